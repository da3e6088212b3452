/* test_kern_grad.c - the CPU kernels against a double-precision reference.
 *
 * For every op: a plain-loop double reference forward; the fp32 forward is compared with it.
 * For every backward kernel: a scalar loss L = sum(out .* R) with a fixed random R (for the
 * fused softmax/cross-entropy, L = dloss * sum(losses)), dL/dx by central differences on the
 * double reference, and the fp32 backward (fed dout = R) compared with that. Then the
 * properties the callers rely on: backward accumulates (two calls give twice the gradient),
 * att is 0 above the diagonal, scratch contents do not matter, and two calls are
 * bit-identical. Exit 0 pass, 1 fail.
 */
#include "kernels.h"
#include "t_helpers.h"

#include <stdint.h>

#define FD_H 1e-5
/* Forward: fp32 vs double on O(1) data. */
#define FWD_ATOL 1e-5
#define FWD_RTOL 1e-4
/* Backward: fp32 kernel vs double central differences (truncation ~h^2, rounding ~1e-11). */
#define GRAD_ATOL 1e-4
#define GRAD_RTOL 1e-3
/* Two identical calls give twice the first up to fp32 rounding: a kernel that sums rows
 * straight into the gradient (as llm.c) or a BLAS that splits K into blocks rounds the second
 * call's partial sums onto the first's. An overwriting kernel misses by |g|. */
#define ACC_ATOL 1e-5
#define ACC_RTOL 1e-5

/* ---------------------------------------------------------------- helpers */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi), 24 random bits so the value is exact in float. */
static float urand(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * ((float)(splitmix64(s) >> 40) * 0x1.0p-24f);
}

static void fill(float *x, size_t n, uint64_t *s, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) x[i] = urand(s, lo, hi);
}

static void fill_const(float *x, size_t n, float v)
{
    for (size_t i = 0; i < n; i++) x[i] = v;
}

static double *to_d(const float *x, size_t n)
{
    double *d = malloc(n * sizeof *d);
    if (!d) exit(1);
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

static float *falloc(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof *p);
    if (!p) exit(1);
    return p;
}

static double *dalloc(size_t n)
{
    double *p = calloc(n ? n : 1, sizeof *p);
    if (!p) exit(1);
    return p;
}

static int verbose;

/* One T_CHECK per tensor: every element within atol + rtol*|ref|. */
static void check_arr(const char *what, const float *got, const double *ref, size_t n,
                      double atol, double rtol)
{
    size_t bad = 0;
    double maxerr = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - ref[i]);
        if (!(e <= maxerr)) maxerr = e;
        if (!t_close(got[i], ref[i], atol, rtol)) {
            if (++bad <= 3)
                fprintf(stderr, "  %s[%zu]: got %.9g, ref %.9g\n", what, i, got[i], ref[i]);
        }
    }
    if (verbose) printf("  %-28s n=%-6zu max|err| %.3g\n", what, n, maxerr);
    T_CHECK(bad == 0, "%s: %zu of %zu outside tolerance, max |err| %.3g", what, bad, n, maxerr);
}

static void check_same(const char *what, const float *a, const float *b, size_t n)
{
    T_CHECK(memcmp(a, b, n * sizeof *a) == 0, "%s: two calls differ", what);
}

/* got2 (after two accumulating calls) == 2 * got1 (after one). */
static void check_twice(const char *what, const float *got2, const float *got1, size_t n)
{
    size_t bad = 0;
    double maxerr = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got2[i] - 2.0 * got1[i]);
        if (!(e <= maxerr)) maxerr = e;
        if (!t_close(got2[i], 2.0 * got1[i], ACC_ATOL, ACC_RTOL)) bad++;
    }
    if (verbose) printf("  %-28s n=%-6zu twice: max|err| %.3g\n", what, n, maxerr);
    T_CHECK(bad == 0, "%s: %zu of %zu not doubled by a second call (no accumulation?)", what,
            bad, n);
}

typedef double (*loss_fn)(void *ctx);

/* Central-difference gradient of loss wrt x[i] for i = 0, stride, 2*stride, ... compared
 * with the kernel's gradient g. */
static void check_grad(const char *what, loss_fn loss, void *ctx, double *x, const float *g,
                       size_t n, size_t stride)
{
    size_t m = (n + stride - 1) / stride;
    double *ref = dalloc(m);
    float *got = falloc(m);
    for (size_t j = 0; j < m; j++) {
        size_t i = j * stride;
        double x0 = x[i];
        x[i] = x0 + FD_H;
        double lp = loss(ctx);
        x[i] = x0 - FD_H;
        double lm = loss(ctx);
        x[i] = x0;
        ref[j] = (lp - lm) / (2 * FD_H);
        got[j] = g[i];
    }
    check_arr(what, got, ref, m, GRAD_ATOL, GRAD_RTOL);
    free(ref);
    free(got);
}

static double dot_d(const double *a, const double *r, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * r[i];
    return s;
}

/* ---------------------------------------------------------------- encoder */

struct enc_ctx {
    int B, T, C;
    const int32_t *inp;
    double *wte, *wpe, *R, *out;
};

static void ref_encoder(double *out, const int32_t *inp, const double *wte, const double *wpe,
                        int B, int T, int C)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < C; i++)
                out[((size_t)b * T + t) * C + i] =
                    wte[(size_t)inp[b * T + t] * C + i] + wpe[(size_t)t * C + i];
}

static double enc_loss(void *p)
{
    struct enc_ctx *c = p;
    ref_encoder(c->out, c->inp, c->wte, c->wpe, c->B, c->T, c->C);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->C);
}

static void test_encoder(uint64_t *rng)
{
    const int B = 2, T = 5, C = 8, V = 11, maxT = 7;
    const size_t nout = (size_t)B * T * C, nwte = (size_t)V * C, nwpe = (size_t)maxT * C;
    int32_t inp[2 * 5];
    for (int i = 0; i < B * T; i++) inp[i] = (int32_t)(splitmix64(rng) % V);
    inp[3] = inp[7]; /* a repeated token, so scatter-add is exercised */
    float *wte = falloc(nwte), *wpe = falloc(nwpe), *R = falloc(nout);
    fill(wte, nwte, rng, -1, 1);
    fill(wpe, nwpe, rng, -1, 1);
    fill(R, nout, rng, -1, 1);

    float *out = falloc(nout), *out2 = falloc(nout);
    fill_const(out, nout, NAN);
    kern_encoder_forward(out, inp, wte, wpe, B, T, C);
    kern_encoder_forward(out2, inp, wte, wpe, B, T, C);
    struct enc_ctx c = {B, T, C, inp, to_d(wte, nwte), to_d(wpe, nwpe), to_d(R, nout),
                        dalloc(nout)};
    ref_encoder(c.out, inp, c.wte, c.wpe, B, T, C);
    check_arr("encoder fwd out", out, c.out, nout, FWD_ATOL, FWD_RTOL);
    check_same("encoder fwd out", out, out2, nout);

    float *dwte = falloc(nwte), *dwpe = falloc(nwpe);
    float *dwte2 = falloc(nwte), *dwpe2 = falloc(nwpe);
    kern_encoder_backward(dwte, dwpe, R, inp, B, T, C);
    check_grad("encoder dwte", enc_loss, &c, c.wte, dwte, nwte, 1);
    check_grad("encoder dwpe", enc_loss, &c, c.wpe, dwpe, nwpe, 1);
    kern_encoder_backward(dwte2, dwpe2, R, inp, B, T, C);
    check_same("encoder dwte", dwte, dwte2, nwte);
    check_same("encoder dwpe", dwpe, dwpe2, nwpe);
    kern_encoder_backward(dwte2, dwpe2, R, inp, B, T, C);
    check_twice("encoder dwte", dwte2, dwte, nwte);
    check_twice("encoder dwpe", dwpe2, dwpe, nwpe);

    free(wte), free(wpe), free(R), free(out), free(out2);
    free(dwte), free(dwpe), free(dwte2), free(dwpe2);
    free(c.wte), free(c.wpe), free(c.R), free(c.out);
}

/* ---------------------------------------------------------------- layernorm */

struct ln_ctx {
    int N, C;
    double *x, *w, *b, *R, *out;
};

static void ref_layernorm(double *out, double *mean, double *rstd, const double *x,
                          const double *w, const double *bi, int N, int C)
{
    for (int n = 0; n < N; n++) {
        const double *xr = x + (size_t)n * C;
        double m = 0, v = 0;
        for (int i = 0; i < C; i++) m += xr[i];
        m /= C;
        for (int i = 0; i < C; i++) v += (xr[i] - m) * (xr[i] - m);
        v /= C;
        double s = 1.0 / sqrt(v + 1e-5);
        for (int i = 0; i < C; i++) out[(size_t)n * C + i] = (xr[i] - m) * s * w[i] + bi[i];
        if (mean) mean[n] = m;
        if (rstd) rstd[n] = s;
    }
}

static double ln_loss(void *p)
{
    struct ln_ctx *c = p;
    ref_layernorm(c->out, NULL, NULL, c->x, c->w, c->b, c->N, c->C);
    return dot_d(c->out, c->R, (size_t)c->N * c->C);
}

static void test_layernorm(uint64_t *rng)
{
    const int N = 10, C = 8;
    const size_t nx = (size_t)N * C;
    float *x = falloc(nx), *w = falloc(C), *bi = falloc(C), *R = falloc(nx);
    fill(x, nx, rng, -2, 2);
    fill(w, C, rng, 0.5f, 1.5f);
    fill(bi, C, rng, -0.5f, 0.5f);
    fill(R, nx, rng, -1, 1);

    float *out = falloc(nx), *mean = falloc(N), *rstd = falloc(N);
    float *out2 = falloc(nx), *mean2 = falloc(N), *rstd2 = falloc(N);
    fill_const(out, nx, NAN);
    kern_layernorm_forward(out, mean, rstd, x, w, bi, N, C);
    kern_layernorm_forward(out2, mean2, rstd2, x, w, bi, N, C);
    struct ln_ctx c = {N, C, to_d(x, nx), to_d(w, C), to_d(bi, C), to_d(R, nx), dalloc(nx)};
    double *rmean = dalloc(N), *rrstd = dalloc(N);
    ref_layernorm(c.out, rmean, rrstd, c.x, c.w, c.b, N, C);
    check_arr("layernorm fwd out", out, c.out, nx, FWD_ATOL, FWD_RTOL);
    check_arr("layernorm fwd mean", mean, rmean, N, FWD_ATOL, FWD_RTOL);
    check_arr("layernorm fwd rstd", rstd, rrstd, N, FWD_ATOL, FWD_RTOL);
    check_same("layernorm fwd out", out, out2, nx);
    check_same("layernorm fwd rstd", rstd, rstd2, N);

    float *dx = falloc(nx), *dw = falloc(C), *db = falloc(C);
    float *dx2 = falloc(nx), *dw2 = falloc(C), *db2 = falloc(C);
    kern_layernorm_backward(dx, dw, db, R, x, w, mean, rstd, N, C);
    check_grad("layernorm dinp", ln_loss, &c, c.x, dx, nx, 1);
    check_grad("layernorm dweight", ln_loss, &c, c.w, dw, C, 1);
    check_grad("layernorm dbias", ln_loss, &c, c.b, db, C, 1);
    kern_layernorm_backward(dx2, dw2, db2, R, x, w, mean, rstd, N, C);
    check_same("layernorm dinp", dx, dx2, nx);
    check_same("layernorm dweight", dw, dw2, C);
    kern_layernorm_backward(dx2, dw2, db2, R, x, w, mean, rstd, N, C);
    check_twice("layernorm dinp", dx2, dx, nx);
    check_twice("layernorm dweight", dw2, dw, C);
    check_twice("layernorm dbias", db2, db, C);

    free(x), free(w), free(bi), free(R), free(out), free(mean), free(rstd);
    free(out2), free(mean2), free(rstd2), free(dx), free(dw), free(db), free(dx2), free(dw2);
    free(db2), free(rmean), free(rrstd);
    free(c.x), free(c.w), free(c.b), free(c.R), free(c.out);
}

/* ---------------------------------------------------------------- matmul */

struct mm_ctx {
    int N, C, OC;
    double *x, *w, *b, *R, *out; /* b may be NULL */
};

static void ref_matmul(double *out, const double *x, const double *w, const double *b, int N,
                       int C, int OC)
{
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = b ? b[o] : 0.0;
            for (int i = 0; i < C; i++) s += x[(size_t)n * C + i] * w[(size_t)o * C + i];
            out[(size_t)n * OC + o] = s;
        }
}

static double mm_loss(void *p)
{
    struct mm_ctx *c = p;
    ref_matmul(c->out, c->x, c->w, c->b, c->N, c->C, c->OC);
    return dot_d(c->out, c->R, (size_t)c->N * c->OC);
}

/* Exact gradients of the linear map, in double: for shapes too big for central differences
 * everywhere. */
static void ref_matmul_backward(double *dx, double *dw, double *db, const double *R,
                                const double *x, const double *w, int N, int C, int OC)
{
    for (int n = 0; n < N; n++)
        for (int i = 0; i < C; i++) {
            double s = 0;
            for (int o = 0; o < OC; o++) s += R[(size_t)n * OC + o] * w[(size_t)o * C + i];
            dx[(size_t)n * C + i] = s;
        }
    for (int o = 0; o < OC; o++)
        for (int i = 0; i < C; i++) {
            double s = 0;
            for (int n = 0; n < N; n++) s += R[(size_t)n * OC + o] * x[(size_t)n * C + i];
            dw[(size_t)o * C + i] = s;
        }
    for (int o = 0; o < OC; o++) {
        double s = 0;
        for (int n = 0; n < N; n++) s += R[(size_t)n * OC + o];
        db[o] = s;
    }
}

static void test_matmul_shape(uint64_t *rng, int N, int C, int OC, int fd)
{
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    char name[64];
    float *x = falloc(nx), *w = falloc(nw), *bi = falloc(OC), *R = falloc(no);
    fill(x, nx, rng, -1, 1);
    fill(w, nw, rng, -1, 1);
    fill(bi, OC, rng, -1, 1);
    fill(R, no, rng, -1, 1);
    struct mm_ctx c = {N,           C,           OC,          to_d(x, nx),
                       to_d(w, nw), to_d(bi, OC), to_d(R, no), dalloc(no)};

    /* forward, with and without bias; out is overwritten, NaN in it must not survive */
    float *out = falloc(no), *out2 = falloc(no);
    fill_const(out, no, NAN);
    kern_matmul_forward(out, x, w, bi, N, C, OC);
    kern_matmul_forward(out2, x, w, bi, N, C, OC);
    ref_matmul(c.out, c.x, c.w, c.b, N, C, OC);
    snprintf(name, sizeof name, "matmul%dx%dx%d fwd", N, C, OC);
    check_arr(name, out, c.out, no, FWD_ATOL, FWD_RTOL);
    check_same(name, out, out2, no);
    fill_const(out, no, NAN);
    kern_matmul_forward(out, x, w, NULL, N, C, OC);
    ref_matmul(c.out, c.x, c.w, NULL, N, C, OC);
    snprintf(name, sizeof name, "matmul%dx%dx%d fwd nobias", N, C, OC);
    check_arr(name, out, c.out, no, FWD_ATOL, FWD_RTOL);

    float *dx = falloc(nx), *dw = falloc(nw), *db = falloc(OC);
    float *dx2 = falloc(nx), *dw2 = falloc(nw), *db2 = falloc(OC);
    kern_matmul_backward(dx, dw, db, R, x, w, N, C, OC);
    if (fd) {
        snprintf(name, sizeof name, "matmul%dx%dx%d dinp", N, C, OC);
        check_grad(name, mm_loss, &c, c.x, dx, nx, 1);
        snprintf(name, sizeof name, "matmul%dx%dx%d dweight", N, C, OC);
        check_grad(name, mm_loss, &c, c.w, dw, nw, 1);
        snprintf(name, sizeof name, "matmul%dx%dx%d dbias", N, C, OC);
        check_grad(name, mm_loss, &c, c.b, db, OC, 1);
    } else {
        double *rdx = dalloc(nx), *rdw = dalloc(nw), *rdb = dalloc(OC);
        ref_matmul_backward(rdx, rdw, rdb, c.R, c.x, c.w, N, C, OC);
        snprintf(name, sizeof name, "matmul%dx%dx%d dinp", N, C, OC);
        check_arr(name, dx, rdx, nx, GRAD_ATOL, GRAD_RTOL);
        snprintf(name, sizeof name, "matmul%dx%dx%d dweight", N, C, OC);
        check_arr(name, dw, rdw, nw, GRAD_ATOL, GRAD_RTOL);
        snprintf(name, sizeof name, "matmul%dx%dx%d dbias", N, C, OC);
        check_arr(name, db, rdb, OC, GRAD_ATOL, GRAD_RTOL);
        free(rdx), free(rdw), free(rdb);
    }
    snprintf(name, sizeof name, "matmul%dx%dx%d bwd", N, C, OC);
    kern_matmul_backward(dx2, dw2, db2, R, x, w, N, C, OC);
    check_same(name, dx, dx2, nx);
    check_same(name, dw, dw2, nw);
    check_same(name, db, db2, OC);
    kern_matmul_backward(dx2, dw2, db2, R, x, w, N, C, OC);
    check_twice(name, dx2, dx, nx);
    check_twice(name, dw2, dw, nw);
    check_twice(name, db2, db, OC);

    /* dinp NULL, then dbias NULL: the other gradients are unchanged, bit for bit */
    memset(dw2, 0, nw * sizeof *dw2);
    memset(db2, 0, OC * sizeof *db2);
    kern_matmul_backward(NULL, dw2, db2, R, x, w, N, C, OC);
    check_same("matmul dinp=NULL dweight", dw, dw2, nw);
    check_same("matmul dinp=NULL dbias", db, db2, OC);
    memset(dx2, 0, nx * sizeof *dx2);
    memset(dw2, 0, nw * sizeof *dw2);
    kern_matmul_backward(dx2, dw2, NULL, R, x, w, N, C, OC);
    check_same("matmul dbias=NULL dinp", dx, dx2, nx);
    check_same("matmul dbias=NULL dweight", dw, dw2, nw);

    free(x), free(w), free(bi), free(R), free(out), free(out2);
    free(dx), free(dw), free(db), free(dx2), free(dw2), free(db2);
    free(c.x), free(c.w), free(c.b), free(c.R), free(c.out);
}

/* ---------------------------------------------------------------- attention */

struct att_ctx {
    int B, T, C, NH;
    double *qkv, *R, *out;
};

static void ref_attention(double *out, double *att, const double *qkv, int B, int T, int C,
                          int NH)
{
    const int hs = C / NH;
    const double scale = 1.0 / sqrt((double)hs);
    double *row = dalloc((size_t)T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
                double maxv = -INFINITY, sum = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const double *k = qkv + ((size_t)b * T + t2) * 3 * C + C + (size_t)h * hs;
                    double s = 0;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    row[t2] = s * scale;
                    if (row[t2] > maxv) maxv = row[t2];
                }
                for (int t2 = 0; t2 <= t; t2++) {
                    row[t2] = exp(row[t2] - maxv);
                    sum += row[t2];
                }
                for (int t2 = 0; t2 <= t; t2++) row[t2] /= sum;
                if (att)
                    for (int t2 = 0; t2 < T; t2++)
                        att[(((size_t)b * NH + h) * T + t) * T + t2] = t2 <= t ? row[t2] : 0.0;
                double *o = out + ((size_t)b * T + t) * C + (size_t)h * hs;
                for (int i = 0; i < hs; i++) {
                    double s = 0;
                    for (int t2 = 0; t2 <= t; t2++)
                        s += row[t2] * qkv[((size_t)b * T + t2) * 3 * C + 2 * C +
                                           (size_t)h * hs + i];
                    o[i] = s;
                }
            }
    free(row);
}

static double att_loss(void *p)
{
    struct att_ctx *c = p;
    ref_attention(c->out, NULL, c->qkv, c->B, c->T, c->C, c->NH);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->C);
}

static void test_attention_shape(uint64_t *rng, int B, int T, int C, int NH, size_t stride)
{
    const size_t nqkv = (size_t)B * T * 3 * C, no = (size_t)B * T * C;
    const size_t natt = (size_t)B * NH * T * T, nscr = 2 * (size_t)T * T;
    char name[64];
    float *qkv = falloc(nqkv), *R = falloc(no);
    fill(qkv, nqkv, rng, -2, 2); /* wide enough that the softmax is far from uniform */
    fill(R, no, rng, -1, 1);
    struct att_ctx c = {B, T, C, NH, to_d(qkv, nqkv), to_d(R, no), dalloc(no)};

    /* forward; out, att and scratch start as garbage */
    float *out = falloc(no), *att = falloc(natt), *scr = falloc(nscr);
    float *out2 = falloc(no), *att2 = falloc(natt);
    fill_const(out, no, NAN);
    fill_const(att, natt, 7.0f);
    fill_const(scr, nscr, NAN);
    kern_attention_forward(out, att, scr, qkv, B, T, C, NH);
    fill(scr, nscr, rng, -100, 100);
    kern_attention_forward(out2, att2, scr, qkv, B, T, C, NH);
    double *ratt = dalloc(natt);
    ref_attention(c.out, ratt, c.qkv, B, T, C, NH);
    snprintf(name, sizeof name, "attn B%d T%d C%d NH%d fwd out", B, T, C, NH);
    check_arr(name, out, c.out, no, FWD_ATOL, FWD_RTOL);
    check_same(name, out, out2, no);
    snprintf(name, sizeof name, "attn B%d T%d C%d NH%d fwd att", B, T, C, NH);
    check_arr(name, att, ratt, natt, FWD_ATOL, FWD_RTOL);
    check_same(name, att, att2, natt);
    size_t above = 0;
    for (size_t bh = 0; bh < (size_t)B * NH; bh++)
        for (int t = 0; t < T; t++)
            for (int t2 = t + 1; t2 < T; t2++)
                if (att[(bh * T + t) * T + t2] != 0.0f) above++;
    T_CHECK(above == 0, "%s: %zu entries above the diagonal are not 0", name, above);

    /* backward */
    float *dqkv = falloc(nqkv), *dqkv2 = falloc(nqkv);
    fill_const(scr, nscr, NAN);
    kern_attention_backward(dqkv, scr, R, qkv, att, B, T, C, NH);
    snprintf(name, sizeof name, "attn B%d T%d C%d NH%d dqkv", B, T, C, NH);
    check_grad(name, att_loss, &c, c.qkv, dqkv, nqkv, stride);
    fill(scr, nscr, rng, -100, 100);
    kern_attention_backward(dqkv2, scr, R, qkv, att, B, T, C, NH);
    check_same(name, dqkv, dqkv2, nqkv);
    kern_attention_backward(dqkv2, scr, R, qkv, att, B, T, C, NH);
    check_twice(name, dqkv2, dqkv, nqkv);

    free(qkv), free(R), free(out), free(att), free(scr), free(out2), free(att2), free(ratt);
    free(dqkv), free(dqkv2), free(c.qkv), free(c.R), free(c.out);
}

/* ---------------------------------------------------------------- gelu, residual */

struct ew_ctx {
    size_t n;
    double *a, *b, *R; /* b unused by gelu */
};

static double ref_gelu(double x)
{
    const double k = sqrt(2.0 / acos(-1.0));
    return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
}

static double gelu_loss(void *p)
{
    struct ew_ctx *c = p;
    double s = 0;
    for (size_t i = 0; i < c->n; i++) s += ref_gelu(c->a[i]) * c->R[i];
    return s;
}

static double res_loss(void *p)
{
    struct ew_ctx *c = p;
    double s = 0;
    for (size_t i = 0; i < c->n; i++) s += (c->a[i] + c->b[i]) * c->R[i];
    return s;
}

static void test_gelu(uint64_t *rng)
{
    const size_t n = 67; /* not a multiple of any vector width */
    float *x = falloc(n), *R = falloc(n), *out = falloc(n), *out2 = falloc(n);
    fill(x, n, rng, -4, 4);
    x[0] = 0.0f; /* and tails where exp(-2u) under- or overflows */
    x[1] = -30.0f;
    x[2] = 30.0f;
    x[3] = -9.0f;
    x[4] = 9.0f;
    x[5] = -100.0f;
    x[6] = 100.0f;
    fill(R, n, rng, -1, 1);
    struct ew_ctx c = {n, to_d(x, n), NULL, to_d(R, n)};
    double *ref = dalloc(n);
    for (size_t i = 0; i < n; i++) ref[i] = ref_gelu(c.a[i]);
    kern_gelu_forward(out, x, n);
    kern_gelu_forward(out2, x, n);
    check_arr("gelu fwd", out, ref, n, FWD_ATOL, FWD_RTOL);
    check_same("gelu fwd", out, out2, n);

    float *dx = falloc(n), *dx2 = falloc(n);
    kern_gelu_backward(dx, x, R, n);
    check_grad("gelu dinp", gelu_loss, &c, c.a, dx, n, 1);
    kern_gelu_backward(dx2, x, R, n);
    check_same("gelu dinp", dx, dx2, n);
    kern_gelu_backward(dx2, x, R, n);
    check_twice("gelu dinp", dx2, dx, n);

    free(x), free(R), free(out), free(out2), free(ref), free(dx), free(dx2);
    free(c.a), free(c.R);
}

static void test_residual(uint64_t *rng)
{
    const size_t n = 67;
    float *a = falloc(n), *b = falloc(n), *R = falloc(n), *out = falloc(n);
    fill(a, n, rng, -1, 1);
    fill(b, n, rng, -1, 1);
    fill(R, n, rng, -1, 1);
    struct ew_ctx c = {n, to_d(a, n), to_d(b, n), to_d(R, n)};
    double *ref = dalloc(n);
    for (size_t i = 0; i < n; i++) ref[i] = c.a[i] + c.b[i];
    kern_residual_forward(out, a, b, n);
    check_arr("residual fwd", out, ref, n, FWD_ATOL, FWD_RTOL);

    float *da = falloc(n), *db = falloc(n), *da2 = falloc(n), *db2 = falloc(n);
    kern_residual_backward(da, db, R, n);
    check_grad("residual da", res_loss, &c, c.a, da, n, 1);
    check_grad("residual db", res_loss, &c, c.b, db, n, 1);
    kern_residual_backward(da2, db2, R, n);
    kern_residual_backward(da2, db2, R, n);
    check_twice("residual da", da2, da, n);
    check_twice("residual db", db2, db, n);

    free(a), free(b), free(R), free(out), free(ref), free(da), free(db), free(da2), free(db2);
    free(c.a), free(c.b), free(c.R);
}

/* ---------------------------------------------------------------- softmax + cross-entropy */

struct ce_ctx {
    int N, V;
    const int32_t *targets;
    double dloss;
    double *logits;
};

static void ref_softmax_ce(double *probs, double *losses, const double *logits,
                           const int32_t *targets, int N, int V)
{
    for (int n = 0; n < N; n++) {
        const double *l = logits + (size_t)n * V;
        double maxv = l[0], sum = 0;
        for (int i = 1; i < V; i++)
            if (l[i] > maxv) maxv = l[i];
        for (int i = 0; i < V; i++) sum += exp(l[i] - maxv);
        if (probs)
            for (int i = 0; i < V; i++) probs[(size_t)n * V + i] = exp(l[i] - maxv) / sum;
        losses[n] = log(sum) - (l[targets[n]] - maxv);
    }
}

static double ce_loss(void *p)
{
    struct ce_ctx *c = p;
    double losses[64], s = 0;
    ref_softmax_ce(NULL, losses, c->logits, c->targets, c->N, c->V);
    for (int n = 0; n < c->N; n++) s += losses[n];
    return c->dloss * s;
}

static void test_softmax_ce(uint64_t *rng)
{
    const int N = 10, V = 11;
    const size_t nl = (size_t)N * V;
    int32_t targets[10];
    for (int n = 0; n < N; n++) targets[n] = (int32_t)(splitmix64(rng) % V);
    targets[0] = V - 1; /* both ends of the row */
    targets[1] = 0;
    float *logits = falloc(nl), *probs = falloc(nl), *losses = falloc(N);
    float *probs2 = falloc(nl), *losses2 = falloc(N);
    fill(logits, nl, rng, -4, 4);
    struct ce_ctx c = {N, V, targets, 1.0 / N, to_d(logits, nl)};
    double *rprobs = dalloc(nl), *rlosses = dalloc(N);
    ref_softmax_ce(rprobs, rlosses, c.logits, targets, N, V);
    fill_const(probs, nl, NAN);
    kern_softmax_crossentropy_forward(probs, losses, logits, targets, N, V);
    kern_softmax_crossentropy_forward(probs2, losses2, logits, targets, N, V);
    check_arr("softmax_ce fwd probs", probs, rprobs, nl, FWD_ATOL, FWD_RTOL);
    check_arr("softmax_ce fwd losses", losses, rlosses, N, FWD_ATOL, FWD_RTOL);
    check_same("softmax_ce fwd probs", probs, probs2, nl);
    check_same("softmax_ce fwd losses", losses, losses2, N);

    /* a row whose target probability underflows in fp32 still has a finite loss */
    float big[3] = {0.0f, 200.0f, -200.0f}, pbig[3], lbig;
    int32_t tbig = 2;
    kern_softmax_crossentropy_forward(pbig, &lbig, big, &tbig, 1, 3);
    T_CHECK(t_close(lbig, 400.0, 1e-3, 1e-6), "softmax_ce underflow loss %g, want 400", lbig);

    float *dl = falloc(nl), *dl2 = falloc(nl);
    kern_softmax_crossentropy_backward(dl, probs, targets, (float)(1.0 / N), N, V);
    check_grad("softmax_ce dlogits", ce_loss, &c, c.logits, dl, nl, 1);
    kern_softmax_crossentropy_backward(dl2, probs, targets, (float)(1.0 / N), N, V);
    check_same("softmax_ce dlogits", dl, dl2, nl);
    kern_softmax_crossentropy_backward(dl2, probs, targets, (float)(1.0 / N), N, V);
    check_twice("softmax_ce dlogits", dl2, dl, nl);

    free(logits), free(probs), free(losses), free(probs2), free(losses2);
    free(rprobs), free(rlosses), free(dl), free(dl2), free(c.logits);
}

int main(int argc, char **argv)
{
    verbose = argc > 1 && strcmp(argv[1], "-v") == 0;
    uint64_t rng = 0x6b65726e5f677264ULL; /* fixed seed */

    test_encoder(&rng);
    test_layernorm(&rng);
    test_matmul_shape(&rng, 10, 8, 12, 1);
    test_matmul_shape(&rng, 300, 70, 130, 0); /* past small-matrix paths of the BLAS */
    test_attention_shape(&rng, 2, 5, 8, 2, 1);
    test_attention_shape(&rng, 1, 1, 4, 1, 1);   /* T = 1: a single unmasked entry */
    test_attention_shape(&rng, 2, 37, 48, 3, 7); /* odd T, hs = 16, sampled */
    test_gelu(&rng);
    test_residual(&rng);
    test_softmax_ce(&rng);
    return t_done("test_kern_grad");
}
