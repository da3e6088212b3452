/* optim.h - AdamW, the learning-rate schedule, gradient accumulation and clipping.
 *
 * Everything here is deterministic and independent of how the flat space is split
 * (DESIGN section 4): gradients of micro-batches are summed in a fixed pairwise tree, and
 * global norms are reduced over fixed TRAIN_BLOCK-element blocks, then over blocks in a
 * fixed pairwise tree.
 *
 * Thread-safety: objects are used by one thread at a time.
 */
#ifndef TRAIN_OPTIM_H
#define TRAIN_OPTIM_H

#include "device.h"
#include "kern_ops.h"
#include "model.h"

#include <stddef.h>
#include <stdint.h>

typedef struct train_adamw_config {
    float lr;           /* peak learning rate; > 0; default 1e-3 */
    float min_lr_ratio; /* final lr = lr * min_lr_ratio after the cosine; [0, 1]; default 0.1 */
    int warmup;         /* steps of linear warm-up; >= 0; default 0 */
    int total_steps;    /* steps of the schedule (warm-up + cosine); >= 1 */
    float beta1, beta2; /* [0, 1); defaults 0.9, 0.95 */
    float eps;          /* > 0; default 1e-8 */
    float weight_decay; /* decoupled (Loshchilov & Hutter 2019); >= 0; default 0.1; only on
                           tensors with decay = 1 (not LayerNorm gains, not biases) */
    float grad_clip;    /* global-norm clip; 0 = off; default 1.0 */
} train_adamw_config;

#define TRAIN_ADAMW_CONFIG_INIT {1e-3f, 0.1f, 0, 1, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f}

/* Learning rate of step `step` (0-based): linear warm-up lr*(step+1)/warmup for
 * step < warmup, then cosine decay from lr to lr*min_lr_ratio at total_steps, constant after. */
float train_lr_at(const train_adamw_config *c, int64_t step);

/* One AdamW update (Kingma & Ba 2015 with bias correction; decoupled weight decay) of the
 * elements [lo, hi) of the flat space: params, m, v, grads are (num_params) arrays (only
 * [lo, hi) is touched). t is the 1-based update count. Weight decay follows the tensor
 * table; padding is left at zero. */
void train_adamw_update(const train_adamw_config *c, const train_tensor *tensors, size_t ntensors,
                        float *params, float *m, float *v, const float *grads, size_t lo,
                        size_t hi, int64_t t, float lr);

/* The same update over a shard held in its own arrays (ZeRO): params, m, v and grads point
 * at element lo of the flat space and hold hi - lo floats each; the tensor table still uses
 * flat offsets. Bit-identical to train_adamw_update over [lo, hi). */
void train_adamw_update_shard(const train_adamw_config *c, const train_tensor *tensors,
                              size_t ntensors, float *params, float *m, float *v,
                              const float *grads, size_t lo, size_t hi, int64_t t, float lr);

/* The same update through a kernel table (kern_ops.h): params, m, v, grads are memory of the
 * table's device holding hi - lo floats from element lo (as train_adamw_update_shard); one
 * ops->adamw call per tensor segment of [lo, hi), with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
 * (powf) and the tensor's weight decay. With the CPU fp32 table it is train_adamw_update_shard
 * (which calls it), bit for bit. */
void train_adamw_update_ops(const kern_ops *ops, const train_adamw_config *c,
                            const train_tensor *tensors, size_t ntensors, float *params, float *m,
                            float *v, const float *grads, size_t lo, size_t hi, int64_t t,
                            float lr);

/* Sum of squares of x[lo, hi) for every TRAIN_BLOCK-element block that lies in [lo, hi)
 * (lo and hi multiples of TRAIN_BLOCK) into out[(lo/TRAIN_BLOCK) ..], in double. */
void train_block_sumsq(const float *x, size_t lo, size_t hi, double *out);

/* The same for a shard in its own array: x holds n floats (n a multiple of TRAIN_BLOCK)
 * starting at a block boundary; out gets n / TRAIN_BLOCK sums. */
void train_block_sumsq_shard(const float *x, size_t n, double *out);

/* Pairwise-tree sum of n values (the tree of train_tree_*); n may be 0. */
double train_tree_sum(const double *vals, size_t n);

/* Multiply x[lo, hi) by s. */
void train_scale(float *x, size_t lo, size_t hi, float s);

/* Accumulator that sums micro-batch gradients in a fixed pairwise tree over their order j:
 * a binary counter of partial sums, so that for M = 2^k micro-batches the result is
 * ((g0+g1)+(g2+g3))+..., and any contiguous power-of-two-aligned run of micro-batches forms
 * a subtree (what a rank computes when the batch is split over ranks). Memory:
 * (log2(M)+1) buffers of n floats. */
typedef struct train_tree train_tree;

/* Errors: -EINVAL (n == 0 or max_items == 0), -ENOMEM. Host memory, the CPU fp32 kernels. */
int train_tree_create(train_tree **out, size_t n, int max_items);
/* The same with the buffers in device memory of dev (train_device_alloc; NULL = host memory)
 * and the sums done by ops->copy / ops->add / ops->zero (NULL = the CPU fp32 table); then
 * train_tree_push's x and train_tree_result's out are memory of that device too. dev and ops
 * are not owned and must outlive the accumulator. */
int train_tree_create_on(train_tree **out, size_t n, int max_items, train_device *dev,
                         const kern_ops *ops);
void train_tree_free(train_tree *t); /* accepts NULL */
/* Start a new sum. */
void train_tree_reset(train_tree *t);
/* Add the next item (n floats, copied). Errors: -ENOSPC when max_items were already pushed
 * since the last reset or result (nothing is changed). */
int train_tree_push(train_tree *t, const float *x);
/* Finish: write the total into out (n floats) and start a new sum. With no item pushed, out
 * is zeroed. */
void train_tree_result(train_tree *t, float *out);

#endif /* TRAIN_OPTIM_H */
