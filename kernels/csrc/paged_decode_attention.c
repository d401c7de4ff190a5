/* Decode-step attention over a paged float32 or bfloat16 KV cache, read in place (CPU).
 *
 * One query per sequence (a decode step): for sequence b and head h,
 *
 *     s_j   = scale * q[b, h] . k_j  (+ bias[h, min(L_b - 1 - j, N - 1)])   j < L_b
 *     out   = sum_j softmax(s)_j v_j
 *
 * where key j of sequence b lives in block block_tables[b, j / block_size]
 * at offset j % block_size of k_cache / v_cache [num_blocks, block_size, H, D]
 * (the layout of kernels/paged_attention.py, whose torch reference gathers
 * the blocks into a dense copy first; this kernel never builds that copy).
 * The optional bias is T5's relative position bias by causal distance, the
 * query sitting at position L_b - 1. A sequence with L_b == 0 gets zeros.
 *
 * Softmax is the usual max-subtracted one over a per-thread score buffer; exp is the Cephes expf range reduction and polynomial
 * (S. L. Moshier, Cephes Math Library, expf.c), eight lanes at a time.
 *
 * For head_dim % 64 == 0 (every model we serve) each head is done on its own
 * (head_major): scores four keys per pass, then the weighted sum of values
 * with the head's 64 outputs held in registers; a t5-small batch-32 step's
 * call went 135 -> 84 us (24 keys) and 220 -> 132 us (40 keys) on 2 cores.
 * Other head sizes read a sequence's K and V token by token, all heads
 * together. A batch of fewer sequences than 2 x threads is split by heads
 * as well. paged_write_kv is the scatter of write_kv (per token, a memcpy or a bfloat16 rounding of its row).
 * Plain C ABI, loaded with ctypes by
 * kernels/cpu_paged_attention.py; work items go to POSIX threads (parallel.h). Block ids
 * and lengths are checked before anything is read: a bad one returns an error
 * code instead of reading outside the cache.
 *
 * Over 300 lines: one kernel (scores, softmax, weighted values) in its two layouts and two cache dtypes, with the
 * cache write; they share the helpers and must keep one summation order.
 *
 * Cache dtype: both functions take an int cache_dtype (CACHE_F32 0, CACHE_BF16 1) and untyped cache pointers,
 * one entry point each instead of _bf16 twins, so decode_layer.c passes a layer's dtypes through unchanged. The
 * query, the math and the output stay float32. A bfloat16 element is the high half of a float32, so reading one
 * widens it exactly (zero-extend to 32 bits, shift left 16: AVX2's vpmovzxwd + vpslld, 8 lanes). The kernel bodies
 * are instantiated once per dtype (always_inline with the dtype a constant) and differ only in that load and the
 * software prefetch's distance (PREFETCH_KEYS); the token-by-token path widens a chunk of rows and runs the float32 code
 * itself (token_scores / token_values). So a bfloat16 cache gives bit for bit what the float32 kernel gives on the
 * same cache upcast, every sum in the float32 kernel's order: results do not depend on the batch or the thread
 * split, as for float32. No AVX-512 variant: 16-lane FMAs would reorder the sums (another result than the float32
 * kernel's), and the widening is not what bounds the kernel (bfloat16 beats float32 on cache-resident shapes too;
 * a one-shuffle widening, vbroadcasti128 + vpshufb, was no faster); AVX-512 CPUs run this AVX2 code. Writing
 * rounds float32 to bfloat16 to nearest even (bf16_round).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd_math.h"

enum { CACHE_F32 = 0, CACHE_BF16 = 1 }; /* cache_dtype: float32, bfloat16 */
#define INLINE __attribute__((always_inline)) static inline

/* Element i of a cache row p as float32: loaded (float32) or widened exactly (bfloat16: its 16 bits become the
 * high half of a float32). bf16 is a constant at every call, so each instantiation has only its own load. */
TARGET INLINE __m256 load8(const void* p, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))), 16));
    return _mm256_loadu_ps((const float*)p + i);
}

TARGET INLINE float load1(const void* p, int64_t i, int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float*)p)[i];
}

/* p + i elements. */
INLINE const void* elem(const void* p, int64_t i, int bf16) { return (const char*)p + i * (bf16 ? 2 : 4); }

/* How many keys ahead head_major prefetches a cache's rows. A head's pass reads D elements of every H * D row (one
 * 128-byte run per key at D = 64 for bfloat16, 256 bytes for float32; rows 1 or 2 KiB apart in block order) and
 * without software prefetch it is bound by memory latency, not bandwidth: bfloat16 was then no faster than float32
 * on a Whisper-sized cross pool. bfloat16: 32 was the best of 8 / 16 / 32 / 48 / 64 on Zen 5. float32: 16, the
 * same bytes ahead, was as fast as 32 on long contexts and faster on short ones (fewer keys prefetched in vain);
 * 64 was slower. A pool already in L2 runs a little slower with the prefetch (its extra loads); one streamed from
 * memory, as in a decode step over every layer, faster. */
#define PREFETCH_KEYS_BF16 32
#define PREFETCH_KEYS_F32 16
#define PREFETCH_KEYS(bf16) ((bf16) ? PREFETCH_KEYS_BF16 : PREFETCH_KEYS_F32)

/* The cache lines of n cache elements (bfloat16 or float32) from p into L1. */
INLINE void prefetch_elems(const void* p, int64_t n, int bf16) {
    for (int64_t i = 0; i < (bf16 ? 2 : 4) * n; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T0);
}


int paged_decode_attention_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* a . b over d floats, a float32, b a cache row. */
TARGET INLINE float dot(const float* a, const void* b, int64_t d, int bf16) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b, i, bf16), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b, i + 8, bf16), acc1);
    }
    for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b, i, bf16), acc0);
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < d; i++) s += a[i] * load1(b, i, bf16);
    return s;
}

typedef struct {
    const float* q;
    const void *k_cache, *v_cache; /* float32 or bfloat16 (the instantiation of run_items says which) */
    const float* bias;
    const int64_t *block_tables, *context_lens;
    float* out;
    int64_t num_heads, head_dim, block_size, bt_stride, bias_len, max_len, head_groups, q_stride;
    float scale;
} attn_t;

/* Scores of four keys (cache rows) against q (d floats, d % 8 == 0): four dot products, one horizontal reduction. */
TARGET INLINE __m128 dot4(const float* q, const void* k0, const void* k1, const void* k2, const void* k3, int64_t d,
                          int bf16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        s0 = _mm256_fmadd_ps(qv, load8(k0, i, bf16), s0);
        s1 = _mm256_fmadd_ps(qv, load8(k1, i, bf16), s1);
        s2 = _mm256_fmadd_ps(qv, load8(k2, i, bf16), s2);
        s3 = _mm256_fmadd_ps(qv, load8(k3, i, bf16), s3);
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3)); /* lanes i and i + 4: halves of s_i */
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Softmax of s[0 .. len) in place (max-subtracted; s must have room for len + 8 floats); all -inf gives zeros. */
TARGET static void softmax_row(float* s, int64_t len) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; j++) mx = s[j] > mx ? s[j] : mx;
    if (mx == -INFINITY) { /* every key masked by a -inf bias: zeros, as the reference */
        memset(s, 0, sizeof(float) * (size_t)len);
        return;
    }
    for (int64_t j = len; j < len + 8; j++) s[j] = -INFINITY; /* pads the last vector: exp gives 0 */
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(x, vmx)), _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_UQ));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    const float inv = 1.0f / hsum(vsum);
    for (int64_t j = 0; j < len; j++) s[j] *= inv;
}

/* Scores of keys [j0, j1) (j0 % 4 == 0) of one head against qh into s[j0 .. j1): four keys a dot4, a tail of fewer
 * with dot, each times scale; with prefetch, the keys PREFETCH_KEYS ahead (below len) prefetched. rows[j]: key j's row in the
 * cache; kc: the cache at the head's first element. The one place scores are computed (head_major, tile_head). */
TARGET INLINE void key_scores(const attn_t* a, const float* qh, const void* kc, const int64_t* rows, int64_t j0,
                              int64_t j1, int64_t len, float* s, int prefetch, int bf16) {
    const int64_t D = a->head_dim, row = a->num_heads * D;
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        if (prefetch && j + PREFETCH_KEYS(bf16) + 4 <= len) {
            const int64_t* r = rows + j + PREFETCH_KEYS(bf16);
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                prefetch_elems(elem(kc, r[0] * row + d0, bf16), 64, bf16);
                prefetch_elems(elem(kc, r[1] * row + d0, bf16), 64, bf16);
                prefetch_elems(elem(kc, r[2] * row + d0, bf16), 64, bf16);
                prefetch_elems(elem(kc, r[3] * row + d0, bf16), 64, bf16);
            }
        }
        _mm_storeu_ps(s + j, _mm_mul_ps(dot4(qh, elem(kc, rows[j] * row, bf16), elem(kc, rows[j + 1] * row, bf16),
                                             elem(kc, rows[j + 2] * row, bf16), elem(kc, rows[j + 3] * row, bf16), D,
                                             bf16),
                                        _mm_set1_ps(a->scale)));
    }
    for (; j < j1; j++) s[j] = dot(qh, elem(kc, rows[j] * row, bf16), D, bf16) * a->scale;
}

/* Head h's scores s[0 .. len) made probabilities: T5's bias by causal distance added (if any), then softmax_row. */
TARGET INLINE void bias_softmax(const attn_t* a, int64_t h, float* s, int64_t len) {
    if (a->bias) {
        const float* bias = a->bias + h * a->bias_len;
        for (int64_t j = 0; j < len; j++) {
            const int64_t dist = len - 1 - j;
            s[j] += bias[dist < a->bias_len ? dist : a->bias_len - 1];
        }
    }
    softmax_row(s, len);
}

/* o[0 .. 64) = (from_out ? o : 0) + sum_{j0 <= j < j1} p[j] v_j[d0 .. d0 + 64), the fmadds in key order into eight
 * registers (a store and reload between calls rounds nothing); with prefetch, the values PREFETCH_KEYS ahead
 * (below len) prefetched. vc: the cache at the head's first element. The one place values are summed (head_major, tile_head). */
TARGET INLINE void weighted_values64(const void* vc, const int64_t* rows, int64_t row, int64_t d0, const float* p,
                                     int64_t j0, int64_t j1, int64_t len, float* o, int from_out, int prefetch,
                                     int bf16) {
    __m256 o0, o1, o2, o3, o4, o5, o6, o7;
    if (from_out) {
        o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8), o2 = _mm256_loadu_ps(o + 16);
        o3 = _mm256_loadu_ps(o + 24), o4 = _mm256_loadu_ps(o + 32), o5 = _mm256_loadu_ps(o + 40);
        o6 = _mm256_loadu_ps(o + 48), o7 = _mm256_loadu_ps(o + 56);
    } else {
        o0 = o1 = o2 = o3 = o4 = o5 = o6 = o7 = _mm256_setzero_ps();
    }
    for (int64_t j = j0; j < j1; j++) {
        const __m256 w = _mm256_set1_ps(p[j]);
        const void* v = elem(vc, rows[j] * row + d0, bf16);
        if (prefetch && j + PREFETCH_KEYS(bf16) < len)
            prefetch_elems(elem(vc, rows[j + PREFETCH_KEYS(bf16)] * row + d0, bf16), 64, bf16);
        o0 = _mm256_fmadd_ps(w, load8(v, 0, bf16), o0);
        o1 = _mm256_fmadd_ps(w, load8(v, 8, bf16), o1);
        o2 = _mm256_fmadd_ps(w, load8(v, 16, bf16), o2);
        o3 = _mm256_fmadd_ps(w, load8(v, 24, bf16), o3);
        o4 = _mm256_fmadd_ps(w, load8(v, 32, bf16), o4);
        o5 = _mm256_fmadd_ps(w, load8(v, 40, bf16), o5);
        o6 = _mm256_fmadd_ps(w, load8(v, 48, bf16), o6);
        o7 = _mm256_fmadd_ps(w, load8(v, 56, bf16), o7);
    }
    _mm256_storeu_ps(o, o0);
    _mm256_storeu_ps(o + 8, o1);
    _mm256_storeu_ps(o + 16, o2);
    _mm256_storeu_ps(o + 24, o3);
    _mm256_storeu_ps(o + 32, o4);
    _mm256_storeu_ps(o + 40, o5);
    _mm256_storeu_ps(o + 48, o6);
    _mm256_storeu_ps(o + 56, o7);
}

/* Heads [h0, h1) of one sequence when head_dim % 64 == 0 (every model we serve has 64): per head, the scores four
 * keys at a time, then sum_j p_j v_j with 64 output floats held in eight registers (no read-modify-write of an
 * accumulator in memory for every key). rows[j]: key j's row in the cache; s: len + 8 floats of scratch. */
TARGET INLINE void head_major(const attn_t* a, const float* q, float* out, const int64_t* rows, int64_t len,
                              int64_t h0, int64_t h1, float* s, int bf16) {
    const int64_t H = a->num_heads, D = a->head_dim, row = H * D;
    for (int64_t h = h0; h < h1; h++) {
        const void *kc = elem(a->k_cache, h * D, bf16), *vc = elem(a->v_cache, h * D, bf16);
        key_scores(a, q + h * D, kc, rows, 0, len, len, s, 1, bf16);
        bias_softmax(a, h, s, len);
        for (int64_t d0 = 0; d0 < D; d0 += 64)
            weighted_values64(vc, rows, row, d0, s, 0, len, len, out + h * D + d0, 0, 1, bf16);
    }
}

/* The token-by-token path (head_dim % 64 != 0) over heads [h0, h1) of a sequence, keys j0 .. j0 + n: their scores
 * (scores[h, j], rows max_len + 8 apart) against q, and their share sum_j p[h, j] v_j[h] added to acc; k[i] / v[i]:
 * key j0 + i's float32 row [H, D]. Not inlined: a float32 cache's rows (all keys in one call) and a bfloat16
 * cache's rows widened to float32 (TOKEN_CHUNK keys a call) run this one machine code, so their scalar tails
 * (D % 8) round alike whatever the compiler made of them. */
TARGET __attribute__((noinline)) static void token_scores(const attn_t* a, const float* q, const float* const* k,
                                                          int64_t j0, int64_t n, int64_t len, int64_t h0, int64_t h1,
                                                          float* scores) {
    const int64_t D = a->head_dim, stride = a->max_len + 8;
    for (int64_t j = j0; j < j0 + n; j++) {
        const int64_t dist = len - 1 - j, col = a->bias ? (dist < a->bias_len ? dist : a->bias_len - 1) : 0;
        for (int64_t h = h0; h < h1; h++)
            scores[h * stride + j] = dot(q + h * D, k[j - j0] + h * D, D, 0) * a->scale +
                                     (a->bias ? a->bias[h * a->bias_len + col] : 0.0f);
    }
}

TARGET __attribute__((noinline)) static void token_values(const attn_t* a, const float* const* v, int64_t j0,
                                                          int64_t n, int64_t h0, int64_t h1, const float* scores,
                                                          float* acc) {
    const int64_t D = a->head_dim, stride = a->max_len + 8;
    for (int64_t j = j0; j < j0 + n; j++) {
        for (int64_t h = h0; h < h1; h++) {
            const float p = scores[h * stride + j];
            const __m256 w = _mm256_set1_ps(p);
            float *o = acc + h * D;
            const float* vh = v[j - j0] + h * D;
            int64_t i = 0;
            for (; i + 8 <= D; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(vh + i), _mm256_loadu_ps(o + i)));
            for (; i < D; i++) o[i] += p * vh[i];
        }
    }
}

#define TOKEN_CHUNK 16 /* keys of a bfloat16 cache widened per token_scores / token_values call */

/* Rows[j0 .. j0 + n) of a bfloat16 cache (row ids rows[j], H * D elements each), heads [h0, h1) widened to float32
 * (exact) into buf [n, H, D]; ptr[i] = key j0 + i's row in buf. */
TARGET static void widen_rows(const void* cache, const int64_t* rows, int64_t j0, int64_t n, int64_t H, int64_t D,
                              int64_t h0, int64_t h1, float* buf, const float** ptr) {
    for (int64_t i = 0; i < n; i++) {
        const void* src = elem(cache, rows[j0 + i] * H * D, 1);
        float* dst = buf + i * H * D;
        int64_t e = h0 * D;
        for (; e + 8 <= h1 * D; e += 8) _mm256_storeu_ps(dst + e, load8(src, e, 1));
        for (; e < h1 * D; e++) dst[e] = load1(src, e, 1);
        ptr[i] = dst;
    }
}

/* Work items [begin, end): item = b * head_groups + g covers sequence b's heads [g H / G, (g + 1) H / G).
 * head_dim % 64 == 0: head_major. Otherwise keys and values are read token by token (each token's heads are
 * adjacent in the cache), once per item (token_scores, token_values; a bfloat16 cache's rows widened first, a chunk
 * at a time). Instantiated per cache dtype (run_items_f32, run_items_bf16). */
TARGET INLINE void run_items(const void* ctx, size_t begin, size_t end, int bf16) {
    const attn_t* a = (const attn_t*)ctx;
    const int64_t H = a->num_heads, D = a->head_dim, bs = a->block_size, G = a->head_groups;
    float* scores = malloc(sizeof(float) * (size_t)(H * (a->max_len + 8)));  /* [heads, max_len + 8] */
    float* acc = malloc(sizeof(float) * (size_t)(H * D));
    int64_t* rows = malloc(sizeof(int64_t) * (size_t)(a->max_len + 1));  /* rows[j]: key j's row in the cache */
    /* Token-by-token path: ptr[j] key j's float32 row (in the cache, or widened into buf: bfloat16) */
    const float** ptr = D % 64 ? malloc(sizeof(float*) * (size_t)(a->max_len + 1)) : NULL;
    float* buf = D % 64 && bf16 ? malloc(sizeof(float) * (size_t)(TOKEN_CHUNK * H * D)) : NULL;
    if (scores == NULL || acc == NULL || rows == NULL || (D % 64 && ptr == NULL) || (D % 64 && bf16 && buf == NULL)) {  /* cannot happen for sane sizes; leave NaN so it is seen */
        for (size_t it = begin; it < end; it++)
            for (int64_t i = 0; i < H * D; i++) a->out[(int64_t)it / G * H * D + i] = NAN;
        free(scores);
        free(acc);
        free(rows);
        free(ptr);
        free(buf);
        return;
    }
    const int64_t stride = a->max_len + 8;
    for (size_t it = begin; it < end; it++) {
        const int64_t b = (int64_t)it / G, g = (int64_t)it % G, h0 = g * H / G, h1 = (g + 1) * H / G;
        const int64_t len = a->context_lens[b], *table = a->block_tables + b * a->bt_stride;
        const float* q = a->q + b * a->q_stride;
        float* out = a->out + b * H * D;
        if (len <= 0) {
            memset(out + h0 * D, 0, sizeof(float) * (size_t)((h1 - h0) * D));
            continue;
        }
        for (int64_t j = 0; j < len; j++) rows[j] = table[j / bs] * bs + j % bs;
        if (D % 64 == 0) {
            head_major(a, q, out, rows, len, h0, h1, scores, bf16);
            continue;
        }
        if (bf16) {
            for (int64_t j0 = 0; j0 < len; j0 += TOKEN_CHUNK) {
                const int64_t n = len - j0 < TOKEN_CHUNK ? len - j0 : TOKEN_CHUNK;
                widen_rows(a->k_cache, rows, j0, n, H, D, h0, h1, buf, ptr);
                token_scores(a, q, ptr, j0, n, len, h0, h1, scores);
            }
        } else {
            for (int64_t j = 0; j < len; j++) ptr[j] = (const float*)a->k_cache + rows[j] * H * D;
            token_scores(a, q, ptr, 0, len, len, h0, h1, scores);
        }
        for (int64_t h = h0; h < h1; h++) softmax_row(scores + h * stride, len);
        memset(acc + h0 * D, 0, sizeof(float) * (size_t)((h1 - h0) * D));
        if (bf16) {
            for (int64_t j0 = 0; j0 < len; j0 += TOKEN_CHUNK) {
                const int64_t n = len - j0 < TOKEN_CHUNK ? len - j0 : TOKEN_CHUNK;
                widen_rows(a->v_cache, rows, j0, n, H, D, h0, h1, buf, ptr);
                token_values(a, ptr, j0, n, h0, h1, scores, acc);
            }
        } else {
            for (int64_t j = 0; j < len; j++) ptr[j] = (const float*)a->v_cache + rows[j] * H * D;
            token_values(a, ptr, 0, len, h0, h1, scores, acc);
        }
        memcpy(out + h0 * D, acc + h0 * D, sizeof(float) * (size_t)((h1 - h0) * D));
    }
    free(scores);
    free(acc);
    free(rows);
    free(ptr);
    free(buf);
}

TARGET static void run_items_f32(const void* ctx, size_t begin, size_t end) { run_items(ctx, begin, end, 0); }
TARGET static void run_items_bf16(const void* ctx, size_t begin, size_t end) { run_items(ctx, begin, end, 1); }

/* Rows that read the same keys: consecutive rows of one length over the same used block ids (a prefill's
 * cross-attention rows, expanded by query_rows; the best_of samples of one window over its cross KV). Their
 * (row tile, head) items read each tile of KEY_TILE keys and values once for up to ROW_TILE rows (from L1) instead
 * of once per row, and a head's keys and values stay in L2 across the tiles of its rows (items head-major). Every
 * row's sums are head_major's, in its order: dot4 over the same groups of four keys (KEY_TILE % 4 == 0, the tail
 * with dot), the same softmax_row, and per output lane the fmadds over keys in key order (the accumulators stored
 * to out and reloaded between key tiles, which rounds nothing). So a row's result is bit for bit what it gets
 * alone: results still do not depend on the batch. 225 rows x 1500 keys x 6 heads of 64 (a Whisper tiny prefill's
 * cross-attention): measured in docs/benchmarks.md. */
#define ROW_TILE 8
#define KEY_TILE 64

typedef struct {
    const attn_t* a;
    const int64_t* tile_row;  /* [num_tiles]: first row of tile t (rows of a tile share their keys) */
    const int64_t* tile_rows; /* [num_tiles]: rows in tile t (1 .. ROW_TILE) */
    int64_t num_tiles;
} tiles_t;

TARGET INLINE void tile_head(const attn_t* a, int64_t b0, int64_t n, int64_t h, const int64_t* rows, int64_t len,
                             float* s, int bf16) {
    const int64_t H = a->num_heads, D = a->head_dim, row = H * D, stride = len + 8;
    const void *kc = elem(a->k_cache, h * D, bf16), *vc = elem(a->v_cache, h * D, bf16);
    for (int64_t j0 = 0; j0 < len; j0 += KEY_TILE) {
        const int64_t j1 = j0 + KEY_TILE < len ? j0 + KEY_TILE : len;
        for (int64_t r = 0; r < n; r++)
            key_scores(a, a->q + (b0 + r) * a->q_stride + h * D, kc, rows, j0, j1, len, s + r * stride, r == 0, bf16);
    }
    for (int64_t r = 0; r < n; r++) bias_softmax(a, h, s + r * stride, len);
    for (int64_t d0 = 0; d0 < D; d0 += 64)
        for (int64_t j0 = 0; j0 < len; j0 += KEY_TILE) {
            const int64_t j1 = j0 + KEY_TILE < len ? j0 + KEY_TILE : len;
            for (int64_t r = 0; r < n; r++)
                weighted_values64(vc, rows, row, d0, s + r * stride, j0, j1, len, a->out + (b0 + r) * H * D + h * D + d0,
                                  j0 > 0, r == 0, bf16);
        }
}

/* Items [begin, end) of tiles_t: item = h * num_tiles + t (head-major), tile t's rows for head h. */
TARGET INLINE void run_tiles(const void* ctx, size_t begin, size_t end, int bf16) {
    const tiles_t* T = (const tiles_t*)ctx;
    const attn_t* a = T->a;
    const int64_t H = a->num_heads, D = a->head_dim, bs = a->block_size;
    float* s = malloc(sizeof(float) * (size_t)(ROW_TILE * (a->max_len + 8)));
    int64_t* rows = malloc(sizeof(int64_t) * (size_t)(a->max_len + 1));
    if (s == NULL || rows == NULL) { /* cannot happen for sane sizes; leave NaN so it is seen */
        for (size_t it = begin; it < end; it++) {
            const int64_t t = (int64_t)it % T->num_tiles, h = (int64_t)it / T->num_tiles;
            for (int64_t r = 0; r < T->tile_rows[t]; r++)
                for (int64_t i = 0; i < D; i++) a->out[(T->tile_row[t] + r) * H * D + h * D + i] = NAN;
        }
        free(s);
        free(rows);
        return;
    }
    int64_t rows_of = -1; /* the tile whose keys rows[] holds */
    for (size_t it = begin; it < end; it++) {
        const int64_t t = (int64_t)it % T->num_tiles, h = (int64_t)it / T->num_tiles;
        const int64_t b0 = T->tile_row[t], n = T->tile_rows[t], len = a->context_lens[b0];
        if (len <= 0) {
            for (int64_t r = 0; r < n; r++) memset(a->out + (b0 + r) * H * D + h * D, 0, sizeof(float) * (size_t)D);
            continue;
        }
        if (rows_of != t) {
            const int64_t* table = a->block_tables + b0 * a->bt_stride;
            for (int64_t j = 0; j < len; j++) rows[j] = table[j / bs] * bs + j % bs;
            rows_of = t;
        }
        tile_head(a, b0, n, h, rows, len, s, bf16);
    }
    free(s);
    free(rows);
}

TARGET static void run_tiles_f32(const void* ctx, size_t begin, size_t end) { run_tiles(ctx, begin, end, 0); }
TARGET static void run_tiles_bf16(const void* ctx, size_t begin, size_t end) { run_tiles(ctx, begin, end, 1); }

/* Whether row b reads the keys of row b - 1: the same length and the same used block ids. */
static int same_keys(const int64_t* block_tables, int64_t bt_stride, const int64_t* context_lens, int64_t b,
                     int64_t block_size) {
    const int64_t len = context_lens[b];
    if (len != context_lens[b - 1]) return 0;
    const int64_t used = len / block_size + (len % block_size != 0);
    return memcmp(block_tables + b * bt_stride, block_tables + (b - 1) * bt_stride, sizeof(int64_t) * (size_t)used) == 0;
}

/* The calls whose rows share keys (head_dim % 64 == 0): cut into tiles of up to ROW_TILE rows of one run of rows over
 * the same keys, run head-major. Returns the parallel_for code, or 1 when no two rows share keys (nothing done:
 * the per-row path runs). */
static int run_shared_keys(const attn_t* a, int64_t batch, int num_threads, int cache_dtype) {
    int shared = 0;
    for (int64_t b = 1; b < batch && !shared; b++)
        shared = same_keys(a->block_tables, a->bt_stride, a->context_lens, b, a->block_size);
    if (!shared) return 1;
    int64_t* tile_row = malloc(sizeof(int64_t) * (size_t)batch);
    int64_t* tile_rows = malloc(sizeof(int64_t) * (size_t)batch);
    if (tile_row == NULL || tile_rows == NULL) {
        free(tile_row);
        free(tile_rows);
        return 1;
    }
    int64_t num_tiles = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (b > 0 && tile_rows[num_tiles - 1] < ROW_TILE &&
            same_keys(a->block_tables, a->bt_stride, a->context_lens, b, a->block_size)) {
            tile_rows[num_tiles - 1]++;
            continue;
        }
        tile_row[num_tiles] = b;
        tile_rows[num_tiles++] = 1;
    }
    tiles_t T = {a, tile_row, tile_rows, num_tiles};
    const int rc = parallel_for(cache_dtype == CACHE_BF16 ? run_tiles_bf16 : run_tiles_f32, &T,
                                (size_t)(num_tiles * a->num_heads), num_threads);
    free(tile_row);
    free(tile_rows);
    return rc;
}

/* q [B, H, D] with sequence b's H * D floats contiguous at q + b * q_stride (a row of a fused q/k/v product);
 * k_cache, v_cache [num_blocks, block_size, H, D] of cache_dtype (CACHE_F32: float32, CACHE_BF16: bfloat16);
 * block_tables [B, bt_stride]; context_lens [B]; bias [H, bias_len] or NULL; out [B, H, D]. All else contiguous;
 * float32 / int64. Returns 0; -1 if a worker thread could not be started (its pairs then ran on the caller);
 * -2 if a length is negative or needs more than bt_stride blocks; -3 if a block id that would
 * be read is outside [0, num_blocks); -4 if cache_dtype is neither. Nothing is read or written on -2 / -3 / -4. */
int paged_decode_attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int cache_dtype,
                           const int64_t* block_tables, int64_t bt_stride, const int64_t* context_lens, const float* bias,
                           int64_t bias_len, float* out, int64_t batch, int64_t num_heads, int64_t head_dim,
                           int64_t num_blocks, int64_t block_size, float scale, int num_threads) {
    if (cache_dtype != CACHE_F32 && cache_dtype != CACHE_BF16) return -4;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = context_lens[b];
        if (len < 0) return -2;
        const int64_t used = len / block_size + (len % block_size != 0); /* no overflow near INT64_MAX */
        if (used > bt_stride) return -2;
        for (int64_t i = 0; i < used; i++)
            if (block_tables[b * bt_stride + i] < 0 || block_tables[b * bt_stride + i] >= num_blocks) return -3;
        max_len = len > max_len ? len : max_len;
    }
    /* Whole sequences per work item when there are enough of them for the threads; else heads are split too. */
    int64_t groups = num_threads < 1 ? 1 : (2 * (int64_t)num_threads + batch - 1) / (batch > 0 ? batch : 1);
    groups = groups < 1 ? 1 : groups > num_heads ? num_heads : groups;
    attn_t a = {q, k_cache, v_cache, bias, block_tables, context_lens, out,
                num_heads, head_dim, block_size, bt_stride, bias_len, max_len, groups, q_stride, scale};
    if (head_dim % 64 == 0 && batch > 1) {
        const int rc = run_shared_keys(&a, batch, num_threads, cache_dtype);
        if (rc != 1) return rc;
    }
    return parallel_for(cache_dtype == CACHE_BF16 ? run_items_bf16 : run_items_f32, &a, (size_t)(batch * groups),
                        num_threads);
}

/* float32 -> bfloat16 bits, rounded to nearest even (add 0x7fff plus the kept part's lowest bit, keep the high
 * half: overflow rounds to +-inf, subnormals stay subnormal); a NaN becomes 0xffff, the NaN torch's vectorized
 * CPU conversion (hence x.to(torch.bfloat16)) writes, so a written cache equals torch's bit for bit. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return f != f ? (uint16_t)0xffff : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* dst[0 .. n) = bf16_round(src[0 .. n)), eight at a time (vpackusdw keeps each 16-bit result: all are <= 0xffff). */
TARGET static void row_to_bf16(uint16_t* dst, const float* src, int64_t n) {
    int64_t i = 0;
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0xffff);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(src + i);
        const __m256i u = _mm256_castps_si256(x);
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        r = _mm256_srli_epi32(r, 16);
        r = _mm256_blendv_epi8(nan, r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* lanes 0..3, 4..7 */
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_castsi256_si128(packed));
    }
    for (; i < n; i++) dst[i] = bf16_round(src[i]);
}

/* write_kv of kernels/paged_attention.py: token i's key and value (row = H * D floats, at key + i * key_stride and
 * value + i * value_stride) into k_cache / v_cache [num_slots, row] of cache_dtype at slots[i]: copied (CACHE_F32)
 * or rounded to nearest even (CACHE_BF16, bf16_round); a negative slot (a padding token) is skipped. Every slot is
 * checked first: one at or past num_slots returns -3 and nothing is written; -4: cache_dtype is neither. */
int paged_write_kv(const float* key, const float* value, int64_t key_stride, int64_t value_stride, void* k_cache,
                   void* v_cache, int cache_dtype, const int64_t* slots, int64_t t, int64_t row, int64_t num_slots) {
    if (cache_dtype != CACHE_F32 && cache_dtype != CACHE_BF16) return -4;
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= num_slots) return -3;
    for (int64_t i = 0; i < t; i++) {
        if (slots[i] < 0) continue;
        if (cache_dtype == CACHE_BF16) {
            row_to_bf16((uint16_t*)k_cache + slots[i] * row, key + i * key_stride, row);
            row_to_bf16((uint16_t*)v_cache + slots[i] * row, value + i * value_stride, row);
        } else {
            memcpy((float*)k_cache + slots[i] * row, key + i * key_stride, sizeof(float) * (size_t)row);
            memcpy((float*)v_cache + slots[i] * row, value + i * value_stride, sizeof(float) * (size_t)row);
        }
    }
    return 0;
}
