/* AdamW, schedule, tree accumulation, block norms. */
#include "optim.h"

#include "device.h"
#include "kern_cpu_vec.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

float train_lr_at(const train_adamw_config *c, int64_t step)
{
    if (c->warmup > 0 && step < c->warmup) return c->lr * (float)(step + 1) / (float)c->warmup;
    int64_t decay_steps = (int64_t)c->total_steps - c->warmup;
    float min_lr = c->lr * c->min_lr_ratio;
    if (decay_steps <= 0 || step >= c->total_steps) return min_lr;
    double ratio = (double)(step - c->warmup) / (double)decay_steps;
    double coeff = 0.5 * (1.0 + cos(3.14159265358979323846 * ratio));
    return (float)(min_lr + coeff * (c->lr - min_lr));
}

void train_adamw_update(const train_adamw_config *c, const train_tensor *tensors, size_t ntensors,
                        float *params, float *m, float *v, const float *grads, size_t lo,
                        size_t hi, int64_t t, float lr)
{
    train_adamw_update_shard(c, tensors, ntensors, params + lo, m + lo, v + lo, grads + lo, lo, hi,
                             t, lr);
}

void train_adamw_update_shard(const train_adamw_config *c, const train_tensor *tensors,
                              size_t ntensors, float *params, float *m, float *v,
                              const float *grads, size_t lo, size_t hi, int64_t t, float lr)
{
    train_adamw_update_ops(kern_cpu_ops_fp32(), c, tensors, ntensors, params, m, v, grads, lo, hi,
                           t, lr);
}

void train_adamw_update_ops(const kern_ops *ops, const train_adamw_config *c,
                            const train_tensor *tensors, size_t ntensors, float *params, float *m,
                            float *v, const float *grads, size_t lo, size_t hi, int64_t t, float lr)
{
    kern_adamw_args a = {.lr = lr, .beta1 = c->beta1, .beta2 = c->beta2, .eps = c->eps};
    a.bc1 = 1.0f - powf(c->beta1, (float)t);
    a.bc2 = 1.0f - powf(c->beta2, (float)t);
    for (size_t ti = 0; ti < ntensors; ti++) {
        const train_tensor *tt = &tensors[ti];
        size_t lo_t = tt->offset > lo ? tt->offset : lo;
        size_t hi_t = tt->offset + tt->numel < hi ? tt->offset + tt->numel : hi;
        if (hi_t <= lo_t) continue;
        a.weight_decay = tt->decay ? c->weight_decay : 0.0f;
        size_t i = lo_t - lo;
        ops->adamw(ops->ctx, params + i, m + i, v + i, grads + i, hi_t - lo_t, &a);
    }
}

void train_block_sumsq(const float *x, size_t lo, size_t hi, double *out)
{
    train_block_sumsq_shard(x + lo, hi - lo, out + lo / TRAIN_BLOCK);
}

void train_block_sumsq_shard(const float *x, size_t n, double *out)
{
    kern_cpu_block_sumsq(x, n, out);
}

double train_tree_sum(const double *vals, size_t n)
{
    if (n == 0) return 0.0;
    if (n == 1) return vals[0];
    size_t h = 1;
    while (h * 2 < n) h *= 2; /* largest power of two below n: left subtrees are complete */
    return train_tree_sum(vals, h) + train_tree_sum(vals + h, n - h);
}

void train_scale(float *x, size_t lo, size_t hi, float s)
{
    if (hi > lo) kern_cpu_scale(x + lo, hi - lo, s);
}

struct train_tree {
    size_t n;
    int levels;
    int depth;     /* partial sums on the stack */
    int max_items, pushed;
    int *size;     /* items in each stacked partial sum */
    float **slot;  /* (levels) buffers of n floats, memory of dev (host memory when NULL) */
    train_device *dev;
    const kern_ops *ops;
};

int train_tree_create(train_tree **out, size_t n, int max_items)
{
    return train_tree_create_on(out, n, max_items, NULL, NULL);
}

int train_tree_create_on(train_tree **out, size_t n, int max_items, train_device *dev,
                         const kern_ops *ops)
{
    *out = NULL;
    if (n == 0 || max_items < 1) return -EINVAL;
    train_tree *t = calloc(1, sizeof *t);
    if (!t) return -ENOMEM;
    t->n = n;
    t->max_items = max_items;
    t->dev = dev;
    t->ops = ops ? ops : kern_cpu_ops_fp32();
    int levels = 1;
    while ((1 << (levels - 1)) < max_items) levels++;
    t->levels = levels + 1;
    t->size = calloc((size_t)t->levels, sizeof *t->size);
    t->slot = calloc((size_t)t->levels, sizeof *t->slot);
    if (!t->size || !t->slot) goto fail;
    for (int i = 0; i < t->levels; i++) {
        if (dev) {
            void *p;
            if (train_device_alloc(dev, &p, n * sizeof(float)) < 0) goto fail;
            t->slot[i] = p;
        } else if (!(t->slot[i] = malloc(n * sizeof(float)))) {
            goto fail;
        }
    }
    *out = t;
    return 0;
fail:
    train_tree_free(t);
    return -ENOMEM;
}

void train_tree_free(train_tree *t)
{
    if (!t) return;
    for (int i = 0; t->slot && i < t->levels; i++) {
        if (t->dev) train_device_free(t->dev, t->slot[i]);
        else free(t->slot[i]);
    }
    free(t->slot);
    free(t->size);
    free(t);
}

void train_tree_reset(train_tree *t)
{
    t->depth = 0;
    t->pushed = 0;
}

int train_tree_push(train_tree *t, const float *x)
{
    if (t->pushed >= t->max_items) return -ENOSPC;
    t->pushed++;
    const kern_ops *k = t->ops;
    /* the stack never holds two partial sums of equal size, so depth <= levels - 1 here */
    k->copy(k->ctx, t->slot[t->depth], x, t->n);
    t->size[t->depth] = 1;
    t->depth++;
    while (t->depth >= 2 && t->size[t->depth - 1] == t->size[t->depth - 2]) {
        k->add(k->ctx, t->slot[t->depth - 2], t->slot[t->depth - 1], t->n);
        t->size[t->depth - 2] *= 2;
        t->depth--;
    }
    return 0;
}

void train_tree_result(train_tree *t, float *out)
{
    const kern_ops *k = t->ops;
    if (t->depth == 0) {
        k->zero(k->ctx, out, t->n);
        return;
    }
    /* combine right to left: earlier (larger, complete) subtrees on the left */
    for (int i = t->depth - 1; i >= 1; i--) k->add(k->ctx, t->slot[i - 1], t->slot[i], t->n);
    k->copy(k->ctx, out, t->slot[0], t->n);
    t->depth = 0;
    t->pushed = 0;
}
