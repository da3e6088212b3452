/* Sharded snapshots inside one process: W threads, each a rank with its own engine
 * (opts.group set), whose two-phase commit travels over an in-memory board instead of the
 * elastic store. Covers: every rank durable -> one committed step-<N> with W data files that
 * read back exactly what the ranks staged (whole buffers and ranges across shard
 * boundaries); a rank that fails, a rank that never votes (rank 0 times out) and rank 0's own
 * failure -> nothing committed, no temp folder, every rank's result negative and the others
 * told promptly; invalid groups refused at create.
 *
 * Also the gaps this test first found (now fixed): destroy after a persist whose result was a
 * group timeout, the shared temp folder after rank 0's early failures and after a rank that
 * arrives late, and a bad trainer record on rank 0 (the others told at once).
 */
#include "ckpt.h"
#include "t_helpers.h"
#include "t_threads.h"

#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>

#define MAXW 8
#define NSLOTS 4
#define CHUNK 4096u
#define RUN "run"
#define STEP 40


/* ------------------------------------------------------------------ the board
 *
 * What the elastic store does for train: per step, each rank != 0 posts its vote, rank 0
 * posts its decision; waits are bounded by the caller's timeout (CLOCK_MONOTONIC). */

enum { FROM_NONE = 0, FROM_DECISION = 1, FROM_TIMEOUT = 2 };

typedef struct slot {
    int used;
    uint64_t step;
    int voted[MAXW], vote[MAXW];
    int decided, decision;
} slot;

typedef struct board {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t world;
    int dead_rank;   /* >= 0: this rank's votes are lost (returns 0, records nothing) */
    slot slots[NSLOTS];
    int vote_calls[MAXW], collect_calls, decide_calls, outcome_calls[MAXW];
    int collect_rc;
    int outcome_from[MAXW]; /* FROM_* of the last outcome call of each rank */
    int rank0_done;         /* rank 0's persist has finished (set by the test's rank thread) */
} board;

typedef struct rank_ctx {
    board *b;
    uint32_t rank;
} rank_ctx;

static void board_init(board *b, uint32_t world)
{
    memset(b, 0, sizeof *b);
    pthread_mutex_init(&b->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    b->world = world;
    b->dead_rank = -1;
}

static void board_fini(board *b)
{
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
}

/* The slot of step (created on first use); mutex held. */
static slot *slot_of(board *b, uint64_t step)
{
    for (int i = 0; i < NSLOTS; i++)
        if (b->slots[i].used && b->slots[i].step == step) return &b->slots[i];
    for (int i = 0; i < NSLOTS; i++)
        if (!b->slots[i].used) {
            b->slots[i].used = 1;
            b->slots[i].step = step;
            return &b->slots[i];
        }
    fprintf(stderr, "board: out of step slots\n");
    abort();
}

/* Votes of ranks 1..W-1: 1 all in and 0, the first negative one, or 0 while some are missing
 * (*missing set). Mutex held. */
static int tally(const board *b, const slot *s, int *missing)
{
    *missing = 0;
    for (uint32_t r = 1; r < b->world; r++) {
        if (!s->voted[r]) *missing = 1;
        else if (s->vote[r] < 0) return s->vote[r];
    }
    return *missing ? 0 : 1;
}

static int board_vote(void *ctx, uint64_t step, int result)
{
    rank_ctx *c = ctx;
    board *b = c->b;
    pthread_mutex_lock(&b->mu);
    b->vote_calls[c->rank]++;
    if ((int)c->rank != b->dead_rank) {
        slot *s = slot_of(b, step);
        s->voted[c->rank] = 1;
        s->vote[c->rank] = result;
    }
    pthread_cond_broadcast(&b->cv); /* a lost vote still opens board_wait_votes */
    pthread_mutex_unlock(&b->mu);
    return 0;
}

static int board_collect(void *ctx, uint64_t step, double timeout_s)
{
    rank_ctx *c = ctx;
    board *b = c->b;
    struct timespec ts;
    t_deadline_in(CLOCK_MONOTONIC, &ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    b->collect_calls++;
    slot *s = slot_of(b, step);
    int missing, t, rc = 0;
    while ((t = tally(b, s, &missing)) == 0)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) {
            t = tally(b, s, &missing);
            if (t == 0) t = -ETIMEDOUT;
            break;
        }
    rc = t < 0 ? t : 0;
    b->collect_rc = rc;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static int board_decide(void *ctx, uint64_t step, int result)
{
    rank_ctx *c = ctx;
    board *b = c->b;
    pthread_mutex_lock(&b->mu);
    b->decide_calls++;
    slot *s = slot_of(b, step);
    s->decided = 1;
    s->decision = result;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return 0;
}

static int board_outcome(void *ctx, uint64_t step, double timeout_s, int *decision)
{
    rank_ctx *c = ctx;
    board *b = c->b;
    struct timespec ts;
    t_deadline_in(CLOCK_MONOTONIC, &ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    b->outcome_calls[c->rank]++;
    slot *s = slot_of(b, step);
    while (!s->decided)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) break;
    int rc = s->decided ? 0 : -ETIMEDOUT;
    if (s->decided) *decision = s->decision;
    b->outcome_from[c->rank] = s->decided ? FROM_DECISION : FROM_TIMEOUT;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

/* Test-side gates: wait until n ranks called vote (any result, lost votes too) / rank 0's
 * persist ended; 0 or -ETIMEDOUT. */
static int board_wait_votes(board *b, uint64_t step, int n, double timeout_s)
{
    struct timespec ts;
    t_deadline_in(CLOCK_MONOTONIC, &ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    (void)step; /* one step per board in these tests */
    int rc = 0;
    for (;;) {
        int k = 0;
        for (uint32_t r = 1; r < b->world; r++) k += b->vote_calls[r] > 0;
        if (k >= n) break;
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) {
            rc = -ETIMEDOUT;
            break;
        }
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static void board_set_rank0_done(board *b)
{
    pthread_mutex_lock(&b->mu);
    b->rank0_done = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static int board_wait_rank0_done(board *b, double timeout_s)
{
    struct timespec ts;
    t_deadline_in(CLOCK_MONOTONIC, &ts, timeout_s);
    pthread_mutex_lock(&b->mu);
    while (!b->rank0_done)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) break;
    int rc = b->rank0_done ? 0 : -ETIMEDOUT;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

/* ------------------------------------------------------------------ the state */

/* Three buffers, sharded by element: params and adam_m evenly (the first total % W ranks
 * one element more), tiny held by the last (W + 1) / 2 ranks only, so for W >= 2 rank 0
 * and others stage 0 bytes of it. */
#define NP 10007u /* f32: 40028 bytes, not a multiple of W or of the chunk */
#define NM 2503u  /* f32 */
#define NT 5u     /* u16 */

enum { B_PARAMS, B_ADAM, B_TINY, NBUF };
static const char *bname[NBUF] = {"params", "adam_m", "tiny"};
static const char *bdtype[NBUF] = {"f32", "f32", "u16"};
static const uint32_t belem[NBUF] = {4, 4, 2};
static const uint32_t bcount[NBUF] = {NP, NM, NT};

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Element i of buffer k of the whole state, written into dst (elem bytes). */
static void element(int k, uint64_t i, void *dst)
{
    if (k == B_TINY) {
        uint16_t v = (uint16_t)(0xa000u + 7u * i);
        memcpy(dst, &v, 2);
        return;
    }
    float scale = k == B_PARAMS ? 0.02f : 0.001f;
    float v = scale * ((float)(mix(i * 2 + (uint64_t)k) % 2001) - 1000.0f) / 1000.0f;
    memcpy(dst, &v, 4);
}

/* Elements [first, first + n) of buffer k of rank r in a world of W. */
static void shard_of(int k, uint32_t W, uint32_t r, uint64_t *first, uint64_t *n)
{
    uint64_t total = bcount[k];
    if (k == B_TINY) {
        uint32_t h = (W + 1) / 2, lo = W - h;
        if (r < lo) {
            *first = 0;
            *n = 0;
            return;
        }
        uint32_t j = r - lo;
        uint64_t base = total / h, rem = total % h;
        *first = j * base + (j < rem ? j : rem);
        *n = base + (j < rem);
        return;
    }
    uint64_t base = total / W, rem = total % W;
    *first = r * base + (r < rem ? r : rem);
    *n = base + (r < rem);
}

/* The whole buffer k as the snapshot must hold it (malloc'ed). */
static uint8_t *whole(int k)
{
    uint8_t *p = malloc((size_t)bcount[k] * belem[k]);
    if (!p) exit(1);
    for (uint64_t i = 0; i < bcount[k]; i++) element(k, i, p + i * belem[k]);
    return p;
}

/* ------------------------------------------------------------------ ranks */

typedef struct rank_job rank_job;
struct rank_job {
    board *b;
    rank_ctx cx;
    uint32_t rank, world;
    char dir[4200];
    const char *tag;
    uint64_t step;
    double timeout_s;
    const char *trainer;
    /* before staging: wait for this many votes / for rank 0's persist to end; then run hook */
    int gate_votes, gate_rank0_done;
    void (*hook)(rank_job *j);
    int hook_rc;
    ckpt_buffer bufs[NBUF];
    uint8_t *mem[NBUF];
    uint64_t staged_bytes;
    /* results */
    int create_rc, stage_rc, wait_rc, last_rc, destroy_rc;
    ckpt_persist_stats last;
    double elapsed_s; /* from the stage to the end of the persist */
};

static void job_init(rank_job *j, board *b, const char *dir, const char *tag, uint32_t rank,
                     uint32_t world, double timeout_s)
{
    memset(j, 0, sizeof *j);
    j->b = b;
    j->cx = (rank_ctx){b, rank};
    j->rank = rank;
    j->world = world;
    snprintf(j->dir, sizeof j->dir, "%s", dir);
    j->tag = tag;
    j->step = STEP;
    j->timeout_s = timeout_s;
    j->trainer = "{\"step\":40,\"lr\":0.001}";
    j->create_rc = j->stage_rc = j->wait_rc = j->last_rc = j->destroy_rc = 1;
    for (int k = 0; k < NBUF; k++) {
        uint64_t first, n;
        shard_of(k, world, rank, &first, &n);
        j->mem[k] = n ? malloc(n * belem[k]) : NULL;
        for (uint64_t i = 0; i < n; i++) element(k, first + i, j->mem[k] + i * belem[k]);
        j->bufs[k] = (ckpt_buffer){bname[k], bdtype[k], belem[k], (uint64_t)bcount[k] * belem[k],
                                   first * belem[k], n * belem[k], j->mem[k]};
        j->staged_bytes += n * belem[k];
    }
}

static void job_free(rank_job *j)
{
    for (int k = 0; k < NBUF; k++) free(j->mem[k]);
}

static void *rank_main(void *arg)
{
    rank_job *j = arg;
    char tag[64];
    snprintf(tag, sizeof tag, "%s", j->tag);
    ckpt_group g = {j->rank, j->world, tag, &j->cx, board_vote, board_collect, board_decide,
                    board_outcome, j->timeout_s};
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = j->dir;
    eo.save.chunk_bytes = CHUNK;
    eo.threads = 1;
    eo.wait_timeout_s = 30;
    eo.group = &g;
    ckpt_engine *e = NULL;
    j->create_rc = ckpt_engine_create(&e, &eo);
    /* the engine copied the group and its tag: clobber ours */
    memset(tag, 'x', sizeof tag - 1);
    memset(&g, 0, sizeof g);
    if (j->create_rc < 0) return NULL;
    if (j->gate_votes && board_wait_votes(j->b, j->step, j->gate_votes, 20) < 0)
        fprintf(stderr, "rank %u: gate on %d votes timed out\n", j->rank, j->gate_votes);
    if (j->gate_rank0_done && board_wait_rank0_done(j->b, 20) < 0)
        fprintf(stderr, "rank %u: gate on rank 0 timed out\n", j->rank);
    if (j->hook) j->hook(j);
    double t0 = t_now_s();
    j->stage_rc = ckpt_engine_stage(e, j->step, RUN, "cfg", j->bufs, NBUF, j->trainer, NULL);
    j->wait_rc = ckpt_engine_wait(e, 20);
    j->elapsed_s = t_now_s() - t0;
    if (j->rank == 0) board_set_rank0_done(j->b);
    j->last_rc = ckpt_engine_last(e, &j->last);
    j->destroy_rc = ckpt_engine_destroy(e);
    return NULL;
}

/* Threads of this process, not counting the kernel's io_uring workers (iou-wrk-*, iou-sqp-*),
 * which come and go on their own. */
static int count_threads(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[300], comm[64] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue; /* gone meanwhile */
        if (!fgets(comm, sizeof comm, f)) comm[0] = '\0';
        fclose(f);
        n += strncmp(comm, "iou-", 4) != 0;
    }
    closedir(d);
    return n;
}

/* Run the W ranks to the end. Afterwards every engine is gone, threads included, and
 * destroy returned the last result as ckpt_engine_wait did (ckpt.h). A persist whose result
 * is -ETIMEDOUT (a group timeout) is taken by ckpt_engine_destroy for its own wait timing
 * out: it logs "still persisting", returns without stopping the engine and leaks it. */
static void run_ranks(rank_job *jobs, uint32_t W)
{
    pthread_t th[MAXW];
    int before = count_threads(), timed_out = 0;
    for (uint32_t r = 0; r < W; r++)
        T_REQUIRE(pthread_create(&th[r], NULL, rank_main, &jobs[r]) == 0, "thread %u", r);
    for (uint32_t r = 0; r < W; r++) pthread_join(th[r], NULL);
    for (uint32_t r = 0; r < W; r++) {
        T_CHECK(jobs[r].create_rc < 0 || jobs[r].destroy_rc == jobs[r].wait_rc,
                "rank %u: destroy returned %d, the last result was %d", r, jobs[r].destroy_rc,
                jobs[r].wait_rc);
        timed_out |= jobs[r].wait_rc == -ETIMEDOUT;
    }
    /* pthread_join returns when the thread's tid is cleared, a moment before the kernel drops
     * its /proc/self/task entry: give the count up to a second to settle */
    int after = count_threads();
    for (int i = 0; i < 100 && after != before; i++) {
        t_sleep_s(0.01);
        after = count_threads();
    }
    if (timed_out)
        T_CHECK(after == before,
                "%d engine thread(s) still running after every engine was "
                "destroyed (a result of -ETIMEDOUT makes destroy abandon the engine)",
                after - before);
    else
        T_CHECK(after == before, "%d engine thread(s) still running after destroy", after - before);
}

/* ------------------------------------------------------------------ folder checks */

static int path_exists(const char *dir, const char *name)
{
    char p[8400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    return stat(p, &st) == 0;
}

/* Entries of dir whose names start with prefix and end with suffix (either may be ""). */
static int count_entries(const char *dir, const char *prefix, const char *suffix)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        size_t l = strlen(e->d_name), ls = strlen(suffix);
        if (!strncmp(e->d_name, prefix, strlen(prefix)) && l >= ls &&
            !strcmp(e->d_name + l - ls, suffix))
            n++;
    }
    closedir(d);
    return n;
}

static void make_dir(const char *root, const char *name, char *out, size_t len)
{
    snprintf(out, len, "%s/%s", root, name);
    T_REQUIRE(mkdir(out, 0755) == 0, "mkdir %s", out);
}

/* Nothing visible or left behind for `step` in dir: no step folder, no temp folder. */
static void check_nothing_committed(const char *dir, const char *what)
{
    char name[32];
    ckpt_step_dirname(STEP, name, sizeof name);
    T_CHECK(!path_exists(dir, name), "%s: no %s", what, name);
    int ntmp = count_entries(dir, ".tmp-", "");
    T_CHECK(ntmp == 0, "%s: %d temp folder(s) left", what, ntmp);
    ckpt_entry *en = NULL;
    size_t n = 99;
    T_CHECK(ckpt_list(dir, &en, &n) == 0 && n == 0, "%s: ckpt_list sees %zu entries", what, n);
    free(en);
}

/* ------------------------------------------------------------------ 1: all ranks succeed */

static void test_commit(const char *root, uint32_t W)
{
    char dir[4200], what[64], sub[32];
    snprintf(what, sizeof what, "commit W=%u", W);
    snprintf(sub, sizeof sub, "commit-%u", W);
    make_dir(root, sub, dir, sizeof dir);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++) job_init(&jobs[r], &b, dir, "launch-1", r, W, 10.0);
    run_ranks(jobs, W);

    for (uint32_t r = 0; r < W; r++) {
        rank_job *j = &jobs[r];
        T_CHECK(j->create_rc == 0 && j->stage_rc == 0, "%s rank %u: create %d stage %d", what, r,
                j->create_rc, j->stage_rc);
        T_CHECK(j->wait_rc == 0, "%s rank %u: wait %d", what, r, j->wait_rc);
        T_CHECK(j->last_rc == 0 && j->last.step == STEP && j->last.result == 0,
                "%s rank %u: last rc %d step %llu result %d", what, r, j->last_rc,
                (unsigned long long)j->last.step, j->last.result);
        T_CHECK(j->last.raw_bytes == j->staged_bytes, "%s rank %u: raw %llu staged %llu", what, r,
                (unsigned long long)j->last.raw_bytes, (unsigned long long)j->staged_bytes);
        T_CHECK(j->destroy_rc == 0, "%s rank %u: destroy %d", what, r, j->destroy_rc);
    }
    slot *s = slot_of(&b, STEP);
    T_CHECK(b.collect_calls == 1 && b.decide_calls == 1 && s->decided && s->decision == 0,
            "%s: rank 0 collected once (%d) and decided 0 once (%d, %d)", what, b.collect_calls,
            b.decide_calls, s->decision);
    for (uint32_t r = 1; r < W; r++)
        T_CHECK(b.vote_calls[r] == 1 && s->voted[r] && s->vote[r] == 0 && b.outcome_calls[r] == 1 &&
                    b.outcome_from[r] == FROM_DECISION,
                "%s rank %u: one vote of 0 (%d calls, %d) and one outcome from the decision", what,
                r, b.vote_calls[r], s->vote[r]);
    T_CHECK(b.vote_calls[0] == 0 && b.outcome_calls[0] == 0, "%s: rank 0 neither votes nor waits",
            what);

    /* the folder: manifest + W data files, no part records, no temp folder */
    char snap[4300], name[32];
    ckpt_step_dirname(STEP, name, sizeof name);
    snprintf(snap, sizeof snap, "%s/%s", dir, name);
    T_CHECK(path_exists(dir, name), "%s: %s committed", what, name);
    T_CHECK(count_entries(dir, ".tmp-", "") == 0, "%s: no temp folder left", what);
    for (uint32_t r = 0; r < W; r++) {
        char f[32];
        snprintf(f, sizeof f, "rank-%05u.bin", r);
        T_CHECK(path_exists(snap, f), "%s: %s present", what, f);
    }
    T_CHECK(count_entries(snap, "rank-", ".bin") == (int)W, "%s: exactly %u data files", what, W);
    T_CHECK(count_entries(snap, "", ".part.json") == 0, "%s: no part record left", what);
    T_CHECK(count_entries(snap, "", "") == (int)W + 1, "%s: manifest + %u files, nothing else (%d)",
            what, W, count_entries(snap, "", ""));

    ckpt_snapshot *sn = NULL;
    char why[256] = "";
    T_REQUIRE(ckpt_snapshot_open(&sn, snap, why, sizeof why) == 0, "%s: open: %s", what, why);
    T_CHECK(ckpt_snapshot_world_size(sn) == W, "%s: world_size %u", what,
            ckpt_snapshot_world_size(sn));
    T_CHECK(ckpt_snapshot_step(sn) == STEP && !strcmp(ckpt_snapshot_run_id(sn), RUN),
            "%s: step and run id", what);
    T_CHECK(strstr(ckpt_snapshot_trainer_json(sn), "\"lr\"") != NULL, "%s: trainer record kept",
            what);
    T_CHECK(ckpt_snapshot_nbuffers(sn) == NBUF, "%s: %zu buffers", what,
            ckpt_snapshot_nbuffers(sn));
    for (int k = 0; k < NBUF; k++) {
        uint64_t total = (uint64_t)bcount[k] * belem[k];
        T_CHECK(ckpt_snapshot_buffer_bytes(sn, bname[k]) == (int64_t)total, "%s: %s bytes", what,
                bname[k]);
        /* a chunk list per non-empty shard: chunks never straddle shards */
        size_t expect_chunks = 0;
        for (uint32_t r = 0; r < W; r++)
            expect_chunks += (jobs[r].bufs[k].bytes + CHUNK - 1) / CHUNK;
        ckpt_buffer_info bi;
        int found = 0;
        for (size_t i = 0; i < ckpt_snapshot_nbuffers(sn); i++)
            if (ckpt_snapshot_buffer_info(sn, i, &bi) == 0 && !strcmp(bi.name, bname[k])) {
                found = 1;
                T_CHECK(bi.total_bytes == total && bi.elem_bytes == belem[k] &&
                            !strcmp(bi.dtype, bdtype[k]) && bi.nchunks == expect_chunks,
                        "%s: %s info (%zu chunks, want %zu)", what, bname[k], bi.nchunks,
                        expect_chunks);
            }
        T_CHECK(found, "%s: %s listed", what, bname[k]);

        uint8_t *want = whole(k), *got = malloc(total);
        memset(got, 0x55, total);
        T_CHECK(ckpt_snapshot_read(sn, bname[k], 0, total, got, NULL, 0) == 0 &&
                    memcmp(got, want, total) == 0,
                "%s: %s reads back as staged", what, bname[k]);
        /* ranges across each shard boundary (odd bytes, inside elements) */
        for (uint32_t r = 1; r < W; r++) {
            uint64_t bound = jobs[r].bufs[k].offset;
            uint64_t lo = bound >= 7 ? bound - 7 : 0, hi = bound + 11 < total ? bound + 11 : total;
            if (hi <= lo) continue;
            memset(got, 0x55, total);
            int rc = ckpt_snapshot_read(sn, bname[k], lo, hi - lo, got, NULL, 0);
            T_CHECK(rc == 0 && memcmp(got, want + lo, hi - lo) == 0,
                    "%s: %s bytes [%llu, %llu) across the shard boundary of rank %u (rc %d)", what,
                    bname[k], (unsigned long long)lo, (unsigned long long)hi, r, rc);
        }
        /* one range over every shard but the first and last bytes */
        if (total > 9) {
            memset(got, 0x55, total);
            T_CHECK(ckpt_snapshot_read(sn, bname[k], 3, total - 9, got, NULL, 0) == 0 &&
                        memcmp(got, want + 3, total - 9) == 0,
                    "%s: %s bytes [3, total-6)", what, bname[k]);
        }
        T_CHECK(ckpt_snapshot_read(sn, bname[k], total - 1, 2, got, NULL, 0) == -EINVAL,
                "%s: %s range past the end refused", what, bname[k]);
        free(want);
        free(got);
    }
    char bad[256] = "";
    T_CHECK(ckpt_snapshot_verify(sn, bad, sizeof bad, NULL, NULL) == 0, "%s: verify: %s", what,
            bad);
    ckpt_snapshot_close(sn);

    ckpt_entry *en = NULL;
    size_t n = 0;
    T_CHECK(ckpt_list(dir, &en, &n) == 0 && n == 1 && en[0].step == STEP &&
                en[0].status == CKPT_STATUS_COMMITTED,
            "%s: listed as one committed snapshot (%zu)", what, n);
    free(en);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

/* ------------------------------------------------------------------ 2: a rank fails */

/* Rank W-1 cannot use its folder (a path through a regular file: -ENOTDIR). It starts once
 * every other rank != 0 has voted, so that rank 0's early abort cannot race a rank still
 * writing into the shared temp folder (test_late_rank covers that race). */
static void test_rank_fails(const char *root, uint32_t W)
{
    char dir[4200], what[64], sub[32], badfile[4300], baddir[4400];
    snprintf(what, sizeof what, "rank fails W=%u", W);
    snprintf(sub, sizeof sub, "fail-%u", W);
    make_dir(root, sub, dir, sizeof dir);
    snprintf(badfile, sizeof badfile, "%s/not-a-dir-%u", root, W);
    T_REQUIRE(t_spit(badfile, "x", 1) == 0, "write %s", badfile);
    snprintf(baddir, sizeof baddir, "%s/snapshots", badfile);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    const uint32_t bad = W - 1;
    for (uint32_t r = 0; r < W; r++)
        job_init(&jobs[r], &b, r == bad ? baddir : dir, "launch-2", r, W, 10.0);
    jobs[bad].gate_votes = (int)W - 2;
    double t0 = t_now_s();
    run_ranks(jobs, W);
    double took = t_now_s() - t0;

    slot *s = slot_of(&b, STEP);
    T_CHECK(jobs[bad].wait_rc == -ENOTDIR && jobs[bad].last.result == -ENOTDIR,
            "%s: the failing rank reports its own error (%d)", what, jobs[bad].wait_rc);
    T_CHECK(b.vote_calls[bad] == 1 && s->voted[bad] && s->vote[bad] == -ENOTDIR,
            "%s: the failing rank voted its error once (%d)", what, s->vote[bad]);
    T_CHECK(b.outcome_calls[bad] == 0, "%s: the failing rank does not wait for the outcome", what);
    T_CHECK(b.collect_rc == -ENOTDIR && s->decided && s->decision == -ENOTDIR &&
                b.decide_calls == 1,
            "%s: rank 0 collected the failure and decided it once (%d, %d)", what, b.collect_rc,
            s->decision);
    for (uint32_t r = 0; r < W; r++) {
        rank_job *j = &jobs[r];
        T_CHECK(j->stage_rc == 0, "%s rank %u: stage %d", what, r, j->stage_rc);
        T_CHECK(j->wait_rc < 0 && j->last_rc == 0 && j->last.result == j->wait_rc &&
                    j->last.step == STEP,
                "%s rank %u: result %d (last %d)", what, r, j->wait_rc, j->last.result);
        if (r != bad)
            T_CHECK(j->wait_rc == -ENOTDIR, "%s rank %u: the decision becomes its result (%d)",
                    what, r, j->wait_rc);
        if (r != 0 && r != bad)
            T_CHECK(b.outcome_from[r] == FROM_DECISION, "%s rank %u: told by rank 0", what, r);
    }
    T_CHECK(took < 5.0, "%s: over in %.2f s, well before the 10 s timeout", what, took);
    check_nothing_committed(dir, what);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

/* ------------------------------------------------------------------ 3: a rank never votes */

/* Rank W-1 writes its shard but its vote is lost (a rank that died). Rank 0 waits 0.5 s;
 * the others wait up to 5 s, so a result of -ETIMEDOUT well before 5 s is rank 0's decision
 * reaching them, not their own timeout. Rank 0 starts once every other rank has called vote:
 * on a loaded machine a healthy rank could otherwise still be writing when rank 0 gives up
 * and removes the shared temp folder (test_late_rank). */
static void test_dead_rank(const char *root, uint32_t W)
{
    char dir[4200], what[64], sub[32];
    snprintf(what, sizeof what, "dead rank W=%u", W);
    snprintf(sub, sizeof sub, "dead-%u", W);
    make_dir(root, sub, dir, sizeof dir);
    board b;
    board_init(&b, W);
    b.dead_rank = (int)W - 1;
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++)
        job_init(&jobs[r], &b, dir, "launch-3", r, W, r == 0 ? 0.5 : 5.0);
    jobs[0].gate_votes = (int)W - 1;
    run_ranks(jobs, W);

    slot *s = slot_of(&b, STEP);
    T_CHECK(b.vote_calls[W - 1] == 1 && !s->voted[W - 1], "%s: the dead rank's vote was lost",
            what);
    T_CHECK(b.collect_rc == -ETIMEDOUT, "%s: rank 0's collect timed out (%d)", what, b.collect_rc);
    T_CHECK(s->decided && s->decision == -ETIMEDOUT && b.decide_calls == 1,
            "%s: rank 0 decided -ETIMEDOUT (%d)", what, s->decision);
    T_CHECK(jobs[0].wait_rc == -ETIMEDOUT && jobs[0].last.result == -ETIMEDOUT,
            "%s rank 0: result %d", what, jobs[0].wait_rc);
    T_CHECK(jobs[0].elapsed_s >= 0.45 && jobs[0].elapsed_s < 4.0,
            "%s rank 0: gave up after %.2f s (timeout 0.5 s)", what, jobs[0].elapsed_s);
    for (uint32_t r = 1; r < W; r++) {
        rank_job *j = &jobs[r];
        T_CHECK(j->wait_rc == -ETIMEDOUT && j->last.result == -ETIMEDOUT,
                "%s rank %u: result %d", what, r, j->wait_rc);
        T_CHECK(b.outcome_from[r] == FROM_DECISION && j->elapsed_s < 4.0,
                "%s rank %u: the decision reached it (from %d after %.2f s, own timeout 5 s)", what,
                r, b.outcome_from[r], j->elapsed_s);
    }
    check_nothing_committed(dir, what);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

/* ------------------------------------------------------------------ 4: rank 0 fails */

/* A committed snapshot of STEP from an earlier run, one rank, params only. */
static const float *prev_params(void)
{
    static float p[64];
    for (int i = 0; i < 64; i++) p[i] = (float)i * 0.5f;
    return p;
}

static int save_previous(const char *dir)
{
    ckpt_save_opts so = CKPT_SAVE_OPTS_INIT;
    so.dir = dir;
    ckpt_buffer pb = {"params", "f32", 4, 64 * 4, 0, 64 * 4, NULL};
    float p[64];
    memcpy(p, prev_params(), sizeof p);
    pb.data = p;
    return ckpt_save(&so, STEP, "earlier", "cfg", &pb, 1, "{}", NULL);
}

static void check_previous_intact(const char *dir, const char *what)
{
    char snap[4300], name[32];
    ckpt_step_dirname(STEP, name, sizeof name);
    snprintf(snap, sizeof snap, "%s/%s", dir, name);
    ckpt_snapshot *sn = NULL;
    float back[64];
    T_REQUIRE(ckpt_snapshot_open(&sn, snap, NULL, 0) == 0, "%s: the earlier snapshot opens", what);
    T_CHECK(ckpt_snapshot_world_size(sn) == 1 && !strcmp(ckpt_snapshot_run_id(sn), "earlier") &&
                ckpt_snapshot_nbuffers(sn) == 1,
            "%s: the earlier snapshot is the same one", what);
    T_CHECK(ckpt_snapshot_read(sn, "params", 0, sizeof back, back, NULL, 0) == 0 &&
                memcmp(back, prev_params(), sizeof back) == 0 &&
                ckpt_snapshot_verify(sn, NULL, 0, NULL, NULL) == 0,
            "%s: the earlier snapshot is untouched", what);
    ckpt_snapshot_close(sn);
    T_CHECK(count_entries(snap, "", "") == 2, "%s: nothing added to it", what);
}

/* 4a: the step is already committed when every rank starts: every rank refuses (-EEXIST),
 * the others by their own check and vote, at once; rank 0 decides -EEXIST. */
static void test_step_exists(const char *root, uint32_t W)
{
    char dir[4200], what[64], sub[32];
    snprintf(what, sizeof what, "step exists W=%u", W);
    snprintf(sub, sizeof sub, "exists-%u", W);
    make_dir(root, sub, dir, sizeof dir);
    T_REQUIRE(save_previous(dir) == 0, "%s: save the earlier snapshot", what);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++) job_init(&jobs[r], &b, dir, "launch-4a", r, W, 5.0);
    double t0 = t_now_s();
    run_ranks(jobs, W);
    double took = t_now_s() - t0;
    slot *s = slot_of(&b, STEP);
    for (uint32_t r = 0; r < W; r++)
        T_CHECK(jobs[r].wait_rc == -EEXIST && jobs[r].last.result == -EEXIST,
                "%s rank %u: result %d", what, r, jobs[r].wait_rc);
    T_CHECK(s->decided && s->decision == -EEXIST && b.decide_calls == 1,
            "%s: rank 0 decided -EEXIST (%d)", what, s->decision);
    T_CHECK(took < 2.0, "%s: over in %.2f s (timeouts 5 s)", what, took);
    check_previous_intact(dir, what);
    T_CHECK(count_entries(dir, ".tmp-", "") == 0, "%s: no temp folder left", what);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

static void hook_save_previous(rank_job *j)
{
    j->hook_rc = save_previous(j->dir);
}

/* 4b: the others have written and voted; then the step appears committed (an earlier run's)
 * and rank 0 refuses it (-EEXIST) before writing anything: the others, waiting up to 5 s,
 * get -EEXIST from rank 0 at once. */
static void test_rank0_exists(const char *root, uint32_t W)
{
    char dir[4200], what[64], sub[32];
    snprintf(what, sizeof what, "rank 0 -EEXIST W=%u", W);
    snprintf(sub, sizeof sub, "r0exists-%u", W);
    make_dir(root, sub, dir, sizeof dir);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++) job_init(&jobs[r], &b, dir, "launch-4b", r, W, 5.0);
    jobs[0].gate_votes = (int)W - 1;
    jobs[0].hook = hook_save_previous;
    run_ranks(jobs, W);
    slot *s = slot_of(&b, STEP);
    T_CHECK(jobs[0].hook_rc == 0, "%s: the earlier snapshot saved meanwhile (%d)", what,
            jobs[0].hook_rc);
    T_CHECK(jobs[0].wait_rc == -EEXIST, "%s rank 0: result %d", what, jobs[0].wait_rc);
    T_CHECK(b.collect_calls == 0 && s->decided && s->decision == -EEXIST && b.decide_calls == 1,
            "%s: rank 0 decided -EEXIST without collecting (%d)", what, s->decision);
    for (uint32_t r = 1; r < W; r++) {
        T_CHECK(s->vote[r] == 0, "%s rank %u: voted 0", what, r);
        T_CHECK(jobs[r].wait_rc == -EEXIST && jobs[r].last.result == -EEXIST,
                "%s rank %u: result %d", what, r, jobs[r].wait_rc);
        T_CHECK(b.outcome_from[r] == FROM_DECISION && jobs[r].elapsed_s < 2.5,
                "%s rank %u: told in %.2f s (timeout 5 s)", what, r, jobs[r].elapsed_s);
    }
    check_previous_intact(dir, what);
    /* ckpt.h: on its own error rank 0 "removes the temp folder"; here it fails before it
     * made the folder (tmp_made is still 0), so the others' shards stay behind */
    int ntmp = count_entries(dir, ".tmp-", "");
    T_CHECK(ntmp == 0, "%s: %d temp folder(s) with the other ranks' shards left behind", what,
            ntmp);
    ckpt_remove_temp(dir);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

/* 4c: rank 0 fails after collecting: its adam_m disagrees with the others' part records
 * (dtype), so the merge fails (-EBADMSG); the others get it at once; the temp folder goes. */
static void test_rank0_merge_fails(const char *root, uint32_t W)
{
    char dir[4200], what[64], sub[32];
    snprintf(what, sizeof what, "rank 0 merge fails W=%u", W);
    snprintf(sub, sizeof sub, "r0merge-%u", W);
    make_dir(root, sub, dir, sizeof dir);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++) job_init(&jobs[r], &b, dir, "launch-4c", r, W, 5.0);
    jobs[0].bufs[B_ADAM].dtype = "i32";
    run_ranks(jobs, W);
    slot *s = slot_of(&b, STEP);
    T_CHECK(jobs[0].wait_rc == -EBADMSG, "%s rank 0: result %d", what, jobs[0].wait_rc);
    T_CHECK(b.collect_rc == 0 && s->decided && s->decision == -EBADMSG && b.decide_calls == 1,
            "%s: all voted 0, rank 0 decided -EBADMSG (%d)", what, s->decision);
    for (uint32_t r = 1; r < W; r++)
        T_CHECK(jobs[r].wait_rc == -EBADMSG && b.outcome_from[r] == FROM_DECISION &&
                    jobs[r].elapsed_s < 2.5,
                "%s rank %u: result %d after %.2f s (timeout 5 s)", what, r, jobs[r].wait_rc,
                jobs[r].elapsed_s);
    check_nothing_committed(dir, what);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

/* ------------------------------------------------------------------ 5: invalid groups */

static int try_create(const char *dir, const ckpt_group *g)
{
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    eo.group = g;
    ckpt_engine *e = (ckpt_engine *)&eo; /* must be reset to NULL on failure */
    int rc = ckpt_engine_create(&e, &eo);
    if (rc < 0) T_CHECK(e == NULL, "failed create leaves *out NULL");
    ckpt_engine_destroy(rc == 0 ? e : NULL);
    return rc;
}

static void test_invalid_groups(const char *root)
{
    char dir[4200];
    make_dir(root, "invalid", dir, sizeof dir);
    board b;
    board_init(&b, 4);
    rank_ctx cx = {&b, 0};
    const ckpt_group ok0 = {0, 4, "tag", &cx, NULL, board_collect, board_decide, NULL, 5.0};
    const ckpt_group ok1 = {1, 4, "tag", &cx, board_vote, NULL, NULL, board_outcome, 5.0};
    T_CHECK(try_create(dir, &ok0) == 0, "rank 0 needs only collect and decide");
    T_CHECK(try_create(dir, &ok1) == 0, "a rank != 0 needs only vote and outcome");
    ckpt_group g;
    char tag64[65];
    memset(tag64, 'a', 64);
    tag64[64] = '\0';
    struct {
        const char *why;
        ckpt_group g;
    } bad[] = {
        {"rank == world_size", {4, 4, "tag", &cx, board_vote, NULL, NULL, board_outcome, 5.0}},
        {"rank > world_size", {9, 4, "tag", &cx, board_vote, NULL, NULL, board_outcome, 5.0}},
        {"world_size 0", {0, 0, "tag", &cx, NULL, board_collect, board_decide, NULL, 5.0}},
        {"world_size 65537", {0, 65537, "tag", &cx, NULL, board_collect, board_decide, NULL, 5.0}},
        {"NULL tag", {0, 4, NULL, &cx, NULL, board_collect, board_decide, NULL, 5.0}},
        {"empty tag", {0, 4, "", &cx, NULL, board_collect, board_decide, NULL, 5.0}},
        {"tag with a slash", {0, 4, "a/b", &cx, NULL, board_collect, board_decide, NULL, 5.0}},
        {"tag with a space", {1, 4, "a b", &cx, board_vote, NULL, NULL, board_outcome, 5.0}},
        {"tag of 64 characters", {0, 4, tag64, &cx, NULL, board_collect, board_decide, NULL, 5.0}},
        {"rank 0 without collect",
         {0, 4, "tag", &cx, board_vote, NULL, board_decide, board_outcome, 5.0}},
        {"rank 0 without decide",
         {0, 4, "tag", &cx, board_vote, board_collect, NULL, board_outcome, 5.0}},
        {"rank 0 of 1 without collect", {0, 1, "tag", &cx, NULL, NULL, board_decide, NULL, 5.0}},
        {"rank 1 without vote",
         {1, 4, "tag", &cx, NULL, board_collect, board_decide, board_outcome, 5.0}},
        {"rank 3 without outcome",
         {3, 4, "tag", &cx, board_vote, board_collect, board_decide, NULL, 5.0}},
        {"timeout 0", {0, 4, "tag", &cx, NULL, board_collect, board_decide, NULL, 0.0}},
        {"negative timeout", {1, 4, "tag", &cx, board_vote, NULL, NULL, board_outcome, -1.0}},
        {"NaN timeout", {1, 4, "tag", &cx, board_vote, NULL, NULL, board_outcome, NAN}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        g = bad[i].g;
        int rc = try_create(dir, &g);
        T_CHECK(rc == -EINVAL, "create with %s: %d", bad[i].why, rc);
    }
    tag64[63] = '\0';
    g = ok0;
    g.tag = tag64;
    T_CHECK(try_create(dir, &g) == 0, "a tag of 63 characters is fine");
    g = ok0;
    g.world_size = 65536;
    T_CHECK(try_create(dir, &g) == 0, "world_size 65536 is fine");

    /* a rank's shard (offset/bytes) is accepted only in a group */
    float x[4] = {1, 2, 3, 4};
    ckpt_buffer part = {"params", "f32", 4, 64, 16, sizeof x, x};
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = dir;
    ckpt_engine *e = NULL;
    T_REQUIRE(ckpt_engine_create(&e, &eo) == 0, "engine without a group");
    T_CHECK(ckpt_engine_stage(e, 1, RUN, "cfg", &part, 1, "{}", NULL) == -EINVAL,
            "a partial buffer without a group is refused");
    T_CHECK(ckpt_engine_destroy(e) == 0, "destroy");
    T_CHECK(count_entries(dir, "", "") == 0, "nothing saved by the invalid attempts");
    board_fini(&b);
}

/* ------------------------------------------------------------------ late rank, bad record */

/* A rank that starts late: rank 1 fails at once, rank 0 aborts and removes the shared temp
 * folder; rank 2 (W=3) only then stages, recreates the folder, writes its shard and learns
 * the negative decision. Nobody removes what it wrote. (Starting it between rank 0's decide
 * and its removal makes its write fail instead: -ENOENT.) */
static void test_late_rank(const char *root)
{
    const uint32_t W = 3;
    char dir[4200], badfile[4300], baddir[4400];
    make_dir(root, "late", dir, sizeof dir);
    snprintf(badfile, sizeof badfile, "%s/not-a-dir-late", root);
    T_REQUIRE(t_spit(badfile, "x", 1) == 0, "write %s", badfile);
    snprintf(baddir, sizeof baddir, "%s/snapshots", badfile);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++)
        job_init(&jobs[r], &b, r == 1 ? baddir : dir, "launch-late", r, W, 5.0);
    jobs[2].gate_rank0_done = 1;
    run_ranks(jobs, W);
    for (uint32_t r = 0; r < W; r++)
        T_CHECK(jobs[r].wait_rc == -ENOTDIR, "late rank: rank %u result %d", r, jobs[r].wait_rc);
    char name[32];
    ckpt_step_dirname(STEP, name, sizeof name);
    T_CHECK(!path_exists(dir, name), "late rank: nothing committed");
    int ntmp = count_entries(dir, ".tmp-", "");
    T_CHECK(ntmp == 0,
            "late rank: %d temp folder(s) left by a rank that wrote after rank 0 aborted", ntmp);
    ckpt_remove_temp(dir);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

/* Rank 0's trainer record is not a JSON object: its persist fails (-EINVAL) but returns
 * before reaching the code that calls decide, so the others wait for their own timeout
 * (1.5 s here) instead of hearing at once. */
static void test_bad_trainer_record(const char *root)
{
    const uint32_t W = 2;
    char dir[4200];
    make_dir(root, "badjson", dir, sizeof dir);
    board b;
    board_init(&b, W);
    rank_job jobs[MAXW];
    for (uint32_t r = 0; r < W; r++) job_init(&jobs[r], &b, dir, "launch-json", r, W, 1.5);
    jobs[0].trainer = "[1, 2]";
    run_ranks(jobs, W);
    T_CHECK(jobs[0].wait_rc == -EINVAL, "bad trainer: rank 0 result %d", jobs[0].wait_rc);
    T_CHECK(jobs[1].wait_rc < 0, "bad trainer: rank 1 result %d", jobs[1].wait_rc);
    /* rank 1 either hears the decision, or - when rank 0 already removed the shared folder
     * under it - fails on its own at once; never by waiting for its timeout */
    T_CHECK(b.decide_calls == 1 && jobs[1].elapsed_s < 1.0 &&
                (b.outcome_from[1] == FROM_DECISION || b.outcome_calls[1] == 0),
            "bad trainer: rank 0 decided %d time(s); rank 1 learned it %s after %.2f s",
            b.decide_calls,
            b.outcome_from[1] == FROM_DECISION ? "from the decision" : "by its own timeout",
            jobs[1].elapsed_s);
    int ntmp = count_entries(dir, ".tmp-", "");
    T_CHECK(ntmp == 0, "bad trainer: %d temp folder(s) left", ntmp);
    ckpt_remove_temp(dir);
    for (uint32_t r = 0; r < W; r++) job_free(&jobs[r]);
    board_fini(&b);
}

static void *noop(void *arg)
{
    return arg;
}

int main(void)
{
    /* a first thread, so that helper threads a runtime starts with it (ThreadSanitizer's)
     * exist before run_ranks counts threads */
    pthread_t th;
    T_REQUIRE(pthread_create(&th, NULL, noop, NULL) == 0 && pthread_join(th, NULL) == 0, "thread");
    char *root = t_tmpdir("ckpt-group");
    static const uint32_t worlds[] = {1, 2, 3, 5};
    for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
        uint32_t W = worlds[i];
        test_commit(root, W);
        test_step_exists(root, W);
        if (W < 2) continue; /* the cases below need a rank != 0 */
        test_rank_fails(root, W);
        test_dead_rank(root, W);
        test_rank0_exists(root, W);
        test_rank0_merge_fails(root, W);
    }
    test_invalid_groups(root);
    test_late_rank(root);
    test_bad_trainer_record(root);
    t_rmrf(root);
    free(root);
    return t_done("test_ckpt_group");
}
