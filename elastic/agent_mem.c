/* agent_mem.c - the agent's side of the memory tier (issue 13; agent.h "Memory tier"): the
 * segment folder and the prefix, the lease, stale clean-up, the peer replica (a server thread
 * and a sender thread), and the removal of every file of the prefix at the end.
 *
 * Why a lease file with flock rather than a pid in a file: a pid can be reused, a lock dies
 * with its process (SIGKILL, OOM, a crash of the machine's agent), so "nobody holds the
 * lease" is exactly "its agent is dead", without guessing.
 *
 * Why the sender copies each piece with shmseg_copy_out instead of sending from the mapping:
 * the worker may overwrite the slot while it is being sent (the slot after next); copy_out
 * checks the slot's seq around each piece against the seq of the first, so a payload that
 * changed is never committed on the peer (the connection is closed before the last byte; the
 * receiver's slot stays "writing", its other slot keeps the previous replica).
 *
 * Replica protocol (version 2, little-endian, one transfer per TCP connection):
 *   sender -> receiver   magic "CKMR" | version u32 = 2 | token_len u32 (<= 1024) |
 *                        token[token_len] | src_node u32 | slot u32 (local rank L) |
 *                        slot_bytes u64 | payload_bytes u64 | step u64 | seq u64 |
 *                        src_agent u64 (the sender's id: its prefix's random part)
 *   receiver -> sender   1 byte: 0 go on, or an answer code below (then it closes)
 *   sender -> receiver   payload_bytes bytes (closing early = abandoned: nothing committed)
 *   receiver -> sender   1 byte: 0 committed into <its prefix>.rep-<src_agent 16 hex>-<slot>,
 *                        or a code
 * Version 1 (no src_agent) named the file by src_node; node ranks change between rounds, so a
 * survivor re-sending under its new node rank overwrote the replica of the dead node that had
 * held that rank - while a restore read it. It is refused (BAD). src_node is for the logs.
 * Answer codes: 0 OK, 1 DENIED (token), 2 BAD (magic, version, fields out of range),
 * 3 LOCAL (the receiver cannot keep it: no space, I/O error). The token is compared in
 * constant time and never logged. Each accepted connection gets a thread of its own (at most
 * CONN_MAX at once; past that a connection is closed at once, the refusal logged as the
 * others), which must read the whole handshake (magic, version, token, fixed header) within
 * HANDSHAKE_S of the accept, progress or not: whoever can reach the port without the token
 * (anyone on the machine) cannot hold the server with silent connections or a byte now and
 * then, nor delay a transfer or a query that authenticates. After the handshake every socket
 * wait is bounded by IO_TIMEOUT_S without progress. Authenticated transfers go to a thread of
 * their own (put_main), one at a time (one writer per replica file); queries (below) are
 * answered by their connection's thread, one at a time (qmu), so a restore's reads never wait
 * behind a replica transfer.
 *
 * Queries (magic "CKMQ", mem_wire.h; the client is mem_client.h): on the same socket, with the
 * same token check, a worker of another node LISTs the complete slots of this node's segments
 * (own and replicas, with each payload's first 4096 bytes) and GETs byte ranges of one, copied
 * out with shmseg_copy_out pinned to the listed seq (a slot that changed answers STALE), so a
 * restore can read a rank's shard that is only here. Payloads are bytes to this file: what they
 * hold is ckpt/'s business. A GET is copied into a buffer first and only then sent, so the
 * answer's status is known before its body: a torn copy is STALE, never mixed bytes.
 */
#include "clock.h"
#include "agent_internal.h"

#include "log.h"
#include "mem_wire.h"
#include "shmseg.h"
#include "thread.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define MEM_TAG "elastic"
#define NAME_PREFIX "ckptmem-"
#define HASH_HEX 16
#define RAND_HEX 16
/* "ckptmem-" + 16 + "-" + 16 */
#define PREFIX_LEN (8 + HASH_HEX + 1 + RAND_HEX)
/* The longest CKPT_MEM_PATH the workers' readers take: ckpt_mem_prefix_ok (ckpt/ckpt_mem.h)
 * wants fewer than CKPT_PATH_MAX - 64 = 4032 bytes. elastic/ does not include ckpt/: the
 * bound is repeated here (test_ckpt_mem test_prefix_rule pins the reader's edge, test_mem_agent
 * this one's). */
#define WORKER_PREFIX_MAX 4031
#define IO_TIMEOUT_S 10.0      /* every socket wait without progress, after the handshake */
#define HANDSHAKE_S 5.0        /* from accept to the end of the fixed header (magic, version,
                                  token, fields), progress or not: a client sending a byte now
                                  and then cannot hold a connection */
#define CONN_MAX 64            /* connections served at once (a thread each); more are refused
                                  at once */
#define CONNECT_TIMEOUT_S 3.0
#define POLL_S 0.1             /* the sender's look at the own segments */
#define CHUNK (256u * 1024u)   /* the sender's piece: copy_out, then send; the bucket's depth */
#define TOKEN_MAX 1024u
#define MAX_SLOT_BYTES (1ull << 40)
#define SEEN_MAX 64
#define TORN_WARN 8            /* torn transfers in a row of one slot before a warning */

enum { ANS_OK = 0, ANS_DENIED = 1, ANS_BAD = 2, ANS_LOCAL = 3 };

#define QCACHE 16              /* segments kept mapped for the queries (a restore reads a slot in
                                  many GETs: a mapping per GET would fault in every page again) */

#define PUTQ 8                 /* replica transfers waiting for the put thread */

/* A replica transfer whose handshake (magic, version, token, fixed header f) a connection
 * thread read and accepted, for the put thread. */
typedef struct put_job {
    int fd;
    unsigned char f[48];
    char from[NI_MAXHOST + NI_MAXSERV + 4];
} put_job;

/* One accepted connection, for its thread. */
typedef struct conn_job {
    struct elastic_mem *m;
    int fd;
    double deadline;           /* of the handshake (clock_now_s) */
    char from[NI_MAXHOST + NI_MAXSERV + 4];
} conn_job;

/* A segment mapped for the queries; identified by path and inode (a rebuilt file is another). */
typedef struct qseg {
    char path[PATH_MAX + PREFIX_LEN + 40];
    dev_t dev;
    ino_t ino;
    shmseg *seg;
} qseg;

struct elastic_mem {
    char dir[PATH_MAX];
    char prefix[PREFIX_LEN + 1];
    char path[PATH_MAX + PREFIX_LEN + 2]; /* dir/prefix */
    char hash[HASH_HEX + 1];
    int lease_fd;
    int nproc;
    uint64_t agent;            /* this agent's id: the prefix's rand16 (replica file names) */

    /* replica */
    int replica;               /* the threads run */
    int listen_fd;
    char *token;               /* NULL = none */
    size_t token_len;
    double rate;               /* bytes per second */
    elastic_metrics *metrics;
    pthread_t srv_th, snd_th, put_th;
    int srv_started, snd_started, put_started;

    pthread_mutex_t mu;        /* guards everything below */
    int quit;
    int gen, node_rank, nnodes;
    char peer[96];             /* "" = none */
    unsigned serial;           /* bumped by every elastic_mem_round */
    int send_fd;               /* the sender's connection, -1 none (shut down by close) */

    /* sender-thread data */
    uint64_t *sent_seq;        /* per local slot: the seq the peer sent_to has */
    uint64_t *sent_to;         /* ... XXH3 of "<peer>" (a new peer: send again; a new node
                                  rank of ours is not, the file is named by m->agent) */
    double retry_at;           /* after a failed connection or a refusal: not before */
    unsigned retry_serial;     /* the round retry_at belongs to (a new round tries at once) */
    unsigned *torn;            /* torn transfers in a row */
    unsigned warned_serial;    /* the round whose unreachable peer was logged (+1) */
    unsigned logged_serial;    /* the round whose first transfer was logged (+1) */

    /* server-thread data */
    double refused_logged;     /* when a refusal was last logged */
    qseg qcache[QCACHE];       /* segments the queries opened (mem_wire.h), by path and inode */
    unsigned qnext;            /* the cache entry to replace next */
    unsigned nconn;            /* connection threads running (with mu) */
    pthread_cond_t conn_cv;    /* signals nconn reaching 0 (with mu) */
    pthread_mutex_t qmu;       /* the queries' state below (qcache, qnext, qbuf): queries of
                                  several connections are answered one at a time */
    pthread_cond_t put_cv;     /* signals putq (with mu) */
    put_job putq[PUTQ];        /* replica transfers accepted, for the put thread (with mu) */
    unsigned put_head, put_n;
    unsigned char *qbuf;       /* a GET's copy (MEMQ_GET_MAX bytes, allocated at the first GET,
                                  kept: a fresh 8 MiB per GET cost a page fault per page) */
    uint64_t *seen;            /* SEEN_MAX XXH3s of (src agent, slot) logged at INFO once */
};

/* ------------------------------------------------------------------ names */

void elastic_mem_jobhash(unsigned uid, const char *run_id, char out[17])
{
    size_t n = strlen(run_id);
    unsigned char buf[4 + 64];
    if (n > 64) n = 64; /* run ids are at most 64 bytes (agent.h) */
    for (int i = 0; i < 4; i++) buf[i] = (unsigned char)(uid >> (8 * i));
    memcpy(buf + 4, run_id, n);
    snprintf(out, 17, "%016" PRIx64, (uint64_t)XXH3_64bits(buf, 4 + n));
}

static int is_hex(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

/* name = "ckptmem-<hash>-<rand16>.<rest>": 1 and rand into r (17 bytes), else 0. */
static int name_of_job(const char *name, const char *hash, char r[RAND_HEX + 1])
{
    if (strncmp(name, NAME_PREFIX, 8) != 0 || strncmp(name + 8, hash, HASH_HEX) != 0) return 0;
    const char *p = name + 8 + HASH_HEX;
    if (p[0] != '-' || strlen(p) < 1 + RAND_HEX + 1 || p[1 + RAND_HEX] != '.') return 0;
    if (!is_hex(p + 1, RAND_HEX)) return 0;
    memcpy(r, p + 1, RAND_HEX);
    r[RAND_HEX] = '\0';
    return 1;
}

const char *elastic_mem_path(const elastic_mem *m) { return m->path; }

/* ------------------------------------------------------------------ stale clean-up */

typedef struct stale_sum {
    unsigned long files, agents;
    unsigned long long bytes;
} stale_sum;

/* Unlink every "ckptmem-<hash>-<r>.*" of this uid in dir but the lease; add to sum. */
static void remove_set(int dfd, const char *hash, const char *r, stale_sum *sum, int count)
{
    DIR *d = fdopendir(dup(dfd));
    if (!d) return;
    rewinddir(d); /* the dup shares its offset with dfd, which an earlier listing moved */
    char want[PREFIX_LEN + 2];
    snprintf(want, sizeof want, NAME_PREFIX "%s-%s.", hash, r);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, want, PREFIX_LEN + 1) != 0) continue;
        if (!strcmp(e->d_name + PREFIX_LEN + 1, "lease")) continue;
        struct stat st;
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != getuid())
            continue;
        if (unlinkat(dfd, e->d_name, 0) == 0 && count) {
            sum->files++;
            sum->bytes += (unsigned long long)st.st_size;
        }
    }
    closedir(d);
}

/* name = "ckptmem-<hash16>-<rand16>.<rest>" (any job): 1 and the hash and rand, else 0. */
static int name_of_any(const char *name, char h[HASH_HEX + 1], char r[RAND_HEX + 1])
{
    if (strncmp(name, NAME_PREFIX, 8) != 0 || strlen(name) < PREFIX_LEN + 2 ||
        !is_hex(name + 8, HASH_HEX))
        return 0;
    memcpy(h, name + 8, HASH_HEX);
    h[HASH_HEX] = '\0';
    return name_of_job(name, h, r);
}

typedef struct pfx {
    char hash[HASH_HEX + 1], r[RAND_HEX + 1];
} pfx;

/* Every prefix in dir (of job hash `hash`, or of any job when NULL; never skip_r's) whose
 * lease nobody holds, or that has no lease (what a removal cut short leaves; a live agent
 * creates its lease before any other file): its files of this uid removed, the lease last.
 * Adds to *sum; with out, one line per removed prefix there. 0, or -errno when dir cannot be
 * listed or a file cannot be removed (the others still are). */
static int clean_dead(int dfd, const char *dirname, const char *hash, const char *skip_r,
                      stale_sum *sum, FILE *out)
{
    DIR *d = fdopendir(dup(dfd));
    if (d) rewinddir(d);
    if (!d) return -errno;
    pfx *seen = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        pfx p;
        if (hash ? !name_of_job(e->d_name, hash, p.r) : !name_of_any(e->d_name, p.hash, p.r))
            continue;
        if (hash) snprintf(p.hash, sizeof p.hash, "%s", hash);
        if (skip_r && !strcmp(p.r, skip_r)) continue;
        size_t k = 0;
        while (k < n && (strcmp(seen[k].r, p.r) || strcmp(seen[k].hash, p.hash))) k++;
        if (k < n) continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 16;
            void *q = realloc(seen, nc * sizeof *seen);
            if (!q) {
                rc = -ENOMEM;
                break;
            }
            seen = q;
            cap = nc;
        }
        seen[n++] = p;
    }
    closedir(d);
    for (size_t k = 0; k < n; k++) {
        char lease[PREFIX_LEN + 8];
        snprintf(lease, sizeof lease, NAME_PREFIX "%s-%s.lease", seen[k].hash, seen[k].r);
        int fd = openat(dfd, lease, O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
        struct stat st;
        if (fd < 0 && errno != ENOENT) continue; /* not ours to judge */
        if (fd >= 0) {
            if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid() ||
                flock(fd, LOCK_EX | LOCK_NB) != 0) {
                close(fd); /* held: its agent lives */
                continue;
            }
        }
        stale_sum one = {0, 0, 0};
        remove_set(dfd, seen[k].hash, seen[k].r, &one, 1);
        if (fd >= 0) {
            if (unlinkat(dfd, lease, 0) == 0) {
                one.files++;
                one.bytes += (unsigned long long)st.st_size;
            } else if (rc == 0) {
                rc = -errno;
            }
            close(fd);
        }
        if (out && one.files)
            fprintf(out, "removed %s/" NAME_PREFIX "%s-%s: %lu file(s), %llu bytes\n", dirname,
                    seen[k].hash, seen[k].r, one.files, one.bytes);
        sum->files += one.files;
        sum->bytes += one.bytes;
        sum->agents++;
    }
    free(seen);
    return rc;
}

/* Every other prefix of this job in dir whose lease nobody holds (clean_dead). */
static void clean_stale(elastic_mem *m, int dfd)
{
    stale_sum sum = {0, 0, 0};
    int rc = clean_dead(dfd, m->dir, m->hash, m->prefix + 8 + HASH_HEX + 1, &sum, NULL);
    if (rc < 0)
        LOG_W(MEM_TAG, "memory tier: cannot remove every stale segment in %s: %s", m->dir,
              strerror(-rc));
    if (sum.agents)
        LOG_I(MEM_TAG, "memory tier: removed %lu stale file(s) (%llu bytes) of %lu dead agent(s) "
              "of this job in %s", sum.files, sum.bytes, sum.agents, m->dir);
}

int elastic_mem_clean(const char *dir)
{
    char real[PATH_MAX];
    if (!dir) dir = "/dev/shm";
    int dfd = realpath(dir, real) ? open(real, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    if (dfd < 0) {
        int e = errno;
        fprintf(stderr, "elastic: --mem-clean: cannot open the segment folder %s: %s\n", dir,
                strerror(e));
        return -e;
    }
    stale_sum sum = {0, 0, 0};
    int rc = clean_dead(dfd, real, NULL, NULL, &sum, stdout);
    close(dfd);
    if (rc < 0)
        fprintf(stderr, "elastic: --mem-clean: in %s: %s (removed %lu file(s), %llu bytes)\n",
                real, strerror(-rc), sum.files, sum.bytes);
    return rc;
}

/* ------------------------------------------------------------------ open, close */

static int make_lease(elastic_mem *m, int dfd, const char *run_id)
{
    for (int tries = 0; tries < 8; tries++) {
        uint64_t r;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) return -EIO;
        snprintf(m->prefix, sizeof m->prefix, NAME_PREFIX "%s-%016" PRIx64, m->hash, r);
        char lease[PREFIX_LEN + 8];
        snprintf(lease, sizeof lease, "%s.lease", m->prefix);
        int fd = openat(dfd, lease, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0) {
            if (errno == EEXIST) continue;
            return -errno;
        }
        struct stat a, b;
        /* a cleaner of another agent may have taken it between create and lock: then it is
         * (being) unlinked, and we draw another name */
        if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &a) != 0 ||
            fstatat(dfd, lease, &b, AT_SYMLINK_NOFOLLOW) != 0 || a.st_ino != b.st_ino ||
            a.st_dev != b.st_dev) {
            close(fd);
            continue;
        }
        char info[160];
        int il = snprintf(info, sizeof info, "pid=%d run=%s\n", (int)getpid(), run_id);
        if (write(fd, info, (size_t)il) != il) {
            /* the lease is the lock, not its text */
        }
        m->lease_fd = fd;
        return 0;
    }
    return -EEXIST;
}

int elastic_mem_open(elastic_mem **out, const char *dir, const char *run_id, int nproc)
{
    *out = NULL;
    elastic_mem *m = calloc(1, sizeof *m);
    if (!m) return -ENOMEM;
    m->lease_fd = m->listen_fd = m->send_fd = -1;
    m->nproc = nproc;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->put_cv, NULL);
    pthread_cond_init(&m->conn_cv, NULL);
    pthread_mutex_init(&m->qmu, NULL);
    int rc = 0, dfd = -1;
    struct stat st;
    if (!realpath(dir, m->dir)) {
        rc = -errno;
        goto fail;
    }
    dfd = open(m->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fstat(dfd, &st) != 0) {
        rc = -errno;
        goto fail;
    }
    if (access(m->dir, W_OK | X_OK) != 0) {
        rc = -errno;
        goto fail;
    }
    if (strlen(m->dir) + 1 + PREFIX_LEN > WORKER_PREFIX_MAX) {
        /* the start of the path only: the logger's line would cut the whole one */
        LOG_E(MEM_TAG, "memory tier: cannot use the segment folder %.64s...: its path is %zu "
              "bytes long, the workers' prefix <folder>/" NAME_PREFIX "... would be %zu; at most "
              "%d (the folder at most %d bytes)", m->dir, strlen(m->dir),
              strlen(m->dir) + 1 + PREFIX_LEN, WORKER_PREFIX_MAX,
              WORKER_PREFIX_MAX - 1 - PREFIX_LEN);
        close(dfd);
        pthread_cond_destroy(&m->put_cv);
        pthread_cond_destroy(&m->conn_cv);
        pthread_mutex_destroy(&m->qmu);
        pthread_mutex_destroy(&m->mu);
        free(m);
        return -ENAMETOOLONG;
    }
    elastic_mem_jobhash((unsigned)getuid(), run_id, m->hash);
    if ((rc = make_lease(m, dfd, run_id)) < 0) goto fail;
    snprintf(m->path, sizeof m->path, "%s/%s", m->dir, m->prefix);
    m->agent = strtoull(m->prefix + 8 + HASH_HEX + 1, NULL, 16);
    clean_stale(m, dfd);
    close(dfd);
    LOG_I(MEM_TAG, "memory tier: segments in %s, prefix %s (lease held)", m->dir, m->prefix);
    *out = m;
    return 0;
fail:
    LOG_E(MEM_TAG, "memory tier: cannot use the segment folder %s: %s", dir, strerror(-rc));
    if (dfd >= 0) close(dfd);
    pthread_cond_destroy(&m->put_cv);
    pthread_cond_destroy(&m->conn_cv);
    pthread_mutex_destroy(&m->qmu);
    pthread_mutex_destroy(&m->mu);
    free(m);
    return rc;
}

int elastic_mem_has_own(const elastic_mem *m)
{
    DIR *d = opendir(m->dir);
    if (!d) return 0;
    char want[PREFIX_LEN + 8];
    int n = snprintf(want, sizeof want, "%s.own-", m->prefix);
    int found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d)))
        found = !strncmp(e->d_name, want, (size_t)n) && e->d_name[n] >= '0' && e->d_name[n] <= '9';
    closedir(d);
    return found;
}

static void replica_stop(elastic_mem *m);

void elastic_mem_close(elastic_mem *m)
{
    if (!m) return;
    replica_stop(m);
    int dfd = open(m->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        stale_sum sum = {0, 0, 0};
        char r[RAND_HEX + 1];
        memcpy(r, m->prefix + 8 + HASH_HEX + 1, RAND_HEX + 1);
        remove_set(dfd, m->hash, r, &sum, 1);
        char lease[PREFIX_LEN + 8];
        snprintf(lease, sizeof lease, "%s.lease", m->prefix);
        if (unlinkat(dfd, lease, 0) != 0)
            LOG_W(MEM_TAG, "memory tier: cannot remove the lease %s/%s: %s", m->dir, lease,
                  strerror(errno));
        close(dfd);
        log_msg(sum.files ? LOG_INFO : LOG_DEBUG, MEM_TAG, "memory tier: removed this agent's "
                "%lu segment file(s) (%llu bytes) and its lease", sum.files, sum.bytes);
    } else {
        LOG_W(MEM_TAG, "memory tier: cannot open %s to remove this agent's files: %s", m->dir,
              strerror(errno));
    }
    if (m->lease_fd >= 0) close(m->lease_fd);
    free(m->token);
    free(m->sent_seq);
    free(m->sent_to);
    free(m->torn);
    free(m->seen);
    pthread_cond_destroy(&m->put_cv);
    pthread_cond_destroy(&m->conn_cv);
    pthread_mutex_destroy(&m->qmu);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* ------------------------------------------------------------------ socket helpers */

static int quitting(elastic_mem *m)
{
    pthread_mutex_lock(&m->mu);
    int q = m->quit;
    pthread_mutex_unlock(&m->mu);
    return q;
}

/* Wait for ev on fd: at most IO_TIMEOUT_S (or timeout_s when > 0), in pieces of 0.2 s that
 * look at the quit flag. 0, -ETIMEDOUT, -ECANCELED (closing), -errno. */
static int wait_io(elastic_mem *m, int fd, short ev, double timeout_s)
{
    double deadline = clock_now_s() + (timeout_s > 0 ? timeout_s : IO_TIMEOUT_S);
    for (;;) {
        if (quitting(m)) return -ECANCELED;
        double left = deadline - clock_now_s();
        if (left <= 0) return -ETIMEDOUT;
        struct pollfd p = {fd, ev, 0};
        int r = poll(&p, 1, left > 0.2 ? 200 : (int)(left * 1000) + 1);
        if (r > 0) {
            if (p.revents & (POLLERR | POLLNVAL)) return -ECONNRESET;
            return 0;
        }
        if (r < 0 && errno != EINTR) return -errno;
    }
}

static int send_all(elastic_mem *m, int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno != EAGAIN) return errno == EPIPE ? -EPIPE : -ECONNRESET;
        int rc = wait_io(m, fd, POLLOUT, 0);
        if (rc < 0) return rc;
    }
    return 0;
}

/* Read exactly n bytes; -ECONNRESET at an early end of the stream. deadline 0: each wait at
 * most IO_TIMEOUT_S without progress; else (clock_now_s) all of it by then, progress or not. */
static int recv_dl(elastic_mem *m, int fd, void *buf, size_t n, double deadline)
{
    char *p = buf;
    while (n) {
        ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN) return errno == EFAULT ? -EFAULT : -ECONNRESET;
        double left = deadline > 0 ? deadline - clock_now_s() : 0;
        if (deadline > 0 && left <= 0) return -ETIMEDOUT;
        int rc = wait_io(m, fd, POLLIN, deadline > 0 && left < IO_TIMEOUT_S ? left : 0);
        if (rc < 0) return rc;
    }
    return 0;
}

static int recv_all(elastic_mem *m, int fd, void *buf, size_t n)
{
    return recv_dl(m, fd, buf, n, 0);
}

/* Equal lengths and bytes, in time that depends on neither (both at most TOKEN_MAX). */
static int token_equal(const unsigned char *a, size_t alen, const unsigned char *b, size_t blen)
{
    volatile unsigned char diff = (unsigned char)(alen != blen);
    for (size_t i = 0; i < TOKEN_MAX; i++) {
        unsigned char x = i < alen ? a[i] : 0, y = i < blen ? b[i] : 0;
        diff |= (unsigned char)(x ^ y);
    }
    return diff == 0;
}

/* "host:port" or "[v6]:port" -> a connected socket, within CONNECT_TIMEOUT_S. */
static int connect_peer(elastic_mem *m, const char *hostport)
{
    char host[80];
    const char *colon = strrchr(hostport, ':');
    if (!colon || colon == hostport) return -EINVAL;
    size_t hl = (size_t)(colon - hostport);
    const char *h = hostport;
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl >= sizeof host) return -EINVAL;
    memcpy(host, h, hl);
    host[hl] = '\0';
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    if (getaddrinfo(host, colon + 1, &hints, &res) != 0 || !res) return -EINVAL;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = fd < 0 ? -errno : 0;
    if (rc == 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
        rc = errno == EINPROGRESS ? 0 : -errno;
        if (rc == 0 && (rc = wait_io(m, fd, POLLOUT, CONNECT_TIMEOUT_S)) == 0) {
            int e = 0;
            socklen_t el = sizeof e;
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0) e = errno;
            rc = -e;
        }
    }
    freeaddrinfo(res);
    if (rc < 0) {
        if (fd >= 0) close(fd);
        return rc;
    }
    return fd;
}

/* ------------------------------------------------------------------ sender */

typedef struct round_view {
    int gen, node_rank, nnodes;
    char peer[96];
    unsigned serial;
    uint64_t to;               /* XXH3 of "<peer>" */
} round_view;

static const char *answer_text(int a)
{
    switch (a) {
    case ANS_DENIED: return "refused our job token";
    case ANS_BAD: return "refused the frame (another version?)";
    case ANS_LOCAL: return "cannot keep it (no space or an I/O error there)";
    default: return "answered an unknown code";
    }
}

/* Send slot `slot` of seg (info: its complete header) to the peer. 0 sent and committed,
 * -EAGAIN torn (try later), -ECONNREFUSED & co: the peer is unreachable (*answer -1), took the
 * connection but answered nothing within IO_TIMEOUT_S (-ETIMEDOUT, *answer -2), or answered a
 * refusal (*answer > 0). */
static int send_slot(elastic_mem *m, const round_view *rv, int local, shmseg *seg, int slot,
                     const shmseg_info *info, int *answer, unsigned char *buf)
{
    *answer = -1;
    int fd = connect_peer(m, rv->peer);
    if (fd < 0) return fd;
    pthread_mutex_lock(&m->mu);
    m->send_fd = fd;
    pthread_mutex_unlock(&m->mu);
    unsigned char hdr[12 + TOKEN_MAX + 48];
    size_t k = 0;
    memcpy(hdr, "CKMR", 4);
    put32(hdr + 4, 2);
    put32(hdr + 8, (uint32_t)m->token_len);
    k = 12;
    if (m->token_len) memcpy(hdr + k, m->token, m->token_len);
    k += m->token_len;
    put32(hdr + k, (uint32_t)rv->node_rank);
    put32(hdr + k + 4, (uint32_t)local);
    put64(hdr + k + 8, shmseg_slot_bytes(seg));
    put64(hdr + k + 16, info->payload_bytes);
    put64(hdr + k + 24, info->step);
    put64(hdr + k + 32, info->seq);
    put64(hdr + k + 40, m->agent);
    k += 48;
    unsigned char a = 0;
    int rc = send_all(m, fd, hdr, k);
    explicit_bzero(hdr, sizeof hdr);
    if (rc == 0 && (rc = recv_all(m, fd, &a, 1)) == -ETIMEDOUT) *answer = -2;
    if (rc == 0 && a != ANS_OK) {
        *answer = a;
        rc = -EACCES;
    }
    double next = clock_now_s();
    uint64_t seq = info->seq;
    for (uint64_t off = 0; rc == 0 && off < info->payload_bytes;) {
        size_t len = info->payload_bytes - off < CHUNK ? (size_t)(info->payload_bytes - off) : CHUNK;
        /* token bucket of one CHUNK: a piece goes when its bytes are earned at m->rate */
        for (double now = clock_now_s(); now < next && rc == 0; now = clock_now_s()) {
            double s = next - now > 0.1 ? 0.1 : next - now;
            struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
            nanosleep(&ts, NULL);
            if (quitting(m)) rc = -ECANCELED;
        }
        if (rc < 0) break;
        if ((rc = shmseg_copy_out(seg, slot, buf, off, len, &seq)) < 0) {
            rc = -EAGAIN; /* torn (or no longer complete): close early, nothing commits */
            break;
        }
        if ((rc = send_all(m, fd, buf, len)) < 0) break;
        off += len;
        double now = clock_now_s();
        next = (next > now ? next : now) + (double)len / m->rate;
    }
    if (rc == 0 && (rc = recv_all(m, fd, &a, 1)) == -ETIMEDOUT) *answer = -2;
    if (rc == 0 && a != ANS_OK) {
        *answer = a;
        rc = -EIO;
    }
    pthread_mutex_lock(&m->mu);
    m->send_fd = -1;
    pthread_mutex_unlock(&m->mu);
    close(fd);
    if (rc == -EAGAIN) return rc;
    if (rc < 0 && *answer == -1 && rc != -ECANCELED) rc = rc == -ETIMEDOUT ? rc : -ECONNRESET;
    return rc;
}

/* One look at local slot L's own segment: send its newest complete slot when the current
 * peer does not have it. */
static void poll_one(elastic_mem *m, const round_view *rv, int L, unsigned char *buf)
{
    char path[sizeof m->path + 24];
    snprintf(path, sizeof path, "%s.own-%d", m->path, L);
    shmseg *seg = NULL;
    if (shmseg_open(path, 0, &seg) < 0) return; /* none yet, or being rebuilt */
    int slot;
    shmseg_info info;
    if (shmseg_newest(seg, &slot) < 0 || shmseg_slot_info(seg, slot, &info) < 0 ||
        info.state != SHMSEG_COMPLETE ||
        (m->sent_to[L] == rv->to && m->sent_seq[L] == info.seq)) {
        shmseg_close(seg);
        return;
    }
    int answer;
    double t0 = clock_now_s();
    int rc = send_slot(m, rv, L, seg, slot, &info, &answer, buf);
    shmseg_close(seg);
    int dst = (rv->node_rank + 1) % rv->nnodes;
    if (rc == 0) {
        m->sent_seq[L] = info.seq;
        m->sent_to[L] = rv->to;
        m->torn[L] = 0;
        if (m->metrics) elastic_metrics_mem_replica(m->metrics, info.payload_bytes, info.step);
        log_msg(m->logged_serial == rv->serial + 1 ? LOG_DEBUG : LOG_INFO, MEM_TAG,
                "memory tier: replica of local slot %d (step %" PRIu64 ", %" PRIu64 " bytes) sent "
                "to node %d in %.3f s", L, info.step, info.payload_bytes, dst, clock_now_s() - t0);
        m->logged_serial = rv->serial + 1;
        if (m->warned_serial == rv->serial + 1) {
            LOG_I(MEM_TAG, "memory tier: peer node %d at %s reachable again", dst, rv->peer);
            m->warned_serial = 0;
        }
        return;
    }
    if (rc == -ECANCELED) return;
    if (rc != -EAGAIN) m->retry_at = clock_now_s() + 1.0; /* no connection per 0.1 s to a peer
                                                            that is gone or refuses */
    if (rc == -EAGAIN) {
        if (++m->torn[L] == TORN_WARN)
            LOG_W(MEM_TAG, "memory tier: local slot %d changed during each of the last %d "
                  "transfers to node %d: the replica cannot keep up (raise --mem-replica-mbps or "
                  "snapshot to memory less often)", L, TORN_WARN, dst);
        return;
    }
    if (m->warned_serial == rv->serial + 1) return; /* once per round */
    m->warned_serial = rv->serial + 1;
    if (answer > 0)
        LOG_W(MEM_TAG, "memory tier: peer node %d at %s %s; no replica this round", dst, rv->peer,
              answer_text(answer));
    else if (answer == -2)
        LOG_W(MEM_TAG, "memory tier: peer node %d at %s took the connection but did not answer "
              "within %.0f s; retrying quietly this round", dst, rv->peer, IO_TIMEOUT_S);
    else if (rc == -ETIMEDOUT)
        LOG_W(MEM_TAG, "memory tier: peer node %d at %s is unreachable (no connection within "
              "%.0f s, or it stopped taking the bytes for %.0f s); retrying quietly this round",
              dst, rv->peer, CONNECT_TIMEOUT_S, IO_TIMEOUT_S);
    else
        LOG_W(MEM_TAG, "memory tier: peer node %d at %s is unreachable (%s); retrying quietly "
              "this round", dst, rv->peer, strerror(-rc));
}

static void *sender_main(void *arg)
{
    elastic_mem *m = arg;
    unsigned char *buf = malloc(CHUNK);
    if (!buf) {
        LOG_E(MEM_TAG, "memory tier: out of memory for the replica sender: no replica");
        return NULL;
    }
    while (!quitting(m)) {
        round_view rv;
        pthread_mutex_lock(&m->mu);
        rv.gen = m->gen;
        rv.node_rank = m->node_rank;
        rv.nnodes = m->nnodes;
        memcpy(rv.peer, m->peer, sizeof rv.peer);
        rv.serial = m->serial;
        pthread_mutex_unlock(&m->mu);
        char key[128];
        int kl = snprintf(key, sizeof key, "%s", rv.peer);
        rv.to = XXH3_64bits(key, (size_t)kl);
        if (rv.serial != m->retry_serial) {
            m->retry_serial = rv.serial;
            m->retry_at = 0;
        }
        if (rv.peer[0] && rv.nnodes > 1 && clock_now_s() >= m->retry_at)
            for (int L = 0; L < m->nproc && !quitting(m); L++) poll_one(m, &rv, L, buf);
        struct timespec ts = {0, (long)(POLL_S * 1e9)};
        nanosleep(&ts, NULL);
    }
    free(buf);
    return NULL;
}

/* ------------------------------------------------------------------ server */

/* what: "replica connection" or "memory query" */
static void refused_what(elastic_mem *m, const char *what, const char *from, const char *why)
{
    double now = clock_now_s();
    pthread_mutex_lock(&m->mu); /* the server and the put thread */
    int quiet = m->refused_logged > 0 && now - m->refused_logged < 10.0; /* a flood: 1 per 10 s */
    if (!quiet) m->refused_logged = now;
    pthread_mutex_unlock(&m->mu);
    if (!quiet) LOG_W(MEM_TAG, "memory tier: refused a %s from %s: %s", what, from, why);
}

static void refused(elastic_mem *m, const char *from, const char *why)
{
    refused_what(m, "replica connection", from, why);
}

/* Does dir have room for a segment of slot_bytes at path (an existing file's size counts)? */
static int room_for(const elastic_mem *m, const char *path, uint64_t slot_bytes)
{
    struct statvfs sv;
    if (statvfs(m->dir, &sv) != 0) return 1; /* cannot tell: let the create say */
    uint64_t need = shmseg_file_bytes(SHMSEG_REPLICA_SLOTS, slot_bytes);
    uint64_t have = (uint64_t)sv.f_bavail * sv.f_frsize;
    struct stat st;
    if (stat(path, &st) == 0 && (uint64_t)st.st_size == need) return 1; /* reused in place */
    return need != 0 && need <= have;
}

/* ------------------------------------------------------------------ queries (mem_wire.h) */

/* The segment at path, mapped read-only, from the cache when it is still the same file. A file
 * replaced under the same name (a worker's segment rebuilt with another layout) is unmapped
 * when that name is next asked for; at most QCACHE mappings stay, all closed when the server
 * stops (before the agent removes its files). */
static int qseg_get(elastic_mem *m, const char *path, shmseg **out)
{
    struct stat st;
    if (stat(path, &st) != 0) return -errno;
    for (unsigned i = 0; i < QCACHE; i++) {
        qseg *q = &m->qcache[i];
        if (q->seg && !strcmp(q->path, path)) {
            if (q->dev == st.st_dev && q->ino == st.st_ino) {
                *out = q->seg;
                return 0;
            }
            shmseg_close(q->seg);
            q->seg = NULL;
        }
    }
    shmseg *seg;
    int rc = shmseg_open(path, 0, &seg);
    if (rc < 0) return rc;
    qseg *q = &m->qcache[m->qnext++ % QCACHE];
    shmseg_close(q->seg);
    snprintf(q->path, sizeof q->path, "%s", path);
    q->dev = st.st_dev;
    q->ino = st.st_ino;
    q->seg = seg;
    /* a restore reads every byte: the page tables in one batch, not a fault per page */
    for (int i = 0; i < shmseg_nslots(seg); i++) (void)shmseg_prefault(seg, i, 0);
    *out = seg;
    return 0;
}

static void qcache_clear(elastic_mem *m)
{
    for (unsigned i = 0; i < QCACHE; i++) {
        shmseg_close(m->qcache[i].seg);
        m->qcache[i].seg = NULL;
    }
}

/* Digits only (1..9 of them): 0 and the value, or -1. */
static int digits_u32(const char *s, size_t n, uint32_t *v)
{
    if (n == 0 || n > 9) return -1;
    uint32_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        x = x * 10 + (uint32_t)(s[i] - '0');
    }
    *v = x;
    return 0;
}

/* "own-<L>" -> kind 0, "rep-<agent16>-<L>" -> kind 1; -1 for any other name. */
static int seg_name(const char *rest, uint64_t *agent, uint32_t *local)
{
    *agent = 0;
    if (!strncmp(rest, "own-", 4)) return digits_u32(rest + 4, strlen(rest + 4), local) == 0 ? 0 : -1;
    if (strncmp(rest, "rep-", 4) != 0) return -1;
    if (strlen(rest) < 4 + RAND_HEX + 2 || !is_hex(rest + 4, RAND_HEX) || rest[4 + RAND_HEX] != '-' ||
        digits_u32(rest + 4 + RAND_HEX + 1, strlen(rest + 4 + RAND_HEX + 1), local) < 0)
        return -1;
    *agent = strtoull(rest + 4, NULL, 16);
    return 1;
}

typedef struct qname {
    char name[PREFIX_LEN + 40];
    uint32_t kind, local;
    uint64_t agent;
} qname;

static int cmp_qname(const void *a, const void *b)
{
    return strcmp(((const qname *)a)->name, ((const qname *)b)->name);
}

static int send_answer(elastic_mem *m, int fd, uint32_t status, uint64_t body_len)
{
    unsigned char a[MEMQ_ANS_BYTES] = {0};
    put32(a, status);
    put64(a + 8, body_len);
    return send_all(m, fd, a, sizeof a);
}

/* LIST: every complete slot of this node's segments, with its payload's head. */
static void query_list(elastic_mem *m, int fd)
{
    DIR *d = opendir(m->dir);
    if (!d) {
        LOG_W(MEM_TAG, "memory tier: cannot list %s for a peer's query: %s", m->dir, strerror(errno));
        send_answer(m, fd, MEMQ_ST_LOCAL, 0);
        return;
    }
    size_t plen = strlen(m->prefix), nn = 0, cap = 0;
    qname *names = NULL;
    unsigned char *body = NULL;
    size_t cnt = 0;
    int ok = 1;
    struct dirent *e;
    while ((e = readdir(d))) {
        qname q;
        if (strncmp(e->d_name, m->prefix, plen) != 0 || e->d_name[plen] != '.' ||
            strlen(e->d_name) >= sizeof q.name)
            continue;
        int kind = seg_name(e->d_name + plen + 1, &q.agent, &q.local);
        if (kind < 0) continue;
        q.kind = (uint32_t)kind;
        snprintf(q.name, sizeof q.name, "%s", e->d_name);
        if (nn == cap) {
            size_t nc = cap ? 2 * cap : 16;
            void *p = realloc(names, nc * sizeof *names);
            if (!p) {
                ok = 0;
                break;
            }
            names = p;
            cap = nc;
        }
        names[nn++] = q;
    }
    closedir(d);
    if (nn) qsort(names, nn, sizeof *names, cmp_qname);
    if (ok && nn && !(body = calloc(nn * SHMSEG_MAX_SLOTS, MEMQ_ENTRY_BYTES))) ok = 0;
    for (size_t i = 0; ok && i < nn && cnt < MEMQ_LIST_MAX; i++) {
        char path[sizeof m->path + 40];
        snprintf(path, sizeof path, "%s/%s", m->dir, names[i].name);
        shmseg *seg;
        if (qseg_get(m, path, &seg) < 0) continue; /* gone, or being rebuilt */
        for (int sl = 0; sl < shmseg_nslots(seg) && cnt < MEMQ_LIST_MAX; sl++) {
            shmseg_info in, in2;
            if (shmseg_slot_info(seg, sl, &in) < 0 || in.state != SHMSEG_COMPLETE) continue;
            unsigned char *en = body + cnt * MEMQ_ENTRY_BYTES;
            uint64_t hl = in.payload_bytes < MEMQ_HEAD_BYTES ? in.payload_bytes : MEMQ_HEAD_BYTES;
            uint64_t seq = in.seq;
            if (shmseg_copy_out(seg, sl, en + 64, 0, hl, &seq) < 0) continue; /* being rewritten */
            if (shmseg_slot_info(seg, sl, &in2) < 0 || in2.seq != in.seq) continue;
            put32(en, names[i].kind);
            put64(en + 48, names[i].agent);
            put32(en + 8, names[i].local);
            put32(en + 12, (uint32_t)sl);
            put64(en + 16, in.seq);
            put64(en + 24, in.payload_bytes);
            put64(en + 32, in.step);
            put32(en + 40, (uint32_t)hl);
            cnt++;
        }
    }
    free(names);
    if (!ok) {
        LOG_W(MEM_TAG, "memory tier: out of memory answering a peer's listing");
        send_answer(m, fd, MEMQ_ST_LOCAL, 0);
    } else if (send_answer(m, fd, MEMQ_ST_OK, (uint64_t)cnt * MEMQ_ENTRY_BYTES) == 0 && cnt) {
        send_all(m, fd, body, cnt * MEMQ_ENTRY_BYTES);
    }
    free(body);
}

/* GET: bytes of one complete slot at the listed seq. */
static void query_get(elastic_mem *m, int fd, const unsigned char *f)
{
    uint32_t kind = get32(f + 4), local = get32(f + 12), sl = get32(f + 16);
    uint64_t seq = get64(f + 24), off = get64(f + 32), len = get64(f + 40), agent = get64(f + 48);
    if (kind > 1 || sl >= SHMSEG_MAX_SLOTS || local >= 4096 || seq == 0 ||
        len > MEMQ_GET_MAX || off > UINT64_MAX - len) {
        send_answer(m, fd, MEMQ_ST_BAD, 0);
        return;
    }
    char path[sizeof m->path + 40];
    int rc = kind == 0 ? shmseg_own_path(path, sizeof path, m->path, local)
                       : shmseg_rep_path(path, sizeof path, m->path, agent, local);
    shmseg *seg = NULL;
    if (rc == 0) rc = qseg_get(m, path, &seg);
    if (rc < 0 || (int)sl >= shmseg_nslots(seg)) { /* a segment may have 2 or 3 slots */
        send_answer(m, fd, MEMQ_ST_NOENT, 0);
        return;
    }
    shmseg_info in;
    if (shmseg_slot_info(seg, (int)sl, &in) < 0) {
        send_answer(m, fd, MEMQ_ST_STALE, 0); /* a writer keeps changing it */
        return;
    }
    if (in.state != SHMSEG_COMPLETE) {
        /* being rewritten: the listed payload is gone; empty: there never was one */
        send_answer(m, fd, in.state == SHMSEG_WRITING ? MEMQ_ST_STALE : MEMQ_ST_NOENT, 0);
        return;
    }
    if (in.seq != seq) {
        send_answer(m, fd, MEMQ_ST_STALE, 0);
        return;
    }
    if (off > in.payload_bytes || len > in.payload_bytes - off) {
        send_answer(m, fd, MEMQ_ST_RANGE, 0);
        return;
    }
    if (len && !m->qbuf && !(m->qbuf = malloc(MEMQ_GET_MAX))) {
        send_answer(m, fd, MEMQ_ST_LOCAL, 0);
        return;
    }
    uint64_t s2 = seq;
    rc = len ? shmseg_copy_out(seg, (int)sl, m->qbuf, off, len, &s2) : 0;
    if (rc < 0) send_answer(m, fd, rc == -EINVAL ? MEMQ_ST_RANGE : MEMQ_ST_STALE, 0);
    else if (send_answer(m, fd, MEMQ_ST_OK, len) == 0 && len) send_all(m, fd, m->qbuf, (size_t)len);
}

/* A query connection after its first 12 bytes h (magic "CKMQ" checked by the caller); the
 * token and the request by the handshake's deadline. */
static void serve_query(elastic_mem *m, int fd, const char *from, const unsigned char *h,
                        double deadline)
{
    unsigned char tok[TOKEN_MAX], f[MEMQ_REQ_BYTES];
    uint32_t tl = get32(h + 8);
    if (get32(h + 4) != MEMQ_VERSION || tl > TOKEN_MAX) {
        refused_what(m, "memory query", from, "not a query of version 2");
        send_answer(m, fd, MEMQ_ST_BAD, 0);
        return;
    }
    int rc = recv_dl(m, fd, tok, tl, deadline);
    if (rc == 0) rc = recv_dl(m, fd, f, sizeof f, deadline);
    if (rc < 0) {
        if (rc == -ETIMEDOUT) refused_what(m, "memory query", from, "no complete request in time");
        return;
    }
    int ok = token_equal(tok, tl, (const unsigned char *)(m->token ? m->token : ""), m->token_len);
    explicit_bzero(tok, sizeof tok);
    if (!ok) {
        refused_what(m, "memory query", from, "wrong job token");
        send_answer(m, fd, MEMQ_ST_DENIED, 0);
        return;
    }
    uint32_t op = get32(f);
    pthread_mutex_lock(&m->qmu);
    if (op == MEMQ_OP_LIST) query_list(m, fd);
    else if (op == MEMQ_OP_GET) query_get(m, fd, f);
    else send_answer(m, fd, MEMQ_ST_BAD, 0);
    pthread_mutex_unlock(&m->qmu);
}

/* A replica transfer's handshake after its first 12 bytes h, by the deadline: 0 and its fixed
 * header in f (token accepted), or -1 (answered or dropped; the caller closes fd). */
static int put_handshake(elastic_mem *m, int fd, const char *from, const unsigned char *h,
                         unsigned char f[48], double deadline)
{
    unsigned char tok[TOKEN_MAX];
    unsigned char ans = ANS_BAD;
    uint32_t tl = get32(h + 8);
    if (memcmp(h, "CKMR", 4) != 0 || get32(h + 4) != 2 || tl > TOKEN_MAX) {
        refused(m, from, "not a replica frame of version 2");
        send_all(m, fd, &ans, 1);
        return -1;
    }
    int rc = recv_dl(m, fd, tok, tl, deadline);
    if (rc == 0) rc = recv_dl(m, fd, f, 48, deadline);
    if (rc < 0) {
        if (rc == -ETIMEDOUT) refused(m, from, "no complete frame header in time");
        return -1;
    }
    int ok = token_equal(tok, tl, (const unsigned char *)(m->token ? m->token : ""),
                         m->token_len);
    explicit_bzero(tok, sizeof tok);
    if (!ok) {
        ans = ANS_DENIED;
        refused(m, from, "wrong job token");
        send_all(m, fd, &ans, 1);
        return -1;
    }
    return 0;
}

/* A replica transfer after its accepted handshake (f: the fixed header; put thread). */
static void serve_put(elastic_mem *m, int fd, const char *from, const unsigned char *f)
{
    unsigned char ans = ANS_BAD;
    shmseg *seg = NULL;
    uint32_t src = get32(f), L = get32(f + 4);
    uint64_t slot_bytes = get64(f + 8), payload = get64(f + 16), step = get64(f + 24);
    uint64_t agent = get64(f + 40);
    if (src >= 4096 || L >= 4096 || slot_bytes == 0 || slot_bytes % SHMSEG_PAGE ||
        slot_bytes > MAX_SLOT_BYTES || payload > slot_bytes) {
        refused(m, from, "fields out of range");
        goto answer;
    }
    char path[sizeof m->path + 40];
    shmseg_rep_path(path, sizeof path, m->path, agent, L);
    ans = ANS_LOCAL;
    int rc, slot;
    if (!room_for(m, path, slot_bytes)) {
        refused(m, from, "no room in the segment folder for the replica");
        goto answer;
    }
    if ((rc = shmseg_create(path, SHMSEG_REPLICA_SLOTS, slot_bytes, &seg)) < 0 ||
        (rc = shmseg_begin(seg, -1, &slot)) < 0) {
        LOG_W(MEM_TAG, "memory tier: cannot keep the replica of node %u slot %u in %s: %s", src, L,
              path, strerror(-rc));
        goto answer;
    }
    ans = ANS_OK;
    if (send_all(m, fd, &ans, 1) < 0) goto out;
    double t0 = clock_now_s();
    /* straight into the slot: recv() of a page the tmpfs cannot back fails with EFAULT */
    if ((rc = recv_all(m, fd, shmseg_payload(seg, slot), (size_t)payload)) < 0) {
        if (rc == -EFAULT)
            LOG_W(MEM_TAG, "memory tier: the segment folder is full: replica of node %u slot %u "
                  "dropped", src, L);
        else
            LOG_D(MEM_TAG, "memory tier: replica of node %u slot %u from %s abandoned (%s)", src, L,
                  from, strerror(-rc));
        goto out; /* the slot stays writing: never used; the other keeps the previous one */
    }
    ans = ANS_LOCAL;
    if ((rc = shmseg_commit(seg, slot, payload, step)) == 0) ans = ANS_OK;
    unsigned char kb[12];
    put64(kb, agent);
    put32(kb + 8, L);
    uint64_t key = XXH3_64bits(kb, sizeof kb) | 1; /* never 0, the free mark */
    int first = 1;
    for (size_t i = 0; i < SEEN_MAX; i++)
        if (m->seen[i] == key) first = 0;
    for (size_t i = 0; first && i < SEEN_MAX; i++)
        if (m->seen[i] == 0) {
            m->seen[i] = key;
            break;
        }
    log_msg(first ? LOG_INFO : LOG_DEBUG, MEM_TAG, "memory tier: replica of node %u local slot %u "
            "(agent %016" PRIx64 ", step %" PRIu64 ", %" PRIu64 " bytes) received in %.3f s into %s",
            src, L, agent, step, payload, clock_now_s() - t0, path);
answer:
    send_all(m, fd, &ans, 1);
out:
    shmseg_close(seg);
}

/* The replica transfers, one at a time in the order their handshakes ended (one writer per
 * replica file), on a thread of their own so that a restore's queries never wait behind one. */
static void *put_main(void *arg)
{
    elastic_mem *m = arg;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        while (!m->quit && m->put_n == 0) pthread_cond_wait(&m->put_cv, &m->mu);
        if (m->quit) break;
        put_job j = m->putq[m->put_head];
        m->put_head = (m->put_head + 1) % PUTQ;
        m->put_n--;
        pthread_mutex_unlock(&m->mu);
        serve_put(m, j.fd, j.from, j.f);
        close(j.fd);
        pthread_mutex_lock(&m->mu);
    }
    while (m->put_n) { /* stopped: the waiting ones get nothing (their senders see a reset) */
        close(m->putq[m->put_head].fd);
        m->put_head = (m->put_head + 1) % PUTQ;
        m->put_n--;
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* One connection (a thread of its own): the handshake by its deadline, then a query served
 * here or a replica transfer queued for the put thread. */
static void *conn_main(void *arg)
{
    conn_job *c = arg;
    elastic_mem *m = c->m;
    int fd = c->fd;
    unsigned char h[12], f[48];
    int rc = recv_dl(m, fd, h, sizeof h, c->deadline);
    if (rc == -ETIMEDOUT) refused(m, c->from, "no frame header in time");
    if (rc == 0 && !memcmp(h, MEMQ_MAGIC, 4)) {
        serve_query(m, fd, c->from, h, c->deadline);
    } else if (rc == 0 && put_handshake(m, fd, c->from, h, f, c->deadline) == 0) {
        pthread_mutex_lock(&m->mu);
        int queued = m->put_started && !m->quit && m->put_n < PUTQ;
        if (queued) {
            put_job *j = &m->putq[(m->put_head + m->put_n++) % PUTQ];
            j->fd = fd;
            memcpy(j->f, f, sizeof f);
            snprintf(j->from, sizeof j->from, "%s", c->from);
            pthread_cond_signal(&m->put_cv);
            fd = -1;
        }
        pthread_mutex_unlock(&m->mu);
        if (!queued) refused(m, c->from, "too many replica transfers waiting");
    }
    if (fd >= 0) close(fd);
    free(c);
    pthread_mutex_lock(&m->mu);
    if (--m->nconn == 0) pthread_cond_broadcast(&m->conn_cv);
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

static void *server_main(void *arg)
{
    elastic_mem *m = arg;
    while (!quitting(m)) {
        struct pollfd p = {m->listen_fd, POLLIN, 0};
        if (poll(&p, 1, 200) <= 0) continue;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(m->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) continue;
        double deadline = clock_now_s() + HANDSHAKE_S;
        char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?", from[NI_MAXHOST + NI_MAXSERV + 4];
        getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(from, sizeof from, "%s:%s", host, port);
        pthread_mutex_lock(&m->mu);
        int room = m->nconn < CONN_MAX;
        if (room) m->nconn++;
        pthread_mutex_unlock(&m->mu);
        conn_job *c = room ? malloc(sizeof *c) : NULL;
        pthread_t th;
        int rc = -ENOMEM;
        if (c) {
            *c = (conn_job){m, fd, deadline, ""};
            snprintf(c->from, sizeof c->from, "%s", from);
            if ((rc = common_thread_start(&th, conn_main, c)) == 0) pthread_detach(th);
        }
        if (rc == 0) continue;
        free(c);
        if (room) {
            pthread_mutex_lock(&m->mu);
            if (--m->nconn == 0) pthread_cond_broadcast(&m->conn_cv);
            pthread_mutex_unlock(&m->mu);
        }
        refused_what(m, "connection", from, room ? "cannot start a thread for it"
                                                 : "too many connections in flight");
        close(fd);
    }
    return NULL;
}

/* ------------------------------------------------------------------ replica start/stop */

int elastic_mem_replica_start(elastic_mem *m, const char *bind_host, const char *token,
                              int mbps, elastic_metrics *metrics, char *addr, size_t addr_len)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
    int rc = 0, fd = -1;
    if (getaddrinfo(bind_host, "0", &hints, &res) != 0 || !res) {
        rc = -EINVAL;
        goto fail;
    }
    fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 16) != 0) {
        rc = -errno;
        goto fail;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char port[NI_MAXSERV];
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0 ||
        getnameinfo((struct sockaddr *)&ss, sl, NULL, 0, port, sizeof port, NI_NUMERICSERV) != 0) {
        rc = -EIO;
        goto fail;
    }
    snprintf(addr, addr_len, strchr(bind_host, ':') ? "[%s]:%s" : "%s:%s", bind_host, port);
    m->token = token && *token ? strdup(token) : NULL;
    m->token_len = m->token ? strlen(m->token) : 0;
    if (m->token_len > TOKEN_MAX) m->token_len = TOKEN_MAX;
    m->rate = (double)mbps * 1e6;
    m->metrics = metrics;
    m->listen_fd = fd;
    m->sent_seq = calloc((size_t)m->nproc, sizeof *m->sent_seq);
    m->sent_to = calloc((size_t)m->nproc, sizeof *m->sent_to);
    m->torn = calloc((size_t)m->nproc, sizeof *m->torn);
    m->seen = calloc(SEEN_MAX, sizeof *m->seen);
    if ((token && *token && !m->token) || !m->sent_seq || !m->sent_to || !m->torn ||
        !m->seen) {
        rc = -ENOMEM;
        goto fail;
    }
    if ((rc = common_thread_start(&m->put_th, put_main, m)) < 0) goto fail;
    m->put_started = 1;
    if ((rc = common_thread_start(&m->srv_th, server_main, m)) < 0) goto fail;
    m->srv_started = 1;
    if ((rc = common_thread_start(&m->snd_th, sender_main, m)) < 0) goto fail;
    m->snd_started = 1;
    m->replica = 1;
    freeaddrinfo(res);
    LOG_I(MEM_TAG, "memory tier: replica server on %s, sending to the next node at most %d MB/s",
          addr, mbps);
    return 0;
fail:
    LOG_W(MEM_TAG, "memory tier: cannot start the peer replica on %s: %s; running without it",
          bind_host, strerror(-rc));
    if (res) freeaddrinfo(res);
    if (m->srv_started || m->snd_started || m->put_started) {
        m->listen_fd = fd;
        replica_stop(m);
    } else if (fd >= 0) {
        close(fd);
    }
    m->listen_fd = -1;
    return rc;
}

void elastic_mem_round(elastic_mem *m, int gen, int node_rank, int nnodes, const char *peer)
{
    if (!m || !m->replica) return;
    pthread_mutex_lock(&m->mu);
    m->gen = gen;
    m->node_rank = node_rank;
    m->nnodes = nnodes;
    snprintf(m->peer, sizeof m->peer, "%s", peer ? peer : "");
    m->serial++;
    pthread_mutex_unlock(&m->mu);
}

static void replica_stop(elastic_mem *m)
{
    pthread_mutex_lock(&m->mu);
    m->quit = 1;
    if (m->send_fd >= 0) shutdown(m->send_fd, SHUT_RDWR);
    pthread_mutex_unlock(&m->mu);
    if (m->snd_started) pthread_join(m->snd_th, NULL);
    if (m->srv_started) pthread_join(m->srv_th, NULL);
    pthread_mutex_lock(&m->mu);
    /* the connection threads see quit within 0.2 s (wait_io) */
    while (m->nconn) pthread_cond_wait(&m->conn_cv, &m->mu);
    pthread_cond_broadcast(&m->put_cv);
    pthread_mutex_unlock(&m->mu);
    if (m->put_started) pthread_join(m->put_th, NULL);
    qcache_clear(m);
    free(m->qbuf);
    m->qbuf = NULL;
    m->snd_started = m->srv_started = m->put_started = 0;
    m->replica = 0;
    if (m->listen_fd >= 0) close(m->listen_fd);
    m->listen_fd = -1;
    if (m->token) explicit_bzero(m->token, strlen(m->token));
}
