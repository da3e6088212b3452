/* kern_ops.h - the kernels of one backend behind one table, so that the model, the optimizer
 * and the collectives run unchanged on the CPU and on CUDA.
 *
 * Every pointer argument is memory of the backend's device (train/device.h: host memory for
 * the CPU backend, device memory for CUDA) unless the comment says host. Shapes, layouts,
 * accumulate-vs-overwrite and determinism are exactly those of kernels.h, whose functions the
 * CPU table calls (so the CPU backend gives the bits it gave before this table existed).
 *
 * Execution: CPU - each call runs to completion in the calling thread. CUDA - each call only
 * queues work on the context's stream (kern_cuda_ctx.stream) and returns; results are visible
 * after a copy or wait on that stream (train_device_copy waits for the compute stream).
 *
 * Errors: launches return nothing (as kernels.h); a backend's first failure (a CUDA launch or
 * cuBLAS error) is kept and returned by ops->status(ctx) (0 or a negative errno: -EIO a CUDA
 * or cuBLAS failure, logged once with the call's name; -ENOMEM workspace). Callers check the
 * status once per step.
 *
 * Determinism (DESIGN section 4): on both backends no float atomics in accumulations and fixed
 * reduction trees: for fixed shapes and inputs every op gives the same bits run to run. CUDA
 * bits differ from CPU bits (other summation orders, FMA); kernel-vs-CPU tolerances are those
 * of tests/gpu (fp32 1e-5 relative, bf16 1e-2). GEMMs: CPU CBLAS sgemm; CUDA cuBLAS with the
 * default (non-atomic) mode and a fixed workspace, so that the same algorithm runs each time.
 *
 * bf16 (ops->bf16 = 1, `--dtype bf16`): the model keeps bf16 working parameters and stores
 * the activations that feed GEMMs in bf16 (uint16_t arrays of bf16 bit patterns, the top 16
 * bits of an IEEE fp32, rounded by kern_round_bf16's rule: round to nearest even, NaN kept a
 * quiet NaN). It uses the *_bf16 entries below:
 *   round_bf16                  the working parameters, from the fp32 master parameters;
 *   layernorm_forward_bf16,     LayerNorm, attention and GELU compute in fp32 and store their
 *   attention_forward_bf16,     output rounded to bf16 (those outputs are read only by the
 *   gelu_forward_bf16           next GEMM);
 *   matmul_forward_bf16,        GEMMs with bf16 operands (inp, weight, and dout rounded here)
 *   matmul_backward_bf16        and fp32 products, sums, bias, dinp, dweight, dbias.
 * Everything else stays fp32: the residual stream, qkv, the attention probabilities, the
 * GELU input (the backward passes read them at full precision), gradients, the optimizer.
 * Master weights, Adam moments and gradient accumulation are fp32, so snapshots hold fp32
 * state. Because every rounded tensor is one that the GEMM used to round on input, a bf16
 * model gives the bits of "fp32 kernels whose GEMM operands are rounded to bf16" (the CPU's
 * emulation before bf16 storage existed; tests/unit/test_train_model checks it).
 * CPU: the bf16 arrays are widened into scratch (exactly) and sgemm runs on them (an
 * emulation, for tests); CUDA: cublasGemmEx with CUDA_R_16BF inputs and CUBLAS_COMPUTE_32F.
 * In a table with bf16 = 0 the *_bf16 entries are NULL.
 *
 * Thread-safety: one table and its context are used by one thread at a time.
 */
#ifndef KERN_OPS_H
#define KERN_OPS_H

#include <stddef.h>
#include <stdint.h>

/* One AdamW step's constants (optim.h's train_adamw_update_shard computes the same). */
typedef struct kern_adamw_args {
    float lr, beta1, beta2, eps;
    float weight_decay; /* already 0 for tensors without decay */
    float bc1, bc2;     /* 1 - beta1^t, 1 - beta2^t */
} kern_adamw_args;

typedef struct kern_ops {
    const char *name; /* "cpu" or "cuda" */
    void *ctx;        /* backend context: CPU kern_cpu_ctx *, CUDA kern_cuda_ctx * */
    int bf16;         /* see the top */

    /* ---- the model: the functions of kernels.h, same arguments after ctx */
    void (*encoder_forward)(void *ctx, float *out, const int32_t *inp, const float *wte,
                            const float *wpe, int B, int T, int C);
    void (*encoder_backward)(void *ctx, float *dwte, float *dwpe, const float *dout,
                             const int32_t *inp, int B, int T, int C);
    void (*layernorm_forward)(void *ctx, float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C);
    void (*layernorm_backward)(void *ctx, float *dinp, float *dweight, float *dbias,
                               const float *dout, const float *inp, const float *weight,
                               const float *mean, const float *rstd, int N, int C);
    void (*matmul_forward)(void *ctx, float *out, const float *inp, const float *weight,
                           const float *bias, int N, int C, int OC);
    void (*matmul_backward)(void *ctx, float *dinp, float *dweight, float *dbias,
                            const float *dout, const float *inp, const float *weight, int N,
                            int C, int OC);
    void (*attention_forward)(void *ctx, float *out, float *att, float *scratch,
                              const float *qkv, int B, int T, int C, int NH);
    void (*attention_backward)(void *ctx, float *dqkv, float *scratch, const float *dout,
                               const float *qkv, const float *att, int B, int T, int C, int NH);
    void (*gelu_forward)(void *ctx, float *out, const float *inp, size_t n);
    void (*gelu_backward)(void *ctx, float *dinp, const float *inp, const float *dout, size_t n);
    void (*residual_forward)(void *ctx, float *out, const float *a, const float *b, size_t n);
    void (*residual_backward)(void *ctx, float *da, float *db, const float *dout, size_t n);
    void (*softmax_crossentropy_forward)(void *ctx, float *probs, float *losses,
                                         const float *logits, const int32_t *targets, int N,
                                         int V);
    void (*softmax_crossentropy_backward)(void *ctx, float *dlogits, const float *probs,
                                          const int32_t *targets, float dloss, int N, int V);

    /* ---- bf16 (see the top; NULL when bf16 = 0). uint16_t arrays hold bf16 bit patterns.
     * dst[i] = bf16(src[i]) for n elements. */
    void (*round_bf16)(void *ctx, uint16_t *dst, const float *src, size_t n);
    /* layernorm_forward, attention_forward, gelu_forward with out rounded to bf16 (mean, rstd,
     * att stay fp32); the same fp32 arithmetic as the fp32 entries before the rounding. */
    void (*layernorm_forward_bf16)(void *ctx, uint16_t *out, float *mean, float *rstd,
                                   const float *inp, const float *weight, const float *bias,
                                   int N, int C);
    void (*attention_forward_bf16)(void *ctx, uint16_t *out, float *att, float *scratch,
                                   const float *qkv, int B, int T, int C, int NH);
    void (*gelu_forward_bf16)(void *ctx, uint16_t *out, const float *inp, size_t n);
    /* matmul_forward / matmul_backward on bf16 operands: out (N,OC) = inp (N,C) @ weight
     * (OC,C)^T + bias with products summed in fp32; backward rounds dout (fp32) to bf16 and
     * accumulates dinp (may be NULL), dweight and dbias (may be NULL: the column sums of the
     * rounded dout) in fp32. Scratch: CPU the widened operands, CUDA the rounded dout. */
    void (*matmul_forward_bf16)(void *ctx, float *out, const uint16_t *inp,
                                const uint16_t *weight, const float *bias, int N, int C, int OC);
    void (*matmul_backward_bf16)(void *ctx, float *dinp, float *dweight, float *dbias,
                                 const float *dout, const uint16_t *inp, const uint16_t *weight,
                                 int N, int C, int OC);

    /* ---- optimizer, accumulation, norms (flat fp32 vectors of n elements) */
    void (*zero)(void *ctx, float *x, size_t n);                   /* x = 0 */
    void (*copy)(void *ctx, float *dst, const float *src, size_t n); /* dst = src (no overlap) */
    void (*add)(void *ctx, float *acc, const float *x, size_t n);  /* acc[i] = acc[i] + x[i] */
    void (*scale)(void *ctx, float *x, size_t n, float s);         /* x[i] *= s */
    /* out[k] (double, device memory) = sum over the TRAIN_BLOCK (2048) elements of block k of
     * x[i]^2 in double, in index order within the block (CPU) / a fixed tree (CUDA);
     * n a multiple of 2048; n / 2048 outputs. */
    void (*block_sumsq)(void *ctx, const float *x, size_t n, double *out);
    /* One AdamW update of n contiguous elements of one tensor (optim.h's loop body):
     * m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/bc1 / (sqrt(v/bc2) + eps) + wd p). */
    void (*adamw)(void *ctx, float *params, float *m, float *v, const float *grads, size_t n,
                  const kern_adamw_args *a);
    /* Deterministic sum over ranks: out[i] = the pairwise tree sum (comm.h's tree over rank
     * index: left subtree = the largest power of two below the count) of in[r * stride + i]
     * for r in [0, nranks), i in [0, n). in: nranks x stride floats; out may be in (r = 0). */
    void (*rank_tree_sum)(void *ctx, float *out, const float *in, size_t n, size_t stride,
                          int nranks);
    /* Byte shuffle (the snapshot filter, ckpt's shuffle with element size 4) of n bytes
     * (n a multiple of 4): out[j * (n/4) + i] = in[4 i + j]. */
    void (*shuffle4)(void *ctx, uint8_t *out, const uint8_t *in, size_t n);

    /* First failure since creation (see Errors), 0 when none. */
    int (*status)(void *ctx);
} kern_ops;

/* The CPU table (kernels/cpu/kern_ops_cpu.c). ctx is NULL for fp32; with bf16 = 1 the table
 * holds a scratch context: the widened bf16 GEMM operands, and the fp32 outputs of the
 * *_forward_bf16 entries before they are rounded (grown to the largest call, kept until
 * kern_cpu_ops_free; a failed allocation makes the call a no-op and status -ENOMEM). *out is
 * filled in (no allocation for fp32). Errors: -ENOMEM. Free with kern_cpu_ops_free. */
int kern_cpu_ops_init(kern_ops *out, int bf16);
void kern_cpu_ops_free(kern_ops *ops);

/* Round x to the nearest bf16 (ties to even), returned as a float; NaN stays NaN. The
 * reference both backends follow for bf16. */
float kern_round_bf16(float x);

#endif /* KERN_OPS_H */
