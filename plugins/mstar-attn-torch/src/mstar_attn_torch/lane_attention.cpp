// Decode attention over decode lanes, in chunks of keys with a partial softmax each: built by lane_kernel.py.
//
// A decode step's attention on a CPU is memory-bound: every key and value of every decoding sequence
// is read once per layer. As torch ops (two batched matmuls, a scale, a mask, a softmax) a bf16 lane
// must be widened to fp32 first and the scores make several passes; here each key and value is read
// once in its own dtype, accumulates in fp32, and serves every query head that shares its KV head
// (grouped-query attention). A sequence's keys split into chunks (a function of their count: the
// bits never depend on the batch or the threads), each chunk's softmax kept unnormalized with its top
// score and sum, merged once per KV head: a lone decoding row's few KV heads are spread over the
// threads by chunk, each thread reading its share of the keys once (flash-decoding), while a batch's
// task is a whole KV head. Each task also appends the step's new key and value to the lane, and,
// given the paged pool, stores them in their pool slots, so a layer's whole decode attention is one
// call, with no allocation (per-thread scratch kept between calls).
//
// No torch headers: the library is plain C ABI, compiled once per machine in about a second, and
// called through ctypes with raw pointers. OpenMP resolves to the runtime torch already loaded.

#include <cstdint>
#include <cstdlib>
#include <cmath>
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
    int64_t span;              // keys a task reads; 0: the kernel's choice, by each sequence's key count (span_for)
    void *side;                // a linear kernel's mstar::SideFetch to name the next layer's lanes in, or null
    const char *lanes_end;     // the end of the lane store (every layer's): the last layer has no next one
};

}  // extern "C"

namespace {

using mstar::narrow;
using mstar::widen;

constexpr int64_t MAX_GROUP = 16;  // query heads per KV head
constexpr int64_t MAX_DIM = 256;


#if defined(__AVX512F__)
// The AVX-512 path for head dims that are a multiple of 16: each query head's scores for 16 keys at a
// time (16 dot products summed across their lanes at once, no per-key horizontal sum), then the
// group's outputs from the probabilities, several query heads at once with the accumulators in registers.

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
    int64_t l0 = 0;
    for (; l0 + 16 <= n; l0 += 16) {  // whole blocks: no test per key, so the 16 sums stay in registers
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
            for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv[c], load16(keys + (l0 + j) * D + 16 * c), a[j]);
        _mm512_storeu_ps(s + l0, sum16(a));
    }
    for (; l0 < n; l0 += 16) {
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

// weighted16 for G query heads at once (their weights w + g * w_stride): each value vector is loaded once and
// serves all G (a KV group's heads read their values once, not G times), with G * D / 16 accumulators in registers.
// Each head's sums are in weighted16's order: the same bits.
template <int D, int G>
void weighted16_heads(const float *w, int64_t w_stride, const float *vals, int64_t n, float (*out)[MAX_DIM]) {
    constexpr int C = D / 16;
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; ++l) {
        __m512 wl[G];
        for (int g = 0; g < G; ++g) wl[g] = _mm512_set1_ps(w[g * w_stride + l]);
        for (int c = 0; c < C; ++c) {
            const __m512 v = _mm512_loadu_ps(vals + l * D + 16 * c);
            for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(wl[g], v, acc[g][c]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g] + 16 * c, acc[g][c]);
}

// bf16 values, the even/odd halves of each 32 (weighted32's order, for G heads at once)
template <int D, int G>
void weighted16_heads(const float *w, int64_t w_stride, const bf16 *vals, int64_t n, float (*out)[MAX_DIM]) {
    constexpr int C = D / 32;
    __m512 acc_e[G][C], acc_o[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc_e[g][c] = _mm512_setzero_ps(), acc_o[g][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; ++l) {
        __m512 wl[G];
        for (int g = 0; g < G; ++g) wl[g] = _mm512_set1_ps(w[g * w_stride + l]);
        for (int c = 0; c < C; ++c) {
            __m512 even, odd;
            load32(vals + l * D + 32 * c, even, odd);
            for (int g = 0; g < G; ++g) {
                acc_e[g][c] = _mm512_fmadd_ps(wl[g], even, acc_e[g][c]);
                acc_o[g][c] = _mm512_fmadd_ps(wl[g], odd, acc_o[g][c]);
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        alignas(64) float split[2][C][16];
        for (int c = 0; c < C; ++c) _mm512_store_ps(split[0][c], acc_e[g][c]), _mm512_store_ps(split[1][c], acc_o[g][c]);
        for (int c = 0; c < C; ++c)
            for (int i = 0; i < 16; ++i) out[g][32 * c + 2 * i] = split[0][c][i], out[g][32 * c + 2 * i + 1] = split[1][c][i];
    }
}

// query heads weighted16_heads takes at once at head dim D (its accumulators and broadcasts in 32 registers)
constexpr int heads_at_once(int d) { return d <= 64 ? 4 : d <= 128 ? 3 : 1; }


template <int D>
void scores32(const float *qf, const bf16 *keys, int64_t n, float *s) {
    constexpr int C = D / 32;
    alignas(64) float split[2][C][16];
    for (int c = 0; c < C; ++c)
        for (int i = 0; i < 16; ++i) split[0][c][i] = qf[32 * c + 2 * i], split[1][c][i] = qf[32 * c + 2 * i + 1];
    __m512 qe[C], qo[C];
    for (int c = 0; c < C; ++c) qe[c] = _mm512_load_ps(split[0][c]), qo[c] = _mm512_load_ps(split[1][c]);
    int64_t l0 = 0;
    for (; l0 + 16 <= n; l0 += 16) {  // whole blocks: no test per key, so the 16 sums stay in registers
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
            for (int j = 0; j < 16; ++j) {
                __m512 even, odd;
                load32(keys + (l0 + j) * D + 32 * c, even, odd);
                a[j] = _mm512_fmadd_ps(qo[c], odd, _mm512_fmadd_ps(qe[c], even, a[j]));
            }
        _mm512_storeu_ps(s + l0, sum16(a));
    }
    for (; l0 < n; l0 += 16) {
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


// s[0..n) -> e^(s - top) in place, top their maximum, total the sum of the exponentials (a chunk's part of a
// softmax: normalized once the chunks are merged), vectorized (the same reduction and polynomial as the portable loop)
inline void exps16(float *s, int64_t n, float &top, float &total) {
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l < 16 ? static_cast<__mmask16>((1u << (n - l)) - 1u) : static_cast<__mmask16>(0xFFFF);
        peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(peak, m, s + l));
    }
    top = _mm512_reduce_max_ps(peak);
    const __m512 shift = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l < 16 ? static_cast<__mmask16>((1u << (n - l)) - 1u) : static_cast<__mmask16>(0xFFFF);
        const __m512 e = _mm512_maskz_mov_ps(m, mstar::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), shift)));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(s + l, m, e);
    }
    total = _mm512_reduce_add_ps(sum);
}

// this build's vector kernels, by one name (the dispatch below is written once for both paths)
template <typename T, int D>
inline void vector_scores(const float *qf, const T *keys, int64_t n, float *s) { scores16<T, D>(qf, keys, n, s); }
inline void vector_exps(float *s, int64_t n, float &top, float &total) { exps16(s, n, top, total); }
// the group's G query heads' weighted sums (head g's weights at w + g * w_stride), as many heads at once as fit
template <typename T, int D>
inline void vector_weighted(const float *w, int64_t w_stride, const T *vals, int64_t n, int64_t group, float (*out)[MAX_DIM]) {
    constexpr int most = heads_at_once(D);
    for (int64_t g = 0; g < group;) {
        const int64_t take = group - g < most ? group - g : most;
        const float *wg = w + g * w_stride;
        if constexpr (most >= 4)
            if (take == 4) weighted16_heads<D, 4>(wg, w_stride, vals, n, out + g);
        if constexpr (most >= 3)
            if (take == 3) weighted16_heads<D, 3>(wg, w_stride, vals, n, out + g);
        if constexpr (most >= 2)
            if (take == 2) weighted16_heads<D, 2>(wg, w_stride, vals, n, out + g);
        if (take == 1) weighted16<T, D>(wg, vals, n, out[g]);
        g += take;
    }
}
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

// exps16's work, 8 lanes at a time
inline void exps8(float *s, int64_t n, float &top, float &total) {
    __m256 peak = _mm256_set1_ps(-INFINITY);
    for (int64_t l = 0; l < n; l += 8) {
        const __m256i m = first8(n - l);
        peak = _mm256_max_ps(peak, _mm256_blendv_ps(peak, _mm256_maskload_ps(s + l, m), _mm256_castsi256_ps(m)));
    }
    top = reduce8(peak, true);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t l = 0; l < n; l += 8) {
        const __m256i m = first8(n - l);
        const __m256 e = _mm256_and_ps(mstar::exp8(_mm256_sub_ps(_mm256_maskload_ps(s + l, m), shift)), _mm256_castsi256_ps(m));
        sum = _mm256_add_ps(sum, e);
        _mm256_maskstore_ps(s + l, m, e);
    }
    total = reduce8(sum, false);
}

template <typename T, int D>
inline void vector_scores(const float *qf, const T *keys, int64_t n, float *s) { scores8<T, D>(qf, keys, n, s); }
inline void vector_exps(float *s, int64_t n, float &top, float &total) { exps8(s, n, top, total); }
template <typename T, int D>
inline void vector_weighted(const float *w, int64_t w_stride, const T *vals, int64_t n, int64_t group, float (*out)[MAX_DIM]) {
    for (int64_t g = 0; g < group; ++g) weighted8<T, D>(w + g * w_stride, vals, n, out[g]);
}
#endif

// Bytes of keys (and of values) asked for from memory ahead of the block being scored, one block's worth at a time
// (a whole chunk asked for at once stalls the core on its lines, then computes from L2). Measured at a c=32 step's
// shapes on one Zen 4 thread (benchmarks/lane_attention.py): 4 KB 15.0-15.2 GB/s; 2, 3, 6 and 8 KB 13.6-14.3; the
// next chunk asked for at once (before) 13.8-14.0. Values are asked for with the keys, while the scores are computed
// (asking for them while they are weighted, or keys and values in one pass with an online softmax, did worse:
// 10-11.5 GB/s).
constexpr int64_t AHEAD_BYTES = 4096;

// Keys and values [0, count) elements from `keys` and `vals` asked for from memory (the keys nearer: read first).
template <typename T>
inline void prefetch_keys(const T *keys, const T *vals, int64_t count) {
    for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char *>(keys) + b, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char *>(vals) + b, 0, 2);
    }
}

// prefetch_keys for a whole block of 16 keys of head dim D (a count known here: the loop unrolls)
template <typename T, int D>
inline void prefetch_block(const T *keys, const T *vals) {
    constexpr int64_t bytes = 16 * D * static_cast<int64_t>(sizeof(T));
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char *>(keys) + b, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char *>(vals) + b, 0, 2);
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The group's query heads as a chunk's score kernel takes them (fp32, the softmax scale applied).
template <typename T, int D>
struct Queries {
    const float (*qf)[MAX_DIM];
    Queries(const float (*q)[MAX_DIM], int64_t, float) : qf(q) {}
    void scores(int64_t g, const T *keys, int64_t m, float *s) const { vector_scores<T, D>(qf[g], keys, m, s); }
};

#if defined(__AVX512BF16__)
// bf16 keys on a CPU with AVX512-BF16: each key's products with the query head in bf16 pairs by vdpbf16ps (each
// product exact in fp32 and added as an FMA adds it, two per 32-bit lane), half the instructions of widening the keys
// to fp32 first. The head is the query row itself (fp32 / scale gives its bf16 back exactly: the scaled fp32 is
// within an fp32 rounding of it), and the scale multiplies each score instead.
template <int D>
struct Queries<bf16, D> {
    static constexpr int C = D / 32;
    __m512bh q[MAX_GROUP][C];
    float scale;
    Queries(const float (*qf)[MAX_DIM], int64_t group, float scale_) : scale(scale_) {
        const __m512 by = _mm512_set1_ps(scale);
        for (int64_t g = 0; g < group; ++g)
            for (int c = 0; c < C; ++c)
                q[g][c] = _mm512_cvtne2ps_pbh(_mm512_div_ps(_mm512_loadu_ps(qf[g] + 32 * c + 16), by),
                                              _mm512_div_ps(_mm512_loadu_ps(qf[g] + 32 * c), by));
    }
    void scores(int64_t g, const bf16 *keys, int64_t n, float *s) const {
        for (int64_t l0 = 0; l0 < n; l0 += 16) {
            const int64_t m = n - l0 < 16 ? n - l0 : 16;
            __m512 a[16];
            for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
            if (m == 16) {
                for (int c = 0; c < C; ++c)
                    for (int j = 0; j < 16; ++j)
                        a[j] = _mm512_dpbf16_ps(a[j], q[g][c], (__m512bh)_mm512_loadu_si512(keys + (l0 + j) * D + 32 * c));
            } else {
                for (int j = 0; j < m; ++j)
                    for (int c = 0; c < C; ++c)
                        a[j] = _mm512_dpbf16_ps(a[j], q[g][c], (__m512bh)_mm512_loadu_si512(keys + (l0 + j) * D + 32 * c));
            }
            _mm512_mask_storeu_ps(s + l0, static_cast<__mmask16>((1u << m) - 1u), _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
        }
    }
};
#endif

// One task's chunk of keys through the vector kernels; false: not for this head dim. Scores 16 keys at a time for
// every query head of the group (the 16 keys stay in L1 between heads), asking for the keys and values AHEAD_BYTES on
// (no further than `readable` keys from the chunk's first: the task's), then each head's exponentials, then the
// heads' weighted sums together (each value read once for all of them).
template <typename T>
bool chunk_vector(int64_t d, int64_t group, const float (*qf)[MAX_DIM], float scale, const T *keys, const T *vals,
                  int64_t n, int64_t readable, float *scores, float (*acc)[MAX_DIM], float *top, float *total) {
    switch (d) {
#define MSTAR_DIM(D)                                                                                     \
    case D: {                                                                                            \
        const int64_t stride = (n + 15) / 16 * 16, ahead = AHEAD_BYTES / (D * sizeof(T));                \
        const Queries<T, D> queries(qf, group, scale);                                                   \
        for (int64_t l0 = 0; l0 < n; l0 += 16) {                                                         \
            const int64_t m = n - l0 < 16 ? n - l0 : 16, next = l0 + ahead;                              \
            if (next + 16 <= readable)                                                                   \
                prefetch_block<T, D>(keys + next * D, vals + next * D);                                  \
            else if (next < readable)                                                                    \
                prefetch_keys(keys + next * D, vals + next * D, (readable - next) * D);                  \
            for (int64_t g = 0; g < group; ++g) queries.scores(g, keys + l0 * D, m, scores + g * stride + l0); \
        }                                                                                                \
        for (int64_t g = 0; g < group; ++g) vector_exps(scores + g * stride, n, top[g], total[g]);       \
        vector_weighted<T, D>(scores, stride, vals, n, group, acc);                                      \
        return true;                                                                                     \
    }
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
bool chunk_vector(int64_t, int64_t, const float (*)[MAX_DIM], float, const T *, const T *, int64_t, int64_t, float *,
                  float (*)[MAX_DIM], float *, float *) {
    return false;
}
#endif

// The same in portable loops (any head dim, any x86 or other CPU), the group's query heads together.
template <typename T>
void chunk_portable(int64_t d, int64_t group, const float (*qf)[MAX_DIM], const T *keys, const T *vals, int64_t n,
                    float *scores, float (*acc)[MAX_DIM], float *top, float *total) {
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
        float *s = scores + g * n, peak = s[0], sum = 0.0f;
#pragma omp simd reduction(max : peak)
        for (int64_t l = 1; l < n; ++l) peak = s[l] > peak ? s[l] : peak;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < n; ++l) {
            s[l] = mstar::exp_approx(s[l] - peak);
            sum += s[l];
        }
        top[g] = peak, total[g] = sum;
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

// Sequence i's new key and value for KV head h, into its lane (and the pool).
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

// Keys in a chunk: a function of the sequence's key count alone, so a row's result has the same bits in any batch
// and on any number of threads (a row alone or beside others; the tests compare them): each chunk's part of the
// softmax is computed alike and folds in in chunk order, whichever thread ran it. An even number of chunks of about
// 256 keys or fewer, a multiple of 16 keys each (whole vector blocks), at most MAX_CHUNKS until MAX_SPAN: one
// decoding row's 3 KV groups at 200 keys are 6 tasks of 112 or 88 keys, which 2 threads share evenly, each reading
// its keys once. (Chunks of at most 128 keys cost more on one thread at 300 keys, alone and at c=32, for no better
// balance on two: each chunk has its reductions, its part and its fold.)
constexpr int64_t MAX_CHUNKS = 16, MAX_SPAN = 512;

inline int64_t span_for(int64_t n, int64_t asked) {
    if (asked > 0) return asked < MAX_SPAN ? asked : MAX_SPAN;
    const int64_t pairs = (n + 511) / 512, chunks = 2 * pairs < MAX_CHUNKS ? 2 * pairs : MAX_CHUNKS;
    const int64_t even = ((n + chunks - 1) / chunks + 15) / 16 * 16;
    return even > MAX_SPAN ? MAX_SPAN : even;
}

inline int64_t chunks_for(int64_t bound, int64_t asked) {
    const int64_t n = bound > 1 ? bound : 1, span = span_for(n, asked);
    return (n + span - 1) / span;
}

// A chunk's part of one KV group's attention, kept until its group's chunks merge: each query head's weighted sum
// of values by e^(score - top) [group][d], then its top score [group], then the sum of its exponentials [group].
inline int64_t part_floats(int64_t group, int64_t d) { return group * (d + 2); }
inline int64_t top_at(int64_t group, int64_t d, int64_t g) { return group * d + g; }
inline int64_t total_at(int64_t group, int64_t d, int64_t g) { return group * (d + 1) + g; }

// A query head's softmax over the chunks seen so far: the top score, the sum of e^(score - top), and the values
// weighted by them. Chunks fold in in chunk order, whichever thread computed them and whether or not their parts
// went through memory, with the same arithmetic: the same bits either way.
struct Running {
    float top, total;
    float acc[MAX_DIM];

    void start(float chunk_top, float chunk_total, const float *chunk_acc, int64_t d) {
        top = chunk_top, total = chunk_total;
        std::memcpy(acc, chunk_acc, d * sizeof(float));
    }

    void fold(float chunk_top, float chunk_total, const float *chunk_acc, int64_t d) {
        const float peak = chunk_top > top ? chunk_top : top;
        const float mine = mstar::exp_approx(top - peak), theirs = mstar::exp_approx(chunk_top - peak);
        top = peak, total = mine * total + theirs * chunk_total;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) acc[e] = mine * acc[e] + theirs * chunk_acc[e];
    }

    template <typename T>
    void write(T *dst, int64_t d) const {
        const float inv = 1.0f / total;
        for (int64_t e = 0; e < d; ++e) narrow(acc[e] * inv, dst + e);
    }
};

// Sequence i's KV head h from its chunks' parts (written by other tasks), folded in chunk order.
template <typename T>
void merge_chunks(const LanePlan &p, int64_t i, int64_t h, int64_t chunks, const float *parts, T *out) {
    const int64_t d = p.head_dim, group = p.q_heads / p.kv_heads, stride = part_floats(group, d);
    for (int64_t g = 0; g < group; ++g) {
        Running run;
        for (int64_t c = 0; c < chunks; ++c) {
            const float *part = parts + c * stride;
            if (c == 0)
                run.start(part[top_at(group, d, g)], part[total_at(group, d, g)], part + g * d, d);
            else
                run.fold(part[top_at(group, d, g)], part[total_at(group, d, g)], part + g * d, d);
        }
        run.write(out + p.rows[i] * p.out_row + (h * group + g) * p.out_head, d);
    }
}

// The pointers of one call, typed.
template <typename T>
struct Tensors {
    const T *q, *k_new, *v_new;
    T *k_lanes, *v_lanes, *k_pool, *v_pool, *out;
};

// One task: chunks [from, to) of the `chunks` of sequence i's KV head h. It stores the new key and value first when
// they fall in its chunks (the chunk holding the write position, or the last one: no other task reads them), then
// attends the group's query heads over each chunk's keys. A task of all the chunks folds them as it goes and
// writes the output; a task of some writes each chunk's part (`parts`: the group's, chunk 0 first), and whichever
// task completes the group (`done` counts its chunks finished) merges them.
template <typename T>
void attend_chunks(const LanePlan &p, const Tensors<T> &x, int64_t i, int64_t h, int64_t from, int64_t to, int64_t chunks,
                   float *parts, int32_t *done) {
    const int64_t d = p.head_dim, group = p.q_heads / p.kv_heads, n = p.bound[i], row = p.rows[i];
    const int64_t span = span_for(n > 1 ? n : 1, p.span);
    if (x.k_new != nullptr) {
        const int64_t holds = p.write_pos[i] / span, at = holds < chunks - 1 ? holds : chunks - 1;
        if (from <= at && at < to) store_new<T>(p, i, h, x.k_new, x.v_new, x.k_lanes, x.v_lanes, x.k_pool, x.v_pool);
    }
    const int64_t first = h * group;  // the group's first query head
    if (n <= 0) {  // (a row always sees its own new key; nothing to attend to gives zeros, never garbage)
        for (int64_t g = 0; g < group; ++g)
            for (int64_t e = 0; e < d; ++e) narrow(0.0f, x.out + row * p.out_row + (first + g) * p.out_head + e);
        return;
    }
    float qf[MAX_GROUP][MAX_DIM];
    for (int64_t g = 0; g < group; ++g) {
        const T *src = x.q + row * p.q_row + (first + g) * p.q_head;
        for (int64_t e = 0; e < d; ++e) qf[g][e] = widen(src[e]) * p.scale;
    }
    const int64_t stride = part_floats(group, d);
    const T *lane_keys = x.k_lanes + p.lanes[i] * p.lane_stride + h * p.head_stride;
    const T *lane_vals = x.v_lanes + p.lanes[i] * p.lane_stride + h * p.head_stride;
    // the task's first keys and values asked for before it starts (the vector kernels ask for the rest as they go)
    const int64_t end = to * span < n ? to * span : n, head = AHEAD_BYTES / (d * static_cast<int64_t>(sizeof(T)));
    prefetch_keys(lane_keys + from * span * d, lane_vals + from * span * d, (end - from * span < head ? end - from * span : head) * d);
    const bool whole = to - from == chunks;
    Running runs[MAX_GROUP];
    for (int64_t c = from; c < to; ++c) {
        const int64_t l0 = c * span, m = n - l0 < span ? n - l0 : span;
        const T *keys = lane_keys + l0 * d, *vals = lane_vals + l0 * d;
        float scores[MAX_GROUP * MAX_SPAN], acc[MAX_GROUP][MAX_DIM], top[MAX_GROUP], total[MAX_GROUP];
        if (!chunk_vector<T>(d, group, qf, p.scale, keys, vals, m, end - l0, scores, acc, top, total)) {
            if (c + 1 < to) prefetch_keys(keys + m * d, vals + m * d, (end - l0 - m < span ? end - l0 - m : span) * d);
            chunk_portable<T>(d, group, qf, keys, vals, m, scores, acc, top, total);
        }
        for (int64_t g = 0; g < group; ++g) {
            if (!whole) {
                float *part = parts + c * stride;
                std::memcpy(part + g * d, acc[g], d * sizeof(float));
                part[top_at(group, d, g)] = top[g], part[total_at(group, d, g)] = total[g];
            } else if (c == 0) {
                runs[g].start(top[g], total[g], acc[g], d);
            } else {
                runs[g].fold(top[g], total[g], acc[g], d);
            }
        }
    }
    if (whole) {
        for (int64_t g = 0; g < group; ++g) runs[g].write(x.out + row * p.out_row + (first + g) * p.out_head, d);
        return;
    }
    // acquire-release: the task that completes the group sees the parts the others wrote before they counted them
    if (__atomic_add_fetch(done, static_cast<int32_t>(to - from), __ATOMIC_ACQ_REL) == chunks)
        merge_chunks<T>(p, i, h, chunks, parts, x.out);
}

// Per-thread scratch of the calling thread, kept between calls (a decode step calls once per layer: no allocation
// per call): each sequence's first chunk, each KV group's count of chunks done, then the chunks' parts.
struct Scratch {
    void *data = nullptr;
    size_t bytes = 0;
    ~Scratch() { std::free(data); }
    void *at_least(size_t want) {
        if (want > bytes) {
            std::free(data);
            bytes = want + want / 2;
            data = std::malloc(bytes);
            if (data == nullptr) bytes = 0;
        }
        return data;
    }
};
thread_local Scratch scratch;

// The next layer's keys and values of every row (a layer's lane store is its keys' then its values' [lanes, kv heads,
// capacity, head dim], so the next layer's keys begin twice the keys-to-values distance on), as spans for the linears
// between this call and the next to fetch while they compute (mstar::SideFetch): the next call reads them from cache
// instead of at the memory's speed. The rows attend over the same keys there (one step). None past the store's end.
template <typename T>
void name_next_layer(const LanePlan &p, const T *k_lanes, const T *v_lanes) {
    auto &side = *static_cast<mstar::SideFetch *>(p.side);
    const int64_t layer = 2 * (v_lanes - k_lanes), d = p.head_dim;
    const T *k_next = k_lanes + layer, *v_next = v_lanes + layer;
    int64_t count = 0;
    for (int64_t i = 0; i < p.count && count + 2 <= mstar::SideFetch::MAX_SPANS; ++i) {
        const int64_t bytes = p.bound[i] * d * static_cast<int64_t>(sizeof(T));
        for (int64_t h = 0; h < p.kv_heads && count + 2 <= mstar::SideFetch::MAX_SPANS; ++h) {
            const int64_t at = p.lanes[i] * p.lane_stride + h * p.head_stride;
            const char *keys = reinterpret_cast<const char *>(k_next + at), *vals = reinterpret_cast<const char *>(v_next + at);
            if (vals + bytes > p.lanes_end || bytes <= 0) continue;
            // (a span from its first byte's line: one line more where it does not start on one)
            const int64_t lines = (bytes + (reinterpret_cast<uintptr_t>(keys) & 63) + 63) / 64;
            side.start[count] = keys, side.lines[count++] = lines;
            side.start[count] = vals, side.lines[count++] = lines;
        }
    }
    side.reset(count, p.threads);
}

template <typename T>
int attend(const LanePlan *plan, const void *q, const void *k_new, const void *v_new, void *k_lanes, void *v_lanes,
           void *k_pool, void *v_pool, void *out) {
    const LanePlan &p = *plan;
    if (p.q_heads % p.kv_heads || p.q_heads / p.kv_heads > MAX_GROUP || p.head_dim > MAX_DIM) return 1;
    const Tensors<T> x{static_cast<const T *>(q), static_cast<const T *>(k_new), static_cast<const T *>(v_new),
                       static_cast<T *>(k_lanes), static_cast<T *>(v_lanes), static_cast<T *>(k_pool),
                       static_cast<T *>(v_pool), static_cast<T *>(out)};
    const int64_t count = p.count, heads = p.kv_heads, pairs = count * heads;
    const int64_t stride = part_floats(p.q_heads / heads, p.head_dim);
    if (p.side != nullptr) name_next_layer<T>(p, x.k_lanes, x.v_lanes);
    int64_t chunks_total = 0;
    for (int64_t i = 0; i < count; ++i) chunks_total += heads * chunks_for(p.bound[i], p.span);
    int64_t *first = static_cast<int64_t *>(scratch.at_least(
        sizeof(int64_t) * (count + 1) + sizeof(int32_t) * (pairs + 1) + sizeof(float) * chunks_total * stride));
    if (first == nullptr) return 2;
    int32_t *done = reinterpret_cast<int32_t *>(first + count + 1);
    float *parts = reinterpret_cast<float *>(done + pairs + 1);
    first[0] = 0;  // sequence i's chunks are [first[i], first[i + 1]), KV head major
    for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + heads * chunks_for(p.bound[i], p.span);
    // A task is a sequence's whole KV group where there are a few groups per thread; else a single chunk of one, so
    // that a lone decoding row's keys are split between the threads (SmolLM2's 3 groups on 2 threads: one thread
    // idle a third of the call). Either way the same chunks compute the same bits.
    if (pairs >= 4 * p.threads) {
#pragma omp parallel for num_threads(p.threads) schedule(dynamic)  // (a held-up thread holds up no one)
        for (int64_t u = 0; u < pairs; ++u) {
            const int64_t i = u / heads, h = u % heads, chunks = (first[i + 1] - first[i]) / heads;
            attend_chunks<T>(p, x, i, h, 0, chunks, chunks, parts + (first[i] + h * chunks) * stride, nullptr);
        }
        return 0;
    }
    std::memset(done, 0, sizeof(int32_t) * pairs);
#pragma omp parallel for num_threads(p.threads) schedule(dynamic) if (chunks_total > 1)
    for (int64_t t = 0; t < chunks_total; ++t) {
        int64_t i = 0, hi = count;  // the sequence whose chunks hold t: first[i] <= t < first[i + 1]
        while (hi - i > 1) {
            const int64_t mid = (i + hi) / 2;
            (first[mid] <= t ? i : hi) = mid;
        }
        const int64_t chunks = (first[i + 1] - first[i]) / heads, h = (t - first[i]) / chunks;
        const int64_t c = (t - first[i]) % chunks;
        attend_chunks<T>(p, x, i, h, c, c + 1, chunks, parts + (first[i] + h * chunks) * stride, done + i * heads + h);
    }
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
