/* AdamW, schedule, tree accumulation, block norms. */
#include "optim.h"

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
    const float b1 = c->beta1, b2 = c->beta2, eps = c->eps;
    const float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
    for (size_t ti = 0; ti < ntensors; ti++) {
        const train_tensor *tt = &tensors[ti];
        size_t a = tt->offset > lo ? tt->offset : lo;
        size_t b = tt->offset + tt->numel < hi ? tt->offset + tt->numel : hi;
        const float wd = tt->decay ? c->weight_decay : 0.0f;
        for (size_t k = a; k < b; k++) {
            size_t i = k - lo;
            float g = grads[i];
            float mi = b1 * m[i] + (1.0f - b1) * g;
            float vi = b2 * v[i] + (1.0f - b2) * g * g;
            m[i] = mi;
            v[i] = vi;
            float mhat = mi / bc1, vhat = vi / bc2;
            params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * params[i]);
        }
    }
}

void train_block_sumsq(const float *x, size_t lo, size_t hi, double *out)
{
    train_block_sumsq_shard(x + lo, hi - lo, out + lo / TRAIN_BLOCK);
}

void train_block_sumsq_shard(const float *x, size_t n, double *out)
{
    for (size_t b = 0; b < n; b += TRAIN_BLOCK) {
        double s = 0.0;
        for (size_t i = b; i < b + TRAIN_BLOCK; i++) s += (double)x[i] * (double)x[i];
        out[b / TRAIN_BLOCK] = s;
    }
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
    for (size_t i = lo; i < hi; i++) x[i] *= s;
}

struct train_tree {
    size_t n;
    int levels;
    int depth;     /* partial sums on the stack */
    int max_items, pushed;
    int *size;     /* items in each stacked partial sum */
    float **slot;  /* (levels) buffers of n floats */
};

int train_tree_create(train_tree **out, size_t n, int max_items)
{
    *out = NULL;
    if (n == 0 || max_items < 1) return -EINVAL;
    train_tree *t = calloc(1, sizeof *t);
    if (!t) return -ENOMEM;
    t->n = n;
    t->max_items = max_items;
    int levels = 1;
    while ((1 << (levels - 1)) < max_items) levels++;
    t->levels = levels + 1;
    t->size = calloc((size_t)t->levels, sizeof *t->size);
    t->slot = calloc((size_t)t->levels, sizeof *t->slot);
    if (!t->size || !t->slot) goto fail;
    for (int i = 0; i < t->levels; i++)
        if (!(t->slot[i] = malloc(n * sizeof(float)))) goto fail;
    *out = t;
    return 0;
fail:
    train_tree_free(t);
    return -ENOMEM;
}

void train_tree_free(train_tree *t)
{
    if (!t) return;
    for (int i = 0; t->slot && i < t->levels; i++) free(t->slot[i]);
    free(t->slot);
    free(t->size);
    free(t);
}

void train_tree_reset(train_tree *t)
{
    t->depth = 0;
    t->pushed = 0;
}

static void add_into(float *left, const float *right, size_t n)
{
    for (size_t i = 0; i < n; i++) left[i] = left[i] + right[i];
}

int train_tree_push(train_tree *t, const float *x)
{
    if (t->pushed >= t->max_items) return -ENOSPC;
    t->pushed++;
    /* the stack never holds two partial sums of equal size, so depth <= levels - 1 here */
    memcpy(t->slot[t->depth], x, t->n * sizeof(float));
    t->size[t->depth] = 1;
    t->depth++;
    while (t->depth >= 2 && t->size[t->depth - 1] == t->size[t->depth - 2]) {
        add_into(t->slot[t->depth - 2], t->slot[t->depth - 1], t->n);
        t->size[t->depth - 2] *= 2;
        t->depth--;
    }
    return 0;
}

void train_tree_result(train_tree *t, float *out)
{
    if (t->depth == 0) {
        memset(out, 0, t->n * sizeof(float));
        return;
    }
    /* combine right to left: earlier (larger, complete) subtrees on the left */
    for (int i = t->depth - 1; i >= 1; i--) {
        float *left = t->slot[i - 1];
        add_into(left, t->slot[i], t->n);
    }
    memcpy(out, t->slot[0], t->n * sizeof(float));
    t->depth = 0;
    t->pushed = 0;
}
