/* Decode-step attention over a paged float32 KV cache, read in place (CPU).
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
 * as well. paged_write_kv is the scatter of write_kv (one memcpy per token). Plain C ABI, loaded with ctypes by
 * kernels/cpu_paged_attention.py; work items go to POSIX threads (parallel.h). Block ids
 * and lengths are checked before anything is read: a bad one returns an error
 * code instead of reading outside the cache.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd_math.h"


int paged_decode_attention_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

TARGET static inline float dot(const float* a, const float* b, int64_t d) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    const float *q, *k_cache, *v_cache, *bias;
    const int64_t *block_tables, *context_lens;
    float* out;
    int64_t num_heads, head_dim, block_size, bt_stride, bias_len, max_len, head_groups, q_stride;
    float scale;
} attn_t;

/* Scores of four keys against q (d floats, d % 8 == 0): four dot products, one horizontal reduction. */
TARGET static inline __m128 dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        s0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), s0);
        s1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), s1);
        s2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), s2);
        s3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), s3);
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

/* Heads [h0, h1) of one sequence when head_dim % 64 == 0 (every model we serve has 64): per head, the scores four
 * keys at a time, then sum_j p_j v_j with 64 output floats held in eight registers (no read-modify-write of an
 * accumulator in memory for every key). rows[j]: key j's row in the cache; s: len + 8 floats of scratch. */
TARGET static void head_major(const attn_t* a, const float* q, float* out, const int64_t* rows, int64_t len,
                              int64_t h0, int64_t h1, float* s) {
    const int64_t H = a->num_heads, D = a->head_dim, row = H * D;
    for (int64_t h = h0; h < h1; h++) {
        const float *qh = q + h * D, *kc = a->k_cache + h * D, *vc = a->v_cache + h * D;
        int64_t j = 0;
        for (; j + 4 <= len; j += 4)
            _mm_storeu_ps(s + j, _mm_mul_ps(dot4(qh, kc + rows[j] * row, kc + rows[j + 1] * row, kc + rows[j + 2] * row,
                                                 kc + rows[j + 3] * row, D), _mm_set1_ps(a->scale)));
        for (; j < len; j++) s[j] = dot(qh, kc + rows[j] * row, D) * a->scale;
        if (a->bias) {
            const float* bias = a->bias + h * a->bias_len;
            for (j = 0; j < len; j++) {
                const int64_t dist = len - 1 - j;
                s[j] += bias[dist < a->bias_len ? dist : a->bias_len - 1];
            }
        }
        softmax_row(s, len);
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
            for (j = 0; j < len; j++) {
                const __m256 p = _mm256_set1_ps(s[j]);
                const float* v = vc + rows[j] * row + d0;
                o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), o0);
                o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), o1);
                o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), o2);
                o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), o3);
                o4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), o4);
                o5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), o5);
                o6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), o6);
                o7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), o7);
            }
            float* o = out + h * D + d0;
            _mm256_storeu_ps(o, o0);
            _mm256_storeu_ps(o + 8, o1);
            _mm256_storeu_ps(o + 16, o2);
            _mm256_storeu_ps(o + 24, o3);
            _mm256_storeu_ps(o + 32, o4);
            _mm256_storeu_ps(o + 40, o5);
            _mm256_storeu_ps(o + 48, o6);
            _mm256_storeu_ps(o + 56, o7);
        }
    }
}

/* Work items [begin, end): item = b * head_groups + g covers sequence b's heads [g H / G, (g + 1) H / G).
 * head_dim % 64 == 0: head_major. Otherwise keys and values are read token by token (each token's heads are
 * adjacent in the cache), once per item. */
TARGET static void run_items(const void* ctx, size_t begin, size_t end) {
    const attn_t* a = (const attn_t*)ctx;
    const int64_t H = a->num_heads, D = a->head_dim, bs = a->block_size, G = a->head_groups;
    float* scores = malloc(sizeof(float) * (size_t)(H * (a->max_len + 8)));  /* [heads, max_len + 8] */
    float* acc = malloc(sizeof(float) * (size_t)(H * D));
    int64_t* rows = malloc(sizeof(int64_t) * (size_t)(a->max_len + 1));  /* rows[j]: key j's row in the cache */
    if (scores == NULL || acc == NULL || rows == NULL) {  /* cannot happen for sane sizes; leave NaN so it is seen */
        for (size_t it = begin; it < end; it++)
            for (int64_t i = 0; i < H * D; i++) a->out[(int64_t)it / G * H * D + i] = NAN;
        free(scores);
        free(acc);
        free(rows);
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
        if (D % 64 == 0) {
            for (int64_t j = 0; j < len; j++) rows[j] = table[j / bs] * bs + j % bs;
            head_major(a, q, out, rows, len, h0, h1, scores);
            continue;
        }
        for (int64_t j = 0; j < len; j++) {  /* scores[h, j] */
            const float* k = a->k_cache + (table[j / bs] * bs + j % bs) * H * D;
            const int64_t dist = len - 1 - j, col = a->bias ? (dist < a->bias_len ? dist : a->bias_len - 1) : 0;
            for (int64_t h = h0; h < h1; h++)
                scores[h * stride + j] = dot(q + h * D, k + h * D, D) * a->scale + (a->bias ? a->bias[h * a->bias_len + col] : 0.0f);
        }
        for (int64_t h = h0; h < h1; h++) softmax_row(scores + h * stride, len);
        memset(acc + h0 * D, 0, sizeof(float) * (size_t)((h1 - h0) * D));
        for (int64_t j = 0; j < len; j++) {  /* acc[h] += p[h, j] v_j[h] */
            const float* v = a->v_cache + (table[j / bs] * bs + j % bs) * H * D;
            for (int64_t h = h0; h < h1; h++) {
                const float p = scores[h * stride + j];
                const __m256 w = _mm256_set1_ps(p);
                float *o = acc + h * D;
                const float* vh = v + h * D;
                int64_t i = 0;
                for (; i + 8 <= D; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(vh + i), _mm256_loadu_ps(o + i)));
                for (; i < D; i++) o[i] += p * vh[i];
            }
        }
        memcpy(out + h0 * D, acc + h0 * D, sizeof(float) * (size_t)((h1 - h0) * D));
    }
    free(scores);
    free(acc);
    free(rows);
}

/* q [B, H, D] with sequence b's H * D floats contiguous at q + b * q_stride (a row of a fused q/k/v product);
 * k_cache, v_cache [num_blocks, block_size, H, D]; block_tables [B, bt_stride]; context_lens [B];
 * bias [H, bias_len] or NULL; out [B, H, D]. All else contiguous; float32 / int64.
 * Returns 0; -1 if a worker thread could not be started (its pairs then ran on the caller);
 * -2 if a length is negative or needs more than bt_stride blocks; -3 if a block id that would
 * be read is outside [0, num_blocks). Nothing is read or written on -2 / -3. */
int paged_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache, const int64_t* block_tables,
                           int64_t bt_stride, const int64_t* context_lens, const float* bias, int64_t bias_len, float* out,
                           int64_t batch, int64_t num_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           float scale, int num_threads) {
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
    return parallel_for(run_items, &a, (size_t)(batch * groups), num_threads);
}

/* write_kv of kernels/paged_attention.py: token i's key and value (row = H * D floats, at key + i * key_stride and
 * value + i * value_stride) into k_cache / v_cache [num_slots, row] at slots[i]; a negative slot (a padding token)
 * is skipped. Every slot is checked first: one at or past num_slots returns -3 and nothing is written. */
int paged_write_kv(const float* key, const float* value, int64_t key_stride, int64_t value_stride, float* k_cache,
                   float* v_cache, const int64_t* slots, int64_t t, int64_t row, int64_t num_slots) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= num_slots) return -3;
    for (int64_t i = 0; i < t; i++) {
        if (slots[i] < 0) continue;
        memcpy(k_cache + slots[i] * row, key + i * key_stride, sizeof(float) * (size_t)row);
        memcpy(v_cache + slots[i] * row, value + i * value_stride, sizeof(float) * (size_t)row);
    }
    return 0;
}
