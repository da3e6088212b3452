/* dcomm_nccl_stub.c - the NCCL backend of dcomm.h when the build found no CUDA toolkit:
 * every entry returns -ENOTSUP and train_dcomm_nccl_built() is 0 (train_dcomm_create refuses
 * a CUDA device before it gets here). */
#include "dcomm.h"
#include "dcomm_internal.h"

#include <errno.h>

int train_dcomm_nccl_built(void)
{
    return 0;
}

int train_dcomm_log_env(void)
{
    return -ENOTSUP;
}

int train_dcomm_nccl_exchange_id(train_comm *host, unsigned char *id)
{
    if (!host || !id) return -EINVAL;
    return -ENOTSUP;
}

int dcomm_nccl_init(train_dcomm *c)
{
    (void)c;
    return -ENOTSUP;
}

void dcomm_nccl_free(train_dcomm *c)
{
    (void)c;
}

int dcomm_nccl_reduce_scatter_f32(train_dcomm *c, const float *in, float *out,
                                  const size_t *counts)
{
    (void)c, (void)in, (void)out, (void)counts;
    return -ENOTSUP;
}

int dcomm_nccl_all_reduce_f32(train_dcomm *c, float *buf, size_t n)
{
    (void)c, (void)buf, (void)n;
    return -ENOTSUP;
}

int dcomm_nccl_all_gather(train_dcomm *c, const void *in, void *out, const size_t *counts)
{
    (void)c, (void)in, (void)out, (void)counts;
    return -ENOTSUP;
}
