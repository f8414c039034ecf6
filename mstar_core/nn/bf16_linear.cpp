// bf16 linears on CPUs with AVX512-BF16 but no AMX: built by native.py, called by packed.py.
//
// The fp32 panel kernel's shape (fp32_linear.cpp) over bf16 weights, which halve the bytes a decode step
// streams: each panel is 32 outputs, its inputs taken in pairs ([panels][K/2][32][2]), and `vdpbf16ps` adds one
// pair's two products into each output's fp32 sum, so one 64-byte load feeds 16 outputs two inputs each. A call
// is mstar::run_panel_tasks' loop, BLOCK_ROWS rows a pass. oneDNN's bf16 GEMM here costs ~25 us of setup a call
// (121 calls a SmolLM2 step) and reads the weights below the memory's speed.
//
// Batch invariance: an output element is one chain of pair dot products over its inputs in order, from zero
// (vdpbf16ps rounds the same way whatever the other lanes hold), then its bias added in fp32 and the sum rounded
// once to bf16 (nearest even, as torch rounds): a row computes bitwise the same alone or beside others, in a
// decode step or a prefill chunk of any length.

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

// out[r][0..outs) = round(bias + x[r] . panel's columns), for R rows (named accumulators: see fp32_linear.cpp)
template <int R>
void block(const bf16 *x, int64_t x_row, const bf16 *panel, int64_t k, const bf16 *bias, bf16 *out, int64_t out_row,
           int64_t outs, const char *ahead, int64_t ahead_step) {
#define MSTAR_ACC(r) __m512 a##r##l = _mm512_setzero_ps(), a##r##h = a##r##l; const bf16 *x##r = x + (R > r ? r : 0) * x_row;
    MSTAR_ACC(0) MSTAR_ACC(1) MSTAR_ACC(2) MSTAR_ACC(3) MSTAR_ACC(4) MSTAR_ACC(5)
    MSTAR_ACC(6) MSTAR_ACC(7) MSTAR_ACC(8) MSTAR_ACC(9) MSTAR_ACC(10) MSTAR_ACC(11)
#undef MSTAR_ACC
    const int64_t steps = (k + 1) / 2, full = k / 2;
    for (int64_t e = 0; e < steps; ++e) {
        const bf16 *w = panel + e * 2 * PANEL;
        const __m512i lo = _mm512_loadu_si512(w), hi = _mm512_loadu_si512(w + PANEL);
        const char *next = reinterpret_cast<const char *>(w) + PREFETCH;
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 64, _MM_HINT_T0);
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
        for (int r = 0; r < R; ++r) {
            bf16 *dst = out + r * out_row + h * 16;
            mstar::store16(mstar::round16(_mm512_add_ps(acc[r][h], b), dst), dst, keep);
        }
    }
}

template <int... R>
void dispatch(int64_t rows, const bf16 *x, int64_t x_row, const bf16 *panel, int64_t k, const bf16 *bias, bf16 *out,
              int64_t out_row, int64_t outs, const char *ahead, int64_t ahead_step) {
    // the block template for `rows` rows (1 to BLOCK_ROWS)
    (void)((rows == R && (block<R>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step), true)) || ...);
}
#endif

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

// bytes of the packed layout of an [n, k] weight
int64_t mstar_bf16_packed_bytes(int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * PANEL * ((k + 1) / 2 * 2) * static_cast<int64_t>(sizeof(bf16));
}

// weight [n, k] (row stride w_row) into panels: packed[p][e][j][i] = weight[p * 32 + j][2e + i], zeros past n and k
void mstar_bf16_pack(const void *w, int64_t w_row, int64_t n, int64_t k, void *packed) {
    const bf16 *src = static_cast<const bf16 *>(w);
    bf16 *dst = static_cast<bf16 *>(packed);
    const int64_t panels = (n + PANEL - 1) / PANEL, steps = (k + 1) / 2;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t e = 0; e < steps; ++e)
            for (int64_t j = 0; j < PANEL; ++j)
                for (int64_t i = 0; i < 2; ++i) {
                    const int64_t o = p * PANEL + j, c = 2 * e + i;
                    dst[((p * steps + e) * PANEL + j) * 2 + i] = o < n && c < k ? src[o * w_row + c] : bf16(0);
                }
}

// out [m, n] (row stride out_row) = x [m, k] (row stride x_row) @ weight.T + bias (or none); nonzero: not built here
int mstar_bf16_linear(const void *x, int64_t x_row, const void *packed, const void *bias, void *out, int64_t out_row,
                      int64_t m, int64_t n, int64_t k, int threads) {
#if defined(MSTAR_BF16_LINEAR)
    const bf16 *xs = static_cast<const bf16 *>(x), *ws = static_cast<const bf16 *>(packed);
    const bf16 *bs = static_cast<const bf16 *>(bias);
    bf16 *os = static_cast<bf16 *>(out);
    const int64_t steps = (k + 1) / 2;
    const mstar::PanelCall call{m, (n + PANEL - 1) / PANEL, steps, 2 * PANEL * static_cast<int64_t>(sizeof(bf16)),
                                BLOCK_ROWS};
    mstar::run_panel_tasks(call, static_cast<const char *>(packed), m * n * k, threads,
                           [&](int64_t r0, int64_t rows, int64_t p, const char *ahead, int64_t ahead_step) {
        const int64_t outs = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        dispatch<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(rows, xs + r0 * x_row, x_row, ws + p * steps * 2 * PANEL, k,
                                                        bs ? bs + p * PANEL : nullptr, os + r0 * out_row + p * PANEL,
                                                        out_row, outs, ahead, ahead_step);
    });
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)bias, (void)out, (void)out_row, (void)m, (void)n, (void)k, (void)threads;
    return 1;
#endif
}

}  // extern "C"
