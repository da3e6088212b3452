/* kern_cuda.cu - the CUDA table of kern_ops.h: context, element-wise ops, embedding,
 * LayerNorm, fused softmax + cross-entropy, the byte shuffle, and the deterministic column
 * sums shared with the matmul.
 *
 * Determinism: no atomics; each output element is written by one thread; every reduction
 * has a fixed shape (warp butterflies, shared-memory trees, sequential loops over a fixed
 * number of rows), chosen by the shapes only - never by timing or by the device's size.
 * Where the CPU order is cheap to follow (the embedding backward, the residuals), it is
 * followed, and those ops give the CPU's bits.
 */
#include "kern_cuda_internal.cuh"

#include <stdlib.h>
#include <string.h>

#define LN_EPS 1e-5f
#define GELU_SCALING_FACTOR 0.7978845608028654f /* sqrt(2/pi) */
#define ENC_SLICES 16                           /* token-id classes per column (encoder bwd) */
#define LN_WARPS 8                              /* rows per block in LayerNorm */

static kern_cuda_ctx *C_(void *ctx)
{
    return (kern_cuda_ctx *)ctx;
}

void *kc_scratch(kern_cuda_ctx *c, size_t bytes, const char *what)
{
    bytes = kc_align(bytes ? bytes : 1);
    if (bytes <= c->scratch_cap) return c->scratch;
    if (c->scratch) {
        /* stream-ordered: released after the work already queued that uses it */
        if (!kc_cuda_ok(c, cudaFreeAsync(c->scratch, c->stream), what)) return NULL;
        c->scratch = NULL;
        c->scratch_cap = 0;
    }
    void *p = NULL;
    if (!kc_cuda_ok(c, cudaMallocAsync(&p, bytes, c->stream), what)) return NULL;
    c->scratch = p;
    c->scratch_cap = bytes;
    return p;
}

/* ------------------------------------------------------------------ element-wise */

__global__ void k_zero(float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = 0.0f;
}

__global__ void k_copy(float *dst, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

__global__ void k_add(float *acc, const float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        acc[i] = __fadd_rn(acc[i], x[i]);
}

__global__ void k_scale(float *x, size_t n, float s)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], s);
}

__global__ void k_residual_forward(float *out, const float *a, const float *b, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __fadd_rn(a[i], b[i]);
}

__global__ void k_residual_backward(float *da, float *db, const float *dout, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float d = dout[i];
        da[i] = __fadd_rn(da[i], d);
        db[i] = __fadd_rn(db[i], d);
    }
}

/* kern_cpu.c's forms: 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)), and the backward's sigmoid
 * pair formed without cancellation. expf is the accurate one (no fast math). */
template <typename O> __global__ void k_gelu_forward(O *out, const float *inp, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = inp[i];
        const float u = GELU_SCALING_FACTOR * (x + 0.044715f * x * x * x);
        kc_store(&out[i], x / (1.0f + expf(-2.0f * u)));
    }
}

__global__ void k_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = inp[i];
        const float u = GELU_SCALING_FACTOR * (x + 0.044715f * x * x * x);
        const float e = expf(-2.0f * fabsf(u));
        const float r = 1.0f / (1.0f + e);
        const float q = e * r;
        const float s = u >= 0.0f ? r : q;
        const float sm = u >= 0.0f ? q : r;
        const float g =
            s + 2.0f * x * s * sm * GELU_SCALING_FACTOR * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] += g * dout[i];
    }
}

/* Grid for a grid-stride loop over n elements: enough blocks to fill any current GPU, capped
 * so that grid.x stays small; results do not depend on it (one thread per element). */
static unsigned ew_grid(size_t n)
{
    const size_t want = (n + KC_THREADS - 1) / KC_THREADS;
    return (unsigned)(want < 65536 ? want : 65536);
}

#define EW_LAUNCH(name, n, ...)                                                               \
    do {                                                                                      \
        if ((n) == 0) return;                                                                 \
        name<<<ew_grid(n), KC_THREADS, 0, c->stream>>>(__VA_ARGS__);                          \
        kc_launched(c, #name);                                                                \
    } while (0)

static void kc_zero(void *ctx, float *x, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_zero, n, x, n);
}

static void kc_copy(void *ctx, float *dst, const float *src, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_copy, n, dst, src, n);
}

static void kc_add(void *ctx, float *acc, const float *x, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_add, n, acc, x, n);
}

static void kc_scale(void *ctx, float *x, size_t n, float s)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_scale, n, x, n, s);
}

static void kc_residual_forward(void *ctx, float *out, const float *a, const float *b, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_residual_forward, n, out, a, b, n);
}

static void kc_residual_backward(void *ctx, float *da, float *db, const float *dout, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_residual_backward, n, da, db, dout, n);
}

static void kc_gelu_forward(void *ctx, float *out, const float *inp, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_gelu_forward<float>, n, out, inp, n);
}

static void kc_gelu_forward_bf16(void *ctx, uint16_t *out, const float *inp, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_gelu_forward<uint16_t>, n, out, inp, n);
}

static void kc_gelu_backward(void *ctx, float *dinp, const float *inp, const float *dout,
                             size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    EW_LAUNCH(k_gelu_backward, n, dinp, inp, dout, n);
}

/* ------------------------------------------------------------------ embedding */

/* out (B,T,C) = wte[inp[b,t]] + wpe[t]; one thread per element. */
__global__ void k_encoder_forward(float *out, const int32_t *inp, const float *wte,
                                  const float *wpe, int T, int C, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t bt = i / (size_t)C;
        const int ch = (int)(i - bt * (size_t)C);
        const int t = (int)(bt % (size_t)T);
        out[i] = __fadd_rn(wte[(size_t)inp[bt] * C + ch], wpe[(size_t)t * C + ch]);
    }
}

/* dwte scatter without atomics: thread (column ch, class s) owns the entries dwte[tok, ch]
 * of the token ids tok with tok % ENC_SLICES == s, and adds the rows of dout in position
 * order (b, then t) - the CPU's order, so the bits are the CPU's. */
__global__ void k_encoder_backward_wte(float *dwte, const float *dout, const int32_t *inp,
                                       int N, int C)
{
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (tid >= (size_t)C * ENC_SLICES) return;
    const int ch = (int)(tid % (size_t)C);
    const int s = (int)(tid / (size_t)C);
    for (int n = 0; n < N; n++) {
        const int tok = inp[n];
        if (tok % ENC_SLICES != s) continue;
        float *d = dwte + (size_t)tok * C + ch;
        *d = __fadd_rn(*d, dout[(size_t)n * C + ch]);
    }
}

/* dwpe[t, ch] += dout[b, t, ch] for b in order (the CPU's order). */
__global__ void k_encoder_backward_wpe(float *dwpe, const float *dout, int B, int T, int C)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * C) return;
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc = __fadd_rn(acc, dout[(size_t)b * T * C + i]);
    dwpe[i] = acc;
}

static void kc_encoder_forward(void *ctx, float *out, const int32_t *inp, const float *wte,
                               const float *wpe, int B, int T, int C)
{
    kern_cuda_ctx *c = C_(ctx);
    const size_t n = (size_t)B * T * C;
    EW_LAUNCH(k_encoder_forward, n, out, inp, wte, wpe, T, C, n);
}

static void kc_encoder_backward(void *ctx, float *dwte, float *dwpe, const float *dout,
                                const int32_t *inp, int B, int T, int C)
{
    kern_cuda_ctx *c = C_(ctx);
    if (B <= 0 || T <= 0 || C <= 0) return;
    k_encoder_backward_wte<<<kc_blocks((size_t)C * ENC_SLICES, KC_THREADS), KC_THREADS, 0,
                             c->stream>>>(dwte, dout, inp, B * T, C);
    kc_launched(c, "k_encoder_backward_wte");
    k_encoder_backward_wpe<<<kc_blocks((size_t)T * C, KC_THREADS), KC_THREADS, 0, c->stream>>>(
        dwpe, dout, B, T, C);
    kc_launched(c, "k_encoder_backward_wpe");
}

/* ------------------------------------------------------------------ column sums */

/* part[chunk, j] = sum over the rows of the chunk, in row order, of a[n, j] (fp32 or bf16). */
__global__ void k_colsum_part(float *part, const float *a, const uint16_t *a16, int N, int C)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    const int n0 = blockIdx.y * KC_ROWS_PER_CHUNK;
    const int n1 = n0 + KC_ROWS_PER_CHUNK < N ? n0 + KC_ROWS_PER_CHUNK : N;
    float acc = 0.0f;
    if (a) {
        for (int n = n0; n < n1; n++) acc = __fadd_rn(acc, a[(size_t)n * C + j]);
    } else {
        for (int n = n0; n < n1; n++)
            acc = __fadd_rn(acc, __uint_as_float((uint32_t)a16[(size_t)n * C + j] << 16));
    }
    part[(size_t)blockIdx.y * C + j] = acc;
}

/* dst[j] += sum over chunks, in chunk order, of part[chunk, j]. */
__global__ void k_colsum_final(float *dst, const float *part, int nchunks, int C)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    float acc = 0.0f;
    for (int k = 0; k < nchunks; k++) acc = __fadd_rn(acc, part[(size_t)k * C + j]);
    dst[j] = __fadd_rn(dst[j], acc);
}

void kc_colsum_add(kern_cuda_ctx *c, float *dst, const float *a, const uint16_t *a16, int N,
                   int C, float *part, const char *what)
{
    if (N <= 0 || C <= 0) return;
    const int nchunks = (N + KC_ROWS_PER_CHUNK - 1) / KC_ROWS_PER_CHUNK;
    if (nchunks > 65535) {
        kc_fail(c, -EINVAL, what, "too many rows for the column sum (N > 16.7M)");
        return;
    }
    dim3 grid(kc_blocks((size_t)C, KC_THREADS), (unsigned)nchunks);
    k_colsum_part<<<grid, KC_THREADS, 0, c->stream>>>(part, a, a16, N, C);
    kc_launched(c, what);
    k_colsum_final<<<kc_blocks((size_t)C, KC_THREADS), KC_THREADS, 0, c->stream>>>(dst, part,
                                                                                   nchunks, C);
    kc_launched(c, what);
}

/* ------------------------------------------------------------------ LayerNorm */

/* One warp per row; two passes (mean, then the variance of x - mean) as the CPU does. */
template <typename O>
__global__ void k_layernorm_forward(O *out, float *mean, float *rstd, const float *inp,
                                    const float *weight, const float *bias, int N, int C)
{
    const int row = blockIdx.x * LN_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= N) return;
    const float *x = inp + (size_t)row * C;
    O *o = out + (size_t)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += x[i];
    const float m = kc_warp_sum(s) / (float)C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float xs = x[i] - m;
        v += xs * xs;
    }
    v = kc_warp_sum(v) / (float)C;
    const float r = 1.0f / sqrtf(v + LN_EPS);
    for (int i = lane; i < C; i += 32) kc_store(&o[i], (r * (x[i] - m)) * weight[i] + bias[i]);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

/* dinp only (the weight and bias gradients are column sums, below); one warp per row. */
__global__ void k_layernorm_backward_dinp(float *dinp, const float *dout, const float *inp,
                                          const float *weight, const float *mean,
                                          const float *rstd, int N, int C)
{
    const int row = blockIdx.x * LN_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= N) return;
    const float *d = dout + (size_t)row * C;
    const float *x = inp + (size_t)row * C;
    float *dx = dinp + (size_t)row * C;
    const float m = mean[row], s = rstd[row];
    float dm = 0.0f, dnm = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float norm_i = (x[i] - m) * s;
        const float dnorm_i = weight[i] * d[i];
        dm += dnorm_i;
        dnm += dnorm_i * norm_i;
    }
    dm = kc_warp_sum(dm) / (float)C;
    dnm = kc_warp_sum(dnm) / (float)C;
    for (int i = lane; i < C; i += 32) {
        const float norm_i = (x[i] - m) * s;
        const float dnorm_i = weight[i] * d[i];
        dx[i] += ((dnorm_i - dm) - norm_i * dnm) * s;
    }
}

/* Chunk partials of dweight (part_w) and dbias (part_b), as k_colsum_part. */
__global__ void k_layernorm_backward_part(float *part_w, float *part_b, const float *dout,
                                          const float *inp, const float *mean,
                                          const float *rstd, int N, int C)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    const int n0 = blockIdx.y * KC_ROWS_PER_CHUNK;
    const int n1 = n0 + KC_ROWS_PER_CHUNK < N ? n0 + KC_ROWS_PER_CHUNK : N;
    float aw = 0.0f, ab = 0.0f;
    for (int n = n0; n < n1; n++) {
        const float d = dout[(size_t)n * C + j];
        const float norm = (inp[(size_t)n * C + j] - mean[n]) * rstd[n];
        aw += norm * d;
        ab += d;
    }
    part_w[(size_t)blockIdx.y * C + j] = aw;
    part_b[(size_t)blockIdx.y * C + j] = ab;
}

template <typename O>
static void layernorm_forward(void *ctx, O *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || C <= 0) return;
    k_layernorm_forward<O><<<kc_blocks((size_t)N, LN_WARPS), LN_WARPS * 32, 0, c->stream>>>(
        out, mean, rstd, inp, weight, bias, N, C);
    kc_launched(c, "k_layernorm_forward");
}

static void kc_layernorm_forward(void *ctx, float *out, float *mean, float *rstd,
                                 const float *inp, const float *weight, const float *bias, int N,
                                 int C)
{
    layernorm_forward<float>(ctx, out, mean, rstd, inp, weight, bias, N, C);
}

static void kc_layernorm_forward_bf16(void *ctx, uint16_t *out, float *mean, float *rstd,
                                      const float *inp, const float *weight, const float *bias,
                                      int N, int C)
{
    layernorm_forward<uint16_t>(ctx, out, mean, rstd, inp, weight, bias, N, C);
}

static void kc_layernorm_backward(void *ctx, float *dinp, float *dweight, float *dbias,
                                  const float *dout, const float *inp, const float *weight,
                                  const float *mean, const float *rstd, int N, int C)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || C <= 0) return;
    const int nchunks = (N + KC_ROWS_PER_CHUNK - 1) / KC_ROWS_PER_CHUNK;
    if (nchunks > 65535) {
        kc_fail(c, -EINVAL, "layernorm_backward", "too many rows (N > 16.7M)");
        return;
    }
    float *part = (float *)kc_scratch(c, 2 * (size_t)nchunks * C * sizeof(float),
                                      "layernorm_backward scratch");
    if (!part) return;
    k_layernorm_backward_dinp<<<kc_blocks((size_t)N, LN_WARPS), LN_WARPS * 32, 0, c->stream>>>(
        dinp, dout, inp, weight, mean, rstd, N, C);
    kc_launched(c, "k_layernorm_backward_dinp");
    float *part_w = part, *part_b = part + (size_t)nchunks * C;
    dim3 grid(kc_blocks((size_t)C, KC_THREADS), (unsigned)nchunks);
    k_layernorm_backward_part<<<grid, KC_THREADS, 0, c->stream>>>(part_w, part_b, dout, inp,
                                                                  mean, rstd, N, C);
    kc_launched(c, "k_layernorm_backward_part");
    k_colsum_final<<<kc_blocks((size_t)C, KC_THREADS), KC_THREADS, 0, c->stream>>>(
        dweight, part_w, nchunks, C);
    kc_launched(c, "k_colsum_final");
    k_colsum_final<<<kc_blocks((size_t)C, KC_THREADS), KC_THREADS, 0, c->stream>>>(
        dbias, part_b, nchunks, C);
    kc_launched(c, "k_colsum_final");
}

/* ------------------------------------------------------------------ softmax + cross-entropy */

#define CE_THREADS 512

/* Block-wide sum by a fixed tree: each warp's butterfly, then warp 0 over the warp sums.
 * Every thread gets the result. sh: CE_THREADS / 32 floats. */
__device__ float block_sum(float v, float *sh)
{
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    v = kc_warp_sum(v);
    __syncthreads(); /* sh may still be read from a previous call */
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x / 32) ? sh[lane] : 0.0f;
    return kc_warp_sum(t);
}

__device__ float block_max(float v, float *sh)
{
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    v = kc_warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x / 32) ? sh[lane] : -INFINITY;
    return kc_warp_max(t);
}

/* One block per row of logits. */
__global__ void k_softmax_ce_forward(float *probs, float *losses, const float *logits,
                                     const int32_t *targets, int V)
{
    __shared__ float sh[CE_THREADS / 32];
    const size_t row = blockIdx.x;
    const float *l = logits + row * V;
    float *p = probs + row * V;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, l[i]);
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float e = expf(l[i] - mx);
        p[i] = e;
        s += e;
    }
    s = block_sum(s, sh);
    for (int i = threadIdx.x; i < V; i += blockDim.x) p[i] = p[i] / s;
    if (threadIdx.x == 0) losses[row] = logf(s) - (l[targets[row]] - mx);
}

/* dlogits[n, i] += (probs[n, i] - (i == target)) * dloss, as the CPU writes it. */
__global__ void k_softmax_ce_backward(float *dlogits, const float *probs, const int32_t *targets,
                                      float dloss, int V, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / (size_t)V;
        const int col = (int)(i - row * (size_t)V);
        const float p = probs[i];
        const float g = col == targets[row] ? (p - 1.0f) * dloss : p * dloss;
        dlogits[i] = __fadd_rn(dlogits[i], g);
    }
}

static void kc_softmax_ce_forward(void *ctx, float *probs, float *losses, const float *logits,
                                  const int32_t *targets, int N, int V)
{
    kern_cuda_ctx *c = C_(ctx);
    if (N <= 0 || V <= 0) return;
    k_softmax_ce_forward<<<(unsigned)N, CE_THREADS, 0, c->stream>>>(probs, losses, logits,
                                                                   targets, V);
    kc_launched(c, "k_softmax_ce_forward");
}

static void kc_softmax_ce_backward(void *ctx, float *dlogits, const float *probs,
                                   const int32_t *targets, float dloss, int N, int V)
{
    kern_cuda_ctx *c = C_(ctx);
    const size_t n = (size_t)(N > 0 ? N : 0) * (size_t)(V > 0 ? V : 0);
    EW_LAUNCH(k_softmax_ce_backward, n, dlogits, probs, targets, dloss, V, n);
}

/* ------------------------------------------------------------------ shuffle */

/* out[j * q + i] = in[4 i + j], q = n / 4; one thread per 4-byte element. */
__global__ void k_shuffle4(uint8_t *out, const uint8_t *in, size_t q)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < q;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint8_t b0 = in[4 * i], b1 = in[4 * i + 1], b2 = in[4 * i + 2],
                      b3 = in[4 * i + 3];
        out[i] = b0;
        out[q + i] = b1;
        out[2 * q + i] = b2;
        out[3 * q + i] = b3;
    }
}

static void kc_shuffle4(void *ctx, uint8_t *out, const uint8_t *in, size_t n)
{
    kern_cuda_ctx *c = C_(ctx);
    if (n % 4) {
        kc_fail(c, -EINVAL, "shuffle4", "n is not a multiple of 4");
        return;
    }
    const size_t q = n / 4;
    EW_LAUNCH(k_shuffle4, q, out, in, q);
}

/* ------------------------------------------------------------------ table */

/* The first failure; also collects an asynchronous fault of queued work (a kernel that
 * faulted after its launch returned) without waiting: cudaStreamQuery only looks. */
static int kc_status(void *ctx)
{
    kern_cuda_ctx *c = C_(ctx);
    if (!c->status) {
        cudaError_t e = cudaStreamQuery(c->stream);
        if (e == cudaErrorNotReady) {
            /* not an error: clear it should the runtime keep it as the last error, or the next
             * launch's cudaGetLastError check would report it */
            if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
        } else if (e != cudaSuccess) {
            kc_cuda_ok(c, e, "queued kernels");
        }
    }
    return c->status;
}

static void ctx_free(kern_cuda_ctx *c)
{
    if (!c) return;
    if (c->scratch) cudaFreeAsync(c->scratch, c->stream);
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->cublas_ws) cudaFree(c->cublas_ws); /* cudaFree waits for the device's work */
    free(c);
}

extern "C" int kern_cuda_ops_init(kern_ops *out, void *stream, int bf16)
{
    memset(out, 0, sizeof *out);
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        LOG_E(KC_TAG, "cuda kernels: no CUDA device: %s",
              e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0");
        cudaGetLastError(); /* clear it: this is not a failure of later calls */
        return -ENODEV;
    }
    kern_cuda_ctx *c = (kern_cuda_ctx *)calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    c->stream = (cudaStream_t)stream;
    int rc = 0;
    if (!kc_cuda_ok(c, cudaGetDevice(&c->device), "cudaGetDevice")) goto fail;
    if (!kc_cublas_ok(c, cublasCreate(&c->cublas), "cublasCreate")) goto fail;
    if (!kc_cublas_ok(c, cublasSetStream(c->cublas, c->stream), "cublasSetStream")) goto fail;
    if (!kc_cuda_ok(c, cudaMalloc(&c->cublas_ws, KC_CUBLAS_WS_BYTES), "cuBLAS workspace"))
        goto fail;
    if (!kc_cublas_ok(c, cublasSetWorkspace(c->cublas, c->cublas_ws, KC_CUBLAS_WS_BYTES),
                      "cublasSetWorkspace"))
        goto fail;
    /* the defaults, stated: host scalars, no atomics (deterministic), no TF32 for fp32 */
    if (!kc_cublas_ok(c, cublasSetPointerMode(c->cublas, CUBLAS_POINTER_MODE_HOST),
                      "cublasSetPointerMode") ||
        !kc_cublas_ok(c, cublasSetAtomicsMode(c->cublas, CUBLAS_ATOMICS_NOT_ALLOWED),
                      "cublasSetAtomicsMode") ||
        !kc_cublas_ok(c, cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH),
                      "cublasSetMathMode"))
        goto fail;

    out->name = "cuda";
    out->ctx = c;
    out->bf16 = bf16 ? 1 : 0;
    out->encoder_forward = kc_encoder_forward;
    out->encoder_backward = kc_encoder_backward;
    out->layernorm_forward = kc_layernorm_forward;
    out->layernorm_backward = kc_layernorm_backward;
    out->matmul_forward = kc_matmul_forward;
    out->matmul_backward = kc_matmul_backward;
    if (bf16) {
        out->round_bf16 = kc_round_bf16;
        out->layernorm_forward_bf16 = kc_layernorm_forward_bf16;
        out->attention_forward_bf16 = kc_attention_forward_bf16;
        out->gelu_forward_bf16 = kc_gelu_forward_bf16;
        out->matmul_forward_bf16 = kc_matmul_forward_bf16;
        out->matmul_backward_bf16 = kc_matmul_backward_bf16;
    }
    out->attention_forward = kc_attention_forward;
    out->attention_backward = kc_attention_backward;
    out->gelu_forward = kc_gelu_forward;
    out->gelu_backward = kc_gelu_backward;
    out->residual_forward = kc_residual_forward;
    out->residual_backward = kc_residual_backward;
    out->softmax_crossentropy_forward = kc_softmax_ce_forward;
    out->softmax_crossentropy_backward = kc_softmax_ce_backward;
    out->zero = kc_zero;
    out->copy = kc_copy;
    out->add = kc_add;
    out->scale = kc_scale;
    out->block_sumsq = kc_block_sumsq;
    out->adamw = kc_adamw;
    out->rank_tree_sum = kc_rank_tree_sum;
    out->shuffle4 = kc_shuffle4;
    out->status = kc_status;
    return 0;
fail:
    rc = c->status ? c->status : -EIO;
    ctx_free(c);
    memset(out, 0, sizeof *out);
    return rc;
}

extern "C" void kern_cuda_ops_free(kern_ops *ops)
{
    if (!ops) return;
    ctx_free((kern_cuda_ctx *)ops->ctx);
    ops->ctx = NULL;
}

extern "C" int kern_cuda_built(void)
{
    return 1;
}
