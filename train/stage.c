/* Snapshot staging from device memory (the engine's copier over the device layer) and the
 * restore path through two pinned bounce buffers. See stage.h. */
#include "stage.h"

#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TAG "stage"

/* One ticket's event. The ring holds tickets [first, next) at positions head, head + 1, ...
 * (mod cap); positions outside that range keep their (complete) events for reuse. */
typedef struct ev_slot {
    train_event *ev; /* NULL until first needed */
    uint64_t ticket;
    int waiters; /* threads inside train_event_wait on ev: it is not reused meanwhile */
} ev_slot;

struct train_stager {
    train_device *dev;
    train_stream *copy;
    train_event *order; /* after_compute's event on the compute stream */
    double timeout_s;
    pthread_mutex_t mu; /* the ring and the ticket counters */
    ev_slot *ring;
    size_t cap, head, count;
    uint64_t first, next; /* first + count == next; tickets start at 1 */
};

int train_stager_create(train_stager **out, train_device *dev, double timeout_s)
{
    if (!out) return -EINVAL;
    *out = NULL;
    if (!dev || !(timeout_s > 0)) return -EINVAL;
    train_stager *st = calloc(1, sizeof *st);
    if (!st) return -ENOMEM;
    st->dev = dev;
    st->timeout_s = timeout_s;
    st->first = st->next = 1;
    int rc = train_stream_create(dev, &st->copy);
    if (rc == 0) rc = train_event_create(dev, &st->order);
    if (rc == 0) {
        st->cap = 16;
        st->ring = calloc(st->cap, sizeof *st->ring);
        if (!st->ring) rc = -ENOMEM;
    }
    if (rc < 0) {
        train_event_destroy(st->order);
        train_stream_destroy(st->copy, timeout_s);
        free(st->ring);
        free(st);
        return rc;
    }
    pthread_mutex_init(&st->mu, NULL);
    *out = st;
    return 0;
}

int train_stager_destroy(train_stager *st)
{
    if (!st) return 0;
    /* drain first, then the events (recorded on the stream), then the stream itself */
    int rc = train_stream_sync(st->copy, st->timeout_s);
    if (rc == -ETIMEDOUT) {
        /* the copy stream still runs: its events may still be reached; leak, never free */
        LOG_E(TAG, "copy stream still busy after %.0f s; abandoning the stager", st->timeout_s);
        return rc;
    }
    for (size_t i = 0; i < st->cap; i++) train_event_destroy(st->ring[i].ev);
    train_event_destroy(st->order);
    int d = train_stream_destroy(st->copy, st->timeout_s);
    if (rc == 0) rc = d;
    free(st->ring);
    pthread_mutex_destroy(&st->mu);
    free(st);
    return rc;
}

train_stream *train_stager_stream(train_stager *st)
{
    return st ? st->copy : NULL;
}

static int stager_pin(void *ctx, void *host, size_t bytes)
{
    train_stager *st = ctx;
    return train_host_register(st->dev, host, bytes);
}

static void stager_unpin(void *ctx, void *host)
{
    train_stager *st = ctx;
    int rc = train_host_unregister(st->dev, host);
    if (rc < 0) LOG_W(TAG, "unregistering the staging area failed: %s", strerror(-rc));
}

static int stager_copy(void *ctx, void *host_dst, const void *device_src, size_t bytes,
                       uint64_t *ticket)
{
    return train_stager_copy(ctx, host_dst, device_src, bytes, ticket);
}

static int stager_wait(void *ctx, uint64_t ticket, double timeout_s)
{
    return train_stager_wait(ctx, ticket, timeout_s);
}

void train_stager_copier(train_stager *st, ckpt_copier *out)
{
    out->ctx = st;
    out->pin = stager_pin;
    out->unpin = stager_unpin;
    out->copy = stager_copy;
    out->wait = stager_wait;
    out->timeout_s = st ? st->timeout_s : 0;
}

int train_stager_after(train_stager *st, train_event *ev)
{
    if (!st || !ev) return -EINVAL;
    return train_stream_wait_event(st->copy, ev);
}

int train_stager_after_compute(train_stager *st)
{
    if (!st) return -EINVAL;
    int rc = train_event_record(st->order, NULL);
    return rc < 0 ? rc : train_stream_wait_event(st->copy, st->order);
}

/* Drop complete tickets from the front of the ring (mutex held): their events may be reused.
 * A ticket someone is waiting on stays, and so do the ones after it (order is kept). */
static void ring_recycle(train_stager *st)
{
    while (st->count > 0) {
        ev_slot *s = &st->ring[st->head];
        if (s->waiters > 0 || train_event_query(s->ev) != 1) break;
        st->head = (st->head + 1) % st->cap;
        st->count--;
        st->first++;
    }
}

/* Double the ring (mutex held): live tickets move to positions 0.., in order. */
static int ring_grow(train_stager *st)
{
    size_t cap = st->cap * 2;
    ev_slot *r = calloc(cap, sizeof *r);
    if (!r) return -ENOMEM;
    for (size_t i = 0; i < st->cap; i++) r[i] = st->ring[(st->head + i) % st->cap];
    free(st->ring);
    st->ring = r;
    st->cap = cap;
    st->head = 0;
    return 0;
}

int train_stager_copy(train_stager *st, void *host_dst, const void *device_src, size_t bytes,
                      uint64_t *ticket)
{
    if (!st || !ticket || (bytes && (!host_dst || !device_src))) return -EINVAL;
    pthread_mutex_lock(&st->mu);
    ring_recycle(st);
    int rc = 0;
    if (st->count == st->cap) rc = ring_grow(st);
    ev_slot *s = NULL;
    if (rc == 0) {
        s = &st->ring[(st->head + st->count) % st->cap];
        if (!s->ev) rc = train_event_create(st->dev, &s->ev);
    }
    /* the slot is not yet visible to waiters (its ticket is not handed out): recording it
     * under the mutex keeps the ring consistent for the waiters that look up other slots */
    if (rc == 0) rc = train_stream_copy_async(st->copy, host_dst, device_src, bytes, TRAIN_COPY_D2H);
    if (rc == 0 && (rc = train_event_record(s->ev, st->copy)) < 0) {
        /* the copy is queued but untracked: let it finish before host_dst can be reused */
        int w = train_stream_sync(st->copy, st->timeout_s);
        if (w < 0) LOG_E(TAG, "copy stream did not drain after a failed event record: %s", strerror(-w));
    }
    if (rc == 0) {
        s->ticket = st->next;
        *ticket = st->next++;
        st->count++;
    }
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int train_stager_wait(train_stager *st, uint64_t ticket, double timeout_s)
{
    if (!st) return -EINVAL;
    pthread_mutex_lock(&st->mu);
    if (ticket == 0 || ticket >= st->next) {
        pthread_mutex_unlock(&st->mu);
        return -EINVAL;
    }
    if (ticket < st->first) { /* complete, and its event recycled */
        pthread_mutex_unlock(&st->mu);
        return 0;
    }
    ev_slot *s = &st->ring[(st->head + (size_t)(ticket - st->first)) % st->cap];
    train_event *ev = s->ev;
    s->waiters++;
    pthread_mutex_unlock(&st->mu);
    int rc = train_event_wait(ev, timeout_s);
    pthread_mutex_lock(&st->mu);
    /* the slot cannot have been recycled (waiters > 0), but the ring may have grown */
    st->ring[(st->head + (size_t)(ticket - st->first)) % st->cap].waiters--;
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int train_stager_wait_all(train_stager *st, double timeout_s)
{
    if (!st) return -EINVAL;
    return train_stream_sync(st->copy, timeout_s);
}

uint64_t train_stager_tickets(train_stager *st)
{
    if (!st) return 0;
    pthread_mutex_lock(&st->mu);
    uint64_t n = st->next - 1;
    pthread_mutex_unlock(&st->mu);
    return n;
}

/* ------------------------------------------------------------------ restore */

int train_stage_restore_fn(train_stager *st, train_stage_read_fn read, void *ctx,
                           uint64_t offset, uint64_t len, void *dst_dev, size_t slice_bytes)
{
    if (!st || !read || (len && !dst_dev)) return -EINVAL;
    if (len == 0) return 0;
    size_t slice = slice_bytes ? slice_bytes : TRAIN_STAGE_SLICE_DEFAULT;
    if (slice > len) slice = (size_t)len;
    void *bounce[2] = {NULL, NULL};
    train_event *ev[2] = {NULL, NULL};
    int used[2] = {0, 0};
    /* dst_dev may have been written by work on the compute stream (initialization): the
     * copies come after it */
    int rc = train_stager_after_compute(st);
    if (rc == 0) rc = train_host_alloc_pinned(st->dev, &bounce[0], slice);
    if (rc == 0 && len > slice) rc = train_host_alloc_pinned(st->dev, &bounce[1], slice);
    if (rc == 0) rc = train_event_create(st->dev, &ev[0]);
    if (rc == 0 && len > slice) rc = train_event_create(st->dev, &ev[1]);
    int queued = 0;
    for (uint64_t done = 0, k = 0; rc == 0 && done < len; done += slice, k++) {
        int b = (int)(k & 1);
        size_t n = (size_t)(len - done < slice ? len - done : slice);
        /* the buffer's previous copy must be done before the next read overwrites it */
        if (used[b] && (rc = train_event_wait(ev[b], st->timeout_s)) < 0) {
            LOG_E(TAG, "restore: the copy of a slice did not finish: %s", strerror(-rc));
            break;
        }
        if ((rc = read(ctx, offset + done, n, bounce[b])) < 0) break;
        rc = train_stream_copy_async(st->copy, (uint8_t *)dst_dev + done, bounce[b], n,
                                     TRAIN_COPY_H2D);
        if (rc < 0) break;
        queued = 1;
        if ((rc = train_event_record(ev[b], st->copy)) < 0) break;
        used[b] = 1;
    }
    /* every byte in place, or (after an error) no copy left reading the bounce buffers */
    int sync = queued ? train_stream_sync(st->copy, st->timeout_s) : 0;
    if (sync < 0 && rc == 0) rc = sync;
    if (sync == -ETIMEDOUT) {
        LOG_E(TAG, "restore: copies still running after %.0f s; leaking the bounce buffers",
              st->timeout_s);
        return rc;
    }
    for (int i = 0; i < 2; i++) {
        train_event_destroy(ev[i]);
        train_host_free_pinned(st->dev, bounce[i]);
    }
    return rc;
}

typedef struct snap_read {
    ckpt_snapshot *s;
    const char *name;
} snap_read;

static int read_snapshot(void *ctx, uint64_t offset, uint64_t len, void *host_dst)
{
    snap_read *r = ctx;
    char bad[512] = "";
    int rc = ckpt_snapshot_read(r->s, r->name, offset, len, host_dst, bad, sizeof bad);
    if (rc == -EBADMSG) LOG_E(TAG, "restore of %s: %s", r->name, bad[0] ? bad : "corrupt chunk");
    else if (rc < 0) LOG_E(TAG, "restore of %s at %llu (%llu bytes): %s", r->name,
                           (unsigned long long)offset, (unsigned long long)len, strerror(-rc));
    return rc;
}

int train_stage_restore(train_stager *st, ckpt_snapshot *s, const char *name, uint64_t offset,
                        uint64_t len, void *dst_dev, size_t slice_bytes)
{
    if (!s || !name) return -EINVAL;
    snap_read r = {s, name};
    return train_stage_restore_fn(st, read_snapshot, &r, offset, len, dst_dev, slice_bytes);
}
