/* test_train_model.c - train/model: tensor table layout, initialisation, and the gradient of
 * the whole model against central finite differences of the forward loss.
 *
 * Tolerances: the forward pass runs in fp32 and returns the mean of fp32 per-position losses,
 * so the finite difference (f(p+h) - f(p-h)) / 2h carries a rounding error of about
 * 1e-7 * |loss| / h ~ 1e-5, plus a truncation error of order h^2 * f''' that dominates for
 * the larger gradients. With h = 1e-2, over ten data seeds the largest difference seen was
 * about 5e-4 (at gradients around 0.15), never more than a quarter of the allowance below.
 * The check |a-b| <= 2e-4 + 1e-2*|ref| is thus four times the observed error, and tight enough
 * to catch a dropped term or a wrong factor in any backward kernel (sampled gradients here
 * are of order 1e-3..1e-1).
 *
 * bf16: the model on the bf16 table is bit-identical to the fp32 model whose GEMMs round their
 * operands (bf16_storage below). */
#include "kern_cpu_vec.h"
#include "kern_ops.h"
#include "model.h"
#include "t_helpers.h"

#include <stdint.h>

enum { V = 11, T = 6, L = 2, C = 8, NH = 2, B = 3 };

static uint64_t rng_s = 0xD1B54A32D192ED03ull;

static uint64_t rnd(void)
{
    rng_s ^= rng_s << 13;
    rng_s ^= rng_s >> 7;
    rng_s ^= rng_s << 17;
    return rng_s;
}

static double rnd_normal(void)
{
    double u1 = ((double)(rnd() >> 11) + 0.5) * 0x1p-53, u2 = (double)(rnd() >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

static train_model *make(void)
{
    train_model_config cfg = {V, T, L, C, NH};
    train_model *m = NULL;
    int rc = train_model_create(&m, &cfg, B);
    T_REQUIRE(rc == 0 && m, "train_model_create: %d", rc);
    return m;
}

static void table(train_model *m)
{
    size_t nt = 0;
    const train_tensor *t = train_model_tensors(m, &nt);
    size_t np = train_model_num_params(m);
    T_CHECK(nt == 2 + 12 * L + 2, "%zu tensors, want %d", nt, 2 + 12 * L + 2);
    T_CHECK(np % TRAIN_BLOCK == 0 && np > 0, "num_params %zu not a multiple of %d", np, TRAIN_BLOCK);
    size_t real = 0, prev_end = 0;
    int align_ok = 1, order_ok = 1, numel_ok = 1, uniq_ok = 1, decay_ok = 1;
    for (size_t i = 0; i < nt; i++) {
        align_ok &= t[i].offset % 16 == 0;
        order_ok &= t[i].offset >= prev_end && t[i].offset + t[i].numel <= np;
        prev_end = t[i].offset + t[i].numel;
        size_t prod = 1;
        for (int d = 0; d < t[i].ndim; d++) prod *= (size_t)t[i].shape[d];
        numel_ok &= t[i].ndim >= 1 && t[i].ndim <= TRAIN_MAX_DIMS && prod == t[i].numel && prod > 0;
        for (size_t j = 0; j < i; j++) uniq_ok &= strcmp(t[i].name, t[j].name) != 0;
        /* decay on matrices and embeddings, not on LayerNorm gains or biases */
        decay_ok &= t[i].decay == (t[i].ndim == 2);
        real += t[i].numel;
    }
    T_CHECK(align_ok, "a tensor offset is not a multiple of 16");
    T_CHECK(order_ok, "tensors overlap, are out of order or run past num_params");
    T_CHECK(numel_ok, "numel does not match the shape");
    T_CHECK(uniq_ok, "tensor names repeat");
    T_CHECK(decay_ok, "decay flags");
    T_CHECK(real == train_model_num_real(m), "num_real %zu, sum of numel %zu",
            train_model_num_real(m), real);
    T_CHECK(!strcmp(t[0].name, "wte.weight") && t[0].shape[0] == V && t[0].shape[1] == C,
            "first tensor %s", t[0].name);
    T_CHECK(!strcmp(t[1].name, "wpe.weight") && t[1].shape[0] == T && t[1].shape[1] == C,
            "second tensor %s", t[1].name);
    T_CHECK(!strcmp(t[4].name, "h.0.attn.c_attn.weight") && t[4].shape[0] == 3 * C &&
                t[4].shape[1] == C, "c_attn layout (out, in): %s", t[4].name);
    T_CHECK(!strcmp(t[12].name, "h.0.mlp.c_proj.weight") && t[12].shape[0] == C &&
                t[12].shape[1] == 4 * C, "mlp.c_proj: %s", t[12].name);
    T_CHECK(!strcmp(t[nt - 1].name, "ln_f.bias"), "last tensor %s", t[nt - 1].name);
    const train_model_config *c = train_model_get_config(m);
    T_CHECK(c->vocab == V && c->seq_len == T && c->n_layer == L && c->n_embd == C && c->n_head == NH,
            "config not kept");
}

/* Elements of the flat space that belong to no tensor. */
static int is_padding(const train_tensor *t, size_t nt, size_t i)
{
    for (size_t k = 0; k < nt; k++)
        if (i >= t[k].offset && i < t[k].offset + t[k].numel) return 0;
    return 1;
}

static void init(train_model *m, train_model *m2)
{
    size_t nt = 0, np = train_model_num_params(m);
    const train_tensor *t = train_model_tensors(m, &nt);
    float *p = train_model_params(m), *p2 = train_model_params(m2);
    memset(p, 0x7f, np * sizeof *p); /* garbage in the padding must be cleared */
    train_model_init_params(m, 42);
    train_model_init_params(m2, 42);
    T_CHECK(!memcmp(p, p2, np * sizeof *p), "same seed, different parameters");
    train_model_init_params(m2, 43);
    T_CHECK(memcmp(p, p2, np * sizeof *p) != 0, "seeds 42 and 43 give the same parameters");
    size_t differ = 0;
    for (size_t i = 0; i < np; i++) differ += p[i] != p2[i];
    T_CHECK(differ > train_model_num_real(m) / 2, "only %zu of the values change with the seed",
            differ);

    int pad_ok = 1, gain_ok = 1, bias_ok = 1;
    double s1 = 0, s2 = 0, r1 = 0, r2 = 0;
    size_t n1 = 0, n2 = 0;
    for (size_t i = 0; i < np; i++)
        if (is_padding(t, nt, i)) pad_ok &= p[i] == 0.0f;
    for (size_t k = 0; k < nt; k++) {
        const float *x = p + t[k].offset;
        for (size_t i = 0; i < t[k].numel; i++) {
            if (ends_with(t[k].name, ".bias")) {
                bias_ok &= x[i] == 0.0f;
            } else if (strstr(t[k].name, "ln_")) {
                gain_ok &= x[i] == 1.0f;
            } else if (strstr(t[k].name, "c_proj.weight")) {
                r1 += x[i];
                r2 += (double)x[i] * x[i];
                n2++;
            } else {
                s1 += x[i];
                s2 += (double)x[i] * x[i];
                n1++;
            }
        }
    }
    T_CHECK(pad_ok, "padding is not zero after init");
    T_CHECK(gain_ok, "LayerNorm gains are not 1");
    T_CHECK(bias_ok, "biases are not 0");
    double sd = sqrt(s2 / (double)n1), rsd = sqrt(r2 / (double)n2);
    T_CHECK(fabs(sd - 0.02) < 0.003 && fabs(s1 / (double)n1) < 0.003, "weights: std %.5f mean %.5f over %zu",
            sd, s1 / (double)n1, n1);
    double want_r = 0.02 / sqrt(2.0 * L);
    T_CHECK(fabs(rsd - want_r) < 0.15 * want_r, "c_proj weights: std %.5f, want %.5f over %zu", rsd,
            want_r, n2);
}

/* Spread the parameters out (gains around 1, biases and weights of order 0.1-0.3) so that
 * every term of the backward pass matters; padding stays zero. */
static void randomize(train_model *m)
{
    size_t nt = 0;
    const train_tensor *t = train_model_tensors(m, &nt);
    float *p = train_model_params(m);
    for (size_t k = 0; k < nt; k++)
        for (size_t i = 0; i < t[k].numel; i++) {
            double z = rnd_normal();
            float *x = p + t[k].offset + i;
            if (ends_with(t[k].name, ".bias")) *x = (float)(0.1 * z);
            else if (strstr(t[k].name, "ln_")) *x = (float)(1.0 + 0.2 * z);
            else *x = (float)(0.3 * z);
        }
}

static void gradcheck(train_model *m, const int32_t *in, const int32_t *tg)
{
    size_t nt = 0, np = train_model_num_params(m);
    const train_tensor *t = train_model_tensors(m, &nt);
    float *p = train_model_params(m);
    double loss = train_model_forward(m, in, tg, B);
    T_CHECK(loss > 0.5 && loss < 20, "loss %g", loss);
    train_model_backward(m, 1.0f / (float)(B * T));
    float *g = malloc(np * sizeof *g);
    T_REQUIRE(g != NULL, "malloc");
    memcpy(g, train_model_grads(m), np * sizeof *g);

    int pad_ok = 1;
    for (size_t i = 0; i < np; i++)
        if (is_padding(t, nt, i)) pad_ok &= g[i] == 0.0f;
    T_CHECK(pad_ok, "gradient in the padding");

    const double h = 1e-2, atol = 2e-4, rtol = 1e-2;
    int checked = 0, bad = 0, nonzero = 0;
    double worst = 0;
    for (size_t k = 0; k < nt; k++) {
        int per = k == 0 ? 6 : 2; /* wte gets more: it is also the output layer */
        for (int r = 0; r < per; r++) {
            size_t idx = t[k].offset + (size_t)(rnd() % t[k].numel);
            float keep = p[idx];
            p[idx] = keep + (float)h;
            double hp = (double)p[idx] - keep;
            double fp = train_model_forward(m, in, tg, B);
            p[idx] = keep - (float)h;
            double hm = keep - (double)p[idx];
            double fm = train_model_forward(m, in, tg, B);
            p[idx] = keep;
            double fd = (fp - fm) / (hp + hm);
            double a = g[idx];
            double err = fabs(a - fd);
            if (err > worst) worst = err;
            checked++;
            nonzero += fabs(fd) > 1e-3;
            if (!t_close(a, fd, atol, rtol)) {
                bad++;
                fprintf(stderr, "  %s[%zu]: backward %.6g, finite difference %.6g\n", t[k].name,
                        idx - t[k].offset, a, fd);
            }
        }
    }
    printf("gradient check: %d parameters, %d with |grad| > 1e-3, worst |diff| %.3g\n", checked,
           nonzero, worst);
    T_CHECK(bad == 0, "%d of %d gradients differ from finite differences", bad, checked);
    T_CHECK(nonzero >= checked / 2, "only %d of %d sampled gradients are > 1e-3: test too weak",
            nonzero, checked);

    /* backward zeroes first: garbage in the gradient buffer does not survive, and a second
     * call gives the same bits */
    (void)train_model_forward(m, in, tg, B);
    float *gb = train_model_grads(m);
    for (size_t i = 0; i < np; i++) gb[i] = 1e3f;
    train_model_backward(m, 1.0f / (float)(B * T));
    T_CHECK(!memcmp(gb, g, np * sizeof *g), "backward after garbage differs");
    train_model_backward(m, 1.0f / (float)(B * T));
    T_CHECK(!memcmp(gb, g, np * sizeof *g), "second backward differs");
    /* loss_scale is linear */
    train_model_backward(m, 2.0f / (float)(B * T));
    int lin = 1;
    for (size_t i = 0; i < np; i++) lin &= t_close(gb[i], 2.0 * g[i], 1e-9, 1e-5);
    T_CHECK(lin, "backward with twice the loss scale is not twice the gradient");
    free(g);
}

static void determinism(train_model *m, const int32_t *in, const int32_t *tg)
{
    double a = train_model_forward(m, in, tg, B);
    double b = train_model_forward(m, in, tg, B);
    T_CHECK(!memcmp(&a, &b, sizeof a), "forward twice: %.17g vs %.17g", a, b);
    /* sequences do not see each other: the mean over B equals the mean of the parts */
    double parts = 0;
    for (int s = 0; s < B; s++) parts += train_model_forward(m, in + s * T, tg + s * T, 1);
    T_CHECK(t_close(a, parts / B, 0, 1e-6), "batch of %d: %.9g, separate %.9g", B, a, parts / B);
    T_CHECK(train_model_forward(m, in, NULL, B) == 0.0, "forward without targets returns 0");
    /* the loss depends on the inputs */
    int32_t in2[B * T];
    memcpy(in2, in, sizeof in2);
    in2[T - 1] = (in2[T - 1] + 1) % V;
    double c = train_model_forward(m, in2, tg, B);
    T_CHECK(c != a, "changing an input token leaves the loss unchanged");
}

/* ---- bf16 storage (kern_ops.h): a model on the bf16 table (bf16 working parameters, GEMM
 * inputs stored as bf16) gives exactly the bits of the fp32 model whose GEMMs round their
 * operands to bf16 on input (the reference table below, the CPU's emulation before bf16
 * storage), through a parameter hook (ZeRO-3's gather) and a parameter change between two
 * micro-batches (the working parameters follow the update). */
static void rounded(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kern_round_bf16(src[i]);
}

static void ref_matmul_forward(void *ctx, float *out, const float *inp, const float *weight,
                               const float *bias, int N, int C_, int OC)
{
    (void)ctx;
    const size_t ni = (size_t)N * C_, nw = (size_t)OC * C_;
    float *s = malloc((ni + nw) * sizeof(float));
    rounded(s, inp, ni);
    rounded(s + ni, weight, nw);
    kern_cpu_ops_fp32()->matmul_forward(NULL, out, s, s + ni, bias, N, C_, OC);
    free(s);
}

static void ref_matmul_backward(void *ctx, float *dinp, float *dweight, float *dbias,
                                const float *dout, const float *inp, const float *weight, int N,
                                int C_, int OC)
{
    (void)ctx;
    const size_t nd = (size_t)N * OC, ni = (size_t)N * C_, nw = (size_t)OC * C_;
    float *s = malloc((nd + ni + nw) * sizeof(float));
    rounded(s, dout, nd);
    rounded(s + nd, inp, ni);
    rounded(s + nd + ni, weight, nw);
    kern_cpu_ops_fp32()->matmul_backward(NULL, dinp, dweight, dbias, s, s + nd, s + nd + ni, N,
                                         C_, OC);
    free(s);
}

/* ZeRO-3's part: the group's parameters are written into the model just before use. */
typedef struct gather_ctx {
    train_model *m;
    const float *master;
    int calls;
} gather_ctx;

static int gather(void *ctx, size_t lo, size_t hi)
{
    gather_ctx *g = ctx;
    memcpy(train_model_params(g->m) + lo, g->master + lo, (hi - lo) * sizeof(float));
    g->calls++;
    return 0;
}

static void bf16_storage(const int32_t *in, const int32_t *tg)
{
    train_model_config cfg = {V, T, L, C, NH};
    kern_ops k16, kref = *kern_cpu_ops_fp32();
    T_REQUIRE(kern_cpu_ops_init(&k16, 1) == 0, "bf16 table");
    kref.matmul_forward = ref_matmul_forward;
    kref.matmul_backward = ref_matmul_backward;
    train_model *a = NULL, *r = NULL, *f = NULL, *z = NULL;
    T_REQUIRE(train_model_create_on(&a, &cfg, B, NULL, &k16) == 0 &&
                  train_model_create_on(&r, &cfg, B, NULL, &kref) == 0 &&
                  train_model_create_on(&z, &cfg, B, NULL, &k16) == 0 &&
                  train_model_create(&f, &cfg, B) == 0,
              "create bf16, reference, fp32 models");
    const size_t np = train_model_num_params(a);
    randomize(a);
    float *master = malloc(np * sizeof(float));
    memcpy(master, train_model_params(a), np * sizeof(float));
    memcpy(train_model_params(r), master, np * sizeof(float));
    memcpy(train_model_params(f), master, np * sizeof(float));
    /* z starts with zero parameters and gets each group from the hook, as ZeRO-3 does */
    gather_ctx g = {z, master, 0};
    train_model_set_param_hook(z, gather, &g);
    int same_loss = 1, same_grads = 1;
    for (int mb = 0; mb < 2; mb++) {
        double la = train_model_forward(a, in, tg, B), lr = train_model_forward(r, in, tg, B);
        double lz = train_model_forward(z, in, tg, B), lf = train_model_forward(f, in, tg, B);
        same_loss &= !memcmp(&la, &lr, sizeof la) && !memcmp(&la, &lz, sizeof la);
        T_CHECK(la != lf, "micro-batch %d: the bf16 loss %.9g is the fp32 one", mb, la);
        T_CHECK(fabs(la - lf) < 2e-2 * fabs(lf), "micro-batch %d: bf16 loss %.9g far from fp32 %.9g",
                mb, la, lf);
        train_model_backward(a, 0.5f);
        train_model_backward(r, 0.5f);
        train_model_backward(z, 0.5f);
        same_grads &= !memcmp(train_model_grads(a), train_model_grads(r), np * sizeof(float)) &&
                      !memcmp(train_model_grads(a), train_model_grads(z), np * sizeof(float));
        /* an optimizer-like change of every parameter before the next micro-batch */
        for (size_t i = 0; i < np; i++) master[i] -= 0.05f * train_model_grads(r)[i];
        memcpy(train_model_params(a), master, np * sizeof(float));
        memcpy(train_model_params(r), master, np * sizeof(float));
        memcpy(train_model_params(f), master, np * sizeof(float));
        memset(train_model_params(z), 0, np * sizeof(float));
    }
    T_CHECK(same_loss, "bf16 storage: loss differs from the rounded-operand reference");
    T_CHECK(same_grads, "bf16 storage: gradients differ from the rounded-operand reference");
    T_CHECK(g.calls == 2 * 2 * (L + 2), "hook calls %d", g.calls);
    T_CHECK(k16.status(k16.ctx) == 0, "bf16 table status %d", k16.status(k16.ctx));
    /* memory: the five GEMM inputs per layer group (ln_1, attention output, ln_2, GELU output;
     * ln_f) moved from fp32 (16-element aligned) to bf16 (128-element aligned); the working
     * parameters are 2 bytes a parameter; gradients and the rest are the fp32 model's */
    train_model_mem m16, m32;
    train_model_memory(a, &m16);
    train_model_memory(f, &m32);
    const size_t btc = (size_t)B * T * C;
#define F32(n) (((n) + 15) / 16 * 16 * 4)
#define B16(n) (((n) + 127) / 128 * 128 * 2)
    const size_t saved = (size_t)L * (3 * (F32(btc) - B16(btc)) + F32(4 * btc) - B16(4 * btc)) +
                         F32(btc) - B16(btc);
#undef F32
#undef B16
    T_CHECK(m16.params == m32.params && m16.params == 2 * np * sizeof(float) &&
                m16.working == np * 2 && m32.working == 0 && m16.act_grads == m32.act_grads &&
                m16.other == m32.other && m32.acts - m16.acts == saved,
            "memory: bf16 acts %zu vs fp32 %zu (want %zu less), working %zu", m16.acts, m32.acts,
            saved, m16.working);
    /* a bf16 table without its bf16 entries is refused */
    kern_ops bad = *kern_cpu_ops_fp32();
    bad.bf16 = 1;
    train_model *x = (train_model *)1;
    T_CHECK(train_model_create_on(&x, &cfg, B, NULL, &bad) == -EINVAL && x == NULL,
            "bf16 table without bf16 entries: -EINVAL");
    free(master);
    train_model_free(a);
    train_model_free(r);
    train_model_free(z);
    train_model_free(f);
    kern_cpu_ops_free(&k16);
}

static void bad_args(void)
{
    train_model_config cfg = {V, T, L, C, NH};
    train_model *m = (train_model *)1;
    T_CHECK(train_model_create(&m, &cfg, 0) == -EINVAL && m == NULL, "micro_batch 0");
    cfg.n_embd = 9;
    char why[128] = "";
    T_CHECK(train_model_config_check(&cfg, why, sizeof why) == -EINVAL && why[0], "n_embd 9 / 2 heads");
    T_CHECK(train_model_create(&m, &cfg, 1) == -EINVAL, "create with n_embd 9");
    cfg.n_embd = C;
    cfg.vocab = 1;
    T_CHECK(train_model_config_check(&cfg, NULL, 0) == -EINVAL, "vocab 1");
    cfg.vocab = V;
    T_CHECK(train_model_config_check(&cfg, NULL, 0) == 0, "good config");
    train_model_free(NULL);
}

int main(void)
{
    train_model *m = make(), *m2 = make();
    table(m);
    init(m, m2);
    int32_t in[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++) {
        in[i] = (int32_t)(rnd() % V);
        tg[i] = (int32_t)(rnd() % V);
    }
    randomize(m);
    gradcheck(m, in, tg);
    determinism(m, in, tg);
    bf16_storage(in, tg);
    bad_args();
    train_model_free(m2);
    train_model_free(m);
    return t_done("test_train_model");
}
