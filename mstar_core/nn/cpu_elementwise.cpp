// RMSNorm (alone or after a residual add), a residual add, SiLU-and-multiply and rotary embedding for CPU, in one pass each:
// built by native.py, called by cpu_elementwise.py.
//
// As torch ops a bf16 RMSNorm is eight passes over its rows (widen, square, mean, add, rsqrt, scale,
// narrow, weight) and SwiGLU's gate two (silu, multiply), each allocating; in a 2,048-token prefill
// of SmolLM2 they took ~40 % of the step. Here each row is read once and written once, with the
// same roundings as the torch ops they replace: fp32 math, the normalised row rounded to the
// activation dtype before the weight multiplies it, the SiLU rounded before the product.

#include <cstdint>

#include "mstar_native.h"

namespace {

using namespace mstar;

constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;  // below this a row loop on one thread beats waking the team
constexpr int64_t MAX_VECTOR_ROT = 512;  // rotary widths the vector loop takes (its rounded tables on the stack)

template <typename T>
void rms_norm(const T *x, int64_t x_row, const T *weight, T *out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const T *src = x + r * x_row;
        T *dst = out + r * dim;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t e = 0; e < dim; ++e) total += widen(src[e]) * widen(src[e]);
        const float inv = 1.0f / std::sqrt(total / static_cast<float>(dim) + eps);
#pragma omp simd
        for (int64_t e = 0; e < dim; ++e) store(round_to(widen(weight[e]) * round_to(widen(src[e]) * inv, dst), dst), dst + e);
    }
}

// rms_norm over every head of [rows, heads, dim] rows whose heads are `head` apart and rows `row` apart (a per-head
// q/k norm over a view of the fused qkv output, which no 2-D stride describes), into contiguous out
template <typename T>
void rms_norm_heads(const T *x, int64_t row, int64_t head, int64_t rows, int64_t heads, int64_t dim, const T *weight,
                    T *out, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) rms_norm(x + r * row, head, weight, out + r * heads * dim, heads, dim, eps, 1);
}

// residual + delta (rounded to T, as torch's add) written over delta, then RMSNorm of that sum into out
template <typename T>
void add_rms_norm(T *delta, const T *residual, int64_t res_row, const T *weight, T *out, int64_t rows, int64_t dim,
                  float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        T *sum = delta + r * dim;
        const T *res = residual + r * res_row;
        T *dst = out + r * dim;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t e = 0; e < dim; ++e) {
            const float v = round_to(widen(res[e]) + widen(sum[e]), sum);
            store(v, sum + e);
            total += v * v;
        }
        const float inv = 1.0f / std::sqrt(total / static_cast<float>(dim) + eps);
#pragma omp simd
        for (int64_t e = 0; e < dim; ++e) store(round_to(widen(weight[e]) * round_to(widen(sum[e]) * inv, dst), dst), dst + e);
    }
}

// acc [rows, dim] (contiguous) = other + acc, rounded to T as torch's add (a residual added to a block's output)
template <typename T>
void add(T *acc, const T *other, int64_t other_row, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        T *sum = acc + r * dim;
        const T *src = other + r * other_row;
#pragma omp simd
        for (int64_t e = 0; e < dim; ++e) store(round_to(widen(src[e]) + widen(sum[e]), sum), sum + e);
    }
}

template <typename T>
void silu_mul(const T *gate_up, int64_t row, T *out, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const T *gate = gate_up + r * row, *up = gate + width;
        T *dst = out + r * width;
        int64_t e = 0;
#if defined(__AVX512F__)
        for (; e + 16 <= width; e += 16) {
            const __m512 g = load16(gate + e);
            const __m512 act = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))), dst);
            store16(round16(_mm512_mul_ps(act, load16(up + e)), dst), dst + e);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; e + 8 <= width; e += 8) {
            const __m256 g = load8(gate + e);
            const __m256 act = round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))), dst);
            store8(round8(_mm256_mul_ps(act, load8(up + e)), dst), dst + e);
        }
#endif
        for (; e < width; ++e) {
            const float g = widen(gate[e]);
            const float act = round_to(g / (1.0f + exp_approx(-g)), dst);
            store(round_to(act * widen(up[e]), dst), dst + e);
        }
    }
}

// Rotary embedding in place over [rows, heads, dim] (strided rows and heads, unit innermost), the first `rot`
// elements of each head rotated by the row's cos / sin ([rows, rot], fp32, half-split layout), the rest left
// as they are. As apply_rotary's torch ops round: cos and sin rounded to T, each product rounded, then
// the sum (-ffp-contract=off keeps the products apart). As torch ops it is ~14 ops a layer.
template <typename T>
void rotary(T *x, int64_t row, int64_t head, int64_t rows, int64_t heads, int64_t rot, const float *cos,
            const float *sin, int threads) {
    const int64_t half = rot / 2;
    // a row's heads in turn (no division a head to find its row), 16 lanes at a time where AVX-512 is built: the
    // compiler left the scalar loop mostly scalar (~2x the time of the whole row's reads and writes)
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * rot >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * rot, *s = sin + r * rot;
#if defined(__AVX512F__)
        // the row's cos and sin rounded to T once for all its heads (a bf16 row: a third of the roundings)
        alignas(64) float tables[2 * MAX_VECTOR_ROT];
        const int64_t vector_half = rot <= MAX_VECTOR_ROT ? half / 16 * 16 : 0;
        for (int64_t e = 0; e < rot && vector_half; e += 16) {
            const __mmask16 keep = rot - e >= 16 ? 0xffff : static_cast<__mmask16>((1u << (rot - e)) - 1);
            _mm512_store_ps(tables + e, round16(_mm512_maskz_loadu_ps(keep, c + e), x));
            _mm512_store_ps(tables + MAX_VECTOR_ROT + e, round16(_mm512_maskz_loadu_ps(keep, s + e), x));
        }
        const float *rc = tables, *rs = tables + MAX_VECTOR_ROT;
        const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
#endif
        for (int64_t h = 0; h < heads; ++h) {
            T *v = x + r * row + h * head;
            int64_t e = 0;
#if defined(__AVX512F__)
            for (; e < vector_half; e += 16) {
                const __m512 a = load16(v + e), b = load16(v + e + half);
                const __m512 minus_b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), sign));
                const __m512 lo_c = round16(_mm512_mul_ps(a, _mm512_load_ps(rc + e)), v);
                const __m512 lo_s = round16(_mm512_mul_ps(minus_b, _mm512_load_ps(rs + e)), v);
                const __m512 hi_c = round16(_mm512_mul_ps(b, _mm512_loadu_ps(rc + e + half)), v);
                const __m512 hi_s = round16(_mm512_mul_ps(a, _mm512_loadu_ps(rs + e + half)), v);
                store16(round16(_mm512_add_ps(lo_c, lo_s), v), v + e);
                store16(round16(_mm512_add_ps(hi_c, hi_s), v), v + e + half);
            }
#endif
            for (; e < half; ++e) {
                const float a = widen(v[e]), b = widen(v[e + half]);
                const float lo_c = round_to(a * round_to(c[e], v), v), lo_s = round_to(-b * round_to(s[e], v), v);
                const float hi_c = round_to(b * round_to(c[e + half], v), v), hi_s = round_to(a * round_to(s[e + half], v), v);
                store(round_to(lo_c + lo_s, v), v + e);
                store(round_to(hi_c + hi_s, v), v + e + half);
            }
        }
    }
}

}  // namespace

extern "C" {

// whether the vectorized SiLU is in this build (a scalar exp is slower than torch's)
int mstar_elementwise_vectorized() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

void mstar_rms_norm_f32(const void *x, int64_t x_row, const void *w, void *out, int64_t rows, int64_t dim, float eps,
                        int threads) {
    rms_norm(static_cast<const float *>(x), x_row, static_cast<const float *>(w), static_cast<float *>(out), rows, dim, eps,
             threads);
}

void mstar_rms_norm_bf16(const void *x, int64_t x_row, const void *w, void *out, int64_t rows, int64_t dim, float eps,
                         int threads) {
    rms_norm(static_cast<const bf16 *>(x), x_row, static_cast<const bf16 *>(w), static_cast<bf16 *>(out), rows, dim, eps,
             threads);
}

void mstar_rms_norm_heads_f32(const void *x, int64_t row, int64_t head, int64_t rows, int64_t heads, int64_t dim,
                              const void *w, void *out, float eps, int threads) {
    rms_norm_heads(static_cast<const float *>(x), row, head, rows, heads, dim, static_cast<const float *>(w),
                   static_cast<float *>(out), eps, threads);
}

void mstar_rms_norm_heads_bf16(const void *x, int64_t row, int64_t head, int64_t rows, int64_t heads, int64_t dim,
                               const void *w, void *out, float eps, int threads) {
    rms_norm_heads(static_cast<const bf16 *>(x), row, head, rows, heads, dim, static_cast<const bf16 *>(w),
                   static_cast<bf16 *>(out), eps, threads);
}

void mstar_add_rms_norm_f32(void *delta, const void *residual, int64_t res_row, const void *w, void *out, int64_t rows,
                            int64_t dim, float eps, int threads) {
    add_rms_norm(static_cast<float *>(delta), static_cast<const float *>(residual), res_row, static_cast<const float *>(w),
                 static_cast<float *>(out), rows, dim, eps, threads);
}

void mstar_add_rms_norm_bf16(void *delta, const void *residual, int64_t res_row, const void *w, void *out, int64_t rows,
                             int64_t dim, float eps, int threads) {
    add_rms_norm(static_cast<bf16 *>(delta), static_cast<const bf16 *>(residual), res_row, static_cast<const bf16 *>(w),
                 static_cast<bf16 *>(out), rows, dim, eps, threads);
}

void mstar_add_f32(void *acc, const void *other, int64_t other_row, int64_t rows, int64_t dim, int threads) {
    add(static_cast<float *>(acc), static_cast<const float *>(other), other_row, rows, dim, threads);
}

void mstar_add_bf16(void *acc, const void *other, int64_t other_row, int64_t rows, int64_t dim, int threads) {
    add(static_cast<bf16 *>(acc), static_cast<const bf16 *>(other), other_row, rows, dim, threads);
}

void mstar_silu_mul_f32(const void *gate_up, int64_t row, void *out, int64_t rows, int64_t width, int threads) {
    silu_mul(static_cast<const float *>(gate_up), row, static_cast<float *>(out), rows, width, threads);
}

void mstar_silu_mul_bf16(const void *gate_up, int64_t row, void *out, int64_t rows, int64_t width, int threads) {
    silu_mul(static_cast<const bf16 *>(gate_up), row, static_cast<bf16 *>(out), rows, width, threads);
}

void mstar_rotary_f32(void *x, int64_t row, int64_t head, int64_t rows, int64_t heads, int64_t rot, const float *cos,
                      const float *sin, int threads) {
    rotary(static_cast<float *>(x), row, head, rows, heads, rot, cos, sin, threads);
}

void mstar_rotary_bf16(void *x, int64_t row, int64_t head, int64_t rows, int64_t heads, int64_t rot, const float *cos,
                       const float *sin, int threads) {
    rotary(static_cast<bf16 *>(x), row, head, rows, heads, rot, cos, sin, threads);
}

}  // extern "C"
