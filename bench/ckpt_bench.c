/* ckpt_bench - the asynchronous checkpoint engine against memcpy and a naive write(2) of the
 * same bytes, on the same disk. A benchmark, not a test: it checks nothing but that a load
 * gives back the bytes saved.
 *
 * Default mode: generate a synthetic optimizer state in memory (seeded, deterministic), then
 * measure, in this order:
 *   fault    - the first touch (memset) of a buffer of the state's size: page faults;
 *   memcpy   - the state copied into that already-faulted buffer (one thread, best of 3);
 *   naive    - write(2) of the state in 4 MiB blocks to DIR/state.bin, then fsync (buffered);
 *   ours     - per mode (uncompressed, zstd, optionally zstd + shuffle): --reps + 1 snapshots
 *              staged and persisted one after the other with ckpt_engine_stage/wait (the
 *              first stage also allocates and faults the staging area; the best of the
 *              others is reported), then the last loaded cold (page cache dropped) --reps
 *              times with ckpt_snapshot_open/read on --threads reading threads and compared
 *              with the state.
 * Figures go to stdout as "key value" lines (seconds, bytes) for bench/ckpt_bench.sh, which
 * adds fio and the zstd CLI on DIR/state.bin and prints the table.
 *
 * --from mode: read the buffers of a real snapshot and print a table of the compression ratio
 * of zstd level 1 with and without the shuffle filter, per buffer (ckpt_save into DIR).
 *
 * Exit status: 0 done, 1 failure, 2 usage error.
 */
#include "clock.h"
#include "ckpt.h"
#include "log.h"
#include "storage.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TAG "bench"
#define MIB (1024.0 * 1024.0)
#define NAIVE_BLOCK (4u << 20)
#define TRAINER_JSON "{\"bench\":\"ckpt_bench\"}"

static const char usage_text[] =
    "usage: ckpt_bench [options]              engine vs memcpy and write(2), key value lines\n"
    "       ckpt_bench --from SNAPSHOT [--dir DIR]  zstd -1 ratio with/without shuffle\n"
    "\n"
    "Options:\n"
    "  --dir DIR        work folder on the disk to measure (created if missing); default a\n"
    "                   new temp folder under /tmp, removed at the end\n"
    "  --size-mib N     state size in MiB, split in three f32 buffers; default 2048\n"
    "  --seed S         generator seed; default 1\n"
    "  --threads T      engine compression threads and snapshot reading threads; default the\n"
    "                   number of online cores\n"
    "  --reps R         repetitions: per mode R + 1 saves (the first also allocates the\n"
    "                   staging area) and R cold loads; the best is reported; default 2\n"
    "  --shuffle        also measure zstd with the shuffle filter\n"
    "  --overlap        engine option: the persist starts with the stage copy\n"
    "  --only MODE      measure the engine in one mode only: raw, zstd or zstd_shuffle\n"
    "                   (for profiling)\n"
    "  --keep-state     leave DIR/state.bin (the state's bytes, for the zstd CLI)\n"
    "  --keep           leave every file written (snapshots too)\n"
    "  --frames         write DIR/frames.zst: the zstd frames of the last zstd snapshot, in\n"
    "                   file order (chunks stored raw left out), for the zstd -d baseline\n"
    "  --from SNAPSHOT  a snapshot folder (step-NNNNNNNNN) or a snapshot root (its newest\n"
    "                   committed snapshot is taken)\n"
    "  -h, --help       this text\n";

typedef struct bench_opts {
    const char *dir;
    const char *from;
    uint64_t size_mib;
    uint64_t seed;
    unsigned threads;
    unsigned reps;
    int shuffle;
    int overlap; /* engine option: persist starts with the stage copy */
    const char *only; /* one mode key, or NULL for all */
    int keep_state;
    int keep;
    int frames; /* write DIR/frames.zst: the zstd frames of the zstd mode's last snapshot */
} bench_opts;

/* The synthetic state: three f32 buffers of n elements each. */
typedef struct state {
    uint64_t n;
    float *buf[3];
} state;

static const char *const state_names[3] = {"params", "adam_m", "adam_v"};

/* CPU time of the whole process (every thread, the engine's too), user + system, seconds. */
static double cpu_s(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           1e-6 * (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

/* out = a + "/" + b; -ENAMETOOLONG when it does not fit in len bytes. */
static int path_join(char *out, size_t len, const char *a, const char *b)
{
    int n = snprintf(out, len, "%s/%s", a, b);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

static unsigned online_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1u : n > 64 ? 64u : (unsigned)n;
}

/* ------------------------------------------------------------------ generator */

/* splitmix64's finalizer: a bijection on 64 bits, so distinct keys give distinct draws. */
static inline uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Two N(0, 1) draws from the top 48 bits of h (Box-Muller on 24-bit uniforms); the low 16
 * bits are left to the caller. */
static inline void normal2(uint64_t h, float *z0, float *z1)
{
    float u1 = (float)((h >> 40) + 1) * 0x1p-24f;          /* (0, 1] */
    float u2 = (float)((h >> 16) & 0xffffffu) * 0x1p-24f;  /* [0, 1) */
    float r = sqrtf(-2.0f * logf(u1));
    float a = 6.2831853f * u2;
    *z0 = r * cosf(a);
    *z1 = r * sinf(a);
}

typedef struct gen_job {
    state *st;
    uint64_t seed;
    uint64_t k0, k1; /* element pairs [k0, k1) */
} gen_job;

/* Pair k holds elements 2k and 2k+1 of each buffer; its values depend only on (seed, k), so
 * the state does not depend on how the pairs are split among threads.
 *   params ~ N(0, 0.02)
 *   adam_m ~ N(0, 1e-3), a quarter of it scaled down by 2^-6 .. 2^-21 (rarely updated
 *            parameters: many tiny values)
 *   adam_v = m^2 (1 + z^2), z ~ N(0, 1): positive, small, m^2-like */
static void *gen_run(void *arg)
{
    const gen_job *j = arg;
    const uint64_t n = j->st->n;
    const uint64_t bp = mix64(j->seed * 3 + 0), bm = mix64(j->seed * 3 + 1),
                   bv = mix64(j->seed * 3 + 2);
    float *p = j->st->buf[0], *m = j->st->buf[1], *v = j->st->buf[2];
    for (uint64_t k = j->k0; k < j->k1; k++) {
        float p2[2], m2[2], z2[2];
        normal2(mix64(bp ^ k), &p2[0], &p2[1]);
        uint64_t hm = mix64(bm ^ k);
        normal2(hm, &m2[0], &m2[1]);
        normal2(mix64(bv ^ k), &z2[0], &z2[1]);
        unsigned sel = (unsigned)(hm & 0xffffu);
        for (int t = 0; t < 2; t++) {
            uint64_t i = 2 * k + (uint64_t)t;
            if (i >= n) break;
            unsigned s = (sel >> (8 * t)) & 0xffu;
            float mv = 1e-3f * m2[t];
            if ((s & 3u) == 0) mv = ldexpf(mv, -(int)(6 + (s >> 4)));
            p[i] = 0.02f * p2[t];
            m[i] = mv;
            v[i] = mv * mv * (1.0f + z2[t] * z2[t]);
        }
    }
    return NULL;
}

static void state_free(state *st)
{
    for (int b = 0; b < 3; b++) free(st->buf[b]);
    memset(st, 0, sizeof *st);
}

/* Allocate and fill the state on `threads` threads (which also faults it in).
 * Errors: -ENOMEM, -errno of pthread_create. */
static int state_generate(state *st, uint64_t bytes, uint64_t seed, unsigned threads)
{
    int rc = 0;
    memset(st, 0, sizeof *st);
    st->n = bytes / 12;
    size_t alloc = (size_t)((st->n * 4 + 4095) / 4096 * 4096);
    for (int b = 0; b < 3; b++) {
        st->buf[b] = aligned_alloc(4096, alloc ? alloc : 4096);
        if (!st->buf[b]) {
            rc = -ENOMEM;
            goto out;
        }
    }
    pthread_t tid[64];
    gen_job jobs[64];
    unsigned started = 0;
    uint64_t pairs = (st->n + 1) / 2;
    for (unsigned t = 0; t < threads; t++) {
        jobs[t] = (gen_job){st, seed, pairs * t / threads, pairs * (t + 1) / threads};
        int e = pthread_create(&tid[t], NULL, gen_run, &jobs[t]);
        if (e) {
            rc = -e;
            break;
        }
        started++;
    }
    for (unsigned t = 0; t < started; t++) pthread_join(tid[t], NULL);
out:
    if (rc < 0) state_free(st);
    return rc;
}

/* ------------------------------------------------------------------ measurements */

/* Write back dirty pages and drop the page cache so that loads come from the disk.
 * Returns 0 or -errno (then *why says what failed). */
static int drop_caches(char *why, size_t why_len)
{
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    if (fd < 0 || write(fd, "3\n", 2) != 2) {
        int rc = -errno;
        snprintf(why, why_len, "cannot write /proc/sys/vm/drop_caches: %s", strerror(errno));
        if (fd >= 0) close(fd);
        return rc;
    }
    close(fd);
    return 0;
}

/* Best of 3 copies of the whole state into dst (already faulted), seconds. */
static double measure_memcpy(const state *st, uint8_t *dst)
{
    double best = INFINITY;
    size_t len = (size_t)st->n * 4;
    for (int r = 0; r < 3; r++) {
        double t0 = clock_now_s();
        for (int b = 0; b < 3; b++) memcpy(dst + (size_t)b * len, st->buf[b], len);
        double t = clock_now_s() - t0;
        if (t < best) best = t;
    }
    return best;
}

/* write(2) the state in 4 MiB blocks to a new file `path`, fsync, close: seconds in *secs,
 * process CPU seconds in *cpu.
 * Returns 0 or -errno. */
static int measure_naive(const state *st, const char *path, double *secs, double *cpu)
{
    int rc = 0;
    size_t len = (size_t)st->n * 4;
    unlink(path);
    sync();
    double c0 = cpu_s(), t0 = clock_now_s();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return -errno;
    for (int b = 0; b < 3 && rc == 0; b++) {
        const uint8_t *p = (const uint8_t *)st->buf[b];
        size_t done = 0;
        while (done < len) {
            size_t want = len - done < NAIVE_BLOCK ? len - done : NAIVE_BLOCK;
            ssize_t w = write(fd, p + done, want);
            if (w < 0) {
                if (errno == EINTR) continue;
                rc = -errno;
                break;
            }
            done += (size_t)w; /* a short write is continued */
        }
    }
    if (rc == 0 && fsync(fd) != 0) rc = -errno;
    if (close(fd) != 0 && rc == 0) rc = -errno;
    *secs = clock_now_s() - t0;
    *cpu = cpu_s() - c0;
    return rc;
}

typedef struct mode_result {
    double stall_first_s;            /* the first stage: also allocates the staging area */
    double stall_s, stall_max_s;     /* steady stages: best and worst */
    double persist_s, save_s, save_max_s, save_cpu_s; /* the best steady save, the worst */
    double write_s, write_max_s;     /* steady saves from the end of the stage copy to the
                                        commit (the disk path alone): best and worst */
    double load_s, load_max_s, load_cpu_s;            /* the best cold load, the worst */
    uint64_t raw_bytes, stored_bytes;
    int load_ok;
} mode_result;

static void fill_buffers(const state *st, ckpt_buffer bufs[3])
{
    for (int b = 0; b < 3; b++)
        bufs[b] = (ckpt_buffer){state_names[b], "f32", 4, st->n * 4, 0, st->n * 4, st->buf[b]};
}

/* Open snapshot `path` and read every buffer of the state into dst (three consecutive
 * buffers) on `threads` reading threads: seconds in *secs, process CPU seconds in *cpu.
 * Returns 0 or -errno. */
static int load_snapshot(const char *path, const state *st, unsigned threads, uint8_t *dst,
                         double *secs, double *cpu)
{
    char why[256] = "", bad[256] = "";
    ckpt_snapshot *s = NULL;
    size_t len = (size_t)st->n * 4;
    double c0 = cpu_s(), t0 = clock_now_s();
    int rc = ckpt_snapshot_open(&s, path, why, sizeof why);
    if (rc < 0) {
        LOG_E(TAG, "cannot open %s: %s (%s)", path, strerror(-rc), why);
        goto out;
    }
    if ((rc = ckpt_snapshot_set_threads(s, threads)) < 0) goto out;
    for (int b = 0; b < 3; b++) {
        rc = ckpt_snapshot_read(s, state_names[b], 0, len, dst + (size_t)b * len, bad, sizeof bad);
        if (rc < 0) {
            LOG_E(TAG, "cannot read %s of %s: %s %s", state_names[b], path, strerror(-rc), bad);
            goto out;
        }
    }
    *secs = clock_now_s() - t0;
    *cpu = cpu_s() - c0;
out:
    ckpt_snapshot_close(s);
    return rc;
}

/* One zstd frame of a snapshot: where it lies in its data file, its stored and raw bytes. */
typedef struct frame_ref {
    int64_t file_offset, stored, raw;
} frame_ref;

static int cmp_frame(const void *a, const void *b)
{
    const frame_ref *x = a, *y = b;
    return x->file_offset < y->file_offset ? -1 : x->file_offset > y->file_offset;
}

/* Write the zstd frames of the world-of-one snapshot `snap` (its rank-00000.bin), in file
 * order, to a new file `out`: what the zstd CLI decompresses for the restore baseline (a data
 * file is concatenated frames, except chunks stored raw, which zstd cannot read). Prints
 * "<key>.frames_bytes", "<key>.frames_raw_bytes" (the bytes they decode to) and
 * "<key>.raw_chunks" (chunks left out). Returns 0 or -errno. */
static int extract_frames(const char *snap, const char *out, const char *key)
{
    char path[CKPT_PATH_MAX];
    json_error_t jerr;
    frame_ref *f = NULL;
    size_t n = 0, cap = 0, raw_chunks = 0;
    int in = -1, fd = -1, rc = 0;
    uint8_t *buf = NULL;
    int64_t fbytes = 0, fraw = 0;
    if ((rc = path_join(path, sizeof path, snap, "manifest.json")) < 0) return rc;
    json_t *m = json_load_file(path, 0, &jerr);
    json_t *bufs = json_object_get(m, "buffers"), *b, *sh, *c;
    size_t i, j, k;
    json_array_foreach(bufs, i, b) {
        json_array_foreach(json_object_get(b, "shards"), j, sh) {
            json_array_foreach(json_object_get(sh, "chunks"), k, c) {
                const char *codec = json_string_value(json_object_get(c, "codec"));
                if (!codec || strcmp(codec, "zstd") != 0) {
                    raw_chunks++;
                    continue;
                }
                if (n == cap) {
                    cap = cap ? 2 * cap : 256;
                    frame_ref *nf = realloc(f, cap * sizeof *f);
                    if (!nf) {
                        rc = -ENOMEM;
                        goto out;
                    }
                    f = nf;
                }
                f[n++] = (frame_ref){json_integer_value(json_object_get(c, "file_offset")),
                                     json_integer_value(json_object_get(c, "stored_bytes")),
                                     json_integer_value(json_object_get(c, "bytes"))};
            }
        }
    }
    if (!m) {
        LOG_E(TAG, "cannot parse %s: %s", path, jerr.text);
        rc = -EBADMSG;
        goto out;
    }
    qsort(f, n, sizeof *f, cmp_frame);
    if ((rc = path_join(path, sizeof path, snap, "rank-00000.bin")) < 0) goto out;
    in = open(path, O_RDONLY | O_CLOEXEC);
    fd = open(out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (in < 0 || fd < 0) {
        rc = -errno;
        goto out;
    }
    for (size_t q = 0; q < n; q++) {
        uint8_t *nb = realloc(buf, (size_t)f[q].stored);
        if (!nb) {
            rc = -ENOMEM;
            goto out;
        }
        buf = nb;
        if (pread(in, buf, (size_t)f[q].stored, f[q].file_offset) != f[q].stored ||
            write(fd, buf, (size_t)f[q].stored) != f[q].stored) {
            rc = errno ? -errno : -EIO;
            goto out;
        }
        fbytes += f[q].stored;
        fraw += f[q].raw;
    }
    if (fsync(fd) != 0) rc = -errno;
    printf("%s.frames_bytes %lld\n%s.frames_raw_bytes %lld\n%s.raw_chunks %zu\n", key,
           (long long)fbytes, key, (long long)fraw, key, raw_chunks);
out:
    if (in >= 0) close(in);
    if (fd >= 0 && close(fd) != 0 && rc == 0) rc = -errno;
    free(buf);
    free(f);
    json_decref(m);
    return rc;
}

/* Save the state reps + 1 times with one engine in folder snap-<key> of dir (the first save also
 * allocates the staging area; the others are steady), then load the last snapshot cold reps
 * times into dst and compare it with the state. Returns 0 or -errno. */
static int measure_mode(const bench_opts *bo, const state *st, uint8_t *dst, const char *key,
                        int compress, int filter, mode_result *res)
{
    char snapdir[CKPT_PATH_MAX], path[CKPT_PATH_MAX], name[32], why[256], sub[64];
    ckpt_buffer bufs[3];
    ckpt_engine *e = NULL;
    ckpt_persist_stats ps = {0};
    const unsigned saves = bo->reps + 1;
    /* far beyond any sane persist: 60 s plus 20 s per GB */
    const double wait_s = 60.0 + 20.0 * (double)st->n * 12 / 1e9;
    int rc;
    memset(res, 0, sizeof *res);
    fill_buffers(st, bufs);
    snprintf(sub, sizeof sub, "snap-%.50s", key);
    if ((rc = path_join(snapdir, sizeof snapdir, bo->dir, sub)) < 0) return rc;
    if ((rc = store_remove_tree(snapdir)) < 0) return rc;

    ckpt_engine_opts o = CKPT_ENGINE_OPTS_INIT;
    o.save.dir = snapdir;
    o.save.zstd_level = 1;
    o.save.filter = filter;
    o.compress = compress;
    o.threads = bo->threads;
    o.overlap = bo->overlap;
    o.reserve_bytes = (size_t)(3 * st->n * sizeof(float)); /* as train does: faulted in at create */
    if ((rc = ckpt_engine_create(&e, &o)) < 0) {
        LOG_E(TAG, "ckpt_engine_create: %s", strerror(-rc));
        goto out;
    }
    res->stall_s = res->save_s = res->write_s = INFINITY;
    for (unsigned i = 1; i <= saves; i++) {
        double stall = 0, c0 = cpu_s();
        rc = ckpt_engine_stage(e, i, "bench", "synthetic", bufs, 3, TRAINER_JSON, &stall);
        if (rc != 0) {
            LOG_E(TAG, "ckpt_engine_stage step %u: %s", i, rc < 0 ? strerror(-rc) : "skipped");
            if (rc > 0) rc = -EAGAIN;
            goto out;
        }
        rc = ckpt_engine_wait(e, wait_s);
        if (rc == -EINPROGRESS) {
            /* A stuck persist cannot be destroyed without waiting for it as well: leave the
             * snapshot folder for inspection and end the process. */
            fprintf(stderr, "ckpt_bench: persist of step %u did not finish within %.0f s: the "
                    "engine is stuck (pid %ld; snapshot folder %s left in place)\n", i, wait_s,
                    (long)getpid(), snapdir);
            fflush(stdout);
            _exit(1);
        }
        if (rc < 0) {
            LOG_E(TAG, "persist of step %u: %s", i, strerror(-rc));
            goto out;
        }
        double cpu = cpu_s() - c0;
        if ((rc = ckpt_engine_last(e, &ps)) < 0 || ps.step != i || ps.result != 0) {
            LOG_E(TAG, "no stats for the persist of step %u", i);
            rc = rc < 0 ? rc : -EIO;
            goto out;
        }
        /* the persist starts with the stage copy and follows it, so the whole save runs from
         * the start of the stage to the commit: that is persist_seconds */
        double save = ps.persist_seconds;
        printf("%s.save%u stall_s=%.6f persist_s=%.6f cpu_s=%.6f\n", key, i, ps.stage_seconds,
               ps.persist_seconds, cpu);
        if (i == 1) {
            res->stall_first_s = ps.stage_seconds;
            if (saves > 1) continue;
        }
        double write = ps.persist_seconds - ps.stage_seconds;
        if (write < res->write_s) res->write_s = write;
        if (write > res->write_max_s) res->write_max_s = write;
        if (ps.stage_seconds < res->stall_s) res->stall_s = ps.stage_seconds;
        if (ps.stage_seconds > res->stall_max_s) res->stall_max_s = ps.stage_seconds;
        if (save > res->save_max_s) res->save_max_s = save;
        if (save < res->save_s) {
            res->save_s = save;
            res->persist_s = ps.persist_seconds;
            res->save_cpu_s = cpu;
        }
    }
    res->raw_bytes = ps.raw_bytes;
    res->stored_bytes = ps.stored_bytes;
    rc = ckpt_engine_destroy(e);
    e = NULL;
    if (rc < 0) goto out;

    ckpt_step_dirname(saves, name, sizeof name);
    if ((rc = path_join(path, sizeof path, snapdir, name)) < 0) goto out;
    res->load_s = INFINITY;
    res->load_ok = 1;
    for (unsigned r = 0; r < bo->reps; r++) {
        double secs = 0, cpu = 0;
        /* cold when the cache can be dropped (a failure was reported already) */
        drop_caches(why, sizeof why);
        memset(dst, 0, (size_t)st->n * 12); /* a load that skipped bytes cannot pass */
        if ((rc = load_snapshot(path, st, bo->threads, dst, &secs, &cpu)) < 0) goto out;
        printf("%s.load%u s=%.6f cpu_s=%.6f\n", key, r + 1, secs, cpu);
        if (secs > res->load_max_s) res->load_max_s = secs;
        if (secs < res->load_s) {
            res->load_s = secs;
            res->load_cpu_s = cpu;
        }
        for (int b = 0; b < 3; b++)
            if (memcmp(dst + (size_t)b * st->n * 4, st->buf[b], (size_t)st->n * 4) != 0)
                res->load_ok = 0;
    }
    if (bo->frames && compress && filter == CKPT_FILTER_NONE) {
        char fpath[CKPT_PATH_MAX];
        if ((rc = path_join(fpath, sizeof fpath, bo->dir, "frames.zst")) < 0 ||
            (rc = extract_frames(path, fpath, key)) < 0) {
            /* the baseline row then says "not run"; the engine's figures stand */
            LOG_E(TAG, "extracting the zstd frames of %s: %s", path, strerror(-rc));
            unlink(fpath);
            rc = 0;
        }
    }
out:
    if (e) ckpt_engine_destroy(e);
    if (!bo->keep) store_remove_tree(snapdir);
    return rc;
}

static void print_mode(const char *key, const mode_result *r)
{
    printf("%s.stall_first_s %.6f\n", key, r->stall_first_s);
    printf("%s.stall_s %.6f\n", key, r->stall_s);
    printf("%s.stall_max_s %.6f\n", key, r->stall_max_s);
    printf("%s.persist_s %.6f\n", key, r->persist_s);
    printf("%s.save_s %.6f\n", key, r->save_s);
    printf("%s.save_max_s %.6f\n", key, r->save_max_s);
    printf("%s.save_cpu_s %.6f\n", key, r->save_cpu_s);
    printf("%s.write_s %.6f\n", key, r->write_s);
    printf("%s.write_max_s %.6f\n", key, r->write_max_s);
    printf("%s.raw_bytes %llu\n", key, (unsigned long long)r->raw_bytes);
    printf("%s.stored_bytes %llu\n", key, (unsigned long long)r->stored_bytes);
    printf("%s.load_s %.6f\n", key, r->load_s);
    printf("%s.load_max_s %.6f\n", key, r->load_max_s);
    printf("%s.load_cpu_s %.6f\n", key, r->load_cpu_s);
    printf("%s.load_ok %d\n", key, r->load_ok);
    fflush(stdout);
}

static int run_synthetic(const bench_opts *bo)
{
    state st = {0};
    uint8_t *dst = NULL;
    char path[CKPT_PATH_MAX], why[256] = "";
    unsigned cores = online_cores();
    int rc;

    uint64_t bytes = bo->size_mib << 20;
    if ((rc = path_join(path, sizeof path, bo->dir, "state.bin")) < 0) return rc;
    double t0 = clock_now_s();
    if ((rc = state_generate(&st, bytes, bo->seed, cores)) < 0) {
        fprintf(stderr, "ckpt_bench: cannot generate %llu MiB of state: %s\n",
                (unsigned long long)bo->size_mib, strerror(-rc));
        return rc;
    }
    uint64_t raw = st.n * 12;
    printf("raw_bytes %llu\n", (unsigned long long)raw);
    printf("cores %u\n", cores);
    printf("engine_threads %u\n", bo->threads);
    printf("seed %llu\n", (unsigned long long)bo->seed);
    printf("gen_s %.6f\n", clock_now_s() - t0);
    fflush(stdout);

    dst = aligned_alloc(4096, (size_t)((raw + 4095) / 4096 * 4096));
    if (!dst) {
        rc = -ENOMEM;
        goto out;
    }
    t0 = clock_now_s();
    memset(dst, 1, (size_t)raw); /* fault it in: memcpy measures copying, not page faults */
    printf("fault_s %.6f\n", clock_now_s() - t0);
    printf("memcpy_s %.6f\n", measure_memcpy(&st, dst));

    double naive_s = 0, naive_cpu = 0;
    if ((rc = measure_naive(&st, path, &naive_s, &naive_cpu)) < 0) {
        fprintf(stderr, "ckpt_bench: naive write of %s: %s\n", path, strerror(-rc));
        goto out;
    }
    printf("naive_s %.6f\n", naive_s);
    printf("naive_cpu_s %.6f\n", naive_cpu);

    /* Dropping the cache is probed once here; loads retry it and ignore the result. */
    if (drop_caches(why, sizeof why) == 0) printf("drop_caches ok\n");
    else printf("drop_caches %s\n", why);
    fflush(stdout);

    static const struct {
        const char *key;
        int compress, filter;
    } modes[] = {{"raw", 0, CKPT_FILTER_NONE},
                 {"zstd", 1, CKPT_FILTER_NONE},
                 {"zstd_shuffle", 1, CKPT_FILTER_SHUFFLE}};
    for (int m = 0; m < 3; m++) {
        mode_result r;
        if (bo->only ? strcmp(bo->only, modes[m].key) != 0 : m == 2 && !bo->shuffle) continue;
        fprintf(stderr, "ckpt_bench: engine, %s: %u saves of %.0f MiB, then %u cold loads\n",
                modes[m].key, bo->reps + 1, (double)raw / MIB, bo->reps);
        rc = measure_mode(bo, &st, dst, modes[m].key, modes[m].compress, modes[m].filter, &r);
        if (rc < 0) {
            fprintf(stderr, "ckpt_bench: engine, %s: %s\n", modes[m].key, strerror(-rc));
            goto out;
        }
        print_mode(modes[m].key, &r);
        if (!r.load_ok) {
            fprintf(stderr, "ckpt_bench: engine, %s: the loaded bytes differ from the state\n",
                    modes[m].key);
            rc = -EBADMSG;
            goto out;
        }
    }
out:
    if (!bo->keep_state && !bo->keep) unlink(path);
    free(dst);
    state_free(&st);
    return rc;
}

/* ------------------------------------------------------------------ --from */

/* Open `path` as a snapshot, or else as a root whose newest committed snapshot is taken. */
static int open_from(const char *path, ckpt_snapshot **out)
{
    char why[256] = "", sub[CKPT_PATH_MAX];
    int rc = ckpt_snapshot_open(out, path, why, sizeof why);
    if (rc != -ENOENT) {
        if (rc < 0) fprintf(stderr, "ckpt_bench: %s: %s (%s)\n", path, strerror(-rc), why);
        return rc;
    }
    ckpt_entry *ents = NULL;
    size_t n = 0;
    if ((rc = ckpt_list(path, &ents, &n)) < 0) {
        fprintf(stderr, "ckpt_bench: %s is neither a snapshot nor a snapshot root\n", path);
        return rc;
    }
    rc = -ENOENT;
    for (size_t i = n; i-- > 0;) {
        if (ents[i].status != CKPT_STATUS_COMMITTED) continue;
        rc = path_join(sub, sizeof sub, path, ents[i].name);
        if (rc == 0) rc = ckpt_snapshot_open(out, sub, why, sizeof why);
        break;
    }
    free(ents);
    if (rc < 0) fprintf(stderr, "ckpt_bench: no committed snapshot under %s\n", path);
    return rc;
}

/* Stored bytes per buffer of a ckpt_save of bufs with `filter` at zstd level 1, in sub. */
static int stored_with_filter(const char *dir, const char *sub, int filter, const ckpt_buffer *bufs,
                              size_t n, uint64_t *stored)
{
    char root[CKPT_PATH_MAX], path[CKPT_PATH_MAX], name[32], why[256] = "";
    ckpt_snapshot *s = NULL;
    int rc = path_join(root, sizeof root, dir, sub);
    if (rc == 0) rc = store_remove_tree(root);
    if (rc < 0) return rc;
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.zstd_level = 1;
    o.filter = filter;
    if ((rc = ckpt_save(&o, 1, "bench", "from", bufs, n, TRAINER_JSON, NULL)) < 0) {
        fprintf(stderr, "ckpt_bench: ckpt_save into %s: %s\n", root, strerror(-rc));
        goto out;
    }
    ckpt_step_dirname(1, name, sizeof name);
    if ((rc = path_join(path, sizeof path, root, name)) < 0) goto out;
    if ((rc = ckpt_snapshot_open(&s, path, why, sizeof why)) < 0) {
        fprintf(stderr, "ckpt_bench: %s: %s (%s)\n", path, strerror(-rc), why);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        ckpt_buffer_info info;
        if ((rc = ckpt_snapshot_buffer_info(s, i, &info)) < 0) goto out;
        stored[i] = info.stored_bytes;
    }
out:
    ckpt_snapshot_close(s);
    store_remove_tree(root);
    return rc;
}

static double ratio(uint64_t raw, uint64_t stored)
{
    return stored ? (double)raw / (double)stored : 0.0;
}

static int run_from(const bench_opts *bo)
{
    ckpt_snapshot *s = NULL;
    ckpt_buffer *bufs = NULL;
    ckpt_buffer_info *info = NULL;
    uint64_t *st_none = NULL, *st_shuf = NULL;
    char bad[256] = "";
    size_t n = 0;
    int rc = open_from(bo->from, &s);
    if (rc < 0) return rc;
    n = ckpt_snapshot_nbuffers(s);
    bufs = calloc(n ? n : 1, sizeof *bufs);
    info = calloc(n ? n : 1, sizeof *info);
    st_none = calloc(n ? n : 1, sizeof *st_none);
    st_shuf = calloc(n ? n : 1, sizeof *st_shuf);
    if (!bufs || !info || !st_none || !st_shuf) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if ((rc = ckpt_snapshot_buffer_info(s, i, &info[i])) < 0) goto out;
        void *data = malloc(info[i].total_bytes ? (size_t)info[i].total_bytes : 1);
        if (!data) {
            rc = -ENOMEM;
            goto out;
        }
        bufs[i] = (ckpt_buffer){info[i].name, info[i].dtype, info[i].elem_bytes,
                                info[i].total_bytes, 0, info[i].total_bytes, data};
        rc = ckpt_snapshot_read(s, info[i].name, 0, info[i].total_bytes, data, bad, sizeof bad);
        if (rc < 0) {
            fprintf(stderr, "ckpt_bench: reading %s: %s %s\n", info[i].name, strerror(-rc), bad);
            goto out;
        }
    }
    if ((rc = stored_with_filter(bo->dir, "from-none", CKPT_FILTER_NONE, bufs, n, st_none)) < 0 ||
        (rc = stored_with_filter(bo->dir, "from-shuffle", CKPT_FILTER_SHUFFLE, bufs, n, st_shuf)) < 0)
        goto out;

    printf("snapshot %s (step %llu)\n", ckpt_snapshot_path(s),
           (unsigned long long)ckpt_snapshot_step(s));
    printf("compression ratio = raw bytes / stored bytes; ckpt_save at zstd level 1, default "
           "chunks (4 MiB), a chunk stored raw when zstd does not shrink it\n\n");
    printf("%-12s %-5s %10s %12s %10s %16s\n", "buffer", "dtype", "raw MiB", "as stored",
           "zstd -1", "zstd -1+shuffle");
    uint64_t traw = 0, tstored = 0, tnone = 0, tshuf = 0;
    for (size_t i = 0; i < n; i++) {
        printf("%-12s %-5s %10.2f %11.3fx %9.3fx %15.3fx\n", info[i].name, info[i].dtype,
               (double)info[i].total_bytes / MIB, ratio(info[i].total_bytes, info[i].stored_bytes),
               ratio(info[i].total_bytes, st_none[i]), ratio(info[i].total_bytes, st_shuf[i]));
        traw += info[i].total_bytes;
        tstored += info[i].stored_bytes;
        tnone += st_none[i];
        tshuf += st_shuf[i];
    }
    printf("%-12s %-5s %10.2f %11.3fx %9.3fx %15.3fx\n", "all", "", (double)traw / MIB,
           ratio(traw, tstored), ratio(traw, tnone), ratio(traw, tshuf));
out:
    for (size_t i = 0; bufs && i < n; i++) free((void *)bufs[i].data);
    free(bufs);
    free(info);
    free(st_none);
    free(st_shuf);
    ckpt_snapshot_close(s);
    return rc;
}

/* ------------------------------------------------------------------ main */

static int parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi) return -EINVAL;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    bench_opts bo = {NULL, NULL, 2048, 1, 0, 2, 0, 0, NULL, 0, 0, 0};
    char tmpdir[] = "/tmp/ckpt-bench.XXXXXX";
    int own_dir = 0;
    uint64_t v;
    static const struct option opts[] = {
        {"dir", required_argument, NULL, 'd'},  {"size-mib", required_argument, NULL, 's'},
        {"seed", required_argument, NULL, 'S'}, {"threads", required_argument, NULL, 't'},
        {"reps", required_argument, NULL, 'n'}, {"shuffle", no_argument, NULL, 'x'},
        {"overlap", no_argument, NULL, 'O'},
        {"only", required_argument, NULL, 'o'}, {"keep-state", no_argument, NULL, 'k'},
        {"keep", no_argument, NULL, 'K'},       {"from", required_argument, NULL, 'f'},
        {"frames", no_argument, NULL, 'F'},
        {"help", no_argument, NULL, 'h'},       {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'd': bo.dir = optarg; break;
        case 'f': bo.from = optarg; break;
        case 'x': bo.shuffle = 1; break;
        case 'O': bo.overlap = 1; break;
        case 'o':
            if (strcmp(optarg, "raw") && strcmp(optarg, "zstd") && strcmp(optarg, "zstd_shuffle"))
                goto usage;
            bo.only = optarg;
            break;
        case 'k': bo.keep_state = 1; break;
        case 'K': bo.keep = 1; break;
        case 'F': bo.frames = 1; break;
        case 's':
            if (parse_u64(optarg, 1, 1u << 20, &bo.size_mib) < 0) goto usage;
            break;
        case 'S':
            if (parse_u64(optarg, 0, UINT64_MAX, &bo.seed) < 0) goto usage;
            break;
        case 't':
            if (parse_u64(optarg, 1, 64, &v) < 0) goto usage;
            bo.threads = (unsigned)v;
            break;
        case 'n':
            if (parse_u64(optarg, 1, 100, &v) < 0) goto usage;
            bo.reps = (unsigned)v;
            break;
        case 'h': fputs(usage_text, stdout); return 0;
        default: goto usage;
        }
    }
    if (optind != argc) goto usage;
    if (!bo.threads) bo.threads = online_cores();

    if (!bo.dir) {
        if (!mkdtemp(tmpdir)) {
            fprintf(stderr, "ckpt_bench: mkdtemp %s: %s\n", tmpdir, strerror(errno));
            return 1;
        }
        bo.dir = tmpdir;
        own_dir = 1;
    } else if (mkdir(bo.dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "ckpt_bench: mkdir %s: %s\n", bo.dir, strerror(errno));
        return 1;
    }
    int rc = bo.from ? run_from(&bo) : run_synthetic(&bo);
    if (own_dir && !bo.keep && !bo.keep_state) store_remove_tree(tmpdir);
    return rc < 0 ? 1 : 0;
usage:
    fputs(usage_text, stderr);
    return 2;
}
