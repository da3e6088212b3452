/* The asynchronous snapshot engine: bit-identical to a synchronous save while the caller
 * overwrites its buffers, explicit wait/skip policy, bounded memory over many snapshots
 * (C21), retention that never deletes the only committed snapshot early (C22), a load right
 * after a save never reads a half-written step (C06), raw storage of incompressible chunks.
 */
#include "ckpt.h"
#include "t_helpers.h"

#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>

static uint64_t rng_state = 42;
static uint32_t rnd(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

/* optimizer-like floats: compressible but not trivially */
static void fill(float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = scale * ((float)(rnd() % 2001) - 1000.0f) / 1000.0f;
}

static int exists(const char *dir, const char *name)
{
    char p[8400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    return stat(p, &st) == 0;
}

static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kib = strtol(line + 6, NULL, 10);
    if (f) fclose(f);
    return kib;
}

#define N (600 * 1024) /* floats per buffer: 2.3 MiB, several 1 MiB chunks */

static void test_async_equals_sync(const char *root)
{
    float *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    fill(a, N, 0.02f);
    fill(b, N, 0.001f);
    ckpt_buffer bufs[2] = {{"params", "f32", 4, N * 4, 0, N * 4, a},
                           {"adam_m", "f32", 4, N * 4, 0, N * 4, b}};
    char sync_dir[4200], async_dir[4200];
    snprintf(sync_dir, sizeof sync_dir, "%s/sync", root);
    snprintf(async_dir, sizeof async_dir, "%s/async", root);
    ckpt_save_opts so = CKPT_SAVE_OPTS_INIT;
    so.dir = sync_dir;
    so.chunk_bytes = 1u << 20;
    so.filter = CKPT_FILTER_SHUFFLE;
    T_REQUIRE(ckpt_save(&so, 7, "run", "cfg", bufs, 2, "{\"k\":1}", NULL) == 0, "sync save");

    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save = so;
    eo.save.dir = async_dir;
    eo.threads = 3;
    eo.overlap = 1; /* the persist follows the copy: the bytes must still be the staged ones */
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    double stall = -1;
    T_CHECK(ckpt_engine_stage(e, 7, "run", "cfg", bufs, 2, "{\"k\":1}", &stall) == 0, "stage");
    T_CHECK(stall >= 0, "stall reported");
    /* training goes on and overwrites its buffers while the persist runs */
    memset(a, 0x7f, N * sizeof(float));
    memset(b, 0, N * sizeof(float));
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "persist result");
    ckpt_persist_stats ps;
    T_CHECK(ckpt_engine_last(e, &ps) == 0 && ps.step == 7 && ps.result == 0 &&
                ps.raw_bytes == 2ull * N * 4 && ps.stored_bytes < ps.raw_bytes,
            "last stats: step %llu result %d raw %llu stored %llu", (unsigned long long)ps.step,
            ps.result, (unsigned long long)ps.raw_bytes, (unsigned long long)ps.stored_bytes);
    T_CHECK(ckpt_engine_completed(e) == 1, "one persist completed");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");

    char pa[4300], pb[4300];
    snprintf(pa, sizeof pa, "%s/step-000000007/rank-00000.bin", sync_dir);
    snprintf(pb, sizeof pb, "%s/step-000000007/rank-00000.bin", async_dir);
    T_CHECK(t_file_equal(pa, pb), "async data file is bit-identical to the synchronous save's");
    /* manifests equal apart from created_unix and the checksum */
    snprintf(pa, sizeof pa, "%s/step-000000007/manifest.json", sync_dir);
    snprintf(pb, sizeof pb, "%s/step-000000007/manifest.json", async_dir);
    unsigned char *ua, *ub;
    t_slurp(pa, &ua);
    t_slurp(pb, &ub);
    char *ma = (char *)ua, *mb = (char *)ub;
    T_REQUIRE(ma && mb, "manifests readable");
    char *ca = strstr(ma, "\"created_unix\""), *cb = strstr(mb, "\"created_unix\"");
    char *ba = strstr(ma, "\"files\""), *bb = strstr(mb, "\"files\"");
    char *ea = strstr(ma, ",\"manifest_xxh3\""), *eb = strstr(mb, ",\"manifest_xxh3\"");
    T_REQUIRE(ca && cb && ba && bb && ea && eb, "manifest members present");
    T_CHECK(ca - ma == cb - mb && memcmp(ma, mb, (size_t)(ca - ma)) == 0, "manifest prefix equal");
    T_CHECK(ea - ba == eb - bb && memcmp(ba, bb, (size_t)(ea - ba)) == 0, "manifest body equal");
    free(ma);
    free(mb);

    /* the persisted bytes are the staged ones, not the overwritten ones */
    ckpt_snapshot *s;
    snprintf(pa, sizeof pa, "%s/step-000000007", async_dir);
    T_REQUIRE(ckpt_snapshot_open(&s, pa, NULL, 0) == 0, "open async snapshot");
    rng_state = 42;
    fill(b, N, 0.02f); /* regenerate the original a into b */
    T_CHECK(ckpt_snapshot_read(s, "params", 0, N * 4, a, NULL, 0) == 0 &&
                memcmp(a, b, N * sizeof(float)) == 0,
            "params restored as staged");
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify");
    ckpt_snapshot_close(s);
    free(a);
    free(b);
}

/* C21: 20 snapshots in a row; resident memory after the 20th equals that after the 2nd. */
static void test_c21_memory_bounded(const char *root)
{
    float *a = malloc(N * sizeof(float));
    fill(a, N, 0.02f);
    ckpt_buffer bufs[1] = {{"params", "f32", 4, N * 4, 0, N * 4, a}};
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/c21", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.chunk_bytes = 1u << 20;
    eo.keep_last = 2;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    long rss2 = 0, rss20 = 0;
    int rounds = getenv("C21_ROUNDS") ? atoi(getenv("C21_ROUNDS")) : 20;
    for (int i = 1; i <= rounds; i++) {
        a[i] = (float)i;
        T_CHECK(ckpt_engine_stage(e, (uint64_t)i, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage %d", i);
        T_CHECK(ckpt_engine_wait(e, 60) == 0, "persist %d", i);
        if (i == 2) rss2 = rss_kib();
        if (i == 20) rss20 = rss_kib();
        if (getenv("C21_ROUNDS") && i % 10 == 0) printf("c21: after %d: %ld KiB\n", i, rss_kib());
    }
    printf("c21: rss after 2nd snapshot %ld KiB, after 20th %ld KiB\n", rss2, rss20);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* sanitizers keep freed memory in quarantine and shadow it: RSS says nothing here; the
     * plain build asserts it */
    printf("c21: sanitizer build, resident memory not compared\n");
#else
    T_CHECK(rss2 > 0 && rss20 - rss2 <= 512, "resident memory grew by %ld KiB over 18 snapshots",
            rss20 - rss2);
#endif
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    ckpt_entry *en;
    size_t n;
    T_REQUIRE(ckpt_list(dir, &en, &n) == 0, "list");
    T_CHECK(n == 2 && en[0].step == 19 && en[1].step == 20, "keep-last 2 keeps 19 and 20 (got %zu)", n);
    free(en);
    free(a);
}

/* Policy skip: a snapshot due while one persists is skipped and counted; wait waits. */
static void test_policy(const char *root)
{
    size_t big = 24u << 20; /* 24 MiB of floats: the persist takes a while on one thread */
    float *a = malloc(big);
    fill(a, big / 4, 1.0f);
    ckpt_buffer bufs[1] = {{"params", "f32", 4, big, 0, big, a}};
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/policy", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.zstd_level = 9;
    eo.threads = 1;
    eo.policy = CKPT_POLICY_SKIP;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    T_CHECK(ckpt_engine_stage(e, 1, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage 1");
    int busy = ckpt_engine_busy(e);
    int r2 = ckpt_engine_stage(e, 2, "run", "cfg", bufs, 1, "{}", NULL);
    T_CHECK(!busy || r2 == 1, "skip while busy (busy %d, rc %d)", busy, r2);
    T_CHECK(ckpt_engine_skipped(e) == (uint64_t)(r2 == 1), "skip counted");
    T_CHECK(ckpt_engine_wait(e, 120) == 0, "wait");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    T_CHECK(exists(dir, "step-000000001"), "step 1 committed");
    T_CHECK(r2 == 1 ? !exists(dir, "step-000000002") : exists(dir, "step-000000002"),
            "step 2 present only if not skipped");

    eo.policy = CKPT_POLICY_WAIT;
    snprintf(dir, sizeof dir, "%s/policy-wait", root);
    eo.save.dir = dir;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create (wait)");
    T_CHECK(ckpt_engine_stage(e, 1, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage 1 (wait)");
    T_CHECK(ckpt_engine_stage(e, 2, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage 2 waits");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy (wait)");
    T_CHECK(exists(dir, "step-000000001") && exists(dir, "step-000000002"), "both committed");
    free(a);
}

/* C06: open the step right after staging it: it is either absent (refused cleanly) or
 * complete and verified; never half-written. After the wait it loads. */
static void test_c06_load_right_after_save(const char *root)
{
    float *a = malloc(N * sizeof(float));
    fill(a, N, 0.02f);
    ckpt_buffer bufs[1] = {{"params", "f32", 4, N * 4, 0, N * 4, a}};
    char dir[4200], snap[4300];
    snprintf(dir, sizeof dir, "%s/c06", root);
    snprintf(snap, sizeof snap, "%s/step-000000005", dir);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    T_CHECK(ckpt_engine_stage(e, 5, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage");
    int absent = 0, complete = 0;
    for (int i = 0; i < 2000 && ckpt_engine_busy(e); i++) {
        ckpt_snapshot *s;
        int rc = ckpt_snapshot_open(&s, snap, NULL, 0);
        if (rc == -ENOENT) absent++;
        else if (rc == 0) {
            T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "a visible step is complete");
            complete++;
            ckpt_snapshot_close(s);
        } else {
            T_CHECK(0, "open during the save returned %d", rc);
        }
    }
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "wait for the commit");
    ckpt_snapshot *s;
    T_CHECK(ckpt_snapshot_open(&s, snap, NULL, 0) == 0, "loads after the commit");
    ckpt_snapshot_close(s);
    printf("c06: %d opens refused (not committed yet), %d saw it complete\n", absent, complete);
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    free(a);
}

/* C22: keep-last 1; the only committed snapshot survives until its successor commits. */
static void test_c22_retention_waits_for_successor(const char *root)
{
    float *a = malloc(N * sizeof(float));
    fill(a, N, 0.02f);
    ckpt_buffer bufs[1] = {{"params", "f32", 4, N * 4, 0, N * 4, a}};
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/c22", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.keep_last = 1;
    eo.keep_every = 0;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    T_CHECK(ckpt_engine_stage(e, 10, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage 10");
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "10 committed");
    T_CHECK(ckpt_engine_stage(e, 20, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage 20");
    /* while 20 persists, 10 must exist whenever 20 is not committed */
    int violations = 0;
    while (ckpt_engine_busy(e))
        if (!exists(dir, "step-000000010") && !exists(dir, "step-000000020")) violations++;
    T_CHECK(violations == 0, "no instant without a committed snapshot (%d)", violations);
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "20 committed");
    T_CHECK(!exists(dir, "step-000000010") && exists(dir, "step-000000020"), "10 removed after 20");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");

    /* keep-every keeps multiples; other lineages are left alone */
    snprintf(dir, sizeof dir, "%s/keep", root);
    ckpt_save_opts so = CKPT_SAVE_OPTS_INIT;
    so.dir = dir;
    for (uint64_t st = 10; st <= 60; st += 10)
        T_CHECK(ckpt_save(&so, st, st == 30 ? "other" : "run", "cfg", bufs, 1, "{}", NULL) == 0, "save");
    T_CHECK(ckpt_retain(dir, 1, 20, "run") == 2, "removes 10 and 50");
    T_CHECK(!exists(dir, "step-000000010") && exists(dir, "step-000000020") &&
                exists(dir, "step-000000030") && exists(dir, "step-000000040") &&
                !exists(dir, "step-000000050") && exists(dir, "step-000000060"),
            "kept: 20, 40 (every 20), 30 (other lineage), 60 (newest)");
    T_CHECK(ckpt_remove_temp(dir) == 0, "retention left no temp folder");
    free(a);
}

/* Incompressible chunks are stored raw (codec none) and read back; compress=0 stores all raw. */
static void test_raw_chunks(const char *root)
{
    size_t n = 3u << 20;
    uint8_t *r = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++) r[i] = (uint8_t)(rnd() >> 7);
    memset(r, 0, 1u << 20); /* first chunk compresses, the others do not */
    ckpt_buffer bufs[1] = {{"noise", "u8", 1, n, 0, n, r}};
    char dir[4200], snap[4300], path[4400];
    for (int compress = 1; compress >= 0; compress--) {
        snprintf(dir, sizeof dir, "%s/raw-%d", root, compress);
        ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
        eo.save.dir = dir;
        eo.save.chunk_bytes = 1u << 20;
        eo.compress = compress;
        ckpt_engine *e;
        T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
        T_CHECK(ckpt_engine_stage(e, 1, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage");
        T_CHECK(ckpt_engine_destroy(e) == 0, "persist ok");
        snprintf(snap, sizeof snap, "%s/step-000000001", dir);
        snprintf(path, sizeof path, "%s/manifest.json", snap);
        unsigned char *um;
        t_slurp(path, &um);
        char *m = (char *)um;
        int nzstd = 0, nnone = 0;
        for (char *p = m; p && (p = strstr(p, "\"codec\":\"")); p++) {
            if (!strncmp(p + 9, "zstd", 4)) nzstd++;
            if (!strncmp(p + 9, "none", 4)) nnone++;
        }
        free(m);
        if (compress) T_CHECK(nzstd == 1 && nnone == 2, "zstd for the zeros, raw for noise (%d/%d)", nzstd, nnone);
        else T_CHECK(nzstd == 0 && nnone == 3, "all raw without compression (%d/%d)", nzstd, nnone);
        ckpt_snapshot *s;
        T_REQUIRE(ckpt_snapshot_open(&s, snap, NULL, 0) == 0, "open");
        memset(back, 0, n);
        T_CHECK(ckpt_snapshot_read(s, "noise", 0, n, back, NULL, 0) == 0 && memcmp(back, r, n) == 0,
                "raw chunks read back");
        T_CHECK(ckpt_snapshot_read(s, "noise", (1u << 20) - 7, 100000, back, NULL, 0) == 0 &&
                    memcmp(back, r + (1u << 20) - 7, 100000) == 0,
                "range across a zstd and a raw chunk");
        ckpt_snapshot_close(s);
    }
    free(r);
    free(back);
}

/* Many small chunks, more workers than cores, back-to-back saves: the pool must never wedge
 * (a worker holding chunk i + nslots once took the slot chunk i needed and every save hung
 * until the pool's timeout). Each save must finish well within the wait. */
static void test_pool_no_deadlock(const char *root)
{
    size_t n = 6u << 20;
    float *a = malloc(n);
    fill(a, n / 4, 0.02f);
    ckpt_buffer bufs[1] = {{"params", "f32", 4, n, 0, n, a}};
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/stress", root);
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.save.chunk_bytes = 4096; /* 1536 chunks a save */
    eo.threads = 8;
    eo.keep_last = 1;
    eo.overlap = 1;
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    int ok = 1;
    for (int i = 1; i <= 12 && ok; i++) {
        a[i] = (float)i;
        ok &= ckpt_engine_stage(e, (uint64_t)i, "run", "cfg", bufs, 1, "{}", NULL) == 0;
        int rc = ckpt_engine_wait(e, 30.0);
        T_CHECK(rc == 0, "save %d finished (rc %d)", i, rc);
        ok &= rc == 0;
    }
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    free(a);
}

/* ckpt_engine_persist_staged: the persist reads the caller's bytes (no stage copy) and
 * writes the files a synchronous save of them writes; an ordinary stage with overlap still
 * follows its copy afterwards; a NULL data pointer is refused. */
static void test_persist_staged(const char *root)
{
    float *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    fill(a, N, 0.03f);
    fill(b, N, 0.002f);
    ckpt_buffer bufs[2] = {{"params", "f32", 4, N * 4, 0, N * 4, a},
                           {"adam_m", "f32", 4, N * 4, 0, N * 4, b}};
    char sync_dir[4200], dir[4200];
    snprintf(sync_dir, sizeof sync_dir, "%s/staged-sync", root);
    snprintf(dir, sizeof dir, "%s/staged", root);
    ckpt_save_opts so = CKPT_SAVE_OPTS_INIT;
    so.dir = sync_dir;
    so.chunk_bytes = 1u << 20;
    T_REQUIRE(ckpt_save(&so, 3, "run", "cfg", bufs, 2, "{\"k\":3}", NULL) == 0, "sync save");
    T_REQUIRE(ckpt_save(&so, 4, "run", "cfg", bufs, 1, "{}", NULL) == 0, "sync save 4");

    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save = so;
    eo.save.dir = dir;
    eo.threads = 3;
    eo.overlap = 1; /* does not apply to a staged persist; must not wait for a copy */
    ckpt_engine *e;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine create");
    ckpt_buffer nul = bufs[0];
    nul.data = NULL;
    T_CHECK(ckpt_engine_persist_staged(e, 3, "run", "cfg", &nul, 1, "{}", NULL) == -EINVAL,
            "NULL data refused");
    T_CHECK(ckpt_engine_persist_staged(e, 3, "bad name!", "cfg", bufs, 2, "{}", NULL) == -EINVAL,
            "bad run id refused");
    double stall = -1;
    T_CHECK(ckpt_engine_persist_staged(e, 3, "run", "cfg", bufs, 2, "{\"k\":3}", &stall) == 0,
            "persist_staged");
    T_CHECK(stall >= 0, "stall reported");
    T_CHECK(ckpt_engine_wait(e, 60) == 0, "persist result");
    ckpt_persist_stats ps;
    T_CHECK(ckpt_engine_last(e, &ps) == 0 && ps.step == 3 && ps.result == 0 && ps.raw_bytes == 2ull * N * 4,
            "last stats: step %llu result %d", (unsigned long long)ps.step, ps.result);
    /* an ordinary overlapped stage after it still follows its own copy */
    T_CHECK(ckpt_engine_stage(e, 4, "run", "cfg", bufs, 1, "{}", NULL) == 0, "stage after");
    memset(a, 0x11, N * sizeof(float)); /* staged: the caller may overwrite */
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    for (int st = 3; st <= 4; st++) {
        char pa[4300], pb[4300];
        snprintf(pa, sizeof pa, "%s/step-00000000%d/rank-00000.bin", sync_dir, st);
        snprintf(pb, sizeof pb, "%s/step-00000000%d/rank-00000.bin", dir, st);
        T_CHECK(t_file_equal(pa, pb), "step %d: data file equals the synchronous save's", st);
    }
    ckpt_snapshot *s;
    char p[4300];
    snprintf(p, sizeof p, "%s/step-000000003", dir);
    T_REQUIRE(ckpt_snapshot_open(&s, p, NULL, 0) == 0, "open");
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify");
    T_CHECK(!strcmp(ckpt_snapshot_trainer_json(s), "{\"k\":3}"), "trainer record copied");
    ckpt_snapshot_close(s);
    free(a);
    free(b);
}

int main(void)
{
    char *root = t_tmpdir("ckpt-engine");
    test_async_equals_sync(root);
    test_c21_memory_bounded(root);
    test_policy(root);
    test_c06_load_right_after_save(root);
    test_c22_retention_waits_for_successor(root);
    test_raw_chunks(root);
    test_pool_no_deadlock(root);
    test_persist_staged(root);
    t_rmrf(root);
    free(root);
    return t_done("test_ckpt_engine");
}
