/* dcomm_nccl.c - the NCCL backend of dcomm.h (built only when meson found CUDA; see
 * dcomm_nccl_stub.c otherwise).
 *
 * Why non-blocking: a blocking NCCL communicator waits inside the library (init, a
 * collective whose peer died) with no bound, so a dead rank would hang every other rank.
 * With ncclConfig_t.blocking = 0 every NCCL call returns at once (ncclSuccess or
 * ncclInProgress) and this file polls ncclCommGetAsyncError and cudaStreamQuery against a
 * deadline; when it passes, ncclCommAbort tears the communicator down (it also stops the
 * kernels that wait for the peer) and the dcomm is poisoned.
 *
 * Two waits per collective, because in non-blocking mode ncclGroupEnd (or a collective
 * outside a group) may return ncclInProgress before its work is on the stream: first until
 * the async state leaves ncclInProgress (the work is queued), only then may more work (the
 * tree sum) be queued behind it; then until the stream is idle. All work of a dcomm goes to
 * one stream (the kernels' table must queue on the same one, see dcomm.h), so stream order
 * is the only ordering needed.
 */
#include "dcomm.h"
#include "dcomm_internal.h"

#include "clock.h"
#include "log.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TAG "dcomm"

_Static_assert(sizeof(ncclUniqueId) == TRAIN_DCOMM_ID_BYTES, "NCCL unique id size");

extern char **environ;

typedef struct nccl_state {
    ncclComm_t comm;     /* NULL once aborted */
    cudaStream_t stream; /* train_stream_native of the dcomm's stream */
    int cuda_dev;        /* the stream's device */
    void *rbuf;          /* tree mode: W x range receive buffer, device memory */
    size_t rbuf_bytes;
    size_t *cnt, *off;   /* [W + 1] scratch: element counts and offsets */
    size_t *bcnt, *boff; /* [W + 1] scratch: byte counts and offsets */
} nccl_state;

int train_dcomm_nccl_built(void)
{
    return 1;
}

static int nccl_errno(ncclResult_t r)
{
    return r == ncclRemoteError || r == ncclSystemError ? -ECONNRESET : -EIO;
}

/* ncclCommAbort on a thread of its own, waited for at most ABORT_WAIT_S: an abort can hang
 * with a dead peer (NVIDIA/nccl#863, #1777), and a dead peer must be an error in seconds.
 * After the bound the thread is left running (detached) with its communicator. */
#define ABORT_WAIT_S 30.0

typedef struct abort_job {
    ncclComm_t comm;
    int cuda_dev; /* the communicator's device, made current on the abort's thread */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, abandoned;
} abort_job;

static void *abort_main(void *arg)
{
    abort_job *j = arg;
    (void)cudaSetDevice(j->cuda_dev); /* a fresh thread would otherwise start on device 0 */
    ncclCommAbort(j->comm);
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    const int abandoned = j->abandoned;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (abandoned) { /* the waiter is gone: the job is this thread's to free */
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j);
    }
    return NULL;
}

static void abort_bounded(ncclComm_t comm, int cuda_dev)
{
    abort_job *j = calloc(1, sizeof *j);
    pthread_t th;
    if (!j) {
        ncclCommAbort(comm);
        return;
    }
    j->comm = comm;
    j->cuda_dev = cuda_dev;
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&th, NULL, abort_main, j) != 0) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j);
        ncclCommAbort(comm);
        return;
    }
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += (time_t)ABORT_WAIT_S;
    pthread_mutex_lock(&j->mu);
    while (!j->done)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &dl) == ETIMEDOUT) break;
    const int done = j->done;
    if (!done) j->abandoned = 1;
    pthread_mutex_unlock(&j->mu);
    if (done) {
        pthread_join(th, NULL);
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j);
    } else {
        pthread_detach(th);
        LOG_W(TAG, "ncclCommAbort did not return within %.0f s; leaving it to the process",
              ABORT_WAIT_S);
    }
}

/* The first failure of a collective: log it, abort the communicator, poison the dcomm. */
static int poison(train_dcomm *c, int err)
{
    nccl_state *s = c->nccl;
    if (s && s->comm) {
        abort_bounded(s->comm, s->cuda_dev);
        s->comm = NULL;
    }
    if (!c->err) c->err = err;
    return c->err;
}

static int fail_nccl(train_dcomm *c, const char *what, ncclResult_t r)
{
    nccl_state *s = c->nccl;
    const char *last = s && s->comm ? ncclGetLastError(s->comm) : NULL;
    LOG_E(TAG, "%s: %s (%d)%s%s", what, ncclGetErrorString(r), (int)r, last && *last ? ": " : "",
          last ? last : "");
    return poison(c, nccl_errno(r));
}

static int fail_cuda(train_dcomm *c, const char *what, cudaError_t e)
{
    LOG_E(TAG, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return poison(c, -EIO);
}

static int nccl_ok(ncclResult_t r)
{
    return r == ncclSuccess || r == ncclInProgress;
}

static void backoff(int *k)
{
    /* 2 us doubling to 256 us: a collective of a few MB is done in well under a ms */
    long ns = 2000L << (*k < 7 ? *k : 7);
    if (*k < 7) (*k)++;
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

/* Wait until the communicator's async state is no longer ncclInProgress (the work is on the
 * stream) and, when want_stream, the stream is idle; bounded by deadline. */
static int wait_nccl(train_dcomm *c, double deadline, int want_stream, const char *what)
{
    nccl_state *s = c->nccl;
    int k = 0;
    for (;;) {
        ncclResult_t as = ncclInProgress;
        ncclResult_t q = ncclCommGetAsyncError(s->comm, &as);
        if (q != ncclSuccess) return fail_nccl(c, what, q);
        if (as != ncclSuccess && as != ncclInProgress) return fail_nccl(c, what, as);
        if (as == ncclSuccess) {
            if (!want_stream) return 0;
            cudaError_t e = cudaStreamQuery(s->stream);
            if (e == cudaSuccess) return 0;
            if (e != cudaErrorNotReady) return fail_cuda(c, what, e);
            /* not an error; clear it should the runtime have kept it as the last error, or
             * the next kernel launch's cudaGetLastError would report it (as PyTorch does) */
            if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
        }
        if (clock_now_s() >= deadline) {
            LOG_E(TAG, "%s: not done after %.1f s (timeout): aborting the NCCL communicator",
                  what, c->timeout_s);
            return poison(c, -ETIMEDOUT);
        }
        backoff(&k);
    }
}

int train_dcomm_log_env(void)
{
    int v = 0;
    ncclResult_t nr = ncclGetVersion(&v);
    if (nr != ncclSuccess) {
        LOG_E(TAG, "ncclGetVersion: %s", ncclGetErrorString(nr));
        return -EIO;
    }
    /* NCCL_VERSION: X * 10000 + Y * 100 + Z since 2.9, X * 1000 + Y * 100 + Z before */
    int maj = v >= 10000 ? v / 10000 : v / 1000, min = v >= 10000 ? v / 100 % 100 : v / 100 % 10;
    LOG_I(TAG, "NCCL %d.%d.%d (built with %d.%d.%d)", maj, min, v % 100, NCCL_MAJOR, NCCL_MINOR,
          NCCL_PATCH);

    size_t n = 0, len = 0;
    for (char **e = environ; e && *e; e++)
        if (!strncmp(*e, "NCCL_", 5)) n++, len += strlen(*e) + 1;
    const char **vars = n ? malloc(n * sizeof *vars) : NULL;
    char *line = malloc(len + 1);
    if ((n && !vars) || !line) {
        free(vars);
        free(line);
        return -ENOMEM;
    }
    size_t i = 0;
    for (char **e = environ; e && *e && i < n; e++)
        if (!strncmp(*e, "NCCL_", 5)) vars[i++] = *e;
    n = i;
    /* sorted, so that two runs' lines compare with diff */
    for (size_t a = 1; a < n; a++)
        for (size_t b = a; b > 0 && strcmp(vars[b - 1], vars[b]) > 0; b--) {
            const char *t = vars[b];
            vars[b] = vars[b - 1];
            vars[b - 1] = t;
        }
    size_t pos = 0;
    line[0] = 0;
    for (i = 0; i < n; i++) {
        size_t l = strlen(vars[i]);
        if (i) line[pos++] = ' ';
        memcpy(line + pos, vars[i], l);
        pos += l;
        line[pos] = 0;
    }
    LOG_I(TAG, "NCCL_* in effect: %s", n ? line : "none");
    free(vars);
    free(line);
    return 0;
}

int train_dcomm_nccl_exchange_id(train_comm *host, unsigned char *id)
{
    if (!host || !id) return -EINVAL;
    unsigned char msg[1 + TRAIN_DCOMM_ID_BYTES];
    memset(msg, 0, sizeof msg);
    if (train_comm_rank(host) == 0) {
        ncclUniqueId uid;
        ncclResult_t nr = ncclGetUniqueId(&uid);
        if (nr != ncclSuccess) {
            LOG_E(TAG, "ncclGetUniqueId: %s (%d)", ncclGetErrorString(nr), (int)nr);
            msg[0] = 1; /* still broadcast: the other ranks learn of the failure */
        } else {
            memcpy(msg + 1, &uid, TRAIN_DCOMM_ID_BYTES);
        }
    }
    int r = train_comm_broadcast(host, msg, sizeof msg, 0);
    if (r < 0) return r;
    if (msg[0]) return -EIO;
    memcpy(id, msg + 1, TRAIN_DCOMM_ID_BYTES);
    return 0;
}

static void state_free(train_dcomm *c)
{
    nccl_state *s = c->nccl;
    if (!s) return;
    train_device_free(c->dev, s->rbuf);
    free(s->cnt);
    free(s->off);
    free(s->bcnt);
    free(s->boff);
    free(s);
    c->nccl = NULL;
}

int dcomm_nccl_init(train_dcomm *c)
{
    nccl_state *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    c->nccl = s;
    size_t w1 = (size_t)c->world + 1;
    s->cnt = calloc(w1, sizeof *s->cnt);
    s->off = calloc(w1, sizeof *s->off);
    s->bcnt = calloc(w1, sizeof *s->bcnt);
    s->boff = calloc(w1, sizeof *s->boff);
    int r = 0;
    if (!s->cnt || !s->off || !s->bcnt || !s->boff) {
        r = -ENOMEM;
        goto out;
    }
    /* NCCL binds the communicator to the current device: make it the stream's. */
    s->stream = (cudaStream_t)train_stream_native(c->stream);
    cudaError_t e = s->stream ? cudaStreamGetDevice(s->stream, &s->cuda_dev)
                              : cudaGetDevice(&s->cuda_dev);
    if (e == cudaSuccess) e = cudaSetDevice(s->cuda_dev);
    if (e != cudaSuccess) {
        LOG_E(TAG, "the stream's device: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        r = -EIO;
        goto out;
    }
    if (c->rank == 0) train_dcomm_log_env();

    unsigned char id[TRAIN_DCOMM_ID_BYTES];
    r = train_dcomm_nccl_exchange_id(c->host, id);
    if (r < 0) {
        LOG_E(TAG, "NCCL unique id exchange over the host communicator: %d", r);
        goto out;
    }
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof uid);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    double deadline = clock_now_s() + c->timeout_s;
    ncclResult_t nr = ncclCommInitRankConfig(&s->comm, c->world, uid, c->rank, &config);
    if (!nccl_ok(nr)) {
        r = fail_nccl(c, "ncclCommInitRankConfig", nr);
        goto out;
    }
    r = wait_nccl(c, deadline, 0, "ncclCommInitRankConfig");
    if (r == 0)
        LOG_I(TAG, "NCCL communicator: rank %d of %d on CUDA device %d, %s mode", c->rank,
              c->world, s->cuda_dev, c->mode == TRAIN_DCOMM_RING ? "ring" : "tree");
out:
    if (r < 0) {
        if (s->comm) abort_bounded(s->comm, s->cuda_dev);
        s->comm = NULL;
        state_free(c);
        c->err = 0;
    }
    return r;
}

void dcomm_nccl_free(train_dcomm *c)
{
    nccl_state *s = c->nccl;
    if (!s) return;
    if (s->comm && !c->err) {
        /* Finalize flushes outstanding work; non-blocking, so it too is polled with a bound
         * (a dead peer must not hang the free) and aborted when it does not finish. */
        cudaSetDevice(s->cuda_dev);
        ncclResult_t nr = ncclCommFinalize(s->comm);
        int r = nccl_ok(nr) ? wait_nccl(c, clock_now_s() + c->timeout_s, 0, "ncclCommFinalize")
                            : fail_nccl(c, "ncclCommFinalize", nr);
        if (r == 0 && s->comm) {
            nr = ncclCommDestroy(s->comm);
            if (nr != ncclSuccess) LOG_W(TAG, "ncclCommDestroy: %s", ncclGetErrorString(nr));
            s->comm = NULL;
        }
    }
    if (s->comm) abort_bounded(s->comm, s->cuda_dev);
    s->comm = NULL;
    state_free(c);
}

/* p (bytes > 0) must be memory of the communicator's device. */
static int check_dev_ptr(train_dcomm *c, const void *p, const char *what)
{
    nccl_state *s = c->nccl;
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: clear it */
        LOG_E(TAG, "%s: %p is not CUDA memory (%s)", what, p, cudaGetErrorName(e));
        return -EINVAL;
    }
    if ((a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) ||
        a.device != s->cuda_dev) {
        LOG_E(TAG, "%s: %p is not memory of CUDA device %d (type %d, device %d)", what, p,
              s->cuda_dev, (int)a.type, a.device);
        return -EINVAL;
    }
    return 0;
}

/* [a, a + al) and [b, b + bl) overlap */
static int overlap(const void *a, size_t al, const void *b, size_t bl)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return al && bl && x < y + bl && y < x + al;
}

/* counts[W] (units of elem bytes) -> off[W + 1] in the same units; 0 or -EINVAL on a size
 * overflow. *equal: every count is the same. */
static int layout(const size_t *counts, int W, size_t elem, size_t *off, int *equal)
{
    size_t total = 0;
    *equal = 1;
    for (int r = 0; r < W; r++) {
        off[r] = total;
        if (counts[r] > SIZE_MAX / elem - total) return -EINVAL;
        total += counts[r];
        if (counts[r] != counts[0]) *equal = 0;
    }
    off[W] = total;
    return 0;
}

static int ensure_rbuf(train_dcomm *c, size_t bytes)
{
    nccl_state *s = c->nccl;
    if (bytes <= s->rbuf_bytes) return 0;
    /* every earlier collective has completed on the stream: the old buffer is free */
    train_device_free(c->dev, s->rbuf);
    s->rbuf = NULL;
    s->rbuf_bytes = 0;
    int r = train_device_alloc(c->dev, &s->rbuf, bytes);
    if (r < 0) {
        LOG_E(TAG, "tree receive buffer of %zu bytes: %d", bytes, r);
        return r;
    }
    s->rbuf_bytes = bytes;
    return 0;
}

/* The deterministic reduce-scatter: every rank's range goes to its owner (grouped
 * send/recv) into row p of the W x m receive buffer, the owner's own range by a copy into
 * its row, then rank_tree_sum over the rows. Leaves the work queued (the caller waits). */
static int tree_rs(train_dcomm *c, const float *in, float *out, const size_t *cnt,
                   const size_t *off, double deadline)
{
    nccl_state *s = c->nccl;
    int W = c->world, me = c->rank;
    size_t m = cnt[me];
    if (m && m > SIZE_MAX / sizeof(float) / (size_t)W) return poison(c, -EINVAL);
    int r = ensure_rbuf(c, (size_t)W * m * sizeof(float));
    if (r < 0) return poison(c, r);
    float *rb = s->rbuf;
    if (m) {
        cudaError_t e = cudaMemcpyAsync(rb + (size_t)me * m, in + off[me], m * sizeof(float),
                                        cudaMemcpyDeviceToDevice, s->stream);
        if (e != cudaSuccess) return fail_cuda(c, "tree reduce-scatter: own range", e);
    }
    if (W > 1) {
        ncclResult_t nr = ncclGroupStart();
        for (int p = 0; p < W && nccl_ok(nr); p++) {
            if (p == me) continue;
            if (cnt[p]) nr = ncclSend(in + off[p], cnt[p], ncclFloat, p, s->comm, s->stream);
            if (m && nccl_ok(nr))
                nr = ncclRecv(rb + (size_t)p * m, m, ncclFloat, p, s->comm, s->stream);
        }
        ncclResult_t ne = ncclGroupEnd(); /* always close the group */
        if (!nccl_ok(nr)) return fail_nccl(c, "tree reduce-scatter: ncclSend/ncclRecv", nr);
        if (!nccl_ok(ne)) return fail_nccl(c, "tree reduce-scatter: ncclGroupEnd", ne);
        r = wait_nccl(c, deadline, 0, "tree reduce-scatter");
        if (r < 0) return r;
    }
    if (m) c->ops->rank_tree_sum(c->ops->ctx, out, rb, m, m, W);
    return 0;
}

/* All-gather of bytes: ncclAllGather for equal counts, else grouped send/recv (and a copy
 * of this rank's part when not in place). Leaves the work queued. */
static int gather(train_dcomm *c, const void *in, void *out, const size_t *cnt,
                  const size_t *off, int equal)
{
    nccl_state *s = c->nccl;
    int W = c->world, me = c->rank;
    uint8_t *o = out;
    if (off[W] == 0) return 0;
    if (equal) {
        ncclResult_t nr = ncclAllGather(in, out, cnt[0], ncclUint8, s->comm, s->stream);
        return nccl_ok(nr) ? 0 : fail_nccl(c, "ncclAllGather", nr);
    }
    if (cnt[me] && in != o + off[me]) {
        cudaError_t e = cudaMemcpyAsync(o + off[me], in, cnt[me], cudaMemcpyDeviceToDevice,
                                        s->stream);
        if (e != cudaSuccess) return fail_cuda(c, "all-gather: own part", e);
    }
    if (W == 1) return 0;
    ncclResult_t nr = ncclGroupStart();
    for (int p = 0; p < W && nccl_ok(nr); p++) {
        if (p == me) continue;
        if (cnt[me]) nr = ncclSend(in, cnt[me], ncclUint8, p, s->comm, s->stream);
        if (cnt[p] && nccl_ok(nr))
            nr = ncclRecv(o + off[p], cnt[p], ncclUint8, p, s->comm, s->stream);
    }
    ncclResult_t ne = ncclGroupEnd();
    if (!nccl_ok(nr)) return fail_nccl(c, "all-gather: ncclSend/ncclRecv", nr);
    if (!nccl_ok(ne)) return fail_nccl(c, "all-gather: ncclGroupEnd", ne);
    return 0;
}

/* The end of every collective: the stream idle, then the kernels' sticky status. */
static int finish(train_dcomm *c, double deadline, const char *what)
{
    int r = wait_nccl(c, deadline, 1, what);
    if (r < 0) return r;
    int st = c->ops->status(c->ops->ctx);
    if (st < 0) LOG_E(TAG, "%s: the kernels report %d", what, st);
    return st < 0 ? st : 0;
}

static int set_device(train_dcomm *c)
{
    nccl_state *s = c->nccl;
    cudaError_t e = cudaSetDevice(s->cuda_dev);
    return e == cudaSuccess ? 0 : fail_cuda(c, "cudaSetDevice", e);
}

int dcomm_nccl_reduce_scatter_f32(train_dcomm *c, const float *in, float *out,
                                  const size_t *counts)
{
    nccl_state *s = c->nccl;
    int W = c->world, me = c->rank, equal = 0;
    if (!counts || layout(counts, W, sizeof(float), s->off, &equal) < 0) return -EINVAL;
    size_t total = s->off[W], m = counts[me];
    if ((total && !in) || (m && !out)) return -EINVAL;
    if (total && check_dev_ptr(c, in, "reduce-scatter in") < 0) return -EINVAL;
    if (m && check_dev_ptr(c, out, "reduce-scatter out") < 0) return -EINVAL;
    if (out != in + s->off[me] && overlap(in, total * 4, out, m * 4)) return -EINVAL;
    if (total == 0) return 0;
    int r = set_device(c);
    if (r < 0) return r;
    double deadline = clock_now_s() + c->timeout_s;
    if (c->mode == TRAIN_DCOMM_RING && equal) {
        ncclResult_t nr = ncclReduceScatter(in, out, m, ncclFloat, ncclSum, s->comm, s->stream);
        if (!nccl_ok(nr)) return fail_nccl(c, "ncclReduceScatter", nr);
        return wait_nccl(c, deadline, 1, "ncclReduceScatter");
    }
    r = tree_rs(c, in, out, counts, s->off, deadline);
    return r < 0 ? r : finish(c, deadline, "tree reduce-scatter");
}

int dcomm_nccl_all_reduce_f32(train_dcomm *c, float *buf, size_t n)
{
    nccl_state *s = c->nccl;
    int W = c->world, me = c->rank;
    if (n == 0) return 0;
    if (!buf || n > SIZE_MAX / sizeof(float)) return -EINVAL;
    if (check_dev_ptr(c, buf, "all-reduce buf") < 0) return -EINVAL;
    int r = set_device(c);
    if (r < 0) return r;
    double deadline = clock_now_s() + c->timeout_s;
    if (c->mode == TRAIN_DCOMM_RING) {
        ncclResult_t nr = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, s->comm, s->stream);
        if (!nccl_ok(nr)) return fail_nccl(c, "ncclAllReduce", nr);
        return wait_nccl(c, deadline, 1, "ncclAllReduce");
    }
    /* comm.h's split: W near-equal ranges, the first n % W one element longer */
    int equal = 0;
    for (int q = 0; q < W; q++) {
        s->cnt[q] = n / (size_t)W + ((size_t)q < n % (size_t)W);
        s->bcnt[q] = s->cnt[q] * sizeof(float);
    }
    layout(s->cnt, W, sizeof(float), s->off, &equal);
    layout(s->bcnt, W, 1, s->boff, &equal);
    r = tree_rs(c, buf, buf + s->off[me], s->cnt, s->off, deadline);
    if (r == 0) r = gather(c, buf + s->off[me], buf, s->bcnt, s->boff, equal);
    return r < 0 ? r : finish(c, deadline, "tree all-reduce");
}

int dcomm_nccl_all_gather(train_dcomm *c, const void *in, void *out, const size_t *counts)
{
    nccl_state *s = c->nccl;
    int W = c->world, me = c->rank, equal = 0;
    if (!counts || layout(counts, W, 1, s->boff, &equal) < 0) return -EINVAL;
    size_t total = s->boff[W], m = counts[me];
    if ((m && !in) || (total && !out)) return -EINVAL;
    if (m && check_dev_ptr(c, in, "all-gather in") < 0) return -EINVAL;
    if (total && check_dev_ptr(c, out, "all-gather out") < 0) return -EINVAL;
    if (in != (const uint8_t *)out + s->boff[me] && overlap(in, m, out, total)) return -EINVAL;
    if (total == 0) return 0;
    int r = set_device(c);
    if (r < 0) return r;
    double deadline = clock_now_s() + c->timeout_s;
    r = gather(c, in, out, counts, s->boff, equal);
    return r < 0 ? r : wait_nccl(c, deadline, 1, "all-gather");
}
