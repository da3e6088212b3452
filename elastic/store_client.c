/* store_client.c - the key-value store client: one request in flight per handle, every
 * socket wait bounded by a deadline (poll on a non-blocking socket).
 *
 * A call that gives up while waiting for its answer leaves the connection usable: the late
 * answer is recognised by its request id and skipped by the next call, and a partly received
 * frame stays buffered. Only a request that was partly sent (or a malformed answer) leaves
 * the byte stream unusable; the handle then drops the connection.
 */
#include "store.h"

#include "elastic_internal.h"

#include <errno.h>
#include <pthread.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define IBUF_MIN 4096u

struct elastic_store_client {
    int fd;
    pthread_mutex_t fd_mu; /* guards fd's close against elastic_store_interrupt, which
                              another thread calls: no shutdown of a closed (or reused) fd */
    int err;          /* sticky: the connection is gone; every call returns it */
    double timeout_s; /* deadline of the quick operations */
    uint32_t next_id;
    uint32_t max_key, max_value; /* the server's limits, from its hello answer */
    uint64_t req_limit;          /* largest request len the server takes */
    uint64_t resp_limit;         /* largest response len accepted */
    uint8_t *ibuf;
    size_t ilen, icap;
    size_t ihead; /* bytes of the last answer, dropped at the next call */
};

static int status_errno(uint8_t st)
{
    switch (st) {
    case ES_ST_OK: return 0;
    case ES_ST_TIMEDOUT: return -ETIMEDOUT;
    case ES_ST_DENIED: return -EACCES;
    case ES_ST_VERSION: return -EPROTONOSUPPORT;
    case ES_ST_TOOBIG: return -EMSGSIZE;
    case ES_ST_INVALID: return -EINVAL;
    case ES_ST_NOTFOUND: return -ENOENT;
    case ES_ST_RANGE: return -ERANGE;
    case ES_ST_NOMEM: return -ENOMEM;
    default: return -EBADMSG;
    }
}

/* Drop the connection; later calls return `sticky`; this one returns `ret`. */
static int drop(elastic_store_client *c, int ret, int sticky)
{
    pthread_mutex_lock(&c->fd_mu);
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    pthread_mutex_unlock(&c->fd_mu);
    if (!c->err) c->err = sticky;
    return ret;
}

/* The connection failed with errno e: EPIPE stays -EPIPE; ECONNRESET, ECONNABORTED, an end
 * of file, a keepalive ETIMEDOUT, EHOSTUNREACH...: all mean "the server is gone". */
static int lost(elastic_store_client *c, int e)
{
    int code = e == EPIPE ? -EPIPE : -ECONNRESET;
    return drop(c, code, code);
}

/* Wait until fd is ready for ev or the deadline passes: 0 or -ETIMEDOUT. */
static int wait_fd(int fd, short ev, double deadline)
{
    for (;;) {
        double left = deadline - clock_now_s();
        if (left <= 0) return -ETIMEDOUT;
        double ms = es_ceil(left * 1e3);
        struct pollfd p = {.fd = fd, .events = ev};
        int n = poll(&p, 1, ms > INT_MAX ? INT_MAX : (int)ms);
        if (n > 0) return 0; /* ready, or an error the next I/O call reports */
        if (n < 0 && errno != EINTR) return -errno;
    }
}

static int send_all(elastic_store_client *c, struct iovec *iov, int niov, double deadline)
{
    int started = 0;
    while (niov > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t n = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int r = wait_fd(c->fd, POLLOUT, deadline);
                if (r) return started ? drop(c, r, -ECONNRESET) : r;
                continue;
            }
            return lost(c, errno);
        }
        started = 1;
        size_t done = (size_t)n;
        while (niov > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return 0;
}

static int ibuf_reserve(elastic_store_client *c, size_t need)
{
    if (need <= c->icap) return 0;
    uint8_t *b = realloc(c->ibuf, need);
    if (!b) return -ENOMEM;
    c->ibuf = b;
    c->icap = need;
    return 0;
}

static void ibuf_consume(elastic_store_client *c, size_t n)
{
    memmove(c->ibuf, c->ibuf + n, c->ilen - n);
    c->ilen -= n;
}

/* Receive the answer to request (op, id); *body and *blen point into the buffer until the next
 * call. Answers to earlier requests that timed out are skipped. */
static int recv_answer(elastic_store_client *c, uint8_t op, uint32_t id, double deadline,
                       const uint8_t **body, uint32_t *blen)
{
    for (;;) {
        size_t need = IBUF_MIN;
        if (c->ilen >= 4) {
            uint32_t flen = es_get_u32(c->ibuf);
            if (flen < 6 || flen > c->resp_limit) return drop(c, -EBADMSG, -ECONNRESET);
            if (c->ilen >= 4 + (size_t)flen) {
                uint32_t rid = es_get_u32(c->ibuf + 5);
                if (rid != id) { /* a late answer to a request that timed out */
                    ibuf_consume(c, 4 + (size_t)flen);
                    continue;
                }
                if (c->ibuf[4] != (uint8_t)(op | ES_RESP)) return drop(c, -EBADMSG, -ECONNRESET);
                *body = c->ibuf + ES_HDR;
                *blen = flen - 5;
                c->ihead = 4 + (size_t)flen;
                return 0;
            }
            if (4 + (size_t)flen > need) need = 4 + (size_t)flen;
        }
        if (ibuf_reserve(c, need)) return -ENOMEM; /* nothing lost: the bytes stay buffered */
        ssize_t n = recv(c->fd, c->ibuf + c->ilen, c->icap - c->ilen, MSG_DONTWAIT);
        if (n > 0) {
            c->ilen += (size_t)n;
            continue;
        }
        if (n == 0) return lost(c, ECONNRESET);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = wait_fd(c->fd, POLLIN, deadline);
            if (r) return r; /* a partial answer stays buffered for the next call */
            continue;
        }
        return lost(c, errno);
    }
}

/* Send op with the body in iov[1..niov-1] (iov[0] is filled here with the header), receive
 * its answer and map its status. On 0 (and on a status error) *res reads the result. */
static int call(elastic_store_client *c, uint8_t op, struct iovec *iov, int niov,
                double deadline, es_reader *res)
{
    if (c->err) return c->err;
    if (c->ihead) {
        ibuf_consume(c, c->ihead);
        c->ihead = 0;
    }
    uint64_t body = 0;
    for (int i = 1; i < niov; i++) body += iov[i].iov_len;
    if (5 + body > c->req_limit) return -EMSGSIZE;
    uint8_t hdr[ES_HDR];
    uint32_t id = c->next_id++;
    es_put_u32(hdr, (uint32_t)(5 + body));
    hdr[4] = op;
    es_put_u32(hdr + 5, id);
    iov[0] = (struct iovec){.iov_base = hdr, .iov_len = ES_HDR};
    int r = send_all(c, iov, niov, deadline);
    if (r) return r;
    const uint8_t *b;
    uint32_t bl;
    r = recv_answer(c, op, id, deadline, &b, &bl);
    if (r) return r;
    *res = (es_reader){b + 1, bl - 1, 0};
    return status_errno(b[0]);
}

/* Length of key, checked against the server's limit: > 0, or -EINVAL / -EMSGSIZE. */
static long key_len(const elastic_store_client *c, const char *key)
{
    size_t n = strnlen(key, (size_t)c->max_key + 1);
    if (n == 0) return -EINVAL;
    if (n > c->max_key) return -EMSGSIZE;
    return (long)n;
}

static uint32_t wait_ms(double timeout_s)
{
    double ms = es_ceil(timeout_s * 1e3);
    return ms >= (double)UINT32_MAX ? UINT32_MAX - 1 : (uint32_t)ms;
}

/* Deadline of a waiting call: its own timeout, or the handle's for a single check. */
static double wait_deadline(const elastic_store_client *c, double timeout_s)
{
    return clock_now_s() + (timeout_s > 0 ? timeout_s : c->timeout_s);
}

/* Copy a bytes result into a malloc'ed, NUL-terminated buffer. */
static int take_value(elastic_store_client *c, es_reader *r, void **out, size_t *len)
{
    uint32_t n;
    const uint8_t *v = es_rd_bytes(r, &n);
    if (r->bad || r->left) return drop(c, -EBADMSG, -ECONNRESET);
    if (!out) return 0;
    uint8_t *p = malloc((size_t)n + 1);
    if (!p) return -ENOMEM;
    if (n) memcpy(p, v, n);
    p[n] = 0;
    *out = p;
    if (len) *len = n;
    return 0;
}

/* ------------------------------------------------------------------ connect */

static int try_connect(elastic_store_client *c, const char *host, int port, double deadline)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int g = getaddrinfo(host, ps, &hints, &res);
    if (g != 0) return g == EAI_MEMORY ? -ENOMEM : -EHOSTUNREACH;
    int err = -ECONNREFUSED;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = -errno;
            continue;
        }
        int r = connect(fd, a->ai_addr, a->ai_addrlen);
        if (r < 0 && errno == EINPROGRESS) {
            r = wait_fd(fd, POLLOUT, deadline);
            if (r == 0) {
                int so = 0;
                socklen_t sl = sizeof so;
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl) != 0) so = errno;
                r = so ? -1 : 0;
                errno = so;
            } else {
                errno = -r;
                r = -1;
            }
        }
        if (r == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            c->fd = fd;
            err = 0;
            break;
        }
        err = -errno;
        close(fd);
    }
    freeaddrinfo(res);
    return err;
}

static int hello(elastic_store_client *c, const char *token, double deadline)
{
    size_t tn = token ? strlen(token) : 0;
    uint8_t f[10];
    memcpy(f, ES_MAGIC, 4);
    es_put_u16(f + 4, ELASTIC_STORE_PROTOCOL_VERSION);
    es_put_u32(f + 6, (uint32_t)tn);
    struct iovec iov[3] = {{0}, {f, sizeof f}, {(void *)token, tn}};
    c->req_limit = ELASTIC_STORE_HELLO_MAX;
    c->resp_limit = 64;
    es_reader r;
    int err = call(c, ES_OP_HELLO, iov, 3, deadline, &r);
    if (err) return err;
    uint16_t version = es_rd_u16(&r);
    c->max_key = es_rd_u32(&r);
    c->max_value = es_rd_u32(&r);
    if (r.bad || r.left || version != ELASTIC_STORE_PROTOCOL_VERSION || c->max_key < 1 ||
        c->max_key > 65536 || c->max_value < 1 || c->max_value > (256u << 20))
        return drop(c, -EBADMSG, -ECONNRESET);
    c->req_limit = es_frame_limit(c->max_key, c->max_value);
    c->resp_limit = 64 + (uint64_t)c->max_value;
    return 0;
}

int elastic_store_connect(elastic_store_client **out, const char *host, int port,
                          const char *token, double timeout_s)
{
    if (!out) return -EINVAL;
    *out = NULL;
    if (!host || !*host || port < 1 || port > 65535 || !(timeout_s > 0) ||
        (token && strlen(token) > ELASTIC_STORE_TOKEN_MAX))
        return -EINVAL;
    double deadline = clock_now_s() + timeout_s, pause = 0.01;
    elastic_store_client *c = NULL;
    int err;
    for (;;) {
        c = calloc(1, sizeof *c);
        if (!c) return -ENOMEM;
        c->fd = -1;
        pthread_mutex_init(&c->fd_mu, NULL);
        c->timeout_s = timeout_s;
        c->next_id = 1;
        err = try_connect(c, host, port, deadline);
        if (!err) err = hello(c, token, deadline);
        if (!err) break;
        elastic_store_close(c);
        c = NULL;
        /* Refusals are final; a server that is not there (yet), or that closed the
         * connection during the hello (restarting, full), is tried again. */
        if (err == -EACCES || err == -EPROTONOSUPPORT || err == -EBADMSG || err == -ENOMEM)
            return err;
        double left = deadline - clock_now_s();
        if (left <= 0) return -ETIMEDOUT;
        double nap = pause < left ? pause : left;
        struct timespec ts = {(time_t)nap, (long)((nap - (double)(time_t)nap) * 1e9)};
        nanosleep(&ts, NULL);
        pause = pause * 2 > 0.1 ? 0.1 : pause * 2;
    }
    *out = c;
    return 0;
}

void elastic_store_close(elastic_store_client *c)
{
    if (!c) return;
    if (c->fd >= 0) close(c->fd);
    pthread_mutex_destroy(&c->fd_mu);
    free(c->ibuf);
    free(c);
}

/* ------------------------------------------------------------------ operations */

int elastic_store_set(elastic_store_client *c, const char *key, const void *value, size_t len)
{
    if (!c || !key || (!value && len)) return -EINVAL;
    long kn = key_len(c, key);
    if (kn < 0) return (int)kn;
    if (len > c->max_value) return -EMSGSIZE;
    uint8_t kl[4], vl[4];
    es_put_u32(kl, (uint32_t)kn);
    es_put_u32(vl, (uint32_t)len);
    struct iovec iov[5] = {{0}, {kl, 4}, {(void *)key, (size_t)kn}, {vl, 4}, {(void *)value, len}};
    es_reader r;
    return call(c, ES_OP_SET, iov, 5, clock_now_s() + c->timeout_s, &r);
}

int elastic_store_get(elastic_store_client *c, const char *key, void **value_out,
                      size_t *len_out, double timeout_s)
{
    if (value_out) *value_out = NULL;
    if (len_out) *len_out = 0;
    if (!c || !key || !value_out || !len_out || !(timeout_s >= 0)) return -EINVAL;
    long kn = key_len(c, key);
    if (kn < 0) return (int)kn;
    uint8_t f[8];
    es_put_u32(f, wait_ms(timeout_s));
    es_put_u32(f + 4, (uint32_t)kn);
    struct iovec iov[3] = {{0}, {f, 8}, {(void *)key, (size_t)kn}};
    es_reader r;
    int err = call(c, ES_OP_GET, iov, 3, wait_deadline(c, timeout_s), &r);
    if (err) return err;
    return take_value(c, &r, value_out, len_out);
}

int elastic_store_wait(elastic_store_client *c, const char *const keys[], size_t n,
                       double timeout_s)
{
    if (!c || !keys || n == 0 || !(timeout_s >= 0)) return -EINVAL;
    uint64_t body = 8;
    for (size_t i = 0; i < n; i++) {
        if (!keys[i]) return -EINVAL;
        long kn = key_len(c, keys[i]);
        if (kn < 0) return (int)kn;
        body += 4 + (uint64_t)kn;
        if (5 + body > c->req_limit || n > UINT32_MAX) return -EMSGSIZE;
    }
    uint8_t *b = malloc(body), *p = b;
    if (!b) return -ENOMEM;
    es_put_u32(p, wait_ms(timeout_s));
    es_put_u32(p + 4, (uint32_t)n);
    p += 8;
    for (size_t i = 0; i < n; i++) {
        size_t kn = strlen(keys[i]);
        es_put_u32(p, (uint32_t)kn);
        memcpy(p + 4, keys[i], kn);
        p += 4 + kn;
    }
    struct iovec iov[2] = {{0}, {b, body}};
    es_reader r;
    int err = call(c, ES_OP_WAIT, iov, 2, wait_deadline(c, timeout_s), &r);
    free(b);
    return err;
}

int elastic_store_add(elastic_store_client *c, const char *key, int64_t delta,
                      int64_t *new_value)
{
    if (!c || !key) return -EINVAL;
    long kn = key_len(c, key);
    if (kn < 0) return (int)kn;
    uint8_t f[12];
    es_put_u64(f, (uint64_t)delta);
    es_put_u32(f + 8, (uint32_t)kn);
    struct iovec iov[3] = {{0}, {f, 12}, {(void *)key, (size_t)kn}};
    es_reader r;
    int err = call(c, ES_OP_ADD, iov, 3, clock_now_s() + c->timeout_s, &r);
    if (err) return err;
    int64_t v = (int64_t)es_rd_u64(&r);
    if (r.bad || r.left) return drop(c, -EBADMSG, -ECONNRESET);
    if (new_value) *new_value = v;
    return 0;
}

int elastic_store_compare_set(elastic_store_client *c, const char *key, const void *expected,
                              size_t expected_len, const void *desired, size_t desired_len,
                              void **actual_out, size_t *actual_len)
{
    if (actual_out) *actual_out = NULL;
    if (actual_len) *actual_len = 0;
    if (!c || !key || (!expected && expected_len) || (!desired && desired_len) ||
        (!actual_out) != (!actual_len))
        return -EINVAL;
    long kn = key_len(c, key);
    if (kn < 0) return (int)kn;
    if (expected_len > c->max_value || desired_len > c->max_value) return -EMSGSIZE;
    uint8_t kl[4], el[4], dl[4];
    es_put_u32(kl, (uint32_t)kn);
    es_put_u32(el, (uint32_t)expected_len);
    es_put_u32(dl, (uint32_t)desired_len);
    struct iovec iov[7] = {{0},
                           {kl, 4},
                           {(void *)key, (size_t)kn},
                           {el, 4},
                           {(void *)expected, expected_len},
                           {dl, 4},
                           {(void *)desired, desired_len}};
    es_reader r;
    int err = call(c, ES_OP_CAS, iov, 7, clock_now_s() + c->timeout_s, &r);
    if (err) return err;
    return take_value(c, &r, actual_out, actual_len);
}

int elastic_store_delete(elastic_store_client *c, const char *key)
{
    if (!c || !key) return -EINVAL;
    long kn = key_len(c, key);
    if (kn < 0) return (int)kn;
    uint8_t kl[4];
    es_put_u32(kl, (uint32_t)kn);
    struct iovec iov[3] = {{0}, {kl, 4}, {(void *)key, (size_t)kn}};
    es_reader r;
    int err = call(c, ES_OP_DELETE, iov, 3, clock_now_s() + c->timeout_s, &r);
    if (err) return err;
    uint8_t existed = es_rd_u8(&r);
    if (r.bad || r.left || existed > 1) return drop(c, -EBADMSG, -ECONNRESET);
    return existed;
}

int elastic_store_local_addr(const elastic_store_client *c, char *host, size_t host_len)
{
    if (!c || !host || host_len == 0) return -EINVAL;
    if (c->fd < 0) return -ENOTCONN;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(c->fd, (struct sockaddr *)&ss, &sl) != 0) return -errno;
    char buf[NI_MAXHOST];
    int g = getnameinfo((struct sockaddr *)&ss, sl, buf, sizeof buf, NULL, 0, NI_NUMERICHOST);
    if (g != 0) return g == EAI_SYSTEM ? -errno : -EINVAL;
    if (strlen(buf) >= host_len) return -ENAMETOOLONG;
    memcpy(host, buf, strlen(buf) + 1);
    return 0;
}

void elastic_store_interrupt(elastic_store_client *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->fd_mu);
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_unlock(&c->fd_mu);
}
