/* kern_cpu_vec.h - the CPU implementations of kern_ops.h's vector ops (accumulation, clip,
 * block norms, AdamW, the rank tree sum), shared by the CPU kernel table
 * (kernels/cpu/kern_ops_cpu.c) and train/optim.c, so that the optimizer has exactly one
 * implementation and the table gives the bits optim.c always gave.
 *
 * Plain host memory, fp32 (block sums in double). Loops run in index order; the build uses
 * -fno-fast-math -ffp-contract=off, so each result is fixed for fixed inputs.
 * Thread-safety: touch only their arguments.
 */
#ifndef KERN_CPU_VEC_H
#define KERN_CPU_VEC_H

#include "kern_ops.h"

#include <stddef.h>
#include <stdint.h>

/* Elements per block of kern_cpu_block_sumsq (= model.h's TRAIN_BLOCK). */
#define KERN_BLOCK 2048

/* acc[i] = acc[i] + x[i], i in [0, n). */
void kern_cpu_add(float *acc, const float *x, size_t n);

/* x[i] *= s. */
void kern_cpu_scale(float *x, size_t n, float s);

/* out[k] = sum over i in block k (KERN_BLOCK elements, index order) of (double)x[i]^2;
 * n a multiple of KERN_BLOCK. */
void kern_cpu_block_sumsq(const float *x, size_t n, double *out);

/* One AdamW update of n contiguous elements of one tensor (kern_ops.h's adamw):
 * m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/bc1 / (sqrt(v/bc2) + eps) + wd p). */
void kern_cpu_adamw(float *params, float *m, float *v, const float *grads, size_t n,
                    const kern_adamw_args *a);

/* kern_ops.h's rank_tree_sum: comm.h's tree over rank index (left subtree = the largest
 * power of two below the count), out may be in. */
void kern_cpu_rank_tree_sum(float *out, const float *in, size_t n, size_t stride, int nranks);

/* The CPU fp32 table, a static constant (ctx NULL): what kern_cpu_ops_init(&t, 0) fills in.
 * For callers that need a default table without owning one. */
const kern_ops *kern_cpu_ops_fp32(void);

#endif /* KERN_CPU_VEC_H */
