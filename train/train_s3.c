/* train_s3.c - the S3 tier of the train program: store handles, the start-up check of the
 * bucket, the uploader and its events (see train_internal.h). */
#include "ckpt_s3.h"
#include "clock.h"
#include "log.h"
#include "objstore.h"
#include "train_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TAG "s3"

void train_s3_store_opts(const options *o, objstore_opts *so)
{
    *so = (objstore_opts)OBJSTORE_OPTS_INIT;
    so->url = o->s3;
    so->signature = o->s3_signature;
    so->request_timeout_s = o->s3_timeout;
    so->max_attempts = o->s3_attempts;
}

int train_s3_open(state *s)
{
    const options *o = s->o;
    objstore_opts so;
    train_s3_store_opts(o, &so);
    char why[400] = "";
    int rc = objstore_open(&s->s3_read, &so, why, sizeof why);
    if (rc == 0) rc = objstore_open(&s->s3_up, &so, why, sizeof why);
    if (rc < 0) {
        LOG_E(TAG, "--s3 %s: %s", o->s3, why[0] ? why : strerror(-rc));
        return rc == -ENOMEM ? 1 : 2;
    }
    /* the credentials and the bucket, before the first step: a listing of the prefix, on a
     * handle of its own with short limits (at most 2 attempts of 10 s), so that a server that
     * does not answer delays the start by seconds, not by the uploads' patience */
    char pfx[1100];
    const char *p = objstore_prefix(s->s3_read);
    snprintf(pfx, sizeof pfx, "%s%s", p, *p ? "/" : "");
    objstore_entry *e = NULL;
    size_t n = 0;
    double t0 = clock_now_s();
    objstore_opts po = so;
    po.request_timeout_s = so.request_timeout_s < 10 ? so.request_timeout_s : 10;
    po.connect_timeout_s = 5;
    po.max_attempts = so.max_attempts < 2 ? so.max_attempts : 2;
    objstore *probe = NULL;
    rc = objstore_open(&probe, &po, why, sizeof why);
    if (rc == 0) {
        LOG_D(TAG, "checking %s at %s", o->s3, objstore_endpoint(probe));
        rc = objstore_list(probe, pfx, "/", &e, &n, 0, why, sizeof why);
    }
    objstore_entries_free(e, n);
    objstore_close(probe);
    if (rc == -EACCES || rc == -ENXIO || rc == -EINVAL) {
        LOG_E(TAG, "--s3 %s: %s", o->s3, why[0] ? why : strerror(-rc));
        return 2; /* wrong keys, no such bucket: a restart would find the same (DESIGN I8) */
    }
    if (rc < 0) {
        /* an outage: training goes on, the uploads retry; a resume that needs the bucket
         * finds out on its own */
        LOG_W(TAG, "--s3 %s: the bucket cannot be reached now (%s, after %.1f s); training goes "
              "on, uploads will retry%s", o->s3, why[0] ? why : strerror(-rc), clock_now_s() - t0,
              o->resume && !strcmp(o->resume, "auto") ? ", and --resume auto does not look at "
              "the bucket this time" : "");
        s->s3_down = 1;
        return 0;
    }
    if (s->rank == 0)
        LOG_I(TAG, "S3 tier: %s at %s (signature %s), reachable (%.0f ms)", o->s3,
              objstore_endpoint(s->s3_read), objstore_signature(s->s3_read) == OBJSTORE_SIG_V2 ?
              "v2" : "v4", (clock_now_s() - t0) * 1e3);
    return 0;
}

int train_s3_vote_create(state *s, const char *host, int port, const char *token,
                         const char *gen)
{
    char vprefix[160];
    snprintf(vprefix, sizeof vprefix, "g%s/s3/%s", gen && *gen ? gen : "0", s->job_tag);
    int rc = train_vote_create(&s->s3_vote, &s->s3_group, host, port, token, 60.0, vprefix,
                               s->job_tag, s->rank, s->world, s->o->s3_snapshot_timeout);
    if (rc < 0)
        LOG_E(TAG, "rank %d cannot open the upload confirmation channel: %s", s->rank, strerror(-rc));
    return rc;
}

/* "step N", or "none" while S3 holds no complete snapshot (remote_step -1) */
static const char *remote_step_name(int64_t remote_step, char *buf, size_t len)
{
    if (remote_step < 0) return "none";
    snprintf(buf, len, "step %" PRId64, remote_step);
    return buf;
}

static void on_event(void *ctx, const ckpt_upload_event *ev)
{
    state *s = ctx;
    char nb[32];
    switch (ev->kind) {
    case CKPT_UPLOAD_DONE:
        if (s->rank == 0)
            LOG_I(TAG, "step %" PRIu64 " is on S3 (%s): %.2f MiB from this rank in %.2f s "
                  "(%.1f MiB/s), %u requests, %u retries; lag %" PRIu64 " steps, %.0f s", ev->step,
                  s->o->s3, (double)ev->bytes / 1048576.0, ev->seconds,
                  ev->seconds > 0 ? (double)ev->bytes / 1048576.0 / ev->seconds : 0.0, ev->requests,
                  ev->retries, ev->lag_steps, ev->lag_seconds);
        else
            LOG_D(TAG, "step %" PRIu64 ": objects uploaded (%.2f MiB, %.2f s, %u retries)", ev->step,
                  (double)ev->bytes / 1048576.0, ev->seconds, ev->retries);
        train_report_upload(s->report, "done", (int64_t)ev->step, ev->bytes, ev->seconds, 0,
                            ev->lag_steps, ev->lag_seconds, ev->remote_step);
        break;
    case CKPT_UPLOAD_FAILED:
        LOG_W(TAG, "upload of step %" PRIu64 " failed after %.1f s (%u requests, %u retries): %s; "
              "the local snapshot is intact, the next one will be tried", ev->step, ev->seconds,
              ev->requests, ev->retries, ev->why ? ev->why : strerror(-ev->result));
        train_report_upload(s->report, "failed", (int64_t)ev->step, ev->bytes, ev->seconds,
                            ev->result, ev->lag_steps, ev->lag_seconds, ev->remote_step);
        break;
    case CKPT_UPLOAD_SKIPPED:
        train_report_upload(s->report, "skipped", (int64_t)ev->step, 0, 0, ev->result,
                            ev->lag_steps, ev->lag_seconds, ev->remote_step);
        break;
    case CKPT_UPLOAD_LAG:
        LOG_W(TAG, "S3 lags behind: the oldest snapshot not yet on S3 was committed %.0f s ago "
              "(%" PRIu64 " steps behind; newest complete on S3: %s); threshold "
              "--s3-lag-warn %.0f s", ev->lag_seconds, ev->lag_steps,
              remote_step_name(ev->remote_step, nb, sizeof nb), s->o->s3_lag_warn);
        break;
    }
}

int train_s3_start(state *s)
{
    const options *o = s->o;
    if (!o->s3 || o->ckpt_every <= 0) return 0;
    ckpt_uploader_opts uo = {0};
    uo.os = s->s3_up;
    uo.dir = o->ckpt_dir;
    uo.group = s->world > 1 ? &s->s3_group : NULL;
    uo.part_bytes = o->s3_part_bytes;
    uo.backlog = o->s3_backlog;
    uo.keep_last = s->rank == 0 ? o->s3_keep_last : 0;
    uo.run_id = s->run_id;
    uo.snapshot_timeout_s = o->s3_snapshot_timeout;
    uo.lag_warn_s = o->s3_lag_warn;
    char state_file[CKPT_PATH_MAX];
    snprintf(state_file, sizeof state_file, "%s/%s", o->ckpt_dir, CKPT_UPLOAD_STATE_NAME);
    uo.state_file = s->rank == 0 ? state_file : NULL;
    uo.remote_step = s->rank == 0 ? s->s3_newest : -1;
    uo.on_event = on_event;
    uo.ctx = s;
    int rc = ckpt_uploader_create(&s->uploader, &uo);
    if (rc < 0) LOG_E(TAG, "cannot start the S3 uploader: %s", strerror(-rc));
    return rc;
}

void train_s3_on_commit(void *ctx, uint64_t step)
{
    state *s = ctx;
    if (s->uploader) ckpt_uploader_submit(s->uploader, step, (double)time(NULL));
}

void train_s3_finish(state *s, int drain)
{
    if (s->uploader) {
        double t = s->o->s3_drain_timeout, t0 = clock_now_s(), end = t0 + t, said = t0;
        int rc = 0, interrupted = 0;
        const sig_atomic_t stops = train_stop_count;
        /* in slices, each followed by a report line: a launcher's hang watchdog sees the
         * rank alive while the last uploads finish; another stop signal ends the wait */
        while (drain && t > 0 && (rc = ckpt_uploader_drain(s->uploader, end - clock_now_s() < 1 ?
                                                          end - clock_now_s() : 1)) == -ETIMEDOUT &&
               clock_now_s() < end) {
            train_report_uploads_draining(s->report, s->step);
            if (train_stop_count != stops) {
                interrupted = 1;
                break;
            }
            if (clock_now_s() - said >= 10 && s->rank == 0) {
                char pend[200];
                ckpt_uploader_pending(s->uploader, pend, sizeof pend);
                LOG_I(TAG, "waiting for the uploads of %s (%.0f s so far, at most %.0f s more; "
                      "another SIGTERM/SIGINT stops waiting)", pend, clock_now_s() - t0,
                      end - clock_now_s());
                said = clock_now_s();
            }
        }
        if (drain && t > 0 && rc == -ETIMEDOUT) {
            char pend[200];
            ckpt_uploader_pending(s->uploader, pend, sizeof pend);
            LOG_W(TAG, "%s: not uploaded: %s (the local snapshots are intact; a later run with "
                  "--s3 does not upload them)", pend,
                  interrupted ? "a second stop request ended the wait"
                              : "--s3-drain-timeout passed");
        }
        ckpt_upload_stats st;
        char nb[32];
        ckpt_uploader_stats(s->uploader, &st);
        ckpt_uploader_destroy(s->uploader);
        s->uploader = NULL;
        if (s->rank == 0)
            LOG_I(TAG, "S3 uploads: %" PRIu64 " complete, %" PRIu64 " failed, %" PRIu64 " skipped; "
                  "newest on S3: %s; lag %" PRIu64 " steps", st.uploaded, st.failed, st.skipped,
                  remote_step_name(st.remote_step, nb, sizeof nb), st.lag_steps);
    }
    objstore_close(s->s3_up);
    objstore_close(s->s3_read);
    s->s3_up = s->s3_read = NULL;
    train_vote_free(s->s3_vote);
    s->s3_vote = NULL;
}
