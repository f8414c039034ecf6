// This machine's ceilings, the figures BENCHMARKS.md's issue-53 sections measure the kernels against: fp32 FMA and
// AVX512-BF16 dot-product GFLOP/s a thread (register-only loops, 12 independent chains), and the rate at which every
// thread together reads a 538 MB huge-page buffer (SmolLM2-135M's fp32 weights) with AVX-512 loads.
//
//     gcc -O3 -march=native -fopenmp benchmarks/cpu_ceilings.c -o /tmp/cpu_ceilings && /tmp/cpu_ceilings
//
// Needs AVX-512 with AVX512-BF16 (the machine class the figures are for); OMP_NUM_THREADS sets the threads.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS(op) a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5); \
                   a6 = op(a6); a7 = op(a7); a8 = op(a8); a9 = op(a9); a10 = op(a10); a11 = op(a11);

static double peak(int bf16, long iters) {  // best of 5, GFLOP/s over every thread
    double best = 1e9;
    for (int r = 0; r < 5; ++r) {
        float sink = 0;
        const double t = now();
#pragma omp parallel reduction(+ : sink)
        {
            volatile float seed = omp_get_thread_num() * 1e-7f;  // (distinct chains: nothing for the compiler to fold)
            __m512 a0 = _mm512_set1_ps(seed), a1 = _mm512_set1_ps(seed + 1), a2 = _mm512_set1_ps(seed + 2),
                   a3 = _mm512_set1_ps(seed + 3), a4 = _mm512_set1_ps(seed + 4), a5 = _mm512_set1_ps(seed + 5),
                   a6 = _mm512_set1_ps(seed + 6), a7 = _mm512_set1_ps(seed + 7), a8 = _mm512_set1_ps(seed + 8),
                   a9 = _mm512_set1_ps(seed + 9), a10 = _mm512_set1_ps(seed + 10), a11 = _mm512_set1_ps(seed + 11);
            const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(1e-9f);
            const __m512bh bx = (__m512bh)_mm512_set1_epi16(0x3f80), by = (__m512bh)_mm512_set1_epi16(0x0001);
#define FMA(v) _mm512_fmadd_ps(v, x, y)
#define DOT(v) _mm512_dpbf16_ps(v, bx, by)
            if (bf16)
                for (long i = 0; i < iters; ++i) { CHAINS(DOT) }
            else
                for (long i = 0; i < iters; ++i) { CHAINS(FMA) }
            __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                     _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
            s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
            sink += _mm512_reduce_add_ps(s);
        }
        const double dt = now() - t;
        if (dt < best) best = dt;
        if (sink == 1234.5f) printf(" ");
    }
    return (double)iters * 12 * omp_get_max_threads() * (bf16 ? 64 : 32) / best / 1e9;
}

static float read_all(const float *a, size_t n) {
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const size_t lo = n / T * t, hi = n / T * (t + 1);
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (size_t i = lo; i + 64 <= hi; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(a + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(a + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(a + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(a + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
    return total;
}

int main(void) {
    const int threads = omp_get_max_threads();
    printf("threads %d\n", threads);
    printf("fp32 FMA:        %.1f GFLOP/s (%.1f a thread)\n", peak(0, 25000000), peak(0, 25000000) / threads);
    printf("bf16 vdpbf16ps:  %.1f GFLOP/s (%.1f a thread)\n", peak(1, 25000000), peak(1, 25000000) / threads);
    const size_t n = 538000000 / 4;
    float *a = aligned_alloc(2 << 20, n * 4);
    madvise(a, n * 4, MADV_HUGEPAGE);
    for (size_t i = 0; i < n; ++i) a[i] = 1.0f;
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {
        const double t = now();
        volatile float s = read_all(a, n);
        (void)s;
        const double dt = now() - t;
        if (dt < best) best = dt;
    }
    printf("read (538 MB):   %.1f GB/s\n", n * 4 / best / 1e9);
    free(a);
    return 0;
}
