/* store_file.c - sequential writer and range reader over io_uring, O_DIRECT when allowed.
 *
 * Writer: queue_depth aligned buffers allocated once; buffer i holds the bytes of one
 * buffer_bytes-sized slice of the file and is in flight or free. Reader: requests are cut
 * into pieces; a piece is read straight into the caller's memory when it is aligned (or the
 * file is buffered), otherwise through a per-slot bounce buffer whose total size is bounded.
 */
#include "storage.h"

#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TAG "store"

/* Consecutive resubmissions of one request without progress (-EAGAIN, -EINTR, 0 bytes)
 * before giving up; keeps a misbehaving device from spinning us forever. */
#define MAX_RETRIES 1000u
/* Bytes one read request may move straight into the caller's buffer. */
#define READ_PIECE_MAX (16u << 20)
/* Bounce memory of a reader in O_DIRECT mode, all slots together, and the per-slot range. */
#define READ_BOUNCE_TOTAL (4u << 20)
#define READ_CHUNK_MIN (64u << 10)
#define READ_CHUNK_MAX (1u << 20)
/* After a timeout, how long to wait for cancelled requests before abandoning them. */
#define CANCEL_WAIT_S 5

static uint64_t align_down(uint64_t x) { return x & ~(uint64_t)(STORE_ALIGN - 1); }
static uint64_t align_up(uint64_t x) { return align_down(x + STORE_ALIGN - 1); }
static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* ---- fault injection (CKPT_FAULT_STORE) ---- */

static atomic_int fault_parsed;       /* 0 not yet, 1 parsed */
static atomic_int fault_err;          /* -ENOSPC / -EIO, 0 = off */
static atomic_ullong fault_nth;       /* 1-based index of the write that fails */
static atomic_ullong fault_count;     /* data writes submitted so far in this process */
static atomic_ullong fault_slow_ms;   /* slow:MS - every data write waits MS milliseconds */
static atomic_ullong fault_read_nth;  /* eio-read:N - 1-based index of the read call that fails */
static atomic_ullong fault_read_count;/* store_reader_read calls so far in this process */
static atomic_ullong fault_read_slow_ms; /* slow-read:MS - every read call waits MS ms */

static void fault_parse(void)
{
    if (atomic_load(&fault_parsed)) return;
    /* Concurrent first calls parse the same string to the same values: the race is benign. */
    const char *s = getenv("CKPT_FAULT_STORE");
    int err = 0;
    unsigned long long n = 0;
    if (s && *s) {
        const char *num = NULL;
        if (!strncmp(s, "enospc:", 7)) {
            err = -ENOSPC;
            num = s + 7;
        } else if (!strncmp(s, "eio:", 4)) {
            err = -EIO;
            num = s + 4;
        } else if (!strncmp(s, "slow:", 5)) {
            err = 1; /* not an error: a delay */
            num = s + 5;
        } else if (!strncmp(s, "eio-read:", 9)) {
            err = 2; /* a read, not a write */
            num = s + 9;
        } else if (!strncmp(s, "slow-read:", 10)) {
            err = 3;
            num = s + 10;
        }
        char *end = NULL;
        if (num) {
            errno = 0;
            n = strtoull(num, &end, 10);
        }
        if (!num || errno || end == num || *end || n == 0) {
            LOG_W(TAG, "ignoring malformed CKPT_FAULT_STORE=\"%s\" (want enospc:N, eio:N, "
                  "eio-read:N, slow:MS or slow-read:MS)", s);
            err = 0;
            n = 0;
        }
    }
    if (err == 1) {
        atomic_store(&fault_slow_ms, n);
        err = 0;
        n = 0;
    } else if (err == 2) {
        atomic_store(&fault_read_nth, n);
        err = 0;
        n = 0;
    } else if (err == 3) {
        atomic_store(&fault_read_slow_ms, n);
        err = 0;
        n = 0;
    }
    atomic_store(&fault_nth, n);
    atomic_store(&fault_err, err);
    atomic_store(&fault_parsed, 1);
}

/* CKPT_FAULT_DIR: one-shot faults armed at run time. The process whose unlink of
 * DIR/<name> succeeds takes the fault ("store-enospc", "store-eio": the next data write;
 * "store-eio-read": the next read call). */
static char fault_dir[3072];
static pthread_once_t fault_dir_once = PTHREAD_ONCE_INIT;

static void fault_dir_load(void)
{
    const char *s = getenv("CKPT_FAULT_DIR");
    if (s && *s && strlen(s) < sizeof fault_dir) memcpy(fault_dir, s, strlen(s) + 1);
}

int store_fault_armed(const char *name)
{
    pthread_once(&fault_dir_once, fault_dir_load);
    if (!fault_dir[0]) return 0;
    char path[sizeof fault_dir + 64];
    if (snprintf(path, sizeof path, "%s/%s", fault_dir, name) >= (int)sizeof path) return 0;
    return unlink(path) == 0;
}

/* Called once per data write submitted by a writer; returns the error to inject or 0. */
static int fault_next(void)
{
    fault_parse();
    if (store_fault_armed("store-enospc")) return -ENOSPC;
    if (store_fault_armed("store-eio")) return -EIO;
    unsigned long long slow = atomic_load(&fault_slow_ms);
    if (slow) {
        struct timespec ts = {(time_t)(slow / 1000), (long)(slow % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    int err = atomic_load(&fault_err);
    if (!err) return 0;
    unsigned long long k = atomic_fetch_add(&fault_count, 1) + 1;
    return k == atomic_load(&fault_nth) ? err : 0;
}

/* ---- ring helpers ---- */

/* Wait for one completion for at most STORE_WAIT_TIMEOUT_S in all (EINTR does not restart
 * the clock). Returns 0 with *cqe set, -ETIMEDOUT, or -errno. */
static int ring_wait(struct io_uring *ring, struct io_uring_cqe **cqe, int timeout_s)
{
    struct timespec now, end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += timeout_s;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long left_ns = (long long)(end.tv_sec - now.tv_sec) * 1000000000LL +
                            (end.tv_nsec - now.tv_nsec);
        if (left_ns <= 0) return -ETIMEDOUT;
        struct __kernel_timespec ts = {.tv_sec = left_ns / 1000000000LL,
                                       .tv_nsec = left_ns % 1000000000LL};
        int rc = io_uring_wait_cqe_timeout(ring, cqe, &ts);
        if (rc == 0) return 0;
        if (rc == -ETIME) return -ETIMEDOUT;
        if (rc != -EINTR) return rc;
    }
}

static struct io_uring_sqe *ring_sqe(struct io_uring *ring)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (!sqe) { /* cannot happen with one SQE per slot; flush and retry to be safe */
        io_uring_submit(ring);
        sqe = io_uring_get_sqe(ring);
    }
    return sqe;
}

static int ring_submit(struct io_uring *ring, const char *path)
{
    for (;;) {
        int rc = io_uring_submit(ring);
        if (rc >= 0) return 0;
        if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
        LOG_E(TAG, "io_uring_submit (%s): %s", path, strerror(-rc));
        return rc;
    }
}

/* Ask the kernel to cancel everything in flight on the ring (after a timeout). */
static void ring_cancel_all(struct io_uring *ring)
{
    struct io_uring_sqe *sqe = ring_sqe(ring);
    if (!sqe) return;
    io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
    io_uring_sqe_set_data64(sqe, UINT64_MAX);
    io_uring_submit(ring);
}

/* ---- writer ---- */

typedef struct wslot {
    unsigned char *data; /* buffer_bytes, STORE_ALIGN-aligned */
    size_t fill;         /* bytes copied in */
    size_t len;          /* bytes to write (fill, padded in O_DIRECT mode) */
    size_t done;         /* bytes the kernel confirmed */
    uint64_t off;        /* file offset of data[0] */
    unsigned retries;    /* consecutive resubmissions without progress */
    int fault;           /* injected error to report on completion */
    bool fresh;          /* next request is the slot's first (counted for fault injection) */
    bool busy;           /* a request is in flight */
} wslot;

struct store_writer {
    struct io_uring ring;
    bool owns_mem; /* buffers allocated here (not caller's opts.memory) */
    int fd;
    bool direct;    /* opened with O_DIRECT: buffers are padded to STORE_ALIGN */
    bool fd_direct; /* O_DIRECT still set on fd (cleared after an unaligned short write) */
    bool stuck; /* requests may still be in flight after a timeout: do not free buffers */
    int err;    /* sticky first error */
    size_t buf_bytes;
    unsigned qd;
    unsigned cur;      /* slot being filled; never busy between calls */
    unsigned inflight; /* busy slots */
    uint64_t logical;  /* bytes appended */
    uint64_t next_off; /* file offset of the slot being filled */
    wslot *slots;
    wslot *refs;       /* qd writes straight from the caller's memory (store_writer_append_ref;
                          data points there, fill unused); request user data qd + index */
    uint64_t reserved; /* bytes preallocated by store_writer_reserve */
    char *path;
};

static void w_fail(store_writer *w, int err) { if (!w->err) w->err = err; }

/* The request of user data i: a buffer slot (i < qd) or a write from the caller's memory. */
static wslot *w_req(store_writer *w, uint64_t i)
{
    return i < w->qd ? &w->slots[i] : &w->refs[i - w->qd];
}

/* Queue the request for what remains of request i (w_req). */
static int w_queue(store_writer *w, unsigned i)
{
    wslot *s = w_req(w, i);
    struct io_uring_sqe *sqe = ring_sqe(&w->ring);
    if (!sqe) {
        LOG_E(TAG, "no submission queue entry for %s", w->path);
        return -EBUSY;
    }
    bool fresh = s->fresh;
    s->fresh = false;
    if (fresh && (s->fault = fault_next()) != 0) {
        LOG_W(TAG, "injecting %s on the write of %s at offset %llu (CKPT_FAULT_STORE or CKPT_FAULT_DIR)",
              strerror(-s->fault), w->path, (unsigned long long)s->off);
        io_uring_prep_nop(sqe);
    } else {
        io_uring_prep_write(sqe, w->fd, s->data + s->done, (unsigned)(s->len - s->done),
                            s->off + s->done);
    }
    io_uring_sqe_set_data64(sqe, i);
    return ring_submit(&w->ring, w->path);
}

static int w_reap(store_writer *w);

/* Wait until fewer than qd requests are in flight (buffer slots and writes from the caller's
 * memory together). Returns 0 or the sticky error. */
static int w_room(store_writer *w)
{
    while (w->inflight >= w->qd)
        if (w_reap(w)) return w->err;
    return w->err;
}

static int w_submit_slot(store_writer *w, unsigned i)
{
    wslot *s = &w->slots[i];
    int rc = w_room(w);
    if (rc) return rc;
    s->len = s->fill;
    if (w->direct && s->len % STORE_ALIGN) {
        size_t padded = (size_t)align_up(s->len);
        memset(s->data + s->len, 0, padded - s->len);
        s->len = padded;
    }
    s->done = 0;
    s->retries = 0;
    s->fault = 0;
    s->fresh = true;
    s->busy = true;
    w->inflight++;
    rc = w_queue(w, i);
    if (rc) {
        s->busy = false;
        w->inflight--;
        w_fail(w, rc);
    }
    return rc;
}

static void w_release(store_writer *w, wslot *s)
{
    s->busy = false;
    s->fill = 0;
    w->inflight--;
}

/* Account for one completion: finish the slot or resubmit its remainder. */
static void w_complete(store_writer *w, struct io_uring_cqe *cqe)
{
    uint64_t i = io_uring_cqe_get_data64(cqe);
    int res = cqe->res;
    io_uring_cqe_seen(&w->ring, cqe);
    if (i >= 2 * (uint64_t)w->qd) return; /* the cancel request itself */
    wslot *s = w_req(w, i);
    if (s->fault) {
        res = s->fault;
        s->fault = 0;
    }
    if (res > 0) {
        size_t before = s->done;
        s->done += (size_t)res;
        if (s->done >= s->len) {
            w_release(w, s);
            return;
        }
        /* Short write. With O_DIRECT the remainder must start aligned: drop O_DIRECT for
         * the rest of the file (buffers stay padded, close truncates), or, if that fails,
         * back up to the last aligned byte (rewriting it is harmless: same data, same
         * offset). */
        if (w->fd_direct && s->done % STORE_ALIGN) {
            int fl = fcntl(w->fd, F_GETFL);
            if (fl >= 0 && fcntl(w->fd, F_SETFL, fl & ~O_DIRECT) == 0) {
                w->fd_direct = false;
                LOG_W(TAG, "unaligned short write to %s at offset %llu; continuing buffered",
                      w->path, (unsigned long long)(s->off + s->done));
            } else {
                s->done = (size_t)align_down(s->done);
            }
        }
        if (s->done > before) {
            s->retries = 0;
        } else if (++s->retries > MAX_RETRIES) {
            LOG_E(TAG, "write of %s at offset %llu made no progress after %u tries", w->path,
                  (unsigned long long)(s->off + s->done), MAX_RETRIES);
            w_fail(w, -EIO);
            w_release(w, s);
            return;
        }
    } else if (res == 0 || res == -EAGAIN || res == -EINTR) {
        if (++s->retries > MAX_RETRIES) {
            res = res ? res : -EIO;
            LOG_E(TAG, "write of %s at offset %llu made no progress after %u tries: %s",
                  w->path, (unsigned long long)(s->off + s->done), MAX_RETRIES,
                  strerror(-res));
            w_fail(w, res);
            w_release(w, s);
            return;
        }
    } else {
        if (!w->err)
            LOG_E(TAG, "write of %s at offset %llu (%zu bytes): %s", w->path,
                  (unsigned long long)(s->off + s->done), s->len - s->done, strerror(-res));
        w_fail(w, res);
        w_release(w, s);
        return;
    }
    if (w->err) { /* already failed: stop writing */
        w_release(w, s);
        return;
    }
    int rc = w_queue(w, (unsigned)i);
    if (rc) {
        w_fail(w, rc);
        w_release(w, s);
    }
}

/* Reap one completion. Returns 0 or a wait error (also made sticky). */
static int w_reap(store_writer *w)
{
    struct io_uring_cqe *cqe;
    int rc = ring_wait(&w->ring, &cqe, STORE_WAIT_TIMEOUT_S);
    if (rc) {
        if (rc == -ETIMEDOUT)
            LOG_E(TAG, "writes to %s did not complete within %d s", w->path,
                  STORE_WAIT_TIMEOUT_S);
        else
            LOG_E(TAG, "io_uring wait (%s): %s", w->path, strerror(-rc));
        w_fail(w, rc);
        return rc;
    }
    w_complete(w, cqe);
    return 0;
}

/* Account for the completions already there, without waiting: frees buffers early and
 * surfaces an error at the next append instead of qd buffers later. */
static void w_poll(store_writer *w)
{
    struct io_uring_cqe *cqe;
    while (w->inflight && io_uring_peek_cqe(&w->ring, &cqe) == 0) w_complete(w, cqe);
}

/* Wait until nothing is in flight; after a failed wait, cancel and wait a little longer,
 * then give up (w->stuck) rather than block forever. */
static void w_drain(store_writer *w)
{
    while (w->inflight) {
        if (w_reap(w) == 0) continue;
        ring_cancel_all(&w->ring);
        while (w->inflight) {
            struct io_uring_cqe *cqe;
            if (ring_wait(&w->ring, &cqe, CANCEL_WAIT_S)) {
                LOG_E(TAG, "%u writes to %s still in flight after cancel; abandoning them",
                      w->inflight, w->path);
                w->stuck = true;
                return;
            }
            w_complete(w, cqe);
        }
    }
}

static void w_free(store_writer *w)
{
    if (w->stuck) {
        /* The kernel may still read the buffers; it never writes them, but keep them (and
         * the ring) alive rather than hand the memory back while it is in use. */
        free(w->path);
        free(w);
        return;
    }
    io_uring_queue_exit(&w->ring);
    if (w->owns_mem)
        for (unsigned i = 0; i < w->qd; i++) free(w->slots[i].data);
    free(w->slots);
    free(w->refs);
    free(w->path);
    free(w);
}

int store_writer_open(store_writer **out, const char *path, const store_writer_opts *opts)
{
    static const store_writer_opts defaults = STORE_WRITER_OPTS_INIT;
    if (!out || !path) return -EINVAL;
    *out = NULL;
    if (!opts) opts = &defaults;
    if (opts->buffer_bytes < STORE_ALIGN || opts->buffer_bytes > (64u << 20) ||
        opts->buffer_bytes % STORE_ALIGN || opts->queue_depth < 1 || opts->queue_depth > 64 ||
        ((uintptr_t)opts->memory % STORE_ALIGN) != 0)
        return -EINVAL;

    int rc = 0;
    bool ring_ok = false;
    store_writer *w = calloc(1, sizeof *w);
    if (!w) return -ENOMEM;
    w->fd = -1;
    w->buf_bytes = opts->buffer_bytes;
    w->qd = opts->queue_depth;
    w->path = strdup(path);
    w->slots = calloc(w->qd, sizeof *w->slots);
    w->refs = calloc(w->qd, sizeof *w->refs);
    if (!w->path || !w->slots || !w->refs) {
        rc = -ENOMEM;
        goto fail;
    }
    w->owns_mem = opts->memory == NULL;
    for (unsigned i = 0; i < w->qd; i++) {
        void *p = NULL;
        if (!w->owns_mem) {
            p = (char *)opts->memory + (size_t)i * w->buf_bytes;
        } else if (posix_memalign(&p, STORE_ALIGN, w->buf_bytes)) {
            rc = -ENOMEM;
            goto fail;
        }
        w->slots[i].data = p;
    }

    /* Create without O_DIRECT, then switch it on with fcntl: opening with O_CREAT|O_DIRECT
     * on a file system without direct I/O creates the file before failing with EINVAL,
     * which would make the O_EXCL retry fail. */
    w->fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        rc = -errno;
        if (rc != -EEXIST) LOG_E(TAG, "open %s for writing: %s", path, strerror(errno));
        goto fail;
    }
    if (opts->direct) {
        int fl = fcntl(w->fd, F_GETFL);
        if (fl >= 0 && fcntl(w->fd, F_SETFL, fl | O_DIRECT) == 0) {
            w->direct = w->fd_direct = true;
        } else if (errno == EINVAL) {
            LOG_D(TAG, "%s: O_DIRECT not supported by the file system, using buffered I/O",
                  path);
        } else {
            rc = -errno;
            LOG_E(TAG, "fcntl O_DIRECT on %s: %s", path, strerror(errno));
            goto fail_created;
        }
    }
    rc = io_uring_queue_init(w->qd, &w->ring, 0);
    if (rc) {
        LOG_E(TAG, "io_uring_queue_init(%u) for %s: %s", w->qd, path, strerror(-rc));
        goto fail_created;
    }
    ring_ok = true;
    *out = w;
    return 0;

fail_created:
    close(w->fd);
    w->fd = -1;
    unlink(path);
fail:
    if (w->fd >= 0) close(w->fd);
    if (ring_ok) io_uring_queue_exit(&w->ring);
    if (w->slots && w->owns_mem)
        for (unsigned i = 0; i < w->qd; i++) free(w->slots[i].data);
    free(w->slots);
    free(w->refs);
    free(w->path);
    free(w);
    return rc;
}

int store_writer_append(store_writer *w, const void *buf, size_t len)
{
    if (!w || (len && !buf)) return -EINVAL;
    if (w->err) return w->err;
    const unsigned char *p = buf;
    while (len) {
        wslot *s = &w->slots[w->cur];
        size_t n = min_sz(len, w->buf_bytes - s->fill);
        memcpy(s->data + s->fill, p, n);
        s->fill += n;
        w->logical += n;
        p += n;
        len -= n;
        if (s->fill < w->buf_bytes) break;
        s->off = w->next_off;
        w->next_off += w->buf_bytes;
        if (w_submit_slot(w, w->cur)) return w->err;
        w_poll(w);
        w->cur = (w->cur + 1) % w->qd;
        while (w->slots[w->cur].busy)
            if (w_reap(w)) return w->err;
        if (w->err) return w->err;
    }
    return 0;
}

/* Bytes of one write from the caller's memory: large requests, few system calls, but cut so
 * that a queue of them still overlaps (the block layer splits them further anyway). */
#define REF_PIECE_MAX (4u << 20)
/* Below this, a store_writer_append_ref copies: a write of its own is not worth it. */
#define REF_MIN (64u << 10)

/* Submit the slot being filled although it is not full (its bytes end on an aligned file
 * offset in O_DIRECT mode), so that the next bytes can go out from the caller's memory. */
static int w_flush_partial(store_writer *w)
{
    wslot *s = &w->slots[w->cur];
    if (!s->fill) return 0;
    s->off = w->next_off;
    w->next_off += s->fill;
    if (w_submit_slot(w, w->cur)) return w->err;
    w->cur = (w->cur + 1) % w->qd;
    while (w->slots[w->cur].busy)
        if (w_reap(w)) return w->err;
    return w->err;
}

int store_writer_append_ref(store_writer *w, const void *buf, size_t len)
{
    if (!w || (len && !buf)) return -EINVAL;
    if (w->err) return w->err;
    const unsigned char *p = buf;
    /* in O_DIRECT mode only memory that is aligned like the file offset it goes to can be
     * written from where it is; the rest is copied */
    if (len < REF_MIN || (w->direct && ((uintptr_t)p - w->logical) % STORE_ALIGN))
        return store_writer_append(w, buf, len);
    size_t head = w->direct ? (size_t)(align_up(w->logical) - w->logical) : 0;
    int rc = store_writer_append(w, p, head);
    if (rc) return rc;
    p += head;
    len -= head;
    if ((rc = w_flush_partial(w))) return rc;
    size_t mid = w->direct ? (size_t)align_down(len) : len;
    while (mid) {
        if ((rc = w_room(w))) return rc;
        unsigned j = 0;
        while (j < w->qd && w->refs[j].busy) j++;
        if (j == w->qd) { /* cannot happen: fewer than qd requests are in flight */
            w_fail(w, -EBUSY);
            return w->err;
        }
        wslot *s = &w->refs[j];
        size_t n = min_sz(mid, REF_PIECE_MAX);
        s->data = (unsigned char *)p; /* only read: the kernel writes it to the file */
        s->len = n;
        s->off = w->next_off;
        s->done = 0;
        s->retries = 0;
        s->fault = 0;
        s->fresh = true;
        s->busy = true;
        w->inflight++;
        if ((rc = w_queue(w, w->qd + j))) {
            s->busy = false;
            w->inflight--;
            w_fail(w, rc);
            return w->err;
        }
        w->next_off += n;
        w->logical += n;
        p += n;
        len -= n;
        mid -= n;
        w_poll(w);
        if (w->err) return w->err;
    }
    return store_writer_append(w, p, len);
}

int store_writer_reserve(store_writer *w, uint64_t bytes)
{
    if (!w) return -EINVAL;
    if (bytes <= w->reserved || bytes > (uint64_t)INT64_MAX) return 0;
    /* mode 0 also sets the file size: the writes then land inside the file, which ext4 runs
     * in parallel, instead of extending it one write at a time; close truncates */
    if (fallocate(w->fd, 0, 0, (off_t)bytes) != 0) {
        /* only a hint: the writes will still find their space, or report why not */
        LOG_D(TAG, "%s: no preallocation of %llu bytes: %s", w->path, (unsigned long long)bytes,
              strerror(errno));
        return 0;
    }
    w->reserved = bytes;
    return 0;
}

uint64_t store_writer_offset(const store_writer *w) { return w ? w->logical : 0; }

int store_writer_close(store_writer *w, int do_fsync)
{
    if (!w) return -EINVAL;
    wslot *s = &w->slots[w->cur];
    if (!w->err && s->fill) {
        s->off = w->next_off;
        w_submit_slot(w, w->cur);
    }
    w_drain(w);
    int rc = w->err;
    if (!rc && ftruncate(w->fd, (off_t)w->logical)) {
        rc = -errno;
        LOG_E(TAG, "ftruncate %s to %llu: %s", w->path, (unsigned long long)w->logical,
              strerror(errno));
    }
    if (!rc && do_fsync && fsync(w->fd)) {
        rc = -errno;
        LOG_E(TAG, "fsync %s: %s", w->path, strerror(errno));
    }
    if (close(w->fd) && !rc) {
        rc = -errno;
        LOG_E(TAG, "close %s: %s", w->path, strerror(errno));
    }
    w_free(w);
    return rc;
}

void store_writer_abort(store_writer *w)
{
    if (!w) return;
    w_fail(w, -ECANCELED); /* completions that come in now are not resubmitted */
    w_drain(w);
    close(w->fd);
    if (unlink(w->path) && errno != ENOENT)
        LOG_W(TAG, "unlink %s: %s", w->path, strerror(errno));
    w_free(w);
}

/* ---- reader ---- */

typedef struct rslot {
    unsigned char *bounce; /* chunk bytes, aligned; NULL until first needed */
    unsigned char *rd;     /* where the kernel reads to: bounce or the caller's memory */
    unsigned char *copy_to; /* caller's memory for a bounce piece, else NULL */
    size_t skip;           /* bounce bytes before the requested ones */
    size_t need;           /* bytes of the read that must arrive (skip + copied) */
    size_t len;            /* bytes asked of the kernel */
    size_t done;           /* bytes arrived */
    uint64_t off;          /* file offset of rd[0] */
    unsigned retries;
    bool busy;
} rslot;

struct store_reader {
    struct io_uring ring;
    int fd;
    bool direct;
    bool stuck; /* reads may still be in flight after a timeout: never free their memory */
    unsigned qd;
    size_t chunk; /* bounce bytes per slot */
    uint64_t size;
    rslot *slots;
    char *path;
    /* the batch in progress (store_reader_submit until store_reader_wait) */
    bool active;
    const store_read_req *reqs;
    size_t n, ri, rpos; /* next piece: request ri from byte rpos */
    unsigned inflight;
    int err;
};

int store_reader_open(store_reader **out, const char *path, unsigned queue_depth,
                      unsigned flags, uint64_t *size_out)
{
    if (!out || !path || queue_depth > 64 || (flags & ~STORE_NOFOLLOW)) return -EINVAL;
    *out = NULL;
    if (queue_depth == 0) queue_depth = 8;
    int rc = 0;
    store_reader *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    r->qd = queue_depth;
    r->chunk = (size_t)align_down(READ_BOUNCE_TOTAL / queue_depth);
    if (r->chunk < READ_CHUNK_MIN) r->chunk = READ_CHUNK_MIN;
    if (r->chunk > READ_CHUNK_MAX) r->chunk = READ_CHUNK_MAX;
    r->path = strdup(path);
    r->slots = calloc(queue_depth, sizeof *r->slots);
    if (!r->path || !r->slots) {
        rc = -ENOMEM;
        goto fail;
    }
    struct stat st;
    r->fd = store_open_regular(path, flags, O_DIRECT, &st);
    if (r->fd >= 0) {
        r->direct = true;
    } else if (r->fd == -EINVAL) {
        LOG_D(TAG, "%s: O_DIRECT not supported by the file system, using buffered I/O", path);
        r->fd = store_open_regular(path, flags, 0, &st);
    }
    if (r->fd < 0) {
        rc = r->fd;
        /* often expected (probing, or a verdict on a folder's contents): the caller decides */
        if (rc == -ENOENT || rc == -ELOOP || rc == -EISDIR || rc == -ENODEV || rc == -ENOTDIR)
            LOG_D(TAG, "open %s for reading: %s", path, strerror(-rc));
        else
            LOG_E(TAG, "open %s for reading: %s", path, strerror(-rc));
        goto fail;
    }
    r->size = (uint64_t)st.st_size;
    rc = io_uring_queue_init(queue_depth, &r->ring, 0);
    if (rc) {
        LOG_E(TAG, "io_uring_queue_init(%u) for %s: %s", queue_depth, path, strerror(-rc));
        goto fail_fd;
    }
    if (size_out) *size_out = r->size;
    *out = r;
    return 0;

fail_fd:
    close(r->fd);
fail:
    free(r->slots);
    free(r->path);
    free(r);
    return rc;
}

static int r_queue(store_reader *r, unsigned i)
{
    rslot *s = &r->slots[i];
    struct io_uring_sqe *sqe = ring_sqe(&r->ring);
    if (!sqe) {
        LOG_E(TAG, "no submission queue entry for %s", r->path);
        return -EBUSY;
    }
    io_uring_prep_read(sqe, r->fd, s->rd + s->done, (unsigned)(s->len - s->done),
                       s->off + s->done);
    io_uring_sqe_set_data64(sqe, i);
    return ring_submit(&r->ring, r->path);
}

/* Cut the next piece of reqs[*ri] (from byte *rpos) into slot s; advances *ri / *rpos.
 * Returns 0 or -ENOMEM. */
static int r_piece(store_reader *r, rslot *s, const store_read_req *q, size_t *rpos)
{
    uint64_t pos = q->offset + *rpos;
    size_t rem = q->len - *rpos;
    unsigned char *dst = (unsigned char *)q->dst + *rpos;
    s->done = 0;
    s->retries = 0;
    s->copy_to = NULL;
    s->skip = 0;
    if (!r->direct || (pos % STORE_ALIGN == 0 && (uintptr_t)dst % STORE_ALIGN == 0 &&
                       rem >= STORE_ALIGN)) {
        size_t n = min_sz(rem, READ_PIECE_MAX);
        if (r->direct) n = (size_t)align_down(n);
        s->rd = dst;
        s->off = pos;
        s->len = s->need = n;
        *rpos += n;
        return 0;
    }
    if (!s->bounce) {
        void *p = NULL;
        if (posix_memalign(&p, STORE_ALIGN, r->chunk)) return -ENOMEM;
        s->bounce = p;
    }
    uint64_t a0 = align_down(pos);
    uint64_t end = pos + rem;
    if (end > a0 + r->chunk) end = a0 + r->chunk;
    s->rd = s->bounce;
    s->copy_to = dst;
    s->off = a0;
    s->skip = (size_t)(pos - a0);
    s->need = (size_t)(end - a0);
    s->len = (size_t)(align_up(end) - a0);
    *rpos += (size_t)(end - pos);
    return 0;
}

/* Account for one completion. Returns 1 when the slot is finished (freed), 0 when it was
 * resubmitted, or -errno (slot freed). */
static int r_complete(store_reader *r, struct io_uring_cqe *cqe, bool resubmit)
{
    uint64_t i = io_uring_cqe_get_data64(cqe);
    int res = cqe->res;
    io_uring_cqe_seen(&r->ring, cqe);
    if (i >= r->qd) return 0; /* the cancel request itself */
    rslot *s = &r->slots[i];
    int rc = 0;
    if (res > 0) {
        s->done += (size_t)res;
        s->retries = 0;
        if (s->done >= s->need) {
            if (s->copy_to) memcpy(s->copy_to, s->bounce + s->skip, s->need - s->skip);
            s->busy = false;
            return 1;
        }
        /* In O_DIRECT mode only end of file yields an unaligned count. */
        if (r->direct && s->done % STORE_ALIGN) res = 0;
    }
    if (res == 0) {
        rc = -EBADMSG;
        LOG_E(TAG, "%s: range ends at %llu, past the end of the file", r->path,
              (unsigned long long)(s->off + s->need));
    } else if (res == -EAGAIN || res == -EINTR) {
        if (++s->retries > MAX_RETRIES) {
            rc = res;
            LOG_E(TAG, "read of %s at offset %llu made no progress after %u tries: %s",
                  r->path, (unsigned long long)(s->off + s->done), MAX_RETRIES,
                  strerror(-res));
        }
    } else if (res < 0) {
        rc = res;
        LOG_E(TAG, "read of %s at offset %llu (%zu bytes): %s", r->path,
              (unsigned long long)(s->off + s->done), s->len - s->done, strerror(-res));
    }
    if (!rc && !resubmit) rc = -ECANCELED; /* draining after an earlier error */
    if (!rc) rc = r_queue(r, (unsigned)i);
    if (rc) s->busy = false;
    return rc;
}

/* Called once per store_reader_read; true when this call is to fail with -EIO. */
static bool read_fault_next(void)
{
    fault_parse();
    unsigned long long slow = atomic_load(&fault_read_slow_ms);
    if (slow) {
        struct timespec ts = {(time_t)(slow / 1000), (long)(slow % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (store_fault_armed("store-eio-read")) return true;
    unsigned long long nth = atomic_load(&fault_read_nth);
    return nth && atomic_fetch_add(&fault_read_count, 1) + 1 == nth;
}

/* Fill free slots with the next pieces of the batch; a failure becomes r->err. */
static void r_fill(store_reader *r)
{
    for (unsigned i = 0; !r->err && i < r->qd && r->ri < r->n; i++) {
        rslot *s = &r->slots[i];
        if (s->busy) continue;
        while (r->ri < r->n && r->rpos == r->reqs[r->ri].len) { /* finished or empty */
            r->ri++;
            r->rpos = 0;
        }
        if (r->ri == r->n) break;
        int rc = r_piece(r, s, &r->reqs[r->ri], &r->rpos);
        if (!rc) rc = r_queue(r, i);
        if (rc) {
            r->err = rc;
            break;
        }
        s->busy = true;
        r->inflight++;
    }
    while (r->ri < r->n && r->rpos == r->reqs[r->ri].len) {
        r->ri++;
        r->rpos = 0;
    }
}

int store_reader_submit(store_reader *r, const store_read_req *reqs, size_t n)
{
    if (!r || (n && !reqs) || r->active) return -EINVAL;
    if (r->stuck) return -EIO;
    for (size_t k = 0; k < n; k++)
        if ((reqs[k].len && !reqs[k].dst) || reqs[k].offset > UINT64_MAX - reqs[k].len)
            return -EINVAL;
    if (read_fault_next()) {
        LOG_W(TAG, "injecting %s on a read of %s (CKPT_FAULT_STORE)", strerror(EIO), r->path);
        return -EIO;
    }
    r->reqs = reqs;
    r->n = n;
    r->ri = r->rpos = 0;
    r->inflight = 0;
    r->err = 0;
    r->active = true;
    r_fill(r);
    return 0;
}

int store_reader_wait(store_reader *r)
{
    if (!r || !r->active) return -EINVAL;
    for (;;) {
        if (!r->err) r_fill(r);
        if (!r->inflight) break;

        struct io_uring_cqe *cqe;
        int rc = ring_wait(&r->ring, &cqe, STORE_WAIT_TIMEOUT_S);
        if (rc) {
            if (rc == -ETIMEDOUT)
                LOG_E(TAG, "reads of %s did not complete within %d s", r->path,
                      STORE_WAIT_TIMEOUT_S);
            else
                LOG_E(TAG, "io_uring wait (%s): %s", r->path, strerror(-rc));
            if (!r->err) r->err = rc;
            ring_cancel_all(&r->ring);
            while (r->inflight) {
                if (ring_wait(&r->ring, &cqe, CANCEL_WAIT_S)) {
                    LOG_E(TAG, "%u reads of %s still in flight after cancel; abandoning",
                          r->inflight, r->path);
                    r->stuck = true;
                    break;
                }
                if (r_complete(r, cqe, false) != 0) r->inflight--; /* 0: the cancel itself */
            }
            break;
        }
        rc = r_complete(r, cqe, r->err == 0);
        if (rc == 1) {
            r->inflight--;
        } else if (rc < 0) {
            r->inflight--;
            if (!r->err && rc != -ECANCELED) r->err = rc;
        }
    }
    r->active = false;
    r->reqs = NULL;
    return r->err;
}

int store_reader_read(store_reader *r, const store_read_req *reqs, size_t n)
{
    int rc = store_reader_submit(r, reqs, n);
    return rc ? rc : store_reader_wait(r);
}

void store_reader_close(store_reader *r)
{
    if (!r) return;
    if (r->active) store_reader_wait(r); /* the kernel must be done with the memory */
    close(r->fd);
    if (!r->stuck) { /* otherwise the kernel may still write to the bounce buffers */
        io_uring_queue_exit(&r->ring);
        for (unsigned i = 0; i < r->qd; i++) free(r->slots[i].bounce);
        free(r->slots);
    }
    free(r->path);
    free(r);
}
