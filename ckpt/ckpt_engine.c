/* Asynchronous two-phase snapshots: stage (copy, on the caller's thread) and persist (one
 * background thread driving the compression pool, then retention). See ckpt.h. */
#include "ckpt.h"
#include "ckpt_internal.h"
#include "log.h"
#include "thread.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define TAG "ckpt"

/* The staging area: one allocation reused for every snapshot. The interface is this small
 * so that a shared-memory segment kept by the agent across restarts can replace it
 * (DESIGN section 3, planned next tier). */
typedef struct staging {
    uint8_t *base;
    size_t cap;
} staging;

static int staging_reserve(staging *s, size_t bytes)
{
    if (bytes <= s->cap) return 0;
    size_t cap = (bytes + 4095) & ~(size_t)4095;
    /* MAP_POPULATE faults the pages in now (about twice as fast as touching them), not during
     * a copy that training waits for */
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (p == MAP_FAILED) return -ENOMEM;
    if (s->base) munmap(s->base, s->cap);
    s->base = p;
    s->cap = cap;
    return 0;
}

static void staging_release(staging *s)
{
    if (s->base) munmap(s->base, s->cap);
    s->base = NULL;
    s->cap = 0;
}

enum { MAX_BUFFERS = 64 };

struct ckpt_engine;
static int engine_reserve(struct ckpt_engine *e, size_t bytes);
static void engine_unpin(struct ckpt_engine *e);

struct ckpt_engine {
    ckpt_engine_opts o;
    ckpt_group group; /* valid when o.group != NULL (then o.group points here) */
    char group_tag[64];
    char dir[CKPT_PATH_MAX];
    staging stage;
    ckpt_pool *pool;
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int pending;  /* a staged snapshot waits for or is in persist */
    int stop;
    /* the stage copy in progress: bytes of the staging area already copied; the persist may
     * run ahead of it chunk by chunk (ready_hook) */
    size_t staged_upto, staged_total;
    int stage_done; /* the copy finished and stage_seconds is set */
    pthread_cond_t cv_staged;
    /* device staging (ckpt_engine_stage_device): the job in flight reads the staging area
     * behind the copier's asynchronous copies, one per chunk; dev_tickets[i] is the ticket of
     * the copy that ends at staging offset dev_ends[i] (ascending) */
    int dev_job;
    ckpt_copier copier;
    size_t dev_n, dev_cap;
    size_t *dev_ends;
    uint64_t *dev_tickets;
    /* the staging area is pinned (copier->pin) once per allocation; pin_copier unpins it */
    int pinned;
    ckpt_copier pin_copier;
    /* the staged job */
    uint64_t step;
    char run_id[64], config_hash[64];
    char *trainer_json;
    /* a deferred trainer record (ckpt_engine_stage_device with trainer_json NULL): the persist
     * waits for ckpt_engine_set_trainer before its manifest */
    int trainer_deferred;  /* the job's record is deferred */
    int trainer_state;     /* 0 not yet given, 1 given (trainer_json), -errno withdrawn */
    double trainer_wait_s; /* how long the persist waited for it (persist thread only) */
    pthread_cond_t cv_trainer;
    size_t nbufs;
    ckpt_buffer bufs[MAX_BUFFERS];
    char names[MAX_BUFFERS][64], dtypes[MAX_BUFFERS][64];
    double stage_seconds;
    struct timespec staged_at;
    /* results */
    int have_last;
    ckpt_persist_stats last;
    uint64_t completed, skipped;
};

static double since(const struct timespec *a)
{
    struct timespec b;
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)(b.tv_sec - a->tv_sec) + 1e-9 * (double)(b.tv_nsec - a->tv_nsec);
}


/* Grow the staging area to `bytes`; a pinned area is unpinned first (the copier must not
 * see memory it pinned go away under it). */
static int engine_reserve(ckpt_engine *e, size_t bytes)
{
    if (bytes <= e->stage.cap) return 0;
    engine_unpin(e);
    return staging_reserve(&e->stage, bytes);
}

static void engine_unpin(ckpt_engine *e)
{
    if (!e->pinned) return;
    if (e->pin_copier.unpin) e->pin_copier.unpin(e->pin_copier.ctx, e->stage.base);
    e->pinned = 0;
}

/* Device job: wait for the copy that ends at `need` bytes into the staging area. Each chunk
 * of the persist is exactly one copy (both cut every shard into chunk_bytes pieces from its
 * start), so the chunk's end is a copy's end. */
static int device_ready(ckpt_engine *e, size_t need)
{
    size_t lo = 0, hi = e->dev_n;
    while (lo < hi) { /* first copy whose end >= need */
        size_t mid = lo + (hi - lo) / 2;
        if (e->dev_ends[mid] < need) lo = mid + 1;
        else hi = mid;
    }
    if (lo == e->dev_n) return need == 0 ? 0 : -EINVAL; /* past every copy: cannot happen */
    int rc = e->copier.wait(e->copier.ctx, e->dev_tickets[lo], e->copier.timeout_s);
    if (rc > 0) rc = 0;
    if (rc < 0)
        LOG_E(TAG, "step %llu: the device copy of staging bytes up to %zu (ticket %llu) failed: %s",
              (unsigned long long)e->step, need, (unsigned long long)e->dev_tickets[lo],
              strerror(-rc));
    return rc;
}

/* Wait for every copy queued so far of a device stage that failed (they write into the
 * staging area, which must not be reused or freed under them). */
static void device_drain(ckpt_engine *e, const ckpt_copier *c, size_t queued)
{
    for (size_t i = 0; i < queued; i++) {
        int rc = c->wait(c->ctx, e->dev_tickets[i], c->timeout_s);
        if (rc < 0) {
            /* a copy may still be writing into the staging area: abandon it (leaked, never
             * unpinned, unmapped or reused under a running copy); the next stage makes a new
             * one */
            LOG_E(TAG, "a device copy queued before the failure did not finish: %s; the staging "
                  "area (%zu bytes) is abandoned", strerror(-rc), e->stage.cap);
            e->stage.base = NULL;
            e->stage.cap = 0;
            e->pinned = 0;
            return;
        }
    }
}

/* ckpt_trainer_wait_fn of a deferred record: wait (bounded by the copier's timeout) for
 * ckpt_engine_set_trainer. */
static int trainer_wait(void *ctx, char **json)
{
    ckpt_engine *e = ctx;
    struct timespec ts, w0;
    clock_gettime(CLOCK_MONOTONIC, &w0);
    ckpt_deadline(&ts, e->copier.timeout_s);
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    while (e->trainer_state == 0 && rc == 0)
        if (pthread_cond_timedwait(&e->cv_trainer, &e->mu, &ts) == ETIMEDOUT && e->trainer_state == 0)
            rc = -ETIMEDOUT;
    if (rc == 0 && e->trainer_state < 0) rc = e->trainer_state;
    if (rc == 0) {
        *json = e->trainer_json;
        e->trainer_json = NULL;
        if (!*json) rc = -ENOMEM;
    }
    pthread_mutex_unlock(&e->mu);
    e->trainer_wait_s = since(&w0);
    return rc;
}

/* Pool hook: wait until the stage copy has passed `end` (bounded wait). */
static int ready_hook(void *ctx, const void *end)
{
    ckpt_engine *e = ctx;
    if (e->dev_job) /* set before the persist started, fixed while it runs */
        return device_ready(e, (size_t)((const uint8_t *)end - e->stage.base));
    pthread_mutex_lock(&e->mu);
    int no_copy = e->staged_upto == SIZE_MAX; /* ckpt_engine_persist_staged: nothing to follow */
    pthread_mutex_unlock(&e->mu);
    if (no_copy) return 0;
    size_t need = (size_t)((const uint8_t *)end - e->stage.base);
    struct timespec ts;
    ckpt_deadline(&ts, 600.0);
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    while (e->staged_upto < need && rc == 0)
        if (pthread_cond_timedwait(&e->cv_staged, &e->mu, &ts) == ETIMEDOUT && e->staged_upto < need)
            rc = -ETIMEDOUT;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

static void *persist_main(void *arg)
{
    ckpt_engine *e = arg;
    ckpt_thread_background();
    struct timespec ts;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->pending && !e->stop) {
            ckpt_deadline(&ts, 1.0); /* idle: re-check once a second */
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        if (!e->pending && e->stop) break;
        pthread_mutex_unlock(&e->mu);

        ckpt_save_stats st = {0};
        e->trainer_wait_s = 0;
        int rc = ckpt_persist(e->pool, &e->o.save, e->o.compress, e->step, e->run_id,
                              e->config_hash, e->bufs, e->nbufs,
                              e->trainer_deferred ? NULL : e->trainer_json,
                              e->trainer_deferred ? trainer_wait : NULL, e, e->o.group, &st);
        double persist_s = since(&e->staged_at);
        /* a failed persist may have left copies unwaited: they still write into the staging
         * area, which the next stage may grow (unmap); wait for them now (bounded) */
        if (rc < 0 && e->dev_job) device_drain(e, &e->copier, e->dev_n);
        int removed = 0;
        if (rc == 0) {
            /* the throughput is of the whole save, as ckpt_persist_stats has it; the wait for a
             * deferred trainer record (the trainer's pace, not the pipeline's) is shown */
            double work_s = persist_s;
            char waited[64] = "";
            if (e->trainer_deferred)
                snprintf(waited, sizeof waited, " (%.0f ms of it waiting for the trainer record)",
                         e->trainer_wait_s * 1e3);
            LOG_I(TAG, "snapshot step %llu committed: %.2f MiB raw -> %.2f MiB stored (ratio %.3f), "
                  "persist %.0f ms%s, %.1f MiB/s", (unsigned long long)e->step,
                  (double)st.raw_bytes / 1048576.0, (double)st.stored_bytes / 1048576.0,
                  st.stored_bytes ? (double)st.raw_bytes / (double)st.stored_bytes : 0.0,
                  persist_s * 1e3, waited,
                  work_s > 0 ? (double)st.raw_bytes / 1048576.0 / work_s : 0.0);
            if (e->o.on_commit) e->o.on_commit(e->o.on_commit_ctx, e->step);
            if ((e->o.keep_last > 0 || e->o.keep_every > 0) && e->o.save.lock &&
                ckpt_dir_lock_check(e->o.save.lock, e->o.save.dir) < 0) {
                LOG_W(TAG, "retention in %s skipped: this run's lock on it is gone", e->o.save.dir);
            } else if (e->o.keep_last > 0 || e->o.keep_every > 0) {
                removed = ckpt_retain(e->o.save.dir, e->o.keep_last, e->o.keep_every, e->run_id);
                if (removed < 0) {
                    LOG_W(TAG, "retention in %s failed: %s", e->o.save.dir, strerror(-removed));
                    removed = 0;
                }
            }
        } else {
            LOG_E(TAG, "snapshot step %llu failed: %s; it is not committed", (unsigned long long)e->step,
                  strerror(-rc));
        }

        pthread_mutex_lock(&e->mu);
        /* the copy has passed the last chunk; wait the moment it takes to report its time */
        struct timespec dl;
        ckpt_deadline(&dl, 60.0);
        while (!e->stage_done)
            if (pthread_cond_timedwait(&e->cv_staged, &e->mu, &dl) == ETIMEDOUT) break;
        e->last.step = e->step;
        e->last.result = rc;
        e->last.raw_bytes = st.raw_bytes;
        e->last.stored_bytes = st.stored_bytes;
        e->last.stage_seconds = e->stage_seconds;
        e->last.persist_seconds = persist_s;
        e->last.removed = (unsigned)removed;
        e->have_last = 1;
        e->completed++;
        e->pending = 0;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int ckpt_engine_create(ckpt_engine **out, const ckpt_engine_opts *opts)
{
    *out = NULL;
    if (!opts || !opts->save.dir || strlen(opts->save.dir) >= CKPT_PATH_MAX - 128) return -EINVAL;
    if (opts->threads < 1 || opts->threads > 64 || (opts->policy != CKPT_POLICY_WAIT &&
        opts->policy != CKPT_POLICY_SKIP) || !(opts->wait_timeout_s > 0))
        return -EINVAL;
    ckpt_buffer probe = {"probe", "u8", 1, 0, 0, 0, NULL};
    if (ckpt_check_save(&opts->save, "probe", "probe", &probe, 1) < 0) return -EINVAL;
    if (ckpt_check_group(opts->group) < 0) return -EINVAL;
    ckpt_engine *e = calloc(1, sizeof *e);
    if (!e) return -ENOMEM;
    e->o = *opts;
    if (opts->group) {
        e->group = *opts->group;
        snprintf(e->group_tag, sizeof e->group_tag, "%s", opts->group->tag);
        e->group.tag = e->group_tag;
        e->o.group = &e->group;
    }
    snprintf(e->dir, sizeof e->dir, "%s", opts->save.dir);
    e->o.save.dir = e->dir;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_cond_init(&e->cv_staged, NULL);
    pthread_cond_init(&e->cv_trainer, NULL);
    int rc = ckpt_pool_create(&e->pool, opts->threads, opts->save.chunk_bytes,
                              opts->save.filter == CKPT_FILTER_SHUFFLE);
    if (rc == 0) ckpt_pool_set_ready_hook(e->pool, ready_hook, e);
    if (rc == 0 && opts->reserve_bytes > 0) rc = staging_reserve(&e->stage, opts->reserve_bytes);
    if (rc == 0 && common_thread_start(&e->thread, persist_main, e) != 0) rc = -ENOMEM;
    if (rc < 0) {
        ckpt_pool_destroy(e->pool);
        staging_release(&e->stage);
        pthread_cond_destroy(&e->cv);
        pthread_cond_destroy(&e->cv_staged);
        pthread_cond_destroy(&e->cv_trainer);
        pthread_mutex_destroy(&e->mu);
        free(e);
        return rc;
    }
    e->thread_started = 1;
    *out = e;
    return 0;
}

/* Wait (mutex held) until no persist is pending, at most timeout_s. */
static int wait_idle_locked(ckpt_engine *e, double timeout_s)
{
    struct timespec ts;
    ckpt_deadline(&ts, timeout_s);
    while (e->pending)
        if (pthread_cond_timedwait(&e->cv, &e->mu, &ts) == ETIMEDOUT && e->pending) return -ETIMEDOUT;
    return 0;
}

/* Queue the copies of a device stage into the staging area (laid out in e->bufs), one per
 * chunk, recording each copy's end and ticket. 0, or the first negative errno of pin/copy
 * (copies queued before it are waited for). */
static int device_queue(ckpt_engine *e, const ckpt_buffer *bufs, size_t nbufs,
                        const ckpt_copier *c, uint64_t *last_ticket)
{
    const uint64_t chunk = e->o.save.chunk_bytes;
    size_t n = 0;
    for (size_t i = 0; i < nbufs; i++) n += (size_t)((bufs[i].bytes + chunk - 1) / chunk);
    if (n > e->dev_cap) {
        size_t *ends = realloc(e->dev_ends, n * sizeof *ends);
        if (!ends) return -ENOMEM;
        e->dev_ends = ends;
        uint64_t *t = realloc(e->dev_tickets, n * sizeof *t);
        if (!t) return -ENOMEM;
        e->dev_tickets = t;
        e->dev_cap = n;
    }
    int rc;
    if (!e->pinned && c->pin && e->stage.cap > 0) {
        if ((rc = c->pin(c->ctx, e->stage.base, e->stage.cap)) < 0) {
            LOG_E(TAG, "pinning the staging area (%zu bytes) failed: %s", e->stage.cap,
                  strerror(-rc));
            return rc;
        }
        e->pinned = 1;
        e->pin_copier = *c;
    }
    size_t k = 0, off = 0;
    for (size_t i = 0; i < nbufs; i++) {
        const uint8_t *src = bufs[i].data;
        for (uint64_t done = 0; done < bufs[i].bytes; done += chunk) {
            size_t len = (size_t)(bufs[i].bytes - done < chunk ? bufs[i].bytes - done : chunk);
            uint64_t t = 0;
            if ((rc = c->copy(c->ctx, e->stage.base + off, src + done, len, &t)) < 0) {
                LOG_E(TAG, "queueing the device copy of %s at %llu (%zu bytes) failed: %s",
                      bufs[i].name, (unsigned long long)(bufs[i].offset + done), len, strerror(-rc));
                device_drain(e, c, k);
                return rc;
            }
            off += len;
            e->dev_ends[k] = off;
            e->dev_tickets[k] = t;
            k++;
        }
    }
    e->dev_n = k;
    if (k && last_ticket) *last_ticket = e->dev_tickets[k - 1];
    return 0;
}

enum { JOB_COPY = 1, JOB_IN_PLACE = 0, JOB_DEVICE = 2 };

/* mode JOB_COPY: ckpt_engine_stage (copy into the staging area); JOB_IN_PLACE:
 * ckpt_engine_persist_staged (the persist reads the caller's bytes, which the caller keeps
 * until it finishes); JOB_DEVICE: ckpt_engine_stage_device (the copier queues the copies into
 * the staging area, the persist's workers wait for each chunk's copy). */
static int stage_job(ckpt_engine *e, uint64_t step, const char *run_id, const char *config_hash,
                     const ckpt_buffer *bufs, size_t nbufs, const char *trainer_json,
                     double *stall_s, int mode, const ckpt_copier *copier, uint64_t *last_ticket)
{
    const int copy = mode != JOB_IN_PLACE; /* the persist reads the staging area */
    const int dev = mode == JOB_DEVICE;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!e || nbufs > MAX_BUFFERS || (nbufs && !bufs)) return -EINVAL;
    int rc = ckpt_check_save_group(&e->o.save, run_id, config_hash, bufs, nbufs, e->o.group);
    if (rc < 0) return rc;
    for (size_t i = 0; (!copy || dev) && i < nbufs; i++)
        if (bufs[i].bytes && !bufs[i].data) return -EINVAL;
    const int deferred = dev && !trainer_json; /* ckpt_engine_set_trainer gives it later */
    char *json_copy = deferred ? NULL : strdup(trainer_json ? trainer_json : "{}");
    if (!deferred && !json_copy) return -ENOMEM;

    pthread_mutex_lock(&e->mu);
    if (e->pending) {
        if (e->o.policy == CKPT_POLICY_SKIP) {
            e->skipped++;
            uint64_t busy_step = e->step;
            pthread_mutex_unlock(&e->mu);
            free(json_copy);
            LOG_W(TAG, "snapshot of step %llu skipped: step %llu is still persisting (policy skip; "
                  "%llu skipped so far)", (unsigned long long)step, (unsigned long long)busy_step,
                  (unsigned long long)e->skipped);
            if (stall_s) *stall_s = since(&t0);
            return 1;
        }
        if ((rc = wait_idle_locked(e, e->o.wait_timeout_s)) < 0) {
            pthread_mutex_unlock(&e->mu);
            free(json_copy);
            LOG_E(TAG, "snapshot of step %llu not taken: step %llu did not finish persisting within "
                  "%.0f s", (unsigned long long)step, (unsigned long long)e->step, e->o.wait_timeout_s);
            return rc;
        }
    }
    /* no persist runs now: the staging area and job fields are ours */
    pthread_mutex_unlock(&e->mu);
    size_t total = 0;
    for (size_t i = 0; i < nbufs; i++) total += (size_t)bufs[i].bytes;
    if (copy && (rc = engine_reserve(e, total)) < 0) {
        free(json_copy);
        return rc;
    }
    /* lay the job out; then either copy and start the persist, or (overlap) start the persist
     * and copy, its workers following the copy chunk by chunk (ready_hook) */
    size_t off = 0;
    for (size_t i = 0; i < nbufs; i++) {
        snprintf(e->names[i], sizeof e->names[i], "%s", bufs[i].name);
        snprintf(e->dtypes[i], sizeof e->dtypes[i], "%s", bufs[i].dtype);
        e->bufs[i] = bufs[i];
        e->bufs[i].name = e->names[i];
        e->bufs[i].dtype = e->dtypes[i];
        e->bufs[i].data = copy ? e->stage.base + off : bufs[i].data;
        off += (size_t)bufs[i].bytes;
    }
    e->nbufs = nbufs;
    e->step = step;
    snprintf(e->run_id, sizeof e->run_id, "%s", run_id);
    snprintf(e->config_hash, sizeof e->config_hash, "%s", config_hash);
    free(e->trainer_json);
    e->trainer_json = json_copy;
    pthread_mutex_lock(&e->mu);
    e->trainer_deferred = deferred;
    e->trainer_state = deferred ? 0 : 1;
    pthread_mutex_unlock(&e->mu);
    clock_gettime(CLOCK_MONOTONIC, &e->staged_at);

    const size_t piece = 8u << 20;
    const int overlap = copy && !dev && e->o.overlap;
    if (dev) { /* queue the copies first (the persist needs every ticket), then start it */
        if ((rc = device_queue(e, bufs, nbufs, copier, last_ticket)) < 0) return rc;
        e->copier = *copier;
    }
    if (copy && !dev && !overlap) { /* copy first, then start the persist */
        off = 0;
        for (size_t i = 0; i < nbufs; i++) {
            if (bufs[i].bytes) memcpy(e->stage.base + off, bufs[i].data, (size_t)bufs[i].bytes);
            off += (size_t)bufs[i].bytes;
        }
    }
    pthread_mutex_lock(&e->mu);
    /* without a copy the ready hook has nothing to wait for: staged_upto = total, and the
     * pool's hook compares against stage.base, so the whole range counts as ready */
    e->staged_upto = overlap ? 0 : copy ? total : SIZE_MAX;
    e->staged_total = total;
    e->dev_job = dev;
    e->stage_done = !overlap;
    if (!overlap) e->stage_seconds = since(&t0);
    e->pending = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);

    if (overlap) { /* the persist's workers follow this copy chunk by chunk */
        off = 0;
        for (size_t i = 0; i < nbufs; i++) {
            const uint8_t *src = bufs[i].data;
            for (size_t done = 0; done < (size_t)bufs[i].bytes;) {
                size_t n = (size_t)bufs[i].bytes - done < piece ? (size_t)bufs[i].bytes - done : piece;
                memcpy(e->stage.base + off, src + done, n);
                done += n;
                off += n;
                pthread_mutex_lock(&e->mu);
                e->staged_upto = off;
                pthread_cond_broadcast(&e->cv_staged);
                pthread_mutex_unlock(&e->mu);
            }
        }
        pthread_mutex_lock(&e->mu);
        e->stage_seconds = since(&t0);
        e->stage_done = 1;
        pthread_cond_broadcast(&e->cv_staged);
        pthread_mutex_unlock(&e->mu);
    }
    if (stall_s) *stall_s = since(&t0);
    return 0;
}

int ckpt_engine_stage(ckpt_engine *e, uint64_t step, const char *run_id, const char *config_hash,
                      const ckpt_buffer *bufs, size_t nbufs, const char *trainer_json,
                      double *stall_s)
{
    return stage_job(e, step, run_id, config_hash, bufs, nbufs, trainer_json, stall_s, JOB_COPY,
                     NULL, NULL);
}

int ckpt_engine_persist_staged(ckpt_engine *e, uint64_t step, const char *run_id,
                               const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
                               const char *trainer_json, double *stall_s)
{
    return stage_job(e, step, run_id, config_hash, bufs, nbufs, trainer_json, stall_s,
                     JOB_IN_PLACE, NULL, NULL);
}

int ckpt_engine_stage_device(ckpt_engine *e, uint64_t step, const char *run_id,
                             const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
                             const char *trainer_json, const ckpt_copier *copier,
                             uint64_t *last_ticket, double *stall_s)
{
    if (!copier || !copier->copy || !copier->wait || !(copier->timeout_s > 0)) return -EINVAL;
    return stage_job(e, step, run_id, config_hash, bufs, nbufs, trainer_json, stall_s, JOB_DEVICE,
                     copier, last_ticket);
}

int ckpt_engine_wait(ckpt_engine *e, double timeout_s)
{
    if (!e) return -EINVAL;
    pthread_mutex_lock(&e->mu);
    int rc = wait_idle_locked(e, timeout_s);
    if (rc == 0) rc = e->have_last ? e->last.result : 0;
    else if (rc == -ETIMEDOUT) rc = -EINPROGRESS;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int ckpt_engine_busy(ckpt_engine *e)
{
    pthread_mutex_lock(&e->mu);
    int b = e->pending;
    pthread_mutex_unlock(&e->mu);
    return b;
}

int ckpt_engine_last(ckpt_engine *e, ckpt_persist_stats *st)
{
    pthread_mutex_lock(&e->mu);
    int rc = e->have_last ? 0 : -ENOENT;
    if (rc == 0 && st) *st = e->last;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

uint64_t ckpt_engine_completed(ckpt_engine *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t n = e->completed;
    pthread_mutex_unlock(&e->mu);
    return n;
}

uint64_t ckpt_engine_skipped(ckpt_engine *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t n = e->skipped;
    pthread_mutex_unlock(&e->mu);
    return n;
}

int ckpt_engine_set_trainer(ckpt_engine *e, uint64_t step, const char *trainer_json)
{
    if (!e) return -EINVAL;
    char *copy = trainer_json ? strdup(trainer_json) : NULL;
    if (trainer_json && !copy) return -ENOMEM;
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (!e->pending || !e->trainer_deferred || e->step != step || e->trainer_state != 0) {
        rc = -ENOENT;
        free(copy);
    } else if (!copy) {
        e->trainer_state = -ECANCELED;
    } else {
        free(e->trainer_json);
        e->trainer_json = copy;
        e->trainer_state = 1;
    }
    pthread_cond_broadcast(&e->cv_trainer);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int ckpt_engine_destroy(ckpt_engine *e)
{
    if (!e) return 0;
    /* a deferred record that never came will not come now: the persist gives up at once */
    pthread_mutex_lock(&e->mu);
    if (e->pending && e->trainer_deferred && e->trainer_state == 0) {
        LOG_W(TAG, "snapshot of step %llu: its trainer record was never given; not committed",
              (unsigned long long)e->step);
        e->trainer_state = -ECANCELED;
        pthread_cond_broadcast(&e->cv_trainer);
    }
    pthread_mutex_unlock(&e->mu);
    int rc = ckpt_engine_wait(e, e->o.wait_timeout_s);
    if (rc == -EINPROGRESS) {
        /* the persist thread still reads the staging area: leak it rather than free it */
        LOG_E(TAG, "snapshot of step %llu still persisting after %.0f s; abandoning it",
              (unsigned long long)e->step, e->o.wait_timeout_s);
        return rc;
    }
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) pthread_join(e->thread, NULL);
    ckpt_pool_destroy(e->pool);
    engine_unpin(e);
    staging_release(&e->stage);
    free(e->dev_ends);
    free(e->dev_tickets);
    free(e->trainer_json);
    pthread_cond_destroy(&e->cv);
    pthread_cond_destroy(&e->cv_staged);
    pthread_cond_destroy(&e->cv_trainer);
    pthread_mutex_destroy(&e->mu);
    free(e);
    return rc;
}
