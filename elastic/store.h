/* store.h - a small TCP key-value store (the role of torchrun's TCPStore) used to bootstrap
 * communicators, barriers and rendezvous.
 *
 * One process runs a server (elastic_store_server_start); every rank connects a client
 * (elastic_store_connect) and sets, gets, waits for, counts, compares-and-swaps and deletes
 * keys. Keys are NUL-terminated strings of 1..max_key bytes (any bytes but NUL); values are
 * binary (NULs allowed, may be empty) of 0..max_value bytes. The store lives in the server's
 * memory and is lost when the server stops.
 *
 * Waiting is done by the server: a GET or WAIT on a missing key is parked on the server and
 * answered the moment another client creates the key (or when its wait time runs out), so a
 * waiting client sends one request and polls nothing.
 *
 * No wait is unbounded (DESIGN I4): every client call has a deadline - the handle's timeout
 * (the timeout_s given to elastic_store_connect) for the quick operations, the per-call
 * timeout for elastic_store_get and elastic_store_wait. A server that goes away (process
 * killed, stopped, connection reset) turns into -ECONNRESET or -EPIPE as soon as the kernel
 * reports it, and a server that stops answering into -ETIMEDOUT at the deadline.
 *
 * Security: the optional token is a shared secret presented in the client's hello; a server
 * started with a token refuses (and disconnects) a client whose token differs. The token is
 * never logged, echoed or put into an error (DESIGN I6). The token is no encryption: run the
 * store on a trusted network. An authenticated client may store as many keys as it likes;
 * the limits bound the size of each message, not the number of keys.
 *
 * Errors (negative errno, STYLE.md): -EINVAL bad argument (or a counter that is not a decimal
 * int64), -ETIMEDOUT deadline passed, -ECONNRESET / -EPIPE server gone (or connection dropped
 * after an earlier failure), -EACCES token refused, -EPROTONOSUPPORT the server does not
 * speak this protocol version, -EMSGSIZE key or value over the limits, -EBADMSG malformed
 * answer from the server, -ERANGE counter overflow, -ENOENT (compare_set, see there),
 * -ENOMEM, other -errno from the socket layer (server start: -EADDRINUSE, ...).
 *
 * Thread-safety: the server runs on its own thread and serves any number of clients
 * concurrently; start/port/stop are called by one controlling thread. A client handle is used
 * by ONE thread at a time (one handle per thread); distinct handles are independent, also
 * within one process.
 *
 * ------------------------------------------------------------------------------------------
 * Format spec (protocol version 1; all integers little-endian, no padding)
 *
 *   frame   := len:u32 | op:u8 | id:u32 | body[len - 5]
 *              len counts the bytes after the len field: op, id and body; len >= 5.
 *   bytes   := n:u32 | n bytes
 *
 * The client sends requests; the server sends exactly one response per request, in request
 * order, with op = request op | 0x80 and the request's id. Response bodies start with
 * status:u8, followed (only on status OK unless noted) by the result below.
 *
 *   op    name     request body                                    result (status OK)
 *   0x01  HELLO    magic "ESTR" | version:u16 | token:bytes        version:u16 | max_key:u32
 *                                                                  | max_value:u32
 *   0x02  SET      key:bytes | value:bytes                         -
 *   0x03  GET      wait_ms:u32 | key:bytes                         value:bytes
 *   0x04  WAIT     wait_ms:u32 | count:u32 | count x key:bytes      -
 *   0x05  ADD      delta:i64 | key:bytes                           value:i64 (after adding)
 *   0x06  CAS      key:bytes | expected:bytes | desired:bytes      value:bytes (current)
 *   0x07  DELETE   key:bytes                                       existed:u8 (0 or 1)
 *
 *   status: 0 OK, 1 TIMEDOUT (GET/WAIT: a key still missing after wait_ms), 2 DENIED (bad
 *   token), 3 VERSION (unknown protocol version), 4 TOOBIG (key or value over the limits),
 *   5 INVALID (malformed body, unknown op, empty key, counter not a decimal int64), 6 NOTFOUND
 *   (CAS on a missing key with non-empty expected), 7 RANGE (counter overflow), 8 NOMEM.
 *
 * Rules:
 *  - The first frame of a connection is a HELLO with len <= ELASTIC_STORE_HELLO_MAX and the
 *    magic; anything else closes the connection at once. A wrong token gets DENIED, an
 *    unknown version VERSION; the server then closes the connection. An empty token means
 *    "none" (accepted only by a server without a token; a server without a token accepts
 *    any). A connection that sends no complete HELLO within hello_timeout_s is closed.
 *  - After the HELLO, a frame with len > 64 + max_key + 2 x max_value (a CAS with both values
 *    at the limit) closes the connection before its body is read; a smaller frame whose key
 *    or value is over max_key / max_value is answered TOOBIG and the connection stays.
 *  - GET and WAIT are answered when every key exists, or with TIMEDOUT after wait_ms
 *    milliseconds (0 = check once). While one is parked, later frames of that connection
 *    wait behind it (responses stay in request order).
 *  - ADD treats a missing key as 0 and stores the result as decimal text ("-12"); the stored
 *    text must be an optional '-' and 1..19 digits, else INVALID.
 *  - CAS (torch's compareSet): when the key exists and its value equals expected, or the key
 *    is missing and expected is empty, the value becomes desired; the result is the value
 *    after the operation. A missing key with non-empty expected sets nothing and is answered
 *    NOTFOUND (torch answers expected there, which a caller cannot tell from a swap).
 *  - SET, ADD and a CAS that stores wake the GETs and WAITs parked on that key.
 * ------------------------------------------------------------------------------------------
 */
#ifndef ELASTIC_STORE_H
#define ELASTIC_STORE_H

#include <stddef.h>
#include <stdint.h>

/* Protocol version this code speaks (and the only one its server accepts). */
#define ELASTIC_STORE_PROTOCOL_VERSION 1

/* Longest token, bytes without the NUL. */
#define ELASTIC_STORE_TOKEN_MAX 1024u

/* Largest len of the first frame (a HELLO with the longest token), bytes. */
#define ELASTIC_STORE_HELLO_MAX (5u + 4u + 2u + 4u + ELASTIC_STORE_TOKEN_MAX)

/* ------------------------------------------------------------------ server */

typedef struct elastic_store_server_opts {
    const char *host;       /* address to bind: numeric IPv4/IPv6 or a name;
                               default "127.0.0.1" (loopback only); "0.0.0.0" = all IPv4 */
    int port;               /* TCP port, range [0, 65535]; 0 (default) = a free port chosen
                               by the kernel, see elastic_store_server_port() */
    const char *token;      /* shared secret clients must present, at most
                               ELASTIC_STORE_TOKEN_MAX bytes; NULL or "" (default) = none.
                               Copied at start; never logged */
    uint32_t max_key;       /* longest key, bytes; default 512, range [1, 65536] */
    uint32_t max_value;     /* longest value, bytes; default 1 MiB, range [1, 256 MiB] */
    uint32_t max_clients;   /* authenticated connections served at once; default 1024,
                               range [1, 65536]. A client whose HELLO is accepted while
                               max_clients others are connected is closed without an answer
                               (elastic_store_connect retries until its timeout).
                               Connections still in their hello do not count here */
    double hello_timeout_s; /* a connection must complete its HELLO within this, seconds;
                               default 10, range (0, 3600] */
    uint32_t max_unauthed;  /* connections held at once that have not completed their HELLO
                               ("pre-hello"); default 64, range [1, 65536]. See "Connection
                               limits" below */
} elastic_store_server_opts;

#define ELASTIC_STORE_SERVER_OPTS_INIT {"127.0.0.1", 0, NULL, 512u, 1u << 20, 1024u, 10.0, 64u}

/* Connection limits (what a flood of connections can and cannot do).
 *
 * Authenticated clients and pre-hello connections have separate quotas, max_clients and
 * max_unauthed, so connections that never say hello (a port scanner, a misconfigured
 * client, a flood of silent sockets) cannot lock authenticated clients out:
 *  - Every connection is accepted at once and read at once. A HELLO that has arrived by then
 *    (elastic_store_connect sends it in one piece right after connecting, so normally it
 *    has) is served at once; the connection never waits in the pre-hello quota.
 *  - A connection without a complete HELLO takes one of max_unauthed slots. When they are
 *    all taken, the new connection evicts the OLDEST pre-hello connection that has sent no
 *    byte yet, or, when each has sent part of a hello, the oldest of them. Before it is
 *    closed the victim is read once more, so a hello that has arrived is served, not lost.
 *    Evicted, timed-out (hello_timeout_s) and refused (max_clients) pre-hello connections
 *    are closed with a reset, so that they leave no TIME_WAIT socket on the server.
 * Guaranteed, whatever the number and rate of pre-hello connections:
 *  - a client whose complete HELLO has arrived when its connection is accepted, or at the
 *    latest when the connection would be evicted, gets in (while fewer than max_clients
 *    authenticated clients are connected);
 *  - a connection that has sent part of its hello is evicted only when no silent one is
 *    left to evict: a flood of silent sockets never evicts a client that sends its hello
 *    slowly (a slow link, a hello in pieces), as long as it completes within hello_timeout_s;
 *  - a connection is only ever evicted for a newer one, never by one accepted before it.
 * Not guaranteed: a client that stays silent after connecting while the flood opens
 * max_unauthed new connections (at 10^4 per second and the default 64: about 6 ms) is
 * evicted; elastic_store_connect then connects again (every 10..100 ms) until its timeout.
 * File descriptors: the server holds at most max_clients + max_unauthed sockets (plus, for
 * a moment, the up to 64 it accepts per turn of its loop, and one spare descriptor), so a
 * flood cannot exhaust RLIMIT_NOFILE; set that limit above max_clients + max_unauthed plus
 * what else the process opens. When the process is out of descriptors anyway, new
 * connections are accepted (with the spare descriptor) and closed at once, so their clients
 * retry instead of waiting in the listen backlog. Log: evicted and timed-out connections
 * at most 10 lines per 10 s (the rest counted in one summary line), refusals at max_clients
 * or for want of descriptors at most one line per second. */

typedef struct elastic_store_server elastic_store_server;

/* Bind opts->host:opts->port, listen and start serving on a new thread. opts may be NULL for
 * the defaults. Returns once the socket is listening, so clients may connect at once. The
 * caller owns *out and releases it with elastic_store_server_stop().
 * Memory: per connection a receive buffer of up to one frame (bounded by the limits above)
 * and the responses not yet sent; plus the keys and values stored.
 * Errors: -EINVAL bad options or out NULL, -EADDRINUSE, -EADDRNOTAVAIL (opts->host does not
 * resolve, or not to an address of this host), -EAGAIN (the resolver could not answer now:
 * getaddrinfo's EAI_AGAIN, transient), -EACCES (privileged port), -ENOMEM, other -errno of
 * socket/bind/listen/pthread_create (logged). */
int elastic_store_server_start(elastic_store_server **out, const elastic_store_server_opts *opts);

/* The TCP port the server listens on (the chosen one when opts->port was 0); -1 for NULL. */
int elastic_store_server_port(const elastic_store_server *srv);

/* Stop serving: the thread ends, every connection is closed (clients waiting on it get
 * -ECONNRESET), the data are dropped and srv is freed. Accepts NULL. */
void elastic_store_server_stop(elastic_store_server *srv);

/* ------------------------------------------------------------------ client */

typedef struct elastic_store_client elastic_store_client;

/* Connect to host:port and authenticate with token (NULL or "" = none). Connection attempts
 * are repeated (every 10..100 ms) until timeout_s has passed, so the server may start after
 * the client; a host name that does not resolve yet is retried the same way. timeout_s
 * (seconds, > 0) is also the handle's deadline for each later set/add/compare_set/delete.
 * The caller owns *out and frees it with elastic_store_close().
 * Errors: -EINVAL bad argument (NULL out or host, port outside [1, 65535], timeout_s <= 0,
 * token longer than ELASTIC_STORE_TOKEN_MAX), -ETIMEDOUT no server accepted the connection
 * and answered the hello within timeout_s (a server that closes the connection during the
 * hello - restarting, at max_clients, or evicted as a pre-hello connection under a flood, see
 * "Connection limits" - is tried again), -EACCES token refused,
 * -EPROTONOSUPPORT protocol version refused, -EBADMSG malformed answer, -ENOMEM. */
int elastic_store_connect(elastic_store_client **out, const char *host, int port,
                          const char *token, double timeout_s);

/* Set key to the len bytes at value (value may be NULL when len is 0), replacing any old
 * value, and wake the waiters of key. Deadline: the handle's timeout.
 * Errors: -EINVAL (c or key NULL, key empty), -EMSGSIZE key or value over the server's
 * limits (checked before sending; the connection stays usable), -ETIMEDOUT, -ECONNRESET,
 * -EPIPE, -ENOMEM, -EBADMSG. */
int elastic_store_set(elastic_store_client *c, const char *key, const void *value, size_t len);

/* Get the value of key, waiting up to timeout_s seconds (>= 0; 0 = do not wait) for another
 * client to set it. On success *value_out is a malloc'ed copy (free() it) with one extra
 * NUL byte after the *len_out value bytes, so text values can be used as C strings.
 * The call returns within timeout_s (for timeout_s == 0: within the handle's timeout).
 * Errors: -EINVAL (NULL argument, empty key, timeout_s < 0), -ETIMEDOUT key still missing,
 * -EMSGSIZE key over the limit, -ECONNRESET, -EPIPE, -ENOMEM, -EBADMSG. */
int elastic_store_get(elastic_store_client *c, const char *key, void **value_out,
                      size_t *len_out, double timeout_s);

/* Wait until every one of the n keys exists (n >= 1), up to timeout_s seconds (>= 0; 0 =
 * check once). Returns within timeout_s as elastic_store_get does.
 * Errors: -EINVAL (NULL argument, n == 0, an empty key), -ETIMEDOUT some key still missing,
 * -EMSGSIZE a key over the limit or the request larger than a frame may be, -ECONNRESET,
 * -EPIPE, -ENOMEM, -EBADMSG. */
int elastic_store_wait(elastic_store_client *c, const char *const keys[], size_t n,
                       double timeout_s);

/* Atomically add delta to the int64 counter at key (a missing key counts as 0; the value is
 * stored as decimal text, readable with elastic_store_get) and return the new value in
 * *new_value (may be NULL). Wakes the waiters of key. Deadline: the handle's timeout.
 * Errors: -EINVAL (NULL c or key, empty key, the stored value is not a decimal int64),
 * -ERANGE the sum overflows int64 (nothing stored), -EMSGSIZE, -ETIMEDOUT, -ECONNRESET,
 * -EPIPE, -EBADMSG. */
int elastic_store_add(elastic_store_client *c, const char *key, int64_t delta,
                      int64_t *new_value);

/* Compare-and-set with torch's semantics: when key exists and its value equals the
 * expected_len bytes at expected, or key is missing and expected_len is 0, key is set to the
 * desired bytes. *actual_out gets a malloc'ed copy (free() it, one extra NUL byte) of the
 * value after the operation - desired when it swapped, the unchanged current value when not -
 * and *actual_len its length; actual_out and actual_len may both be NULL. expected/desired
 * may be NULL when their length is 0. Deadline: the handle's timeout.
 * Errors: -ENOENT key missing and expected_len > 0 (nothing set; torch would return
 * expected here), -EINVAL, -EMSGSIZE, -ETIMEDOUT, -ECONNRESET, -EPIPE, -ENOMEM, -EBADMSG. */
int elastic_store_compare_set(elastic_store_client *c, const char *key, const void *expected,
                              size_t expected_len, const void *desired, size_t desired_len,
                              void **actual_out, size_t *actual_len);

/* Delete key. Returns 1 when it existed, 0 when it did not (both success).
 * Deadline: the handle's timeout.
 * Errors: -EINVAL, -EMSGSIZE, -ETIMEDOUT, -ECONNRESET, -EPIPE, -EBADMSG. */
int elastic_store_delete(elastic_store_client *c, const char *key);

/* Close the connection and free the handle. Accepts NULL. */
void elastic_store_close(elastic_store_client *c);

/* The local address of the connection (getsockname), numeric ("10.0.0.5", "::1"), into host
 * (host_len bytes with the NUL; 64 is enough): the address this machine uses to reach the
 * store, so the one its peers can reach it on (the agent's memory-tier replica server binds
 * it). Errors: -EINVAL (NULL argument, host_len 0), -ENOTCONN the connection was dropped,
 * -ENAMETOOLONG host_len too small, other -errno of getsockname/getnameinfo. */
int elastic_store_local_addr(const elastic_store_client *c, char *host, size_t host_len);

/* Shut the connection down (shutdown(2), both directions) without freeing anything: a call in
 * progress on another thread returns -ECONNRESET/-EPIPE at once, and every later call fails.
 * The one function that may be called while another thread uses the handle (to unblock it when
 * the job is being torn down); c must stay allocated until that thread is done with it, then
 * freed with elastic_store_close. Accepts NULL. */
void elastic_store_interrupt(elastic_store_client *c);

#endif /* ELASTIC_STORE_H */
