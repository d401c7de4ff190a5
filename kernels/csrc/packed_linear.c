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
 * so one decode step reads W exactly once, front to back (software-prefetched
 * PREFETCH_BYTES ahead), and each 64-byte row of a panel feeds 2 x MR fused
 * multiply-adds (MR = up to 6 rows of x whose values are broadcast). 12
 * accumulators + 2 weight vectors + 1 broadcast fill the 16 AVX2 registers;
 * the register blocking is the classic GEMM micro-kernel of Goto & van de Geijn, "Anatomy of High-Performance
 * Matrix Multiplication" (ACM TOMS 34(3), 2008), with the packed operand
 * being the weight instead of a per-call copy.
 *
 * Summation order: each output is one running fp32 sum over k (MKL splits k
 * differently), so results differ from F.linear by float rounding only.
 *
 * Instruction sets, chosen at run time (packed_linear_isa; the decoder times both at start and keeps the faster:
 * kernels/calibration.py): AVX2/FMA, and on
 * CPUs with AVX-512F (unless ENCDEC_MAX_CPU_ISA=avx2: encdec_max_isa in parallel.h) a micro-kernel that holds a whole panel in one 512-bit
 * register, up to MR512_MAX = 12 rows per call (12 accumulators hide the FMA
 * latency; the broadcast of x is the FMA's embedded {1to16} operand). Each
 * output is the same running fp32 sum over k in the same order in both, so
 * the two give bit-identical results: the choice never changes a token. The
 * epilogue (bias, activation, residual) is the AVX2 code for both.
 *
 * bfloat16 weights (packed_linear_bf16, CPUs with AVX-512 BF16, no ENCDEC_MAX_CPU_ISA cap): the same panels with k in pairs, half the
 * bytes, x rounded to bf16 once per call, vdpbf16ps's 32 multiply-adds per instruction into fp32 sums, the same
 * epilogue and thread split; layout and rounding at MR_BF16_MAX below.
 *
 * Plain C ABI, loaded with ctypes by kernels/packed_linear.py (no Python.h).
 * Work is split over N across `num_threads` POSIX threads (parallel.h); the
 * AVX2/FMA and AVX-512 code is compiled per function (target attribute) and
 * refused at run time on CPUs without it.
 *
 * Over 300 lines: the float32 (AVX2, AVX-512) and bfloat16 micro-kernels share the packing scheme, the epilogue
 * and the thread split.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd_math.h"

#define PANEL 16 /* output features per panel: two 8-float AVX registers */
#define MR_MAX 6 /* rows of x per AVX2 micro-kernel call */
#define MR512_MAX 12 /* rows of x per AVX-512 micro-kernel call */
#define PREFETCH_BYTES 8192 /* every micro-kernel (float32 and bf16) prefetches the weight this far ahead, one 64-byte
                             * line per panel step, into the next panel near a panel's end (a thread's panels are
                             * adjacent): without it a weight streamed from memory stalls the dot products of a few
                             * rows; float32: 8 / 12 / 16 KiB alike on AMD Zen 5, 2 and 4 KiB slower */
#define X_ALIAS_FLOATS 1024 /* x rows this many floats (4 KiB) apart share L1 sets (packed_linear's padded copy) */
#define X_COPY_MIN_WEIGHT ((size_t)1 << 21) /* weight elements (N K) from which packed_linear copies such x rows */
#define ISA_AVX2 ENCDEC_ISA_AVX2
#define ISA_AVX512 ENCDEC_ISA_AVX512
#define TARGET512 __attribute__((target("avx512f,avx2,fma")))
#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_GELU 2 /* exact (erf) GELU */

int packed_linear_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int isa_in_use = 0; /* 0 = not chosen yet: the best this CPU has */

/* The best this CPU has under the ENCDEC_MAX_CPU_ISA cap (encdec_max_isa; an unknown value caps to AVX2). */
static int best_isa(void) {
    __builtin_cpu_init();
    int cap = encdec_max_isa();
    if (cap == ENCDEC_ISA_AVX2 || cap < 0) return ISA_AVX2;
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
#define ACC_DECL(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps(); const float* x##i = x + (i) * ldx;
#define ACC_STEP(i) b = _mm256_broadcast_ss(x##i + kk); a##i##0 = _mm256_fmadd_ps(b, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(b, w1, a##i##1);
#define ACC_STORE(i) acc[2 * (i)] = a##i##0; acc[2 * (i) + 1] = a##i##1;

/* acc[2 i], acc[2 i + 1] = x[i, :] . panel columns 0..7, 8..15, for i < MR. */
#define MICRO_KERNEL(MR)                                                                  \
    TARGET static void micro_kernel_##MR(const void* pw_, const void* x_, size_t ldx, size_t k, __m256* acc) { \
        const float *pw = pw_, *x = x_;                                                   \
        REP##MR(ACC_DECL)                                                                 \
        for (size_t kk = 0; kk < k; kk++) {                                               \
            __m256 w0 = _mm256_loadu_ps(pw + PANEL * kk), w1 = _mm256_loadu_ps(pw + PANEL * kk + 8), b; \
            _mm_prefetch((const char*)(pw + PANEL * kk) + PREFETCH_BYTES, _MM_HINT_T0);   \
            REP##MR(ACC_STEP)                                                             \
        }                                                                                 \
        REP##MR(ACC_STORE)                                                                \
    }
MICRO_KERNEL(1) MICRO_KERNEL(2) MICRO_KERNEL(3) MICRO_KERNEL(4) MICRO_KERNEL(5) MICRO_KERNEL(6)

/* acc[2 i], acc[2 i + 1] = row i of x . one panel (16 outputs, as two 8-float halves), for i < MR; `steps`
 * 64-byte weight rows per panel (k for float32, ceil(k / 2) k pairs for bfloat16), rows of x ldx 4-byte elements
 * apart (floats or bf16 pairs). */
typedef void (*micro_kernel_t)(const void* pw, const void* x, size_t ldx, size_t steps, __m256* acc);
static const micro_kernel_t MICRO_KERNELS[MR_MAX + 1] = {0, micro_kernel_1, micro_kernel_2, micro_kernel_3,
                                                         micro_kernel_4, micro_kernel_5, micro_kernel_6};

/* AVX-512: one accumulator of 16 per row; written back as the two 8-float halves the AVX2 epilogue reads. */
#define REP7(M) REP6(M) M(6)
#define REP8(M) REP7(M) M(7)
#define REP9(M) REP8(M) M(8)
#define REP10(M) REP9(M) M(9)
#define REP11(M) REP10(M) M(10)
#define REP12(M) REP11(M) M(11)
#define ACC512_DECL(i) __m512 a##i = _mm512_setzero_ps(); const float* x##i = x + (i) * ldx;
#define ACC512_STEP(i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(x##i[kk]), w, a##i);
#define ACC512_STORE(i) acc[2 * (i)] = _mm512_castps512_ps256(a##i); \
    acc[2 * (i) + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a##i), 1));
#define MICRO_KERNEL512(MR)                                                                       \
    TARGET512 static void micro_kernel512_##MR(const void* pw_, const void* x_, size_t ldx, size_t k, __m256* acc) { \
        const float *pw = pw_, *x = x_;                                                           \
        REP##MR(ACC512_DECL)                                                                      \
        for (size_t kk = 0; kk < k; kk++) {                                                       \
            __m512 w = _mm512_loadu_ps(pw + PANEL * kk);                                          \
            _mm_prefetch((const char*)(pw + PANEL * kk) + PREFETCH_BYTES, _MM_HINT_T0);           \
            REP##MR(ACC512_STEP)                                                                  \
        }                                                                                         \
        REP##MR(ACC512_STORE)                                                                     \
    }
MICRO_KERNEL512(1) MICRO_KERNEL512(2) MICRO_KERNEL512(3) MICRO_KERNEL512(4) MICRO_KERNEL512(5) MICRO_KERNEL512(6)
MICRO_KERNEL512(7) MICRO_KERNEL512(8) MICRO_KERNEL512(9) MICRO_KERNEL512(10) MICRO_KERNEL512(11) MICRO_KERNEL512(12)
static const micro_kernel_t MICRO_KERNELS512[MR512_MAX + 1] = {
    0, micro_kernel512_1, micro_kernel512_2, micro_kernel512_3, micro_kernel512_4, micro_kernel512_5, micro_kernel512_6,
    micro_kernel512_7, micro_kernel512_8, micro_kernel512_9, micro_kernel512_10, micro_kernel512_11, micro_kernel512_12};

/* A call of one or two rows (a decode step of one or two sequences) has one or two running sums per 8 or 16 outputs:
 * each FMA waits for the last one of its chain (4-5 cycles), and the weight is read one panel at a time. The wide
 * micro-kernels take up to 4 panels at once (as many weight streams, G x MR x 2 or G x MR independent chains), so the
 * FMAs overlap and the weight streams at the memory's pace. Each output is still the one running fp32 sum over k in
 * order, so they equal the one-panel kernels bit for bit (a row's result is the same alone or in any batch).
 * acc[(g MR + i) 2 + h]: panel g, row i, half h. Panels are panel_bytes apart (steps x 64). */
typedef void (*wide_kernel_t)(const void* pw, size_t panel_bytes, const void* x, size_t ldx, size_t steps,
                              __m256* acc);
#define WIDE_MAX_ROWS 2
#define WIDE_KERNEL(MR, G)                                                                                         \
    TARGET static void wide_kernel_##MR##x##G(const void* pw_, size_t panel_bytes, const void* x_, size_t ldx,      \
                                              size_t k, __m256* acc) {                                            \
        const float* x = x_;                                                                                       \
        const char* base = pw_;                                                                                    \
        __m256 a[G][MR][2];                                                                                        \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)   \
            a[g][i][0] = a[g][i][1] = _mm256_setzero_ps();                                                         \
        for (size_t kk = 0; kk < k; kk++) {                                                                        \
            __m256 b[MR];                                                                                          \
            _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) b[i] = _mm256_broadcast_ss(x + i * ldx + kk);     \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {                                                  \
                const float* w = (const float*)(base + g * panel_bytes) + PANEL * kk;                              \
                __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);                                       \
                _mm_prefetch((const char*)w + PREFETCH_BYTES, _MM_HINT_T0);                                        \
                _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) {                                             \
                    a[g][i][0] = _mm256_fmadd_ps(b[i], w0, a[g][i][0]);                                            \
                    a[g][i][1] = _mm256_fmadd_ps(b[i], w1, a[g][i][1]);                                            \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) { \
            acc[(g * MR + i) * 2] = a[g][i][0];                                                                    \
            acc[(g * MR + i) * 2 + 1] = a[g][i][1];                                                                \
        }                                                                                                          \
    }
/* AVX2: up to 8 (one row) and 12 (two rows) accumulators of the 16 registers */
WIDE_KERNEL(1, 2) WIDE_KERNEL(1, 3) WIDE_KERNEL(1, 4) WIDE_KERNEL(2, 2) WIDE_KERNEL(2, 3)
#define WIDE_KERNEL512(MR, G)                                                                                      \
    TARGET512 static void wide_kernel512_##MR##x##G(const void* pw_, size_t panel_bytes, const void* x_,            \
                                                    size_t ldx, size_t k, __m256* acc) {                          \
        const float* x = x_;                                                                                       \
        const char* base = pw_;                                                                                    \
        __m512 a[G][MR];                                                                                           \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++)   \
            a[g][i] = _mm512_setzero_ps();                                                                         \
        for (size_t kk = 0; kk < k; kk++) {                                                                        \
            __m512 b[MR];                                                                                          \
            _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) b[i] = _mm512_set1_ps(x[i * ldx + kk]);           \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {                                                  \
                const float* w = (const float*)(base + g * panel_bytes) + PANEL * kk;                              \
                __m512 wv = _mm512_loadu_ps(w);                                                                    \
                _mm_prefetch((const char*)w + PREFETCH_BYTES, _MM_HINT_T0);                                        \
                _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) a[g][i] = _mm512_fmadd_ps(b[i], wv, a[g][i]); \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) _Pragma("GCC unroll 2") for (int i = 0; i < MR; i++) { \
            acc[(g * MR + i) * 2] = _mm512_castps512_ps256(a[g][i]);                                               \
            acc[(g * MR + i) * 2 + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[g][i]), 1));    \
        }                                                                                                          \
    }
/* AVX-512: 4 and 8 accumulators. Not more panels: the streams are K x 64 bytes apart (a multiple of 4 KiB), so they
 * and their prefetched lines share L1 sets; 8 panels (16 lines in a set of 12 ways) measured slower than 4 on an
 * Intel Xeon for a weight read from cache. */
WIDE_KERNEL512(1, 2) WIDE_KERNEL512(1, 3) WIDE_KERNEL512(1, 4) WIDE_KERNEL512(2, 2) WIDE_KERNEL512(2, 3)
WIDE_KERNEL512(2, 4)
#define WIDE_PANELS_MAX 4
/* [rows][panels]: the kernel of that many panels at once (NULL: none); a thread's chunk of panels (parallel.h: about
 * 4 per thread) takes the widest that fits, then narrower ones. */
static const wide_kernel_t WIDE_KERNELS[WIDE_MAX_ROWS + 1][WIDE_PANELS_MAX + 1] = {
    {0}, {0, 0, wide_kernel_1x2, wide_kernel_1x3, wide_kernel_1x4}, {0, 0, wide_kernel_2x2, wide_kernel_2x3}};
static const wide_kernel_t WIDE_KERNELS512[WIDE_MAX_ROWS + 1][WIDE_PANELS_MAX + 1] = {
    {0}, {0, 0, wide_kernel512_1x2, wide_kernel512_1x3, wide_kernel512_1x4},
    {0, 0, wide_kernel512_2x2, wide_kernel512_2x3, wide_kernel512_2x4}};
static const size_t WIDE_PANELS[WIDE_MAX_ROWS + 1] = {0, 4, 3};
static const size_t WIDE_PANELS512[WIDE_MAX_ROWS + 1] = {0, 4, 4};

/* bfloat16 weights (packed_linear_bf16): AVX-512 BF16's vdpbf16ps multiplies 16 lanes of bf16 pairs and adds both
 * products to fp32 accumulators, 32 multiply-adds per instruction, at half the weight bytes of float32. Layout
 * (packed_linear_bf16_pack), k in pairs, K padded to even with a zero:
 *
 *     wp[p, q, j, h] = bf16(w[16 p + j, 2 q + h])   (uint16 bits; zero for 16 p + j >= N or 2 q + h >= K)
 *
 * so a panel step (one k pair) is again 64 bytes, the float32 panel step's size. The x rows are rounded to bf16 the
 * same way (round to nearest even, as torch's .to(torch.bfloat16)) into pairs x2[i, q] = (bf16(x[i, 2 q]),
 * bf16(x[i, 2 q + 1])), once per call; each step broadcasts one pair per row ({1to16} memory operand). Per the Intel
 * SDM's VDPBF16PS pseudocode (and as measured on AMD Zen 5), acc = fp32(fp32(acc + x[2 q + 1] w[2 q + 1]) +
 * x[2 q] w[2 q]): the products of two bf16 are exact in fp32, so each output is one running fp32 sum over k in
 * the order 1, 0, 3, 2, ..., with denormal inputs, products and sums taken as zero (DAZ / FTZ). */
#define MR_BF16_MAX 16 /* rows of x per bf16 micro-kernel call: 16 accumulators of the 32 registers */
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
typedef uint32_t __attribute__((may_alias)) bf16_pair_t; /* two bf16 (low: even k), written by vector stores */

int packed_linear_bf16_supported(void) {
    __builtin_cpu_init();
    return packed_linear_supported() && encdec_max_isa() == 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

size_t packed_linear_bf16_packed_size(size_t n, size_t k) { return (n + PANEL - 1) / PANEL * PANEL * (k + (k & 1)); }

/* bf16 bits of f, rounded to nearest even; NaN -> 0x7fc0 (both as c10::BFloat16's round_to_nearest_even). */
static uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The bf16 layout above from w [n, k] row-major: float32 (wf, rounded) or bf16 bits (wb, copied); the other NULL. */
static void pack_bf16(const float* wf, const uint16_t* wb, uint16_t* wp, size_t n, size_t k) {
    size_t panels = (n + PANEL - 1) / PANEL, pairs = (k + 1) / 2;
    for (size_t p = 0; p < panels; p++)
        for (size_t q = 0; q < pairs; q++)
            for (size_t j = 0; j < PANEL; j++)
                for (size_t h = 0; h < 2; h++) {
                    size_t row = p * PANEL + j, kk = 2 * q + h;
                    uint16_t v = 0;
                    if (row < n && kk < k) v = wb ? wb[row * k + kk] : bf16_rne(wf[row * k + kk]);
                    wp[((p * pairs + q) * PANEL + j) * 2 + h] = v;
                }
}

void packed_linear_bf16_pack(const float* w, uint16_t* wp, size_t n, size_t k) { pack_bf16(w, NULL, wp, n, k); }

void packed_linear_bf16_pack_bf16(const uint16_t* w, uint16_t* wp, size_t n, size_t k) { pack_bf16(NULL, w, wp, n, k); }

/* x [m, k] float32 -> x2 [m, ldx] bf16 pairs: row i's ceil(k / 2) pairs (an odd K's last one padded with zero) at
 * x2 + i ldx, the rest unused. vcvtne2ps2bf16 rounds to nearest even as bf16_rne (a NaN stays NaN; denormals become
 * zero, as the dot product would read them). */
TARGET_BF16 static void x_to_bf16_pairs(const float* x, bf16_pair_t* x2, size_t ldx, size_t m, size_t k) {
    size_t pairs = (k + 1) / 2;
    for (size_t i = 0; i < m; i++) {
        const float* row = x + i * k;
        uint16_t* o = (uint16_t*)(x2 + i * ldx);
        for (size_t c = 0; c < 2 * pairs; c += 32) { /* c < k: the loads' masks read only x[i, c .. k) */
            size_t left = k - c, lo = left < 16 ? left : 16, hi = left < 16 ? 0 : left - 16 < 16 ? left - 16 : 16;
            size_t store = 2 * pairs - c < 32 ? 2 * pairs - c : 32;
            __m512 a = _mm512_maskz_loadu_ps((__mmask16)((1u << lo) - 1), row + c);
            __m512 b = _mm512_maskz_loadu_ps((__mmask16)((1u << hi) - 1), row + c + 16);
            __m512bh v = _mm512_cvtne2ps_pbh(b, a); /* elements 0..15 from a */
            _mm512_mask_storeu_epi16(o + c, (__mmask32)((1ull << store) - 1), (__m512i)v);
        }
    }
}

#define REP13(M) REP12(M) M(12)
#define REP14(M) REP13(M) M(13)
#define REP15(M) REP14(M) M(14)
#define REP16(M) REP15(M) M(15)
#define ACCBF_DECL(i) __m512 a##i = _mm512_setzero_ps(); const bf16_pair_t* x##i = x + (i) * ldx;
/* a += x's pair (broadcast) . w: vdpbf16ps with the pair as its {1to16} memory operand, written out because GCC 12
 * does not fold _mm512_set1_epi32 into it (a vpbroadcastd per row is slower at 16 rows); AT&T | Intel syntax. */
#define ACCBF_STEP(i) __asm__("vdpbf16ps {%1%{1to16%}, %2, %0|%0, %2, %1%{1to16%}}" : "+v"(a##i) : "m"(x##i[q]), "v"(w));
#define MICRO_KERNEL_BF16(MR)                                                                    \
    TARGET_BF16 static void micro_kernel_bf16_##MR(const void* pw_, const void* x_, size_t ldx, size_t k, __m256* acc) { \
        const uint16_t* pw = pw_;                                                                \
        const bf16_pair_t* x = x_;                                                               \
        REP##MR(ACCBF_DECL)                                                                      \
        for (size_t q = 0; q < k; q++) {                                                         \
            __m512bh w = (__m512bh)_mm512_loadu_si512(pw + 2 * PANEL * q);                       \
            _mm_prefetch((const char*)(pw + 2 * PANEL * q) + PREFETCH_BYTES, _MM_HINT_T0);      \
            REP##MR(ACCBF_STEP)                                                                  \
        }                                                                                        \
        REP##MR(ACC512_STORE)                                                                    \
    }
MICRO_KERNEL_BF16(1) MICRO_KERNEL_BF16(2) MICRO_KERNEL_BF16(3) MICRO_KERNEL_BF16(4) MICRO_KERNEL_BF16(5)
MICRO_KERNEL_BF16(6) MICRO_KERNEL_BF16(7) MICRO_KERNEL_BF16(8) MICRO_KERNEL_BF16(9) MICRO_KERNEL_BF16(10)
MICRO_KERNEL_BF16(11) MICRO_KERNEL_BF16(12) MICRO_KERNEL_BF16(13) MICRO_KERNEL_BF16(14) MICRO_KERNEL_BF16(15) MICRO_KERNEL_BF16(16)
static const micro_kernel_t MICRO_KERNELS_BF16[MR_BF16_MAX + 1] = {
    0, micro_kernel_bf16_1, micro_kernel_bf16_2, micro_kernel_bf16_3, micro_kernel_bf16_4, micro_kernel_bf16_5,
    micro_kernel_bf16_6, micro_kernel_bf16_7, micro_kernel_bf16_8, micro_kernel_bf16_9, micro_kernel_bf16_10,
    micro_kernel_bf16_11, micro_kernel_bf16_12, micro_kernel_bf16_13, micro_kernel_bf16_14, micro_kernel_bf16_15, micro_kernel_bf16_16};

typedef struct {
    const void *x, *wp; /* float32 x and weight, or bfloat16 pairs (packed_linear_bf16) */
    const float *bias, *residual;
    float* out;
    size_t m, n, steps, ldx; /* the micro-kernel's (see micro_kernel_t) */
    int activation;
    const micro_kernel_t* kernels; /* MICRO_KERNELS, MICRO_KERNELS512 or MICRO_KERNELS_BF16 */
    size_t mr_max;                 /* rows per micro-kernel call: MR_MAX, MR512_MAX or MR_BF16_MAX */
    const wide_kernel_t (*wide)[WIDE_PANELS_MAX + 1]; /* WIDE_KERNELS / WIDE_KERNELS512 (m <= WIDE_MAX_ROWS), or NULL */
    const size_t* wide_panels;                        /* the most panels per wide-kernel call, by rows */
} job_t;

/* The epilogue's activation (packed_linear's `activation`). */
TARGET static inline __m256 activate(__m256 v, int activation) {
    if (activation == ACT_RELU) return _mm256_max_ps(_mm256_setzero_ps(), v); /* a NaN (second operand) stays NaN, as torch.relu */
    if (activation == ACT_GELU) return gelu_ps(v);
    return v;
}

/* Rows [m0, m0 + mr) of panel p from the micro-kernel's sums acc[2 i], acc[2 i + 1]: + bias, activation, + residual. */
TARGET static void epilogue(const job_t* j, size_t p, size_t m0, size_t mr, const __m256* acc) {
    float tail[PANEL];
    size_t n0 = p * PANEL, valid = j->n - n0 < PANEL ? j->n - n0 : PANEL;
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (j->bias && valid == PANEL) {
        b0 = _mm256_loadu_ps(j->bias + n0);
        b1 = _mm256_loadu_ps(j->bias + n0 + 8);
    }
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
        } else { /* last, partial panel: bias added per element, then the activation and the residual */
            _mm256_storeu_ps(tail, r0);
            _mm256_storeu_ps(tail + 8, r1);
            for (size_t c = 0; c < PANEL; c++) tail[c] += c < valid && j->bias ? j->bias[n0 + c] : 0.0f;
            _mm256_storeu_ps(tail, activate(_mm256_loadu_ps(tail), j->activation));
            _mm256_storeu_ps(tail + 8, activate(_mm256_loadu_ps(tail + 8), j->activation));
            for (size_t c = 0; c < valid; c++) o[c] = res ? res[c] + tail[c] : tail[c];
        }
    }
}

/* Panels [first_panel, end_panel) of the output. */
TARGET static void run_panels(const void* ctx, size_t first_panel, size_t end_panel) {
    const job_t* j = (const job_t*)ctx;
    __m256 acc[2 * (MR512_MAX > MR_BF16_MAX ? MR512_MAX : MR_BF16_MAX)];
    _Static_assert(WIDE_PANELS_MAX * WIDE_MAX_ROWS <= (MR512_MAX > MR_BF16_MAX ? MR512_MAX : MR_BF16_MAX),
                   "a wide micro-kernel's sums fit acc");
    size_t panel_bytes = j->steps * 64; /* a panel step is 64 bytes in both layouts */
    size_t p = first_panel;
    if (j->wide && j->m <= WIDE_MAX_ROWS) { /* one or two rows: up to 4 panels at a time; a last single one below */
        while (end_panel - p >= 2) {
            size_t g = end_panel - p < j->wide_panels[j->m] ? end_panel - p : j->wide_panels[j->m];
            j->wide[j->m][g]((const char*)j->wp + p * panel_bytes, panel_bytes, j->x, j->ldx, j->steps, acc);
            for (size_t q = 0; q < g; q++) epilogue(j, p + q, 0, j->m, acc + 2 * q * j->m);
            p += g;
        }
    }
    for (; p < end_panel; p++) {
        const char* pw = (const char*)j->wp + p * panel_bytes;
        for (size_t m0 = 0; m0 < j->m; m0 += j->mr_max) { /* the panel stays in L1/L2 across row groups */
            size_t mr = j->m - m0 < j->mr_max ? j->m - m0 : j->mr_max;
            j->kernels[mr](pw, (const char*)j->x + m0 * j->ldx * 4, j->ldx, j->steps, acc);
            epilogue(j, p, m0, mr, acc);
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
    /* AVX-512 reads 12 rows of x per step: rows a multiple of 4 KiB apart (K % 1024 == 0) fall in one L1 set,
     * 12 lines plus the streamed weight's in a set of 12 ways (AMD Zen 5), and evict each other. A copy with rows
     * an odd number of 64-byte lines apart puts them in distinct sets (as packed_linear_bf16's x2); the kernel
     * reads the same floats, so the sums are unchanged. Made only where it measured faster on Zen 5: two or more
     * full 12-row blocks (the later blocks read the panel from cache, so the misses on x are what they wait on) and a weight
     * of X_COPY_MIN_WEIGHT elements or more (the copy, on the calling thread, costs more than it saves on smaller
     * ones). AVX2's 6 rows fit the ways (a copy measured no faster there). No memory for the copy: x as it is. */
    size_t ldx = k;
    float* xp = NULL;
    if (avx512 && m >= 2 * MR512_MAX && k % X_ALIAS_FLOATS == 0 && n * k >= X_COPY_MIN_WEIGHT) {
        xp = malloc(m * (k + 16) * sizeof *xp);
        if (xp) {
            ldx = k + 16; /* k / 16 lines (even) plus one */
            for (size_t i = 0; i < m; i++) memcpy(xp + i * ldx, x + i * k, k * sizeof *xp);
        }
    }
    job_t job = {xp ? xp : x, wp, bias, residual, out, m, n, k, ldx, activation, avx512 ? MICRO_KERNELS512 : MICRO_KERNELS,
                 avx512 ? MR512_MAX : MR_MAX, avx512 ? WIDE_KERNELS512 : WIDE_KERNELS,
                 avx512 ? WIDE_PANELS512 : WIDE_PANELS};
    int rc = parallel_for(run_panels, &job, (n + PANEL - 1) / PANEL, num_threads);
    free(xp);
    return rc;
}

#define X2_STACK_PAIRS 8192 /* x2 of up to 32 KiB on the stack, larger ones malloc'd */

/* packed_linear with wp packed by packed_linear_bf16_pack[_bf16] from w [n, k]; x, bias, residual, out as there
 * (float32). out = act(bf16(x) bf16(w)^T + bias) + residual: the bias, activation and residual in float32 as in
 * packed_linear. Returns 0, -1 (a worker thread could not be started: all was still computed), -2 (unknown
 * activation), -3 (this CPU lacks AVX-512 BF16) or -4 (no memory for x's bf16 copy); nothing done on -2..-4. */
int packed_linear_bf16(const float* x, const uint16_t* wp, const float* bias, const float* residual, float* out,
                       size_t m, size_t n, size_t k, int num_threads, int activation) {
    if (activation < ACT_NONE || activation > ACT_GELU) return -2;
    if (!packed_linear_bf16_supported()) return -3;
    if (m == 0) return 0;
    /* Rows of x2 an odd number of 64-byte lines apart: the micro-kernel's MR rows then fall in distinct L1 sets
     * (rows 4 KiB apart, as for K = 2048, would all share one set of 12 ways, and evict each other every step). */
    size_t pairs = (k + 1) / 2, ldx = ((pairs + 15) / 16 | 1) * 16;
    bf16_pair_t stack_x2[X2_STACK_PAIRS];
    bf16_pair_t* x2 = m * ldx <= X2_STACK_PAIRS ? stack_x2 : malloc(m * ldx * sizeof *x2);
    if (x2 == NULL) return -4;
    x_to_bf16_pairs(x, x2, ldx, m, k);
    job_t job = {x2, wp, bias, residual, out, m, n, pairs, ldx, activation, MICRO_KERNELS_BF16, MR_BF16_MAX, NULL, NULL};
    int rc = parallel_for(run_panels, &job, (n + PANEL - 1) / PANEL, num_threads);
    if (x2 != stack_x2) free(x2);
    return rc;
}
