/* The CUDA kind of device.h over the CUDA runtime API (libcudart; never the driver API).
 *
 * Every CUDA error enters here: it is translated once (-EIO, or -ENOMEM for
 * cudaErrorMemoryAllocation, -EINVAL for a host range CUDA refuses as such) and logged once
 * with the call, cudaGetErrorName and cudaGetErrorString; the stream or event it happened on
 * then stays failed (sticky) and later calls return the error without logging again.
 *
 * Waits poll cudaStreamQuery / cudaEventQuery with sleeps growing from 10 us to 1 ms instead
 * of blocking in the driver, so that every wait has a bound. The current device is
 * per-thread in CUDA: every call that allocates or queues work sets it first (cudaSetDevice is
 * cheap when it is already current), so that any thread may use a device.
 */
#include "clock.h"
#include "device_internal.h"
#include "log.h"

#include <cuda_runtime_api.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SYNC_BOUND_S 300.0  /* the synchronous calls' wait for the compute stream */
#define DESTROY_WAIT_S 60.0 /* train_event_destroy / train_device_close */
/* The pinned bounce buffer of train_device_copy between the device and pageable host memory,
 * in bytes: a copy of N bytes takes ceil(N / BOUNCE_BYTES) round trips. */
#define BOUNCE_BYTES ((size_t)8 << 20)

typedef struct cuda_stream {
    train_stream base;
    cudaStream_t st;
    int ordinal;
    int compute;    /* the device's compute stream (not destroyed by train_stream_destroy) */
    atomic_int err; /* sticky */
} cuda_stream;

typedef struct cuda_event {
    train_event base;
    cudaEvent_t ev;
    int ordinal;
    atomic_int recorded;
    atomic_int marked; /* the last cudaEventRecord succeeded: ev completes after its work */
    atomic_int err;    /* sticky */
} cuda_event;

typedef struct cuda_device {
    train_device base;
    int ordinal;
    cuda_stream compute;
    /* train_device_copy's pinned bounce buffer (BOUNCE_BYTES, made on first use) and the lock
     * that gives it to one copy at a time */
    pthread_mutex_t bounce_mu;
    void *bounce;
    char desc[352]; /* "cuda:N " + a name of up to 256 + " (sm_XY, N GiB)" */
} cuda_device;

static cuda_device *dev_of(train_device *d) { return (cuda_device *)d; }
static cuda_stream *stream_of(train_stream *s) { return (cuda_stream *)s; }
static cuda_event *event_of(train_event *e) { return (cuda_event *)e; }

static int errno_of(cudaError_t e)
{
    switch (e) {
    case cudaErrorMemoryAllocation: return -ENOMEM;
    default: return -EIO;
    }
}

/* Log a failed call once and translate its error. The thread's last error is cleared, so
 * that a non-sticky failure (an allocation) is not reported again by the kernels' launch
 * checks (cudaGetLastError). */
static int cuda_fail(cudaError_t e, const char *call)
{
    (void)cudaGetLastError();
    LOG_E("device", "%s: %s (%s)", call, cudaGetErrorName(e), cudaGetErrorString(e));
    return errno_of(e);
}

/* The first error of a stream or event is kept and logged; later ones are returned quietly. */
static int fail_sticky(atomic_int *sticky, cudaError_t e, const char *call)
{
    int rc = errno_of(e);
    int expected = 0;
    if (atomic_compare_exchange_strong(sticky, &expected, rc)) return cuda_fail(e, call);
    (void)cudaGetLastError();
    return atomic_load(sticky);
}

static int set_device(int ordinal)
{
    cudaError_t e = cudaSetDevice(ordinal);
    return e == cudaSuccess ? 0 : cuda_fail(e, "cudaSetDevice");
}

static void sleep_ns(long ns)
{
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

/* Poll st (or, when st is NULL, ev) until done: 0, -ETIMEDOUT after timeout_s, or -EIO with
 * the CUDA error in *cerr (not logged: the caller keeps it sticky and logs once). */
static int poll_ready(cudaStream_t st, cudaEvent_t ev, double timeout_s, cudaError_t *cerr)
{
    double end = clock_now_s() + timeout_s;
    long nap = 10000;
    for (;;) {
        cudaError_t e = st ? cudaStreamQuery(st) : cudaEventQuery(ev);
        if (e == cudaSuccess) return 0;
        if (e != cudaErrorNotReady) {
            *cerr = e;
            return -EIO;
        }
        if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
        if (clock_now_s() >= end) return -ETIMEDOUT;
        sleep_ns(nap);
        if (nap < 1000000) nap *= 2;
    }
}

/* Wait for everything queued on s, also when s has failed already: a caller that frees or
 * reuses memory after an error return relies on no copy still being in flight (the CPU kind
 * drains its queue before it returns the error too). Then the sticky error, if any. After a
 * sticky CUDA error (an illegal address, say) cudaStreamQuery returns it at once. */
static int stream_wait(cuda_stream *s, double timeout_s)
{
    int rc = set_device(s->ordinal);
    if (rc < 0) return rc;
    cudaError_t ce = cudaSuccess;
    rc = poll_ready(s->st, NULL, timeout_s, &ce);
    if (rc == -EIO) return fail_sticky(&s->err, ce, "cudaStreamQuery");
    if (rc) return rc; /* -ETIMEDOUT: work is still queued, whatever failed before */
    return atomic_load(&s->err);
}

static enum cudaMemcpyKind memcpy_kind(train_copy_kind kind)
{
    switch (kind) {
    case TRAIN_COPY_H2D: return cudaMemcpyHostToDevice;
    case TRAIN_COPY_D2H: return cudaMemcpyDeviceToHost;
    case TRAIN_COPY_D2D: return cudaMemcpyDeviceToDevice;
    case TRAIN_COPY_H2H: return cudaMemcpyHostToHost;
    }
    return cudaMemcpyDefault;
}

/* --- the device --- */

static int cuda_count(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    return n > 0 ? n : -ENODEV;
}

static int cuda_open(train_device **out, int ordinal, char *why, size_t why_len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        log_why(why, why_len,
                "--device cuda: no CUDA device (cudaGetDeviceCount: error %d, %s: %s)", (int)e,
                cudaGetErrorName(e), cudaGetErrorString(e));
        return -ENODEV;
    }
    if (n <= 0) {
        log_why(why, why_len,
                "--device cuda: no CUDA device (cudaGetDeviceCount reports 0 devices)");
        return -ENODEV;
    }
    if (ordinal >= n) {
        log_why(why, why_len, "--device cuda:%d: no such device (cudaGetDeviceCount reports %d)",
                ordinal, n);
        return -ENODEV;
    }
    cuda_device *d = calloc(1, sizeof *d);
    if (!d) return -ENOMEM;
    const char *call = "cudaSetDevice";
    struct cudaDeviceProp prop;
    if ((e = cudaSetDevice(ordinal)) != cudaSuccess) goto fail;
    call = "cudaGetDeviceProperties";
    if ((e = cudaGetDeviceProperties(&prop, ordinal)) != cudaSuccess) goto fail;
    call = "cudaStreamCreateWithFlags";
    if ((e = cudaStreamCreateWithFlags(&d->compute.st, cudaStreamNonBlocking)) != cudaSuccess)
        goto fail;
    d->ordinal = ordinal;
    d->compute.base.ops = &train_device_cuda_ops;
    d->compute.base.dev = &d->base;
    d->compute.ordinal = ordinal;
    d->compute.compute = 1;
    atomic_init(&d->compute.err, 0);
    pthread_mutex_init(&d->bounce_mu, NULL);
    prop.name[sizeof prop.name - 1] = '\0';
    snprintf(d->desc, sizeof d->desc, "cuda:%d %s (sm_%d%d, %zu GiB)", ordinal, prop.name,
             prop.major, prop.minor, (size_t)(prop.totalGlobalMem >> 30));
    *out = &d->base;
    return 0;
fail:
    log_why(why, why_len, "--device cuda:%d: %s: %s (%s)", ordinal, call, cudaGetErrorName(e),
            cudaGetErrorString(e));
    int rc = cuda_fail(e, call);
    free(d);
    return rc;
}

static void cuda_close(train_device *td)
{
    cuda_device *d = dev_of(td);
    if (set_device(d->ordinal) == 0) {
        int rc = stream_wait(&d->compute, DESTROY_WAIT_S);
        if (rc == -ETIMEDOUT)
            LOG_W("device",
                  "cuda:%d closed with work still running on the compute stream after %.0f s",
                  d->ordinal, DESTROY_WAIT_S);
        cudaError_t e = cudaStreamDestroy(d->compute.st);
        if (e != cudaSuccess) cuda_fail(e, "cudaStreamDestroy");
        /* after a timeout a copy may still use the bounce buffer: it is left to the process */
        if (rc != -ETIMEDOUT && d->bounce && (e = cudaFreeHost(d->bounce)) != cudaSuccess)
            cuda_fail(e, "cudaFreeHost");
    }
    pthread_mutex_destroy(&d->bounce_mu);
    free(d);
}

static const char *cuda_describe(const train_device *d) { return ((const cuda_device *)d)->desc; }

static int cuda_alloc(train_device *td, void **out, size_t bytes)
{
    cuda_device *d = dev_of(td);
    int rc = set_device(d->ordinal);
    if (rc < 0) return rc;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) return cuda_fail(e, "cudaMalloc");
    /* Zeroed before any stream can see it: the memset is on the compute stream, and the
     * other streams (copy streams) are not ordered after it, so wait for it here. */
    e = cudaMemsetAsync(p, 0, bytes, d->compute.st);
    if (e != cudaSuccess)
        rc = fail_sticky(&d->compute.err, e, "cudaMemsetAsync");
    else
        rc = stream_wait(&d->compute, SYNC_BOUND_S);
    if (rc == -ETIMEDOUT) {
        /* the memset is still queued: cudaFree would wait for it without a bound (it
         * synchronises the device), so the allocation is left to the process */
        LOG_W("device", "cuda:%d: %zu bytes leaked: their zeroing did not finish in %.0f s",
              d->ordinal, bytes, SYNC_BOUND_S);
        return rc;
    }
    if (rc < 0) {
        (void)cudaFree(p);
        return rc;
    }
    *out = p;
    return 0;
}

static void cuda_free(train_device *td, void *p)
{
    if (set_device(dev_of(td)->ordinal) < 0) return;
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) cuda_fail(e, "cudaFree");
}

static int cuda_zero(train_device *td, void *p, size_t bytes)
{
    cuda_device *d = dev_of(td);
    int rc = atomic_load(&d->compute.err);
    if (rc) return rc;
    if ((rc = set_device(d->ordinal)) < 0) return rc;
    cudaError_t e = cudaMemsetAsync(p, 0, bytes, d->compute.st);
    return e == cudaSuccess ? 0 : fail_sticky(&d->compute.err, e, "cudaMemsetAsync");
}

/* 1 when p is in page-locked host memory (cudaHostAlloc'd or cudaHostRegister'ed), which
 * cudaMemcpyAsync reaches by DMA without staging; 0 for pageable memory or when CUDA cannot
 * tell. */
static int host_is_pinned(const void *p)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeHost;
}

/* train_device_copy between the device and pageable host memory, in chunks through the
 * device's pinned bounce buffer, each copy followed by the bounded wait. cudaMemcpyAsync with
 * a pageable host side may wait inside the driver for the work queued before it on the
 * stream, without a bound (CUDA runtime API, "API synchronization behavior": for pageable
 * memory the driver "may synchronize with the stream and stage the copy into pinned
 * memory"); from pinned memory it only queues the copy. Called with the device current. */
static int bounce_copy(cuda_device *d, void *dst, const void *src, size_t bytes,
                       train_copy_kind kind)
{
    const int up = kind == TRAIN_COPY_H2D;
    int rc = 0;
    pthread_mutex_lock(&d->bounce_mu);
    if (!d->bounce) {
        cudaError_t e = cudaHostAlloc(&d->bounce, BOUNCE_BYTES, cudaHostAllocPortable);
        if (e != cudaSuccess) {
            d->bounce = NULL;
            rc = cuda_fail(e, "cudaHostAlloc (copy bounce buffer)");
        }
    }
    for (size_t off = 0; rc == 0 && off < bytes;) {
        const size_t n = bytes - off < BOUNCE_BYTES ? bytes - off : BOUNCE_BYTES;
        if (up) memcpy(d->bounce, (const char *)src + off, n);
        cudaError_t e = cudaMemcpyAsync(up ? (char *)dst + off : d->bounce,
                                        up ? d->bounce : (const char *)src + off, n,
                                        memcpy_kind(kind), d->compute.st);
        if (e != cudaSuccess) {
            rc = fail_sticky(&d->compute.err, e, "cudaMemcpyAsync");
            break;
        }
        if ((rc = stream_wait(&d->compute, SYNC_BOUND_S)) < 0) break;
        if (!up) memcpy((char *)dst + off, d->bounce, n);
        off += n;
    }
    /* a copy that timed out may still read or write the buffer: leave it, take a new one */
    if (rc == -ETIMEDOUT) d->bounce = NULL;
    pthread_mutex_unlock(&d->bounce_mu);
    return rc;
}

static int cuda_copy(train_device *td, void *dst, const void *src, size_t bytes,
                     train_copy_kind kind)
{
    cuda_device *d = dev_of(td);
    int rc = atomic_load(&d->compute.err);
    if (rc) return rc;
    if ((rc = set_device(d->ordinal)) < 0) return rc;
    if ((kind == TRAIN_COPY_H2D && !host_is_pinned(src)) ||
        (kind == TRAIN_COPY_D2H && !host_is_pinned(dst)))
        return bounce_copy(d, dst, src, bytes, kind);
    /* on the compute stream, so that it follows the kernels queued there */
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, memcpy_kind(kind), d->compute.st);
    if (e != cudaSuccess) return fail_sticky(&d->compute.err, e, "cudaMemcpyAsync");
    return stream_wait(&d->compute, SYNC_BOUND_S);
}

static int cuda_host_alloc(train_device *td, void **out, size_t bytes)
{
    int rc = set_device(dev_of(td)->ordinal);
    if (rc < 0) return rc;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable); /* page-aligned */
    if (e != cudaSuccess) return cuda_fail(e, "cudaHostAlloc");
    memset(p, 0, bytes);
    *out = p;
    return 0;
}

static void cuda_host_free(train_device *td, void *p)
{
    (void)set_device(dev_of(td)->ordinal); /* a thread without a device would make a context on 0 */
    cudaError_t e = cudaFreeHost(p);
    if (e != cudaSuccess) cuda_fail(e, "cudaFreeHost");
}

static int cuda_host_pin(train_device *td, void *p, size_t bytes)
{
    int rc = set_device(dev_of(td)->ordinal);
    if (rc < 0) return rc;
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e == cudaSuccess) return 0;
    if (e == cudaErrorHostMemoryAlreadyRegistered) { /* by someone else in this process */
        (void)cudaGetLastError();
        return -EINVAL;
    }
    return cuda_fail(e, "cudaHostRegister");
}

static int cuda_host_unpin(train_device *td, void *p)
{
    int rc = set_device(dev_of(td)->ordinal);
    if (rc < 0) return rc;
    cudaError_t e = cudaHostUnregister(p);
    if (e == cudaSuccess) return 0;
    if (e == cudaErrorHostMemoryNotRegistered) {
        (void)cudaGetLastError();
        return -EINVAL;
    }
    return cuda_fail(e, "cudaHostUnregister");
}

/* --- streams --- */

static train_stream *cuda_compute_stream(train_device *d) { return &dev_of(d)->compute.base; }

static int cuda_stream_create(train_device *td, train_stream **out)
{
    cuda_device *d = dev_of(td);
    int rc = set_device(d->ordinal);
    if (rc < 0) return rc;
    cuda_stream *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    cudaError_t e = cudaStreamCreateWithFlags(&s->st, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(s);
        return cuda_fail(e, "cudaStreamCreateWithFlags");
    }
    s->base.ops = &train_device_cuda_ops;
    s->base.dev = td;
    s->ordinal = d->ordinal;
    atomic_init(&s->err, 0);
    *out = &s->base;
    return 0;
}

static int cuda_stream_destroy(train_stream *ts, double timeout_s)
{
    cuda_stream *s = stream_of(ts);
    int rc = stream_wait(s, timeout_s);
    if (rc == -ETIMEDOUT)
        LOG_W("device", "cuda:%d stream destroyed with work still running after %.3g s", s->ordinal,
              timeout_s);
    /* Legal with work pending: CUDA releases the stream when the work is done, so nothing of
     * ours runs under freed memory. */
    cudaError_t e = cudaStreamDestroy(s->st);
    if (e != cudaSuccess) {
        int r = cuda_fail(e, "cudaStreamDestroy");
        if (rc == 0) rc = r;
    }
    free(s);
    return rc;
}

static void *cuda_stream_native(train_stream *s) { return (void *)stream_of(s)->st; }

static int cuda_copy_async(train_stream *ts, void *dst, const void *src, size_t bytes,
                           train_copy_kind kind)
{
    cuda_stream *s = stream_of(ts);
    int rc = atomic_load(&s->err);
    if (rc) return rc;
    if ((rc = set_device(s->ordinal)) < 0) return rc;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, memcpy_kind(kind), s->st);
    return e == cudaSuccess ? 0 : fail_sticky(&s->err, e, "cudaMemcpyAsync");
}

static int cuda_host_fn(train_stream *ts, void (*fn)(void *ctx), void *ctx)
{
    cuda_stream *s = stream_of(ts);
    int rc = atomic_load(&s->err);
    if (rc) return rc;
    if ((rc = set_device(s->ordinal)) < 0) return rc;
    cudaError_t e = cudaLaunchHostFunc(s->st, (cudaHostFn_t)fn, ctx);
    return e == cudaSuccess ? 0 : fail_sticky(&s->err, e, "cudaLaunchHostFunc");
}

static int cuda_stream_sync(train_stream *ts, double timeout_s)
{
    return stream_wait(stream_of(ts), timeout_s);
}

/* --- events --- */

static int cuda_event_create(train_device *td, train_event **out)
{
    cuda_device *d = dev_of(td);
    int rc = set_device(d->ordinal);
    if (rc < 0) return rc;
    cuda_event *e = calloc(1, sizeof *e);
    if (!e) return -ENOMEM;
    cudaError_t ce = cudaEventCreateWithFlags(&e->ev, cudaEventDisableTiming);
    if (ce != cudaSuccess) {
        free(e);
        return cuda_fail(ce, "cudaEventCreateWithFlags");
    }
    e->base.ops = &train_device_cuda_ops;
    e->base.dev = td;
    e->ordinal = d->ordinal;
    atomic_init(&e->recorded, 0);
    atomic_init(&e->marked, 0);
    atomic_init(&e->err, 0);
    *out = &e->base;
    return 0;
}

/* Wait until e is complete, then its error if it has one: an event recorded after failed
 * work (cuda_event_record) is still a mark in its stream, and a waiter that reuses memory on
 * the error must not get it before the copies queued ahead of the mark are done. An event
 * whose last cudaEventRecord failed marks nothing (e->marked 0): its error at once. */
static int event_wait_poll(cuda_event *e, double timeout_s)
{
    if (!atomic_load(&e->recorded)) return -EINVAL;
    int err = atomic_load(&e->err);
    if (err && !atomic_load(&e->marked)) return err;
    /* the engine's persist workers wait here: bind their thread to the event's device, or
     * the runtime would make a context on device 0 in every process (cheap when already set) */
    int rc = set_device(e->ordinal);
    if (rc < 0) return rc;
    cudaError_t ce = cudaSuccess;
    rc = poll_ready(NULL, e->ev, timeout_s, &ce);
    if (rc == -EIO) return fail_sticky(&e->err, ce, "cudaEventQuery");
    if (rc) return rc;
    return atomic_load(&e->err);
}

static void cuda_event_destroy(train_event *te)
{
    cuda_event *e = event_of(te);
    if (atomic_load(&e->recorded) && event_wait_poll(e, DESTROY_WAIT_S) == -ETIMEDOUT)
        LOG_W("device", "cuda:%d event destroyed while still pending after %.0f s", e->ordinal,
              DESTROY_WAIT_S);
    (void)set_device(e->ordinal); /* also for an event never recorded (see event_wait_poll) */
    cudaError_t ce = cudaEventDestroy(e->ev); /* legal while pending */
    if (ce != cudaSuccess) cuda_fail(ce, "cudaEventDestroy");
    free(e);
}

static int cuda_event_record(train_event *te, train_stream *ts)
{
    cuda_event *e = event_of(te);
    cuda_stream *s = stream_of(ts);
    /* after failed work on s the event fails too, but it is still recorded, so that it
     * completes only once the work queued ahead of it is done (event_wait_poll) */
    const int serr = atomic_load(&s->err);
    int rc = set_device(s->ordinal);
    if (rc < 0) return rc;
    cudaError_t ce = cudaEventRecord(e->ev, s->st);
    atomic_store(&e->marked, ce == cudaSuccess);
    rc = serr;
    if (ce != cudaSuccess) rc = fail_sticky(&s->err, ce, "cudaEventRecord");
    if (rc) {
        int expected = 0;
        atomic_compare_exchange_strong(&e->err, &expected, rc);
    }
    atomic_store(&e->recorded, 1);
    return rc;
}

static int cuda_stream_wait_event(train_stream *ts, train_event *te)
{
    cuda_event *e = event_of(te);
    cuda_stream *s = stream_of(ts);
    if (!atomic_load(&e->recorded)) return -EINVAL;
    int rc = atomic_load(&s->err);
    if (rc) return rc;
    int eerr = atomic_load(&e->err);
    if (eerr) { /* what s would wait for failed: so does s */
        int expected = 0;
        atomic_compare_exchange_strong(&s->err, &expected, eerr);
        return eerr;
    }
    if ((rc = set_device(s->ordinal)) < 0) return rc;
    cudaError_t ce = cudaStreamWaitEvent(s->st, e->ev, 0);
    return ce == cudaSuccess ? 0 : fail_sticky(&s->err, ce, "cudaStreamWaitEvent");
}

static int cuda_event_query(train_event *te)
{
    cuda_event *e = event_of(te);
    if (!atomic_load(&e->recorded)) return -EINVAL;
    int err = atomic_load(&e->err);
    if (err && !atomic_load(&e->marked)) return err;
    if ((err = set_device(e->ordinal)) < 0) return err; /* any thread: see event_wait_poll */
    cudaError_t ce = cudaEventQuery(e->ev);
    if (ce == cudaSuccess) return atomic_load(&e->err) ? atomic_load(&e->err) : 1;
    if (ce == cudaErrorNotReady) {
        if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
        return 0;
    }
    return fail_sticky(&e->err, ce, "cudaEventQuery");
}

static int cuda_event_wait(train_event *te, double timeout_s)
{
    return event_wait_poll(event_of(te), timeout_s);
}

const train_device_ops train_device_cuda_ops = {
    .kind = TRAIN_DEVICE_CUDA,
    .count = cuda_count,
    .open = cuda_open,
    .close = cuda_close,
    .describe = cuda_describe,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .zero = cuda_zero,
    .copy = cuda_copy,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_pin = cuda_host_pin,
    .host_unpin = cuda_host_unpin,
    .compute_stream = cuda_compute_stream,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_native = cuda_stream_native,
    .copy_async = cuda_copy_async,
    .host_fn = cuda_host_fn,
    .stream_sync = cuda_stream_sync,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .stream_wait_event = cuda_stream_wait_event,
    .event_query = cuda_event_query,
    .event_wait = cuda_event_wait,
};
