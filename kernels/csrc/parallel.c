/* The worker pool of parallel.h: see there. C11 atomics, POSIX threads.
 *
 * A job is cut into chunks that the caller and the workers claim one at a
 * time (an atomic counter), so nobody waits for a worker that has not been
 * scheduled: on 2 cores shared with another busy process (the encoder
 * service), a static split made every kernel call wait for a descheduled
 * worker's half. The counter carries the job's generation in its high 32
 * bits: a late worker's claim on a finished job fails, and the job's fields
 * are read only after a successful claim, while the caller cannot post the
 * next job until every claimed chunk is done. Posting takes two generations:
 * the first (chunk index all ones, nothing to claim) closes the old job
 * before its fields are overwritten, the second opens the new one.
 */
#define _GNU_SOURCE
#include "parallel.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define SPIN_US 50          /* how long an idle worker spins (yielding) before sleeping */
#define CHUNKS_PER_THREAD 4 /* finer chunks: less waiting for the last one; more claims */

typedef struct {
    parallel_fn fn;
    const void* ctx;
    size_t n, chunk, chunks;
} job_t;

static pthread_mutex_t dispatch = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int num_workers = 0; /* guarded by dispatch */
static job_t job;           /* written under dispatch before the job is posted */
static atomic_uint_fast64_t next_chunk = 0; /* generation << 32 | next chunk index */
static atomic_size_t done = 0;              /* chunks finished of the current job */
static atomic_int sleepers = 0;
static int fork_handler_installed = 0;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Claims and runs chunks of generation `gen` until none is left (or a newer job replaced it). */
static void run_chunks(uint64_t gen) {
    uint64_t v = atomic_load(&next_chunk);
    while ((v >> 32) == gen) {
        size_t idx = (size_t)(v & 0xffffffffu);
        if (idx >= job.chunks) return; /* may read a newer job's count: then the claim below fails anyway */
        if (!atomic_compare_exchange_weak(&next_chunk, &v, v + 1)) continue; /* v reloaded */
        size_t a = idx * job.chunk, b = a + job.chunk < job.n ? a + job.chunk : job.n;
        job.fn(job.ctx, a, b);
        atomic_fetch_add(&done, 1);
        v = atomic_load(&next_chunk);
    }
}

static void* worker(void* arg) {
    uint64_t seen = (uint64_t)(uintptr_t)arg; /* the generation when started: the next job is new to it */
    for (;;) {
        uint64_t g = atomic_load(&next_chunk) >> 32;
        if (g == seen) {
            double start = now_us();
            int spins = 0;
            while ((g = atomic_load(&next_chunk) >> 32) == seen) {
                _mm_pause();
                if (++spins % 16 == 0) {
                    if (now_us() - start > SPIN_US) break;
                    sched_yield(); /* a runnable thread on this core (an OpenMP worker of the next torch op) goes first */
                }
            }
            if (g == seen) {
                pthread_mutex_lock(&sleep_lock);
                atomic_fetch_add(&sleepers, 1);
                while ((g = atomic_load(&next_chunk) >> 32) == seen) pthread_cond_wait(&wake, &sleep_lock);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&sleep_lock);
            }
        }
        seen = g;
        run_chunks(g);
    }
    return NULL;
}

/* In a forked child the workers are gone: start afresh. */
static void after_fork_child(void) {
    pthread_mutex_init(&dispatch, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
    num_workers = 0;
    atomic_store(&sleepers, 0);
}

int encdec_kernels_abi(void) { return ENCDEC_KERNELS_ABI; }

int encdec_max_isa(void) {
    static int cap = -2; /* -2: not read yet; every thread reads the same value, so a race only repeats the read */
    if (cap == -2) {
        const char* value = getenv("ENCDEC_MAX_CPU_ISA");
        if (value == NULL || value[0] == '\0')
            cap = 0;
        else if (strcasecmp(value, "avx2") == 0)
            cap = ENCDEC_ISA_AVX2;
        else if (strcasecmp(value, "avx512") == 0)
            cap = ENCDEC_ISA_AVX512;
        else
            cap = -1;
    }
    return cap;
}

int parallel_for(parallel_fn fn, const void* ctx, size_t n, int num_threads) {
    if (n == 0) return 0;
    static long cpus = 0; /* sysconf reads /sys/devices/system/cpu/online: once, not per call */
    if (cpus == 0) cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (num_threads > cpus && cpus > 0) num_threads = (int)cpus;
    if (num_threads > MAX_WORKERS + 1) num_threads = MAX_WORKERS + 1;
    if ((size_t)num_threads > n) num_threads = (int)n;
    if (num_threads <= 1 || pthread_mutex_trylock(&dispatch) != 0) { /* one thread, or the pool is busy */
        fn(ctx, 0, n);
        return 0;
    }
    int rc = 0;
    if (!fork_handler_installed) fork_handler_installed = pthread_atfork(NULL, NULL, after_fork_child) == 0;
    uint64_t gen = atomic_load(&next_chunk) >> 32;
    while (num_workers < num_threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&t, &attr, worker, (void*)(uintptr_t)gen) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) {
            rc = -1;
            break;
        }
        num_workers++;
    }
    size_t chunks = (size_t)(num_workers + 1) * CHUNKS_PER_THREAD;
    if (chunks > n) chunks = n;
    size_t chunk = (n + chunks - 1) / chunks;
    /* Close the previous job before touching `job`: a worker that loaded its exhausted counter (gen, chunks) and
     * then read the new, larger job.chunks could otherwise claim "chunk `chunks`" of the old generation with a CAS
     * that still succeeds, run the new job's function on it and count it in `done`: the caller then returned while
     * a chunk still ran on its (dead) stack context. After this store every claim on an older generation fails. */
    atomic_store(&next_chunk, (((gen + 1) & 0xffffffffu) << 32) | 0xffffffffu);
    job = (job_t){fn, ctx, n, chunk, (n + chunk - 1) / chunk};
    atomic_store(&done, 0);
    gen = (gen + 2) & 0xffffffffu;
    atomic_store(&next_chunk, gen << 32); /* posts the job (seq_cst: the fields above are visible to a claimer) */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    run_chunks(gen);
    while (atomic_load(&done) < job.chunks) _mm_pause(); /* chunks a worker claimed and still runs */
    pthread_mutex_unlock(&dispatch);
    return rc;
}
