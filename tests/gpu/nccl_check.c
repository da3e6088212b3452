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
 * The tree sum is the CUDA table's rank_tree_sum (kern_cuda_ops_init on the dcomm's stream),
 * checked bit for bit against the host reference tree. The process harness and the inputs are
 * tests/unit/t_ranks.h's.
 */
#include "comm.h"
#include "dcomm.h"
#include "device.h"
#include "kern_cuda.h"
#include "kern_ops.h"
#include "store.h"
#include "t_helpers.h"
#include "t_ranks.h"

#include <cuda_runtime_api.h>

#include <poll.h>
#include <signal.h>
#include <stdint.h>

#define MAXW T_RANKS_MAXW
#define TIMEOUT_S 10.0

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
        float ref = t_ref_elem(seed, W, off + k, &a);
        if (ring ? fabs((double)got[k] - ref) > 1e-5 * a + 1e-30 : memcmp(&got[k], &ref, 4))
            bad++;
    }
    return bad;
}

static uint64_t check_all_reduce(child *ch, train_dcomm *d, uint64_t seed, size_t n, int ring)
{
    float *h = malloc(n * sizeof *h), *dv = dalloc(ch, n * sizeof *h);
    if (!h) _exit(3);
    for (size_t i = 0; i < n; i++) h[i] = t_gen(seed, ch->rank, i);
    h2d(ch, dv, h, n * sizeof *h);
    int r = train_dcomm_all_reduce_f32(d, dv, n);
    C_CHECK(ch, r == 0, "all-reduce n=%zu: %d", n, r);
    d2h(ch, h, dv, n * sizeof *h);
    size_t bad = compare(h, n, 0, seed, ch->W, ring);
    C_CHECK(ch, bad == 0, "%s all-reduce n=%zu: %zu of %zu elements off the reference",
            ring ? "ring" : "tree", n, bad, n);
    uint64_t hash = t_fnv(T_FNV_OFFSET, h, n * sizeof *h);
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
    for (size_t i = 0; i < tot; i++) h[i] = t_gen(seed, me, i);
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
    ch->m.hash = T_FNV_OFFSET;
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
            ch->m.hash = t_fnv(ch->m.hash, &h1, sizeof h1);
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

/* arg: the scenario (int *) */
static void child_main(int rank, int W, int port_rd, int port_wr, int out_fd, void *arg)
{
    int sc = *(const int *)arg;
    child ch;
    memset(&ch, 0, sizeof ch);
    ch.rank = rank;
    ch.W = W;
    elastic_store_server *srv = NULL;
    int port = t_ranks_store(rank, W, "nccl-check", NULL, port_rd, port_wr, &srv);
    char why[512] = "";
    int r = train_device_open(&ch.dev, TRAIN_DEVICE_CUDA, rank, why, sizeof why);
    if (r < 0) {
        fprintf(stderr, "rank %d: %s\n", rank, why);
        _exit(3);
    }
    ch.s = train_device_compute_stream(ch.dev);
    kern_ops ops;
    r = kern_cuda_ops_init(&ops, train_stream_native(ch.s), 0);
    if (r < 0) {
        fprintf(stderr, "rank %d: the CUDA kernel table: %s\n", rank, strerror(-r));
        _exit(3);
    }

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
    t_ranks_send(out_fd, &copy, sizeof copy);
    if (sc == SC_FUNC) train_comm_barrier(ch.c);
    train_comm_free(ch.c);
    kern_cuda_ops_free(&ops);
    train_device_close(ch.dev);
    elastic_store_server_stop(srv);
    _exit(ch.fails ? 1 : 0);
}

/* ------------------------------------------------------------------ parent */

/* One group; returns the number of ranks (the killed one not counted) that did not exit 0. */
static int run_group(int W, int sc, msg *done, int *got, double limit_s)
{
    for (int r = 0; r < W; r++) got[r] = 0;
    t_ranks g;
    t_ranks_start(&g, W, child_main, &sc);
    int expect = sc == SC_KILL ? W - 1 : W, n = 0;
    double end = t_now_s() + limit_s;
    while (n < expect) {
        msg m;
        if (t_ranks_read(&g, &m, sizeof m, end) < 0) break;
        if (m.rank >= 0 && m.rank < W && !got[m.rank]) {
            got[m.rank] = 1;
            done[m.rank] = m;
            n++;
        }
    }
    return t_ranks_reap(&g, sc == SC_KILL ? W - 1 : -1, 20.0);
}

/* The number of CUDA devices, counted in a child process: the parent must not initialise
 * CUDA, or the ranks it forks next could not use it (CUDA does not survive fork). -1 when
 * the child failed or took over 60 s. */
static int count_gpus_forked(void)
{
    int fd[2];
    if (pipe(fd)) return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(fd[0]), close(fd[1]);
        return -1;
    }
    if (pid == 0) {
        close(fd[0]);
        int n = train_device_count(TRAIN_DEVICE_CUDA);
        _exit(write(fd[1], &n, sizeof n) == (ssize_t)sizeof n ? 0 : 1);
    }
    close(fd[1]);
    int n = -1;
    struct pollfd pf = {fd[0], POLLIN, 0};
    if (poll(&pf, 1, 60000) == 1 && read(fd[0], &n, sizeof n) != (ssize_t)sizeof n) n = -1;
    close(fd[0]);
    kill(pid, SIGKILL); /* gone already unless it hung */
    waitpid(pid, NULL, 0);
    return n;
}

int main(int argc, char **argv)
{
    int single = argc > 1 && !strcmp(argv[1], "--single");
    int ngpu = count_gpus_forked();
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
