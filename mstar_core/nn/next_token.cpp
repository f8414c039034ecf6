// The next token of each row of logits: greedy (the row's argmax, read where the LM head wrote it, fp32 or bf16) and a
// temperature draw (fp32): built by native.py, called by logits.py.
//
// The sampler's greedy path was `logits.float()` and `max(-1).indices`: two torch ops over a 49,152-wide row
// (~60 us at one row on a 2-core EPYC, mostly each op's dispatch and the OpenMP team it wakes), against a few
// microseconds for one pass over the row's 96 KB from cache. The index is torch's: the first NaN if the row has
// one, otherwise the first column equal to the row's maximum (+0 and -0 are equal).
//
// A draw at a temperature alone (no top-k, top-p or min-p) was ten torch ops (divide, log-softmax, nan_to_num, exp,
// cumsum, searchsorted, ...), ~0.3-0.5 ms a row; here it is three passes: the row's maximum, the weights
// exp((x - max) / T) summed in blocks of 16, then the block and the column where the running sum first exceeds u of
// the total. The distribution is the same (the exp within ~2 ulp of expf, sums in another order), the token for a
// given u may differ from the torch ops' where u falls within rounding of a boundary; a row's draw depends on its
// own logits and u alone, whatever shares its batch.

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "mstar_native.h"

namespace {

using namespace mstar;

constexpr int64_t PARALLEL_ELEMENTS = 1 << 17;  // below this one thread beats waking the team

// columns [begin, width): the first maximum's index and its value in *best (the first NaN's, NaN, if any); -1 if none
template <typename T>
int64_t argmax_scalar(const T *x, int64_t begin, int64_t width, float *best) {
    int64_t at = -1;
    float top = 0.0f;
    for (int64_t e = begin; e < width; ++e) {
        const float v = widen(x[e]);
        if (v != v) {  // NaN: torch's max takes the first one
            *best = v;
            return e;
        }
        if (at < 0 || v > top) top = v, at = e;
    }
    *best = top;
    return at;
}

template <typename T>
int64_t argmax_row(const T *x, int64_t width) {
#if defined(__AVX512F__)
    const int64_t body = width - width % 16;
    if (body >= 16) {
        // pass 1: the row's maximum, returning at the first NaN (a block with one holds the row's first)
        __m512 top = load16(x);
        for (int64_t e = 0; e < body; e += 16) {
            const __m512 v = load16(x + e);
            const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            if (nan) return e + __builtin_ctz(nan);
            top = _mm512_max_ps(top, v);
        }
        float tail_top = 0.0f;
        const int64_t tail = argmax_scalar(x, body, width, &tail_top);
        if (tail >= 0 && tail_top != tail_top) return tail;
        float m = _mm512_reduce_max_ps(top);
        if (tail >= 0 && tail_top > m) return tail;  // (a tail equal to the maximum is found after the body below)
        // pass 2: the first column equal to it
        const __m512 want = _mm512_set1_ps(m);
        for (int64_t e = 0; e < body; e += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + e), want, _CMP_EQ_OQ);
            if (hit) return e + __builtin_ctz(hit);
        }
        return tail;  // (unreachable: the maximum is in the body)
    }
#endif
    float top = 0.0f;
    return argmax_scalar(x, 0, width, &top);
}

template <typename T>
void argmax_rows(const T *x, int64_t row, int64_t rows, int64_t width, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row, width);
}

constexpr int64_t BLOCK = 16;

// The column drawn from softmax(x / t) by the uniform u in [0, 1); -1 where the row's maximum is not finite (a NaN or
// an infinity: the caller's torch ops decide those rows). `w`: room for the row's weights, `sums` for its blocks'.
int64_t draw_row(const float *x, int64_t width, float inv_t, double u, float *w, float *sums) {
    float top = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t e = 0; e < width; ++e) {
        const float v = x[e] * inv_t;
        nan |= v != v;
        top = v > top ? v : top;
    }
    if (nan || !std::isfinite(top)) return -1;
    // the weights and each block's sum (vector-wide), then the total over the blocks in order: the running sum below
    // adds the same block sums in the same order, so it reaches the total exactly
    const int64_t blocks = (width + BLOCK - 1) / BLOCK;
    float total = 0.0f;
    int64_t b = 0;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(inv_t), peak = _mm512_set1_ps(top), none = _mm512_set1_ps(-INFINITY);
    for (; (b + 1) * BLOCK <= width; ++b) {
        const __m512 v = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(x + b * BLOCK), scale), peak);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, none, _CMP_NEQ_OQ), mstar::exp16(v));
        _mm512_storeu_ps(w + b * BLOCK, e);
        sums[b] = _mm512_reduce_add_ps(e);
        total += sums[b];
    }
#endif
    for (; b < blocks; ++b) {
        const int64_t lo = b * BLOCK, hi = lo + BLOCK < width ? lo + BLOCK : width;
        float block = 0.0f;
        for (int64_t e = lo; e < hi; ++e) {  // (a masked column, -inf, weighs exactly nothing: exp_approx floors at -87)
            const float v = x[e] * inv_t - top;
            w[e] = v == -INFINITY ? 0.0f : exp_approx(v);
            block += w[e];
        }
        sums[b] = block;
        total += block;
    }
    const float target = static_cast<float>(u * static_cast<double>(total));
    float running = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        if (running + sums[b] > target) {
            const int64_t lo = b * BLOCK, hi = lo + BLOCK < width ? lo + BLOCK : width;
            float within = running;
            for (int64_t e = lo; e < hi; ++e) {
                within += w[e];
                if (within > target) return e;
            }
        }
        running += sums[b];
    }
    for (int64_t e = width - 1; e >= 0; --e)  // (u * total rounded up to the total: the last token of weight)
        if (w[e] > 0.0f) return e;
    return -1;
}

}  // namespace

extern "C" {

// out[r] = the index of row r's maximum (torch's `max(-1).indices`) over `width` columns; rows `row` elements apart
void mstar_argmax_rows_f32(const void *x, int64_t row, int64_t rows, int64_t width, int64_t *out, int threads) {
    argmax_rows(static_cast<const float *>(x), row, rows, width, out, threads);
}

void mstar_argmax_rows_bf16(const void *x, int64_t row, int64_t rows, int64_t width, int64_t *out, int threads) {
    argmax_rows(static_cast<const bf16 *>(x), row, rows, width, out, threads);
}

// out[r] = the column drawn from softmax(row r / temperature[r]) by u[r] (fp32 rows `row` apart), -1 for a row whose
// maximum is not finite; 0, or 1 without memory for the weights
int mstar_draw_rows_f32(const void *x, int64_t row, int64_t rows, int64_t width, const float *temperature,
                        const double *u, int64_t *out, int threads) {
    const int64_t per_row = width + (width + BLOCK - 1) / BLOCK;  // (weights, then block sums)
    // (a thread's buffer kept between calls: a fresh 200 KB one a step is an mmap and its page faults)
    thread_local float *kept = nullptr;
    thread_local int64_t kept_size = 0;
    float *scratch = kept;
    const bool own = rows > 1;  // (rows in parallel each take their own share of one fresh buffer)
    if (own) {
        scratch = static_cast<float *>(std::malloc(sizeof(float) * per_row * rows));
    } else if (kept_size < per_row) {
        std::free(kept);
        kept = scratch = static_cast<float *>(std::malloc(sizeof(float) * per_row));
        kept_size = kept == nullptr ? 0 : per_row;
    }
    if (scratch == nullptr) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        float *w = scratch + r * per_row;
        out[r] = draw_row(static_cast<const float *>(x) + r * row, width, 1.0f / temperature[r], u[r], w, w + width);
    }
    if (own) std::free(scratch);
    return 0;
}

}  // extern "C"
