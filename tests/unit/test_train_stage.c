/* train/stage.c over the CPU device layer (whose streams are worker threads, so copies and
 * events really are asynchronous). Covers: a shard in device memory staged through the
 * stager's copier gives files equal to ckpt_engine_stage of the same bytes, with the device
 * buffers overwritten right after train_stager_wait_all; train_stage_restore of whole
 * buffers and of ranges, for sizes that are not multiples of the slice, equal bytes; a
 * failing read stops the restore with its error; tickets: several threads wait at once while
 * copies are queued, bytes in place when a wait returns, unknown tickets refused, events
 * recycled over many copies; wait_all times out while the stream is held, then succeeds.
 *
 * TRAIN_STAGE_TEST_DEVICE=cuda (or cuda:N) runs the same checks on a GPU (exit 77 without
 * one); the default is the CPU device.
 */
#include "ckpt.h"
#include "device.h"
#include "stage.h"
#include "t_helpers.h"

#include <dirent.h>
#include <pthread.h>
#include <stdint.h>

#define CHUNK (64u << 10)

static uint64_t rng_state = 7;
static uint32_t rnd(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

static void fill(float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = scale * ((float)(rnd() % 2001) - 1000.0f) / 1000.0f;
}


static void sleep_ms(void *ctx)
{
    usleep((useconds_t)(intptr_t)ctx * 1000u);
}

/* ------------------------------------------------------------------ stage + restore */

typedef struct fail_read {
    ckpt_snapshot *s;
    int calls, fail_at;
} fail_read;

static int read_or_fail(void *ctx, uint64_t offset, uint64_t len, void *host_dst)
{
    fail_read *f = ctx;
    if (++f->calls == f->fail_at) return -EBADMSG;
    return ckpt_snapshot_read(f->s, "params", offset, len, host_dst, NULL, 0);
}

/* A slow source whose copies are slow too: each read sleeps, and puts a sleep on the copy
 * stream ahead of its slice's copy. */
typedef struct slow_read {
    train_stager *st;
    const uint8_t *src;
    int ms, calls;
} slow_read;

static int read_slow(void *ctx, uint64_t offset, uint64_t len, void *host_dst)
{
    slow_read *r = ctx;
    r->calls++;
    usleep((useconds_t)r->ms * 1000u);
    memcpy(host_dst, r->src + offset, len);
    return train_stream_host_fn(train_stager_stream(r->st), sleep_ms, (void *)(intptr_t)r->ms);
}

static void test_stage_and_restore(train_device *dev, const char *root)
{
    const size_t np = 300007, nm = 70001; /* floats: neither a multiple of chunk or slice */
    float *hp = malloc(np * 4), *hm = malloc(nm * 4), *back = malloc(np * 4);
    fill(hp, np, 0.02f);
    fill(hm, nm, 0.001f);
    void *dp, *dm, *dr;
    T_REQUIRE(train_device_alloc(dev, &dp, np * 4) == 0 && train_device_alloc(dev, &dm, nm * 4) == 0 &&
                  train_device_alloc(dev, &dr, np * 4) == 0,
              "device buffers");
    T_REQUIRE(train_device_copy(dev, dp, hp, np * 4, TRAIN_COPY_H2D) == 0 &&
                  train_device_copy(dev, dm, hm, nm * 4, TRAIN_COPY_H2D) == 0,
              "upload");

    char ref[4200], got[4200];
    snprintf(ref, sizeof ref, "%s/ref", root);
    snprintf(got, sizeof got, "%s/dev", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = ref;
    eo.save.chunk_bytes = CHUNK;
    eo.save.filter = CKPT_FILTER_SHUFFLE;
    eo.threads = 2;
    ckpt_buffer hb[2] = {{"params", "f32", 4, np * 4, 0, np * 4, hp},
                         {"adam_m", "f32", 4, nm * 4, 0, nm * 4, hm}};
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "reference engine");
    T_CHECK(ckpt_engine_stage(e, 3, "run", "cfg", hb, 2, "{\"s\":3}", NULL) == 0, "reference stage");
    T_CHECK(ckpt_engine_destroy(e) == 0, "reference committed");

    train_stager *st;
    T_REQUIRE(train_stager_create(&st, dev, 30.0) == 0, "stager");
    ckpt_copier cp;
    train_stager_copier(st, &cp);
    eo.save.dir = got;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "device engine");
    ckpt_buffer db[2] = {{"params", "f32", 4, np * 4, 0, np * 4, dp},
                         {"adam_m", "f32", 4, nm * 4, 0, nm * 4, dm}};
    /* hold the copy stream a moment, so the persist really follows the copies */
    T_CHECK(train_stream_host_fn(train_stager_stream(st), sleep_ms, (void *)(intptr_t)100) == 0, "hold");
    T_CHECK(train_stager_after_compute(st) == 0, "copies ordered after the compute stream");
    uint64_t last = 0;
    double stall = -1;
    T_CHECK(ckpt_engine_stage_device(e, 3, "run", "cfg", db, 2, "{\"s\":3}", &cp, &last, &stall) == 0,
            "stage_device");
    uint64_t nchunks = (np * 4 + CHUNK - 1) / CHUNK + (nm * 4 + CHUNK - 1) / CHUNK;
    T_CHECK(last == nchunks && train_stager_tickets(st) == nchunks, "one ticket per chunk: %llu",
            (unsigned long long)last);
    T_CHECK(stall < 0.08, "stall %.1f ms: queueing only, not the held copies", stall * 1e3);
    T_CHECK(train_stager_wait_all(st, 30) == 0, "wait_all before the next update");
    /* the next optimizer update overwrites the shard */
    float zero[1024] = {0};
    for (size_t off = 0; off < np * 4; off += sizeof zero)
        train_device_copy(dev, (uint8_t *)dp + off, zero, np * 4 - off < sizeof zero ? np * 4 - off : sizeof zero,
                          TRAIN_COPY_H2D);
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "device persist committed");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy engine");
    const char *files[] = {"rank-00000.bin"};
    char pa[4400], pb[4400];
    snprintf(pa, sizeof pa, "%s/step-000000003/%s", ref, files[0]);
    snprintf(pb, sizeof pb, "%s/step-000000003/%s", got, files[0]);
    T_CHECK(t_file_equal(pa, pb), "data file equals ckpt_engine_stage's");

    /* restore into device memory */
    ckpt_snapshot *s;
    snprintf(pa, sizeof pa, "%s/step-000000003", got);
    T_REQUIRE(ckpt_snapshot_open(&s, pa, NULL, 0) == 0, "open");
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify");
    const size_t slices[] = {100000, 4096, 0, (size_t)np * 4 + 1};
    for (size_t k = 0; k < sizeof slices / sizeof slices[0]; k++) {
        T_CHECK(train_device_zero(dev, dr, np * 4) == 0, "zero"); /* the restore follows it */
        int rc = train_stage_restore(st, s, "params", 0, np * 4, dr, slices[k]);
        memset(back, 0xee, np * 4);
        train_device_copy(dev, back, dr, np * 4, TRAIN_COPY_D2H);
        T_CHECK(rc == 0 && memcmp(back, hp, np * 4) == 0, "restore with slice %zu: rc %d, equal bytes",
                slices[k], rc);
    }
    /* a range across chunk boundaries, odd offset and length */
    const uint64_t off = 12345, len = 777777;
    memset(back, 0, np * 4);
    T_CHECK(train_device_zero(dev, dr, np * 4) == 0, "zero");
    T_CHECK(train_stage_restore(st, s, "params", off, len, dr, 65536 + 8) == 0, "range restore");
    train_device_copy(dev, back, dr, len, TRAIN_COPY_D2H);
    T_CHECK(memcmp(back, (uint8_t *)hp + off, len) == 0, "range bytes equal");
    T_CHECK(train_stage_restore(st, s, "adam_m", 0, nm * 4, dr, 50000) == 0, "adam_m restore");
    train_device_copy(dev, back, dr, nm * 4, TRAIN_COPY_D2H);
    T_CHECK(memcmp(back, hm, nm * 4) == 0, "adam_m bytes equal");
    T_CHECK(train_stage_restore(st, s, "nope", 0, 16, dr, 0) == -ENOENT, "no such buffer");
    T_CHECK(train_stage_restore(st, s, "params", np * 4 - 8, 16, dr, 0) == -EINVAL, "past the end");
    T_CHECK(train_stage_restore(st, s, "params", 0, 0, dr, 0) == 0, "len 0 does nothing");
    T_CHECK(train_stage_restore(st, NULL, "params", 0, 16, dr, 0) == -EINVAL, "NULL snapshot");
    fail_read fr = {s, 0, 3};
    T_CHECK(train_stage_restore_fn(st, read_or_fail, &fr, 0, np * 4, dr, 100000) == -EBADMSG && fr.calls == 3,
            "a failing read stops the restore with its error (%d reads)", fr.calls);
    fr.calls = 0;
    fr.fail_at = 0;
    T_CHECK(train_stage_restore_fn(st, read_or_fail, &fr, 0, np * 4, dr, 100000) == 0 &&
                fr.calls == (int)((np * 4 + 99999) / 100000),
            "one read per slice (%d)", fr.calls);
    ckpt_snapshot_close(s);

    /* reading slice k + 1 overlaps the copy of slice k: 8 slices, 25 ms to read and 25 ms to
     * copy each: about 9 x 25 ms overlapped, 16 x 25 ms one after the other */
    slow_read sr = {st, (const uint8_t *)hm, 25, 0};
    T_CHECK(train_device_zero(dev, dr, nm * 4) == 0, "zero");
    double t0 = t_now_s();
    size_t slice = (nm * 4 + 7) / 8;
    T_CHECK(train_stage_restore_fn(st, read_slow, &sr, 0, nm * 4, dr, slice) == 0 && sr.calls == 8, "slow restore");
    double took = t_now_s() - t0;
    train_device_copy(dev, back, dr, nm * 4, TRAIN_COPY_D2H);
    T_CHECK(memcmp(back, hm, nm * 4) == 0, "slow restore bytes equal");
    T_CHECK(took < 0.8 * 16 * 0.025 && took >= 8 * 0.025, "reads overlapped the copies: %.0f ms (serial %.0f ms)",
            took * 1e3, 16 * 25.0);
    T_CHECK(train_stager_destroy(st) == 0, "destroy stager");
    train_device_free(dev, dp);
    train_device_free(dev, dm);
    train_device_free(dev, dr);
    free(hp);
    free(hm);
    free(back);
}

/* ------------------------------------------------------------------ tickets */

#define NT 64
#define BYTES 4096

typedef struct waiter {
    train_stager *st;
    uint8_t (*dst)[BYTES];
    const uint8_t (*src)[BYTES];
    uint64_t *tickets; /* filled by the main thread; 0 until handed out */
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int from, rc, wrong;
} waiter;

static void *waiter_main(void *arg)
{
    waiter *w = arg;
    for (int i = w->from; i < NT; i += 4) {
        pthread_mutex_lock(w->mu);
        while (!w->tickets[i]) pthread_cond_wait(w->cv, w->mu);
        uint64_t t = w->tickets[i];
        pthread_mutex_unlock(w->mu);
        int rc = train_stager_wait(w->st, t, 30);
        if (rc < 0 && w->rc == 0) w->rc = rc;
        /* ticket done: that copy's bytes are in place */
        if (rc == 0 && memcmp(w->dst[i], w->src[i], BYTES) != 0) w->wrong++;
    }
    return NULL;
}

static void test_tickets(train_device *dev)
{
    train_stager *st;
    T_REQUIRE(train_stager_create(&st, dev, 30.0) == 0, "stager");
    static uint8_t src[NT][BYTES];
    uint8_t (*dst)[BYTES];
    T_REQUIRE(train_host_alloc_pinned(dev, (void **)&dst, (size_t)NT * BYTES) == 0, "pinned destination");
    for (int i = 0; i < NT; i++)
        for (int j = 0; j < BYTES; j++) src[i][j] = (uint8_t)(i * 31 + j);
    void *dsrc;
    T_REQUIRE(train_device_alloc(dev, &dsrc, sizeof src) == 0, "device source");
    T_REQUIRE(train_device_copy(dev, dsrc, src, sizeof src, TRAIN_COPY_H2D) == 0, "upload");
    uint64_t tickets[NT] = {0}, t = 0;
    T_CHECK(train_stager_wait(st, 0, 1) == -EINVAL && train_stager_wait(st, 1, 1) == -EINVAL,
            "tickets not handed out are refused");
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    waiter w[4];
    pthread_t th[4];
    for (int k = 0; k < 4; k++) {
        w[k] = (waiter){st, dst, (const uint8_t (*)[BYTES])src, tickets, &mu, &cv, k, 0, 0};
        T_REQUIRE(pthread_create(&th[k], NULL, waiter_main, &w[k]) == 0, "waiter");
    }
    int rc = 0;
    for (int i = 0; i < NT && rc == 0; i++) {
        if (i % 8 == 0) train_stream_host_fn(train_stager_stream(st), sleep_ms, (void *)(intptr_t)5);
        rc = train_stager_copy(st, dst[i], (uint8_t *)dsrc + (size_t)i * BYTES, BYTES, &t);
        pthread_mutex_lock(&mu);
        tickets[i] = t;
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    T_CHECK(rc == 0 && t == NT, "%d copies queued, last ticket %llu", NT, (unsigned long long)t);
    for (int k = 0; k < 4; k++) {
        pthread_join(th[k], NULL);
        T_CHECK(w[k].rc == 0 && w[k].wrong == 0, "waiter %d: rc %d, %d copies not in place", k, w[k].rc,
                w[k].wrong);
    }
    T_CHECK(train_stager_wait(st, 1, 1) == 0, "an old (recycled) ticket is done");
    T_CHECK(train_stager_wait(st, NT + 1, 1) == -EINVAL, "a future ticket is refused");

    /* many copies, each waited for: events are recycled (the run stays small and fast) */
    for (int i = 0; i < 2000 && rc == 0; i++) {
        rc = train_stager_copy(st, dst[i % NT], (uint8_t *)dsrc + (size_t)(i % NT) * BYTES, BYTES, &t);
        if (rc == 0) rc = train_stager_wait(st, t, 30);
    }
    T_CHECK(rc == 0 && t == NT + 2000, "2000 more copies: rc %d, ticket %llu", rc, (unsigned long long)t);

    /* wait_all is bounded */
    T_CHECK(train_stream_host_fn(train_stager_stream(st), sleep_ms, (void *)(intptr_t)300) == 0, "hold");
    T_CHECK(train_stager_copy(st, dst[0], dsrc, BYTES, &t) == 0, "copy behind the hold");
    T_CHECK(train_stager_wait(st, t, 0.05) == -ETIMEDOUT, "wait times out while held");
    T_CHECK(train_stager_wait_all(st, 0.05) == -ETIMEDOUT, "wait_all times out while held");
    T_CHECK(train_stager_wait_all(st, 30) == 0, "then completes");
    T_CHECK(train_stager_copy(NULL, dst[0], dsrc, BYTES, &t) == -EINVAL, "NULL stager");
    train_stager *bad = (train_stager *)1;
    T_CHECK(train_stager_create(&bad, dev, 0) == -EINVAL && bad == NULL, "timeout 0 refused");
    T_CHECK(train_stager_create(&bad, NULL, 1) == -EINVAL, "NULL device refused");
    train_device_free(dev, dsrc);
    T_CHECK(train_stager_destroy(st) == 0, "destroy");
    train_host_free_pinned(dev, dst);
}

int main(void)
{
    train_device *dev;
    char why[256] = "";
    const char *want = getenv("TRAIN_STAGE_TEST_DEVICE");
    train_device_kind kind = TRAIN_DEVICE_CPU;
    int ordinal = 0;
    if (want && *want && train_device_parse(want, &kind, &ordinal) < 0) {
        fprintf(stderr, "TRAIN_STAGE_TEST_DEVICE=%s: not a device\n", want);
        return 1;
    }
    int rc = train_device_open(&dev, kind, ordinal, why, sizeof why);
    if (rc < 0) {
        fprintf(stderr, "%s: %s (%d)\n", want ? want : "cpu", why, rc);
        return kind == TRAIN_DEVICE_CUDA ? 77 : 1; /* no GPU here: skip */
    }
    printf("device: %s\n", train_device_describe(dev));
    char *root = t_tmpdir("train-stage");
    test_stage_and_restore(dev, root);
    test_tickets(dev);
    train_device_close(dev);
    t_rmrf(root);
    free(root);
    return t_done("test_train_stage");
}
