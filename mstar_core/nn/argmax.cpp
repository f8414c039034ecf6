// The greedy token of each row of logits, read where the LM head wrote them (fp32 or bf16): built by native.py,
// called by logits.py.
//
// The sampler's greedy path was `logits.float()` and `max(-1).indices`: two torch ops over a 49,152-wide row
// (~60 us at one row on a 2-core EPYC, mostly each op's dispatch and the OpenMP team it wakes), against a few
// microseconds for one pass over the row's 96 KB from cache. The index is torch's: the first NaN if the row has
// one, otherwise the first column equal to the row's maximum (+0 and -0 are equal).

#include <cstdint>

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

}  // namespace

extern "C" {

// out[r] = the index of row r's maximum (torch's `max(-1).indices`) over `width` columns; rows `row` elements apart
void mstar_argmax_rows_f32(const void *x, int64_t row, int64_t rows, int64_t width, int64_t *out, int threads) {
    argmax_rows(static_cast<const float *>(x), row, rows, width, out, threads);
}

void mstar_argmax_rows_bf16(const void *x, int64_t row, int64_t rows, int64_t width, int64_t *out, int threads) {
    argmax_rows(static_cast<const bf16 *>(x), row, rows, width, out, threads);
}

}  // extern "C"
