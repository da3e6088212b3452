/* nccl_check.c - the NCCL backend of train/dcomm.h on real GPUs: W processes, one per GPU
 * (W = the number of CUDA devices, at most 8), each with its own GPU, the host communicator
 * of comm.h over a store hosted by rank 0.
 *
 * Checked, in the tree and the ring mode:
 *   - reduce-scatter with equal counts (ring: ncclReduceScatter) and unequal counts (the
 *     tree exchange in both modes), all-reduce with n % W != 0 and == 0, all-gather of
 *     unequal and equal parts, against the host reference: the pairwise tree over rank
 *     index (bit for bit in tree mode; ring within 1e-5 of sum |x_r|);
 *   - tree bits identical run to run (the same all-reduce twice) and on every rank;
 *   - a killed rank (SIGKILL during an all-reduce loop) gives every survivor an error within
 *     the timeout (plus slack), not a hang.
 * Exits 77 (skip) with fewer than 2 GPUs; `nccl_check --single` runs the functional part on
 * one GPU (W = 1: the NCCL calls, the waits and the tree sum, no peers).
 *
 * The tree sum: the kernels' table of piece B (kern_cuda_ops_init) lands separately, so this
 * test brings its own kern_ops whose rank_tree_sum copies the rows to pinned host memory on
 * the dcomm's stream, sums them with the reference tree and copies the result back on the
 * same stream. That checks the exchange's layout exactly (a wrong row or offset changes the
 * bits); the CUDA rank_tree_sum itself is tests/gpu/kernel_check's business.
 */
#include "comm.h"
#include "dcomm.h"
#include "device.h"
#include "kern_ops.h"
#include "store.h"
#include "t_helpers.h"

#include <cuda_runtime_api.h>

#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>

#define MAXW 8
#define TIMEOUT_S 10.0

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static float gen(uint64_t seed, int r, size_t i)
{
    uint64_t h = mix(seed * 0x100000001b3ull ^ mix(((uint64_t)r << 40) ^ (uint64_t)i));
    float u = (float)(h >> 40) / 16777216.0f;
    int e = (int)((h >> 8) % 21) - 10;
    return ldexpf(h & 1 ? -u : u, e);
}

static float tree_sum(const float *v, size_t stride, int n)
{
    if (n == 1) return v[0];
    int h = 1;
    while (h * 2 < n) h *= 2;
    return tree_sum(v, stride, h) + tree_sum(v + (size_t)h * stride, stride, n - h);
}

static float ref_elem(uint64_t seed, int W, size_t i, double *abs_sum)
{
    float v[MAXW];
    double a = 0;
    for (int r = 0; r < W; r++) {
        v[r] = gen(seed, r, i);
        a += fabs(v[r]);
    }
    if (abs_sum) *abs_sum = a;
    return tree_sum(v, 1, W);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* ------------------------------------------------------------------ the test's kern_ops */

typedef struct host_tree_ctx {
    cudaStream_t stream;
    float *pin; /* pinned, grown */
    size_t pin_n;
    int err;
} host_tree_ctx;

static int stream_wait(cudaStream_t s, double timeout_s)
{
    double end = t_now_s() + timeout_s;
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return 0;
        if (e != cudaErrorNotReady) return -EIO;
        if (t_now_s() > end) return -ETIMEDOUT;
        t_sleep_s(1e-5);
    }
}

static void host_tree_sum(void *vctx, float *out, const float *in, size_t n, size_t stride,
                          int nranks)
{
    host_tree_ctx *c = vctx;
    size_t need = (size_t)nranks * stride;
    if (c->err || n == 0) return;
    if (need > c->pin_n) {
        cudaFreeHost(c->pin);
        c->pin = NULL;
        c->pin_n = 0;
        if (cudaMallocHost((void **)&c->pin, need * sizeof(float)) != cudaSuccess) {
            c->err = -ENOMEM;
            return;
        }
        c->pin_n = need;
    }
    /* the rows on the stream, after the exchange queued before */
    if (cudaMemcpyAsync(c->pin, in, need * sizeof(float), cudaMemcpyDeviceToHost, c->stream) !=
            cudaSuccess ||
        stream_wait(c->stream, 60.0) < 0) {
        c->err = -EIO;
        return;
    }
    for (size_t i = 0; i < n; i++) c->pin[i] = tree_sum(c->pin + i, stride, nranks);
    /* row 0 now holds the sums; the dcomm waits for the stream before returning */
    if (cudaMemcpyAsync(out, c->pin, n * sizeof(float), cudaMemcpyHostToDevice, c->stream) !=
        cudaSuccess)
        c->err = -EIO;
}

static int host_tree_status(void *vctx)
{
    return ((host_tree_ctx *)vctx)->err;
}

/* ------------------------------------------------------------------ child side */

typedef struct msg {
    int rank, rc, fails, iters;
    double elapsed;
    uint64_t hash;
} msg;

typedef struct child {
    int rank, W, fails;
    train_comm *c;
    train_device *dev;
    train_stream *s;
    cudaStream_t cs;
    msg m;
} child;

#define C_CHECK(ch, cond, ...)                                                                 \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            (ch)->fails++;                                                                     \
            fprintf(stderr, "FAIL rank %d %s:%d: %s: ", (ch)->rank, __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
        }                                                                                      \
    } while (0)

static void *dalloc(child *ch, size_t bytes)
{
    void *p = NULL;
    int r = train_device_alloc(ch->dev, &p, bytes ? bytes : 4);
    if (r < 0) _exit(3);
    return p;
}

static void h2d(child *ch, void *d, const void *h, size_t bytes)
{
    if (bytes && train_device_copy(ch->dev, d, h, bytes, TRAIN_COPY_H2D) < 0) _exit(3);
}

static void d2h(child *ch, void *h, const void *d, size_t bytes)
{
    if (bytes && train_device_copy(ch->dev, h, d, bytes, TRAIN_COPY_D2H) < 0) _exit(3);
}

/* compare got[k] (element off + k of the full vector) with the reference */
static size_t compare(const float *got, size_t n, size_t off, uint64_t seed, int W, int ring)
{
    size_t bad = 0;
    for (size_t k = 0; k < n; k++) {
        double a = 0;
        float ref = ref_elem(seed, W, off + k, &a);
        if (ring ? fabs((double)got[k] - ref) > 1e-5 * a + 1e-30 : memcmp(&got[k], &ref, 4))
            bad++;
    }
    return bad;
}

static uint64_t check_all_reduce(child *ch, train_dcomm *d, uint64_t seed, size_t n, int ring)
{
    float *h = malloc(n * sizeof *h), *dv = dalloc(ch, n * sizeof *h);
    if (!h) _exit(3);
    for (size_t i = 0; i < n; i++) h[i] = gen(seed, ch->rank, i);
    h2d(ch, dv, h, n * sizeof *h);
    int r = train_dcomm_all_reduce_f32(d, dv, n);
    C_CHECK(ch, r == 0, "all-reduce n=%zu: %d", n, r);
    d2h(ch, h, dv, n * sizeof *h);
    size_t bad = compare(h, n, 0, seed, ch->W, ring);
    C_CHECK(ch, bad == 0, "%s all-reduce n=%zu: %zu of %zu elements off the reference",
            ring ? "ring" : "tree", n, bad, n);
    uint64_t hash = fnv(1469598103934665603ull, h, n * sizeof *h);
    train_device_free(ch->dev, dv);
    free(h);
    return hash;
}

static void check_reduce_scatter(child *ch, train_dcomm *d, int equal, int ring)
{
    int W = ch->W, me = ch->rank;
    size_t cnt[MAXW] = {0}, off[MAXW + 1] = {0}, tot = 0;
    for (int q = 0; q < W; q++) {
        cnt[q] = equal ? 4099 : (q % 3 == 1 ? 0 : 1000 + 777 * (size_t)q);
        off[q] = tot;
        tot += cnt[q];
    }
    uint64_t seed = 40 + (uint64_t)equal;
    float *h = malloc(tot * sizeof *h), *din = dalloc(ch, tot * 4), *dout = dalloc(ch, cnt[me] * 4);
    if (!h) _exit(3);
    for (size_t i = 0; i < tot; i++) h[i] = gen(seed, me, i);
    for (int pass = 0; pass < 2; pass++) { /* out of place, in place */
        h2d(ch, din, h, tot * 4);
        float *dst = pass ? din + off[me] : dout;
        int r = train_dcomm_reduce_scatter_f32(d, din, dst, cnt);
        C_CHECK(ch, r == 0, "reduce-scatter: %d", r);
        float *got = malloc(cnt[me] * 4 + 4);
        if (!got) _exit(3);
        d2h(ch, got, dst, cnt[me] * 4);
        /* the ring mode with unequal counts is the tree exchange: exact */
        size_t bad = compare(got, cnt[me], off[me], seed, W, ring && equal);
        C_CHECK(ch, bad == 0, "%s reduce-scatter (%s counts, pass %d): %zu of %zu off",
                ring ? "ring" : "tree", equal ? "equal" : "unequal", pass, bad, cnt[me]);
        free(got);
    }
    train_device_free(ch->dev, din);
    train_device_free(ch->dev, dout);
    free(h);
}

static void check_all_gather(child *ch, train_dcomm *d, int equal)
{
    int W = ch->W, me = ch->rank;
    size_t bc[MAXW] = {0}, boff[MAXW + 1] = {0}, tot = 0;
    for (int q = 0; q < W; q++) {
        bc[q] = equal ? 65536 : (q % 2 ? 5 : 100000 + 13 * (size_t)q);
        boff[q] = tot;
        tot += bc[q];
    }
    uint8_t *h = malloc(tot), *mine = malloc(bc[me]);
    uint8_t *dout = dalloc(ch, tot), *din = dalloc(ch, bc[me]);
    if (!h || !mine) _exit(3);
    for (size_t i = 0; i < bc[me]; i++) mine[i] = (uint8_t)(me * 31 + i * 7);
    h2d(ch, din, mine, bc[me]);
    int r = train_dcomm_all_gather(d, din, dout, bc);
    C_CHECK(ch, r == 0, "all-gather: %d", r);
    d2h(ch, h, dout, tot);
    size_t bad = 0;
    for (int q = 0; q < W; q++)
        for (size_t i = 0; i < bc[q]; i++) bad += h[boff[q] + i] != (uint8_t)(q * 31 + i * 7);
    C_CHECK(ch, bad == 0, "all-gather (%s parts): %zu bad bytes", equal ? "equal" : "unequal",
            bad);
    train_device_free(ch->dev, dout);
    train_device_free(ch->dev, din);
    free(h);
    free(mine);
}

static void functional(child *ch, const kern_ops *ops)
{
    ch->m.hash = 1469598103934665603ull;
    for (int ring = 0; ring < 2; ring++) {
        train_dcomm *d = NULL;
        int r = train_dcomm_create(&d, ch->c, ch->dev, ops, ch->s,
                                   ring ? TRAIN_DCOMM_RING : TRAIN_DCOMM_TREE, TIMEOUT_S);
        C_CHECK(ch, r == 0, "create %s: %d", ring ? "ring" : "tree", r);
        if (r < 0) return;
        C_CHECK(ch, !strcmp(train_dcomm_describe(d), ring ? "nccl ring" : "nccl tree"),
                "describe: %s", train_dcomm_describe(d));
        size_t n_odd = ((size_t)1 << 20) + 3, n_even = (size_t)ch->W * 12345;
        uint64_t h1 = check_all_reduce(ch, d, 7, n_odd, ring);
        uint64_t h2 = check_all_reduce(ch, d, 7, n_odd, ring);
        check_all_reduce(ch, d, 8, n_even, ring);
        if (!ring) {
            C_CHECK(ch, h1 == h2, "tree all-reduce: bits differ run to run");
            ch->m.hash = fnv(ch->m.hash, &h1, sizeof h1);
        }
        check_reduce_scatter(ch, d, 1, ring);
        check_reduce_scatter(ch, d, 0, ring);
        check_all_gather(ch, d, 1);
        check_all_gather(ch, d, 0);
        /* a host pointer is refused, not handed to NCCL */
        float hostbuf[4] = {0};
        C_CHECK(ch, train_dcomm_all_reduce_f32(d, hostbuf, 4) == -EINVAL &&
                    train_dcomm_status(d) == 0, "host pointer");
        C_CHECK(ch, train_dcomm_status(d) == 0 && ops->status(ops->ctx) == 0, "status");
        train_dcomm_free(d);
    }
}

static void killed_rank(child *ch, const kern_ops *ops, int out_fd)
{
    train_dcomm *d = NULL;
    int r = train_dcomm_create(&d, ch->c, ch->dev, ops, ch->s, TRAIN_DCOMM_TREE, TIMEOUT_S);
    C_CHECK(ch, r == 0, "create: %d", r);
    if (r < 0) return;
    size_t n = (size_t)4 << 20;
    float *dv = dalloc(ch, n * 4);
    r = train_dcomm_all_reduce_f32(d, dv, n);
    C_CHECK(ch, r == 0, "first all-reduce: %d", r);
    r = train_comm_barrier(ch->c);
    (void)out_fd;
    if (ch->rank == ch->W - 1) {
        t_sleep_s(0.2); /* the others are in the loop by now */
        raise(SIGKILL);
    }
    double t0 = t_now_s();
    int it = 0;
    do {
        t0 = t_now_s();
        r = train_dcomm_all_reduce_f32(d, dv, n);
        it++;
    } while (r == 0 && it < 100000);
    ch->m.elapsed = t_now_s() - t0;
    ch->m.rc = r;
    ch->m.iters = it;
    C_CHECK(ch, r < 0 && train_dcomm_status(d) == r, "killed rank: rc %d, status %d", r,
            train_dcomm_status(d));
    train_dcomm_free(d); /* poisoned: ncclCommAbort, must not hang */
}

enum { SC_FUNC, SC_KILL };

static void child_main(int rank, int W, int sc, int port_rd, int port_wr, int out_fd)
{
    child ch;
    memset(&ch, 0, sizeof ch);
    ch.rank = rank;
    ch.W = W;
    elastic_store_server *srv = NULL;
    int port = 0;
    if (W > 1) {
        if (rank == 0) {
            elastic_store_server_opts so = ELASTIC_STORE_SERVER_OPTS_INIT;
            so.token = "nccl-check";
            if (elastic_store_server_start(&srv, &so) < 0) _exit(3);
            port = elastic_store_server_port(srv);
            for (int i = 1; i < W; i++)
                if (write(port_wr, &port, sizeof port) != (ssize_t)sizeof port) _exit(3);
        } else if (read(port_rd, &port, sizeof port) != (ssize_t)sizeof port) {
            _exit(3);
        }
    }
    close(port_rd);
    close(port_wr);
    char why[512] = "";
    int r = train_device_open(&ch.dev, TRAIN_DEVICE_CUDA, rank, why, sizeof why);
    if (r < 0) {
        fprintf(stderr, "rank %d: %s\n", rank, why);
        _exit(3);
    }
    ch.s = train_device_compute_stream(ch.dev);
    host_tree_ctx tctx = {(cudaStream_t)train_stream_native(ch.s), NULL, 0, 0};
    kern_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.name = "nccl_check host tree";
    ops.ctx = &tctx;
    ops.rank_tree_sum = host_tree_sum;
    ops.status = host_tree_status;

    train_comm_opts o = TRAIN_COMM_OPTS_INIT;
    o.rank = rank;
    o.world_size = W;
    o.store_host = "127.0.0.1";
    o.store_port = port;
    o.store_token = "nccl-check";
    o.prefix = sc == SC_KILL ? "nccl/kill" : "nccl/func";
    o.timeout_s = 60.0;
    r = train_comm_init(&ch.c, &o);
    C_CHECK(&ch, r == 0, "host comm: %d", r);
    if (r == 0 && train_comm_barrier(ch.c) == 0) {
        if (sc == SC_FUNC) functional(&ch, &ops);
        else killed_rank(&ch, &ops, out_fd);
    }
    ch.m.rank = rank;
    ch.m.fails = ch.fails;
    msg copy = ch.m;
    if (write(out_fd, &copy, sizeof copy) != (ssize_t)sizeof copy) _exit(3);
    if (sc == SC_FUNC) train_comm_barrier(ch.c);
    train_comm_free(ch.c);
    cudaFreeHost(tctx.pin);
    train_device_close(ch.dev);
    elastic_store_server_stop(srv);
    _exit(ch.fails ? 1 : 0);
}

/* ------------------------------------------------------------------ parent */

static int run_group(int W, int sc, msg *done, int *got, double limit_s)
{
    int pp[2], rp[2];
    pid_t pid[MAXW];
    T_REQUIRE(pipe(pp) == 0 && pipe(rp) == 0, "pipe");
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < W; r++) {
        pid[r] = fork();
        T_REQUIRE(pid[r] >= 0, "fork");
        if (pid[r] == 0) {
            close(rp[0]);
            child_main(r, W, sc, pp[0], pp[1], rp[1]);
        }
        got[r] = 0;
    }
    close(pp[0]);
    close(pp[1]);
    close(rp[1]);
    int expect = sc == SC_KILL ? W - 1 : W, n = 0;
    double end = t_now_s() + limit_s;
    while (n < expect) {
        struct pollfd pf = {rp[0], POLLIN, 0};
        int ms = (int)((end - t_now_s()) * 1000);
        msg m;
        if (ms <= 0 || poll(&pf, 1, ms) <= 0 || read(rp[0], &m, sizeof m) != (ssize_t)sizeof m)
            break;
        if (m.rank >= 0 && m.rank < W && !got[m.rank]) {
            got[m.rank] = 1;
            done[m.rank] = m;
            n++;
        }
    }
    close(rp[0]);
    int bad = 0;
    for (int r = 0; r < W; r++) {
        int st = 0;
        pid_t w = 0;
        double wd = t_now_s() + 20;
        while ((w = waitpid(pid[r], &st, WNOHANG)) == 0 && t_now_s() < wd) t_sleep_s(0.01);
        if (w != pid[r]) {
            kill(pid[r], SIGKILL);
            waitpid(pid[r], &st, 0);
            if (!(sc == SC_KILL && r == W - 1)) bad++;
        } else if (!(sc == SC_KILL && r == W - 1) && (!WIFEXITED(st) || WEXITSTATUS(st))) {
            bad++;
        }
    }
    return bad;
}

int main(int argc, char **argv)
{
    int single = argc > 1 && !strcmp(argv[1], "--single");
    int ngpu = train_device_count(TRAIN_DEVICE_CUDA);
    if (!train_dcomm_nccl_built() || ngpu < (single ? 1 : 2)) {
        printf("nccl_check: skipped (%d CUDA device(s), NCCL %s)\n", ngpu < 0 ? 0 : ngpu,
               train_dcomm_nccl_built() ? "built" : "not built");
        return 77;
    }
    int W = single ? 1 : (ngpu > MAXW ? MAXW : ngpu);
    msg done[MAXW];
    int got[MAXW];
    double t0 = t_now_s();
    int bad = run_group(W, SC_FUNC, done, got, 240.0);
    T_CHECK(bad == 0, "functional W=%d: %d rank(s) failed", W, bad);
    for (int r = 0; r < W; r++) {
        T_CHECK(got[r], "rank %d did not report", r);
        if (got[r] && got[0])
            T_CHECK(done[r].hash == done[0].hash, "tree bits of rank %d differ from rank 0's", r);
    }
    printf("NCCL W=%d tree + ring: reduce-scatter, all-reduce, all-gather %s in %.1f s\n", W,
           bad ? "FAILED" : "ok", t_now_s() - t0);
    if (W >= 2) {
        t0 = t_now_s();
        run_group(W, SC_KILL, done, got, TIMEOUT_S + 60.0);
        for (int r = 0; r < W - 1; r++) {
            T_CHECK(got[r], "killed rank: survivor %d did not report (hang?)", r);
            if (!got[r]) continue;
            printf("killed rank %d: rank %d got %d (%s) after %.2f s, %d all-reduce(s)\n", W - 1,
                   r, done[r].rc, strerror(-done[r].rc), done[r].elapsed, done[r].iters);
            T_CHECK(done[r].rc < 0 && done[r].elapsed < TIMEOUT_S + 5.0,
                    "killed rank: rank %d rc %d after %.2f s", r, done[r].rc, done[r].elapsed);
        }
    }
    return t_done("nccl_check");
}
