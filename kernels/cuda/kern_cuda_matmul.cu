/* kern_cuda_matmul.cu - matmul forward/backward on cuBLAS, fp32 (cublasSgemm) and bf16
 * operands (cublasGemmEx: CUDA_R_16BF inputs, CUDA_R_32F output, CUBLAS_COMPUTE_32F).
 *
 * Row-major (N, C) @ (OC, C)^T is the column-major product W^T-view x X-view, so every call
 * below swaps the operands (llm.c's form). The bias add and the bias gradient (column sums)
 * are our own kernels: one thread per element / fixed chunked sums (kc_colsum_add).
 *
 * bf16: inp and weight arrive as bf16 (the model's bf16 activations and working parameters,
 * kern_ops.h); dout is rounded to bf16 with kern_round_bf16's rule (kc_bf16_bits) into the
 * arena, so that the GPU multiplies exactly the values the CPU emulation multiplies; the bias
 * gradient is the column sum of the rounded dout (as kernels/cpu/kern_ops_cpu.c).
 * kc_round_bf16 (k_round_bf16) makes the working parameters.
 */
#include "kern_cuda_internal.cuh"

static kern_cuda_ctx *C_(void *ctx)
{
    return (kern_cuda_ctx *)ctx;
}

/* out (N,OC) += bias (OC) per row; one thread per element. */
__global__ void k_bias_add(float *out, const float *bias, int OC, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __fadd_rn(out[i], bias[i % (size_t)OC]);
}

__global__ void k_round_bf16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = kc_bf16_bits(src[i]);
}

static unsigned grid_for(size_t n)
{
    const size_t want = (n + KC_THREADS - 1) / KC_THREADS;
    return (unsigned)(want < 65536 ? want : 65536);
}

static void bias_add(kern_cuda_ctx *c, float *out, const float *bias, int N, int OC)
{
    const size_t n = (size_t)N * OC;
    k_bias_add<<<grid_for(n), KC_THREADS, 0, c->stream>>>(out, bias, OC, n);
    kc_launched(c, "k_bias_add");
}

static void round_to(kern_cuda_ctx *c, uint16_t *dst, const float *src, size_t n)
{
    k_round_bf16<<<grid_for(n), KC_THREADS, 0, c->stream>>>(dst, src, n);
    kc_launched(c, "k_round_bf16");
}

/* Column-sum partials for a bias gradient of N rows: floats. */
static size_t bias_part_floats(int N, int OC)
{
    return (size_t)((N + KC_ROWS_PER_CHUNK - 1) / KC_ROWS_PER_CHUNK) * (size_t)OC;
}

static const float one = 1.0f, zero = 0.0f;

void kc_matmul_forward(void *ctx, float *out, const float *inp, const float *weight,
                       const float *bias, int N, int C, int OC)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || OC <= 0 || C <= 0) return;
    /* out^T (OC,N) = W (OC,C) . inp^T (C,N) in column-major terms */
    if (!kc_cublas_ok(c, cublasSgemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, weight,
                                     C, inp, C, &zero, out, OC),
                      "matmul_forward cublasSgemm"))
        return;
    if (bias) bias_add(c, out, bias, N, OC);
}

void kc_matmul_backward(void *ctx, float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, int N, int C, int OC)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || OC <= 0 || C <= 0) return;
    /* dinp (N,C) += dout (N,OC) @ weight (OC,C) */
    if (dinp && !kc_cublas_ok(c, cublasSgemm(c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one,
                                             weight, C, dout, OC, &one, dinp, C),
                              "matmul_backward dinp cublasSgemm"))
        return;
    /* dweight (OC,C) += dout^T (OC,N) @ inp (N,C) */
    if (!kc_cublas_ok(c, cublasSgemm(c->cublas, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp, C,
                                     dout, OC, &one, dweight, C),
                      "matmul_backward dweight cublasSgemm"))
        return;
    if (dbias) {
        float *part = (float *)kc_scratch(c, bias_part_floats(N, OC) * sizeof(float),
                                          "matmul_backward scratch");
        if (part) kc_colsum_add(c, dbias, dout, NULL, N, OC, part, "matmul_backward dbias");
    }
}

static int gemm_bf16(kern_cuda_ctx *c, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                     int k, const uint16_t *A, int lda, const uint16_t *B, int ldb, float beta,
                     float *Cm, int ldc, const char *what)
{
    return kc_cublas_ok(c, cublasGemmEx(c->cublas, ta, tb, m, n, k, &one, A, CUDA_R_16BF, lda, B,
                                        CUDA_R_16BF, ldb, &beta, Cm, CUDA_R_32F, ldc,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                        what);
}

void kc_round_bf16(void *ctx, uint16_t *dst, const float *src, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    if (n) round_to(c, dst, src, n);
}

void kc_matmul_forward_bf16(void *ctx, float *out, const uint16_t *inp, const uint16_t *weight,
                            const float *bias, int N, int C, int OC)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || OC <= 0 || C <= 0) return;
    if (!gemm_bf16(c, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, 0.0f, out, OC,
                   "matmul_forward cublasGemmEx"))
        return;
    if (bias) bias_add(c, out, bias, N, OC);
}

void kc_matmul_backward_bf16(void *ctx, float *dinp, float *dweight, float *dbias,
                             const float *dout, const uint16_t *inp, const uint16_t *weight, int N,
                             int C, int OC)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || OC <= 0 || C <= 0) return;
    const size_t nd = (size_t)N * OC;
    const size_t op = kc_align(nd * 2);
    const size_t bytes = op + (dbias ? bias_part_floats(N, OC) * sizeof(float) : 0);
    uint8_t *s = (uint8_t *)kc_scratch(c, bytes, "matmul_backward bf16 scratch");
    if (!s) return;
    uint16_t *d16 = (uint16_t *)s;
    round_to(c, d16, dout, nd);
    if (dinp && !gemm_bf16(c, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, d16, OC, 1.0f, dinp,
                           C, "matmul_backward dinp cublasGemmEx"))
        return;
    if (!gemm_bf16(c, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, d16, OC, 1.0f, dweight, C,
                   "matmul_backward dweight cublasGemmEx"))
        return;
    if (dbias)
        kc_colsum_add(c, dbias, NULL, d16, N, OC, (float *)(s + op), "matmul_backward dbias");
}
