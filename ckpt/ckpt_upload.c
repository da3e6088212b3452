/* The background uploader of committed snapshots to S3 (ckpt_s3.h, "the uploader"). */
#include "ckpt_s3.h"
#include "ckpt_internal.h"
#include "clock.h"
#include "log.h"
#include "storage.h"
#include "thread.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TAG "s3"
#define MAX_BACKLOG 64u
#define HISTORY 128u /* steps kept in the state file and for the lag */

typedef struct job {
    uint64_t step;
    double committed_unix;
    double submitted;   /* clock_now_s */
    int fd;             /* this rank's data file, opened at submit */
    uint64_t size;
    char *manifest;     /* rank 0: the manifest text */
    size_t manifest_len;
} job;

typedef struct record {
    uint64_t step;
    double committed_unix;
    int state;          /* 0 pending, CKPT_UPLOAD_DONE / _FAILED / _SKIPPED */
    double unix_done;
    uint64_t bytes;
    double seconds;
    char why[200];
} record;

struct ckpt_uploader {
    ckpt_uploader_opts o;
    char dir[CKPT_PATH_MAX];
    char run_id[64];
    char state_file[CKPT_PATH_MAX];
    uint32_t rank, world;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv, cv_idle;
    job waiting[MAX_BACKLOG];
    unsigned nwaiting;
    uint64_t skipped_steps[MAX_BACKLOG]; /* dropped, their votes still to send (thread) */
    unsigned nskipped_pending;
    int busy, stop;
    uint64_t busy_step;
    ckpt_upload_stats st;
    record hist[HISTORY]; /* rank 0: recent commits, oldest first */
    unsigned nhist;
    int lag_warned;
};

static void job_free(job *j)
{
    if (j->fd >= 0) close(j->fd);
    j->fd = -1;
    free(j->manifest);
    j->manifest = NULL;
}

/* ------------------------------------------------------------------ rank 0's bookkeeping */

static record *hist_find(ckpt_uploader *u, uint64_t step)
{
    for (unsigned i = 0; i < u->nhist; i++)
        if (u->hist[i].step == step) return &u->hist[i];
    return NULL;
}

static void hist_add(ckpt_uploader *u, uint64_t step, double committed_unix)
{
    if (hist_find(u, step)) return;
    if (u->nhist == HISTORY) {
        memmove(u->hist, u->hist + 1, (HISTORY - 1) * sizeof *u->hist);
        u->nhist--;
    }
    record *r = &u->hist[u->nhist++];
    memset(r, 0, sizeof *r);
    r->step = step;
    r->committed_unix = committed_unix;
}

/* Lag (under mu): newest local commit vs newest complete on S3. */
static void update_lag(ckpt_uploader *u)
{
    uint64_t newest = 0;
    double oldest_missing = 0;
    int any = 0;
    for (unsigned i = 0; i < u->nhist; i++) {
        const record *r = &u->hist[i];
        if (!any || r->step > newest) newest = r->step;
        any = 1;
        if ((u->st.remote_step < 0 || r->step > (uint64_t)u->st.remote_step) &&
            (oldest_missing == 0 || r->committed_unix < oldest_missing))
            oldest_missing = r->committed_unix;
    }
    if (!any) return;
    u->st.lag_steps = u->st.remote_step < 0 ? newest
                      : newest > (uint64_t)u->st.remote_step ? newest - (uint64_t)u->st.remote_step : 0;
    double now = (double)time(NULL);
    u->st.lag_seconds = oldest_missing > 0 && now > oldest_missing ? now - oldest_missing : 0;
}

/* Replace the state file (rank 0): what ckpt-inspect list shows. Under mu. */
static void write_state(ckpt_uploader *u)
{
    if (!u->state_file[0]) return;
    json_t *steps = json_array();
    for (unsigned i = 0; steps && i < u->nhist; i++) {
        const record *r = &u->hist[i];
        const char *st = r->state == CKPT_UPLOAD_DONE ? "uploaded"
                         : r->state == CKPT_UPLOAD_FAILED ? "failed"
                         : r->state == CKPT_UPLOAD_SKIPPED ? "skipped" : "pending";
        json_t *o = json_pack("{s:I,s:s,s:I}", "step", (json_int_t)r->step, "state", st,
                              "committed_unix", (json_int_t)r->committed_unix);
        if (!o) continue;
        if (r->state == CKPT_UPLOAD_DONE) {
            json_object_set_new(o, "uploaded_unix", json_integer((json_int_t)r->unix_done));
            json_object_set_new(o, "bytes", json_integer((json_int_t)r->bytes));
            json_object_set_new(o, "seconds", json_real(r->seconds));
        }
        if (r->why[0]) json_object_set_new(o, "why", json_string(r->why));
        json_array_append_new(steps, o);
    }
    char url[CKPT_PATH_MAX];
    const char *p = objstore_prefix(u->o.os);
    snprintf(url, sizeof url, "s3://%s%s%s", objstore_bucket(u->o.os), *p ? "/" : "", p);
    json_t *doc = json_pack("{s:s,s:i,s:s,s:I,s:I,s:I,s:f,s:I,s:I,s:I,s:o}",
                            "format", "ckptsys.upload-state", "format_version", 1, "url", url,
                            "updated_unix", (json_int_t)time(NULL),
                            "remote_step", (json_int_t)u->st.remote_step,
                            "lag_steps", (json_int_t)u->st.lag_steps, "lag_seconds", u->st.lag_seconds,
                            "uploaded", (json_int_t)u->st.uploaded, "failed", (json_int_t)u->st.failed,
                            "skipped", (json_int_t)u->st.skipped, "steps", steps ? steps : json_array());
    char *text = doc ? json_dumps(doc, JSON_INDENT(1) | JSON_ENSURE_ASCII) : NULL;
    json_decref(doc);
    if (!text) return;
    char tmp[CKPT_PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.tmp", u->state_file);
    unlink(tmp);
    int rc = store_write_file_durable(tmp, text, strlen(text));
    if (rc == 0 && rename(tmp, u->state_file) != 0) rc = -errno;
    if (rc < 0) LOG_W(TAG, "cannot write the upload state %s: %s", u->state_file, strerror(-rc));
    free(text);
}

static void emit(ckpt_uploader *u, ckpt_upload_event *ev)
{
    pthread_mutex_lock(&u->mu);
    ev->lag_steps = u->st.lag_steps;
    ev->lag_seconds = u->st.lag_seconds;
    ev->remote_step = u->st.remote_step;
    pthread_mutex_unlock(&u->mu);
    if (u->o.on_event) u->o.on_event(u->o.ctx, ev);
}

/* Rank 0: record an outcome, recompute the lag, write the state, warn on lag. */
static void account(ckpt_uploader *u, uint64_t step, int state, uint64_t bytes, double secs,
                    const char *why)
{
    if (u->rank != 0) return;
    pthread_mutex_lock(&u->mu);
    record *r = hist_find(u, step);
    if (r) {
        r->state = state;
        r->unix_done = (double)time(NULL);
        r->bytes = bytes;
        r->seconds = secs;
        snprintf(r->why, sizeof r->why, "%s", why ? why : "");
    }
    if (state == CKPT_UPLOAD_DONE && (u->st.remote_step < 0 || step > (uint64_t)u->st.remote_step))
        u->st.remote_step = (int64_t)step;
    update_lag(u);
    write_state(u);
    int warn = 0;
    if (u->st.lag_seconds > u->o.lag_warn_s && !u->lag_warned) warn = u->lag_warned = 1;
    else if (u->st.lag_seconds <= u->o.lag_warn_s) u->lag_warned = 0;
    pthread_mutex_unlock(&u->mu);
    if (warn) {
        ckpt_upload_event ev = {.kind = CKPT_UPLOAD_LAG, .step = step};
        emit(u, &ev);
    }
}

/* ------------------------------------------------------------------ one snapshot */

static int upload_objects(ckpt_uploader *u, job *j, double deadline_s, unsigned *requests,
                          unsigned *retries, char *why, size_t why_len)
{
    char name[32];
    ckpt_rank_filename(u->rank, name, sizeof name);
    uint64_t pb = u->o.part_bytes;
    uint64_t np = j->size <= pb ? 1 : (j->size + pb - 1) / pb;
    if (np > 99999) {
        log_why(why, why_len, "step %" PRIu64 ": %s of %" PRIu64 " bytes needs %" PRIu64 " objects "
                "of %" PRIu64 " bytes, more than the key layout allows (99999); raise the part size",
                j->step, name, j->size, np, pb);
        return -EFBIG;
    }
    /* a manifest object left by an earlier attempt at this step would describe other bytes
     * while these are overwritten: remove it first (case C32) */
    char mkey[1100];
    int rc = ckpt_s3_object_key(u->o.os, j->step, "manifest.json", 0, 1, mkey, sizeof mkey);
    if (rc < 0) return rc;
    objstore_op del = {.kind = OBJSTORE_DELETE, .key = mkey};
    rc = objstore_run(u->o.os, &del, 1, deadline_s);
    *requests += 1;
    *retries += del.attempts > 1 ? del.attempts - 1 : 0;
    if (rc < 0) {
        log_why(why, why_len, "%s", del.why);
        return rc;
    }
    objstore_op *ops = calloc((size_t)np, sizeof *ops);
    char (*keys)[1100] = calloc((size_t)np, sizeof *keys);
    if (!ops || !keys) {
        free(ops);
        free(keys);
        return -ENOMEM;
    }
    for (uint64_t p = 0; p < np && rc == 0; p++) {
        rc = ckpt_s3_object_key(u->o.os, j->step, name, (uint32_t)p, (uint32_t)np, keys[p],
                                sizeof keys[p]);
        ops[p].kind = OBJSTORE_PUT;
        ops[p].key = keys[p];
        ops[p].put_fd = j->fd;
        ops[p].put_offset = p * pb;
        ops[p].put_len = np == 1 ? j->size : (p + 1 < np ? pb : j->size - p * pb);
    }
    if (rc == 0) {
        rc = objstore_run(u->o.os, ops, (size_t)np, deadline_s);
        for (uint64_t p = 0; p < np; p++) {
            *requests += 1;
            *retries += ops[p].attempts > 1 ? ops[p].attempts - 1 : 0;
        }
        for (uint64_t p = 0; rc < 0 && p < np; p++)
            if (ops[p].rc < 0) {
                log_why(why, why_len, "%s", ops[p].why);
                break;
            }
    }
    free(ops);
    free(keys);
    return rc;
}

static void upload_one(ckpt_uploader *u, job *j)
{
    double t0 = clock_now_s();
    double deadline = u->o.snapshot_timeout_s;
    unsigned requests = 0, retries = 0;
    char why[400] = "";
    int rc = upload_objects(u, j, deadline, &requests, &retries, why, sizeof why);
    if (rc == 0) ckpt_fault_point("mid-upload", j->step);
    const ckpt_group *g = u->o.group;
    if (u->rank != 0) {
        if (g) g->vote(g->ctx, j->step, rc);
    } else {
        if (rc == 0 && g && u->world > 1) {
            double left = deadline - (clock_now_s() - t0);
            rc = g->collect(g->ctx, j->step, left > 1 ? left : 1);
            if (rc < 0)
                log_why(why, sizeof why, "step %" PRIu64 ": not every rank uploaded its objects "
                        "(%s%s)", j->step, strerror(-rc),
                        rc == -ECANCELED ? ": a rank dropped it from a full backlog" : "");
        }
        if (rc == 0) {
            char mkey[1100];
            char pbs[32];
            rc = ckpt_s3_object_key(u->o.os, j->step, "manifest.json", 0, 1, mkey, sizeof mkey);
            snprintf(pbs, sizeof pbs, "%" PRIu64, u->o.part_bytes);
            objstore_op op = {.kind = OBJSTORE_PUT, .key = mkey, .put_data = j->manifest,
                              .put_len = j->manifest_len, .meta_name = "ckpt-part-bytes"};
            snprintf(op.meta_value, sizeof op.meta_value, "%s", pbs);
            double left = deadline - (clock_now_s() - t0);
            if (rc == 0) rc = objstore_run(u->o.os, &op, 1, left > 1 ? left : 1);
            requests++;
            retries += op.attempts > 1 ? op.attempts - 1 : 0;
            if (rc < 0) log_why(why, sizeof why, "%s", op.why);
        }
        if (g && u->world > 1) g->decide(g->ctx, j->step, rc);
    }
    double secs = clock_now_s() - t0;
    pthread_mutex_lock(&u->mu);
    if (rc == 0) {
        u->st.uploaded++;
        u->st.bytes += j->size + (u->rank == 0 ? j->manifest_len : 0);
    } else {
        u->st.failed++;
    }
    pthread_mutex_unlock(&u->mu);
    account(u, j->step, rc == 0 ? CKPT_UPLOAD_DONE : CKPT_UPLOAD_FAILED, j->size, secs,
            rc == 0 ? NULL : why);
    if (rc == 0 && u->rank == 0 && u->o.keep_last > 0) {
        char w[320] = "";
        int r = ckpt_s3_retain(u->o.os, u->o.keep_last, u->run_id[0] ? u->run_id : NULL, w, sizeof w);
        if (r < 0) LOG_W(TAG, "remote retention failed: %s", w[0] ? w : strerror(-r));
    }
    ckpt_upload_event ev = {.kind = rc == 0 ? CKPT_UPLOAD_DONE : CKPT_UPLOAD_FAILED,
                            .step = j->step, .bytes = j->size, .seconds = secs,
                            .requests = requests, .retries = retries, .result = rc,
                            .why = rc == 0 ? NULL : why};
    emit(u, &ev);
}

/* Votes of dropped snapshots (thread; outside mu). */
static void flush_skipped(ckpt_uploader *u)
{
    for (;;) {
        pthread_mutex_lock(&u->mu);
        if (u->nskipped_pending == 0) {
            pthread_mutex_unlock(&u->mu);
            return;
        }
        uint64_t step = u->skipped_steps[0];
        memmove(u->skipped_steps, u->skipped_steps + 1, (u->nskipped_pending - 1) * sizeof(uint64_t));
        u->nskipped_pending--;
        pthread_mutex_unlock(&u->mu);
        const ckpt_group *g = u->o.group;
        if (g && u->world > 1) {
            if (u->rank != 0) g->vote(g->ctx, step, -ECANCELED);
            else g->decide(g->ctx, step, -ECANCELED);
        }
    }
}

static void *upload_main(void *arg)
{
    ckpt_uploader *u = arg;
    struct timespec ts;
    for (;;) {
        flush_skipped(u);
        pthread_mutex_lock(&u->mu);
        while (!u->nwaiting && !u->nskipped_pending && !u->stop) {
            ckpt_deadline(&ts, 1.0);
            pthread_cond_timedwait(&u->cv, &u->mu, &ts);
        }
        if (u->stop) {
            pthread_mutex_unlock(&u->mu);
            break;
        }
        if (!u->nwaiting) {
            pthread_mutex_unlock(&u->mu);
            continue;
        }
        /* the newest first: it is the one a restart would want; older ones follow when
         * there is time, or are dropped when the backlog fills */
        job j = u->waiting[--u->nwaiting];
        u->busy = 1;
        u->busy_step = j.step;
        pthread_mutex_unlock(&u->mu);
        upload_one(u, &j);
        job_free(&j);
        pthread_mutex_lock(&u->mu);
        u->busy = 0;
        pthread_cond_broadcast(&u->cv_idle);
        pthread_mutex_unlock(&u->mu);
    }
    flush_skipped(u);
    return NULL;
}

/* ------------------------------------------------------------------ public */

int ckpt_uploader_create(ckpt_uploader **out, const ckpt_uploader_opts *opts)
{
    if (!out || !opts || !opts->os || !opts->dir) return -EINVAL;
    *out = NULL;
    ckpt_uploader *u = calloc(1, sizeof *u);
    if (!u) return -ENOMEM;
    u->o = *opts;
    if (!u->o.part_bytes) u->o.part_bytes = CKPT_S3_PART_BYTES_DEFAULT;
    if (!u->o.backlog) u->o.backlog = 2;
    if (u->o.snapshot_timeout_s <= 0) u->o.snapshot_timeout_s = 1800;
    if (u->o.lag_warn_s <= 0) u->o.lag_warn_s = 1800;
    if (u->o.part_bytes < CKPT_S3_PART_BYTES_MIN || u->o.part_bytes > CKPT_S3_PART_BYTES_MAX ||
        u->o.backlog > MAX_BACKLOG || strlen(opts->dir) >= sizeof u->dir ||
        (opts->state_file && strlen(opts->state_file) >= sizeof u->state_file) ||
        (opts->group && (opts->group->world_size < 1 || opts->group->rank >= opts->group->world_size))) {
        free(u);
        return -EINVAL;
    }
    snprintf(u->dir, sizeof u->dir, "%s", opts->dir);
    if (opts->run_id) snprintf(u->run_id, sizeof u->run_id, "%s", opts->run_id);
    if (opts->state_file) snprintf(u->state_file, sizeof u->state_file, "%s", opts->state_file);
    u->o.dir = u->dir;
    u->o.run_id = NULL;
    u->o.state_file = NULL;
    u->rank = opts->group ? opts->group->rank : 0;
    u->world = opts->group ? opts->group->world_size : 1;
    u->st.remote_step = opts->remote_step >= 0 ? opts->remote_step : -1;
    pthread_mutex_init(&u->mu, NULL);
    pthread_cond_init(&u->cv, NULL);
    pthread_cond_init(&u->cv_idle, NULL);
    if (common_thread_start(&u->thread, upload_main, u) != 0) {
        pthread_mutex_destroy(&u->mu);
        pthread_cond_destroy(&u->cv);
        pthread_cond_destroy(&u->cv_idle);
        free(u);
        return -ENOMEM;
    }
    *out = u;
    return 0;
}

int ckpt_uploader_submit(ckpt_uploader *u, uint64_t step, double committed_unix)
{
    if (!u) return -EINVAL;
    job j = {.step = step, .committed_unix = committed_unix, .submitted = clock_now_s(), .fd = -1};
    char d[32], name[32], path[CKPT_PATH_MAX];
    ckpt_step_dirname(step, d, sizeof d);
    ckpt_rank_filename(u->rank, name, sizeof name);
    int rc = snprintf(path, sizeof path, "%s/%s/%s", u->dir, d, name) >= (int)sizeof path ? -ENAMETOOLONG : 0;
    struct stat st;
    if (rc == 0) {
        int fd = store_open_regular(path, STORE_NOFOLLOW, 0, &st);
        if (fd < 0) rc = fd;
        else {
            j.fd = fd;
            j.size = (uint64_t)st.st_size;
        }
    }
    if (rc == 0 && u->rank == 0) {
        if (snprintf(path, sizeof path, "%s/%s/manifest.json", u->dir, d) >= (int)sizeof path)
            rc = -ENAMETOOLONG;
        if (rc == 0) rc = store_read_file(path, CKPT_MAX_MANIFEST_BYTES, STORE_NOFOLLOW, &j.manifest, &j.manifest_len);
    }
    if (u->rank == 0) {
        pthread_mutex_lock(&u->mu);
        hist_add(u, step, committed_unix);
        update_lag(u);
        pthread_mutex_unlock(&u->mu);
    }
    if (rc < 0) {
        LOG_E(TAG, "step %" PRIu64 ": cannot read %s for the upload: %s", step, path, strerror(-rc));
        job_free(&j);
        pthread_mutex_lock(&u->mu);
        u->st.failed++;
        if (u->nskipped_pending < MAX_BACKLOG) u->skipped_steps[u->nskipped_pending++] = step;
        pthread_cond_signal(&u->cv);
        pthread_mutex_unlock(&u->mu);
        account(u, step, CKPT_UPLOAD_FAILED, 0, 0, "cannot read the local snapshot");
        return rc;
    }
    int dropped = 0;
    job old = {.fd = -1};
    pthread_mutex_lock(&u->mu);
    if (u->nwaiting >= u->o.backlog) {
        old = u->waiting[0];
        memmove(u->waiting, u->waiting + 1, (u->nwaiting - 1) * sizeof *u->waiting);
        u->nwaiting--;
        u->st.skipped++;
        if (u->nskipped_pending < MAX_BACKLOG) u->skipped_steps[u->nskipped_pending++] = old.step;
        dropped = 1;
    }
    u->waiting[u->nwaiting++] = j;
    pthread_cond_signal(&u->cv);
    pthread_mutex_unlock(&u->mu);
    if (dropped) {
        LOG_W(TAG, "upload of step %" PRIu64 " skipped: the backlog of %u snapshot%s is full (step %"
              PRIu64 " came); the oldest waiting one is dropped", old.step, u->o.backlog,
              u->o.backlog == 1 ? "" : "s", step);
        account(u, old.step, CKPT_UPLOAD_SKIPPED, 0, 0, "dropped from a full upload backlog");
        ckpt_upload_event ev = {.kind = CKPT_UPLOAD_SKIPPED, .step = old.step, .result = -ECANCELED};
        emit(u, &ev);
        job_free(&old);
    }
    return dropped;
}

int ckpt_uploader_drain(ckpt_uploader *u, double timeout_s)
{
    if (!u) return 0;
    struct timespec ts;
    ckpt_deadline(&ts, timeout_s);
    int rc = 0;
    pthread_mutex_lock(&u->mu);
    while ((u->nwaiting || u->busy) && rc == 0)
        if (pthread_cond_timedwait(&u->cv_idle, &u->mu, &ts) == ETIMEDOUT &&
            (u->nwaiting || u->busy))
            rc = -ETIMEDOUT;
    pthread_mutex_unlock(&u->mu);
    return rc;
}

void ckpt_uploader_pending(ckpt_uploader *u, char *out, size_t len)
{
    if (!out || len == 0) return;
    out[0] = '\0';
    if (!u) return;
    size_t off = 0;
    pthread_mutex_lock(&u->mu);
    unsigned n = u->nwaiting + (u->busy ? 1u : 0u);
    off += (size_t)snprintf(out, len, "%s", n == 0 ? "no snapshot" : n == 1 ? "step" : "steps");
    if (u->busy && off < len)
        off += (size_t)snprintf(out + off, len - off, " %" PRIu64 " (in progress)", u->busy_step);
    for (unsigned i = u->nwaiting; i-- > 0 && off < len;)
        off += (size_t)snprintf(out + off, len - off, "%s %" PRIu64, u->busy || i + 1 < u->nwaiting ?
                                ",": "", u->waiting[i].step);
    pthread_mutex_unlock(&u->mu);
}

void ckpt_uploader_stats(ckpt_uploader *u, ckpt_upload_stats *st)
{
    if (!u || !st) return;
    pthread_mutex_lock(&u->mu);
    *st = u->st;
    pthread_mutex_unlock(&u->mu);
}

void ckpt_uploader_destroy(ckpt_uploader *u)
{
    if (!u) return;
    pthread_mutex_lock(&u->mu);
    u->stop = 1;
    /* what still waits is not uploaded: say so to rank 0 (votes) */
    for (unsigned i = 0; i < u->nwaiting; i++) {
        if (u->nskipped_pending < MAX_BACKLOG) u->skipped_steps[u->nskipped_pending++] = u->waiting[i].step;
        job_free(&u->waiting[i]);
    }
    u->nwaiting = 0;
    pthread_cond_broadcast(&u->cv);
    pthread_mutex_unlock(&u->mu);
    objstore_cancel(u->o.os); /* the store is the uploader's own: end what is in flight */
    pthread_join(u->thread, NULL);
    pthread_mutex_destroy(&u->mu);
    pthread_cond_destroy(&u->cv);
    pthread_cond_destroy(&u->cv_idle);
    free(u);
}
