/* The worker's client of the agents' memory-tier servers (mem_client.h; wire: mem_wire.h). */
#include "mem_client.h"

#include "clock.h"
#include "mem_wire.h"
#include "shmseg.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

struct elastic_mem_client {
    char addr[128];
    char host[80];
    char port[16];
    char *token;
    size_t token_len;
    double timeout_s;
};

int elastic_mem_client_open(elastic_mem_client **out, const char *addr, const char *token,
                            double timeout_s)
{
    if (out) *out = NULL;
    if (!out || !addr || !(timeout_s > 0 && timeout_s <= 3600) || strlen(addr) >= 128) return -EINVAL;
    size_t tl = token ? strlen(token) : 0;
    if (tl > MEMQ_TOKEN_MAX) return -EINVAL;
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || !colon[1] || strlen(colon + 1) >= 16) return -EINVAL;
    size_t hl = (size_t)(colon - addr);
    const char *h = addr;
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl == 0 || hl >= 80) return -EINVAL;
    elastic_mem_client *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    memcpy(c->host, h, hl);
    c->host[hl] = '\0';
    strcpy(c->port, colon + 1);
    strcpy(c->addr, addr);
    if (tl && !(c->token = malloc(tl))) {
        free(c);
        return -ENOMEM;
    }
    if (tl) memcpy(c->token, token, tl);
    c->token_len = tl;
    c->timeout_s = timeout_s;
    /* the address must be numeric and resolve now: a typo is -EINVAL here, not a timeout later */
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    if (getaddrinfo(c->host, c->port, &hints, &res) != 0 || !res) {
        elastic_mem_client_close(c);
        return -EINVAL;
    }
    freeaddrinfo(res);
    *out = c;
    return 0;
}

void elastic_mem_client_close(elastic_mem_client *c)
{
    if (!c) return;
    if (c->token) {
        explicit_bzero(c->token, c->token_len);
        free(c->token);
    }
    free(c);
}

const char *elastic_mem_client_addr(const elastic_mem_client *c) { return c ? c->addr : NULL; }

/* Wait for ev on fd at most timeout_s. */
static int wait_io(int fd, short ev, double timeout_s)
{
    double deadline = clock_now_s() + timeout_s;
    for (;;) {
        double left = deadline - clock_now_s();
        if (left <= 0) return -ETIMEDOUT;
        struct pollfd p = {fd, ev, 0};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r > 0) return (p.revents & (POLLERR | POLLNVAL)) && !(p.revents & ev) ? -ECONNRESET : 0;
        if (r < 0 && errno != EINTR) return -errno;
    }
}

static int send_all(const elastic_mem_client *c, int fd, const void *buf, size_t n)
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
        int rc = wait_io(fd, POLLOUT, c->timeout_s);
        if (rc < 0) return rc;
    }
    return 0;
}

static int recv_all(const elastic_mem_client *c, int fd, void *buf, size_t n)
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
        if (errno != EAGAIN) return -ECONNRESET;
        int rc = wait_io(fd, POLLIN, c->timeout_s);
        if (rc < 0) return rc;
    }
    return 0;
}

static int connect_to(const elastic_mem_client *c)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    if (getaddrinfo(c->host, c->port, &hints, &res) != 0 || !res) return -EINVAL;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = fd < 0 ? -errno : 0;
    if (rc == 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
        rc = errno == EINPROGRESS ? 0 : -errno;
        if (rc == 0 && (rc = wait_io(fd, POLLOUT, c->timeout_s)) == 0) {
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

static int status_errno(uint32_t st)
{
    switch (st) {
    case MEMQ_ST_OK: return 0;
    case MEMQ_ST_DENIED: return -EACCES;
    case MEMQ_ST_STALE: return -ESTALE;
    case MEMQ_ST_NOENT: return -ENOENT;
    case MEMQ_ST_RANGE: return -ERANGE;
    case MEMQ_ST_LOCAL: return -EIO;
    default: return -EPROTO;
    }
}

/* One request; on OK the connection is left open for the body (*fd_out, body_len). */
static int request(const elastic_mem_client *c, uint32_t op, const elastic_mem_slot *w, uint64_t off,
                   uint64_t len, int *fd_out, uint64_t *body_len)
{
    int fd = connect_to(c);
    if (fd < 0) return fd;
    unsigned char req[12 + MEMQ_TOKEN_MAX + MEMQ_REQ_BYTES];
    memset(req, 0, sizeof req);
    memcpy(req, MEMQ_MAGIC, 4);
    put32(req + 4, MEMQ_VERSION);
    put32(req + 8, (uint32_t)c->token_len);
    size_t k = 12;
    if (c->token_len) memcpy(req + k, c->token, c->token_len);
    k += c->token_len;
    put32(req + k, op);
    if (w) {
        put32(req + k + 4, w->kind);
        put64(req + k + 48, w->agent);
        put32(req + k + 12, w->local);
        put32(req + k + 16, w->slot);
        put64(req + k + 24, w->seq);
    }
    put64(req + k + 32, off);
    put64(req + k + 40, len);
    k += MEMQ_REQ_BYTES;
    int rc = send_all(c, fd, req, k);
    explicit_bzero(req, sizeof req);
    unsigned char ans[MEMQ_ANS_BYTES];
    if (rc == 0) rc = recv_all(c, fd, ans, sizeof ans);
    if (rc == 0) rc = status_errno(get32(ans));
    if (rc < 0) {
        close(fd);
        return rc;
    }
    *body_len = get64(ans + 8);
    *fd_out = fd;
    return 0;
}

int elastic_mem_client_list(elastic_mem_client *c, elastic_mem_slot **out, size_t *n)
{
    if (out) *out = NULL;
    if (n) *n = 0;
    if (!c || !out || !n) return -EINVAL;
    int fd;
    uint64_t bl;
    int rc = request(c, MEMQ_OP_LIST, NULL, 0, 0, &fd, &bl);
    if (rc < 0) return rc;
    if (bl % MEMQ_ENTRY_BYTES || bl / MEMQ_ENTRY_BYTES > MEMQ_LIST_MAX) {
        close(fd);
        return -EPROTO;
    }
    size_t cnt = (size_t)(bl / MEMQ_ENTRY_BYTES);
    elastic_mem_slot *v = cnt ? calloc(cnt, sizeof *v) : NULL;
    unsigned char *e = malloc(MEMQ_ENTRY_BYTES);
    if ((cnt && !v) || !e) rc = -ENOMEM;
    for (size_t i = 0; rc == 0 && i < cnt; i++) {
        if ((rc = recv_all(c, fd, e, MEMQ_ENTRY_BYTES)) < 0) break;
        elastic_mem_slot *s = &v[i];
        s->kind = get32(e);
        s->agent = get64(e + 48);
        s->local = get32(e + 8);
        s->slot = get32(e + 12);
        s->seq = get64(e + 16);
        s->payload_bytes = get64(e + 24);
        s->step = get64(e + 32);
        s->head_len = get32(e + 40);
        uint64_t want = s->payload_bytes < MEMQ_HEAD_BYTES ? s->payload_bytes : MEMQ_HEAD_BYTES;
        if (s->kind > ELASTIC_MEM_REP || s->slot >= SHMSEG_MAX_SLOTS || s->head_len != want) {
            rc = -EPROTO;
            break;
        }
        memcpy(s->head, e + 64, MEMQ_HEAD_BYTES);
    }
    free(e);
    close(fd);
    if (rc < 0) {
        free(v);
        return rc;
    }
    *out = v;
    *n = cnt;
    return 0;
}

int elastic_mem_client_get(elastic_mem_client *c, const elastic_mem_slot *which, uint64_t off,
                           void *dst, uint64_t len)
{
    if (!c || !which || (len && !dst) || off > UINT64_MAX - len) return -EINVAL;
    unsigned char *p = dst;
    while (len) {
        uint64_t piece = len < MEMQ_GET_MAX ? len : MEMQ_GET_MAX;
        int fd;
        uint64_t bl;
        int rc = request(c, MEMQ_OP_GET, which, off, piece, &fd, &bl);
        if (rc < 0) return rc;
        if (bl != piece) rc = -EPROTO;
        else rc = recv_all(c, fd, p, (size_t)piece);
        close(fd);
        if (rc < 0) return rc;
        p += piece;
        off += piece;
        len -= piece;
    }
    return 0;
}
