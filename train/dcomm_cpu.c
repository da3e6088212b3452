/* dcomm_cpu.c - dcomm.h's entry points and its CPU backend.
 *
 * The CPU backend is comm.h: device memory of the CPU device is host memory, so every
 * collective is the train_comm function of the same name on the same pointers - the same
 * bits (the tree over rank index), errors and timeouts. The only addition is ordering with
 * the dcomm's stream: work queued on it before the collective (a worker stream of the CPU
 * device layer runs asynchronously) is waited for first, as on a GPU the collective would
 * queue behind it.
 *
 * The NCCL backend lives in dcomm_nccl.c (dcomm_nccl_stub.c without CUDA); this file
 * dispatches to it for CUDA devices.
 */
#include "dcomm.h"
#include "dcomm_internal.h"

#include "log.h"

#include <errno.h>
#include <stdlib.h>

#define TAG "dcomm"

int train_dcomm_create(train_dcomm **out, train_comm *host, train_device *dev,
                       const kern_ops *ops, train_stream *stream, train_dcomm_mode mode,
                       double timeout_s)
{
    if (!out) return -EINVAL;
    *out = NULL;
    if (!host || !dev || !(timeout_s > 0 && timeout_s <= 86400.0) ||
        (mode != TRAIN_DCOMM_TREE && mode != TRAIN_DCOMM_RING))
        return -EINVAL;
    train_device_kind kind = train_device_kind_of(dev);
    if (kind != TRAIN_DEVICE_CPU && kind != TRAIN_DEVICE_CUDA) return -EINVAL;
    if (kind == TRAIN_DEVICE_CUDA && !train_dcomm_nccl_built()) return -ENOTSUP;
    /* The NCCL tree mode sums with the kernels; the CPU backend does not need them. */
    if (kind == TRAIN_DEVICE_CUDA && (!ops || !ops->rank_tree_sum || !ops->status))
        return -EINVAL;
    int st = train_comm_status(host);
    if (st < 0) return st;

    train_dcomm *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    c->backend = kind == TRAIN_DEVICE_CUDA ? DCOMM_NCCL : DCOMM_CPU;
    c->host = host;
    c->dev = dev;
    c->ops = ops;
    c->stream = stream ? stream : train_device_compute_stream(dev);
    c->mode = mode;
    c->timeout_s = timeout_s;
    c->rank = train_comm_rank(host);
    c->world = train_comm_world_size(host);
    if (!c->stream) {
        free(c);
        return -EINVAL;
    }
    if (c->backend == DCOMM_NCCL) {
        int r = dcomm_nccl_init(c);
        if (r < 0) {
            free(c);
            return r;
        }
    }
    *out = c;
    return 0;
}

void train_dcomm_free(train_dcomm *c)
{
    if (!c) return;
    if (c->backend == DCOMM_NCCL) dcomm_nccl_free(c);
    free(c);
}

int train_dcomm_status(const train_dcomm *c)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (c->backend == DCOMM_CPU) return train_comm_status(c->host);
    return 0;
}

const char *train_dcomm_describe(const train_dcomm *c)
{
    if (!c) return "none";
    if (c->backend == DCOMM_CPU) return "cpu";
    return c->mode == TRAIN_DCOMM_RING ? "nccl ring" : "nccl tree";
}

/* CPU: wait for what was queued on the dcomm's stream before the collective. A failure
 * here poisons the dcomm (the peers then meet this rank's absence as comm.h's timeout). */
static int cpu_order(train_dcomm *c)
{
    int r = train_stream_sync(c->stream, c->timeout_s);
    if (r < 0) {
        LOG_E(TAG, "the stream before a collective: %d", r);
        c->err = r;
    }
    return r;
}

int train_dcomm_reduce_scatter_f32(train_dcomm *c, const float *in, float *out,
                                   const size_t *counts)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (c->backend == DCOMM_NCCL) return dcomm_nccl_reduce_scatter_f32(c, in, out, counts);
    int r = cpu_order(c);
    return r < 0 ? r : train_comm_reduce_scatter_f32(c->host, in, out, counts);
}

int train_dcomm_all_reduce_f32(train_dcomm *c, float *buf, size_t n)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (c->backend == DCOMM_NCCL) return dcomm_nccl_all_reduce_f32(c, buf, n);
    int r = cpu_order(c);
    return r < 0 ? r : train_comm_all_reduce_f32(c->host, buf, n);
}

int train_dcomm_all_gather(train_dcomm *c, const void *in, void *out, const size_t *counts)
{
    if (!c) return -EINVAL;
    if (c->err) return c->err;
    if (c->backend == DCOMM_NCCL) return dcomm_nccl_all_gather(c, in, out, counts);
    int r = cpu_order(c);
    return r < 0 ? r : train_comm_all_gather(c->host, in, out, counts);
}
