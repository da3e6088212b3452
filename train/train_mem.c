/* train_mem.c - the memory tier of the train program: the budget check, this rank's own
 * shared-memory segment, memory snapshots, and the flush mode (see train_internal.h and
 * docs/OPERATIONS.md, "Memory tier").
 *
 * Why the pieces sit where they do:
 * - The tier is on or off for the whole group (train_mem_plan agrees on it): a memory snapshot
 *   needs the same collectives as a disk one (the moments digest, at ZeRO-3 the parameter
 *   gather), so every rank takes it at the same steps, also a rank whose segment could not be
 *   created (it then skips only the local copy).
 * - The own segment is created after the resume (train_mem_open): creating it with another
 *   layout (another world size) clears its slots, which may hold the snapshot being restored.
 * - A memory snapshot never changes the training bits: it only reads the state (DESIGN 4). */
#include "ckpt.h"
#include "ckpt_mem.h"
#include "clock.h"
#include "log.h"
#include "shmseg.h"
#include "stage.h"
#include "train_internal.h"

#include <jansson.h>

#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define TAG "train"

/* Slots of this rank's own segment. Sync mode wants three: a disk persist reads its step's
 * slot for as long as it lasts (several steps), and the memory snapshots meanwhile alternate
 * between the other two, so that a rank killed in the middle of one still has the step
 * before it in memory (with two, each of them rewrote the one other slot, and a kill then
 * left only the persisted step). Async mode persists from the engine's own buffers, never
 * from a slot: two. */
static int own_slots_wanted(const state *s)
{
    return s->mem_async ? SHMSEG_MIN_SLOTS : SHMSEG_MAX_SLOTS;
}

/* Bytes per node of the memory tier with own segments of `nslots` slots of slot_bytes for
 * each of local_world ranks, and as many replicas of a peer node's segments (SHMSEG_REPLICA_SLOTS,
 * two: elastic/agent_mem.c) when there are several nodes; 0 when a segment would be invalid. */
static uint64_t node_bytes(int nslots, uint64_t slot_bytes, int local_world, int nodes)
{
    const uint64_t own = shmseg_file_bytes(nslots, slot_bytes);
    const uint64_t rep = nodes > 1 ? shmseg_file_bytes(SHMSEG_REPLICA_SLOTS, slot_bytes) : 0;
    if (!own || (nodes > 1 && !rep)) return 0;
    return (uint64_t)local_world * (own + rep);
}

/* An upper bound of the trainer record's length (train_snapshot.c, trainer_record): a fixed
 * part of well under 2 KiB plus one entry per tensor (name, shape, offset, decay), rounded up
 * to whole pages so that the slot layout of a given model never changes between restarts. */
static uint64_t trainer_len_max(const state *s)
{
    size_t nt = 0;
    (void)train_model_tensors(s->model, &nt);
    uint64_t n = 4096u + 256u * (uint64_t)nt;
    return (n + 4095u) & ~(uint64_t)4095u;
}

/* "1.5 GiB"-style text of n bytes. */
static void human_bytes(uint64_t n, char *out, size_t len)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double x = (double)n;
    int k = 0;
    while (x >= 1024.0 && k < 4) {
        x /= 1024.0;
        k++;
    }
    snprintf(out, len, k ? "%.1f %s" : "%.0f %s", x, u[k]);
}

/* Bytes held in dir by this node's segments under the prefix's file name part base:
 * "<base>.own-<L>" (each local rank's, reused in place by the next round) and
 * "<base>.rep-<agent16>-<L>" (the agent's replicas, reused in place too; the agent's room_for counts
 * them alike). The default budget counts them as available: otherwise the tier, on after the
 * first start, measured its own segments as used and switched itself off after a restart. */
static uint64_t own_files_bytes(const char *dir, const char *base)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    const size_t bl = strlen(base);
    uint64_t sum = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        if (strncmp(n, base, bl) != 0 || n[bl] != '.') continue;
        const char *k = n + bl + 1;
        size_t dig;
        if (!strncmp(k, "own-", 4)) {
            dig = strspn(k + 4, "0123456789");
            if (!dig || k[4 + dig]) continue;
        } else if (!strncmp(k, "rep-", 4)) {
            dig = strspn(k + 4, "0123456789abcdef"); /* the sending agent's id (or a node rank) */
            const char *l = k + 4 + dig;
            if (!dig || *l != '-' || !l[1] || l[1 + strspn(l + 1, "0123456789")]) continue;
        } else {
            continue;
        }
        struct stat st;
        if (fstatat(dirfd(d), n, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
            st.st_uid == geteuid())
            sum += (uint64_t)st.st_blocks * 512u; /* what it occupies (fallocated: its size) */
    }
    closedir(d);
    return sum;
}

static int env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    char *end;
    if (!v || !*v) return dflt;
    long x = strtol(v, &end, 10);
    return *end || x < 0 || x > 1 << 20 ? dflt : (int)x;
}

/* The three buffers of this rank's shard, as train_take_snapshot saves them; data NULL when
 * only the sizes are needed. shard_el: the elements of the shard. */
static void shard_buffers(const state *s, size_t shard_el, ckpt_buffer bufs[3])
{
    const uint64_t total = (uint64_t)s->np * sizeof(float), sb = (uint64_t)shard_el * sizeof(float);
    const char *names[3] = {"params", "adam_m", "adam_v"};
    for (int i = 0; i < 3; i++)
        bufs[i] = (ckpt_buffer){names[i], "f32", 4, total, (uint64_t)s->lo * sizeof(float), sb, NULL};
}

int train_mem_plan(state *s)
{
    const options *o = s->o;
    s->mem_every = 0;
    s->mem_persist_slot = -1;
    s->mem_nslots = 0;
    /* the same on every rank (the two modes run the digests' collective at different
     * points): the option and the device kind are among the settings every rank agrees on at
     * start */
    s->mem_async = o->mem_async >= 0 ? o->mem_async : train_device_kind_of(s->dev) != TRAIN_DEVICE_CPU;
    const char *path = getenv("CKPT_MEM_PATH");
    s->mem_path = path && *path ? path : NULL;
    /* this rank's view: want = 1 the tier fits here, status = 2 an explicit budget too small */
    int32_t mine[2] = {0, 0};
    const uint64_t total = (uint64_t)s->np * sizeof(float);
    const ckpt_buffer whole[3] = {{"params", "f32", 4, total, 0, total, NULL},
                                  {"adam_m", "f32", 4, total, 0, total, NULL},
                                  {"adam_v", "f32", 4, total, 0, total, NULL}};
    s->mem_chunk = ckpt_fit_chunk_bytes(o->chunk_bytes, whole, 3, (uint32_t)s->world);
    if (!s->mem_path) {
        if (s->rank == 0)
            LOG_I(TAG, "no memory tier: CKPT_MEM_PATH is not set (elastic sets it)%s",
                  o->mem_every > 0 || o->mem_budget ? "; --mem-snapshot-every and --mem-budget "
                  "are ignored" : "");
    } else if (!ckpt_mem_prefix_ok(s->mem_path)) {
        /* the reader's rule (ckpt_mem_list): a prefix it refuses would give segments that are
         * never listed nor restored, nor removed by the agent */
        if (env_int("LOCAL_RANK", s->rank) == 0)
            LOG_E(TAG, "CKPT_MEM_PATH '%.200s%s' is not a usable memory tier prefix: it needs a file "
                  "name part after its last '/' and fewer than %d bytes (elastic sets it to "
                  "<mem-dir>/ckptmem-...)", s->mem_path, strlen(s->mem_path) > 200 ? "..." : "",
                  CKPT_PATH_MAX - 64);
        mine[1] = 2;
    } else if (o->mem_every == 0) {
        if (s->rank == 0) LOG_I(TAG, "memory tier off: --mem-snapshot-every 0");
    } else if (s->mem_chunk == 0) {
        if (s->rank == 0) LOG_W(TAG, "memory tier off: no chunk size fits this state");
    } else {
        /* the budget is per node: every local rank's segment, sized for the largest shard
         * (rank 0's: the first nb % W ranks hold one block more), so that every rank of the
         * group computes the same need */
        ckpt_buffer mx[3], own[3];
        shard_buffers(s, s->shard_el[0], mx);
        shard_buffers(s, s->hi - s->lo, own);
        const uint64_t tmax = trainer_len_max(s);
        const uint64_t slot_max = ckpt_mem_need(mx, 3, tmax, s->mem_chunk);
        s->mem_slot_bytes = ckpt_mem_need(own, 3, tmax, s->mem_chunk);
        /* torchrun-style launchers set both; by hand, every rank counts as one node's */
        int local_world = env_int("LOCAL_WORLD_SIZE", getenv("LOCAL_RANK") ? 1 : s->world);
        if (local_world < 1) local_world = 1;
        const int nodes = env_int("GROUP_WORLD_SIZE", 1);
        const int wanted = own_slots_wanted(s);
        const uint64_t need_wanted = node_bytes(wanted, slot_max, local_world, nodes);
        const uint64_t need = node_bytes(SHMSEG_MIN_SLOTS, slot_max, local_world, nodes);
        uint64_t budget = o->mem_budget;
        char dir[CKPT_PATH_MAX], base[CKPT_PATH_MAX], nb[32], bb[32], sb[32];
        snprintf(dir, sizeof dir, "%s", s->mem_path);
        snprintf(base, sizeof base, "%s", s->mem_path);
        const char *d = dirname(dir), *bn = basename(base);
        int fs_err = 0;
        if (!budget) {
            /* free space plus what this node's own segments and replicas already hold: they
             * are reused in place (an explicit --mem-budget is compared with the need alone,
             * the space measured nowhere, so it needs no such correction) */
            struct statvfs v;
            if (statvfs(d, &v) == 0)
                budget = ((uint64_t)v.f_bavail * (uint64_t)v.f_frsize + own_files_bytes(d, bn)) / 2u;
            else fs_err = errno;
        }
        human_bytes(need, nb, sizeof nb);
        human_bytes(budget, bb, sizeof bb);
        human_bytes(shmseg_file_bytes(SHMSEG_MIN_SLOTS, slot_max), sb, sizeof sb);
        /* the budget is the node's: its first local rank says why, once per node */
        const int speaks = env_int("LOCAL_RANK", s->rank) == 0;
        if (slot_max == 0 || s->mem_slot_bytes == 0 || need == 0 || need_wanted == 0) {
            if (speaks) LOG_W(TAG, "memory tier off: a slot of this state's shard would "
                              "exceed the format's limits");
        } else if (o->mem_budget && need > budget) {
            if (speaks) LOG_E(TAG, "--mem-budget %" PRIu64 " (%s) is too small for the memory tier: "
                  "it needs %" PRIu64 " bytes (%s) per node = %d local rank%s x %s (2 slots of the "
                  "state shard)%s; raise --mem-budget or pass --mem-snapshot-every 0",
                  budget, bb, need, nb, local_world, local_world == 1 ? "" : "s", sb,
                  nodes > 1 ? " x 2 (the peer node's replicas live here too)" : "");
            mine[1] = 2;
        } else if (fs_err) {
            LOG_W(TAG, "memory tier off: cannot read the free space of %s: %s",
                  d, strerror(fs_err));
        } else if (need > budget) {
            if (speaks) LOG_W(TAG, "memory tier off: it needs %s per node (%d local rank%s x %s%s), "
                  "more than the default budget of %s (half the free space of %s, this node's "
                  "segments counted as free); free memory "
                  "there or give --mem-budget", nb, local_world, local_world == 1 ? "" : "s",
                  sb, nodes > 1 ? " x 2 for the peer's replicas" : "", bb, d);
        } else {
            mine[0] = 1;
            s->mem_nslots = need_wanted <= budget ? wanted : SHMSEG_MIN_SLOTS;
            if (s->mem_nslots == wanted) human_bytes(need_wanted, nb, sizeof nb);
            if (s->rank == 0)
                LOG_I(TAG, "memory tier: a snapshot every %d step%s into %s.own-* (%d slots each), "
                      "%s per node of a budget of %s%s", o->mem_every > 0 ? o->mem_every : 1,
                      o->mem_every > 1 ? "s" : "", s->mem_path, s->mem_nslots, nb, bb,
                      o->mem_budget ? "" : " (half the free space)");
            if (s->mem_nslots < wanted && speaks) {
                char wb[32];
                human_bytes(need_wanted, wb, sizeof wb);
                LOG_W(TAG, "memory tier: two slots per segment, not three: three need %s per node, "
                      "more than the budget of %s; while a disk persist reads one slot, every "
                      "memory snapshot rewrites the other, so a rank killed during one of them "
                      "resumes from the persisted step (give --mem-budget %" PRIu64 " or more "
                      "for the third slot)", wb, bb, need_wanted);
            }
        }
    }
    int want = mine[0], status = mine[1];
    if (s->world > 1) {
        int32_t *all = calloc((size_t)s->world * 2, sizeof(int32_t));
        if (!all) return 1;
        memcpy(all + 2 * (size_t)s->rank, mine, sizeof mine);
        int rc = train_gather_records(s, all, sizeof mine);
        if (rc < 0) {
            train_comm_failed(s, "agreement on the memory tier", rc);
            free(all);
            return 1;
        }
        int off = 0;
        for (int r = 0; r < s->world; r++) {
            if (all[2 * r + 1] > status) status = all[2 * r + 1];
            if (!all[2 * r]) {
                if (want && s->rank == 0 && !off)
                    LOG_W(TAG, "memory tier off: rank %d cannot hold it (no CKPT_MEM_PATH there, "
                          "or see its line)", r);
                off |= !all[2 * r];
            }
        }
        if (off) want = 0;
        free(all);
    }
    if (status) return status;
    if (want) s->mem_every = o->mem_every > 0 ? o->mem_every : 1;
    s->stage_mem_slot = -1;
    if (want && s->rank == 0)
        LOG_I(TAG, "memory snapshots are %s", s->mem_async ?
              "asynchronous (copied while the next step computes, committed at its optimizer update)" :
              "synchronous (copied and committed before the next step)");
    return 0;
}

int train_mem_open(state *s)
{
    if (s->mem_every <= 0) return 0;
    /* LOCAL_RANK from the launcher; without it (ranks started by hand on one machine) the
     * rank itself, so that no two ranks share a segment */
    snprintf(s->mem_own, sizeof s->mem_own, "%s.own-%d", s->mem_path,
             env_int("LOCAL_RANK", s->rank));
    int rc = shmseg_create(s->mem_own, s->mem_nslots, s->mem_slot_bytes, &s->mem_seg);
    if (rc == -EBUSY) {
        LOG_W(TAG, "no memory snapshots on this rank: another process writes the segment %s (two "
              "workers with the same CKPT_MEM_PATH and LOCAL_RANK?); training goes on with disk "
              "snapshots only for this rank", s->mem_own);
        s->mem_seg = NULL;
        return rc;
    }
    if (rc < 0) {
        /* this rank keeps taking part in the snapshots' collectives (mem_every stays): only
         * its copy is missing, and a restore from memory then falls back to disk */
        LOG_W(TAG, "no memory snapshots on this rank: cannot create the segment %s "
              "(%" PRIu64 " bytes per slot): %s", s->mem_own, s->mem_slot_bytes,
              strerror(-rc));
        s->mem_seg = NULL;
        return rc;
    }
    /* asynchronous memory snapshots are copied from the device straight into the slots: pin
     * them once (the CPU device only checks the arguments); unpinned, the copies still work,
     * as staged pageable copies */
    if (s->mem_async) {
        int pr = 0, i;
        for (i = 0; i < shmseg_nslots(s->mem_seg) && pr == 0; i++)
            pr = train_host_register(s->dev, shmseg_payload(s->mem_seg, i), shmseg_slot_bytes(s->mem_seg));
        if (pr < 0) {
            while (--i > 0) (void)train_host_unregister(s->dev, shmseg_payload(s->mem_seg, i - 1));
            LOG_W(TAG, "registering the memory segment %s as pinned memory on %s failed: %s; its "
                  "copies from the device are not DMA", s->mem_own, train_device_describe(s->dev),
                  strerror(-pr));
        } else {
            s->mem_pinned = 1;
        }
    }
    /* the tag of this launch's memory snapshots: slots of one snapshot share it (ckpt_mem.h) */
    if (s->job_tag[0]) snprintf(s->mem_tag, sizeof s->mem_tag, "%s", s->job_tag);
    else snprintf(s->mem_tag, sizeof s->mem_tag, "j%016" PRIx64 "%08x",
                  (uint64_t)(clock_now_s() * 1e6), (unsigned)getpid());
    return 0;
}

void train_mem_close(state *s)
{
    if (s->mem_seg && s->mem_count && s->rank == 0)
        LOG_I(TAG, "memory snapshots: %" PRIu64 " taken, stall %.2f ms mean, %.2f ms max; %" PRIu64
              " failed", s->mem_count, s->mem_stall_sum / (double)s->mem_count * 1e3,
              s->mem_stall_max * 1e3, s->mem_failed);
    if (s->mem_pinned)
        for (int i = 0; i < shmseg_nslots(s->mem_seg); i++)
            (void)train_host_unregister(s->dev, shmseg_payload(s->mem_seg, i));
    s->mem_pinned = 0;
    free(s->mem_sums);
    s->mem_sums = NULL;
    shmseg_close(s->mem_seg);
    s->mem_seg = NULL;
}

/* The outcome of one memory snapshot (rc 0: slot committed): counted, logged (a failure
 * once until it recovers) and reported. Returns rc. */
static int mem_account(state *s, int rc, int slot, uint64_t bytes, double stall)
{
    if (rc < 0) {
        s->mem_failed++;
        if (!s->mem_failing)
            LOG_W(TAG, "step %" PRId64 ": memory snapshot into %s failed: %s; training "
                  "goes on (the previous complete slot stays; logged again when it recovers)",
                  s->step, s->mem_own, strerror(-rc));
        s->mem_failing = 1;
        train_report_mem_snapshot_failed(s->report, s->step, rc);
        return rc;
    }
    if (s->mem_failing)
        LOG_I(TAG, "step %" PRId64 ": memory snapshots work again", s->step);
    s->mem_failing = 0;
    s->mem_count++;
    s->mem_stall_sum += stall;
    if (stall > s->mem_stall_max) s->mem_stall_max = stall;
    if (s->mem_count == 1 && s->rank == 0)
        LOG_I(TAG, "memory snapshot step %" PRId64 " in slot %d of %s: stall %.2f ms for %.2f MiB",
              s->step, slot, s->mem_own, stall * 1e3, (double)bytes / 1048576.0);
    else
        LOG_D(TAG, "memory snapshot step %" PRId64 " in slot %d: stall %.2f ms", s->step, slot,
              stall * 1e3);
    train_report_mem_snapshot(s->report, s->step, stall, bytes, slot);
    return 0;
}

int train_mem_write(state *s, const ckpt_buffer bufs[3], const char *trainer_json, double t0,
                    ckpt_buffer staged[3], int *slot_out)
{
    *slot_out = -1;
    if (!s->mem_seg) return -ENODEV;
    /* the slot a persist still reads stays untouched (ckpt_engine_persist_staged) */
    if (s->mem_persist_slot >= 0 && (!s->engine || !ckpt_engine_busy(s->engine)))
        s->mem_persist_slot = -1;
    int slot = -1;
    int rc = ckpt_mem_write(s->mem_seg, s->mem_persist_slot, (uint64_t)s->step, s->run_id,
                            s->config_hash, s->mem_tag, (uint32_t)s->world, (uint32_t)s->rank, bufs,
                            3, trainer_json, s->mem_chunk, &slot, staged);
    rc = mem_account(s, rc, slot, bufs[0].bytes + bufs[1].bytes + bufs[2].bytes, clock_now_s() - t0);
    if (rc == 0) *slot_out = slot;
    return rc;
}

/* train_stream_host_fn: one shard's checksums, on the copy stream right after its copy. */
static void sum_shard(void *ctx)
{
    train_mem_sum_job *j = ctx;
    j->rc = ckpt_mem_sum_buffer(j->bufs, 3, j->index, j->chunk_bytes, j->sums);
}

int train_mem_begin(state *s, const ckpt_buffer dbufs[3])
{
    if (!s->mem_seg) return -ENODEV;
    if (!s->mem_sums) { /* the shard sizes, hence the count, are the run's */
        uint64_t n = ckpt_mem_sum_count(dbufs, 3, s->mem_chunk);
        if (n == 0 || !(s->mem_sums = calloc((size_t)n, sizeof *s->mem_sums)))
            return mem_account(s, n ? -ENOMEM : -EINVAL, -1, 0, 0);
    }
    /* no persist reads a slot in this mode (train_stage_snapshot): the older slot is taken */
    int slot = -1;
    ckpt_buffer *staged = s->stage_mem_bufs;
    int rc = ckpt_mem_begin(s->mem_seg, -1, dbufs, 3, s->mem_chunk, &slot, staged);
    if (rc < 0) return mem_account(s, rc, -1, 0, 0);
    train_stream *st = train_stager_stream(s->stager);
    for (size_t i = 0; i < 3 && rc == 0; i++) {
        uint64_t t; /* where the shard goes in the slot (writable: a ckpt_buffer's data is const) */
        rc = train_stager_copy(s->stager, (void *)(uintptr_t)staged[i].data, dbufs[i].data,
                               (size_t)staged[i].bytes, &t);
        s->stage_mem_jobs[i] = (train_mem_sum_job){staged, i, s->mem_chunk, s->mem_sums, -EINPROGRESS};
        if (rc == 0) rc = train_stream_host_fn(st, sum_shard, &s->stage_mem_jobs[i]);
    }
    if (rc < 0) /* no copy into the slot still runs: a failed queue waits for its stream */
        return train_mem_commit(s, slot, NULL, rc, 0);
    return slot;
}

int train_mem_commit(state *s, int slot, const char *trainer_json, int rc, double stall)
{
    double t0 = clock_now_s();
    const ckpt_buffer *staged = s->stage_mem_bufs;
    /* the checksums from the copy stream, unless one of them failed (then hashed here) */
    int sums_ok = 1;
    for (int i = 0; i < 3; i++) sums_ok &= s->stage_mem_jobs[i].rc == 0;
    if (rc == 0)
        rc = ckpt_mem_commit(s->mem_seg, slot, (uint64_t)s->step, s->run_id, s->config_hash,
                             s->mem_tag, (uint32_t)s->world, (uint32_t)s->rank, staged, 3,
                             trainer_json, s->mem_chunk, sums_ok ? s->mem_sums : NULL);
    return mem_account(s, rc, slot, staged[0].bytes + staged[1].bytes + staged[2].bytes,
                       stall + (clock_now_s() - t0));
}

int train_mem_take(state *s)
{
    if (s->mem_async && s->stager) return train_stage_snapshot(s, 0);
    double t0 = clock_now_s();
    ckpt_buffer bufs[3];
    char *text = NULL;
    int rc = train_snapshot_prepare(s, bufs, &text);
    if (rc < 0) return rc;
    int slot;
    (void)train_mem_write(s, bufs, text, t0, NULL, &slot); /* logged; not fatal */
    free(text);
    return 0;
}

/* What the flush checks each candidate against: this job's flags, data and model size. */
typedef struct flush_job {
    const options *o;
    char data_hash[17];
    size_t np;
} flush_job;

static const ckpt_buffer *find_buffer(const ckpt_buffer *bufs, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(bufs[i].name, name)) return &bufs[i];
    return NULL;
}

/* ckpt_mem_check_fn: what load_part and load_snapshot check of a restore (the record by
 * train_record_check, then the digests over the whole buffers), so that the flush never
 * commits a snapshot that the restore then rejects and sets aside. */
static int flush_check(void *ctx, ckpt_snapshot *snap, const ckpt_buffer *bufs, size_t nbufs, char *why,
                       size_t why_len)
{
    const flush_job *j = ctx;
    json_error_t jerr;
    json_t *tr = json_loads(ckpt_snapshot_trainer_json(snap), 0, &jerr);
    if (!tr && (json_error_code(&jerr) == json_error_out_of_memory || !jerr.text[0])) {
        snprintf(why, why_len, "out of memory parsing the trainer record");
        return -ENOMEM;
    }
    train_record rec;
    int rc = train_record_check(j->o, j->data_hash, j->np, snap, tr, &rec, why, why_len);
    const ckpt_buffer *p = find_buffer(bufs, nbufs, "params"), *m = find_buffer(bufs, nbufs, "adam_m"),
                      *v = find_buffer(bufs, nbufs, "adam_v");
    if (rc == 0 && (!p || !m || !v || p->bytes != j->np * sizeof(float) || m->bytes != p->bytes ||
                    v->bytes != p->bytes)) {
        snprintf(why, why_len, "state buffers missing or of the wrong size");
        rc = -EINVAL;
    }
    if (rc == 0) {
        char got[33];
        train_digest_hex(p->data, j->np, got);
        if (strcmp(got, rec.params_digest) != 0) {
            snprintf(why, why_len, "params digest %s differs from the recorded %s", got, rec.params_digest);
            rc = -EBADMSG;
        }
    }
    if (rc == 0 && rec.adam_m_digest) {
        uint64_t md[2];
        train_moments_digest_whole(m->data, v->data, j->np, md);
        const char *want[2] = {rec.adam_m_digest, rec.adam_v_digest};
        for (int k = 0; k < 2 && rc == 0; k++) {
            char have[17];
            snprintf(have, sizeof have, "%016" PRIx64, md[k]);
            if (strcmp(want[k], have) != 0) {
                snprintf(why, why_len, "%s digest %s differs from the recorded %s", k ? "adam_v" : "adam_m",
                         have, want[k]);
                rc = -EBADMSG;
            }
        }
    }
    json_decref(tr);
    return rc;
}

int train_mem_flush_main(const options *o)
{
    const char *path = getenv("CKPT_MEM_PATH");
    if (!path || !*path) {
        LOG_E(TAG, "flush (CKPT_MEM_FLUSH=1): CKPT_MEM_PATH is not set: no memory tier to flush");
        return 2;
    }
    if (!ckpt_mem_prefix_ok(path)) {
        LOG_E(TAG, "flush (CKPT_MEM_FLUSH=1): CKPT_MEM_PATH '%.200s%s' is not a usable memory tier "
              "prefix: it needs a file name part after its last '/' and fewer than %d bytes", path,
              strlen(path) > 200 ? "..." : "", CKPT_PATH_MAX - 64);
        return 2;
    }
    if (!o->ckpt_dir) {
        LOG_I(TAG, "flush of %s: nothing to do (no --ckpt-dir to flush into)", path);
        return 0;
    }
    ckpt_save_opts so = CKPT_SAVE_OPTS_INIT;
    so.dir = o->ckpt_dir;
    so.chunk_bytes = o->chunk_bytes;
    so.zstd_level = o->zstd_level;
    so.filter = o->filter;
    so.direct_io = o->direct_io;
    /* the folder's lock names this job while the flush writes, as the ranks' does
     * (train_startup_local): a new round's rank 0 waits for it rather than exiting 2 */
    const char *job_id = getenv("ELASTIC_RUN_ID");
    if (job_id && *job_id && strlen(job_id) <= 64 &&
        strspn(job_id, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-") ==
            strlen(job_id))
        so.lock_owner = job_id;
    double t0 = clock_now_s();
    char why[600] = "";
    /* the job's data hash and model size, for the checks a restore makes (flush_check) */
    flush_job job = {.o = o};
    train_dataset *ds = NULL;
    train_model *model = NULL;
    int orc = train_dataset_open(&ds, o->data, o->model.seq_len, o->model.vocab, why, sizeof why);
    if (orc < 0) {
        LOG_E(TAG, "flush of %s: training data: %s", path, why);
        return train_input_status(orc);
    }
    snprintf(job.data_hash, sizeof job.data_hash, "%016" PRIx64, train_dataset_hash(ds));
    train_dataset_close(ds);
    if ((orc = train_model_create(&model, &o->model, o->micro_batch)) < 0) {
        LOG_E(TAG, "flush of %s: cannot create the model: %s", path, strerror(-orc));
        return 1;
    }
    job.np = train_model_num_params(model);
    train_model_free(model);
    int64_t rc = ckpt_mem_flush_checked(path, o->ckpt_dir, &so, o->run_id, flush_check, &job, why, sizeof why);
    double dt = clock_now_s() - t0;
    if (rc < 0) {
        LOG_E(TAG, "flush of %s into %s failed: %s", path, o->ckpt_dir,
              why[0] ? why : strerror((int)-rc));
        return 1;
    }
    if (rc == 0)
        LOG_I(TAG, "flush of %s: nothing to do (%s)", path,
              why[0] ? why : "no memory snapshot newer than the newest one in --ckpt-dir");
    else
        LOG_I(TAG, "flushed the memory snapshot of step %" PRId64 " from %s into %s in %.0f ms", rc,
              path, o->ckpt_dir, dt * 1e3);
    return 0;
}
