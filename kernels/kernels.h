/* kernels.h - forward and backward kernels of a GPT-2 style decoder.
 *
 * Pure compute: no I/O, no globals, no allocation. Every buffer is owned by the caller and
 * must not alias another argument unless stated. All tensors are dense, row-major fp32
 * (token ids int32). Shapes are written as (dim0, dim1, ...); N = B*T rows.
 *
 * Backward kernels ACCUMULATE (+=) into every gradient output (dinp, dweight, dbias, ...),
 * as in llm.c (karpathy/llm.c, train_gpt2.c), so the caller zeroes gradients once per
 * micro-batch and the residual stream can collect gradients from two branches.
 *
 * Determinism: every kernel is deterministic for fixed shapes and inputs (fixed loop order,
 * no atomics, no threads of its own). GEMMs go through CBLAS; the caller pins the BLAS to one
 * thread so that results do not depend on the machine's core count. Bits also depend on the
 * BLAS build and on the kernel it picks for the CPU (OpenBLAS: OPENBLAS_CORETYPE, read at
 * load time); pin that too where runs must reproduce bit for bit across machines.
 *
 * Thread-safety: kernels touch only their arguments; concurrent calls on disjoint buffers
 * are safe.
 *
 * The CPU implementation lives in kernels/cpu/; the CUDA one arrives with the CUDA issue
 * behind the same names with a stream argument.
 */
#ifndef KERNELS_H
#define KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* out (B,T,C) = wte[inp[b,t]] (C) + wpe[t] (C).
 * inp (B,T) token ids in [0, V); wte (V,C); wpe (maxT,C) with T <= maxT. */
void kern_encoder_forward(float *out, const int32_t *inp, const float *wte, const float *wpe,
                          int B, int T, int C);

/* dwte (V,C) += scatter of dout rows by token id; dwpe (maxT,C) += sum over b of dout[b,t].
 * Rows are accumulated in a fixed order (b, then t), so the result is deterministic. */
void kern_encoder_backward(float *dwte, float *dwpe, const float *dout, const int32_t *inp,
                           int B, int T, int C);

/* LayerNorm over the last dimension, eps = 1e-5.
 * out (N,C) = (inp - mean) * rstd * weight (C) + bias (C); mean (N), rstd (N) are saved for
 * the backward pass. */
void kern_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                            const float *weight, const float *bias, int N, int C);

/* dinp (N,C), dweight (C), dbias (C) += gradients, given dout (N,C) and the forward's
 * inp, weight, mean, rstd. */
void kern_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                             const float *inp, const float *weight, const float *mean,
                             const float *rstd, int N, int C);

/* out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC). bias may be NULL. out is
 * overwritten (not accumulated). */
void kern_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                         int N, int C, int OC);

/* dinp (N,C) += dout @ weight; dweight (OC,C) += dout^T @ inp; dbias (OC) += column sums of
 * dout. dinp may be NULL (first layer), dbias may be NULL (no bias). */
void kern_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                          const float *inp, const float *weight, int N, int C, int OC);

/* Causal multi-head self-attention.
 * qkv (B,T,3C): per position the query, key and value vectors, each (NH, hs), hs = C/NH.
 * out (B,T,C): attention output, heads concatenated (overwritten).
 * att (B,NH,T,T): softmax probabilities saved for backward (entries above the diagonal 0).
 * scratch (T,T): work space. Scale 1/sqrt(hs). */
void kern_attention_forward(float *out, float *att, float *scratch, const float *qkv, int B,
                            int T, int C, int NH);

/* dqkv (B,T,3C) += gradient, given dout (B,T,C) and the forward's qkv and att.
 * scratch: 2*T*T floats of work space. */
void kern_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                             const float *att, int B, int T, int C, int NH);

/* GELU, tanh approximation (Hendrycks & Gimpel 2016, as GPT-2): out (n) = gelu(inp). */
void kern_gelu_forward(float *out, const float *inp, size_t n);

/* dinp (n) += gelu'(inp) * dout. */
void kern_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n);

/* out (n) = a + b. */
void kern_residual_forward(float *out, const float *a, const float *b, size_t n);

/* da (n) += dout; db (n) += dout. */
void kern_residual_backward(float *da, float *db, const float *dout, size_t n);

/* Softmax and cross-entropy, fused. logits (N,V). probs (N,V) is written; losses (N) gets
 * -log probs[n, targets[n]]. targets in [0, V). Returns nothing; computation in fp32 with
 * the max subtracted. */
void kern_softmax_crossentropy_forward(float *probs, float *losses, const float *logits,
                                       const int32_t *targets, int N, int V);

/* dlogits (N,V) += (probs - onehot(targets)) * dloss, where dloss is the gradient of the
 * total loss with respect to each row's loss (1 / number of rows in the global batch). */
void kern_softmax_crossentropy_backward(float *dlogits, const float *probs,
                                        const int32_t *targets, float dloss, int N, int V);

#endif /* KERNELS_H */
