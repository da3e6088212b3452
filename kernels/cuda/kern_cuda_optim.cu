/* kern_cuda_optim.cu - the optimizer side of the table: AdamW over a shard, the gradient-norm
 * partials (block_sumsq) and the deterministic sum over ranks (rank_tree_sum).
 *
 * adamw and rank_tree_sum give the CPU's bits: every operation is written with an explicitly
 * rounded intrinsic (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, ...), which the compiler
 * never contracts into an FMA, in the CPU's order of evaluation (train/optim.c
 * train_adamw_update_shard, train_tree_sum; the CPU build uses -ffp-contract=off), and
 * denormals are kept (no -ftz). The build also compiles this file's library with
 * -fmad=false, a second guard.
 */
#include "kern_cuda_internal.cuh"

#define SUMSQ_THREADS 256
#define TREE_MAX_DEPTH 33 /* partial sums on the stack for up to 2^32 ranks */

static kern_cuda_ctx *C_(void *ctx)
{
    return (kern_cuda_ctx *)ctx;
}

/* out[k] = sum of x[i]^2 over block k's KC_SUMSQ_BLOCK elements, in double: thread t sums
 * elements t, t + 256, ... (8 of them) in order, then a fixed shared-memory tree. */
__global__ void k_block_sumsq(const float *x, double *out)
{
    __shared__ double sh[SUMSQ_THREADS];
    const float *xb = x + (size_t)blockIdx.x * KC_SUMSQ_BLOCK;
    double s = 0.0;
    for (int i = threadIdx.x; i < KC_SUMSQ_BLOCK; i += SUMSQ_THREADS) {
        const double v = (double)xb[i];
        s = __dadd_rn(s, __dmul_rn(v, v));
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = SUMSQ_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = sh[0];
}

void kc_block_sumsq(void *ctx, const float *x, size_t n, double *out)
{
    kern_cuda_ctx *c = C_(ctx);
    if (n % KC_SUMSQ_BLOCK) {
        kc_fail(c, -EINVAL, "block_sumsq", "n is not a multiple of 2048");
        return;
    }
    const size_t nb = n / KC_SUMSQ_BLOCK;
    if (nb == 0) return;
    if (nb > 0x7fffffffu) {
        kc_fail(c, -EINVAL, "block_sumsq", "n too large");
        return;
    }
    k_block_sumsq<<<(unsigned)nb, SUMSQ_THREADS, 0, c->stream>>>(x, out);
    kc_launched(c, "k_block_sumsq");
}

/* train_adamw_update_shard's loop body, operation by operation:
 *   m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g;
 *   p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p). */
__global__ void k_adamw(float *params, float *m, float *v, const float *grads, size_t n,
                        kern_adamw_args a)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = grads[i];
    const float mi = __fadd_rn(__fmul_rn(a.beta1, m[i]), __fmul_rn(__fsub_rn(1.0f, a.beta1), g));
    const float vi = __fadd_rn(__fmul_rn(a.beta2, v[i]),
                               __fmul_rn(__fmul_rn(__fsub_rn(1.0f, a.beta2), g), g));
    m[i] = mi;
    v[i] = vi;
    const float mhat = __fdiv_rn(mi, a.bc1), vhat = __fdiv_rn(vi, a.bc2);
    const float p = params[i];
    const float upd = __fmul_rn(
        a.lr, __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)),
                        __fmul_rn(a.weight_decay, p)));
    params[i] = __fsub_rn(p, upd);
}

void kc_adamw(void *ctx, float *params, float *m, float *v, const float *grads, size_t n,
              const kern_adamw_args *a)
{
    kern_cuda_ctx *c = C_(ctx);
    if (n == 0) return;
    const size_t nb = (n + KC_THREADS - 1) / KC_THREADS;
    if (nb > 0x7fffffffu) {
        kc_fail(c, -EINVAL, "adamw", "n too large");
        return;
    }
    k_adamw<<<(unsigned)nb, KC_THREADS, 0, c->stream>>>(params, m, v, grads, n, *a);
    kc_launched(c, "k_adamw");
}

/* out[i] = train_tree_sum's tree over r of in[r * stride + i], iteratively: push the ranks'
 * values in order onto a stack of complete left subtrees, merging the top two while they
 * have the same size (after pushing value r there are ctz(r + 1) merges), which builds the
 * complete trees of the binary digits of nranks; then fold the stack from the top,
 * left + right, which is the recursion's (left subtree) + (sum of the rest). Each thread reads
 * all of its column before it writes out[i], so out may be in. */
__global__ void k_rank_tree_sum(float *out, const float *in, size_t n, size_t stride,
                                int nranks)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float st[TREE_MAX_DEPTH];
    int depth = 0;
    for (int r = 0; r < nranks; r++) {
        float x = in[(size_t)r * stride + i];
        for (unsigned k = (unsigned)r + 1u; !(k & 1u); k >>= 1) x = __fadd_rn(st[--depth], x);
        st[depth++] = x;
    }
    float acc = st[--depth];
    while (depth > 0) acc = __fadd_rn(st[--depth], acc);
    out[i] = acc;
}

void kc_rank_tree_sum(void *ctx, float *out, const float *in, size_t n, size_t stride,
                      int nranks)
{
    kern_cuda_ctx *c = C_(ctx);
    if (nranks < 1 || stride < n) {
        kc_fail(c, -EINVAL, "rank_tree_sum", "nranks < 1 or stride < n");
        return;
    }
    if (n == 0) return;
    const size_t nb = (n + KC_THREADS - 1) / KC_THREADS;
    if (nb > 0x7fffffffu) {
        kc_fail(c, -EINVAL, "rank_tree_sum", "n too large");
        return;
    }
    k_rank_tree_sum<<<(unsigned)nb, KC_THREADS, 0, c->stream>>>(out, in, n, stride, nranks);
    kc_launched(c, "k_rank_tree_sum");
}
