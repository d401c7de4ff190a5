/* AVX2/FMA helpers shared by the kernels of kernels/csrc (static inline: each includer gets its copy).
 *
 * exp_ps: the Cephes expf range reduction and polynomial (S. L. Moshier,
 * Cephes Math Library, expf.c) for x <= 0, max relative error ~2e-7.
 * erf_ps: Abramowitz & Stegun, Handbook of Mathematical Functions, 7.1.26
 * (|error| <= 1.5e-7), the form ATen's AVX2 vectorized float erf uses, so GELU
 * built on it matches torch's CPU GELU to float rounding where torch runs its
 * AVX2 kernels. Where torch dispatches AVX-512 (torch.backends.cpu.
 * get_cpu_capability() == "AVX512"), its GELU differs at the tails
 * (gelu(-5): torch -1.19e-6, this -1.49e-6, exact -1.43e-6; gelu(inf): torch
 * NaN, this inf): tests compare with the float64 GELU instead.
 */
#ifndef ENCDEC_SIMD_MATH_H
#define ENCDEC_SIMD_MATH_H

#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))

/* exp(x) for x <= 0; NaN gives NaN. */
TARGET static inline __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    x = _mm256_max_ps(lo, x); /* max_ps returns its second operand for a NaN: NaN stays NaN, as in the reference */
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

TARGET static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* erf(x), 8 lanes; NaN gives NaN. */
TARGET static inline __m256 erf_ps(__m256 x) {
    const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), ax, one));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(ax, ax)));  /* exp(-x^2) */
    __m256 y = _mm256_fnmadd_ps(p, e, one);  /* 1 - p e */
    return _mm256_or_ps(y, sign);
}

/* GELU(x) = x / 2 (1 + erf(x / sqrt 2)) (Hendrycks & Gimpel, 2016; torch's approximate="none"). */
TARGET static inline __m256 gelu_ps(__m256 x) {
    __m256 e = erf_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)));
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
}

#endif
