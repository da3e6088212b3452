/* The agent's side of the memory tier (elastic/agent_mem.c) in one process: the job hash, the
 * prefix and its lease, stale clean-up (an unheld lease and a set without a lease removed; a
 * held lease and another job kept), has_own, removal at close; the replica between two
 * elastic_mem objects on loopback (same bytes, complete, the bandwidth cap holds, a wrong
 * token commits nothing and is logged once on each side, a peer that is gone is logged once
 * per round); silent and slow-byte connections without the token delay neither a replica
 * transfer nor a query, and are closed by the handshake's deadline; a peer that takes the
 * connection and never answers is logged as such; a replica stays when another agent takes
 * its sender's node rank in the next round (files named by agent id).
 */
#include "agent_internal.h"
#include "mem_client.h"
#include "shmseg.h"
#include "t_helpers.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <xxhash.h>

static void touch(const char *dir, const char *name, size_t bytes)
{
    char *p = t_path_in(dir, name);
    char *buf = calloc(1, bytes + 1);
    T_REQUIRE(buf && t_spit(p, buf, bytes) == 0, "write %s", p);
    free(buf);
    free(p);
}

static int present(const char *dir, const char *name)
{
    char *p = t_path_in(dir, name);
    int r = t_exists(p);
    free(p);
    return r;
}

static int count_prefix(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
    if (d) closedir(d);
    return n;
}

static void test_names_and_stale(const char *dir)
{
    char h[17], h2[17];
    elastic_mem_jobhash(1000, "job", h);
    unsigned char b[7] = {0xe8, 0x03, 0, 0, 'j', 'o', 'b'};
    char want[17];
    snprintf(want, sizeof want, "%016llx", (unsigned long long)XXH3_64bits(b, sizeof b));
    T_CHECK(!strcmp(h, want), "jobhash %s, want %s", h, want);
    elastic_mem_jobhash((unsigned)getuid(), "job", h);
    elastic_mem_jobhash((unsigned)getuid(), "other", h2);
    T_CHECK(strcmp(h, h2) != 0, "jobs differ");

    char n[128];
    /* a dead agent (lease nobody holds), a set without lease, a live agent, another job */
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000a1.lease", h);
    touch(dir, n, 10);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000a1.own-0", h);
    touch(dir, n, 1000);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000a1.rep-1-0", h);
    touch(dir, n, 500);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000b2.own-3", h);
    touch(dir, n, 7);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000c3.lease", h);
    touch(dir, n, 0);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000c3.own-0", h);
    touch(dir, n, 0);
    char *live = t_path_in(dir, n);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000c3.lease", h);
    char *lp = t_path_in(dir, n);
    int lfd = open(lp, O_RDWR);
    T_REQUIRE(lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) == 0, "hold the live lease");
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000d4.lease", h2);
    touch(dir, n, 0);
    snprintf(n, sizeof n, "ckptmem-%s-00000000000000d4.own-0", h2);
    touch(dir, n, 0);

    elastic_mem *m = NULL;
    T_REQUIRE(elastic_mem_open(&m, dir, "job", 4) == 0, "open");
    char pre[64];
    snprintf(pre, sizeof pre, "ckptmem-%s-00000000000000a1.", h);
    T_CHECK(count_prefix(dir, pre) == 0, "the dead agent's files are gone");
    snprintf(pre, sizeof pre, "ckptmem-%s-00000000000000b2.", h);
    T_CHECK(count_prefix(dir, pre) == 0, "the set without a lease is gone");
    T_CHECK(t_exists(live) && t_exists(lp), "the live agent's files stay");
    snprintf(pre, sizeof pre, "ckptmem-%s-00000000000000d4.", h2);
    T_CHECK(count_prefix(dir, pre) == 2, "another job's files stay");

    const char *path = elastic_mem_path(m);
    const char *base = strrchr(path, '/') + 1;
    T_CHECK(!strncmp(base, "ckptmem-", 8) && !strncmp(base + 8, h, 16) && base[24] == '-' &&
            strlen(base) == 41, "prefix %s", base);
    char lease[4200];
    snprintf(lease, sizeof lease, "%s.lease", path);
    struct stat st;
    T_REQUIRE(stat(lease, &st) == 0, "own lease");
    T_CHECK((st.st_mode & 0777) == 0600, "lease mode %o", (unsigned)(st.st_mode & 0777));
    int fd = open(lease, O_RDWR);
    T_CHECK(fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0, "the lease is held");
    if (fd >= 0) close(fd);
    T_CHECK(elastic_mem_has_own(m) == 0, "no own segment yet");
    char own[4200];
    snprintf(own, sizeof own, "%s.own-2", path);
    T_REQUIRE(t_spit(own, "x", 1) == 0, "own");
    T_CHECK(elastic_mem_has_own(m) == 1, "an own segment");

    /* a second agent of the job leaves the first alone */
    elastic_mem *m2 = NULL;
    T_REQUIRE(elastic_mem_open(&m2, dir, "job", 1) == 0, "open 2");
    T_CHECK(t_exists(own) && t_exists(lease), "a live agent's files stay");
    elastic_mem_close(m2);

    snprintf(pre, sizeof pre, "%s.", base);
    elastic_mem_close(m);
    T_CHECK(count_prefix(dir, pre) == 0, "every own file removed");
    T_CHECK(t_exists(live), "the live agent's files still stay");
    close(lfd);
    free(live);
    free(lp);
    (void)present;
}

/* "<prefix of to>.rep-<id of from>-<L>": the file where `to` keeps from's slot L. */
static void rep_of(char *out, size_t len, const elastic_mem *to, const elastic_mem *from, unsigned L)
{
    const char *fp = elastic_mem_path(from);
    uint64_t id = strtoull(fp + strlen(fp) - 16, NULL, 16);
    T_REQUIRE(shmseg_rep_path(out, len, elastic_mem_path(to), id, L) == 0, "rep path");
}

/* Wait (at most 10 s) until path has a complete slot with seq >= 1; its info into *in. */
static int wait_rep(const char *path, shmseg_info *in, double limit_s)
{
    double t0 = t_now_s();
    while (t_now_s() - t0 < limit_s) {
        shmseg *s = NULL;
        int slot;
        if (shmseg_open(path, 0, &s) == 0) {
            int ok = shmseg_newest(s, &slot) == 0 && shmseg_slot_info(s, slot, in) == 0;
            shmseg_close(s);
            if (ok) return 0;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return -ETIMEDOUT;
}

static void test_replica(const char *dir_a, const char *dir_b)
{
    elastic_mem *a = NULL, *b = NULL, *c = NULL;
    T_REQUIRE(elastic_mem_open(&a, dir_a, "rep", 1) == 0, "open a");
    T_REQUIRE(elastic_mem_open(&b, dir_b, "rep", 1) == 0, "open b");
    char aa[96], ba[96];
    T_REQUIRE(elastic_mem_replica_start(a, "127.0.0.1", "tok", 4, NULL, aa, sizeof aa) == 0, "a");
    T_REQUIRE(elastic_mem_replica_start(b, "127.0.0.1", "tok", 4, NULL, ba, sizeof ba) == 0, "b");

    /* a's worker: 2 MB + 5 bytes in its own segment */
    const uint64_t n = 2000005, sb = 2002944; /* 489 pages */
    char own[4200], rep[4200];
    snprintf(own, sizeof own, "%s.own-0", elastic_mem_path(a));
    shmseg *s = NULL;
    int slot;
    T_REQUIRE(shmseg_create(own, 2, sb, &s) == 0 && shmseg_begin(s, -1, &slot) == 0, "own seg");
    unsigned char *p = shmseg_payload(s, slot);
    for (uint64_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 131 + 7);
    T_REQUIRE(shmseg_commit(s, slot, n, 77) == 0, "commit");
    unsigned long long want = XXH3_64bits(p, n);

    double t0 = t_now_s();
    elastic_mem_round(a, 3, 0, 2, ba);  /* node 0 of 2 sends to node 1 = b */
    elastic_mem_round(b, 3, 1, 2, aa);
    rep_of(rep, sizeof rep, b, a, 0);
    shmseg_info in;
    T_REQUIRE(wait_rep(rep, &in, 10) == 0, "replica arrived");
    double took = t_now_s() - t0;
    /* 4 MB/s, one 256 KiB piece free: at least (2000005 - 262144) / 4e6 = 0.43 s */
    T_CHECK(took >= 0.40, "bandwidth cap: %.3f s for 2 MB at 4 MB/s", took);
    T_CHECK(in.step == 77 && in.payload_bytes == n, "step %llu bytes %llu",
            (unsigned long long)in.step, (unsigned long long)in.payload_bytes);
    shmseg *r = NULL;
    T_REQUIRE(shmseg_open(rep, 0, &r) == 0 && shmseg_newest(r, &slot) == 0, "open rep");
    T_CHECK(XXH3_64bits(shmseg_payload(r, slot), n) == want, "same bytes");
    T_CHECK(shmseg_slot_bytes(r) == sb, "same slot size");
    shmseg_close(r);

    /* the log of what follows goes to a file, to count lines */
    char *logp = t_path_in(dir_a, "log");
    int saved = dup(2), lfd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    T_REQUIRE(saved >= 0 && lfd >= 0 && dup2(lfd, 2) == 2, "log to a file");

    /* a third agent with another token: refused, nothing committed */
    T_REQUIRE(elastic_mem_open(&c, dir_b, "rep2", 1) == 0, "open c");
    char ca[96];
    T_REQUIRE(elastic_mem_replica_start(c, "127.0.0.1", "other", 1000, NULL, ca, sizeof ca) == 0,
              "c");
    elastic_mem_round(a, 4, 0, 2, ca);
    rep_of(rep, sizeof rep, c, a, 0);
    T_CHECK(wait_rep(rep, &in, 1.0) == -ETIMEDOUT, "a wrong token commits nothing");
    T_CHECK(!t_exists(rep), "no replica file for a wrong token");

    /* a peer that is gone: retried once a second, logged once for the round */
    elastic_mem_round(a, 5, 0, 2, "127.0.0.1:1");
    struct timespec ts = {2, 500 * 1000 * 1000};
    nanosleep(&ts, NULL);
    dup2(saved, 2);
    close(saved);
    close(lfd);
    unsigned char *log = NULL;
    T_REQUIRE(t_slurp(logp, &log) >= 0, "read the log");
    int unreach = 0, refused_tok = 0, refused_srv = 0;
    for (const char *q = (const char *)log; (q = strstr(q, "is unreachable")); q++) unreach++;
    for (const char *q = (const char *)log; (q = strstr(q, "refused our job token")); q++)
        refused_tok++;
    for (const char *q = (const char *)log; (q = strstr(q, "wrong job token")); q++) refused_srv++;
    T_CHECK(unreach == 1, "a gone peer logged %d times in 2.5 s:\n%s", unreach, log);
    T_CHECK(refused_tok == 1 && refused_srv == 1, "refusal logged %d / %d times:\n%s",
            refused_tok, refused_srv, log);
    free(log);
    free(logp);

    shmseg_close(s);
    elastic_mem_close(c);
    elastic_mem_close(a);
    elastic_mem_close(b);
    T_CHECK(count_prefix(dir_a, "ckptmem-") == 0 && count_prefix(dir_b, "ckptmem-") == 0,
            "all removed");
}

/* A TCP connection to 127.0.0.1:port, or -1. */
static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in pa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    pa.sin_port = htons((uint16_t)port);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&pa, sizeof pa) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

typedef struct slow_arg {
    int port;
    double held_s; /* how long the server kept the connection (-1: not closed within 14 s) */
} slow_arg;

/* A client that sends the replica magic one byte a second, watching for the server's close. */
static void *slow_main(void *arg)
{
    slow_arg *a = arg;
    a->held_s = -1;
    int fd = dial(a->port);
    if (fd < 0) return NULL;
    double t0 = t_now_s();
    const char *magic = "CKMR\1\0\0\0\3\0\0\0tok";
    for (int i = 0; t_now_s() - t0 < 14; i++) {
        if (send(fd, magic + i % 15, 1, MSG_NOSIGNAL) != 1) {
            a->held_s = t_now_s() - t0;
            break;
        }
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 1000) > 0) {
            char c;
            if (recv(fd, &c, 1, MSG_DONTWAIT) <= 0) {
                a->held_s = t_now_s() - t0;
                break;
            }
        }
    }
    close(fd);
    return NULL;
}

static void test_hostile(const char *dir_a, const char *dir_b)
{
    elastic_mem *a = NULL, *b = NULL;
    T_REQUIRE(elastic_mem_open(&a, dir_a, "hostile", 1) == 0, "open a");
    T_REQUIRE(elastic_mem_open(&b, dir_b, "hostile", 1) == 0, "open b");
    char aa[96], ba[96];
    T_REQUIRE(elastic_mem_replica_start(a, "127.0.0.1", "tok", 1000, NULL, aa, sizeof aa) == 0, "a");
    T_REQUIRE(elastic_mem_replica_start(b, "127.0.0.1", "tok", 1000, NULL, ba, sizeof ba) == 0, "b");
    int port = atoi(strrchr(ba, ':') + 1);

    /* 40 silent connections and a slow-byte one to b, none with a complete handshake */
    int silent[40];
    for (int i = 0; i < 40; i++) T_REQUIRE((silent[i] = dial(port)) >= 0, "silent %d", i);
    slow_arg sa = {port, 0};
    pthread_t th;
    T_REQUIRE(pthread_create(&th, NULL, slow_main, &sa) == 0, "slow client");
    struct timespec ts = {0, 200 * 1000 * 1000};
    nanosleep(&ts, NULL); /* all accepted by now */

    /* a real transfer a -> b must not wait behind them */
    const uint64_t n = 300000, sb = 303104;
    char own[4200], rep[4200];
    snprintf(own, sizeof own, "%s.own-0", elastic_mem_path(a));
    shmseg *s = NULL;
    int slot;
    T_REQUIRE(shmseg_create(own, 2, sb, &s) == 0 && shmseg_begin(s, -1, &slot) == 0, "own seg");
    unsigned char *p = shmseg_payload(s, slot);
    for (uint64_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 7 + 1);
    T_REQUIRE(shmseg_commit(s, slot, n, 42) == 0, "commit");
    double t0 = t_now_s();
    elastic_mem_round(a, 1, 0, 2, ba);
    elastic_mem_round(b, 1, 1, 2, aa);
    rep_of(rep, sizeof rep, b, a, 0);
    shmseg_info in;
    T_CHECK(wait_rep(rep, &in, 3.0) == 0, "the replica arrived within 3 s beside 41 hostile "
            "connections (%.1f s)", t_now_s() - t0);

    /* and a LIST + GET to b, also within a few seconds */
    t0 = t_now_s();
    elastic_mem_client *c = NULL;
    elastic_mem_slot *v = NULL;
    size_t nv = 0;
    T_REQUIRE(elastic_mem_client_open(&c, ba, "tok", 3.0) == 0, "client");
    int rc = elastic_mem_client_list(c, &v, &nv);
    T_CHECK(rc == 0 && nv >= 1, "LIST beside hostile connections: %s, %zu slots", strerror(-rc), nv);
    unsigned char got[100];
    if (rc == 0 && nv >= 1) {
        rc = elastic_mem_client_get(c, &v[0], 0, got, sizeof got);
        T_CHECK(rc == 0 && got[5] == (unsigned char)(5 * 7 + 1), "GET: %s", strerror(-rc));
    }
    T_CHECK(t_now_s() - t0 < 3.0, "LIST and GET took %.1f s", t_now_s() - t0);
    free(v);
    elastic_mem_client_close(c);

    pthread_join(th, NULL);
    T_CHECK(sa.held_s > 3.5 && sa.held_s < 7.5, "a byte a second held the server %.1f s "
            "(a 5 s handshake deadline; -1: never closed)", sa.held_s);
    for (int i = 0; i < 40; i++) close(silent[i]);

    /* a peer that takes the connection and never answers: said so, not "unreachable" */
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in la = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t ll = sizeof la;
    T_REQUIRE(lfd >= 0 && bind(lfd, (struct sockaddr *)&la, sizeof la) == 0 && listen(lfd, 4) == 0 &&
              getsockname(lfd, (struct sockaddr *)&la, &ll) == 0, "mute peer");
    char mute[64];
    snprintf(mute, sizeof mute, "127.0.0.1:%d", ntohs(la.sin_port));
    char *logp = t_path_in(dir_a, "log");
    int saved = dup(2), lg = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    T_REQUIRE(saved >= 0 && lg >= 0 && dup2(lg, 2) == 2, "log to a file");
    elastic_mem_round(a, 2, 0, 2, mute);
    struct timespec ts2 = {11, 500 * 1000 * 1000};
    nanosleep(&ts2, NULL);
    dup2(saved, 2);
    close(saved);
    close(lg);
    unsigned char *log = NULL;
    T_REQUIRE(t_slurp(logp, &log) >= 0, "read the log");
    T_CHECK(strstr((char *)log, "took the connection but did not answer within 10 s") &&
            !strstr((char *)log, "unreachable"), "the mute peer's line:\n%s", log);
    free(log);
    free(logp);
    close(lfd);

    shmseg_close(s);
    elastic_mem_close(a);
    elastic_mem_close(b);
}

/* Node ranks change between rounds: X is node 0 and sends to B; X dies, Y becomes node 0 in
 * the next round and sends to B too. B keeps both: X's replica (a dead node's slot a restore
 * may need) is not overwritten by Y's. */
static void test_renumbered(const char *dir_a, const char *dir_b)
{
    elastic_mem *x = NULL, *y = NULL, *b = NULL;
    T_REQUIRE(elastic_mem_open(&x, dir_a, "renum", 1) == 0, "open x");
    T_REQUIRE(elastic_mem_open(&y, dir_a, "renum", 1) == 0, "open y");
    T_REQUIRE(elastic_mem_open(&b, dir_b, "renum", 1) == 0, "open b");
    char xa[96], ya[96], ba[96];
    T_REQUIRE(elastic_mem_replica_start(x, "127.0.0.1", "tok", 1000, NULL, xa, sizeof xa) == 0, "x");
    T_REQUIRE(elastic_mem_replica_start(y, "127.0.0.1", "tok", 1000, NULL, ya, sizeof ya) == 0, "y");
    T_REQUIRE(elastic_mem_replica_start(b, "127.0.0.1", "tok", 1000, NULL, ba, sizeof ba) == 0, "b");
    const uint64_t sb = 8192;
    char own[4200], rx[4200], ry[4200];
    shmseg *sx = NULL, *sy = NULL;
    int slot;
    snprintf(own, sizeof own, "%s.own-0", elastic_mem_path(x));
    T_REQUIRE(shmseg_create(own, 2, sb, &sx) == 0 && shmseg_begin(sx, -1, &slot) == 0, "x seg");
    memset(shmseg_payload(sx, slot), 0xa1, 5000);
    T_REQUIRE(shmseg_commit(sx, slot, 5000, 100) == 0, "x commit");
    snprintf(own, sizeof own, "%s.own-0", elastic_mem_path(y));
    T_REQUIRE(shmseg_create(own, 2, sb, &sy) == 0 && shmseg_begin(sy, -1, &slot) == 0, "y seg");
    memset(shmseg_payload(sy, slot), 0xb2, 6000);
    T_REQUIRE(shmseg_commit(sy, slot, 6000, 200) == 0, "y commit");

    /* round 1: x node 0 -> b node 1 (y is node 2 of 3, sending nowhere here) */
    elastic_mem_round(x, 1, 0, 3, ba);
    elastic_mem_round(b, 1, 1, 3, "");
    rep_of(rx, sizeof rx, b, x, 0);
    shmseg_info in;
    T_REQUIRE(wait_rep(rx, &in, 10) == 0 && in.step == 100, "x's replica on b");
    /* x dies (its sender stops); round 2: y takes node rank 0 and sends to b */
    elastic_mem_round(x, 2, 0, 3, "");
    elastic_mem_round(y, 2, 0, 2, ba);
    elastic_mem_round(b, 2, 1, 2, "");
    rep_of(ry, sizeof ry, b, y, 0);
    T_REQUIRE(wait_rep(ry, &in, 10) == 0 && in.step == 200, "y's replica on b");
    T_CHECK(strcmp(rx, ry) != 0, "two files: %s, %s", rx, ry);
    shmseg *r = NULL;
    T_REQUIRE(shmseg_open(rx, 0, &r) == 0 && shmseg_newest(r, &slot) == 0 &&
              shmseg_slot_info(r, slot, &in) == 0, "x's replica still there");
    const unsigned char *p = shmseg_payload(r, slot);
    T_CHECK(in.step == 100 && in.payload_bytes == 5000 && p[0] == 0xa1 && p[4999] == 0xa1,
            "x's replica kept: step %llu bytes %llu", (unsigned long long)in.step,
            (unsigned long long)in.payload_bytes);
    shmseg_close(r);
    /* and both listed to a restore, each by its agent */
    elastic_mem_client *c = NULL;
    elastic_mem_slot *v = NULL;
    size_t n = 0;
    T_REQUIRE(elastic_mem_client_open(&c, ba, "tok", 5.0) == 0 && elastic_mem_client_list(c, &v, &n) == 0,
              "list b");
    int seen100 = 0, seen200 = 0;
    for (size_t i = 0; i < n; i++) {
        seen100 += v[i].kind == ELASTIC_MEM_REP && v[i].step == 100;
        seen200 += v[i].kind == ELASTIC_MEM_REP && v[i].step == 200;
    }
    T_CHECK(seen100 == 1 && seen200 == 1, "b lists both replicas (%d, %d)", seen100, seen200);
    free(v);
    elastic_mem_client_close(c);
    shmseg_close(sx);
    shmseg_close(sy);
    elastic_mem_close(x);
    elastic_mem_close(y);
    elastic_mem_close(b);
}

int main(void)
{
    char *d = t_tmpdir("elastic-mem"), *a = t_tmpdir("elastic-mem-a"), *b = t_tmpdir("elastic-mem-b");
    test_names_and_stale(d);
    test_replica(a, b);
    test_hostile(a, b);
    test_renumbered(a, b);
    t_rmrf(d);
    t_rmrf(a);
    t_rmrf(b);
    free(d);
    free(a);
    free(b);
    return t_done("test_elastic_mem");
}
