// fp32 linears on CPUs with AVX2 and FMA but no AVX-512: built by native.py, called by packed.py.
//
// A decode step reads every weight once for a few rows, so on such a CPU its speed is the speed the weights
// stream at. oneDNN's AVX2 GEMM, called through torch, streams a step's 121 weights at about half the bandwidth
// a plain sum reaches (most of the calls are a few MB each, and each pays its setup), and one row runs as two
// (its one-row kernel sums in another order). Here the weight is packed once into panels of 16 outputs, each
// panel its K inputs in order ([panels][K][16]), and a call is one loop: each task takes a run of panels that
// stays in L2, and passes every input row through it six rows at a time (12 accumulators of 8 lanes).
//
// With more than six rows the passes after the first compute from L2 and leave the memory idle, and the first
// waits on it. So a thread claims its next task when it starts one, and fetches that task's panels into L2
// while it computes this one, spread over its first passes: the weight stream keeps going during the
// compute-bound passes (`benchmarks/decode_linears.py`: 8 and 32 rows).
//
// Batch invariance: an output element is one FMA chain over its inputs in order, from zero, then its bias
// added, whatever the call's row count or the row's place in its block of six, so a row computes bitwise the
// same alone or beside others, in a decode step or a prefill chunk of any length.

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define MSTAR_FP32_LINEAR 1
#endif

namespace {

constexpr int64_t PANEL = 16;                 // outputs per panel: two 8-lane vectors
constexpr int64_t BLOCK_ROWS = 6;             // rows per block: 12 accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t TASK_BYTES = 192 * 1024;    // weight panels one task passes every row through (in L2)
constexpr int64_t PREFETCH = 32;              // inputs ahead the weight stream is fetched (32 lines, 2 KB)
constexpr int64_t SPREAD = 8;                 // passes over which the next task's panels are fetched, at most
constexpr int64_t LINE = 64;                  // bytes
constexpr int64_t PARALLEL_MACS = 1 << 15;    // smaller calls run on the calling thread

#if defined(MSTAR_FP32_LINEAR)
// out[r][0..outs) = bias + x[r] . panel's columns, for R rows. The accumulators are named, not an array: gcc
// keeps an array of them in memory, a store per FMA.
// `ahead`: where this block fetches the next task's panels into L2, `ahead_step` bytes further each input (0: none).
template <int R>
void block(const float *x, int64_t x_row, const float *panel, int64_t k, const float *bias, float *out, int64_t out_row,
           int64_t outs, const char *ahead, int64_t ahead_step) {
    __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l, a3l = a0l, a3h = a0l,
           a4l = a0l, a4h = a0l, a5l = a0l, a5h = a0l;
    const float *x0 = x, *x1 = x + x_row, *x2 = x + 2 * x_row, *x3 = x + 3 * x_row, *x4 = x + 4 * x_row,
                *x5 = x + 5 * x_row;
    for (int64_t e = 0; e < k; ++e) {
        const __m256 lo = _mm256_loadu_ps(panel + e * PANEL), hi = _mm256_loadu_ps(panel + e * PANEL + 8);
        _mm_prefetch(reinterpret_cast<const char *>(panel + (e + PREFETCH) * PANEL), _MM_HINT_T0);
        if (ahead_step) _mm_prefetch(ahead + e * ahead_step, _MM_HINT_T1);
#define MSTAR_ROW(r)                                                                        \
    if constexpr (R > r) {                                                                  \
        const __m256 v = _mm256_broadcast_ss(x##r + e);                                     \
        a##r##l = _mm256_fmadd_ps(v, lo, a##r##l), a##r##h = _mm256_fmadd_ps(v, hi, a##r##h); \
    }
        MSTAR_ROW(0) MSTAR_ROW(1) MSTAR_ROW(2) MSTAR_ROW(3) MSTAR_ROW(4) MSTAR_ROW(5)
#undef MSTAR_ROW
    }
    alignas(32) float sums[BLOCK_ROWS][PANEL];
    const __m256 acc[BLOCK_ROWS][2] = {{a0l, a0h}, {a1l, a1h}, {a2l, a2h}, {a3l, a3h}, {a4l, a4h}, {a5l, a5h}};
    for (int r = 0; r < R; ++r) _mm256_store_ps(sums[r], acc[r][0]), _mm256_store_ps(sums[r] + 8, acc[r][1]);
    for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < outs; ++j) out[r * out_row + j] = bias ? sums[r][j] + bias[j] : sums[r][j];
}

void rows_through_panel(int64_t rows, const float *x, int64_t x_row, const float *panel, int64_t k, const float *bias,
                        float *out, int64_t out_row, int64_t outs, const char *ahead, int64_t ahead_step) {
    switch (rows) {
        case 1: return block<1>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step);
        case 2: return block<2>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step);
        case 3: return block<3>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step);
        case 4: return block<4>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step);
        case 5: return block<5>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step);
        default: return block<6>(x, x_row, panel, k, bias, out, out_row, outs, ahead, ahead_step);
    }
}
#endif

}  // namespace

extern "C" {

// whether this build has the kernel (AVX2 + FMA, and no AVX-512, where oneDNN's own kernels are faster)
int mstar_fp32_linear_available() {
#if defined(MSTAR_FP32_LINEAR)
    return 1;
#else
    return 0;
#endif
}

// floats of the packed layout of an [n, k] weight
int64_t mstar_fp32_packed_floats(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

// weight [n, k] (row stride w_row) into panels: packed[p][e][j] = weight[p * 16 + j][e], zeros past n
void mstar_fp32_pack(const float *weight, int64_t w_row, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t e = 0; e < k; ++e)
            for (int64_t j = 0; j < PANEL; ++j) {
                const int64_t o = p * PANEL + j;
                packed[(p * k + e) * PANEL + j] = o < n ? weight[o * w_row + e] : 0.0f;
            }
}

// out [m, n] (row stride out_row) = x [m, k] (row stride x_row) @ weight.T + bias (or none); nonzero: not built here
int mstar_fp32_linear(const float *x, int64_t x_row, const float *packed, const float *bias, float *out, int64_t out_row,
                      int64_t m, int64_t n, int64_t k, int threads) {
#if defined(MSTAR_FP32_LINEAR)
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int64_t per_task = TASK_BYTES / (k * PANEL * static_cast<int64_t>(sizeof(float)));
    if (panels < 4 * threads * per_task) per_task = (panels + 4 * threads - 1) / (4 * threads);  // a few tasks a thread
    per_task = per_task < 1 ? 1 : per_task;
    const int64_t tasks = (panels + per_task - 1) / per_task;
    const int64_t passes = (m + BLOCK_ROWS - 1) / BLOCK_ROWS, spread = passes < SPREAD ? passes : SPREAD;
    const int64_t ahead_step = (LINE + spread - 1) / spread;  // the next task's bytes fetched per input of a pass
    const int64_t task_floats = per_task * k * PANEL;
    int64_t claimed = 0;  // tasks handed out: claimed with an atomic add, so a held-up thread holds up no one
#pragma omp parallel num_threads(tasks > 1 && m * n * k >= PARALLEL_MACS ? threads : 1)
    {
        int64_t t = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (t < tasks) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int64_t first = t * per_task, last = first + per_task < panels ? first + per_task : panels;
            // one pass streams its own panels at the memory's speed already: fetch ahead only behind later passes
            const bool fetch = next < tasks && passes > 1;
            const char *ahead = reinterpret_cast<const char *>(packed + (fetch ? next : t) * task_floats);
            const int64_t pass_bytes = (task_floats * static_cast<int64_t>(sizeof(float)) + spread - 1) / spread;
            for (int64_t r0 = 0, pass = 0; r0 < m; r0 += BLOCK_ROWS, ++pass)
                for (int64_t p = first; p < last; ++p) {
                    const int64_t outs = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
                    const char *at = ahead + pass * pass_bytes + (p - first) * k * ahead_step;
                    rows_through_panel(m - r0 < BLOCK_ROWS ? m - r0 : BLOCK_ROWS, x + r0 * x_row, x_row, packed + p * k * PANEL,
                                       k, bias ? bias + p * PANEL : nullptr, out + r0 * out_row + p * PANEL, out_row, outs,
                                       at, fetch && pass < spread ? ahead_step : 0);
                }
            t = next;
        }
    }
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)bias, (void)out, (void)out_row, (void)m, (void)n, (void)k, (void)threads;
    return 1;
#endif
}

}  // extern "C"
