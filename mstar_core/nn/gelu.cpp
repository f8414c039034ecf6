// Exact (erf) GELU over a decode step's few fp32 rows, in place: built by gelu.py.
//
// Between the weight streams of a one-row decode step (a Whisper-base step reads ~230 MB) a torch elementwise op
// starts cold: its dispatch and TensorIterator code and tables come back from memory, ~30-170 us for a 2048-wide
// GELU measured on the benchmark's EPYC right after a stream, ~8 us warm. These loops are a few cache lines of code.
//
// The formula is torch's for approximate="none": x / 2 * (1 + erf(x / sqrt 2)), erf by Abramowitz and Stegun
// 7.1.26 (|error| < 1.5e-7) with mstar's exp: within ~1.5e-6 of F.gelu (about 70% of values bitwise equal).
//
// No torch headers: plain C ABI over raw pointers, called through ctypes (native.py).

#include <cmath>
#include <cstdint>

#include <omp.h>

#include "mstar_native.h"  // (exp)

namespace {

inline float erf_as(float x) {
    const float a = std::fabs(x);
    const float t = 1.0f / std::fma(0.3275911f, a, 1.0f);
    float r = std::fma(1.061405429f, t, -1.453152027f);
    r = std::fma(r, t, 1.421413741f);
    r = std::fma(r, t, -0.284496736f);
    r = std::fma(r, t, 0.254829592f);
    const float e = std::fma(-mstar::exp_approx(-a * a) * t, r, 1.0f);
    return std::copysign(e, x);
}

void gelu_span(float *x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), root = _mm512_set1_ps(0.70710678118654752f);
    const __m512 neg = _mm512_set1_ps(-0.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 z = _mm512_mul_ps(v, root);
        const __m512 a = _mm512_andnot_ps(neg, z);
        const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
        __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
        r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
        r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
        r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
        const __m512 e = mstar::exp16(_mm512_xor_ps(neg, _mm512_mul_ps(a, a)));
        __m512 erf = _mm512_fmadd_ps(_mm512_xor_ps(neg, _mm512_mul_ps(e, t)), r, one);
        erf = _mm512_or_ps(erf, _mm512_and_ps(neg, z));  // (erf >= 0 here: the sign of z)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(v, half), _mm512_add_ps(one, erf)));
    }
#endif
    for (; i < n; ++i) x[i] = x[i] * 0.5f * (1.0f + erf_as(x[i] * 0.70710678118654752f));
}

}  // namespace

extern "C" {

// GELU of `count` contiguous floats, in place
void mstar_gelu_f32(float *x, int64_t count, int threads) {
    constexpr int64_t SPAN = 1 << 14;
    const int64_t spans = (count + SPAN - 1) / SPAN;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (spans > 1) schedule(static)
    for (int64_t s = 0; s < spans; ++s) gelu_span(x + s * SPAN, count - s * SPAN < SPAN ? count - s * SPAN : SPAN);
}

}  // extern "C"
