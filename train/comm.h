/* comm.h - collectives between the ranks of one data-parallel job: all-reduce, reduce-scatter,
 * all-gather, broadcast and barrier, each bounded by a timeout (DESIGN I4).
 *
 * Backend: CPU. Every pair of ranks shares one TCP connection (loopback on one node; a full
 * mesh), set up through the elastic key-value store (store.h), the way torchrun/gloo do it.
 * TCP rather than shared memory because the kernel then reports a dead peer for us: when a
 * process dies (SIGKILL included) its sockets are closed, and every peer that reads from or
 * writes to it gets an end of file or a reset at once. With shared memory a dead peer is
 * silent (its spin flags just stop moving) and can only be found by timeouts or pid checks,
 * and a process killed while holding a lock or in the middle of a write leaves the segment
 * in an unknown state. Loopback TCP moves several GB/s, enough for CPU training; the same
 * code works across hosts should the launcher give one.
 *
 * Bootstrap (train_comm_init): each rank listens on opts->listen_host (default: the address
 * its store connection comes from, so ranks on other hosts reach it), port 0, and publishes
 * "<prefix>/addr/<rank>" = "host port" in the store; the ranks agree on a random 32-byte job
 * secret through "<prefix>/secret" (compare-and-set: the first writer wins). For every pair
 * i < j, rank j connects to rank i and both sides present the secret, their rank and the world
 * size in a hello; a connection with a wrong hello (a stray client, a rank of an older
 * generation with another prefix) is closed and not counted. The store is only used during
 * init. Use a fresh prefix per restart/generation so that old keys are never read.
 * Launcher convention (torchrun): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (see
 * train_comm_opts_from_env); rank 0 hosts the store (elastic_store_server_start) at
 * MASTER_ADDR:MASTER_PORT before calling train_comm_init, and keeps it running until init
 * has returned on every rank (a barrier after init suffices).
 *
 * Determinism (DESIGN section 4): every reduction is a sum over ranks in a fixed pairwise tree
 * over rank index - the left subtree holds the largest power of two of ranks below the count,
 * as train_tree_sum does (W = 4: (x0 + x1) + (x2 + x3); W = 3: (x0 + x1) + x2) - computed by
 * the owner of a range after all contributions have arrived, never in arrival order. The
 * result bits depend only on the inputs and W, not on timing, and are identical on every rank.
 *
 * Collectives must be called by all ranks in the same order with matching arguments (the
 * same counts, n, root). Every message carries the collective's kind, sequence number and
 * length; a rank whose peer is in a different collective, or disagrees about a length, gets
 * -EBADMSG instead of corrupt data.
 *
 * Failures: each collective has a deadline of opts->timeout_s seconds from its start. A peer
 * that dies (its connection is closed or reset) turns into -ECONNRESET or -EPIPE as soon as
 * the kernel reports it; a peer that is alive but silent (stopped, stuck) into -ETIMEDOUT at
 * the deadline. After any error the communicator is poisoned: its connections are shut down
 * (so the peers fail promptly too, with -ECONNRESET/-EPIPE, instead of waiting for their
 * own deadline) and every later call returns the same error. The only way on is
 * train_comm_free and a new communicator (the agent restarts the group).
 *
 * Errors (negative errno, STYLE.md): -EINVAL bad argument, -ETIMEDOUT deadline passed,
 * -ECONNRESET / -EPIPE a peer is gone (or a peer shut the group down after its own error),
 * -EBADMSG ranks disagree (other collective, other length, bad hello), -ENOMEM, -EACCES the
 * store refused the token, other -errno of the socket layer (logged once where it happens).
 *
 * Thread-safety: a communicator is used by ONE thread at a time (calls are not concurrent);
 * distinct communicators are independent. SIGPIPE is never raised (MSG_NOSIGNAL).
 */
#ifndef TRAIN_COMM_H
#define TRAIN_COMM_H

#include <stddef.h>

typedef struct train_comm_opts {
    int rank;                 /* this process's rank, [0, world_size) */
    int world_size;           /* number of ranks, [1, 4096]; 1 needs no store and no sockets */
    const char *store_host;   /* host of the elastic store (MASTER_ADDR); required when
                                 world_size > 1 */
    int store_port;           /* port of the store (MASTER_PORT), [1, 65535] */
    const char *store_token;  /* store token; NULL or "" = none; never logged */
    const char *prefix;       /* key prefix in the store, 1..200 bytes, no NUL; default
                                 "comm"; use a new one per restart/generation */
    const char *listen_host;  /* numeric address this rank listens on and publishes; default
                                 NULL: the local address of its connection to the store (the
                                 interface that reaches MASTER_ADDR; 127.0.0.1 when the store
                                 is on loopback), so that ranks on other hosts can reach it */
    double timeout_s;         /* deadline of each collective, seconds from its start;
                                 (0, 86400]; default 30 */
    double connect_timeout_s; /* deadline of train_comm_init (store connection, rendezvous,
                                 mesh set-up), seconds; (0, 86400]; default 60 */
} train_comm_opts;

#define TRAIN_COMM_OPTS_INIT {0, 1, NULL, 0, NULL, "comm", NULL, 30.0, 60.0}

typedef struct train_comm train_comm;

/* Fill o->rank, o->world_size, o->store_host and o->store_port from the torchrun variables
 * RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the other fields are left as they are.
 * o->store_host points into the environment (valid while the environment is unchanged).
 * A missing RANK and WORLD_SIZE mean a single process (rank 0 of 1).
 * Errors: -EINVAL o NULL, a variable that is not a decimal number in range, RANK without
 * WORLD_SIZE or the reverse, world_size > 1 without MASTER_ADDR/MASTER_PORT (logged). */
int train_comm_opts_from_env(train_comm_opts *o);

/* Create the communicator of rank o->rank: connect to the store, rendezvous with the other
 * ranks and open the mesh (see Bootstrap above). Blocks until all world_size ranks have
 * joined or o->connect_timeout_s has passed. *out is owned by the caller, freed with
 * train_comm_free. o may not be NULL.
 * Memory: one socket per peer; a scratch buffer grown to the largest reduce-scatter (see
 * there) and kept until free.
 * Errors: -EINVAL bad options or out NULL, -ETIMEDOUT some rank did not join in time,
 * -EACCES store token refused, -EBADMSG malformed store value, -ECONNRESET / -EPIPE the store
 * or a peer went away, -ENOMEM, other -errno of socket/bind/listen/connect (logged). */
int train_comm_init(train_comm **out, const train_comm_opts *o);

/* Close every connection and free c. Accepts NULL. Peers still in a collective with this
 * rank get -ECONNRESET/-EPIPE. */
void train_comm_free(train_comm *c);

/* This rank and the world size; -1 for NULL. */
int train_comm_rank(const train_comm *c);
int train_comm_world_size(const train_comm *c);

/* The sticky error of a poisoned communicator (negative errno), 0 when healthy, -EINVAL for
 * NULL. */
int train_comm_status(const train_comm *c);

/* Reduce-scatter, sum, fp32. counts[r] (elements, for each r in [0, W)) is the size of rank
 * r's range; the ranges lie back to back in rank order. in holds the whole vector,
 * sum(counts) floats, on every rank; on return out (counts[rank] floats) holds, for each
 * element of this rank's range, the tree sum over ranks of in (see Determinism). Ranges
 * may be empty; every rank passes the same counts. out may be exactly in + (offset of this
 * rank's range) (in place) or must not overlap in. in/out may be NULL where their size is 0.
 * Scratch: W x counts[rank] floats, kept in c.
 * Errors: see the top; -EINVAL also for NULL c or counts, a size overflow. */
int train_comm_reduce_scatter_f32(train_comm *c, const float *in, float *out,
                                  const size_t *counts);

/* All-reduce, sum, fp32, in place: buf (n floats, the same n on every rank) becomes the tree
 * sum over ranks (see Determinism) with identical bits on every rank. Done as a
 * reduce-scatter over W near-equal ranges (the first n % W ranges one element longer)
 * followed by an all-gather, so each rank sends and receives about 2 x n x 4 bytes.
 * buf may be NULL when n is 0. Scratch: about n floats (see reduce-scatter).
 * Errors: see the top. */
int train_comm_all_reduce_f32(train_comm *c, float *buf, size_t n);

/* All-gather of bytes. counts[r] (bytes) is the size of rank r's part; every rank passes the
 * same counts. in holds this rank's counts[rank] bytes; on return out (sum(counts) bytes)
 * holds the parts of all ranks back to back in rank order. in may be exactly
 * out + (offset of this rank's part) (in place) or must not overlap out; in/out may be NULL
 * where their size is 0.
 * Errors: see the top; -EINVAL also for NULL c or counts, a size overflow. */
int train_comm_all_gather(train_comm *c, const void *in, void *out, const size_t *counts);

/* Broadcast len bytes from rank root ([0, W)) to every rank: on return buf on every rank
 * holds root's bytes. The same len and root on every rank; buf may be NULL when len is 0.
 * Only the root talks to each peer, so a non-root rank does not notice the death of another
 * non-root rank here (it will in the next collective that involves it).
 * Errors: see the top. */
int train_comm_broadcast(train_comm *c, void *buf, size_t len, int root);

/* Check, without waiting and without a collective, whether any peer's connection was closed
 * or reset (the peer died or tore its communicator down). Returns 0 when every connection
 * looks healthy, the sticky error of a poisoned communicator, or -ECONNRESET (the
 * communicator is then poisoned). Only meaningful while the peers are expected to be alive
 * (a peer that finished and freed its communicator also closes its connections).
 * Errors: -EINVAL NULL c. */
int train_comm_probe(train_comm *c);

/* Return once every rank has entered the barrier (or with an error).
 * Errors: see the top. */
int train_comm_barrier(train_comm *c);

#endif /* TRAIN_COMM_H */
