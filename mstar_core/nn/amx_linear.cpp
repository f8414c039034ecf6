// bf16 linears for a decode step's rows (up to 32) on AMX tiles: built by native.py, called by packed.py.
//
// A decode step's linears stream every weight once for a few rows. Through torch's oneDNN call each one also
// pays ~25 us of setup (primitive lookup, memory descriptors) whatever its size: 121 calls, ~3 ms, of a
// SmolLM2 step. Here the weight is packed once into AMX's pair-interleaved layout, 16 outputs x 32 inputs a
// tile, and a call is the tile loop: for each pair of 16-output blocks, each two 16-row groups of inputs, the
// 32-input chunks in order, `tdpbf16ps` into four fp32 accumulator tiles (each weight tile loaded once for
// both row groups).
//
// Batch invariance: an output element is the same chain of tile products (its own input row, its own weight
// column, the chunks in the same order) whatever the call's row count or the row's place in its tile, so a
// row computes bitwise the same alone or beside others. Sums in fp32, the bias added, rounded once to bf16.

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/syscall.h>
#include <unistd.h>

#include "mstar_native.h"

namespace {

using mstar::bf16;

constexpr int64_t TILE_ROWS = 16;  // input rows per tile, and outputs per block
constexpr int64_t TILE_K = 32;     // inputs per tile (64 bytes of bf16)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// tiles 0-3: accumulators (16 rows x 16 fp32: two row groups x two output blocks); 4, 5: inputs (16 rows x 32
// bf16); 6, 7: weights (16 pairs x 16 outputs x 2). Every tile is 16 rows of 64 bytes.
void configure() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

bool permitted() {  // Linux hands out AMX tile state only on request (oneDNN asks too; asking twice is fine)
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state == 1;
}

// out rows [m0, m0 + rows) and outputs [n0, n0 + outs) (outs <= 32) from two fp32 accumulator tiles, 16 at a time
void finish(const float (*acc)[TILE_ROWS][TILE_ROWS], int64_t rows, int64_t n0, int64_t outs, const bf16 *bias, bf16 *out,
            int64_t out_row) {
    for (int64_t half = 0; half < 2 && half * TILE_ROWS < outs; ++half) {
        const int64_t width = outs - half * TILE_ROWS < TILE_ROWS ? outs - half * TILE_ROWS : TILE_ROWS;
        const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
        const int64_t first = n0 + half * TILE_ROWS;
        const __m512 b = bias != nullptr ? mstar::load16(bias + first, keep) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) {
            bf16 *dst = out + r * out_row + first;
            mstar::store16(mstar::round16(_mm512_add_ps(_mm512_load_ps(acc[half][r]), b), dst), dst, keep);
        }
    }
}

#endif

}  // namespace

extern "C" {

// whether this build has the AMX kernel and this process may use the tiles (else the caller keeps oneDNN)
int mstar_amx_linear_available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
    return permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// bytes of the packed weight for n outputs x k inputs
int64_t mstar_amx_packed_bytes(int64_t n, int64_t k) {
    return ((n + TILE_ROWS - 1) / TILE_ROWS) * ((k + TILE_K - 1) / TILE_K) * TILE_ROWS * TILE_K * 2;
}

// w [n, k] (row stride w_row) into tiles [n block][k chunk][pair][output][2], zero-padded at the edges
void mstar_amx_pack(const void *w, int64_t w_row, int64_t n, int64_t k, void *packed) {
    const bf16 *src = static_cast<const bf16 *>(w);
    bf16 *dst = static_cast<bf16 *>(packed);
    const int64_t blocks = (n + TILE_ROWS - 1) / TILE_ROWS, chunks = (k + TILE_K - 1) / TILE_K;
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t c = 0; c < chunks; ++c) {
            bf16 *tile = dst + (b * chunks + c) * TILE_ROWS * TILE_K;
            for (int64_t p = 0; p < TILE_K / 2; ++p)
                for (int64_t o = 0; o < TILE_ROWS; ++o)
                    for (int64_t e = 0; e < 2; ++e) {
                        const int64_t row = b * TILE_ROWS + o, col = c * TILE_K + 2 * p + e;
                        tile[(p * TILE_ROWS + o) * 2 + e] = row < n && col < k ? src[row * w_row + col] : bf16(0);
                    }
        }
}

// out [rows, n] (row stride out_row) = x [rows, k] (row stride x_row) @ w^T + bias [n] (or null), w packed by
// mstar_amx_pack; 0: done, 1: not built for AMX here, 2: no memory. `next` (the next call's weight, the panel
// kernels' mstar::NextWeight hint) is taken for the shared signature and not used: AMX tiles stream their own way
int mstar_amx_linear(const void *x, int64_t x_row, const void *packed, const void *bias, void *out, int64_t out_row,
                     int64_t rows, int64_t n, int64_t k, int threads, const void *next) {
    (void)next;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
    if (!permitted()) return 1;
    const bf16 *ws = static_cast<const bf16 *>(packed), *bs = static_cast<const bf16 *>(bias);
    bf16 *os = static_cast<bf16 *>(out);
    const int64_t blocks = (n + TILE_ROWS - 1) / TILE_ROWS, chunks = (k + TILE_K - 1) / TILE_K;
    const int64_t pairs = (blocks + 1) / 2;
    // a short last row group or a k edge: the inputs copied once into a zero-padded [16 x groups, chunks x 32]
    const bf16 *xs = static_cast<const bf16 *>(x);
    int64_t stride = x_row;
    bf16 *staged = nullptr;
    if (rows % TILE_ROWS != 0 || k % TILE_K != 0) {
        const int64_t padded_rows = (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
        stride = chunks * TILE_K;
        staged = static_cast<bf16 *>(std::calloc(padded_rows * stride, sizeof(bf16)));
        if (staged == nullptr) return 2;
        for (int64_t r = 0; r < rows; ++r) std::memcpy(staged + r * stride, xs + r * x_row, k * sizeof(bf16));
        xs = staged;
    }
#pragma omp parallel num_threads(threads)
    {
        configure();
        alignas(64) float acc[2][2][TILE_ROWS][TILE_ROWS];  // [row group][output block]
        // dynamic: a server's other threads share the cores, and a thread held up must not hold up the call (a block's
        // result does not depend on the thread that computes it)
#pragma omp for schedule(dynamic, 2)
        for (int64_t pair = 0; pair < pairs; ++pair) {
            const int64_t b0 = 2 * pair, n0 = b0 * TILE_ROWS;
            const bf16 *w0 = ws + b0 * chunks * TILE_ROWS * TILE_K;
            // (a lone last block computes its tile twice; only its own outputs are written)
            const bf16 *w1 = b0 + 1 < blocks ? w0 + chunks * TILE_ROWS * TILE_K : w0;
            const int64_t outs = n - n0 < 2 * TILE_ROWS ? n - n0 : 2 * TILE_ROWS;
            // two row groups at a time: each weight tile loaded once for both
            for (int64_t m0 = 0; m0 < rows; m0 += 2 * TILE_ROWS) {
                const bf16 *x0 = xs + m0 * stride;
                _tile_zero(0);
                _tile_zero(1);
                if (rows - m0 > TILE_ROWS) {
                    const bf16 *x1 = x0 + TILE_ROWS * stride;
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t c = 0; c < chunks; ++c) {
                        _tile_loadd(4, x0 + c * TILE_K, stride * sizeof(bf16));
                        _tile_loadd(5, x1 + c * TILE_K, stride * sizeof(bf16));
                        _tile_loadd(6, w0 + c * TILE_ROWS * TILE_K, 64);
                        _tile_loadd(7, w1 + c * TILE_ROWS * TILE_K, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(2, acc[1][0], 64);
                    _tile_stored(3, acc[1][1], 64);
                } else {
                    for (int64_t c = 0; c < chunks; ++c) {
                        _tile_loadd(4, x0 + c * TILE_K, stride * sizeof(bf16));
                        _tile_loadd(6, w0 + c * TILE_ROWS * TILE_K, 64);
                        _tile_loadd(7, w1 + c * TILE_ROWS * TILE_K, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                _tile_stored(0, acc[0][0], 64);
                _tile_stored(1, acc[0][1], 64);
                for (int64_t g = 0; g < 2 && m0 + g * TILE_ROWS < rows; ++g) {
                    const int64_t first = m0 + g * TILE_ROWS;
                    const int64_t group = rows - first < TILE_ROWS ? rows - first : TILE_ROWS;
                    finish(acc[g], group, n0, outs, bs, os + first * out_row, out_row);
                }
            }
        }
        _tile_release();
    }
    std::free(staged);
    return 0;
#else
    (void)x, (void)x_row, (void)packed, (void)bias, (void)out, (void)out_row, (void)rows, (void)n, (void)k, (void)threads;
    return 1;
#endif
}

}  // extern "C"
