/* dcomm_internal.h - what dcomm_cpu.c (the public entry points and the CPU backend) and
 * dcomm_nccl.c (or its stub, dcomm_nccl_stub.c) share. Not for callers of dcomm.h; the unit
 * test uses train_dcomm_nccl_exchange_id directly, because train_dcomm_create on a CUDA
 * device cannot be reached on a machine without a GPU.
 */
#ifndef TRAIN_DCOMM_INTERNAL_H
#define TRAIN_DCOMM_INTERNAL_H

#include "dcomm.h"

#include <stddef.h>

#define TRAIN_DCOMM_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

enum { DCOMM_CPU = 0, DCOMM_NCCL = 1 };

struct train_dcomm {
    int backend; /* DCOMM_CPU or DCOMM_NCCL */
    train_comm *host;
    train_device *dev;
    const kern_ops *ops;
    train_stream *stream; /* never NULL after create (the compute stream by default) */
    train_dcomm_mode mode;
    double timeout_s;
    int rank, world;
    int err;     /* sticky */
    void *nccl;  /* the NCCL backend's state (dcomm_nccl.c), NULL for CPU */
};

/* The NCCL unique id exchange of train_dcomm_create, collective over host: rank 0 calls
 * ncclGetUniqueId and sends a status byte and the 128 id bytes with train_comm_broadcast;
 * on return id (TRAIN_DCOMM_ID_BYTES bytes, host memory) holds rank 0's id on every rank.
 * When rank 0's ncclGetUniqueId fails, every rank gets -EIO (rank 0 still broadcasts, so no
 * rank waits for an id that never comes).
 * Errors: -EINVAL NULL argument, -ENOTSUP NCCL not built, -EIO ncclGetUniqueId failed (on
 * rank 0: logged with ncclGetErrorString), the errors of train_comm_broadcast. */
int train_dcomm_nccl_exchange_id(train_comm *host, unsigned char *id);

/* The NCCL backend behind the public functions (c is filled in by train_dcomm_create:
 * host, dev, ops, stream, mode, timeout_s, rank, world). Each returns as its public
 * counterpart; the caller has checked c->err and the arguments that do not depend on the
 * backend. */
int dcomm_nccl_init(train_dcomm *c);
void dcomm_nccl_free(train_dcomm *c);
int dcomm_nccl_reduce_scatter_f32(train_dcomm *c, const float *in, float *out,
                                  const size_t *counts);
int dcomm_nccl_all_reduce_f32(train_dcomm *c, float *buf, size_t n);
int dcomm_nccl_all_gather(train_dcomm *c, const void *in, void *out, const size_t *counts);

#endif /* TRAIN_DCOMM_INTERNAL_H */
