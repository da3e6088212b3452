/* test_train_dcomm.c - the device collectives (train/dcomm.h) without a GPU.
 *
 * Like test_train_comm.c, W forked processes, rank 0 hosting the store; children report over
 * a shared pipe (fixed-size records) and the parent always kills and reaps every child (the
 * harness and the inputs: t_ranks.h).
 * Checked:
 *   - the CPU backend at W = 1, 2, 3, 4: reduce-scatter (uneven and empty ranges, out of
 *     place and in place), all-reduce (n = 10007, 3, 1, 0) and all-gather (uneven parts)
 *     give exactly the bits of comm.h's functions on the same inputs and of the pairwise
 *     tree computed locally, the same on every rank; the ring mode on the CPU device is the
 *     same tree; the collectives queue behind work on a stream of their own;
 *   - a dead peer (SIGKILL) turns into -ECONNRESET/-EPIPE within the timeout, then the same
 *     error from train_dcomm_status and every later call;
 *   - NCCL's unique id exchange over the host communicator (W = 3): every rank ends with
 *     rank 0's 128 bytes (NCCL builds only; ncclGetUniqueId works without a GPU);
 *   - train_dcomm_log_env: the NCCL version line and the sorted NCCL_* variables (none, then
 *     some set here), captured from stderr; -ENOTSUP without NCCL;
 *   - argument errors of create, and a CUDA device that cannot be opened here.
 */
#include "comm.h"
#include "dcomm.h"
#include "dcomm_internal.h"
#include "log.h"
#include "store.h"
#include "t_helpers.h"
#include "t_ranks.h"

#include <fcntl.h>
#include <signal.h>
#include <stdint.h>

#define MAXW 4
#define FAIL_TIMEOUT_S 3.0

extern char **environ;

/* ------------------------------------------------------------------ child side */

enum { MSG_READY = 1, MSG_DONE = 2 };

typedef struct msg {
    int type, rank, rc, rc2, rc3, fails;
    double t, elapsed;
    uint64_t hash;
    unsigned char id[TRAIN_DCOMM_ID_BYTES];
} msg;

typedef struct child {
    train_comm *c;
    train_dcomm *d;
    train_device *dev;
    int rank, W, out_fd, fails;
    msg m;
} child;

static void send_msg(child *ch, int type)
{
    ch->m.type = type;
    ch->m.rank = ch->rank;
    ch->m.fails = ch->fails;
    msg copy = ch->m;
    t_ranks_send(ch->out_fd, &copy, sizeof copy);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) _exit(3);
    return p;
}

/* dcomm vs comm.h vs the local tree, for one all-reduce of n elements */
static void check_allreduce(child *ch, train_dcomm *d, uint64_t seed, size_t n)
{
    float *a = xmalloc(n * sizeof *a), *b = xmalloc(n * sizeof *b);
    for (size_t i = 0; i < n; i++) a[i] = b[i] = t_gen(seed, ch->rank, i);
    int r1 = train_dcomm_all_reduce_f32(d, n ? a : NULL, n);
    int r2 = train_comm_all_reduce_f32(ch->c, n ? b : NULL, n);
    C_CHECK(ch, r1 == 0 && r2 == 0, "all_reduce n=%zu: dcomm %d, comm %d", n, r1, r2);
    size_t bad_comm = 0, bad_tree = 0;
    for (size_t i = 0; i < n; i++) {
        float ref = t_ref_elem(seed, ch->W, i, NULL);
        bad_comm += memcmp(&a[i], &b[i], sizeof *a) != 0;
        bad_tree += memcmp(&a[i], &ref, sizeof ref) != 0;
    }
    C_CHECK(ch, bad_comm == 0 && bad_tree == 0,
            "all_reduce n=%zu: %zu elements differ from comm.h, %zu from the tree", n, bad_comm,
            bad_tree);
    ch->m.hash = t_fnv(ch->m.hash, a, n * sizeof *a);
    free(a);
    free(b);
}

static void check_reduce_scatter(child *ch, train_dcomm *d)
{
    int W = ch->W, me = ch->rank;
    size_t counts[MAXW], off[MAXW + 1], total = 0;
    for (int q = 0; q < W; q++) {
        counts[q] = q % 3 == 1 ? 0 : 100 + 37 * (size_t)q; /* uneven, some empty */
        off[q] = total;
        total += counts[q];
    }
    float *in = xmalloc(total * sizeof *in), *in2 = xmalloc(total * sizeof *in);
    float *out = xmalloc((counts[me] + 1) * sizeof *out), *out2 = xmalloc((counts[me] + 1) * 4);
    for (int pass = 0; pass < 2; pass++) { /* out of place, in place */
        for (size_t i = 0; i < total; i++) in[i] = in2[i] = t_gen(21 + (uint64_t)pass, me, i);
        float *dst = pass ? in + off[me] : out, *dst2 = pass ? in2 + off[me] : out2;
        int r1 = train_dcomm_reduce_scatter_f32(d, in, dst, counts);
        int r2 = train_comm_reduce_scatter_f32(ch->c, in2, dst2, counts);
        C_CHECK(ch, r1 == 0 && r2 == 0, "reduce_scatter pass %d: dcomm %d comm %d", pass, r1, r2);
        size_t bad_comm = 0, bad_tree = 0;
        for (size_t i = 0; i < counts[me]; i++) {
            float ref = t_ref_elem(21 + (uint64_t)pass, W, off[me] + i, NULL);
            bad_comm += memcmp(&dst[i], &dst2[i], sizeof ref) != 0;
            bad_tree += memcmp(&dst[i], &ref, sizeof ref) != 0;
        }
        C_CHECK(ch, bad_comm == 0 && bad_tree == 0,
                "reduce_scatter pass %d: %zu differ from comm.h, %zu from the tree", pass,
                bad_comm, bad_tree);
    }
    free(in);
    free(in2);
    free(out);
    free(out2);
}

static void check_all_gather(child *ch, train_dcomm *d)
{
    int W = ch->W, me = ch->rank;
    size_t bc[MAXW], boff[MAXW + 1], btot = 0;
    for (int q = 0; q < W; q++) {
        bc[q] = q % 2 ? (q == W - 1 ? 5 : 0) : 1000 + 13 * (size_t)q;
        boff[q] = btot;
        btot += bc[q];
    }
    uint8_t *g = xmalloc(btot), *g2 = xmalloc(btot), *mine = xmalloc(bc[me]);
    for (int pass = 0; pass < 2; pass++) {
        memset(g, 0xEE, btot);
        memset(g2, 0xEE, btot);
        for (size_t i = 0; i < bc[me]; i++) mine[i] = (uint8_t)(me * 31 + i * 7 + (size_t)pass);
        const uint8_t *src = mine;
        if (pass) {
            memcpy(g + boff[me], mine, bc[me]);
            src = g + boff[me];
        }
        int r1 = train_dcomm_all_gather(d, src, g, bc);
        int r2 = train_comm_all_gather(ch->c, mine, g2, bc);
        C_CHECK(ch, r1 == 0 && r2 == 0, "all_gather pass %d: dcomm %d comm %d", pass, r1, r2);
        size_t bad = 0;
        for (int q = 0; q < W; q++)
            for (size_t i = 0; i < bc[q]; i++)
                bad += g[boff[q] + i] != (uint8_t)(q * 31 + i * 7 + (size_t)pass);
        C_CHECK(ch, bad == 0 && !memcmp(g, g2, btot), "all_gather pass %d: %zu bad bytes", pass,
                bad);
    }
    free(g);
    free(g2);
    free(mine);
}

/* A collective on a stream of its own sees what was queued on that stream before it (the
 * CPU device layer's worker streams are asynchronous). */
static void check_stream_order(child *ch)
{
    train_stream *s = NULL;
    int r = train_stream_create(ch->dev, &s);
    C_CHECK(ch, r == 0, "stream_create: %d", r);
    if (r < 0) return;
    train_dcomm *d = NULL;
    r = train_dcomm_create(&d, ch->c, ch->dev, NULL, s, TRAIN_DCOMM_TREE, 20.0);
    C_CHECK(ch, r == 0, "create on a stream: %d", r);
    size_t n = (size_t)1 << 20;
    float *src = xmalloc(n * sizeof *src), *buf = xmalloc(n * sizeof *buf);
    for (size_t i = 0; i < n; i++) src[i] = t_gen(31, ch->rank, i);
    memset(buf, 0, n * sizeof *buf);
    r = train_stream_copy_async(s, buf, src, n * sizeof *src, TRAIN_COPY_H2D);
    C_CHECK(ch, r == 0, "copy_async: %d", r);
    r = train_dcomm_all_reduce_f32(d, buf, n);
    C_CHECK(ch, r == 0, "all_reduce after a queued copy: %d", r);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        float ref = t_ref_elem(31, ch->W, i, NULL);
        bad += memcmp(&buf[i], &ref, sizeof ref) != 0;
    }
    C_CHECK(ch, bad == 0, "all_reduce after a queued copy: %zu of %zu wrong", bad, n);
    train_dcomm_free(d);
    C_CHECK(ch, train_stream_destroy(s, 10.0) == 0, "stream_destroy");
    free(src);
    free(buf);
}

static void scenario_func(child *ch)
{
    ch->m.hash = T_FNV_OFFSET;
    for (int mode = 0; mode < 2; mode++) {
        train_dcomm *d = NULL;
        int r = train_dcomm_create(&d, ch->c, ch->dev, NULL, NULL,
                                   mode ? TRAIN_DCOMM_RING : TRAIN_DCOMM_TREE, 20.0);
        C_CHECK(ch, r == 0, "create mode %d: %d", mode, r);
        if (r < 0) return;
        C_CHECK(ch, !strcmp(train_dcomm_describe(d), "cpu") && train_dcomm_status(d) == 0,
                "describe %s", train_dcomm_describe(d));
        check_allreduce(ch, d, 11, 10007);
        check_allreduce(ch, d, 12, 3); /* W = 4: an empty range */
        check_allreduce(ch, d, 13, 1);
        check_allreduce(ch, d, 14, 0);
        check_reduce_scatter(ch, d);
        check_all_gather(ch, d);
        train_dcomm_free(d);
    }
    check_stream_order(ch);
    int r = train_comm_barrier(ch->c);
    C_CHECK(ch, r == 0, "final barrier: %d", r);
}

/* The victim (rank W - 1) kills itself once everybody is ready; the others then all-reduce
 * through the dcomm. */
static void scenario_dead_peer(child *ch)
{
    train_dcomm *d = NULL;
    int r = train_dcomm_create(&d, ch->c, ch->dev, NULL, NULL, TRAIN_DCOMM_TREE,
                               FAIL_TIMEOUT_S);
    C_CHECK(ch, r == 0, "create: %d", r);
    size_t n = (size_t)1 << 18;
    float *b = xmalloc(n * sizeof *b);
    for (size_t i = 0; i < n; i++) b[i] = t_gen(5, ch->rank, i);
    r = train_comm_barrier(ch->c);
    C_CHECK(ch, r == 0, "barrier: %d", r);
    send_msg(ch, MSG_READY);
    if (ch->rank == ch->W - 1) raise(SIGKILL);
    t_sleep_s(0.3);
    double t0 = t_now_s();
    ch->m.rc = train_dcomm_all_reduce_f32(d, b, n);
    ch->m.elapsed = t_now_s() - t0;
    ch->m.rc2 = train_dcomm_status(d);
    ch->m.rc3 = train_dcomm_reduce_scatter_f32(d, b, b, (size_t[MAXW]){n / 4, n / 4, n / 4, n / 4});
    train_dcomm_free(d);
    free(b);
}

static void scenario_id(child *ch)
{
    memset(ch->m.id, 0, sizeof ch->m.id);
    ch->m.rc = train_dcomm_nccl_exchange_id(ch->c, ch->m.id);
}

enum { SC_FUNC, SC_DEAD, SC_ID };

/* arg: the scenario (int *) */
static void child_main(int rank, int W, int port_rd, int port_wr, int out_fd, void *arg)
{
    int sc = *(const int *)arg;
    child ch;
    memset(&ch, 0, sizeof ch);
    ch.rank = rank;
    ch.W = W;
    ch.out_fd = out_fd;
    elastic_store_server *srv = NULL;
    int port = t_ranks_store(rank, W, "test-token", NULL, port_rd, port_wr, &srv);
    train_comm_opts o = TRAIN_COMM_OPTS_INIT;
    o.rank = rank;
    o.world_size = W;
    o.store_host = "127.0.0.1";
    o.store_port = port;
    o.store_token = "test-token";
    o.prefix = "dcomm/gen0";
    o.timeout_s = sc == SC_DEAD ? FAIL_TIMEOUT_S : 20.0;
    o.connect_timeout_s = 20.0;
    char why[256] = "";
    int r = train_device_open(&ch.dev, TRAIN_DEVICE_CPU, 0, why, sizeof why);
    C_CHECK(&ch, r == 0, "device open: %d %s", r, why);
    if (r == 0) r = train_comm_init(&ch.c, &o);
    C_CHECK(&ch, r == 0, "init: %d", r);
    if (r == 0) {
        r = train_comm_barrier(ch.c); /* every rank is past init: the store may go */
        C_CHECK(&ch, r == 0, "first barrier: %d", r);
        switch (sc) {
        case SC_FUNC: scenario_func(&ch); break;
        case SC_DEAD: scenario_dead_peer(&ch); break;
        case SC_ID: scenario_id(&ch); break;
        }
    }
    send_msg(&ch, MSG_DONE);
    train_comm_free(ch.c);
    train_device_close(ch.dev);
    elastic_store_server_stop(srv);
    _exit(ch.fails ? 1 : 0);
}

/* ------------------------------------------------------------------ parent side */

typedef struct group {
    t_ranks r;
    msg done[MAXW];
    int got[MAXW];
} group;

/* One group; returns the number of children (the victim not counted) that did not exit 0. */
static int run_group(group *g, int W, int sc, int victim)
{
    memset(g, 0, sizeof *g);
    t_ranks_start(&g->r, W, child_main, &sc);
    double deadline = t_now_s() + 60.0;
    int ndone = 0, expect = victim >= 0 ? W - 1 : W;
    while (ndone < expect) {
        msg m;
        if (t_ranks_read(&g->r, &m, sizeof m, deadline) < 0) {
            T_CHECK(0, "group W=%d: children did not report in time (%d of %d)", W, ndone,
                    expect);
            break;
        }
        if (m.rank < 0 || m.rank >= W || m.type != MSG_DONE || g->got[m.rank]) continue;
        g->got[m.rank] = 1;
        g->done[m.rank] = m;
        ndone++;
    }
    return t_ranks_reap(&g->r, victim, 10.0);
}

/* ------------------------------------------------------------------ single process */

static void test_args(void)
{
    train_device *dev = NULL;
    T_REQUIRE(train_device_open(&dev, TRAIN_DEVICE_CPU, 0, NULL, 0) == 0, "cpu device");
    train_comm *c = NULL;
    train_comm_opts o = TRAIN_COMM_OPTS_INIT;
    T_REQUIRE(train_comm_init(&c, &o) == 0, "world 1");
    train_dcomm *d = (train_dcomm *)1;
    T_CHECK(train_dcomm_create(NULL, c, dev, NULL, NULL, TRAIN_DCOMM_TREE, 1) == -EINVAL, "out");
    T_CHECK(train_dcomm_create(&d, NULL, dev, NULL, NULL, TRAIN_DCOMM_TREE, 1) == -EINVAL && !d,
            "host NULL");
    T_CHECK(train_dcomm_create(&d, c, NULL, NULL, NULL, TRAIN_DCOMM_TREE, 1) == -EINVAL, "dev");
    T_CHECK(train_dcomm_create(&d, c, dev, NULL, NULL, TRAIN_DCOMM_TREE, 0) == -EINVAL, "t 0");
    T_CHECK(train_dcomm_create(&d, c, dev, NULL, NULL, TRAIN_DCOMM_TREE, 86401) == -EINVAL,
            "t > 1 day");
    T_CHECK(train_dcomm_create(&d, c, dev, NULL, NULL, (train_dcomm_mode)7, 1) == -EINVAL,
            "mode");
    T_CHECK(train_dcomm_status(NULL) == -EINVAL && !strcmp(train_dcomm_describe(NULL), "none"),
            "NULL");
    T_CHECK(train_dcomm_all_reduce_f32(NULL, NULL, 0) == -EINVAL, "NULL all_reduce");
    train_dcomm_free(NULL);

    /* W = 1: the collectives are copies; comm.h's poisoning shows through */
    T_REQUIRE(train_dcomm_create(&d, c, dev, NULL, NULL, TRAIN_DCOMM_TREE, 5) == 0, "create");
    float b[5] = {1, 2, 3, 4, 5}, out[5] = {0};
    size_t n5 = 5;
    T_CHECK(train_dcomm_all_reduce_f32(d, b, 5) == 0 && b[4] == 5, "W=1 all_reduce");
    T_CHECK(train_dcomm_reduce_scatter_f32(d, b, out, &n5) == 0 && !memcmp(out, b, sizeof b),
            "W=1 reduce_scatter");
    T_CHECK(train_comm_broadcast(c, b, 4, 1) == -EINVAL, "poison the host comm");
    T_CHECK(train_dcomm_status(d) == -EINVAL && train_dcomm_all_reduce_f32(d, b, 5) == -EINVAL,
            "the host comm's error");
    train_dcomm_free(d);
    train_comm_free(c);

    /* CUDA: this machine has no GPU (or the build no CUDA): open fails with a reason, so
     * train_dcomm_create cannot be reached with a CUDA device; the NCCL paths are
     * exercised by tests/gpu/nccl_check. */
    train_device *cd = NULL;
    char why[512] = "";
    int r = train_device_open(&cd, TRAIN_DEVICE_CUDA, 0, why, sizeof why);
    if (r == 0) {
        printf("CUDA device present (%s): the NCCL backend is tested by tests/gpu/nccl_check\n",
               train_device_describe(cd));
        train_device_close(cd);
    } else {
        T_CHECK((r == -ENODEV || r == -ENOTSUP) && why[0], "CUDA open: %d, why '%s'", r, why);
        printf("CUDA device: %s (%s)\n", strerror(-r), why);
    }
    train_device_close(dev);
}

/* Run train_dcomm_log_env with stderr in a file; returns the text (caller frees). */
static char *capture_log_env(int *rc)
{
    char path[] = "/tmp/t-dcomm-log-XXXXXX";
    int fd = mkstemp(path);
    T_REQUIRE(fd >= 0, "mkstemp");
    fflush(stderr);
    int saved = dup(2);
    T_REQUIRE(saved >= 0 && dup2(fd, 2) == 2, "dup2");
    *rc = train_dcomm_log_env();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    unsigned char *text = NULL;
    T_REQUIRE(t_slurp(path, &text) >= 0, "read %s", path);
    unlink(path);
    return (char *)text;
}

static void test_log_env(void)
{
    log_set_level(LOG_INFO);
    /* start from no NCCL_* at all */
    for (int again = 1; again;) {
        again = 0;
        for (char **e = environ; *e; e++)
            if (!strncmp(*e, "NCCL_", 5)) {
                char name[256];
                size_t l = strcspn(*e, "=");
                snprintf(name, sizeof name, "%.*s", (int)l, *e);
                unsetenv(name);
                again = 1;
                break;
            }
    }
    int rc = 0;
    char *t = capture_log_env(&rc);
    if (!train_dcomm_nccl_built()) {
        T_CHECK(rc == -ENOTSUP && !t[0], "log_env without NCCL: %d, '%s'", rc, t);
        printf("log_env: NCCL not built, -ENOTSUP\n");
        free(t);
        return;
    }
    T_CHECK(rc == 0, "log_env: %d", rc);
    T_CHECK(strstr(t, "[dcomm]") && strstr(t, "NCCL 2.") && strstr(t, "NCCL_* in effect: none"),
            "log without NCCL_*: '%s'", t);
    free(t);

    setenv("NCCL_IB_DISABLE", "1", 1);
    setenv("NCCL_DEBUG", "WARN", 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 1);
    setenv("NCCL_P2P_LEVEL", "NVL", 1);
    setenv("NOT_NCCL_X", "1", 1);
    t = capture_log_env(&rc);
    T_CHECK(rc == 0, "log_env: %d", rc);
    T_CHECK(strstr(t, "NCCL_* in effect: NCCL_DEBUG=WARN NCCL_IB_DISABLE=1 NCCL_P2P_LEVEL=NVL "
                      "NCCL_SOCKET_IFNAME=lo\n") != NULL,
            "log with NCCL_*: '%s'", t);
    T_CHECK(!strstr(t, "NOT_NCCL"), "a variable that is not NCCL_*: '%s'", t);
    const char *v = strstr(t, "NCCL 2.");
    int maj = 0, min = 0, pat = 0;
    T_CHECK(v && sscanf(v, "NCCL %d.%d.%d", &maj, &min, &pat) == 3 && maj == 2 && min >= 0,
            "version line '%s'", t);
    printf("log_env: NCCL %d.%d.%d; the four NCCL_* variables logged sorted\n", maj, min, pat);
    free(t);
    unsetenv("NCCL_IB_DISABLE");
    unsetenv("NCCL_DEBUG");
    unsetenv("NCCL_SOCKET_IFNAME");
    unsetenv("NCCL_P2P_LEVEL");
    unsetenv("NOT_NCCL_X");
}

int main(void)
{
    double t_all = t_now_s();
    signal(SIGPIPE, SIG_IGN);
    test_args();
    test_log_env();

    for (int W = 1; W <= 4; W++) {
        group g;
        double t0 = t_now_s();
        int bad = run_group(&g, W, SC_FUNC, -1);
        T_CHECK(bad == 0, "functional W=%d: %d rank(s) failed", W, bad);
        for (int r = 1; r < W; r++)
            T_CHECK(g.got[r] && g.got[0] && g.done[r].hash == g.done[0].hash,
                    "W=%d: rank %d's results differ from rank 0's", W, r);
        printf("CPU backend W=%d: %s in %.2f s (bits = comm.h = local tree)\n", W,
               bad ? "FAILED" : "ok", t_now_s() - t0);
    }

    for (int W = 2; W <= 4; W++) {
        group g;
        run_group(&g, W, SC_DEAD, W - 1);
        for (int r = 0; r < W - 1; r++) {
            const msg *m = &g.done[r];
            T_CHECK(g.got[r], "dead peer W=%d: rank %d did not report", W, r);
            if (!g.got[r]) continue;
            printf("dead peer W=%d: rank %d: %s after %.3f s, status %s, next call %s\n", W, r,
                   t_errname(m->rc), m->elapsed, t_errname(m->rc2), t_errname(m->rc3));
            T_CHECK(m->rc == -ECONNRESET || m->rc == -EPIPE, "dead peer W=%d rank %d: %s", W, r,
                    t_errname(m->rc));
            T_CHECK(m->elapsed < FAIL_TIMEOUT_S, "dead peer: rank %d took %.3f s", r, m->elapsed);
            T_CHECK(m->rc2 == m->rc && m->rc3 == m->rc, "poisoned: %d %d %d", m->rc, m->rc2,
                    m->rc3);
        }
    }

    {
        group g;
        int bad = run_group(&g, 3, SC_ID, -1), f0 = t_failures;
        if (train_dcomm_nccl_built()) {
            T_CHECK(bad == 0, "id exchange: %d rank(s) failed", bad);
            static const unsigned char zero[TRAIN_DCOMM_ID_BYTES];
            T_CHECK(g.got[0] && g.done[0].rc == 0 && memcmp(g.done[0].id, zero, sizeof zero),
                    "rank 0's id: rc %d", g.done[0].rc);
            for (int r = 1; r < 3; r++)
                T_CHECK(g.got[r] && g.done[r].rc == 0 &&
                            !memcmp(g.done[r].id, g.done[0].id, TRAIN_DCOMM_ID_BYTES),
                        "rank %d's id differs from rank 0's (rc %d)", r, g.done[r].rc);
            printf("NCCL unique id exchange W=3: %s\n", t_failures > f0 ? "FAILED" : "ok");
        } else {
            for (int r = 0; r < 3; r++)
                T_CHECK(g.done[r].rc == -ENOTSUP, "id exchange without NCCL: %d", g.done[r].rc);
            printf("NCCL unique id exchange: not built, -ENOTSUP\n");
        }
    }
    printf("total %.2f s\n", t_now_s() - t_all);
    return t_done("test_train_dcomm");
}
