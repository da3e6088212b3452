/* kern_cuda.h - the CUDA kernel table (the .cu files of kernels/cuda/) behind kern_ops.h.
 *
 * Built when meson found nvcc (config.h CKPT_HAVE_CUDA = 1); otherwise kern_cuda_ops_init is a
 * stub returning -ENOTSUP, so callers need no #if.
 *
 * Context: one cuBLAS handle bound to `stream` (cudaStream_t, passed as void * so that C code
 * needs no CUDA header), a fixed cuBLAS workspace (32 MiB, cublasSetWorkspace, so that the
 * same algorithms run every time) and the scratch of the kernels that need it; no globals.
 * Every launcher queues on `stream` and returns.
 *
 * Thread-safety: one table per thread (cuBLAS handles are not shared).
 */
#ifndef KERN_CUDA_H
#define KERN_CUDA_H

#include "kern_ops.h"

/* Fill *out with the CUDA table on `stream` (may be NULL: the legacy default stream) for the
 * current device (cudaSetDevice before). bf16 as kern_ops.h.
 * Errors: -ENOTSUP not built with CUDA, -ENODEV no device, -EIO cuBLAS or CUDA failure
 * (logged), -ENOMEM. */
int kern_cuda_ops_init(kern_ops *out, void *stream, int bf16);

/* Free the context of a table filled by kern_cuda_ops_init (cuBLAS handle, workspace).
 * Accepts a table whose ctx is NULL. */
void kern_cuda_ops_free(kern_ops *ops);

/* 1 when the CUDA table is built in, else 0. */
int kern_cuda_built(void);

#endif /* KERN_CUDA_H */
