/* Splits [0, n) into one contiguous range per POSIX thread; the caller runs the first.
 *
 * Shared by the C kernels of kernels/csrc (header only: each .so gets its own
 * copy). A worker that cannot be started has its range run on the caller.
 * Returns 0, or -1 if some worker could not be started.
 */
#ifndef ENCDEC_PARALLEL_H
#define ENCDEC_PARALLEL_H

#include <pthread.h>
#include <stddef.h>

#define PARALLEL_MAX_THREADS 64

typedef void (*parallel_fn)(const void* ctx, size_t begin, size_t end);

typedef struct {
    parallel_fn fn;
    const void* ctx;
    size_t begin, end;
} parallel_job;

static void* parallel_run_job(void* arg) {
    const parallel_job* j = (const parallel_job*)arg;
    j->fn(j->ctx, j->begin, j->end);
    return NULL;
}

static int parallel_for(parallel_fn fn, const void* ctx, size_t n, int num_threads) {
    if (n == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > PARALLEL_MAX_THREADS) num_threads = PARALLEL_MAX_THREADS;
    if ((size_t)num_threads > n) num_threads = (int)n;
    parallel_job jobs[PARALLEL_MAX_THREADS];
    pthread_t threads[PARALLEL_MAX_THREADS];
    int started[PARALLEL_MAX_THREADS] = {0}, rc = 0;
    size_t per = (n + num_threads - 1) / num_threads;
    for (int t = 0; t < num_threads; t++) {
        size_t a = t * per < n ? t * per : n, b = a + per < n ? a + per : n;
        jobs[t] = (parallel_job){fn, ctx, a, b};
    }
    for (int t = 1; t < num_threads; t++) started[t] = pthread_create(&threads[t], NULL, parallel_run_job, &jobs[t]) == 0;
    parallel_run_job(&jobs[0]);
    for (int t = 1; t < num_threads; t++) {
        if (started[t]) {
            pthread_join(threads[t], NULL);
        } else {
            parallel_run_job(&jobs[t]);
            rc = -1;
        }
    }
    return rc;
}

#endif
