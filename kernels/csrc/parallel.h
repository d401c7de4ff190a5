/* A persistent worker pool shared by the C kernels of kernels/csrc (one per process).
 *
 * parallel_for(fn, ctx, n, num_threads) runs fn over [0, n) in chunks (about
 * 4 per thread) that the caller and up to num_threads - 1 pool workers claim
 * one by one, so a worker the OS has not scheduled yet (the cores busy with
 * another process) only means the caller does more chunks itself. Workers are
 * started on first use (at most one per online CPU, minus the caller) and
 * kept: starting threads on every call cost ~0.1-0.15 ms, as much as a whole
 * [512, 512] x 32-row product of a decode step. After a job a worker spins
 * for 50 us, yielding the core to any other runnable thread (the OpenMP
 * workers of torch's next op), then sleeps on a condition variable. One job
 * runs at a time; a caller that finds the pool busy (another Python thread)
 * runs its whole range itself. Results never depend on the split (each kernel
 * computes every output in one place).
 */
#ifndef ENCDEC_PARALLEL_H
#define ENCDEC_PARALLEL_H

#include <stddef.h>

typedef void (*parallel_fn)(const void* ctx, size_t begin, size_t end);

/* Returns 0, or -1 if fewer workers than asked for could be started (the work still all ran). */
int parallel_for(parallel_fn fn, const void* ctx, size_t n, int num_threads);

/* The version of the library's C signatures, bumped whenever one changes; kernels/_clib.py (ABI_VERSION) refuses
 * a library built from other sources (an editable install not rebuilt after a pull) instead of calling it with
 * shifted arguments. 2: packed_linear's residual, paged_decode_attention's q_stride, paged_write_kv; 3: decode_layer;
 * 4: packed_linear_isa / packed_linear_set_isa (the AVX-512 micro-kernel); 5: the cache_dtype of
 * paged_decode_attention / paged_write_kv, decode_layer's self / cross cache dtypes (bfloat16 KV caches),
 * packed_linear_bf16 and its packing (bfloat16 weights); 6: encdec_max_isa (the ENCDEC_MAX_CPU_ISA cap). */
#define ENCDEC_KERNELS_ABI 6
int encdec_kernels_abi(void);

/* Instruction-set levels of the kernels with variants (packed_linear's micro-kernels). */
#define ENCDEC_ISA_AVX2 1   /* AVX2 + FMA */
#define ENCDEC_ISA_AVX512 2 /* AVX-512F (no AVX-512 BF16: bfloat16 weights are off) */

/* The cap the environment variable ENCDEC_MAX_CPU_ISA sets on every kernel of the library, read once (at the
 * first call, when the library loads): 0 none (unset or empty), ENCDEC_ISA_AVX2 ("avx2"), ENCDEC_ISA_AVX512
 * ("avx512"), any case; -1 for another value, which the kernels treat as avx2 (never above what was meant;
 * kernels/_clib.py refuses to load the library then). bfloat16 weights (AVX-512 BF16) run only without a cap.
 * It lets an AVX-512 machine reproduce an AVX2 CPU's kernel choices (encdec bench --cpu-isa). */
int encdec_max_isa(void);

#endif
