/* comm_cpu.c - the CPU backend of comm.h: a full mesh of non-blocking TCP connections and
 * one poll() loop per collective.
 *
 * Why one poll loop that sends and receives at once: when every rank sends megabytes to
 * every other rank, a rank that blocked in send() before receiving would wait for a peer that
 * is itself blocked in send() - the socket buffers fill up and nobody reads. Interleaving
 * non-blocking sends and receives (full duplex) always lets some transfer progress.
 *
 * Messages: 16-byte header (op:u32 | seq:u32 | len:u64, host byte order - one node) and len
 * bytes. Every collective sends exactly one message on each connection it uses (empty ranges
 * included), so a dead peer is noticed in every collective that involves it, and a receive
 * never reads past the current message: bytes of the next collective stay in the socket.
 */
#include "clock.h"
#include "comm.h"

#include "log.h"
#include "store.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define TAG "comm"
#define HELLO_MAGIC 0x314d4354u /* "TCM1" */
#define HELLO_VERSION 1u
#define SECRET_LEN 32
#define HELLO_LEN (5 * 4 + SECRET_LEN)
#define HDR_LEN 16
#define MAX_WORLD 4096
#define PREFIX_MAX 200

enum { OP_RS = 1, OP_AG = 2, OP_BC = 3, OP_BAR = 4 };

static const char *op_name(uint32_t op)
{
    switch (op) {
    case OP_RS: return "reduce-scatter";
    case OP_AG: return "all-gather";
    case OP_BC: return "broadcast";
    case OP_BAR: return "barrier";
    default: return "?";
    }
}

/* One peer's transfer in the current collective: at most one message each way. */
typedef struct peer_io {
    const uint8_t *sdata;
    size_t slen, sdone; /* sdone counts header + data bytes */
    uint8_t shdr[HDR_LEN];
    int son;
    uint8_t *rdata;
    size_t rlen, rdone;
    uint8_t rhdr[HDR_LEN];
    int ron;
} peer_io;

struct train_comm {
    int rank, world;
    double timeout_s;
    int err; /* sticky */
    uint32_t seq;
    int *fd;        /* [world]; -1 for this rank */
    peer_io *io;    /* [world] */
    size_t *off;    /* [world + 1] offsets of the current collective */
    size_t *counts; /* [world] all-reduce's split */
    struct pollfd *pfd;
    int *who;
    float *scratch;
    size_t scratch_cap; /* floats */
};

static int poll_ms(double deadline)
{
    double left = deadline - clock_now_s();
    if (left <= 0) return 0;
    if (left > 1e6) return 1000000000;
    return (int)ceil(left * 1000.0);
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The peer is gone: EPIPE stays -EPIPE, everything else (reset, abort, end of file) is
 * -ECONNRESET. */
static int lost_errno(int e) { return e == EPIPE ? -EPIPE : -ECONNRESET; }

/* Poison c with err (the first error is kept) and shut the connections down so that the
 * peers fail at once instead of at their deadline. Returns the sticky error. */
static int poison(train_comm *c, int err)
{
    if (c->err) return c->err;
    c->err = err;
    for (int p = 0; p < c->world; p++)
        if (c->fd[p] >= 0) shutdown(c->fd[p], SHUT_RDWR);
    return err;
}

/* ---------------------------------------------------------------- message engine */

static void set_send(train_comm *c, int p, uint32_t op, const void *data, size_t len)
{
    peer_io *io = &c->io[p];
    uint64_t l = len;
    put32(io->shdr, op);
    put32(io->shdr + 4, c->seq);
    memcpy(io->shdr + 8, &l, 8);
    io->sdata = data;
    io->slen = len;
    io->sdone = 0;
    io->son = 1;
}

static void set_recv(train_comm *c, int p, void *data, size_t len)
{
    peer_io *io = &c->io[p];
    io->rdata = data;
    io->rlen = len;
    io->rdone = 0;
    io->ron = 1;
}

static int do_send(train_comm *c, int p)
{
    peer_io *io = &c->io[p];
    while (io->sdone < HDR_LEN + io->slen) {
        struct iovec iov[2];
        int n = 0;
        if (io->sdone < HDR_LEN) {
            iov[n].iov_base = io->shdr + io->sdone;
            iov[n++].iov_len = HDR_LEN - io->sdone;
            if (io->slen) {
                iov[n].iov_base = (void *)(uintptr_t)io->sdata;
                iov[n++].iov_len = io->slen;
            }
        } else {
            iov[n].iov_base = (void *)(uintptr_t)(io->sdata + (io->sdone - HDR_LEN));
            iov[n++].iov_len = io->slen - (io->sdone - HDR_LEN);
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)n;
        ssize_t w = sendmsg(c->fd[p], &mh, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return lost_errno(errno);
        }
        io->sdone += (size_t)w;
    }
    io->son = 0;
    return 0;
}

static int do_recv(train_comm *c, int p, uint32_t op)
{
    peer_io *io = &c->io[p];
    while (io->ron) {
        ssize_t r;
        if (io->rdone < HDR_LEN)
            r = recv(c->fd[p], io->rhdr + io->rdone, HDR_LEN - io->rdone, 0);
        else
            r = recv(c->fd[p], io->rdata + (io->rdone - HDR_LEN),
                     io->rlen - (io->rdone - HDR_LEN), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return lost_errno(errno);
        }
        if (r == 0) return -ECONNRESET; /* end of file: the peer closed */
        size_t before = io->rdone;
        io->rdone += (size_t)r;
        if (before < HDR_LEN && io->rdone == HDR_LEN) {
            uint64_t len;
            memcpy(&len, io->rhdr + 8, 8);
            uint32_t rop = get32(io->rhdr), rseq = get32(io->rhdr + 4);
            if (rop != op || rseq != c->seq || len != io->rlen) {
                LOG_E(TAG, "%s #%u: rank %d sent %s #%u of %llu bytes, expected %zu bytes "
                      "(ranks out of step or with different arguments)", op_name(op), c->seq,
                      p, op_name(rop), rseq, (unsigned long long)len, io->rlen);
                return -EBADMSG;
            }
        }
        if (io->rdone == HDR_LEN + io->rlen) io->ron = 0;
    }
    return 0;
}

/* Run the transfers set up in c->io until all are done, an error, or the deadline. */
static int run_io(train_comm *c, uint32_t op, double deadline)
{
    int bad = -1, err = 0;
    for (;;) {
        int n = 0;
        for (int p = 0; p < c->world; p++) {
            if (p == c->rank) continue;
            short ev = 0;
            if (c->io[p].son) ev |= POLLOUT;
            if (c->io[p].ron) ev |= POLLIN;
            if (!ev) continue;
            c->pfd[n].fd = c->fd[p];
            c->pfd[n].events = ev;
            c->pfd[n].revents = 0;
            c->who[n++] = p;
        }
        if (n == 0) return 0;
        int ms = poll_ms(deadline);
        if (ms == 0) {
            err = -ETIMEDOUT;
            bad = c->who[0];
            break;
        }
        int r = poll(c->pfd, (nfds_t)n, ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            err = -errno;
            break;
        }
        for (int i = 0; i < n && !err; i++) {
            short re = c->pfd[i].revents;
            int p = c->who[i];
            if (!re) continue;
            if (re & POLLNVAL) err = -EBADF;
            if (!err && c->io[p].ron && (re & (POLLIN | POLLHUP | POLLERR)))
                err = do_recv(c, p, op);
            if (!err && c->io[p].son && (re & (POLLOUT | POLLHUP | POLLERR))) err = do_send(c, p);
            if (err) bad = p;
        }
        if (err) break;
    }
    if (err == -ETIMEDOUT) {
        /* name a peer that has not finished, the likely culprit */
        for (int p = 0; p < c->world; p++)
            if (p != c->rank && (c->io[p].ron || c->io[p].son)) {
                bad = p;
                break;
            }
        LOG_E(TAG, "%s #%u: timed out after %.1f s waiting for rank %d", op_name(op), c->seq,
              c->timeout_s, bad);
    } else if (err != -EBADMSG) {
        LOG_E(TAG, "%s #%u: connection to rank %d lost: %s", op_name(op), c->seq, bad,
              strerror(-err));
    }
    return poison(c, err);
}

static void clear_io(train_comm *c) { memset(c->io, 0, sizeof *c->io * (size_t)c->world); }

/* ---------------------------------------------------------------- collectives */

/* Offsets of counts (elem bytes each) into c->off; -EINVAL on overflow. */
static int offsets(train_comm *c, const size_t *counts, size_t elem)
{
    size_t o = 0;
    for (int r = 0; r < c->world; r++) {
        c->off[r] = o;
        if (counts[r] > (SIZE_MAX / elem) - o / elem - 1) return -EINVAL;
        o += counts[r] * elem;
    }
    c->off[c->world] = o;
    return 0;
}

/* Slot lo of s (slots of n floats) becomes the tree sum of slots [lo, lo + cnt). */
static void tree_sum(float *s, size_t n, int lo, int cnt)
{
    if (cnt <= 1) return;
    int h = 1;
    while (h * 2 < cnt) h *= 2; /* left subtree: largest power of two below cnt */
    tree_sum(s, n, lo, h);
    tree_sum(s, n, lo + h, cnt - h);
    float *a = s + (size_t)lo * n;
    const float *b = s + (size_t)(lo + h) * n;
    for (size_t i = 0; i < n; i++) a[i] = a[i] + b[i];
}

static int rs_f32(train_comm *c, const float *in, float *out, const size_t *counts,
                  double deadline)
{
    int W = c->world, me = c->rank;
    if (offsets(c, counts, sizeof(float)) < 0) return poison(c, -EINVAL);
    size_t n = counts[me];
    if ((c->off[W] && !in) || (n && !out)) return poison(c, -EINVAL);
    const uint8_t *inb = (const uint8_t *)in;
    c->seq++;
    if (W == 1) {
        if (n && out != in) memmove(out, in, n * sizeof(float));
        return 0;
    }
    if (n > SIZE_MAX / sizeof(float) / (size_t)W) return poison(c, -EINVAL);
    if (c->scratch_cap < n * (size_t)W) {
        float *s = realloc(c->scratch, n * (size_t)W * sizeof(float));
        if (!s) return poison(c, -ENOMEM);
        c->scratch = s;
        c->scratch_cap = n * (size_t)W;
    }
    /* our own contribution first: out may alias it */
    if (n) memcpy(c->scratch + (size_t)me * n, inb + c->off[me], n * sizeof(float));
    clear_io(c);
    for (int p = 0; p < W; p++) {
        if (p == me) continue;
        set_send(c, p, OP_RS, inb ? inb + c->off[p] : NULL, counts[p] * sizeof(float));
        set_recv(c, p, c->scratch + (size_t)p * n, n * sizeof(float));
    }
    int r = run_io(c, OP_RS, deadline);
    if (r < 0) return r;
    if (n) {
        tree_sum(c->scratch, n, 0, W);
        memcpy(out, c->scratch, n * sizeof(float));
    }
    return 0;
}

static int ag_bytes(train_comm *c, const void *in, void *out, const size_t *counts,
                    double deadline)
{
    int W = c->world, me = c->rank;
    if (offsets(c, counts, 1) < 0) return poison(c, -EINVAL);
    if ((counts[me] && !in) || (c->off[W] && !out)) return poison(c, -EINVAL);
    uint8_t *ob = out;
    c->seq++;
    if (counts[me] && (const uint8_t *)in != ob + c->off[me])
        memmove(ob + c->off[me], in, counts[me]);
    if (W == 1) return 0;
    clear_io(c);
    for (int p = 0; p < W; p++) {
        if (p == me) continue;
        set_send(c, p, OP_AG, ob ? ob + c->off[me] : NULL, counts[me]);
        set_recv(c, p, ob ? ob + c->off[p] : NULL, counts[p]);
    }
    return run_io(c, OP_AG, deadline);
}

int train_comm_reduce_scatter_f32(train_comm *c, const float *in, float *out,
                                  const size_t *counts)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (!counts) return poison(c, -EINVAL);
    return rs_f32(c, in, out, counts, clock_now_s() + c->timeout_s);
}

int train_comm_all_reduce_f32(train_comm *c, float *buf, size_t n)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (n && !buf) return poison(c, -EINVAL);
    if (n > SIZE_MAX / sizeof(float)) return poison(c, -EINVAL);
    double deadline = clock_now_s() + c->timeout_s;
    size_t W = (size_t)c->world, me = (size_t)c->rank;
    for (size_t r = 0; r < W; r++) c->counts[r] = n / W + (r < n % W ? 1 : 0);
    size_t mine = me * (n / W) + (me < n % W ? me : n % W); /* first element of our range */
    int ret = rs_f32(c, buf, buf ? buf + mine : NULL, c->counts, deadline);
    if (ret < 0) return ret;
    for (size_t r = 0; r < W; r++) c->counts[r] *= sizeof(float);
    return ag_bytes(c, buf ? buf + mine : NULL, buf, c->counts, deadline);
}

int train_comm_all_gather(train_comm *c, const void *in, void *out, const size_t *counts)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (!counts) return poison(c, -EINVAL);
    return ag_bytes(c, in, out, counts, clock_now_s() + c->timeout_s);
}

int train_comm_broadcast(train_comm *c, void *buf, size_t len, int root)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (root < 0 || root >= c->world || (len && !buf)) return poison(c, -EINVAL);
    double deadline = clock_now_s() + c->timeout_s;
    c->seq++;
    if (c->world == 1) return 0;
    clear_io(c);
    if (c->rank == root) {
        for (int p = 0; p < c->world; p++)
            if (p != root) set_send(c, p, OP_BC, buf, len);
    } else {
        set_recv(c, root, buf, len);
    }
    return run_io(c, OP_BC, deadline);
}

int train_comm_barrier(train_comm *c)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    double deadline = clock_now_s() + c->timeout_s;
    c->seq++;
    if (c->world == 1) return 0;
    clear_io(c);
    for (int p = 0; p < c->world; p++) {
        if (p == c->rank) continue;
        set_send(c, p, OP_BAR, NULL, 0);
        set_recv(c, p, NULL, 0);
    }
    return run_io(c, OP_BAR, deadline);
}

int train_comm_rank(const train_comm *c) { return c ? c->rank : -1; }
int train_comm_world_size(const train_comm *c) { return c ? c->world : -1; }
int train_comm_status(const train_comm *c) { return c ? c->err : -EINVAL; }

/* ---------------------------------------------------------------- set-up */

static int parse_int(const char *s, long lo, long hi, long *out)
{
    if (!s || !*s) return -EINVAL;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -EINVAL;
    *out = v;
    return 0;
}

int train_comm_opts_from_env(train_comm_opts *o)
{
    if (!o) return -EINVAL;
    const char *rs = getenv("RANK"), *ws = getenv("WORLD_SIZE");
    const char *ma = getenv("MASTER_ADDR"), *mp = getenv("MASTER_PORT");
    long rank = 0, world = 1, port = 0;
    if (!rs != !ws) {
        LOG_E(TAG, "RANK and WORLD_SIZE must be set together");
        return -EINVAL;
    }
    if (rs && (parse_int(ws, 1, MAX_WORLD, &world) < 0 || parse_int(rs, 0, world - 1, &rank) < 0)) {
        LOG_E(TAG, "bad RANK or WORLD_SIZE: need 0 <= RANK < WORLD_SIZE <= %d", MAX_WORLD);
        return -EINVAL;
    }
    if (world > 1) {
        if (!ma || !*ma || parse_int(mp, 1, 65535, &port) < 0) {
            LOG_E(TAG, "WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (1..65535)");
            return -EINVAL;
        }
        o->store_host = ma;
        o->store_port = (int)port;
    }
    o->rank = (int)rank;
    o->world_size = (int)world;
    return 0;
}

static void set_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Blocking-style I/O on a non-blocking socket, bounded by deadline. */
static int io_full(int fd, void *buf, size_t len, int sending, double deadline)
{
    size_t done = 0;
    while (done < len) {
        ssize_t r = sending ? send(fd, (uint8_t *)buf + done, len - done, MSG_NOSIGNAL)
                            : recv(fd, (uint8_t *)buf + done, len - done, 0);
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (r == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return lost_errno(errno);
        struct pollfd pf = {fd, sending ? POLLOUT : POLLIN, 0};
        int ms = poll_ms(deadline);
        if (ms == 0) return -ETIMEDOUT;
        if (poll(&pf, 1, ms) < 0 && errno != EINTR) return -errno;
    }
    return 0;
}

static void hello_fill(uint8_t *h, int from, int to, int world, const uint8_t *secret)
{
    put32(h, HELLO_MAGIC);
    put32(h + 4, HELLO_VERSION);
    put32(h + 8, (uint32_t)from);
    put32(h + 12, (uint32_t)to);
    put32(h + 16, (uint32_t)world);
    memcpy(h + 20, secret, SECRET_LEN);
}

/* Constant-time check of a received hello; from is returned in *from. */
static int hello_ok(const uint8_t *h, int to, int world, const uint8_t *secret, int *from)
{
    unsigned diff = 0;
    for (int i = 0; i < SECRET_LEN; i++) diff |= (unsigned)(h[20 + i] ^ secret[i]);
    *from = (int)get32(h + 8);
    return get32(h) == HELLO_MAGIC && get32(h + 4) == HELLO_VERSION &&
           get32(h + 12) == (uint32_t)to && get32(h + 16) == (uint32_t)world && diff == 0;
}

static int open_listener(const char *host, int *fd_out, int *port_out)
{
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
    int g = getaddrinfo(host, "0", &hints, &ai);
    if (g != 0) {
        LOG_E(TAG, "listen address '%s': %s", host, gai_strerror(g));
        return -EINVAL;
    }
    int ret = 0;
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        ret = -errno;
        goto out;
    }
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
        ret = -errno;
        goto out;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
        ret = -errno;
        goto out;
    }
    *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
out:
    if (ret < 0) {
        LOG_E(TAG, "listen on %s: %s", host, strerror(-ret));
        if (fd >= 0) close(fd);
        fd = -1;
    }
    *fd_out = fd;
    freeaddrinfo(ai);
    return ret;
}

/* Connect to host:port, retrying refused connections until the deadline. */
static int connect_peer(const char *host, const char *port, double deadline, int *fd_out)
{
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    if (getaddrinfo(host, port, &hints, &ai) != 0) return -EBADMSG;
    int ret;
    for (;;) {
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            ret = -errno;
            break;
        }
        ret = 0;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
            ret = -errno;
            if (ret == -EINPROGRESS) {
                struct pollfd pf = {fd, POLLOUT, 0};
                int ms = poll_ms(deadline), pr = ms ? poll(&pf, 1, ms) : 0;
                int e = 0;
                socklen_t el = sizeof e;
                if (pr <= 0) ret = -ETIMEDOUT;
                else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) < 0) ret = -errno;
                else ret = -e;
            }
        }
        if (ret == 0) {
            *fd_out = fd;
            break;
        }
        close(fd);
        if (ret == -ETIMEDOUT || clock_now_s() >= deadline) {
            ret = -ETIMEDOUT;
            break;
        }
        if (ret != -ECONNREFUSED && ret != -EAGAIN && ret != -EINTR) break;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(ai);
    return ret;
}

static int store_err(int r, const char *what)
{
    LOG_E(TAG, "store %s: %s", what, strerror(-r));
    return r;
}

/* Rendezvous through the store and open the mesh. */
static int mesh_setup(train_comm *c, const train_comm_opts *o)
{
    double deadline = clock_now_s() + o->connect_timeout_s;
    elastic_store_client *st = NULL;
    int lfd = -1, port = 0, ret;
    char key[PREFIX_MAX + 32], val[128];
    uint8_t secret[SECRET_LEN], hello[HELLO_LEN], reply[HELLO_LEN];
    void *v = NULL;
    size_t vlen = 0;

    char local[NI_MAXHOST];
    ret = elastic_store_connect(&st, o->store_host, o->store_port, o->store_token,
                                o->connect_timeout_s);
    if (ret < 0) {
        store_err(ret, "connect");
        goto out;
    }
    /* No listen host given: the address this rank reaches the store from, i.e. the interface
     * the other nodes reach this one through (127.0.0.1 when the store is on loopback). A
     * fixed 127.0.0.1 would be published to ranks on other hosts, which then connect to
     * their own loopback. */
    const char *listen_host = o->listen_host;
    if (!listen_host) {
        ret = elastic_store_local_addr(st, local, sizeof local);
        if (ret < 0) {
            LOG_E(TAG, "cannot read the local address of the store connection: %s",
                  strerror(-ret));
            goto out;
        }
        listen_host = local;
    }
    ret = open_listener(listen_host, &lfd, &port);
    if (ret < 0) goto out;
    /* the job secret: every rank proposes one, the first to arrive wins */
    if (getrandom(secret, sizeof secret, 0) != (ssize_t)sizeof secret) {
        ret = -EIO;
        LOG_E(TAG, "getrandom failed");
        goto out;
    }
    snprintf(key, sizeof key, "%s/secret", o->prefix);
    ret = elastic_store_compare_set(st, key, NULL, 0, secret, sizeof secret, &v, &vlen);
    if (ret < 0) {
        store_err(ret, "secret");
        goto out;
    }
    if (vlen != SECRET_LEN) {
        LOG_E(TAG, "store key %s has a malformed value", key);
        ret = -EBADMSG;
        goto out;
    }
    memcpy(secret, v, SECRET_LEN);
    free(v);
    v = NULL;

    const char *pub = listen_host;
    if (!strcmp(pub, "0.0.0.0")) pub = "127.0.0.1";
    else if (!strcmp(pub, "::")) pub = "::1";
    snprintf(key, sizeof key, "%s/addr/%d", o->prefix, c->rank);
    int vl = snprintf(val, sizeof val, "%s %d", pub, port);
    /* compare-and-set: a second process claiming the same rank (a duplicated RANK, or two
     * jobs on one MASTER_ADDR:MASTER_PORT) is refused instead of silently replacing us */
    ret = elastic_store_compare_set(st, key, NULL, 0, val, (size_t)vl, &v, &vlen);
    if (ret < 0) {
        store_err(ret, "publish");
        goto out;
    }
    if (vlen != (size_t)vl || memcmp(v, val, (size_t)vl) != 0) {
        LOG_E(TAG, "rank %d has already joined this group at %s:%d: a duplicated RANK, or two "
              "jobs on one MASTER_ADDR:MASTER_PORT", c->rank, o->store_host, o->store_port);
        ret = -EEXIST;
        goto out;
    }
    free(v);
    v = NULL;
    LOG_D(TAG, "rank %d published its address %s in the store at %s:%d", c->rank, val,
          o->store_host, o->store_port);

    /* connect to every lower rank */
    for (int i = 0; i < c->rank; i++) {
        double left = deadline - clock_now_s();
        snprintf(key, sizeof key, "%s/addr/%d", o->prefix, i);
        ret = left > 0 ? elastic_store_get(st, key, &v, &vlen, left) : -ETIMEDOUT;
        if (ret < 0) {
            LOG_E(TAG, "rank %d did not publish its address: %s", i, strerror(-ret));
            goto out;
        }
        char host[100], ps[16];
        if (vlen >= sizeof val || sscanf((char *)v, "%99s %15s", host, ps) != 2) {
            LOG_E(TAG, "store key %s has a malformed value", key);
            ret = -EBADMSG;
            goto out;
        }
        free(v);
        v = NULL;
        ret = connect_peer(host, ps, deadline, &c->fd[i]);
        if (ret < 0) {
            LOG_E(TAG, "connect to rank %d at %s port %s: %s", i, host, ps, strerror(-ret));
            goto out;
        }
        set_nodelay(c->fd[i]);
        hello_fill(hello, c->rank, i, c->world, secret);
        int from = -1;
        ret = io_full(c->fd[i], hello, HELLO_LEN, 1, deadline);
        if (ret == 0) ret = io_full(c->fd[i], reply, HELLO_LEN, 0, deadline);
        if (ret == 0 && (!hello_ok(reply, c->rank, c->world, secret, &from) || from != i))
            ret = -EBADMSG;
        if (ret < 0) {
            LOG_E(TAG, "hello with rank %d: %s", i, strerror(-ret));
            goto out;
        }
    }

    /* accept every higher rank; strays and impostors are closed and not counted. Once a
     * second, check that the store is still there: when its host (rank 0 without a launcher)
     * gave up, nobody will come, and waiting for the deadline would only delay the error. */
    double next_check = clock_now_s() + 1.0;
    for (int need = c->world - 1 - c->rank; need > 0;) {
        struct pollfd pf = {lfd, POLLIN, 0};
        int ms = poll_ms(deadline);
        if (ms == 0) {
            ret = -ETIMEDOUT;
            LOG_E(TAG, "%d higher rank(s) did not connect within %.0f s", need,
                  o->connect_timeout_s);
            goto out;
        }
        if (clock_now_s() >= next_check) {
            next_check = clock_now_s() + 1.0;
            snprintf(key, sizeof key, "%s/addr/%d", o->prefix, c->rank);
            ret = elastic_store_get(st, key, &v, &vlen, 0);
            free(v);
            v = NULL;
            if (ret < 0) {
                LOG_E(TAG, "the store at %s:%d went away while %d higher rank(s) were still "
                      "joining: %s", o->store_host, o->store_port, need, strerror(-ret));
                goto out;
            }
        }
        if (ms > 1000) ms = 1000;
        if (poll(&pf, 1, ms) <= 0) continue;
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) continue;
        /* a stray client gets at most 5 s to say hello */
        double hd = fmin(deadline, clock_now_s() + 5.0);
        int from = -1;
        int r = io_full(fd, hello, HELLO_LEN, 0, hd);
        if (r == 0 && (!hello_ok(hello, c->rank, c->world, secret, &from) || from <= c->rank ||
                       from >= c->world || c->fd[from] >= 0))
            r = -EBADMSG;
        if (r == 0) {
            hello_fill(reply, c->rank, from, c->world, secret);
            r = io_full(fd, reply, HELLO_LEN, 1, hd);
        }
        if (r < 0) {
            LOG_W(TAG, "refused a connection with a bad hello: %s", strerror(-r));
            close(fd);
            continue;
        }
        set_nodelay(fd);
        c->fd[from] = fd;
        need--;
    }
    ret = 0;
out:
    memset(secret, 0, sizeof secret); /* DESIGN I6: no copies of the secret left behind */
    memset(hello, 0, sizeof hello);
    memset(reply, 0, sizeof reply);
    free(v);
    elastic_store_close(st);
    if (lfd >= 0) close(lfd);
    return ret;
}

int train_comm_init(train_comm **out, const train_comm_opts *o)
{
    if (!out || !o) return -EINVAL;
    *out = NULL;
    if (o->world_size < 1 || o->world_size > MAX_WORLD || o->rank < 0 ||
        o->rank >= o->world_size || !(o->timeout_s > 0 && o->timeout_s <= 86400) ||
        !(o->connect_timeout_s > 0 && o->connect_timeout_s <= 86400)) {
        LOG_E(TAG, "bad options: rank %d, world size %d, timeouts %g/%g s", o->rank,
              o->world_size, o->timeout_s, o->connect_timeout_s);
        return -EINVAL;
    }
    if (o->world_size > 1 &&
        (!o->store_host || !*o->store_host || o->store_port < 1 || o->store_port > 65535 ||
         !o->prefix || !*o->prefix || strlen(o->prefix) > PREFIX_MAX)) {
        LOG_E(TAG, "bad options: store address and prefix (1..%d bytes) needed", PREFIX_MAX);
        return -EINVAL;
    }
    train_comm *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    int W = o->world_size;
    c->rank = o->rank;
    c->world = W;
    c->timeout_s = o->timeout_s;
    c->fd = malloc(sizeof *c->fd * (size_t)W);
    c->io = calloc((size_t)W, sizeof *c->io);
    c->off = malloc(sizeof *c->off * ((size_t)W + 1));
    c->counts = malloc(sizeof *c->counts * (size_t)W);
    c->pfd = malloc(sizeof *c->pfd * (size_t)W);
    c->who = malloc(sizeof *c->who * (size_t)W);
    if (!c->fd || !c->io || !c->off || !c->counts || !c->pfd || !c->who) {
        train_comm_free(c);
        return -ENOMEM;
    }
    for (int p = 0; p < W; p++) c->fd[p] = -1;
    if (W > 1) {
        int r = mesh_setup(c, o);
        if (r < 0) {
            train_comm_free(c);
            return r;
        }
    }
    *out = c;
    return 0;
}

void train_comm_free(train_comm *c)
{
    if (!c) return;
    if (c->fd)
        for (int p = 0; p < c->world; p++)
            if (c->fd[p] >= 0) close(c->fd[p]);
    free(c->fd);
    free(c->io);
    free(c->off);
    free(c->counts);
    free(c->pfd);
    free(c->who);
    free(c->scratch);
    free(c);
}

int train_comm_probe(train_comm *c)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    int n = 0;
    for (int p = 0; p < c->world; p++) {
        if (c->fd[p] < 0) continue;
        c->pfd[n].fd = c->fd[p];
        c->pfd[n].events = POLLRDHUP;
        c->pfd[n].revents = 0;
        c->who[n] = p;
        n++;
    }
    if (n == 0) return 0;
    int r = poll(c->pfd, (nfds_t)n, 0);
    if (r <= 0) return 0;
    for (int i = 0; i < n; i++)
        if (c->pfd[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
            LOG_E(TAG, "rank %d: the connection to rank %d is gone", c->rank, c->who[i]);
            return poison(c, -ECONNRESET);
        }
    return 0;
}
