/* The CPU kind of device.h: host memory for "device" memory, a synchronous compute stream, and
 * worker-thread streams with a FIFO queue so that asynchronous copies and events behave as
 * they do on a GPU (pending until the worker reaches them).
 *
 * Events count their recordings (rec_gen) and the highest recording a stream has reached
 * (done_gen): an event is complete when done_gen >= rec_gen, so recording it again moves the
 * mark. A queued operation that names an event holds a reference on it, so that destroying an
 * event never frees it under a worker.
 *
 * Failures are sticky per stream: once a stream has failed (a cross-stream wait passed its
 * bound, the event it waited for failed, an injected error, or its destroy gave up), its
 * worker skips every later copy and host function and completes later events with the
 * error, so a failed stream drains at once and never touches the caller's buffers again.
 */
#include "clock.h"
#include "device_internal.h"
#include "log.h"
#include "thread.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEVICE_ALIGN 256
#define HOST_ALIGN 64
#define WAIT_BOUND_DEFAULT_S 300.0 /* one cross-stream wait */
#define WAIT_SLICE_S 0.05          /* how often a waiting worker looks for its abandonment */
#define DESTROY_WAIT_S 60.0        /* train_event_destroy on a pending event */

typedef struct cpu_event {
    train_event base;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC; done_gen moved or err set */
    uint64_t rec_gen;  /* recordings so far; 0 = never recorded */
    uint64_t done_gen; /* the highest recording a stream has reached */
    int err;           /* sticky: the error of a stream that reached a recording */
    atomic_int refs;   /* the owner, and each queued operation naming the event */
} cpu_event;

enum op_type { OP_COPY, OP_HOST_FN, OP_RECORD, OP_WAIT, OP_FAIL };

typedef struct cpu_op {
    struct cpu_op *next;
    enum op_type type;
    void *dst; /* OP_COPY */
    const void *src;
    size_t bytes;
    void (*fn)(void *ctx); /* OP_HOST_FN */
    void *ctx;
    cpu_event *ev; /* OP_RECORD, OP_WAIT: holds a reference */
    uint64_t gen;  /* the recording to reach (OP_RECORD) or to wait for (OP_WAIT) */
    double bound;  /* OP_WAIT, seconds */
    int err;       /* OP_FAIL */
} cpu_op;

typedef struct cpu_stream {
    train_stream base;
    int worker; /* 0: the compute stream (synchronous, no thread) */
    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* worker: an operation was queued, or stop */
    pthread_cond_t cv_done; /* CLOCK_MONOTONIC; sync and destroy: an operation finished */
    /* under mu */
    cpu_op *head, *tail;
    uint64_t queued, done; /* operations queued / finished so far */
    int err;               /* sticky */
    int stop;              /* the worker exits once the queue is empty */
    atomic_int abandoned;  /* destroy gave up: the worker frees the stream when it exits */
    pthread_t thread;
} cpu_stream;

typedef struct cpu_device {
    train_device base;
    cpu_stream compute;
    _Atomic double wait_bound_s;
} cpu_device;

static cpu_device *dev_of(train_device *d) { return (cpu_device *)d; }
static cpu_stream *stream_of(train_stream *s) { return (cpu_stream *)s; }
static cpu_event *event_of(train_event *e) { return (cpu_event *)e; }

static struct timespec ts_of(double t)
{
    double whole = floor(t);
    struct timespec ts = {(time_t)whole, (long)((t - whole) * 1e9)};
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

static int cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    int rc = -pthread_condattr_init(&ca);
    if (rc < 0) return rc;
    rc = -pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines immune to clock steps */
    if (rc == 0) rc = -pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

/* --- events --- */

static void event_unref(cpu_event *e)
{
    if (atomic_fetch_sub(&e->refs, 1) != 1) return;
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* A stream reached recording gen of e, with the stream's error err (0 = none). */
static void event_reach(cpu_event *e, uint64_t gen, int err)
{
    pthread_mutex_lock(&e->mu);
    if (err && !e->err) e->err = err;
    if (gen > e->done_gen) e->done_gen = gen;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* Wait until e reached recording gen: 0, the event's sticky error, -ETIMEDOUT after
 * timeout_s, or -ECANCELED once *abandoned is set (looked at every WAIT_SLICE_S). */
static int event_wait_gen(cpu_event *e, uint64_t gen, double timeout_s, atomic_int *abandoned)
{
    double end = clock_now_s() + timeout_s;
    int rc;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->err) {
            rc = e->err;
            break;
        }
        if (e->done_gen >= gen) {
            rc = 0;
            break;
        }
        if (abandoned && atomic_load(abandoned)) {
            rc = -ECANCELED;
            break;
        }
        double now = clock_now_s();
        if (now >= end) {
            rc = -ETIMEDOUT;
            break;
        }
        double wake = abandoned && now + WAIT_SLICE_S < end ? now + WAIT_SLICE_S : end;
        struct timespec ts = ts_of(wake);
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* The recording to wait for, or 0 when e was never recorded. */
static uint64_t event_rec_gen(cpu_event *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t gen = e->rec_gen;
    pthread_mutex_unlock(&e->mu);
    return gen;
}

static uint64_t event_next_gen(cpu_event *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t gen = ++e->rec_gen;
    pthread_mutex_unlock(&e->mu);
    return gen;
}

static int cpu_event_create(train_device *d, train_event **out)
{
    cpu_event *e = calloc(1, sizeof *e);
    if (!e) return -ENOMEM;
    int rc = -pthread_mutex_init(&e->mu, NULL);
    if (rc < 0) {
        free(e);
        return rc;
    }
    if ((rc = cond_init_monotonic(&e->cv)) < 0) {
        pthread_mutex_destroy(&e->mu);
        free(e);
        return rc;
    }
    atomic_init(&e->refs, 1);
    e->base.ops = &train_device_cpu_ops;
    e->base.dev = d;
    *out = &e->base;
    return 0;
}

static void cpu_event_destroy(train_event *te)
{
    cpu_event *e = event_of(te);
    uint64_t gen = event_rec_gen(e);
    if (gen && event_wait_gen(e, gen, DESTROY_WAIT_S, NULL) == -ETIMEDOUT)
        LOG_W("device", "cpu event destroyed while still pending after %.0f s", DESTROY_WAIT_S);
    event_unref(e); /* a queued operation may still hold it: the last reference frees */
}

static int cpu_event_query(train_event *te)
{
    cpu_event *e = event_of(te);
    pthread_mutex_lock(&e->mu);
    int rc = e->rec_gen == 0 ? -EINVAL : e->err ? e->err : e->done_gen >= e->rec_gen;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

static int cpu_event_wait(train_event *te, double timeout_s)
{
    cpu_event *e = event_of(te);
    uint64_t gen = event_rec_gen(e);
    return gen ? event_wait_gen(e, gen, timeout_s, NULL) : -EINVAL;
}

/* --- streams --- */

static void stream_fini(cpu_stream *s)
{
    pthread_cond_destroy(&s->cv_done);
    pthread_cond_destroy(&s->cv_work);
    pthread_mutex_destroy(&s->mu);
}

static int stream_init(cpu_stream *s, train_device *d, int worker)
{
    s->base.ops = &train_device_cpu_ops;
    s->base.dev = d;
    s->worker = worker;
    atomic_init(&s->abandoned, 0);
    int rc = -pthread_mutex_init(&s->mu, NULL);
    if (rc < 0) return rc;
    if ((rc = -pthread_cond_init(&s->cv_work, NULL)) < 0) {
        pthread_mutex_destroy(&s->mu);
        return rc;
    }
    if ((rc = cond_init_monotonic(&s->cv_done)) < 0) {
        pthread_cond_destroy(&s->cv_work);
        pthread_mutex_destroy(&s->mu);
        return rc;
    }
    return 0;
}

static int stream_err(cpu_stream *s)
{
    pthread_mutex_lock(&s->mu);
    int err = s->err;
    pthread_mutex_unlock(&s->mu);
    return err;
}

static void stream_fail(cpu_stream *s, int err)
{
    pthread_mutex_lock(&s->mu);
    if (!s->err) s->err = err;
    pthread_mutex_unlock(&s->mu);
}

static cpu_op *op_new(enum op_type type)
{
    cpu_op *o = calloc(1, sizeof *o);
    if (o) o->type = type;
    return o;
}

static void op_free(cpu_op *o)
{
    if (o->ev) event_unref(o->ev);
    free(o);
}

/* Queue o on worker stream s. A failed stream refuses it (returns the sticky error, o
 * freed) unless force, which queues it anyway and returns the error. */
static int enqueue(cpu_stream *s, cpu_op *o, int force)
{
    pthread_mutex_lock(&s->mu);
    int rc = s->err;
    if (rc && !force) {
        pthread_mutex_unlock(&s->mu);
        op_free(o);
        return rc;
    }
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    s->queued++;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Run one operation on the worker; err is the stream's error when it was taken off the
 * queue (0 = healthy). Returns 0 or the error that fails the stream. */
static int run_op(cpu_stream *s, cpu_op *o, int err)
{
    switch (o->type) {
    case OP_COPY:
        if (!err) memmove(o->dst, o->src, o->bytes);
        return 0;
    case OP_HOST_FN:
        if (!err) o->fn(o->ctx);
        return 0;
    case OP_RECORD: event_reach(o->ev, o->gen, err); return 0;
    case OP_WAIT: {
        if (err) return 0;
        int rc = event_wait_gen(o->ev, o->gen, o->bound, &s->abandoned);
        if (rc == -ECANCELED) return 0; /* abandoned: the stream has failed already */
        if (rc == -ETIMEDOUT)
            LOG_E("device", "cpu stream: a cross-stream event wait passed its bound of %.3g s",
                  o->bound);
        return rc;
    }
    case OP_FAIL: return err ? 0 : o->err;
    }
    return 0;
}

static void *worker_main(void *arg)
{
    cpu_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->cv_work, &s->mu);
        cpu_op *o = s->head;
        if (!o) break; /* stop, and nothing left */
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        int err = s->err;
        pthread_mutex_unlock(&s->mu);

        int rc = run_op(s, o, err);
        op_free(o);

        pthread_mutex_lock(&s->mu);
        if (rc < 0 && !s->err) s->err = rc;
        s->done++;
        pthread_cond_broadcast(&s->cv_done);
    }
    int self_free = atomic_load(&s->abandoned);
    pthread_mutex_unlock(&s->mu);
    if (self_free) {
        stream_fini(s);
        free(s);
    }
    return NULL;
}

/* Wait (under s->mu) until the operations queued so far are done: 0 or -ETIMEDOUT. */
static int drain_locked(cpu_stream *s, double timeout_s)
{
    uint64_t target = s->queued;
    double end = clock_now_s() + timeout_s;
    while (s->done < target) {
        if (clock_now_s() >= end) return -ETIMEDOUT;
        struct timespec ts = ts_of(end);
        pthread_cond_timedwait(&s->cv_done, &s->mu, &ts);
    }
    return 0;
}

static train_stream *cpu_compute_stream(train_device *d)
{
    return &dev_of(d)->compute.base;
}

static int cpu_stream_create(train_device *d, train_stream **out)
{
    cpu_stream *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    int rc = stream_init(s, d, 1);
    if (rc < 0) {
        free(s);
        return rc;
    }
    if ((rc = common_thread_start(&s->thread, worker_main, s)) < 0) {
        stream_fini(s);
        free(s);
        return rc;
    }
    *out = &s->base;
    return 0;
}

static int cpu_stream_destroy(train_stream *ts, double timeout_s)
{
    cpu_stream *s = stream_of(ts);
    pthread_mutex_lock(&s->mu);
    int rc = drain_locked(s, timeout_s);
    if (rc == -ETIMEDOUT) {
        /* The worker is still in an operation (a host function that does not return, a
         * copy): never free under it. It skips what is left and frees the stream itself. */
        if (!s->err) s->err = -ETIMEDOUT;
        atomic_store(&s->abandoned, 1);
        s->stop = 1;
        pthread_cond_signal(&s->cv_work);
        pthread_t th = s->thread;
        pthread_mutex_unlock(&s->mu);
        pthread_detach(th);
        LOG_W("device", "cpu stream destroyed with work still running after %.3g s: abandoned",
              timeout_s);
        return -ETIMEDOUT;
    }
    s->stop = 1;
    pthread_cond_signal(&s->cv_work);
    rc = s->err;
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    stream_fini(s);
    free(s);
    return rc;
}

static void *cpu_stream_native(train_stream *s)
{
    (void)s;
    return NULL;
}

static int cpu_copy_async(train_stream *ts, void *dst, const void *src, size_t bytes,
                          train_copy_kind kind)
{
    (void)kind; /* every kind is a memcpy here */
    cpu_stream *s = stream_of(ts);
    if (!s->worker) {
        int err = stream_err(s);
        if (!err) memmove(dst, src, bytes);
        return err;
    }
    cpu_op *o = op_new(OP_COPY);
    if (!o) return -ENOMEM;
    o->dst = dst;
    o->src = src;
    o->bytes = bytes;
    return enqueue(s, o, 0);
}

static int cpu_host_fn(train_stream *ts, void (*fn)(void *ctx), void *ctx)
{
    cpu_stream *s = stream_of(ts);
    if (!s->worker) {
        int err = stream_err(s);
        if (!err) fn(ctx);
        return err;
    }
    cpu_op *o = op_new(OP_HOST_FN);
    if (!o) return -ENOMEM;
    o->fn = fn;
    o->ctx = ctx;
    return enqueue(s, o, 0);
}

static int cpu_stream_sync(train_stream *ts, double timeout_s)
{
    cpu_stream *s = stream_of(ts);
    pthread_mutex_lock(&s->mu);
    int rc = s->worker ? drain_locked(s, timeout_s) : 0;
    if (rc == 0) rc = s->err;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int cpu_event_record(train_event *te, train_stream *ts)
{
    cpu_event *e = event_of(te);
    cpu_stream *s = stream_of(ts);
    if (!s->worker) { /* everything before it is done already */
        int err = stream_err(s);
        event_reach(e, event_next_gen(e), err);
        return err;
    }
    cpu_op *o = op_new(OP_RECORD);
    if (!o) return -ENOMEM;
    atomic_fetch_add(&e->refs, 1);
    o->ev = e;
    o->gen = event_next_gen(e);
    return enqueue(s, o, 1); /* queued even on a failed stream, to complete with the error */
}

static int cpu_stream_wait_event(train_stream *ts, train_event *te)
{
    cpu_event *e = event_of(te);
    cpu_stream *s = stream_of(ts);
    uint64_t gen = event_rec_gen(e);
    if (!gen) return -EINVAL;
    double bound = atomic_load(&dev_of(s->base.dev)->wait_bound_s);
    if (!s->worker) { /* later work runs in the caller: wait here */
        int err = stream_err(s);
        if (err) return err;
        int rc = event_wait_gen(e, gen, bound, NULL);
        if (rc < 0) {
            if (rc == -ETIMEDOUT)
                LOG_E("device", "cpu compute stream: an event wait passed its bound of %.3g s",
                      bound);
            stream_fail(s, rc);
        }
        return rc;
    }
    cpu_op *o = op_new(OP_WAIT);
    if (!o) return -ENOMEM;
    atomic_fetch_add(&e->refs, 1);
    o->ev = e;
    o->gen = gen;
    o->bound = bound;
    return enqueue(s, o, 0);
}

/* --- the device --- */

static int cpu_count(void) { return 1; }

static int cpu_open(train_device **out, int ordinal, char *why, size_t why_len)
{
    if (ordinal != 0) {
        log_why(why, why_len, "--device cpu: there is one CPU device (ordinal 0), not %d", ordinal);
        return -ENODEV;
    }
    cpu_device *d = calloc(1, sizeof *d);
    if (!d) return -ENOMEM;
    atomic_init(&d->wait_bound_s, WAIT_BOUND_DEFAULT_S);
    int rc = stream_init(&d->compute, &d->base, 0);
    if (rc < 0) {
        log_why(why, why_len, "--device cpu: %s", strerror(-rc));
        free(d);
        return rc;
    }
    *out = &d->base;
    return 0;
}

static void cpu_close(train_device *td)
{
    cpu_device *d = dev_of(td);
    stream_fini(&d->compute);
    free(d);
}

static const char *cpu_describe(const train_device *d)
{
    (void)d;
    return "cpu";
}

static int aligned_zeroed(void **out, size_t align, size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, align, bytes) != 0) return -ENOMEM;
    memset(p, 0, bytes);
    *out = p;
    return 0;
}

static int cpu_alloc(train_device *d, void **out, size_t bytes)
{
    (void)d;
    return aligned_zeroed(out, DEVICE_ALIGN, bytes);
}

static void cpu_free(train_device *d, void *p)
{
    (void)d;
    free(p);
}

static int cpu_zero(train_device *d, void *p, size_t bytes)
{
    int err = stream_err(&dev_of(d)->compute);
    if (!err) memset(p, 0, bytes);
    return err;
}

static int cpu_copy(train_device *d, void *dst, const void *src, size_t bytes,
                    train_copy_kind kind)
{
    (void)kind;
    int err = stream_err(&dev_of(d)->compute);
    if (!err) memmove(dst, src, bytes);
    return err;
}

static int cpu_host_alloc(train_device *d, void **out, size_t bytes)
{
    (void)d;
    return aligned_zeroed(out, HOST_ALIGN, bytes);
}

static int cpu_host_pin(train_device *d, void *p, size_t bytes)
{
    (void)d, (void)p, (void)bytes; /* ordinary memory: device.c remembers the range */
    return 0;
}

static int cpu_host_unpin(train_device *d, void *p)
{
    (void)d, (void)p;
    return 0;
}

int train_device_cpu_set_wait_bound(train_device *d, double seconds)
{
    if (!d || d->ops != &train_device_cpu_ops || !(seconds > 0) || !isfinite(seconds))
        return -EINVAL;
    atomic_store(&dev_of(d)->wait_bound_s, seconds);
    return 0;
}

int train_stream_cpu_inject_error(train_stream *ts, int err)
{
    if (!ts || ts->ops != &train_device_cpu_ops || err >= 0) return -EINVAL;
    cpu_stream *s = stream_of(ts);
    if (!s->worker) return -EINVAL;
    cpu_op *o = op_new(OP_FAIL);
    if (!o) return -ENOMEM;
    o->err = err;
    return enqueue(s, o, 0);
}

const train_device_ops train_device_cpu_ops = {
    .kind = TRAIN_DEVICE_CPU,
    .count = cpu_count,
    .open = cpu_open,
    .close = cpu_close,
    .describe = cpu_describe,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .host_pin = cpu_host_pin,
    .host_unpin = cpu_host_unpin,
    .compute_stream = cpu_compute_stream,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .stream_native = cpu_stream_native,
    .copy_async = cpu_copy_async,
    .host_fn = cpu_host_fn,
    .stream_sync = cpu_stream_sync,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .stream_wait_event = cpu_stream_wait_event,
    .event_query = cpu_event_query,
    .event_wait = cpu_event_wait,
};
