/* The worker pool of parallel.h: see there. C11 atomics, POSIX threads. */
#define _GNU_SOURCE
#include "parallel.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define SPIN_US 50 /* how long an idle worker spins (yielding) before sleeping */

typedef struct {
    parallel_fn fn;
    const void* ctx;
    size_t n, per;
    int participants; /* the caller is participant 0 */
} job_t;

static pthread_mutex_t dispatch = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int num_workers = 0; /* guarded by dispatch */
static job_t job;           /* written under dispatch before generation is bumped */
static atomic_ulong generation = 0;
static atomic_int pending = 0;
static atomic_int sleepers = 0;
static unsigned long start_generation[MAX_WORKERS + 1]; /* what a new worker has already seen */
static int fork_handler_installed = 0;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void run_part(const job_t* j, int part) {
    size_t a = (size_t)part * j->per, b = a + j->per;
    if (a > j->n) a = j->n;
    if (b > j->n) b = j->n;
    if (a < b) j->fn(j->ctx, a, b);
}

static void* worker(void* arg) {
    const int id = (int)(intptr_t)arg; /* participant id, 1.. */
    unsigned long seen = start_generation[id]; /* not the current value: the job may already be posted */
    for (;;) {
        unsigned long g = atomic_load(&generation);
        if (g == seen) {
            double start = now_us();
            int spins = 0;
            while ((g = atomic_load(&generation)) == seen) {
                _mm_pause();
                if (++spins % 16 == 0) {
                    if (now_us() - start > SPIN_US) break;
                    sched_yield(); /* a runnable thread on this core (an OpenMP worker of the next torch op) goes first */
                }
            }
            if (g == seen) {
                pthread_mutex_lock(&sleep_lock);
                atomic_fetch_add(&sleepers, 1);
                while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&wake, &sleep_lock);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&sleep_lock);
            }
        }
        seen = g;
        if (id < job.participants) run_part(&job, id);
        atomic_fetch_sub(&pending, 1);
    }
    return NULL;
}

/* In a forked child the workers are gone: start afresh. */
static void after_fork_child(void) {
    pthread_mutex_init(&dispatch, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
    num_workers = 0;
    atomic_store(&pending, 0);
    atomic_store(&sleepers, 0);
}

int parallel_for(parallel_fn fn, const void* ctx, size_t n, int num_threads) {
    if (n == 0) return 0;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (num_threads > cpus && cpus > 0) num_threads = (int)cpus;
    if (num_threads > MAX_WORKERS + 1) num_threads = MAX_WORKERS + 1;
    if ((size_t)num_threads > n) num_threads = (int)n;
    if (num_threads <= 1 || pthread_mutex_trylock(&dispatch) != 0) { /* one thread, or the pool is busy */
        fn(ctx, 0, n);
        return 0;
    }
    int rc = 0;
    if (!fork_handler_installed) fork_handler_installed = pthread_atfork(NULL, NULL, after_fork_child) == 0;
    while (num_workers < num_threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[num_workers + 1] = atomic_load(&generation);
        int ok = pthread_create(&t, &attr, worker, (void*)(intptr_t)(num_workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        num_workers++;
    }
    if (num_workers < num_threads - 1) {
        num_threads = num_workers + 1;
        rc = -1;
    }
    job = (job_t){fn, ctx, n, (n + num_threads - 1) / num_threads, num_threads};
    atomic_store(&pending, num_workers);
    atomic_fetch_add(&generation, 1); /* publishes job (seq_cst) */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    run_part(&job, 0);
    while (atomic_load(&pending) > 0) _mm_pause();
    pthread_mutex_unlock(&dispatch);
    return rc;
}
