/* metrics.c - the agent's aggregation of the workers' progress lines into Prometheus series
 * and the goodput report (metrics.h). State lives here, in the agent, for its whole life: a
 * restarted worker starts from nothing, the counters do not. One mutex guards everything; the
 * agent's main thread updates, the HTTP thread renders. */
#include "metrics.h"

#include "log.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TAG "elastic"
#define MAX_SOURCES 4 /* distinct restore sources kept: a worker cannot grow the series set */

/* A gauge that has a value once one was reported. */
typedef struct gauge {
    int set;
    double v;
} gauge;

struct elastic_metrics {
    pthread_mutex_t mu;
    /* the current round */
    int have_round, gen, node_rank, world, first_rank, nlocal;
    unsigned char *up;          /* nlocal entries */
    /* counters: the agent's, never reset */
    uint64_t restarts, committed, fail_stage, fail_persist, skipped, persist_bytes;
    uint64_t uploads_done, uploads_failed, uploads_skipped, upload_bytes;
    uint64_t lines_ok, lines_unknown, lines_malformed;
    uint64_t mem_replica_bytes;
    gauge mem_replica_step;
    /* gauges */
    gauge step, loss, lr, grad_norm, tps, samples, val_loss;
    gauge last_committed, last_commit_time;
    gauge upload_lag_steps, upload_lag_seconds, last_uploaded; /* rank 0's upload lines */
    struct {
        char name[ELASTIC_REPORT_SOURCE_MAX];
        double seconds;
    } restore[MAX_SOURCES];
    int nrestore;
    /* histograms */
    elastic_hist step_seconds, stall_seconds, persist_seconds, mem_stall_seconds, wait_seconds;
    uint64_t mem_failed;      /* memory snapshots that failed (any local rank) */
    gauge mem_step;           /* the node's first rank's newest memory snapshot */
    /* one count per snapshot: the (round, step) last counted */
    int done_gen, stage_fail_gen, upload_gen;
    int64_t done_step, stage_fail_step, upload_step;
    elastic_goodput gp;
    int gp_error_logged;
};

int elastic_metrics_create(elastic_metrics **out, double now)
{
    elastic_metrics *m = calloc(1, sizeof *m);
    if (!m) return -ENOMEM;
    if (pthread_mutex_init(&m->mu, NULL) != 0) {
        free(m);
        return -ENOMEM;
    }
    m->done_gen = m->stage_fail_gen = m->upload_gen = -1;
    m->done_step = m->stage_fail_step = m->upload_step = -1;
    elastic_goodput_ev ev = {ELASTIC_GP_START, now, 0, 0};
    elastic_goodput_add(&m->gp, &ev);
    *out = m;
    return 0;
}

void elastic_metrics_free(elastic_metrics *m)
{
    if (!m) return;
    elastic_goodput_free(&m->gp);
    free(m->up);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static void gp_add(elastic_metrics *m, int kind, double t, int64_t step, double seconds)
{
    elastic_goodput_ev ev = {kind, t, step, seconds};
    if (elastic_goodput_add(&m->gp, &ev) == -ENOMEM && !m->gp_error_logged) {
        m->gp_error_logged = 1;
        LOG_W(TAG, "goodput: out of memory for the step timeline: the report will count lost "
              "steps as a gap");
    }
}

int elastic_metrics_round(elastic_metrics *m, int gen, int node_rank, int world, int first_rank,
                          int nlocal, double now)
{
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    m->have_round = 1;
    m->gen = gen;
    m->node_rank = node_rank;
    m->world = world;
    m->first_rank = first_rank;
    unsigned char *up = nlocal > 0 ? calloc((size_t)nlocal, 1) : NULL;
    free(m->up);
    m->up = up;
    m->nlocal = up ? nlocal : 0;
    if (nlocal > 0 && !up) rc = -ENOMEM;
    gp_add(m, ELASTIC_GP_ROUND, now, 0, 0);
    pthread_mutex_unlock(&m->mu);
    return rc;
}

void elastic_metrics_rank_up(elastic_metrics *m, int local_rank, int up)
{
    pthread_mutex_lock(&m->mu);
    if (local_rank >= 0 && local_rank < m->nlocal) m->up[local_rank] = (unsigned char)!!up;
    pthread_mutex_unlock(&m->mu);
}

static void set(gauge *g, double v)
{
    g->set = 1;
    g->v = v;
}

/* Wall-clock time, seconds since the epoch (a timestamp for dashboards, not a duration). */
static double unix_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t add_sat(uint64_t a, uint64_t b) { return b > UINT64_MAX - a ? UINT64_MAX : a + b; }

/* upload_done, upload_failed, upload_skipped */
static void apply_upload(elastic_metrics *m, int first, const elastic_report_event *ev)
{
    if (ev->kind == ELASTIC_REPORT_UPLOAD_DONE && (ev->has & ELASTIC_RF_BYTES))
        m->upload_bytes = add_sat(m->upload_bytes, ev->bytes); /* every local rank's PUTs */
    if (!first) return;
    if (m->first_rank == 0) {
        /* the lag keys are rank 0's view; the other ranks write placeholders (0, -1) */
        if (ev->has & ELASTIC_RF_LAG_STEPS) set(&m->upload_lag_steps, (double)ev->lag_steps);
        if (ev->has & ELASTIC_RF_LAG_SECONDS) set(&m->upload_lag_seconds, ev->lag_seconds);
        /* -1: nothing on S3 yet in the trainer's view (a restarted trainer's uploader starts
         * from -1 again): the newest complete step seen is kept, like the last commit */
        if ((ev->has & ELASTIC_RF_REMOTE_STEP) && ev->remote_step >= 0 &&
            (!m->last_uploaded.set || (double)ev->remote_step > m->last_uploaded.v))
            set(&m->last_uploaded, (double)ev->remote_step);
    }
    /* one outcome per snapshot: the same report twice counts once */
    if (m->upload_gen == m->gen && m->upload_step == ev->step) return;
    m->upload_gen = m->gen;
    m->upload_step = ev->step;
    if (ev->kind == ELASTIC_REPORT_UPLOAD_DONE) m->uploads_done++;
    else if (ev->kind == ELASTIC_REPORT_UPLOAD_FAILED) m->uploads_failed++;
    else m->uploads_skipped++;
}

static void apply(elastic_metrics *m, int local_rank, const elastic_report_event *ev, double now)
{
    int first = local_rank == 0; /* the node's first rank speaks for the job */
    switch (ev->kind) {
    case ELASTIC_REPORT_STEP:
        if (!first) break;
        set(&m->step, (double)ev->step);
        if (ev->has & ELASTIC_RF_SECONDS) elastic_hist_observe(&m->step_seconds, ev->seconds);
        if (ev->has & ELASTIC_RF_LOSS) set(&m->loss, ev->loss);
        if (ev->has & ELASTIC_RF_LR) set(&m->lr, ev->lr);
        if (ev->has & ELASTIC_RF_GRAD_NORM) set(&m->grad_norm, ev->grad_norm);
        if (ev->has & ELASTIC_RF_TPS) set(&m->tps, ev->tokens_per_second);
        if (ev->has & ELASTIC_RF_SAMPLES) set(&m->samples, (double)ev->samples);
        gp_add(m, ELASTIC_GP_STEP, now, ev->step,
               ev->has & ELASTIC_RF_SECONDS ? ev->seconds : -1.0);
        break;
    case ELASTIC_REPORT_VAL:
        if (first) set(&m->val_loss, ev->loss);
        break;
    case ELASTIC_REPORT_STAGED:
        elastic_hist_observe(&m->stall_seconds, ev->stall_seconds);
        if (first) gp_add(m, ELASTIC_GP_STALL, now, ev->step, ev->stall_seconds);
        break;
    case ELASTIC_REPORT_SNAPSHOT_WAIT:
        /* the second part of a snapshot's stall (asynchronous staging): not in the step's
         * seconds, so it adds to the goodput's stall without counting twice */
        elastic_hist_observe(&m->wait_seconds, ev->stall_seconds);
        if (first) gp_add(m, ELASTIC_GP_STALL, now, ev->step, ev->stall_seconds);
        break;
    case ELASTIC_REPORT_MEM_SNAPSHOT:
        /* a stall like a snapshot's (the stage of a disk snapshot is reported apart) */
        elastic_hist_observe(&m->mem_stall_seconds, ev->stall_seconds);
        if (first) {
            gp_add(m, ELASTIC_GP_STALL, now, ev->step, ev->stall_seconds);
            set(&m->mem_step, (double)ev->step);
        }
        break;
    case ELASTIC_REPORT_MEM_FAILED:
        m->mem_failed++;
        break;
    case ELASTIC_REPORT_SKIPPED:
        if (first) m->skipped++;
        break;
    case ELASTIC_REPORT_STAGE_FAILED:
        /* any local rank: a snapshot that one rank could not stage is not committed */
        if (m->stage_fail_gen != m->gen || m->stage_fail_step != ev->step) {
            m->stage_fail_gen = m->gen;
            m->stage_fail_step = ev->step;
            m->fail_stage++;
        }
        break;
    case ELASTIC_REPORT_DONE:
        if (ev->result == 0) {
            if (ev->has & ELASTIC_RF_PERSIST_SECONDS)
                elastic_hist_observe(&m->persist_seconds, ev->persist_seconds);
            if (ev->has & ELASTIC_RF_STORED_BYTES)
                m->persist_bytes = add_sat(m->persist_bytes, ev->stored_bytes);
        }
        if (!first || (m->done_gen == m->gen && m->done_step == ev->step)) break;
        m->done_gen = m->gen;
        m->done_step = ev->step;
        if (ev->result < 0) {
            m->fail_persist++;
            break;
        }
        m->committed++;
        if (!m->last_committed.set || (double)ev->step > m->last_committed.v)
            set(&m->last_committed, (double)ev->step); /* never goes down */
        set(&m->last_commit_time, unix_now());
        break;
    case ELASTIC_REPORT_RESTORE: {
        if (!first) break;
        int k = 0;
        while (k < m->nrestore && strcmp(m->restore[k].name, ev->source) != 0) k++;
        if (k == m->nrestore) {
            if (k == MAX_SOURCES) break; /* more kinds than any real trainer has */
            memcpy(m->restore[k].name, ev->source, sizeof m->restore[k].name);
            m->nrestore++;
        }
        m->restore[k].seconds = ev->seconds;
        break;
    }
    case ELASTIC_REPORT_UPLOAD_DONE:
    case ELASTIC_REPORT_UPLOAD_FAILED:
    case ELASTIC_REPORT_UPLOAD_SKIPPED:
        apply_upload(m, first, ev);
        break;
    default: break;
    }
}

int elastic_metrics_line(elastic_metrics *m, int local_rank, const char *line, size_t len,
                         double now)
{
    elastic_report_event ev;
    int rc = elastic_report_parse(line, len, &ev);
    pthread_mutex_lock(&m->mu);
    if (rc == 1) {
        m->lines_ok++;
        apply(m, local_rank, &ev, now);
    } else if (rc == 0) {
        m->lines_unknown++;
    } else {
        m->lines_malformed++;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

void elastic_metrics_interrupt(elastic_metrics *m, double now)
{
    pthread_mutex_lock(&m->mu);
    gp_add(m, ELASTIC_GP_INTERRUPT, now, 0, 0);
    pthread_mutex_unlock(&m->mu);
}

void elastic_metrics_restart(elastic_metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->restarts++;
    pthread_mutex_unlock(&m->mu);
}

void elastic_metrics_end(elastic_metrics *m, double now)
{
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->nlocal; i++) m->up[i] = 0;
    gp_add(m, ELASTIC_GP_END, now, 0, 0);
    pthread_mutex_unlock(&m->mu);
}

void elastic_metrics_mem_replica(elastic_metrics *m, uint64_t bytes, uint64_t step)
{
    pthread_mutex_lock(&m->mu);
    m->mem_replica_bytes = add_sat(m->mem_replica_bytes, bytes);
    if (!m->mem_replica_step.set || (double)step > m->mem_replica_step.v) {
        m->mem_replica_step.set = 1;
        m->mem_replica_step.v = (double)step;
    }
    pthread_mutex_unlock(&m->mu);
}

/* ------------------------------------------------------------------ rendering */

static void gauge_out(elastic_expo *e, const char *name, const char *help, const gauge *g,
                      const char *const *labels)
{
    elastic_expo_family(e, name, "gauge", help);
    if (g->set) elastic_expo_sample(e, name, labels, g->v);
}

static void counter_out(elastic_expo *e, const char *name, const char *help, uint64_t v)
{
    elastic_expo_family(e, name, "counter", help);
    elastic_expo_sample_u64(e, name, NULL, v);
}

int elastic_metrics_render(elastic_metrics *m, double now, char **text, size_t *len)
{
    elastic_expo e = ELASTIC_EXPO_INIT;
    pthread_mutex_lock(&m->mu);
    char node[16];
    snprintf(node, sizeof node, "%d", m->node_rank);
    const char *const nl[] = {"node", node, NULL};
    const char *const *labels = m->have_round ? nl : NULL;

    gauge_out(&e, "train_step", "Last optimizer step completed (the node's first rank; goes "
              "back to the restored step after a resume).", &m->step, labels);
    gauge_out(&e, "train_loss", "Mean training loss of the last step (rank 0).", &m->loss,
              labels);
    gauge_out(&e, "train_val_loss", "Last validation loss (rank 0).", &m->val_loss, labels);
    gauge_out(&e, "train_learning_rate", "Learning rate of the last step (rank 0).", &m->lr,
              labels);
    gauge_out(&e, "train_grad_norm", "Global gradient norm of the last step before clipping "
              "(rank 0).", &m->grad_norm, labels);
    gauge_out(&e, "train_tokens_per_second", "Throughput of the last step, tokens per second "
              "(rank 0).", &m->tps, labels);
    gauge_out(&e, "train_samples", "Samples of the data consumed by the training state at the "
              "last step (rank 0; goes back after a resume).", &m->samples, labels);
    elastic_expo_family(&e, "train_step_seconds", "histogram", "Wall time of each optimizer "
                        "step, seconds (the node's first rank).");
    elastic_expo_histogram(&e, "train_step_seconds", NULL, &m->step_seconds);

    elastic_goodput_report gr;
    elastic_goodput_get(&m->gp, now, &gr);
    elastic_expo_family(&e, "train_goodput_ratio", "gauge", "Productive step time (steps not "
                        "recomputed later) over the agent's wall time, 0..1.");
    if (m->have_round) elastic_expo_sample(&e, "train_goodput_ratio", labels, gr.ratio);

    counter_out(&e, "elastic_restarts_total", "Restarts of the worker group counted against "
                "--max-restarts (failures and hangs).", m->restarts);
    elastic_expo_family(&e, "elastic_world_size", "gauge", "Ranks in the current round.");
    if (m->have_round) elastic_expo_sample(&e, "elastic_world_size", labels, m->world);
    elastic_expo_family(&e, "elastic_round", "gauge", "Number of the current round (0, 1, ...: "
                        "ELASTIC_RESTART_COUNT).");
    if (m->have_round) elastic_expo_sample(&e, "elastic_round", labels, m->gen);
    elastic_expo_family(&e, "elastic_rank_up", "gauge", "1 while the worker of this global rank "
                        "runs on this node, 0 once it exited.");
    for (int i = 0; i < m->nlocal; i++) {
        char rank[16];
        snprintf(rank, sizeof rank, "%d", m->first_rank + i);
        const char *const rl[] = {"node", node, "rank", rank, NULL};
        elastic_expo_sample(&e, "elastic_rank_up", rl, m->up[i]);
    }
    elastic_expo_family(&e, "elastic_report_lines_total", "counter", "Progress lines read from "
                        "the workers, by outcome (ok, unknown: an event of a newer protocol, "
                        "malformed: ignored).");
    const char *const l_ok[] = {"outcome", "ok", NULL}, *const l_unk[] = {"outcome", "unknown",
                                                                          NULL},
                      *const l_bad[] = {"outcome", "malformed", NULL};
    elastic_expo_sample_u64(&e, "elastic_report_lines_total", l_ok, m->lines_ok);
    elastic_expo_sample_u64(&e, "elastic_report_lines_total", l_unk, m->lines_unknown);
    elastic_expo_sample_u64(&e, "elastic_report_lines_total", l_bad, m->lines_malformed);

    counter_out(&e, "ckpt_snapshots_committed_total", "Snapshots committed (the node's first "
                "rank's persist result 0).", m->committed);
    elastic_expo_family(&e, "ckpt_snapshot_failures_total", "counter", "Snapshots that failed, "
                        "by stage: stage (the copy, any local rank) or persist (the node's first "
                        "rank's result < 0).");
    const char *const l_stage[] = {"stage", "stage", NULL},
                      *const l_persist[] = {"stage", "persist", NULL};
    elastic_expo_sample_u64(&e, "ckpt_snapshot_failures_total", l_stage, m->fail_stage);
    elastic_expo_sample_u64(&e, "ckpt_snapshot_failures_total", l_persist, m->fail_persist);
    counter_out(&e, "ckpt_snapshots_skipped_total", "Snapshots skipped by the wait/skip policy "
                "(the previous one still persisted).", m->skipped);
    elastic_expo_family(&e, "ckpt_snapshot_stall_seconds", "histogram", "Training stall of each "
                        "snapshot's stage copy, seconds (every local rank).");
    elastic_expo_histogram(&e, "ckpt_snapshot_stall_seconds", NULL, &m->stall_seconds);
    elastic_expo_family(&e, "ckpt_snapshot_wait_seconds", "histogram", "Time the next optimizer "
                        "update waited for a snapshot's device-to-host copies and its digests "
                        "(asynchronous staging: the second part of the snapshot's stall), "
                        "seconds (every local rank).");
    elastic_expo_histogram(&e, "ckpt_snapshot_wait_seconds", NULL, &m->wait_seconds);
    elastic_expo_family(&e, "ckpt_mem_snapshot_stall_seconds", "histogram", "Training stall of "
                        "each memory snapshot (the copy into the shared-memory slot with its "
                        "checksums, the record and digests), seconds (every local rank).");
    elastic_expo_histogram(&e, "ckpt_mem_snapshot_stall_seconds", NULL, &m->mem_stall_seconds);
    counter_out(&e, "ckpt_mem_snapshot_failures_total", "Memory snapshots that could not be "
                "written (any local rank; training goes on).", m->mem_failed);
    elastic_expo_family(&e, "ckpt_persist_seconds", "histogram", "Time from a shard's stage to "
                        "its commit, seconds (every local rank, committed persists).");
    elastic_expo_histogram(&e, "ckpt_persist_seconds", NULL, &m->persist_seconds);
    counter_out(&e, "ckpt_persist_bytes_total", "Bytes stored (compressed) by the committed "
                "persists of every local rank.", m->persist_bytes);
    gauge_out(&e, "ckpt_last_committed_step", "Step of the newest committed snapshot seen "
              "(never decreases).", &m->last_committed, labels);
    gauge_out(&e, "ckpt_last_commit_timestamp_seconds", "When the agent learnt of the last "
              "commit, seconds since the Unix epoch.", &m->last_commit_time, labels);
    gauge_out(&e, "ckpt_mem_snapshot_step", "Step of the newest memory snapshot of the node's "
              "first rank.", &m->mem_step, labels);
    elastic_expo_family(&e, "ckpt_restore_seconds", "gauge", "Time of the last restore from "
                        "each source, seconds (rank 0; source none: a fresh start).");
    for (int k = 0; k < m->nrestore; k++) {
        const char *const sl[] = {"node", node, "source", m->restore[k].name, NULL};
        elastic_expo_sample(&e, "ckpt_restore_seconds", sl, m->restore[k].seconds);
    }
    elastic_expo_family(&e, "ckpt_snapshot_uploads_total", "counter", "Snapshots the S3 "
                        "uploader finished with, by result: done (on rank 0: complete on S3), "
                        "failed, skipped (dropped from a full backlog); the node's first rank, "
                        "once per snapshot.");
    const char *const l_up_done[] = {"result", "done", NULL},
                      *const l_up_failed[] = {"result", "failed", NULL},
                      *const l_up_skipped[] = {"result", "skipped", NULL};
    elastic_expo_sample_u64(&e, "ckpt_snapshot_uploads_total", l_up_done, m->uploads_done);
    elastic_expo_sample_u64(&e, "ckpt_snapshot_uploads_total", l_up_failed, m->uploads_failed);
    elastic_expo_sample_u64(&e, "ckpt_snapshot_uploads_total", l_up_skipped, m->uploads_skipped);
    counter_out(&e, "ckpt_upload_bytes_total", "Bytes PUT to S3 by the finished uploads "
                "(upload_done) of every local rank.", m->upload_bytes);
    gauge_out(&e, "ckpt_upload_lag_steps", "Step of the newest local commit minus the newest "
              "complete step on S3 (rank 0, as of its last upload outcome).",
              &m->upload_lag_steps, labels);
    gauge_out(&e, "ckpt_upload_lag_seconds", "Age of the oldest local commit not yet on S3, "
              "seconds; 0 when caught up (rank 0, as of its last upload outcome).",
              &m->upload_lag_seconds, labels);
    gauge_out(&e, "ckpt_last_uploaded_step", "Step of the newest snapshot complete on S3 seen "
              "(rank 0; never decreases).", &m->last_uploaded, labels);
    counter_out(&e, "ckpt_mem_replica_bytes_total", "Bytes of memory snapshot slots this agent "
                "sent to its peer node and the peer committed (the memory tier's replica).",
                m->mem_replica_bytes);
    gauge_out(&e, "ckpt_mem_replica_step", "Newest step of a memory snapshot slot of this node "
              "that the peer node holds as a replica (never decreases).", &m->mem_replica_step,
              labels);
    pthread_mutex_unlock(&m->mu);
    return elastic_expo_finish(&e, text, len);
}

void elastic_metrics_goodput(elastic_metrics *m, double now, elastic_goodput_report *r)
{
    pthread_mutex_lock(&m->mu);
    elastic_goodput_get(&m->gp, now, r);
    pthread_mutex_unlock(&m->mu);
}

void elastic_metrics_log_goodput(elastic_metrics *m, double now)
{
    elastic_goodput_report r;
    pthread_mutex_lock(&m->mu);
    elastic_goodput_get(&m->gp, now, &r);
    int node = m->node_rank, first = m->first_rank;
    pthread_mutex_unlock(&m->mu);
    double w = r.wall_s > 0 ? 100.0 / r.wall_s : 0;
    LOG_I(TAG, "goodput report (node %d, from rank %d's progress lines):", node, first);
    LOG_I(TAG, "goodput: wall time %.3f s", r.wall_s);
    LOG_I(TAG, "goodput: productive steps %.3f s (%.1f%%; %" PRId64 " steps)", r.productive_s,
          r.productive_s * w, r.steps_kept);
    LOG_I(TAG, "goodput: recomputed steps %.3f s (%.1f%%; %" PRId64 " steps after %d resume(s))",
          r.recomputed_s, r.recomputed_s * w, r.steps_recomputed, r.resumes);
    LOG_I(TAG, "goodput: lost to restarts %.3f s (%.1f%%; %d restart window(s), %d interrupted "
          "round(s))", r.restart_s, r.restart_s * w, r.restart_windows, r.interrupts);
    LOG_I(TAG, "goodput: snapshot stall %.3f s (%.1f%%)", r.stall_s, r.stall_s * w);
    LOG_I(TAG, "goodput: other %.3f s (%.1f%%; start-up, evaluation, cut steps, shutdown)",
          r.other_s, r.other_s * w);
    LOG_I(TAG, "goodput: ratio %.4f (productive / wall)", r.ratio);
}
