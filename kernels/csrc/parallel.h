/* A persistent worker pool shared by the C kernels of kernels/csrc (one per process).
 *
 * parallel_for(fn, ctx, n, num_threads) splits [0, n) into num_threads
 * contiguous ranges; the caller runs the first, pool workers the others.
 * Workers are started on first use (at most one per online CPU, minus the
 * caller) and kept: starting threads on every call cost ~0.1-0.15 ms, as much
 * as a whole [512, 512] x 32-row product of a decode step. After a job a
 * worker spins for SPIN_US microseconds (a decode step calls the kernels
 * every ~0.05-0.3 ms), then sleeps on a condition variable. One job runs at a
 * time; a caller that finds the pool busy (another Python thread) runs its
 * whole range itself. Results never depend on the split (each kernel makes
 * every output in one place).
 */
#ifndef ENCDEC_PARALLEL_H
#define ENCDEC_PARALLEL_H

#include <stddef.h>

typedef void (*parallel_fn)(const void* ctx, size_t begin, size_t end);

/* Returns 0, or -1 if fewer workers than asked for could be started (the work still all ran). */
int parallel_for(parallel_fn fn, const void* ctx, size_t n, int num_threads);

#endif
