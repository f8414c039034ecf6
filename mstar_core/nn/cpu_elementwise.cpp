// RMSNorm and SiLU-and-multiply for CPU, in one pass each: built by native.py, called by cpu_elementwise.py.
//
// As torch ops a bf16 RMSNorm is eight passes over its rows (widen, square, mean, add, rsqrt, scale,
// narrow, weight) and SwiGLU's gate two (silu, multiply), each allocating; in a 2,048-token prefill
// of SmolLM2 they took ~40 % of the step. Here each row is read once and written once, with the
// same roundings as the torch ops they replace: fp32 math, the normalised row rounded to the
// activation dtype before the weight multiplies it, the SiLU rounded before the product.

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef uint16_t bf16;

inline float widen(float x) { return x; }
inline float widen(bf16 h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float round_to(float x, float *) { return x; }
inline float round_to(float x, bf16 *) {  // fp32 -> bf16 -> fp32, round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline void store(float x, float *dst) { *dst = x; }
inline void store(float x, bf16 *dst) {  // x already holds a bf16 value (round_to)
    uint32_t u;
    std::memcpy(&u, &x, 4);
    *dst = static_cast<bf16>(u >> 16);
}

// e^x: Cody-Waite reduction and Cephes' degree-6 polynomial (within ~2 ulp), written so loops vectorize
inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.8f ? 88.8f : x);  // (above 88.7: 2^128, inf, as expf overflows)
    float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;  // below this a row loop on one thread beats waking the team

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

#if defined(__AVX512F__)
// gcc leaves the SiLU's exp loop scalar; these are the same formulas 16 lanes at a time
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
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.8f));  // (above: 2^128, inf)
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
#endif
        for (; e < width; ++e) {
            const float g = widen(gate[e]);
            const float act = round_to(g / (1.0f + exp_approx(-g)), dst);
            store(round_to(act * widen(up[e]), dst), dst + e);
        }
    }
}

}  // namespace

extern "C" {

// whether the vectorized SiLU is in this build (the portable one's scalar exp is slower than torch's)
int mstar_elementwise_vectorized() {
#if defined(__AVX512F__)
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

void mstar_silu_mul_f32(const void *gate_up, int64_t row, void *out, int64_t rows, int64_t width, int threads) {
    silu_mul(static_cast<const float *>(gate_up), row, static_cast<float *>(out), rows, width, threads);
}

void mstar_silu_mul_bf16(const void *gate_up, int64_t row, void *out, int64_t rows, int64_t width, int threads) {
    silu_mul(static_cast<const bf16 *>(gate_up), row, static_cast<bf16 *>(out), rows, width, threads);
}

}  // extern "C"
