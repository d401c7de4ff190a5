/* Row normalizations on CPU: T5's RMS norm and LayerNorm, float32.
 *
 *     rms:   out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps)
 *     layer: out[r] = w * (x[r] - mean(x[r])) / sqrt(var(x[r]) + eps) + b     (biased variance)
 *
 * over the last dim of a contiguous [rows, d] input (w, b optional: NULL
 * means 1 and 0). LayerNorm is Ba, Kiros & Hinton, "Layer Normalization"
 * (2016); the RMS form is Zhang & Sennrich, "Root Mean Square Layer
 * Normalization" (NeurIPS 2019), as T5 and HF's T5LayerNorm use it (no mean
 * subtraction, no bias). The variance is computed in two passes (mean first,
 * then the mean of squared deviations), in fp32 with 32 running lanes: results
 * differ from torch's by float rounding only.
 *
 * Why: a decode step normalizes a few rows ([32, 512]) ~19 times; torch's
 * reductions there cost 30-100 us each (an OpenMP region for 16k floats),
 * this ~3 us. Large inputs are split over rows (parallel.h). Plain C ABI,
 * loaded with ctypes by kernels/cpu_norm.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#include "parallel.h"
#include "simd_math.h"

#define MIN_PARALLEL_FLOATS 262144 /* below this many floats in all (1 MB), one thread: waking a worker costs more */

int row_norm_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

typedef struct {
    const float *x, *w, *b;
    float* out;
    size_t d;
    float eps;
    int rms;
} job_t;

/* Sum of x[c] (sq = 0) or of (x[c] - m)^2 (sq = 1) over a row: 4 independent 8-lane sums (no add latency chain). */
TARGET static inline float row_sum(const float* x, size_t d, float m, int sq) {
    __m256 vm = _mm256_set1_ps(m), a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t c = 0;
#define TERM(off) (sq ? (v = _mm256_sub_ps(_mm256_loadu_ps(x + c + (off)), vm), _mm256_mul_ps(v, v)) : _mm256_loadu_ps(x + c + (off)))
    __m256 v;
    for (; c + 32 <= d; c += 32) {
        a0 = _mm256_add_ps(a0, TERM(0));
        a1 = _mm256_add_ps(a1, TERM(8));
        a2 = _mm256_add_ps(a2, TERM(16));
        a3 = _mm256_add_ps(a3, TERM(24));
    }
    for (; c + 8 <= d; c += 8) a0 = _mm256_add_ps(a0, TERM(0));
#undef TERM
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; c < d; c++) s += sq ? (x[c] - m) * (x[c] - m) : x[c];
    return s;
}

TARGET static void run_rows(const void* ctx, size_t first, size_t end) {
    const job_t* j = (const job_t*)ctx;
    const float *w = j->w, *b = j->b; /* locals: the stores below cannot change them */
    size_t d = j->d, d8 = d / 8 * 8;
    int rms = j->rms;
    float eps = j->eps;
    for (size_t r = first; r < end; r++) {
        const float* x = j->x + r * d;
        float* o = j->out + r * d;
        float mean = rms ? 0.0f : row_sum(x, d, 0.0f, 0) / (float)d;
        float inv = 1.0f / sqrtf(row_sum(x, d, mean, 1) / (float)d + eps);
        __m256 vm = _mm256_set1_ps(mean), vi = _mm256_set1_ps(inv);
        size_t c = 0;
        for (; c < d8; c += 8) {
            __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), vm), vi);
            if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + c));
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + c));
            _mm256_storeu_ps(o + c, v);
        }
        for (; c < d; c++) {
            float v = (x[c] - mean) * inv;
            if (w) v *= w[c];
            if (b) v += b[c];
            o[c] = v;
        }
    }
}

/* x, out [rows, d] contiguous float32 (out may be x); w, b [d] or NULL; rms: 1 RMS norm, 0 LayerNorm.
 * Returns 0, or -1 if a worker thread could not be started (the rows still all ran). */
int row_norm(const float* x, const float* w, const float* b, float* out, size_t rows, size_t d, float eps, int rms,
             int num_threads) {
    if (rows == 0 || d == 0) return 0;
    job_t job = {x, w, b, out, d, eps, rms};
    if (rows * d < MIN_PARALLEL_FLOATS) num_threads = 1;
    return parallel_for(run_rows, &job, rows, num_threads);
}
