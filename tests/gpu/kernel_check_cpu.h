/* kernel_check_cpu.h - kernel_check's harness on the CPU: the few CUDA runtime calls it makes,
 * on host memory, and kern_cuda_ops_init giving the CPU table (kern_ops_cpu.c). Included by
 * kernel_check.c when KERNEL_CHECK_CPU is defined (the unit test kernel_check_cpu, which has
 * no GPU): every check then compares the CPU table with itself and must pass, and the defects
 * that KERNEL_CHECK_INJECT plants into the "GPU" table must each make the check meant to
 * catch them fail (tests/gpu/kernel_check_selftest.py). It tests the harness, not a kernel.
 *
 * KERNEL_CHECK_INJECT=<name>, one of:
 *   ce_backward_scaled   softmax_crossentropy_backward adds 1.0002x its gradient (an error of
 *                        2e-4 of the gradient, 4e-7 of a random start: only "from 0" sees it)
 *   mm16_unrounded_dout  matmul_backward_bf16 on dout not rounded to bf16 (about 1.5e-3)
 *   gelu_last_unwritten  gelu_forward leaves the last element as it was (0xFF bytes: NaN)
 *   colsum_first_chunk   matmul_backward's dbias sums only the first 256 rows
 *   adamw_one_grid       adamw updates only the first 65536 x 256 elements
 */
#ifndef KERNEL_CHECK_CPU_H
#define KERNEL_CHECK_CPU_H

#include "kern_ops.h"
#include "kernels.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorNotReady = 600 };
enum { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
#define cudaStreamNonBlocking 1u

static cudaError_t cudaGetDeviceCount(int *n)
{
    *n = 1;
    return cudaSuccess;
}
static const char *cudaGetErrorString(cudaError_t e)
{
    return e == cudaErrorMemoryAllocation ? "out of memory (CPU shim)" : "error (CPU shim)";
}
static cudaError_t cudaMalloc(void **p, size_t bytes)
{
    *p = malloc(bytes);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
static cudaError_t cudaFree(void *p)
{
    free(p);
    return cudaSuccess;
}
static cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind,
                                   cudaStream_t s)
{
    (void)kind, (void)s;
    memcpy(dst, src, bytes);
    return cudaSuccess;
}
static cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s)
{
    (void)s;
    memset(dst, value, bytes);
    return cudaSuccess;
}
static cudaError_t cudaStreamQuery(cudaStream_t s)
{
    (void)s;
    return cudaSuccess;
}
static cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
static cudaError_t cudaGetLastError(void) { return cudaSuccess; }
static cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    (void)flags;
    *s = NULL;
    return cudaSuccess;
}
static cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    (void)s;
    return cudaSuccess;
}

/* ---- the planted defects */

static void (*inj_ce_backward)(void *, float *, const float *, const int32_t *, float, int, int);
static void inj_ce_backward_scaled(void *ctx, float *dlogits, const float *probs,
                                   const int32_t *targets, float dloss, int N, int V)
{
    const size_t n = (size_t)N * V;
    float *g = calloc(n ? n : 1, sizeof(float));
    if (!g) abort();
    inj_ce_backward(ctx, g, probs, targets, dloss, N, V);
    for (size_t i = 0; i < n; i++) dlogits[i] += g[i] * 1.0002f;
    free(g);
}

static float *inj_widen(const uint16_t *h, size_t n)
{
    float *f = malloc((n ? n : 1) * sizeof(float));
    if (!f) abort();
    for (size_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)h[i] << 16;
        memcpy(&f[i], &u, sizeof u);
    }
    return f;
}
static void inj_mm16_unrounded_dout(void *ctx, float *dinp, float *dweight, float *dbias,
                                    const float *dout, const uint16_t *inp,
                                    const uint16_t *weight, int N, int C, int OC)
{
    (void)ctx;
    float *fi = inj_widen(inp, (size_t)N * C), *fw = inj_widen(weight, (size_t)OC * C);
    kern_matmul_backward(dinp, dweight, dbias, dout, fi, fw, N, C, OC);
    free(fi), free(fw);
}

static void (*inj_gelu_forward)(void *, float *, const float *, size_t);
static void inj_gelu_last_unwritten(void *ctx, float *out, const float *inp, size_t n)
{
    if (n) inj_gelu_forward(ctx, out, inp, n - 1);
}

static void (*inj_mm_backward)(void *, float *, float *, float *, const float *, const float *,
                               const float *, int, int, int);
static void inj_colsum_first_chunk(void *ctx, float *dinp, float *dweight, float *dbias,
                                   const float *dout, const float *inp, const float *weight,
                                   int N, int C, int OC)
{
    inj_mm_backward(ctx, dinp, dweight, NULL, dout, inp, weight, N, C, OC);
    if (!dbias) return;
    const int rows = N < 256 ? N : 256;
    for (int o = 0; o < OC; o++) {
        float sum = 0.0f;
        for (int r = 0; r < rows; r++) sum += dout[(size_t)r * OC + o];
        dbias[o] += sum;
    }
}

static void (*inj_adamw)(void *, float *, float *, float *, const float *, size_t,
                         const kern_adamw_args *);
static void inj_adamw_one_grid(void *ctx, float *params, float *m, float *v, const float *grads,
                               size_t n, const kern_adamw_args *a)
{
    const size_t grid = (size_t)65536 * 256;
    inj_adamw(ctx, params, m, v, grads, n < grid ? n : grid, a);
}

static int kern_cuda_ops_init(kern_ops *out, void *stream, int bf16)
{
    (void)stream;
    const int rc = kern_cpu_ops_init(out, bf16);
    const char *inj = getenv("KERNEL_CHECK_INJECT");
    if (rc || !inj || !*inj) return rc;
    if (!strcmp(inj, "ce_backward_scaled")) {
        inj_ce_backward = out->softmax_crossentropy_backward;
        out->softmax_crossentropy_backward = inj_ce_backward_scaled;
    } else if (!strcmp(inj, "mm16_unrounded_dout")) {
        if (bf16) out->matmul_backward_bf16 = inj_mm16_unrounded_dout;
    } else if (!strcmp(inj, "gelu_last_unwritten")) {
        inj_gelu_forward = out->gelu_forward;
        out->gelu_forward = inj_gelu_last_unwritten;
    } else if (!strcmp(inj, "colsum_first_chunk")) {
        inj_mm_backward = out->matmul_backward;
        out->matmul_backward = inj_colsum_first_chunk;
    } else if (!strcmp(inj, "adamw_one_grid")) {
        inj_adamw = out->adamw;
        out->adamw = inj_adamw_one_grid;
    } else {
        fprintf(stderr, "kernel_check: unknown KERNEL_CHECK_INJECT '%s'\n", inj);
        kern_cpu_ops_free(out);
        return -22; /* -EINVAL */
    }
    return 0;
}

static void kern_cuda_ops_free(kern_ops *ops)
{
    kern_cpu_ops_free(ops);
}

#endif /* KERNEL_CHECK_CPU_H */
