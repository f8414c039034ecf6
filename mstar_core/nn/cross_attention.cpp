// Cross-attention of a few query rows per sequence over that sequence's encoder keys and values, read in place
// from KV pool pages: built by cross_attention.py.
//
// A decoder step's cross-attention is memory-bound: each decoding sequence's rows read all of its encoder keys and
// values in every layer (Whisper: 1500 frames x heads x head dim, twice). A task is one (sequence, chunk of
// `CHUNK` frames): it streams its frames' key rows, every head of a frame at once (a frame's heads sit side by side
// in the pool's slot-major pages, [slots, heads, dim]), so each page is read front to back exactly once, then the
// same frames' value rows; it keeps, per query row and head, the chunk's softmax partials (the largest score, the
// sum of the exponentials, the weighted sum of the values). A second pass merges each sequence's chunks in order.
// (Tasks of one head over all frames instead read 256 bytes every 2 KB, which the hardware prefetchers, confined
// to a 4 KB page, barely follow: ~8-12 GB/s on the benchmark's EPYC against ~25 for a stream.)
//
// The chunks depend only on the sequence's frame count and are merged in frame order, so a sequence's rows get
// the same bits alone or batched, on one thread or many.
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
// frames a task streams: 128 x 8 heads x 64 x 4 B = 256 KB of keys (and as much of values) at Whisper-base, in L2
// between its two passes; 12 tasks over 1500 frames, a few per thread
constexpr int64_t CHUNK = 128;

// One task's view: the sequence's rows and the chunk's frames.
struct Task {
    int64_t row, rows, first, frames;  // first packed row, rows; first frame of the chunk, frames in it
    const int64_t *pages;              // the sequence's pages
    float *partial;                    // rows x q heads x (head dim + 2): weighted values, then max, then sum
};

// where each of the chunk's frames' key (and value) row starts in a layer's keys
void frame_offsets(const CrossPlan &p, const Task &t, int64_t *offsets) {
    for (int64_t j = 0; j < t.frames; ++j) {
        const int64_t f = t.first + j;
        offsets[j] = (t.pages[f / p.page_size] * p.page_size + f % p.page_size) * p.slot;
    }
}

// scores[(r * q_heads + h) * CHUNK + j]: query row r, head h, over the chunk's frame j, frames outermost (a frame's
// key row is read once, all its heads)
void chunk_scores(const CrossPlan &p, const Task &t, const float *q, const float *keys, const int64_t *offsets,
                  float *scores) {
    const int64_t group = p.q_heads / p.kv_heads, dim = p.head_dim;
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        // 16 dot products at a time, summed across lanes together (sum16 below)
        __m512 acc[16];
        float *dest[16];
        int n = 0;
        alignas(64) float sums[16];
        auto flush = [&](int m) {
            // r[j] = the sum of acc[j]'s lanes: pairs within 128-bit lanes, then across them
            for (int j = m; j < 16; ++j) acc[j] = _mm512_setzero_ps();
            __m512 b[8], c[4];
            for (int i = 0; i < 8; ++i)
                b[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                                     _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
            for (int i = 0; i < 4; ++i) {
                const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
                c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
            }
            const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
            const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
            _mm512_store_ps(sums, _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88),
                                                              _mm512_shuffle_f32x4(e01, e23, 0xDD)),
                                                _mm512_set1_ps(p.scale)));
            for (int j = 0; j < m; ++j) *dest[j] = sums[j];
        };
        for (int64_t j = 0; j < t.frames; ++j) {
            const float *frame = keys + offsets[j];
            for (int64_t h = 0; h < p.q_heads; ++h) {
                const float *k = frame + (h / group) * p.head;
                for (int64_t r = 0; r < t.rows; ++r) {
                    const float *qr = q + (t.row + r) * p.q_row + h * p.q_head;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(k));
                    for (int64_t d = 16; d < dim; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(k + d), a);
                    acc[n] = a;
                    dest[n] = scores + (r * p.q_heads + h) * CHUNK + j;
                    if (++n == 16) {
                        flush(16);
                        n = 0;
                    }
                }
            }
        }
        if (n) flush(n);
        return;
    }
#endif
    for (int64_t j = 0; j < t.frames; ++j) {
        const float *frame = keys + offsets[j];
        for (int64_t h = 0; h < p.q_heads; ++h) {
            const float *k = frame + (h / group) * p.head;
            for (int64_t r = 0; r < t.rows; ++r) {
                const float *qr = q + (t.row + r) * p.q_row + h * p.q_head;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; ++d) dot += qr[d] * k[d];
                scores[(r * p.q_heads + h) * CHUNK + j] = dot * p.scale;
            }
        }
    }
}

// each (row, head)'s scores -> exp(score - the chunk's max), in place; the max and the sum into its partial
void chunk_softmax(const CrossPlan &p, const Task &t, float *scores) {
    const int64_t width = p.head_dim + 2;
    for (int64_t i = 0; i < t.rows * p.q_heads; ++i) {
        float *s = scores + i * CHUNK;
        float most = -INFINITY, total = 0.0f;
        int64_t j = 0;
#if defined(__AVX512F__)
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (; j + 16 <= t.frames; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
        most = _mm512_reduce_max_ps(top);
#endif
        for (; j < t.frames; ++j) most = s[j] > most ? s[j] : most;
        j = 0;
#if defined(__AVX512F__)
        const __m512 mv = _mm512_set1_ps(most);
        __m512 sum = _mm512_setzero_ps();
        for (; j + 16 <= t.frames; j += 16) {
            const __m512 e = mstar::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
            _mm512_storeu_ps(s + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        total = _mm512_reduce_add_ps(sum);
#endif
        for (; j < t.frames; ++j) {
            s[j] = mstar::exp_approx(s[j] - most);
            total += s[j];
        }
        t.partial[i * width + p.head_dim] = most;
        t.partial[i * width + p.head_dim + 1] = total;
    }
}

// each (row, head)'s weighted sum of the chunk's values into its partial, frames outermost
void chunk_values(const CrossPlan &p, const Task &t, const float *values, const int64_t *offsets,
                  const float *probs) {
    const int64_t group = p.q_heads / p.kv_heads, dim = p.head_dim, width = dim + 2;
    for (int64_t i = 0; i < t.rows * p.q_heads; ++i)
        for (int64_t d = 0; d < dim; ++d) t.partial[i * width + d] = 0.0f;
    for (int64_t j = 0; j < t.frames; ++j) {
        const float *frame = values + offsets[j];
        for (int64_t h = 0; h < p.q_heads; ++h) {
            const float *v = frame + (h / group) * p.head;
            for (int64_t r = 0; r < t.rows; ++r) {
                const int64_t i = r * p.q_heads + h;
                const float w = probs[i * CHUNK + j];
                float *acc = t.partial + i * width;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) acc[d] += w * v[d];
            }
        }
    }
}

}  // namespace

extern "C" {

// 0: done; 1: a sequence has more than MAX_ROWS rows or no frames, or the head dim is over MAX_DIM, or the query
// heads are not a multiple of the KV heads (the caller runs torch ops instead)
int mstar_cross_attend_f32(const CrossPlan *plan, const float *q, const float *keys, const float *values, float *out) {
    const CrossPlan &p = *plan;
    if (p.head_dim > MAX_DIM || p.head_dim < 1 || p.kv_heads < 1 || p.q_heads % p.kv_heads) return 1;
    const int64_t width = p.head_dim + 2;
    std::vector<Task> tasks;
    std::vector<int64_t> first_task(static_cast<size_t>(p.count + 1));
    int64_t floats = 0;
    for (int64_t s = 0; s < p.count; ++s) {
        const int64_t *span = p.spans + 4 * s;
        if (span[1] > MAX_ROWS || span[1] < 1 || span[2] < 1) return 1;
        first_task[s] = static_cast<int64_t>(tasks.size());
        for (int64_t f = 0; f < span[2]; f += CHUNK) {
            tasks.push_back({span[0], span[1], f, span[2] - f < CHUNK ? span[2] - f : CHUNK, p.pages + span[3], nullptr});
            floats += span[1] * p.q_heads * width;
        }
    }
    first_task[p.count] = static_cast<int64_t>(tasks.size());
    static thread_local std::vector<float> partials;  // (the caller's thread: reused call after call)
    if (partials.size() < static_cast<size_t>(floats)) partials.resize(static_cast<size_t>(floats));
    for (int64_t i = 0, at = 0; i < static_cast<int64_t>(tasks.size()); ++i) {
        tasks[i].partial = partials.data() + at;
        at += tasks[i].rows * p.q_heads * width;
    }
    const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(p.threads > 0 ? p.threads : 1) if (count > 1)
    {
        static thread_local std::vector<float> scores;  // (each thread's, kept: OpenMP's threads persist)
        if (scores.size() < static_cast<size_t>(MAX_ROWS * p.q_heads * CHUNK))
            scores.resize(static_cast<size_t>(MAX_ROWS * p.q_heads * CHUNK));
        int64_t offsets[CHUNK];
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; ++i) {
            const Task &t = tasks[i];
            frame_offsets(p, t, offsets);
            chunk_scores(p, t, q, keys, offsets, scores.data());
            chunk_softmax(p, t, scores.data());
            chunk_values(p, t, values, offsets, scores.data());
        }
        // each sequence's chunks merged in frame order: out = sum_c w_c acc_c / sum_c w_c total_c, w_c = e^(max_c - max)
#pragma omp for schedule(static)
        for (int64_t s = 0; s < p.count; ++s) {
            const int64_t lo = first_task[s], hi = first_task[s + 1];
            const Task &t0 = tasks[lo];
            for (int64_t i = 0; i < t0.rows * p.q_heads; ++i) {
                float most = -INFINITY;
                for (int64_t c = lo; c < hi; ++c) {
                    const float m = tasks[c].partial[i * width + p.head_dim];
                    most = m > most ? m : most;
                }
                float acc[MAX_DIM], total = 0.0f;
                for (int64_t d = 0; d < p.head_dim; ++d) acc[d] = 0.0f;
                for (int64_t c = lo; c < hi; ++c) {
                    const float *part = tasks[c].partial + i * width;
                    const float w = hi - lo == 1 ? 1.0f : mstar::exp_approx(part[p.head_dim] - most);
                    total += w * part[p.head_dim + 1];
#pragma omp simd
                    for (int64_t d = 0; d < p.head_dim; ++d) acc[d] += w * part[d];
                }
                const int64_t r = i / p.q_heads, h = i % p.q_heads;
                float *o = out + (t0.row + r) * p.out_row + h * p.out_head;
                const float inv = 1.0f / total;
                for (int64_t d = 0; d < p.head_dim; ++d) o[d] = acc[d] * inv;
            }
        }
    }
    return 0;
}

}  // extern "C"
