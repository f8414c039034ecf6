// bf16 linears on CPUs with AVX512-BF16 but no AMX: built by native.py, called by packed.py (bf16 weights) and
// quant.py (int8 weights with one scale per output, the `int8` weight-only mode, for bf16 activations).
//
// The fp32 panel kernel's shape (fp32_linear.cpp) over bf16 weights, which halve the bytes a decode step
// streams: each panel is 32 outputs, its inputs taken in pairs ([panels][K/2][32][2]), and `vdpbf16ps` adds one
// pair's two products into each output's fp32 sum, so one 64-byte load feeds 16 outputs two inputs each. A call
// passes its rows through every panel, BLOCK_ROWS rows a pass, each thread over a contiguous range of panels of its
// own (`run_panel_ranges`). oneDNN's bf16 GEMM here costs ~25 us of setup a call (121 calls a SmolLM2 step) and
// reads the weights below the memory's speed.
//
// int8 weights take the same pair panels at a byte an element, widened to bf16 as they are loaded (exact: every
// int8 value is a bf16 value), and an output's sum is multiplied by its channel's scale before the bias.
//
// Batch invariance: an output element is one chain of pair dot products over its inputs in order, from zero
// (vdpbf16ps rounds the same way whatever the other lanes hold), then its scale and bias applied in fp32 and the
// sum rounded once to bf16 (nearest even, as torch rounds): a row computes bitwise the same alone or beside
// others, in a decode step or a prefill chunk of any length.

#include <cstdint>
#include <cstring>

#include "mstar_native.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MSTAR_BF16_LINEAR 1
#endif

namespace {

using mstar::bf16;

constexpr int64_t PANEL = 32;       // outputs per panel: two vectors of 16 fp32 sums
constexpr int64_t BLOCK_ROWS = 12;  // 24 accumulators, 2 weight vectors, broadcasts: 32 registers
constexpr int64_t PREFETCH = 2048;  // bytes ahead the weight stream is fetched
// a pass of fewer rows runs at vdpbf16ps' latency (2 chains a row, a 6-cycle add), not its rate: a call's last pass
// shares the rows of the one before it rather than run so few
constexpr int64_t MIN_PASS_ROWS = 3;

// what a decode step's lane attention asks this library's next calls to fetch (mstar::SideFetch)
mstar::SideFetch side_fetch;

#if defined(MSTAR_BF16_LINEAR)
// inputs 2e and 2e + 1 of a row in every 32-bit lane (one broadcast load)
inline __m512i pair(const bf16 *x, int64_t e) {
    int bits;
    std::memcpy(&bits, x + 2 * e, sizeof(bits));
    return _mm512_set1_epi32(bits);
}

// an odd row's last input, paired with zero
inline __m512i last(const bf16 *x, int64_t k) { return _mm512_set1_epi32(static_cast<int>(x[k - 1])); }

inline __m512 dot(__m512 acc, __m512i x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }

// 16 outputs' pair of inputs as 32 bf16: loaded, or widened from int8
inline __m512i weights(const bf16 *w) { return _mm512_loadu_si512(w); }
inline __m512i weights(const int8_t *w) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// out[r][0..outs) = round(bias + scale * (x[r] . panel's columns)), for R rows (no scale: 1; named accumulators:
// see fp32_linear.cpp)
template <int R, typename W>
void block(const bf16 *x, int64_t x_row, const W *panel, int64_t k, const float *scale, const bf16 *bias, bf16 *out,
           int64_t out_row, int64_t outs, const char *ahead, int64_t ahead_step, const char *side, int64_t side_lines) {
#define MSTAR_ACC(r) __m512 a##r##l = _mm512_setzero_ps(), a##r##h = a##r##l; const bf16 *x##r = x + (R > r ? r : 0) * x_row;
    MSTAR_ACC(0) MSTAR_ACC(1) MSTAR_ACC(2) MSTAR_ACC(3) MSTAR_ACC(4) MSTAR_ACC(5)
    MSTAR_ACC(6) MSTAR_ACC(7) MSTAR_ACC(8) MSTAR_ACC(9) MSTAR_ACC(10) MSTAR_ACC(11)
#undef MSTAR_ACC
    const int64_t steps = (k + 1) / 2, full = k / 2;
    for (int64_t e = 0; e < steps; ++e) {
        const W *w = panel + e * 2 * PANEL;
        const __m512i lo = weights(w), hi = weights(w + PANEL);
        const char *next = reinterpret_cast<const char *>(w) + PREFETCH;
        for (int64_t line = 0; line < 2 * PANEL * static_cast<int64_t>(sizeof(W)); line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
        if (ahead_step) _mm_prefetch(ahead + e * ahead_step, _MM_HINT_T1);
        if (e % mstar::SIDE_FETCH_STEPS == 0 && e / mstar::SIDE_FETCH_STEPS < side_lines)
            _mm_prefetch(side + e / mstar::SIDE_FETCH_STEPS * 64, _MM_HINT_T1);
#define MSTAR_ROW(r)                                                                \
    if constexpr (R > r) {                                                          \
        const __m512i v = e < full ? pair(x##r, e) : last(x##r, k);                 \
        a##r##l = dot(a##r##l, v, lo), a##r##h = dot(a##r##h, v, hi);               \
    }
        MSTAR_ROW(0) MSTAR_ROW(1) MSTAR_ROW(2) MSTAR_ROW(3) MSTAR_ROW(4) MSTAR_ROW(5)
        MSTAR_ROW(6) MSTAR_ROW(7) MSTAR_ROW(8) MSTAR_ROW(9) MSTAR_ROW(10) MSTAR_ROW(11)
#undef MSTAR_ROW
    }
    const __m512 acc[12][2] = {{a0l, a0h}, {a1l, a1h}, {a2l, a2h}, {a3l, a3h}, {a4l, a4h},   {a5l, a5h},
                               {a6l, a6h}, {a7l, a7h}, {a8l, a8h}, {a9l, a9h}, {a10l, a10h}, {a11l, a11h}};
    for (int64_t h = 0; h < 2 && h * 16 < outs; ++h) {
        const int64_t width = outs - h * 16 < 16 ? outs - h * 16 : 16;
        const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
        const __m512 b = bias != nullptr ? mstar::load16(bias + h * 16, keep) : _mm512_setzero_ps();
        const __m512 s = scale != nullptr ? _mm512_maskz_loadu_ps(keep, scale + h * 16) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < R; ++r) {
            bf16 *dst = out + r * out_row + h * 16;
            const __m512 sum = scale != nullptr ? _mm512_mul_ps(acc[r][h], s) : acc[r][h];
            mstar::store16(mstar::round16(_mm512_add_ps(sum, b), dst), dst, keep);
        }
    }
}

// The call's task loop: mstar::run_panel_tasks' work (every row through every panel, BLOCK_ROWS rows a pass, the
// next run of panels fetched into L2 behind a run's later passes, the next call's weight near the end) split another
// way. run_panel_tasks deals out runs of panels from one counter, so a thread's runs lie apart in memory (thread 0
// reads runs 0, 2, 4, ..., each a stream that starts cold); when this loop was written its call's last run could also
// leave one thread alone for a whole run (SmolLM2's qkv, 30 panels in runs of 4: 16 panels against 14; gate/up 50
// against 46; at a prefill chunk's 113 rows a run of 4 panels is ~75 us), which it now splits into passes near the
// end. Here each thread owns a contiguous range of panels, an equal
// share, and takes runs from its front: one unbroken stream a thread, and on a quiet machine both threads done
// within a panel of each other. A thread out of its range takes the back half of another's (work stealing) and
// goes on through it front to back, so a thread the machine holds up is relieved as before, by forward streams.
//
// A call's rows split into passes of BLOCK_ROWS, and a last pass of one or two rows shares the rows of the one before
// (25 rows: 12, 7 and 6; a pass of 1-2 rows is held by vdpbf16ps' 6-cycle latency over 2-4 chains, and passes of 11
// rows instead of 12 measured 1-3 % slower on one core): a row's sums are the same in any pass.
struct RangeCall {
    int64_t m, panels, steps, step_bytes;  // rows, panels, input steps a panel, bytes an input step
};

// One thread's panels [front, back) in one word (front << 32 | back), changed by compare-and-swap: the owner
// moves the front, a thread out of work the back. Alone on its cache line (the owner claims without contention).
struct alignas(64) PanelRange {
    uint64_t bounds;
};

constexpr int MAX_INLINE_RANGES = 16;

inline uint64_t bounds(int64_t front, int64_t back) { return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back); }

// up to `want` panels from the front of `range` as [first, last); false when it is empty
inline bool claim_front(PanelRange &range, int64_t want, int64_t &first, int64_t &last) {
    uint64_t seen = __atomic_load_n(&range.bounds, __ATOMIC_ACQUIRE);
    for (;;) {
        const int64_t front = static_cast<int64_t>(seen >> 32), back = static_cast<int64_t>(seen & 0xffffffffu);
        if (front >= back) return false;
        const int64_t count = back - front < want ? back - front : want;
        if (__atomic_compare_exchange_n(&range.bounds, &seen, bounds(front + count, back), false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            first = front, last = front + count;
            return true;
        }
    }
}

// the back half of `range` (its last panel, when one is left) as [first, last); false when it is empty
inline bool steal_back(PanelRange &range, int64_t &first, int64_t &last) {
    uint64_t seen = __atomic_load_n(&range.bounds, __ATOMIC_ACQUIRE);
    for (;;) {
        const int64_t front = static_cast<int64_t>(seen >> 32), back = static_cast<int64_t>(seen & 0xffffffffu);
        if (front >= back) return false;
        const int64_t count = back - front > 1 ? (back - front) / 2 : 1;
        if (__atomic_compare_exchange_n(&range.bounds, &seen, bounds(front, back - count), false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            first = back - count, last = back;
            return true;
        }
    }
}

// thread `me`'s first panel of `panels` over `team` threads (its range is [range_start(me), range_start(me + 1)))
inline int64_t range_start(int64_t panels, int64_t team, int64_t me) { return panels * me / team; }

template <typename Body>
void run_panel_ranges(const RangeCall &c, const char *packed, int64_t macs, int threads, const mstar::NextWeight *next_weight,
                      Body rows_through_panel, mstar::SideFetch *side) {
    const int64_t panel_bytes = c.steps * c.step_bytes;
    const int64_t passes = (c.m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    // full passes, but a last pass of one or two rows shares the rows of the one before it (12 + 1 -> 7 + 6)
    const int64_t short_rows = c.m - (passes - 1) * BLOCK_ROWS;
    const int64_t even_tail = passes > 1 && short_rows < MIN_PASS_ROWS ? BLOCK_ROWS + short_rows : 0;
    // a run: the panels every pass goes through before the next run (L2-sized where later passes reuse them; one
    // panel for a single pass, so that a thread out of work can take the very last panels)
    const int64_t run = passes > 1 ? mstar::panels_per_task(c.panels, panel_bytes, threads) : 1;
    const int64_t spread = passes < mstar::PANEL_SPREAD ? passes : mstar::PANEL_SPREAD;
    const int64_t ahead_step = (c.step_bytes + spread - 1) / spread;  // the next run's bytes fetched per input step
    const bool hinted = next_weight != nullptr && next_weight->bytes > 0;
    const int team = c.panels > 1 && macs >= mstar::PANEL_PARALLEL_MACS ? (threads < c.panels ? threads : c.panels) : 1;
    // a thread fetches its share of the next call's weight over the last panels of its own range (as many as a
    // run_panel_tasks task), in its last pass, a cache line an input step at most
    const int64_t tail = mstar::panels_per_task(c.panels, panel_bytes, threads);
    PanelRange inline_ranges[MAX_INLINE_RANGES];
    PanelRange *ranges = team <= MAX_INLINE_RANGES ? inline_ranges : new PanelRange[team];
    for (int64_t i = 0; i < team; ++i)
        ranges[i].bounds = bounds(range_start(c.panels, team, i), range_start(c.panels, team, i + 1));
    int64_t working = team;  // threads not yet out of work
#pragma omp parallel num_threads(team)
    {
#if defined(_OPENMP)
        const int64_t me = omp_get_thread_num();
#else
        const int64_t me = 0;
#endif
        PanelRange &own = ranges[me];
        const int64_t own_start = range_start(c.panels, team, me), own_end = range_start(c.panels, team, me + 1);
        const int64_t tail_start = own_end - tail > own_start ? own_end - tail : own_start;
        const char *next_ahead = hinted ? next_weight->start + me * next_weight->stride : nullptr;
        int64_t next_step = hinted ? (next_weight->bytes + tail * c.steps - 1) / (tail * c.steps) : 0;
        next_step = next_step > mstar::NEXT_WEIGHT_LINE ? mstar::NEXT_WEIGHT_LINE : next_step;
        int64_t first = 0, last = 0, after_first = 0, after_last = 0, victim = me;
        bool have = claim_front(own, run, first, last);
        for (;;) {
            // out of its own range: the back half of another's (the next thread's first) becomes its own
            for (int64_t tried = 1; !have && tried < team; ++tried) {
                victim = (victim + 1) % team == me ? (victim + 2) % team : (victim + 1) % team;
                int64_t taken_first = 0, taken_last = 0;
                if (steal_back(ranges[victim], taken_first, taken_last)) {
                    __atomic_store_n(&own.bounds, bounds(taken_first, taken_last), __ATOMIC_RELEASE);
                    have = claim_front(own, run, first, last);
                    tried = 0;  // (another thief may have emptied it already: every other range is tried again)
                }
            }
            if (!have) break;
            // the next run, claimed now so that later passes fetch it behind this run's panels
            const bool next_own = passes > 1 && claim_front(own, run, after_first, after_last);
            const char *ahead = packed + (next_own ? after_first : first) * panel_bytes;
            const int64_t pass_bytes = ((next_own ? after_last - after_first : last - first) * panel_bytes + spread - 1) / spread;
            for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
                const int64_t rows = even_tail == 0 ? (pass < passes - 1 ? BLOCK_ROWS : short_rows)
                                                    : (pass < passes - 2 ? BLOCK_ROWS : pass == passes - 2 ? even_tail - even_tail / 2 : even_tail / 2);
                const bool last_pass = pass == passes - 1;
                for (int64_t p = first; p < last; ++p) {
                    const char *side_at = nullptr;  // (the lines a lane attention named: mstar::SideFetch)
                    const int64_t side_lines = side != nullptr ? side->take(me, c.steps / mstar::SIDE_FETCH_STEPS, side_at) : 0;
                    if (hinted && last_pass && !next_own && p >= tail_start && p < own_end)  // the end of its own share
                        rows_through_panel(r0, rows, p, next_ahead + (p - tail_start) * c.steps * next_step, next_step,
                                           side_at, side_lines);
                    else
                        rows_through_panel(r0, rows, p, ahead + pass * pass_bytes + (p - first) * c.steps * ahead_step,
                                           next_own && pass < spread ? ahead_step : 0, side_at, side_lines);
                }
                r0 += rows;
            }
            first = after_first, last = after_last;
            have = next_own || claim_front(own, run, first, last);
        }
        // Out of work while another thread still runs its last: this core would wait at the barrier, so it fetches
        // the next call's first runs (every thread's) meanwhile; the last thread to finish fetches nothing.
        if (__atomic_sub_fetch(&working, 1, __ATOMIC_RELAXED) > 0 && hinted) {
            for (int64_t off = 0; off < next_weight->bytes && __atomic_load_n(&working, __ATOMIC_RELAXED) > 0;
                 off += 8 * mstar::NEXT_WEIGHT_LINE)
                for (int64_t i = 0; i < team; ++i)
                    for (int64_t line = 0; line < 8 * mstar::NEXT_WEIGHT_LINE; line += mstar::NEXT_WEIGHT_LINE)
                        __builtin_prefetch(next_weight->start + i * next_weight->stride + off + line, 0, 2);
        }
    }
    if (ranges != inline_ranges) delete[] ranges;
}

// out [m, n] = x [m, k] @ (weight * scale).T + bias over pair panels of W (scale null: 1)
template <typename W>
void linear(const bf16 *x, int64_t x_row, const W *packed, const float *scale, const bf16 *bias, bf16 *out,
            int64_t out_row, int64_t m, int64_t n, int64_t k, int threads, const mstar::NextWeight *next) {
    const int64_t steps = (k + 1) / 2;
    const RangeCall call{m, (n + PANEL - 1) / PANEL, steps, 2 * PANEL * static_cast<int64_t>(sizeof(W))};
    run_panel_ranges(call, reinterpret_cast<const char *>(packed), m * n * k, threads, next,
                     [&](int64_t r0, int64_t rows, int64_t p, const char *ahead, int64_t ahead_step, const char *side,
                         int64_t side_lines) {
        const int64_t outs = n - p * PANEL < PANEL ? n - p * PANEL : PANEL, first = p * PANEL;
        mstar::for_rows<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(rows, [&](auto r) {
            block<decltype(r)::value>(x + r0 * x_row, x_row, packed + p * steps * 2 * PANEL, k, scale ? scale + first : nullptr,
                                      bias ? bias + first : nullptr, out + r0 * out_row + first, out_row, outs, ahead,
                                      ahead_step, side, side_lines);
        });
    }, side_fetch.spans > 0 ? &side_fetch : nullptr);
}
#endif

// weight [n, k] (row stride w_row) into pair panels: packed[p][e][j][i] = weight[p * 32 + j][2e + i], zeros past
// n and k
template <typename W>
void pack(const W *src, int64_t w_row, int64_t n, int64_t k, W *dst) {
    const int64_t panels = (n + PANEL - 1) / PANEL, steps = (k + 1) / 2;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t e = 0; e < steps; ++e)
            for (int64_t j = 0; j < PANEL; ++j)
                for (int64_t i = 0; i < 2; ++i) {
                    const int64_t o = p * PANEL + j, c = 2 * e + i;
                    dst[((p * steps + e) * PANEL + j) * 2 + i] = o < n && c < k ? src[o * w_row + c] : W(0);
                }
}

}  // namespace

extern "C" {

// whether this build has the kernel (AVX512-BF16)
int mstar_bf16_linear_available() {
#if defined(MSTAR_BF16_LINEAR)
    return 1;
#else
    return 0;
#endif
}

// the record of what the next calls fetch while they compute (mstar::SideFetch: a lane attention call fills it)
void *mstar_bf16_side_fetch() { return &side_fetch; }

// elements of the packed layout of an [n, k] weight (bf16, or bytes for int8)
int64_t mstar_bf16_packed_elements(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * ((k + 1) / 2 * 2); }

void mstar_bf16_pack(const void *w, int64_t w_row, int64_t n, int64_t k, void *packed) {
    pack(static_cast<const bf16 *>(w), w_row, n, k, static_cast<bf16 *>(packed));
}

void mstar_bf16_pack_int8(const int8_t *w, int64_t w_row, int64_t n, int64_t k, int8_t *packed) {
    pack(w, w_row, n, k, packed);
}

// bytes between the first tasks of a call's threads over an [n, k] weight of `weight_bytes` an element (bf16 2,
// int8 1): the `stride` of a hint naming that weight as the next call's (mstar::NextWeight)
int64_t mstar_bf16_task_bytes(int64_t n, int64_t k, int64_t weight_bytes, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    return threads > 0 ? panels / threads * ((k + 1) / 2 * 2 * PANEL * weight_bytes) : 0;
}

// out [m, n] (row stride out_row) = x [m, k] (row stride x_row) @ weight.T + bias (or none); `next`: the next
// call's weight to start fetching (null: none); nonzero: not built here
int mstar_bf16_linear(const void *x, int64_t x_row, const void *packed, const void *bias, void *out, int64_t out_row,
                      int64_t m, int64_t n, int64_t k, int threads, const void *next) {
#if defined(MSTAR_BF16_LINEAR)
    linear(static_cast<const bf16 *>(x), x_row, static_cast<const bf16 *>(packed), nullptr,
           static_cast<const bf16 *>(bias), static_cast<bf16 *>(out), out_row, m, n, k, threads,
           static_cast<const mstar::NextWeight *>(next));
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)bias, (void)out, (void)out_row, (void)m, (void)n, (void)k, (void)threads;
    (void)next;
    return 1;
#endif
}

// the same over int8 weights: out = x @ (weight * scale[:, None]).T + bias; nonzero: not built here
int mstar_bf16_int8_linear(const void *x, int64_t x_row, const int8_t *packed, const float *scale, const void *bias,
                           void *out, int64_t out_row, int64_t m, int64_t n, int64_t k, int threads, const void *next) {
#if defined(MSTAR_BF16_LINEAR)
    linear(static_cast<const bf16 *>(x), x_row, packed, scale, static_cast<const bf16 *>(bias),
           static_cast<bf16 *>(out), out_row, m, n, k, threads, static_cast<const mstar::NextWeight *>(next));
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)scale, (void)bias, (void)out, (void)out_row, (void)m, (void)n, (void)k;
    (void)threads, (void)next;
    return 1;
#endif
}

}  // extern "C"
