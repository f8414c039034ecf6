// LayerNorm over a decode step's few fp32 rows: built by layer_norm.py.
//
// A one-row decode step streams its weights from memory between its small ops, so torch's `layer_norm` starts cold
// there (its dispatch, TensorIterator and moments code come back from memory), and a recorded step (tape.cpp) can
// only replay kernels it can call without Python. This is one short loop a row.
//
// The statistics are summed in double (the mean, then the biased variance around it) and rounded to float, and the
// output is formed as torch's CPU kernel forms it: y = fma((x - mean) * rstd, weight, bias), rstd = 1 / sqrt(var +
// eps) (checked against `aten.native_layer_norm` given its own mean and rstd: every bit equal). torch's float moments
// differ from these correctly rounded ones by an ulp on about a third of the rows; there an output differs by about
// an ulp of the statistic (within 2e-6 of torch's on unit-scale rows, tests/nn/test_layer_norm.py).
//
// No torch headers: plain C ABI over raw pointers, called through ctypes (native.py).

#include <cmath>
#include <cstdint>

#include <omp.h>

#include "mstar_native.h"

namespace {

void norm_row(const float *x, const float *weight, const float *bias, float *out, int64_t dim, float eps) {
    double sum = 0.0;
    for (int64_t e = 0; e < dim; ++e) sum += x[e];
    const double mean = sum / static_cast<double>(dim);
    double squares = 0.0;
    for (int64_t e = 0; e < dim; ++e) {
        const double d = x[e] - mean;
        squares += d * d;
    }
    const float mean_f = static_cast<float>(mean);
    const float var_f = static_cast<float>(squares / static_cast<double>(dim));
    const float rstd = 1.0f / std::sqrt((var_f > 0.0f ? var_f : 0.0f) + eps);
    int64_t e = 0;
#if defined(__AVX512F__)
    const __m512 mean16 = _mm512_set1_ps(mean_f), rstd16 = _mm512_set1_ps(rstd);
    for (; e + 16 <= dim; e += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + e), mean16), rstd16);
        _mm512_storeu_ps(out + e, _mm512_fmadd_ps(y, _mm512_loadu_ps(weight + e), _mm512_loadu_ps(bias + e)));
    }
#endif
    for (; e < dim; ++e) out[e] = std::fma((x[e] - mean_f) * rstd, weight[e], bias[e]);
}

}  // namespace

extern "C" {

// rows of `dim` floats (row r at x + r * x_row) -> out (contiguous rows)
void mstar_layer_norm_f32(const float *x, int64_t x_row, const float *weight, const float *bias, float *out, int64_t rows,
                          int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (rows > 8) schedule(static)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * x_row, weight, bias, out + r * dim, dim, eps);
}

}  // extern "C"
