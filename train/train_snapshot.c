/* train_snapshot.c - digests, the trainer record and the snapshot engine of the train program
 * (see train_internal.h). */
#include "clock.h"
#include "ckpt.h"
#include "comm.h"
#include "log.h"
#include "model.h"
#include "stage.h"
#include "train_internal.h"
#include "vote.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define TAG "train"

void train_digest_hex(const float *p, size_t n, char out[33])
{
    XXH128_hash_t h = XXH3_128bits(p, n * sizeof(float));
    snprintf(out, 33, "%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
}

/* Digest of x[lo, hi) (whole TRAIN_BLOCK blocks; x points at element lo) that does not depend
 * on how the flat space is split over ranks: the sum, mod 2^64, of XXH3-64 of each block
 * seeded with the block's index. Ranks add their parts (block_digest_sum); the total is that
 * of the whole buffer. Used for the Adam moments, which no other digest covers as a whole: a
 * shard restored at the wrong offset passes every chunk checksum but not this. */
static uint64_t block_digest(const float *x, size_t lo, size_t hi)
{
    uint64_t sum = 0;
    for (size_t b = lo; b < hi; b += TRAIN_BLOCK)
        sum += XXH3_64bits_withSeed(x + (b - lo), TRAIN_BLOCK * sizeof(float), b / TRAIN_BLOCK);
    return sum;
}

/* This rank's parts of the digests of adam_m and adam_v over its shard [lo, hi), summed over
 * all ranks (collective when W > 1). Returns 0 or the collective's error. */
void train_moments_digest_whole(const float *m, const float *v, size_t np, uint64_t out[2])
{
    out[0] = block_digest(m, 0, np);
    out[1] = block_digest(v, 0, np);
}

void train_moments_digest_local(const float *m, const float *v, size_t lo, size_t hi, size_t olo,
                                uint64_t out[2])
{
    out[0] = block_digest(m + (lo - olo), lo, hi);
    out[1] = block_digest(v + (lo - olo), lo, hi);
}

int train_moments_digest(state *s, uint64_t out[2])
{
    uint64_t mine[2];
    train_moments_digest_local(s->m, s->v, s->lo, s->hi, s->olo, mine);
    return train_moments_digest_sum(s, mine, out);
}

int train_moments_digest_sum(state *s, const uint64_t mine[2], uint64_t out[2])
{
    if (s->world == 1) {
        out[0] = mine[0];
        out[1] = mine[1];
        return 0;
    }
    uint64_t *all = calloc((size_t)s->world * 2, sizeof(uint64_t));
    if (!all) return -ENOMEM;
    memcpy(all + 2 * (size_t)s->rank, mine, 2 * sizeof(uint64_t));
    int rc = train_gather_records(s, all, 2 * sizeof(uint64_t));
    if (rc < 0) train_comm_failed(s, "all-gather of the moments digest", rc);
    out[0] = out[1] = 0;
    for (int r = 0; r < s->world && rc == 0; r++) {
        out[0] += all[2 * (size_t)r];
        out[1] += all[2 * (size_t)r + 1];
    }
    free(all);
    return rc;
}

void train_make_config_hash(const state *s, char out[17])
{
    const options *o = s->o;
    char buf[512];
    int n = snprintf(buf, sizeof buf,
                     "vocab=%d;seq_len=%d;n_layer=%d;n_embd=%d;n_head=%d;seed=%" PRIu64
                     ";global_batch=%d",
                     o->model.vocab, o->model.seq_len, o->model.n_layer, o->model.n_embd,
                     o->model.n_head, o->seed, s->global_batch);
    /* the dtype only for bf16, so that the hash of an fp32 run is what it always was */
    if (o->bf16 && n > 0 && (size_t)n < sizeof buf)
        n += snprintf(buf + n, sizeof buf - (size_t)n, ";dtype=bf16");
    uint64_t h = XXH3_64bits(buf, (size_t)n);
    snprintf(out, 17, "%016" PRIx64, h);
}

/* The shortest decimal that reads back as the same float: 0.9f is recorded as 0.9, not as
 * 0.8999999761581421. */
double train_f2d(float f)
{
    char buf[32] = "0";
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if ((float)strtod(buf, NULL) == f) break;
    }
    return strtod(buf, NULL);
}

/* The record's digests: params_digest (hex, 32 digits) and s->moments_digest. */
static int record_set_digests(state *s, json_t *rec, const char *digest)
{
    char mdig[17], vdig[17];
    snprintf(mdig, sizeof mdig, "%016" PRIx64, s->moments_digest[0]);
    snprintf(vdig, sizeof vdig, "%016" PRIx64, s->moments_digest[1]);
    if (json_object_set_new(rec, "params_digest", json_string(digest)) < 0 ||
        json_object_set_new(rec, "moments_digest",
                            json_pack("{s:s, s:s}", "adam_m", mdig, "adam_v", vdig)) < 0)
        return -ENOMEM;
    return 0;
}

/* The trainer record of the current state; with digests = 0 its digest fields are left for
 * record_set_digests (a snapshot staged from the device: they are computed after the
 * copies, off the stall). */
static json_t *trainer_record(state *s, int digests)
{
    const options *o = s->o;
    size_t nt;
    const train_tensor *t = train_model_tensors(s->model, &nt);
    json_t *tensors = json_array();
    for (size_t i = 0; i < nt; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < t[i].ndim; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
        json_array_append_new(tensors, json_pack("{s:s, s:o, s:I, s:b}", "name", t[i].name, "shape",
                                                 shape, "offset", (json_int_t)t[i].offset, "decay",
                                                 t[i].decay));
    }
    char digest[33] = "", dhash[17], mdig[17] = "", vdig[17] = "";
    if (digests) {
        train_digest_hex(s->params_host, train_model_num_params(s->model), digest);
        snprintf(mdig, sizeof mdig, "%016" PRIx64, s->moments_digest[0]);
        snprintf(vdig, sizeof vdig, "%016" PRIx64, s->moments_digest[1]);
    }
    snprintf(dhash, sizeof dhash, "%016" PRIx64, train_dataset_hash(s->train));
    uint64_t n = train_dataset_num_samples(s->train);
    json_t *rec = json_pack(
        "{s:I, s:{s:i, s:i, s:i, s:i, s:i}, s:s, s:o, s:i, "
        "s:{s:s, s:f, s:f, s:i, s:i, s:f, s:f, s:f, s:f, s:f, s:I}, "
        "s:{s:i, s:i, s:i, s:i, s:i}, s:{s:I, s:I, s:I, s:I, s:I, s:s, s:i}, s:s, s:f, "
        "s:{s:s, s:s}}",
        "step", (json_int_t)s->step, "model", "vocab", o->model.vocab, "seq_len", o->model.seq_len,
        "n_layer", o->model.n_layer, "n_embd", o->model.n_embd, "n_head", o->model.n_head,
        "tensor_buffer", "params", "tensors", tensors, "num_params",
        (int)train_model_num_params(s->model), "optimizer", "type", "adamw", "lr", train_f2d(o->adam.lr),
        "min_lr_ratio", train_f2d(o->adam.min_lr_ratio), "warmup", o->adam.warmup, "total_steps",
        o->adam.total_steps, "beta1", train_f2d(o->adam.beta1), "beta2", train_f2d(o->adam.beta2), "eps",
        train_f2d(o->adam.eps), "weight_decay", train_f2d(o->adam.weight_decay), "grad_clip",
        train_f2d(o->adam.grad_clip), "t", (json_int_t)s->step, "batch", "micro_batch", o->micro_batch,
        "grad_accum", s->grad_accum, "world_size", s->world, "global_batch", s->global_batch,
        "zero_stage", o->zero_stage,
        "data", "samples_consumed", (json_int_t)s->samples, "epoch", (json_int_t)(s->samples / n),
        "offset_in_epoch", (json_int_t)(s->samples % n), "seed", (json_int_t)o->seed, "num_samples",
        (json_int_t)n, "data_hash", dhash, "files", (int)train_dataset_num_files(s->train),
        "params_digest", digest, "loss", s->last_loss, "moments_digest", "adam_m", mdig, "adam_v",
        vdig);
    /* the compute dtype of the run; the buffers are fp32 either way (master state) */
    if (rec && json_object_set_new(rec, "dtype", json_string(o->bf16 ? "bf16" : "fp32")) < 0) {
        json_decref(rec);
        return NULL;
    }
    return rec;
}

/* Resident memory of this process in KiB (VmRSS), or -1. */
static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) {
            kib = strtol(line + 6, NULL, 10);
            break;
        }
    fclose(f);
    return kib;
}

/* Wait for the persist in flight (at most timeout_s). In a group, check every half second
 * that no peer died meanwhile: a dead rank means no commit decision will ever come, so the
 * vote channel is shut (the persist fails at once) and -ECONNRESET returned. */
int train_wait_engine(state *s, double timeout_s)
{
    /* a snapshot staged from the device waits for its record: complete it first */
    int crc = train_wait_stage_copies(s);
    if (crc == -ECONNRESET || crc == -EPIPE) return -ECONNRESET;
    double end = clock_now_s() + timeout_s;
    for (;;) {
        double left = end - clock_now_s();
        if (s->world == 1) return ckpt_engine_wait(s->engine, left > 0 ? left : 0);
        int rc = ckpt_engine_wait(s->engine, left < 0.5 ? (left > 0 ? left : 0) : 0.5);
        if (rc != -EINPROGRESS || left <= 0.5) return rc;
        if ((rc = train_comm_probe(s->comm)) < 0) {
            LOG_E(TAG, "rank %d, step %" PRId64 ": a rank died while a snapshot persisted; it will "
                  "not be committed", s->rank, s->step);
            train_vote_abort(s->vote);
            return rc;
        }
    }
}

void train_poll_persists(state *s)
{
    if (!s->engine) return;
    uint64_t done = ckpt_engine_completed(s->engine);
    if (done == s->persists_reported) return;
    s->persists_reported = done; /* only the last one's figures are kept: report it */
    ckpt_persist_stats ps;
    if (ckpt_engine_last(s->engine, &ps) == 0)
        train_report_snapshot_done(s->report, (int64_t)ps.step, ps.result, ps.persist_seconds,
                                   ps.raw_bytes, ps.stored_bytes);
}

int train_snapshot_prepare(state *s, ckpt_buffer bufs[3], char **text)
{
    *text = NULL;
    if (s->o->zero_stage == 3 && s->world > 1) {
        int rc = train_gather_range_hook(s, 0, s->np); /* the record's params digest */
        if (rc < 0) return rc;
    }
    int dr = train_state_to_host(s); /* the host view the buffers below point into */
    if (dr < 0) return dr;
    dr = train_moments_digest(s, s->moments_digest);
    if (dr < 0) return dr;
    size_t bytes = s->np * sizeof(float), off = s->lo * sizeof(float);
    size_t sb = (s->hi - s->lo) * sizeof(float);
    bufs[0] = (ckpt_buffer){"params", "f32", 4, bytes, off, sb, s->params_host + s->lo};
    bufs[1] = (ckpt_buffer){"adam_m", "f32", 4, bytes, off, sb, s->m + (s->lo - s->olo)};
    bufs[2] = (ckpt_buffer){"adam_v", "f32", 4, bytes, off, sb, s->v + (s->lo - s->olo)};
    json_t *rec = trainer_record(s, 1);
    *text = rec ? json_dumps(rec, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(rec);
    return *text ? 0 : -ENOMEM;
}

/* The snapshot straight from the device (train_internal.h): the copies of the shards into the
 * engine's staging area and, with an asynchronous memory snapshot, into the slot begun for it
 * (and, on CUDA, of the state into the host view for the digests) are queued on the stager's
 * copy stream after the optimizer update, the engine persists behind them, and the trainer
 * record, whose digests need the copied state, follows at the next optimizer update
 * (train_wait_stage_copies), which also commits the slot. The stall is the time to queue.
 * The disk persist does not read the slot (as the synchronous mode's does): a slot held by
 * a persist for several steps would leave the other slot, overwritten each step, uncommitted
 * until the next update, so that no complete slot newer than the persisted step existed
 * meanwhile. One more device-to-host copy per disk snapshot keeps the memory tier at most one
 * step behind. */
int train_stage_snapshot(state *s, int disk)
{
    if (s->o->zero_stage == 3 && s->world > 1) {
        int rc = train_gather_range_hook(s, 0, s->np); /* the record's params digest */
        if (rc < 0) return rc;
    } else if (!disk && s->world > 1 && s->o->zero_stage == 0 && s->mem_every > 0) {
        /* A memory-only step at ZeRO-0 has no collective between this step's optimizer update,
         * where every rank committed the previous slot, and the begin below, which overwrites
         * this rank's older slot: a peer that died between the moments digest and its own
         * commit would keep only that older step, this rank only the newer one, and no
         * snapshot would be complete in memory. Every rank has committed (or died) when the
         * barrier returns. (ZeRO-1/2 all-gather the parameters after the update, ZeRO-3
         * gathers them above; a disk snapshot's agreement in train_take_snapshot is one too.)
         * Every rank runs it: mem_every is agreed, with or without a segment. */
        int rc = train_comm_barrier(s->comm);
        if (rc < 0) {
            train_comm_failed(s, "barrier before a memory snapshot", rc);
            return rc;
        }
    }
    const size_t bytes = s->np * sizeof(float), off = s->lo * sizeof(float);
    const size_t sb = (s->hi - s->lo) * sizeof(float);
    ckpt_buffer dbufs[3] = {
        {"params", "f32", 4, bytes, off, sb, train_model_params(s->model) + s->lo},
        {"adam_m", "f32", 4, bytes, off, sb, s->dm + (s->lo - s->olo)},
        {"adam_v", "f32", 4, bytes, off, sb, s->dv + (s->lo - s->olo)}};
    json_t *rec = trainer_record(s, 0);
    if (!rec) return -ENOMEM;
    double stall = 0, t0 = clock_now_s();
    int rc = train_stager_after_compute(s->stager);
    if (rc == 0) rc = train_state_to_host_async(s, train_stager_stream(s->stager));
    /* the record's digests of the host view, on the digest thread once those copies are done
     * (train_digest.c); without it, train_wait_stage_copies hashes on this thread */
    s->stage_digest = 0;
    if (rc == 0 && train_digest_usable(s)) {
        int dg = train_digest_start(s, train_stager_stream(s->stager));
        if (dg == 0) s->stage_digest = 1;
        else LOG_D(TAG, "snapshot step %" PRId64 ": digests on the training thread (%s)", s->step,
                   strerror(-dg));
    }
    /* the memory snapshot: a slot begun, the three shards copied into it and checksummed on
     * the copy stream (a failure is accounted there) */
    const int mem = s->mem_async && s->mem_every > 0 && s->mem_seg;
    int slot = mem && rc == 0 ? train_mem_begin(s, dbufs) : -1;
    if (mem && rc < 0) (void)train_mem_commit(s, -1, NULL, rc, 0); /* only accounts the failure */
    double t1 = clock_now_s();
    int drc = 1; /* the disk snapshot: 0 staged, 1 not taken (policy, or a memory-only step) */
    if (rc == 0 && disk) {
        ckpt_copier cp;
        train_stager_copier(s->stager, &cp);
        drc = ckpt_engine_stage_device(s->engine, (uint64_t)s->step, s->run_id, s->config_hash,
                                       dbufs, 3, NULL, &cp, NULL, &stall);
    }
    s->stage_pending = 1;
    s->stage_staged = drc == 0;
    s->stage_t0 = clock_now_s();
    s->stage_rec = rec;
    s->stage_mem_slot = slot;
    s->stage_mem_stall = t1 - t0;
    if (!disk) return 0; /* a memory snapshot's failure is accounted (logged) */
    if (rc < 0 || drc < 0) {
        LOG_E(TAG, "snapshot of step %" PRId64 " to %s not taken: %s", s->step, s->o->ckpt_dir,
              strerror(rc < 0 ? -rc : -drc));
        train_report_snapshot_failed(s->report, s->step, rc < 0 ? rc : drc);
    } else if (drc == 0) {
        stall = s->stage_t0 - t0;
        char also[48] = "";
        if (slot >= 0) snprintf(also, sizeof also, ", and into memory slot %d", slot);
        LOG_I(TAG, "snapshot step %" PRId64 " staged: stall %.1f ms for %.2f MiB (copies from %s "
              "queued%s); rss %.1f MiB", s->step, stall * 1e3, 3.0 * (double)sb / 1048576.0,
              train_device_describe(s->dev), also, (double)rss_kib() / 1024.0);
        train_report_snapshot_staged(s->report, s->step, stall, 3 * (uint64_t)sb);
    } else {
        train_report_snapshot_skipped(s->report, s->step); /* refused by the engine's policy */
    }
    return 0;
}

/* Stage a snapshot of the current state; the engine persists it in the background. Every
 * rank stages its shard [lo, hi) of params, adam_m and adam_v (the same layout at every ZeRO
 * stage), so that a restore at any world size is range arithmetic. Collective: the ranks first
 * agree whether a persist is still running anywhere, so that all of them skip or wait alike.
 * With the memory tier the stage is the memory snapshot: the state is copied once, into a slot
 * of the own segment, and the persist reads it from there (ckpt_engine_persist_staged); when
 * that copy fails, the engine's own staging copy is used as without the tier. With
 * asynchronous memory snapshots (and without the tier) it is train_stage_snapshot.
 * Returns 0, or a negative errno (a failed collective is fatal; a failed stage is logged). */
int train_take_snapshot(state *s, int last)
{
    double t0 = clock_now_s();
    if (s->world > 1) {
        uint8_t *busy = calloc((size_t)s->world, 1);
        if (!busy) return -ENOMEM;
        busy[s->rank] = (uint8_t)(ckpt_engine_busy(s->engine) > 0);
        int rc = train_gather_records(s, busy, 1);
        int any = 0;
        for (int r = 0; r < s->world; r++) any |= busy[r];
        free(busy);
        if (rc < 0) {
            train_comm_failed(s, "snapshot agreement", rc);
            return rc;
        }
        if (any && s->o->policy == CKPT_POLICY_SKIP && !last) {
            s->skipped++;
            train_report_snapshot_skipped(s->report, s->step);
            if (s->rank == 0)
                LOG_W(TAG, "snapshot of step %" PRId64 " skipped: the previous one still persists on "
                      "some rank (policy skip)", s->step);
            /* the memory snapshot of this step is still taken (main leaves it to us) */
            return s->mem_every > 0 ? train_mem_take(s) : 0;
        }
        if (any && (rc = train_wait_engine(s, 3600.0)) == -ECONNRESET) return rc;
    }
    if (s->stager && (s->mem_every <= 0 || s->mem_async)) return train_stage_snapshot(s, 1);
    ckpt_buffer bufs[3], staged[3];
    char *text = NULL;
    int rc = train_snapshot_prepare(s, bufs, &text);
    if (rc < 0) return rc;
    const size_t sb = (size_t)bufs[0].bytes;
    double stall = 0;
    int slot = -1;
    if (s->mem_every > 0 && train_mem_write(s, bufs, text, t0, staged, &slot) == 0) {
        /* the copy's stall is the memory snapshot's (reported as such); this one is only the
         * hand-over (and the wait for a persist in flight), so that the two add up */
        rc = ckpt_engine_persist_staged(s->engine, (uint64_t)s->step, s->run_id, s->config_hash,
                                        staged, 3, text, &stall);
        if (rc == 0) s->mem_persist_slot = slot; /* untouched until the persist is done */
    } else if (s->stager) {
        /* from the device: the copies are queued on the stager's copy stream, ordered after
         * the optimizer update (the end of the compute stream), and the persist follows them
         * chunk by chunk; the next optimizer update waits for them (train_wait_stage_copies) */
        ckpt_buffer dbufs[3];
        memcpy(dbufs, bufs, sizeof dbufs);
        dbufs[0].data = train_model_params(s->model) + s->lo;
        dbufs[1].data = s->dm + (s->lo - s->olo);
        dbufs[2].data = s->dv + (s->lo - s->olo);
        ckpt_copier cp;
        train_stager_copier(s->stager, &cp);
        rc = train_stager_after_compute(s->stager);
        if (rc == 0) {
            rc = ckpt_engine_stage_device(s->engine, (uint64_t)s->step, s->run_id, s->config_hash,
                                          dbufs, 3, text, &cp, NULL, &stall);
            if (rc == 0) {
                s->stage_pending = 1;
                s->stage_t0 = clock_now_s();
            }
        }
    } else {
        rc = ckpt_engine_stage(s->engine, (uint64_t)s->step, s->run_id, s->config_hash, bufs, 3,
                               text, &stall);
    }
    free(text);
    if (rc < 0) {
        LOG_E(TAG, "snapshot of step %" PRId64 " to %s not taken: %s", s->step, s->o->ckpt_dir,
              strerror(-rc));
        train_report_snapshot_failed(s->report, s->step, rc);
        return 0;
    }
    if (rc == 0) {
        char from[48] = "";
        if (slot >= 0) snprintf(from, sizeof from, " (persisted from memory slot %d)", slot);
        LOG_I(TAG, "snapshot step %" PRId64 " staged: stall %.1f ms for %.2f MiB%s; rss %.1f MiB",
              s->step, stall * 1e3, 3.0 * (double)sb / 1048576.0, from,
              (double)rss_kib() / 1024.0);
        train_report_snapshot_staged(s->report, s->step, stall, 3 * (uint64_t)sb);
    } else {
        train_report_snapshot_skipped(s->report, s->step); /* refused by the engine's policy */
    }
    return 0;
}

int train_make_stager(state *s)
{
    if (s->stager) return 0;
    double st_timeout = s->o->comm_timeout * 10 > 600 ? s->o->comm_timeout * 10 : 600;
    int rc = train_stager_create(&s->stager, s->dev, st_timeout);
    if (rc < 0)
        LOG_E(TAG, "cannot create the snapshot copy stream on %s: %s", train_device_describe(s->dev),
              strerror(-rc));
    return rc;
}

int train_make_engine(state *s)
{
    const options *o = s->o;
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = o->ckpt_dir;
    eo.save.zstd_level = o->zstd_level;
    eo.save.filter = o->filter;
    eo.save.direct_io = o->direct_io;
    eo.save.lock = s->lock; /* rank 0 (NULL elsewhere): no save once the folder has lost it */
    eo.save.dir_locked = 1; /* rank 0 made and locked it at start-up: never made again here */
    /* a state too large for the format's chunk limit at this chunk size gets larger chunks
     * (the same on every rank: it depends on the model and W only) */
    const uint64_t total = (uint64_t)s->np * sizeof(float);
    const ckpt_buffer whole[3] = {{"params", "f32", 4, total, 0, total, NULL},
                                  {"adam_m", "f32", 4, total, 0, total, NULL},
                                  {"adam_v", "f32", 4, total, 0, total, NULL}};
    eo.save.chunk_bytes = ckpt_fit_chunk_bytes(o->chunk_bytes, whole, 3, (uint32_t)s->world);
    if (eo.save.chunk_bytes == 0) {
        LOG_E(TAG, "no chunk size up to 1 GiB keeps a snapshot of this state within the format's "
              "%u chunks", (unsigned)CKPT_MAX_CHUNKS);
        return -EINVAL;
    }
    if (eo.save.chunk_bytes != o->chunk_bytes && s->rank == 0)
        LOG_I(TAG, "snapshot chunks of %llu MiB instead of %llu MiB: the state would need more "
              "chunks than the format allows (%u)", (unsigned long long)(eo.save.chunk_bytes >> 20),
              (unsigned long long)(o->chunk_bytes >> 20), (unsigned)CKPT_MAX_CHUNKS);
    eo.compress = o->compress;
    eo.threads = (unsigned)o->snapshot_threads;
    eo.policy = o->policy;
    eo.keep_last = s->rank == 0 ? o->keep_last : 0; /* only rank 0 applies retention */
    eo.keep_every = s->rank == 0 ? (uint64_t)o->keep_every : 0;
    /* with synchronous memory snapshots the persists read the slots: the staging area is
     * only the fallback for a failed memory copy, allocated when first needed */
    eo.reserve_bytes = s->mem_seg && !s->mem_async ? 0 : 3 * (s->hi - s->lo) * sizeof(float);
    eo.overlap = o->overlap;
    eo.group = s->world > 1 ? &s->group : NULL;
    if (s->uploader) {
        eo.on_commit = train_s3_on_commit;
        eo.on_commit_ctx = s;
    }
    /* the stager first: the engine pins its staging area through it, and unpins it when it
     * is destroyed, so the stager goes after the engine (train_main's out: path) */
    int rc = train_make_stager(s);
    if (rc < 0) return rc;
    rc = ckpt_engine_create(&s->engine, &eo);
    if (rc < 0) LOG_E(TAG, "cannot start the snapshot engine for %s: %s", o->ckpt_dir, strerror(-rc));
    return rc;
}

void train_stage_discard(state *s)
{
    json_decref(s->stage_rec);
    s->stage_rec = NULL;
    s->stage_pending = 0;
}

int train_wait_stage_copies(state *s)
{
    if (!s->stage_pending) return 0;
    json_t *rec = s->stage_rec;
    const int staged = s->stage_staged;
    s->stage_pending = 0;
    s->stage_staged = 0;
    s->stage_rec = NULL;
    double t0 = clock_now_s();
    double timeout = s->o->comm_timeout * 10 > 600 ? s->o->comm_timeout * 10 : 600;
    const int64_t step = s->step; /* the snapshot's: no update ran since it was staged */
    int rc = train_stager_wait_all(s->stager, timeout);
    double t1 = clock_now_s();
    if (rc < 0) {
        LOG_E(TAG, "rank %d, step %" PRId64 ": the snapshot copies from %s did not finish: %s",
              s->rank, s->step + 1, train_device_describe(s->dev), strerror(-rc));
    } else if (t1 - t0 >= 0.001) {
        LOG_I(TAG, "snapshot step %" PRId64 ": waited %.1f ms for its copies (queued %.1f ms "
              "earlier)", s->step, (t1 - t0) * 1e3, (t1 - s->stage_t0) * 1e3);
    }
    /* the digests: hashed on the digest thread while this step computed (train_digest.c), or
     * here when that thread was not used; then the moments digest's sum over the ranks (a
     * collective: every rank has this snapshot pending; a rank whose copies failed fails its
     * step instead, and its peers see it leave) */
    char hex[33] = "";
    uint64_t mine[2] = {0, 0};
    double hash_s = 0;
    int hashed = 0;
    if (s->stage_digest) {
        int fr = rc < 0 ? train_digest_cancel(s, timeout)
                        : train_digest_finish(s, timeout, hex, mine, &hash_s);
        if (fr == 0 && rc == 0) hashed = 1;
        else if (fr < 0 && rc == 0) {
            LOG_E(TAG, "rank %d, step %" PRId64 ": the snapshot's digests did not finish: %s",
                  s->rank, s->step, strerror(-fr));
            rc = fr;
            /* drop the job, waiting once more for a hash still running, so that later writes
             * of the host view (the final digest's copy) do not race it */
            (void)train_digest_cancel(s, timeout);
        }
        s->stage_digest = 0;
    }
    double t2 = clock_now_s();
    if (rc == 0 && !hashed) {
        /* the params digest only for a record (the fallback of a failed memory write has
         * none); the moments parts always: their sum is a collective of every rank */
        if (rec) train_digest_hex(s->params_host, s->np, hex);
        train_moments_digest_local(s->m, s->v, s->lo, s->hi, s->olo, mine);
    }
    if (rc == 0 && rec)
        LOG_D(TAG, "snapshot step %" PRId64 ": digests %s (%.1f ms of hashing)", step,
              hashed ? "hashed on the digest thread" : "hashed on the training thread",
              (hashed ? hash_s : clock_now_s() - t2) * 1e3);
    int dr = rc < 0 ? 0 : train_moments_digest_sum(s, mine, s->moments_digest);
    if (rc == 0 && dr < 0) rc = dr;
    char *text = NULL;
    if (rc == 0 && rec && record_set_digests(s, rec, hex) == 0)
        text = json_dumps(rec, JSON_COMPACT | JSON_REAL_PRECISION(17));
    json_decref(rec);
    if (rc == 0 && rec && !text) { /* none without a record: a failed memory write's fallback */
        LOG_E(TAG, "rank %d, step %" PRId64 ": cannot encode the snapshot's trainer record",
              s->rank, step);
        rc = -ENOMEM;
    }
    /* the memory snapshot's slot, before the disk snapshot gets its record: the disk
     * snapshot of a step never commits before its memory snapshot (the memory tier is never
     * older than disk) */
    if (s->stage_mem_slot >= 0) {
        (void)train_mem_commit(s, s->stage_mem_slot, text, rc, s->stage_mem_stall); /* logged */
        s->stage_mem_slot = -1;
    }
    /* the copies' wait, the digests and the commit: the second part of the snapshot's stall */
    const double waited = clock_now_s() - t0;
    s->stage_wait_s += waited;
    if (rc == 0) train_report_snapshot_wait(s->report, step, waited);
    if (staged) {
        int sr = ckpt_engine_set_trainer(s->engine, (uint64_t)s->step, rc == 0 ? text : NULL);
        if (sr < 0 && sr != -ENOENT)
            LOG_W(TAG, "snapshot of step %" PRId64 ": handing over its trainer record failed: %s",
                  s->step, strerror(-sr));
    }
    free(text);
    return rc;
}
