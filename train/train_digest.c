/* train_digest.c - the trainer record's digests of a staged snapshot, on a helper thread.
 *
 * A snapshot staged from the device (train_stage_snapshot) needs its record's digests of the
 * copied state: params_digest (XXH3-128 of the host view's np parameters) and this rank's
 * parts of the moments digests (block digests of adam_m, adam_v over [lo, hi)). Hashing them
 * on the training thread at the next optimizer update costs about 150 ms at GPT-2 124M
 * (1.5 GB at the 10 GB/s of XXH3 on one core), more than a GPU step. Instead, a host function
 * queued on the copy stream after the state's device-to-host copies wakes this module's
 * thread, which hashes while the training thread runs the next step's forward and backward;
 * the next update then only waits for the result (usually there) and sums the moments parts
 * over the ranks (a collective, so on the training thread).
 *
 * The host view must not change between train_digest_start and train_digest_finish: the
 * trainer writes its state only at an optimizer update, after train_wait_stage_copies (which
 * finishes the digest). One exception is why train_digest_usable says no: on the CPU device
 * the host view is the model's live parameters, and at ZeRO-3 with several ranks the layer
 * all-gathers of the next forward pass write (the same values) into them; there the digests
 * stay on the training thread.
 *
 * Threads: start, finish, usable and stop are called by the training thread only; the thread
 * is made at the first start and joined by train_digest_stop. */
#include "clock.h"
#include "device.h"
#include "log.h"
#include "model.h"
#include "train_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TAG "train"

struct train_digester {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int armed;    /* a job was started and not finished */
    int ready;    /* its copies are done (set by the host function on the copy stream) */
    int running;  /* the thread is hashing it */
    int done;     /* its results are in */
    int quit;
    int fn_pending; /* a host function was queued and has not run yet: set by start, cleared
                       only by that function; no job starts while it is set (so the function
                       always belongs to the current job, or to a dropped one when !armed),
                       and stop leaks d rather than free it under that function */
    /* the job: read by the thread between ready and done */
    const float *params, *m, *v;
    size_t np, lo, hi, olo;
    char params_hex[33];
    uint64_t mine[2];
    double hash_s; /* seconds the thread hashed */
};

static void *digest_thread(void *arg)
{
    train_digester *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->quit && !(d->armed && d->ready && !d->done)) pthread_cond_wait(&d->cv, &d->mu);
        if (d->quit) break;
        d->running = 1;
        pthread_mutex_unlock(&d->mu);
        double t0 = clock_now_s();
        char hex[33];
        uint64_t mine[2];
        train_digest_hex(d->params, d->np, hex);
        train_moments_digest_local(d->m, d->v, d->lo, d->hi, d->olo, mine);
        double t1 = clock_now_s();
        pthread_mutex_lock(&d->mu);
        memcpy(d->params_hex, hex, sizeof hex);
        memcpy(d->mine, mine, sizeof mine);
        d->hash_s = t1 - t0;
        d->running = 0;
        d->done = 1;
        pthread_cond_broadcast(&d->cv);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* The host function on the copy stream: the state's copies before it are done. It only
 * signals (a CUDA host function must not call CUDA, and should return soon). */
static void copies_done(void *ctx)
{
    train_digester *d = ctx;
    pthread_mutex_lock(&d->mu);
    d->fn_pending = 0;
    if (d->armed) {
        d->ready = 1;
        pthread_cond_broadcast(&d->cv);
    }
    pthread_mutex_unlock(&d->mu);
}

int train_digest_usable(const state *s)
{
    int live = train_device_kind_of(s->dev) == TRAIN_DEVICE_CPU;
    return !(live && s->o->zero_stage == 3 && s->world > 1);
}

static int digester_make(state *s)
{
    if (s->digester) return 0;
    train_digester *d = calloc(1, sizeof *d);
    if (!d) return -ENOMEM;
    pthread_mutex_init(&d->mu, NULL);
    pthread_condattr_t ca; /* its timed waits on the monotonic clock (clock.h) */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&d->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&d->th, NULL, digest_thread, d);
    if (rc != 0) {
        pthread_cond_destroy(&d->cv);
        pthread_mutex_destroy(&d->mu);
        free(d);
        return -rc;
    }
    s->digester = d;
    return 0;
}

int train_digest_start(state *s, train_stream *st)
{
    if (!train_digest_usable(s)) return -EOPNOTSUPP;
    int rc = digester_make(s);
    if (rc < 0) return rc;
    train_digester *d = s->digester;
    pthread_mutex_lock(&d->mu);
    if (d->armed || d->fn_pending) { /* a job not finished, or a dropped job's host function
                                         still to come: never two at once */
        pthread_mutex_unlock(&d->mu);
        return -EBUSY;
    }
    d->params = s->params_host;
    d->np = s->np;
    d->m = s->m;
    d->v = s->v;
    d->lo = s->lo;
    d->hi = s->hi;
    d->olo = s->olo;
    d->armed = 1;
    d->fn_pending = 1;
    d->ready = d->done = 0;
    pthread_mutex_unlock(&d->mu);
    rc = train_stream_host_fn(st, copies_done, d);
    if (rc < 0) { /* not queued: it will not run */
        pthread_mutex_lock(&d->mu);
        d->armed = 0;
        d->fn_pending = 0;
        pthread_mutex_unlock(&d->mu);
    }
    return rc;
}

int train_digest_finish(state *s, double timeout_s, char params_hex[33], uint64_t mine[2],
                        double *hash_s)
{
    train_digester *d = s->digester;
    if (!d) return -EINVAL;
    struct timespec until;
    clock_deadline_in(CLOCK_MONOTONIC, &until, timeout_s);
    pthread_mutex_lock(&d->mu);
    if (!d->armed) {
        pthread_mutex_unlock(&d->mu);
        return -EINVAL;
    }
    int rc = 0;
    while (!d->done && rc == 0) rc = pthread_cond_timedwait(&d->cv, &d->mu, &until);
    if (d->done) {
        memcpy(params_hex, d->params_hex, 33);
        memcpy(mine, d->mine, sizeof d->mine);
        if (hash_s) *hash_s = d->hash_s;
        d->armed = 0;
        rc = 0;
    } else {
        rc = -ETIMEDOUT; /* the job stays armed: no other starts (train_digest_start: -EBUSY) */
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

int train_digest_cancel(state *s, double timeout_s)
{
    train_digester *d = s->digester;
    if (!d) return 0;
    struct timespec until;
    clock_deadline_in(CLOCK_MONOTONIC, &until, timeout_s);
    pthread_mutex_lock(&d->mu);
    /* a job whose copies never signalled (the copy stream failed) is dropped (its host
     * function, should it still run, finds it not armed); one being hashed is waited for, so
     * that its reads of the host view end before the caller goes on */
    int rc = 0;
    while (d->running && rc == 0) rc = pthread_cond_timedwait(&d->cv, &d->mu, &until);
    if (!d->running) {
        d->armed = d->ready = d->done = 0;
        rc = 0;
    } else {
        rc = -ETIMEDOUT;
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

void train_digest_stop(state *s)
{
    train_digester *d = s->digester;
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    /* a host function may still come from a copy stream left running (the stager's destroy
     * timed out): the thread ends all the same (it never hashes after quit), d stays */
    const int fn_may_come = d->fn_pending;
    d->quit = 1;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->th, NULL); /* bounded: a hash under way is a finite pass over the host view */
    s->digester = NULL;
    if (fn_may_come) return; /* leaked rather than freed under that host function */
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->mu);
    free(d);
}
