/* s3_bench - our S3 tier on one W=2 snapshot, for bench/s3_bench.sh (which adds awscli on the
 * same files and prints the table). A benchmark, not a test: it checks only what the reader's
 * checksums check.
 *
 *   s3_bench make --dir DIR [--size-mib N] [--seed S] [--codec zstd|none]
 *       a synthetic fp32 optimizer state (params, adam_m, adam_v; the generator of
 *       ckpt_bench: N(0, 0.02) weights, small and many tiny first moments, m^2-like second
 *       moments) saved as one committed snapshot DIR/step-000000001 by two engines, ranks 0
 *       and 1, whose two-phase commit runs over an in-memory board (as in
 *       tests/unit/test_ckpt_group.c); codec zstd (default): zstd -1 + byte shuffle, what
 *       train writes by default; none: every chunk raw.
 *   s3_bench upload --dir DIR --url s3://BUCKET/PREFIX [--part-mib N] [--in-flight K]
 *       two ckpt_uploader instances (rank 0 and rank 1, each with its own objstore handle, a
 *       memory ckpt_group between them) upload DIR/step-000000001; wall time from the submit
 *       to both done (rank 0: manifest included).
 *   s3_bench restore --url s3://BUCKET/PREFIX [--world W] [--threads T]
 *       W threads, each a new rank with its own objstore handle: ckpt_snapshot_open_s3 (GET
 *       manifest, HEAD every object), then ckpt_snapshot_read of its 1/W of every buffer into
 *       memory faulted beforehand (every chunk checked against its checksums by the reader);
 *       wall time from the first open to the last byte.
 * Each prints "key value" lines on stdout (seconds, bytes, counts). Settings and keys of the
 * store come from the AWS variables (storage/objstore.h).
 * Exit status: 0 done, 1 failure, 2 usage error.
 */
#include "ckpt.h"
#include "ckpt_s3.h"
#include "clock.h"
#include "log.h"
#include "objstore.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define STEP 1
#define RUN_ID "s3bench"
#define WORLD 2
#define MAXW 8

static const char usage_text[] =
    "usage: s3_bench make --dir DIR [--size-mib N] [--seed S] [--codec zstd|none]\n"
    "       s3_bench upload --dir DIR --url s3://BUCKET/PREFIX [--part-mib N] [--in-flight K]\n"
    "       s3_bench restore --url s3://BUCKET/PREFIX [--world W] [--threads T] [--in-flight K]\n"
    "  make     a committed W=2 snapshot DIR/step-000000001 of a synthetic fp32 optimizer\n"
    "           state of N MiB (default 2048), zstd -1 + shuffle (default) or raw\n"
    "  upload   ranks 0 and 1 upload it with ckpt_uploader (part size default 256 MiB,\n"
    "           objstore in flight default 8)\n"
    "  restore  W (default 2, at most 8) ranks read their 1/W of every buffer from S3\n"
    "           (reading threads per rank default 8)\n"
    "Prints key value lines. Store settings from the AWS variables (storage/objstore.h).\n";

static double cpu_s(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           1e-6 * (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

/* ------------------------------------------------------------------ the state (ckpt_bench's) */

static const char *const bname[3] = {"params", "adam_m", "adam_v"};

static inline uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline void normal2(uint64_t h, float *z0, float *z1)
{
    float u1 = (float)((h >> 40) + 1) * 0x1p-24f;
    float u2 = (float)((h >> 16) & 0xffffffu) * 0x1p-24f;
    float r = sqrtf(-2.0f * logf(u1));
    float a = 6.2831853f * u2;
    *z0 = r * cosf(a);
    *z1 = r * sinf(a);
}

/* Elements [first, first + n) of the three buffers (first even). */
typedef struct gen_job {
    float *buf[3];
    uint64_t seed, first, n;
} gen_job;

static void *gen_run(void *arg)
{
    const gen_job *j = arg;
    const uint64_t bp = mix64(j->seed * 3 + 0), bm = mix64(j->seed * 3 + 1),
                   bv = mix64(j->seed * 3 + 2);
    for (uint64_t i = 0; i < j->n; i += 2) {
        uint64_t k = (j->first + i) / 2;
        float p2[2], m2[2], z2[2];
        normal2(mix64(bp ^ k), &p2[0], &p2[1]);
        uint64_t hm = mix64(bm ^ k);
        normal2(hm, &m2[0], &m2[1]);
        normal2(mix64(bv ^ k), &z2[0], &z2[1]);
        unsigned sel = (unsigned)(hm & 0xffffu);
        for (int t = 0; t < 2 && i + (uint64_t)t < j->n; t++) {
            unsigned s = (sel >> (8 * t)) & 0xffu;
            float mv = 1e-3f * m2[t];
            if ((s & 3u) == 0) mv = ldexpf(mv, -(int)(6 + (s >> 4)));
            j->buf[0][i + t] = 0.02f * p2[t];
            j->buf[1][i + t] = mv;
            j->buf[2][i + t] = mv * mv * (1.0f + z2[t] * z2[t]);
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ the memory board
 *
 * What the elastic store does for train: ranks != 0 post their vote per step, rank 0 its
 * decision; one step at a time is enough here. */

typedef struct board {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t step[WORLD];
    int voted[WORLD], vote[WORLD];
    int decided, decision;
} board;

typedef struct rank_ctx {
    board *b;
    uint32_t rank;
} rank_ctx;

static board g_board = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}, {0}, {0}, 0, 0};

static void abs_deadline(struct timespec *ts, double s)
{
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += (time_t)s;
    ts->tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static int board_vote(void *ctx, uint64_t step, int result)
{
    rank_ctx *c = ctx;
    pthread_mutex_lock(&c->b->mu);
    c->b->step[c->rank] = step;
    c->b->voted[c->rank] = 1;
    c->b->vote[c->rank] = result;
    pthread_cond_broadcast(&c->b->cv);
    pthread_mutex_unlock(&c->b->mu);
    return 0;
}

static int board_collect(void *ctx, uint64_t step, double timeout_s)
{
    rank_ctx *c = ctx;
    board *b = c->b;
    struct timespec ts;
    abs_deadline(&ts, timeout_s);
    int rc = 0;
    pthread_mutex_lock(&b->mu);
    for (uint32_t r = 1; r < WORLD && rc == 0; r++) {
        while (!(b->voted[r] && b->step[r] == step))
            if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) break;
        if (!(b->voted[r] && b->step[r] == step)) rc = -ETIMEDOUT;
        else if (b->vote[r] < 0) rc = b->vote[r];
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static int board_decide(void *ctx, uint64_t step, int result)
{
    rank_ctx *c = ctx;
    (void)step;
    pthread_mutex_lock(&c->b->mu);
    c->b->decided = 1;
    c->b->decision = result;
    pthread_cond_broadcast(&c->b->cv);
    pthread_mutex_unlock(&c->b->mu);
    return 0;
}

static int board_outcome(void *ctx, uint64_t step, double timeout_s, int *decision)
{
    rank_ctx *c = ctx;
    board *b = c->b;
    (void)step;
    struct timespec ts;
    abs_deadline(&ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    while (!b->decided)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) break;
    int rc = b->decided ? 0 : -ETIMEDOUT;
    if (b->decided) *decision = b->decision;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static void board_reset(void)
{
    pthread_mutex_lock(&g_board.mu);
    memset(g_board.voted, 0, sizeof g_board.voted);
    g_board.decided = 0;
    pthread_mutex_unlock(&g_board.mu);
}

/* ------------------------------------------------------------------ make */

typedef struct make_job {
    uint32_t rank;
    const char *dir;
    uint64_t n_total, first, n; /* elements of each buffer: the whole, this rank's range */
    uint64_t seed;
    int zstd;
    rank_ctx cx;
    int rc;
    ckpt_persist_stats st;
} make_job;

static void *make_rank(void *arg)
{
    make_job *j = arg;
    float *mem[3] = {NULL, NULL, NULL};
    ckpt_engine *e = NULL;
    j->rc = -ENOMEM;
    for (int k = 0; k < 3; k++)
        if (!(mem[k] = malloc((size_t)(j->n ? j->n : 1) * 4))) goto out;
    gen_job g = {{mem[0], mem[1], mem[2]}, j->seed, j->first, j->n};
    gen_run(&g);
    ckpt_buffer bufs[3];
    for (int k = 0; k < 3; k++)
        bufs[k] = (ckpt_buffer){bname[k], "f32", 4, j->n_total * 4, j->first * 4, j->n * 4, mem[k]};
    ckpt_group grp = {j->rank, WORLD, "s3bench", &j->cx, board_vote, board_collect,
                      board_decide, board_outcome, 600};
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = j->dir;
    eo.save.filter = j->zstd ? CKPT_FILTER_SHUFFLE : CKPT_FILTER_NONE;
    eo.compress = j->zstd;
    eo.threads = 1; /* one per rank: two ranks on two cores */
    eo.group = &grp;
    if ((j->rc = ckpt_engine_create(&e, &eo)) < 0) goto out;
    j->rc = ckpt_engine_stage(e, STEP, RUN_ID, "cfg", bufs, 3, "{\"bench\":\"s3_bench\"}", NULL);
    if (j->rc == 0) j->rc = ckpt_engine_wait(e, 600);
    if (j->rc == 0) j->rc = ckpt_engine_last(e, &j->st);
    if (j->rc == 0) j->rc = j->st.result;
    int d = ckpt_engine_destroy(e);
    if (j->rc == 0 && d < 0) j->rc = d;
out:
    for (int k = 0; k < 3; k++) free(mem[k]);
    return NULL;
}

static int cmd_make(const char *dir, uint64_t size_mib, uint64_t seed, int zstd)
{
    uint64_t n = size_mib * 1048576ull / 12 / 32 * 32; /* elements a buffer, even per rank */
    make_job jobs[WORLD];
    pthread_t th[WORLD];
    double t0 = clock_now_s();
    for (uint32_t r = 0; r < WORLD; r++) {
        jobs[r] = (make_job){r, dir, n, n / WORLD * r, n / WORLD, seed, zstd, {&g_board, r}, 0, {0}};
        if (pthread_create(&th[r], NULL, make_rank, &jobs[r]) != 0) return -EAGAIN;
    }
    for (uint32_t r = 0; r < WORLD; r++) pthread_join(th[r], NULL);
    int rc = 0;
    uint64_t raw = 0, stored = 0;
    for (uint32_t r = 0; r < WORLD; r++) {
        if (jobs[r].rc < 0) {
            fprintf(stderr, "s3_bench make: rank %u: %s\n", r, strerror(-jobs[r].rc));
            if (rc == 0) rc = jobs[r].rc;
        }
        raw += jobs[r].st.raw_bytes;
        stored += jobs[r].st.stored_bytes;
    }
    if (rc < 0) return rc;
    printf("make_s %.6f\nraw_bytes %" PRIu64 "\nstored_bytes %" PRIu64 "\ncodec %s\n",
           clock_now_s() - t0, raw, stored, zstd ? "zstd1+shuffle" : "none");
    return 0;
}

/* ------------------------------------------------------------------ upload */

typedef struct up_rank {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int done, result;
    ckpt_upload_event ev;
    char why[400];
    double t_done;
} up_rank;

static void on_event(void *ctx, const ckpt_upload_event *ev)
{
    up_rank *u = ctx;
    if (ev->kind != CKPT_UPLOAD_DONE && ev->kind != CKPT_UPLOAD_FAILED) return;
    pthread_mutex_lock(u->mu);
    u->ev = *ev;
    u->ev.why = NULL;
    snprintf(u->why, sizeof u->why, "%s", ev->why ? ev->why : "");
    u->result = ev->result;
    u->t_done = clock_now_s();
    u->done = 1;
    pthread_cond_broadcast(u->cv);
    pthread_mutex_unlock(u->mu);
}

static int open_store(objstore **os, const char *url, unsigned in_flight)
{
    objstore_opts o = OBJSTORE_OPTS_INIT;
    o.url = url;
    if (in_flight) o.max_in_flight = in_flight;
    char why[400] = "";
    int rc = objstore_open(os, &o, why, sizeof why);
    if (rc < 0) fprintf(stderr, "s3_bench: %s\n", why[0] ? why : strerror(-rc));
    return rc;
}

static int cmd_upload(const char *dir, const char *url, uint64_t part_mib, unsigned in_flight)
{
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    objstore *os[WORLD] = {NULL};
    ckpt_uploader *up[WORLD] = {NULL};
    up_rank ur[WORLD];
    rank_ctx cx[WORLD];
    ckpt_group grp[WORLD];
    int rc = 0;
    board_reset();
    for (uint32_t r = 0; r < WORLD && rc == 0; r++) {
        ur[r] = (up_rank){&mu, &cv, 0, 0, {0}, "", 0};
        cx[r] = (rank_ctx){&g_board, r};
        grp[r] = (ckpt_group){r, WORLD, "s3bench", &cx[r], board_vote, board_collect, board_decide,
                              board_outcome, 600};
        if ((rc = open_store(&os[r], url, in_flight)) < 0) break;
        ckpt_uploader_opts uo = {0};
        uo.os = os[r];
        uo.dir = dir;
        uo.group = &grp[r];
        uo.part_bytes = part_mib << 20;
        uo.remote_step = -1;
        uo.on_event = on_event;
        uo.ctx = &ur[r];
        if ((rc = ckpt_uploader_create(&up[r], &uo)) < 0)
            fprintf(stderr, "s3_bench upload: uploader %u: %s\n", r, strerror(-rc));
    }
    double c0 = cpu_s(), t0 = clock_now_s();
    for (uint32_t r = 0; r < WORLD && rc == 0; r++) {
        rc = ckpt_uploader_submit(up[r], STEP, (double)time(NULL));
        if (rc > 0) rc = 0;
        if (rc < 0) fprintf(stderr, "s3_bench upload: submit %u: %s\n", r, strerror(-rc));
    }
    if (rc == 0) {
        struct timespec ts;
        abs_deadline(&ts, 1800);
        pthread_mutex_lock(&mu);
        while (!(ur[0].done && ur[1].done))
            if (pthread_cond_timedwait(&cv, &mu, &ts) == ETIMEDOUT) break;
        int all = ur[0].done && ur[1].done;
        pthread_mutex_unlock(&mu);
        double t = clock_now_s() - t0, cpu = cpu_s() - c0;
        if (!all) {
            fprintf(stderr, "s3_bench upload: not done within 1800 s\n");
            rc = -ETIMEDOUT;
        }
        uint64_t bytes = 0;
        unsigned req = 0, retries = 0;
        for (uint32_t r = 0; r < WORLD && rc == 0; r++) {
            if (ur[r].result < 0) {
                fprintf(stderr, "s3_bench upload: rank %u: %s\n", r, ur[r].why);
                rc = ur[r].result;
            }
            bytes += ur[r].ev.bytes;
            req += ur[r].ev.requests;
            retries += ur[r].ev.retries;
            printf("upload_rank%u_s %.6f\n", r, ur[r].t_done - t0);
        }
        if (rc == 0)
            printf("upload_s %.6f\nupload_bytes %" PRIu64 "\nupload_requests %u\nupload_retries %u\n"
                   "upload_cpu_s %.3f\nupload_part_mib %" PRIu64 "\n",
                   t, bytes, req, retries, cpu, part_mib);
    }
    for (uint32_t r = 0; r < WORLD; r++) {
        if (up[r]) ckpt_uploader_drain(up[r], 30);
        ckpt_uploader_destroy(up[r]);
        objstore_close(os[r]);
    }
    return rc;
}

/* ------------------------------------------------------------------ restore */

typedef struct rs_rank {
    uint32_t rank, world;
    const char *url;
    unsigned threads, in_flight;
    uint8_t *mem;
    uint64_t mem_bytes;
    int rc;
    char why[512];
    uint64_t bytes;
    double t_open, t_end;
    double t0;
} rs_rank;

/* Bytes [*off, *off + *len) of a buffer of total bytes that rank r of w reads (elements of
 * 4 bytes, the first total % w ranks one more). */
static void share(uint64_t total, uint32_t w, uint32_t r, uint64_t *off, uint64_t *len)
{
    uint64_t n = total / 4, base = n / w, rem = n % w;
    uint64_t first = r * base + (r < rem ? r : rem);
    *off = first * 4;
    *len = (base + (r < rem)) * 4;
}

static void *restore_rank(void *arg)
{
    rs_rank *j = arg;
    objstore *os = NULL;
    ckpt_snapshot *s = NULL;
    if ((j->rc = open_store(&os, j->url, j->in_flight)) < 0) return NULL;
    j->rc = ckpt_snapshot_open_s3(&s, os, STEP, j->why, sizeof j->why);
    j->t_open = clock_now_s() - j->t0;
    if (j->rc == 0 && j->threads) j->rc = ckpt_snapshot_set_threads(s, j->threads);
    uint64_t at = 0;
    for (size_t i = 0; j->rc == 0 && i < 3; i++) {
        int64_t total = ckpt_snapshot_buffer_bytes(s, bname[i]);
        if (total < 0) {
            j->rc = (int)total;
            snprintf(j->why, sizeof j->why, "no buffer %s", bname[i]);
            break;
        }
        uint64_t off, len;
        share((uint64_t)total, j->world, j->rank, &off, &len);
        if (at + len > j->mem_bytes) {
            j->rc = -EOVERFLOW;
            break;
        }
        j->rc = ckpt_snapshot_read(s, bname[i], off, len, j->mem + at, j->why, sizeof j->why);
        at += len;
    }
    j->bytes = at;
    j->t_end = clock_now_s() - j->t0;
    ckpt_snapshot_close(s);
    objstore_close(os);
    return NULL;
}

static int cmd_restore(const char *url, uint32_t world, unsigned threads, unsigned in_flight)
{
    /* sizes first (one open, not timed), so that the memory is faulted before the clock */
    objstore *os = NULL;
    ckpt_snapshot *s = NULL;
    char why[512] = "";
    int rc = open_store(&os, url, in_flight);
    if (rc == 0) rc = ckpt_snapshot_open_s3(&s, os, STEP, why, sizeof why);
    if (rc < 0) {
        fprintf(stderr, "s3_bench restore: %s\n", why[0] ? why : strerror(-rc));
        objstore_close(os);
        return rc;
    }
    uint64_t raw = 0, stored = 0;
    ckpt_snapshot_sizes(s, &raw, &stored);
    ckpt_snapshot_close(s);
    objstore_close(os);
    rs_rank jobs[MAXW];
    pthread_t th[MAXW];
    for (uint32_t r = 0; r < world; r++) {
        uint64_t per = raw / world + 3 * 4 + 4096;
        jobs[r] = (rs_rank){r, world, url, threads, in_flight, malloc((size_t)per), per, 0, "", 0,
                            0, 0, 0};
        if (!jobs[r].mem) return -ENOMEM;
        memset(jobs[r].mem, 0xa5, (size_t)per); /* not 0: malloc + memset 0 may become calloc,
                                                    which leaves the pages unfaulted */
    }
    double c0 = cpu_s(), t0 = clock_now_s();
    uint32_t started = 0;
    for (uint32_t r = 0; r < world; r++) {
        jobs[r].t0 = t0;
        if (pthread_create(&th[r], NULL, restore_rank, &jobs[r]) != 0) break;
        started++;
    }
    for (uint32_t r = 0; r < started; r++) pthread_join(th[r], NULL);
    double t = clock_now_s() - t0, cpu = cpu_s() - c0;
    uint64_t bytes = 0;
    rc = started == world ? 0 : -EAGAIN;
    for (uint32_t r = 0; r < world; r++) {
        if (r < started && jobs[r].rc < 0) {
            fprintf(stderr, "s3_bench restore: rank %u of %u: %s\n", r, world,
                    jobs[r].why[0] ? jobs[r].why : strerror(-jobs[r].rc));
            if (rc == 0) rc = jobs[r].rc;
        }
        bytes += jobs[r].bytes;
        printf("restore_w%u_rank%u_open_s %.6f\nrestore_w%u_rank%u_s %.6f\n", world, r,
               jobs[r].t_open, world, r, jobs[r].t_end);
        free(jobs[r].mem);
    }
    if (rc == 0 && bytes != raw) {
        fprintf(stderr, "s3_bench restore: read %" PRIu64 " bytes of %" PRIu64 "\n", bytes, raw);
        rc = -EIO;
    }
    if (rc == 0)
        printf("restore_w%u_s %.6f\nrestore_w%u_raw_bytes %" PRIu64 "\nrestore_w%u_stored_bytes %"
               PRIu64 "\nrestore_w%u_cpu_s %.3f\n", world, t, world, raw, world, stored, world, cpu);
    return rc;
}

/* ------------------------------------------------------------------ main */

static int parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || !end || *end || s[0] == '-' || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(usage_text, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1], *dir = NULL, *url = NULL, *codec = "zstd";
    uint64_t size_mib = 2048, seed = 1, part_mib = 256, world = 2, threads = 0, in_flight = 0;
    static const struct option lo[] = {
        {"dir", 1, 0, 'd'}, {"url", 1, 0, 'u'}, {"size-mib", 1, 0, 's'}, {"seed", 1, 0, 'S'},
        {"codec", 1, 0, 'c'}, {"part-mib", 1, 0, 'p'}, {"world", 1, 0, 'w'},
        {"threads", 1, 0, 't'}, {"in-flight", 1, 0, 'i'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c, bad = 0;
    optind = 2;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'd': dir = optarg; break;
        case 'u': url = optarg; break;
        case 'c': codec = optarg; break;
        case 's': bad |= parse_u64(optarg, 1, 1u << 20, &size_mib); break;
        case 'S': bad |= parse_u64(optarg, 0, UINT64_MAX, &seed); break;
        case 'p': bad |= parse_u64(optarg, 1, 4096, &part_mib); break;
        case 'w': bad |= parse_u64(optarg, 1, MAXW, &world); break;
        case 't': bad |= parse_u64(optarg, 1, 64, &threads); break;
        case 'i': bad |= parse_u64(optarg, 1, 256, &in_flight); break;
        case 'h': fputs(usage_text, stdout); return 0;
        default: bad = 1;
        }
    }
    int zstd = !strcmp(codec, "zstd");
    if (!zstd && strcmp(codec, "none")) bad = 1;
    if (optind < argc) bad = 1;
    int rc;
    if (!bad && !strcmp(cmd, "make") && dir) rc = cmd_make(dir, size_mib, seed, zstd);
    else if (!bad && !strcmp(cmd, "upload") && dir && url)
        rc = cmd_upload(dir, url, part_mib, (unsigned)in_flight);
    else if (!bad && !strcmp(cmd, "restore") && url)
        rc = cmd_restore(url, (uint32_t)world, (unsigned)threads, (unsigned)in_flight);
    else {
        fputs(usage_text, stderr);
        return 2;
    }
    return rc < 0 ? 1 : 0;
}
