/* GPT-2 style decoder on a kernel table (kern_ops.h) over device memory (device.h);
 * structure follows llm.c's train_gpt2.c. */
#include "model.h"

#include "device.h"
#include "kern_cpu_vec.h"
#include "kern_ops.h"
#include "rng.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Per-layer tensors, in layout order. */
enum {
    T_LN1W, T_LN1B, T_QKVW, T_QKVB, T_PROJW, T_PROJB,
    T_LN2W, T_LN2B, T_FCW, T_FCB, T_FCPW, T_FCPB, T_PER_LAYER
};

/* With bf16 (kern_ops.h) the GEMM inputs of the forward set (ln1, atty, ln2, fch_gelu, lnf)
 * are bf16 (the *16 pointers) and their float pointers NULL; in the gradient set and in fp32
 * they are float and the *16 pointers NULL. */
typedef struct layer_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (B,T,C) (B,T) (B,T) */
    uint16_t *ln1_16, *atty16, *ln2_16, *fch_gelu16;
    float *qkv;                       /* (B,T,3C) */
    float *atty;                      /* (B,T,C) */
    float *att;                       /* (B,NH,T,T) */
    float *attproj, *res2;            /* (B,T,C) */
    float *ln2, *ln2_mean, *ln2_rstd;
    float *fch, *fch_gelu;            /* (B,T,4C) */
    float *fcproj, *res3;             /* (B,T,C) */
} layer_acts;

typedef struct acts {
    float *encoded;                   /* (B,T,C) */
    layer_acts *layers;               /* (L) */
    float *lnf, *lnf_mean, *lnf_rstd;
    uint16_t *lnf16;
    float *logits, *probs;            /* (B,T,V) */
    float *losses;                    /* (B,T) */
    float *base;                      /* one allocation for all of the above */
    size_t count;                     /* floats in base */
    uint16_t *base16;                 /* the bf16 activations (bf16 forward set only) */
} acts;

struct train_model {
    train_model_config cfg;
    int max_b;
    size_t ntensors;
    train_tensor *tensors;
    size_t num_params, num_real;
    float *params, *grads;
    uint16_t *params16;  /* bf16: the working parameters (num_params), rounded from params by
                            forward as each layer group is used; NULL in fp32 */
    int bf16;            /* ops->bf16 */
    acts a, da;          /* activations and their gradients */
    float *scratch;      /* 2*T*T work space for attention */
    int32_t *inputs, *targets; /* copies of the last forward's tokens (max_b, T) */
    int last_b, have_targets;
    train_param_hook hook;     /* ZeRO-3: gathers a layer group before use; may be NULL */
    void *hook_ctx;
    int hook_status;           /* first error of the hook, sticky */
    train_device *dev;         /* NULL: host memory (calloc) */
    const kern_ops *ops;       /* the kernels; never NULL */
    int host_mem;              /* buffers are host memory (dev NULL or a CPU device) */
    float *host_losses;        /* (max_b, T) host copy of the losses when !host_mem */
    int copy_status;           /* first failed H2D/D2H copy, sticky */
    train_model_mem mem;       /* what the buffers take (train_model_memory) */
};

/* Model buffers: device memory of m->dev (zeroed), or calloc'ed host memory without one. */
static void *dalloc(train_model *m, size_t bytes)
{
    if (!m->dev) return calloc(1, bytes ? bytes : 1);
    void *p = NULL;
    return train_device_alloc(m->dev, &p, bytes ? bytes : 1) < 0 ? NULL : p;
}

static void dfree(train_model *m, void *p)
{
    if (!m->dev) free(p);
    else train_device_free(m->dev, p);
}

/* Copy between host and the model's memory (memcpy for host memory); errors are kept. */
static void dcopy(train_model *m, void *dst, const void *src, size_t bytes, train_copy_kind kind)
{
    if (m->host_mem) {
        if (bytes) memcpy(dst, src, bytes);
        return;
    }
    int rc = train_device_copy(m->dev, dst, src, bytes, kind);
    if (rc < 0 && !m->copy_status) m->copy_status = rc;
}

void train_model_set_param_hook(train_model *m, train_param_hook fn, void *ctx)
{
    m->hook = fn;
    m->hook_ctx = ctx;
    m->hook_status = 0;
}

int train_model_hook_status(const train_model *m) { return m->hook_status; }

/* Layer groups for the hook: 0 = wte + wpe, 1 + l = block l, L + 1 = ln_f and the padding.
 * The group's range [lo, hi) of the flat space. */
static void group_range(const train_model *m, int group, size_t *lo, size_t *hi)
{
    const int L = m->cfg.n_layer;
    if (group == 0) {
        *lo = 0;
        *hi = m->tensors[2].offset;
    } else if (group <= L) {
        size_t k = 2 + (size_t)(group - 1) * T_PER_LAYER;
        *lo = m->tensors[k].offset;
        *hi = m->tensors[k + T_PER_LAYER].offset;
    } else {
        *lo = m->tensors[2 + (size_t)L * T_PER_LAYER].offset;
        *hi = m->num_params;
    }
}

/* The hook on [lo, hi) (no-op without one, or after its first error). */
static void hook_range(train_model *m, size_t lo, size_t hi)
{
    if (!m->hook || m->hook_status) return;
    int rc = m->hook(m->hook_ctx, lo, hi);
    if (rc < 0) m->hook_status = rc;
}

static void call_hook(train_model *m, int group)
{
    size_t lo, hi;
    group_range(m, group, &lo, &hi);
    hook_range(m, lo, hi);
}

/* Forward's use of a group: the hook (ZeRO-3 gathers the group's parameters), then, in bf16,
 * the group's working parameters rounded from the fp32 ones just gathered or updated. The
 * backward pass of the same micro-batch reuses them: the parameters do not change between a
 * forward and its backward. */
static void use_group(train_model *m, int group)
{
    size_t lo, hi;
    group_range(m, group, &lo, &hi);
    hook_range(m, lo, hi);
    if (!m->bf16 || m->hook_status) return;
    m->ops->round_bf16(m->ops->ctx, m->params16 + lo, m->params + lo, hi - lo);
}

int train_model_config_check(const train_model_config *c, char *why, size_t why_len)
{
    const char *bad = NULL;
    if (c->vocab < 2 || c->vocab > 65536) bad = "vocab must be in [2, 65536]";
    else if (c->seq_len < 1 || c->seq_len > 8192) bad = "seq_len must be in [1, 8192]";
    else if (c->n_layer < 1 || c->n_layer > 256) bad = "n_layer must be in [1, 256]";
    else if (c->n_head < 1 || c->n_head > 256) bad = "n_head must be in [1, 256]";
    else if (c->n_embd < c->n_head || c->n_embd > 65536 || c->n_embd % c->n_head)
        bad = "n_embd must be a multiple of n_head, at most 65536";
    if (bad && why)
        snprintf(why, why_len, "%s (vocab %d, seq_len %d, n_layer %d, n_embd %d, n_head %d)", bad,
                 c->vocab, c->seq_len, c->n_layer, c->n_embd, c->n_head);
    return bad ? -EINVAL : 0;
}

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static void add_tensor(train_model *m, size_t *off, const char *name, int decay, int ndim,
                       int64_t d0, int64_t d1)
{
    train_tensor *t = &m->tensors[m->ntensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim > 1 ? d1 : 0;
    t->numel = (size_t)d0 * (ndim > 1 ? (size_t)d1 : 1);
    t->decay = decay;
    *off = round_up(*off, 16);
    t->offset = *off;
    *off += t->numel;
    m->num_real += t->numel;
}

static void build_table(train_model *m)
{
    const int64_t V = m->cfg.vocab, T = m->cfg.seq_len, C = m->cfg.n_embd;
    size_t off = 0;
    char n[48];
    add_tensor(m, &off, "wte.weight", 1, 2, V, C);
    add_tensor(m, &off, "wpe.weight", 1, 2, T, C);
    for (int l = 0; l < m->cfg.n_layer; l++) {
#define ADD(suffix, decay, nd, a, b)                                                               \
    do {                                                                                           \
        snprintf(n, sizeof n, "h.%d.%s", l, suffix);                                              \
        add_tensor(m, &off, n, decay, nd, a, b);                                                   \
    } while (0)
        ADD("ln_1.weight", 0, 1, C, 0);
        ADD("ln_1.bias", 0, 1, C, 0);
        ADD("attn.c_attn.weight", 1, 2, 3 * C, C);
        ADD("attn.c_attn.bias", 0, 1, 3 * C, 0);
        ADD("attn.c_proj.weight", 1, 2, C, C);
        ADD("attn.c_proj.bias", 0, 1, C, 0);
        ADD("ln_2.weight", 0, 1, C, 0);
        ADD("ln_2.bias", 0, 1, C, 0);
        ADD("mlp.c_fc.weight", 1, 2, 4 * C, C);
        ADD("mlp.c_fc.bias", 0, 1, 4 * C, 0);
        ADD("mlp.c_proj.weight", 1, 2, C, 4 * C);
        ADD("mlp.c_proj.bias", 0, 1, C, 0);
#undef ADD
    }
    add_tensor(m, &off, "ln_f.weight", 0, 1, C, 0);
    add_tensor(m, &off, "ln_f.bias", 0, 1, C, 0);
    m->num_params = round_up(off, TRAIN_BLOCK);
}

/* Lay out one activation set inside a single allocation; with base == NULL, only count.
 * grads: the set of the activations' gradients (m->da), which holds only what the backward
 * pass reads or writes: no attention matrix (attention_backward works in m->scratch), no
 * LayerNorm means/rstds, no probs, no losses (their pointers stay NULL). At GPT-2 124M with a
 * micro-batch of 16 x 1024 those are about 13 GB that were allocated and zeroed before every
 * backward pass for nothing. */
static size_t layout_acts(acts *a, float *base, uint16_t *base16, size_t *count16,
                          const train_model_config *c, int B, int grads, int bf16)
{
    const size_t BT = (size_t)B * (size_t)c->seq_len, C = (size_t)c->n_embd;
    const size_t TT = (size_t)c->seq_len * (size_t)c->seq_len;
    size_t off = 0, off16 = 0;
    const int half = bf16 && !grads; /* the GEMM inputs of this set are bf16 */
#define TAKE(ptr, n)                                                                               \
    do {                                                                                           \
        if (base) (ptr) = base + off;                                                              \
        off += round_up((n), 16);                                                                  \
    } while (0)
#define TAKE_FWD(ptr, n)                                                                           \
    do {                                                                                           \
        if (!grads) {                                                                              \
            TAKE(ptr, n);                                                                          \
        } else if (base) {                                                                         \
            (ptr) = NULL;                                                                          \
        }                                                                                          \
    } while (0)
    /* a GEMM input: bf16 in base16 (the float pointer NULL), or float in base */
#define TAKE_IN(ptr, ptr16, n)                                                                     \
    do {                                                                                           \
        if (half) {                                                                                \
            if (base) {                                                                            \
                (ptr) = NULL;                                                                      \
                (ptr16) = base16 + off16;                                                          \
            }                                                                                      \
            off16 += round_up((n), 128);                                                           \
        } else {                                                                                   \
            TAKE(ptr, n);                                                                          \
            if (base) (ptr16) = NULL;                                                              \
        }                                                                                          \
    } while (0)
    TAKE(a->encoded, BT * C);
    for (int l = 0; l < c->n_layer; l++) {
        layer_acts dummy, *la = base ? &a->layers[l] : &dummy;
        TAKE_IN(la->ln1, la->ln1_16, BT * C);
        TAKE_FWD(la->ln1_mean, BT);
        TAKE_FWD(la->ln1_rstd, BT);
        TAKE(la->qkv, BT * 3 * C);
        TAKE_IN(la->atty, la->atty16, BT * C);
        TAKE_FWD(la->att, (size_t)B * (size_t)c->n_head * TT);
        TAKE(la->attproj, BT * C);
        TAKE(la->res2, BT * C);
        TAKE_IN(la->ln2, la->ln2_16, BT * C);
        TAKE_FWD(la->ln2_mean, BT);
        TAKE_FWD(la->ln2_rstd, BT);
        TAKE(la->fch, BT * 4 * C);
        TAKE_IN(la->fch_gelu, la->fch_gelu16, BT * 4 * C);
        TAKE(la->fcproj, BT * C);
        TAKE(la->res3, BT * C);
    }
    TAKE_IN(a->lnf, a->lnf16, BT * C);
    TAKE_FWD(a->lnf_mean, BT);
    TAKE_FWD(a->lnf_rstd, BT);
    TAKE(a->logits, BT * (size_t)c->vocab);
    TAKE_FWD(a->probs, BT * (size_t)c->vocab);
    TAKE_FWD(a->losses, BT);
#undef TAKE_IN
#undef TAKE_FWD
#undef TAKE
    *count16 = off16;
    return off;
}

static int alloc_acts(train_model *m, acts *a, const train_model_config *c, int B, int grads)
{
    size_t n16 = 0;
    size_t n = layout_acts(a, NULL, NULL, &n16, c, B, grads, m->bf16);
    a->layers = calloc((size_t)c->n_layer, sizeof *a->layers);
    a->base = dalloc(m, n * sizeof(float));
    if (!a->layers || !a->base) return -ENOMEM;
    if (n16 && !(a->base16 = dalloc(m, n16 * sizeof(uint16_t)))) return -ENOMEM;
    layout_acts(a, a->base, a->base16, &n16, c, B, grads, m->bf16);
    a->count = n;
    const size_t bytes = n * sizeof(float) + n16 * sizeof(uint16_t);
    if (grads) m->mem.act_grads += bytes;
    else m->mem.acts += bytes;
    return 0;
}

int train_model_create(train_model **out, const train_model_config *config, int micro_batch)
{
    return train_model_create_on(out, config, micro_batch, NULL, NULL);
}

int train_model_create_on(train_model **out, const train_model_config *config, int micro_batch,
                          train_device *dev, const kern_ops *ops)
{
    *out = NULL;
    if (!config || micro_batch < 1 || train_model_config_check(config, NULL, 0) < 0) return -EINVAL;
    train_model *m = calloc(1, sizeof *m);
    if (!m) return -ENOMEM;
    m->cfg = *config;
    m->max_b = micro_batch;
    m->dev = dev;
    m->ops = ops ? ops : kern_cpu_ops_fp32();
    m->bf16 = m->ops->bf16;
    if (m->bf16 && (!m->ops->round_bf16 || !m->ops->layernorm_forward_bf16 ||
                    !m->ops->attention_forward_bf16 || !m->ops->gelu_forward_bf16 ||
                    !m->ops->matmul_forward_bf16 || !m->ops->matmul_backward_bf16)) {
        free(m);
        return -EINVAL;
    }
    m->host_mem = !dev || train_device_kind_of(dev) == TRAIN_DEVICE_CPU;
    m->tensors = calloc(2 + (size_t)T_PER_LAYER * (size_t)config->n_layer + 2, sizeof *m->tensors);
    if (!m->tensors) goto fail;
    build_table(m);
    m->params = dalloc(m, m->num_params * sizeof(float));
    m->grads = dalloc(m, m->num_params * sizeof(float));
    if (m->bf16 && !(m->params16 = dalloc(m, m->num_params * sizeof(uint16_t)))) goto fail;
    size_t T = (size_t)config->seq_len;
    m->scratch = dalloc(m, 2 * T * T * sizeof(float));
    m->inputs = dalloc(m, (size_t)micro_batch * T * sizeof(int32_t));
    m->targets = dalloc(m, (size_t)micro_batch * T * sizeof(int32_t));
    /* pinned: a copy into pageable memory would block in the driver, past every timeout */
    if (!m->host_mem && train_host_alloc_pinned(m->dev, (void **)&m->host_losses,
                                                (size_t)micro_batch * T * sizeof(float)) < 0)
        goto fail;
    if (!m->params || !m->grads || !m->scratch || !m->inputs || !m->targets ||
        alloc_acts(m, &m->a, config, micro_batch, 0) < 0 ||
        alloc_acts(m, &m->da, config, micro_batch, 1) < 0)
        goto fail;
    m->mem.params = 2 * m->num_params * sizeof(float);
    m->mem.working = m->params16 ? m->num_params * sizeof(uint16_t) : 0;
    m->mem.other = 2 * T * T * sizeof(float) + 2 * (size_t)micro_batch * T * sizeof(int32_t);
    *out = m;
    return 0;
fail:
    train_model_free(m);
    return -ENOMEM;
}

void train_model_free(train_model *m)
{
    if (!m) return;
    free(m->tensors);
    dfree(m, m->params);
    dfree(m, m->grads);
    if (m->params16) dfree(m, m->params16);
    dfree(m, m->scratch);
    dfree(m, m->inputs);
    dfree(m, m->targets);
    free(m->a.layers);
    dfree(m, m->a.base);
    if (m->a.base16) dfree(m, m->a.base16);
    free(m->da.layers);
    dfree(m, m->da.base);
    if (m->host_losses) train_host_free_pinned(m->dev, m->host_losses);
    free(m);
}

train_device *train_model_device(const train_model *m) { return m->dev; }
void train_model_memory(const train_model *m, train_model_mem *out) { *out = m->mem; }
const kern_ops *train_model_ops(const train_model *m) { return m->ops; }
int train_model_copy_status(const train_model *m) { return m->copy_status; }

const train_tensor *train_model_tensors(const train_model *m, size_t *n)
{
    *n = m->ntensors;
    return m->tensors;
}
size_t train_model_num_params(const train_model *m) { return m->num_params; }
size_t train_model_num_real(const train_model *m) { return m->num_real; }
float *train_model_params(train_model *m) { return m->params; }
float *train_model_grads(train_model *m) { return m->grads; }
const train_model_config *train_model_get_config(const train_model *m) { return &m->cfg; }

void train_model_init_params(train_model *m, uint64_t seed)
{
    if (m->host_mem) {
        train_model_init_params_into(m, seed, m->params);
        return;
    }
    float *h = malloc(m->num_params * sizeof(float));
    if (!h) {
        if (!m->copy_status) m->copy_status = -ENOMEM;
        return;
    }
    train_model_init_params_into(m, seed, h);
    dcopy(m, m->params, h, m->num_params * sizeof(float), TRAIN_COPY_H2D);
    free(h);
}

void train_model_init_params_into(const train_model *m, uint64_t seed, float *dst)
{
    memset(dst, 0, m->num_params * sizeof(float));
    const double resid_std = 0.02 / sqrt(2.0 * m->cfg.n_layer);
    for (size_t ti = 0; ti < m->ntensors; ti++) {
        const train_tensor *t = &m->tensors[ti];
        float *p = dst + t->offset;
        const char *suffix = strrchr(t->name, '.');
        int is_bias = suffix && !strcmp(suffix, ".bias");
        int is_ln = strstr(t->name, "ln_") != NULL;
        if (is_ln && !is_bias) {
            for (size_t i = 0; i < t->numel; i++) p[i] = 1.0f;
        } else if (!is_bias) {
            double std = strstr(t->name, "c_proj.weight") ? resid_std : 0.02;
            for (size_t i = 0; i < t->numel; i++)
                p[i] = (float)(std * train_rng_normal(seed, 0x1417ull + ti, i));
        }
    }
}

/* Parameter pointer of a tensor. */
static float *P(float *base, const train_model *m, size_t ti) { return base + m->tensors[ti].offset; }

/* The working bf16 parameters of a tensor. */
static const uint16_t *W16(const train_model *m, size_t ti) { return m->params16 + m->tensors[ti].offset; }

/* The ops whose output feeds a GEMM, and the GEMMs: fp32, or in bf16 the *_bf16 entries on
 * the activations' bf16 storage and the working parameters (kern_ops.h). wk: the tensor
 * index of the weight. */
static void ln_fwd(train_model *m, float *out, uint16_t *out16, float *mean, float *rstd,
                   const float *inp, size_t wk, int N, int C)
{
    const kern_ops *K = m->ops;
    const float *w = P(m->params, m, wk), *b = P(m->params, m, wk + 1);
    if (m->bf16) K->layernorm_forward_bf16(K->ctx, out16, mean, rstd, inp, w, b, N, C);
    else K->layernorm_forward(K->ctx, out, mean, rstd, inp, w, b, N, C);
}

static void mm_fwd(train_model *m, float *out, const float *inp, const uint16_t *inp16, size_t wk,
                   const float *bias, int N, int C, int OC)
{
    const kern_ops *K = m->ops;
    if (m->bf16) K->matmul_forward_bf16(K->ctx, out, inp16, W16(m, wk), bias, N, C, OC);
    else K->matmul_forward(K->ctx, out, inp, P(m->params, m, wk), bias, N, C, OC);
}

static void mm_bwd(train_model *m, float *dinp, float *dweight, float *dbias, const float *dout,
                   const float *inp, const uint16_t *inp16, size_t wk, int N, int C, int OC)
{
    const kern_ops *K = m->ops;
    if (m->bf16)
        K->matmul_backward_bf16(K->ctx, dinp, dweight, dbias, dout, inp16, W16(m, wk), N, C, OC);
    else
        K->matmul_backward(K->ctx, dinp, dweight, dbias, dout, inp, P(m->params, m, wk), N, C, OC);
}

double train_model_forward(train_model *m, const int32_t *inputs, const int32_t *targets, int B)
{
    const int T = m->cfg.seq_len, C = m->cfg.n_embd, NH = m->cfg.n_head, V = m->cfg.vocab;
    const int L = m->cfg.n_layer, BT = B * T;
    float *w = m->params;
    acts *a = &m->a;
    const kern_ops *K = m->ops;
    void *X = K->ctx;
    dcopy(m, m->inputs, inputs, (size_t)BT * sizeof(int32_t), TRAIN_COPY_H2D);
    m->have_targets = targets != NULL;
    if (targets) dcopy(m, m->targets, targets, (size_t)BT * sizeof(int32_t), TRAIN_COPY_H2D);
    m->last_b = B;

    use_group(m, 0);
    K->encoder_forward(X, a->encoded, m->inputs, P(w, m, 0), P(w, m, 1), B, T, C);
    const float *residual = a->encoded;
    for (int l = 0; l < L; l++) {
        size_t k = 2 + (size_t)l * T_PER_LAYER;
        layer_acts *la = &a->layers[l];
        use_group(m, 1 + l);
        ln_fwd(m, la->ln1, la->ln1_16, la->ln1_mean, la->ln1_rstd, residual, k + T_LN1W, BT, C);
        mm_fwd(m, la->qkv, la->ln1, la->ln1_16, k + T_QKVW, P(w, m, k + T_QKVB), BT, C, 3 * C);
        if (m->bf16) K->attention_forward_bf16(X, la->atty16, la->att, m->scratch, la->qkv, B, T, C, NH);
        else K->attention_forward(X, la->atty, la->att, m->scratch, la->qkv, B, T, C, NH);
        mm_fwd(m, la->attproj, la->atty, la->atty16, k + T_PROJW, P(w, m, k + T_PROJB), BT, C, C);
        K->residual_forward(X, la->res2, residual, la->attproj, (size_t)BT * C);
        ln_fwd(m, la->ln2, la->ln2_16, la->ln2_mean, la->ln2_rstd, la->res2, k + T_LN2W, BT, C);
        mm_fwd(m, la->fch, la->ln2, la->ln2_16, k + T_FCW, P(w, m, k + T_FCB), BT, C, 4 * C);
        if (m->bf16) K->gelu_forward_bf16(X, la->fch_gelu16, la->fch, (size_t)BT * 4 * C);
        else K->gelu_forward(X, la->fch_gelu, la->fch, (size_t)BT * 4 * C);
        mm_fwd(m, la->fcproj, la->fch_gelu, la->fch_gelu16, k + T_FCPW, P(w, m, k + T_FCPB), BT,
               4 * C, C);
        K->residual_forward(X, la->res3, la->res2, la->fcproj, (size_t)BT * C);
        residual = la->res3;
    }
    size_t kf = 2 + (size_t)L * T_PER_LAYER;
    use_group(m, L + 1);
    ln_fwd(m, a->lnf, a->lnf16, a->lnf_mean, a->lnf_rstd, residual, kf, BT, C);
    mm_fwd(m, a->logits, a->lnf, a->lnf16, 0, NULL, BT, C, V);
    if (m->hook_status) return NAN;
    if (!targets) return m->copy_status ? NAN : 0.0;
    K->softmax_crossentropy_forward(X, a->probs, a->losses, a->logits, m->targets, BT, V);
    const float *losses = a->losses;
    if (!m->host_mem) {
        dcopy(m, m->host_losses, a->losses, (size_t)BT * sizeof(float), TRAIN_COPY_D2H);
        losses = m->host_losses;
    }
    if (m->copy_status) return NAN;
    double sum = 0.0;
    for (int i = 0; i < BT; i++) sum += losses[i];
    return sum / BT;
}

void train_model_backward(train_model *m, float loss_scale)
{
    const int B = m->last_b, T = m->cfg.seq_len, C = m->cfg.n_embd, NH = m->cfg.n_head;
    const int V = m->cfg.vocab, L = m->cfg.n_layer, BT = B * T;
    float *w = m->params, *g = m->grads;
    acts *a = &m->a, *d = &m->da;
    const kern_ops *K = m->ops;
    void *X = K->ctx;
    if (!m->have_targets) return;
    K->zero(X, g, m->num_params);
    K->zero(X, d->base, d->count);

    call_hook(m, L + 1);
    call_hook(m, 0); /* the tied output head */
    K->softmax_crossentropy_backward(X, d->logits, a->probs, m->targets, loss_scale, BT, V);
    mm_bwd(m, d->lnf, P(g, m, 0), NULL, d->logits, a->lnf, a->lnf16, 0, BT, C, V);
    size_t kf = 2 + (size_t)L * T_PER_LAYER;
    const float *res_last = L ? a->layers[L - 1].res3 : a->encoded;
    float *dres_last = L ? d->layers[L - 1].res3 : d->encoded;
    K->layernorm_backward(X, dres_last, P(g, m, kf), P(g, m, kf + 1), d->lnf, res_last, P(w, m, kf),
                            a->lnf_mean, a->lnf_rstd, BT, C);
    for (int l = L - 1; l >= 0; l--) {
        size_t k = 2 + (size_t)l * T_PER_LAYER;
        layer_acts *la = &a->layers[l], *dl = &d->layers[l];
        const float *residual = l == 0 ? a->encoded : a->layers[l - 1].res3;
        float *dresidual = l == 0 ? d->encoded : d->layers[l - 1].res3;
        call_hook(m, 1 + l);
        K->residual_backward(X, dl->res2, dl->fcproj, dl->res3, (size_t)BT * C);
        mm_bwd(m, dl->fch_gelu, P(g, m, k + T_FCPW), P(g, m, k + T_FCPB), dl->fcproj, la->fch_gelu,
               la->fch_gelu16, k + T_FCPW, BT, 4 * C, C);
        K->gelu_backward(X, dl->fch, la->fch, dl->fch_gelu, (size_t)BT * 4 * C);
        mm_bwd(m, dl->ln2, P(g, m, k + T_FCW), P(g, m, k + T_FCB), dl->fch, la->ln2, la->ln2_16,
               k + T_FCW, BT, C, 4 * C);
        K->layernorm_backward(X, dl->res2, P(g, m, k + T_LN2W), P(g, m, k + T_LN2B), dl->ln2, la->res2,
                                P(w, m, k + T_LN2W), la->ln2_mean, la->ln2_rstd, BT, C);
        K->residual_backward(X, dresidual, dl->attproj, dl->res2, (size_t)BT * C);
        mm_bwd(m, dl->atty, P(g, m, k + T_PROJW), P(g, m, k + T_PROJB), dl->attproj, la->atty,
               la->atty16, k + T_PROJW, BT, C, C);
        K->attention_backward(X, dl->qkv, m->scratch, dl->atty, la->qkv, la->att, B, T, C, NH);
        mm_bwd(m, dl->ln1, P(g, m, k + T_QKVW), P(g, m, k + T_QKVB), dl->qkv, la->ln1, la->ln1_16,
               k + T_QKVW, BT, C, 3 * C);
        K->layernorm_backward(X, dresidual, P(g, m, k + T_LN1W), P(g, m, k + T_LN1B), dl->ln1, residual,
                                P(w, m, k + T_LN1W), la->ln1_mean, la->ln1_rstd, BT, C);
    }
    K->encoder_backward(X, P(g, m, 0), P(g, m, 1), d->encoded, m->inputs, B, T, C);
}
