/* dcomm.h - collectives over device memory: the gradient reduce-scatter / all-reduce and the
 * parameter all-gather of the trainer, on the CPU (through comm.h) or on GPUs (NCCL).
 *
 * The host communicator of comm.h stays what the ranks use for everything small and host-side
 * (losses, stop flags, records, norms, votes); a dcomm carries the big device buffers.
 *
 * Backends:
 *   CPU  - every call forwards to the train_comm given at create (device memory is host
 *          memory); the same bits, errors and timeouts as comm.h (whose sticky error is also
 *          the dcomm's). Work queued on the dcomm's stream before a call is waited for first
 *          (train_stream_sync, bounded by timeout_s). The mode does not matter: comm.h
 *          always sums with its tree, so "ring" gives the tree's bits too.
 *   NCCL - ncclCommInitRankConfig with the unique id made by rank 0 (ncclGetUniqueId) and sent to
 *          the others by train_comm_broadcast over the host communicator (itself set up
 *          through the elastic store), on a communicator created non-blocking
 *          (ncclConfig_t.blocking = 0). Every call queues on the given stream, then polls
 *          ncclCommGetAsyncError and the stream (cudaStreamQuery) until done or until
 *          timeout_s has passed; on a timeout or an async error it calls ncclCommAbort, the
 *          dcomm is poisoned (every later call returns the same error) and the caller frees
 *          it: a dead or stuck peer is an error in seconds, not a hang.
 *          Two reduction modes (train --reduce):
 *            "ring" (TRAIN_DCOMM_RING): ncclReduceScatter / ncclAllReduce (sum). Fast; the
 *              summation order is NCCL's, not bit-stable across world sizes. A reduce-scatter
 *              whose counts are not all equal (ncclReduceScatter needs equal ranges) falls
 *              back to the tree exchange below, so it gets the tree's bits.
 *            "tree" (TRAIN_DCOMM_TREE, the default): deterministic (DESIGN section 4). Each
 *              rank sends every other rank that rank's range (grouped ncclSend/ncclRecv,
 *              ncclGroupStart/End) into a W x range receive buffer, then sums it with the
 *              kernels' rank_tree_sum: comm.h's tree over rank index, the same fp32 adds
 *              in the same order as the CPU backend, so the result is bit-stable across
 *              runs and world sizes (where the CPU backend promises it). All-reduce in this
 *              mode: the tree reduce-scatter over comm.h's W near-equal ranges, then the
 *              all-gather. The receive buffer (device memory, train_device_alloc) is kept
 *              and grown to the largest W x range seen, freed with the dcomm.
 *          All-gather: ncclAllGather when every rank's count is equal, else grouped
 *          ncclSend/ncclRecv (broadcast-style) - exact copies either way.
 *          The NCCL version and every NCCL_* variable in the environment are logged once at
 *          create, by rank 0 (train_dcomm_log_env); NCCL_* variables pass through untouched.
 *          Pointers passed to the NCCL backend must be memory of the dcomm's CUDA device
 *          (checked with cudaPointerGetAttributes: -EINVAL otherwise), and the kernel table's
 *          context must queue on the dcomm's stream (the tree sum is ordered after the
 *          exchange by stream order only).
 *          Internal: the unique id exchange is train_dcomm_nccl_exchange_id in
 *          dcomm_internal.h (tested on its own: create cannot run without a GPU).
 *
 * Errors (negative errno): -EINVAL bad argument, -ENOTSUP the backend is not built,
 * -ETIMEDOUT a collective passed timeout_s (NCCL: after ncclCommAbort), -ECONNRESET a peer
 * failed (NCCL: ncclRemoteError / ncclSystemError from ncclCommGetAsyncError), -EIO another
 * NCCL or CUDA failure (logged with its ncclGetErrorString), -ENOMEM, and for CPU the errors
 * of comm.h. NCCL: an argument error found before any communication (-EINVAL) leaves the
 * dcomm healthy; every failure after that point poisons it (and aborts the communicator).
 *
 * Thread-safety: one thread at a time per dcomm. All ranks call the collectives in the same
 * order with the same counts.
 */
#ifndef TRAIN_DCOMM_H
#define TRAIN_DCOMM_H

#include "comm.h"
#include "device.h"
#include "kern_ops.h"

#include <stddef.h>

typedef enum train_dcomm_mode { TRAIN_DCOMM_TREE = 0, TRAIN_DCOMM_RING = 1 } train_dcomm_mode;

typedef struct train_dcomm train_dcomm;

/* Create the device communicator of this rank. host: the rank's host communicator (kept, not
 * owned; it must outlive the dcomm). dev: its device; CPU device -> CPU backend, CUDA device
 * -> NCCL (-ENOTSUP when NCCL is not built). ops: the device's kernel table (not owned;
 * NCCL: required, its rank_tree_sum and status are used; CPU: unused, may be NULL).
 * stream: the stream the collectives queue on (NULL = the device's compute stream).
 * timeout_s: bound of init and of each collective, seconds, (0, 86400]. Collective over host.
 * Errors: see the top. */
int train_dcomm_create(train_dcomm **out, train_comm *host, train_device *dev,
                       const kern_ops *ops, train_stream *stream, train_dcomm_mode mode,
                       double timeout_s);

/* Free (NCCL: ncclCommDestroy, or ncclCommAbort when poisoned). Accepts NULL. */
void train_dcomm_free(train_dcomm *c);

/* The sticky error, 0 when healthy, -EINVAL for NULL. */
int train_dcomm_status(const train_dcomm *c);

/* "cpu", "nccl tree" or "nccl ring": for the start-up log line. */
const char *train_dcomm_describe(const train_dcomm *c);

/* As comm.h's functions of the same name, over device memory: counts (host array, W
 * entries, elements or bytes as there) and the in-place rules are the same. Each returns
 * when the result is in place on this rank (NCCL: the stream work is complete). */
int train_dcomm_reduce_scatter_f32(train_dcomm *c, const float *in, float *out,
                                   const size_t *counts);
int train_dcomm_all_reduce_f32(train_dcomm *c, float *buf, size_t n);
int train_dcomm_all_gather(train_dcomm *c, const void *in, void *out, const size_t *counts);

/* Log one line with the NCCL version (ncclGetVersion) and one with every NCCL_* variable of
 * the environment ("NCCL_* in effect: NCCL_DEBUG=INFO NCCL_IB_DISABLE=1" or "none").
 * Without NCCL built: logs nothing, returns -ENOTSUP. */
int train_dcomm_log_env(void);

/* 1 when the NCCL backend is built in, else 0. */
int train_dcomm_nccl_built(void);

#endif /* TRAIN_DCOMM_H */
