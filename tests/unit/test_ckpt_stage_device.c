/* ckpt_engine_stage_device: staging from "device" memory through a copier whose copies run
 * later, on a thread of this test, each after a delay (a slow DMA), so that the persist really
 * has to follow them. Covers: files byte-identical to ckpt_engine_stage of the same bytes
 * (compressed with the shuffle filter, and stored raw); the stall is the time to queue the
 * copies, far below the copy time, while the persist lasts at least the copy time; the
 * workers waited for every chunk's ticket and started before the last copy ended; pin/unpin
 * once per allocation and balanced (reserve, reuse, grow, destroy); a copy failing at stage
 * time (-EIO, nothing staged, the copies queued before it finished, nothing committed); a
 * wait failing during the persist (negative result, no step folder, no temp folder); bad
 * copiers refused; a sharded snapshot of two in-process ranks staged from device memory
 * equal to the same group staged with ckpt_engine_stage.
 */
#include "ckpt.h"
#include "t_helpers.h"
#include "t_threads.h"

#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>

#define CHUNK (1u << 20)
#define N (600 * 1024) /* floats per buffer: 2.3 MiB, 3 chunks of 1 MiB */

/* ------------------------------------------------------------------ the test copier
 *
 * copy() queues (dst, src, n) and returns ticket 1, 2, ...; one thread performs the copies
 * in order, each after delay_ms; wait(t) blocks until copy t is done. */

#define QMAX 1024
#define TMAX 1024

typedef struct tcopy {
    void *dst;
    const void *src;
    size_t n;
} tcopy;

typedef struct tcopier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    int stop;
    tcopy q[QMAX];
    uint64_t queued, done; /* tickets 1..queued queued, 1..done done */
    int delay_ms;
    int fail_copy_at;          /* the n-th copy call (1-based) returns -EIO; 0 none */
    uint64_t fail_wait_ticket; /* waits on this ticket or later return -EIO; 0 none */
    int fail_pin;              /* pin returns this when non-zero */
    int copy_calls, waits, early_waits; /* early: returned while copies were still queued */
    unsigned char waited[TMAX];         /* tickets waited for */
    int pins, unpins;
    void *pin_base;
    size_t pin_bytes;
    double last_done_at;
} tcopier;

static void *tc_main(void *arg)
{
    tcopier *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && c->done == c->queued) pthread_cond_wait(&c->cv, &c->mu);
        if (c->done == c->queued && c->stop) break;
        tcopy j = c->q[c->done % QMAX];
        int delay = c->delay_ms;
        pthread_mutex_unlock(&c->mu);
        if (delay) usleep((useconds_t)delay * 1000u);
        memcpy(j.dst, j.src, j.n);
        pthread_mutex_lock(&c->mu);
        c->done++;
        c->last_done_at = t_now_s();
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void tc_init(tcopier *c, int delay_ms)
{
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->delay_ms = delay_ms;
    if (pthread_create(&c->th, NULL, tc_main, c) != 0) exit(1);
}

static void tc_fini(tcopier *c)
{
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->th, NULL);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
}

static int tc_pin(void *ctx, void *host, size_t bytes)
{
    tcopier *c = ctx;
    pthread_mutex_lock(&c->mu);
    int rc = c->fail_pin;
    if (!rc) {
        c->pins++;
        c->pin_base = host;
        c->pin_bytes = bytes;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void tc_unpin(void *ctx, void *host)
{
    tcopier *c = ctx;
    pthread_mutex_lock(&c->mu);
    if (host == c->pin_base) c->unpins++;
    else c->unpins += 1000; /* an unpin of memory that was not pinned: counted as wrong */
    pthread_mutex_unlock(&c->mu);
}

static int tc_copy(void *ctx, void *host_dst, const void *device_src, size_t bytes,
                   uint64_t *ticket)
{
    tcopier *c = ctx;
    pthread_mutex_lock(&c->mu);
    c->copy_calls++;
    if (c->fail_copy_at && c->copy_calls == c->fail_copy_at) {
        pthread_mutex_unlock(&c->mu);
        return -EIO;
    }
    if (c->queued - c->done >= QMAX) {
        pthread_mutex_unlock(&c->mu);
        return -EAGAIN;
    }
    c->q[c->queued % QMAX] = (tcopy){host_dst, device_src, bytes};
    *ticket = ++c->queued;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

static int tc_wait(void *ctx, uint64_t ticket, double timeout_s)
{
    tcopier *c = ctx;
    struct timespec ts;
    t_deadline_in(CLOCK_REALTIME, &ts, timeout_s);
    pthread_mutex_lock(&c->mu);
    c->waits++;
    if (ticket < TMAX) c->waited[ticket] = 1;
    int rc = 0;
    while (rc == 0 && c->done < ticket)
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT && c->done < ticket)
            rc = -ETIMEDOUT;
    /* a failing copy is reported when it completes, as a CUDA event's error would be */
    if (rc == 0 && c->fail_wait_ticket && ticket >= c->fail_wait_ticket) rc = -EIO;
    if (rc == 0 && c->done < c->queued) c->early_waits++;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static ckpt_copier copier_of(tcopier *c)
{
    ckpt_copier k = {c, tc_pin, tc_unpin, tc_copy, tc_wait, 30.0};
    return k;
}

static uint64_t tc_done(tcopier *c)
{
    pthread_mutex_lock(&c->mu);
    uint64_t d = c->done;
    pthread_mutex_unlock(&c->mu);
    return d;
}

/* ------------------------------------------------------------------ helpers */

static uint64_t rng_state = 42;
static uint32_t rnd(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

static void fill(float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = scale * ((float)(rnd() % 2001) - 1000.0f) / 1000.0f;
}


/* Manifests equal apart from created_unix and the checksum. */
static int manifest_equal(const char *a, const char *b)
{
    unsigned char *ua, *ub;
    t_slurp(a, &ua);
    t_slurp(b, &ub);
    char *ma = (char *)ua, *mb = (char *)ub;
    int eq = 0;
    if (ma && mb) {
        char *ca = strstr(ma, "\"created_unix\""), *cb = strstr(mb, "\"created_unix\"");
        char *ba = strstr(ma, "\"files\""), *bb = strstr(mb, "\"files\"");
        char *ea = strstr(ma, ",\"manifest_xxh3\""), *eb = strstr(mb, ",\"manifest_xxh3\"");
        eq = ca && cb && ba && bb && ea && eb && ca - ma == cb - mb &&
             memcmp(ma, mb, (size_t)(ca - ma)) == 0 && ea - ba == eb - bb &&
             memcmp(ba, bb, (size_t)(ea - ba)) == 0;
    }
    free(ma);
    free(mb);
    return eq;
}

/* Every file of the snapshot folder dirA/sub equals dirB/sub's (manifests up to the time). */
static int snapshot_equal(const char *dirA, const char *dirB, const char *sub)
{
    char pa[4400], pb[4400];
    snprintf(pa, sizeof pa, "%s/%s", dirA, sub);
    DIR *d = opendir(pa);
    if (!d) return 0;
    int eq = 1, files = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        files++;
        snprintf(pa, sizeof pa, "%s/%s/%s", dirA, sub, de->d_name);
        snprintf(pb, sizeof pb, "%s/%s/%s", dirB, sub, de->d_name);
        int same = !strcmp(de->d_name, "manifest.json") ? manifest_equal(pa, pb) : t_file_equal(pa, pb);
        if (!same) {
            fprintf(stderr, "differs: %s\n", pb);
            eq = 0;
        }
    }
    closedir(d);
    return eq && files > 0;
}

/* Entries of dir whose name starts with prefix. */
static int count_prefix(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, prefix, strlen(prefix))) n++;
    closedir(d);
    return n;
}

/* ------------------------------------------------------------------ tests */

/* Same files as ckpt_engine_stage; the stall is the queueing; the persist follows the copies. */
static void test_equal_files(const char *root, int compress)
{
    float *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    rng_state = 42 + (uint64_t)compress;
    fill(a, N, 0.02f);
    fill(b, N, 0.001f);
    ckpt_buffer bufs[2] = {{"params", "f32", 4, N * 4, 0, N * 4, a},
                           {"adam_m", "f32", 4, N * 4, 0, N * 4, b}};
    char ref_dir[4200], dev_dir[4200];
    snprintf(ref_dir, sizeof ref_dir, "%s/ref-%d", root, compress);
    snprintf(dev_dir, sizeof dev_dir, "%s/dev-%d", root, compress);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = ref_dir;
    eo.save.chunk_bytes = CHUNK;
    eo.save.filter = CKPT_FILTER_SHUFFLE;
    eo.compress = compress;
    eo.threads = 3;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "reference engine");
    T_CHECK(ckpt_engine_stage(e, 5, "run", "cfg", bufs, 2, "{\"k\":5}", NULL) == 0, "stage");
    T_CHECK(ckpt_engine_destroy(e) == 0, "reference persist committed");

    const int delay_ms = 40, nchunks = 6; /* 3 chunks per buffer */
    tcopier tc;
    tc_init(&tc, delay_ms);
    ckpt_copier cp = copier_of(&tc);
    eo.save.dir = dev_dir;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "device engine");
    double stall = -1, t0 = t_now_s();
    uint64_t last = 0;
    T_CHECK(ckpt_engine_stage_device(e, 5, "run", "cfg", bufs, 2, "{\"k\":5}", &cp, &last, &stall) == 0,
            "stage_device");
    double total_delay = nchunks * delay_ms * 1e-3;
    T_CHECK(stall >= 0 && stall < total_delay / 4, "stall %.1f ms, below the copy time %.0f ms",
            stall * 1e3, total_delay * 1e3);
    T_CHECK(last == (uint64_t)nchunks, "last ticket %llu (one copy per chunk)", (unsigned long long)last);
    T_CHECK(tc_done(&tc) < (uint64_t)nchunks, "copies still in flight when stage returned");
    /* the caller waits for its copies before changing the device buffers */
    T_CHECK(tc_wait(&tc, last, 30) == 0, "caller waits for the last copy");
    memset(a, 0x7f, N * sizeof(float));
    memset(b, 0, N * sizeof(float));
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "device persist committed");
    double elapsed = t_now_s() - t0;
    ckpt_persist_stats ps;
    T_CHECK(ckpt_engine_last(e, &ps) == 0 && ps.result == 0 && ps.step == 5 &&
                ps.raw_bytes == 2ull * N * 4 && ps.stage_seconds < total_delay / 4 &&
                ps.persist_seconds >= total_delay * 0.9,
            "stats: result %d stage %.1f ms persist %.1f ms (copies %.0f ms)", ps.result,
            ps.stage_seconds * 1e3, ps.persist_seconds * 1e3, total_delay * 1e3);
    T_CHECK(elapsed >= total_delay * 0.9, "the persist followed the copies: %.0f ms", elapsed * 1e3);
    int all = 1;
    for (int t = 1; t <= nchunks; t++) all &= tc.waited[t];
    T_CHECK(all && tc.waits >= nchunks, "workers waited for every chunk's ticket (%d waits)", tc.waits);
    T_CHECK(tc.early_waits > 0, "compression began before the last copy ended (%d early waits)",
            tc.early_waits);
    T_CHECK(tc.pins == 1 && tc.pin_bytes >= 2ull * N * 4, "pinned once: %d pins, %zu bytes",
            tc.pins, tc.pin_bytes);
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    T_CHECK(tc.unpins == 1, "unpinned once at destroy: %d", tc.unpins);
    T_CHECK(snapshot_equal(ref_dir, dev_dir, "step-000000005"),
            "device-staged files equal ckpt_engine_stage's (compress %d)", compress);
    tc_fini(&tc);
    free(a);
    free(b);
}

/* Pin once per allocation: reserve_bytes, reuse, growth (unpin, grow, pin), destroy. */
static void test_pin_per_allocation(const char *root)
{
    float *a = calloc(N, sizeof(float));
    fill(a, N, 0.5f);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/pin", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.chunk_bytes = CHUNK;
    eo.reserve_bytes = N; /* a quarter of the buffer: the second size grows it */
    tcopier tc;
    tc_init(&tc, 0);
    ckpt_copier cp = copier_of(&tc);
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine");
    T_CHECK(tc.pins == 0, "nothing pinned at create (no copier yet)");
    ckpt_buffer small = {"params", "f32", 4, N, 0, N, a};
    ckpt_buffer big = {"params", "f32", 4, N * 4, 0, N * 4, a};
    uint64_t last = 0;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &small, 1, "{}", &cp, &last, NULL) == 0, "1");
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "1 committed");
    void *first_base = tc.pin_base;
    T_CHECK(tc.pins == 1 && tc.unpins == 0 && tc.pin_bytes >= N, "reserved area pinned at the first stage");
    T_CHECK(ckpt_engine_stage_device(e, 2, "run", "cfg", &small, 1, "{}", &cp, &last, NULL) == 0, "2");
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "2 committed");
    T_CHECK(tc.pins == 1 && tc.unpins == 0, "same allocation: not pinned again");
    T_CHECK(ckpt_engine_stage_device(e, 3, "run", "cfg", &big, 1, "{}", &cp, &last, NULL) == 0, "3");
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "3 committed");
    T_CHECK(tc.unpins == 1 && tc.pins == 2 && tc.pin_bytes >= N * 4,
            "grown: unpinned %d, pinned %d (%zu bytes)", tc.unpins, tc.pins, tc.pin_bytes);
    (void)first_base;
    /* a plain stage of the same size reuses the pinned area */
    T_CHECK(ckpt_engine_stage(e, 4, "run", "cfg", &big, 1, "{}", NULL) == 0, "4 (memcpy)");
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "4 committed");
    T_CHECK(tc.pins == 2 && tc.unpins == 1, "memcpy stage leaves the pin alone");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    T_CHECK(tc.pins == 2 && tc.unpins == 2, "balanced: %d pins, %d unpins", tc.pins, tc.unpins);

    /* a failing pin fails the stage: nothing staged, nothing pinned; the next stage pins */
    snprintf(dir, sizeof dir, "%s/pin-fail", root);
    eo.save.dir = dir;
    eo.reserve_bytes = 0;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine 2");
    tc.pins = tc.unpins = 0;
    tc.fail_pin = -ENOMEM;
    int calls = tc.copy_calls;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &small, 1, "{}", &cp, &last, NULL) == -ENOMEM,
            "failed pin fails the stage");
    T_CHECK(tc.copy_calls == calls && !ckpt_engine_busy(e) && ckpt_engine_last(e, NULL) == -ENOENT,
            "nothing queued, nothing staged");
    tc.fail_pin = 0;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &small, 1, "{}", &cp, &last, NULL) == 0,
            "stage after the pin failure");
    T_CHECK(ckpt_engine_wait(e, 60) == 0 && tc.pins == 1, "committed, pinned once");
    T_CHECK(ckpt_engine_destroy(e) == 0 && tc.unpins == 1, "balanced after a failed pin");
    tc_fini(&tc);
    free(a);
}

/* A copy failing at stage time: -EIO, the copies queued before it done, nothing staged. */
static void test_copy_fails(const char *root)
{
    float *a = malloc(N * sizeof(float));
    fill(a, N, 0.1f);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/copyfail", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.chunk_bytes = CHUNK;
    tcopier tc;
    tc_init(&tc, 30);
    tc.fail_copy_at = 3;
    ckpt_copier cp = copier_of(&tc);
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine");
    ckpt_buffer buf = {"params", "f32", 4, N * 4, 0, N * 4, a};
    uint64_t last = 12345;
    T_CHECK(ckpt_engine_stage_device(e, 9, "run", "cfg", &buf, 1, "{}", &cp, &last, NULL) == -EIO,
            "a failing copy fails the stage with its error");
    T_CHECK(last == 12345, "last_ticket unchanged");
    T_CHECK(tc_done(&tc) == 2, "the two copies queued before were waited for (%llu done)",
            (unsigned long long)tc_done(&tc));
    T_CHECK(!ckpt_engine_busy(e) && ckpt_engine_last(e, NULL) == -ENOENT && ckpt_engine_completed(e) == 0,
            "nothing staged, no persist");
    T_CHECK(ckpt_engine_wait(e, 5) == 0, "no persist result");
    T_CHECK(count_prefix(dir, "step-") == 0 && count_prefix(dir, ".tmp-") == 0, "nothing committed");
    /* the engine still works afterwards */
    tc.fail_copy_at = 0;
    T_CHECK(ckpt_engine_stage_device(e, 9, "run", "cfg", &buf, 1, "{}", &cp, &last, NULL) == 0, "retry");
    T_CHECK(ckpt_engine_wait(e, 60) == 0 && count_prefix(dir, "step-000000009") == 1, "retry committed");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    tc_fini(&tc);
    free(a);
}

/* A wait failing during the persist: result negative, nothing committed, temp removed. */
static void test_wait_fails(const char *root, int compress)
{
    float *a = malloc(N * sizeof(float));
    fill(a, N, 0.1f);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/waitfail-%d", root, compress);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.chunk_bytes = CHUNK;
    eo.compress = compress;
    tcopier tc;
    tc_init(&tc, 10);
    tc.fail_wait_ticket = 2;
    ckpt_copier cp = copier_of(&tc);
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine");
    ckpt_buffer buf = {"params", "f32", 4, N * 4, 0, N * 4, a};
    uint64_t last = 0;
    T_CHECK(ckpt_engine_stage_device(e, 11, "run", "cfg", &buf, 1, "{}", &cp, &last, NULL) == 0, "staged");
    int rc = ckpt_engine_wait(e, 60);
    T_CHECK(rc == -EIO, "persist result %d (the wait's -EIO)", rc);
    ckpt_persist_stats ps;
    T_CHECK(ckpt_engine_last(e, &ps) == 0 && ps.result == -EIO && ps.step == 11, "last: %d", ps.result);
    T_CHECK(count_prefix(dir, "step-") == 0, "no step folder");
    T_CHECK(count_prefix(dir, ".tmp-") == 0, "temp folder removed");
    T_CHECK(ckpt_engine_destroy(e) == -EIO, "destroy returns the last result");
    tc_fini(&tc);
    free(a);
}

static void test_bad_copier(const char *root)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/bad", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine");
    float x[64] = {0};
    ckpt_buffer buf = {"params", "f32", 4, sizeof x, 0, sizeof x, x};
    tcopier tc;
    tc_init(&tc, 0);
    ckpt_copier cp = copier_of(&tc);
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &buf, 1, "{}", NULL, NULL, NULL) == -EINVAL, "NULL copier");
    ckpt_copier k = cp;
    k.copy = NULL;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &buf, 1, "{}", &k, NULL, NULL) == -EINVAL, "no copy");
    k = cp;
    k.wait = NULL;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &buf, 1, "{}", &k, NULL, NULL) == -EINVAL, "no wait");
    k = cp;
    k.timeout_s = 0;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &buf, 1, "{}", &k, NULL, NULL) == -EINVAL, "timeout 0");
    ckpt_buffer nul = buf;
    nul.data = NULL;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &nul, 1, "{}", &cp, NULL, NULL) == -EINVAL, "NULL data");
    T_CHECK(tc.copy_calls == 0 && tc.pins == 0, "nothing queued or pinned");
    /* pin and unpin may be NULL */
    k = cp;
    k.pin = NULL;
    k.unpin = NULL;
    T_CHECK(ckpt_engine_stage_device(e, 1, "run", "cfg", &buf, 1, "{}", &k, NULL, NULL) == 0, "no pin");
    T_CHECK(ckpt_engine_destroy(e) == 0 && tc.pins == 0 && tc.unpins == 0, "committed without pinning");
    tc_fini(&tc);
}

/* ------------------------------------------------------------------ a group of two ranks */

typedef struct board {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int voted, vote, decided, decision;
} board;

typedef struct rank_job {
    board *b;
    uint32_t rank;
    const char *dir, *tag;
    int device;
    const float *whole;
    size_t n; /* floats in the whole buffer */
    tcopier tc;
    int rc;
    double stall;
} rank_job;

static int bv(void *ctx, uint64_t step, int result)
{
    (void)step;
    board *b = ((rank_job *)ctx)->b;
    pthread_mutex_lock(&b->mu);
    b->voted = 1;
    b->vote = result;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return 0;
}

static int bc(void *ctx, uint64_t step, double timeout_s)
{
    (void)step;
    board *b = ((rank_job *)ctx)->b;
    struct timespec ts;
    t_deadline_in(CLOCK_REALTIME, &ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    while (!b->voted)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) break;
    int rc = !b->voted ? -ETIMEDOUT : b->vote;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static int bd(void *ctx, uint64_t step, int result)
{
    (void)step;
    board *b = ((rank_job *)ctx)->b;
    pthread_mutex_lock(&b->mu);
    b->decided = 1;
    b->decision = result;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return 0;
}

static int bo(void *ctx, uint64_t step, double timeout_s, int *decision)
{
    (void)step;
    board *b = ((rank_job *)ctx)->b;
    struct timespec ts;
    t_deadline_in(CLOCK_REALTIME, &ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    while (!b->decided)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) break;
    int rc = b->decided ? 0 : -ETIMEDOUT;
    if (b->decided) *decision = b->decision;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static void *rank_main(void *arg)
{
    rank_job *j = arg;
    ckpt_group g = {j->rank, 2, j->tag, j, bv, bc, bd, bo, 30.0};
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = j->dir;
    eo.save.chunk_bytes = 64u << 10;
    eo.save.filter = CKPT_FILTER_SHUFFLE;
    eo.group = &g;
    ckpt_engine *e;
    j->rc = ckpt_engine_create(&e, &eo);
    if (j->rc < 0) return NULL;
    /* rank 0 holds the first half (rounded to 4 floats), rank 1 the rest: not chunk multiples */
    size_t half = (j->n / 2) & ~(size_t)3;
    size_t first = j->rank ? half : 0, cnt = j->rank ? j->n - half : half;
    ckpt_buffer b = {"params", "f32", 4, j->n * 4, first * 4, cnt * 4, j->whole + first};
    if (j->device) {
        ckpt_copier cp = copier_of(&j->tc);
        j->rc = ckpt_engine_stage_device(e, 20, "run", "cfg", &b, 1, "{\"g\":1}", &cp, NULL, &j->stall);
    } else {
        j->rc = ckpt_engine_stage(e, 20, "run", "cfg", &b, 1, "{\"g\":1}", &j->stall);
    }
    if (j->rc == 0) j->rc = ckpt_engine_wait(e, 60);
    int d = ckpt_engine_destroy(e);
    if (j->rc == 0) j->rc = d;
    return NULL;
}

static void run_group(const char *dir, const char *tag, int device, const float *whole, size_t n,
                      int rcs[2], int waits[2])
{
    board b;
    memset(&b, 0, sizeof b);
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    rank_job j[2];
    pthread_t th[2];
    for (uint32_t r = 0; r < 2; r++) {
        memset(&j[r], 0, sizeof j[r]);
        j[r].b = &b;
        j[r].rank = r;
        j[r].dir = dir;
        j[r].tag = tag;
        j[r].device = device;
        j[r].whole = whole;
        j[r].n = n;
        tc_init(&j[r].tc, device ? 5 : 0);
        if (pthread_create(&th[r], NULL, rank_main, &j[r]) != 0) exit(1);
    }
    for (int r = 0; r < 2; r++) {
        pthread_join(th[r], NULL);
        rcs[r] = j[r].rc;
        waits[r] = j[r].tc.waits;
        if (device)
            T_CHECK(j[r].tc.pins == 1 && j[r].tc.unpins == 1, "rank %d: pinned once, unpinned once", r);
        tc_fini(&j[r].tc);
    }
    pthread_cond_destroy(&b.cv);
    pthread_mutex_destroy(&b.mu);
}

static void test_group(const char *root)
{
    const size_t n = 100003; /* floats: neither shard a multiple of the chunk */
    float *w = malloc(n * sizeof(float));
    fill(w, n, 0.03f);
    char ref[4200], dev[4200];
    snprintf(ref, sizeof ref, "%s/group-ref", root);
    snprintf(dev, sizeof dev, "%s/group-dev", root);
    int rcs[2], waits[2];
    run_group(ref, "tagref", 0, w, n, rcs, waits);
    T_CHECK(rcs[0] == 0 && rcs[1] == 0, "reference group committed: %d %d", rcs[0], rcs[1]);
    run_group(dev, "tagdev", 1, w, n, rcs, waits);
    T_CHECK(rcs[0] == 0 && rcs[1] == 0, "device group committed: %d %d", rcs[0], rcs[1]);
    T_CHECK(waits[0] > 0 && waits[1] > 0, "both ranks' workers waited for tickets (%d, %d)", waits[0],
            waits[1]);
    T_CHECK(snapshot_equal(ref, dev, "step-000000020"), "device-staged group files equal the reference's");
    char p[4300];
    snprintf(p, sizeof p, "%s/step-000000020", dev);
    ckpt_snapshot *s;
    T_REQUIRE(ckpt_snapshot_open(&s, p, NULL, 0) == 0, "open the group snapshot");
    float *back = malloc(n * sizeof(float));
    T_CHECK(ckpt_snapshot_world_size(s) == 2, "world size 2");
    T_CHECK(ckpt_snapshot_read(s, "params", 0, n * 4, back, NULL, 0) == 0 &&
                memcmp(back, w, n * sizeof(float)) == 0,
            "the whole buffer reads back as the ranks held it");
    ckpt_snapshot_close(s);
    T_CHECK(count_prefix(dev, ".tmp-") == 0, "no temp folder left");
    free(back);
    free(w);
}

/* A deferred trainer record (trainer_json NULL): the chunks are written but nothing commits
 * until ckpt_engine_set_trainer gives the record, which the manifest then holds; a withdrawn
 * record, or one never given before destroy, commits nothing and leaves no temp folder. */
static void test_deferred_trainer(const char *root)
{
    float *a = malloc(N * sizeof(float));
    fill(a, N, 0.1f);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/deferred", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.chunk_bytes = CHUNK;
    tcopier tc;
    tc_init(&tc, 0);
    ckpt_copier cp = copier_of(&tc);
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine");
    ckpt_buffer buf = {"params", "f32", 4, N * 4, 0, N * 4, a};
    T_CHECK(ckpt_engine_set_trainer(e, 3, "{}") == -ENOENT, "no persist waits: -ENOENT");
    T_CHECK(ckpt_engine_stage_device(e, 3, "run", "cfg", &buf, 1, NULL, &cp, NULL, NULL) == 0, "staged");
    T_CHECK(ckpt_engine_wait(e, 0.5) == -EINPROGRESS, "the persist waits for the record");
    T_CHECK(count_prefix(dir, "step-") == 0, "nothing committed before the record");
    T_CHECK(ckpt_engine_set_trainer(e, 4, "{}") == -ENOENT, "another step's record: -ENOENT");
    T_CHECK(ckpt_engine_set_trainer(e, 3, "{\"late\":7}") == 0, "record given");
    T_CHECK(ckpt_engine_set_trainer(e, 3, "{}") == -ENOENT, "given twice: -ENOENT");
    T_CHECK(ckpt_engine_wait(e, 60) == 0 && count_prefix(dir, "step-000000003") == 1, "committed");
    char path[4300];
    snprintf(path, sizeof path, "%s/step-000000003/manifest.json", dir);
    unsigned char *um = NULL;
    t_slurp(path, &um);
    char *m = (char *)um;
    T_CHECK(m && strstr(m, "\"late\"") != NULL, "the manifest holds the late record");
    free(m);
    /* withdrawn */
    T_CHECK(ckpt_engine_stage_device(e, 5, "run", "cfg", &buf, 1, NULL, &cp, NULL, NULL) == 0, "staged 5");
    T_CHECK(ckpt_engine_set_trainer(e, 5, NULL) == 0, "withdrawn");
    T_CHECK(ckpt_engine_wait(e, 60) == -ECANCELED, "the persist fails with -ECANCELED");
    T_CHECK(count_prefix(dir, "step-000000005") == 0 && count_prefix(dir, ".tmp-") == 0,
            "nothing committed, no temp folder");
    /* an invalid late record fails the persist */
    T_CHECK(ckpt_engine_stage_device(e, 6, "run", "cfg", &buf, 1, NULL, &cp, NULL, NULL) == 0, "staged 6");
    T_CHECK(ckpt_engine_set_trainer(e, 6, "[1, 2]") == 0, "given");
    T_CHECK(ckpt_engine_wait(e, 60) == -EINVAL && count_prefix(dir, "step-000000006") == 0,
            "not an object: -EINVAL, not committed");
    /* never given: destroy does not wait for the copier's timeout */
    T_CHECK(ckpt_engine_stage_device(e, 7, "run", "cfg", &buf, 1, NULL, &cp, NULL, NULL) == 0, "staged 7");
    double t0 = t_now_s();
    T_CHECK(ckpt_engine_destroy(e) == -ECANCELED, "destroy withdraws the missing record");
    T_CHECK(t_now_s() - t0 < 10.0, "promptly (%.1f s)", t_now_s() - t0);
    T_CHECK(count_prefix(dir, "step-000000007") == 0 && count_prefix(dir, ".tmp-") == 0,
            "nothing committed, no temp folder");
    tc_fini(&tc);
    free(a);
}

int main(void)
{
    char *root = t_tmpdir("ckpt-stage-device");
    test_equal_files(root, 1);
    test_equal_files(root, 0);
    test_pin_per_allocation(root);
    test_copy_fails(root);
    test_wait_fails(root, 1);
    test_wait_fails(root, 0);
    test_bad_copier(root);
    test_deferred_trainer(root);
    test_group(root);
    t_rmrf(root);
    free(root);
    return t_done("test_ckpt_stage_device");
}
