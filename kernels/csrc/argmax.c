/* Row-wise argmax of a float32 matrix (greedy decoding's token pick), CPU.
 *
 * out[r] = the first index of the largest value of row r, or of its first
 * NaN if it has one: torch.argmax's answer. torch 2.13's CPU argmax tracks
 * an index per element without vectorizing, ~1.3 ms for [32, 32128] on our
 * 2-core AVX2 machines where its amax takes 0.06 ms. Here: one vectorized pass
 * for the max (and whether a NaN is present), one for the first position
 * holding it.
 *
 * Plain C ABI, loaded with ctypes by kernels/cpu_argmax.py; rows go to the
 * worker pool (parallel.h).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "parallel.h"

#define TARGET __attribute__((target("avx2,fma")))

int argmax_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

typedef struct {
    const float* x;
    int64_t* out;
    int64_t cols, row_stride;
} argmax_t;

TARGET static int64_t row_argmax(const float* x, int64_t n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, v);
    }
    float lanes[8], m = -INFINITY;
    int nan = _mm256_movemask_ps(vnan) != 0;
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; j < n; j++) {
        nan |= isnan(x[j]);
        m = x[j] > m ? x[j] : m;
    }
    const __m256 vm = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, vm, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    for (; j < n; j++)
        if (nan ? isnan(x[j]) : x[j] == m) return j;
    return 0; /* n == 0 cannot reach here: the caller refuses empty rows */
}

static void run_rows(const void* ctx, size_t begin, size_t end) {
    const argmax_t* a = (const argmax_t*)ctx;
    for (size_t r = begin; r < end; r++) a->out[r] = row_argmax(a->x + (int64_t)r * a->row_stride, a->cols);
}

/* x [rows, cols] with rows row_stride floats apart (cols contiguous), out [rows] int64. Returns 0 or -1 (see parallel.h). */
int argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out, int num_threads) {
    argmax_t a = {x, out, cols, row_stride};
    return parallel_for(run_rows, &a, (size_t)rows, num_threads);
}
