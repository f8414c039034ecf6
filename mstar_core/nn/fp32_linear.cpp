// fp32 linears on CPUs with AVX2 and FMA (8 lanes) or AVX-512 (16 lanes): built by native.py, called by packed.py
// (fp32 weights) and quant.py (int8 weights with one scale per output, the `int8` weight-only mode).
//
// A decode step reads every weight once for a few rows, so its speed is the speed the weights stream at.
// oneDNN's GEMM, called through torch, streams a step's 121 weights well below the memory's speed (most of the
// calls are a few MB each, and each pays its setup), and one row runs as two (its one-row kernel sums in another
// order). Here the weight is packed once into panels of PANEL outputs, each panel its K inputs in order
// ([panels][K][PANEL]), and a call is mstar::run_panel_tasks' loop: runs of panels that stay in L2, every input
// row passed through each panel BLOCK_ROWS rows at a time (two vectors of accumulators a row; near a call's end the
// threads share a run's passes). At a prompt chunk's rows a call is FMA-bound, so each row's float is broadcast
// inside its FMAs on AVX-512 (`fma_splat`) and the sums stored straight from the accumulators.
//
// int8 weights take the same panels at a byte an element: each is widened to fp32 (exact) as it is loaded, and
// an output's sum is multiplied by its channel's scale before the bias: a quarter of the bytes a step streams.
//
// Batch invariance: an output element is one FMA chain over its inputs in order, from zero, then its scale and
// bias applied, whatever the call's row count, the row's place in its block or the vector width, so a row
// computes bitwise the same alone or beside others, in a decode step or a prefill chunk of any length, and the
// AVX2 and AVX-512 builds agree bit for bit.

#include <cstdint>

#include "mstar_native.h"

#if defined(__AVX512F__)
#define MSTAR_FP32_LINEAR 512
#elif defined(__AVX2__) && defined(__FMA__)
#define MSTAR_FP32_LINEAR 256
#endif

namespace {

#if MSTAR_FP32_LINEAR == 512
typedef __m512 vec;
constexpr int64_t LANES = 16;
constexpr int64_t BLOCK_ROWS = 12;  // 24 accumulators, 2 weight vectors (the rows' floats broadcast inside the FMAs)
inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float *p) { return _mm512_loadu_ps(p); }
inline vec load(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
}
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
// acc + w * x[0] (x's one float in every lane) with the float broadcast by the FMA's own load (AVX-512's embedded
// broadcast): bit for bit fma(set1(*x), w, acc), one instruction. gcc keeps a splat two FMAs use in a register of its
// own, 12 vbroadcastss a step beside 24 FMAs: a block of 12 rows then ran at ~90-95 % of the FMA rate on one Zen 4
// core, with the broadcasts inside the FMAs at ~100 % (K 576 and 1536, 120 rows; the issue-53 fp32lin probe)
inline vec fma_splat(const float *x, vec w, vec acc) {
    asm("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*x), "v"(w));
    return acc;
}
#elif MSTAR_FP32_LINEAR == 256
typedef __m256 vec;
constexpr int64_t LANES = 8;
constexpr int64_t BLOCK_ROWS = 6;  // 12 accumulators, 2 weight vectors, 1 broadcast: 16 registers
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float *p) { return _mm256_loadu_ps(p); }
inline vec load(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}
inline vec splat(const float *p) { return _mm256_broadcast_ss(p); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec fma_splat(const float *x, vec w, vec acc) { return fma(splat(x), w, acc); }  // (AVX2: no embedded broadcast)
#else
constexpr int64_t LANES = 8;
#endif

// what a decode step's lane attention asks this library's next calls to fetch (mstar::SideFetch)
mstar::SideFetch side_fetch;

constexpr int64_t PANEL = 2 * LANES;  // outputs per panel: two vectors
constexpr int64_t PREFETCH = 2048;    // bytes ahead the weight stream is fetched

#if defined(MSTAR_FP32_LINEAR)
// out[r][0..outs) = bias + scale * (x[r] . panel's columns), for R rows (no scale: 1). The accumulators are named,
// not an array: gcc keeps an array of them in memory, a store per FMA.
// `ahead`: where this block fetches the next task's panels into L2, `ahead_step` bytes further each input (0: none).
template <int R, typename W>
void block(const float *x, int64_t x_row, const W *panel, int64_t k, const float *scale, const float *bias, float *out,
           int64_t out_row, int64_t outs, const char *ahead, int64_t ahead_step, const char *side, int64_t side_lines) {
#define MSTAR_ACC(r) vec a##r##l = zero(), a##r##h = a##r##l; const float *x##r = x + (R > r ? r : 0) * x_row;
    MSTAR_ACC(0) MSTAR_ACC(1) MSTAR_ACC(2) MSTAR_ACC(3) MSTAR_ACC(4) MSTAR_ACC(5)
    MSTAR_ACC(6) MSTAR_ACC(7) MSTAR_ACC(8) MSTAR_ACC(9) MSTAR_ACC(10) MSTAR_ACC(11)
#undef MSTAR_ACC
    for (int64_t e = 0; e < k; ++e) {
        const W *w = panel + e * PANEL;
        const vec lo = load(w), hi = load(w + LANES);
        const char *next = reinterpret_cast<const char *>(w) + PREFETCH;
        for (int64_t line = 0; line < PANEL * static_cast<int64_t>(sizeof(W)); line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
        if (ahead_step) _mm_prefetch(ahead + e * ahead_step, _MM_HINT_T1);
        if (e % mstar::SIDE_FETCH_STEPS == 0 && e / mstar::SIDE_FETCH_STEPS < side_lines)
            _mm_prefetch(side + e / mstar::SIDE_FETCH_STEPS * 64, _MM_HINT_T1);
#define MSTAR_ROW(r)                                                                \
    if constexpr (R > r) {                                                          \
        a##r##l = fma_splat(x##r + e, lo, a##r##l);                                 \
        a##r##h = fma_splat(x##r + e, hi, a##r##h);                                 \
    }
        MSTAR_ROW(0) MSTAR_ROW(1) MSTAR_ROW(2) MSTAR_ROW(3) MSTAR_ROW(4) MSTAR_ROW(5)
        MSTAR_ROW(6) MSTAR_ROW(7) MSTAR_ROW(8) MSTAR_ROW(9) MSTAR_ROW(10) MSTAR_ROW(11)
#undef MSTAR_ROW
    }
    const vec acc[12][2] = {{a0l, a0h}, {a1l, a1h}, {a2l, a2h}, {a3l, a3h}, {a4l, a4h},   {a5l, a5h},
                            {a6l, a6h}, {a7l, a7h}, {a8l, a8h}, {a9l, a9h}, {a10l, a10h}, {a11l, a11h}};
#if MSTAR_FP32_LINEAR == 512
    // straight from the accumulators, masked past `outs` (the scalar loop below, 16 lanes at once: the same
    // multiply, then add, each rounded once)
    for (int64_t h = 0; h < 2 && h * LANES < outs; ++h) {
        const int64_t width = outs - h * LANES < LANES ? outs - h * LANES : LANES;
        const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
        const vec s = scale ? _mm512_maskz_loadu_ps(keep, scale + h * LANES) : zero();
        const vec b = bias ? _mm512_maskz_loadu_ps(keep, bias + h * LANES) : zero();
        for (int r = 0; r < R; ++r) {
            vec sum = scale ? _mm512_mul_ps(acc[r][h], s) : acc[r][h];
            if (bias) sum = _mm512_add_ps(sum, b);
            _mm512_mask_storeu_ps(out + r * out_row + h * LANES, keep, sum);
        }
    }
#else
    alignas(64) float sums[12][PANEL];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) __builtin_memcpy(sums[r] + h * LANES, &acc[r][h], sizeof(vec));
    for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < outs; ++j) {
            const float sum = scale ? sums[r][j] * scale[j] : sums[r][j];
            out[r * out_row + j] = bias ? sum + bias[j] : sum;
        }
#endif
}

// out [m, n] = x [m, k] @ (weight * scale).T + bias over panels of W (scale null: 1)
template <typename W>
void linear(const float *x, int64_t x_row, const W *packed, const float *scale, const float *bias, float *out,
            int64_t out_row, int64_t m, int64_t n, int64_t k, int threads, const mstar::NextWeight *next) {
    const mstar::PanelCall call{m, (n + PANEL - 1) / PANEL, k, PANEL * static_cast<int64_t>(sizeof(W)), BLOCK_ROWS,
                                false};
    // (the next-weight hint is taken and not used: on the served SmolLM2 step it made fp32's linears slower,
    // 11-45 % in three alternated pairs, where bf16's gained; BENCHMARKS.md, issue 53)
    (void)next;
    mstar::run_panel_tasks(call, reinterpret_cast<const char *>(packed), m * n * k, threads, nullptr,
                           [&](int64_t r0, int64_t rows, int64_t p, const char *ahead, int64_t ahead_step, const char *side,
                               int64_t side_lines) {
        const int64_t outs = n - p * PANEL < PANEL ? n - p * PANEL : PANEL, first = p * PANEL;
        mstar::for_rows<1, 2, 3, 4, 5, 6
#if MSTAR_FP32_LINEAR == 512
                        , 7, 8, 9, 10, 11, 12
#endif
                        >(rows, [&](auto r) {
            block<decltype(r)::value>(x + r0 * x_row, x_row, packed + p * k * PANEL, k, scale ? scale + first : nullptr,
                                      bias ? bias + first : nullptr, out + r0 * out_row + first, out_row, outs, ahead,
                                      ahead_step, side, side_lines);
        });
    }, side_fetch.spans > 0 ? &side_fetch : nullptr);
}
#endif

// weight [n, k] (row stride w_row) into panels: packed[p][e][j] = weight[p * PANEL + j][e], zeros past n
template <typename W>
void pack(const W *weight, int64_t w_row, int64_t n, int64_t k, W *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t e = 0; e < k; ++e)
            for (int64_t j = 0; j < PANEL; ++j) {
                const int64_t o = p * PANEL + j;
                packed[(p * k + e) * PANEL + j] = o < n ? weight[o * w_row + e] : W(0);
            }
}

}  // namespace

extern "C" {

// the kernel's vector width in bits in this build (256: AVX2 and FMA, 512: AVX-512), 0: not built here
int mstar_fp32_linear_available() {
#if defined(MSTAR_FP32_LINEAR)
    return MSTAR_FP32_LINEAR;
#else
    return 0;
#endif
}

// the record of what the next calls fetch while they compute (mstar::SideFetch: a lane attention call fills it)
void *mstar_fp32_side_fetch() { return &side_fetch; }

// elements of the packed layout of an [n, k] weight (floats, or bytes for int8)
int64_t mstar_fp32_packed_elements(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

void mstar_fp32_pack(const float *weight, int64_t w_row, int64_t n, int64_t k, float *packed) {
    pack(weight, w_row, n, k, packed);
}

void mstar_fp32_pack_int8(const int8_t *weight, int64_t w_row, int64_t n, int64_t k, int8_t *packed) {
    pack(weight, w_row, n, k, packed);
}

// bytes between the first tasks of a call's threads over an [n, k] weight of `weight_bytes` an element (fp32 4,
// int8 1): the `stride` of a hint naming that weight as the next call's (mstar::NextWeight)
int64_t mstar_fp32_task_bytes(int64_t n, int64_t k, int64_t weight_bytes, int threads) {
    return mstar::panel_task_bytes((n + PANEL - 1) / PANEL, k * PANEL * weight_bytes, threads);
}

// out [m, n] (row stride out_row) = x [m, k] (row stride x_row) @ weight.T + bias (or none); `next`: the next
// call's weight to start fetching (null: none); nonzero: not built here
int mstar_fp32_linear(const float *x, int64_t x_row, const float *packed, const float *bias, float *out, int64_t out_row,
                      int64_t m, int64_t n, int64_t k, int threads, const void *next) {
#if defined(MSTAR_FP32_LINEAR)
    linear(x, x_row, packed, nullptr, bias, out, out_row, m, n, k, threads, static_cast<const mstar::NextWeight *>(next));
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)bias, (void)out, (void)out_row, (void)m, (void)n, (void)k, (void)threads;
    (void)next;
    return 1;
#endif
}

// the same over int8 weights: out = x @ (weight * scale[:, None]).T + bias; nonzero: not built here
int mstar_fp32_int8_linear(const float *x, int64_t x_row, const int8_t *packed, const float *scale, const float *bias,
                           float *out, int64_t out_row, int64_t m, int64_t n, int64_t k, int threads, const void *next) {
#if defined(MSTAR_FP32_LINEAR)
    linear(x, x_row, packed, scale, bias, out, out_row, m, n, k, threads, static_cast<const mstar::NextWeight *>(next));
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)scale, (void)bias, (void)out, (void)out_row, (void)m, (void)n, (void)k;
    (void)threads, (void)next;
    return 1;
#endif
}

}  // extern "C"
