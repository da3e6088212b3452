/* test_train_prefetch.c - train/prefetch: read-ahead batches equal synchronous reads (in
 * order, across epochs, after jumps), dataset errors reach the get that asks, free does not
 * wait for the read-ahead, and a slow consumer finds its batch already read. */
#include "data.h"
#include "prefetch.h"
#include "t_helpers.h"
#include "t_shard.h"

#include <stdint.h>
#include <sys/stat.h>

#define SEED 4242u

/* A valid shard of ntok tokens that differ from shard to shard and position to position. */
static void make_shard(const char *path, int tag, size_t ntok, int vocab)
{
    uint16_t *tok = malloc(2 * ntok);
    T_REQUIRE(tok, "malloc");
    for (size_t i = 0; i < ntok; i++)
        tok[i] = (uint16_t)(((((uint64_t)i + 1) * 2654435761u + (uint64_t)tag * 40503u) >> 7) %
                            (uint64_t)vocab);
    T_REQUIRE(write_shard(path, TRAIN_SHARD_MAGIC, TRAIN_SHARD_VERSION, (int32_t)ntok, tok, ntok) == 0,
              "write %s", path);
    free(tok);
}

static train_dataset *open_ds(const char *glob, int T, int vocab)
{
    train_dataset *d = NULL;
    char why[512] = "";
    int rc = train_dataset_open(&d, glob, T, vocab, why, sizeof why);
    T_REQUIRE(rc == 0, "open %s: %d %s", glob, rc, why);
    return d;
}

/* The batch read synchronously: the reference. */
typedef struct batch {
    int32_t *in, *tg;
    uint64_t *idx;
} batch;

static batch batch_new(int count, int T)
{
    batch b = {malloc((size_t)count * (size_t)T * 4), malloc((size_t)count * (size_t)T * 4),
               malloc((size_t)count * 8)};
    T_REQUIRE(b.in && b.tg && b.idx, "malloc");
    return b;
}

static void batch_free(batch *b)
{
    free(b->in);
    free(b->tg);
    free(b->idx);
}

static int sync_read(train_dataset *d, uint64_t first, int count, int T, batch *b, char *why,
                     size_t why_len)
{
    for (int j = 0; j < count; j++) {
        int64_t ix = train_dataset_order(d, SEED, first + (uint64_t)j);
        if (ix < 0) return (int)ix;
        b->idx[j] = (uint64_t)ix;
        int rc = train_dataset_sample(d, (uint64_t)ix, b->in + (size_t)j * (size_t)T,
                                      b->tg + (size_t)j * (size_t)T, why, why_len);
        if (rc < 0) return rc;
    }
    return 0;
}

static int batch_equal(const batch *a, const batch *b, int count, int T)
{
    size_t n = (size_t)count * (size_t)T * 4;
    return memcmp(a->in, b->in, n) == 0 && memcmp(a->tg, b->tg, n) == 0 &&
           memcmp(a->idx, b->idx, (size_t)count * 8) == 0;
}

/* (1) in-order gets of W ranks equal the synchronous reads over many epoch boundaries;
 * (2) jumps back and forward (a resume) return the right data. */
static void small_equality(const char *base)
{
    enum { T = 8, COUNT = 5, W = 3, STEPS = 25 };
    char *dir = t_path_in(base, "small");
    T_REQUIRE(mkdir(dir, 0755) == 0, "mkdir");
    char *s0 = t_path_in(dir, "train_000000.bin"), *s1 = t_path_in(dir, "train_000001.bin");
    make_shard(s0, 0, 8 * 20 + 1, 300); /* 20 samples */
    make_shard(s1, 1, 8 * 17 + 3, 300); /* 17 samples: 37 in all, so batches straddle epochs */
    char *glob = t_path_in(dir, "train_*.bin");
    train_dataset *ref = open_ds(glob, T, 300);
    batch want = batch_new(COUNT, T), got = batch_new(COUNT, T);
    char why[512];
    const uint64_t stride = (uint64_t)W * COUNT;

    for (int depth = 1; depth <= 3; depth++) {
        for (int r = 0; r < W; r++) {
            train_dataset *d = open_ds(glob, T, 300);
            train_prefetch *p = NULL;
            int rc = train_prefetch_create(&p, d, SEED, T, COUNT, stride, depth);
            T_REQUIRE(rc == 0 && p, "create depth %d: %d", depth, rc);
            int ok = 1;
            for (int step = 0; step < STEPS; step++) {
                uint64_t first = (uint64_t)r * COUNT + (uint64_t)step * stride;
                T_REQUIRE(sync_read(ref, first, COUNT, T, &want, why, sizeof why) == 0, "sync %s", why);
                rc = train_prefetch_get(p, first, got.in, got.tg, got.idx, 10.0, why, sizeof why);
                ok &= rc == 0 && batch_equal(&want, &got, COUNT, T);
                if (step % 7 == 3) t_sleep_s(0.001); /* let the thread run ahead sometimes */
            }
            T_CHECK(ok, "depth %d rank %d: in-order gets differ from synchronous reads", depth, r);

            /* a resume: back to step 4, on for a while, then forward to step 40; a repeat of
             * the previous first; idx may be NULL */
            const int steps[] = {4, 5, 6, 7, 40, 41, 41, 2, 3, 0, 1, 2};
            ok = 1;
            for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
                uint64_t first = (uint64_t)r * COUNT + (uint64_t)steps[i] * stride;
                T_REQUIRE(sync_read(ref, first, COUNT, T, &want, why, sizeof why) == 0, "sync %s", why);
                memset(got.idx, 0, COUNT * 8);
                uint64_t *ip = i == 8 ? NULL : got.idx;
                rc = train_prefetch_get(p, first, got.in, got.tg, ip, 10.0, why, sizeof why);
                if (!ip) memcpy(got.idx, want.idx, COUNT * 8);
                T_CHECK(rc == 0 && batch_equal(&want, &got, COUNT, T),
                        "depth %d rank %d: jump to step %d: rc %d", depth, r, steps[i], rc);
            }
            train_prefetch_free(p);
            train_dataset_close(d);
        }
    }
    batch_free(&got);
    batch_free(&want);
    train_dataset_close(ref);
    free(glob);
    free(s1);
    free(s0);
    free(dir);
}

static void bad_arguments(const char *base)
{
    char *p0 = t_path_in(base, "args_000000.bin");
    make_shard(p0, 3, 8 * 10 + 1, 256);
    train_dataset *d = open_ds(p0, 8, 256);
    train_prefetch *p = (train_prefetch *)1;
    T_CHECK(train_prefetch_create(&p, NULL, 1, 8, 4, 4, 2) == -EINVAL && !p, "NULL ds");
    T_CHECK(train_prefetch_create(NULL, d, 1, 8, 4, 4, 2) == -EINVAL, "NULL out");
    T_CHECK(train_prefetch_create(&p, d, 1, 0, 4, 4, 2) == -EINVAL, "seq_len 0");
    T_CHECK(train_prefetch_create(&p, d, 1, 8, 0, 4, 2) == -EINVAL, "count 0");
    T_CHECK(train_prefetch_create(&p, d, 1, 8, 4, 0, 2) == -EINVAL, "stride 0");
    T_CHECK(train_prefetch_create(&p, d, 1, 8, 4, 4, 0) == -EINVAL, "depth 0");
    T_CHECK(train_prefetch_create(&p, d, 1, 1 << 30, 1 << 30, 4, 1 << 30) == -EINVAL, "size overflow");
    T_REQUIRE(train_prefetch_create(&p, d, 1, 8, 4, 4, 2) == 0, "create");
    int32_t in[32], tg[32];
    T_CHECK(train_prefetch_get(NULL, 0, in, tg, NULL, 1, NULL, 0) == -EINVAL, "NULL p");
    T_CHECK(train_prefetch_get(p, 0, NULL, tg, NULL, 1, NULL, 0) == -EINVAL, "NULL inputs");
    T_CHECK(train_prefetch_get(p, 0, in, NULL, NULL, 1, NULL, 0) == -EINVAL, "NULL targets");
    T_CHECK(train_prefetch_get(p, 0, in, tg, NULL, -1, NULL, 0) == -EINVAL, "negative timeout");
    T_CHECK(train_prefetch_get(p, 0, in, tg, NULL, NAN, NULL, 0) == -EINVAL, "NaN timeout");
    T_CHECK(train_prefetch_get(p, 0, in, tg, NULL, 1e300, NULL, 0) == 0, "huge timeout");
    train_prefetch_free(p);
    train_prefetch_free(NULL);
    /* freed right after create, the thread never having had work */
    T_REQUIRE(train_prefetch_create(&p, d, 1, 8, 4, 4, 2) == 0, "create");
    train_prefetch_free(p);
    train_dataset_close(d);
    free(p0);
}

/* (3) a shard cut under the running prefetcher: the get that asks for an unreadable batch
 * returns the dataset's -EIO and reason, no hang, and batches read before the cut are intact. */
static void dataset_errors(const char *base)
{
    enum { T = 8, COUNT = 8, DEPTH = 2, N = 24 };
    char why[512];
    batch want = batch_new(COUNT, T), got = batch_new(COUNT, T);

    /* cut before the first get */
    char *p0 = t_path_in(base, "cut_000000.bin");
    make_shard(p0, 5, 8 * N + 1, 256);
    train_dataset *d = open_ds(p0, T, 256), *ref = open_ds(p0, T, 256);
    train_prefetch *p = NULL;
    T_REQUIRE(train_prefetch_create(&p, d, SEED, T, COUNT, COUNT, DEPTH) == 0, "create");
    T_REQUIRE(truncate(p0, HDR_BYTES + 100) == 0, "truncate"); /* samples 0..5 still whole */
    char rwhy[512] = "";
    int want_rc = sync_read(ref, 0, COUNT, T, &want, rwhy, sizeof rwhy);
    T_CHECK(want_rc == -EIO, "the reference read does not fail: %d", want_rc);
    why[0] = '\0';
    double t0 = t_now_s();
    int rc = train_prefetch_get(p, 0, got.in, got.tg, got.idx, 10.0, why, sizeof why);
    double dt = t_now_s() - t0;
    T_CHECK(rc == -EIO && strstr(why, "cut_000000.bin") && dt < 5, "cut before get: %d in %.3f s: %s",
            rc, dt, why);
    T_CHECK(strcmp(why, rwhy) == 0, "why differs from the synchronous one:\n  %s\n  %s", why, rwhy);
    /* the next get reads afresh and fails again (the file is still cut), promptly */
    why[0] = '\0';
    rc = train_prefetch_get(p, COUNT, got.in, got.tg, got.idx, 10.0, why, sizeof why);
    T_CHECK(rc == -EIO && strstr(why, "cut_000000.bin"), "second get after the cut: %d %s", rc, why);
    train_prefetch_free(p);
    train_dataset_close(ref);
    train_dataset_close(d);
    unlink(p0);

    /* cut mid-stream: gets before the error equal what the file held; the error comes within
     * depth + 1 gets (what was read ahead, the batch in flight, then the first read after) */
    make_shard(p0, 6, 8 * N + 1, 256);
    d = open_ds(p0, T, 256);
    ref = open_ds(p0, T, 256);
    enum { STEPS = 6 };
    batch pre[STEPS];
    for (int s = 0; s < STEPS; s++) {
        pre[s] = batch_new(COUNT, T);
        T_REQUIRE(sync_read(ref, (uint64_t)s * COUNT, COUNT, T, &pre[s], why, sizeof why) == 0, "pre");
    }
    T_REQUIRE(train_prefetch_create(&p, d, SEED, T, COUNT, COUNT, DEPTH) == 0, "create");
    rc = train_prefetch_get(p, 0, got.in, got.tg, got.idx, 10.0, why, sizeof why);
    T_CHECK(rc == 0 && batch_equal(&pre[0], &got, COUNT, T), "first batch before the cut: %d", rc);
    T_REQUIRE(truncate(p0, HDR_BYTES + 100) == 0, "truncate");
    int err_at = -1;
    for (int s = 1; s < STEPS && err_at < 0; s++) {
        why[0] = '\0';
        t0 = t_now_s();
        rc = train_prefetch_get(p, (uint64_t)s * COUNT, got.in, got.tg, got.idx, 10.0, why, sizeof why);
        dt = t_now_s() - t0;
        T_CHECK(dt < 5, "get %d took %.3f s", s, dt);
        if (rc == 0) {
            T_CHECK(batch_equal(&pre[s], &got, COUNT, T), "batch %d read before the cut differs", s);
        } else {
            err_at = s;
            T_CHECK(rc == -EIO && strstr(why, "cut_000000.bin") && strstr(why, "changed while training"),
                    "get %d after the cut: %d %s", s, rc, why);
        }
    }
    printf("cut mid-stream: first error at get %d (depth %d)\n", err_at, DEPTH);
    T_CHECK(err_at >= 1 && err_at <= DEPTH + 1, "error at get %d, want 1..%d", err_at, DEPTH + 1);
    train_prefetch_free(p);
    for (int s = 0; s < STEPS; s++) batch_free(&pre[s]);
    train_dataset_close(ref);
    train_dataset_close(d);
    batch_free(&got);
    batch_free(&want);
    free(p0);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* (4) free while the thread reads ahead; -ETIMEDOUT and its retry; (5) a slow consumer finds
 * its batch read: get time well under a synchronous read. */
static void timing(const char *base)
{
    enum { T = 8, N = 65536, COUNT = 16384, BIG = 65536, DEPTH = 2 };
    char *p0 = t_path_in(base, "big_000000.bin");
    make_shard(p0, 7, (size_t)T * N + 1, 65536);
    train_dataset *ref = open_ds(p0, T, 65536);
    char why[512] = "";
    batch want = batch_new(BIG, T), got = batch_new(BIG, T);

    /* the synchronous time of a batch (the epoch's permutation computed beforehand) */
    T_REQUIRE(sync_read(ref, 0, 1, T, &want, why, sizeof why) == 0, "warm: %s", why);
    double st[4];
    for (int s = 0; s < 4; s++) {
        double t0 = t_now_s();
        T_REQUIRE(sync_read(ref, (uint64_t)s * COUNT, COUNT, T, &want, why, sizeof why) == 0, "%s", why);
        st[s] = t_now_s() - t0;
    }
    double sync_t = median(st, 4); /* medians: the machine may be shared with other jobs */

    /* (5): sleep twice a batch's read time between gets */
    train_dataset *d = open_ds(p0, T, 65536);
    train_prefetch *p = NULL;
    T_REQUIRE(train_prefetch_create(&p, d, SEED, T, COUNT, COUNT, DEPTH) == 0, "create");
    double t0 = t_now_s();
    int rc = train_prefetch_get(p, 0, got.in, got.tg, got.idx, 30.0, why, sizeof why);
    double first_t = t_now_s() - t0;
    T_CHECK(rc == 0, "first get: %d %s", rc, why);
    enum { GETS = 8 };
    double gt[GETS], max = 0;
    int ok = 1;
    for (int s = 1; s <= GETS; s++) { /* crosses epochs 0 -> 1 -> 2 */
        t_sleep_s(2 * sync_t + 0.005);
        t0 = t_now_s();
        rc = train_prefetch_get(p, (uint64_t)s * COUNT, got.in, got.tg, got.idx, 30.0, why, sizeof why);
        double dt = t_now_s() - t0;
        gt[s - 1] = dt;
        if (dt > max) max = dt;
        T_REQUIRE(sync_read(ref, (uint64_t)s * COUNT, COUNT, T, &want, why, sizeof why) == 0, "%s", why);
        ok &= rc == 0 && batch_equal(&want, &got, COUNT, T);
    }
    double get_t = median(gt, GETS);
    printf("batch of %d x %d tokens: synchronous read %.3f ms (median of 4), first get %.3f ms, "
           "prefetched get %.3f ms (median of %d, max %.3f ms) = %.1f%% of synchronous\n",
           COUNT, T, sync_t * 1e3, first_t * 1e3, get_t * 1e3, GETS, max * 1e3,
           100 * get_t / sync_t);
    T_CHECK(ok, "prefetched batches differ from synchronous reads");
    T_CHECK(sync_t >= 0.002, "a synchronous batch read takes %.3f ms, too fast to show anything",
            sync_t * 1e3);
    T_CHECK(get_t < 0.5 * sync_t, "get %.3f ms is not under half a synchronous read %.3f ms",
            get_t * 1e3, sync_t * 1e3);

    /* -ETIMEDOUT: a poll right after a jump normally finds nothing (unless this thread was
     * descheduled long enough for the read to finish: then it must deliver the right batch);
     * the same get then succeeds */
    uint64_t jump = 3 * (uint64_t)N + 5;
    T_REQUIRE(sync_read(ref, jump, COUNT, T, &want, why, sizeof why) == 0, "%s", why);
    rc = train_prefetch_get(p, jump, got.in, got.tg, got.idx, 0, why, sizeof why);
    T_CHECK(rc == -ETIMEDOUT || (rc == 0 && batch_equal(&want, &got, COUNT, T)),
            "poll after a jump: %d", rc);
    if (rc == -ETIMEDOUT) {
        rc = train_prefetch_get(p, jump, got.in, got.tg, got.idx, 30.0, why, sizeof why);
        T_CHECK(rc == 0 && batch_equal(&want, &got, COUNT, T), "retry after -ETIMEDOUT: %d", rc);
    }
    train_prefetch_free(p);
    train_dataset_close(d);

    /* (4): whole-epoch batches, depth 3: after the first get the thread has two batches of
     * reading to do; free must not wait for them */
    d = open_ds(p0, T, 65536);
    T_REQUIRE(train_prefetch_create(&p, d, SEED, T, BIG, BIG, 3) == 0, "create big");
    t0 = t_now_s();
    rc = train_prefetch_get(p, 0, got.in, got.tg, NULL, 60.0, why, sizeof why);
    double big_t = t_now_s() - t0;
    T_CHECK(rc == 0, "big get: %d %s", rc, why);
    t0 = t_now_s();
    train_prefetch_free(p);
    double free_t = t_now_s() - t0;
    printf("free with the thread reading a batch of %d x %d (a first get took %.3f ms): %.3f ms\n",
           BIG, T, big_t * 1e3, free_t * 1e3);
    T_CHECK(free_t < 0.25 * big_t, "free took %.3f ms, a batch read %.3f ms", free_t * 1e3,
            big_t * 1e3);
    train_dataset_close(d);

    batch_free(&got);
    batch_free(&want);
    train_dataset_close(ref);
    free(p0);
}

int main(void)
{
    char *base = t_tmpdir("train-prefetch");
    small_equality(base);
    bad_arguments(base);
    dataset_errors(base);
    timing(base);
    t_rmrf(base);
    free(base);
    return t_done("test_train_prefetch");
}
