/* test_train_comm.c - the CPU communicator (train/comm.h) with W forked processes.
 *
 * Rank 0 of each group hosts the store (port 0) and passes the port to the other ranks
 * through a pipe. Children report over a shared pipe (one fixed-size record per write, so
 * records never interleave); the parent checks the records, and always kills and reaps every
 * child. Checked: sums against a locally computed pairwise tree, bit for bit, with the same
 * bits on every rank; uneven and empty ranges; all-gather; broadcast from non-zero roots;
 * barrier; 64 MiB all-reduce (no deadlock); random sleeps (timing independence); a killed
 * rank (before and during a collective) and a stopped rank turn into errors in every
 * survivor within timeout + 1 s. The process harness and the inputs are t_ranks.h's.
 */
#include "comm.h"
#include "store.h"
#include "t_helpers.h"
#include "t_ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

#define MAXW T_RANKS_MAXW
#define FAIL_TIMEOUT_S 3.0

/* ------------------------------------------------------------------ child side */

enum { MSG_READY = 1, MSG_DONE = 2 };

typedef struct msg {
    int type, rank, rc, rc2, fails, iters;
    double t, elapsed;
    uint64_t hash;
} msg;

typedef struct child {
    train_comm *c;
    int rank, W, out_fd;
    int fails;
    msg m;
} child;

static void send_msg(child *ch, int type)
{
    ch->m.type = type;
    ch->m.rank = ch->rank;
    ch->m.fails = ch->fails;
    t_ranks_send(ch->out_fd, &ch->m, sizeof ch->m);
}

static void check_allreduce(child *ch, uint64_t seed, size_t n)
{
    float *b = n ? malloc(n * sizeof *b) : NULL;
    if (n && !b) _exit(3);
    for (size_t i = 0; i < n; i++) b[i] = t_gen(seed, ch->rank, i);
    int r = train_comm_all_reduce_f32(ch->c, b, n);
    C_CHECK(ch, r == 0, "all_reduce n=%zu: %d", n, r);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        float ref = t_ref_elem(seed, ch->W, i, NULL);
        if (memcmp(&ref, &b[i], sizeof ref)) bad++;
    }
    C_CHECK(ch, bad == 0, "all_reduce n=%zu: %zu elements differ from the tree sum", n, bad);
    if (n) ch->m.hash = t_fnv(ch->m.hash, b, n * sizeof *b);
    free(b);
}

static void scenario_func(child *ch)
{
    train_comm *c = ch->c;
    int W = ch->W, me = ch->rank, r;
    ch->m.hash = T_FNV_OFFSET;

    C_CHECK(ch, train_comm_rank(c) == me && train_comm_world_size(c) == W, "rank/size");
    check_allreduce(ch, 11, 10007);
    check_allreduce(ch, 12, 3); /* W = 8: empty ranges */
    check_allreduce(ch, 13, 0);
    check_allreduce(ch, 14, 1);

    /* reduce-scatter with uneven and empty ranges, out of place and in place */
    size_t counts[MAXW], off[MAXW + 1], total = 0;
    for (int q = 0; q < W; q++) {
        counts[q] = q % 3 == 1 ? 0 : 100 + 37 * (size_t)q;
        off[q] = total;
        total += counts[q];
    }
    float *in = malloc(total * sizeof *in), *out = malloc((counts[me] + 1) * sizeof *out);
    if (!in || !out) _exit(3);
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < total; i++) in[i] = t_gen(21, me, i);
        float *dst = pass ? in + off[me] : out;
        r = train_comm_reduce_scatter_f32(c, in, dst, counts);
        C_CHECK(ch, r == 0, "reduce_scatter pass %d: %d", pass, r);
        size_t bad = 0;
        for (size_t i = 0; i < counts[me]; i++) {
            float ref = t_ref_elem(21, W, off[me] + i, NULL);
            if (memcmp(&ref, &dst[i], sizeof ref)) bad++;
        }
        C_CHECK(ch, bad == 0, "reduce_scatter pass %d: %zu bad", pass, bad);
    }
    free(in);
    free(out);

    /* all-gather of bytes with per-rank sizes (some empty), out of place and in place */
    size_t bc[MAXW], boff[MAXW + 1], btot = 0;
    for (int q = 0; q < W; q++) {
        bc[q] = q % 2 ? (q == W - 1 ? 5 : 0) : 1000 + 13 * (size_t)q;
        boff[q] = btot;
        btot += bc[q];
    }
    uint8_t *g = malloc(btot + 1), *mine = malloc(bc[me] + 1);
    if (!g || !mine) _exit(3);
    for (int pass = 0; pass < 2; pass++) {
        memset(g, 0xEE, btot);
        for (size_t i = 0; i < bc[me]; i++) mine[i] = (uint8_t)(me * 31 + i * 7);
        const uint8_t *src = mine;
        if (pass) {
            memcpy(g + boff[me], mine, bc[me]);
            src = g + boff[me];
        }
        r = train_comm_all_gather(c, src, g, bc);
        C_CHECK(ch, r == 0, "all_gather: %d", r);
        size_t bad = 0;
        for (int q = 0; q < W; q++)
            for (size_t i = 0; i < bc[q]; i++)
                if (g[boff[q] + i] != (uint8_t)(q * 31 + i * 7)) bad++;
        C_CHECK(ch, bad == 0, "all_gather pass %d: %zu bad bytes", pass, bad);
    }
    free(g);
    free(mine);

    /* broadcast from non-zero roots */
    int roots[2] = {W - 1, W / 2};
    for (int k = 0; k < 2; k++) {
        uint8_t buf[4097];
        for (size_t i = 0; i < sizeof buf; i++)
            buf[i] = me == roots[k] ? (uint8_t)(i * 3 + (size_t)roots[k]) : 0;
        r = train_comm_broadcast(c, buf, sizeof buf, roots[k]);
        C_CHECK(ch, r == 0, "broadcast root %d: %d", roots[k], r);
        size_t bad = 0;
        for (size_t i = 0; i < sizeof buf; i++)
            if (buf[i] != (uint8_t)(i * 3 + (size_t)roots[k])) bad++;
        C_CHECK(ch, bad == 0, "broadcast root %d: %zu bad", roots[k], bad);
    }

    /* timing independence: random sleeps in some ranks before each collective */
    srand((unsigned)(me * 7919 + 1));
    for (int it = 0; it < 5; it++) {
        if ((me + it) % 2 == 0) t_sleep_s((double)(rand() % 20) * 1e-3);
        check_allreduce(ch, 100 + (uint64_t)it, 4099);
    }

    /* the barrier really waits for the last rank */
    if (me == W - 1) t_sleep_s(0.2);
    double t0 = t_now_s();
    r = train_comm_barrier(c);
    C_CHECK(ch, r == 0, "barrier: %d", r);
    if (W > 1 && me != W - 1)
        C_CHECK(ch, t_now_s() - t0 > 0.15, "barrier returned after %.3f s, before the last rank",
                t_now_s() - t0);
    r = train_comm_barrier(c);
    C_CHECK(ch, r == 0 && train_comm_status(c) == 0, "final barrier: %d", r);
}

/* 64 MiB all-reduce: every rank sends and receives ~2 x 48 MiB at once. */
static void scenario_big(child *ch)
{
    size_t n = (size_t)16 << 20;
    float *b = malloc(n * sizeof *b);
    if (!b) _exit(3);
    for (size_t i = 0; i < n; i++) b[i] = t_gen(77, ch->rank, i);
    double t0 = t_now_s();
    int r = train_comm_all_reduce_f32(ch->c, b, n);
    ch->m.elapsed = t_now_s() - t0;
    C_CHECK(ch, r == 0, "64 MiB all_reduce: %d", r);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        float ref = t_ref_elem(77, ch->W, i, NULL);
        if (memcmp(&ref, &b[i], sizeof ref)) bad++;
    }
    C_CHECK(ch, bad == 0, "64 MiB all_reduce: %zu bad", bad);
    ch->m.hash = t_fnv(T_FNV_OFFSET, b, n * sizeof *b);
    free(b);
    r = train_comm_barrier(ch->c);
    C_CHECK(ch, r == 0, "barrier: %d", r);
}

/* Rank mismatch: rank 1 passes another n; both must fail, not corrupt data: at least one
 * with -EBADMSG (the other may instead see the first one shut the group down). */
static void scenario_mismatch(child *ch)
{
    float b[12] = {0};
    ch->m.rc = train_comm_all_reduce_f32(ch->c, b, ch->rank ? 12 : 10);
    ch->m.rc2 = train_comm_barrier(ch->c);
}

enum { VICTIM_PAUSE, VICTIM_SUICIDE, VICTIM_LOOP };

typedef struct fail_case {
    const char *name;
    int victim, victim_mode;
    int survivor_loop; /* survivors loop all-reduces; else one all-reduce */
    double survivor_delay;
    int sig; /* SIGKILL or SIGSTOP sent by the parent; 0 = none */
    size_t n;
} fail_case;

static void scenario_fail(child *ch, const fail_case *fc)
{
    float *b = malloc(fc->n * sizeof *b);
    if (!b) _exit(3);
    for (size_t i = 0; i < fc->n; i++) b[i] = t_gen(5, ch->rank, i);
    send_msg(ch, MSG_READY);
    if (ch->rank == fc->victim) {
        if (fc->victim_mode == VICTIM_SUICIDE) raise(SIGKILL);
        if (fc->victim_mode == VICTIM_PAUSE)
            for (;;) pause();
    }
    if (fc->survivor_delay > 0) t_sleep_s(fc->survivor_delay);
    double t0 = t_now_s();
    int r = 0, it = 0;
    do {
        t0 = t_now_s();
        r = train_comm_all_reduce_f32(ch->c, b, fc->n);
        it++;
    } while (r == 0 && (fc->survivor_loop || ch->rank == fc->victim) && it < 100000);
    ch->m.t = t_now_s();
    ch->m.elapsed = ch->m.t - t0;
    ch->m.rc = r;
    ch->m.iters = it;
    ch->m.rc2 = train_comm_barrier(ch->c); /* poisoned: the same error at once */
    free(b);
}

/* ------------------------------------------------------------------ parent side */

enum { SC_FUNC, SC_BIG, SC_MISMATCH, SC_FAIL, SC_STRAY, SC_V6 };

/* Before its own init, rank 1 reads rank 0's address from the store and connects with a
 * well-formed hello that carries a wrong secret: rank 0 must close that connection and
 * still accept the real rank 1. */
static void stray_connect(child *ch, int port)
{
    elastic_store_client *st = NULL;
    void *v = NULL;
    size_t vl = 0;
    char host[64];
    int p = 0;
    int r = elastic_store_connect(&st, "127.0.0.1", port, "test-token", 10.0);
    if (r == 0) r = elastic_store_get(st, "test/gen0/addr/0", &v, &vl, 10.0);
    C_CHECK(ch, r == 0 && sscanf((char *)v, "%63s %d", host, &p) == 2, "stray: address %d", r);
    elastic_store_close(st);
    free(v);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)p);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    r = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    C_CHECK(ch, r == 0, "stray connect: %s", strerror(errno));
    uint32_t h[13] = {0x314d4354u, 1, 1, 0, 2, 0xdeadbeef};
    C_CHECK(ch, write(fd, h, sizeof h) == (ssize_t)sizeof h, "stray write");
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char b[64];
    ssize_t n = read(fd, b, sizeof b);
    C_CHECK(ch, n == 0 || (n < 0 && errno == ECONNRESET), "stray: got %zd bytes, not closed", n);
    close(fd);
}

/* The address this rank published is the one its store connection comes from (::1 for a
 * store on ::1), not a fixed 127.0.0.1 that ranks on other hosts would take for their own. */
static void check_published_addr(child *ch, int port)
{
    elastic_store_client *st = NULL;
    int r = elastic_store_connect(&st, "::1", port, "test-token", 5.0);
    C_CHECK(ch, r == 0, "connect to the store on ::1: %d", r);
    if (r < 0) return;
    char key[64];
    snprintf(key, sizeof key, "test/gen0/addr/%d", ch->rank);
    void *v = NULL;
    size_t len = 0;
    r = elastic_store_get(st, key, &v, &len, 5.0);
    C_CHECK(ch, r == 0 && len > 4 && !memcmp(v, "::1 ", 4), "published address %.*s (rc %d)",
            r == 0 ? (int)len : 0, r == 0 ? (const char *)v : "", r);
    free(v);
    elastic_store_close(st);
}

/* what a group's children run: the scenario and, for SC_FAIL, the case */
typedef struct group_arg {
    int sc;
    const fail_case *fc;
} group_arg;

static void child_main(int rank, int W, int port_rd, int port_wr, int out_fd, void *arg)
{
    int sc = ((const group_arg *)arg)->sc;
    const fail_case *fc = ((const group_arg *)arg)->fc;
    child ch;
    memset(&ch, 0, sizeof ch);
    ch.rank = rank;
    ch.W = W;
    ch.out_fd = out_fd;
    elastic_store_server *srv = NULL;
    int port = t_ranks_store(rank, W, "test-token", sc == SC_V6 ? "::1" : NULL, port_rd, port_wr,
                             &srv);
    train_comm_opts o = TRAIN_COMM_OPTS_INIT;
    o.rank = rank;
    o.world_size = W;
    o.store_host = sc == SC_V6 ? "::1" : "127.0.0.1";
    o.store_port = port;
    o.store_token = "test-token";
    o.prefix = "test/gen0";
    o.timeout_s = sc == SC_FAIL ? FAIL_TIMEOUT_S : 20.0;
    o.connect_timeout_s = 20.0;
    if (sc == SC_STRAY && rank == 1) stray_connect(&ch, port);
    int r = train_comm_init(&ch.c, &o);
    C_CHECK(&ch, r == 0, "init: %d", r);
    if (r == 0) {
        r = train_comm_barrier(ch.c); /* every rank is past init: the store may go */
        C_CHECK(&ch, r == 0, "first barrier: %d", r);
        switch (sc) {
        case SC_FUNC: scenario_func(&ch); break;
        case SC_BIG: scenario_big(&ch); break;
        case SC_MISMATCH: scenario_mismatch(&ch); break;
        case SC_FAIL: scenario_fail(&ch, fc); break;
        case SC_STRAY: check_allreduce(&ch, 9, 1000); break;
        case SC_V6: check_published_addr(&ch, port); check_allreduce(&ch, 5, 1000); break;
        }
    }
    send_msg(&ch, MSG_DONE);
    train_comm_free(ch.c);
    elastic_store_server_stop(srv);
    _exit(ch.fails ? 1 : 0);
}

typedef struct group {
    t_ranks r;
    msg done[MAXW];
    int got[MAXW];
    double t_signal;
} group;

/* Run one group; returns the number of children that exited non-zero (killed victims not
 * counted). */
static int run_group(group *g, int W, int sc, const fail_case *fc)
{
    memset(g, 0, sizeof *g);
    group_arg ga = {sc, fc};
    t_ranks_start(&g->r, W, child_main, &ga);
    double deadline = t_now_s() + 40.0;
    int ready = 0, ndone = 0, expect_done = fc ? W - 1 : W; /* a victim never reports */
    while (ndone < expect_done) {
        msg m;
        if (t_ranks_read(&g->r, &m, sizeof m, deadline) < 0) {
            T_CHECK(0, "group W=%d: children did not report in time (%d of %d)", W, ndone,
                    expect_done);
            break;
        }
        if (m.rank < 0 || m.rank >= W) continue;
        if (m.type == MSG_READY && ++ready == W && fc && fc->sig) {
            t_sleep_s(0.3);
            g->t_signal = t_now_s();
            kill(g->r.pid[fc->victim], fc->sig);
        } else if (m.type == MSG_DONE && !g->got[m.rank]) {
            g->got[m.rank] = 1;
            g->done[m.rank] = m;
            ndone++;
        }
    }
    /* then the victim (killed or stopped), and anything that hung, is killed */
    return t_ranks_reap(&g->r, fc ? fc->victim : -1, 10.0);
}

static void test_single(void)
{
    train_comm *c = NULL;
    train_comm_opts o = TRAIN_COMM_OPTS_INIT;
    T_CHECK(train_comm_init(NULL, &o) == -EINVAL, "NULL out");
    o.rank = 1;
    T_CHECK(train_comm_init(&c, &o) == -EINVAL && !c, "rank >= world");
    o.rank = 0;
    o.timeout_s = 0;
    T_CHECK(train_comm_init(&c, &o) == -EINVAL, "timeout 0");
    o.timeout_s = 30;
    o.world_size = 2; /* no store */
    T_CHECK(train_comm_init(&c, &o) == -EINVAL, "no store");
    o.world_size = 1;
    T_REQUIRE(train_comm_init(&c, &o) == 0, "world 1");
    float b[5] = {1, 2, 3, 4, 5};
    T_CHECK(train_comm_all_reduce_f32(c, b, 5) == 0 && b[4] == 5, "W=1 all_reduce");
    float o1[5];
    size_t cnt = 5;
    T_CHECK(train_comm_reduce_scatter_f32(c, b, o1, &cnt) == 0 && !memcmp(o1, b, sizeof b),
            "W=1 reduce_scatter");
    uint8_t g[3];
    size_t gc = 3;
    T_CHECK(train_comm_all_gather(c, "abc", g, &gc) == 0 && !memcmp(g, "abc", 3), "W=1 gather");
    T_CHECK(train_comm_broadcast(c, g, 3, 0) == 0 && train_comm_barrier(c) == 0, "W=1 bc");
    T_CHECK(train_comm_broadcast(c, g, 3, 1) == -EINVAL, "bad root");
    T_CHECK(train_comm_status(c) == -EINVAL && train_comm_barrier(c) == -EINVAL, "poisoned");
    train_comm_free(c);
    train_comm_free(NULL);
    T_CHECK(train_comm_barrier(NULL) == -EINVAL && train_comm_rank(NULL) == -1, "NULL");

    setenv("RANK", "2", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29500", 1);
    o = (train_comm_opts)TRAIN_COMM_OPTS_INIT;
    T_CHECK(train_comm_opts_from_env(&o) == 0 && o.rank == 2 && o.world_size == 4 &&
                o.store_port == 29500 && !strcmp(o.store_host, "127.0.0.1"), "from env");
    setenv("RANK", "4", 1);
    T_CHECK(train_comm_opts_from_env(&o) == -EINVAL, "RANK out of range");
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    T_CHECK(train_comm_opts_from_env(&o) == 0 && o.world_size == 1 && o.rank == 0, "no env");
}

int main(void)
{
    double t_all = t_now_s();
    test_single();

    int ws[] = {1, 2, 3, 4, 8};
    for (size_t k = 0; k < sizeof ws / sizeof *ws; k++) {
        group g;
        double t0 = t_now_s();
        int bad = run_group(&g, ws[k], SC_FUNC, NULL);
        T_CHECK(bad == 0, "functional W=%d: %d rank(s) failed", ws[k], bad);
        for (int r = 1; r < ws[k]; r++)
            T_CHECK(g.got[r] && g.got[0] && g.done[r].hash == g.done[0].hash,
                    "W=%d: rank %d's results differ from rank 0's", ws[k], r);
        printf("functional W=%d: %s in %.2f s\n", ws[k], bad ? "FAILED" : "ok", t_now_s() - t0);
    }
    for (int W = 2; W <= 4; W++) {
        group g;
        double t0 = t_now_s();
        int bad = run_group(&g, W, SC_BIG, NULL);
        T_CHECK(bad == 0, "64 MiB W=%d: %d rank(s) failed", W, bad);
        for (int r = 1; r < W; r++)
            T_CHECK(g.done[r].hash == g.done[0].hash, "64 MiB W=%d: rank %d differs", W, r);
        printf("64 MiB all-reduce W=%d: %s, all-reduce %.2f s (group %.2f s)\n", W,
               bad ? "FAILED" : "ok", g.done[0].elapsed, t_now_s() - t0);
    }
    {
        group g;
        run_group(&g, 2, SC_MISMATCH, NULL);
        int n_bad = 0;
        for (int r = 0; r < 2; r++) {
            int rc = g.done[r].rc;
            n_bad += rc == -EBADMSG;
            T_CHECK(g.got[r] && (rc == -EBADMSG || rc == -ECONNRESET || rc == -EPIPE) &&
                        g.done[r].rc2 == rc, "mismatch rank %d: rc %d, then %d", r, rc,
                    g.done[r].rc2);
        }
        T_CHECK(n_bad >= 1, "mismatch: nobody saw -EBADMSG");
        printf("mismatched arguments: rank 0 %s, rank 1 %s\n", t_errname(g.done[0].rc),
               t_errname(g.done[1].rc));
    }

    {
        /* a store on ::1: the ranks listen on and publish the address of their store
         * connection (before, always 127.0.0.1: unreachable from another host) */
        int v6 = socket(AF_INET6, SOCK_STREAM, 0);
        struct sockaddr_in6 a6;
        memset(&a6, 0, sizeof a6);
        a6.sin6_family = AF_INET6;
        a6.sin6_addr = in6addr_loopback;
        int have = v6 >= 0 && bind(v6, (struct sockaddr *)&a6, sizeof a6) == 0;
        if (v6 >= 0) close(v6);
        if (have) {
            group g;
            int bad = run_group(&g, 3, SC_V6, NULL);
            T_CHECK(bad == 0, "store on ::1: %d rank(s) failed", bad);
            printf("store on ::1, ranks publish ::1: %s\n", bad ? "FAILED" : "ok");
        } else {
            printf("store on ::1: skipped (no IPv6 loopback)\n");
        }
    }
    {
        group g;
        int bad = run_group(&g, 2, SC_STRAY, NULL);
        T_CHECK(bad == 0, "stray connection: %d rank(s) failed", bad);
        printf("stray connection with a wrong secret: %s\n", bad ? "FAILED" : "refused, ok");
    }

    const fail_case cases[] = {
        {"SIGKILL before the collective", 2, VICTIM_PAUSE, 0, 0.0, SIGKILL, 1000},
        {"SIGKILL during all-reduce loop", 1, VICTIM_LOOP, 1, 0.0, SIGKILL, (size_t)4 << 20},
        {"self-kill, survivors enter later", 3, VICTIM_SUICIDE, 0, 0.3, 0, 1000},
        {"SIGKILL rank 0 (store host)", 0, VICTIM_LOOP, 1, 0.0, SIGKILL, (size_t)1 << 20},
        {"SIGSTOP during all-reduce loop", 3, VICTIM_LOOP, 1, 0.0, SIGSTOP, (size_t)1 << 20},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const fail_case *fc = &cases[k];
        int W = 4;
        group g;
        run_group(&g, W, SC_FAIL, fc);
        int n_to = 0;
        printf("%s (W=%d, timeout %.0f s, victim %d):\n", fc->name, W, FAIL_TIMEOUT_S,
               fc->victim);
        for (int r = 0; r < W; r++) {
            if (r == fc->victim) continue;
            const msg *m = &g.done[r];
            T_CHECK(g.got[r], "%s: rank %d did not report", fc->name, r);
            if (!g.got[r]) continue;
            /* for a parent's signal: time from the signal; else from the call */
            double lat = fc->sig ? m->t - g.t_signal : m->elapsed;
            printf("  rank %d: %s after %.3f s (%d collective(s)), then %s\n", r,
                   t_errname(m->rc), lat, m->iters, t_errname(m->rc2));
            T_CHECK(m->rc < 0 && m->rc2 == m->rc, "%s: rank %d rc %d rc2 %d", fc->name, r,
                    m->rc, m->rc2);
            T_CHECK(lat < FAIL_TIMEOUT_S + 1.0, "%s: rank %d took %.3f s", fc->name, r, lat);
            if (fc->sig == SIGSTOP) {
                n_to += m->rc == -ETIMEDOUT;
                T_CHECK(m->rc == -ETIMEDOUT || m->rc == -ECONNRESET || m->rc == -EPIPE,
                        "%s: rank %d: %d", fc->name, r, m->rc);
                T_CHECK(lat > FAIL_TIMEOUT_S - 1.0, "%s: rank %d gave up early (%.3f s)",
                        fc->name, r, lat);
            } else {
                T_CHECK(m->rc == -ECONNRESET || m->rc == -EPIPE, "%s: rank %d: %s", fc->name, r,
                        t_errname(m->rc));
                T_CHECK(lat < 1.0, "%s: rank %d took %.3f s for a dead peer", fc->name, r, lat);
            }
        }
        if (fc->sig == SIGSTOP) T_CHECK(n_to >= 1, "%s: nobody timed out", fc->name);
    }
    printf("total %.2f s\n", t_now_s() - t_all);
    return t_done("test_train_comm");
}
