// Bidirectional fp32 self-attention of an encoder's whole window (Whisper: 1500 frames x heads x 64), every head,
// reading q, k and v in place from the projections' output: built by encoder_attention.py.
//
// A task is one (window, head, block of QB query rows). It runs in three passes over the head's keys, all of them
// in registers and L1/L2:
//   1. scores: the block's queries, transposed once into [head dim][QB] (a few KB), times KEYS key rows at a time;
//      the accumulators hold QB queries x KEYS keys, each query a vector lane, each key row's element a broadcast,
//      so a block's scores come out key-major [frames][QB] and each query's running maximum is a lane-wise max
//      (no horizontal reductions anywhere). The scores (frames x QB x 4 B: 288 KB at 1500 frames, AVX-512) stay
//      in L2.
//   2. per chunk of CHUNK keys: the exponentials of the scores less their query's maximum, in place, and their
//      sums per query;
//   3. the same chunk's values weighted by them into the block's outputs, R rows x DV vectors of the head dim a
//      time, the chunk's values (CHUNK x head dim: 32 KB at 64) in L1 across the block's row groups.
// The outputs, divided by their sums, go straight to the attention's [windows, frames, heads x head dim] output,
// the layout the out projection reads, so there is no transpose or copy after.
//
// The softmax is exact two-pass (the true maximum first, no rescaling as an online softmax does); sums run in
// key order within a chunk, then chunk by chunk. Within ~1e-6 relative of torch's scaled_dot_product_attention (its
// products summed in another order); against float64 at Whisper-base's shape 7.6e-7 of the largest output (torch's
// 7.2e-7).
// A task's result depends only on its own rows, so a window gets the same bits alone or batched, on any thread count.
//
// No torch headers: plain C ABI over raw pointers, called through ctypes (native.py).

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#include "mstar_native.h"  // (exp)

namespace {

#if defined(__AVX512F__)
typedef __m512 vec;
constexpr int LANES = 16;
constexpr int KEYS = 8;  // keys a score step holds: 3 x 8 accumulators, 3 query loads and a broadcast
constexpr int R = 6;     // output rows a value step holds: 6 x 4 accumulators, 4 value loads and a broadcast
constexpr int DV = 4;    // head-dim vectors a value step holds: the head dim a multiple of DV x LANES
inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
inline void vstore(float *p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vfloor(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vscale2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p x 2^n (0 far below the range)
#define MSTAR_ENCODER_ATTENTION 1
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
constexpr int LANES = 8;
constexpr int KEYS = 3;  // 3 x 3 accumulators beside the 3 maxima and the scale (4 keys spill one: 45 GFLOP/s vs 57)
constexpr int R = 3;     // 3 x 4 accumulators, 4 value loads and a broadcast
constexpr int DV = 4;
// (this level measured 57 GFLOP/s a core on the EPYC against torch's attention's 79: the tests run it, callers
// that ask for no level get it only at AVX-512, see encoder_attention.py)
inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
inline void vstore(float *p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vfloor(vec x) { return _mm256_floor_ps(x); }
inline vec vscale2(vec p, vec n) {  // p x 2^n, n clamped where 2^n leaves the normal range (p in [0.7, 1.5))
    n = _mm256_max_ps(n, _mm256_set1_ps(-126.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#define MSTAR_ENCODER_ATTENTION 1
#endif

#if defined(MSTAR_ENCODER_ATTENTION)
// 2^x for x <= 0 (a score less its query's maximum, in units of log2 e): n = round(x), 2^(x - n) by the degree-6
// Taylor polynomial of e^(r ln 2) on |r| <= 1/2 (relative error < 2e-7), times 2^n. Nine vector ops against exp's
// sixteen (no clamps, no Cody-Waite split: the scores carry log2 e in their scale); the exponentials are ~10% of
// the kernel's work.
inline vec vexp2(vec x) {
    const vec n = vfloor(vadd(x, vset(0.5f)));
    const vec r = vsub(x, n);
    vec p = vset(1.5403530393381609e-4f);
    p = vfma(p, r, vset(1.3333558146428443e-3f));
    p = vfma(p, r, vset(9.6181291076284772e-3f));
    p = vfma(p, r, vset(5.5504108664821580e-2f));
    p = vfma(p, r, vset(2.4022650695910071e-1f));
    p = vfma(p, r, vset(6.9314718055994531e-1f));
    p = vfma(p, r, vset(1.0f));
    return vscale2(p, n);
}
#endif

#if defined(MSTAR_ENCODER_ATTENTION)
constexpr int QV = 3;               // query vectors a block holds
constexpr int QB = QV * LANES;      // query rows a task: 48 (AVX-512), 24 (AVX2)
constexpr int64_t CHUNK = 128;      // keys whose exponentials and values pass 3 keeps in L1
constexpr int64_t MAX_DIM = 256;

struct Operand {  // a tensor's first element and strides (elements): [windows, frames, heads x head dim]
    const float *data;
    int64_t window, row;
};

// Per-thread scratch: the block's queries transposed, its scores, its outputs; 64-byte aligned.
struct Scratch {
    float *qt, *scores, *out;
    explicit Scratch(int64_t frames, int64_t dim) {
        const int64_t qt_n = dim * QB, sc_n = frames * QB, out_n = QB * dim;
        base = static_cast<float *>(std::aligned_alloc(64, sizeof(float) * ((qt_n + sc_n + out_n + 47) / 16 * 16)));
        qt = base;
        scores = qt + (qt_n + 15) / 16 * 16;
        out = scores + (sc_n + 15) / 16 * 16;
    }
    ~Scratch() { std::free(base); }
    Scratch(const Scratch &) = delete;
    Scratch &operator=(const Scratch &) = delete;
    float *base;
};

// Pass 1 for KEYS keys from `key0` (rows past the last key repeat it; only `keys` are stored): scores, scaled,
// into scores[key][QB], and each query's maximum so far into `top`.
inline void score_step(const float *qt, const float *k, int64_t k_row, int64_t key0, int64_t keys, int64_t dim,
                       float scale, float *scores, vec *top) {
    const float *rows[KEYS];
    for (int j = 0; j < KEYS; ++j) rows[j] = k + (key0 + (j < keys ? j : keys - 1)) * k_row;
    vec acc[QV][KEYS];
    for (int v = 0; v < QV; ++v)
        for (int j = 0; j < KEYS; ++j) acc[v][j] = vset(0.0f);
    for (int64_t d = 0; d < dim; ++d) {
        const float *qd = qt + d * QB;
        const vec q0 = vload(qd), q1 = vload(qd + LANES), q2 = vload(qd + 2 * LANES);
        for (int j = 0; j < KEYS; ++j) {
            const vec kd = vbroadcast(rows[j] + d);
            acc[0][j] = vfma(q0, kd, acc[0][j]);
            acc[1][j] = vfma(q1, kd, acc[1][j]);
            acc[2][j] = vfma(q2, kd, acc[2][j]);
        }
    }
    const vec s = vset(scale);
    for (int j = 0; j < KEYS; ++j) {
        if (j >= keys) break;
        for (int v = 0; v < QV; ++v) {
            const vec x = vmul(acc[v][j], s);
            vstore(scores + (key0 + j) * QB + v * LANES, x);
            top[v] = vmax(top[v], x);
        }
    }
}

// Pass 3 for rows [r0, r0 + R) of the block and head-dim vectors [c0, c0 + DV x LANES), over keys [key0, key1):
// out[r][c] (+)= sum_key p[key][r] x value[key][c], summed in key order from zero, then added.
inline void value_step(const float *scores, const float *v, int64_t v_row, int64_t key0, int64_t key1, int r0,
                       int64_t c0, int64_t dim, bool first, float *out) {
    vec acc[R][DV];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < DV; ++c) acc[r][c] = vset(0.0f);
    for (int64_t key = key0; key < key1; ++key) {
        const float *vk = v + key * v_row + c0;
        vec val[DV];
        for (int c = 0; c < DV; ++c) val[c] = vload(vk + c * LANES);
        const float *p = scores + key * QB + r0;
        for (int r = 0; r < R; ++r) {
            const vec w = vbroadcast(p + r);
            for (int c = 0; c < DV; ++c) acc[r][c] = vfma(w, val[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < DV; ++c) {
            float *o = out + (r0 + r) * dim + c0 + c * LANES;
            vstore(o, first ? acc[r][c] : vadd(vload(o), acc[r][c]));
        }
}

// One task: queries [row0, row0 + rows) of one window and head (operands already at that window and head).
void attend_block(const Operand &q, const Operand &k, const Operand &v, float *out, int64_t out_row, int64_t row0,
                  int64_t rows, int64_t frames, int64_t dim, float scale, Scratch &s) {
    for (int64_t d = 0; d < dim; ++d)  // (rows past the window's last are zeros: finite scores, never stored)
        for (int i = 0; i < QB; ++i) s.qt[d * QB + i] = i < rows ? q.data[(row0 + i) * q.row + d] : 0.0f;
    vec top[QV];
    for (int w = 0; w < QV; ++w) top[w] = vset(-INFINITY);
    for (int64_t key0 = 0; key0 < frames; key0 += KEYS)
        score_step(s.qt, k.data, k.row, key0, frames - key0 < KEYS ? frames - key0 : KEYS, dim, scale, s.scores, top);
    // (each chunk's sums start from zero and are added to the block's: two-level sums, nearer the exact ones
    // than one running sum over all frames)
    vec sum[QV];
    for (int w = 0; w < QV; ++w) sum[w] = vset(0.0f);
    for (int64_t key0 = 0; key0 < frames; key0 += CHUNK) {
        const int64_t key1 = frames - key0 < CHUNK ? frames : key0 + CHUNK;
        vec part[QV];
        for (int w = 0; w < QV; ++w) part[w] = vset(0.0f);
        for (int64_t key = key0; key < key1; ++key)
            for (int w = 0; w < QV; ++w) {
                float *p = s.scores + key * QB + w * LANES;
                const vec e = vexp2(vsub(vload(p), top[w]));
                vstore(p, e);
                part[w] = vadd(part[w], e);
            }
        for (int w = 0; w < QV; ++w) sum[w] = vadd(sum[w], part[w]);
        for (int r0 = 0; r0 < QB; r0 += R) {
            if (r0 >= rows) break;
            for (int64_t c0 = 0; c0 < dim; c0 += DV * LANES)
                value_step(s.scores, v.data, v.row, key0, key1, r0, c0, dim, key0 == 0, s.out);
        }
    }
    alignas(64) float total[QB];
    for (int w = 0; w < QV; ++w) vstore(total + w * LANES, sum[w]);
    for (int64_t i = 0; i < rows; ++i) {
        const vec t = vset(total[i]);
        for (int64_t c = 0; c < dim; c += LANES)
            vstore(out + (row0 + i) * out_row + c, vdiv(vload(s.out + i * dim + c), t));
    }
}
#endif

}  // namespace

extern "C" {

// The vector width this build computes with (16: AVX-512, 8: AVX2), 0 where it has no vector code.
int mstar_encoder_attention_lanes() {
#if defined(MSTAR_ENCODER_ATTENTION)
    return LANES;
#else
    return 0;
#endif
}

// softmax(q k^T x scale) v over `frames` frames of each of `windows` windows, every head; q, k, v and out are
// [windows, frames, heads x dim] with the given window and row strides (elements) and unit stride within a row.
// Returns 0, or 1 where the shapes are not taken (the head dim not a multiple of 4 vectors or over 256), 2 where
// this build has no vector code (the portable level: the caller runs torch's attention).
int mstar_encoder_attention_f32(const float *q, const float *k, const float *v, float *out, const int64_t *strides,
                                int64_t windows, int64_t frames, int64_t heads, int64_t dim, float scale, int threads) {
#if defined(MSTAR_ENCODER_ATTENTION)
    if (dim < 1 || dim > MAX_DIM || dim % (DV * LANES) || frames < 1 || windows < 1 || heads < 1) return 1;
    // strides: q, k, v, out, each (window, row)
    const float scale2 = scale * 1.44269504088896341f;  // (scores in units of log2 e: exponentials as 2^x)
    const int64_t blocks = (frames + QB - 1) / QB, tasks = windows * heads * blocks;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (tasks > 1)
    {
        Scratch scratch(frames, dim);
        // (claimed one at a time: a thread the server's other threads hold up holds up no one; blocks innermost,
        // so a thread's next task mostly shares its head's keys and values in L2)
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t b = t / (heads * blocks), h = t / blocks % heads, block = t % blocks;
            const Operand qo{q + b * strides[0] + h * dim, strides[0], strides[1]};
            const Operand ko{k + b * strides[2] + h * dim, strides[2], strides[3]};
            const Operand vo{v + b * strides[4] + h * dim, strides[4], strides[5]};
            const int64_t row0 = block * QB, rows = frames - row0 < QB ? frames - row0 : QB;
            attend_block(qo, ko, vo, out + b * strides[6] + h * dim, strides[7], row0, rows, frames, dim, scale2,
                         scratch);
        }
    }
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)strides, (void)windows, (void)frames, (void)heads, (void)dim;
    (void)scale, (void)threads;
    return 2;
#endif
}

}  // extern "C"
