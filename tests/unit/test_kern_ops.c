/* test_kern_ops: the CPU kernel table (kern_ops.h, kernels/cpu/kern_ops_cpu.c).
 *  - fp32: every entry gives exactly the bits of the kernels.h function it stands for;
 *  - the vector ops give exactly the bits of the optimizer code as it was before the table
 *    (AdamW over many tensor segments, block sums of squares, scale, the micro-batch tree
 *    accumulator, comm.h's rank tree) - the reference loops are copied here verbatim;
 *  - kern_round_bf16 on edge cases (ties to even, NaN, inf, overflow, subnormals, signs);
 *  - bf16 entries: round_bf16 is kern_round_bf16; matmul forward/backward on bf16 operands
 *    equal the fp32 kernels on operands rounded beforehand (forward: inp, weight; backward:
 *    dout, inp, weight) and differ from plain fp32; LayerNorm, GELU and attention with a bf16
 *    output give the fp32 kernel's output rounded (and the same fp32 mean, rstd, att). */
#include "t_helpers.h"

#include "device.h"
#include "kern_cpu_vec.h"
#include "kern_ops.h"
#include "kernels.h"
#include "model.h"
#include "optim.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}
static float *rnd(size_t n)
{
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = frand();
    return p;
}
static float *fdup(const float *x, size_t n)
{
    float *p = malloc(n * sizeof(float));
    memcpy(p, x, n * sizeof(float));
    return p;
}
static int same(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

/* ---- every model op of the fp32 table against kernels.h */
static void test_model_ops_fp32(void)
{
    kern_ops k;
    T_REQUIRE(kern_cpu_ops_init(&k, 0) == 0, "init fp32");
    T_CHECK(k.ctx == NULL && k.bf16 == 0 && !strcmp(k.name, "cpu"), "fp32 table fields");
    const int B = 2, T = 8, C = 16, NH = 4, V = 32, N = B * T, OC = 24;
    int32_t inp[16], tg[16];
    for (int i = 0; i < N; i++) {
        inp[i] = (int32_t)(rng % V);
        frand();
        tg[i] = (int32_t)(rng % V);
        frand();
    }
    float *wte = rnd((size_t)V * C), *wpe = rnd((size_t)T * C), *x = rnd((size_t)N * C);
    float *w = rnd((size_t)OC * C), *bias = rnd(OC), *dout = rnd((size_t)N * OC);
    float *qkv = rnd((size_t)N * 3 * C), *dat = rnd((size_t)N * C);
    float *o1 = calloc((size_t)N * V * 3, sizeof(float)), *o2 = calloc((size_t)N * V * 3, sizeof(float));
    float *a1 = calloc((size_t)N * C * 3, sizeof(float)), *a2 = calloc((size_t)N * C * 3, sizeof(float));

    kern_encoder_forward(o1, inp, wte, wpe, B, T, C);
    k.encoder_forward(k.ctx, o2, inp, wte, wpe, B, T, C);
    T_CHECK(same(o1, o2, (size_t)N * C * 4), "encoder_forward");

    float *g1 = rnd((size_t)V * C), *g2 = fdup(g1, (size_t)V * C), *p1 = rnd((size_t)T * C),
          *p2 = fdup(p1, (size_t)T * C);
    kern_encoder_backward(g1, p1, x, inp, B, T, C);
    k.encoder_backward(k.ctx, g2, p2, x, inp, B, T, C);
    T_CHECK(same(g1, g2, (size_t)V * C * 4) && same(p1, p2, (size_t)T * C * 4), "encoder_backward");

    float m1[16], r1[16], m2[16], r2[16];
    kern_layernorm_forward(o1, m1, r1, x, wte, wpe, N, C);
    k.layernorm_forward(k.ctx, o2, m2, r2, x, wte, wpe, N, C);
    T_CHECK(same(o1, o2, (size_t)N * C * 4) && same(m1, m2, sizeof m1) && same(r1, r2, sizeof r1),
            "layernorm_forward");
    memset(a1, 0, (size_t)N * C * 4);
    memset(a2, 0, (size_t)N * C * 4);
    float dw1[16] = {0}, db1[16] = {0}, dw2[16] = {0}, db2[16] = {0};
    kern_layernorm_backward(a1, dw1, db1, dat, x, wte, m1, r1, N, C);
    k.layernorm_backward(k.ctx, a2, dw2, db2, dat, x, wte, m1, r1, N, C);
    T_CHECK(same(a1, a2, (size_t)N * C * 4) && same(dw1, dw2, sizeof dw1) && same(db1, db2, sizeof db1),
            "layernorm_backward");

    kern_matmul_forward(o1, x, w, bias, N, C, OC);
    k.matmul_forward(k.ctx, o2, x, w, bias, N, C, OC);
    T_CHECK(same(o1, o2, (size_t)N * OC * 4), "matmul_forward");
    float *dw_a = rnd((size_t)OC * C), *dw_b = fdup(dw_a, (size_t)OC * C);
    float *db_a = rnd(OC), *db_b = fdup(db_a, OC);
    memset(a1, 0, (size_t)N * C * 4);
    memset(a2, 0, (size_t)N * C * 4);
    kern_matmul_backward(a1, dw_a, db_a, dout, x, w, N, C, OC);
    k.matmul_backward(k.ctx, a2, dw_b, db_b, dout, x, w, N, C, OC);
    T_CHECK(same(a1, a2, (size_t)N * C * 4) && same(dw_a, dw_b, (size_t)OC * C * 4) &&
                same(db_a, db_b, OC * 4), "matmul_backward");

    float *att1 = calloc((size_t)B * NH * T * T, 4), *att2 = calloc((size_t)B * NH * T * T, 4);
    float *sc = calloc((size_t)2 * T * T, 4);
    kern_attention_forward(a1, att1, sc, qkv, B, T, C, NH);
    k.attention_forward(k.ctx, a2, att2, sc, qkv, B, T, C, NH);
    T_CHECK(same(a1, a2, (size_t)N * C * 4) && same(att1, att2, (size_t)B * NH * T * T * 4),
            "attention_forward");
    float *dq1 = calloc((size_t)N * 3 * C, 4), *dq2 = calloc((size_t)N * 3 * C, 4);
    kern_attention_backward(dq1, sc, dat, qkv, att1, B, T, C, NH);
    k.attention_backward(k.ctx, dq2, sc, dat, qkv, att1, B, T, C, NH);
    T_CHECK(same(dq1, dq2, (size_t)N * 3 * C * 4), "attention_backward");

    const size_t n = (size_t)N * C;
    kern_gelu_forward(a1, x, n);
    k.gelu_forward(k.ctx, a2, x, n);
    T_CHECK(same(a1, a2, n * 4), "gelu_forward");
    kern_gelu_backward(a1, x, dat, n);
    k.gelu_backward(k.ctx, a2, x, dat, n);
    T_CHECK(same(a1, a2, n * 4), "gelu_backward");
    kern_residual_forward(a1, x, dat, n);
    k.residual_forward(k.ctx, a2, x, dat, n);
    T_CHECK(same(a1, a2, n * 4), "residual_forward");
    memcpy(a1 + n, a1, n * 4);
    memcpy(a2 + n, a2, n * 4);
    kern_residual_backward(a1, a1 + n, dat, n);
    k.residual_backward(k.ctx, a2, a2 + n, dat, n);
    T_CHECK(same(a1, a2, 2 * n * 4), "residual_backward");

    float *logits = rnd((size_t)N * V), *pr1 = calloc((size_t)N * V, 4), *pr2 = calloc((size_t)N * V, 4);
    float l1[16], l2[16];
    kern_softmax_crossentropy_forward(pr1, l1, logits, tg, N, V);
    k.softmax_crossentropy_forward(k.ctx, pr2, l2, logits, tg, N, V);
    T_CHECK(same(pr1, pr2, (size_t)N * V * 4) && same(l1, l2, sizeof l1), "softmax_ce_forward");
    float *dl1 = rnd((size_t)N * V), *dl2 = fdup(dl1, (size_t)N * V);
    kern_softmax_crossentropy_backward(dl1, pr1, tg, 0.03125f, N, V);
    k.softmax_crossentropy_backward(k.ctx, dl2, pr1, tg, 0.03125f, N, V);
    T_CHECK(same(dl1, dl2, (size_t)N * V * 4), "softmax_ce_backward");
    T_CHECK(k.status(k.ctx) == 0, "status 0");
    kern_cpu_ops_free(&k);
    free(wte), free(wpe), free(x), free(w), free(bias), free(dout), free(qkv), free(dat);
    free(o1), free(o2), free(a1), free(a2), free(g1), free(g2), free(p1), free(p2);
    free(dw_a), free(dw_b), free(db_a), free(db_b), free(att1), free(att2), free(sc);
    free(dq1), free(dq2), free(logits), free(pr1), free(pr2), free(dl1), free(dl2);
}

/* ---- the optimizer code as it was before the table (train/optim.c at 8a80d3e) */
static void old_adamw_shard(const train_adamw_config *c, const train_tensor *tensors,
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

static void old_block_sumsq_shard(const float *x, size_t n, double *out)
{
    for (size_t b = 0; b < n; b += TRAIN_BLOCK) {
        double s = 0.0;
        for (size_t i = b; i < b + TRAIN_BLOCK; i++) s += (double)x[i] * (double)x[i];
        out[b / TRAIN_BLOCK] = s;
    }
}

/* comm_cpu.c's tree_sum over slots, in place */
static void old_rank_tree(float *s, size_t n, int lo, int cnt)
{
    if (cnt <= 1) return;
    int h = 1;
    while (h * 2 < cnt) h *= 2;
    old_rank_tree(s, n, lo, h);
    old_rank_tree(s, n, lo + h, cnt - h);
    float *a = s + (size_t)lo * n;
    const float *b = s + (size_t)(lo + h) * n;
    for (size_t i = 0; i < n; i++) a[i] = a[i] + b[i];
}

static void test_adamw_segments(void)
{
    /* many tensors of odd sizes, alternating decay, in a padded flat space */
    enum { NT = 37 };
    train_tensor tens[NT];
    size_t off = 0;
    for (int i = 0; i < NT; i++) {
        memset(&tens[i], 0, sizeof tens[i]);
        snprintf(tens[i].name, sizeof tens[i].name, "t%d", i);
        tens[i].ndim = 1;
        tens[i].numel = (size_t)(1 + (i * 7919) % 613);
        tens[i].shape[0] = (int64_t)tens[i].numel;
        tens[i].decay = i % 3 != 0;
        off = (off + 15) / 16 * 16;
        tens[i].offset = off;
        off += tens[i].numel;
    }
    const size_t np = (off + TRAIN_BLOCK - 1) / TRAIN_BLOCK * TRAIN_BLOCK;
    train_adamw_config c = TRAIN_ADAMW_CONFIG_INIT;
    c.weight_decay = 0.05f;
    float *p0 = rnd(np), *m0 = rnd(np), *v0 = rnd(np), *g = rnd(np);
    for (size_t i = 0; i < np; i++) v0[i] = fabsf(v0[i]);
    kern_ops k;
    T_REQUIRE(kern_cpu_ops_init(&k, 0) == 0, "init");
    /* shards of the flat space: whole, and cut at several places (ZeRO ranges) */
    size_t cuts[][2] = {{0, np}, {0, 2048}, {2048, np}, {123, 4567}, {tens[5].offset + 3, np - 1}};
    int ok = 1, ok_shard = 1;
    for (size_t ci = 0; ci < sizeof cuts / sizeof cuts[0]; ci++) {
        size_t lo = cuts[ci][0], hi = cuts[ci][1] < np ? cuts[ci][1] : np;
        for (int64_t t = 1; t <= 3; t++) {
            float lr = 1e-3f * (float)t;
            float *pa = fdup(p0, np), *ma = fdup(m0, np), *va = fdup(v0, np);
            float *pb = fdup(p0, np), *mb = fdup(m0, np), *vb = fdup(v0, np);
            float *pc = fdup(p0, np), *mc = fdup(m0, np), *vc = fdup(v0, np);
            old_adamw_shard(&c, tens, NT, pa + lo, ma + lo, va + lo, g + lo, lo, hi, t, lr);
            train_adamw_update_ops(&k, &c, tens, NT, pb + lo, mb + lo, vb + lo, g + lo, lo, hi, t, lr);
            train_adamw_update_shard(&c, tens, NT, pc + lo, mc + lo, vc + lo, g + lo, lo, hi, t, lr);
            ok &= same(pa, pb, np * 4) && same(ma, mb, np * 4) && same(va, vb, np * 4);
            ok_shard &= same(pa, pc, np * 4) && same(ma, mc, np * 4) && same(va, vc, np * 4);
            free(pa), free(ma), free(va), free(pb), free(mb), free(vb), free(pc), free(mc), free(vc);
        }
    }
    T_CHECK(ok, "ops->adamw over %d segments: the old optimizer's bits", NT);
    T_CHECK(ok_shard, "train_adamw_update_shard: the old optimizer's bits");

    /* block sums of squares and scale */
    double *b1 = calloc(np / TRAIN_BLOCK, 8), *b2 = calloc(np / TRAIN_BLOCK, 8);
    old_block_sumsq_shard(g, np, b1);
    k.block_sumsq(k.ctx, g, np, b2);
    T_CHECK(same(b1, b2, np / TRAIN_BLOCK * 8), "block_sumsq: the old bits");
    memset(b2, 0, np / TRAIN_BLOCK * 8);
    train_block_sumsq_shard(g, np, b2);
    T_CHECK(same(b1, b2, np / TRAIN_BLOCK * 8), "train_block_sumsq_shard: the old bits");
    float *s1 = fdup(g, np), *s2 = fdup(g, np);
    for (size_t i = 0; i < np; i++) s1[i] *= 0.37f;
    k.scale(k.ctx, s2, np, 0.37f);
    T_CHECK(same(s1, s2, np * 4), "scale");
    kern_cpu_ops_free(&k);
    free(b1), free(b2), free(s1), free(s2), free(p0), free(m0), free(v0), free(g);
}

static void test_tree_and_rank_sum(void)
{
    kern_ops k;
    T_REQUIRE(kern_cpu_ops_init(&k, 0) == 0, "init");
    train_device *dev = NULL;
    char why[256] = "";
    T_REQUIRE(train_device_open(&dev, TRAIN_DEVICE_CPU, 0, why, sizeof why) == 0, "cpu device: %s", why);
    const size_t n = 3001;
    for (int M = 1; M <= 9; M++) {
        float *items[9];
        for (int j = 0; j < M; j++) items[j] = rnd(n);
        /* the reference: the binary counter of the old optim.c, with plain loops */
        float *slot[6];
        int size[6], depth = 0;
        for (int i = 0; i < 6; i++) slot[i] = malloc(n * 4);
        for (int j = 0; j < M; j++) {
            memcpy(slot[depth], items[j], n * 4);
            size[depth++] = 1;
            while (depth >= 2 && size[depth - 1] == size[depth - 2]) {
                for (size_t i = 0; i < n; i++) slot[depth - 2][i] = slot[depth - 2][i] + slot[depth - 1][i];
                size[depth - 2] *= 2;
                depth--;
            }
        }
        for (int i = depth - 1; i >= 1; i--)
            for (size_t e = 0; e < n; e++) slot[i - 1][e] = slot[i - 1][e] + slot[i][e];
        train_tree *th, *td;
        T_REQUIRE(train_tree_create(&th, n, M) == 0, "host tree");
        T_REQUIRE(train_tree_create_on(&td, n, M, dev, &k) == 0, "device tree");
        void *dx, *dout;
        T_REQUIRE(train_device_alloc(dev, &dx, n * 4) == 0 && train_device_alloc(dev, &dout, n * 4) == 0,
                  "device buffers");
        for (int j = 0; j < M; j++) {
            T_CHECK(train_tree_push(th, items[j]) == 0, "push");
            T_REQUIRE(train_device_copy(dev, dx, items[j], n * 4, TRAIN_COPY_H2D) == 0, "h2d");
            T_CHECK(train_tree_push(td, dx) == 0, "push on device");
        }
        T_CHECK(train_tree_push(td, dx) == -ENOSPC, "full");
        float *rh = malloc(n * 4), *rd = malloc(n * 4);
        train_tree_result(th, rh);
        train_tree_result(td, dout);
        T_REQUIRE(train_device_copy(dev, rd, dout, n * 4, TRAIN_COPY_D2H) == 0, "d2h");
        T_CHECK(same(rh, slot[0], n * 4), "tree M=%d: the old bits", M);
        T_CHECK(same(rd, slot[0], n * 4), "device tree M=%d: the old bits", M);
        train_tree_result(td, dout); /* nothing pushed: zero */
        T_REQUIRE(train_device_copy(dev, rd, dout, n * 4, TRAIN_COPY_D2H) == 0, "d2h");
        int zero = 1;
        for (size_t i = 0; i < n; i++) zero &= rd[i] == 0.0f;
        T_CHECK(zero, "empty result is zero");
        train_tree_free(th);
        train_tree_free(td);
        train_device_free(dev, dx);
        train_device_free(dev, dout);
        for (int i = 0; i < 6; i++) free(slot[i]);
        for (int j = 0; j < M; j++) free(items[j]);
        free(rh), free(rd);
    }
    /* rank tree sum: comm.h's tree, also in place and with a stride larger than n */
    for (int W = 1; W <= 9; W++) {
        const size_t cnt = 777, stride = 800;
        float *in = rnd(stride * (size_t)W), *ref = malloc(cnt * (size_t)W * 4), *out = malloc(cnt * 4);
        for (int r = 0; r < W; r++) memcpy(ref + (size_t)r * cnt, in + (size_t)r * stride, cnt * 4);
        old_rank_tree(ref, cnt, 0, W);
        k.rank_tree_sum(k.ctx, out, in, cnt, stride, W);
        T_CHECK(same(out, ref, cnt * 4), "rank_tree_sum W=%d", W);
        k.rank_tree_sum(k.ctx, in, in, cnt, stride, W);
        T_CHECK(same(in, ref, cnt * 4), "rank_tree_sum in place W=%d", W);
        free(in), free(ref), free(out);
    }
    /* shuffle4 */
    uint8_t src[64], dst[64];
    for (int i = 0; i < 64; i++) src[i] = (uint8_t)i;
    k.shuffle4(k.ctx, dst, src, 64);
    int ok = 1;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 4; j++) ok &= dst[j * 16 + i] == src[4 * i + j];
    T_CHECK(ok, "shuffle4");
    kern_cpu_ops_free(&k);
    train_device_close(dev);
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float fl(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_round_bf16(void)
{
    struct {
        uint32_t in, want;
        const char *what;
    } c[] = {
        {0x3f800000u, 0x3f800000u, "1.0 exact"},
        {0x3f808000u, 0x3f800000u, "tie, even below: down"},
        {0x3f818000u, 0x3f820000u, "tie, odd below: up"},
        {0x3f808001u, 0x3f810000u, "above the tie: up"},
        {0x3f807fffu, 0x3f800000u, "below the tie: down"},
        {0xbf818000u, 0xbf820000u, "negative tie: away to even"},
        {0x7f800000u, 0x7f800000u, "+inf"},
        {0xff800000u, 0xff800000u, "-inf"},
        {0x7f7fffffu, 0x7f800000u, "max float rounds to inf"},
        {0x7f7f7fffu, 0x7f7f0000u, "max bf16 stays"},
        {0x00000000u, 0x00000000u, "+0"},
        {0x80000000u, 0x80000000u, "-0"},
        {0x00000001u, 0x00000000u, "smallest subnormal: to 0"},
        {0x80000001u, 0x80000000u, "negative tiny subnormal: to -0"},
        {0x00008000u, 0x00000000u, "subnormal tie, even: down"},
        {0x00018000u, 0x00020000u, "subnormal tie, odd: up"},
        {0x007fffffu, 0x00800000u, "largest subnormal: to the smallest normal"},
        {0x00010001u, 0x00010000u, "subnormal: down"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        uint32_t got = bits(kern_round_bf16(fl(c[i].in)));
        T_CHECK(got == c[i].want, "%s: %08x -> %08x, want %08x", c[i].what, c[i].in, got, c[i].want);
    }
    uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        float r = kern_round_bf16(fl(nans[i]));
        T_CHECK(isnan(r) && (bits(r) & 0xffffu) == 0 && (bits(r) >> 31) == (nans[i] >> 31),
                "NaN %08x stays a NaN (%08x)", nans[i], bits(r));
    }
    /* every result is a bf16 value and rounding is idempotent */
    int ok = 1;
    for (int i = 0; i < 100000; i++) {
        float x = frand() * 1e3f, r = kern_round_bf16(x);
        ok &= (bits(r) & 0xffffu) == 0 && kern_round_bf16(r) == r &&
              fabsf(r - x) <= fabsf(x) * (1.0f / 256.0f);
    }
    T_CHECK(ok, "random values: bf16, idempotent, within half an ulp of bf16");
}

/* bf16 bit pattern of an fp32 value already rounded to bf16, and back. */
static uint16_t h16(float r) { return (uint16_t)(bits(r) >> 16); }
static float f16(uint16_t h) { return fl((uint32_t)h << 16); }

/* each of n bf16 outputs is exactly the rounded fp32 reference */
static int rounded_eq(const uint16_t *got, const float *ref, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != h16(kern_round_bf16(ref[i]))) return 0;
    return 1;
}

static void test_bf16_table(void)
{
    kern_ops k;
    T_REQUIRE(kern_cpu_ops_init(&k, 1) == 0, "init bf16");
    T_CHECK(k.bf16 == 1 && k.ctx != NULL, "bf16 table");
    T_CHECK(k.round_bf16 && k.layernorm_forward_bf16 && k.attention_forward_bf16 &&
                k.gelu_forward_bf16 && k.matmul_forward_bf16 && k.matmul_backward_bf16,
            "bf16 entries filled in");
    const kern_ops *f = kern_cpu_ops_fp32();
    T_CHECK(!f->round_bf16 && !f->layernorm_forward_bf16 && !f->attention_forward_bf16 &&
                !f->gelu_forward_bf16 && !f->matmul_forward_bf16 && !f->matmul_backward_bf16,
            "fp32 table: bf16 entries NULL");
    const int N = 24, C = 40, OC = 56;
    float *x = rnd((size_t)N * C), *w = rnd((size_t)OC * C), *bias = rnd(OC), *dout = rnd((size_t)N * OC);
    float *xr = malloc((size_t)N * C * 4), *wr = malloc((size_t)OC * C * 4), *dr = malloc((size_t)N * OC * 4);
    for (int i = 0; i < N * C; i++) xr[i] = kern_round_bf16(x[i]);
    for (int i = 0; i < OC * C; i++) wr[i] = kern_round_bf16(w[i]);
    for (int i = 0; i < N * OC; i++) dr[i] = kern_round_bf16(dout[i]);

    /* round_bf16: kern_round_bf16's bits, widening is exact */
    uint16_t *x16 = malloc((size_t)N * C * 2), *w16 = malloc((size_t)OC * C * 2);
    k.round_bf16(k.ctx, x16, x, (size_t)N * C);
    k.round_bf16(k.ctx, w16, w, (size_t)OC * C);
    int ok = 1;
    for (int i = 0; i < N * C; i++) ok &= f16(x16[i]) == xr[i];
    for (int i = 0; i < OC * C; i++) ok &= f16(w16[i]) == wr[i];
    T_CHECK(ok, "round_bf16 = kern_round_bf16, bit for bit");

    float *o1 = calloc((size_t)N * OC, 4), *o2 = calloc((size_t)N * OC, 4), *o3 = calloc((size_t)N * OC, 4);
    kern_matmul_forward(o1, xr, wr, bias, N, C, OC);
    k.matmul_forward_bf16(k.ctx, o2, x16, w16, bias, N, C, OC);
    kern_matmul_forward(o3, x, w, bias, N, C, OC);
    T_CHECK(same(o1, o2, (size_t)N * OC * 4), "bf16 forward = fp32 kernel on rounded inp, weight");
    T_CHECK(!same(o2, o3, (size_t)N * OC * 4), "bf16 forward differs from fp32");
    double maxrel = 0;
    for (int i = 0; i < N * OC; i++) {
        double r = fabs(o2[i] - o3[i]) / (fabs(o3[i]) + 1.0);
        if (r > maxrel) maxrel = r;
    }
    T_CHECK(maxrel < 2e-2, "bf16 forward close to fp32 (%g)", maxrel);
    k.matmul_forward_bf16(k.ctx, o2, x16, w16, NULL, N, C, OC);
    kern_matmul_forward(o1, xr, wr, NULL, N, C, OC);
    T_CHECK(same(o1, o2, (size_t)N * OC * 4), "bf16 forward without bias");

    float *di1 = rnd((size_t)N * C), *di2 = fdup(di1, (size_t)N * C);
    float *dw1 = rnd((size_t)OC * C), *dw2 = fdup(dw1, (size_t)OC * C);
    float *db1 = rnd(OC), *db2 = fdup(db1, OC);
    kern_matmul_backward(di1, dw1, db1, dr, xr, wr, N, C, OC);
    k.matmul_backward_bf16(k.ctx, di2, dw2, db2, dout, x16, w16, N, C, OC);
    T_CHECK(same(di1, di2, (size_t)N * C * 4) && same(dw1, dw2, (size_t)OC * C * 4) &&
                same(db1, db2, OC * 4), "bf16 backward = fp32 kernel on rounded dout, inp, weight");
    kern_matmul_backward(NULL, dw1, NULL, dr, xr, wr, N, C, OC);
    k.matmul_backward_bf16(k.ctx, NULL, dw2, NULL, dout, x16, w16, N, C, OC);
    T_CHECK(same(dw1, dw2, (size_t)OC * C * 4), "bf16 backward, dweight only (dinp, dbias NULL)");

    /* the ops that feed a GEMM: the fp32 kernel's output, rounded */
    const size_t n = (size_t)N * C;
    float *ref = calloc(n, 4), *m1 = calloc(N, 4), *r1 = calloc(N, 4), *m2 = calloc(N, 4), *r2 = calloc(N, 4);
    float *lw = rnd(C), *lb = rnd(C);
    uint16_t *o16 = malloc(n * 2);
    kern_layernorm_forward(ref, m1, r1, x, lw, lb, N, C);
    k.layernorm_forward_bf16(k.ctx, o16, m2, r2, x, lw, lb, N, C);
    T_CHECK(rounded_eq(o16, ref, n) && same(m1, m2, N * 4) && same(r1, r2, N * 4),
            "layernorm_forward_bf16 = rounded fp32 output, fp32 mean and rstd");
    kern_gelu_forward(ref, x, n);
    k.gelu_forward_bf16(k.ctx, o16, x, n);
    T_CHECK(rounded_eq(o16, ref, n), "gelu_forward_bf16 = rounded fp32 output");
    { /* attention: B 2, T 6, C 40 (NH 4) from qkv (B, T, 3C) */
        const int B = 2, T = 6, NH = 4;
        float *qkv = rnd((size_t)B * T * 3 * C), *att1 = calloc((size_t)B * NH * T * T, 4);
        float *att2 = calloc((size_t)B * NH * T * T, 4), *sc = calloc((size_t)2 * T * T, 4);
        float *ay = calloc((size_t)B * T * C, 4);
        uint16_t *ay16 = malloc((size_t)B * T * C * 2);
        kern_attention_forward(ay, att1, sc, qkv, B, T, C, NH);
        k.attention_forward_bf16(k.ctx, ay16, att2, sc, qkv, B, T, C, NH);
        T_CHECK(rounded_eq(ay16, ay, (size_t)B * T * C) && same(att1, att2, (size_t)B * NH * T * T * 4),
                "attention_forward_bf16 = rounded fp32 output, fp32 att");
        free(qkv), free(att1), free(att2), free(sc), free(ay), free(ay16);
    }
    /* the fp32 entries of a bf16 table are the fp32 ones */
    float *g1 = calloc(n, 4), *g2 = calloc(n, 4);
    kern_gelu_forward(g1, x, n);
    k.gelu_forward(k.ctx, g2, x, n);
    k.matmul_forward(k.ctx, o2, x, w, bias, N, C, OC);
    T_CHECK(same(g1, g2, n * 4) && same(o2, o3, (size_t)N * OC * 4),
            "bf16 table: gelu_forward and matmul_forward are fp32");
    T_CHECK(k.status(k.ctx) == 0, "status 0");
    kern_cpu_ops_free(&k);
    T_CHECK(k.ctx == NULL, "freed");
    kern_cpu_ops_free(&k); /* twice is harmless */
    T_CHECK(kern_cpu_ops_init(NULL, 0) == -EINVAL, "NULL out");
    T_CHECK(kern_cpu_ops_fp32()->ctx == NULL && kern_cpu_ops_fp32()->bf16 == 0, "static fp32 table");
    free(x), free(w), free(bias), free(dout), free(xr), free(wr), free(dr), free(o1), free(o2), free(o3);
    free(di1), free(di2), free(dw1), free(dw2), free(db1), free(db2), free(g1), free(g2);
    free(x16), free(w16), free(ref), free(m1), free(r1), free(m2), free(r2), free(lw), free(lb), free(o16);
}

int main(void)
{
    test_model_ops_fp32();
    test_adamw_segments();
    test_tree_and_rank_sum();
    test_round_bf16();
    test_bf16_table();
    return t_done("test_kern_ops");
}
