/* test_ckpt_format.c - ckpt module: snapshot round trips (chunking, filters, O_DIRECT and
 * buffered), chunks readable by the zstd command, the commit protocol's outcomes, listing,
 * and detection of corrupt snapshots (cases C01 and C05 of CASES.md).
 *
 * The fault-injection part (CKPT_FAULT_STORE) runs in forked children first, before this
 * process writes anything, because the variable is read once per process at the first write. */
#include "ckpt.h"
#include "ckpt_internal.h"
#include "t_helpers.h"
#include "t_manifest.h"

#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <xxhash.h>

/* ------------------------------------------------------------------ helpers */

static uint64_t rng_s = 0x243F6A8885A308D3ull;

static uint64_t rnd(void)
{
    rng_s ^= rng_s << 13;
    rng_s ^= rng_s >> 7;
    rng_s ^= rng_s << 17;
    return rng_s;
}

static uint64_t rnd_below(uint64_t n) { return n ? rnd() % n : 0; }

static char *step_path(const char *root, uint64_t step)
{
    char name[32];
    ckpt_step_dirname(step, name, sizeof name);
    return t_path_in(root, name);
}

static long long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

/* Entries of dir whose name starts with prefix. */
static int count_prefix(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
    closedir(d);
    return n;
}

/* ------------------------------------------------------------------ sample state */

enum { NB = 5 };

typedef struct sample {
    ckpt_buffer b[NB];
    unsigned char *mem[NB];
} sample;

static const char *const TRAINER =
    "{\"step\": 7, \"data\": {\"seed\": 1234, \"samples_consumed\": 9007199254740993},"
    " \"lr\": 0.000125, \"name\": \"caf\\u00e9\", \"list\": [1, 2, 3], \"flag\": true}";

/* Five buffers: f32 params whose size is no chunk multiple, an empty one, u8 text, u16 just
 * over the default 4 MiB chunk, f64. `seed` changes the contents. */
static void sample_make(sample *s, unsigned seed)
{
    static const char *names[NB] = {"params", "empty", "tokens", "adam_v", "f64.state"};
    static const char *dtypes[NB] = {"f32", "u8", "u8", "u16", "f64"};
    static const uint32_t eb[NB] = {4, 1, 1, 2, 8};
    const uint64_t sizes[NB] = {10007 * 4, 0, 5003, (4u << 20) + 1234, 777 * 8};
    rng_s = 0x9E3779B97F4A7C15ull * (seed + 1);
    for (int i = 0; i < NB; i++) {
        uint64_t n = sizes[i];
        s->mem[i] = n ? malloc(n) : NULL;
        T_REQUIRE(n == 0 || s->mem[i] != NULL, "malloc");
        if (i == 0) { /* floats of moderate spread: the shuffle filter has something to do */
            for (uint64_t j = 0; j < n / 4; j++) {
                float f = (float)((double)(int64_t)(rnd() % 2000001 - 1000000) * 1e-8);
                memcpy(s->mem[i] + 4 * j, &f, 4);
            }
        } else if (i == 2) {
            static const char words[] = "the quick brown fox jumps over the lazy dog ";
            for (uint64_t j = 0; j < n; j++)
                s->mem[i][j] = (unsigned char)(rnd() % 50 == 0 ? rnd() : (uint64_t)words[j % 44]);
        } else if (i == 4) {
            for (uint64_t j = 0; j < n / 8; j++) {
                double d = (double)(rnd() >> 11) * 0x1p-53 - 0.5;
                memcpy(s->mem[i] + 8 * j, &d, 8);
            }
        } else {
            for (uint64_t j = 0; j < n; j++) s->mem[i][j] = (unsigned char)(rnd() >> 56);
        }
        s->b[i] = (ckpt_buffer){names[i], dtypes[i], eb[i], n, 0, n, s->mem[i]};
    }
}

static void sample_free(sample *s)
{
    for (int i = 0; i < NB; i++) free(s->mem[i]);
}

static int save_sample(const char *root, uint64_t step, const sample *s, uint64_t chunk,
                       int filter, int direct)
{
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.chunk_bytes = chunk;
    o.filter = filter;
    o.direct_io = direct;
    return ckpt_save(&o, step, "run-A_1.x", "cfg-0123abcd", s->b, NB, TRAINER, NULL);
}

static int read_eq(ckpt_snapshot *s, const sample *sm, int bi, uint64_t off, uint64_t len)
{
    unsigned char *dst = malloc(len + 32);
    if (!dst) return 0;
    memset(dst, 0xA5, len + 32);
    char bad[512] = "";
    int rc = ckpt_snapshot_read(s, sm->b[bi].name, off, len, dst, bad, sizeof bad);
    int ok = rc == 0 && (len == 0 || memcmp(dst, sm->mem[bi] + off, len) == 0);
    for (int i = 0; ok && i < 32; i++) ok = dst[len + i] == 0xA5; /* nothing past len */
    if (!ok)
        fprintf(stderr, "read %s [%llu,+%llu): rc %d %s\n", sm->b[bi].name,
                (unsigned long long)off, (unsigned long long)len, rc, bad);
    free(dst);
    return ok;
}

typedef struct prog {
    int calls;
    uint64_t last_done, last_total;
    int monotone;
    int stop_at;
} prog;

static int on_progress(void *ctx, uint64_t done, uint64_t total)
{
    prog *p = ctx;
    if (p->calls && done < p->last_done) p->monotone = 0;
    p->calls++;
    p->last_done = done;
    p->last_total = total;
    return p->stop_at && p->calls >= p->stop_at;
}

/* ------------------------------------------------------------------ round trip */

/* Every chunk stored as a zstd frame decodes with the system `zstd -d` on its own to the
 * chunk's (filtered) raw bytes; a chunk stored raw (codec none: it did not shrink) holds
 * exactly its raw bytes. Chunks follow each other in the data file in buffer order. */
static void check_zstd_cli(const char *snap, const sample *sm, uint64_t chunk, int filter)
{
    char *data = t_path_in(snap, "rank-00000.bin");
    char *mpath = t_path_in(snap, "manifest.json");
    char *frame_path = t_path_in(snap, "../zstd-cli.frame");
    char *out = t_path_in(snap, "../zstd-cli.out");
    unsigned char *file = NULL;
    long long fsize = t_slurp(data, &file);
    json_error_t jerr;
    json_t *m = json_load_file(mpath, 0, &jerr);
    T_REQUIRE(fsize >= 0 && m != NULL, "read %s and its manifest", data);
    int nzstd = 0, nraw = 0, cli_ok = 1, raw_ok = 1, order_ok = 1;
    uint64_t expect_off = 0;
    for (int i = 0; i < NB; i++) {
        json_t *jb = json_array_get(json_object_get(m, "buffers"), (size_t)i);
        json_t *chunks = json_object_get(json_array_get(json_object_get(jb, "shards"), 0), "chunks");
        T_REQUIRE(jb && !strcmp(json_string_value(json_object_get(jb, "name")), sm->b[i].name),
                  "buffer %d in manifest order", i);
        size_t j;
        json_t *c;
        json_array_foreach(chunks, j, c) {
            uint64_t off = (uint64_t)json_integer_value(json_object_get(c, "offset"));
            uint64_t len = (uint64_t)json_integer_value(json_object_get(c, "bytes"));
            uint64_t foff = (uint64_t)json_integer_value(json_object_get(c, "file_offset"));
            uint64_t slen = (uint64_t)json_integer_value(json_object_get(c, "stored_bytes"));
            const char *codec = json_string_value(json_object_get(c, "codec"));
            const char *filt = json_string_value(json_object_get(c, "filter"));
            order_ok &= foff == expect_off && off % chunk == 0 && len <= chunk;
            expect_off = foff + slen;
            if (foff + slen > (uint64_t)fsize) {
                order_ok = 0;
                continue;
            }
            unsigned char *want = malloc(len + 1);
            T_REQUIRE(want != NULL, "malloc");
            int shuffled = filt && !strcmp(filt, "shuffle");
            if (shuffled) ckpt_shuffle(want, sm->mem[i] + off, len, sm->b[i].elem_bytes);
            else memcpy(want, sm->mem[i] + off, len);
            if (codec && !strcmp(codec, "zstd")) {
                nzstd++;
                T_REQUIRE(t_spit(frame_path, file + foff, slen) == 0, "write frame");
                char cmd[3 * CKPT_PATH_MAX];
                snprintf(cmd, sizeof cmd, "zstd -d -c -q '%s' > '%s'", frame_path, out);
                unsigned char *got = NULL;
                int st = system(cmd);
                long long n = t_slurp(out, &got);
                int ok = st == 0 && n == (long long)len && memcmp(got, want, len) == 0;
                if (!ok) fprintf(stderr, "chunk %zu of %s: zstd -d status %d, %lld bytes\n", j,
                                 sm->b[i].name, st, n);
                cli_ok &= ok;
                free(got);
                if (filter != CKPT_FILTER_SHUFFLE || sm->b[i].elem_bytes == 1) T_CHECK(!shuffled, "filter");
            } else {
                nraw++;
                raw_ok &= codec && !strcmp(codec, "none") && !shuffled && slen == len &&
                          memcmp(file + foff, sm->mem[i] + off, len) == 0;
            }
            free(want);
        }
    }
    T_CHECK(expect_off == (uint64_t)fsize, "chunks end where the file ends");
    T_CHECK(order_ok, "chunks follow each other in buffer order");
    T_CHECK(nzstd > 0, "some chunks are zstd frames");
    T_CHECK(cli_ok, "every zstd chunk decodes with zstd -d on its own");
    T_CHECK(raw_ok, "raw chunks hold their raw bytes");
    printf("zstd cli: %d zstd chunks, %d raw chunks (filter %d)\n", nzstd, nraw, filter);
    unlink(out);
    unlink(frame_path);
    json_decref(m);
    free(file);
    free(out);
    free(frame_path);
    free(mpath);
    free(data);
}

static void round_trip(const char *root, uint64_t step, uint64_t chunk, int filter, int direct,
                       int have_zstd)
{
    sample sm;
    sample_make(&sm, (unsigned)step);
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.chunk_bytes = chunk;
    o.filter = filter;
    o.direct_io = direct;
    ckpt_save_stats stats = {0};
    int64_t t0 = (int64_t)time(NULL);
    int rc = ckpt_save(&o, step, "run-A_1.x", "cfg-0123abcd", sm.b, NB, TRAINER, &stats);
    T_REQUIRE(rc == 0, "ckpt_save chunk %llu filter %d direct %d: %d", (unsigned long long)chunk,
              filter, direct, rc);
    uint64_t raw = 0;
    for (int i = 0; i < NB; i++) raw += sm.b[i].bytes;
    T_CHECK(stats.raw_bytes == raw, "stats raw %llu want %llu", (unsigned long long)stats.raw_bytes,
            (unsigned long long)raw);
    T_CHECK(stats.stored_bytes > 0 && stats.seconds >= 0, "stats stored %llu",
            (unsigned long long)stats.stored_bytes);
    T_CHECK(count_prefix(root, ".tmp-") == 0, "temp folder left after a successful save");

    char *sp = step_path(root, step);
    char *mp = t_path_in(sp, "manifest.json"), *dp = t_path_in(sp, "rank-00000.bin");
    T_CHECK(t_exists(mp) && t_exists(dp), "%s lacks manifest.json or rank-00000.bin", sp);

    ckpt_snapshot *s = NULL;
    char why[512] = "";
    rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
    T_REQUIRE(rc == 0 && s, "open %s: %d %s", sp, rc, why);
    T_CHECK(ckpt_snapshot_step(s) == step, "step %llu", (unsigned long long)ckpt_snapshot_step(s));
    T_CHECK(ckpt_snapshot_world_size(s) == 1, "world size %u", ckpt_snapshot_world_size(s));
    T_CHECK(!strcmp(ckpt_snapshot_run_id(s), "run-A_1.x"), "run_id %s", ckpt_snapshot_run_id(s));
    T_CHECK(!strcmp(ckpt_snapshot_config_hash(s), "cfg-0123abcd"), "config_hash %s",
            ckpt_snapshot_config_hash(s));
    T_CHECK(!strcmp(ckpt_snapshot_path(s), sp), "path %s", ckpt_snapshot_path(s));
    int64_t created = ckpt_snapshot_created(s);
    T_CHECK(created >= t0 - 2 && created <= (int64_t)time(NULL) + 2, "created %lld",
            (long long)created);

    /* trainer record: same JSON value (big integer, unicode, real), compact text */
    const char *tj = ckpt_snapshot_trainer_json(s);
    json_error_t je;
    json_t *a = json_loads(TRAINER, 0, &je), *b = json_loads(tj, 0, &je);
    T_CHECK(a && b && json_equal(a, b), "trainer record changed: %s", tj);
    T_CHECK(json_integer_value(json_object_get(json_object_get(b, "data"), "samples_consumed")) ==
                9007199254740993LL, "2^53+1 not kept exactly: %s", tj);
    T_CHECK(!strchr(tj, '\n') && !strstr(tj, ", ") && !strstr(tj, ": "), "not compact: %s", tj);
    json_decref(a);
    json_decref(b);

    /* buffer table */
    T_CHECK(ckpt_snapshot_nbuffers(s) == NB, "nbuffers %zu", ckpt_snapshot_nbuffers(s));
    uint64_t stored_sum = 0;
    for (size_t i = 0; i < NB && i < ckpt_snapshot_nbuffers(s); i++) {
        ckpt_buffer_info info;
        T_REQUIRE(ckpt_snapshot_buffer_info(s, i, &info) == 0, "buffer_info %zu", i);
        T_CHECK(!strcmp(info.name, sm.b[i].name), "buffer %zu is %s, want %s", i, info.name,
                sm.b[i].name);
        T_CHECK(!strcmp(info.dtype, sm.b[i].dtype) && info.elem_bytes == sm.b[i].elem_bytes,
                "%s: dtype %s elem %u", info.name, info.dtype, info.elem_bytes);
        T_CHECK(info.total_bytes == sm.b[i].bytes, "%s: total %llu", info.name,
                (unsigned long long)info.total_bytes);
        size_t want_chunks = (size_t)((sm.b[i].bytes + chunk - 1) / chunk);
        T_CHECK(info.nchunks == want_chunks, "%s: %zu chunks, want %zu", info.name, info.nchunks,
                want_chunks);
        T_CHECK((info.stored_bytes > 0) == (info.total_bytes > 0), "%s: stored %llu", info.name,
                (unsigned long long)info.stored_bytes);
        T_CHECK(ckpt_snapshot_buffer_bytes(s, sm.b[i].name) == (int64_t)sm.b[i].bytes,
                "buffer_bytes %s", sm.b[i].name);
        stored_sum += info.stored_bytes;
    }
    ckpt_buffer_info info;
    T_CHECK(ckpt_snapshot_buffer_info(s, NB, &info) == -EINVAL, "buffer_info past the end");
    T_CHECK(ckpt_snapshot_buffer_bytes(s, "nope") == -ENOENT, "buffer_bytes of a missing buffer");
    uint64_t r_raw = 0, r_stored = 0;
    ckpt_snapshot_sizes(s, &r_raw, &r_stored);
    T_CHECK(r_raw == raw, "sizes raw %llu want %llu", (unsigned long long)r_raw,
            (unsigned long long)raw);
    T_CHECK(r_stored == stored_sum && r_stored == stats.stored_bytes &&
                (long long)r_stored == file_size(dp),
            "sizes stored %llu, buffers %llu, stats %llu, file %lld", (unsigned long long)r_stored,
            (unsigned long long)stored_sum, (unsigned long long)stats.stored_bytes, file_size(dp));

    /* whole buffers, chunk edges, and random unaligned ranges */
    int whole_ok = 1, edge_ok = 1, rand_ok = 1;
    for (int i = 0; i < NB; i++) {
        uint64_t n = sm.b[i].bytes;
        whole_ok &= read_eq(s, &sm, i, 0, n);
        edge_ok &= read_eq(s, &sm, i, n, 0);
        if (n > chunk + 1) {
            edge_ok &= read_eq(s, &sm, i, chunk - 1, 2);
            edge_ok &= read_eq(s, &sm, i, chunk, n - chunk);
            edge_ok &= read_eq(s, &sm, i, 0, chunk);
        }
        for (int k = 0; k < 60 && n; k++) {
            uint64_t off = rnd_below(n + 1);
            uint64_t maxlen = n - off;
            uint64_t len = k % 5 == 0 ? maxlen : rnd_below((maxlen < 3 * chunk ? maxlen : 3 * chunk) + 1);
            rand_ok &= read_eq(s, &sm, i, off, len);
        }
    }
    T_CHECK(whole_ok, "whole-buffer reads differ");
    T_CHECK(edge_ok, "chunk-edge reads differ");
    T_CHECK(rand_ok, "random range reads differ");
    unsigned char tiny[8];
    uint64_t pn = sm.b[0].bytes;
    T_CHECK(ckpt_snapshot_read(s, "params", pn, 1, tiny, NULL, 0) == -EINVAL, "read past the end");
    T_CHECK(ckpt_snapshot_read(s, "params", pn + 1, 0, tiny, NULL, 0) == -EINVAL, "offset past end");
    T_CHECK(ckpt_snapshot_read(s, "params", pn - 4, 8, tiny, NULL, 0) == -EINVAL, "range over end");
    T_CHECK(ckpt_snapshot_read(s, "params", 0, 4, NULL, NULL, 0) == -EINVAL, "NULL dst");
    T_CHECK(ckpt_snapshot_read(s, "nope", 0, 1, tiny, NULL, 0) == -ENOENT, "missing buffer");
    T_CHECK(ckpt_snapshot_read(s, "empty", 0, 0, NULL, NULL, 0) == 0, "empty read of empty buffer");

    char bad[512] = "";
    prog p = {0, 0, 0, 1, 0};
    rc = ckpt_snapshot_verify(s, bad, sizeof bad, on_progress, &p);
    T_CHECK(rc == 0, "verify: %d %s", rc, bad);
    T_CHECK(p.calls > 0 && p.monotone && p.last_done == raw && p.last_total == raw,
            "progress: %d calls, last %llu of %llu", p.calls, (unsigned long long)p.last_done,
            (unsigned long long)p.last_total);
    prog stop = {0, 0, 0, 1, 2};
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, on_progress, &stop) == -ECANCELED && stop.calls == 2,
            "progress returning non-zero should cancel verify (calls %d)", stop.calls);
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify without progress");
    ckpt_snapshot_close(s);

    if (have_zstd) check_zstd_cli(sp, &sm, chunk, filter);
    free(mp);
    free(dp);
    free(sp);
    sample_free(&sm);
}

/* ------------------------------------------------------------------ commit protocol */

/* A data write that fails mid-save (CKPT_FAULT_STORE): -ENOSPC / -EIO, nothing committed,
 * no temp folder left; the next save in the same process (fault spent) commits. Runs in a
 * child so that the variable is read fresh. */
static int fault_child(const char *root, const char *fault, int want_rc)
{
    setenv("CKPT_FAULT_STORE", fault, 1);
    sample sm;
    sample_make(&sm, 3);
    int rc = save_sample(root, 20, &sm, 1u << 20, CKPT_FILTER_NONE, 1);
    int bad = 0;
    char *sp = step_path(root, 20);
    if (rc != want_rc) {
        fprintf(stderr, "FAIL fault %s: ckpt_save returned %d, want %d\n", fault, rc, want_rc);
        bad = 1;
    }
    if (t_exists(sp) || count_prefix(root, ".tmp-") != 0) {
        fprintf(stderr, "FAIL fault %s: step folder or temp folder left behind\n", fault);
        bad = 1;
    }
    rc = save_sample(root, 20, &sm, 1u << 20, CKPT_FILTER_NONE, 1);
    ckpt_snapshot *s = NULL;
    if (rc != 0 || ckpt_snapshot_open(&s, sp, NULL, 0) != 0 ||
        ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) != 0) {
        fprintf(stderr, "FAIL fault %s: the save after the fault did not commit (%d)\n", fault, rc);
        bad = 1;
    }
    ckpt_snapshot_close(s);
    free(sp);
    sample_free(&sm);
    return bad;
}

static void commit_faults(const char *base)
{
    static const struct {
        const char *fault;
        int rc;
    } f[] = {{"enospc:1", -ENOSPC}, {"eio:3", -EIO}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "fault-%zu", i);
        char *root = t_path_in(base, name);
        fflush(NULL);
        pid_t pid = fork();
        T_REQUIRE(pid >= 0, "fork");
        if (pid == 0) _exit(fault_child(root, f[i].fault, f[i].rc));
        int st = 0;
        waitpid(pid, &st, 0);
        T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fault %s child failed (status %d)",
                f[i].fault, st);
        free(root);
    }
}

static void commit_protocol(const char *base)
{
    char *root = t_path_in(base, "commit");
    sample a, b;
    sample_make(&a, 1);
    sample_make(&b, 2);
    T_REQUIRE(save_sample(root, 42, &a, 4096, CKPT_FILTER_NONE, 1) == 0, "first save of 42");
    char *sp = step_path(root, 42);
    char *mp = t_path_in(sp, "manifest.json"), *dp = t_path_in(sp, "rank-00000.bin");
    unsigned char *m0 = NULL, *d0 = NULL, *m1 = NULL, *d1 = NULL;
    long long mn0 = t_slurp(mp, &m0), dn0 = t_slurp(dp, &d0);

    /* the same step again: refused, first one untouched */
    int rc = save_sample(root, 42, &b, 4096, CKPT_FILTER_SHUFFLE, 0);
    T_CHECK(rc == -EEXIST, "second save of step 42: %d, want -EEXIST", rc);
    long long mn1 = t_slurp(mp, &m1), dn1 = t_slurp(dp, &d1);
    T_CHECK(mn0 > 0 && mn0 == mn1 && !memcmp(m0, m1, (size_t)mn0), "manifest of 42 changed");
    T_CHECK(dn0 > 0 && dn0 == dn1 && !memcmp(d0, d1, (size_t)dn0), "data of 42 changed");
    ckpt_snapshot *s = NULL;
    T_REQUIRE(ckpt_snapshot_open(&s, sp, NULL, 0) == 0, "open 42");
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify 42");
    T_CHECK(read_eq(s, &a, 0, 0, a.b[0].bytes), "step 42 no longer holds the first save's data");
    ckpt_snapshot_close(s);
    T_CHECK(count_prefix(root, ".tmp-") == 0, "temp folder left by the refused save");

    /* bad trainer records and bad arguments: -EINVAL, nothing created */
    const char *bad_json[] = {"[1,2]", "{bad", "\"str\"", "{\"a\":1} x", ""};
    for (size_t i = 0; i < sizeof bad_json / sizeof bad_json[0]; i++) {
        ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
        o.dir = root;
        rc = ckpt_save(&o, 43, "r", "c", a.b, NB, bad_json[i], NULL);
        T_CHECK(rc == -EINVAL, "trainer '%s': %d, want -EINVAL", bad_json[i], rc);
    }
    ckpt_save_opts good = CKPT_SAVE_OPTS_INIT;
    good.dir = root;
    ckpt_save_opts o = good;
    o.chunk_bytes = 4095;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "chunk 4095");
    o = good;
    o.chunk_bytes = 4104;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "chunk not /16");
    o = good;
    o.chunk_bytes = (1ull << 30) + 16;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "chunk > 1 GiB");
    o = good;
    o.zstd_level = 20;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "zstd level 20");
    o = good;
    o.filter = 2;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "filter 2");
    o = good;
    o.queue_depth = 0;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "queue depth 0");
    o = good;
    o.queue_depth = 65;
    T_CHECK(ckpt_save(&o, 43, "r", "c", a.b, NB, NULL, NULL) == -EINVAL, "queue depth 65");
    T_CHECK(ckpt_save(&good, 43, "r/x", "c", a.b, NB, NULL, NULL) == -EINVAL, "run id with /");
    T_CHECK(ckpt_save(&good, 43, "r", "", a.b, NB, NULL, NULL) == -EINVAL, "empty config hash");
    T_CHECK(ckpt_save(&good, 43, "r", "c", NULL, 2, NULL, NULL) == -EINVAL, "NULL buffers");
    ckpt_buffer bb[2] = {a.b[0], a.b[2]};
    bb[1].name = "params";
    T_CHECK(ckpt_save(&good, 43, "r", "c", bb, 2, NULL, NULL) == -EINVAL, "duplicate names");
    bb[1] = a.b[2];
    bb[1].name = "a name";
    T_CHECK(ckpt_save(&good, 43, "r", "c", bb, 2, NULL, NULL) == -EINVAL, "name with space");
    bb[1] = a.b[2];
    bb[1].elem_bytes = 3;
    T_CHECK(ckpt_save(&good, 43, "r", "c", bb, 2, NULL, NULL) == -EINVAL, "elem_bytes 3");
    bb[1] = a.b[2];
    bb[1].data = NULL;
    T_CHECK(ckpt_save(&good, 43, "r", "c", bb, 2, NULL, NULL) == -EINVAL, "NULL data");
    bb[1] = a.b[2];
    bb[1].bytes = bb[1].total_bytes + 1;
    T_CHECK(ckpt_save(&good, 43, "r", "c", bb, 2, NULL, NULL) == -EINVAL, "shard past total");
    bb[1] = a.b[0];
    bb[1].name = "odd";
    bb[1].total_bytes = bb[1].bytes = 4 * 5 + 2;
    T_CHECK(ckpt_save(&good, 43, "r", "c", bb, 2, NULL, NULL) == -EINVAL, "total not /elem");
    char *s43 = step_path(root, 43);
    T_CHECK(!t_exists(s43), "a failed save created %s", s43);
    T_CHECK(count_prefix(root, ".tmp-") == 0, "temp folder left by a failed save");

    /* NULL trainer record means {} */
    T_CHECK(ckpt_save(&good, 44, "r", "c", a.b, NB, NULL, NULL) == 0, "save with NULL trainer");
    char *s44 = step_path(root, 44);
    if (ckpt_snapshot_open(&s, s44, NULL, 0) == 0) {
        T_CHECK(!strcmp(ckpt_snapshot_trainer_json(s), "{}"), "trainer %s",
                ckpt_snapshot_trainer_json(s));
        ckpt_snapshot_close(s);
    } else {
        T_CHECK(0, "open step 44");
    }
    /* zero buffers is a valid snapshot */
    T_CHECK(ckpt_save(&good, 45, "r", "c", NULL, 0, "{}", NULL) == 0, "save without buffers");
    char *s45 = step_path(root, 45);
    if (ckpt_snapshot_open(&s, s45, NULL, 0) == 0) {
        T_CHECK(ckpt_snapshot_nbuffers(s) == 0 && ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0,
                "empty snapshot");
        ckpt_snapshot_close(s);
    } else {
        T_CHECK(0, "open step 45");
    }

    /* the root is a regular file, or lies below one */
    char *afile = t_path_in(base, "afile");
    T_REQUIRE(t_spit(afile, "x", 1) == 0, "write %s", afile);
    o = good;
    o.dir = afile;
    rc = ckpt_save(&o, 1, "r", "c", a.b, NB, NULL, NULL);
    T_CHECK(rc < 0, "root is a file: %d", rc);
    char *below = t_path_in(afile, "sub");
    o.dir = below;
    rc = ckpt_save(&o, 1, "r", "c", a.b, NB, NULL, NULL);
    T_CHECK(rc < 0, "root below a file: %d", rc);
    T_CHECK(file_size(afile) == 1, "%s was changed", afile);

    free(below);
    free(afile);
    free(s45);
    free(s44);
    free(s43);
    free(m0);
    free(m1);
    free(d0);
    free(d1);
    free(mp);
    free(dp);
    free(sp);
    free(root);
    sample_free(&a);
    sample_free(&b);
}

static void remove_temp(const char *base)
{
    char *root = t_path_in(base, "leftovers");
    T_REQUIRE(mkdir(root, 0755) == 0, "mkdir %s", root);
    const char *temps[] = {".tmp-step-000000005-x-1", ".tmp-step-000000007-run.9-4242",
                           ".tmp-step-1000000000-r-1"};
    const char *keep[] = {".tmp-step-5-x-1", ".tmp-step-000000005", ".tmp-step-000000005x-1",
                          ".tmp-other", "tmp-step-000000005-x-1", "step-000000005", "notes"};
    for (size_t i = 0; i < 3; i++) {
        char *p = t_path_in(root, temps[i]);
        T_REQUIRE(mkdir(p, 0755) == 0, "mkdir %s", p);
        char *sub = t_path_in(p, "deeper"), *f = t_path_in(p, "rank-00000.bin");
        T_REQUIRE(mkdir(sub, 0755) == 0 && t_spit(f, "partial", 7) == 0, "fill %s", p);
        char *g = t_path_in(sub, "x");
        T_REQUIRE(t_spit(g, "y", 1) == 0, "write %s", g);
        free(g);
        free(sub);
        free(f);
        free(p);
    }
    for (size_t i = 0; i < sizeof keep / sizeof keep[0]; i++) {
        char *p = t_path_in(root, keep[i]);
        T_REQUIRE(mkdir(p, 0755) == 0, "mkdir %s", p);
        free(p);
    }
    int rc = ckpt_remove_temp(root);
    T_CHECK(rc == 3, "ckpt_remove_temp returned %d, want 3", rc);
    for (size_t i = 0; i < 3; i++) {
        char *p = t_path_in(root, temps[i]);
        T_CHECK(!t_exists(p), "%s not removed", temps[i]);
        free(p);
    }
    for (size_t i = 0; i < sizeof keep / sizeof keep[0]; i++) {
        char *p = t_path_in(root, keep[i]);
        T_CHECK(t_exists(p), "%s was removed but is no temp folder of a save", keep[i]);
        free(p);
    }
    T_CHECK(ckpt_remove_temp(root) == 0, "second ckpt_remove_temp should find nothing");
    char *missing = t_path_in(base, "no-such-dir");
    T_CHECK(ckpt_remove_temp(missing) == 0, "missing dir should give 0");
    free(missing);
    free(root);
}

/* ------------------------------------------------------------------ listing */

static void listing(const char *base)
{
    char *root = t_path_in(base, "list");
    sample sm;
    sample_make(&sm, 5);
    const uint64_t order[] = {100, 1000000000, 9, 10, 200, 300};
    for (size_t i = 0; i < 6; i++)
        T_REQUIRE(save_sample(root, order[i], &sm, 4096, CKPT_FILTER_NONE, 0) == 0, "save %llu",
                  (unsigned long long)order[i]);
    char *big = step_path(root, 1000000000);
    T_CHECK(strstr(big, "/step-1000000000") != NULL, "folder of step 1e9: %s", big);

    char *p50 = step_path(root, 50); /* final name, no manifest */
    T_REQUIRE(mkdir(p50, 0755) == 0, "mkdir %s", p50);
    char *tmp10 = t_path_in(root, ".tmp-step-000000010-x-1");
    T_REQUIRE(mkdir(tmp10, 0755) == 0, "mkdir %s", tmp10);
    char *p200 = step_path(root, 200); /* a newer format, correctly summed */
    T_REQUIRE(rewrite_manifest(p200, "\"format_version\":1,", "\"format_version\":2,") == 0,
              "rewrite %s", p200);
    char *p300 = step_path(root, 300), *p301 = step_path(root, 301);
    T_REQUIRE(rename(p300, p301) == 0, "rename to %s", p301);
    const char *ignored[] = {"step-12", "step-000000007x", "notes", ".tmp-step-8-x"};
    for (size_t i = 0; i < 4; i++) {
        char *p = t_path_in(root, ignored[i]);
        T_REQUIRE(mkdir(p, 0755) == 0, "mkdir %s", p);
        free(p);
    }

    ckpt_entry *e = NULL;
    size_t n = 0;
    int rc = ckpt_list(root, &e, &n);
    T_REQUIRE(rc == 0, "ckpt_list: %d", rc);
    static const struct {
        uint64_t step;
        int status;
        const char *name;
        const char *reason; /* substring expected in the reason; NULL: empty reason */
    } want[] = {
        {9, CKPT_STATUS_COMMITTED, "step-000000009", NULL},
        {10, CKPT_STATUS_COMMITTED, "step-000000010", NULL},
        {10, CKPT_STATUS_INCOMPLETE, ".tmp-step-000000010-x-1", "temp"},
        {50, CKPT_STATUS_CORRUPT, "step-000000050", "manifest"},
        {100, CKPT_STATUS_COMMITTED, "step-000000100", NULL},
        {200, CKPT_STATUS_NEWER, "step-000000200", "format_version"},
        {301, CKPT_STATUS_CORRUPT, "step-000000301", "300"},
        {1000000000, CKPT_STATUS_COMMITTED, "step-1000000000", NULL},
    };
    size_t nw = sizeof want / sizeof want[0];
    T_CHECK(n == nw, "ckpt_list gave %zu entries, want %zu", n, nw);
    for (size_t i = 0; i < n && i < nw; i++) {
        T_CHECK(e[i].step == want[i].step && !strcmp(e[i].name, want[i].name),
                "entry %zu: step %llu %s, want %llu %s", i, (unsigned long long)e[i].step,
                e[i].name, (unsigned long long)want[i].step, want[i].name);
        T_CHECK(e[i].status == want[i].status, "entry %zu (%s): status %s, want %s", i, e[i].name,
                ckpt_status_name(e[i].status), ckpt_status_name(want[i].status));
        if (want[i].reason)
            T_CHECK(strstr(e[i].reason, want[i].reason) != NULL, "entry %s: reason '%s' lacks '%s'",
                    e[i].name, e[i].reason, want[i].reason);
        else
            T_CHECK(e[i].reason[0] == 0 && e[i].created > 0 && e[i].raw_bytes > 0 &&
                        e[i].stored_bytes > 0,
                    "committed entry %s: reason '%s' created %lld raw %llu", e[i].name,
                    e[i].reason, (long long)e[i].created, (unsigned long long)e[i].raw_bytes);
    }
    free(e);

    ckpt_snapshot *s = (ckpt_snapshot *)1;
    char why[512] = "";
    rc = ckpt_snapshot_open(&s, p200, why, sizeof why);
    T_CHECK(rc == -EPROTONOSUPPORT && s == NULL, "open of format_version 2: %d (%s)", rc, why);
    T_CHECK(strstr(why, "format_version") != NULL, "why: %s", why);

    T_CHECK(!strcmp(ckpt_status_name(CKPT_STATUS_COMMITTED), "committed") &&
                !strcmp(ckpt_status_name(CKPT_STATUS_CORRUPT), "corrupt") &&
                !strcmp(ckpt_status_name(CKPT_STATUS_NEWER), "newer-format") &&
                !strcmp(ckpt_status_name(CKPT_STATUS_INCOMPLETE), "incomplete"),
            "status names");
    char *missing = t_path_in(base, "no-such-dir");
    e = (ckpt_entry *)1;
    n = 99;
    T_CHECK(ckpt_list(missing, &e, &n) == 0 && n == 0, "list of a missing dir");
    if (n == 0 && e != (ckpt_entry *)1) free(e);

    free(missing);
    free(p300);
    free(p301);
    free(p200);
    free(tmp10);
    free(p50);
    free(big);
    free(root);
    sample_free(&sm);
}

/* ------------------------------------------------------------------ corruption */

typedef struct chunk_loc {
    char buffer[64];
    int index;
    uint64_t offset, bytes;            /* raw range in the buffer */
    uint64_t file_offset, stored_bytes;
    char xxh3_stored[17];
} chunk_loc;

/* The chunk whose stored bytes hold file offset `pos`, from the manifest. */
static int find_chunk(const char *snap, uint64_t pos, chunk_loc *out)
{
    char *mp = t_path_in(snap, "manifest.json");
    json_error_t je;
    json_t *m = json_load_file(mp, JSON_DISABLE_EOF_CHECK, &je);
    free(mp);
    int found = -1;
    size_t i, j;
    json_t *b, *c;
    json_array_foreach(json_object_get(m, "buffers"), i, b) {
        json_t *sh = json_array_get(json_object_get(b, "shards"), 0);
        json_array_foreach(json_object_get(sh, "chunks"), j, c) {
            uint64_t fo = (uint64_t)json_integer_value(json_object_get(c, "file_offset"));
            uint64_t sb = (uint64_t)json_integer_value(json_object_get(c, "stored_bytes"));
            if (pos >= fo && pos < fo + sb) {
                snprintf(out->buffer, sizeof out->buffer, "%s",
                         json_string_value(json_object_get(b, "name")));
                out->index = (int)j;
                out->offset = (uint64_t)json_integer_value(json_object_get(c, "offset"));
                out->bytes = (uint64_t)json_integer_value(json_object_get(c, "bytes"));
                out->file_offset = fo;
                out->stored_bytes = sb;
                snprintf(out->xxh3_stored, sizeof out->xxh3_stored, "%s",
                         json_string_value(json_object_get(c, "xxh3_stored")));
                found = 0;
            }
        }
    }
    json_decref(m);
    return found;
}

static int sample_index(const sample *sm, const char *name)
{
    for (int i = 0; i < NB; i++)
        if (!strcmp(sm->b[i].name, name)) return i;
    return -1;
}

static int flip_byte(const char *path, uint64_t pos)
{
    int fd = open(path, O_RDWR);
    if (fd < 0) return -1;
    unsigned char c;
    int ok = pread(fd, &c, 1, (off_t)pos) == 1;
    c ^= 0x5A;
    ok = ok && pwrite(fd, &c, 1, (off_t)pos) == 1;
    close(fd);
    return ok ? 0 : -1;
}

static void c05_truncate_shard(const char *root, const sample *sm)
{
    T_REQUIRE(save_sample(root, 501, sm, 4096, CKPT_FILTER_NONE, 1) == 0, "save 501");
    char *sp = step_path(root, 501), *dp = t_path_in(sp, "rank-00000.bin");
    long long size = file_size(dp);
    T_REQUIRE(size > 0 && truncate(dp, size - 1) == 0, "truncate %s", dp);
    ckpt_snapshot *s = (ckpt_snapshot *)1;
    char why[512] = "";
    int rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && s == NULL, "open of a truncated shard: %d", rc);
    T_CHECK(strstr(why, "rank-00000.bin") != NULL, "why does not name the file: %s", why);

    /* one byte too many is as wrong as one too few */
    T_REQUIRE(truncate(dp, size + 1) == 0, "extend %s", dp);
    why[0] = 0;
    rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "rank-00000.bin"), "open of a long shard: %d %s", rc, why);

    ckpt_entry *e = NULL;
    size_t n = 0;
    T_REQUIRE(ckpt_list(root, &e, &n) == 0, "list");
    for (size_t i = 0; i < n; i++)
        if (e[i].step == 501)
            T_CHECK(e[i].status == CKPT_STATUS_CORRUPT && strstr(e[i].reason, "rank-00000.bin"),
                    "list: truncated snapshot is %s (%s)", ckpt_status_name(e[i].status),
                    e[i].reason);
    free(e);
    free(dp);
    free(sp);
}

static void c05_flip_byte(const char *root, const sample *sm)
{
    T_REQUIRE(save_sample(root, 502, sm, 4096, CKPT_FILTER_SHUFFLE, 1) == 0, "save 502");
    char *sp = step_path(root, 502), *dp = t_path_in(sp, "rank-00000.bin");
    uint64_t mid = (uint64_t)file_size(dp) / 2;
    chunk_loc k;
    T_REQUIRE(find_chunk(sp, mid, &k) == 0, "no chunk holds file offset %llu",
              (unsigned long long)mid);
    int bi = sample_index(sm, k.buffer);
    T_REQUIRE(bi >= 0, "chunk of unknown buffer %s", k.buffer);
    T_REQUIRE(k.offset > 0 && k.offset + k.bytes < sm->b[bi].bytes,
              "test wants a chunk in the middle of its buffer");
    T_REQUIRE(flip_byte(dp, mid) == 0, "flip byte of %s", dp);

    ckpt_snapshot *s = NULL;
    char why[512] = "", bad[512] = "", chunk_txt[64];
    snprintf(chunk_txt, sizeof chunk_txt, "chunk %d ", k.index);
    int rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
    T_REQUIRE(rc == 0, "open after a flipped byte (sizes are fine): %d %s", rc, why);

    rc = ckpt_snapshot_verify(s, bad, sizeof bad, NULL, NULL);
    T_CHECK(rc == -EBADMSG, "verify after a flipped byte: %d", rc);
    T_CHECK(strstr(bad, "rank-00000.bin") && strstr(bad, chunk_txt) && strstr(bad, k.buffer),
            "verify's report should name file, '%s' and buffer %s: %s", chunk_txt, k.buffer, bad);

    unsigned char *dst = malloc(sm->b[bi].bytes);
    T_REQUIRE(dst != NULL, "malloc");
    bad[0] = 0;
    rc = ckpt_snapshot_read(s, k.buffer, k.offset + k.bytes / 2, 1, dst, bad, sizeof bad);
    T_CHECK(rc == -EBADMSG, "read of one byte of the bad chunk: %d", rc);
    T_CHECK(strstr(bad, "rank-00000.bin") && strstr(bad, chunk_txt), "read's report: %s", bad);
    T_CHECK(ckpt_snapshot_read(s, k.buffer, 0, sm->b[bi].bytes, dst, NULL, 0) == -EBADMSG,
            "read of the whole buffer over the bad chunk");
    T_CHECK(ckpt_snapshot_read(s, k.buffer, k.offset - 1, 2, dst, NULL, 0) == -EBADMSG,
            "read across the bad chunk's start");
    /* only overlapping chunks are read: the ranges beside it still come back right */
    T_CHECK(read_eq(s, sm, bi, 0, k.offset), "read before the bad chunk");
    T_CHECK(read_eq(s, sm, bi, k.offset + k.bytes, sm->b[bi].bytes - k.offset - k.bytes),
            "read after the bad chunk");
    T_CHECK(read_eq(s, sm, bi, k.offset - 3, 3), "read ending at the bad chunk");
    for (int i = 0; i < NB; i++)
        if (i != bi) T_CHECK(read_eq(s, sm, i, 0, sm->b[i].bytes), "buffer %s", sm->b[i].name);
    ckpt_snapshot_close(s);

    /* a frame changed together with its stored checksum: the decoder or the raw checksum
     * must still catch it */
    unsigned char *frame = malloc(k.stored_bytes);
    int fd = open(dp, O_RDONLY);
    T_REQUIRE(frame && fd >= 0 && pread(fd, frame, k.stored_bytes, (off_t)k.file_offset) ==
                                      (ssize_t)k.stored_bytes,
              "read frame");
    close(fd);
    char from[64], to[64], hex[17];
    ckpt_hex64(XXH3_64bits(frame, k.stored_bytes), hex);
    snprintf(from, sizeof from, "\"xxh3_stored\":\"%s\"", k.xxh3_stored);
    snprintf(to, sizeof to, "\"xxh3_stored\":\"%s\"", hex);
    T_REQUIRE(rewrite_manifest(sp, from, to) == 0, "rewrite stored checksum");
    T_REQUIRE(ckpt_snapshot_open(&s, sp, why, sizeof why) == 0, "reopen: %s", why);
    bad[0] = 0;
    rc = ckpt_snapshot_read(s, k.buffer, k.offset, k.bytes, dst, bad, sizeof bad);
    T_CHECK(rc == -EBADMSG && strstr(bad, chunk_txt), "frame with a matching stored checksum: %d %s",
            rc, bad);
    T_CHECK(read_eq(s, sm, bi, 0, k.offset), "read before the bad chunk (2)");
    ckpt_snapshot_close(s);
    free(frame);
    free(dst);
    free(dp);
    free(sp);
}

static void c05_raw_checksum(const char *root, const sample *sm)
{
    /* data intact, manifest's raw checksum of a chunk wrong (and the manifest re-summed) */
    T_REQUIRE(save_sample(root, 503, sm, 4096, CKPT_FILTER_NONE, 0) == 0, "save 503");
    char *sp = step_path(root, 503);
    chunk_loc k;
    T_REQUIRE(find_chunk(sp, 0, &k) == 0, "first chunk");
    char *mp = t_path_in(sp, "manifest.json");
    unsigned char *text = NULL;
    T_REQUIRE(t_slurp(mp, &text) > 0, "read manifest");
    const char *raw = strstr((const char *)text, "\"xxh3_raw\":\"");
    T_REQUIRE(raw != NULL, "no xxh3_raw");
    char from[64], to[64];
    snprintf(from, sizeof from, "%.29s", raw);
    snprintf(to, sizeof to, "%s", from);
    to[12] = to[12] == '0' ? '1' : '0';
    T_REQUIRE(rewrite_manifest(sp, from, to) == 0, "rewrite raw checksum");
    ckpt_snapshot *s = NULL;
    char bad[512] = "";
    T_REQUIRE(ckpt_snapshot_open(&s, sp, NULL, 0) == 0, "open 503");
    int rc = ckpt_snapshot_read(s, k.buffer, 0, 1, (unsigned char[1]){0}, bad, sizeof bad);
    T_CHECK(rc == -EBADMSG && strstr(bad, "chunk 0 ") && strstr(bad, "rank-00000.bin"),
            "raw checksum mismatch: %d %s", rc, bad);
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == -EBADMSG, "verify with bad raw sum");
    ckpt_snapshot_close(s);
    free(text);
    free(mp);
    free(sp);
}

static void c01_missing_manifest(const char *root, const sample *sm)
{
    T_REQUIRE(save_sample(root, 504, sm, 4096, CKPT_FILTER_NONE, 1) == 0, "save 504");
    char *sp = step_path(root, 504), *mp = t_path_in(sp, "manifest.json");
    T_REQUIRE(unlink(mp) == 0, "unlink manifest");
    ckpt_snapshot *s = (ckpt_snapshot *)1;
    char why[512] = "";
    int rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
    /* ckpt.h: a snapshot folder without its manifest is corrupt (FORMAT.md); -ENOENT is
     * kept for "no such folder", which is what a folder renamed away meanwhile gives */
    T_CHECK(rc == -EBADMSG && s == NULL, "open without manifest: %d, want -EBADMSG", rc);
    T_CHECK(strstr(why, "manifest") != NULL, "why: %s", why);
    char *none = step_path(root, 999);
    s = (ckpt_snapshot *)1;
    rc = ckpt_snapshot_open(&s, none, NULL, 0);
    T_CHECK(rc == -ENOENT && s == NULL, "open of a missing folder: %d, want -ENOENT", rc);
    free(none);
    free(mp);
    free(sp);
}

static void missing_data_file(const char *root, const sample *sm)
{
    T_REQUIRE(save_sample(root, 505, sm, 4096, CKPT_FILTER_NONE, 1) == 0, "save 505");
    char *sp = step_path(root, 505), *dp = t_path_in(sp, "rank-00000.bin");
    /* disappears after open: reads fail cleanly and name the file */
    ckpt_snapshot *s = NULL;
    T_REQUIRE(ckpt_snapshot_open(&s, sp, NULL, 0) == 0, "open 505");
    T_REQUIRE(unlink(dp) == 0, "unlink %s", dp);
    char why[512] = "";
    unsigned char buf[16];
    int rc = ckpt_snapshot_read(s, "params", 0, 16, buf, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "rank-00000.bin"), "read after unlink: %d %s", rc, why);
    ckpt_snapshot_close(s);
    /* missing at open */
    why[0] = 0;
    s = (ckpt_snapshot *)1;
    rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && s == NULL, "open without data file: %d", rc);
    T_CHECK(strstr(why, "rank-00000.bin") != NULL, "why: %s", why);
    free(dp);
    free(sp);
}

static void garbage_manifest(const char *root, const sample *sm)
{
    T_REQUIRE(save_sample(root, 506, sm, 4096, CKPT_FILTER_NONE, 1) == 0, "save 506");
    char *sp = step_path(root, 506), *mp = t_path_in(sp, "manifest.json");
    unsigned char *orig = NULL;
    long long on = t_slurp(mp, &orig);
    T_REQUIRE(on > 100, "read manifest");
    unsigned char *buf = malloc((size_t)on + 64);
    T_REQUIRE(buf != NULL, "malloc");

    struct variant {
        const char *what;
        size_t len;
    } v = {"", 0};
    for (int kind = 0; kind < 8; kind++) {
        memcpy(buf, orig, (size_t)on);
        size_t len = (size_t)on;
        switch (kind) {
        case 0:
            v.what = "random bytes";
            for (size_t i = 0; i < 4096; i++) buf[i] = (unsigned char)rnd();
            len = 4096;
            break;
        case 1:
            v.what = "empty file";
            len = 0;
            break;
        case 2:
            v.what = "first half";
            len = (size_t)on / 2;
            break;
        case 3:
            v.what = "closing brace cut (checksum still right)";
            len = (size_t)on - 2;
            break;
        case 4: {
            v.what = "checksum digit changed";
            char *h = strstr((char *)buf, CKPT_MANIFEST_SUM_KEY) + strlen(CKPT_MANIFEST_SUM_KEY);
            h[7] = h[7] == 'a' ? 'b' : 'a';
            break;
        }
        case 5: {
            v.what = "a digit of chunk_bytes changed, checksum not fixed";
            char *d = strstr((char *)buf, "\"chunk_bytes\":4096");
            T_REQUIRE(d != NULL, "no chunk_bytes");
            d[strlen("\"chunk_bytes\":4096") - 1] = '7';
            break;
        }
        case 6: {
            v.what = "a digit of a chunk offset changed, checksum not fixed";
            char *d = strstr((char *)buf, "\"offset\":4096,");
            T_REQUIRE(d != NULL, "no chunk at offset 4096");
            d[9] = '5';
            break;
        }
        case 7:
            v.what = "junk after the closing brace";
            memcpy(buf + len, "x\n", 2);
            len += 2;
            break;
        }
        v.len = len;
        T_REQUIRE(t_spit(mp, buf, v.len) == 0, "write manifest");
        ckpt_snapshot *s = (ckpt_snapshot *)1;
        char why[512] = "";
        int rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG && s == NULL && why[0], "manifest with %s: %d (%s)", v.what, rc, why);
    }

    /* correctly summed manifests that describe something impossible */
    static const struct {
        const char *what, *from, *to;
    } fix[] = {
        {"body no JSON", "{\"buffers\"", "{\"buffers\"x"},
        {"other format", "\"format\":\"ckptsys.snapshot\"", "\"format\":\"other\""},
        {"format_version 0", "\"format_version\":1,", "\"format_version\":0,"},
        {"chunk bytes", "\"bytes\":4096,", "\"bytes\":4080,"},
        {"total bytes", "\"total_bytes\":40028}", "\"total_bytes\":40032}"},
        {"file bytes", "\"files\":[{\"bytes\":", "\"files\":[{\"bytes\":1"},
        {"unknown codec", "\"codec\":\"zstd\"", "\"codec\":\"lz4\""},
        {"unknown filter", "\"filter\":\"none\"", "\"filter\":\"delta\""},
        {"duplicate key", "{\"buffers\"", "{\"step\":1,\"buffers\""},
        {"trainer not an object", "\"trainer\":{", "\"trainer\":[],\"x\":{"},
        {"negative step", "\"step\":506,", "\"step\":-506,"},
        {"world_size 0", "\"world_size\":1", "\"world_size\":0"},
    };
    for (size_t i = 0; i < sizeof fix / sizeof fix[0]; i++) {
        T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore manifest");
        T_REQUIRE(rewrite_manifest(sp, fix[i].from, fix[i].to) == 0, "rewrite for %s", fix[i].what);
        ckpt_snapshot *s = (ckpt_snapshot *)1;
        char why[512] = "";
        int rc = ckpt_snapshot_open(&s, sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG && s == NULL && why[0], "summed manifest with %s: %d (%s)",
                fix[i].what, rc, why);
    }

    /* the untouched manifest opens: the failures above came from the changes */
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore manifest");
    ckpt_snapshot *s = NULL;
    T_CHECK(ckpt_snapshot_open(&s, sp, NULL, 0) == 0, "restored manifest does not open");
    ckpt_snapshot_close(s);
    /* and a re-summed but unchanged body also opens (the test's checksum rule is right) */
    T_REQUIRE(rewrite_manifest(sp, "\"format_version\":1,", "\"format_version\":1,") == 0, "resum");
    T_CHECK(ckpt_snapshot_open(&s, sp, NULL, 0) == 0, "re-summed manifest does not open");
    ckpt_snapshot_close(s);
    free(buf);
    free(orig);
    free(mp);
    free(sp);
}

static void corruption(const char *base)
{
    char *root = t_path_in(base, "corrupt");
    sample sm;
    sample_make(&sm, 9);
    c05_truncate_shard(root, &sm);
    c05_flip_byte(root, &sm);
    c05_raw_checksum(root, &sm);
    c01_missing_manifest(root, &sm);
    missing_data_file(root, &sm);
    garbage_manifest(root, &sm);
    sample_free(&sm);
    free(root);
}

/* ------------------------------------------------------------------ filters and helpers */

static void shuffle_inverse(void)
{
    static const uint32_t ebs[] = {1, 2, 4, 8};
    static const size_t lens[] = {0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 100, 4093, 4096};
    unsigned char src[4100], sh[4100], back[4100];
    int def_ok = 1, inv_ok = 1;
    for (size_t e = 0; e < 4; e++)
        for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
            uint32_t eb = ebs[e];
            size_t n = lens[l], count = n / eb;
            for (size_t i = 0; i < n; i++) src[i] = (unsigned char)rnd();
            memset(sh, 0xEE, sizeof sh);
            memset(back, 0xEE, sizeof back);
            ckpt_shuffle(sh, src, n, eb);
            for (size_t k = 0; k < eb; k++) /* byte plane k of every element, then the tail */
                for (size_t i = 0; i < count; i++) def_ok &= sh[k * count + i] == src[i * eb + k];
            for (size_t i = count * eb; i < n; i++) def_ok &= sh[i] == src[i];
            def_ok &= sh[n] == 0xEE;
            ckpt_unshuffle(back, sh, n, eb);
            inv_ok &= memcmp(back, src, n) == 0 && back[n] == 0xEE;
            if (!inv_ok || !def_ok) {
                fprintf(stderr, "shuffle elem %u len %zu\n", eb, n);
                break;
            }
        }
    T_CHECK(def_ok, "ckpt_shuffle does not lay out byte planes as ckpt_internal.h says");
    T_CHECK(inv_ok, "ckpt_unshuffle(ckpt_shuffle(x)) != x");
}

static void name_helpers(void)
{
    char b[32];
    uint64_t st = 0;
    ckpt_step_dirname(5, b, sizeof b);
    T_CHECK(!strcmp(b, "step-000000005"), "%s", b);
    ckpt_step_dirname(1234567890123ull, b, sizeof b);
    T_CHECK(!strcmp(b, "step-1234567890123"), "%s", b);
    T_CHECK(ckpt_parse_step_dirname("step-000000010", &st) == 0 && st == 10, "parse step");
    T_CHECK(ckpt_parse_step_dirname("step-00000010", &st) != 0, "8 digits accepted");
    T_CHECK(ckpt_parse_step_dirname("step-000000010 ", &st) != 0, "trailing space accepted");
    T_CHECK(ckpt_parse_temp_dirname(".tmp-step-000000005-x-1", &st) == 0 && st == 5, "parse temp");
    T_CHECK(ckpt_parse_temp_dirname(".tmp-step-000000005", &st) != 0, "temp without id");
    char hex[17];
    uint64_t v = 0;
    ckpt_hex64(0x0123456789abcdefull, hex);
    T_CHECK(!strcmp(hex, "0123456789abcdef"), "hex %s", hex);
    T_CHECK(ckpt_parse_hex64("0123456789abcdef", &v) == 0 && v == 0x0123456789abcdefull, "parse");
    T_CHECK(ckpt_parse_hex64("0123456789ABCDEF", &v) == -EBADMSG, "upper case accepted");
    T_CHECK(ckpt_parse_hex64("0123456789abcde", &v) == -EBADMSG, "15 digits accepted");
    T_CHECK(ckpt_parse_hex64("0123456789abcdef0", &v) == -EBADMSG, "17 digits accepted");
}

int main(void)
{
    char *base = t_tmpdir("ckpt-format");
    commit_faults(base); /* first: forks before this process writes anything */

    int have_zstd = system("zstd --version > /dev/null 2>&1") == 0;
    if (!have_zstd) fprintf(stderr, "note: no zstd command; the zstd -d checks are skipped\n");
    char *rt = t_path_in(base, "roundtrip");
    uint64_t step = 1;
    for (int chunk = 0; chunk < 2; chunk++)
        for (int filter = 0; filter < 2; filter++)
            for (int direct = 0; direct < 2; direct++)
                round_trip(rt, step++, chunk ? 4u << 20 : 4096, filter, direct, have_zstd);
    free(rt);

    commit_protocol(base);
    remove_temp(base);
    listing(base);
    corruption(base);
    shuffle_inverse();
    name_helpers();

    t_rmrf(base);
    free(base);
    return t_done("test_ckpt_format");
}
