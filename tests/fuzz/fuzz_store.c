/* fuzz_store.c - libFuzzer harness: the key-value store server (elastic/store_server.c) and
 * its wire protocol (elastic/store.h, "Format spec").
 *
 * One server runs in this process on a loopback port, started in LLVMFuzzerInitialize (with
 * a token, small limits so that TOOBIG and the frame limit are within reach of small inputs).
 * Each input opens a TCP connection, sends bytes, reads the answers for a short while and
 * closes (half the time with a reset, so that both ways a peer can leave are taken). The
 * first input byte selects how the rest is sent:
 *   mode 0: raw bytes, no hello (the pre-authentication path: the first-frame rules);
 *   mode 1: a valid hello with the token, then raw bytes (the frames after the hello);
 *   mode 2: a valid hello, then structured frames that the harness builds from the input
 *           (see send_ops: every op, keys from a small set or from the input, over-limit
 *           keys and values, inner lengths that lie, WAIT with count 2^32-1, waits of at
 *           most 20 ms), so that well-formed requests reach every handler;
 *   mode 3: a hello built from the input (magic, version, token), then raw bytes.
 * The harness cuts the bytes it sends into frames as the server does, so it knows how many
 * answers to expect: most inputs end as soon as the server has answered them all (or closed
 * the connection), only a request parked by the server waits for the read deadline.
 *
 * Findings (the harness aborts; libFuzzer keeps the input):
 *   - answers that break the spec: not one response per request, in request order, with
 *     op | 0x80 and the request's id, and a status in [0, 8];
 *   - after every input, a real client (elastic_store_connect) must connect, set a key and
 *     read it back within 5 s: a dead or hung server thread is a finding, not a slow run.
 * The store keeps what inputs set; the server is restarted (on a new port) every
 * RESTART_EVERY inputs to bound its memory, which is also how an input's effect on later
 * ones stays limited.
 */
#include "elastic_internal.h"
#include "fz_util.h"
#include "log.h"
#include "store.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#define TOKEN "fuzz-token-5b3e"
#define MAX_KEY 512u
#define MAX_VALUE 4096u
#define READ_DEADLINE_S 0.1 /* longest wait for answers per input */
#define RESTART_EVERY 20000u

static elastic_store_server *g_srv;
static int g_port;
static unsigned long long g_inputs;

static void start_server(void)
{
    elastic_store_server_opts o = ELASTIC_STORE_SERVER_OPTS_INIT;
    o.token = TOKEN;
    o.max_key = MAX_KEY;
    o.max_value = MAX_VALUE;
    o.max_clients = 64;
    o.hello_timeout_s = 2.0;
    int rc = elastic_store_server_start(&g_srv, &o);
    errno = -rc;
    FZ_SETUP(rc == 0, "elastic_store_server_start");
    g_port = elastic_store_server_port(g_srv);
}

static void stop_server(void) { elastic_store_server_stop(g_srv); }

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    log_set_level(LOG_ERROR); /* refusals are logged at WARN: one per input otherwise */
    start_server();
    atexit(stop_server);
    return 0;
}

/* ------------------------------------------------------------------ building requests */

typedef struct out {
    uint8_t *p;
    size_t len, cap;
} out;

static uint8_t *out_room(out *o, size_t n)
{
    if (o->len + n > o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 4096;
        while (cap < o->len + n) cap *= 2;
        uint8_t *p = realloc(o->p, cap);
        FZ_SETUP(p != NULL, "request buffer");
        o->p = p;
        o->cap = cap;
    }
    o->len += n;
    return o->p + o->len - n;
}

static void out_bytes(out *o, const void *d, size_t n)
{
    if (n) memcpy(out_room(o, n), d, n);
}

static void out_u16(out *o, uint16_t v) { es_put_u16(out_room(o, 2), v); }
static void out_u32(out *o, uint32_t v) { es_put_u32(out_room(o, 4), v); }
static void out_u64(out *o, uint64_t v) { es_put_u64(out_room(o, 8), v); }

/* Start a frame (len patched by frame_end); returns where it starts. */
static size_t frame_begin(out *o, uint8_t op, uint32_t id)
{
    size_t at = o->len;
    out_u32(o, 0);
    *out_room(o, 1) = op;
    out_u32(o, id);
    return at;
}

static void frame_end(out *o, size_t at) { es_put_u32(o->p + at, (uint32_t)(o->len - at - 4)); }

static void hello(out *o, const char *magic, uint16_t version, const void *tok, uint32_t tlen)
{
    size_t at = frame_begin(o, ES_OP_HELLO, 1);
    out_bytes(o, magic, 4);
    out_u16(o, version);
    out_u32(o, tlen);
    out_bytes(o, tok, tlen);
    frame_end(o, at);
}

/* bytes := n:u32 | n bytes, where n may lie (claims more than follows) when `lie` is set. */
static void out_field(out *o, const uint8_t *d, uint32_t n, int lie)
{
    out_u32(o, lie ? n + 1 + (n & 7) * 1000 : n);
    out_bytes(o, d, n);
}

/* A key from the input: mostly one of eight short names (so that SET, GET, WAIT and CAS
 * meet), sometimes bytes of the input, empty, or over the limit. */
static void key_from(fz_in *in, out *o, int lie)
{
    static uint8_t big[MAX_KEY + 1];
    uint8_t k = fz_u8(in);
    char name[4] = {'k', (char)('0' + (k & 7)), 0, 0};
    switch (k >> 5) {
    case 0: out_field(o, NULL, 0, lie); break;                         /* empty: INVALID */
    case 1: memset(big, 'K', sizeof big); out_field(o, big, sizeof big, lie); break; /* TOOBIG */
    case 2: {                                                           /* from the input */
        uint32_t n = fz_u8(in);
        if (n > in->left) n = (uint32_t)in->left;
        out_field(o, in->p, n, lie);
        in->p += n;
        in->left -= n;
        break;
    }
    default: out_field(o, (const uint8_t *)name, 2, lie); break;
    }
}

static void value_from(fz_in *in, out *o, int lie)
{
    static uint8_t pat[MAX_VALUE + 8];
    uint32_t n = fz_u16(in) % (MAX_VALUE + 8); /* a few over the limit: TOOBIG */
    if (n <= in->left) {
        out_field(o, in->p, n, lie);
        in->p += n;
        in->left -= n;
    } else {
        memset(pat, (int)n, n);
        out_field(o, pat, n, lie);
    }
}

/* Mode 2: frames built from records of the input until it runs out. Each record starts with
 * a selector byte: op = 1 + (sel & 7) (HELLO again and the unknown op 8 included), bit 3 makes
 * the inner lengths lie, bit 4 appends a junk byte to the body. */
static void send_ops(fz_in *in, out *o, uint32_t *id)
{
    while (in->left > 0) {
        uint8_t sel = fz_u8(in);
        uint8_t op = (uint8_t)(1 + (sel & 7));
        int lie = (sel >> 3) & 1;
        size_t at = frame_begin(o, op, (*id)++);
        switch (op) {
        case ES_OP_SET: key_from(in, o, lie); value_from(in, o, 0); break;
        case ES_OP_GET: out_u32(o, fz_u8(in) % 21u); key_from(in, o, lie); break;
        case ES_OP_WAIT: {
            out_u32(o, fz_u8(in) % 21u);
            uint8_t c = fz_u8(in);
            uint32_t count = c & 3;
            out_u32(o, (c & 0x80) ? 0xffffffffu : count); /* 2^32-1 keys announced */
            for (uint32_t i = 0; i < count; i++) key_from(in, o, lie && i + 1 == count);
            break;
        }
        case ES_OP_ADD: {
            uint64_t d = fz_u32(in);
            d |= (uint64_t)fz_u32(in) << 32;
            out_u64(o, d);
            key_from(in, o, lie);
            break;
        }
        case ES_OP_CAS: key_from(in, o, lie); value_from(in, o, 0); value_from(in, o, 0); break;
        case ES_OP_DELETE: key_from(in, o, lie); break;
        default: { /* a second HELLO, or op 8: the body is whatever follows */
            uint32_t n = fz_u8(in) % 16u;
            if (n > in->left) n = (uint32_t)in->left;
            out_bytes(o, in->p, n);
            in->p += n;
            in->left -= n;
        }
        }
        if ((sel >> 4) & 1) *out_room(o, 1) = 0xAB;
        frame_end(o, at);
    }
}

/* ------------------------------------------------------------------ the exchange */

typedef struct req {
    uint8_t op;
    uint32_t id;
} req;

/* The complete frames in b (as the server cuts them: len:u32 then len bytes), stopping at
 * a length the server refuses (it closes the connection there) or at a cut frame. Returns
 * the number of frames in *reqs. */
static size_t cut_frames(const uint8_t *b, size_t n, req **reqs)
{
    size_t cnt = 0, cap = 0, pos = 0;
    int authed = 0;
    *reqs = NULL;
    while (n - pos >= 4) {
        uint32_t flen = es_get_u32(b + pos);
        uint64_t limit = authed ? es_frame_limit(MAX_KEY, MAX_VALUE) : ELASTIC_STORE_HELLO_MAX;
        if (flen < 5 || flen > limit || n - pos - 4 < flen) break;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 64;
            req *r = realloc(*reqs, cap * sizeof *r);
            FZ_SETUP(r != NULL, "request list");
            *reqs = r;
        }
        (*reqs)[cnt++] = (req){b[pos + 4], es_get_u32(b + pos + 5)};
        pos += 4 + (size_t)flen;
        authed = 1; /* after a first frame the connection is either closed or authenticated */
    }
    return cnt;
}

static double now_s(void) { return clock_now_s(); }

/* Complete answers at the start of in. */
static size_t count_answers(const out *in)
{
    size_t pos = 0, k = 0;
    while (in->len - pos >= 4) {
        uint32_t flen = es_get_u32(in->p + pos);
        if (flen < 5 || in->len - pos - 4 < flen) break;
        pos += 4 + (size_t)flen;
        k++;
    }
    return k;
}

/* Send all of o while reading answers into in; stop once every request has its answer, at
 * EOF or at the deadline (a request parked by the server, or one it never answers). */
static void exchange(int fd, const out *o, out *in, size_t nreq)
{
    size_t sent = 0;
    double deadline = now_s() + READ_DEADLINE_S;
    for (;;) {
        if (sent == o->len && count_answers(in) >= nreq) return;
        struct pollfd p = {fd, POLLIN | (sent < o->len ? POLLOUT : 0), 0};
        double left = deadline - now_s();
        if (left <= 0) return;
        int n = poll(&p, 1, (int)(left * 1000) + 1);
        if (n < 0 && errno == EINTR) continue;
        FZ_SETUP(n >= 0, "poll");
        if (n == 0) return;
        if (p.revents & POLLOUT) {
            ssize_t w = send(fd, o->p + sent, o->len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0) sent += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EINTR) sent = o->len; /* peer gone */
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            uint8_t *dst = out_room(in, 65536);
            ssize_t r = recv(fd, dst, 65536, MSG_DONTWAIT);
            in->len -= 65536 - (r > 0 ? (size_t)r : 0);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return; /* closed */
        }
    }
}

/* Every answer must belong to the next request in order (store.h: exactly one response per
 * request, in request order, op | 0x80, the request's id, a status byte). */
static void check_answers(const out *in, const req *reqs, size_t nreq)
{
    size_t pos = 0, k = 0;
    while (in->len - pos >= 4) {
        uint32_t flen = es_get_u32(in->p + pos);
        FZ_ASSERT(flen >= 6, "answer %zu has len %u", k, flen);
        if (in->len - pos - 4 < flen) break; /* cut by the deadline */
        const uint8_t *f = in->p + pos + 4;
        FZ_ASSERT(k < nreq, "answer %zu to no request (op 0x%02x id %u)", k, f[0], es_get_u32(f + 1));
        FZ_ASSERT(f[0] == (reqs[k].op | ES_RESP) && es_get_u32(f + 1) == reqs[k].id,
                  "answer %zu: op 0x%02x id %u for request op 0x%02x id %u", k, f[0],
                  es_get_u32(f + 1), reqs[k].op, reqs[k].id);
        FZ_ASSERT(f[5] <= ES_ST_NOMEM, "answer %zu: status %u", k, f[5]);
        pos += 4 + (size_t)flen;
        k++;
    }
}

/* A real client must still be served: connect, set, read back (I4: within 5 s). */
static void check_alive(void)
{
    elastic_store_client *c = NULL;
    int rc = elastic_store_connect(&c, "127.0.0.1", g_port, TOKEN, 5.0);
    FZ_ASSERT(rc == 0, "the server no longer accepts a client after this input: %s", strerror(-rc));
    char v[32];
    int n = snprintf(v, sizeof v, "%llu", g_inputs);
    rc = elastic_store_set(c, "fz/alive", v, (size_t)n);
    FZ_ASSERT(rc == 0, "set after this input: %s", strerror(-rc));
    void *got = NULL;
    size_t glen = 0;
    rc = elastic_store_get(c, "fz/alive", &got, &glen, 0);
    FZ_ASSERT(rc == 0 && glen == (size_t)n && !memcmp(got, v, glen),
              "get after this input: %s", strerror(-rc));
    free(got);
    elastic_store_close(c);
}

/* connect(2), where a signal (libFuzzer's timers) may interrupt the blocking call: the
 * connection then completes in the background, so wait for it (at most 10 s) and read its
 * outcome, rather than calling a harmless EINTR a finding. 0, or -1 with errno set. */
static int connect_loopback(int fd, const struct sockaddr_in *a)
{
    if (connect(fd, (const struct sockaddr *)a, sizeof *a) == 0) return 0;
    if (errno != EINTR) return -1;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int n;
    do {
        n = poll(&p, 1, 10000);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
        if (n == 0) errno = ETIMEDOUT;
        return -1;
    }
    int e = 0;
    socklen_t el = sizeof e;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0) return -1;
    if (e) {
        errno = e;
        return -1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (++g_inputs % RESTART_EVERY == 0) {
        elastic_store_server_stop(g_srv);
        start_server();
    }
    fz_in in = {data, size};
    uint8_t mode = fz_u8(&in);
    int reset = (mode >> 2) & 1;
    mode &= 3;

    out o = {0}, ans = {0};
    uint32_t id = 2;
    if (mode == 1 || mode == 2) {
        hello(&o, ES_MAGIC, ELASTIC_STORE_PROTOCOL_VERSION, TOKEN, sizeof TOKEN - 1);
    } else if (mode == 3) {
        uint8_t h = fz_u8(&in);
        uint16_t version = (h & 1) ? fz_u16(&in) : ELASTIC_STORE_PROTOCOL_VERSION;
        const char *magic = (h & 2) ? "ESTr" : ES_MAGIC;
        uint8_t tok[255];
        uint32_t tlen = 0;
        switch ((h >> 2) & 3) {
        case 0: memcpy(tok, TOKEN, sizeof TOKEN - 1); tlen = sizeof TOKEN - 1; break;
        case 1: break; /* no token: DENIED by a server that has one */
        default:
            tlen = fz_u8(&in);
            if (tlen > in.left) tlen = (uint32_t)in.left;
            memcpy(tok, in.p, tlen);
            in.p += tlen;
            in.left -= tlen;
        }
        hello(&o, magic, version, tok, tlen);
    }
    if (mode == 2) send_ops(&in, &o, &id);
    else out_bytes(&o, in.p, in.left);

    /* what the server will see as requests (the complete frames it accepts) */
    req *reqs = NULL;
    size_t nreq = cut_frames(o.p, o.len, &reqs);

    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FZ_SETUP(fd >= 0, "socket");
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)g_port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    FZ_ASSERT(connect_loopback(fd, &a) == 0, "connect to the server: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    exchange(fd, &o, &ans, nreq);
    check_answers(&ans, reqs, nreq);
    if (reset) { /* leave with a reset instead of a FIN (and no TIME_WAIT on this side) */
        struct linger l = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    }
    close(fd);
    free(reqs);
    free(o.p);
    free(ans.p);
    check_alive();
    return 0;
}
