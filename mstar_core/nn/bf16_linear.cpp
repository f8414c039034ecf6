// bf16 linears on CPUs with AVX512-BF16 but no AMX: built by native.py, called by packed.py (bf16 weights) and
// quant.py (int8 weights with one scale per output, the `int8` weight-only mode, for bf16 activations).
//
// The fp32 panel kernel's shape (fp32_linear.cpp) over bf16 weights, which halve the bytes a decode step
// streams: each panel is 32 outputs, its inputs taken in pairs ([panels][K/2][32][2]), and `vdpbf16ps` adds one
// pair's two products into each output's fp32 sum, so one 64-byte load feeds 16 outputs two inputs each. A call
// is mstar::run_panel_tasks' loop, BLOCK_ROWS rows a pass. oneDNN's bf16 GEMM here costs ~25 us of setup a call
// (121 calls a SmolLM2 step) and reads the weights below the memory's speed.
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
           int64_t out_row, int64_t outs, const char *ahead, int64_t ahead_step) {
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

// out [m, n] = x [m, k] @ (weight * scale).T + bias over pair panels of W (scale null: 1)
template <typename W>
void linear(const bf16 *x, int64_t x_row, const W *packed, const float *scale, const bf16 *bias, bf16 *out,
            int64_t out_row, int64_t m, int64_t n, int64_t k, int threads, const mstar::NextWeight *next) {
    const int64_t steps = (k + 1) / 2;
    const mstar::PanelCall call{m, (n + PANEL - 1) / PANEL, steps, 2 * PANEL * static_cast<int64_t>(sizeof(W)),
                                BLOCK_ROWS, true};
    mstar::run_panel_tasks(call, reinterpret_cast<const char *>(packed), m * n * k, threads, next,
                           [&](int64_t r0, int64_t rows, int64_t p, const char *ahead, int64_t ahead_step) {
        const int64_t outs = n - p * PANEL < PANEL ? n - p * PANEL : PANEL, first = p * PANEL;
        mstar::for_rows<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(rows, [&](auto r) {
            block<decltype(r)::value>(x + r0 * x_row, x_row, packed + p * steps * 2 * PANEL, k, scale ? scale + first : nullptr,
                                      bias ? bias + first : nullptr, out + r0 * out_row + first, out_row, outs, ahead,
                                      ahead_step);
        });
    });
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
    return mstar::panel_task_bytes((n + PANEL - 1) / PANEL, (k + 1) / 2 * 2 * PANEL * weight_bytes, threads);
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
