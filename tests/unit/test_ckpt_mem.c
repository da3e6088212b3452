/* The memory tier (ckpt/ckpt_mem.h): W=4 ranks' memory snapshots of known buffers in four
 * segments, listed, opened as one snapshot handle and read back re-sharded to W=2 and 3
 * (ranges across rank boundaries); a flipped data byte is -EBADMSG naming the segment and
 * chunk; a writer killed mid-copy (fault point) leaves the older step listed; a corrupt
 * header is listed as corrupt and not opened, a peer replica of the same slot is used
 * instead; the flush writes a disk snapshot equal to the memory one only when it is newer.
 */
#include "ckpt.h"
#include "ckpt_mem.h"
#include "ckpt_s3.h"
#include "shmseg.h"
#include "t_helpers.h"

#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <xxhash.h>

#define W 4
#define NB 3
#define CB 16384u /* chunk bytes: several chunks per shard */

static const char *names[NB] = {"params", "adam_m", "rng"};
static const char *dtypes[NB] = {"f32", "f32", "u8"};
static const uint32_t elems[NB] = {4, 4, 1};
static const uint64_t totals[NB] = {4 * 50003, 4 * 20011, 1001};

static char *prefix, *dir;

static uint8_t val(uint64_t step, int b, uint64_t i)
{
    uint64_t x = (step * 1000003u + (uint64_t)b * 7919u + i) * 0x9E3779B97F4A7C15ull;
    return (uint8_t)(x >> 56);
}

/* The whole buffers of a step. */
static uint8_t *whole[NB];
static void make_whole(uint64_t step)
{
    for (int b = 0; b < NB; b++) {
        free(whole[b]);
        whole[b] = malloc(totals[b]);
        for (uint64_t i = 0; i < totals[b]; i++) whole[b][i] = val(step, b, i);
    }
}

/* Rank r's shard of buffer b in a world of w: element-aligned equal parts; "rng" belongs to
 * rank 0 alone (the other ranks have empty shards). */
static void shard(int b, uint32_t r, uint32_t w, uint64_t *off, uint64_t *bytes)
{
    if (b == 2) {
        *off = 0;
        *bytes = r == 0 ? totals[b] : 0;
        if (r) *off = totals[b];
        return;
    }
    uint64_t n = totals[b] / elems[b];
    uint64_t s = n * r / w, e = n * (r + 1) / w;
    *off = s * elems[b];
    *bytes = (e - s) * elems[b];
}

static char *seg_path(const char *kind)
{
    char *p = malloc(4200);
    snprintf(p, 4200, "%s.%s", prefix, kind);
    return p;
}

static shmseg *segs[W];
static uint64_t slot_bytes;

static void write_step(uint64_t step, int *slots)
{
    make_whole(step);
    char trainer[128];
    snprintf(trainer, sizeof trainer, "{\"step\":%llu,\"lr\":0.5}", (unsigned long long)step);
    for (uint32_t r = 0; r < W; r++) {
        ckpt_buffer bufs[NB], staged[NB];
        for (int b = 0; b < NB; b++) {
            uint64_t off, bytes;
            shard(b, r, W, &off, &bytes);
            bufs[b] = (ckpt_buffer){names[b], dtypes[b], elems[b], totals[b], off, bytes, whole[b] + off};
        }
        int slot = -1;
        int rc = ckpt_mem_write(segs[r], -1, step, "run1", "cfg1", "tagA", W, r, bufs, NB, trainer, CB, &slot, staged);
        T_REQUIRE(rc == 0, "mem_write step %llu rank %u: %d", (unsigned long long)step, r, rc);
        if (slots) slots[r] = slot;
        uint8_t *pay = shmseg_payload(segs[r], slot);
        for (int b = 0; b < NB; b++) {
            T_CHECK(!strcmp(staged[b].name, names[b]) && staged[b].bytes == bufs[b].bytes &&
                        staged[b].offset == bufs[b].offset, "staged_out %d", b);
            if (bufs[b].bytes) {
                const uint8_t *d = staged[b].data;
                T_CHECK(d >= pay && d + bufs[b].bytes <= pay + slot_bytes && ((uintptr_t)d % 4096) == 0,
                        "staged data points into the slot, aligned");
                T_CHECK(memcmp(d, bufs[b].data, bufs[b].bytes) == 0, "staged bytes equal");
            } else {
                T_CHECK(staged[b].data == NULL, "empty shard has no data");
            }
        }
    }
}

/* Read every new rank's shard of a world of w from the handle and compare. */
static void check_reshard(ckpt_snapshot *s, uint32_t w)
{
    for (int b = 0; b < NB; b++)
        for (uint32_t r = 0; r < w; r++) {
            uint64_t off, bytes;
            shard(b == 2 ? 0 : b, r, w, &off, &bytes); /* rng re-sharded as the others */
            if (b == 2) {
                uint64_t n = totals[b];
                off = n * r / w;
                bytes = n * (r + 1) / w - off;
            }
            uint8_t *dst = malloc(bytes + 1);
            char bad[512] = "";
            int rc = ckpt_snapshot_read(s, names[b], off, bytes, dst, bad, sizeof bad);
            T_CHECK(rc == 0 && memcmp(dst, whole[b] + off, bytes) == 0, "W=%u rank %u buffer %s: rc %d %s", w, r,
                    names[b], rc, bad);
            free(dst);
        }
}

static int count_status(const ckpt_mem_entry *e, size_t n, int status)
{
    int c = 0;
    for (size_t i = 0; i < n; i++) c += e[i].status == status;
    return c;
}

static void test_write_list_open(void)
{
    ckpt_buffer probe[NB];
    for (int b = 0; b < NB; b++) {
        uint64_t off, bytes;
        shard(b, 0, W, &off, &bytes); /* rank 0 has the largest shards */
        probe[b] = (ckpt_buffer){names[b], dtypes[b], elems[b], totals[b], off, bytes, NULL};
    }
    slot_bytes = ckpt_mem_need(probe, NB, 64, CB);
    T_REQUIRE(slot_bytes > 0 && slot_bytes % 4096 == 0, "need %llu", (unsigned long long)slot_bytes);
    T_CHECK(ckpt_mem_need(probe, NB, 64, 0) == 0, "need with chunk 0");
    for (uint32_t r = 0; r < W; r++) {
        char p[4200];
        T_REQUIRE(shmseg_own_path(p, sizeof p, prefix, r) == 0, "name");
        T_REQUIRE(shmseg_create(p, 2, slot_bytes, &segs[r]) == 0, "create %s", p);
    }
    /* a segment too small: -ENOSPC, nothing touched */
    {
        char *p = seg_path("small");
        shmseg *sm;
        T_REQUIRE(shmseg_create(p, 2, 4096, &sm) == 0, "small");
        ckpt_buffer b0 = {"params", "f32", 4, totals[0], 0, 4 * 2000, whole[0]};
        make_whole(1);
        b0.data = whole[0];
        int sl;
        T_CHECK(ckpt_mem_write(sm, -1, 1, "run1", "cfg1", "tagA", 1, 0, &b0, 1, "{}", CB, &sl, NULL) == -ENOSPC,
                "too small");
        T_CHECK(shmseg_newest(sm, &sl) == -ENOENT, "no slot touched");
        shmseg_info in;
        T_CHECK(shmseg_slot_info(sm, 0, &in) == 0 && in.state == SHMSEG_EMPTY, "slot 0 still empty");
        T_CHECK(ckpt_mem_write(sm, -1, 1, "bad id!", "cfg1", "tagA", 1, 0, &b0, 1, "{}", CB, &sl, NULL) == -EINVAL,
                "bad run id");
        T_CHECK(ckpt_mem_write(sm, -1, 1, "run1", "cfg1", "tagA", 1, 0, &b0, 1, "[1]", CB, &sl, NULL) == -EINVAL,
                "trainer record not an object");
        T_CHECK(ckpt_mem_write(sm, -1, 1, "run1", "cfg1", "tagA", 1, 1, &b0, 1, "{}", CB, &sl, NULL) == -EINVAL,
                "rank >= world");
        shmseg_close(sm);
        unlink(p);
        free(p);
    }

    int s10[W], s20[W];
    write_step(10, s10);
    write_step(20, s20);
    for (uint32_t r = 0; r < W; r++) T_CHECK(s10[r] != s20[r], "rank %u alternates slots", r);

    ckpt_mem_entry *e;
    size_t n;
    T_REQUIRE(ckpt_mem_list(prefix, &e, &n) == 0, "list");
    T_REQUIRE(n == 2, "two memory snapshots listed, got %zu", n);
    T_CHECK(e[0].step == 20 && e[0].status == CKPT_MEM_COMPLETE && e[0].world_size == W && e[0].ranks_present == W &&
                e[0].ranks_own == W && e[0].ranks_replica == 0 && e[0].source == CKPT_MEM_SRC_OWN,
            "newest first: step %llu status %d", (unsigned long long)e[0].step, e[0].status);
    T_CHECK(!strcmp(e[0].id, "mem:run1/tagA/20/4") && !strcmp(e[0].run_id, "run1") && !strcmp(e[0].tag, "tagA") &&
                !strcmp(e[0].config_hash, "cfg1"),
            "id %s", e[0].id);
    T_CHECK(e[0].raw_bytes == totals[0] + totals[1] + totals[2], "raw bytes %llu", (unsigned long long)e[0].raw_bytes);
    T_CHECK(e[1].step == 10 && e[1].status == CKPT_MEM_COMPLETE, "step 10 second");
    free(e);

    ckpt_snapshot *s;
    char why[512] = "";
    T_REQUIRE(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/20/4", why, sizeof why) == 0, "open: %s", why);
    T_CHECK(ckpt_snapshot_is_mem(s) && ckpt_snapshot_step(s) == 20 && ckpt_snapshot_world_size(s) == W &&
                !strcmp(ckpt_snapshot_run_id(s), "run1") && !strcmp(ckpt_snapshot_config_hash(s), "cfg1"),
            "accessors");
    T_CHECK(!strcmp(ckpt_snapshot_path(s), "mem:run1/tagA/20/4"), "path is the id");
    T_CHECK(!strcmp(ckpt_snapshot_trainer_json(s), "{\"lr\":0.5,\"step\":20}"), "trainer %s",
            ckpt_snapshot_trainer_json(s));
    T_CHECK(ckpt_mem_snapshot_replicas(s) == 0 && ckpt_mem_snapshot_source(s, 3) == CKPT_MEM_SRC_OWN &&
                ckpt_mem_snapshot_source(s, 4) == -EINVAL,
            "sources");
    T_CHECK(ckpt_snapshot_nbuffers(s) == NB && ckpt_snapshot_buffer_bytes(s, "adam_m") == (int64_t)totals[1],
            "buffers");
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify");
    check_reshard(s, 1);
    check_reshard(s, 2);
    check_reshard(s, 3);
    check_reshard(s, 4);
    T_CHECK(ckpt_snapshot_set_threads(s, 3) == 0, "threads");
    check_reshard(s, 3);
    /* random ranges */
    uint64_t seed = 7;
    for (int i = 0; i < 200; i++) {
        seed = seed * 6364136223846793005ull + 1;
        int b = (int)((seed >> 33) % 2);
        uint64_t off = (seed >> 20) % totals[b];
        uint64_t len = ((seed >> 40) % 70000) % (totals[b] - off) + 1;
        uint8_t *dst = malloc(len);
        int rc = ckpt_snapshot_read(s, names[b], off, len, dst, NULL, 0);
        T_CHECK(rc == 0 && memcmp(dst, whole[b] + off, len) == 0, "range %s [%llu,+%llu)", names[b],
                (unsigned long long)off, (unsigned long long)len);
        free(dst);
    }
    ckpt_snapshot_close(s);
    ckpt_snapshot *s2 = NULL;
    T_CHECK(ckpt_mem_snapshot_open(&s2, prefix, "mem:run1/tagA/20/5", why, sizeof why) == -ENOENT && !s2,
            "another world size is not there");
    T_CHECK(ckpt_mem_snapshot_open(&s2, prefix, "mem:run1/tagB/20/4", why, sizeof why) == -ENOENT, "another tag");
    T_CHECK(ckpt_mem_snapshot_open(&s2, prefix, "mem:run1/tagA/20", why, sizeof why) == -EINVAL, "malformed id");
    T_CHECK(ckpt_mem_snapshot_open(&s2, prefix, "mem:run1/tagA/x/4", why, sizeof why) == -EINVAL, "malformed step");

    /* through open_any with CKPT_MEM_PATH */
    unsetenv(CKPT_MEM_PATH_ENV);
    T_CHECK(ckpt_snapshot_open_any(&s2, "mem:run1/tagA/10/4", NULL, why, sizeof why) == -ENOENT,
            "no CKPT_MEM_PATH: no memory tier");
    setenv(CKPT_MEM_PATH_ENV, prefix, 1);
    T_REQUIRE(ckpt_snapshot_open_any(&s2, "mem:run1/tagA/10/4", NULL, why, sizeof why) == 0, "open_any: %s", why);
    make_whole(10);
    check_reshard(s2, 3);
    ckpt_snapshot_close(s2);
    make_whole(20);
}

/* Flip one data byte of rank 2's step-20 slot: reads through it and verify say -EBADMSG
 * naming the segment and chunk; other ranges still read. */
static void test_flipped_byte(void)
{
    int slot;
    T_REQUIRE(shmseg_newest(segs[2], &slot) == 0, "newest");
    uint64_t off, bytes;
    shard(0, 2, W, &off, &bytes);
    ckpt_snapshot *s;
    char why[512] = "";
    T_REQUIRE(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/20/4", why, sizeof why) == 0, "open: %s", why);
    uint8_t *p = shmseg_payload(segs[2], slot);
    /* params is the first buffer: its data starts at 4096; byte 3*CB+5 is in chunk 3 */
    p[4096 + 3 * CB + 5] ^= 0x40;
    uint8_t *dst = malloc(bytes);
    char bad[512] = "";
    int rc = ckpt_snapshot_read(s, "params", off, bytes, dst, bad, sizeof bad);
    T_CHECK(rc == -EBADMSG, "flipped byte: rc %d", rc);
    T_CHECK(strstr(bad, ".own-2 slot") && strstr(bad, "chunk 3") && strstr(bad, "params"), "message: %s", bad);
    T_CHECK(ckpt_snapshot_read(s, "params", off + 4 * CB, 1000, dst, NULL, 0) == 0, "other chunks still read");
    T_CHECK(ckpt_snapshot_verify(s, bad, sizeof bad, NULL, NULL) == -EBADMSG, "verify finds it");
    p[4096 + 3 * CB + 5] ^= 0x40;
    T_CHECK(ckpt_snapshot_read(s, "params", off, bytes, dst, NULL, 0) == 0 && memcmp(dst, whole[0] + off, bytes) == 0,
            "restored byte reads again");
    free(dst);
    ckpt_snapshot_close(s);
}

/* A worker killed by the fault point halfway through copying step 999: its slot stays
 * "writing"; step 20 is still the newest listed, and rank 0's step-10 slot is gone. */
static void test_crash_mid_copy(void)
{
    pid_t pid = fork();
    T_REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        make_whole(999);
        ckpt_buffer bufs[NB];
        for (int b = 0; b < NB; b++) {
            uint64_t off, bytes;
            shard(b, 0, W, &off, &bytes);
            bufs[b] = (ckpt_buffer){names[b], dtypes[b], elems[b], totals[b], off, bytes, whole[b] + off};
        }
        ckpt_mem_write(segs[0], -1, 999, "run1", "cfg1", "tagA", W, 0, bufs, NB, "{}", CB, NULL, NULL);
        _exit(0); /* reached only when the fault point did not fire */
    }
    int st;
    waitpid(pid, &st, 0);
    T_CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "the fault point killed the writer (status %d)", st);
    int writing = 0;
    for (int i = 0; i < shmseg_nslots(segs[0]); i++) {
        shmseg_info in;
        T_CHECK(shmseg_slot_info(segs[0], i, &in) == 0, "info");
        writing += in.state == SHMSEG_WRITING;
    }
    T_CHECK(writing == 1, "one slot left writing");
    ckpt_mem_entry *e;
    size_t n;
    T_REQUIRE(ckpt_mem_list(prefix, &e, &n) == 0, "list");
    T_CHECK(n == 2 && e[0].step == 20 && e[0].status == CKPT_MEM_COMPLETE, "step 20 newest complete");
    T_CHECK(n == 2 && e[1].step == 10 && e[1].status == CKPT_MEM_PARTIAL && e[1].ranks_present == W - 1 &&
                strstr(e[1].reason, "rank 0"),
            "step 10 partial: %s", n == 2 ? e[1].reason : "");
    for (size_t i = 0; i < n; i++) T_CHECK(e[i].step != 999, "the torn step is never listed");
    free(e);
    ckpt_snapshot *s;
    T_CHECK(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/10/4", NULL, 0) == -ENOENT, "step 10 not openable");
    char why[256];
    T_CHECK(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/20/4", why, sizeof why) == 0, "step 20 opens");
    check_reshard(s, 2);
    ckpt_snapshot_close(s);
}

/* What the agent's receiver does: copy a complete slot into a replica segment. */
static void make_replica(uint32_t rank, const char *kind)
{
    int slot;
    T_REQUIRE(shmseg_newest(segs[rank], &slot) == 0, "newest");
    shmseg_info in;
    T_REQUIRE(shmseg_slot_info(segs[rank], slot, &in) == 0, "info");
    uint8_t *buf = malloc(in.payload_bytes);
    uint64_t seq = 0;
    T_REQUIRE(shmseg_copy_out(segs[rank], slot, buf, 0, in.payload_bytes, &seq) == 0, "copy out");
    char *p = seg_path(kind);
    shmseg *rep;
    T_REQUIRE(shmseg_create(p, 2, shmseg_slot_bytes(segs[rank]), &rep) == 0, "create replica");
    int rs;
    T_REQUIRE(shmseg_begin(rep, -1, &rs) == 0, "begin");
    memcpy(shmseg_payload(rep, rs), buf, in.payload_bytes);
    T_REQUIRE(shmseg_commit(rep, rs, in.payload_bytes, in.step) == 0, "commit");
    shmseg_close(rep);
    free(buf);
    free(p);
}

/* A corrupt header in rank 1's step-20 slot: listed as corrupt, the step partial and not
 * opened; with a replica of rank 1 from a peer it is complete again, from the replica. */
static void test_corrupt_header_and_replica(void)
{
    char rn[4200];
    T_REQUIRE(shmseg_rep_path(rn, sizeof rn, prefix, 0, 1) == 0, "rep name");
    make_replica(1, strrchr(rn, '.') + 1);
    ckpt_mem_entry *e;
    size_t n;
    T_REQUIRE(ckpt_mem_list(prefix, &e, &n) == 0, "list");
    T_CHECK(n >= 1 && e[0].step == 20 && e[0].status == CKPT_MEM_COMPLETE && e[0].ranks_own == W &&
                e[0].ranks_replica == 0,
            "own preferred over a replica of the same slot");
    free(e);
    char *rep = strdup(rn); /* "rep-<agent16>-1": the name the agent gives it */

    int slot;
    T_REQUIRE(shmseg_newest(segs[1], &slot) == 0, "newest");
    uint8_t *p = shmseg_payload(segs[1], slot);
    p[40] ^= 1; /* chunk_bytes field: the header checksum no longer matches */
    T_REQUIRE(ckpt_mem_list(prefix, &e, &n) == 0, "list");
    T_CHECK(n >= 1 && e[0].step == 20 && e[0].status == CKPT_MEM_COMPLETE && e[0].ranks_replica == 1 &&
                e[0].ranks_own == W - 1 && e[0].source == CKPT_MEM_SRC_REPLICA,
            "rank 1 from the replica: status %d own %u rep %u", n ? e[0].status : -1, n ? e[0].ranks_own : 0,
            n ? e[0].ranks_replica : 0);
    T_CHECK(count_status(e, n, CKPT_MEM_CORRUPT) == 1, "one corrupt slot listed");
    for (size_t i = 0; i < n; i++)
        if (e[i].status == CKPT_MEM_CORRUPT)
            T_CHECK(strstr(e[i].name, ".own-1 slot") && e[i].step == 20 && e[i].reason[0], "corrupt entry %s: %s",
                    e[i].name, e[i].reason);
    free(e);
    ckpt_snapshot *s;
    char why[512] = "";
    T_REQUIRE(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/20/4", why, sizeof why) == 0, "open: %s", why);
    T_CHECK(ckpt_mem_snapshot_source(s, 1) == CKPT_MEM_SRC_REPLICA && ckpt_mem_snapshot_source(s, 0) == CKPT_MEM_SRC_OWN &&
                ckpt_mem_snapshot_replicas(s) == 1,
            "rank 1 read from the replica");
    check_reshard(s, 3);
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify");
    ckpt_snapshot_close(s);

    /* without the replica: partial, not opened */
    T_REQUIRE(unlink(rep) == 0, "unlink replica");
    T_REQUIRE(ckpt_mem_list(prefix, &e, &n) == 0, "list");
    T_CHECK(n >= 1 && e[0].step == 20 && e[0].status == CKPT_MEM_PARTIAL && e[0].ranks_present == W - 1 &&
                strstr(e[0].reason, "rank 1"),
            "partial without the replica");
    free(e);
    T_CHECK(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/20/4", why, sizeof why) == -ENOENT && strstr(why, "rank 1"),
            "not opened: %s", why);
    p[40] ^= 1;
    T_CHECK(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/20/4", why, sizeof why) == 0, "header restored");
    ckpt_snapshot_close(s);
    free(rep);
}

static int read_equal(ckpt_snapshot *s)
{
    for (int b = 0; b < NB; b++) {
        uint8_t *dst = malloc(totals[b]);
        int ok = ckpt_snapshot_read(s, names[b], 0, totals[b], dst, NULL, 0) == 0 &&
                 memcmp(dst, whole[b], totals[b]) == 0;
        free(dst);
        if (!ok) return 0;
    }
    return 1;
}

/* A flush check (ckpt_mem_flush_checked) that records what it was shown and accepts or
 * rejects everything. */
typedef struct seen {
    int n, reject, whole_ok;
    uint64_t steps[8];
} seen;

static int check_cb(void *ctx, ckpt_snapshot *s, const ckpt_buffer *bufs, size_t nbufs, char *why, size_t why_len)
{
    seen *sn = ctx;
    uint64_t step = ckpt_snapshot_step(s);
    if (sn->n < 8) sn->steps[sn->n++] = step;
    int ok = nbufs == NB;
    for (size_t b = 0; ok && b < nbufs; b++) {
        ok = !strcmp(bufs[b].name, names[b]) && bufs[b].offset == 0 && bufs[b].bytes == totals[b] &&
             bufs[b].total_bytes == totals[b];
        const uint8_t *d = bufs[b].data;
        for (uint64_t i = 0; ok && i < totals[b]; i += 997) ok = d[i] == val(step, (int)b, i);
        ok = ok && d[totals[b] - 1] == val(step, (int)b, totals[b] - 1);
    }
    sn->whole_ok = ok;
    if (!sn->reject) return 0;
    snprintf(why, why_len, "step %llu is not wanted", (unsigned long long)step);
    return -EBADMSG;
}

static void test_flush(void)
{
    char *disk = t_path_in(dir, "ckpt");
    char why[512] = "";
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.chunk_bytes = 64 * 1024;
    ckpt_dir_lock *l;
    T_REQUIRE(ckpt_dir_lock_acquire(disk, &l, NULL) == 0, "lock");
    T_CHECK(ckpt_mem_flush(prefix, disk, &o, NULL, why, sizeof why) == -EBUSY, "locked folder: %s", why);
    ckpt_dir_lock_release(l);

    /* a newer snapshot of another run in the folder counts: step 20 written below it would
     * block continuing ("later snapshots in the way") */
    char *disk2 = t_path_in(dir, "ckpt-other");
    make_whole(77);
    ckpt_buffer ob = {"params", "f32", 4, 4096, 0, 4096, whole[0]};
    T_REQUIRE(ckpt_save(&(ckpt_save_opts){.dir = disk2, .chunk_bytes = 4096, .zstd_level = 1, .direct_io = 0,
                                          .queue_depth = 4},
                        77, "other", "cfg1", &ob, 1, "{}", NULL) == 0,
              "save other run");
    uint8_t *keep = malloc(4096);
    memcpy(keep, whole[0], 4096);
    ob.data = keep;
    make_whole(20);
    T_CHECK(ckpt_mem_flush(prefix, disk2, &o, NULL, why, sizeof why) == 0 && strstr(why, "step-000000077") &&
                strstr(why, "run other"),
            "another run's step 77 in the folder: nothing flushed (%s)", why);
    char p2[4300];
    snprintf(p2, sizeof p2, "%s/step-000000020", disk2);
    T_CHECK(!t_exists(p2), "no step 20 next to the other run's 77");
    free(disk2);
    T_CHECK(ckpt_mem_flush(prefix, disk, &o, "nope", why, sizeof why) == 0 && strstr(why, "other runs") &&
                strstr(why, "run nope"),
            "only other runs' memory snapshots: %s", why);
    int64_t st = ckpt_mem_flush(prefix, disk, &o, NULL, why, sizeof why);
    T_CHECK(st == 20, "flushed step 20 (got %lld: %s)", (long long)st, why);
    char p[4300];
    snprintf(p, sizeof p, "%s/step-000000020", disk);
    ckpt_snapshot *s;
    T_REQUIRE(ckpt_snapshot_open(&s, p, why, sizeof why) == 0, "open flushed: %s", why);
    T_CHECK(ckpt_snapshot_world_size(s) == 1 && ckpt_snapshot_step(s) == 20 && !strcmp(ckpt_snapshot_run_id(s), "run1") &&
                !strcmp(ckpt_snapshot_config_hash(s), "cfg1"),
            "a world of one of run1");
    T_CHECK(!strcmp(ckpt_snapshot_trainer_json(s), "{\"lr\":0.5,\"step\":20}"), "trainer record");
    T_CHECK(ckpt_snapshot_verify(s, NULL, 0, NULL, NULL) == 0, "verify");
    T_CHECK(read_equal(s), "bytes equal the memory snapshot's");
    ckpt_snapshot_close(s);

    T_CHECK(ckpt_mem_flush(prefix, disk, &o, NULL, why, sizeof why) == 0, "second flush: nothing newer (%s)", why);
    /* disk newer than memory: nothing */
    T_REQUIRE(ckpt_save(&(ckpt_save_opts){.dir = disk, .chunk_bytes = 4096, .zstd_level = 1, .direct_io = 0,
                                          .queue_depth = 4},
                        30, "run1", "cfg1", &ob, 1, "{}", NULL) == 0,
              "save step 30");
    write_step(25, NULL);
    T_CHECK(ckpt_mem_flush(prefix, disk, &o, "run1", why, sizeof why) == 0, "disk (30) newer than memory (25): %s", why);
    snprintf(p, sizeof p, "%s/step-000000025", disk);
    T_CHECK(!t_exists(p), "nothing written");

    /* a corrupt newest candidate: the older one that is still newer than the disk is used */
    write_step(40, NULL);
    write_step(50, NULL);
    int slot;
    T_REQUIRE(shmseg_newest(segs[3], &slot) == 0, "newest");
    uint64_t off, pbytes;
    shard(0, 3, W, &off, &pbytes);
    uint8_t *pay = shmseg_payload(segs[3], slot);
    pay[4096 + (pbytes + 4095) / 4096 * 4096 + 10] ^= 1; /* in adam_m's shard (after params') */
    /* the caller's check sees each candidate that reads back whole, before anything is
     * written; one it rejects is never committed */
    seen sn = {.reject = 1};
    st = ckpt_mem_flush_checked(prefix, disk, &o, "run1", check_cb, &sn, why, sizeof why);
    T_CHECK(st < 0 && sn.n == 1 && sn.steps[0] == 40 && sn.whole_ok,
            "50 corrupt, 40 rejected by the check: nothing flushed (got %lld, %d calls: %s)", (long long)st, sn.n, why);
    snprintf(p, sizeof p, "%s/step-000000040", disk);
    T_CHECK(!t_exists(p), "the rejected step 40 is not on disk");
    sn = (seen){.reject = 0};
    st = ckpt_mem_flush_checked(prefix, disk, &o, "run1", check_cb, &sn, why, sizeof why);
    T_CHECK(st == 40 && sn.n == 1 && sn.whole_ok, "step 50 corrupt, step 40 accepted and flushed (got %lld: %s)",
            (long long)st, why);
    T_CHECK(st != 50, "the corrupt one is not written");
    snprintf(p, sizeof p, "%s/step-000000050", disk);
    T_CHECK(!t_exists(p), "no step 50 on disk");
    free(keep);
    free(disk);
}

/* A handle whose slot is rewritten under it: -ESTALE, never wrong bytes. */
static void test_stale(void)
{
    ckpt_snapshot *s;
    char why[256];
    T_REQUIRE(ckpt_mem_snapshot_open(&s, prefix, "mem:run1/tagA/40/4", why, sizeof why) == 0, "open 40: %s", why);
    write_step(60, NULL); /* overwrites each rank's step-40 slot (50 stays) */
    char bad[512] = "";
    uint8_t *dst = malloc(totals[0]);
    int rc = ckpt_snapshot_read(s, "params", 0, totals[0], dst, bad, sizeof bad);
    T_CHECK(rc == -ESTALE && strstr(bad, "rewritten"), "stale read: %d %s", rc, bad);
    free(dst);
    ckpt_snapshot_close(s);
}

/* Hostile headers: every header byte of a one-rank slot changed (and the header checksum
 * and the slot's head checksum resealed, so the field checks are what stands), and other
 * payload sizes: listing never crashes, a slot that passes opens, and every read returns 0 or
 * a documented error (ASan/UBSan builds check the bounds). */
static void test_hostile_headers(void)
{
    char prefix2[4200]; /* a prefix of its own: only this segment is listed */
    snprintf(prefix2, sizeof prefix2, "%s/ckptmem-hostile", dir);
    char *p = t_path_in(dir, "ckptmem-hostile.own-0");
    make_whole(5);
    ckpt_buffer bufs[NB];
    for (int b = 0; b < NB; b++)
        bufs[b] = (ckpt_buffer){names[b], dtypes[b], elems[b], b == 0 ? 8192 : 100, 0, b == 0 ? 8192 : 100, whole[b]};
    uint64_t need = ckpt_mem_need(bufs, NB, 64, 4096);
    shmseg *seg;
    T_REQUIRE(shmseg_create(p, 2, need, &seg) == 0, "create");
    int slot;
    T_REQUIRE(ckpt_mem_write(seg, -1, 5, "runH", "cfgH", "tagH", 1, 0, bufs, NB, "{\"a\":1}", 4096, &slot, NULL) == 0,
              "write");
    shmseg_info in;
    T_REQUIRE(shmseg_slot_info(seg, slot, &in) == 0, "info");
    uint8_t *pay = shmseg_payload(seg, slot);
    uint8_t good[4096];
    memcpy(good, pay, sizeof good);
    int opened = 0, refused = 0, bad_rc = 0, wrong = 0;
    for (int off = 0; off < 2200; off++) {
        for (int v = 0; v < 3; v++) {
            memcpy(pay, good, sizeof good);
            pay[off] = v == 0 ? (uint8_t)(good[off] ^ 0x01) : v == 1 ? (uint8_t)(good[off] ^ 0x80) : 0xff;
            uint64_t sum = XXH3_64bits(pay, 2200);
            memcpy(pay + 2200, &sum, 8);
            int j;
            if (shmseg_begin(seg, 1 - slot, &j) != 0 || j != slot || shmseg_commit(seg, slot, in.payload_bytes, 5) != 0) {
                fprintf(stderr, "byte %d value %d: reseal failed\n", off, v);
                bad_rc++;
            }
            ckpt_mem_entry *e;
            size_t n;
            if (ckpt_mem_list(prefix2, &e, &n) != 0) {
                fprintf(stderr, "byte %d value %d: list failed\n", off, v);
                bad_rc++;
                continue;
            }
            for (size_t i = 0; i < n; i++) {
                if (e[i].status != CKPT_MEM_COMPLETE) {
                    refused++;
                    continue;
                }
                ckpt_snapshot *s;
                char w2[300] = "";
                int rc = ckpt_mem_snapshot_open(&s, prefix2, e[i].id, w2, sizeof w2);
                if (rc == -EBADMSG || rc == -ENOENT) {
                    refused++;
                    continue;
                }
                if (rc != 0) {
                    fprintf(stderr, "byte %d value %d: open gave %d\n", off, v, rc);
                    bad_rc++;
                    continue;
                }
                opened++;
                for (size_t b = 0; b < ckpt_snapshot_nbuffers(s); b++) {
                    ckpt_buffer_info bi;
                    ckpt_snapshot_buffer_info(s, b, &bi);
                    uint8_t *dst = malloc(bi.total_bytes + 1);
                    rc = ckpt_snapshot_read(s, bi.name, 0, bi.total_bytes, dst, NULL, 0);
                    /* what comes out with 0 is the bytes that were written, or nothing */
                    if (rc == 0 && (b >= NB || bi.total_bytes != bufs[b].bytes ||
                                    memcmp(dst, bufs[b].data, bi.total_bytes) != 0)) {
                        fprintf(stderr, "byte %d value %d: buffer %zu read wrong bytes\n", off, v, b);
                        wrong++;
                    }
                    if (rc != 0 && rc != -EBADMSG) {
                        fprintf(stderr, "byte %d value %d: read gave %d\n", off, v, rc);
                        bad_rc++;
                    }
                    free(dst);
                }
                ckpt_snapshot_close(s);
            }
            free(e);
        }
    }
    printf("hostile headers: %d opened, %d refused\n", opened, refused);
    T_CHECK(bad_rc == 0, "%d undocumented results", bad_rc);
    T_CHECK(wrong == 0, "%d changed headers gave other bytes with success", wrong);
    T_CHECK(refused > 300, "changes of the fields refused (%d)", refused);
    T_CHECK(opened > 0, "changes in unused bytes (name padding, unused entries, created) still open (%d)", opened);
    /* other payload sizes in the slot header: refused (the layout fixes payload_bytes) */
    memcpy(pay, good, sizeof good);
    for (int d = -1; d <= 1; d += 2) {
        int j;
        T_REQUIRE(shmseg_begin(seg, 1 - slot, &j) == 0, "begin");
        T_REQUIRE(shmseg_commit(seg, slot, in.payload_bytes + (uint64_t)(int64_t)(8 * d), 5) == 0, "commit");
        ckpt_mem_entry *e;
        size_t n;
        T_REQUIRE(ckpt_mem_list(prefix2, &e, &n) == 0, "list");
        T_CHECK(n == 1 && e[0].status == CKPT_MEM_CORRUPT, "payload_bytes %+d refused", 8 * d);
        free(e);
    }
    shmseg_close(seg);
    unlink(p);
    free(p);
}

/* The prefix rule the readers apply, exported for the writers (ckpt_mem_prefix_ok). */
static void test_prefix_rule(void)
{
    T_CHECK(ckpt_mem_prefix_ok("/dev/shm/ckptmem-a-b"), "a usual prefix");
    T_CHECK(ckpt_mem_prefix_ok("rel"), "a relative prefix");
    T_CHECK(!ckpt_mem_prefix_ok("/"), "/ refused");
    T_CHECK(!ckpt_mem_prefix_ok("/dev/shm/"), "a folder refused");
    T_CHECK(!ckpt_mem_prefix_ok(""), "empty refused");
    T_CHECK(!ckpt_mem_prefix_ok(NULL), "NULL refused");
    char *longp = malloc(CKPT_PATH_MAX);
    T_REQUIRE(longp, "malloc");
    memset(longp, 'a', CKPT_PATH_MAX - 1);
    longp[0] = '/';
    longp[CKPT_PATH_MAX - 64] = '\0';
    T_CHECK(!ckpt_mem_prefix_ok(longp), "too long refused");
    longp[CKPT_PATH_MAX - 65] = '\0';
    T_CHECK(ckpt_mem_prefix_ok(longp), "the longest accepted");
    ckpt_mem_entry *e = NULL;
    size_t n = 0;
    T_CHECK(ckpt_mem_list("/dev/shm/", &e, &n) == -EINVAL, "the lister refuses what the rule refuses");
    free(e);
    free(longp);
}

/* ------------------------------------------------------------------ remotes */

/* A remote in this process: ranks 2 and 3's segments, moved out of the prefix's folder. */
typedef struct fake_remote {
    shmseg *seg[2];
    uint64_t seq[4]; /* per ref = seg * 2 + slot, as listed */
    int fail_list, flip, stale;
    int reads;
} fake_remote;

static int fake_list(void *ctx, ckpt_mem_remote_slot **out, size_t *n)
{
    fake_remote *f = ctx;
    *out = NULL;
    *n = 0;
    if (f->fail_list) return -ETIMEDOUT;
    ckpt_mem_remote_slot *v = calloc(4, sizeof *v);
    if (!v) return -ENOMEM;
    for (int g = 0; g < 2; g++)
        for (int sl = 0; sl < 2; sl++) {
            shmseg_info in;
            if (shmseg_slot_info(f->seg[g], sl, &in) < 0 || in.state != SHMSEG_COMPLETE) continue;
            ckpt_mem_remote_slot *e = &v[*n];
            uint64_t seq = 0, hl = in.payload_bytes < 4096 ? in.payload_bytes : 4096;
            if (shmseg_copy_out(f->seg[g], sl, e->head, 0, hl, &seq) < 0) continue;
            e->ref = (uint64_t)(g * 2 + sl);
            e->payload_bytes = in.payload_bytes;
            f->seq[e->ref] = seq;
            snprintf(e->where, sizeof e->where, "fake remote seg %d slot %d", g, sl);
            (*n)++;
        }
    *out = v;
    return 0;
}

static int fake_read(void *ctx, uint64_t ref, uint64_t off, uint64_t len, void *dst)
{
    fake_remote *f = ctx;
    __atomic_add_fetch(&f->reads, 1, __ATOMIC_RELAXED);
    if (f->stale) return -ESTALE;
    uint64_t seq = f->seq[ref];
    int rc = shmseg_copy_out(f->seg[ref / 2], (int)(ref % 2), dst, off, len, &seq);
    if (rc == -EINVAL) return -ERANGE;
    if (rc < 0) return -ESTALE;
    if (f->flip && len > 4096 && off >= 4096) ((uint8_t *)dst)[len / 2] ^= 0x10; /* a data chunk */
    return 0;
}

static void test_remote(void)
{
    make_whole(5000);
    write_step(5000, NULL);
    /* ranks 2 and 3's segments leave the folder (their mappings stay): here only 0 and 1 */
    char *away = t_tmpdir("ckpt-mem-away");
    char *own2 = seg_path("own-2"), *own3 = seg_path("own-3"), *a2 = t_path_in(away, "2"), *a3 = t_path_in(away, "3");
    T_REQUIRE(rename(own2, a2) == 0 && rename(own3, a3) == 0, "move ranks 2, 3 away");
    /* the replicas other tests left of ranks 2, 3 are of older steps: step 5000 is partial here */
    fake_remote f = {{segs[2], segs[3]}, {0}, 0, 0, 0, 0};
    ckpt_mem_remote rm = {"fake remote", &f, fake_list, fake_read};
    ckpt_mem_entry *e = NULL;
    size_t n = 0;
    T_REQUIRE(ckpt_mem_list(prefix, &e, &n) == 0 && n > 0, "list local");
    T_CHECK(e[0].step == 5000 && e[0].status == CKPT_MEM_PARTIAL && e[0].ranks_present == 2,
            "local: step 5000 partial (%d, %u ranks)", e[0].status, e[0].ranks_present);
    char id[CKPT_MEM_ID_MAX];
    snprintf(id, sizeof id, "%s", e[0].id);
    free(e);
    T_REQUIRE(ckpt_mem_list_ex(prefix, &rm, 1, &e, &n) == 0 && n > 0, "list with the remote");
    T_CHECK(e[0].step == 5000 && e[0].status == CKPT_MEM_COMPLETE && e[0].ranks_present == W &&
                e[0].ranks_own == 2 && e[0].ranks_remote == 2 && e[0].source == CKPT_MEM_SRC_REMOTE,
            "with the remote: complete, 2 own + 2 remote (%d, %u/%u/%u)", e[0].status, e[0].ranks_own,
            e[0].ranks_replica, e[0].ranks_remote);
    free(e);
    ckpt_snapshot *s = NULL;
    char why[512] = "";
    T_CHECK(ckpt_mem_snapshot_open(&s, prefix, id, why, sizeof why) == -ENOENT && !s, "local open: -ENOENT");
    int rc = ckpt_mem_snapshot_open_ex(&s, prefix, id, &rm, 1, why, sizeof why);
    T_REQUIRE(rc == 0, "open with the remote: %d %s", rc, why);
    T_CHECK(ckpt_mem_snapshot_remotes(s) == 2 && ckpt_mem_snapshot_source(s, 3) == CKPT_MEM_SRC_REMOTE &&
                ckpt_mem_snapshot_source(s, 0) == CKPT_MEM_SRC_OWN, "sources");
    T_CHECK(ckpt_mem_snapshot_remote_name(s, 0) == NULL && ckpt_mem_snapshot_remote_name(s, 2) &&
                !strcmp(ckpt_mem_snapshot_remote_name(s, 2), "fake remote"), "remote names");
    T_CHECK(!strcmp(ckpt_mem_source_name(CKPT_MEM_SRC_REMOTE), "peer"), "source name");
    f.reads = 0;
    check_reshard(s, 3); /* re-sharded to 3: ranges across the local and the remote slots */
    check_reshard(s, 1);
    T_CHECK(f.reads > 0, "reads went through the remote (%d)", f.reads);
    T_CHECK(ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL) == 0, "verify: %s", why);
    /* a flipped byte on the way: the chunk checksum finds it, naming the remote's slot */
    f.flip = 1;
    uint8_t *dst = malloc(totals[0]);
    char bad[512] = "";
    rc = ckpt_snapshot_read(s, "params", 0, totals[0], dst, bad, sizeof bad);
    T_CHECK(rc == -EBADMSG && strstr(bad, "fake remote"), "flipped on a remote: %d %s", rc, bad);
    f.flip = 0;
    f.stale = 1;
    rc = ckpt_snapshot_read(s, "params", 0, totals[0], dst, bad, sizeof bad);
    T_CHECK(rc == -ESTALE, "stale remote: %d %s", rc, bad);
    f.stale = 0;
    /* only the local ranges: no remote read */
    f.reads = 0;
    T_CHECK(ckpt_snapshot_read(s, "params", 0, 4096, dst, bad, sizeof bad) == 0 && f.reads == 0,
            "rank 0's range reads no remote (%d)", f.reads);
    ckpt_snapshot_close(s);
    free(dst);
    /* a remote that cannot list: skipped, the snapshot is not complete */
    f.fail_list = 1;
    T_CHECK(ckpt_mem_snapshot_open_ex(&s, prefix, id, &rm, 1, why, sizeof why) == -ENOENT, "remote down");
    f.fail_list = 0;
    /* remotes only (no local path): ranks 0, 1 missing */
    T_CHECK(ckpt_mem_snapshot_open_ex(&s, NULL, id, &rm, 1, why, sizeof why) == -ENOENT, "remote only: %s", why);
    ckpt_mem_remote nofn = {"x", &f, NULL, fake_read};
    T_CHECK(ckpt_mem_snapshot_open_ex(&s, prefix, id, &nofn, 1, why, sizeof why) == -EINVAL, "no list fn");
    T_CHECK(ckpt_mem_list_ex(prefix, &nofn, 1, &e, &n) == -EINVAL, "no list fn (list)");
    T_REQUIRE(rename(a2, own2) == 0 && rename(a3, own3) == 0, "move back");
    t_rmrf(away);
    free(away);
    free(own2);
    free(own3);
    free(a2);
    free(a3);
}

/* The two-phase write (ckpt_mem_begin, the caller's copy, ckpt_mem_commit): W ranks' slots
 * of a step read back re-sharded exactly as ckpt_mem_write's; a slot begun and not committed
 * is never listed; commit refuses a slot not begun, a layout not begin's and a record that
 * does not fit (the slot stays writing and commits once given one that fits). */
static void test_two_phase(void)
{
    char prefix3[4200];
    snprintf(prefix3, sizeof prefix3, "%s/ckptmem-twophase", dir);
    shmseg *ts[W];
    for (uint32_t r = 0; r < W; r++) {
        char p[4200];
        T_REQUIRE(shmseg_own_path(p, sizeof p, prefix3, r) == 0, "name");
        T_REQUIRE(shmseg_create(p, 2, slot_bytes, &ts[r]) == 0, "create %s", p);
    }
    make_whole(80);
    const char *trainer = "{\"step\":80}";
    ckpt_buffer staged[W][NB];
    int slot[W];
    for (uint32_t r = 0; r < W; r++) {
        ckpt_buffer bufs[NB];
        for (int b = 0; b < NB; b++) {
            uint64_t off, bytes;
            shard(b, r, W, &off, &bytes);
            bufs[b] = (ckpt_buffer){names[b], dtypes[b], elems[b], totals[b], off, bytes, NULL};
        }
        T_REQUIRE(ckpt_mem_begin(ts[r], -1, bufs, NB, CB, &slot[r], staged[r]) == 0, "begin rank %u", r);
        uint8_t *pay = shmseg_payload(ts[r], slot[r]);
        shmseg_info in;
        T_CHECK(shmseg_slot_info(ts[r], slot[r], &in) == 0 && in.state == SHMSEG_WRITING, "begun: writing");
        for (int b = 0; b < NB; b++) {
            T_CHECK(staged[r][b].name == names[b] && staged[r][b].bytes == bufs[b].bytes, "staged %d", b);
            if (!bufs[b].bytes) {
                T_CHECK(staged[r][b].data == NULL, "empty shard: no data");
                continue;
            }
            uint8_t *d = (uint8_t *)(uintptr_t)staged[r][b].data;
            T_CHECK(d >= pay && d + bufs[b].bytes <= pay + slot_bytes && (uintptr_t)d % 4096 == 0,
                    "staged data in the slot, aligned");
            memcpy(d, whole[b] + bufs[b].offset, bufs[b].bytes); /* the caller's copy */
        }
    }
    /* begun, not committed: nothing listed */
    ckpt_mem_entry *e;
    size_t n;
    T_REQUIRE(ckpt_mem_list(prefix3, &e, &n) == 0, "list");
    T_CHECK(n == 0, "a begun slot is not listed (%zu entries)", n);
    free(e);
    /* ranks 0 and 1 give the checksums computed ahead (shard by shard, as a copy stream's
     * callback does), ranks 2 and 3 let the commit hash: every chunk read below checks them */
    for (uint32_t r = 0; r < W; r++) {
        uint64_t ns = ckpt_mem_sum_count(staged[r], NB, CB), *sums = calloc(ns + 1, sizeof *sums);
        T_REQUIRE(ns > NB && sums, "sum count %llu", (unsigned long long)ns);
        for (size_t b = 0; r < 2 && b < NB; b++)
            T_CHECK(ckpt_mem_sum_buffer(staged[r], NB, b, CB, sums) == 0, "sums of shard %zu", b);
        int rc = ckpt_mem_commit(ts[r], slot[r], 80, "run1", "cfg1", "tagA", W, r, staged[r], NB, trainer, CB,
                                 r < 2 ? sums : NULL);
        T_CHECK(rc == 0, "commit rank %u: %d", r, rc);
        free(sums);
    }
    T_CHECK(ckpt_mem_sum_count(staged[0], NB, 100) == 0, "sum count: bad chunk bytes");
    uint64_t one[4];
    T_CHECK(ckpt_mem_sum_buffer(staged[0], NB, NB, CB, one) == -EINVAL, "sum_buffer: no such shard");
    T_REQUIRE(ckpt_mem_list(prefix3, &e, &n) == 0, "list");
    T_CHECK(n == 1 && e[0].status == CKPT_MEM_COMPLETE && e[0].step == 80 && e[0].ranks_present == W,
            "step 80 complete (%zu entries)", n);
    free(e);
    ckpt_snapshot *sn;
    char why[512];
    T_REQUIRE(ckpt_mem_snapshot_open(&sn, prefix3, "mem:run1/tagA/80/4", why, sizeof why) == 0, "open: %s", why);
    T_CHECK(!strcmp(ckpt_snapshot_trainer_json(sn), trainer), "trainer record");
    check_reshard(sn, 3);
    check_reshard(sn, 2);
    ckpt_snapshot_close(sn);
    /* committed already: refused */
    T_CHECK(ckpt_mem_commit(ts[0], slot[0], 80, "run1", "cfg1", "tagA", W, 0, staged[0], NB, trainer, CB, NULL) == -EINVAL,
            "second commit");
    /* rank 0 begins step 90 and copies half of it: step 80 stays the newest */
    make_whole(90);
    ckpt_buffer b90[NB];
    int s90;
    ckpt_buffer probe[NB];
    for (int b = 0; b < NB; b++) {
        uint64_t off, bytes;
        shard(b, 0, W, &off, &bytes);
        probe[b] = (ckpt_buffer){names[b], dtypes[b], elems[b], totals[b], off, bytes, NULL};
    }
    T_REQUIRE(ckpt_mem_begin(ts[0], slot[0], probe, NB, CB, &s90, b90) == 0 && s90 != slot[0], "begin 90");
    memcpy((void *)(uintptr_t)b90[0].data, whole[0] + b90[0].offset, b90[0].bytes / 2);
    T_REQUIRE(ckpt_mem_list(prefix3, &e, &n) == 0, "list");
    T_CHECK(n == 1 && e[0].step == 80 && e[0].status == CKPT_MEM_COMPLETE, "80 still the newest");
    free(e);
    for (int b = 0; b < NB; b++)
        if (b90[b].bytes) memcpy((void *)(uintptr_t)b90[b].data, whole[b] + b90[b].offset, b90[b].bytes);
    /* a layout that is not begin's, a slot out of range, a record that does not fit */
    ckpt_buffer moved[NB];
    memcpy(moved, b90, sizeof moved);
    moved[1].data = (const uint8_t *)moved[1].data + 4096;
    T_CHECK(ckpt_mem_commit(ts[0], s90, 90, "run1", "cfg1", "tagA", W, 0, moved, NB, "{}", CB, NULL) == -EINVAL,
            "moved shard");
    T_CHECK(ckpt_mem_commit(ts[0], 2, 90, "run1", "cfg1", "tagA", W, 0, b90, NB, "{}", CB, NULL) == -EINVAL, "slot 2");
    T_CHECK(ckpt_mem_commit(ts[0], s90, 90, "bad id!", "cfg1", "tagA", W, 0, b90, NB, "{}", CB, NULL) == -EINVAL,
            "bad run id");
    size_t big = (size_t)slot_bytes;
    char *rec = malloc(big + 16);
    memcpy(rec, "{\"k\":\"", 6);
    memset(rec + 6, 'x', big - 6);
    memcpy(rec + big, "\"}", 3);
    T_CHECK(ckpt_mem_commit(ts[0], s90, 90, "run1", "cfg1", "tagA", W, 0, b90, NB, rec, CB, NULL) == -ENOSPC,
            "record too large");
    free(rec);
    shmseg_info in;
    T_CHECK(shmseg_slot_info(ts[0], s90, &in) == 0 && in.state == SHMSEG_WRITING, "still writing");
    T_CHECK(ckpt_mem_commit(ts[0], s90, 90, "run1", "cfg1", "tagA", W, 0, b90, NB, "{\"step\":90}", CB, NULL) == 0,
            "commit 90");
    T_REQUIRE(ckpt_mem_list(prefix3, &e, &n) == 0, "list");
    int partial90 = 0, complete80 = 0;
    for (size_t i = 0; i < n; i++) {
        partial90 |= e[i].step == 90 && e[i].status == CKPT_MEM_PARTIAL && e[i].ranks_present == 1;
        complete80 |= e[i].step == 80 && e[i].status == CKPT_MEM_COMPLETE;
    }
    T_CHECK(partial90 && complete80, "90 partial (rank 0 only), 80 complete");
    free(e);
    /* begin's own checks */
    int sl;
    ckpt_buffer out[NB];
    T_CHECK(ckpt_mem_begin(ts[1], -1, probe, NB, CB, &sl, NULL) == -EINVAL, "no staged_out");
    T_CHECK(ckpt_mem_begin(ts[1], -1, probe, NB, 100, &sl, out) == -EINVAL && sl == -1, "bad chunk bytes");
    char *p = seg_path("small2");
    shmseg *sm;
    T_REQUIRE(shmseg_create(p, 2, 4096, &sm) == 0, "small");
    T_CHECK(ckpt_mem_begin(sm, -1, probe, NB, CB, &sl, out) == -ENOSPC, "shards exceed the slot");
    T_CHECK(shmseg_slot_info(sm, 0, &in) == 0 && in.state == SHMSEG_EMPTY, "nothing touched");
    shmseg_close(sm);
    unlink(p);
    free(p);
    for (uint32_t r = 0; r < W; r++) shmseg_close(ts[r]);
}

int main(void)
{
    /* only the child of test_crash_mid_copy writes step 999 (the value is read once) */
    setenv("CKPT_FAULT_POINT", "mid-mem-copy@999", 1);
    dir = t_tmpdir("ckpt-mem");
    prefix = t_path_in(dir, "ckptmem-0123456789abcdef-fedcba9876543210");
    /* names under the prefix that are not segments are skipped */
    char *lease = seg_path("lease"), *junk = seg_path("own-x");
    T_REQUIRE(t_spit(lease, "", 0) == 0 && t_spit(junk, "garbage", 7) == 0, "decoys");
    test_prefix_rule();
    test_write_list_open();
    test_flipped_byte();
    test_crash_mid_copy();
    test_corrupt_header_and_replica();
    test_flush();
    test_stale();
    test_hostile_headers();
    test_remote();
    test_two_phase();
    for (int r = 0; r < W; r++) shmseg_close(segs[r]);
    for (int b = 0; b < NB; b++) free(whole[b]);
    free(lease);
    free(junk);
    t_rmrf(dir);
    free(prefix);
    free(dir);
    return t_done("test_ckpt_mem");
}
