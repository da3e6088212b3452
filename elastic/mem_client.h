/* mem_client.h - a worker's client of the agents' memory-tier servers (issue 13): list the
 * complete memory slots a (peer) agent holds and read byte ranges of them, so that a restore
 * can take a rank's shard from another node's memory when it is not on this one.
 *
 * Each agent of a job with several nodes runs one server (agent_mem.c) that takes the peer
 * replicas and answers these queries on the same socket; its address "host:port" is in the
 * store under rdzv/<run id>/mem/<gen>/<node rank>, published every round (agent.h "Memory
 * tier"). The server treats payloads as bytes: what a slot holds (ckpt/ckpt_mem.h) is the
 * caller's business; this module knows only common/shmseg.h's slots. The wire format is in
 * mem_wire.h.
 *
 * Authentication: the job token (ELASTIC_STORE_TOKEN, the store's; NULL or "" for a job
 * without one). A wrong token gets -EACCES and nothing else; the server compares it in
 * constant time and never logs it, neither does this client.
 *
 * Timeouts: every connect, send and receive waits at most timeout_s without progress (a
 * silent or stalled peer costs at most that per call, never a hang). Each call opens its own
 * connection, so a handle may be used from several threads at once.
 *
 * Consistency: a GET names the slot's seq from the listing; the server copies the bytes out
 * while the slot keeps that seq (shmseg_copy_out). A slot rewritten since the listing, or
 * during the copy, gives -ESTALE, never mixed bytes. The bytes are not checksummed here: the
 * payload's own checksums (ckpt_mem.h's per-chunk ones) are the reader's check.
 *
 * Errors (negative errno): -EINVAL bad argument or address, -EACCES wrong token, -ESTALE the
 * slot changed, -ENOENT no such segment or the slot is not complete, -ERANGE off + len past
 * the payload, -EPROTO the peer answered something that is not this protocol (or refused the
 * request as malformed), -EIO the peer failed locally, -ETIMEDOUT no progress within
 * timeout_s, -ECONNREFUSED / -ECONNRESET / -EHOSTUNREACH & co the connection, -ENOMEM.
 */
#ifndef ELASTIC_MEM_CLIENT_H
#define ELASTIC_MEM_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#define ELASTIC_MEM_HEAD_BYTES 4096u  /* bytes of a payload's head in a listing */
#define ELASTIC_MEM_GET_MAX (8u << 20) /* one GET request's bytes; elastic_mem_client_get splits */

/* Which segment of an agent's node: its own workers' or a replica it received. */
enum elastic_mem_kind {
    ELASTIC_MEM_OWN = 0, /* "<prefix>.own-<local>": written by that node's worker */
    ELASTIC_MEM_REP = 1  /* "<prefix>.rep-<agent16>-<local>": the slot of agent `agent`'s
                            node, replicated (named by the sending agent's id, which unlike
                            its node rank survives a new round) */
};

/* One complete slot as an agent listed it. */
typedef struct elastic_mem_slot {
    uint32_t kind;          /* enum elastic_mem_kind */
    uint32_t local;         /* local rank slot L of the segment name */
    uint32_t slot;          /* slot index in the segment, 0 .. 2 (shmseg_nslots) */
    uint64_t agent;         /* REP: the sending agent's id (its prefix's 16 hex random digits,
                               agent.h "Memory tier"); OWN: 0 */
    uint64_t seq;           /* the slot's commit seq when listed (pin for GET) */
    uint64_t payload_bytes; /* bytes of the payload */
    uint64_t step;          /* the step in shmseg's slot header */
    uint32_t head_len;      /* min(payload_bytes, 4096) */
    uint8_t head[ELASTIC_MEM_HEAD_BYTES]; /* the payload's first head_len bytes, zero after */
} elastic_mem_slot;

typedef struct elastic_mem_client elastic_mem_client;

/* A handle for the server at addr ("host:port" or "[v6]:port", numeric host as published)
 * with the job token (NULL or "" = none; at most 1024 bytes; copied) and timeout_s (seconds
 * without progress per socket wait, (0, 3600]). Connects nothing yet.
 * Returns 0 (*out set; free with elastic_mem_client_close), -EINVAL (NULL out or addr, an
 * address that does not parse, token too long, timeout out of range), -ENOMEM. */
int elastic_mem_client_open(elastic_mem_client **out, const char *addr, const char *token,
                            double timeout_s);

/* Free the handle; NULL is accepted. The token's copy is wiped. */
void elastic_mem_client_close(elastic_mem_client *c);

/* The address given to elastic_mem_client_open (owned by the handle). */
const char *elastic_mem_client_addr(const elastic_mem_client *c);

/* The complete slots of every segment of the server's node (own and replicas), in the
 * server's order (by file name, then slot). *out gets *n entries (malloc'ed, free() it; NULL
 * and 0 when there are none). Thread-safe. Returns 0 or a negative errno as at the top. */
int elastic_mem_client_list(elastic_mem_client *c, elastic_mem_slot **out, size_t *n);

/* Read len bytes at offset off of the payload of slot `which` (kind, agent, local, slot and seq
 * as listed; the rest is ignored) into dst, in requests of at most ELASTIC_MEM_GET_MAX bytes.
 * len 0 reads nothing and returns 0. On failure dst holds partial bytes. Thread-safe.
 * Returns 0, or -ESTALE (the slot's seq is no longer which->seq, or it changed during a copy),
 * -ERANGE (off + len past the payload), -ENOENT, or another negative errno as at the top. */
int elastic_mem_client_get(elastic_mem_client *c, const elastic_mem_slot *which, uint64_t off,
                           void *dst, uint64_t len);

#endif /* ELASTIC_MEM_CLIENT_H */
