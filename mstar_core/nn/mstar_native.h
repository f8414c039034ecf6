// What the CPU kernels share (native.py puts this folder on every kernel's include path): bf16 <-> fp32 with
// torch's rounding, and one exp, scalar, 8 lanes (AVX2) and 16 lanes (AVX-512) at a time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace mstar {

typedef uint16_t bf16;

inline float widen(float x) { return x; }
inline float widen(bf16 h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }

// x rounded to the precision of T's type (the pointer only picks the overload): round to nearest even, as
// torch's .to(bfloat16); NaN stays NaN
inline float round_to(float x, float *) { return x; }
inline float round_to(float x, bf16 *) {
    uint32_t u = __builtin_bit_cast(uint32_t, x);
    u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return __builtin_bit_cast(float, u);
}

inline void store(float x, float *dst) { *dst = x; }  // x already holds a value of the destination's type
inline void store(float x, bf16 *dst) { *dst = static_cast<bf16>(__builtin_bit_cast(uint32_t, x) >> 16); }

template <typename T>
inline void narrow(float x, T *dst) { store(round_to(x, dst), dst); }

// e^x: Cody-Waite reduction to r in [-ln2/2, ln2/2] and Cephes' degree-6 polynomial, within ~2 ulp; below -87
// it gives ~1e-38 rather than 0, above 88.7 inf (2^128), as expf overflows
inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.8f ? 88.8f : x);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

#if defined(__AVX512F__)
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16));
}

inline __m512 round16(__m512 x, float *) { return x; }
inline __m512 round16(__m512 x, bf16 *) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i half = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(u, half), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000)));
}

inline void store16(__m512 x, float *p) { _mm512_storeu_ps(p, x); }
inline void store16(__m512 x, bf16 *p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

// the first lanes of `keep` only (the rest read as zero, or left unwritten)
inline __m512 load16(const bf16 *p, __mmask16 keep) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}
inline void store16(__m512 x, bf16 *p, __mmask16 keep) {
    _mm256_mask_storeu_epi16(p, keep, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

// exp_approx, 16 lanes (the same clamps and polynomial; 2^n by scalef)
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.8f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), 16));
}

inline __m256 round8(__m256 x, float *) { return x; }
inline __m256 round8(__m256 x, bf16 *) {  // (round_to, 8 lanes)
    const __m256i u = _mm256_castps_si256(x);
    const __m256i half = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, half), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

inline void store8(__m256 x, float *p) { _mm256_storeu_ps(p, x); }
inline void store8(__m256 x, bf16 *p) {  // the high halves, packed in order (packus works per 128-bit lane)
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_castsi256_si128(packed));
}

// exp_approx, 8 lanes (exp16's clamps and polynomial; 2^n built in the exponent bits, as the scalar one)
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.8f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

}  // namespace mstar

namespace mstar {

// The weight of the call that runs after this one (a step's linears run in a fixed order: a replayed step's tape
// links each linear call to the next, tape.py). Thread i of a call fetches `bytes` from `start + i * stride` into
// L2 over its last task, so that the next call's first tasks (`stride` bytes each; the threads arrive and claim
// them in about the order of their numbers) begin in cache instead of waiting for a cold stream to speed up. A
// hint changes no result, only what is cached.
struct NextWeight {
    const char *start;
    int64_t bytes, stride;  // bytes a thread fetches (0: none), bytes between threads' first tasks
};

// The task loop of the fp32 panel linears (fp32_linear.cpp; bf16_linear.cpp splits the same work its own way): a
// weight packed into panels of a few outputs, each panel its input steps in order, and a call that passes every row
// through every panel, `block_rows` rows a pass. A run is a few panels that stay in L2; the call's work is its
// units, (run, pass), in order run by run, and each thread claims a chunk of consecutive units from one atomic
// counter (a thread held up by the server's other threads holds up no one). A chunk is the rest of a run while
// plenty is left, and near the end a share of what is left (half a thread's, at least one pass), so that
// the threads finish within about a pass of each other: whole runs dealt out alone left a call of an odd run count
// (SmolLM2's qkv 15 runs, o 9, down 18 less whatever a held-up thread lost) with one thread idle for up to a run,
// ~80 us at a prompt chunk's 120 rows. A run split between threads is read by both (the other core's L2 or L3), a
// small price near the end only. A row's sums never depend on the split: every pass starts at a multiple of
// `block_rows` and each output is one chain over its inputs.
// A thread starting a whole run of several passes claims its next chunk at once and, when that is another run,
// fetches its panels into L2 behind this run's later passes: those passes compute from L2 while the memory would
// sit idle (other chunks, near the end, claim the next when done, leaving it to whichever thread is free first).
// With a hint (`NextWeight`) every chunk claims early: over its last chunk a thread fetches its share of the next
// call's weight instead, and out of work, while another thread still runs, every thread's share (where
// `fetch_when_idle`).
//
// `rows_through_panel(r0, rows, p, ahead, ahead_step)` runs rows [r0, r0 + rows) through panel p, and when
// `ahead_step` is nonzero prefetches `ahead + e * ahead_step` into L2 at input step e.
struct PanelCall {
    int64_t m, panels, steps, step_bytes, block_rows;  // rows, panels, input steps a panel, bytes a step, rows a pass
    // whether a thread out of tasks fetches the next call's weight while another still runs (measured per kernel:
    // bf16 panels gain from it, fp32 panels, twice the bytes, lose more on the running thread than the next call gains)
    bool fetch_when_idle;
};

// Memory another kernel asks the linears that run after it to fetch into L2 while they compute: a decode step's
// lane attention (lane_attention.cpp) names the next layer's keys and values, which its next call would otherwise
// stream at the memory's speed while the cores wait, and the four linears between the two calls (compute-bound at a
// batch's rows, the memory half idle) fetch them a cache line every few input steps of their blocks. The record
// lives in each panel kernel's library (`mstar_fp32_side_fetch`, `mstar_bf16_side_fetch` give its address); the
// attention fills it before its own threads start, and the linears' threads, in calls that run after it, each walk
// spans of their own (span s belongs to thread s % team), so no two threads share a cursor. A fetch changes no
// result, only what is cached (two engines' device threads in one process sharing a record fetch useless lines,
// never out of bounds: every index stays within the record).
struct SideFetch {
    static constexpr int64_t MAX_SPANS = 2048, MAX_THREADS = 64;
    int64_t spans = 0, team = 1;
    const char *start[MAX_SPANS];
    int64_t lines[MAX_SPANS];  // cache lines from `start`
    struct alignas(64) Cursor {
        int64_t span, line;
    } cursor[MAX_THREADS];

    // a fresh list of `count` spans (starts and bytes), shared by `threads` threads
    void reset(int64_t count, int64_t threads) {
        spans = count < MAX_SPANS ? count : MAX_SPANS;
        team = threads < 1 ? 1 : (threads < MAX_THREADS ? threads : MAX_THREADS);
        for (int64_t t = 0; t < team; ++t) cursor[t].span = t, cursor[t].line = 0;
    }

    // thread `me`'s next lines, at most `most` of one span: their first byte in `at`, their count returned (0: none left)
    int64_t take(int64_t me, int64_t most, const char *&at) {
        if (me >= team || most <= 0) return 0;
        Cursor &c = cursor[me];
        while (c.span < spans) {
            const int64_t left = lines[c.span] - c.line;
            if (left > 0) {
                const int64_t n = left < most ? left : most;
                at = start[c.span] + c.line * 64;
                c.line += n;
                return n;
            }
            c.span += team, c.line = 0;
        }
        return 0;
    }
};

// input steps of a panel block per cache line of a SideFetch span it fetches
constexpr int64_t SIDE_FETCH_STEPS = 4;

constexpr int64_t PANEL_TASK_BYTES = 192 * 1024;  // weight bytes one task passes every row through (in L2)
constexpr int64_t PANEL_SPREAD = 8;               // passes over which the next task's panels are fetched, at most
constexpr int64_t PANEL_PARALLEL_MACS = 1 << 15;  // smaller calls run on the calling thread
constexpr int64_t NEXT_WEIGHT_LINE = 64;          // the next weight is fetched a cache line an input step, at most

// body(std::integral_constant<int, R>{}) for the R of `rows` among R... (a block template's row count, chosen at run time)
template <int... R, typename Body>
void for_rows(int64_t rows, Body body) {
    (void)((rows == R && (body(std::integral_constant<int, R>{}), true)) || ...);
}

// panels a task of a call over `panels` panels of `panel_bytes` each, by `threads` threads
inline int64_t panels_per_task(int64_t panels, int64_t panel_bytes, int threads) {
    int64_t per_task = PANEL_TASK_BYTES / panel_bytes;
    if (panels < 4 * threads * per_task) per_task = (panels + 4 * threads - 1) / (4 * threads);  // a few tasks a thread
    return per_task < 1 ? 1 : per_task;
}

template <typename Body>
void run_panel_tasks(const PanelCall &c, const char *packed, int64_t macs, int threads, const NextWeight *next_weight,
                     Body rows_through_panel, SideFetch *side = nullptr) {
    const int64_t panel_bytes = c.steps * c.step_bytes;
    const int64_t per_run = panels_per_task(c.panels, panel_bytes, threads);
    const int64_t runs = (c.panels + per_run - 1) / per_run, run_bytes = per_run * panel_bytes;
    const int64_t passes = (c.m + c.block_rows - 1) / c.block_rows;
    const int64_t units = runs * passes;
    const bool hinted = next_weight != nullptr && next_weight->bytes > 0;
    const int team = units > 1 && macs >= PANEL_PARALLEL_MACS ? threads : 1;
    // (every chunk claimed, the first arrival taking the first: starting each thread on the task of its number instead,
    // so that a hint's share always met its thread, measured slower on a loaded box and no faster on a quiet one)
    int64_t claimed = 0;     // units handed out
    int64_t working = team;  // threads not yet out of work
    // the next chunk [u0, u1) of units: the rest of its run, or near the end half a thread's share of what is left
    const auto claim = [&](int64_t &u0, int64_t &u1) {
        int64_t u = __atomic_load_n(&claimed, __ATOMIC_RELAXED);
        for (;;) {
            if (u >= units) return false;
            const int64_t rest_of_run = passes - u % passes, share = (units - u + 2 * team - 1) / (2 * team);
            const int64_t take = share < rest_of_run ? share : rest_of_run;
            if (__atomic_compare_exchange_n(&claimed, &u, u + take, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                u0 = u, u1 = u + take;
                return true;
            }
        }
    };
#pragma omp parallel num_threads(team)
    {
#if defined(_OPENMP)
        const int64_t me = omp_get_thread_num();
#else
        const int64_t me = 0;
#endif
        int64_t u0 = 0, u1 = 0, next0 = 0, next1 = 0;
        bool have = claim(u0, u1);
        while (have) {
            const int64_t run = u0 / passes, first_pass = u0 % passes, chunk_passes = u1 - u0;
            const int64_t first = run * per_run, last = first + per_run < c.panels ? first + per_run : c.panels;
            // the next chunk claimed now where this one may fetch it (a whole run of several passes) or a hint needs to
            // know its last chunk; else once this one is done: a chunk claimed early near the end is one another
            // thread, out of work, could have taken
            const bool early = hinted || (chunk_passes == passes && passes > 1);
            bool more = early && claim(next0, next1);
            // one pass streams its own panels at the memory's speed already: fetch ahead only behind later passes, and
            // only another run (this one's panels are in L2 already)
            const bool fetch = more && chunk_passes > 1 && next0 / passes != run;
            const int64_t spread = chunk_passes < PANEL_SPREAD ? chunk_passes : PANEL_SPREAD;
            const int64_t ahead_step = (c.step_bytes + spread - 1) / spread;  // the next run's bytes fetched per input step
            const int64_t pass_bytes = (run_bytes + spread - 1) / spread;
            const char *ahead = packed + (fetch ? next0 / passes : run) * run_bytes;
            // this thread's last chunk: its share of the next call's weight, over the chunk's last pass
            const bool fetch_next = hinted && !more;
            const char *next_ahead = fetch_next ? next_weight->start + me * next_weight->stride : nullptr;
            int64_t next_step = 0;
            if (fetch_next) {
                const int64_t run_steps = (last - first) * c.steps;
                next_step = (next_weight->bytes + run_steps - 1) / run_steps;
                next_step = next_step > NEXT_WEIGHT_LINE ? NEXT_WEIGHT_LINE : next_step;
            }
            for (int64_t i = 0; i < chunk_passes; ++i) {
                const int64_t r0 = (first_pass + i) * c.block_rows, rows = c.m - r0 < c.block_rows ? c.m - r0 : c.block_rows;
                for (int64_t p = first; p < last; ++p) {
                    const char *side_at = nullptr;
                    const int64_t side_lines = side != nullptr ? side->take(me, c.steps / SIDE_FETCH_STEPS, side_at) : 0;
                    if (fetch_next && i == chunk_passes - 1)
                        rows_through_panel(r0, rows, p, next_ahead + (p - first) * c.steps * next_step, next_step,
                                           side_at, side_lines);
                    else
                        rows_through_panel(r0, rows, p, ahead + i * pass_bytes + (p - first) * c.steps * ahead_step,
                                           fetch && i < spread ? ahead_step : 0, side_at, side_lines);
                }
            }
            if (!early) more = claim(next0, next1);
            u0 = next0, u1 = next1, have = more;
        }
        // Out of work while another thread still runs its last: this core would wait at the barrier, so it fetches
        // the next call's first runs (every thread's) meanwhile; the last thread to finish fetches nothing.
        if (__atomic_sub_fetch(&working, 1, __ATOMIC_RELAXED) > 0 && hinted && c.fetch_when_idle) {
            for (int64_t off = 0; off < next_weight->bytes && __atomic_load_n(&working, __ATOMIC_RELAXED) > 0;
                 off += 8 * NEXT_WEIGHT_LINE)
                for (int64_t i = 0; i < team; ++i)
                    for (int64_t line = 0; line < 8 * NEXT_WEIGHT_LINE; line += NEXT_WEIGHT_LINE)
                        __builtin_prefetch(next_weight->start + i * next_weight->stride + off + line, 0, 2);
        }
    }
}

// bytes between the first tasks of a call's threads (`NextWeight::stride` for a call to that weight)
inline int64_t panel_task_bytes(int64_t panels, int64_t panel_bytes, int threads) {
    return panels_per_task(panels, panel_bytes, threads) * panel_bytes;
}

}  // namespace mstar
