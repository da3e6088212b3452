/* kern_cuda_attention.cu - causal multi-head self-attention, forward and backward, the
 * semantics of kern_cpu.c: qkv (B,T,3C), att (B,NH,T,T) the saved softmax (0 above the
 * diagonal), out (B,T,C), scale 1/sqrt(hs), fp32 throughout; the bf16 entry only rounds out
 * when it is stored (kern_ops.h).
 *
 * Per sequence b, the NH heads are one cuBLAS strided-batched GEMM each step: a head's q, k
 * and v are (T, hs) views of qkv with leading dimension 3C, one head hs floats from the next
 * (the same views kern_cpu.c hands to cblas_sgemm). Inputs may interleave across the batch;
 * outputs never do: products land in contiguous (NH, T, hs) or (NH, T, T) arrays (att itself,
 * or the arena), and our own kernels scatter them into out / add them into dqkv. The softmax
 * and its backward are one warp per row with fixed butterflies.
 *
 * The caller's `scratch` (sized for the CPU: T*T, 2*T*T floats) is not used; the arena holds
 * B*T*C floats (forward) or NH*T*T + 3*T*C floats (backward).
 */
#include "kern_cuda_internal.cuh"

#define SM_WARPS 8 /* rows per block in the softmax kernels */

static kern_cuda_ctx *C_(void *ctx)
{
    return (kern_cuda_ctx *)ctx;
}

/* In place on rows of (rows, T): row r is query position t = r % T; entries t2 <= t become
 * the softmax of the row's first t + 1 entries, the rest 0. */
__global__ void k_causal_softmax(float *att, int T, size_t rows)
{
    const size_t r = blockIdx.x * (size_t)SM_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const int t = (int)(r % (size_t)T);
    float *a = att + r * T;
    float mx = -INFINITY;
    for (int i = lane; i <= t; i += 32) mx = fmaxf(mx, a[i]);
    mx = kc_warp_max(mx);
    float s = 0.0f;
    for (int i = lane; i <= t; i += 32) {
        const float e = expf(a[i] - mx);
        a[i] = e;
        s += e;
    }
    s = kc_warp_sum(s);
    for (int i = lane; i <= t; i += 32) a[i] = a[i] / s;
    for (int i = t + 1 + lane; i < T; i += 32) a[i] = 0.0f;
}

/* In place: datt (rows, T) becomes dpreatt = att * (datt - sum(att .* datt)) * scale for
 * t2 <= t, 0 above. Each lane writes only the entries it read. */
__global__ void k_causal_softmax_backward(float *datt, const float *att, int T, size_t rows,
                                          float scale)
{
    const size_t r = blockIdx.x * (size_t)SM_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const int t = (int)(r % (size_t)T);
    float *d = datt + r * T;
    const float *a = att + r * T;
    float dot = 0.0f;
    for (int i = lane; i <= t; i += 32) dot += a[i] * d[i];
    dot = kc_warp_sum(dot);
    for (int i = lane; i <= t; i += 32) d[i] = (a[i] * (d[i] - dot)) * scale;
    for (int i = t + 1 + lane; i < T; i += 32) d[i] = 0.0f;
}

/* out (B,T,C)[b,t,h*hs+d] = y (B,NH,T,hs)[b,h,t,d]; one thread per element of out. */
template <typename O>
__global__ void k_unpermute(O *out, const float *y, int T, int C, int NH, size_t n)
{
    const int hs = C / NH;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t bt = i / (size_t)C;
        const int ch = (int)(i - bt * (size_t)C);
        const size_t b = bt / (size_t)T;
        const int t = (int)(bt - b * (size_t)T);
        const int h = ch / hs, d = ch - h * hs;
        kc_store(&out[i], y[(((b * NH) + h) * T + t) * hs + d]);
    }
}

/* dqkv (T,3C) of one sequence += g (3, NH, T, hs) (dq, dk, dv); one thread per element. */
__global__ void k_add_dqkv(float *dqkv, const float *g, int T, int C, int NH, size_t n)
{
    const int hs = C / NH;
    const int C3 = 3 * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / (size_t)C3);
        const int col = (int)(i - (size_t)t * C3);
        const int which = col / C, ch = col - which * C;
        const int h = ch / hs, d = ch - h * hs;
        dqkv[i] = __fadd_rn(dqkv[i], g[(((size_t)which * NH + h) * T + t) * hs + d]);
    }
}

static unsigned grid_for(size_t n)
{
    const size_t want = (n + KC_THREADS - 1) / KC_THREADS;
    return (unsigned)(want < 65536 ? want : 65536);
}

/* C_h (ldc, strideC) = op(A_h) op(B_h) batched over the NH heads (column-major terms). */
static int gemm_heads(kern_cuda_ctx *c, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                      int k, float alpha, const float *A, int lda, long long sa, const float *B,
                      int ldb, long long sb, float *Cm, int ldc, long long sc, int NH,
                      const char *what)
{
    const float beta = 0.0f;
    return kc_cublas_ok(c, cublasSgemmStridedBatched(c->cublas, ta, tb, m, n, k, &alpha, A, lda,
                                                     sa, B, ldb, sb, &beta, Cm, ldc, sc, NH),
                        what);
}

/* out as float (fp32) or uint16_t (bf16: rounded in the final scatter, kern_ops.h). */
template <typename O>
static void attention_forward(void *ctx, O *out, float *att, float *scratch, const float *qkv,
                              int B, int T, int C, int NH)
{
    (void)scratch;
    kern_cuda_ctx *c = C_(ctx);
    if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return;
    if (C % NH) {
        kc_fail(c, -EINVAL, "attention_forward", "C is not a multiple of NH");
        return;
    }
    const int hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    const long long TT = (long long)T * T;
    float *y = (float *)kc_scratch(c, (size_t)B * T * C * sizeof(float),
                                   "attention_forward scratch");
    if (!y) return;
    for (int b = 0; b < B; b++) {
        const float *q = qkv + (size_t)b * T * C3, *k = q + C, *v = q + 2 * C;
        float *ab = att + (size_t)b * NH * TT;
        float *yb = y + (size_t)b * T * C;
        /* preatt_h (T,T) = scale q_h k_h^T, into att (the upper triangle is overwritten) */
        if (!gemm_heads(c, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, k, C3, hs, q, C3, hs, ab, T,
                        TT, NH, "attention_forward q k^T"))
            return;
        const size_t rows = (size_t)NH * T;
        k_causal_softmax<<<kc_blocks(rows, SM_WARPS), SM_WARPS * 32, 0, c->stream>>>(ab, T, rows);
        kc_launched(c, "k_causal_softmax");
        /* y_h (T,hs) = att_h (T,T) @ v_h (T,hs) */
        if (!gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, v, C3, hs, ab, T, TT, yb, hs,
                        (long long)T * hs, NH, "attention_forward att v"))
            return;
    }
    const size_t n = (size_t)B * T * C;
    k_unpermute<O><<<grid_for(n), KC_THREADS, 0, c->stream>>>(out, y, T, C, NH, n);
    kc_launched(c, "k_unpermute");
}

void kc_attention_forward(void *ctx, float *out, float *att, float *scratch, const float *qkv,
                          int B, int T, int C, int NH)
{
    attention_forward<float>(ctx, out, att, scratch, qkv, B, T, C, NH);
}

void kc_attention_forward_bf16(void *ctx, uint16_t *out, float *att, float *scratch,
                               const float *qkv, int B, int T, int C, int NH)
{
    attention_forward<uint16_t>(ctx, out, att, scratch, qkv, B, T, C, NH);
}

void kc_attention_backward(void *ctx, float *dqkv, float *scratch, const float *dout,
                           const float *qkv, const float *att, int B, int T, int C, int NH)
{
    (void)scratch;
    kern_cuda_ctx *c = C_(ctx);
    if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return;
    if (C % NH) {
        kc_fail(c, -EINVAL, "attention_backward", "C is not a multiple of NH");
        return;
    }
    const int hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    const long long TT = (long long)T * T, Ths = (long long)T * hs;
    const size_t ndatt = (size_t)NH * TT, ng = 3 * (size_t)T * C;
    float *s = (float *)kc_scratch(c, (ndatt + ng) * sizeof(float), "attention_backward scratch");
    if (!s) return;
    float *datt = s, *g = s + ndatt;
    float *gq = g, *gk = g + (size_t)NH * Ths, *gv = g + 2 * (size_t)NH * Ths;
    const size_t rows = (size_t)NH * T;
    for (int b = 0; b < B; b++) {
        const float *q = qkv + (size_t)b * T * C3, *k = q + C, *v = q + 2 * C;
        const float *ab = att + (size_t)b * NH * TT;
        const float *d = dout + (size_t)b * T * C; /* head h: (T,hs), ld C */
        /* datt_h (T,T) = dout_h @ v_h^T */
        if (!gemm_heads(c, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, v, C3, hs, d, C, hs, datt, T,
                        TT, NH, "attention_backward dout v^T"))
            return;
        /* dv_h (T,hs) = att_h^T @ dout_h */
        if (!gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, d, C, hs, ab, T, TT, gv, hs,
                        Ths, NH, "attention_backward att^T dout"))
            return;
        k_causal_softmax_backward<<<kc_blocks(rows, SM_WARPS), SM_WARPS * 32, 0, c->stream>>>(
            datt, ab, T, rows, scale);
        kc_launched(c, "k_causal_softmax_backward");
        /* dq_h = dpreatt_h @ k_h; dk_h = dpreatt_h^T @ q_h */
        if (!gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, k, C3, hs, datt, T, TT, gq, hs,
                        Ths, NH, "attention_backward dpreatt k"))
            return;
        if (!gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, q, C3, hs, datt, T, TT, gk, hs,
                        Ths, NH, "attention_backward dpreatt^T q"))
            return;
        const size_t n = (size_t)T * C3;
        k_add_dqkv<<<grid_for(n), KC_THREADS, 0, c->stream>>>(dqkv + (size_t)b * T * C3, g, T, C,
                                                              NH, n);
        kc_launched(c, "k_add_dqkv");
    }
}
