/* t_ranks.h - a harness for the C tests that run W ranks as forked processes over a store
 * (test_train_comm.c, test_train_dcomm.c, tests/gpu/nccl_check.c). Includes t_helpers.h.
 *
 * Parent side: t_ranks_start forks W children, each running fn(rank, W, port_rd, port_wr,
 * out_fd, arg) (fn must not return; a return exits the child with 3). Rank 0 hosts the store
 * and passes its port to the others through the port pipe (t_ranks_store). Children report
 * over one shared pipe with t_ranks_send, one fixed-size record per write (at most PIPE_BUF
 * bytes, so records of different ranks never interleave); the parent reads them with
 * t_ranks_read, then t_ranks_reap waits for the children and always kills and reaps every
 * one left. Not thread-safe (one group at a time per process); every wait has a deadline.
 *
 * Inputs and references: t_gen(seed, r, i) is element i of rank r (random sign, mantissa and
 * exponent in [2^-10, 2^10], so the order of additions changes the rounding); t_tree_sum is
 * the pairwise tree over rank index; t_ref_elem is that tree over t_gen of ranks 0..W-1, the
 * bits a tree-mode collective must give; t_fnv hashes results (start from T_FNV_OFFSET) to
 * compare them across ranks.
 *
 * C_CHECK(ch, cond, ...) is T_CHECK for a child: ch points to any struct with int members
 * rank and fails; a failure prints the rank, file:line and the message, counts into
 * ch->fails and goes on (the child then reports fails, or exits non-zero).
 */
#ifndef T_RANKS_H
#define T_RANKS_H

#include "rng.h"
#include "store.h"
#include "t_helpers.h"

#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>

/* the most ranks t_ranks_start runs, and the most t_ref_elem sums */
#define T_RANKS_MAXW 8

/* FNV-1a 64-bit offset basis: the first h of t_fnv */
#define T_FNV_OFFSET 1469598103934665603ull

#define C_CHECK(ch, cond, ...)                                                                 \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            (ch)->fails++;                                                                     \
            fprintf(stderr, "FAIL rank %d %s:%d: %s: ", (ch)->rank, __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
        }                                                                                      \
    } while (0)

/* ------------------------------------------------------------------ inputs */

/* Input element i of rank r for seed: a deterministic float, |x| in [2^-10, 2^10) (the mixer
 * is train/rng.h's SplitMix64 finalizer). */
static inline float t_gen(uint64_t seed, int r, size_t i)
{
    uint64_t h = train_rng_mix(seed * 0x100000001b3ull ^
                               train_rng_mix(((uint64_t)r << 40) ^ (uint64_t)i));
    float u = (float)(h >> 40) / 16777216.0f;
    int e = (int)((h >> 8) % 21) - 10;
    return ldexpf(h & 1 ? -u : u, e);
}

/* The pairwise tree sum of v[0..n-1] (n >= 1): the first half is the largest power of two
 * below n, summed the same way, plus the rest. */
static inline float t_tree_sum(const float *v, int n)
{
    if (n == 1) return v[0];
    int h = 1;
    while (h * 2 < n) h *= 2;
    return t_tree_sum(v, h) + t_tree_sum(v + h, n - h);
}

/* The reference of element i after a sum over ranks 0..W-1 (1 <= W <= T_RANKS_MAXW) of
 * t_gen(seed, r, i): t_tree_sum over rank index. abs_sum (NULL: not wanted) gets the sum of
 * |x_r| in double, the scale of a tolerance for sums in another order. */
static inline float t_ref_elem(uint64_t seed, int W, size_t i, double *abs_sum)
{
    float v[T_RANKS_MAXW];
    double a = 0;
    for (int r = 0; r < W; r++) {
        v[r] = t_gen(seed, r, i);
        a += fabs(v[r]);
    }
    if (abs_sum) *abs_sum = a;
    return t_tree_sum(v, W);
}

/* FNV-1a over n bytes at p, continuing from h (T_FNV_OFFSET to start). */
static inline uint64_t t_fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* "ok" for 0, else strerror(-rc) (static text, for reports). */
static inline const char *t_errname(int rc)
{
    return rc == 0 ? "ok" : strerror(-rc);
}

/* ------------------------------------------------------------------ child side */

/* A child's body: rank in [0, W); port_rd/port_wr the port pipe (pass both to
 * t_ranks_store, which closes them); out_fd the write end of the report pipe; arg as given
 * to t_ranks_start (the parent's memory, copied by fork). Ends with _exit. */
typedef void (*t_ranks_child_fn)(int rank, int W, int port_rd, int port_wr, int out_fd,
                                 void *arg);

/* In a child: the port of the group's store. W > 1: rank 0 starts a store server with token
 * (host: the address to bind, NULL for ELASTIC_STORE_SERVER_OPTS_INIT's) and writes its port
 * once for each other rank to port_wr; the others read it from port_rd (blocking until rank 0
 * has written it). W = 1: no store, port 0. Closes port_rd and port_wr. *srv gets rank 0's
 * server, which the child stops (elastic_store_server_stop) after its last use of the store,
 * else NULL. A server that does not start or a pipe that fails exits the child with 3. */
static inline int t_ranks_store(int rank, int W, const char *token, const char *host,
                                int port_rd, int port_wr, elastic_store_server **srv)
{
    *srv = NULL;
    int port = 0;
    if (W > 1) {
        if (rank == 0) {
            elastic_store_server_opts so = ELASTIC_STORE_SERVER_OPTS_INIT;
            so.token = token;
            if (host) so.host = host;
            if (elastic_store_server_start(srv, &so) < 0) _exit(3);
            port = elastic_store_server_port(*srv);
            for (int i = 1; i < W; i++)
                if (write(port_wr, &port, sizeof port) != (ssize_t)sizeof port) _exit(3);
        } else if (read(port_rd, &port, sizeof port) != (ssize_t)sizeof port) {
            _exit(3);
        }
    }
    close(port_rd);
    close(port_wr);
    return port;
}

/* In a child: one record of size bytes (1..PIPE_BUF) to the parent in one write; a short
 * write or a bad size exits the child with 3. */
static inline void t_ranks_send(int out_fd, const void *rec, size_t size)
{
    if (size == 0 || size > PIPE_BUF || write(out_fd, rec, size) != (ssize_t)size) _exit(3);
}

/* ------------------------------------------------------------------ parent side */

typedef struct t_ranks {
    int W;
    pid_t pid[T_RANKS_MAXW];
    int alive[T_RANKS_MAXW]; /* not yet reaped */
    int rd;                  /* the read end of the report pipe; -1 once closed */
} t_ranks;

/* Fork W children (1 <= W <= T_RANKS_MAXW; else the test exits 1) running fn(..., arg); g is
 * overwritten. Counts 1 + W checks (T_REQUIRE: the pipes, then each fork). Flushes stdout
 * and stderr first so that nothing buffered is printed twice. */
static inline void t_ranks_start(t_ranks *g, int W, t_ranks_child_fn fn, void *arg)
{
    memset(g, 0, sizeof *g);
    g->W = W;
    g->rd = -1;
    if (W < 1 || W > T_RANKS_MAXW) {
        fprintf(stderr, "t_ranks_start: W = %d outside [1, %d]\n", W, T_RANKS_MAXW);
        exit(1);
    }
    int pp[2], rp[2];
    T_REQUIRE(pipe(pp) == 0 && pipe(rp) == 0, "pipe");
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < W; r++) {
        pid_t p = fork();
        T_REQUIRE(p >= 0, "fork");
        if (p == 0) {
            close(rp[0]);
            fn(r, W, pp[0], pp[1], rp[1], arg);
            _exit(3);
        }
        g->pid[r] = p;
        g->alive[r] = 1;
    }
    close(pp[0]);
    close(pp[1]);
    close(rp[1]);
    g->rd = rp[0];
}

/* One record of size bytes into rec, waiting until deadline (t_now_s() clock): 0,
 * -ETIMEDOUT (nothing came in time), or -EIO (a short read, or every child has closed its
 * end). */
static inline int t_ranks_read(t_ranks *g, void *rec, size_t size, double deadline)
{
    struct pollfd pf = {g->rd, POLLIN, 0};
    int ms = (int)((deadline - t_now_s()) * 1000);
    if (ms <= 0 || poll(&pf, 1, ms) <= 0) return -ETIMEDOUT;
    ssize_t r = read(g->rd, rec, size);
    return r == (ssize_t)size ? 0 : -EIO;
}

/* After the reports: closes the report pipe; waits for each child but victim (-1: none), in
 * rank order, up to wait_s seconds each; then kills (SIGKILL) and reaps every child not yet
 * reaped (the victim, killed or stopped, and any that hung). Returns how many children, the
 * victim not counted, did not exit with status 0 within their wait. */
static inline int t_ranks_reap(t_ranks *g, int victim, double wait_s)
{
    if (g->rd >= 0) close(g->rd);
    g->rd = -1;
    int bad = 0;
    for (int r = 0; r < g->W; r++) {
        if (r == victim || !g->alive[r]) continue;
        int st = 0;
        double wd = t_now_s() + wait_s;
        pid_t w = 0;
        while ((w = waitpid(g->pid[r], &st, WNOHANG)) == 0 && t_now_s() < wd) t_sleep_s(0.01);
        if (w == g->pid[r]) {
            g->alive[r] = 0;
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad++;
        } else {
            bad++;
        }
    }
    for (int r = 0; r < g->W; r++)
        if (g->alive[r]) {
            kill(g->pid[r], SIGKILL);
            waitpid(g->pid[r], NULL, 0);
            g->alive[r] = 0;
        }
    return bad;
}

#endif /* T_RANKS_H */
