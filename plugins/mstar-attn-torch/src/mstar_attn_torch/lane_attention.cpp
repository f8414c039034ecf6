// Decode attention over decode lanes, one pass per (sequence, KV head): built by lane_kernel.py.
//
// A decode step's attention on a CPU is memory-bound: every key and value of every decoding sequence
// is read once per layer. As torch ops (two batched matmuls, a scale, a mask, a softmax) a bf16 lane
// must be widened to fp32 first and the scores make several passes; here each task reads its lane's
// keys and values once in their own dtype, accumulates in fp32, and handles the query heads that
// share the KV head together (grouped-query attention reads each key once). It also appends the
// step's new key and value to the lane, and, given the paged pool, stores them in their pool slots,
// so a layer's whole decode attention is one call.
//
// No torch headers: the library is plain C ABI, compiled once per machine in about a second, and
// called through ctypes with raw pointers. OpenMP resolves to the runtime torch already loaded.

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#include "mstar_native.h"  // (mstar_core/nn: bf16, exp)

using mstar::bf16;

extern "C" {

// What stays the same for every layer of one step (built once per step by lane_kernel.py).
struct LanePlan {
    const int64_t *rows;       // packed row of each lane-decoding sequence (its q, new k/v and output row)
    const int64_t *lanes;      // its lane
    const int64_t *write_pos;  // where its new key and value go in the lane
    const int64_t *bound;      // keys it attends over: [0, bound)
    int64_t count;             // sequences
    int64_t q_heads, kv_heads, head_dim;
    int64_t q_row, q_head;     // strides (elements) of q, and of the output
    int64_t k_row, k_head;     // strides of the step's new keys
    int64_t v_row, v_head;     // and of its new values
    int64_t out_row, out_head;
    int64_t lane_stride, head_stride;  // strides of a layer's lane store: [lanes, kv heads, capacity, head dim]
    float scale;
    int32_t threads;
    const int64_t *slots;      // pool slot of each packed row's new key and value (with a pool passed)
    int64_t pool_slot, pool_head;  // strides of a layer's pool keys (and values): [slots, kv heads, head dim]
};

}  // extern "C"

namespace {

using mstar::narrow;
using mstar::widen;

constexpr int64_t MAX_GROUP = 16;  // query heads per KV head
constexpr int64_t MAX_DIM = 256;


#if defined(__AVX512F__)
// The AVX-512 path for head dims that are a multiple of 16: each query head's scores for 16 keys at a
// time (16 dot products summed across their lanes at once, no per-key horizontal sum), then its
// output from the probabilities with the accumulators in registers.

using mstar::load16;

// 32 bf16 values as two fp32 vectors, the even-indexed and the odd-indexed ones: a shift and a mask,
// no shuffle (widening in order would put a shuffle on the port the lane sums already load). Dot
// products and accumulations do not care about the order, and the output is put back in order once.
inline void load32(const bf16 *p, __m512 &even, __m512 &odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// r[j] = sum of a[j]'s 16 lanes, for 16 vectors
inline __m512 sum16(__m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

template <typename T, int D>
void scores16(const float *qf, const T *keys, int64_t n, float *s) {
    constexpr int C = D / 16;
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qf + 16 * c);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int64_t m = n - l0 < 16 ? n - l0 : 16;
        __m512 a[16];
        for (int j = 0; j < 16; ++j) {
            a[j] = _mm512_setzero_ps();
            if (j < m)
                for (int c = 0; c < C; ++c) a[j] = _mm512_fmadd_ps(qv[c], load16(keys + (l0 + j) * D + 16 * c), a[j]);
        }
        _mm512_mask_storeu_ps(s + l0, static_cast<__mmask16>((1u << m) - 1u), sum16(a));
    }
}

template <typename T, int D>
void weighted16(const float *w, const T *vals, int64_t n, float *out) {
    constexpr int C = D / 16;
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; ++l) {
        const __m512 wl = _mm512_set1_ps(w[l]);
        for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(wl, load16(vals + l * D + 16 * c), acc[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}


template <int D>
void scores32(const float *qf, const bf16 *keys, int64_t n, float *s) {
    constexpr int C = D / 32;
    alignas(64) float split[2][C][16];
    for (int c = 0; c < C; ++c)
        for (int i = 0; i < 16; ++i) split[0][c][i] = qf[32 * c + 2 * i], split[1][c][i] = qf[32 * c + 2 * i + 1];
    __m512 qe[C], qo[C];
    for (int c = 0; c < C; ++c) qe[c] = _mm512_load_ps(split[0][c]), qo[c] = _mm512_load_ps(split[1][c]);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int64_t m = n - l0 < 16 ? n - l0 : 16;
        __m512 a[16];
        for (int j = 0; j < 16; ++j) {
            a[j] = _mm512_setzero_ps();
            if (j < m)
                for (int c = 0; c < C; ++c) {
                    __m512 even, odd;
                    load32(keys + (l0 + j) * D + 32 * c, even, odd);
                    a[j] = _mm512_fmadd_ps(qo[c], odd, _mm512_fmadd_ps(qe[c], even, a[j]));
                }
        }
        _mm512_mask_storeu_ps(s + l0, static_cast<__mmask16>((1u << m) - 1u), sum16(a));
    }
}

template <int D>
void weighted32(const float *w, const bf16 *vals, int64_t n, float *out) {
    constexpr int C = D / 32;
    __m512 acc_e[C], acc_o[C];
    for (int c = 0; c < C; ++c) acc_e[c] = _mm512_setzero_ps(), acc_o[c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; ++l) {
        const __m512 wl = _mm512_set1_ps(w[l]);
        for (int c = 0; c < C; ++c) {
            __m512 even, odd;
            load32(vals + l * D + 32 * c, even, odd);
            acc_e[c] = _mm512_fmadd_ps(wl, even, acc_e[c]);
            acc_o[c] = _mm512_fmadd_ps(wl, odd, acc_o[c]);
        }
    }
    alignas(64) float split[2][C][16];
    for (int c = 0; c < C; ++c) _mm512_store_ps(split[0][c], acc_e[c]), _mm512_store_ps(split[1][c], acc_o[c]);
    for (int c = 0; c < C; ++c)
        for (int i = 0; i < 16; ++i) out[32 * c + 2 * i] = split[0][c][i], out[32 * c + 2 * i + 1] = split[1][c][i];
}

// bf16 lanes take the even/odd path
template <>
void scores16<bf16, 64>(const float *qf, const bf16 *keys, int64_t n, float *s) { scores32<64>(qf, keys, n, s); }
template <>
void scores16<bf16, 128>(const float *qf, const bf16 *keys, int64_t n, float *s) { scores32<128>(qf, keys, n, s); }
template <>
void scores16<bf16, 256>(const float *qf, const bf16 *keys, int64_t n, float *s) { scores32<256>(qf, keys, n, s); }
template <>
void weighted16<bf16, 64>(const float *w, const bf16 *vals, int64_t n, float *out) { weighted32<64>(w, vals, n, out); }
template <>
void weighted16<bf16, 128>(const float *w, const bf16 *vals, int64_t n, float *out) { weighted32<128>(w, vals, n, out); }
template <>
void weighted16<bf16, 256>(const float *w, const bf16 *vals, int64_t n, float *out) { weighted32<256>(w, vals, n, out); }


// softmax of s[0..n) in place, vectorized (the same reduction and polynomial as the portable loop)
inline void softmax16(float *s, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l < 16 ? static_cast<__mmask16>((1u << (n - l)) - 1u) : static_cast<__mmask16>(0xFFFF);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, m, s + l));
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l < 16 ? static_cast<__mmask16>((1u << (n - l)) - 1u) : static_cast<__mmask16>(0xFFFF);
        const __m512 e = _mm512_maskz_mov_ps(m, mstar::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), peak)));
        total = _mm512_add_ps(total, e);
        _mm512_mask_storeu_ps(s + l, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l < 16 ? static_cast<__mmask16>((1u << (n - l)) - 1u) : static_cast<__mmask16>(0xFFFF);
        _mm512_mask_storeu_ps(s + l, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + l), inv));
    }
}

// this build's vector kernels, by one name (the dispatch below is written once for both paths)
template <typename T, int D>
inline void vector_scores(const float *qf, const T *keys, int64_t n, float *s) { scores16<T, D>(qf, keys, n, s); }
inline void vector_softmax(float *s, int64_t n) { softmax16(s, n); }
template <typename T, int D>
inline void vector_weighted(const float *w, const T *vals, int64_t n, float *out) { weighted16<T, D>(w, vals, n, out); }
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 path, the AVX-512 one's shape at 8 lanes: each query head's scores for 8 keys at a time (8 dot
// products summed across their lanes at once), then its output from the probabilities in registers.

using mstar::load8;

// lanes [0, count) of 8 set
inline __m256i first8(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// r[j] = sum of a[j]'s 8 lanes, for 8 vectors
inline __m256 sum8(const __m256 *a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

template <typename T, int D>
void scores8(const float *qf, const T *keys, int64_t n, float *s) {
    constexpr int C = D / 8;
    __m256 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(qf + 8 * c);
    for (int64_t l0 = 0; l0 < n; l0 += 8) {
        const int64_t m = n - l0 < 8 ? n - l0 : 8;
        __m256 a[8];
        for (int j = 0; j < 8; ++j) {
            a[j] = _mm256_setzero_ps();
            if (j < m)
                for (int c = 0; c < C; ++c) a[j] = _mm256_fmadd_ps(qv[c], load8(keys + (l0 + j) * D + 8 * c), a[j]);
        }
        _mm256_maskstore_ps(s + l0, first8(m), sum8(a));
    }
}

template <typename T, int D>
void weighted8(const float *w, const T *vals, int64_t n, float *out) {
    constexpr int C = D / 8;
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t l = 0; l < n; ++l) {
        const __m256 wl = _mm256_set1_ps(w[l]);
        for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(wl, load8(vals + l * D + 8 * c), acc[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

inline float reduce8(__m256 v, bool take_max) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    float r = lanes[0];
    for (int i = 1; i < 8; ++i) r = take_max ? (lanes[i] > r ? lanes[i] : r) : r + lanes[i];
    return r;
}

// softmax of s[0..n) in place, 8 lanes at a time
inline void softmax8(float *s, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t l = 0; l < n; l += 8) {
        const __m256i m = first8(n - l);
        top = _mm256_max_ps(top, _mm256_blendv_ps(top, _mm256_maskload_ps(s + l, m), _mm256_castsi256_ps(m)));
    }
    const __m256 peak = _mm256_set1_ps(reduce8(top, true));
    __m256 total = _mm256_setzero_ps();
    for (int64_t l = 0; l < n; l += 8) {
        const __m256i m = first8(n - l);
        const __m256 e = _mm256_and_ps(mstar::exp8(_mm256_sub_ps(_mm256_maskload_ps(s + l, m), peak)), _mm256_castsi256_ps(m));
        total = _mm256_add_ps(total, e);
        _mm256_maskstore_ps(s + l, m, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / reduce8(total, false));
    for (int64_t l = 0; l < n; l += 8) {
        const __m256i m = first8(n - l);
        _mm256_maskstore_ps(s + l, m, _mm256_mul_ps(_mm256_maskload_ps(s + l, m), inv));
    }
}

template <typename T, int D>
inline void vector_scores(const float *qf, const T *keys, int64_t n, float *s) { scores8<T, D>(qf, keys, n, s); }
inline void vector_softmax(float *s, int64_t n) { softmax8(s, n); }
template <typename T, int D>
inline void vector_weighted(const float *w, const T *vals, int64_t n, float *out) { weighted8<T, D>(w, vals, n, out); }
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The whole attention of one task through the vector kernels; false: not for this head dim.
template <typename T>
bool attend_vector(int64_t d, int64_t group, const float (*qf)[MAX_DIM], const T *keys, const T *vals, int64_t n,
                   float *scores, float (*acc)[MAX_DIM]) {
    switch (d) {
#define MSTAR_DIM(D)                                                  \
    case D:                                                           \
        for (int64_t g = 0; g < group; ++g) {                         \
            vector_scores<T, D>(qf[g], keys, n, scores);              \
            vector_softmax(scores, n);                                \
            vector_weighted<T, D>(scores, vals, n, acc[g]);           \
        }                                                             \
        return true;
        MSTAR_DIM(64)
        MSTAR_DIM(128)
        MSTAR_DIM(256)
#undef MSTAR_DIM
        default:
            return false;
    }
}
#else
template <typename T>
bool attend_vector(int64_t, int64_t, const float (*)[MAX_DIM], const T *, const T *, int64_t, float *, float (*)[MAX_DIM]) {
    return false;
}
#endif

// The same in portable loops (any head dim, any x86 or other CPU), the group's query heads together.
template <typename T>
void attend_portable(int64_t d, int64_t group, const float (*qf)[MAX_DIM], const T *keys, const T *vals, int64_t n,
                     float *scores, float (*acc)[MAX_DIM]) {
    for (int64_t l = 0; l < n; ++l) {
        const T *key = keys + l * d;
        for (int64_t g = 0; g < group; ++g) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t e = 0; e < d; ++e) dot += qf[g][e] * widen(key[e]);
            scores[g * n + l] = dot;
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * n, top = s[0], total = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t l = 1; l < n; ++l) top = s[l] > top ? s[l] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t l = 0; l < n; ++l) {
            s[l] = mstar::exp_approx(s[l] - top);
            total += s[l];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t l = 0; l < n; ++l) s[l] *= inv;
        for (int64_t e = 0; e < d; ++e) acc[g][e] = 0.0f;
    }
    for (int64_t l = 0; l < n; ++l) {
        const T *val = vals + l * d;
        for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * n + l];
#pragma omp simd
            for (int64_t e = 0; e < d; ++e) acc[g][e] += w * widen(val[e]);
        }
    }
}

// Sequence i's new key and value for KV head h, into its lane (and the pool): before any query head reads them.
template <typename T>
void store_new(const LanePlan &p, int64_t i, int64_t h, const T *k_new, const T *v_new, T *k_lanes, T *v_lanes,
               T *k_pool, T *v_pool) {
    const int64_t d = p.head_dim, row = p.rows[i];
    T *keys = k_lanes + p.lanes[i] * p.lane_stride + h * p.head_stride;
    T *vals = v_lanes + p.lanes[i] * p.lane_stride + h * p.head_stride;
    const T *key = k_new + row * p.k_row + h * p.k_head, *val = v_new + row * p.v_row + h * p.v_head;
    std::memcpy(keys + p.write_pos[i] * d, key, d * sizeof(T));
    std::memcpy(vals + p.write_pos[i] * d, val, d * sizeof(T));
    if (k_pool != nullptr) {  // (values have the keys' pool strides: two views of one pool)
        const int64_t at = p.slots[row] * p.pool_slot + h * p.pool_head;
        std::memcpy(k_pool + at, key, d * sizeof(T));
        std::memcpy(v_pool + at, val, d * sizeof(T));
    }
}

// Sequence i's query heads [g0, g0 + heads) of KV head h's group over its lane: each query head's scores, softmax
// and weighted sum are its own, so a task of one query head computes the bits a task of the group does.
template <typename T>
void attend_one(const LanePlan &p, int64_t i, int64_t h, int64_t g0, int64_t heads, const T *q, const T *k_lanes,
                const T *v_lanes, T *out, float *scores) {
    const int64_t d = p.head_dim, group = p.q_heads / p.kv_heads, n = p.bound[i], row = p.rows[i];
    const T *keys = k_lanes + p.lanes[i] * p.lane_stride + h * p.head_stride;
    const T *vals = v_lanes + p.lanes[i] * p.lane_stride + h * p.head_stride;
    const int64_t first = h * group + g0;  // the task's first query head
    if (n <= 0) {  // (a row always sees its own new key; nothing to attend to gives zeros, never garbage)
        for (int64_t g = 0; g < heads; ++g)
            for (int64_t e = 0; e < d; ++e) narrow(0.0f, out + row * p.out_row + (first + g) * p.out_head + e);
        return;
    }
    float qf[MAX_GROUP][MAX_DIM];
    for (int64_t g = 0; g < heads; ++g) {
        const T *src = q + row * p.q_row + (first + g) * p.q_head;
        for (int64_t e = 0; e < d; ++e) qf[g][e] = widen(src[e]) * p.scale;
    }
    float acc[MAX_GROUP][MAX_DIM];
    if (!attend_vector<T>(d, heads, qf, keys, vals, n, scores, acc))
        attend_portable<T>(d, heads, qf, keys, vals, n, scores, acc);
    for (int64_t g = 0; g < heads; ++g) {
        T *dst = out + row * p.out_row + (first + g) * p.out_head;
        for (int64_t e = 0; e < d; ++e) narrow(acc[g][e], dst + e);
    }
}

template <typename T>
int attend(const LanePlan *plan, const void *q, const void *k_new, const void *v_new, void *k_lanes, void *v_lanes,
           void *k_pool, void *v_pool, void *out) {
    const LanePlan &p = *plan;
    if (p.q_heads % p.kv_heads || p.q_heads / p.kv_heads > MAX_GROUP || p.head_dim > MAX_DIM) return 1;
    int64_t longest = 1;
    for (int64_t i = 0; i < p.count; ++i) longest = p.bound[i] > longest ? p.bound[i] : longest;
    const int64_t group = p.q_heads / p.kv_heads;
    // A task is a sequence's KV head group, or a single query head where the groups are fewer than a few per thread
    // (one decoding row: SmolLM2's 3 groups on 2 threads leave one idle a third of the call; 9 heads split 5 / 4)
    const int64_t split = p.count * p.kv_heads < 4 * p.threads ? group : 1, heads = group / split;
    const int64_t tasks = p.count * p.kv_heads * split;
    // one scores buffer per thread, [group, longest]
    float *scores = static_cast<float *>(std::malloc(sizeof(float) * p.threads * group * longest));
    if (scores == nullptr) return 2;
    if (k_new != nullptr)  // (the new keys first: every query head of the group reads them)
        for (int64_t t = 0; t < p.count * p.kv_heads; ++t)
            store_new<T>(p, t / p.kv_heads, t % p.kv_heads, static_cast<const T *>(k_new), static_cast<const T *>(v_new),
                         static_cast<T *>(k_lanes), static_cast<T *>(v_lanes), static_cast<T *>(k_pool),
                         static_cast<T *>(v_pool));
#pragma omp parallel for num_threads(p.threads) schedule(dynamic)  // (a held-up thread holds up no one)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t pair = t / split;
        attend_one<T>(p, pair / p.kv_heads, pair % p.kv_heads, t % split * heads, heads, static_cast<const T *>(q),
                      static_cast<const T *>(k_lanes), static_cast<const T *>(v_lanes), static_cast<T *>(out),
                      scores + omp_get_thread_num() * group * longest);
    }
    std::free(scores);
    return 0;
}

}  // namespace

extern "C" {

// k_pool / v_pool: a layer's paged pool to store the new keys and values in too, or null
int mstar_lane_attend_f32(const LanePlan *plan, const void *q, const void *k_new, const void *v_new, void *k_lanes,
                          void *v_lanes, void *k_pool, void *v_pool, void *out) {
    return attend<float>(plan, q, k_new, v_new, k_lanes, v_lanes, k_pool, v_pool, out);
}

int mstar_lane_attend_bf16(const LanePlan *plan, const void *q, const void *k_new, const void *v_new, void *k_lanes,
                           void *v_lanes, void *k_pool, void *v_pool, void *out) {
    return attend<bf16>(plan, q, k_new, v_new, k_lanes, v_lanes, k_pool, v_pool, out);
}

}  // extern "C"
