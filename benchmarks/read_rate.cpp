// The floor decode_linears.py compares the one-row kernels against: a plain read of a buffer, split in two
// contiguous halves over `threads` OpenMP threads (as the panel kernels split a weight), each 64-byte line loaded
// once and OR-ed into a sum the caller gets back (so the loads are not optimised away). Built by native.py.

#include <cstdint>

#include "mstar_native.h"

extern "C" {

// OR of every 64-bit word of bytes [0, size) (size a multiple of 64), read by `threads` threads
uint64_t mstar_read_rate(const void *data, int64_t size, int threads) {
    const char *base = static_cast<const char *>(data);
    const int64_t lines = size / 64;
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(| : total)
    {
#if defined(__AVX512F__)
        __m512i acc = _mm512_setzero_si512();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < lines; ++i) acc = _mm512_or_si512(acc, _mm512_loadu_si512(base + i * 64));
        total |= static_cast<uint64_t>(_mm512_reduce_or_epi64(acc));
#else
        uint64_t acc = 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < lines * 8; ++i) acc |= reinterpret_cast<const uint64_t *>(base)[i];
        total |= acc;
#endif
    }
    return total;
}

}  // extern "C"
