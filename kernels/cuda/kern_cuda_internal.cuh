/* kern_cuda_internal.cuh - what the .cu files of kernels/cuda/ share: the context, the error
 * bookkeeping, the scratch arena and the launch geometry. Not a public header.
 *
 * Every launcher (kc_<op>) takes the context first, queues its kernels and cuBLAS calls on
 * ctx->stream and returns; the first failure is kept in ctx->status (kern_ops.h's Errors).
 */
#ifndef KERN_CUDA_INTERNAL_CUH
#define KERN_CUDA_INTERNAL_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "kern_cuda.h"
#include "log.h"
}

#define KC_TAG "kern"
#define KC_THREADS 256                      /* block size of the element-wise kernels */
#define KC_CUBLAS_WS_BYTES (32u << 20)      /* fixed cuBLAS workspace (kern_cuda.h) */
#define KC_ROWS_PER_CHUNK 256               /* rows summed per partial in column reductions */
#define KC_SUMSQ_BLOCK 2048                 /* TRAIN_BLOCK of DESIGN section 4 */

typedef struct kern_cuda_ctx {
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *cublas_ws;   /* KC_CUBLAS_WS_BYTES, owned */
    void *scratch;     /* arena of the kernels that need work space, grown stream-ordered */
    size_t scratch_cap; /* bytes */
    int device;
    int status;        /* first failure, 0 when none */
} kern_cuda_ctx;

/* Keep the first failure; log each failure's call once (the first). */
static inline void kc_fail(kern_cuda_ctx *c, int err, const char *what, const char *detail)
{
    if (c->status) return;
    c->status = err;
    LOG_E(KC_TAG, "cuda kernels: %s failed: %s", what, detail);
}

/* Check a CUDA runtime return code; 0 when it is cudaSuccess. */
static inline int kc_cuda_ok(kern_cuda_ctx *c, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return 1;
    kc_fail(c, e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO, what, cudaGetErrorString(e));
    return 0;
}

static inline int kc_cublas_ok(kern_cuda_ctx *c, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return 1;
    kc_fail(c, s == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO, what, cublasGetStatusString(s));
    return 0;
}

/* After a <<<>>> launch: the launch error (bad configuration, no kernel image), if any. */
static inline void kc_launched(kern_cuda_ctx *c, const char *what)
{
    kc_cuda_ok(c, cudaGetLastError(), what);
}

/* Blocks of KC_THREADS covering n items (n > 0); grid.x is at most 2^31 - 1, so n up to
 * 5e11 elements. */
static inline unsigned kc_blocks(size_t n, unsigned threads)
{
    return (unsigned)((n + threads - 1) / threads);
}

/* Scratch of `bytes` (256-aligned), valid until the next call that asks for scratch; NULL on
 * failure (status set). Grown with stream-ordered allocation, so that work still queued on
 * the old arena completes before it is released and no host wait is needed. */
void *kc_scratch(kern_cuda_ctx *c, size_t bytes, const char *what);

static inline size_t kc_align(size_t bytes)
{
    return (bytes + 255u) & ~(size_t)255u;
}

/* Sum over the 32 lanes of a warp by a fixed butterfly; every lane gets the same bits (each
 * step adds the same two values on both lanes, and float addition is commutative). */
__device__ __forceinline__ float kc_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float kc_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* kern_round_bf16's rule (kern_ops.h) on the bits: round to nearest even on the 16 bits
 * dropped (carries into the exponent are right: max finite rounds to inf), NaN kept quiet. */
__device__ __forceinline__ uint16_t kc_bf16_bits(float x)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
        u = u | 0x00400000u; /* NaN stays a quiet NaN */
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Store an fp32 result as the output type: float as is, uint16_t (bf16 bits) rounded. The
 * kernels that have a bf16 output are templates over it, so both precisions run the same
 * arithmetic up to the store. */
__device__ __forceinline__ void kc_store(float *p, float v) { *p = v; }
__device__ __forceinline__ void kc_store(uint16_t *p, float v) { *p = kc_bf16_bits(v); }

/* ---- launchers (kern_ops.h semantics; ctx is the kern_cuda_ctx) */
void kc_matmul_forward(void *ctx, float *out, const float *inp, const float *weight,
                       const float *bias, int N, int C, int OC);
void kc_matmul_backward(void *ctx, float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, int N, int C, int OC);
void kc_round_bf16(void *ctx, uint16_t *dst, const float *src, size_t n);
void kc_matmul_forward_bf16(void *ctx, float *out, const uint16_t *inp, const uint16_t *weight,
                            const float *bias, int N, int C, int OC);
void kc_matmul_backward_bf16(void *ctx, float *dinp, float *dweight, float *dbias,
                             const float *dout, const uint16_t *inp, const uint16_t *weight,
                             int N, int C, int OC);
void kc_attention_forward(void *ctx, float *out, float *att, float *scratch, const float *qkv,
                          int B, int T, int C, int NH);
void kc_attention_forward_bf16(void *ctx, uint16_t *out, float *att, float *scratch,
                               const float *qkv, int B, int T, int C, int NH);
void kc_attention_backward(void *ctx, float *dqkv, float *scratch, const float *dout,
                           const float *qkv, const float *att, int B, int T, int C, int NH);
void kc_block_sumsq(void *ctx, const float *x, size_t n, double *out);
void kc_adamw(void *ctx, float *params, float *m, float *v, const float *grads, size_t n,
              const kern_adamw_args *a);
void kc_rank_tree_sum(void *ctx, float *out, const float *in, size_t n, size_t stride,
                      int nranks);

/* Column sums of a (N, C) row-major matrix, added to dst (C): dst[j] += sum_n a[n, j], summed
 * in chunks of KC_ROWS_PER_CHUNK rows (each in row order), then the chunk partials in chunk
 * order; deterministic, no atomics. a is fp32, or bf16 (a16) when a is NULL. Scratch: the
 * partials, from `part` (ceil(N / KC_ROWS_PER_CHUNK) * C floats) - the caller's piece of the
 * arena. */
void kc_colsum_add(kern_cuda_ctx *c, float *dst, const float *a, const uint16_t *a16, int N,
                   int C, float *part, const char *what);

#endif /* KERN_CUDA_INTERNAL_CUH */
