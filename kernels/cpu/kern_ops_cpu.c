/* kern_ops_cpu.c - the CPU kernel table of kern_ops.h over kernels.h (kern_cpu.c) and the
 * vector ops of kern_cpu_vec.h.
 *
 * fp32 (bf16 = 0): every entry calls the kernels.h function of the same name, or the
 * kern_cpu_vec.h function that train/optim.c also calls, so the bits are those of the code
 * before the table existed. ctx is NULL.
 *
 * bf16 (bf16 = 1), an emulation of the CUDA backend's bf16 path for tests: the fp32 entries
 * stay as they are and the *_bf16 entries of kern_ops.h are filled in:
 *   round_bf16, layernorm/attention/gelu_forward_bf16: the fp32 kernel into scratch, then
 *     each output rounded (kern_round_bf16, round to nearest even);
 *   matmul_forward_bf16:  inp and weight widened to fp32 (exact) in scratch, the fp32 kernel;
 *   matmul_backward_bf16: dout rounded, inp and weight widened, the fp32 kernel; dinp,
 *     dweight and dbias accumulate in fp32 (dbias is the column sum of the rounded dout).
 * These are the bits of the earlier emulation that rounded the GEMM operands on input. Scratch
 * grows to the largest call and is kept until kern_cpu_ops_free; an allocation failure makes
 * the call a no-op and sets status -ENOMEM.
 */
#include "kern_cpu_vec.h"
#include "kern_ops.h"
#include "kernels.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ shared vector ops */

void kern_cpu_add(float *acc, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) acc[i] = acc[i] + x[i];
}

void kern_cpu_scale(float *x, size_t n, float s)
{
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

void kern_cpu_block_sumsq(const float *x, size_t n, double *out)
{
    for (size_t b = 0; b < n; b += KERN_BLOCK) {
        double s = 0.0;
        for (size_t i = b; i < b + KERN_BLOCK; i++) s += (double)x[i] * (double)x[i];
        out[b / KERN_BLOCK] = s;
    }
}

void kern_cpu_adamw(float *params, float *m, float *v, const float *grads, size_t n,
                    const kern_adamw_args *a)
{
    const float b1 = a->beta1, b2 = a->beta2, eps = a->eps, lr = a->lr, wd = a->weight_decay;
    const float bc1 = a->bc1, bc2 = a->bc2;
    for (size_t i = 0; i < n; i++) {
        float g = grads[i];
        float mi = b1 * m[i] + (1.0f - b1) * g;
        float vi = b2 * v[i] + (1.0f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * params[i]);
    }
}

/* The tree sum of in[(lo .. lo + cnt) * stride] (one element): comm_cpu.c's tree_sum. */
static float tree1(const float *in, size_t stride, int lo, int cnt)
{
    if (cnt == 1) return in[(size_t)lo * stride];
    int h = 1;
    while (h * 2 < cnt) h *= 2; /* left subtree: largest power of two below cnt */
    float a = tree1(in, stride, lo, h);
    float b = tree1(in, stride, lo + h, cnt - h);
    return a + b;
}

void kern_cpu_rank_tree_sum(float *out, const float *in, size_t n, size_t stride, int nranks)
{
    if (nranks < 1) return;
    /* each element reads only its own column before out[i] is written: out may be in */
    for (size_t i = 0; i < n; i++) out[i] = tree1(in + i, stride, 0, nranks);
}

/* ------------------------------------------------------------------ bf16 */

float kern_round_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {
        /* NaN: keep the sign and the top of the payload, make sure it stays a (quiet) NaN */
        u = (u | 0x00400000u) & 0xffff0000u;
    } else {
        /* round to nearest, ties to even, on the 16 bits dropped; carries into the exponent
         * are correct (max finite rounds to inf as RNE says; inf stays inf) */
        u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
    }
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

typedef struct kern_cpu_ctx {
    float *buf; /* scratch for the rounded operands */
    size_t cap; /* floats */
    int status;
} kern_cpu_ctx;

/* Scratch of n floats (grown, kept), or NULL with status -ENOMEM. */
static float *scratch(kern_cpu_ctx *c, size_t n)
{
    if (c->cap < n) {
        float *p = realloc(c->buf, n * sizeof(float));
        if (!p) {
            if (!c->status) c->status = -ENOMEM;
            return NULL;
        }
        c->buf = p;
        c->cap = n;
    }
    return c->buf;
}

static uint16_t bf16_bits(float x)
{
    const float r = kern_round_bf16(x);
    uint32_t u;
    memcpy(&u, &r, sizeof u);
    return (uint16_t)(u >> 16);
}

static float widen(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void round_into(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kern_round_bf16(src[i]);
}

static void widen_into(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = widen(src[i]);
}

static void bf16_round(void *ctx, uint16_t *dst, const float *src, size_t n)
{
    (void)ctx;
    for (size_t i = 0; i < n; i++) dst[i] = bf16_bits(src[i]);
}

static void bf16_layernorm_forward(void *ctx, uint16_t *out, float *mean, float *rstd,
                                   const float *inp, const float *weight, const float *bias, int N,
                                   int C)
{
    const size_t n = (size_t)N * C;
    float *s = scratch(ctx, n);
    if (!s) return;
    kern_layernorm_forward(s, mean, rstd, inp, weight, bias, N, C);
    bf16_round(ctx, out, s, n);
}

static void bf16_attention_forward(void *ctx, uint16_t *out, float *att, float *scratch_,
                                   const float *qkv, int B, int T, int C, int NH)
{
    const size_t n = (size_t)B * T * C;
    float *s = scratch(ctx, n);
    if (!s) return;
    kern_attention_forward(s, att, scratch_, qkv, B, T, C, NH);
    bf16_round(ctx, out, s, n);
}

static void bf16_gelu_forward(void *ctx, uint16_t *out, const float *inp, size_t n)
{
    float *s = scratch(ctx, n);
    if (!s) return;
    kern_gelu_forward(s, inp, n);
    bf16_round(ctx, out, s, n);
}

static void bf16_matmul_forward(void *ctx, float *out, const uint16_t *inp, const uint16_t *weight,
                                const float *bias, int N, int C, int OC)
{
    const size_t ni = (size_t)N * C, nw = (size_t)OC * C;
    float *s = scratch(ctx, ni + nw);
    if (!s) return;
    widen_into(s, inp, ni);
    widen_into(s + ni, weight, nw);
    kern_matmul_forward(out, s, s + ni, bias, N, C, OC);
}

static void bf16_matmul_backward(void *ctx, float *dinp, float *dweight, float *dbias,
                                 const float *dout, const uint16_t *inp, const uint16_t *weight,
                                 int N, int C, int OC)
{
    const size_t nd = (size_t)N * OC, ni = (size_t)N * C, nw = (size_t)OC * C;
    float *s = scratch(ctx, nd + ni + nw);
    if (!s) return;
    round_into(s, dout, nd);
    widen_into(s + nd, inp, ni);
    widen_into(s + nd + ni, weight, nw);
    kern_matmul_backward(dinp, dweight, dbias, s, s + nd, s + nd + ni, N, C, OC);
}

/* ------------------------------------------------------------------ fp32 wrappers */

static void w_encoder_forward(void *ctx, float *out, const int32_t *inp, const float *wte,
                              const float *wpe, int B, int T, int C)
{
    (void)ctx;
    kern_encoder_forward(out, inp, wte, wpe, B, T, C);
}
static void w_encoder_backward(void *ctx, float *dwte, float *dwpe, const float *dout,
                               const int32_t *inp, int B, int T, int C)
{
    (void)ctx;
    kern_encoder_backward(dwte, dwpe, dout, inp, B, T, C);
}
static void w_layernorm_forward(void *ctx, float *out, float *mean, float *rstd,
                                const float *inp, const float *weight, const float *bias, int N,
                                int C)
{
    (void)ctx;
    kern_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
}
static void w_layernorm_backward(void *ctx, float *dinp, float *dweight, float *dbias,
                                 const float *dout, const float *inp, const float *weight,
                                 const float *mean, const float *rstd, int N, int C)
{
    (void)ctx;
    kern_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
static void w_matmul_forward(void *ctx, float *out, const float *inp, const float *weight,
                             const float *bias, int N, int C, int OC)
{
    (void)ctx;
    kern_matmul_forward(out, inp, weight, bias, N, C, OC);
}
static void w_matmul_backward(void *ctx, float *dinp, float *dweight, float *dbias,
                              const float *dout, const float *inp, const float *weight, int N,
                              int C, int OC)
{
    (void)ctx;
    kern_matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
}
static void w_attention_forward(void *ctx, float *out, float *att, float *scratch_,
                                const float *qkv, int B, int T, int C, int NH)
{
    (void)ctx;
    kern_attention_forward(out, att, scratch_, qkv, B, T, C, NH);
}
static void w_attention_backward(void *ctx, float *dqkv, float *scratch_, const float *dout,
                                 const float *qkv, const float *att, int B, int T, int C, int NH)
{
    (void)ctx;
    kern_attention_backward(dqkv, scratch_, dout, qkv, att, B, T, C, NH);
}
static void w_gelu_forward(void *ctx, float *out, const float *inp, size_t n)
{
    (void)ctx;
    kern_gelu_forward(out, inp, n);
}
static void w_gelu_backward(void *ctx, float *dinp, const float *inp, const float *dout, size_t n)
{
    (void)ctx;
    kern_gelu_backward(dinp, inp, dout, n);
}
static void w_residual_forward(void *ctx, float *out, const float *a, const float *b, size_t n)
{
    (void)ctx;
    kern_residual_forward(out, a, b, n);
}
static void w_residual_backward(void *ctx, float *da, float *db, const float *dout, size_t n)
{
    (void)ctx;
    kern_residual_backward(da, db, dout, n);
}
static void w_softmax_crossentropy_forward(void *ctx, float *probs, float *losses,
                                           const float *logits, const int32_t *targets, int N,
                                           int V)
{
    (void)ctx;
    kern_softmax_crossentropy_forward(probs, losses, logits, targets, N, V);
}
static void w_softmax_crossentropy_backward(void *ctx, float *dlogits, const float *probs,
                                            const int32_t *targets, float dloss, int N, int V)
{
    (void)ctx;
    kern_softmax_crossentropy_backward(dlogits, probs, targets, dloss, N, V);
}
static void w_zero(void *ctx, float *x, size_t n)
{
    (void)ctx;
    if (n) memset(x, 0, n * sizeof(float));
}
static void w_copy(void *ctx, float *dst, const float *src, size_t n)
{
    (void)ctx;
    if (n) memcpy(dst, src, n * sizeof(float));
}
static void w_add(void *ctx, float *acc, const float *x, size_t n)
{
    (void)ctx;
    kern_cpu_add(acc, x, n);
}
static void w_scale(void *ctx, float *x, size_t n, float s)
{
    (void)ctx;
    kern_cpu_scale(x, n, s);
}
static void w_block_sumsq(void *ctx, const float *x, size_t n, double *out)
{
    (void)ctx;
    kern_cpu_block_sumsq(x, n, out);
}
static void w_adamw(void *ctx, float *params, float *m, float *v, const float *grads, size_t n,
                    const kern_adamw_args *a)
{
    (void)ctx;
    kern_cpu_adamw(params, m, v, grads, n, a);
}
static void w_rank_tree_sum(void *ctx, float *out, const float *in, size_t n, size_t stride,
                            int nranks)
{
    (void)ctx;
    kern_cpu_rank_tree_sum(out, in, n, stride, nranks);
}
static void w_shuffle4(void *ctx, uint8_t *out, const uint8_t *in, size_t n)
{
    (void)ctx;
    const size_t q = n / 4;
    for (size_t i = 0; i < q; i++)
        for (size_t j = 0; j < 4; j++) out[j * q + i] = in[4 * i + j];
}
static int w_status(void *ctx)
{
    return ctx ? ((kern_cpu_ctx *)ctx)->status : 0;
}

static const kern_ops cpu_fp32 = {
    .name = "cpu",
    .ctx = NULL,
    .bf16 = 0,
    .encoder_forward = w_encoder_forward,
    .encoder_backward = w_encoder_backward,
    .layernorm_forward = w_layernorm_forward,
    .layernorm_backward = w_layernorm_backward,
    .matmul_forward = w_matmul_forward,
    .matmul_backward = w_matmul_backward,
    .attention_forward = w_attention_forward,
    .attention_backward = w_attention_backward,
    .gelu_forward = w_gelu_forward,
    .gelu_backward = w_gelu_backward,
    .residual_forward = w_residual_forward,
    .residual_backward = w_residual_backward,
    .softmax_crossentropy_forward = w_softmax_crossentropy_forward,
    .softmax_crossentropy_backward = w_softmax_crossentropy_backward,
    .zero = w_zero,
    .copy = w_copy,
    .add = w_add,
    .scale = w_scale,
    .block_sumsq = w_block_sumsq,
    .adamw = w_adamw,
    .rank_tree_sum = w_rank_tree_sum,
    .shuffle4 = w_shuffle4,
    .status = w_status,
};

const kern_ops *kern_cpu_ops_fp32(void) { return &cpu_fp32; }

int kern_cpu_ops_init(kern_ops *out, int bf16)
{
    if (!out) return -EINVAL;
    *out = cpu_fp32;
    if (!bf16) return 0;
    kern_cpu_ctx *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    out->ctx = c;
    out->bf16 = 1;
    out->round_bf16 = bf16_round;
    out->layernorm_forward_bf16 = bf16_layernorm_forward;
    out->attention_forward_bf16 = bf16_attention_forward;
    out->gelu_forward_bf16 = bf16_gelu_forward;
    out->matmul_forward_bf16 = bf16_matmul_forward;
    out->matmul_backward_bf16 = bf16_matmul_backward;
    return 0;
}

void kern_cpu_ops_free(kern_ops *ops)
{
    if (!ops) return;
    kern_cpu_ctx *c = ops->ctx;
    if (c) {
        free(c->buf);
        free(c);
    }
    ops->ctx = NULL;
}
