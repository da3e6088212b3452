/* kern_cpu.c - CPU (fp32, CBLAS) implementation of kernels.h.
 *
 * Follows karpathy/llm.c train_gpt2.c. Differences from it are for speed or robustness and
 * do not change the mathematics:
 *  - every GEMM, including the two per (batch, head) in attention, goes through cblas_sgemm
 *    on strided views of qkv (leading dimension 3C) instead of hand-written loops;
 *  - the softmax backward in attention uses the O(T) per row form
 *    dpreatt = att * (datt - sum(att .* datt)) instead of the O(T^2) Jacobian loop;
 *  - GELU goes through expf instead of tanhf/coshf (see kern_gelu_forward);
 *  - the cross-entropy loss is log(sum) - (logit[target] - max), which equals
 *    -log(probs[target]) but stays finite when that probability underflows to 0.
 *
 * Determinism: loops run in a fixed order; reductions are plain left-to-right float loops
 * (the build uses -fno-fast-math -ffp-contract=off, so the compiler keeps that order); the
 * BLAS is pinned to one thread by the caller. Element-wise loops are kept simple so that the
 * compiler can vectorise them without changing any result.
 */
#include "kernels.h"

#include <cblas.h>
#include <math.h>

#define LN_EPS 1e-5f
#define GELU_SCALING_FACTOR 0.7978845608028654f /* sqrt(2/pi) */
#define DBIAS_BLOCK 64 /* columns of dout summed at once in matmul backward */

void kern_encoder_forward(float *out, const int32_t *inp, const float *wte, const float *wpe,
                          int B, int T, int C)
{
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            const float *we = wte + (size_t)inp[(size_t)b * T + t] * C;
            const float *pe = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
        }
    }
}

void kern_encoder_backward(float *dwte, float *dwpe, const float *dout, const int32_t *inp,
                           int B, int T, int C)
{
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *d = dout + ((size_t)b * T + t) * C;
            float *dwe = dwte + (size_t)inp[(size_t)b * T + t] * C;
            float *dpe = dwpe + (size_t)t * C;
            for (int i = 0; i < C; i++) dwe[i] += d[i];
            for (int i = 0; i < C; i++) dpe[i] += d[i];
        }
    }
}

void kern_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                            const float *weight, const float *bias, int N, int C)
{
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        float m = 0.0f;
        for (int i = 0; i < C; i++) m += x[i];
        m = m / (float)C;
        float v = 0.0f;
        for (int i = 0; i < C; i++) {
            float xs = x[i] - m;
            v += xs * xs;
        }
        v = v / (float)C;
        float s = 1.0f / sqrtf(v + LN_EPS);
        for (int i = 0; i < C; i++) o[i] = (s * (x[i] - m)) * weight[i] + bias[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

void kern_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                             const float *inp, const float *weight, const float *mean,
                             const float *rstd, int N, int C)
{
    for (int n = 0; n < N; n++) {
        const float *d = dout + (size_t)n * C;
        const float *x = inp + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        const float m = mean[n];
        const float s = rstd[n];

        float dnorm_mean = 0.0f;
        float dnorm_norm_mean = 0.0f;
        for (int i = 0; i < C; i++) {
            float norm_i = (x[i] - m) * s;
            float dnorm_i = weight[i] * d[i];
            dnorm_mean += dnorm_i;
            dnorm_norm_mean += dnorm_i * norm_i;
        }
        dnorm_mean = dnorm_mean / (float)C;
        dnorm_norm_mean = dnorm_norm_mean / (float)C;

        for (int i = 0; i < C; i++) {
            float norm_i = (x[i] - m) * s;
            float dnorm_i = weight[i] * d[i];
            dbias[i] += d[i];
            dweight[i] += norm_i * d[i];
            dx[i] += ((dnorm_i - dnorm_mean) - norm_i * dnorm_norm_mean) * s;
        }
    }
}

void kern_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                         int N, int C, int OC)
{
    /* out (N,OC) = inp (N,C) @ weight (OC,C)^T */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C,
                0.0f, out, OC);
    if (bias) {
        for (int n = 0; n < N; n++) {
            float *o = out + (size_t)n * OC;
            for (int j = 0; j < OC; j++) o[j] += bias[j];
        }
    }
}

void kern_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                          const float *inp, const float *weight, int N, int C, int OC)
{
    /* dinp (N,C) += dout (N,OC) @ weight (OC,C) */
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC,
                    weight, C, 1.0f, dinp, C);
    /* dweight (OC,C) += dout^T (OC,N) @ inp (N,C) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C,
                1.0f, dweight, C);
    if (dbias) {
        /* Column sums over n in order, into a local block that is added to dbias once (as
         * llm.c's local sum); row by row within a block so the inner loop vectorises. */
        for (int o0 = 0; o0 < OC; o0 += DBIAS_BLOCK) {
            const int nb = OC - o0 < DBIAS_BLOCK ? OC - o0 : DBIAS_BLOCK;
            float acc[DBIAS_BLOCK];
            for (int j = 0; j < nb; j++) acc[j] = 0.0f;
            for (int n = 0; n < N; n++) {
                const float *d = dout + (size_t)n * OC + o0;
                for (int j = 0; j < nb; j++) acc[j] += d[j];
            }
            for (int j = 0; j < nb; j++) dbias[o0 + j] += acc[j];
        }
    }
}

void kern_attention_forward(float *out, float *att, float *scratch, const float *qkv, int B,
                            int T, int C, int NH)
{
    const int hs = C / NH;
    const int C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    float *preatt = scratch; /* (T,T) */

    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float *q = qkv + (size_t)b * T * C3 + (size_t)h * hs; /* (T,hs), ld 3C */
            const float *k = q + C;
            const float *v = q + 2 * C;
            float *a = att + ((size_t)b * NH + h) * T * T; /* (T,T) */
            float *o = out + (size_t)b * T * C + (size_t)h * hs; /* (T,hs), ld C */

            /* preatt (T,T) = scale * q @ k^T; the upper triangle is computed and ignored. */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, C3, k, C3,
                        0.0f, preatt, T);

            for (int t = 0; t < T; t++) {
                const float *p = preatt + (size_t)t * T;
                float *ar = a + (size_t)t * T;
                float maxval = p[0];
                for (int t2 = 1; t2 <= t; t2++)
                    if (p[t2] > maxval) maxval = p[t2];
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    float e = expf(p[t2] - maxval);
                    ar[t2] = e;
                    sum += e;
                }
                for (int t2 = 0; t2 <= t; t2++) ar[t2] = ar[t2] / sum;
                for (int t2 = t + 1; t2 < T; t2++) ar[t2] = 0.0f;
            }

            /* out (T,hs) = att (T,T) @ v (T,hs); the zero upper triangle applies the mask. */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, v, C3,
                        0.0f, o, C);
        }
    }
}

void kern_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                             const float *att, int B, int T, int C, int NH)
{
    const int hs = C / NH;
    const int C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    float *datt = scratch;                       /* (T,T) */
    float *dpreatt = scratch + (size_t)T * T;    /* (T,T) */

    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const size_t qoff = (size_t)b * T * C3 + (size_t)h * hs;
            const float *q = qkv + qoff;
            const float *k = q + C;
            const float *v = q + 2 * C;
            float *dq = dqkv + qoff;
            float *dk = dq + C;
            float *dv = dq + 2 * C;
            const float *a = att + ((size_t)b * NH + h) * T * T;
            const float *d = dout + (size_t)b * T * C + (size_t)h * hs; /* (T,hs), ld C */

            /* datt (T,T) = dout (T,hs) @ v^T; dv (T,hs) += att^T @ dout */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, d, C, v, C3,
                        0.0f, datt, T);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, d, C,
                        1.0f, dv, C3);

            /* Softmax backward, with the 1/sqrt(hs) scale folded in; masked entries are 0. */
            for (int t = 0; t < T; t++) {
                const float *ar = a + (size_t)t * T;
                const float *dar = datt + (size_t)t * T;
                float *dp = dpreatt + (size_t)t * T;
                float dot = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) dot += ar[t2] * dar[t2];
                for (int t2 = 0; t2 <= t; t2++) dp[t2] = (ar[t2] * (dar[t2] - dot)) * scale;
                for (int t2 = t + 1; t2 < T; t2++) dp[t2] = 0.0f;
            }

            /* dq (T,hs) += dpreatt @ k; dk (T,hs) += dpreatt^T @ q */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, dpreatt, T,
                        k, C3, 1.0f, dq, C3);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, dpreatt, T, q,
                        C3, 1.0f, dk, C3);
        }
    }
}

/* GELU uses 0.5 * (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + exp(-2u)), an identity, so that
 * one expf replaces tanhf (and coshf in the backward); glibc's expf is several times faster.
 * Error against a double reference is the same as llm.c's tanhf/coshf form (~3e-7). */
void kern_gelu_forward(float *out, const float *inp, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALING_FACTOR * (x + 0.044715f * x * x * x);
        out[i] = x / (1.0f + expf(-2.0f * u));
    }
}

void kern_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n)
{
    /* gelu'(x) = s + x * 0.5 * sech^2(u) * du/dx with s = sigmoid(2u) and
     * 0.5 * sech^2(u) = 2 s (1 - s). e = exp(-2|u|) <= 1 cannot overflow, and s, 1 - s are
     * both formed without cancellation: 1/(1+e) and e/(1+e), by the sign of u. */
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALING_FACTOR * (x + 0.044715f * x * x * x);
        float e = expf(-2.0f * fabsf(u));
        float r = 1.0f / (1.0f + e);
        float q = e * r;
        float s = u >= 0.0f ? r : q;  /* sigmoid(2u) */
        float sm = u >= 0.0f ? q : r; /* 1 - sigmoid(2u) */
        float local_grad =
            s + 2.0f * x * s * sm * GELU_SCALING_FACTOR * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] += local_grad * dout[i];
    }
}

void kern_residual_forward(float *out, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void kern_residual_backward(float *da, float *db, const float *dout, size_t n)
{
    for (size_t i = 0; i < n; i++) da[i] += dout[i];
    for (size_t i = 0; i < n; i++) db[i] += dout[i];
}

void kern_softmax_crossentropy_forward(float *probs, float *losses, const float *logits,
                                       const int32_t *targets, int N, int V)
{
    for (int n = 0; n < N; n++) {
        const float *l = logits + (size_t)n * V;
        float *p = probs + (size_t)n * V;
        float maxval = l[0];
        for (int i = 1; i < V; i++)
            if (l[i] > maxval) maxval = l[i];
        float sum = 0.0f;
        for (int i = 0; i < V; i++) {
            float e = expf(l[i] - maxval);
            p[i] = e;
            sum += e;
        }
        for (int i = 0; i < V; i++) p[i] = p[i] / sum;
        losses[n] = logf(sum) - (l[targets[n]] - maxval);
    }
}

void kern_softmax_crossentropy_backward(float *dlogits, const float *probs,
                                        const int32_t *targets, float dloss, int N, int V)
{
    for (int n = 0; n < N; n++) {
        const float *p = probs + (size_t)n * V;
        float *dl = dlogits + (size_t)n * V;
        const int32_t tg = targets[n];
        const float dl_tg = dl[tg];
        for (int i = 0; i < V; i++) dl[i] += p[i] * dloss;
        /* The target entry as (p - 1) * dloss in one step, kept out of the loop above so that
         * the loop stays branch-free. */
        dl[tg] = dl_tg + (p[tg] - 1.0f) * dloss;
    }
}
