/* Few-row float32 products against a pre-packed weight, for CPU decode steps.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for M (a decode step's
 * sequences, 1..64) rows and a large N (a vocabulary projection). MKL's sgemm
 * streams such a weight at a fraction of its compute peak: it packs a panel of
 * W on every call and only then computes. Here W is packed once, at load
 * time, into panels of 16 output features stored k-major:
 *
 *     wp[p, k, j] = w[16 p + j, k]          (zero for 16 p + j >= N)
 *
 * so one decode step reads W exactly once, front to back, and each 64-byte
 * row of a panel feeds 2 x MR fused multiply-adds (MR = up to 6 rows of x
 * whose values are broadcast). 12 accumulators + 2 weight vectors + 1
 * broadcast fill the 16 AVX2 registers; the register blocking is the classic
 * GEMM micro-kernel of Goto & van de Geijn, "Anatomy of High-Performance
 * Matrix Multiplication" (ACM TOMS 34(3), 2008), with the packed operand
 * being the weight instead of a per-call copy.
 *
 * Summation order: each output is one running fp32 sum over k (MKL splits k
 * differently), so results differ from F.linear by float rounding only.
 *
 * Instruction sets, chosen at run time (packed_linear_isa): AVX2/FMA, and on
 * CPUs with AVX-512F a micro-kernel that holds a whole panel in one 512-bit
 * register, up to MR512_MAX = 12 rows per call (12 accumulators hide the FMA
 * latency; the broadcast of x is the FMA's embedded {1to16} operand). Each
 * output is the same running fp32 sum over k in the same order in both, so
 * the two give bit-identical results: the choice never changes a token. The
 * epilogue (bias, activation, residual) is the AVX2 code for both.
 *
 * Plain C ABI, loaded with ctypes by kernels/packed_linear.py (no Python.h).
 * Work is split over N across `num_threads` POSIX threads (parallel.h); the
 * AVX2/FMA and AVX-512 code is compiled per function (target attribute) and
 * refused at run time on CPUs without it.
 */
#include <immintrin.h>
#include <stddef.h>

#include "parallel.h"
#include "simd_math.h"

#define PANEL 16 /* output features per panel: two 8-float AVX registers */
#define MR_MAX 6 /* rows of x per AVX2 micro-kernel call */
#define MR512_MAX 12 /* rows of x per AVX-512 micro-kernel call */
#define ISA_AVX2 1
#define ISA_AVX512 2
#define TARGET512 __attribute__((target("avx512f,avx2,fma")))
#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_GELU 2 /* exact (erf) GELU */

int packed_linear_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int isa_in_use = 0; /* 0 = not chosen yet: the best this CPU has */

static int best_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2;
}

/* The micro-kernel's instruction set in use (ISA_AVX2 / ISA_AVX512); 0 where AVX2/FMA is missing. */
int packed_linear_isa(void) {
    if (!packed_linear_supported()) return 0;
    if (isa_in_use == 0) isa_in_use = best_isa();
    return isa_in_use;
}

/* Chooses the micro-kernel's instruction set (tests compare both on one machine): 0 = the best this CPU has.
 * Returns the one in use, or -1 (nothing changed) for one this CPU lacks or an unknown value. */
int packed_linear_set_isa(int isa) {
    if (!packed_linear_supported() || isa < 0 || isa > ISA_AVX512) return -1;
    if (isa == 0) isa = best_isa();
    if (isa == ISA_AVX512 && best_isa() != ISA_AVX512) return -1;
    isa_in_use = isa;
    return isa;
}

size_t packed_linear_packed_size(size_t n, size_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

void packed_linear_pack(const float* w, float* wp, size_t n, size_t k) {
    size_t panels = (n + PANEL - 1) / PANEL;
    for (size_t p = 0; p < panels; p++)
        for (size_t kk = 0; kk < k; kk++)
            for (size_t j = 0; j < PANEL; j++) {
                size_t row = p * PANEL + j;
                wp[(p * k + kk) * PANEL + j] = row < n ? w[row * k + kk] : 0.0f;
            }
}

#define REP1(M) M(0)
#define REP2(M) REP1(M) M(1)
#define REP3(M) REP2(M) M(2)
#define REP4(M) REP3(M) M(3)
#define REP5(M) REP4(M) M(4)
#define REP6(M) REP5(M) M(5)
#define ACC_DECL(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps(); const float* x##i = x + (i) * k;
#define ACC_STEP(i) b = _mm256_broadcast_ss(x##i + kk); a##i##0 = _mm256_fmadd_ps(b, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(b, w1, a##i##1);
#define ACC_STORE(i) acc[2 * (i)] = a##i##0; acc[2 * (i) + 1] = a##i##1;

/* acc[2 i], acc[2 i + 1] = x[i, :] . panel columns 0..7, 8..15, for i < MR. */
#define MICRO_KERNEL(MR)                                                                  \
    TARGET static void micro_kernel_##MR(const float* pw, const float* x, size_t k, __m256* acc) { \
        REP##MR(ACC_DECL)                                                                 \
        for (size_t kk = 0; kk < k; kk++) {                                               \
            __m256 w0 = _mm256_loadu_ps(pw + PANEL * kk), w1 = _mm256_loadu_ps(pw + PANEL * kk + 8), b; \
            REP##MR(ACC_STEP)                                                             \
        }                                                                                 \
        REP##MR(ACC_STORE)                                                                \
    }
MICRO_KERNEL(1) MICRO_KERNEL(2) MICRO_KERNEL(3) MICRO_KERNEL(4) MICRO_KERNEL(5) MICRO_KERNEL(6)

typedef void (*micro_kernel_t)(const float*, const float*, size_t, __m256*);
static const micro_kernel_t MICRO_KERNELS[MR_MAX + 1] = {0, micro_kernel_1, micro_kernel_2, micro_kernel_3,
                                                         micro_kernel_4, micro_kernel_5, micro_kernel_6};

/* AVX-512: one accumulator of 16 per row; written back as the two 8-float halves the AVX2 epilogue reads. */
#define REP7(M) REP6(M) M(6)
#define REP8(M) REP7(M) M(7)
#define REP9(M) REP8(M) M(8)
#define REP10(M) REP9(M) M(9)
#define REP11(M) REP10(M) M(10)
#define REP12(M) REP11(M) M(11)
#define ACC512_DECL(i) __m512 a##i = _mm512_setzero_ps(); const float* x##i = x + (i) * k;
#define ACC512_STEP(i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(x##i[kk]), w, a##i);
#define ACC512_STORE(i) acc[2 * (i)] = _mm512_castps512_ps256(a##i); \
    acc[2 * (i) + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a##i), 1));
#define MICRO_KERNEL512(MR)                                                                       \
    TARGET512 static void micro_kernel512_##MR(const float* pw, const float* x, size_t k, __m256* acc) { \
        REP##MR(ACC512_DECL)                                                                      \
        for (size_t kk = 0; kk < k; kk++) {                                                       \
            __m512 w = _mm512_loadu_ps(pw + PANEL * kk);                                          \
            REP##MR(ACC512_STEP)                                                                  \
        }                                                                                         \
        REP##MR(ACC512_STORE)                                                                     \
    }
MICRO_KERNEL512(1) MICRO_KERNEL512(2) MICRO_KERNEL512(3) MICRO_KERNEL512(4) MICRO_KERNEL512(5) MICRO_KERNEL512(6)
MICRO_KERNEL512(7) MICRO_KERNEL512(8) MICRO_KERNEL512(9) MICRO_KERNEL512(10) MICRO_KERNEL512(11) MICRO_KERNEL512(12)
static const micro_kernel_t MICRO_KERNELS512[MR512_MAX + 1] = {
    0, micro_kernel512_1, micro_kernel512_2, micro_kernel512_3, micro_kernel512_4, micro_kernel512_5, micro_kernel512_6,
    micro_kernel512_7, micro_kernel512_8, micro_kernel512_9, micro_kernel512_10, micro_kernel512_11, micro_kernel512_12};

typedef struct {
    const float *x, *wp, *bias, *residual;
    float* out;
    size_t m, n, k;
    int activation;
    const micro_kernel_t* kernels; /* MICRO_KERNELS or MICRO_KERNELS512 */
    size_t mr_max;                 /* rows per micro-kernel call: MR_MAX or MR512_MAX */
} job_t;

/* The epilogue's activation (packed_linear's `activation`). */
TARGET static inline __m256 activate(__m256 v, int activation) {
    if (activation == ACT_RELU) return _mm256_max_ps(_mm256_setzero_ps(), v); /* a NaN (second operand) stays NaN, as torch.relu */
    if (activation == ACT_GELU) return gelu_ps(v);
    return v;
}

/* Panels [first_panel, end_panel) of the output. */
TARGET static void run_panels(const void* ctx, size_t first_panel, size_t end_panel) {
    const job_t* j = (const job_t*)ctx;
    __m256 acc[2 * MR512_MAX];
    float tail[PANEL];
    for (size_t p = first_panel; p < end_panel; p++) {
        size_t n0 = p * PANEL, valid = j->n - n0 < PANEL ? j->n - n0 : PANEL;
        const float* pw = j->wp + p * j->k * PANEL;
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        if (j->bias && valid == PANEL) {
            b0 = _mm256_loadu_ps(j->bias + n0);
            b1 = _mm256_loadu_ps(j->bias + n0 + 8);
        }
        for (size_t m0 = 0; m0 < j->m; m0 += j->mr_max) {  /* the panel stays in L1/L2 across row groups */
            size_t mr = j->m - m0 < j->mr_max ? j->m - m0 : j->mr_max;
            j->kernels[mr](pw, j->x + m0 * j->k, j->k, acc);
            for (size_t i = 0; i < mr; i++) {
                float* o = j->out + (m0 + i) * j->n + n0;
                const float* res = j->residual ? j->residual + (m0 + i) * j->n + n0 : NULL;
                __m256 r0 = _mm256_add_ps(acc[2 * i], b0), r1 = _mm256_add_ps(acc[2 * i + 1], b1);
                if (valid == PANEL) {
                    r0 = activate(r0, j->activation);
                    r1 = activate(r1, j->activation);
                    if (res) {
                        r0 = _mm256_add_ps(_mm256_loadu_ps(res), r0);
                        r1 = _mm256_add_ps(_mm256_loadu_ps(res + 8), r1);
                    }
                    _mm256_storeu_ps(o, r0);
                    _mm256_storeu_ps(o + 8, r1);
                } else {  /* last, partial panel: bias added per element, then the activation and the residual */
                    _mm256_storeu_ps(tail, r0);
                    _mm256_storeu_ps(tail + 8, r1);
                    for (size_t c = 0; c < PANEL; c++) tail[c] += c < valid && j->bias ? j->bias[n0 + c] : 0.0f;
                    _mm256_storeu_ps(tail, activate(_mm256_loadu_ps(tail), j->activation));
                    _mm256_storeu_ps(tail + 8, activate(_mm256_loadu_ps(tail + 8), j->activation));
                    for (size_t c = 0; c < valid; c++) o[c] = res ? res[c] + tail[c] : tail[c];
                }
            }
        }
    }
}

/* x [m, k], wp packed from w [n, k], bias [n] or NULL, residual [m, n] or NULL, out [m, n]; all contiguous float32;
 * out = act(x w^T + bias) + residual, activation ACT_NONE / ACT_RELU / ACT_GELU (anything else: -2, nothing done);
 * the residual is added as torch adds two float32 tensors (one rounding), so the fused sum equals the unfused one
 * bit for bit. Returns 0, or -1 if a worker thread could not be started (its panels then run on the caller). */
int packed_linear(const float* x, const float* wp, const float* bias, const float* residual, float* out, size_t m,
                  size_t n, size_t k, int num_threads, int activation) {
    if (activation < ACT_NONE || activation > ACT_GELU) return -2;
    if (m == 0) return 0;
    int avx512 = packed_linear_isa() == ISA_AVX512;
    job_t job = {x,          wp, bias, residual, out, m, n, k, activation, avx512 ? MICRO_KERNELS512 : MICRO_KERNELS,
                 avx512 ? MR512_MAX : MR_MAX};
    return parallel_for(run_panels, &job, (n + PANEL - 1) / PANEL, num_threads);
}
