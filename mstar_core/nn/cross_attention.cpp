// Cross-attention of a few query rows per sequence over that sequence's encoder keys and values, read in place
// from KV pool pages: built by cross_attention.py.
//
// A decoder step's cross-attention is memory-bound: each decoding sequence's row reads all of its encoder keys and
// values in every layer (Whisper: 1500 frames). As torch ops over the pool's slot-major pages ([slots, heads, dim])
// the keys are a strided view that scaled_dot_product_attention first copies head-major, about twice the time of the
// attention itself; here each task reads its head's keys and values once, in place, page by page, and accumulates
// in fp32. A task is one (sequence, query head): its rows' results depend on nothing else in the call, so a
// sequence attends the same alone or batched, bit for bit.
//
// No torch headers: plain C ABI over raw pointers, called through ctypes (native.py).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <omp.h>

#include "mstar_native.h"  // (exp)

extern "C" {

// One call: `count` sequences, each `rows` packed query rows from `row` on, over `frames` encoder frames held in
// pool pages `pages[page_at ...]` (page_size frames each, in order).
struct CrossPlan {
    const int64_t *spans;   // per sequence: row, rows, frames, page_at
    const int64_t *pages;   // every sequence's pages, concatenated
    int64_t count;
    int64_t q_heads, kv_heads, head_dim, page_size;
    int64_t q_row, q_head;      // strides (elements) of q
    int64_t out_row, out_head;  // and of the output
    int64_t slot, head;         // strides of a layer's pool keys (and values): [slots, kv heads, head dim]
    float scale;
    int32_t threads;
};

}  // extern "C"

namespace {

constexpr int64_t MAX_ROWS = 16;
constexpr int64_t MAX_DIM = 256;

// where each frame's key (and value) row starts in a layer's keys, page by page (no division per frame)
void frame_offsets(const CrossPlan &p, const int64_t *pages, int64_t frames, std::vector<int64_t> &offsets) {
    offsets.resize(static_cast<size_t>(frames));
    for (int64_t f = 0, page = 0; f < frames; ++page)
        for (int64_t j = 0; j < p.page_size && f < frames; ++j, ++f) offsets[f] = (pages[page] * p.page_size + j) * p.slot;
}

#if defined(__AVX512F__)
// r[j] = the sum of a[j]'s 16 lanes, for 16 vectors (pairs within 128-bit lanes, then across them)
inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// one row's scaled scores over every frame, 16 frames at a time (C: head dim / 16)
template <int C>
void scores16(const float *q, const float *keys, const int64_t *offsets, int64_t frames, float scale, float *out) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t f0 = 0; f0 < frames; f0 += 16) {
        const int64_t m = frames - f0 < 16 ? frames - f0 : 16;
        __m512 acc[16];
        for (int64_t j = 0; j < 16; ++j) {
            if (j >= m) {
                acc[j] = _mm512_setzero_ps();
                continue;
            }
            const float *k = keys + offsets[f0 + j];
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
            acc[j] = a;
        }
        _mm512_mask_storeu_ps(out + f0, static_cast<__mmask16>((1u << m) - 1u), _mm512_mul_ps(sum16(acc), sv));
    }
}

// one row's output: the probabilities' weighted sum of the values, then / total
template <int C>
void weighted16(const float *probs, const float *values, const int64_t *offsets, int64_t frames, float inv, float *o) {
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t f = 0; f < frames; ++f) {
        const __m512 w = _mm512_set1_ps(probs[f]);
        const float *v = values + offsets[f];
        for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), acc[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}

template <int C>
void rows16(const CrossPlan &p, const float *q, const float *keys, const float *values, float *out, int64_t row,
            int64_t rows, int64_t frames, int64_t h, int64_t kvh, const int64_t *offsets, float *sc) {
    for (int64_t r = 0; r < rows; ++r) {
        float *sr = sc;
        scores16<C>(q + (row + r) * p.q_row + h * p.q_head, keys + kvh * p.head, offsets, frames, p.scale, sr);
        __m512 top = _mm512_set1_ps(-INFINITY);
        int64_t f = 0;
        for (; f + 16 <= frames; f += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sr + f));
        float most = _mm512_reduce_max_ps(top);
        for (; f < frames; ++f) most = sr[f] > most ? sr[f] : most;
        const __m512 mv = _mm512_set1_ps(most);
        __m512 sum = _mm512_setzero_ps();
        for (f = 0; f + 16 <= frames; f += 16) {
            const __m512 e = mstar::exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + f), mv));
            _mm512_storeu_ps(sr + f, e);
            sum = _mm512_add_ps(sum, e);
        }
        float total = _mm512_reduce_add_ps(sum);
        for (; f < frames; ++f) {
            sr[f] = mstar::exp_approx(sr[f] - most);
            total += sr[f];
        }
        weighted16<C>(sr, values + kvh * p.head, offsets, frames, 1.0f / total, out + (row + r) * p.out_row + h * p.out_head);
    }
}
#endif

// any head dim: plain loops (the compiler vectorizes what it can)
void rows_any(const CrossPlan &p, const float *q, const float *keys, const float *values, float *out, int64_t row,
              int64_t rows, int64_t frames, int64_t h, int64_t kvh, const int64_t *offsets, float *sc) {
    const int64_t dim = p.head_dim;
    for (int64_t r = 0; r < rows; ++r) {
        const float *qr = q + (row + r) * p.q_row + h * p.q_head;
        float most = -INFINITY;
        for (int64_t f = 0; f < frames; ++f) {
            const float *k = keys + offsets[f] + kvh * p.head;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qr[d] * k[d];
            sc[f] = dot * p.scale;
            most = sc[f] > most ? sc[f] : most;
        }
        float total = 0.0f;
        for (int64_t f = 0; f < frames; ++f) {
            sc[f] = mstar::exp_approx(sc[f] - most);
            total += sc[f];
        }
        float acc[MAX_DIM];
        for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
        for (int64_t f = 0; f < frames; ++f) {
            const float *v = values + offsets[f] + kvh * p.head;
            const float w = sc[f];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) acc[d] += w * v[d];
        }
        float *o = out + (row + r) * p.out_row + h * p.out_head;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] / total;
    }
}

// one (sequence, query head): its rows over its frames, keys and values read in place
void attend_one(const CrossPlan &p, const float *q, const float *keys, const float *values, float *out, int64_t s,
                int64_t h, std::vector<float> &scores, std::vector<int64_t> &offsets) {
    const int64_t *span = p.spans + 4 * s;
    const int64_t row = span[0], rows = span[1], frames = span[2];
    const int64_t kvh = h / (p.q_heads / p.kv_heads);
    frame_offsets(p, p.pages + span[3], frames, offsets);
    scores.resize(static_cast<size_t>(frames + 16));
#if defined(__AVX512F__)
    switch (p.head_dim) {
        case 64: return rows16<4>(p, q, keys, values, out, row, rows, frames, h, kvh, offsets.data(), scores.data());
        case 128: return rows16<8>(p, q, keys, values, out, row, rows, frames, h, kvh, offsets.data(), scores.data());
        default: break;
    }
#endif
    rows_any(p, q, keys, values, out, row, rows, frames, h, kvh, offsets.data(), scores.data());
}

}  // namespace

extern "C" {

// 0: done; 1: a sequence has more than MAX_ROWS rows or no frames, or the head dim is over MAX_DIM, or the query
// heads are not a multiple of the KV heads (the caller runs torch ops instead)
int mstar_cross_attend_f32(const CrossPlan *plan, const float *q, const float *keys, const float *values, float *out) {
    const CrossPlan &p = *plan;
    if (p.head_dim > MAX_DIM || p.kv_heads < 1 || p.q_heads % p.kv_heads) return 1;
    for (int64_t s = 0; s < p.count; ++s)
        if (p.spans[4 * s + 1] > MAX_ROWS || p.spans[4 * s + 1] < 1 || p.spans[4 * s + 2] < 1) return 1;
    const int64_t tasks = p.count * p.q_heads;
#pragma omp parallel num_threads(p.threads > 0 ? p.threads : 1) if (tasks > 1)
    {
        std::vector<float> scores;
        std::vector<int64_t> offsets;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t)
            attend_one(p, q, keys, values, out, t / p.q_heads, t % p.q_heads, scores, offsets);
    }
    return 0;
}

}  // extern "C"
