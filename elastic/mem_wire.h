/* mem_wire.h - the memory tier's query protocol between a worker (mem_client.c) and an agent's
 * replica server (agent_mem.c). Internal to elastic/; mem_client.h documents the behaviour.
 *
 * Version 2 (1 named replicas by node rank), little-endian, one request per TCP connection (on the socket of agent_mem.c's
 * replica transfers; each connection has 5 s from its accept to send everything up to the
 * request's last byte, else it is closed; queries are answered one at a time):
 *   client -> server  magic "CKMQ" | version u32 = 2 | token_len u32 (<= MEMQ_TOKEN_MAX) |
 *                     token[token_len] | op u32 (MEMQ_OP_*) | kind u32 (0 own, 1 rep) |
 *                     zero u32 | local u32 | slot u32 | pad u32 | seq u64 | off u64 | len u64 |
 *                     agent u64 (rep: the sending agent's id, else 0)
 *                     (the last 56 bytes: MEMQ_REQ_BYTES; LIST sends them zero)
 *   server -> client  status u32 (MEMQ_ST_*) | pad u32 | body_len u64 | body[body_len]
 *                     (body_len 0 unless status is OK)
 * LIST body: body_len / MEMQ_ENTRY_BYTES entries (at most MEMQ_LIST_MAX), one per complete slot
 *   of this node's segments "<prefix>.own-<L>" (kind 0, agent 0) and "<prefix>.rep-<A>-<L>"
 *   (kind 1, A the 16 hex digits of the sending agent's id, common/shmseg.h): kind u32 |
 *   zero u32 | local u32 | slot u32 | seq u64 | payload_bytes u64 | step u64 | head_len u32 |
 *   pad u32 | agent u64 | zero to 64 | head[4096] (the payload's first head_len =
 *   min(payload_bytes, 4096) bytes, zero after: read with shmseg_copy_out at that seq).
 * GET body: len bytes at off of the slot named by kind/agent/local/slot, copied out while its
 *   seq stayed the requested one (len <= MEMQ_GET_MAX, off + len <= payload_bytes).
 * The token is compared in constant time (all MEMQ_TOKEN_MAX bytes) and never logged. */
#ifndef ELASTIC_MEM_WIRE_H
#define ELASTIC_MEM_WIRE_H

#include <stdint.h>

#define MEMQ_MAGIC "CKMQ"
#define MEMQ_VERSION 2u
#define MEMQ_TOKEN_MAX 1024u
#define MEMQ_REQ_BYTES 56u
#define MEMQ_ANS_BYTES 16u
#define MEMQ_HEAD_BYTES 4096u
#define MEMQ_ENTRY_BYTES (64u + MEMQ_HEAD_BYTES)
#define MEMQ_LIST_MAX 4096u
#define MEMQ_GET_MAX (8u << 20)

enum { MEMQ_OP_LIST = 1, MEMQ_OP_GET = 2 };

enum {
    MEMQ_ST_OK = 0,     /* body follows */
    MEMQ_ST_DENIED = 1, /* wrong token */
    MEMQ_ST_BAD = 2,    /* malformed request (op, fields, slot >= 3, len > MEMQ_GET_MAX) */
    MEMQ_ST_LOCAL = 3,  /* the server failed locally (out of memory, cannot list its folder) */
    MEMQ_ST_STALE = 4,  /* the slot's seq is not the requested one, or changed during the copy */
    MEMQ_ST_NOENT = 5,  /* no such segment or slot (2 or 3 a segment), or it is not complete */
    MEMQ_ST_RANGE = 6   /* off + len beyond the slot's payload_bytes */
};

/* Little-endian field access of the wire formats above (and of the replica transfers). */
static inline void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint32_t get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t get64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

#endif /* ELASTIC_MEM_WIRE_H */
