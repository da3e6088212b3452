/* The device layer's kind dispatch: the argument checks both kinds share, the registered-range
 * table, and the call through the kind's ops table (device_internal.h). */
#include "device_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const train_device_ops *ops_of(train_device_kind kind)
{
    switch (kind) {
    case TRAIN_DEVICE_CPU: return &train_device_cpu_ops;
    case TRAIN_DEVICE_CUDA: return &train_device_cuda_ops;
    }
    return NULL;
}

static int copy_kind_ok(train_copy_kind kind)
{
    return kind == TRAIN_COPY_H2D || kind == TRAIN_COPY_D2H || kind == TRAIN_COPY_D2D ||
           kind == TRAIN_COPY_H2H;
}

/* A timeout in seconds: finite and >= 0 (NaN fails the comparison); capped at 1e9 s. */
static int timeout_ok(double *t)
{
    if (!(*t >= 0)) return 0;
    if (*t > 1e9) *t = 1e9;
    return 1;
}

int train_device_parse(const char *text, train_device_kind *kind, int *ordinal)
{
    if (!text || !kind) return -EINVAL;
    if (strcmp(text, "cpu") == 0) {
        *kind = TRAIN_DEVICE_CPU;
        if (ordinal) *ordinal = 0;
        return 0;
    }
    if (strncmp(text, "cuda", 4) != 0) return -EINVAL;
    const char *p = text + 4;
    long n = 0;
    if (*p == ':') {
        p++;
        if (*p < '0' || *p > '9') return -EINVAL; /* "cuda:", "cuda:-1", "cuda: 1" */
        for (; *p >= '0' && *p <= '9'; p++) {
            n = n * 10 + (*p - '0');
            if (n > INT_MAX) return -EINVAL;
        }
    }
    if (*p != '\0') return -EINVAL; /* "cudax", "cuda:1x" */
    *kind = TRAIN_DEVICE_CUDA;
    if (ordinal) *ordinal = (int)n;
    return 0;
}

int train_device_count(train_device_kind kind)
{
    const train_device_ops *ops = ops_of(kind);
    return ops ? ops->count() : -EINVAL;
}

int train_device_open(train_device **out, train_device_kind kind, int ordinal, char *why,
                      size_t why_len)
{
    if (why && why_len) why[0] = '\0';
    const train_device_ops *ops = ops_of(kind);
    if (!out || !ops || ordinal < 0) return -EINVAL;
    *out = NULL;
    train_device *d = NULL;
    int rc = ops->open(&d, ordinal, why, why_len);
    if (rc < 0) return rc;
    d->ops = ops;
    d->kind = kind;
    d->reg = NULL;
    d->nreg = d->capreg = 0;
    if ((rc = -pthread_mutex_init(&d->reg_mu, NULL)) < 0) {
        ops->close(d);
        return rc;
    }
    *out = d;
    return 0;
}

void train_device_close(train_device *d)
{
    if (!d) return;
    /* the compute stream first (as the header says), so that no copy it still runs uses a
     * range unregistered below; after a timeout the ranges stay registered (the process's) */
    const int drained = d->nreg == 0 || d->ops->stream_sync(d->ops->compute_stream(d), 60.0) != -ETIMEDOUT;
    for (size_t i = 0; drained && i < d->nreg; i++) /* ranges the caller left registered */
        d->ops->host_unpin(d, d->reg[i].p);
    pthread_mutex_destroy(&d->reg_mu);
    free(d->reg);
    d->reg = NULL;
    d->ops->close(d);
}

train_device_kind train_device_kind_of(const train_device *d)
{
    return d ? d->kind : TRAIN_DEVICE_CPU;
}

const char *train_device_describe(const train_device *d)
{
    return d ? d->ops->describe(d) : "(no device)";
}

int train_device_alloc(train_device *d, void **out, size_t bytes)
{
    if (!d || !out || bytes == 0) return -EINVAL;
    *out = NULL;
    return d->ops->alloc(d, out, bytes);
}

void train_device_free(train_device *d, void *p)
{
    if (d && p) d->ops->free(d, p);
}

int train_device_zero(train_device *d, void *p, size_t bytes)
{
    if (!d || (!p && bytes)) return -EINVAL;
    return bytes ? d->ops->zero(d, p, bytes) : 0;
}

int train_device_copy(train_device *d, void *dst, const void *src, size_t bytes,
                      train_copy_kind kind)
{
    if (!d || !copy_kind_ok(kind) || (bytes && (!dst || !src))) return -EINVAL;
    return bytes ? d->ops->copy(d, dst, src, bytes, kind) : 0;
}

int train_host_alloc_pinned(train_device *d, void **out, size_t bytes)
{
    if (!d || !out || bytes == 0) return -EINVAL;
    *out = NULL;
    return d->ops->host_alloc(d, out, bytes);
}

void train_host_free_pinned(train_device *d, void *p)
{
    if (d && p) d->ops->host_free(d, p);
}

int train_host_register(train_device *d, void *p, size_t bytes)
{
    if (!d || !p || bytes == 0) return -EINVAL;
    char *b = p;
    if ((uintptr_t)b + bytes < (uintptr_t)b) return -EINVAL; /* wraps around */
    int rc = 0;
    pthread_mutex_lock(&d->reg_mu);
    for (size_t i = 0; i < d->nreg; i++) /* an overlap: CUDA's "already registered" */
        if (b < d->reg[i].p + d->reg[i].bytes && d->reg[i].p < b + bytes) {
            rc = -EINVAL;
            goto out;
        }
    if (d->nreg == d->capreg) {
        size_t cap = d->capreg ? 2 * d->capreg : 8;
        train_reg_range *r = realloc(d->reg, cap * sizeof *r);
        if (!r) {
            rc = -ENOMEM;
            goto out;
        }
        d->reg = r;
        d->capreg = cap;
    }
    if ((rc = d->ops->host_pin(d, p, bytes)) < 0) goto out;
    d->reg[d->nreg++] = (train_reg_range){b, bytes};
out:
    pthread_mutex_unlock(&d->reg_mu);
    return rc;
}

int train_host_unregister(train_device *d, void *p)
{
    if (!d || !p) return -EINVAL;
    int rc = -EINVAL; /* not the start of a registered range */
    pthread_mutex_lock(&d->reg_mu);
    for (size_t i = 0; i < d->nreg; i++)
        if (d->reg[i].p == (char *)p) {
            rc = d->ops->host_unpin(d, p);
            d->reg[i] = d->reg[--d->nreg]; /* forgotten even when CUDA refused */
            break;
        }
    pthread_mutex_unlock(&d->reg_mu);
    return rc;
}

train_stream *train_device_compute_stream(train_device *d)
{
    return d ? d->ops->compute_stream(d) : NULL;
}

int train_stream_create(train_device *d, train_stream **out)
{
    if (!d || !out) return -EINVAL;
    *out = NULL;
    return d->ops->stream_create(d, out);
}

int train_stream_destroy(train_stream *s, double timeout_s)
{
    if (!s) return 0;
    if (!timeout_ok(&timeout_s)) return -EINVAL;
    if (s == s->ops->compute_stream(s->dev)) return -EINVAL; /* owned by the device */
    return s->ops->stream_destroy(s, timeout_s);
}

void *train_stream_native(train_stream *s) { return s ? s->ops->stream_native(s) : NULL; }

int train_stream_copy_async(train_stream *s, void *dst, const void *src, size_t bytes,
                            train_copy_kind kind)
{
    if (!s || !copy_kind_ok(kind) || (bytes && (!dst || !src))) return -EINVAL;
    if (bytes == 0) return 0;
    return s->ops->copy_async(s, dst, src, bytes, kind);
}

int train_stream_host_fn(train_stream *s, void (*fn)(void *ctx), void *ctx)
{
    if (!s || !fn) return -EINVAL;
    return s->ops->host_fn(s, fn, ctx);
}

int train_stream_sync(train_stream *s, double timeout_s)
{
    if (!s || !timeout_ok(&timeout_s)) return -EINVAL;
    return s->ops->stream_sync(s, timeout_s);
}

int train_event_create(train_device *d, train_event **out)
{
    if (!d || !out) return -EINVAL;
    *out = NULL;
    return d->ops->event_create(d, out);
}

void train_event_destroy(train_event *e)
{
    if (e) e->ops->event_destroy(e);
}

int train_event_record(train_event *e, train_stream *s)
{
    if (!e) return -EINVAL;
    if (!s) s = e->ops->compute_stream(e->dev);
    if (s->ops != e->ops) return -EINVAL;
    return e->ops->event_record(e, s);
}

int train_stream_wait_event(train_stream *s, train_event *e)
{
    if (!s || !e || s->ops != e->ops) return -EINVAL;
    return s->ops->stream_wait_event(s, e);
}

int train_event_query(train_event *e) { return e ? e->ops->event_query(e) : -EINVAL; }

int train_event_wait(train_event *e, double timeout_s)
{
    if (!e || !timeout_ok(&timeout_s)) return -EINVAL;
    return e->ops->event_wait(e, timeout_s);
}
