/* One decoder layer of a CPU decode step (one new token per sequence) as a single call.
 *
 * The Python layers (shared/models/t5.py, bart.py, whisper.py) run a decode step as ~12 kernel calls per layer
 * (norms, the fused q/k/v product, write_kv, paged self-attention, the output product with its residual,
 * cross-attention, the FFN), each behind a Python wrapper. On our 2-core machines that Python costs ~1 ms per
 * layer inside a step (the weights streamed by the products evict the interpreter's caches, so every bytecode
 * is slow): ~6 ms of a t5-small batch-32 step of ~45 ms. decode_layer runs the same kernels, in the same order
 * and with the same arguments, from C: its output equals the Python layer's bit for bit
 * (tests/kernels/test_decode_layer.py), so the Python layer stays the reference and runs everything else (prefill,
 * GPUs, int8, activations the packed epilogue lacks).
 *
 * Pre-norm layers (T5, mBART, Whisper):  x += Attn(norm0(x)); x += Cross(norm1(x)); x += FFN(norm2(x)).
 * Post-norm layers (BART, Marian):       x = norm0(x + Attn(x)); x = norm1(x + Cross(x)); x = norm2(x + FFN(x)).
 * Attn: fused q/k/v product, the new k/v written to the self cache (paged_write_kv), paged self-attention
 * (with T5's position bias when given), output product; Cross: q product, paged cross-attention over the
 * encoder's blocks, output product; FFN: act(x W1 + b1) W2 + b2 with act relu / exact GELU / none.
 */
#include <stddef.h>
#include <stdint.h>

int packed_linear(const float* x, const float* wp, const float* bias, const float* residual, float* out, size_t m,
                  size_t n, size_t k, int num_threads, int activation);
int packed_linear_bf16(const float* x, const uint16_t* wp, const float* bias, const float* residual, float* out,
                       size_t m, size_t n, size_t k, int num_threads, int activation);
int paged_decode_attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int cache_dtype,
                           const int64_t* block_tables, int64_t bt_stride, const int64_t* context_lens, const float* bias,
                           int64_t bias_len, float* out, int64_t batch, int64_t num_heads, int64_t head_dim,
                           int64_t num_blocks, int64_t block_size, float scale, int num_threads);
int paged_write_kv(const float* key, const float* value, int64_t key_stride, int64_t value_stride, void* k_cache,
                   void* v_cache, int cache_dtype, const int64_t* slots, int64_t t, int64_t row, int64_t num_slots);
int row_norm(const float* x, const float* w, const float* b, float* out, size_t rows, size_t d, float eps, int rms,
             int num_threads);

/* A layer's weights (packed with packed_linear_pack, or packed_linear_bf16_pack when weight_dtype is 1) and shape;
 * set once at load (kernels/decode_layer.py). */
typedef struct {
    const float *norm_w[3], *norm_b[3]; /* self, cross, FFN norms: weight, bias or NULL */
    float eps;
    int rms;      /* 1: RMS norm (T5), 0: LayerNorm */
    int pre_norm; /* 1: pre-norm, 0: post-norm */
    const void* qkv_wp; const float* qkv_b; /* [3 H D, d]: q, k, v */
    const void* o_wp; const float* o_b;     /* [d, H D] */
    const void* cq_wp; const float* cq_b;   /* [H D, d] */
    const void* co_wp; const float* co_b;   /* [d, H D] */
    const void* f1_wp; const float* f1_b;   /* [ffn, d] */
    const void* f2_wp; const float* f2_b;   /* [d, ffn] */
    int activation;              /* of the first FFN product: packed_linear's ACT_* */
    int64_t d, heads, head_dim, ffn;
    float scale; /* on q . k (T5: 1) */
    int weight_dtype; /* of all six packed weights: 0 float32 (packed_linear), 1 bfloat16 (packed_linear_bf16) */
} decode_layer_t;

/* What one decode step's layers share (kernels/decode_layer.py builds it once per step). */
typedef struct {
    int64_t t; /* sequences, one new token each */
    const int64_t* slots;        /* [t] self-cache slot of each new token */
    const int64_t* block_tables; /* [t, bt_stride] */
    int64_t bt_stride;
    const int64_t* seq_lens; /* [t] keys including the new one */
    const int64_t* cross_tables; /* [t, cross_stride] */
    int64_t cross_stride;
    const int64_t* encoder_lens;  /* [t] */
    const float* position_bias;   /* [H, bias_len] or NULL */
    int64_t bias_len;
    int64_t num_self_blocks, num_cross_blocks, block_size;
    int num_threads;
} decode_step_t;

/* One of the layer's products: packed_linear or packed_linear_bf16 by the layer's weight dtype. */
static int product(const decode_layer_t* L, const float* x, const void* wp, const float* bias, const float* residual,
                   float* out, size_t m, size_t n, size_t k, int nt, int activation) {
    if (L->weight_dtype == 1) return packed_linear_bf16(x, (const uint16_t*)wp, bias, residual, out, m, n, k, nt, activation);
    return packed_linear(x, (const float*)wp, bias, residual, out, m, n, k, nt, activation);
}

/* Scratch floats decode_layer needs for t rows. */
int64_t decode_layer_scratch(const decode_layer_t* L, int64_t t) {
    const int64_t hd = L->heads * L->head_dim;
    return t * (3 * L->d + 3 * hd + hd + L->ffn);
}

/* Pre-norm: sublayer i reads norm_i(r) (written to h); post-norm: r itself. */
static const float* sublayer_input(const decode_layer_t* L, int i, const float* r, float* h, int64_t t, int nt) {
    if (!L->pre_norm) return r;
    row_norm(r, L->norm_w[i], L->norm_b[i], h, t, L->d, L->eps, L->rms, nt);
    return h;
}

/* Post-norm: r := norm_i(r + sublayer), in place (row_norm allows out == x); pre-norm: nothing. */
static void post_norm(const decode_layer_t* L, int i, float* r, int64_t t, int nt) {
    if (!L->pre_norm) row_norm(r, L->norm_w[i], L->norm_b[i], r, t, L->d, L->eps, L->rms, nt);
}

/* x [t, d] -> out [t, d] (out != x), float32; self_k / self_v [num_self_blocks, block_size, H, D] of self_dtype
 * (written at the new tokens' slots); cross_k / cross_v [num_cross_blocks, block_size, H, D] of cross_dtype (the
 * dtypes: paged_decode_attention's cache_dtype, 0 float32, 1 bfloat16, each passed through to the attention calls
 * and paged_write_kv); scratch: decode_layer_scratch floats.
 * Returns 0; or the first kernel error (-2 / -3 of the attention kernels: a bad length or block id; -3 of
 * paged_write_kv: a slot past the cache; -4: a dtype neither), with the layer left half done. */
int decode_layer(const decode_layer_t* L, const decode_step_t* S, const float* x, float* out, void* self_k, void* self_v,
                 int self_dtype, const void* cross_k, const void* cross_v, int cross_dtype, float* scratch) {
    const int64_t t = S->t, d = L->d, H = L->heads, D = L->head_dim, hd = H * D;
    const int nt = S->num_threads;
    float *h = scratch, *a = h + t * d, *b = a + t * d, *qkv = b + t * d, *attn = qkv + t * 3 * hd, *f = attn + t * hd;
    int rc;
    if (t == 0) return 0;
#define CHECK(call)          \
    if ((rc = (call)) < -1) \
        return rc;
    /* self-attention: a = x + Attn(...) */
    CHECK(product(L, sublayer_input(L, 0, x, h, t, nt), L->qkv_wp, L->qkv_b, NULL, qkv, t, 3 * hd, d, nt, 0));
    CHECK(paged_write_kv(qkv + hd, qkv + 2 * hd, 3 * hd, 3 * hd, self_k, self_v, self_dtype, S->slots, t, hd,
                         S->num_self_blocks * S->block_size));
    CHECK(paged_decode_attention(qkv, 3 * hd, self_k, self_v, self_dtype, S->block_tables, S->bt_stride, S->seq_lens,
                                 S->position_bias, S->bias_len, attn, t, H, D, S->num_self_blocks, S->block_size,
                                 L->scale, nt));
    CHECK(product(L, attn, L->o_wp, L->o_b, x, a, t, d, hd, nt, 0));
    post_norm(L, 0, a, t, nt);
    /* cross-attention over the encoder's blocks: b = a + Cross(...) */
    CHECK(product(L, sublayer_input(L, 1, a, h, t, nt), L->cq_wp, L->cq_b, NULL, qkv, t, hd, d, nt, 0));
    CHECK(paged_decode_attention(qkv, hd, cross_k, cross_v, cross_dtype, S->cross_tables, S->cross_stride,
                                 S->encoder_lens, NULL, 0, attn, t, H, D, S->num_cross_blocks, S->block_size, L->scale,
                                 nt));
    CHECK(product(L, attn, L->co_wp, L->co_b, a, b, t, d, hd, nt, 0));
    post_norm(L, 1, b, t, nt);
    /* FFN: out = b + FFN(...) */
    CHECK(product(L, sublayer_input(L, 2, b, h, t, nt), L->f1_wp, L->f1_b, NULL, f, t, L->ffn, d, nt, L->activation));
    CHECK(product(L, f, L->f2_wp, L->f2_b, b, out, t, d, L->ffn, nt, 0));
    post_norm(L, 2, out, t, nt);
    return 0;
#undef CHECK
}
