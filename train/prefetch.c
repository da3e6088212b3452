/* One rank's read-ahead thread over a token dataset. */
#include "clock.h"
#include "log.h"
#include "prefetch.h"
#include "thread.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum slot_state {
    SLOT_FREE,
    SLOT_BUSY, /* the thread writes its buffers without the lock */
    SLOT_DONE  /* read (rc says how); only get reads or frees it */
};

typedef struct slot {
    enum slot_state state;
    uint64_t first; /* batch start, in sample numbers */
    uint64_t gen;   /* the restart generation it was read for */
    int rc;
    char why[512];
    int32_t *inputs, *targets; /* (count, seq_len) */
    uint64_t *idx;             /* (count) */
} slot;

struct train_prefetch {
    train_dataset *ds;
    uint64_t seed, stride;
    int seq_len, count, depth;
    slot *slots;
    void *mem;

    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* thread: a slot is free, a restart, or stop */
    pthread_cond_t cv_done; /* get: a slot finished */
    pthread_t thread;
    /* under mu; gen and stop are atomic too so that the thread can check them between samples
     * without the lock and give up a batch nobody wants any more */
    int active;         /* a get has set where to read; 0 before the first and after an error */
    uint64_t expect;    /* the first of the batch the next get should ask for */
    uint64_t fill_next; /* the first of the next batch the thread starts */
    _Atomic uint64_t gen;
    _Atomic int stop;
};


/* Read one batch into s (BUSY, so its buffers are ours). -ECANCELED: a restart or a stop came
 * in between and nobody wants it. */
static int fill(train_prefetch *p, slot *s, uint64_t gen)
{
    const size_t T = (size_t)p->seq_len;
    s->why[0] = '\0';
    for (int j = 0; j < p->count; j++) {
        if (atomic_load_explicit(&p->stop, memory_order_relaxed) ||
            atomic_load_explicit(&p->gen, memory_order_relaxed) != gen)
            return -ECANCELED;
        uint64_t k = s->first + (uint64_t)j;
        int64_t ix = train_dataset_order(p->ds, p->seed, k);
        if (ix < 0) {
            log_why(s->why, sizeof s->why, "sample order at number %llu: %s", (unsigned long long)k,
                strerror((int)-ix));
            return (int)ix;
        }
        s->idx[j] = (uint64_t)ix;
        int rc = train_dataset_sample(p->ds, (uint64_t)ix, s->inputs + (size_t)j * T,
                                      s->targets + (size_t)j * T, s->why, sizeof s->why);
        if (rc < 0) {
            if (!s->why[0])
                log_why(s->why, sizeof s->why, "sample %lld (number %llu): %s", (long long)ix,
                    (unsigned long long)k, strerror(-rc));
            return rc;
        }
    }
    return 0;
}

static slot *find_free(train_prefetch *p)
{
    for (int i = 0; i < p->depth; i++)
        if (p->slots[i].state == SLOT_FREE) return &p->slots[i];
    return NULL;
}

static void *run(void *arg)
{
    train_prefetch *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        slot *s = NULL;
        while (!atomic_load(&p->stop) && !(p->active && (s = find_free(p))))
            pthread_cond_wait(&p->cv_work, &p->mu); /* idle until a get or free wakes us */
        if (atomic_load(&p->stop)) break;
        uint64_t gen = atomic_load(&p->gen);
        s->state = SLOT_BUSY;
        s->first = p->fill_next;
        s->gen = gen;
        p->fill_next += p->stride;
        pthread_mutex_unlock(&p->mu);

        int rc = fill(p, s, gen);

        pthread_mutex_lock(&p->mu);
        if (rc == -ECANCELED || s->gen != atomic_load(&p->gen)) {
            s->state = SLOT_FREE;
        } else {
            s->rc = rc;
            s->state = SLOT_DONE;
        }
        pthread_cond_broadcast(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int train_prefetch_create(train_prefetch **out, train_dataset *ds, uint64_t seed, int seq_len,
                          int count, uint64_t stride, int depth)
{
    if (out) *out = NULL;
    if (!out || !ds || seq_len < 1 || count < 1 || depth < 1 || stride < 1) return -EINVAL;
    size_t per = (size_t)count * (size_t)seq_len; /* int32 per buffer */
    if (per / (size_t)count != (size_t)seq_len || per > SIZE_MAX / 16 / (size_t)depth)
        return -EINVAL;
    size_t bytes = (size_t)depth * (per * 2 * sizeof(int32_t) + (size_t)count * sizeof(uint64_t));

    int rc = 0, have_mu = 0, have_work = 0, have_done = 0;
    train_prefetch *p = calloc(1, sizeof *p);
    if (!p) return -ENOMEM;
    p->ds = ds;
    p->seed = seed;
    p->stride = stride;
    p->seq_len = seq_len;
    p->count = count;
    p->depth = depth;
    atomic_init(&p->gen, 0);
    atomic_init(&p->stop, 0);
    p->slots = calloc((size_t)depth, sizeof *p->slots);
    p->mem = malloc(bytes);
    if (!p->slots || !p->mem) {
        rc = -ENOMEM;
        goto out;
    }
    /* uint64 arrays first so that every one stays 8-byte aligned */
    uint64_t *u = p->mem;
    int32_t *w = (int32_t *)(u + (size_t)depth * (size_t)count);
    for (int i = 0; i < depth; i++) {
        p->slots[i].idx = u + (size_t)i * (size_t)count;
        p->slots[i].inputs = w + (size_t)i * 2 * per;
        p->slots[i].targets = w + (size_t)i * 2 * per + per;
    }

    pthread_condattr_t ca;
    if ((rc = -pthread_mutex_init(&p->mu, NULL)) < 0) goto out;
    have_mu = 1;
    if ((rc = -pthread_condattr_init(&ca)) < 0) goto out;
    rc = -pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines immune to clock steps */
    if (rc == 0) {
        rc = -pthread_cond_init(&p->cv_work, NULL);
        have_work = rc == 0;
    }
    if (rc == 0) {
        rc = -pthread_cond_init(&p->cv_done, &ca);
        have_done = rc == 0;
    }
    pthread_condattr_destroy(&ca);
    if (rc < 0) goto out;
    if ((rc = common_thread_start(&p->thread, run, p)) < 0) goto out;
    *out = p;
    return 0;
out:
    if (have_done) pthread_cond_destroy(&p->cv_done);
    if (have_work) pthread_cond_destroy(&p->cv_work);
    if (have_mu) pthread_mutex_destroy(&p->mu);
    free(p->mem);
    free(p->slots);
    free(p);
    return rc;
}

/* Drop everything read ahead (under mu). A BUSY slot stays with the thread, which frees it
 * when it sees the new generation. */
static void restart(train_prefetch *p, int active, uint64_t first)
{
    atomic_fetch_add(&p->gen, 1);
    for (int i = 0; i < p->depth; i++)
        if (p->slots[i].state == SLOT_DONE) p->slots[i].state = SLOT_FREE;
    p->active = active;
    p->expect = p->fill_next = first;
    pthread_cond_signal(&p->cv_work);
}

static slot *find_ready(train_prefetch *p)
{
    uint64_t gen = atomic_load(&p->gen);
    for (int i = 0; i < p->depth; i++) {
        slot *s = &p->slots[i];
        if (s->state == SLOT_DONE && s->gen == gen && s->first == p->expect) return s;
    }
    return NULL;
}

int train_prefetch_get(train_prefetch *p, uint64_t first, int32_t *inputs, int32_t *targets,
                       uint64_t *idx, double timeout_s, char *why, size_t why_len)
{
    if (!p || !inputs || !targets || !(timeout_s >= 0)) return -EINVAL;
    if (timeout_s > 1e9) timeout_s = 1e9;
    struct timespec dl;
    clock_deadline_in(CLOCK_MONOTONIC, &dl, timeout_s);

    pthread_mutex_lock(&p->mu);
    if (!p->active || first != p->expect) restart(p, 1, first);
    slot *s;
    while (!(s = find_ready(p)))
        if (pthread_cond_timedwait(&p->cv_done, &p->mu, &dl) == ETIMEDOUT && !(s = find_ready(p)))
            break;
    pthread_mutex_unlock(&p->mu);
    if (!s) return -ETIMEDOUT;

    /* A DONE slot is ours until we free it: copy without the lock. */
    int rc = s->rc;
    if (rc == 0) {
        size_t per = (size_t)p->count * (size_t)p->seq_len;
        memcpy(inputs, s->inputs, per * sizeof *inputs);
        memcpy(targets, s->targets, per * sizeof *targets);
        if (idx) memcpy(idx, s->idx, (size_t)p->count * sizeof *idx);
    } else {
        log_why(why, why_len, "%s", s->why);
    }

    pthread_mutex_lock(&p->mu);
    s->state = SLOT_FREE;
    if (rc == 0) {
        p->expect += p->stride;
        pthread_cond_signal(&p->cv_work);
    } else {
        restart(p, 0, first); /* the batch's error is reported once; the next get reads afresh */
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

void train_prefetch_free(train_prefetch *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_signal(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_work);
    pthread_mutex_destroy(&p->mu);
    free(p->mem);
    free(p->slots);
    free(p);
}
