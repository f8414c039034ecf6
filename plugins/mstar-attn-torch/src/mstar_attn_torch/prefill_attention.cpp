// Causal attention of one prompt chunk (a prefill) on a CPU: built by prefill_kernel.py.
//
// torch's CPU flash kernel is sized for long sequences: on a 94-token prompt with 9 query heads of 64 (SmolLM2-135M)
// it takes ~0.2-0.45 ms a layer, ~20-50 GFLOP/s, up to a tenth of a short prompt's time to first token. Here a task
// is one KV head's query heads over a block of rows. It transposes the keys its rows see into fp32; its scores are a
// small GEMM against them (each FMA one query element broadcast against 16 keys, the accumulators in registers); the
// softmax is exact over each row's causal keys; the output is a second small GEMM over the values (each FMA one
// probability broadcast against 16 of a value's dimensions). fp32 accumulation; queries, keys, values and the output
// in the chunk's dtype (fp32 or bf16). A bf16 chunk on an AVX512-BF16 build keeps its keys and queries as pairs of bf16
// dimensions and its scores add two exact products an instruction (`vdpbf16ps`): one 94-token prompt's layer 144 ->
// 113 us on one core, as near attention in float64 as the fp32 tiles (tests/engines/test_prefill_kernel.py).
//
// No torch headers: plain C ABI, called through ctypes with raw pointers. Only the AVX-512 build computes; the
// others answer `mstar_prefill_vectorized() == 0` and the caller keeps torch's kernel.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "mstar_native.h"  // (mstar_core/nn: bf16, widen, load16 / round16 / store16, exp16)

using mstar::bf16;

extern "C" {

// One chunk's call (prefill_kernel.py builds it per layer).
struct PrefillPlan {
    int64_t rows;    // query rows of the chunk
    int64_t prefix;  // keys before the chunk's first row: row i attends to keys [0, prefix + i]
    int64_t q_heads, kv_heads, head_dim;
    int64_t q_row, q_head;  // strides (elements) of the queries [rows, q heads, D]
    int64_t k_row, k_head;  // of the keys [prefix + rows, kv heads, D]
    int64_t v_row, v_head;  // of the values
    int64_t out_row, out_head;
    float scale;
    int32_t threads;
    // where not null, the chunk's own keys and values (the last `rows` of k and v) are stored in the pool as well: row
    // i's at slot store_slots[i] of k_store / v_store ([slots, kv heads, D] views with these strides), each task its
    // rows of its KV head (a prompt step's page writes, two single-threaded torch ops a layer before)
    const int64_t *store_slots;
    void *k_store, *v_store;
    int64_t store_row, store_head;
};

}  // extern "C"

#if defined(__AVX512F__)
namespace {

using mstar::exp16;
using mstar::load16;
using mstar::round16;
using mstar::store16;
using mstar::widen;

constexpr int64_t MAX_VECTORS = 24;  // query vectors (rows x the group's heads) a task takes at most
constexpr int64_t SCORE_VECTORS = 8;  // query vectors per score tile (x 32 keys: 16 accumulators)
constexpr int64_t KEYS = 32;         // keys per score tile (16 for the last keys of a group where no more remain)
constexpr int64_t OUT_VECTORS = 4;   // query vectors per output tile (x 64 dimensions: 16 accumulators)
constexpr int64_t DIMS = 64;         // dimensions per output tile

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// scores[v][0, 16 * NK) = sum over d of q[v][d] * keys_t[d][0, 16 * NK), for v < NV (keys_t: [D][ld], transposed keys)
template <int NV, int NK>
void score_tile(const float *q, int64_t d_len, const float *keys_t, int64_t ld, float *scores, int64_t ld_s) {
    __m512 acc[NV][NK];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
        for (int h = 0; h < NK; ++h) acc[v][h] = _mm512_setzero_ps();
    for (int64_t d = 0; d < d_len; ++d) {
        __m512 k[NK];
        for (int h = 0; h < NK; ++h) k[h] = _mm512_loadu_ps(keys_t + d * ld + 16 * h);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            const __m512 x = _mm512_set1_ps(q[v * d_len + d]);
            for (int h = 0; h < NK; ++h) acc[v][h] = _mm512_fmadd_ps(x, k[h], acc[v][h]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
        for (int h = 0; h < NK; ++h) _mm512_storeu_ps(scores + v * ld_s + 16 * h, acc[v][h]);
}

// a tile of 32 keys (`wide`), or of 16: a group's last keys when no more than 16 remain (half the tile's FMAs)
template <int NK>
void scores_over(int64_t nv, const float *q, int64_t d_len, const float *keys_t, int64_t ld, float *scores, int64_t ld_s) {
    switch (nv) {
        case 1: return score_tile<1, NK>(q, d_len, keys_t, ld, scores, ld_s);
        case 2: return score_tile<2, NK>(q, d_len, keys_t, ld, scores, ld_s);
        case 3: return score_tile<3, NK>(q, d_len, keys_t, ld, scores, ld_s);
        case 4: return score_tile<4, NK>(q, d_len, keys_t, ld, scores, ld_s);
        case 5: return score_tile<5, NK>(q, d_len, keys_t, ld, scores, ld_s);
        case 6: return score_tile<6, NK>(q, d_len, keys_t, ld, scores, ld_s);
        case 7: return score_tile<7, NK>(q, d_len, keys_t, ld, scores, ld_s);
        default: return score_tile<8, NK>(q, d_len, keys_t, ld, scores, ld_s);
    }
}

void scores_for(int64_t nv, bool wide, const float *q, int64_t d_len, const float *keys_t, int64_t ld, float *scores,
                int64_t ld_s) {
    if (wide) return scores_over<2>(nv, q, d_len, keys_t, ld, scores, ld_s);
    return scores_over<1>(nv, q, d_len, keys_t, ld, scores, ld_s);
}

#if defined(__AVX512BF16__)
// bf16 chunks on AVX512-BF16: the scores from pairs of dimensions, `vdpbf16ps` adding two products (each exact in fp32)
// into each score a step, twice the dimensions an instruction of the fp32 tile's FMAs, then multiplied by the scale
// (for a power-of-two scale, as head dims of 64 give, the same as scaling the queries first). q [v][pairs] and
// keys_p [pairs][ld] hold a pair of bf16 dimensions in each 32-bit element, as the rows hold them.
template <int NV, int NK>
void pair_score_tile(const uint32_t *q, int64_t pairs, const uint32_t *keys_p, int64_t ld, float scale, float *scores,
                     int64_t ld_s) {
    __m512 acc[NV][NK];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
        for (int h = 0; h < NK; ++h) acc[v][h] = _mm512_setzero_ps();
    for (int64_t e = 0; e < pairs; ++e) {
        __m512bh k[NK];
        for (int h = 0; h < NK; ++h) k[h] = (__m512bh)_mm512_loadu_si512(keys_p + e * ld + 16 * h);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[v * pairs + e]));
            for (int h = 0; h < NK; ++h) acc[v][h] = _mm512_dpbf16_ps(acc[v][h], x, k[h]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
        for (int h = 0; h < NK; ++h) _mm512_storeu_ps(scores + v * ld_s + 16 * h, _mm512_mul_ps(acc[v][h], s));
}

template <int NK>
void pair_scores_over(int64_t nv, const uint32_t *q, int64_t pairs, const uint32_t *keys_p, int64_t ld, float scale,
                      float *scores, int64_t ld_s) {
    switch (nv) {
        case 1: return pair_score_tile<1, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        case 2: return pair_score_tile<2, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        case 3: return pair_score_tile<3, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        case 4: return pair_score_tile<4, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        case 5: return pair_score_tile<5, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        case 6: return pair_score_tile<6, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        case 7: return pair_score_tile<7, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
        default: return pair_score_tile<8, NK>(q, pairs, keys_p, ld, scale, scores, ld_s);
    }
}

void pair_scores_for(int64_t nv, bool wide, const uint32_t *q, int64_t pairs, const uint32_t *keys_p, int64_t ld,
                     float scale, float *scores, int64_t ld_s) {
    if (wide) return pair_scores_over<2>(nv, q, pairs, keys_p, ld, scale, scores, ld_s);
    return pair_scores_over<1>(nv, q, pairs, keys_p, ld, scale, scores, ld_s);
}

constexpr bool PAIR_SCORES = true;
#else
constexpr bool PAIR_SCORES = false;
// (never called where AVX512-BF16 is not built: `attend` takes the fp32 tiles)
inline void pair_scores_for(int64_t, bool, const uint32_t *, int64_t, const uint32_t *, int64_t, float, float *, int64_t) {}
#endif

// out[v][0, 64) = inv[v] * sum over j < n of p[v][j] * vals[j][0, 64), for v < NV
template <int NV, typename T>
void output_tile(const float *p, int64_t ld_p, int64_t n, const T *vals, int64_t v_row, const float *inv, T *const *out) {
    __m512 acc[NV][4];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[v][0] = acc[v][1] = acc[v][2] = acc[v][3] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        const T *row = vals + j * v_row;
        const __m512 x0 = load16(row), x1 = load16(row + 16), x2 = load16(row + 32), x3 = load16(row + 48);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            const __m512 w = _mm512_set1_ps(p[v * ld_p + j]);
            acc[v][0] = _mm512_fmadd_ps(w, x0, acc[v][0]);
            acc[v][1] = _mm512_fmadd_ps(w, x1, acc[v][1]);
            acc[v][2] = _mm512_fmadd_ps(w, x2, acc[v][2]);
            acc[v][3] = _mm512_fmadd_ps(w, x3, acc[v][3]);
        }
    }
    for (int v = 0; v < NV; ++v) {  // (16 lanes at a time: rounded as `narrow` rounds, NaN stays NaN)
        const __m512 s = _mm512_set1_ps(inv[v]);
        for (int c = 0; c < 4; ++c) store16(round16(_mm512_mul_ps(acc[v][c], s), out[v]), out[v] + 16 * c);
    }
}

template <typename T>
void output_for(int64_t nv, const float *p, int64_t ld_p, int64_t n, const T *vals, int64_t v_row, const float *inv,
                T *const *out) {
    switch (nv) {
        case 1: return output_tile<1, T>(p, ld_p, n, vals, v_row, inv, out);
        case 2: return output_tile<2, T>(p, ld_p, n, vals, v_row, inv, out);
        case 3: return output_tile<3, T>(p, ld_p, n, vals, v_row, inv, out);
        default: return output_tile<4, T>(p, ld_p, n, vals, v_row, inv, out);
    }
}

// Row v's probabilities in place over its keys [0, len) (zero from len to `upto`); 1 / their sum
float softmax_row(float *s, int64_t len, int64_t upto) {
    __m512 top = _mm512_set1_ps(-3.0e38f);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 keep = len - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (len - j)) - 1);
        top = _mm512_mask_max_ps(top, keep, top, _mm512_loadu_ps(s + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 keep = len - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (len - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
        _mm512_storeu_ps(s + j, e);  // (zeros past len: the tile after this one starts at a multiple of 16)
        total = _mm512_add_ps(total, e);
    }
    for (int64_t j = round_up(len, 16); j < upto; ++j) s[j] = 0.0f;
    return 1.0f / _mm512_reduce_add_ps(total);
}

// keys_t[d][j] = key j's dimension d (fp32) for j < n, zero for j in [n, round_up(n, KEYS)). Sixteen keys at a time,
// gathered: a dimension of each (fp32), or a pair of dimensions (bf16: one 32-bit lane holds dimensions d and d + 1,
// split by a shift and a mask); the scalar loop it replaces was ~15 % of a 94-token prompt's attention
inline void store_keys(float *keys_t, int64_t ld, int64_t d, int64_t j, __m512i pairs, const bf16 *) {
    _mm512_storeu_ps(keys_t + d * ld + j, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
    _mm512_storeu_ps(keys_t + (d + 1) * ld + j,
                     _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
}

template <typename T>
void transpose_keys(const T *k, int64_t k_row, int64_t n, int64_t d_len, float *keys_t, int64_t ld) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int>(k_row * sizeof(T))));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 keep = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
        const T *rows = k + j * k_row;
        if constexpr (sizeof(T) == sizeof(float)) {
            for (int64_t d = 0; d < d_len; ++d)
                _mm512_storeu_ps(keys_t + d * ld + j, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, offsets, rows + d, 1));
        } else {
            for (int64_t d = 0; d < d_len; d += 2)
                store_keys(keys_t, ld, d, j, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, offsets, rows + d, 1), rows);
        }
    }
    const int64_t from = round_up(n, 16), end = round_up(n, KEYS);  // (the gathers zeroed the keys up to `from`)
    for (int64_t d = 0; d < d_len && from < end; ++d) std::memset(keys_t + d * ld + from, 0, sizeof(float) * (end - from));
}

// keys_p[e][j] = key j's dimensions 2e and 2e + 1 (one 32-bit element, as the row holds them) for j < n, zero for j in
// [n, round_up(n, KEYS)): the pair score tiles' keys
inline void transpose_key_pairs(const bf16 *k, int64_t k_row, int64_t n, int64_t d_len, uint32_t *keys_p, int64_t ld) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int>(k_row * sizeof(bf16))));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 keep = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
        for (int64_t d = 0; d < d_len; d += 2)
            _mm512_storeu_si512(keys_p + d / 2 * ld + j,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, offsets, k + j * k_row + d, 1));
    }
    const int64_t from = round_up(n, 16), end = round_up(n, KEYS);
    for (int64_t e = 0; e < d_len / 2 && from < end; ++e) std::memset(keys_p + e * ld + from, 0, sizeof(uint32_t) * (end - from));
}

// the scaled queries in fp32 (as widen(x) * scale, 16 dimensions at a time)
template <typename T>
void scale_query(const T *src, int64_t d_len, float scale, float *dst) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t d = 0; d < d_len; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(load16(src + d), s));
}

template <typename T>
int attend(const PrefillPlan &p, const T *q, const T *k, const T *v, T *out) {
    // bf16 chunks where AVX512-BF16 is built: pair score tiles (keys and queries kept as bf16 pairs)
    constexpr bool pairs = PAIR_SCORES && std::is_same<T, bf16>::value;
    const int64_t d_len = p.head_dim, group = p.q_heads / p.kv_heads, keys = p.prefix + p.rows;
    if (p.q_heads % p.kv_heads || group > MAX_VECTORS || d_len % DIMS || p.rows <= 0) return 1;
    const int64_t ld = round_up(keys, KEYS);  // (transposed keys padded with zeros to whole tiles)
    const int64_t rows_per_task = MAX_VECTORS / group;
    const int64_t blocks = (p.rows + rows_per_task - 1) / rows_per_task, tasks = blocks * p.kv_heads;
    int failed = 0;
    // One parallel loop and no barrier inside it: each thread transposes the keys its tasks see itself rather than
    // waiting for a shared transpose, so a thread the OS holds up holds up no one until the end.
#pragma omp parallel num_threads(p.threads)
    {
        // per thread: its task's transposed keys, queries (scaled, fp32), scores / probabilities and 1 / their sums
        float *keys_t = static_cast<float *>(
            std::aligned_alloc(64, sizeof(float) * round_up(d_len * ld + MAX_VECTORS * (d_len + ld + 1), 16)));
        if (keys_t == nullptr) {
#pragma omp atomic write
            failed = 2;
        }
        float *qs = keys_t + d_len * ld, *scores = qs + MAX_VECTORS * d_len, *inv = scores + MAX_VECTORS * ld;
        int64_t length[MAX_VECTORS];
        T *dst[MAX_VECTORS];
        int64_t have_head = -1, have = 0;  // the KV head whose keys [0, have) this thread's keys_t holds
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            if (keys_t == nullptr) continue;
            // a head's blocks in turn, the longest rows first: a thread's next task is mostly its last one's head
            // over fewer keys, whose transpose it already holds
            const int64_t h = t / blocks, block = blocks - 1 - t % blocks;
            const int64_t r0 = block * rows_per_task, r1 = r0 + rows_per_task < p.rows ? r0 + rows_per_task : p.rows;
            const int64_t nv = (r1 - r0) * group, longest = p.prefix + r1;
            if (h != have_head || longest > have) {
                if constexpr (pairs)
                    transpose_key_pairs(k + h * p.k_head, p.k_row, longest, d_len, reinterpret_cast<uint32_t *>(keys_t), ld);
                else
                    transpose_keys(k + h * p.k_head, p.k_row, longest, d_len, keys_t, ld);
                have_head = h, have = longest;
            }
            if (p.store_slots != nullptr) {
                for (int64_t r = r0; r < r1; ++r) {
                    const int64_t slot = p.store_slots[r], at = slot * p.store_row + h * p.store_head;
                    std::memcpy(static_cast<T *>(p.k_store) + at, k + (p.prefix + r) * p.k_row + h * p.k_head, sizeof(T) * d_len);
                    std::memcpy(static_cast<T *>(p.v_store) + at, v + (p.prefix + r) * p.v_row + h * p.v_head, sizeof(T) * d_len);
                }
            }
            for (int64_t i = 0; i < nv; ++i) {  // vector i: row r0 + i / group, query head h * group + i % group
                const int64_t r = r0 + i / group, head = h * group + i % group;
                const T *src = q + r * p.q_row + head * p.q_head;
                if constexpr (pairs)  // (the row as it is: its pairs of dimensions; the scale comes after the sums)
                    std::memcpy(reinterpret_cast<uint32_t *>(qs) + i * (d_len / 2), src, sizeof(T) * d_len);
                else
                    scale_query(src, d_len, p.scale, qs + i * d_len);
                length[i] = p.prefix + r + 1;
                dst[i] = out + r * p.out_row + head * p.out_head;
            }
            for (int64_t i = 0; i < nv; i += SCORE_VECTORS) {
                const int64_t n = nv - i < SCORE_VECTORS ? nv - i : SCORE_VECTORS, upto = length[i + n - 1];
                for (int64_t j = 0; j < upto; j += KEYS)
                    if constexpr (pairs)
                        pair_scores_for(n, upto - j > KEYS / 2, reinterpret_cast<const uint32_t *>(qs) + i * (d_len / 2), d_len / 2,
                                        reinterpret_cast<const uint32_t *>(keys_t) + j, ld, p.scale, scores + i * ld + j, ld);
                    else
                        scores_for(n, upto - j > KEYS / 2, qs + i * d_len, d_len, keys_t + j, ld, scores + i * ld + j, ld);
            }
            for (int64_t i = 0; i < nv; ++i) inv[i] = softmax_row(scores + i * ld, length[i], longest);
            const T *vals = v + h * p.v_head;
            for (int64_t i = 0; i < nv; i += OUT_VECTORS) {
                const int64_t n = nv - i < OUT_VECTORS ? nv - i : OUT_VECTORS;
                for (int64_t c = 0; c < d_len; c += DIMS) {
                    T *at[OUT_VECTORS];
                    for (int64_t u = 0; u < n; ++u) at[u] = dst[i + u] + c;
                    output_for<T>(n, scores + i * ld, ld, length[i + n - 1], vals + c, p.v_row, inv + i, at);
                }
            }
        }
        std::free(keys_t);
    }
    return failed;
}

}  // namespace
#endif

extern "C" {

// 1 where this build computes (AVX-512); 0: the entry points refuse every call
int mstar_prefill_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// 0 on success; 1: a shape it does not take (head dim not a multiple of 64, too many query heads a KV head, or not
// vectorized here); 2: out of memory
int mstar_prefill_attend_f32(const PrefillPlan *plan, const void *q, const void *k, const void *v, void *out) {
#if defined(__AVX512F__)
    return attend<float>(*plan, static_cast<const float *>(q), static_cast<const float *>(k),
                         static_cast<const float *>(v), static_cast<float *>(out));
#else
    (void)plan, (void)q, (void)k, (void)v, (void)out;
    return 1;
#endif
}

int mstar_prefill_attend_bf16(const PrefillPlan *plan, const void *q, const void *k, const void *v, void *out) {
#if defined(__AVX512F__)
    return attend<bf16>(*plan, static_cast<const bf16 *>(q), static_cast<const bf16 *>(k),
                        static_cast<const bf16 *>(v), static_cast<bf16 *>(out));
#else
    (void)plan, (void)q, (void)k, (void)v, (void)out;
    return 1;
#endif
}

}  // extern "C"
