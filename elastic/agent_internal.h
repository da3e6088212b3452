/* agent_internal.h - the two halves of the elastic agent (agent.h) shared with agent.c: the
 * local worker group (agent_workers.c) and the rendezvous over the store (agent_rdzv.c). Not a
 * public API: everything here is called from the agent's main thread unless noted. */
#ifndef ELASTIC_AGENT_INTERNAL_H
#define ELASTIC_AGENT_INTERNAL_H

#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "metrics.h"

#define EA_TAG "elastic"

/* ------------------------------------------------------------------ output sinks */

/* Longest relayed line body, bytes: with the "[rank r] " prefix and the newline a line stays
 * within PIPE_BUF, so each is one atomic write. Longer lines are cut into several. */
#define ELASTIC_LINE_MAX 3968

/* One of the agent's own output fds (1 or 2). A reader that does not take a line within
 * ELASTIC_SINK_WAIT_S makes the sink "stalled": lines are then dropped (counted) without
 * waiting until the fd is writable again, when one note with the count is written. So a slow
 * or stopped reader costs the agent at most that wait per stall. */
#define ELASTIC_SINK_WAIT_S 2.0

typedef struct elastic_sink {
    int fd;
    int stalled;
    int dead;               /* EPIPE or another hard error: everything is dropped */
    unsigned long dropped;  /* lines dropped since the sink stalled */
} elastic_sink;

/* At the end of the job: report lines still counted as dropped (on the sink when it is
 * writable now, else in the log unless the sink is stderr). */
void elastic_sink_finish(elastic_sink *s);

/* Write prefix + line + "\n" (plen + len <= ELASTIC_LINE_MAX + 32). */
void elastic_sink_line(elastic_sink *s, const char *prefix, size_t plen, const char *line,
                       size_t len);

/* ------------------------------------------------------------------ orphan guardian */

/* The guardian (see agent.h "Orphans"): a process forked at start that SIGKILLs the process
 * groups of the workers when the agent dies without saying goodbye. The agent's side: */
typedef struct elastic_guard {
    pid_t pid;                  /* the guardian; 0 = none */
    int fd;                     /* write end of its pipe (O_NONBLOCK, O_CLOEXEC); -1 = none */
    int broken;                 /* a note could not be written (warned once) */
} elastic_guard;

/* Fork the guardian. Call before any thread exists, with SIGINT/SIGTERM blocked (the child
 * inherits the mask until it sets its own). Errors: -errno of pipe/fork (logged); g is then
 * {0, -1, 0} and the agent runs without a guardian. */
int elastic_guard_start(elastic_guard *g);

/* Tell the guardian that process group pgid is gone ('-'); '+' (a new group) is written by the
 * worker itself between fork and exec, so that no group exists unlisted. g may be NULL. A
 * failed write is warned about once; the guardian is then assumed gone. */
void elastic_guard_note(elastic_guard *g, char op, pid_t pgid);

/* Normal exit: "exit" to the guardian, close the pipe, reap it (waits at most 2 s). Accepts a
 * guard that was never started. */
void elastic_guard_finish(elastic_guard *g);

/* ------------------------------------------------------------------ worker group */

typedef struct elastic_stream {
    int fd;                     /* read end of the worker's pipe; -1 once closed */
    elastic_sink *sink;
    size_t len;                 /* bytes of an unfinished line in buf */
    char buf[ELASTIC_LINE_MAX];
} elastic_stream;

typedef struct elastic_worker {
    int local_rank, rank;
    pid_t pid;                  /* also its process group id; 0 = never started */
    int reaped;                 /* the worker itself was waited for; wstatus is valid */
    int gone;                   /* reaped and no process of its group is left */
    int wstatus;                /* waitpid status */
    int killed;                 /* SIGKILL was sent to its group */
    double started, exited;     /* monotonic seconds */
    double last_progress;       /* monotonic time of the last progress line (start at first) */
    long long last_step;        /* from "step <n>" lines; -1 none */
    long long beats;            /* progress lines read */
    elastic_stream out, err;
    int hb_fd;                  /* read end of the heartbeat pipe; -1 once closed */
    size_t hb_len;
    int hb_long;                /* the line in hb_buf was longer than the buffer: malformed */
    char hb_buf[ELASTIC_REPORT_LINE_MAX]; /* a progress line (metrics.h) */
    char prefix[32];            /* "[rank <r>] " */
    size_t prefix_len;
} elastic_worker;

typedef struct elastic_wg_spec {
    const char *path;           /* resolved executable */
    char *const *argv;          /* NULL-terminated */
    int nproc, node_rank, nnodes, gen, max_restarts;
    const char *master_addr;
    int master_port;
    const char *token;          /* NULL or "" = none; never logged */
    const char *run_id;
    elastic_guard *guard;       /* NULL = none: groups are listed with it while they exist */
    elastic_metrics *metrics;   /* NULL = none: gets every progress line and the ranks' up/down */
    const char *mem_path;       /* NULL = no memory tier; else CKPT_MEM_PATH of every worker */
    int flush;                  /* 1: the memory-tier flush command (agent.h "Memory tier"):
                                   nproc must be 1; no rank variables, CKPT_MEM_FLUSH=1, output
                                   prefixed "[flush] " */
} elastic_wg_spec;

typedef struct elastic_wg {
    int n;
    elastic_worker *w;          /* n workers, local rank order */
    int gen;
    int sigfd;                  /* the agent's signalfd (SIGCHLD, SIGTERM, SIGINT) */
    int term_signal;            /* a SIGTERM/SIGINT that arrived while serving (0 = none) */
    int escalate;               /* set by elastic_wg_stop: a further signal kills at once */
    int stopping;               /* inside elastic_wg_stop */
    double started;
    int progress_logged;        /* the first progress line of the round was logged */
    elastic_sink *out, *err;
    elastic_guard *guard;       /* from the spec; NULL = none */
    elastic_metrics *metrics;   /* from the spec; NULL = none */
    int flush;                  /* from the spec: the flush command, not ranks */
    struct pollfd *pfd;         /* 3 n + 1 + ELASTIC_WG_EXTRA_MAX entries */
} elastic_wg;

/* Most extra fds elastic_wg_wait takes. */
#define ELASTIC_WG_EXTRA_MAX 8

/* Start spec->nproc workers (see agent.h for what each gets). The workers that could be
 * started stay in wg even on failure (stop them with elastic_wg_stop, then elastic_wg_free).
 * Errors: -ENOEXEC with *exec_errno set: the command could not be executed (not retried);
 * -ENOMEM, other -errno of pipe/fork (logged). */
int elastic_wg_start(elastic_wg *wg, const elastic_wg_spec *spec, int sigfd, elastic_sink *out,
                     elastic_sink *err, int *exec_errno);

/* Wait up to timeout_s for worker output, progress lines, signals or the nextra extra fds;
 * relay output, read progress, reap exited processes (waitpid(-1, WNOHANG) every call), and
 * remember a SIGTERM/SIGINT in wg->term_signal. Returns the number of extra fds with revents
 * set, 0 otherwise. nextra <= ELASTIC_WG_EXTRA_MAX (more are ignored). */
int elastic_wg_wait(elastic_wg *wg, struct pollfd *extra, int nextra, double timeout_s);

/* Workers not yet reaped. */
int elastic_wg_running(const elastic_wg *wg);

/* The worker whose exit decides the round: the first that exited 2, else the first that
 * exited non-zero or by a signal (earliest exit time); NULL when none did. */
const elastic_worker *elastic_wg_failed(const elastic_wg *wg);

/* Non-zero when a worker exited with status 2. */
int elastic_wg_any_usage_error(const elastic_wg *wg);

/* A worker that is still running and whose last progress is older than timeout_s at now;
 * NULL when none. desc (may be NULL) gets every silent rank listed. */
const elastic_worker *elastic_wg_hung(const elastic_wg *wg, double timeout_s, double now,
                                      char *desc, size_t desc_len);

/* "exited with status 1" / "was killed by signal 9 (Killed)". */
void elastic_wg_exit_text(const elastic_worker *w, char *buf, size_t len);

/* Stop the group: sig (and SIGCONT, so that stopped processes take it) to the process group
 * of every worker, wait up to grace_s while relaying output, then SIGKILL every group that is
 * still there (each logged with its pid), and wait until every process of every group is gone
 * and reaped (bounded: after 10 s more it gives up with an error line). Output left in the
 * pipes is relayed and partial lines are flushed. why is logged. A SIGTERM/SIGINT during the
 * wait is kept in wg->term_signal; with escalate_on_signal it also SIGKILLs at once. */
void elastic_wg_stop(elastic_wg *wg, int sig, double grace_s, int escalate_on_signal,
                     const char *why);

/* Close the pipes and free the workers (the processes must be gone). Accepts an empty wg. */
void elastic_wg_free(elastic_wg *wg);

/* ------------------------------------------------------------------ rendezvous */

typedef struct elastic_rdzv elastic_rdzv;

typedef struct elastic_rdzv_opts {
    const char *host;           /* store endpoint */
    int port;
    const char *token;          /* NULL/"" = none; never logged */
    const char *run_id;         /* key namespace */
    int min_nodes, max_nodes;
    int nproc_per_node;         /* compared with the job's (the store host's) at open */
    double last_call_s, heartbeat_timeout_s, join_timeout_s;
    int hosting;                /* this agent runs the store server: elastic_rdzv_close then
                                   waits for the other agents to leave */
    int (*interrupted)(void *); /* polled between connection attempts; non-zero = give up */
    void *arg;
} elastic_rdzv_opts;

typedef struct elastic_round {
    int gen;                    /* round number, unique in the job */
    int node_rank;              /* this agent's node rank in the round (join order) */
    int nnodes;                 /* nodes in the round */
} elastic_round;

/* Event bits of elastic_rdzv_events. */
#define ELASTIC_EV_STOP 1u      /* the watched round got a stop request */
#define ELASTIC_EV_END 2u       /* the job was ended (end key) */
#define ELASTIC_EV_LOST 4u      /* the store is gone */

/* Connect (two connections: one for the main thread, one for the watcher thread), check that
 * the store serves this job with the same settings, register this agent, start the watcher
 * thread (heartbeats every min(1, timeout / 3) s). The hosting agent records the job first:
 * its run id (key "elastic/job") and its settings (P "config", see agent_rdzv.c); any other
 * agent compares its own with them before it registers.
 * Errors (each logged in one line): -ETIMEDOUT no store within join_timeout_s, -EINTR
 * o->interrupted said so while waiting for the store, -EACCES token refused, -EBUSY the store
 * serves another run id (or no elastic job at all), -EINVAL this agent's --nproc-per-node or
 * --nnodes differ from the job's, -errno. */
int elastic_rdzv_open(elastic_rdzv **out, const elastic_rdzv_opts *o);

/* Join the next round (the first open one at or after from_gen) and wait until it closes;
 * out->node_rank is this agent's node rank in it (sticky: the one it had in the round before
 * when the new round still has it; agent_rdzv.c, r/<g>/ranks).
 * interrupted(arg) is called about every 0.1 s; non-zero stops the wait.
 * Errors: -EINTR interrupted, -ECANCELED the job ended (see elastic_rdzv_end_code),
 * -ETIMEDOUT no round within join_timeout_s, -ECONNRESET/-EPIPE/-ETIMEDOUT store lost,
 * -EBADMSG the round's node ranks in the store are malformed or do not name this agent
 * (logged), -ENOMEM. */
int elastic_rdzv_join(elastic_rdzv *r, int from_gen, elastic_round *out,
                      int (*interrupted)(void *), void *arg);

/* Watch round rd as one of its members: the watcher reports a stop request of the round,
 * requests one itself when a member's heartbeat stalls (kind 'F') or when an agent waits to
 * join and the round has fewer than max_nodes (kind 'S'), and reports the end of the job.
 * done != 0: this node finished; the watcher waits for the end key instead. */
void elastic_rdzv_watch(elastic_rdzv *r, const elastic_round *rd, int done);

/* Stop watching (between rounds). */
void elastic_rdzv_unwatch(elastic_rdzv *r);

/* Readable when elastic_rdzv_events has something new. */
int elastic_rdzv_notify_fd(const elastic_rdzv *r);

/* Take the events seen since the last call (ELASTIC_EV_* bits). */
unsigned elastic_rdzv_events(elastic_rdzv *r);

/* Ask every member of round gen to stop it: kind 'F' failure (counted as a restart), 'S'
 * scale-up, 'P' preemption of a node (graceful, not counted). The first request wins;
 * *winner_kind (may be NULL) gets the kind of the request in force and why_out its text.
 * Errors: store errors (-ECONNRESET, ...). */
int elastic_rdzv_stop_round(elastic_rdzv *r, int gen, char kind, const char *why,
                            char *winner_kind, char *why_out, size_t why_len);

/* This node's workers all exited 0 in round rd: counted in the store; the last node of the
 * round ends the job with status 0. Errors: store errors. */
int elastic_rdzv_finish(elastic_rdzv *r, const elastic_round *rd);

/* Wait up to timeout_s for the end of the job (main thread). Returns 1 ended (the code is then
 * in elastic_rdzv_end_code), 0 not yet. Errors: store errors (the store is then lost). */
int elastic_rdzv_wait_end(elastic_rdzv *r, double timeout_s);

/* End the job with code (0, 1, 2) and a reason (the first end wins). Errors: store errors. */
int elastic_rdzv_end(elastic_rdzv *r, int code, const char *why);

/* The end of the job once seen: returns its code (0, 1, 2), -1 when not ended; why (may be
 * NULL) gets the reason. */
int elastic_rdzv_end_code(elastic_rdzv *r, char *why, size_t why_len);

/* The errno (negative) that made the store count as lost, 0 while healthy. */
int elastic_rdzv_lost(const elastic_rdzv *r);

/* Main thread: set key P<name> (P = "rdzv/<run id>/") to the text value. Used by the memory
 * tier (P mem/<gen>/<node>). Errors: store errors (the store then counts as lost). */
int elastic_rdzv_set(elastic_rdzv *r, const char *name, const char *value);

/* Main thread: read key P<name> without waiting. Returns 1 (*value malloc'ed, NUL-terminated;
 * free it), 0 missing. Errors: store errors (the store then counts as lost). */
int elastic_rdzv_get(elastic_rdzv *r, const char *name, char **value);

/* The local address of the main store connection (elastic_store_local_addr). */
int elastic_rdzv_local_addr(const elastic_rdzv *r, char *host, size_t host_len);

/* Leave: say goodbye in the store (unless it is lost), stop the watcher, close the
 * connections. The hosting agent first waits (at most heartbeat_timeout_s + 1 s) until every
 * other registered agent said goodbye or has a stale heartbeat, so that nobody loses the store
 * while reading the end of the job. Accepts NULL. */
void elastic_rdzv_close(elastic_rdzv *r);

/* ------------------------------------------------------------------ memory tier */

/* The agent's side of the memory tier (agent_mem.c; agent.h "Memory tier"): the segment
 * folder, the prefix and its lease, stale clean-up, the replica server and sender threads,
 * removal at the end. Called from the main thread; the two threads are internal. */
typedef struct elastic_mem elastic_mem;

/* Pick the prefix "ckptmem-<jobhash16>-<rand16>" in dir (jobhash16: elastic_mem_jobhash),
 * create and flock its lease, remove the files of dead agents of the same job (one INFO line
 * with the count and bytes when there were any). dir: an existing folder (made absolute with
 * realpath). nproc: local workers (their segments are <prefix>.own-0 .. own-<nproc-1>).
 * Errors (each logged in one line naming dir): -ENOENT/-ENOTDIR/-EACCES/... dir unusable,
 * -ENAMETOOLONG dir's real path longer than 3989 bytes (the workers' prefix "<dir>/" + 41
 * would fail ckpt_mem_prefix_ok: 4031 bytes at most), -EEXIST no free name in 8 tries,
 * -ENOMEM. */
int elastic_mem_open(elastic_mem **out, const char *dir, const char *run_id, int nproc);

/* XXH3-64 of uid (u32 little-endian) followed by the bytes of run_id, as 16 lowercase hex
 * digits into out (17 bytes). */
void elastic_mem_jobhash(unsigned uid, const char *run_id, char out[17]);

/* "<dir>/<prefix>": CKPT_MEM_PATH of the workers. */
const char *elastic_mem_path(const elastic_mem *m);

/* 1 when some <prefix>.own-* file exists (a worker that is train made a segment), else 0. */
int elastic_mem_has_own(const elastic_mem *m);

/* Start the replica (several nodes, mbps > 0): the server thread on bind_host, port 0, and
 * the sender thread capped at mbps x 10^6 bytes/s. token: the job token (NULL = none; copied,
 * never logged). metrics: may be NULL; gets ckpt_mem_replica_*. The address to publish goes
 * to addr ("host:port", addr_len >= 80). Errors (logged): -errno of socket/bind/listen or the
 * thread start; the job then runs without a replica. */
int elastic_mem_replica_start(elastic_mem *m, const char *bind_host, const char *token,
                              int mbps, elastic_metrics *metrics, char *addr, size_t addr_len);

/* A new round: this node is node_rank of nnodes in round gen; peer = "host:port" of node
 * (node_rank + 1) % nnodes's replica server, NULL while not known (nothing is sent). Every
 * slot is sent again to a new peer. No-op without a replica. */
void elastic_mem_round(elastic_mem *m, int gen, int node_rank, int nnodes, const char *peer);

/* Stop the threads (bounded by the socket timeouts) and unlink every <prefix>.* file, the
 * lease last; then free. Accepts NULL. */
void elastic_mem_close(elastic_mem *m);

#endif /* ELASTIC_AGENT_INTERNAL_H */
