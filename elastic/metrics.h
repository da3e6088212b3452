/* metrics.h - the elastic agent's metrics (issue 12): the workers' progress lines parsed and
 * aggregated in the agent, written in the Prometheus text exposition format (version 0.0.4)
 * and served on /metrics (`elastic --metrics-port`), and the goodput report printed when the
 * agent exits.
 *
 * Where the numbers come from: every worker writes one line per event to its agent's pipe
 * (ELASTIC_HEARTBEAT_FD; the protocol is train/report.h's line protocol version 1, restated at
 * elastic_report_parse). The agent parses each line on its main thread and folds it into one
 * elastic_metrics object that lives as long as the agent, not the workers: counters never go
 * down across worker restarts, gauges keep their last value between rounds. Lines are a
 * sample (a worker drops them when the pipe is full), so a lost line loses an observation,
 * never consistency. elastic/ knows nothing about train/ (DESIGN section 2): the protocol is
 * parsed here from its text, not through train's header.
 *
 * What an agent exports: the view of its own node. Per-rank series (elastic_rank_up) carry
 * `rank` (the global rank); the round's gauges carry `node` (this agent's node rank in the
 * current round). Job-wide events are taken from the node's first local rank (local rank 0:
 * global rank 0 on the node that has it), since every rank steps and snapshots together:
 * train_step, train_step_seconds, the snapshot and upload counters, the goodput figures. The
 * loss, the learning rate, the gradient norm, the throughput, the samples, the restore and the
 * S3 lag are known to rank 0 only: only the agent that hosts rank 0 exports them. The stall
 * and persist histograms, ckpt_persist_bytes_total and ckpt_upload_bytes_total take every
 * local rank. A dashboard aggregates across agents with max() (steps, loss) or sum() (bytes)
 * as docs/grafana-dashboard.json does.
 *
 * Thread-safety: elastic_report_parse, the elastic_expo_* and elastic_goodput_* functions work
 * on caller-owned memory and are safe on distinct objects. An elastic_metrics object is safe to
 * use from several threads: every function takes its mutex (the agent's main thread updates,
 * the HTTP server's thread renders); each holds it for at most one render of the text.
 */
#ifndef ELASTIC_METRICS_H
#define ELASTIC_METRICS_H

#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------ the line protocol */

/* Longest line, bytes, with its newline (TRAIN_REPORT_LINE_MAX): a longer line is malformed. */
#define ELASTIC_REPORT_LINE_MAX 256
/* Longest restore source, bytes, with the NUL. */
#define ELASTIC_REPORT_SOURCE_MAX 16

enum elastic_report_kind {
    ELASTIC_REPORT_STEP = 1,     /* step <n> [seconds=<s>] [loss= lr= grad_norm=
                                    tokens_per_second= samples=] */
    ELASTIC_REPORT_VAL,          /* val step=<n> loss=<x> */
    ELASTIC_REPORT_STAGED,       /* snapshot_staged step=<n> stall_seconds=<s> [bytes=<b>] */
    ELASTIC_REPORT_SKIPPED,      /* snapshot_skipped step=<n> */
    ELASTIC_REPORT_DONE,         /* snapshot_done step=<n> result=<r> [persist_seconds=<s>
                                    raw_bytes=<b> stored_bytes=<b>] */
    ELASTIC_REPORT_RESTORE,      /* restore step=<n> seconds=<s> source=<name> */
    ELASTIC_REPORT_STAGE_FAILED, /* snapshot_failed step=<n> result=<r> (the stage failed) */
    ELASTIC_REPORT_UPLOAD_DONE,  /* upload_done step=<n> result=<r> [bytes=<b> seconds=<s>
                                    lag_steps=<n> lag_seconds=<s> remote_step=<n>] */
    ELASTIC_REPORT_UPLOAD_FAILED,  /* upload_failed, the same keys */
    ELASTIC_REPORT_UPLOAD_SKIPPED, /* upload_skipped, the same keys */
    ELASTIC_REPORT_MEM_SNAPSHOT, /* mem_snapshot step=<n> stall_seconds=<s> [bytes=<b>]: a
                                    memory snapshot (train's memory tier) completed */
    ELASTIC_REPORT_MEM_FAILED,   /* mem_snapshot_failed step=<n> result=<r> */
    ELASTIC_REPORT_SNAPSHOT_WAIT, /* snapshot_wait step=<n> stall_seconds=<s>: the optimizer
                                     waited for snapshot n's copies and digests */
};

/* Bits of elastic_report_event.has: the optional fields that were present. */
#define ELASTIC_RF_SECONDS 0x001u
#define ELASTIC_RF_LOSS 0x002u
#define ELASTIC_RF_LR 0x004u
#define ELASTIC_RF_GRAD_NORM 0x008u
#define ELASTIC_RF_TPS 0x010u
#define ELASTIC_RF_SAMPLES 0x020u
#define ELASTIC_RF_BYTES 0x040u
#define ELASTIC_RF_PERSIST_SECONDS 0x080u
#define ELASTIC_RF_RAW_BYTES 0x100u
#define ELASTIC_RF_STORED_BYTES 0x200u
#define ELASTIC_RF_LAG_STEPS 0x400u
#define ELASTIC_RF_LAG_SECONDS 0x800u
#define ELASTIC_RF_REMOTE_STEP 0x1000u

typedef struct elastic_report_event {
    int kind;                   /* enum elastic_report_kind */
    unsigned has;               /* ELASTIC_RF_* */
    int64_t step;               /* every event; [0, INT64_MAX] */
    double seconds;             /* step: its wall time; restore: the restore's; upload_*:
                                   the upload's; seconds */
    double loss, lr, grad_norm; /* any value, NaN and infinities kept (a diverged loss) */
    double tokens_per_second;   /* likewise */
    uint64_t samples;           /* samples consumed so far (the data position) */
    double stall_seconds;       /* snapshot_staged */
    uint64_t bytes;             /* snapshot_staged: bytes copied; upload_*: bytes PUT */
    int result;                 /* snapshot_done, snapshot_failed, upload_*: 0 or a negative
                                   errno */
    double persist_seconds;     /* snapshot_done */
    uint64_t raw_bytes, stored_bytes; /* snapshot_done */
    char source[ELASTIC_REPORT_SOURCE_MAX]; /* restore: "disk", "none", ... */
    /* upload_*: rank 0's view of the S3 tier (other ranks write placeholders) */
    uint64_t lag_steps;         /* newest local commit step minus newest complete S3 step */
    double lag_seconds;         /* age of the oldest local commit not yet on S3; 0 caught up */
    int64_t remote_step;        /* newest complete step on S3; -1 none yet */
} elastic_report_event;

/* Largest duration accepted, seconds (about 31 years): a larger one is malformed. */
#define ELASTIC_REPORT_SECONDS_MAX 1e9

/* Parse one line (len bytes, without its newline; need not be NUL-terminated) of the line
 * protocol version 1 into *ev. Grammar: words separated by spaces (one or more); the first
 * names the event; "step" takes the step number as its second word; every other word is
 * key=value. Every byte must be printable ASCII (0x21..0x7e) or a space. Integers are decimal
 * digits (a result may start with '-'); reals are what strtod reads in the C locale.
 * Checks: step >= 0 and within int64; remote_step the same or exactly -1; byte counts,
 * samples and lag_steps within uint64 (no sign); result in [-4095, 0]; durations (seconds,
 * stall_seconds, persist_seconds, lag_seconds) finite and in [0, ELASTIC_REPORT_SECONDS_MAX];
 * the other reals any value, NaN and infinities included; source 1..15 bytes of [a-z0-9_-].
 * A known key given twice, a known key with a bad value, a required key missing (step: the
 * step number; val: step, loss; snapshot_staged: step, stall_seconds; snapshot_skipped: step;
 * snapshot_done, snapshot_failed, upload_done, upload_failed, upload_skipped: step, result;
 * restore: step, seconds, source), a word that is not key=value, or a line over
 * ELASTIC_REPORT_LINE_MAX - 1 bytes make the line malformed. Unknown keys are ignored (a newer
 * writer), and so is an unknown event.
 * Returns 1 and fills *ev: an event; 0: an unknown event (ev->kind 0; ignore it); -EINVAL:
 * malformed (*ev is then unspecified). line may be NULL only with len 0. Never reads past
 * line + len. */
int elastic_report_parse(const char *line, size_t len, elastic_report_event *ev);

/* ------------------------------------------------------------------ the exposition writer */

/* Text in the Prometheus exposition format 0.0.4, built in a growing buffer. Errors are
 * sticky: the first one is returned by elastic_expo_finish and every later call does nothing.
 * Usage: elastic_expo e = ELASTIC_EXPO_INIT; family; samples; ...; finish; free(text). */
typedef struct elastic_expo {
    char *buf;
    size_t len, cap;
    int err;                    /* 0, -ENOMEM, or -EINVAL (a bad metric or label name) */
} elastic_expo;

#define ELASTIC_EXPO_INIT {NULL, 0, 0, 0}

/* Bucket upper bounds, seconds, of every histogram of the agent (ascending; +Inf is added):
 * from 1 ms (a stall of a small shard) to 10 min (the persist of a large one). */
#define ELASTIC_HIST_BUCKETS 18
extern const double elastic_hist_bounds[ELASTIC_HIST_BUCKETS];

typedef struct elastic_hist {
    uint64_t bucket[ELASTIC_HIST_BUCKETS + 1]; /* per bucket, not cumulative; last = +Inf */
    uint64_t count;
    double sum;
} elastic_hist;

/* Add one observation (a finite value >= 0; others are ignored). */
void elastic_hist_observe(elastic_hist *h, double v);

/* "# HELP name help" and "# TYPE name type". name: [a-zA-Z_:][a-zA-Z0-9_:]* (else -EINVAL);
 * type: "counter", "gauge", "histogram", "untyped"; help: any text (backslashes and newlines
 * escaped as the format wants). Write each family once, then its samples. */
void elastic_expo_family(elastic_expo *e, const char *name, const char *type, const char *help);

/* One sample line: name{k1="v1",k2="v2"} value. labels: NULL, or an array of name, value
 * pointers ending with a NULL name (label names: [a-zA-Z_][a-zA-Z0-9_]*, else -EINVAL; values:
 * any bytes: backslash, double quote and newline escaped as \\, \" and \n, other control
 * characters and bytes that are not valid UTF-8 written as the text \xNN (log_printable)).
 * value: the shortest of %.15g, %.16g and %.17g that reads back as the same double; NaN, +Inf
 * and -Inf as "NaN", "+Inf", "-Inf". */
void elastic_expo_sample(elastic_expo *e, const char *name, const char *const *labels,
                         double value);

/* The same with an integer value (counters), written exactly. */
void elastic_expo_sample_u64(elastic_expo *e, const char *name, const char *const *labels,
                             uint64_t value);

/* A histogram's samples: name_bucket{labels,le="..."} (cumulative, ending with le="+Inf"),
 * name_sum and name_count. labels as for elastic_expo_sample, without "le". */
void elastic_expo_histogram(elastic_expo *e, const char *name, const char *const *labels,
                            const elastic_hist *h);

/* Hand over the text: *text (NUL-terminated, free() it) and *len (without the NUL). The
 * writer is then empty. Returns 0, or the sticky error (nothing handed over; the buffer is
 * freed). */
int elastic_expo_finish(elastic_expo *e, char **text, size_t *len);

/* ------------------------------------------------------------------ goodput */

/* What the goodput report counts, from a sequence of timed events (monotonic seconds):
 *   wall        from the START event (the agent started) to END (or to now, live).
 *   productive  the sum of the `seconds` of every completed step that was not computed again
 *               later: when a round's first step is n, the job resumed from step n - 1, and
 *               every earlier completion of a step > n - 1 is recomputed (its seconds move
 *               from productive to recomputed). A step line without seconds counts 0 s. Steps
 *               completed after the last snapshot of a job that then ended (budget spent,
 *               preempted) are productive here: a later launch would redo them.
 *   recomputed  the seconds of those completions; steps_recomputed: for each resume, the last
 *               step reached before it minus the step resumed from (when positive), summed.
 *   restart     time lost to restarts: from each INTERRUPT (a round that ended otherwise than
 *               by success: a failure, a hang, a stop by another node, as the agent noticed
 *               it) to the start of the first step of the next round that completes one (its
 *               line's time minus its seconds): failure detection, the stop, the restart,
 *               start-up and restore. Rounds that fail before their first step stay inside one
 *               window. A window that no new round followed (the job ended: budget spent,
 *               preempted) is not a restart: its time is in other; when new rounds started
 *               but none completed a step before the job ended, the window ends at the last
 *               one's interruption (or at the end, if that round ended otherwise).
 *   stall       the sum of the snapshot stalls (stall_seconds) of the node's first rank.
 *   other       wall - productive - recomputed - restart - stall (>= 0): the first start-up
 *               and restore, evaluation, steps cut short by a failure, the final snapshot and
 *               shutdown.
 *   ratio       productive / wall (0 while wall is 0).
 * The events of the node's first local rank are used (all ranks step together). */
enum elastic_goodput_kind {
    ELASTIC_GP_START = 1, /* t: the agent started */
    ELASTIC_GP_ROUND,     /* t: a round's workers were started */
    ELASTIC_GP_STEP,      /* t: the line was read; step; seconds (< 0 = not given) */
    ELASTIC_GP_STALL,     /* seconds: a snapshot stall */
    ELASTIC_GP_INTERRUPT, /* t: the round ended otherwise than by success */
    ELASTIC_GP_END,       /* t: the job ended */
};

typedef struct elastic_goodput_ev {
    int kind;
    double t;
    int64_t step;
    double seconds;
} elastic_goodput_ev;

typedef struct elastic_goodput_report {
    double wall_s, productive_s, recomputed_s, restart_s, stall_s, other_s;
    double ratio;
    int64_t steps_recomputed;   /* summed over resumes */
    int64_t steps_kept;         /* completions counted as productive */
    int resumes;                /* rounds whose first step came back to an earlier step */
    int interrupts;             /* INTERRUPT events */
    int restart_windows;        /* windows closed by a next round's first step (or open) */
} elastic_goodput_report;

/* The state the events fold into. Memory: 8 bytes per step of the job (the cumulative time at
 * each step, so that a resume to any step is exact); at 2^22 steps (32 MiB) the oldest half is
 * folded into one sum, which stays productive even when a resume goes back into it. */
typedef struct elastic_goodput {
    double t_start, t_end;
    int started, ended;
    double *cum;                /* cum[i]: productive seconds up to step base + 1 + i */
    size_t n, cap;
    int64_t base;               /* the step before cum[0] */
    double carried;             /* productive seconds of steps <= base (folded) */
    int64_t carried_steps;      /* and how many steps they were */
    int timeline;               /* a step was seen: base is set */
    double recomputed_s, restart_s, stall_s;
    int64_t steps_recomputed;
    int resumes, interrupts, windows;
    int win_open, win_restarting;
    double win_t;
    int round_open;             /* a round started and did not end by an interruption yet */
    double last_interrupt_t;    /* the latest INTERRUPT */
    int round_stepped;          /* the current round completed a step */
} elastic_goodput;

#define ELASTIC_GOODPUT_INIT {0}

/* Fold one event into g. Events must come in time order (START first). Errors: -ENOMEM (the
 * step could not be recorded: the report then counts it as an unknown gap; g stays usable),
 * -EINVAL (unknown kind, a step < 0). */
int elastic_goodput_add(elastic_goodput *g, const elastic_goodput_ev *ev);

/* The report at time now (monotonic seconds; ignored once END was added): an open restart
 * window after a new round counts up to now. */
void elastic_goodput_get(const elastic_goodput *g, double now, elastic_goodput_report *r);

/* Free the state; g is then ELASTIC_GOODPUT_INIT again. */
void elastic_goodput_free(elastic_goodput *g);

/* The report of a recorded event sequence (a pure function: add each, get at end, free).
 * Returns 0 or the first error of elastic_goodput_add. */
int elastic_goodput_compute(const elastic_goodput_ev *evs, size_t n, double end,
                            elastic_goodput_report *r);

/* ------------------------------------------------------------------ the agent's metrics */

typedef struct elastic_metrics elastic_metrics;

/* Create the agent's metrics; now: monotonic seconds, the start of the goodput's wall time.
 * Errors: -ENOMEM. */
int elastic_metrics_create(elastic_metrics **out, double now);

/* Free; accepts NULL. No other thread may use m any more (stop the HTTP server first). */
void elastic_metrics_free(elastic_metrics *m);

/* A round's workers are being started: round gen, this node's rank and its nlocal workers,
 * global ranks first_rank .. first_rank + nlocal - 1 of world. Every rank is down until
 * elastic_metrics_rank_up. Errors: -ENOMEM (the per-rank series are then left out). */
int elastic_metrics_round(elastic_metrics *m, int gen, int node_rank, int world, int first_rank,
                          int nlocal, double now);

/* The worker of local rank local_rank is running (up 1) or was reaped (0). */
void elastic_metrics_rank_up(elastic_metrics *m, int local_rank, int up);

/* One progress line of local rank local_rank (without its newline), read at now. Returns
 * elastic_report_parse's result (1, 0 or -EINVAL); a malformed line is counted and otherwise
 * ignored. */
int elastic_metrics_line(elastic_metrics *m, int local_rank, const char *line, size_t len,
                         double now);

/* The round ended otherwise than by success (a failure, hang, remote stop, preemption), as the
 * agent noticed it at now. */
void elastic_metrics_interrupt(elastic_metrics *m, double now);

/* A restart counted against --max-restarts. */
void elastic_metrics_restart(elastic_metrics *m);

/* The memory tier's replica sender (agent_mem.c, any thread): a slot of bytes payload bytes
 * of step was sent to the peer node and committed there: ckpt_mem_replica_bytes_total grows
 * by bytes, ckpt_mem_replica_step becomes step when larger (the newest step the peer holds). */
void elastic_metrics_mem_replica(elastic_metrics *m, uint64_t bytes, uint64_t step);

/* The job ended at now (the goodput's wall time stops). */
void elastic_metrics_end(elastic_metrics *m, double now);

/* The exposition text (every family, see docs/OPERATIONS.md "Metrics"), goodput at now.
 * *text: NUL-terminated, the caller frees it. Errors: -ENOMEM. */
int elastic_metrics_render(elastic_metrics *m, double now, char **text, size_t *len);

/* The goodput report at now. */
void elastic_metrics_goodput(elastic_metrics *m, double now, elastic_goodput_report *r);

/* Log the goodput report block: one "goodput: ..." line per figure (INFO, tag "elastic"). */
void elastic_metrics_log_goodput(elastic_metrics *m, double now);

/* ------------------------------------------------------------------ the HTTP endpoint */

typedef struct elastic_metrics_http elastic_metrics_http;

/* Serve GET/HEAD /metrics (200, Content-Type "text/plain; version=0.0.4; charset=utf-8", the
 * text of elastic_metrics_render) on addr:port with libmicrohttpd: one internal thread, the
 * asynchronous signals blocked in it (common/thread.h), at most 64 connections, each closed
 * after 10 s idle. Other paths: 404; other methods: 405. addr: a numeric IPv4 or IPv6 address
 * or a host name that resolves (the first address is used); port 1..65535. m must outlive the
 * server. The listening socket is bound here, so a busy port is an error of this call.
 * Errors (each logged in one line naming addr:port): -EINVAL bad argument or an address that
 * does not resolve, -EADDRINUSE, -EACCES, -EADDRNOTAVAIL, other -errno of socket/bind/listen,
 * -EIO the server did not start, -ENOMEM. */
int elastic_metrics_http_start(elastic_metrics_http **out, const char *addr, int port,
                               elastic_metrics *m);

/* Stop serving (joins the server's thread: connections in progress are closed) and free;
 * accepts NULL. Start and stop a server from one thread; it reads m only under m's mutex. */
void elastic_metrics_http_stop(elastic_metrics_http *h);

#endif /* ELASTIC_METRICS_H */
