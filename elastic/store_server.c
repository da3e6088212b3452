/* store_server.c - the key-value store server: one thread, poll(2) over non-blocking sockets.
 *
 * Every connection owns a receive buffer that holds at most the frame being read (bounded by
 * the limits before any allocation) and an output buffer. A GET/WAIT on a missing key stays
 * at the head of its connection's receive buffer ("parked") and is re-evaluated whenever a
 * key is stored, and answered TIMEDOUT at its deadline. While a request is parked, or while
 * a connection has more than OUT_HIGH bytes of answers unsent, nothing more is read from it,
 * which keeps the memory per connection bounded whatever a client sends.
 *
 * Connections that have not completed their HELLO ("pre-hello") have their own quota,
 * max_unauthed, apart from the max_clients authenticated ones: a flood of silent sockets
 * must not lock the job's own clients out (issue 9: 1100 of them did, for as long as they
 * were held, when they counted against max_clients for their whole hello timeout). When the
 * quota is full, a new connection evicts the oldest pre-hello one (silent ones first), so
 * the flood churns through its own quota while a client whose hello arrives promptly always
 * gets in. conns[] is kept in accept order (new ones are appended, the compaction in serve
 * keeps the order), so "oldest" is "first in the array".
 */
#include "store.h"

#include "elastic_internal.h"
#include "log.h"
#include "thread.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RBUF_MIN 4096u
#define OUT_HIGH (256u << 10)   /* stop taking requests while this much output is unsent */
#define SHRINK_ABOVE (64u << 10) /* idle buffers above this are given back */
#define CLOSE_GRACE_S 1.0        /* time to deliver a refusal before closing */
/* Connections accepted per turn of the loop: bounds the time a flood of connections can keep
 * the loop from serving the established ones, and the dead entries (evicted, refused) that
 * conns[] holds until the end of the turn. */
#define ACCEPT_BATCH 64u

typedef struct entry {
    struct entry *next;
    uint64_t hash;
    uint8_t *val;
    uint32_t vlen;
    uint32_t klen;
    uint8_t key[];
} entry;

typedef struct conn {
    int fd;
    int authed;
    int closing; /* a refusal is queued; close once it is sent or at the deadline */
    int waiting; /* the head frame is a parked GET/WAIT */
    int dead;
    int reset;       /* close with a reset (SO_LINGER 0): a refused or evicted pre-hello
                        connection leaves no TIME_WAIT socket behind, however many come */
    double deadline; /* hello, parked request or closing deadline; 0 = none */
    uint8_t *rbuf;
    size_t rlen, rcap;
    uint8_t *wbuf;
    size_t woff, wlen, wcap;
    char peer[72];
} conn;

struct elastic_store_server {
    elastic_store_server_opts o;
    char *token;
    size_t token_len;
    uint64_t frame_limit;
    int lfd;
    int wake[2];
    int port;
    pthread_t thread;
    conn **conns;      /* accept order; capacity max_clients + max_unauthed + ACCEPT_BATCH */
    size_t nconns;
    int spare_fd;      /* /dev/null, given up to accept-and-close when out of descriptors */
    struct pollfd *pfds;
    double accept_pause_until;
    double full_logged_at;  /* last "max_clients reached" message */
    double nofd_logged_at;  /* last "out of file descriptors" message */
    uint64_t nofd_refused;  /* connections refused for want of a descriptor since then */
    double refused_window;  /* start of the current window of refusal messages */
    unsigned refused_logged;     /* refusal lines logged in that window */
    unsigned long long refused_quiet; /* refusals not logged in that window */
    uint64_t full_refused;  /* connections refused since that message */
    entry **buckets;
    size_t nbuckets, nkeys;
    int changed; /* a key was stored since parked requests were last re-evaluated */
};

enum { H_DONE, H_PARKED, H_CLOSE };
enum { M_FIRST, M_RECHECK };

/* Refused or closed connections are logged one line each, at most 10 per 10 s; the rest of
 * a window are counted and summarised in one line when the next window opens, so that a
 * port scanner or a flood of stray clients cannot flood the log. */
static int refusal_may_log(elastic_store_server *s)
{
    double now = clock_now_s();
    if (now - s->refused_window >= 10.0) {
        if (s->refused_quiet)
            LOG_W(ES_TAG, "store: %llu more refused or closed connections in the last %.0f s "
                  "(not logged one by one)", s->refused_quiet, now - s->refused_window);
        s->refused_window = now;
        s->refused_logged = 0;
        s->refused_quiet = 0;
    }
    if (s->refused_logged < 10) {
        s->refused_logged++;
        return 1;
    }
    s->refused_quiet++;
    return 0;
}

/* ------------------------------------------------------------------ key-value table */

static uint64_t hash_key(const uint8_t *k, uint32_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint32_t i = 0; i < n; i++) {
        h ^= k[i];
        h *= 1099511628211ull;
    }
    return h;
}

static entry **kv_slot(elastic_store_server *s, const uint8_t *k, uint32_t n, uint64_t h)
{
    entry **pp = &s->buckets[h & (s->nbuckets - 1)];
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->hash == h && (*pp)->klen == n && memcmp((*pp)->key, k, n) == 0) break;
    return pp;
}

static entry *kv_find(elastic_store_server *s, const uint8_t *k, uint32_t n)
{
    return *kv_slot(s, k, n, hash_key(k, n));
}

static void kv_grow(elastic_store_server *s)
{
    size_t nb = s->nbuckets * 2;
    entry **b = calloc(nb, sizeof *b);
    if (!b) return; /* longer chains, still correct */
    for (size_t i = 0; i < s->nbuckets; i++) {
        entry *e = s->buckets[i];
        while (e) {
            entry *next = e->next;
            e->next = b[e->hash & (nb - 1)];
            b[e->hash & (nb - 1)] = e;
            e = next;
        }
    }
    free(s->buckets);
    s->buckets = b;
    s->nbuckets = nb;
}

/* Store a copy of val; 0 or -ENOMEM (the old value is then kept). */
static int kv_set(elastic_store_server *s, const uint8_t *k, uint32_t kn, const uint8_t *val,
                  uint32_t vn)
{
    uint8_t *copy = malloc(vn ? vn : 1);
    if (!copy) return -ENOMEM;
    if (vn) memcpy(copy, val, vn);
    uint64_t h = hash_key(k, kn);
    entry **pp = kv_slot(s, k, kn, h);
    if (*pp) {
        free((*pp)->val);
        (*pp)->val = copy;
        (*pp)->vlen = vn;
    } else {
        entry *e = malloc(sizeof *e + kn);
        if (!e) {
            free(copy);
            return -ENOMEM;
        }
        e->next = NULL;
        e->hash = h;
        e->val = copy;
        e->vlen = vn;
        e->klen = kn;
        memcpy(e->key, k, kn);
        *pp = e;
        if (++s->nkeys > 2 * s->nbuckets) kv_grow(s);
    }
    s->changed = 1;
    return 0;
}

static int kv_delete(elastic_store_server *s, const uint8_t *k, uint32_t kn)
{
    entry **pp = kv_slot(s, k, kn, hash_key(k, kn));
    entry *e = *pp;
    if (!e) return 0;
    *pp = e->next;
    free(e->val);
    free(e);
    s->nkeys--;
    return 1;
}

static void kv_free(elastic_store_server *s)
{
    for (size_t i = 0; s->buckets && i < s->nbuckets; i++) {
        entry *e = s->buckets[i];
        while (e) {
            entry *next = e->next;
            free(e->val);
            free(e);
            e = next;
        }
    }
    free(s->buckets);
}

/* ------------------------------------------------------------------ connection buffers */

static size_t out_pending(const conn *c) { return c->wlen - c->woff; }

/* Room for n more output bytes; a pointer to them or NULL (out of memory). */
static uint8_t *out_reserve(conn *c, size_t n)
{
    if (c->woff > 0) {
        memmove(c->wbuf, c->wbuf + c->woff, c->wlen - c->woff);
        c->wlen -= c->woff;
        c->woff = 0;
    }
    if (c->wlen + n > c->wcap) {
        size_t cap = c->wcap ? c->wcap * 2 : 4096;
        if (cap < c->wlen + n) cap = c->wlen + n;
        uint8_t *b = realloc(c->wbuf, cap);
        if (!b) return NULL;
        c->wbuf = b;
        c->wcap = cap;
    }
    uint8_t *p = c->wbuf + c->wlen;
    c->wlen += n;
    return p;
}

/* Queue a response header with its status; returns where `extra` result bytes go, or NULL
 * when out of memory. */
static uint8_t *reply(conn *c, uint8_t op, uint32_t id, uint8_t status, size_t extra)
{
    uint8_t *p = out_reserve(c, ES_HDR + 1 + extra);
    if (!p) return NULL;
    es_put_u32(p, (uint32_t)(5 + 1 + extra));
    p[4] = (uint8_t)(op | ES_RESP);
    es_put_u32(p + 5, id);
    p[9] = status;
    return p + 10;
}

static int reply_status(conn *c, uint8_t op, uint32_t id, uint8_t status)
{
    return reply(c, op, id, status, 0) ? H_DONE : H_CLOSE;
}

static int reply_value(conn *c, uint8_t op, uint32_t id, const uint8_t *v, uint32_t n)
{
    uint8_t *p = reply(c, op, id, ES_ST_OK, 4 + (size_t)n);
    if (!p) return H_CLOSE;
    es_put_u32(p, n);
    if (n) memcpy(p + 4, v, n);
    return H_DONE;
}

static void consume(conn *c, size_t n)
{
    memmove(c->rbuf, c->rbuf + n, c->rlen - n);
    c->rlen -= n;
    if (c->rlen == 0 && c->rcap > SHRINK_ABOVE) {
        uint8_t *b = realloc(c->rbuf, RBUF_MIN);
        if (b) {
            c->rbuf = b;
            c->rcap = RBUF_MIN;
        }
    }
}

/* ------------------------------------------------------------------ requests */

static int key_status(const elastic_store_server *s, uint32_t klen)
{
    if (klen == 0) return ES_ST_INVALID;
    if (klen > s->o.max_key) return ES_ST_TOOBIG;
    return ES_ST_OK;
}

/* Strict decimal int64: optional '-', 1..19 digits. */
static int parse_i64(const uint8_t *p, uint32_t n, int64_t *out)
{
    uint32_t i = 0;
    int neg = n > 0 && p[0] == '-';
    i = (uint32_t)neg;
    if (n - i < 1 || n - i > 19) return -1;
    uint64_t u = 0;
    for (; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return -1;
        u = u * 10 + (uint64_t)(p[i] - '0');
    }
    if (neg) {
        if (u > (uint64_t)INT64_MAX + 1) return -1;
        *out = u == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)u;
    } else {
        if (u > (uint64_t)INT64_MAX) return -1;
        *out = (int64_t)u;
    }
    return 0;
}

/* Authenticated connections that are still served (max_clients counts these only). */
static size_t authed_count(const elastic_store_server *s)
{
    size_t n = 0;
    for (size_t i = 0; i < s->nconns; i++) n += s->conns[i]->authed && !s->conns[i]->dead;
    return n;
}

static int ct_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    uint8_t d = 0; /* constant time: the token's bytes do not steer timing */
    for (size_t i = 0; i < n; i++) d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

static int do_hello(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r)
{
    const uint8_t *magic;
    if (op != ES_OP_HELLO || es_rd_take(r, 4, &magic) || memcmp(magic, ES_MAGIC, 4) != 0) {
        if (refusal_may_log(s))
            LOG_W(ES_TAG, "store: closing connection from %s: first frame is not a hello",
                  c->peer);
        return H_CLOSE;
    }
    uint16_t version = es_rd_u16(r);
    uint32_t tlen;
    const uint8_t *tok = es_rd_bytes(r, &tlen);
    if (r->bad || r->left != 0) {
        if (refusal_may_log(s))
            LOG_W(ES_TAG, "store: closing connection from %s: malformed hello", c->peer);
        return H_CLOSE;
    }
    if (version != ELASTIC_STORE_PROTOCOL_VERSION) {
        if (refusal_may_log(s))
            LOG_W(ES_TAG, "store: refused client %s: protocol version %u (this server speaks %d)",
                  c->peer, (unsigned)version, ELASTIC_STORE_PROTOCOL_VERSION);
        c->closing = 1;
        c->deadline = clock_now_s() + CLOSE_GRACE_S;
        return reply_status(c, op, id, ES_ST_VERSION);
    }
    if (s->token_len > 0 && (tlen != s->token_len || !ct_equal(tok, (const uint8_t *)s->token, tlen))) {
        if (refusal_may_log(s))
            LOG_W(ES_TAG, "store: refused client %s: bad token", c->peer);
        c->closing = 1;
        c->deadline = clock_now_s() + CLOSE_GRACE_S;
        return reply_status(c, op, id, ES_ST_DENIED);
    }
    if (authed_count(s) >= s->o.max_clients) {
        /* no answer: elastic_store_connect retries a connection closed during the hello, so
         * the client gets in once another one leaves. Retrying clients come back every
         * 10..100 ms: one line per second at most. */
        double now = clock_now_s();
        s->full_refused++;
        if (now - s->full_logged_at >= 1.0) {
            LOG_W(ES_TAG, "store: refused client %s: %u clients already connected (%llu "
                  "refused since the last message)", c->peer, (unsigned)s->o.max_clients,
                  (unsigned long long)s->full_refused);
            s->full_logged_at = now;
            s->full_refused = 0;
        }
        c->reset = 1;
        return H_CLOSE;
    }
    uint8_t *p = reply(c, op, id, ES_ST_OK, 10);
    if (!p) return H_CLOSE;
    es_put_u16(p, ELASTIC_STORE_PROTOCOL_VERSION);
    es_put_u32(p + 2, s->o.max_key);
    es_put_u32(p + 6, s->o.max_value);
    c->authed = 1;
    c->deadline = 0;
    return H_DONE;
}

static int do_set(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r)
{
    uint32_t kn, vn;
    const uint8_t *k = es_rd_bytes(r, &kn);
    const uint8_t *v = es_rd_bytes(r, &vn);
    if (r->bad || r->left) return reply_status(c, op, id, ES_ST_INVALID);
    int st = key_status(s, kn);
    if (st == ES_ST_OK && vn > s->o.max_value) st = ES_ST_TOOBIG;
    if (st != ES_ST_OK) return reply_status(c, op, id, (uint8_t)st);
    if (kv_set(s, k, kn, v, vn)) return reply_status(c, op, id, ES_ST_NOMEM);
    return reply_status(c, op, id, ES_ST_OK);
}

/* Arm the deadline of a parked request on its first evaluation; answer TIMEDOUT when wait_ms
 * is 0 or the deadline has passed. */
static int park_or_timeout(conn *c, uint8_t op, uint32_t id, uint32_t wait_ms, int mode,
                           double now)
{
    if (mode == M_FIRST) {
        if (wait_ms == 0) return reply_status(c, op, id, ES_ST_TIMEDOUT);
        c->deadline = now + wait_ms * 1e-3;
        return H_PARKED;
    }
    if (now >= c->deadline) return reply_status(c, op, id, ES_ST_TIMEDOUT);
    return H_PARKED;
}

static int do_get(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r,
                  int mode, double now)
{
    uint32_t wait_ms = es_rd_u32(r), kn;
    const uint8_t *k = es_rd_bytes(r, &kn);
    if (r->bad || r->left) return reply_status(c, op, id, ES_ST_INVALID);
    int st = key_status(s, kn);
    if (st != ES_ST_OK) return reply_status(c, op, id, (uint8_t)st);
    entry *e = kv_find(s, k, kn);
    if (e) return reply_value(c, op, id, e->val, e->vlen);
    return park_or_timeout(c, op, id, wait_ms, mode, now);
}

static int do_wait(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r,
                   int mode, double now)
{
    uint32_t wait_ms = es_rd_u32(r);
    uint32_t count = es_rd_u32(r);
    int st = count == 0 ? ES_ST_INVALID : ES_ST_OK, missing = 0;
    for (uint32_t i = 0; i < count && !r->bad && st == ES_ST_OK; i++) {
        uint32_t kn;
        const uint8_t *k = es_rd_bytes(r, &kn);
        if (r->bad) break;
        st = key_status(s, kn);
        if (st == ES_ST_OK && !missing && !kv_find(s, k, kn)) missing = 1;
    }
    if (st == ES_ST_OK && (r->bad || r->left)) st = ES_ST_INVALID;
    if (st != ES_ST_OK) return reply_status(c, op, id, (uint8_t)st);
    if (!missing) return reply_status(c, op, id, ES_ST_OK);
    return park_or_timeout(c, op, id, wait_ms, mode, now);
}

static int do_add(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r)
{
    int64_t delta = (int64_t)es_rd_u64(r), cur = 0, sum;
    uint32_t kn;
    const uint8_t *k = es_rd_bytes(r, &kn);
    if (r->bad || r->left) return reply_status(c, op, id, ES_ST_INVALID);
    int st = key_status(s, kn);
    if (st != ES_ST_OK) return reply_status(c, op, id, (uint8_t)st);
    entry *e = kv_find(s, k, kn);
    if (e && parse_i64(e->val, e->vlen, &cur)) return reply_status(c, op, id, ES_ST_INVALID);
    if (__builtin_add_overflow(cur, delta, &sum)) return reply_status(c, op, id, ES_ST_RANGE);
    char text[24];
    int n = snprintf(text, sizeof text, "%lld", (long long)sum);
    if (kv_set(s, k, kn, (const uint8_t *)text, (uint32_t)n))
        return reply_status(c, op, id, ES_ST_NOMEM);
    uint8_t *p = reply(c, op, id, ES_ST_OK, 8);
    if (!p) return H_CLOSE;
    es_put_u64(p, (uint64_t)sum);
    return H_DONE;
}

static int do_cas(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r)
{
    uint32_t kn, en, dn;
    const uint8_t *k = es_rd_bytes(r, &kn);
    const uint8_t *exp = es_rd_bytes(r, &en);
    const uint8_t *des = es_rd_bytes(r, &dn);
    if (r->bad || r->left) return reply_status(c, op, id, ES_ST_INVALID);
    int st = key_status(s, kn);
    if (st == ES_ST_OK && (en > s->o.max_value || dn > s->o.max_value)) st = ES_ST_TOOBIG;
    if (st != ES_ST_OK) return reply_status(c, op, id, (uint8_t)st);
    entry *e = kv_find(s, k, kn);
    if (!e && en > 0) return reply_status(c, op, id, ES_ST_NOTFOUND);
    if (!e || (e->vlen == en && (en == 0 || memcmp(e->val, exp, en) == 0))) {
        if (kv_set(s, k, kn, des, dn)) return reply_status(c, op, id, ES_ST_NOMEM);
        return reply_value(c, op, id, des, dn);
    }
    return reply_value(c, op, id, e->val, e->vlen);
}

static int do_delete(elastic_store_server *s, conn *c, uint8_t op, uint32_t id, es_reader *r)
{
    uint32_t kn;
    const uint8_t *k = es_rd_bytes(r, &kn);
    if (r->bad || r->left) return reply_status(c, op, id, ES_ST_INVALID);
    int st = key_status(s, kn);
    if (st != ES_ST_OK) return reply_status(c, op, id, (uint8_t)st);
    uint8_t *p = reply(c, op, id, ES_ST_OK, 1);
    if (!p) return H_CLOSE;
    p[0] = (uint8_t)kv_delete(s, k, kn);
    return H_DONE;
}

/* Evaluate the frame f (op | id | body, flen bytes) at the head of c. */
static int handle(elastic_store_server *s, conn *c, const uint8_t *f, uint32_t flen, int mode,
                  double now)
{
    uint8_t op = f[0];
    uint32_t id = es_get_u32(f + 1);
    es_reader r = {f + 5, flen - 5, 0};
    if (!c->authed) return do_hello(s, c, op, id, &r);
    switch (op) {
    case ES_OP_SET: return do_set(s, c, op, id, &r);
    case ES_OP_GET: return do_get(s, c, op, id, &r, mode, now);
    case ES_OP_WAIT: return do_wait(s, c, op, id, &r, mode, now);
    case ES_OP_ADD: return do_add(s, c, op, id, &r);
    case ES_OP_CAS: return do_cas(s, c, op, id, &r);
    case ES_OP_DELETE: return do_delete(s, c, op, id, &r);
    default: return reply_status(c, op, id, ES_ST_INVALID); /* also a second HELLO */
    }
}

/* ------------------------------------------------------------------ connection I/O */

static int frame_len_ok_quiet(const elastic_store_server *s, const conn *c, uint32_t flen)
{
    uint64_t limit = c->authed ? s->frame_limit : ELASTIC_STORE_HELLO_MAX;
    return flen >= 5 && flen <= limit;
}

static int frame_len_ok(elastic_store_server *s, conn *c, uint32_t flen)
{
    if (frame_len_ok_quiet(s, c, flen)) return 1;
    uint64_t limit = c->authed ? s->frame_limit : ELASTIC_STORE_HELLO_MAX;
    if (refusal_may_log(s))
        LOG_W(ES_TAG, "store: closing connection from %s: frame of %u bytes (limit %llu)",
              c->peer, (unsigned)flen, (unsigned long long)limit);
    return 0;
}

static void conn_read(elastic_store_server *s, conn *c)
{
    for (;;) {
        size_t need = 4;
        if (c->rlen >= 4) {
            uint32_t flen = es_get_u32(c->rbuf);
            if (!frame_len_ok(s, c, flen)) {
                c->dead = 1;
                return;
            }
            need = 4 + (size_t)flen;
            if (c->rlen >= need) return; /* a whole frame is here: handle it first */
        }
        if (need > c->rcap) {
            uint8_t *b = realloc(c->rbuf, need);
            if (!b) {
                LOG_E(ES_TAG, "store: out of memory for a %zu-byte frame from %s; closing it",
                      need, c->peer);
                c->dead = 1;
                return;
            }
            c->rbuf = b;
            c->rcap = need;
        }
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, 0);
        if (n > 0) {
            c->rlen += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        c->dead = 1; /* closed by the peer (n == 0) or reset */
        return;
    }
}

static void conn_flush(conn *c)
{
    while (out_pending(c) > 0) {
        ssize_t n = send(c->fd, c->wbuf + c->woff, out_pending(c), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->woff += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        c->dead = 1;
        return;
    }
    c->woff = c->wlen = 0;
    if (c->wcap > SHRINK_ABOVE) {
        free(c->wbuf);
        c->wbuf = NULL;
        c->wcap = 0;
    }
    if (c->closing) c->dead = 1;
}

/* Handle the complete frames at the head of c, in order, until one parks or more output is
 * pending than OUT_HIGH. */
static void conn_pump(elastic_store_server *s, conn *c, double now)
{
    while (!c->dead && !c->closing && c->rlen >= 4) {
        uint32_t flen = es_get_u32(c->rbuf);
        if (!frame_len_ok(s, c, flen)) {
            c->dead = 1;
            return;
        }
        if (c->rlen - 4 < flen) return;
        if (!c->waiting && out_pending(c) >= OUT_HIGH) return;
        int h = handle(s, c, c->rbuf + 4, flen, c->waiting ? M_RECHECK : M_FIRST, now);
        if (h == H_CLOSE) {
            c->dead = 1;
            return;
        }
        if (h == H_PARKED) {
            c->waiting = 1;
            return;
        }
        if (c->waiting) {
            c->waiting = 0;
            c->deadline = 0;
        }
        consume(c, 4 + (size_t)flen);
    }
}

/* Close c's socket now (its entry is freed at the end of the loop's turn). */
static void conn_close_fd(conn *c)
{
    if (c->fd < 0) return;
    if (c->reset) {
        struct linger l = {1, 0};
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    }
    close(c->fd);
    c->fd = -1;
}

static void conn_free(conn *c)
{
    if (!c) return;
    conn_close_fd(c);
    free(c->rbuf);
    free(c->wbuf);
    free(c);
}

static void peer_name(const struct sockaddr_storage *ss, char *out, size_t n)
{
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
        port = ntohs(a->sin_port);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
        port = ntohs(a->sin6_port);
    }
    snprintf(out, n, "%s:%d", host, port);
}

/* Make room in the pre-hello quota for `keep`, the connection being admitted: the oldest
 * pre-hello connection that has sent nothing goes, else (every one has started a hello) the
 * oldest of them. A newer connection is never evicted for an older one, so a flood cannot
 * push out the client that connected last, whose hello is the one about to arrive. The
 * victim is read once more first: a hello that arrived since the last poll is served rather
 * than thrown away. 1 when a slot was freed, 0 when there was no other pre-hello connection. */
static int evict_oldest_pre(elastic_store_server *s, const conn *keep, double now)
{
    for (;;) {
        conn *victim = NULL;
        for (size_t i = 0; i < s->nconns; i++) {
            conn *c = s->conns[i];
            if (c == keep || c->dead || c->authed) continue;
            if (c->rlen == 0 && !c->closing) {
                victim = c;
                break;
            }
            if (!victim) victim = c;
        }
        if (!victim) return 0;
        int silent = victim->rlen == 0 && !victim->closing;
        conn_read(s, victim);
        conn_pump(s, victim, now);
        if (victim->dead || victim->authed) return 1;
        /* it started a hello just now: it is no longer silent, look again (each round moves
         * one connection out of the silent ones, so this ends) */
        if (silent && victim->rlen > 0) continue;
        if (refusal_may_log(s))
            LOG_W(ES_TAG, "store: closing connection from %s: %u connections without a hello "
                  "(max_unauthed), the oldest makes room for a new one", victim->peer,
                  (unsigned)s->o.max_unauthed);
        victim->reset = 1;
        victim->dead = 1;
        conn_close_fd(victim); /* the descriptor is free for the newcomer now */
        return 1;
    }
}

/* Out of file descriptors: give up the spare one for a moment to take the oldest connection
 * off the listen backlog and close it, so that its client learns at once (and retries)
 * instead of waiting there, unanswered, for its whole timeout. 1 when one was refused, 0 when
 * the backlog is empty (accept4 reports EMFILE before it looks at the backlog), -1 when there
 * is no spare descriptor or accept failed otherwise (errno). */
static int refuse_without_fd(elastic_store_server *s, double now)
{
    if (s->spare_fd < 0) return -1;
    close(s->spare_fd);
    int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
    int e = errno;
    if (fd >= 0) {
        struct linger l = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        close(fd); /* before the spare is taken again: its number is the one free */
    }
    /* another thread of the process may take the number meanwhile: then no spare until a
     * descriptor is free again (accept_some retries) */
    s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        errno = e;
        return e == EAGAIN || e == EWOULDBLOCK ? 0 : -1;
    }
    s->nofd_refused++;
    if (now - s->nofd_logged_at >= 1.0) {
        LOG_E(ES_TAG, "store: out of file descriptors (RLIMIT_NOFILE): refusing new connections "
              "(%llu refused since the last message)", (unsigned long long)s->nofd_refused);
        s->nofd_logged_at = now;
        s->nofd_refused = 0;
    }
    return 1;
}

/* Accept up to ACCEPT_BATCH connections. Each is read at once: a client's hello normally
 * arrives with its connection, and is then served before the connection ever waits in the
 * pre-hello quota. One that must wait takes a slot of max_unauthed, evicting the oldest
 * waiting one when the quota is full. */
static void accept_some(elastic_store_server *s, double now)
{
    size_t pre = 0, cap = (size_t)s->o.max_clients + s->o.max_unauthed + ACCEPT_BATCH;
    for (size_t i = 0; i < s->nconns; i++) pre += !s->conns[i]->authed && !s->conns[i]->dead;
    if (s->spare_fd < 0) s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    for (unsigned k = 0; k < ACCEPT_BATCH; k++) {
        struct sockaddr_storage ss;
        memset(&ss, 0, sizeof ss);
        socklen_t sl = sizeof ss;
        int fd = accept4(s->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int e = errno; /* refuse_without_fd's calls overwrite errno */
            if (e == EINTR || e == ECONNABORTED) continue;
            if (e == EAGAIN || e == EWOULDBLOCK) return;
            if (e == EMFILE || e == ENFILE) {
                int r = refuse_without_fd(s, now);
                if (r > 0) continue;
                if (r == 0) return;
                if (errno != EMFILE && errno != ENFILE) e = errno;
            }
            /* no spare descriptor, or another error: the listening socket stays readable;
             * pause accepting briefly instead of spinning */
            if (now - s->nofd_logged_at >= 1.0) {
                LOG_E(ES_TAG, "store: accept: %s", strerror(e));
                s->nofd_logged_at = now;
            }
            s->accept_pause_until = now + 0.1;
            return;
        }
        char peer[72];
        peer_name(&ss, peer, sizeof peer);
        /* full cannot happen (see ACCEPT_BATCH for the capacity); refuse rather than overrun */
        int full = s->nconns >= cap;
        conn *c = full ? NULL : calloc(1, sizeof *c);
        uint8_t *rb = c ? malloc(RBUF_MIN) : NULL;
        if (!c || !rb) {
            if (!full) LOG_E(ES_TAG, "store: out of memory accepting %s", peer);
            free(c);
            free(rb);
            close(fd);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        c->fd = fd;
        c->rbuf = rb;
        c->rcap = RBUF_MIN;
        c->deadline = now + s->o.hello_timeout_s;
        memcpy(c->peer, peer, sizeof peer);
        s->conns[s->nconns++] = c;
        conn_read(s, c);
        conn_pump(s, c, now);
        if (c->dead || c->authed) continue;
        if (pre >= s->o.max_unauthed && evict_oldest_pre(s, c, now)) pre--;
        pre++;
    }
}

/* ------------------------------------------------------------------ the loop */

/* A connection whose head frame is complete and may be handled now: after its output
 * drained below OUT_HIGH no socket event announces it, so poll must not sleep. */
static int runnable(const elastic_store_server *s, const conn *c)
{
    if (c->dead || c->closing || c->waiting || out_pending(c) >= OUT_HIGH || c->rlen < 4)
        return 0;
    uint32_t flen = es_get_u32(c->rbuf);
    return c->rlen - 4 >= flen || !frame_len_ok_quiet(s, c, flen);
}

static int poll_timeout_ms(const elastic_store_server *s, double now)
{
    double next = -1; /* none */
    for (size_t i = 0; i < s->nconns; i++) {
        const conn *c = s->conns[i];
        if (runnable(s, c)) return 0;
        if (c->deadline > 0 && (c->waiting || c->closing || !c->authed) &&
            (next < 0 || c->deadline < next))
            next = c->deadline;
    }
    if (s->accept_pause_until > now && (next < 0 || s->accept_pause_until < next))
        next = s->accept_pause_until;
    if (next < 0) return -1;
    double ms = es_ceil((next - now) * 1e3);
    if (ms < 0) return 0;
    return ms > 60000 ? 60000 : (int)ms;
}

static void *serve(void *arg)
{
    elastic_store_server *s = arg;
    for (;;) {
        double now = clock_now_s();
        s->pfds[0] = (struct pollfd){.fd = s->wake[0], .events = POLLIN};
        s->pfds[1] = (struct pollfd){.fd = s->accept_pause_until > now ? -1 : s->lfd,
                                     .events = POLLIN};
        for (size_t i = 0; i < s->nconns; i++) {
            conn *c = s->conns[i];
            short ev = POLLRDHUP;
            if (!c->closing && !c->waiting && out_pending(c) < OUT_HIGH) ev |= POLLIN;
            if (out_pending(c) > 0) ev |= POLLOUT;
            s->pfds[2 + i] = (struct pollfd){.fd = c->fd, .events = ev};
        }
        size_t npolled = s->nconns;
        int n = poll(s->pfds, 2 + npolled, poll_timeout_ms(s, now));
        if (n < 0) {
            if (errno == EINTR) continue;
            LOG_E(ES_TAG, "store: poll: %s; the server stops serving", strerror(errno));
            break;
        }
        if (s->pfds[0].revents) break; /* elastic_store_server_stop */
        now = clock_now_s();
        for (size_t i = 0; i < npolled; i++) {
            conn *c = s->conns[i];
            short rev = s->pfds[2 + i].revents, ev = s->pfds[2 + i].events;
            if (rev & (POLLERR | POLLNVAL)) c->dead = 1;
            else if ((ev & POLLIN) && (rev & (POLLIN | POLLRDHUP | POLLHUP))) conn_read(s, c);
            else if (rev & (POLLRDHUP | POLLHUP)) c->dead = 1; /* gone while parked or blocked */
        }
        if (s->pfds[1].revents & POLLIN) accept_some(s, now);
        do {
            s->changed = 0;
            for (size_t i = 0; i < s->nconns; i++) conn_pump(s, s->conns[i], now);
        } while (s->changed);
        size_t kept = 0;
        for (size_t i = 0; i < s->nconns; i++) {
            conn *c = s->conns[i];
            if (!c->dead && out_pending(c) > 0) conn_flush(c);
            if (!c->dead && c->deadline > 0 && now >= c->deadline) {
                if (!c->authed && !c->closing && refusal_may_log(s))
                    LOG_W(ES_TAG, "store: closing connection from %s: no hello within %.1f s",
                          c->peer, s->o.hello_timeout_s);
                if (!c->authed && !c->closing) c->reset = 1;
                if (!c->authed || c->closing) c->dead = 1;
            }
            if (c->dead) conn_free(c);
            else s->conns[kept++] = c;
        }
        s->nconns = kept;
    }
    return NULL;
}

/* ------------------------------------------------------------------ start / stop */

static int check_opts(const elastic_store_server_opts *o)
{
    if (!o->host || !*o->host) return -EINVAL;
    if (o->port < 0 || o->port > 65535) return -EINVAL;
    if (o->token && strlen(o->token) > ELASTIC_STORE_TOKEN_MAX) return -EINVAL;
    if (o->max_key < 1 || o->max_key > 65536) return -EINVAL;
    if (o->max_value < 1 || o->max_value > (256u << 20)) return -EINVAL;
    if (o->max_clients < 1 || o->max_clients > 65536) return -EINVAL;
    if (o->max_unauthed < 1 || o->max_unauthed > 65536) return -EINVAL;
    if (!(o->hello_timeout_s > 0 && o->hello_timeout_s <= 3600)) return -EINVAL;
    return 0;
}

static int listen_on(elastic_store_server *s)
{
    char port[16];
    snprintf(port, sizeof port, "%d", s->o.port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int g = getaddrinfo(s->o.host, port, &hints, &res);
    if (g != 0) {
        LOG_E(ES_TAG, "store: cannot resolve bind address %s: %s", s->o.host, gai_strerror(g));
        /* EAI_AGAIN: the resolver could not answer now (transient); other failures: the
         * name does not resolve to an address to bind (a configuration error) */
        return g == EAI_MEMORY ? -ENOMEM : g == EAI_AGAIN ? -EAGAIN : -EADDRNOTAVAIL;
    }
    int err = -EADDRNOTAVAIL;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = -errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
            struct sockaddr_storage ss;
            memset(&ss, 0, sizeof ss);
            socklen_t sl = sizeof ss;
            if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
                s->port = ss.ss_family == AF_INET6
                              ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                              : ntohs(((struct sockaddr_in *)&ss)->sin_port);
                s->lfd = fd;
                err = 0;
                break;
            }
        }
        err = -errno;
        close(fd);
    }
    freeaddrinfo(res);
    if (err) LOG_E(ES_TAG, "store: cannot listen on %s:%d: %s", s->o.host, s->o.port, strerror(-err));
    return err;
}

static void server_free(elastic_store_server *s)
{
    if (!s) return;
    for (size_t i = 0; i < s->nconns; i++) conn_free(s->conns[i]);
    free(s->conns);
    free(s->pfds);
    kv_free(s);
    if (s->lfd >= 0) close(s->lfd);
    if (s->spare_fd >= 0) close(s->spare_fd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    if (s->token) {
        memset(s->token, 0, s->token_len);
        free(s->token);
    }
    free(s);
}

int elastic_store_server_start(elastic_store_server **out, const elastic_store_server_opts *opts)
{
    static const elastic_store_server_opts defaults = ELASTIC_STORE_SERVER_OPTS_INIT;
    if (!out) return -EINVAL;
    *out = NULL;
    if (!opts) opts = &defaults;
    int err = check_opts(opts);
    if (err) return err;
    elastic_store_server *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->o = *opts;
    s->o.token = NULL; /* the copy below is the only one kept */
    s->lfd = s->wake[0] = s->wake[1] = -1;
    s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC); /* best effort: see accept_some */
    s->frame_limit = es_frame_limit(opts->max_key, opts->max_value);
    s->nbuckets = 256;
    s->buckets = calloc(s->nbuckets, sizeof *s->buckets);
    size_t cap = (size_t)opts->max_clients + opts->max_unauthed + ACCEPT_BATCH;
    s->conns = calloc(cap, sizeof *s->conns);
    s->pfds = calloc(2 + cap, sizeof *s->pfds);
    if (opts->token && *opts->token) {
        s->token_len = strlen(opts->token);
        s->token = malloc(s->token_len + 1);
        if (s->token) memcpy(s->token, opts->token, s->token_len + 1);
    }
    if (!s->buckets || !s->conns || !s->pfds || (s->token_len && !s->token)) {
        err = -ENOMEM;
        goto fail;
    }
    err = listen_on(s);
    s->o.host = NULL; /* the caller's string is not kept past start */
    if (err) goto fail;
    if (pipe2(s->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        err = -errno;
        LOG_E(ES_TAG, "store: pipe: %s", strerror(-err));
        goto fail;
    }
    err = common_thread_start(&s->thread, serve, s);
    if (err) {
        LOG_E(ES_TAG, "store: cannot start the server thread: %s", strerror(-err));
        goto fail;
    }
    *out = s;
    return 0;
fail:
    server_free(s);
    return err;
}

int elastic_store_server_port(const elastic_store_server *srv) { return srv ? srv->port : -1; }

void elastic_store_server_stop(elastic_store_server *srv)
{
    if (!srv) return;
    ssize_t w;
    do w = write(srv->wake[1], "x", 1);
    while (w < 0 && errno == EINTR);
    pthread_join(srv->thread, NULL);
    server_free(srv);
}
