/* vote.h - the votes of a sharded snapshot's two-phase commit (ckpt.h, "sharded snapshots")
 * carried over the elastic key-value store (elastic/store.h).
 *
 * Keys, under a prefix unique to the launch (the caller's "<prefix>"):
 *   <prefix>/<step>/vote/<rank>   rank's result for its shard: "0" durable, "-<errno>" failed
 *   <prefix>/<step>/decision      rank 0's decision: "0" committed, "-<errno>" not committed
 * collect() waits for the votes of ranks 1..W-1 in rank order, each bounded by what is left of
 * the timeout, and returns the first failure it reads (a missing vote is -ETIMEDOUT);
 * outcome() waits for the decision. Values are small decimal strings.
 *
 * The handle owns its own store connection: the callbacks run on the snapshot engine's persist
 * thread, and a store client is used by one thread at a time (store.h).
 *
 * Thread-safety: after train_vote_create, the group callbacks may be called from one thread
 * (the engine's persist thread) while no other thread uses the handle.
 */
#ifndef TRAIN_VOTE_H
#define TRAIN_VOTE_H

#include "ckpt.h"

typedef struct train_vote train_vote;

/* Connect to the store at host:port (token may be NULL) within connect_timeout_s seconds and
 * fill *group (rank, world_size, tag, the callbacks, ctx = the handle, timeout_s). prefix
 * (1..200 bytes) and tag ([A-Za-z0-9_.-]{1,63}) are copied. *out is owned by the caller, freed
 * with train_vote_free after the engine that uses *group is destroyed.
 * Errors: -EINVAL bad arguments, and those of elastic_store_connect (-ETIMEDOUT, -EACCES,
 * -ECONNRESET, ...). */
int train_vote_create(train_vote **out, ckpt_group *group, const char *host, int port,
                      const char *token, double connect_timeout_s, const char *prefix,
                      const char *tag, int rank, int world_size, double timeout_s);

/* Make every call in progress or to come fail at once (the group is being torn down: a rank
 * died, so no decision will come). Safe to call from any thread while the engine's persist
 * thread is inside a callback; accepts NULL. */
void train_vote_abort(train_vote *v);

/* Close the connection and free; accepts NULL. */
void train_vote_free(train_vote *v);

#endif /* TRAIN_VOTE_H */
