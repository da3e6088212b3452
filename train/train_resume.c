/* train_resume.c - fresh start or resume of the train program: rank 0 chooses, every rank
 * loads its ranges, the ranks agree (see train_internal.h). */
#include "clock.h"
#include "ckpt.h"
#include "ckpt_mem.h"
#include "comm.h"
#include "data.h"
#include "log.h"
#include "model.h"
#include "progress.h"
#include "stage.h"
#include "storage.h"
#include "train_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TAG "train"

uint64_t train_random_u64(void)
{
    uint64_t r = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &r, sizeof r) != (ssize_t)sizeof r) r = 0;
        close(fd);
    }
    return r ^ (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
}

static void make_run_id(char out[64])
{
    snprintf(out, 64, "run-%016" PRIx64, train_random_u64());
}

/* Compare the snapshot's model config with ours; list the differing fields in diff. */
static int same_model(const json_t *model, const train_model_config *c, char *diff, size_t len)
{
    struct { const char *k; int v; } f[] = {{"vocab", c->vocab}, {"seq_len", c->seq_len},
                                            {"n_layer", c->n_layer}, {"n_embd", c->n_embd},
                                            {"n_head", c->n_head}};
    size_t off = 0;
    diff[0] = '\0';
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        json_t *x = json_object_get(model, f[i].k);
        long long sv = json_is_integer(x) ? (long long)json_integer_value(x) : -1;
        if (sv != f[i].v && off < len)
            off += (size_t)snprintf(diff + off, len - off, "%s%s (snapshot %lld, now %d)",
                                    off ? ", " : "", f[i].k, sv, f[i].v);
    }
    return diff[0] == '\0';
}

/* Log one warning listing the optimizer and schedule settings that differ from the
 * snapshot's: allowed, but the run no longer reproduces an uninterrupted one. */
static void warn_changed_hparams(const json_t *tr, const options *o)
{
    const json_t *opt = json_object_get(tr, "optimizer");
    struct { const char *k; double now; } f[] = {
        {"lr", o->adam.lr}, {"min_lr_ratio", o->adam.min_lr_ratio}, {"warmup", o->adam.warmup},
        {"total_steps", o->adam.total_steps}, {"beta1", o->adam.beta1}, {"beta2", o->adam.beta2},
        {"eps", o->adam.eps}, {"weight_decay", o->adam.weight_decay},
        {"grad_clip", o->adam.grad_clip}};
    char msg[512];
    size_t off = 0;
    msg[0] = '\0';
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        json_t *x = json_object_get(opt, f[i].k);
        if (!json_is_number(x)) continue;
        double was = json_number_value(x);
        if ((float)was != (float)f[i].now && off < sizeof msg)
            off += (size_t)snprintf(msg + off, sizeof msg - off, "%s%s %g -> %g", off ? ", " : "",
                                    f[i].k, was, f[i].now);
    }
    if (msg[0])
        LOG_W(TAG, "optimizer settings differ from the snapshot's (%s): the run will not match an "
              "uninterrupted one", msg);
    /* a snapshot holds fp32 state whatever the run's dtype: either restores into either */
    const json_t *jd = json_object_get(tr, "dtype");
    const char *was = json_is_string(jd) ? json_string_value(jd) : "fp32"; /* older records */
    const char *now = o->bf16 ? "bf16" : "fp32";
    if (strcmp(was, now) != 0)
        LOG_W(TAG, "dtype differs from the snapshot's (%.8s -> %s): the fp32 state restores, but the "
              "run will not match an uninterrupted one", was, now);
}

/* The global batch this run wants, or 0 when it follows the snapshot's (neither
 * --global-batch nor --grad-accum given). */
static int wanted_global_batch(const state *s)
{
    const options *o = s->o;
    if (o->global_batch) return o->global_batch;
    if (o->grad_accum_set) return o->micro_batch * o->grad_accum * s->world;
    return 0;
}

/* Set B and the accumulation per rank A = B / (b x W). Returns 0, or -EINVAL with why. */
static int set_global_batch(state *s, int B, char *why, size_t why_len)
{
    const int b = s->o->micro_batch, W = s->world;
    if (B % (b * W) != 0) {
        snprintf(why, why_len, "a global batch of %d sequences does not split into %d rank%s x "
                 "micro-batches of %d; choose a --global-batch that is a multiple of %d, or "
                 "another --micro-batch", B, W, W == 1 ? "" : "s", b, b * W);
        return -EINVAL;
    }
    if (s->o->cfg_ga && B != b * s->o->cfg_ga * W) {
        snprintf(why, why_len, "--config: train_batch_size %d != micro-batch %d x "
                 "gradient_accumulation_steps %d x world size %d", B, b, s->o->cfg_ga, W);
        return -EINVAL;
    }
    s->global_batch = B;
    s->grad_accum = B / (b * W);
    return 0;
}

/* One slice of a restore: read (and decode) bytes of one buffer into a pinned bounce buffer,
 * on the training thread, and show the restore's progress (rank 0). */
typedef struct restore_read {
    ckpt_snapshot *snap;
    const char *name;
    char *why;
    size_t why_len;
    progress *p;
    uint64_t done; /* bytes read so far, over the three buffers */
} restore_read;

static int read_slice(void *ctx, uint64_t offset, uint64_t len, void *host_dst)
{
    restore_read *r = ctx;
    int rc = ckpt_snapshot_read(r->snap, r->name, offset, len, host_dst, r->why, r->why_len);
    if (rc < 0 && rc != -EBADMSG)
        snprintf(r->why, r->why_len, "reading %s (bytes %" PRIu64 "..%" PRIu64 "): %s", r->name,
                 offset, offset + len, strerror(-rc));
    r->done += len;
    progress_update(r->p, r->done);
    return rc;
}

/* Bytes per restore slice by default: each of the stager's two bounce buffers (and always the
 * window of an in-place read). Large enough that the chunks cut by a slice's ends (decoded
 * once per slice they overlap) cost little, and that the snapshot's reading threads have
 * chunks to share: 16 chunks of the default 4 MiB. CKPT_RESTORE_SLICE_BYTES overrides it for
 * the staged path. */
#define RESTORE_SLICE_BYTES ((size_t)64 << 20)
#define RESTORE_SLICE_MIN ((size_t)4096)
#define RESTORE_SLICE_MAX ((size_t)1 << 30)

int train_restore_env(state *s)
{
    const char *v = getenv("CKPT_RESTORE_STAGED");
    if (v && *v && strcmp(v, "0") != 0 && strcmp(v, "1") != 0) {
        fprintf(stderr, "train: CKPT_RESTORE_STAGED='%.40s' is not 0 or 1 (1 = restore through "
                "pinned bounce buffers and the copy stream, as on a GPU; unset, empty or 0 = the "
                "device's own way)\n", v);
        return -EINVAL;
    }
    s->restore_staged = v && !strcmp(v, "1");
    s->restore_slice = RESTORE_SLICE_BYTES;
    v = getenv("CKPT_RESTORE_SLICE_BYTES");
    if (v && *v) {
        char *end;
        errno = 0;
        /* digits only: strtoull alone would take leading blanks and a sign */
        int digits = strspn(v, "0123456789") == strlen(v);
        unsigned long long n = digits ? strtoull(v, &end, 10) : 0;
        if (!digits || errno || n < RESTORE_SLICE_MIN || n > RESTORE_SLICE_MAX) {
            fprintf(stderr, "train: CKPT_RESTORE_SLICE_BYTES='%.40s' is not a number of bytes in "
                    "[%zu, %zu] (bytes per restore slice; default %zu)\n", v, RESTORE_SLICE_MIN,
                    RESTORE_SLICE_MAX, RESTORE_SLICE_BYTES);
            return -EINVAL;
        }
        s->restore_slice = (size_t)n;
    }
    return 0;
}

/* Read this rank's ranges of the three buffers into the device state: params [plo, phi) of the
 * model's parameters, adam_m and adam_v [olo, ohi).
 * - Device memory apart from the host (CUDA), or CKPT_RESTORE_STAGED=1: through the stager
 *   (train_stage_restore_fn, issue 11 section 4): a slice is read and decompressed into one
 *   pinned bounce buffer while the host-to-device copy of the previous slice runs from the
 *   other, on the copy stream.
 * - The CPU device (its memory is host memory): decoded straight into the state, a slice at a
 *   time (the staged path there only adds a copy: about twice the restore time measured on a
 *   38M-parameter model, 2 cores). */
static int read_ranges(state *s, ckpt_snapshot *snap, size_t plo, size_t phi, char *why,
                       size_t why_len)
{
    why[0] = '\0';
    int staged = s->restore_staged || train_device_kind_of(s->dev) != TRAIN_DEVICE_CPU, rc = 0;
    size_t slice = staged && s->restore_slice ? s->restore_slice : RESTORE_SLICE_BYTES;
    if (staged && s->rank == 0) {
        /* a slice smaller than a chunk decodes that chunk once per slice: say so (once) */
        for (size_t i = 0; i < ckpt_snapshot_nbuffers(snap); i++) {
            ckpt_buffer_info bi;
            if (ckpt_snapshot_buffer_info(snap, i, &bi) < 0 || bi.nchunks == 0) continue;
            uint64_t chunk = bi.total_bytes / bi.nchunks;
            if (slice < chunk && !s->restore_slice_warned) {
                LOG_W(TAG, "restore slices of %zu bytes (CKPT_RESTORE_SLICE_BYTES) are smaller "
                      "than the snapshot's chunks (about %" PRIu64 " bytes in %s): each chunk is "
                      "decoded once per slice it overlaps, so the restore is up to %" PRIu64
                      "x slower", slice, chunk, bi.name, (chunk + slice - 1) / slice);
                s->restore_slice_warned = 1;
            }
        }
    }
    if (staged && (rc = train_make_stager(s)) < 0) { /* logged; the engine uses it later */
        snprintf(why, why_len, "cannot create the copy stream for the restore: %s", strerror(-rc));
        return rc;
    }
    struct {
        const char *name;
        uint64_t off, len;
        uint8_t *dst;
    } parts[3] = {{"params", plo * 4, (uint64_t)(phi - plo) * 4,
                   (uint8_t *)(train_model_params(s->model) + plo)},
                  {"adam_m", s->olo * 4, (uint64_t)(s->ohi - s->olo) * 4, (uint8_t *)s->dm},
                  {"adam_v", s->olo * 4, (uint64_t)(s->ohi - s->olo) * 4, (uint8_t *)s->dv}};
    progress p;
    progress_begin(&p, "restore", parts[0].len + parts[1].len + parts[2].len, s->rank != 0, 1);
    restore_read r = {snap, NULL, why, why_len, &p, 0};
    for (int i = 0; i < 3 && rc == 0; i++) {
        r.name = parts[i].name;
        if (staged) {
            rc = train_stage_restore_fn(s->stager, read_slice, &r, parts[i].off, parts[i].len,
                                        parts[i].dst, slice);
            if (rc < 0 && !why[0])
                snprintf(why, why_len, "restoring %s to %s: %s", parts[i].name,
                         train_device_describe(s->dev), strerror(-rc));
            continue;
        }
        for (uint64_t k = 0; k < parts[i].len && rc == 0; k += slice) {
            uint64_t n = parts[i].len - k < slice ? parts[i].len - k : slice;
            rc = read_slice(&r, parts[i].off + k, n, parts[i].dst + k);
        }
    }
    progress_end(&p);
    if (rc == 0 && staged && s->rank == 0)
        LOG_I(TAG, "restore into %s: %.1f MiB through pinned bounce buffers and the copy stream "
              "(slices of %zu bytes)", train_device_describe(s->dev), r.done / 1048576.0, slice);
    return rc;
}

/* The temp folder in --ckpt-dir where the local copy of an S3 snapshot is assembled: a temp
 * name (ckpt_remove_temp removes it after a crash), the same on every rank. */
static void s3_copy_dir(const state *s, uint64_t step, const char *run_id, char *out, size_t len)
{
    char d[32];
    ckpt_step_dirname(step, d, sizeof d);
    snprintf(out, len, "%s/.tmp-%s-s3copy-%s", s->o->ckpt_dir, d, run_id);
}

int train_record_check(const options *o, const char *data_hash, size_t np, const ckpt_snapshot *snap,
                       const json_t *tr, train_record *rec, char *why, size_t why_len)
{
    memset(rec, 0, sizeof *rec);
    json_t *data = json_object_get(tr, "data");
    const size_t bytes = np * sizeof(float);
    char diff[400];
    json_t *opt = json_object_get(tr, "optimizer");
    json_t *jstep = json_object_get(tr, "step"), *jsamples = json_object_get(data, "samples_consumed");
    json_t *jt = json_object_get(opt, "t");
    int64_t step = json_is_integer(jstep) ? json_integer_value(jstep) : -1;
    int64_t samples = json_is_integer(jsamples) ? json_integer_value(jsamples) : -1;
    int64_t t = json_is_integer(jt) ? json_integer_value(jt) : -1;
    const char *dh = json_string_value(json_object_get(data, "data_hash"));
    const char *digest = json_string_value(json_object_get(tr, "params_digest"));
    json_t *jbatch = json_object_get(tr, "batch");
    int64_t gb = json_integer_value(json_object_get(jbatch, "global_batch"));
    int64_t saved_world = json_integer_value(json_object_get(jbatch, "world_size"));
    int64_t seed = json_integer_value(json_object_get(data, "seed"));
    int dtypes_ok = 1;
    for (size_t i = 0; i < ckpt_snapshot_nbuffers(snap); i++) {
        ckpt_buffer_info bi;
        ckpt_snapshot_buffer_info(snap, i, &bi);
        if ((!strcmp(bi.name, "params") || !strcmp(bi.name, "adam_m") || !strcmp(bi.name, "adam_v")) &&
            (strcmp(bi.dtype, "f32") != 0 || bi.elem_bytes != 4))
            dtypes_ok = 0;
    }
    int64_t want_samples = 0; /* step x gb, checked: both come from the record */
    json_t *md = json_object_get(tr, "moments_digest");
    const char *dm = json_string_value(json_object_get(md, "adam_m"));
    const char *dv = json_string_value(json_object_get(md, "adam_v"));
    int rc = 0;
    if (!json_is_object(tr) || !json_is_object(data) || !json_is_object(opt) || !dh || !digest ||
        !json_is_object(json_object_get(tr, "model"))) {
        snprintf(why, why_len, "trainer record lacks its model, data position, optimizer or "
                 "params_digest");
        rc = -EBADMSG;
    } else if (md && (!dm || !dv || strlen(dm) != 16 || strlen(dv) != 16 ||
                      strspn(dm, "0123456789abcdef") != 16 || strspn(dv, "0123456789abcdef") != 16)) {
        /* absent in records older than the digest; present, it must be usable */
        snprintf(why, why_len, "trainer record has a malformed moments_digest");
        rc = -EBADMSG;
    } else if (step != (int64_t)ckpt_snapshot_step(snap) || t != step) {
        snprintf(why, why_len, "trainer record is inconsistent: step %lld and Adam step %lld in a "
                 "snapshot of step %llu", (long long)step, (long long)t,
                 (unsigned long long)ckpt_snapshot_step(snap));
        rc = -EBADMSG;
    } else if (!same_model(json_object_get(tr, "model"), &o->model, diff, sizeof diff)) {
        snprintf(why, why_len, "model configuration differs: %s", diff);
        rc = -EINVAL;
    } else if (strcmp(dh, data_hash) != 0) {
        snprintf(why, why_len, "training data differs from the snapshot's (data hash %s, now %s)",
                 dh, data_hash);
        rc = -EINVAL;
    } else if (seed != (int64_t)o->seed) {
        snprintf(why, why_len, "seed differs (snapshot %lld, now %" PRIu64 ")", (long long)seed,
                 o->seed);
        rc = -EINVAL;
    } else if (gb < 1 || gb > (1 << 24)) {
        snprintf(why, why_len, "trainer record has no valid global batch");
        rc = -EBADMSG;
    } else if (__builtin_mul_overflow(step, gb, &want_samples) || samples != want_samples) {
        snprintf(why, why_len, "trainer record is inconsistent: %lld samples consumed after %lld "
                 "steps of %lld", (long long)samples, (long long)step, (long long)gb);
        rc = -EBADMSG;
    } else if (ckpt_snapshot_buffer_bytes(snap, "params") != (int64_t)bytes ||
               ckpt_snapshot_buffer_bytes(snap, "adam_m") != (int64_t)bytes ||
               ckpt_snapshot_buffer_bytes(snap, "adam_v") != (int64_t)bytes) {
        snprintf(why, why_len, "state buffers have the wrong size for this model");
        rc = -EINVAL;
    } else if (!dtypes_ok) {
        snprintf(why, why_len, "state buffers are not f32");
        rc = -EBADMSG;
    }
    if (rc < 0) return rc;
    rec->step = step;
    rec->samples = samples;
    rec->global_batch = gb;
    rec->saved_world = saved_world;
    rec->params_digest = digest;
    rec->adam_m_digest = md ? dm : NULL;
    rec->adam_v_digest = md ? dv : NULL;
    return 0;
}

/* Load this rank's part of one snapshot: params [lo, hi) (all at ZeRO stage 0), Adam moments
 * [olo, ohi). Local: no collective. Returns 0, -EBADMSG (corrupt: try an older one), -EINVAL
 * (incompatible: refuse), other -errno. why gets one line. */
static int load_part(state *s, const char *path, char *why, size_t why_len)
{
    ckpt_snapshot *snap;
    objstore_opts so;
    train_s3_store_opts(s->o, &so);
    int rc = ckpt_mem_is_id(path) ? train_memremote_open(s, &snap, path, why, why_len)
                                   : ckpt_snapshot_open_any(&snap, path, &so, why, why_len);
    if (rc < 0) return rc == -EPROTONOSUPPORT ? -EINVAL : rc;
    if (ckpt_is_s3_url(path) && s->o->ckpt_dir) {
        /* the chunks this rank fetches also go into the local copy that local_copy completes
         * (one fetch per chunk, not two); a failure here only costs that */
        char tmp[CKPT_PATH_MAX];
        s3_copy_dir(s, ckpt_snapshot_step(snap), ckpt_snapshot_run_id(snap), tmp, sizeof tmp);
        int cr = ckpt_s3_copy_begin(snap, tmp);
        if (cr < 0) LOG_D(TAG, "%s: the restore's reads are not kept for the local copy: %s", tmp,
                          strerror(-cr));
    }
    json_error_t jerr;
    json_t *tr = json_loads(ckpt_snapshot_trainer_json(snap), 0, &jerr);
    if (!tr && (json_error_code(&jerr) == json_error_out_of_memory || !jerr.text[0])) {
        ckpt_snapshot_close(snap);
        snprintf(why, why_len, "out of memory parsing the trainer record");
        return -ENOMEM; /* says nothing about the bytes */
    }
    char mydh[17];
    snprintf(mydh, sizeof mydh, "%016" PRIx64, train_dataset_hash(s->train));
    train_record rec;
    int want = wanted_global_batch(s);
    size_t plo = s->o->zero_stage == 0 ? 0 : s->lo, phi = s->o->zero_stage == 0 ? s->np : s->hi;
    json_t *jbatch = json_object_get(tr, "batch");
    if ((rc = train_record_check(s->o, mydh, s->np, snap, tr, &rec, why, why_len)) < 0) {
        /* why is set */
    } else if (want && rec.global_batch != want) {
        snprintf(why, why_len, "global batch differs: the snapshot used %lld sequences per step "
                 "(world size %lld), this run %d; pass --global-batch %lld (or no batch flag) to "
                 "keep it", (long long)rec.global_batch, (long long)rec.saved_world, want,
                 (long long)rec.global_batch);
        rc = -EINVAL;
    } else if ((rc = set_global_batch(s, (int)rec.global_batch, why, why_len)) < 0) {
        /* why is set */
    } else if ((rc = read_ranges(s, snap, plo, phi, why, why_len)) == 0) {
        if (s->rank == 0) warn_changed_hparams(tr, s->o);
        s->step = rec.step;
        s->samples = (uint64_t)rec.samples;
        snprintf(s->run_id, sizeof s->run_id, "%s", ckpt_snapshot_run_id(snap));
        json_t *loss = json_object_get(tr, "loss");
        s->last_loss = json_is_number(loss) ? json_number_value(loss) : NAN;
        snprintf(s->recorded_moments[0], 17, "%s", rec.adam_m_digest ? rec.adam_m_digest : "");
        snprintf(s->recorded_moments[1], 17, "%s", rec.adam_v_digest ? rec.adam_v_digest : "");
        int64_t saved_mb = json_integer_value(json_object_get(jbatch, "micro_batch"));
        if (saved_mb > 0 && saved_mb != s->o->micro_batch && s->rank == 0)
            LOG_W(TAG, "micro-batch differs from the snapshot's (%lld, now %d): the global batch "
                  "stays %lld, but the results agree with an uninterrupted run only to rounding",
                  (long long)saved_mb, s->o->micro_batch, (long long)rec.global_batch);
        if (rec.saved_world != s->world && s->rank == 0)
            LOG_I(TAG, "re-sharding: the snapshot was saved by %lld rank%s, this run has %d; each "
                  "rank reads only its ranges", (long long)rec.saved_world,
                  rec.saved_world == 1 ? "" : "s", s->world);
    }
    char *digest_copy = rc == 0 ? strdup(rec.params_digest) : NULL;
    json_decref(tr);
    train_memremote_done(s, snap);
    ckpt_snapshot_close(snap);
    if (rc == 0) {
        if (!digest_copy) return -ENOMEM;
        snprintf(why, why_len, "%s", digest_copy); /* handed to the caller for the check */
        free(digest_copy);
    }
    return rc;
}

/* The worst of the ranks' results: -EINVAL (refuse) before any other error before -EBADMSG
 * (corrupt) before 0. Collective; a failed collective returns its error with *comm_err set. */
static int agree(state *s, int rc, int *comm_err, int *who)
{
    *comm_err = 0;
    *who = s->rank;
    if (s->world == 1) return rc;
    int32_t *all = calloc((size_t)s->world, sizeof(int32_t));
    if (!all) {
        *comm_err = 1;
        return -ENOMEM;
    }
    all[s->rank] = rc;
    int cr = train_gather_records(s, all, sizeof(int32_t));
    int worst = 0;
    for (int r = 0; r < s->world && cr == 0; r++) {
        int x = all[r], was = worst;
        if (x == -EINVAL) worst = -EINVAL;
        else if (x < 0 && x != -EBADMSG && worst != -EINVAL) worst = x;
        else if (x == -EBADMSG && worst == 0) worst = x;
        if (worst != was) *who = r; /* the first rank with the deciding result */
    }
    free(all);
    if (cr < 0) {
        train_comm_failed(s, "agreement on the snapshot", cr);
        *comm_err = 1;
        return cr;
    }
    return worst;
}

/* Load one snapshot on every rank (collective): each rank reads only its ranges, the ranks
 * agree on the outcome, the parameters are all-gathered and their digest checked against the
 * record. Returns 0, -EBADMSG, -EINVAL, other -errno; *comm_err when a collective failed. */
static int load_snapshot(state *s, const char *path, char *why, size_t why_len, int *comm_err)
{
    char digest[600] = "";
    s->state_on_device = 0;
    int rc = load_part(s, path, why, why_len);
    if (rc == 0) snprintf(digest, sizeof digest, "%s", why);
    else if (s->world > 1)
        LOG_W(TAG, "%s: %s", path, why[0] ? why : strerror(-rc)); /* this rank's reason */
    /* -ENOENT (the folder rank 0 listed is not there for this rank: another file system,
     * or it was just removed) says nothing about the bytes: it stays what it is */
    int who = 0, mine = rc;
    rc = agree(s, rc, comm_err, &who);
    if (*comm_err) return rc;
    if (rc < 0) {
        if (who != s->rank || mine == 0) {
            if (rc == -EBADMSG) snprintf(why, why_len, "rank %d found it corrupt", who);
            else if (rc == -EINVAL) snprintf(why, why_len, "rank %d found it incompatible", who);
            else snprintf(why, why_len, "rank %d could not read it: %s", who, strerror(-rc));
        }
        return rc;
    }
    /* the ranges are in the device state: the params are gathered there, and the state is
     * copied to the host view for the digests, which so check what the device holds (no
     * copy on the CPU device) */
    if (train_gather_params(s) < 0 || train_state_to_host(s) < 0) {
        *comm_err = 1;
        return -EIO;
    }
    char got[33];
    train_digest_hex(s->params_host, s->np, got);
    if (strcmp(got, digest) != 0) {
        snprintf(why, why_len, "params digest %s differs from the recorded %s", got, digest);
        return -EBADMSG;
    }
    uint64_t md[2];
    if (train_moments_digest(s, md) < 0) {
        *comm_err = 1;
        return -EIO;
    }
    for (int k = 0; k < 2; k++) {
        const char *want = s->recorded_moments[k];
        char have[17];
        snprintf(have, sizeof have, "%016" PRIx64, md[k]);
        if (want[0] && strcmp(want, have) != 0) {
            snprintf(why, why_len, "%s digest %s differs from the recorded %s (a shard restored at "
                     "the wrong place?)", k ? "adam_v" : "adam_m", have, want);
            return -EBADMSG;
        }
    }
    s->state_on_device = 1;
    why[0] = '\0';
    return 0;
}

static int o_ckpt_dir(const state *s) { return s->o->ckpt_dir != NULL; }

static void fresh_start(state *s)
{
    train_model_init_params_into(s->model, s->o->seed, s->params_host); /* main: to the device */
    memset(s->m, 0, (s->ohi - s->olo) * sizeof(float));
    memset(s->v, 0, (s->ohi - s->olo) * sizeof(float));
    s->state_on_device = 0; /* main copies the host view to the device */
    s->step = 0;
    s->samples = 0;
    if (s->o->run_id) snprintf(s->run_id, sizeof s->run_id, "%s", s->o->run_id);
    else make_run_id(s->run_id);
}

/* Would this run save a snapshot of `step`? It saves every ckpt_every steps after the step
 * it starts from, and at its last step. (A stop by SIGTERM saves one more, at a step nobody
 * can foresee: a collision there fails that one save, cleanly, with "already exists".) */
static int would_save(const state *s, uint64_t step)
{
    const options *o = s->o;
    return step > (uint64_t)s->step && step <= (uint64_t)o->steps &&
           (step % (uint64_t)o->ckpt_every == 0 || step == (uint64_t)o->steps);
}

/* Snapshot names already in the folder that this run is about to save again would collide
 * (and without --run-id a later --resume auto would continue the other run, so any later
 * snapshot is refused then). With --run-id, lineages are told apart: only a step this run
 * would save is refused. Returns 0, or 2 with one line naming the snapshot, its run and what
 * to do. Rank 0 only. */
static int check_no_later_snapshots(state *s)
{
    const options *o = s->o;
    ckpt_entry *e;
    size_t n;
    if (ckpt_list(o->ckpt_dir, &e, &n) < 0) return 0; /* unreadable: the first save reports it */
    int rc = 0;
    for (size_t i = n; i-- > 0;) {
        if (e[i].status == CKPT_STATUS_INCOMPLETE || e[i].status == CKPT_STATUS_SET_ASIDE) continue;
        if (e[i].step <= (uint64_t)s->step) break;
        if (o->run_id && !would_save(s, e[i].step)) continue;
        const char *who = e[i].run_id[0] ? e[i].run_id : "?";
        if (o->run_id)
            LOG_E(TAG, "refusing to start at step %" PRId64 ": %s already holds %s (run %s, %s), "
                  "a step this run (%s) would save; continue run %s with --run-id %s --resume "
                  "auto, use another --ckpt-dir, or change --steps/--ckpt-every", s->step,
                  o->ckpt_dir, e[i].name, who, ckpt_status_name(e[i].status), o->run_id, who, who);
        else
            LOG_E(TAG, "refusing to start at step %" PRId64 ": %s already holds %s (run %s, %s), "
                  "whose steps this run would save again; continue that run with --resume auto, "
                  "give this run its own --run-id, or use another --ckpt-dir", s->step,
                  o->ckpt_dir, e[i].name, who, ckpt_status_name(e[i].status));
        rc = 2;
        break;
    }
    free(e);
    if (rc || !s->s3_read || s->s3_down || o->ckpt_every <= 0) return rc;
    /* the same on S3: uploads of this run would replace the later snapshots there (only
     * complete ones count: a folder without a manifest is what a re-save overwrites, C32) */
    ckpt_entry *e3 = s->s3_list;
    size_t n3 = s->s3_nlist;
    char w[400] = "";
    if (!e3 && ckpt_list_s3(s->s3_read, &e3, &n3, w, sizeof w) < 0) {
        LOG_W(TAG, "cannot list %s to check for later snapshots there: %s", o->s3, w);
        return 0;
    }
    for (size_t i = n3; i-- > 0;) {
        if (e3[i].status != CKPT_STATUS_COMMITTED) continue;
        if (e3[i].step <= (uint64_t)s->step) break;
        if (o->run_id && !would_save(s, e3[i].step)) continue;
        const char *who = e3[i].run_id[0] ? e3[i].run_id : "?";
        LOG_E(TAG, "refusing to start at step %" PRId64 ": %s already holds %s (run %s), whose "
              "steps this run would upload again; continue that run with --resume auto%s, %suse "
              "another --s3 prefix", s->step, o->s3, e3[i].name, who,
              o->run_id ? " and its --run-id" : "", o->run_id ? "" : "give this run its own "
              "--run-id, or ");
        rc = 2;
        break;
    }
    if (e3 != s->s3_list) free(e3);
    return rc;
}

/* Rank 0 tells the others what to do next during the resume. */
enum { CMD_TRY = 0, CMD_DONE = 1 };
typedef struct resume_msg {
    int32_t cmd;
    int32_t status;          /* CMD_DONE: 0 go on, else the exit status */
    int32_t global_batch;    /* CMD_DONE: B of a fresh start */
    int32_t resumed;         /* CMD_DONE: 1 a snapshot was loaded and accepted by every rank */
    char run_id[64];         /* CMD_DONE: the run id */
    int32_t from_s3;         /* CMD_DONE: resumed from the S3 snapshot in path: make a local copy */
    char path[CKPT_PATH_MAX];/* CMD_TRY */
} resume_msg;

/* Rank 0: try one snapshot on every rank. Returns the agreed result; *fatal set when a
 * collective failed. */
static int try_snapshot(state *s, const char *path, char *why, size_t why_len, int *fatal)
{
    if (s->world > 1) {
        resume_msg m = {.cmd = CMD_TRY};
        snprintf(m.path, sizeof m.path, "%s", path);
        int rc = train_comm_broadcast(s->comm, &m, sizeof m, 0);
        if (rc < 0) {
            train_comm_failed(s, "broadcast of the resume plan", rc);
            *fatal = 1;
            return rc;
        }
    }
    return load_snapshot(s, path, why, why_len, fatal);
}

/* Rank 0's side of --resume PATH: 0 resumed; an unreadable, corrupt or incompatible
 * snapshot named explicitly is an input error (2), a transient failure 1. */
static int resume_path(state *s, int *resumed)
{
    const options *o = s->o;
    char why[600] = "";
    int fatal = 0;
    struct stat st;
    char mpath[CKPT_PATH_MAX + 16];
    if (ckpt_is_s3_url(o->resume)) {
        int rc = try_snapshot(s, o->resume, why, sizeof why, &fatal);
        if (fatal) return 1;
        if (rc < 0) {
            int status = rc == -EBADMSG || rc == -EPROTONOSUPPORT ? 2 : train_input_status(rc);
            LOG_E(TAG, "cannot resume from %s: %s%s", o->resume, why[0] ? why : strerror(-rc),
                  status == 1 ? " (a transient error: the snapshot may be fine)" : "");
            return status;
        }
        *resumed = 1;
        snprintf(s->s3_restored, sizeof s->s3_restored, "%s", o->resume);
        LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s)", o->resume, s->step, s->run_id);
        return 0;
    }
    if (stat(o->resume, &st) != 0 || !S_ISDIR(st.st_mode)) {
        int e = errno;
        if (stat(o->resume, &st) != 0 && e != ENOENT && e != ENOTDIR) {
            LOG_E(TAG, "--resume %s: cannot read it: %s", o->resume, strerror(e));
            return train_input_status(-e);
        }
        LOG_E(TAG, "--resume %s: no such snapshot folder", o->resume);
        return 2;
    }
    snprintf(mpath, sizeof mpath, "%s/manifest.json", o->resume);
    ckpt_entry *inner;
    size_t ninner = 0;
    if (lstat(mpath, &st) != 0 && ckpt_list(o->resume, &inner, &ninner) == 0) {
        free(inner);
        if (ninner > 0) {
            LOG_E(TAG, "--resume %s: this holds snapshots, it is not one; use --ckpt-dir %s "
                  "--resume auto, or name one of its step-* folders", o->resume, o->resume);
            return 2;
        }
    }
    int rc = try_snapshot(s, o->resume, why, sizeof why, &fatal);
    if (fatal) return 1;
    if (rc < 0) {
        int status = rc == -EBADMSG || rc == -EPROTONOSUPPORT ? 2 : train_input_status(rc);
        LOG_E(TAG, "cannot resume from %s: %s%s", o->resume, why[0] ? why : strerror(-rc),
              status == 1 ? " (a transient error: the snapshot may be fine)" : "");
        return status;
    }
    *resumed = 1;
    LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s)", o->resume, s->step, s->run_id);
    return 0;
}

/* Rank 0, --resume auto with --s3: try the S3 snapshot e3. Returns 0 resumed, 1 or 2 (the
 * exit status: stop), or -1 not restorable from there (go on; *line gets why when it was a
 * snapshot: corrupt). */
static int try_s3_entry(state *s, const ckpt_entry *e3, char *line, size_t line_len, int *fatal)
{
    const options *o = s->o;
    char url[CKPT_PATH_MAX], why[600] = "";
    ckpt_s3_step_url(s->s3_read, e3->step, url, sizeof url);
    line[0] = '\0';
    switch (e3->status) {
    case CKPT_STATUS_INCOMPLETE:
        LOG_I(TAG, "ignoring %s: %s", url, e3->reason);
        return -1;
    case CKPT_STATUS_NEWER:
        LOG_E(TAG, "refusing to resume: %s was written by a newer version (%s); upgrade, or pass "
              "--resume PATH to choose an older snapshot", url, e3->reason);
        return 2;
    case CKPT_STATUS_UNREADABLE:
        LOG_E(TAG, "cannot read %s: %s; not resuming (nothing was skipped: the snapshot may be "
              "fine, and a restart tries it again)", url, e3->reason);
        return 1;
    case CKPT_STATUS_CORRUPT:
        LOG_W(TAG, "skipping %s: corrupt (%s)", url, e3->reason);
        snprintf(line, line_len, "%.600s: corrupt: %.300s", url, e3->reason);
        return -1;
    default: break;
    }
    if (o->run_id && strcmp(e3->run_id, o->run_id) != 0) {
        LOG_W(TAG, "skipping %s: it belongs to run %s, another lineage (this run is %s)", url,
              e3->run_id, o->run_id);
        return -1;
    }
    double t0 = clock_now_s();
    int rc = try_snapshot(s, url, why, sizeof why, fatal);
    if (*fatal) return 1;
    if (rc == 0) {
        LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s): fetched, loaded and checked in "
              "%.0f ms", url, s->step, s->run_id, (clock_now_s() - t0) * 1e3);
        snprintf(s->s3_restored, sizeof s->s3_restored, "%s", url);
        return 0;
    }
    if (rc == -EINVAL) {
        LOG_E(TAG, "refusing to resume from %s: %s", url, why);
        return 2;
    }
    if (rc != -EBADMSG) {
        LOG_E(TAG, "cannot read %s: %s; not resuming (nothing was skipped: the snapshot may be "
              "fine, and a restart tries it again)", url, why[0] ? why : strerror(-rc));
        return 1;
    }
    LOG_W(TAG, "skipping corrupt snapshot %s: %s", url, why);
    snprintf(line, line_len, "%.600s: corrupt: %.300s", url, why);
    char tmp[CKPT_PATH_MAX];
    s3_copy_dir(s, e3->step, e3->run_id, tmp, sizeof tmp);
    store_remove_tree(tmp); /* what the ranks' reads kept of it: every rank is done (agreed) */
    /* not "later snapshots in the way" (check_no_later_snapshots): a re-save replaces it,
     * as a corrupt local one is set aside to free its step */
    for (size_t j = 0; j < s->s3_nlist; j++)
        if (s->s3_list[j].step == e3->step) s->s3_list[j].status = CKPT_STATUS_CORRUPT;
    return -1;
}

/* Rank 0: try the S3 snapshots e3[0, *k3) newest first while their step is over `floor`
 * (at least `floor` when inclusive; after the local ones newer than a step were tried, that
 * is exactly the S3 copy of that step). A corrupt one adds its line at lines[*bad + earlier].
 * Returns the first outcome that stops the walk (as try_s3_entry), or -1. */
static int try_s3_from(state *s, const ckpt_entry *e3, size_t *k3, uint64_t floor, int inclusive,
                       char (*lines)[1024], size_t *bad, size_t earlier, int *fatal)
{
    while (*k3 > 0 && (inclusive ? e3[*k3 - 1].step >= floor : e3[*k3 - 1].step > floor)) {
        int r3 = try_s3_entry(s, &e3[--*k3], lines[*bad + earlier], sizeof lines[0], fatal);
        if (r3 >= 0) return r3;
        if (lines[*bad + earlier][0]) (*bad)++;
    }
    return -1;
}

/* Rank 0, --resume auto with the memory tier (CKPT_MEM_PATH): try the memory snapshots complete
 * on this node (every rank of their world has a slot here: own segments or peer replicas)
 * whose step is at least `newest` (the newest step on disk and S3, -1 none; at an equal step memory wins: the
 * same state, read in milliseconds), newest first, of this run with --run-id. Memory is a
 * cache of what the disk tiers hold or will hold: any failure of a candidate (a slot missing
 * on some rank, a checksum, an incompatible record, a read error) is a warning and the next
 * candidate is tried, never an exit and never a set-aside. Candidates at `below` or newer
 * (tried by an earlier call) are passed over. Returns 0 resumed, -1 not (go on with disk and
 * S3); *fatal set when a collective failed. */
static int try_memory(state *s, int64_t newest, int64_t below, int *fatal)
{
    const options *o = s->o;
    ckpt_mem_entry *me = NULL;
    size_t nm = 0;
    int rc = train_memremote_list(s, s->mem_path, newest, &me, &nm);
    if (rc < 0) {
        LOG_W(TAG, "cannot list the memory snapshots of %s: %s; resuming from the disk tiers",
              s->mem_path, strerror(-rc));
        return -1;
    }
    int result = -1;
    for (size_t i = 0; i < nm && result < 0 && !*fatal; i++) {
        const ckpt_mem_entry *m = &me[i];
        const char *id = m->status == CKPT_MEM_CORRUPT ? m->name : m->id;
        char why[600] = "";
        if ((int64_t)m->step >= below) continue;
        if ((int64_t)m->step < newest) {
            LOG_I(TAG, "memory snapshot %s: older than the newest on disk or S3 (step %" PRId64
                  "); not used", id, newest);
            break; /* newest first: the rest is older still */
        }
        if (m->status == CKPT_MEM_CORRUPT) {
            LOG_W(TAG, "memory slot %s (step %" PRIu64 ") is corrupt: %s; trying the next "
                  "candidate", id, m->step, m->reason);
            continue;
        }
        if (m->status != CKPT_MEM_COMPLETE) {
            LOG_I(TAG, "memory snapshot %s: only %u of its %u ranks' slots are on this node or its peers (%s); "
                  "trying the next candidate", id, m->ranks_present, m->world_size, m->reason);
            continue;
        }
        if (o->run_id && strcmp(m->run_id, o->run_id) != 0) {
            LOG_W(TAG, "skipping memory snapshot %s: it belongs to run %s (this run is %s)", id,
                  m->run_id, o->run_id);
            continue;
        }
        double t0 = clock_now_s();
        rc = try_snapshot(s, id, why, sizeof why, fatal);
        if (*fatal) break;
        if (rc == 0) {
            LOG_I(TAG, "resumed from memory (%s) at step %" PRId64 " (run %s, saved by %u rank%s): "
                  "loaded and checked in %.1f ms", ckpt_mem_source_name(m->source), s->step,
                  s->run_id, m->world_size, m->world_size == 1 ? "" : "s",
                  (clock_now_s() - t0) * 1e3);
            s->mem_restored = 1;
            result = 0;
            break;
        }
        LOG_W(TAG, "memory snapshot %s not restored: %s; trying the next candidate", id,
              why[0] ? why : strerror(-rc));
    }
    free(me);
    return result;
}

/* In the walk of resume_rank0: the next candidate is the local snapshot at `step` (-1: none
 * left) or a newer S3 one of e3[0..k3); memory snapshots older than *mem_below (those were
 * tried) and at least as new as that candidate are tried before it. Returns 1 when the walk
 * ends here (*result 0 and *resumed 1: restored; *result 1: a collective failed), else 0. */
static int try_memory_between(state *s, int64_t step, const ckpt_entry *e3, size_t k3,
                              int64_t *mem_below, int *fatal, int *result, int *resumed)
{
    if (!s->mem_path || *mem_below < 0) return 0;
    int64_t floor = step;
    for (size_t j = 0; j < k3; j++)
        if (e3[j].status == CKPT_STATUS_COMMITTED && (int64_t)e3[j].step > floor)
            floor = (int64_t)e3[j].step;
    if (floor >= *mem_below) return 0;
    LOG_I(TAG, "the snapshots newer than step %" PRId64 " could not be restored: trying the "
          "memory snapshots older than step %" PRId64 " first", floor, *mem_below);
    int rm = try_memory(s, floor, *mem_below, fatal);
    *mem_below = floor;
    if (*fatal) {
        *result = 1;
        return 1;
    }
    if (rm == 0) {
        *result = 0;
        *resumed = 1;
        return 1;
    }
    return 0;
}

/* Rank 0's side of the resume: returns 0 (resumed, *resumed = 1, or a fresh start), 1 runtime
 * failure, 2 configuration error; the others follow (train_resume). With --resume auto the
 * newest restorable snapshot wins: a corrupt one is set aside and the next older tried; one
 * that cannot be read for a transient reason stops the resume (exit 1, nothing renamed,
 * DESIGN I7); when snapshots exist but none can be restored, the run starts fresh only with
 * --allow-fresh-start. */
static int resume_rank0(state *s, int *resumed)
{
    const options *o = s->o;
    char why[600];
    int fatal = 0;
    *resumed = 0;
    if (!o->resume || !strcmp(o->resume, "none")) {
        LOG_I(TAG, "fresh start (run %s)", s->run_id);
        return 0;
    }
    if (strcmp(o->resume, "auto") != 0) return resume_path(s, resumed);
    int removed = ckpt_remove_temp(o->ckpt_dir);
    if (removed < 0) LOG_W(TAG, "could not clean temp folders in %s: %s", o->ckpt_dir, strerror(-removed));
    ckpt_entry *e;
    size_t n;
    int rc = ckpt_list(o->ckpt_dir, &e, &n);
    if (rc < 0) {
        LOG_E(TAG, "cannot list snapshots in %s: %s", o->ckpt_dir, strerror(-rc));
        return 1;
    }
    /* the S3 tier: its snapshots join the candidates, newest step first; a listing that fails
     * now leaves the local ones (normally at least as new: S3 copies them) */
    ckpt_entry *e3 = NULL;
    size_t n3 = 0, k3 = 0;
    if (s->s3_read && s->s3_down) {
        LOG_W(TAG, "not looking for snapshots on %s: the bucket could not be reached at start; "
              "resuming from %s only", o->s3, o->ckpt_dir);
    } else if (s->s3_read) {
        char w[400] = "";
        int lr = ckpt_list_s3(s->s3_read, &e3, &n3, w, sizeof w);
        if (lr < 0) {
            LOG_W(TAG, "cannot list the snapshots on %s: %s; resuming from %s only", o->s3,
                  w[0] ? w : strerror(-lr), o->ckpt_dir);
            e3 = NULL;
            n3 = 0;
        } else {
            /* kept for check_no_later_snapshots (a copy: the walk below consumes e3) */
            s->s3_list = malloc((n3 ? n3 : 1) * sizeof *e3);
            if (s->s3_list) {
                memcpy(s->s3_list, e3, n3 * sizeof *e3);
                s->s3_nlist = n3;
            }
            LOG_I(TAG, "%s holds %zu snapshot folder%s", o->s3, n3, n3 == 1 ? "" : "s");
            for (size_t j = 0; j < n3; j++)
                if (e3[j].status == CKPT_STATUS_COMMITTED && (int64_t)e3[j].step > s->s3_newest)
                    s->s3_newest = (int64_t)e3[j].step;
        }
        k3 = n3;
    }
    /* memory snapshots at mem_below or newer have been tried: when the newest disk or S3
     * snapshots turn out corrupt, the memory ones between them and the next candidate come
     * before that candidate (C34: the newest complete, verified step of any tier wins) */
    int64_t mem_below = -1;
    if (s->mem_path) {
        /* the memory tier first, when it is at least as new as the newest elsewhere */
        int64_t newest = -1;
        for (size_t i = 0; i < n; i++)
            if (e[i].status == CKPT_STATUS_COMMITTED && (int64_t)e[i].step > newest &&
                (!o->run_id || !strcmp(e[i].run_id, o->run_id)))
                newest = (int64_t)e[i].step;
        for (size_t j = 0; j < n3; j++)
            if (e3[j].status == CKPT_STATUS_COMMITTED && (int64_t)e3[j].step > newest &&
                (!o->run_id || !strcmp(e3[j].run_id, o->run_id)))
                newest = (int64_t)e3[j].step;
        int rm = try_memory(s, newest, INT64_MAX, &fatal);
        if (rm == 0 || fatal) {
            free(e);
            free(e3);
            *resumed = rm == 0 && !fatal;
            return fatal ? 1 : 0;
        }
        mem_below = newest;
    }
    int result = -1;
    size_t bad = 0;       /* snapshots found corrupt now, set aside */
    size_t earlier = 0;   /* folders set aside as corrupt by earlier resumes */
    char (*lines)[1024] = calloc(n + n3 ? n + n3 : 1, sizeof *lines); /* why each one failed */
    if (!lines) {
        free(e);
        free(e3);
        return 1;
    }
    for (size_t i = n; result < 0 && i-- > 0;) {
        if (try_memory_between(s, (int64_t)e[i].step, e3, k3, &mem_below, &fatal, &result,
                               resumed))
            break;
        /* S3 snapshots newer than this local one come first */
        int r3 = try_s3_from(s, e3, &k3, e[i].step, 0, lines, &bad, earlier, &fatal);
        if (r3 >= 0) {
            result = r3;
            *resumed = r3 == 0;
            break;
        }
        char path[CKPT_PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", o->ckpt_dir, e[i].name);
        if (e[i].status == CKPT_STATUS_SET_ASIDE) {
            snprintf(lines[bad + earlier++], sizeof lines[0], "%.255s: set aside as corrupt earlier",
                     e[i].name);
            continue;
        }
        if (e[i].status == CKPT_STATUS_INCOMPLETE) {
            LOG_D(TAG, "ignoring %s: %s", path, ckpt_status_name(e[i].status));
            continue;
        }
        if (e[i].status == CKPT_STATUS_NEWER) {
            LOG_E(TAG, "refusing to resume: %s was written by a newer version (%s); upgrade, or "
                  "pass --resume PATH to choose an older snapshot", path, e[i].reason);
            result = 2;
            break;
        }
        if (e[i].status == CKPT_STATUS_UNREADABLE) {
            /* says nothing about its bytes: neither skip it (an older one would silently
             * win) nor set it aside; a restart may read it */
            LOG_E(TAG, "cannot read %s: %s; not resuming (nothing was renamed or skipped: the "
                  "snapshot may be fine, and a restart tries it again)", path, e[i].reason);
            result = 1;
            break;
        }
        if (e[i].status == CKPT_STATUS_COMMITTED && o->run_id && strcmp(e[i].run_id, o->run_id) != 0) {
            LOG_W(TAG, "skipping %s: it belongs to run %s, another lineage (this run is %s)", path,
                  e[i].run_id, o->run_id);
            continue;
        }
        const char *reason = e[i].reason;
        if (e[i].status == CKPT_STATUS_COMMITTED) {
            double t0 = clock_now_s();
            why[0] = '\0';
            rc = try_snapshot(s, path, why, sizeof why, &fatal);
            double load_s = clock_now_s() - t0;
            if (fatal) {
                result = 1;
                break;
            }
            if (rc == 0) {
                LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s): loaded and checked in "
                      "%.0f ms", path, s->step, s->run_id, load_s * 1e3);
                *resumed = 1;
                result = 0;
                break;
            }
            if (rc == -EINVAL) {
                LOG_E(TAG, "refusing to resume from %s: %s", path, why);
                result = 2;
                break;
            }
            if (rc != -EBADMSG) {
                LOG_E(TAG, "cannot read %s: %s; not resuming (nothing was renamed or skipped: the "
                      "snapshot may be fine, and a restart tries it again)", path,
                      why[0] ? why : strerror(-rc));
                result = 1;
                break;
            }
            LOG_W(TAG, "skipping corrupt snapshot %s: %s", path, why);
            reason = why;
        } else {
            LOG_W(TAG, "skipping %s: corrupt (%s)", path, e[i].reason);
        }
        snprintf(lines[bad++ + earlier], sizeof lines[0], "%.255s: corrupt: %.600s", e[i].name, reason);
        /* keep the bad bytes for inspection, under a name that frees the step for a new save */
        char aside[96];
        int ar = ckpt_set_aside(o->ckpt_dir, e[i].name, aside, sizeof aside);
        if (ar == 0) LOG_W(TAG, "set %s aside as %s/%s", path, o->ckpt_dir, aside);
        else {
            /* an older snapshot would be restored, and this run would then save the corrupt
             * one's step again under the name it still has: stop here, with the cause */
            LOG_E(TAG, "cannot set the corrupt snapshot %s aside: %s; not resuming from an older "
                  "one (its step would be saved again under that name): make %s writable, or "
                  "move the snapshot away, and restart", path, strerror(-ar), o->ckpt_dir);
            result = 1;
            break;
        }
        /* the S3 copy of the same step, when there is one (DESIGN I1) */
        r3 = try_s3_from(s, e3, &k3, e[i].step, 1, lines, &bad, earlier, &fatal);
        if (r3 >= 0) {
            result = r3;
            *resumed = r3 == 0;
        }
    }
    /* S3 snapshots older than every local one */
    if (result < 0 && !fatal && !try_memory_between(s, -1, e3, k3, &mem_below, &fatal, &result, resumed)) {
        int r3 = try_s3_from(s, e3, &k3, 0, 1, lines, &bad, earlier, &fatal);
        if (r3 >= 0) {
            result = r3;
            *resumed = r3 == 0;
        }
    }
    /* memory snapshots older than every other candidate, which all failed */
    if (result < 0 && !fatal) try_memory_between(s, -1, NULL, 0, &mem_below, &fatal, &result, resumed);
    if (result < 0 && fatal) result = 1;
    free(e3);
    if (result < 0 && bad + earlier > 0 && !o->allow_fresh_start) {
        /* snapshots existed and none could be restored: starting from step 0 silently would
         * lose the run's work; an input error (DESIGN I8), a restart would find the same */
        LOG_E(TAG, "refusing to start from step 0: %s holds %zu snapshot%s and none can be "
              "restored:", o->ckpt_dir, bad + earlier, bad + earlier == 1 ? "" : "s");
        for (size_t i = 0; i < bad + earlier; i++) LOG_E(TAG, "  %s", lines[i]);
        LOG_E(TAG, "inspect them with ckpt-inspect verify; pass --allow-fresh-start to train from "
              "step 0 anyway, or --resume PATH to choose one");
        result = 2;
    }
    free(lines);
    free(e);
    if (result < 0) {
        if (bad + earlier > 0)
            LOG_W(TAG, "no restorable snapshot in %s: fresh start as --allow-fresh-start permits "
                  "(run %s)", o->ckpt_dir, s->run_id);
        else
            LOG_I(TAG, "no usable snapshot in %s: fresh start (run %s)", o->ckpt_dir, s->run_id);
        result = 0;
    }
    return result;
}

/* Every rank, after a restore from S3: leave a verified local copy in --ckpt-dir so that the
 * next restart is local. Each rank fetches the data files f with f % W == rank into one temp
 * folder, every chunk checked; when all succeeded rank 0 writes the manifest and renames the
 * folder to its step name. A failure is logged and costs nothing but the copy (the next
 * restart restores from S3 again). Collective. Returns 0, or -EIO when a collective failed. */
static int local_copy(state *s, const char *url)
{
    const options *o = s->o;
    double t0 = clock_now_s();
    char why[600] = "", tmp[CKPT_PATH_MAX] = "", d[32];
    ckpt_snapshot *snap = NULL;
    objstore_opts so;
    train_s3_store_opts(o, &so);
    int rc = ckpt_snapshot_open_any(&snap, url, &so, why, sizeof why);
    if (rc == 0) {
        ckpt_step_dirname(ckpt_snapshot_step(snap), d, sizeof d);
        s3_copy_dir(s, ckpt_snapshot_step(snap), ckpt_snapshot_run_id(snap), tmp, sizeof tmp);
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) {
            rc = -errno;
            snprintf(why, sizeof why, "cannot create %s: %s", tmp, strerror(errno));
        }
    }
    uint64_t fetched = 0;
    if (rc == 0) rc = ckpt_s3_copy_files(snap, tmp, (uint32_t)s->rank, (uint32_t)s->world,
                                         &fetched, why, sizeof why);
    if (rc < 0 && s->world > 1) LOG_W(TAG, "local copy of %s: %s", url, why[0] ? why : strerror(-rc));
    int comm_err = 0, who = 0;
    int all = agree(s, rc, &comm_err, &who);
    if (comm_err) {
        ckpt_snapshot_close(snap);
        return -EIO;
    }
    if (s->rank == 0) {
        if (all == 0) {
            all = ckpt_s3_commit_local(snap, tmp, o->ckpt_dir);
            if (all == 0)
                LOG_I(TAG, "left a verified local copy of %s in %s/%s (%.0f ms; rank 0 fetched "
                      "%" PRIu64 " bytes again, the rest came from the restore's reads): the next "
                      "restart is local", url, o->ckpt_dir, d, (clock_now_s() - t0) * 1e3, fetched);
            else
                LOG_W(TAG, "no local copy of %s: the commit in %s failed: %s", url, o->ckpt_dir,
                      strerror(-all));
        } else {
            LOG_W(TAG, "no local copy of %s (rank %d: %s); training goes on, a restart restores "
                  "from S3 again", url, who, who == 0 && why[0] ? why : strerror(-all));
        }
        if (all != 0 && tmp[0]) store_remove_tree(tmp);
    }
    ckpt_snapshot_close(snap);
    return 0;
}

static int resume_all(state *s);

/* Every rank: the resume decided by rank 0 (collective). Returns 0, 1 or 2 (exit status). */
int train_resume(state *s)
{
    int status = resume_all(s);
    train_memremote_close(s);
    return status;
}

static int resume_all(state *s)
{
    char why[600];
    fresh_start(s);
    resume_msg m;
    int status;
    if (s->rank == 0) {
        int resumed = 0;
        status = resume_rank0(s, &resumed);
        if (status == 0 && !resumed) {
            /* fresh: a failed load (on this rank, or one the others refused) may have set part
             * of the state, the step and the run id; only the run id of a fresh start stays */
            char keep[64];
            snprintf(keep, sizeof keep, "%s", s->run_id);
            fresh_start(s);
            snprintf(s->run_id, sizeof s->run_id, "%s", keep);
        }
        if (status == 0 && !resumed && set_global_batch(s, wanted_global_batch(s) ?
                                                               wanted_global_batch(s) :
                                                               s->o->micro_batch * s->o->grad_accum * s->world,
                                                           why, sizeof why) < 0) {
            LOG_E(TAG, "%s", why);
            status = 2;
        }
        if (status == 0 && s->o->ckpt_every > 0) status = check_no_later_snapshots(s);
        free(s->s3_list);
        s->s3_list = NULL;
        s->s3_nlist = 0;
        memset(&m, 0, sizeof m);
        m.cmd = CMD_DONE;
        m.status = status;
        m.global_batch = s->global_batch;
        m.resumed = resumed;
        snprintf(m.run_id, sizeof m.run_id, "%s", s->run_id);
        m.from_s3 = status == 0 && resumed && s->s3_restored[0] && o_ckpt_dir(s);
        if (m.from_s3) snprintf(m.path, sizeof m.path, "%s", s->s3_restored);
        if (s->world > 1) {
            int rc = train_comm_broadcast(s->comm, &m, sizeof m, 0);
            if (rc < 0 && status == 0) {
                train_comm_failed(s, "broadcast of the resume outcome", rc);
                status = 1;
            }
        }
        if (status == 0 && m.from_s3 && local_copy(s, m.path) < 0) status = 1;
        return status;
    }
    for (;;) {
        int rc = train_comm_broadcast(s->comm, &m, sizeof m, 0);
        if (rc < 0) {
            train_comm_failed(s, "waiting for rank 0's resume plan", rc);
            return 1;
        }
        m.path[sizeof m.path - 1] = '\0';
        m.run_id[sizeof m.run_id - 1] = '\0';
        if (m.cmd == CMD_DONE) break;
        int fatal = 0;
        load_snapshot(s, m.path, why, sizeof why, &fatal);
        if (fatal) return 1;
    }
    if (m.status != 0) return m.status;
    if (!m.resumed) {
        fresh_start(s);
        if (set_global_batch(s, m.global_batch, why, sizeof why) < 0) {
            LOG_E(TAG, "%s", why);
            return 2;
        }
    }
    snprintf(s->run_id, sizeof s->run_id, "%s", m.run_id);
    if (m.from_s3) {
        snprintf(s->s3_restored, sizeof s->s3_restored, "%s", m.path);
        if (local_copy(s, m.path) < 0) return 1;
    }
    return 0;
}
