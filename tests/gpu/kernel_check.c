/* kernel_check - every op of the CUDA table (kern_cuda.h) against its CPU reference on fresh
 * random inputs (kernels.h's functions, train/optim.c's train_adamw_update_shard, a
 * train_tree_sum-style float tree, a plain shuffle loop), in four shapes (head sizes 20, 32
 * and 64, C not a multiple of 32, N = B*T above two 256-row chunks, V = 50257) and one long
 * element-wise length (above one grid of 65536 x 256 threads).
 *
 * Per op and shape: the GPU op runs twice, each time on freshly allocated and uploaded
 * buffers (a buffer without initial contents is filled with 0xFF bytes - NaN - so that an
 * unwritten element fails); the two results must be the same bits (determinism), and the
 * first is compared with the CPU's by the norm-wise relative error
 *     err = max_i |gpu_i - cpu_i| / max(max_i |cpu_i|, 1e-30)
 * over each output tensor (the worst output counts). The backward ops accumulate into their
 * gradients: each runs from a random start (catches = instead of +=) and from zeros ("from
 * 0": the error is then relative to the gradient itself, however small). Tolerances: fp32
 * 1e-5; the GEMMs on bf16 operands 5e-4 (reference: the fp32 kernel on the same operands
 * rounded to bf16, round to nearest even; only the order of the fp32 sums differs); the ops
 * with a bf16 output (LayerNorm, attention, GELU) 1e-2 and at most 1% of the bits one ulp off
 * (reference: the fp32 kernel's output rounded; the two widened to fp32 and compared); 0 -
 * identical bits - for round_bf16, adamw and rank_tree_sum (and for the ops that follow the
 * CPU's order: embedding, residuals, copies, shuffle).
 *
 * Prints one line per check: name, shape, max rel error, tolerance, PASS/FAIL; exits 0 all
 * pass, 1 a failure, 77 no GPU (cudaGetDeviceCount fails or finds none).
 * KERNEL_CHECK_SEED=<n> repeats a run (the seed is printed); KERNEL_CHECK_SHAPES=<digits>
 * runs only the shapes of those indexes (0-4, in the order of main's table).
 * Built with -DKERNEL_CHECK_CPU (kernel_check_cpu.h) it runs on the CPU table, to test the
 * harness itself (kernel_check_selftest.py).
 */
#include "kernels.h"
#include "model.h"
#include "optim.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KERNEL_CHECK_CPU
#include "kernel_check_cpu.h" /* the harness on the CPU table: test kernel_check_cpu */
#else
#include "kern_cuda.h"
#include <cuda_runtime_api.h>
#endif

#define MAXARGS 8
#define WAIT_TIMEOUT_S 120.0

static uint64_t rng_state;
static int failures;
static cudaStream_t stream;

static uint64_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

static float urand(float lo, float hi)
{
    return lo + (hi - lo) * (float)((rng_next() >> 40) * (1.0 / 16777216.0));
}

static float *frand(size_t n, float lo, float hi)
{
    float *p = malloc(n * sizeof(float) + 1);
    if (!p) abort();
    for (size_t i = 0; i < n; i++) p[i] = urand(lo, hi);
    return p;
}

static int32_t *irand(size_t n, int V)
{
    int32_t *p = malloc(n * sizeof(int32_t) + 1);
    if (!p) abort();
    for (size_t i = 0; i < n; i++) p[i] = (int32_t)(rng_next() % (uint64_t)V);
    return p;
}

static void *dupmem(const void *src, size_t bytes)
{
    void *p = malloc(bytes + 1);
    if (!p) abort();
    memcpy(p, src, bytes);
    return p;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Wait for the stream, at most WAIT_TIMEOUT_S. */
static int wait_stream(void)
{
    const double deadline = now_s() + WAIT_TIMEOUT_S;
    cudaError_t e;
    while ((e = cudaStreamQuery(stream)) == cudaErrorNotReady) {
        /* "not ready" may stay as the thread's last error, where the next launch check
         * (cudaGetLastError) would take it for a failed launch: clear it */
        if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
        if (now_s() > deadline) return -ETIMEDOUT;
        usleep(50);
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "kernel_check: stream: %s\n", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

/* One buffer of an op: initial contents (host), size, and whether it is an output that is
 * compared (kind 1 = floats at the check's tolerance, 2 = doubles, 3 = bytes, 4 = bf16 bit
 * patterns, uint16_t: compared as the floats they widen to, and besides at most 1% of them
 * may differ from the expected bits, each by one bf16 ulp - a wrong rounding mode (truncation)
 * moves about half of them - 5 = floats at the fp32 tolerance 1e-5 whatever the check's). */
typedef struct arg {
    const void *init;
    size_t bytes;
    int out;
} arg;

typedef struct shape {
    int B, T, C, NH, V, OC;
    const char *label;
    size_t n; /* the element-wise length; 0: nelem's default from B, T, C */
} shape;

typedef void (*gpu_fn)(const kern_ops *k, void *const *d, const shape *s, const void *extra);

static double rel_err_f(const float *a, const float *b, size_t n)
{
    double md = 0.0, mb = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= md)) md = d; /* NaN propagates */
        if (fabs((double)b[i]) > mb) mb = fabs((double)b[i]);
    }
    return md / (mb > 1e-30 ? mb : 1e-30);
}

static float widen16(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static double rel_err_h(const uint16_t *a, const uint16_t *b, size_t n)
{
    double md = 0.0, mb = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double x = widen16(a[i]), y = widen16(b[i]);
        double d = fabs(x - y);
        if (!(d <= md)) md = d;
        if (fabs(y) > mb) mb = fabs(y);
    }
    return md / (mb > 1e-30 ? mb : 1e-30);
}

/* bf16 outputs: the share of elements whose bits differ from the expected ones, and whether
 * every difference is at most one ulp of the larger of the two values (or, for values near 0,
 * at most 1e-5 of the tensor's largest: fp32 noise that crossed zero). */
static double bf16_mismatch(const uint16_t *a, const uint16_t *b, size_t n, int *one_ulp)
{
    size_t diff = 0;
    double mb = 0.0;
    for (size_t i = 0; i < n; i++) mb = fmax(mb, fabs((double)widen16(b[i])));
    *one_ulp = 1;
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i]) continue;
        diff++;
        const double x = widen16(a[i]), y = widen16(b[i]);
        int ex;
        (void)frexp(fmax(fabs(x), fabs(y)), &ex);
        const double ulp = ldexp(1.0, ex - 8); /* bf16: 8 significant bits */
        if (!(fabs(x - y) <= fmax(ulp, 1e-5 * mb))) *one_ulp = 0;
    }
    return n ? (double)diff / (double)n : 0.0;
}

static double rel_err_d(const double *a, const double *b, size_t n)
{
    double md = 0.0, mb = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (!(d <= md)) md = d;
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return md / (mb > 1e-30 ? mb : 1e-30);
}

/* Run fn twice on fresh device copies of args; compare outputs with expect[i] (host, same
 * size as args[i], for outputs). tol 0 means identical bits are required. */
static void check(const char *name, const shape *s, const kern_ops *k, gpu_fn fn,
                  const void *extra, const arg *args, int nargs, void *const *expect, double tol)
{
    void *res[2][MAXARGS] = {{0}};
    int ok = 1;
    const char *why = "";
    static char bf16_why[96];
    for (int run = 0; run < 2 && ok; run++) {
        void *d[MAXARGS] = {0};
        for (int i = 0; i < nargs; i++) {
            /* a buffer without initial contents starts as 0xFF bytes (NaN as fp32 and bf16),
             * so that an element the op leaves unwritten cannot match by chance */
            if (cudaMalloc(&d[i], args[i].bytes ? args[i].bytes : 4) != cudaSuccess ||
                (args[i].init ? cudaMemcpyAsync(d[i], args[i].init, args[i].bytes,
                                                cudaMemcpyHostToDevice, stream)
                              : cudaMemsetAsync(d[i], 0xFF, args[i].bytes ? args[i].bytes : 4,
                                                stream)) != cudaSuccess) {
                ok = 0;
                why = " (device alloc/upload)";
            }
        }
        if (ok) {
#ifdef CUDA_EMU
            /* on the CUDA emulator the second run takes its other thread order (blocks and
             * threads reversed, one warp ahead of the others): a race or an order-dependent
             * sum then shows as "two runs differ in bits", or as a wrong value */
            cudaEmuSetSchedule(run ? CUDA_EMU_SCHEDULE_REVERSE : CUDA_EMU_SCHEDULE_FORWARD);
#endif
            fn(k, d, s, extra);
            if (wait_stream() || k->status(k->ctx)) {
                ok = 0;
                why = " (op failed: see the log)";
            }
        }
        for (int i = 0; i < nargs && ok; i++) {
            if (!args[i].out) continue;
            res[run][i] = malloc(args[i].bytes + 1);
            if (cudaMemcpyAsync(res[run][i], d[i], args[i].bytes, cudaMemcpyDeviceToHost,
                                stream) != cudaSuccess) {
                ok = 0;
                why = " (download)";
            }
        }
        if (ok && wait_stream()) {
            ok = 0;
            why = " (download)";
        }
        for (int i = 0; i < nargs; i++) cudaFree(d[i]);
    }
    double err = 0.0;
    int same = 1;
    if (ok) {
        for (int i = 0; i < nargs; i++) {
            if (!args[i].out) continue;
            if (memcmp(res[0][i], res[1][i], args[i].bytes)) same = 0;
            double e;
            if (args[i].out == 2)
                e = rel_err_d(res[0][i], expect[i], args[i].bytes / sizeof(double));
            else if (args[i].out == 3)
                e = memcmp(res[0][i], expect[i], args[i].bytes) ? 1.0 : 0.0;
            else if (args[i].out == 4) {
                const size_t n16 = args[i].bytes / sizeof(uint16_t);
                int one_ulp;
                const double share = bf16_mismatch(res[0][i], expect[i], n16, &one_ulp);
                e = rel_err_h(res[0][i], expect[i], n16);
                if (share > 0.01 || !one_ulp) {
                    e = fmax(e, 1.0);
                    snprintf(bf16_why, sizeof bf16_why,
                             " (bf16 bits: %.2f%% of elements differ%s)", share * 100.0,
                             one_ulp ? "" : ", some by more than one ulp");
                    why = bf16_why;
                }
            } else if (args[i].out == 5) {
                const double e5 = rel_err_f(res[0][i], expect[i], args[i].bytes / sizeof(float));
                e = e5 <= 1e-5 ? 0.0 : fmax(e5, 1.0); /* within 1e-5 counts as exact here */
                if (e5 > 1e-5) why = " (an fp32 output beyond 1e-5)";
            }
            else if (tol == 0.0)
                e = memcmp(res[0][i], expect[i], args[i].bytes)
                        ? fmax(rel_err_f(res[0][i], expect[i], args[i].bytes / 4), 1e-300)
                        : 0.0;
            else
                e = rel_err_f(res[0][i], expect[i], args[i].bytes / sizeof(float));
            if (!(e <= err)) err = e;
        }
        if (!same) why = " (two runs differ in bits)";
    }
    const int pass = ok && same && (tol == 0.0 ? err == 0.0 : err <= tol);
    if (!pass) failures++;
    printf("%-34s %-22s max_rel_err %.3e  tol %.0e%s  %s%s\n", name, s->label, err, tol,
           tol == 0.0 ? " (bits)" : "       ", pass ? "PASS" : "FAIL", why);
    fflush(stdout);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < nargs; i++) free(res[r][i]);
}

/* kern_softmax_crossentropy_forward with the max, the sum and the loss in double, rounded to
 * float at the end: a reference closer to the exact values than either table. */
static void ce_forward_f64(float *probs, float *losses, const float *logits, const int32_t *tg,
                           int N, int V)
{
    for (int n = 0; n < N; n++) {
        const float *l = logits + (size_t)n * V;
        double mx = l[0], sum = 0.0;
        for (int i = 1; i < V; i++) mx = fmax(mx, (double)l[i]);
        for (int i = 0; i < V; i++) sum += exp((double)l[i] - mx);
        for (int i = 0; i < V; i++) probs[(size_t)n * V + i] = (float)(exp((double)l[i] - mx) / sum);
        losses[n] = (float)(log(sum) - ((double)l[tg[n]] - mx));
    }
}

/* kern_round_bf16's rule (kern_ops.h): round to nearest even, NaN kept quiet. */
static float ref_round_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
        u = (u | 0x00400000u) & 0xffff0000u;
    else
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

static float *rounded(const float *x, size_t n)
{
    float *r = malloc(n * sizeof(float) + 1);
    if (!r) abort();
    for (size_t i = 0; i < n; i++) r[i] = ref_round_bf16(x[i]);
    return r;
}

/* The bf16 bit patterns of x rounded (kern_ops.h's uint16_t arrays). */
static uint16_t *to_bf16(const float *x, size_t n)
{
    uint16_t *r = malloc(n * sizeof(uint16_t) + 1);
    if (!r) abort();
    for (size_t i = 0; i < n; i++) {
        const float f = ref_round_bf16(x[i]);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        r[i] = (uint16_t)(u >> 16);
    }
    return r;
}

/* train_tree_sum's tree over ranks, in float (the CPU backend's plain adds). */
static float ref_tree(const float *in, size_t stride, int n)
{
    if (n == 1) return in[0];
    int h = 1;
    while (h * 2 < n) h *= 2;
    return ref_tree(in, stride, h) + ref_tree(in + (size_t)h * stride, stride, n - h);
}

/* ------------------------------------------------------------------ GPU calls */

static void g_encoder_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->encoder_forward(k->ctx, d[0], d[1], d[2], d[3], s->B, s->T, s->C);
}
static void g_encoder_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->encoder_backward(k->ctx, d[0], d[1], d[2], d[3], s->B, s->T, s->C);
}
static void g_ln_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->layernorm_forward(k->ctx, d[0], d[1], d[2], d[3], d[4], d[5], s->B * s->T, s->C);
}
static void g_ln_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->layernorm_backward(k->ctx, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], s->B * s->T,
                          s->C);
}
static void g_mm_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    const int has_bias = *(const int *)x;
    k->matmul_forward(k->ctx, d[0], d[1], d[2], has_bias ? d[3] : NULL, s->B * s->T, s->C,
                      s->OC);
}
static void g_mm_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    const int which = *(const int *)x; /* bit 0: dinp given, bit 1: dbias given */
    k->matmul_backward(k->ctx, which & 1 ? d[0] : NULL, d[1], which & 2 ? d[2] : NULL, d[3],
                       d[4], d[5], s->B * s->T, s->C, s->OC);
}
static void g_mm_forward16(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    const int has_bias = *(const int *)x;
    k->matmul_forward_bf16(k->ctx, d[0], d[1], d[2], has_bias ? d[3] : NULL, s->B * s->T, s->C,
                           s->OC);
}
static void g_mm_backward16(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    const int which = *(const int *)x; /* bit 0: dinp given, bit 1: dbias given */
    k->matmul_backward_bf16(k->ctx, which & 1 ? d[0] : NULL, d[1], which & 2 ? d[2] : NULL,
                            d[3], d[4], d[5], s->B * s->T, s->C, s->OC);
}
static void g_ln_forward16(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->layernorm_forward_bf16(k->ctx, d[0], d[1], d[2], d[3], d[4], d[5], s->B * s->T, s->C);
}
static void g_att_forward16(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->attention_forward_bf16(k->ctx, d[0], d[1], d[2], d[3], s->B, s->T, s->C, s->NH);
}
static void g_att_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->attention_forward(k->ctx, d[0], d[1], d[2], d[3], s->B, s->T, s->C, s->NH);
}
static void g_att_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->attention_backward(k->ctx, d[0], d[1], d[2], d[3], d[4], s->B, s->T, s->C, s->NH);
}
static size_t nelem(const shape *s)
{
    if (s->n) return s->n;
    return (size_t)s->B * s->T * s->C * 4 + 7; /* an odd length, 4x an activation */
}
static void g_gelu_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->gelu_forward(k->ctx, d[0], d[1], nelem(s));
}
static void g_gelu_forward16(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->gelu_forward_bf16(k->ctx, d[0], d[1], nelem(s));
}
static void g_round16(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->round_bf16(k->ctx, d[0], d[1], nelem(s));
}
static void g_gelu_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->gelu_backward(k->ctx, d[0], d[1], d[2], nelem(s));
}
static void g_res_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->residual_forward(k->ctx, d[0], d[1], d[2], nelem(s));
}
static void g_res_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->residual_backward(k->ctx, d[0], d[1], d[2], nelem(s));
}
static void g_ce_forward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->softmax_crossentropy_forward(k->ctx, d[0], d[1], d[2], d[3], s->B * s->T, s->V);
}
static void g_ce_backward(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    k->softmax_crossentropy_backward(k->ctx, d[0], d[1], d[2], *(const float *)x, s->B * s->T,
                                     s->V);
}
static void g_zero(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->zero(k->ctx, d[0], nelem(s));
}
static void g_copy(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->copy(k->ctx, d[0], d[1], nelem(s));
}
static void g_add(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->add(k->ctx, d[0], d[1], nelem(s));
}
static void g_scale(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    k->scale(k->ctx, d[0], nelem(s), *(const float *)x);
}
static size_t nblocks(const shape *s)
{
    return (size_t)s->T + 3; /* blocks of 2048 for block_sumsq */
}
static void g_sumsq(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->block_sumsq(k->ctx, d[0], nblocks(s) * 2048, d[1]);
}
static void g_adamw(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    k->adamw(k->ctx, d[0], d[1], d[2], d[3], nelem(s), x);
}
typedef struct tree_args {
    size_t n, stride;
    int nranks, in_place;
} tree_args;
static void g_tree(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)s;
    const tree_args *t = x;
    k->rank_tree_sum(k->ctx, t->in_place ? d[1] : d[0], d[1], t->n, t->stride, t->nranks);
}
static void g_shuffle(const kern_ops *k, void *const *d, const shape *s, const void *x)
{
    (void)x;
    k->shuffle4(k->ctx, d[0], d[1], nelem(s) * 4);
}

/* ------------------------------------------------------------------ checks */

/* The initial contents of an accumulated gradient (the ops add to theirs): random in [-1, 1],
 * which catches an op that assigns instead of adding, or zeros ("from 0" in the check's name),
 * where the error is measured against what the op added alone - a gradient much smaller than
 * the random start (cross-entropy's p/N, attention's dq) is then held to the tolerance too. */
static float *grad_init(size_t n, int zero)
{
    if (!zero) return frand(n, -1, 1);
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) abort();
    return p;
}

static const char *zname(const char *name, int zero)
{
    static char buf[128];
    if (!zero) return name;
    snprintf(buf, sizeof buf, "%s (from 0)", name);
    return buf;
}

#define F(n) ((n) * sizeof(float))

static void check_model(const kern_ops *k, const kern_ops *kb, const shape *s)
{
    const int B = s->B, T = s->T, C = s->C, NH = s->NH, V = s->V, OC = s->OC, N = B * T;
    const size_t NC = (size_t)N * C;
    void *ex[MAXARGS] = {0};

    { /* encoder */
        int32_t *inp = irand((size_t)N, V);
        float *wte = frand((size_t)V * C, -1, 1), *wpe = frand((size_t)T * C, -1, 1);
        float *out = malloc(F(NC));
        kern_encoder_forward(out, inp, wte, wpe, B, T, C);
        arg a[] = {{NULL, F(NC), 1}, {inp, (size_t)N * 4, 0}, {wte, F((size_t)V * C), 0},
                   {wpe, F((size_t)T * C), 0}};
        ex[0] = out;
        check("encoder_forward", s, k, g_encoder_forward, NULL, a, 4, ex, 0.0);
        float *dwte = frand((size_t)V * C, -1, 1), *dwpe = frand((size_t)T * C, -1, 1);
        float *dout = frand(NC, -1, 1);
        float *ewte = dupmem(dwte, F((size_t)V * C)), *ewpe = dupmem(dwpe, F((size_t)T * C));
        kern_encoder_backward(ewte, ewpe, dout, inp, B, T, C);
        arg b[] = {{dwte, F((size_t)V * C), 1}, {dwpe, F((size_t)T * C), 1}, {dout, F(NC), 0},
                   {inp, (size_t)N * 4, 0}};
        void *eb[MAXARGS] = {ewte, ewpe};
        check("encoder_backward", s, k, g_encoder_backward, NULL, b, 4, eb, 0.0);
        free(inp), free(wte), free(wpe), free(out), free(dwte), free(dwpe), free(dout);
        free(ewte), free(ewpe);
    }
    { /* LayerNorm */
        float *inp = frand(NC, -2, 2), *w = frand((size_t)C, 0.5f, 1.5f),
              *bi = frand((size_t)C, -0.5f, 0.5f);
        float *out = malloc(F(NC)), *mean = malloc(F(N)), *rstd = malloc(F(N));
        kern_layernorm_forward(out, mean, rstd, inp, w, bi, N, C);
        arg a[] = {{NULL, F(NC), 1}, {NULL, F(N), 1},  {NULL, F(N), 1},
                   {inp, F(NC), 0},  {w, F(C), 0},     {bi, F(C), 0}};
        void *ea[MAXARGS] = {out, mean, rstd};
        check("layernorm_forward", s, k, g_ln_forward, NULL, a, 6, ea, 1e-5);
        float *dout = frand(NC, -1, 1);
        for (int zg = 0; zg < 2; zg++) {
            float *dinp = grad_init(NC, zg), *dw = grad_init((size_t)C, zg),
                  *db = grad_init((size_t)C, zg);
            float *edinp = dupmem(dinp, F(NC)), *edw = dupmem(dw, F(C)), *edb = dupmem(db, F(C));
            kern_layernorm_backward(edinp, edw, edb, dout, inp, w, mean, rstd, N, C);
            arg b[] = {{dinp, F(NC), 1}, {dw, F(C), 1}, {db, F(C), 1},  {dout, F(NC), 0},
                       {inp, F(NC), 0},  {w, F(C), 0},  {mean, F(N), 0}, {rstd, F(N), 0}};
            void *eb[MAXARGS] = {edinp, edw, edb};
            check(zname("layernorm_backward", zg), s, k, g_ln_backward, NULL, b, 8, eb, 1e-5);
            free(dinp), free(dw), free(db), free(edinp), free(edw), free(edb);
        }
        free(inp), free(w), free(bi), free(out), free(mean), free(rstd), free(dout);
    }
    /* matmul, fp32 operands (fp32 table) and bf16 operands (bf16 table: inp and weight given
     * as bf16, dout rounded by the op); with and without bias, each of dinp and dbias NULL or
     * not. The bf16 GEMMs' reference has the same rounded operands, so only the order of the
     * fp32 sums differs: 5e-4 (not the 1e-2 of a bf16 output) catches truncated instead of
     * rounded operands (4e-3 to 6e-3), an unrounded dout (1.5e-3) or fp32 operands in the
     * forward (2e-3), measured on the CPU at N128 C128 OC384. */
    for (int prec = 0; prec < 2; prec++) {
        const kern_ops *kk = prec ? kb : k;
        const double tol = prec ? 5e-4 : 1e-5;
        float *inp = frand(NC, -1, 1), *w = frand((size_t)OC * C, -0.5f, 0.5f),
              *bias = frand((size_t)OC, -1, 1);
        float *ri = prec ? rounded(inp, NC) : dupmem(inp, F(NC));
        float *rw = prec ? rounded(w, (size_t)OC * C) : dupmem(w, F((size_t)OC * C));
        uint16_t *i16 = to_bf16(inp, NC), *w16 = to_bf16(w, (size_t)OC * C);
        /* the operands as the op takes them */
        const void *ai = prec ? (const void *)i16 : (const void *)inp;
        const void *aw = prec ? (const void *)w16 : (const void *)w;
        const size_t bi = prec ? NC * 2 : F(NC), bw = prec ? (size_t)OC * C * 2 : F((size_t)OC * C);
        for (int hb = 1; hb >= 0; hb--) {
            float *out = malloc(F((size_t)N * OC));
            kern_matmul_forward(out, ri, rw, hb ? bias : NULL, N, C, OC);
            arg a[] = {{NULL, F((size_t)N * OC), 1}, {ai, bi, 0}, {aw, bw, 0}, {bias, F(OC), 0}};
            void *ea[MAXARGS] = {out};
            check(prec ? (hb ? "matmul_forward_bf16" : "matmul_forward_bf16 (no bias)")
                       : (hb ? "matmul_forward" : "matmul_forward (no bias)"),
                  s, kk, prec ? g_mm_forward16 : g_mm_forward, &hb, a, 4, ea, tol);
            free(out);
        }
        float *dout = frand((size_t)N * OC, -1, 1);
        float *rd = prec ? rounded(dout, (size_t)N * OC) : dupmem(dout, F((size_t)N * OC));
        /* which: bit 0 dinp given, bit 1 dbias given; zg: gradients from 0 (all given) */
        static const int cases[][2] = {{3, 0}, {3, 1}, {0, 0}, {1, 0}, {2, 0}};
        static const char *const suffix[] = {" (dW only)", " (dinp, no dbias)",
                                             " (dbias, no dinp)", ""};
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int which = cases[ci][0], zg = cases[ci][1];
            float *dinp = grad_init(NC, zg), *dw = grad_init((size_t)OC * C, zg),
                  *db = grad_init((size_t)OC, zg);
            float *edinp = dupmem(dinp, F(NC)), *edw = dupmem(dw, F((size_t)OC * C)),
                  *edb = dupmem(db, F(OC));
            kern_matmul_backward(which & 1 ? edinp : NULL, edw, which & 2 ? edb : NULL, rd, ri,
                                 rw, N, C, OC);
            /* an output the op is not given keeps its initial contents on both sides */
            arg b[] = {{dinp, F(NC), 1},  {dw, F((size_t)OC * C), 1}, {db, F(OC), 1},
                       {dout, F((size_t)N * OC), 0}, {ai, bi, 0}, {aw, bw, 0}};
            void *eb[MAXARGS] = {edinp, edw, edb};
            char name[64];
            snprintf(name, sizeof name, "%s%s", prec ? "matmul_backward_bf16" : "matmul_backward",
                     suffix[which]);
            check(zname(name, zg), s, kk, prec ? g_mm_backward16 : g_mm_backward, &which, b, 6,
                  eb, tol);
            free(dinp), free(dw), free(db), free(edinp), free(edw), free(edb);
        }
        free(inp), free(w), free(bias), free(ri), free(rw), free(dout), free(rd), free(i16), free(w16);
    }
    { /* the bf16 outputs (bf16 table): the CPU's fp32 result rounded; round_bf16 bit for bit */
        const size_t n = nelem(s);
        float *x = frand(n, -4, 4), *g = malloc(F(n));
        kern_gelu_forward(g, x, n);
        uint16_t *eg = to_bf16(g, n), *ex16 = to_bf16(x, n);
        arg a[] = {{NULL, n * 2, 4}, {x, F(n), 0}};
        void *ea[MAXARGS] = {eg};
        check("gelu_forward_bf16", s, kb, g_gelu_forward16, NULL, a, 2, ea, 1e-2);
        arg r[] = {{NULL, n * 2, 3}, {x, F(n), 0}};
        void *er[MAXARGS] = {ex16};
        check("round_bf16", s, kb, g_round16, NULL, r, 2, er, 0.0);
        float *inp = frand(NC, -2, 2), *w = frand((size_t)C, 0.5f, 1.5f),
              *bi = frand((size_t)C, -0.5f, 0.5f);
        float *out = malloc(F(NC)), *mean = malloc(F(N)), *rstd = malloc(F(N));
        kern_layernorm_forward(out, mean, rstd, inp, w, bi, N, C);
        uint16_t *eo = to_bf16(out, NC);
        arg l[] = {{NULL, NC * 2, 4}, {NULL, F(N), 5}, {NULL, F(N), 5},
                   {inp, F(NC), 0},   {w, F(C), 0},    {bi, F(C), 0}};
        void *el[MAXARGS] = {eo, mean, rstd};
        check("layernorm_forward_bf16", s, kb, g_ln_forward16, NULL, l, 6, el, 1e-2);
        free(x), free(g), free(eg), free(ex16), free(inp), free(w), free(bi), free(out);
        free(mean), free(rstd), free(eo);
    }
    { /* attention (fp32 in both tables; checked on the bf16 table too) */
        const size_t nq = (size_t)N * 3 * C, na = (size_t)B * NH * T * T;
        float *qkv = frand(nq, -1, 1), *out = malloc(F(NC)), *att = malloc(F(na));
        float *scr = malloc(F(2 * (size_t)T * T));
        kern_attention_forward(out, att, scr, qkv, B, T, C, NH);
        arg a[] = {{NULL, F(NC), 1}, {NULL, F(na), 1}, {NULL, F((size_t)T * T), 0},
                   {qkv, F(nq), 0}};
        void *ea[MAXARGS] = {out, att};
        check("attention_forward", s, k, g_att_forward, NULL, a, 4, ea, 1e-5);
        check("attention_forward (bf16 table)", s, kb, g_att_forward, NULL, a, 4, ea, 1e-5);
        uint16_t *eo16 = to_bf16(out, NC);
        arg a16[] = {{NULL, NC * 2, 4}, {NULL, F(na), 5}, {NULL, F((size_t)T * T), 0},
                     {qkv, F(nq), 0}};
        void *ea16[MAXARGS] = {eo16, att};
        check("attention_forward_bf16", s, kb, g_att_forward16, NULL, a16, 4, ea16, 1e-2);
        free(eo16);
        float *dout = frand(NC, -1, 1);
        for (int zg = 0; zg < 2; zg++) {
            float *dqkv = grad_init(nq, zg);
            float *edqkv = dupmem(dqkv, F(nq));
            kern_attention_backward(edqkv, scr, dout, qkv, att, B, T, C, NH);
            arg b[] = {{dqkv, F(nq), 1}, {NULL, F(2 * (size_t)T * T), 0}, {dout, F(NC), 0},
                       {qkv, F(nq), 0},  {att, F(na), 0}};
            void *eb[MAXARGS] = {edqkv};
            check(zname("attention_backward", zg), s, k, g_att_backward, NULL, b, 5, eb, 1e-5);
            free(dqkv), free(edqkv);
        }
        free(qkv), free(out), free(att), free(scr), free(dout);
    }
    { /* softmax + cross-entropy */
        const size_t nl = (size_t)N * V;
        float *logits = frand(nl, -8, 8), *probs = malloc(F(nl)), *losses = malloc(F(N));
        int32_t *tg = irand((size_t)N, V);
        kern_softmax_crossentropy_forward(probs, losses, logits, tg, N, V);
        /* The CPU table sums the V exponentials of a row in one float loop: at V = 50257 that
         * sum is itself off by about 5e-5 (relative), more than the fp32 tolerance, while a
         * GPU's tree of partial sums is closer to the exact value. So this check compares with
         * sums in double, and allows 1e-5 or twice the CPU table's own distance from them,
         * whichever is larger. */
        float *p64 = malloc(F(nl)), *l64 = malloc(F(N));
        ce_forward_f64(p64, l64, logits, tg, N, V);
        const double cpu_err = fmax(rel_err_f(probs, p64, nl), rel_err_f(losses, l64, (size_t)N));
        arg a[] = {{NULL, F(nl), 1}, {NULL, F(N), 1}, {logits, F(nl), 0}, {tg, (size_t)N * 4, 0}};
        void *ea[MAXARGS] = {p64, l64};
        check("softmax_crossentropy_forward", s, k, g_ce_forward, NULL, a, 4, ea,
              fmax(1e-5, 2.0 * cpu_err));
        free(p64), free(l64);
        const float dloss = 1.0f / (float)N;
        for (int zg = 0; zg < 2; zg++) {
            float *dl = grad_init(nl, zg), *edl = dupmem(dl, F(nl));
            kern_softmax_crossentropy_backward(edl, probs, tg, dloss, N, V);
            arg b[] = {{dl, F(nl), 1}, {probs, F(nl), 0}, {tg, (size_t)N * 4, 0}};
            void *eb[MAXARGS] = {edl};
            check(zname("softmax_crossentropy_backward", zg), s, k, g_ce_backward, &dloss, b, 3,
                  eb, 1e-5);
            free(dl), free(edl);
        }
        free(logits), free(probs), free(losses), free(tg);
    }
}

static void check_elementwise(const kern_ops *k, const shape *s)
{
    const size_t n = nelem(s);
    float *x = frand(n, -4, 4), *y = frand(n, -1, 1), *z = frand(n, -1, 1);
    void *ex[MAXARGS] = {0};
    {
        float *out = malloc(F(n));
        kern_gelu_forward(out, x, n);
        arg a[] = {{NULL, F(n), 1}, {x, F(n), 0}};
        ex[0] = out;
        check("gelu_forward", s, k, g_gelu_forward, NULL, a, 2, ex, 1e-5);
        float *e = dupmem(z, F(n));
        kern_gelu_backward(e, x, y, n);
        arg b[] = {{z, F(n), 1}, {x, F(n), 0}, {y, F(n), 0}};
        ex[0] = e;
        check("gelu_backward", s, k, g_gelu_backward, NULL, b, 3, ex, 1e-5);
        free(out), free(e);
    }
    {
        float *out = malloc(F(n));
        kern_residual_forward(out, x, y, n);
        arg a[] = {{NULL, F(n), 1}, {x, F(n), 0}, {y, F(n), 0}};
        ex[0] = out;
        check("residual_forward", s, k, g_res_forward, NULL, a, 3, ex, 0.0);
        float *ea = dupmem(x, F(n)), *eb = dupmem(y, F(n));
        kern_residual_backward(ea, eb, z, n);
        arg b[] = {{x, F(n), 1}, {y, F(n), 1}, {z, F(n), 0}};
        void *e2[MAXARGS] = {ea, eb};
        check("residual_backward", s, k, g_res_backward, NULL, b, 3, e2, 0.0);
        free(out), free(ea), free(eb);
    }
    {
        float *zero = calloc(n, sizeof(float)), *sum = malloc(F(n)), *sc = malloc(F(n));
        const float f = 0.37f;
        for (size_t i = 0; i < n; i++) sum[i] = x[i] + y[i];
        for (size_t i = 0; i < n; i++) sc[i] = x[i] * f;
        arg a[] = {{x, F(n), 1}};
        ex[0] = zero;
        check("zero", s, k, g_zero, NULL, a, 1, ex, 0.0);
        arg b[] = {{NULL, F(n), 1}, {x, F(n), 0}};
        ex[0] = x;
        check("copy", s, k, g_copy, NULL, b, 2, ex, 0.0);
        arg c[] = {{x, F(n), 1}, {y, F(n), 0}};
        ex[0] = sum;
        check("add", s, k, g_add, NULL, c, 2, ex, 0.0);
        arg d[] = {{x, F(n), 1}};
        ex[0] = sc;
        check("scale", s, k, g_scale, &f, d, 1, ex, 0.0);
        free(zero), free(sum), free(sc);
    }
    {
        const size_t nb = nblocks(s);
        float *g = frand(nb * 2048, -3, 3);
        double *e = malloc(nb * sizeof(double));
        train_block_sumsq_shard(g, nb * 2048, e);
        arg a[] = {{g, F(nb * 2048), 0}, {NULL, nb * sizeof(double), 2}};
        void *ea[MAXARGS] = {NULL, e};
        check("block_sumsq", s, k, g_sumsq, NULL, a, 2, ea, 1e-5);
        free(g), free(e);
    }
    {
        train_adamw_config cfg = TRAIN_ADAMW_CONFIG_INIT;
        train_tensor tt;
        memset(&tt, 0, sizeof tt);
        tt.numel = n;
        tt.decay = 1;
        const int64_t t = 3;
        const float lr = 7e-4f;
        float *p = frand(n, -1, 1), *m = frand(n, -0.1f, 0.1f), *v = frand(n, 0, 0.01f);
        float *g = frand(n, -1, 1);
        float *ep = dupmem(p, F(n)), *em = dupmem(m, F(n)), *ev = dupmem(v, F(n));
        train_adamw_update_shard(&cfg, &tt, 1, ep, em, ev, g, 0, n, t, lr);
        kern_adamw_args aa = {lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                              1.0f - powf(cfg.beta1, (float)t), 1.0f - powf(cfg.beta2, (float)t)};
        arg a[] = {{p, F(n), 1}, {m, F(n), 1}, {v, F(n), 1}, {g, F(n), 0}};
        void *ea[MAXARGS] = {ep, em, ev};
        check("adamw (bits vs train/optim.c)", s, k, g_adamw, &aa, a, 4, ea, 0.0);
        free(p), free(m), free(v), free(g), free(ep), free(em), free(ev);
    }
    {
        static const int ranks[] = {3, 1, 2, 4, 7, 8};
        /* the element-wise-only shape: one rank count (its buffers are nranks x 64 MiB) */
        const size_t nranks_checked = s->n ? 1 : sizeof ranks / sizeof ranks[0];
        for (size_t ri = 0; ri < nranks_checked; ri++) {
            for (int inplace = 0; inplace < 2; inplace++) {
                tree_args ta = {n, n + 5, ranks[ri], inplace};
                float *in = frand(ta.stride * (size_t)ta.nranks, -1, 1);
                float *e = malloc(F(n)), *eo = dupmem(in, F(ta.stride * (size_t)ta.nranks));
                for (size_t i = 0; i < n; i++) e[i] = ref_tree(in + i, ta.stride, ta.nranks);
                memcpy(eo, e, F(n)); /* in place: rank 0's row becomes the sum */
                char name[64];
                snprintf(name, sizeof name, "rank_tree_sum nranks=%d%s", ta.nranks,
                         inplace ? " in place" : "");
                if (inplace) {
                    arg a[] = {{NULL, 4, 0}, {in, F(ta.stride * (size_t)ta.nranks), 1}};
                    void *ea[MAXARGS] = {NULL, eo};
                    check(name, s, k, g_tree, &ta, a, 2, ea, 0.0);
                } else {
                    arg a[] = {{NULL, F(n), 1}, {in, F(ta.stride * (size_t)ta.nranks), 0}};
                    void *ea[MAXARGS] = {e};
                    check(name, s, k, g_tree, &ta, a, 2, ea, 0.0);
                }
                free(in), free(e), free(eo);
            }
        }
    }
    {
        const size_t nbytes = n * 4;
        uint8_t *in = (uint8_t *)frand(n, -1e3f, 1e3f), *e = malloc(nbytes);
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < 4; j++) e[j * n + i] = in[4 * i + j];
        arg a[] = {{NULL, nbytes, 3}, {in, nbytes, 0}};
        void *ea[MAXARGS] = {e};
        check("shuffle4", s, k, g_shuffle, NULL, a, 2, ea, 0.0);
        free(in), free(e);
    }
    free(x), free(y), free(z);
}

int main(void)
{
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev < 1) {
        printf("SKIP: no CUDA device (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
        return 77;
    }
    const char *seed_env = getenv("KERNEL_CHECK_SEED");
    uint64_t seed = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL) ^ (uint64_t)getpid();
    rng_state = seed ? seed : 1;
    printf("kernel_check: seed %llu (KERNEL_CHECK_SEED), %d device(s); err = max|gpu-cpu| / "
           "max(max|cpu|, 1e-30) per output, worst output\n",
           (unsigned long long)seed, ndev);
    /* non-blocking, as the trainer's compute stream (device_cuda.c): the legacy stream does
     * not order it, so every upload and download goes through it too */
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        printf("FAIL: cudaStreamCreateWithFlags\n");
        return 1;
    }
    kern_ops k, kb;
    int rc = kern_cuda_ops_init(&k, stream, 0);
    if (rc == 0) {
        rc = kern_cuda_ops_init(&kb, stream, 1);
        if (rc) kern_cuda_ops_free(&k);
    }
    if (rc) {
        printf("FAIL: kern_cuda_ops_init: %s\n", strerror(-rc));
        return 1;
    }
    /* head sizes 32, 32, 20 and 64; C = 100 not a multiple of 32; N = B*T = 515 more than two
     * chunks of 256 rows (the column-sum and LayerNorm partials); V = 50257 (GPT-2's), more
     * logits per row than the cross-entropy block has threads; the last shape, element-wise
     * only, longer than one grid of 65536 blocks of 256 threads covers (grid-stride loops) */
    static const shape shapes[] = {
        {2, 64, 128, 4, 512, 384, "B2 T64 C128 NH4 V512", 0},
        {3, 37, 96, 3, 509, 509, "B3 T37 C96 NH3 V509", 0},
        {5, 103, 100, 5, 50257, 300, "B5 T103 C100 NH5 V50257", 0},
        {2, 96, 256, 4, 1031, 768, "B2 T96 C256 NH4 V1031", 0},
        {0, 0, 0, 0, 0, 0, "n=16789563", ((size_t)1 << 24) + 12347},
    };
    const char *only = getenv("KERNEL_CHECK_SHAPES"); /* e.g. "0,4": the shapes to run */
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        char idx[8];
        snprintf(idx, sizeof idx, "%zu", i);
        if (only && !strstr(only, idx)) continue;
        if (shapes[i].B) check_model(&k, &kb, &shapes[i]);
        check_elementwise(&k, &shapes[i]);
    }
    int st = k.status(k.ctx), stb = kb.status(kb.ctx);
    printf("%-34s %-22s %s (fp32 %d, bf16 %d)\n", "status", "", st || stb ? "FAIL" : "PASS", st,
           stb);
    if (st || stb) failures++;
    kern_cuda_ops_free(&k);
    kern_cuda_ops_free(&kb);
    cudaStreamDestroy(stream);
    printf("kernel_check: %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
