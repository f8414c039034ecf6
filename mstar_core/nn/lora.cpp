// LoRA deltas of one linear for rows of several adapters in one call: y[r] += B_s^T (A_s x[r]) for each row r whose
// slot s = row_slot[r] is >= 0 (rows of the base model, -1, are left alone). Built by native.py, called by lora.py.
//
// As torch ops a step's deltas were four ops per adapter per linear (gather, two small GEMMs, scatter-add): on a
// 2-core CPU over 30 % of a 32-row decode step of a 512-wide Llama with four adapters, most of it per-op overhead.
// Here one call per linear does every adapter, reading which row belongs to which slot from memory, so a recorded
// step (tape.py) replays with whatever rows the next step has. Rows of one slot run in blocks of eight that share
// each load of A's and B's rows. A row's result depends on nothing but that row (batch-invariant).
//
// A fused linear (q/k/v, gate/up) has parts, each with its own A and B: rank block k (rows k*R .. k*R+R of a and b,
// R the largest rank) belongs to part k, whose outputs are y[bounds[2k] .. bounds[2k] + bounds[2k+1]).
// a: [slots, parts * R, in] (A of every slot, each part's rank rows padded to R), b: [slots, parts * R, out] (B^T
// with the scale folded in), cols[s * parts + k]: the rank of slot s's part k (0: it does not target it).
// dims: rows, in, out, x row stride, y row stride, R, slots, parts, threads.

#include <cstdint>

#include "mstar_native.h"

namespace {

using namespace mstar;

constexpr int64_t BLOCK = 8;
constexpr int64_t MAX_RANK = 1024;

// rows x[0..n) (n <= BLOCK; the rest of the block repeats row 0 and is never stored) of one slot: for each rank block
// k of a fused linear with width w = cols[k] > 0, low = A[k*R .. k*R+w) x, then y[lo_k .. lo_k+rows_k) += low B
template <typename T>
void block_delta(const T *const *x, T *const *y, int64_t n, const T *a, const T *b, const int64_t *cols,
                 const int64_t *bounds, int64_t parts, int64_t rank, int64_t in, int64_t out) {
    float low[BLOCK][MAX_RANK];
    constexpr int64_t CHUNK = 256;
    float acc[BLOCK][CHUNK];
    for (int64_t k = 0; k < parts; ++k) {
        const int64_t width = cols[k];
        if (width <= 0) continue;
        const T *ak = a + k * rank * in, *bk = b + k * rank * out;
        // (the rows in locals: read through `x` the compiler reloads them every element and does not vectorize)
        const T *__restrict x0 = x[0], *__restrict x1 = x[1], *__restrict x2 = x[2], *__restrict x3 = x[3];
        const T *__restrict x4 = x[4], *__restrict x5 = x[5], *__restrict x6 = x[6], *__restrict x7 = x[7];
        for (int64_t j = 0; j < width; ++j) {
            const T *__restrict arow = ak + j * in;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, s4 = 0.0f, s5 = 0.0f, s6 = 0.0f, s7 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
            for (int64_t e = 0; e < in; ++e) {
                const float w = widen(arow[e]);
                s0 += w * widen(x0[e]);
                s1 += w * widen(x1[e]);
                s2 += w * widen(x2[e]);
                s3 += w * widen(x3[e]);
                s4 += w * widen(x4[e]);
                s5 += w * widen(x5[e]);
                s6 += w * widen(x6[e]);
                s7 += w * widen(x7[e]);
            }
            low[0][j] = s0, low[1][j] = s1, low[2][j] = s2, low[3][j] = s3;
            low[4][j] = s4, low[5][j] = s5, low[6][j] = s6, low[7][j] = s7;
        }
        // y += low B over this part's outputs, summed in fp32 per output and rounded once (a bf16 y is not rounded
        // per rank row)
        const int64_t lo = bounds[2 * k], hi = lo + bounds[2 * k + 1];
        for (int64_t o0 = lo; o0 < hi; o0 += CHUNK) {
            const int64_t m = hi - o0 < CHUNK ? hi - o0 : CHUNK;
            for (int64_t r = 0; r < BLOCK; ++r)
                for (int64_t o = 0; o < m; ++o) acc[r][o] = 0.0f;
            for (int64_t j = 0; j < width; ++j) {
                const T *__restrict brow = bk + j * out + o0;
                const float l0 = low[0][j], l1 = low[1][j], l2 = low[2][j], l3 = low[3][j];
                const float l4 = low[4][j], l5 = low[5][j], l6 = low[6][j], l7 = low[7][j];
#pragma omp simd
                for (int64_t o = 0; o < m; ++o) {
                    const float w = widen(brow[o]);
                    acc[0][o] += l0 * w;
                    acc[1][o] += l1 * w;
                    acc[2][o] += l2 * w;
                    acc[3][o] += l3 * w;
                    acc[4][o] += l4 * w;
                    acc[5][o] += l5 * w;
                    acc[6][o] += l6 * w;
                    acc[7][o] += l7 * w;
                }
            }
            for (int64_t r = 0; r < n; ++r) {
                T *dst = y[r] + o0;
#pragma omp simd
                for (int64_t o = 0; o < m; ++o) narrow(widen(dst[o]) + acc[r][o], dst + o);
            }
        }
    }
}

bool targets(const int64_t *cols, int64_t parts) {
    for (int64_t k = 0; k < parts; ++k)
        if (cols[k] > 0) return true;
    return false;
}

template <typename T>
int lora_delta(const T *x, T *y, const T *a, const T *b, const int64_t *row_slot, const int64_t *cols,
               const int64_t *dims, const int64_t *bounds) {
    const int64_t rows = dims[0], in = dims[1], out = dims[2], xs = dims[3], ys = dims[4], rank = dims[5];
    const int64_t slots = dims[6], parts = dims[7];
    const int threads = static_cast<int>(dims[8]);
    if (rank > MAX_RANK) return 1;
    const int64_t cap = parts * rank;
    // one task per (slot, block of up to BLOCK of its rows): gathered in row order, so each row's sums run the same
    // way whatever else the call holds
    int64_t count = 0;
    for (int64_t s = 0; s < slots; ++s) {
        if (!targets(cols + s * parts, parts)) continue;
        int64_t in_slot = 0;
        for (int64_t r = 0; r < rows; ++r) in_slot += row_slot[r] == s;
        count += (in_slot + BLOCK - 1) / BLOCK;
    }
    if (count == 0) return 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && count > 1)
    for (int64_t task = 0; task < count; ++task) {
        // find this task's slot and block: walk the slots again (cheap: a handful of slots, tens of rows)
        int64_t seen = 0;
        for (int64_t s = 0; s < slots; ++s) {
            if (!targets(cols + s * parts, parts)) continue;
            int64_t in_slot = 0;
            for (int64_t r = 0; r < rows; ++r) in_slot += row_slot[r] == s;
            const int64_t blocks = (in_slot + BLOCK - 1) / BLOCK;
            if (task >= seen + blocks) {
                seen += blocks;
                continue;
            }
            const int64_t first = (task - seen) * BLOCK;
            const T *xr[BLOCK];
            T *yr[BLOCK];
            int64_t n = 0, index = 0;
            for (int64_t r = 0; r < rows && n < BLOCK; ++r) {
                if (row_slot[r] != s) continue;
                if (index++ < first) continue;
                xr[n] = x + r * xs;
                yr[n] = y + r * ys;
                ++n;
            }
            for (int64_t k = n; k < BLOCK; ++k) xr[k] = xr[0], yr[k] = yr[0];  // (padding lanes, never stored)
            block_delta(xr, yr, n, a + s * cap * in, b + s * cap * out, cols + s * parts, bounds, parts, rank, in, out);
            break;
        }
    }
    return 0;
}

}  // namespace

extern "C" {

int mstar_lora_delta_f32(const void *x, void *y, const void *a, const void *b, const void *row_slot,
                         const void *cols, const void *dims, const void *bounds, const void *) {
    return lora_delta(static_cast<const float *>(x), static_cast<float *>(y), static_cast<const float *>(a),
                      static_cast<const float *>(b), static_cast<const int64_t *>(row_slot),
                      static_cast<const int64_t *>(cols), static_cast<const int64_t *>(dims),
                      static_cast<const int64_t *>(bounds));
}

int mstar_lora_delta_bf16(const void *x, void *y, const void *a, const void *b, const void *row_slot,
                          const void *cols, const void *dims, const void *bounds, const void *) {
    return lora_delta(static_cast<const bf16 *>(x), static_cast<bf16 *>(y), static_cast<const bf16 *>(a),
                      static_cast<const bf16 *>(b), static_cast<const int64_t *>(row_slot),
                      static_cast<const int64_t *>(cols), static_cast<const int64_t *>(dims),
                      static_cast<const int64_t *>(bounds));
}
}
