/* kern_cuda_stub.c - kern_cuda.h when the build found no CUDA toolkit (config.h
 * CKPT_HAVE_CUDA = 0): the table cannot be built, so that callers need no #if. */
#include "kern_cuda.h"

#include <errno.h>
#include <string.h>

int kern_cuda_ops_init(kern_ops *out, void *stream, int bf16)
{
    (void)stream;
    (void)bf16;
    memset(out, 0, sizeof *out);
    return -ENOTSUP;
}

void kern_cuda_ops_free(kern_ops *ops)
{
    if (ops) ops->ctx = NULL;
}

int kern_cuda_built(void)
{
    return 0;
}
