/* agent.c - the elastic agent's main loop: store, rounds, serving a worker group, deciding
 * what a round's end means (success, restart, give up, preempted). See agent.h for the
 * contract, agent_workers.c for the processes and agent_rdzv.c for the multi-node protocol.
 *
 * Everything runs on the main thread around one poll(2): worker pipes, a signalfd (SIGCHLD,
 * SIGTERM, SIGINT; blocked in every thread) and, with several nodes, the rendezvous watcher's
 * notification pipe. Worker deaths are seen through SIGCHLD at once; the tick
 * (monitor_interval_s) only paces the hang watchdog and a safety waitpid. The metrics
 * (metrics.h) are updated from this thread; the only other thread of ours that reads them is
 * the --metrics-port server's, under their mutex.
 */
#include "clock.h"
#include "agent.h"

#include "agent_internal.h"
#include "log.h"
#include "metrics.h"
#include "store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WHY_MAX 512

enum outcome {
    OUT_SUCCESS,     /* every worker exited 0 */
    OUT_FAIL,        /* a worker exited non-zero (not 2) or by a signal, or could not start */
    OUT_USAGE,       /* a worker exited 2, or the command cannot be executed */
    OUT_HANG,        /* the watchdog fired */
    OUT_PREEMPT,     /* SIGTERM/SIGINT to the agent */
    OUT_REMOTE_STOP, /* another node stopped the round */
    OUT_END,         /* the job was ended by another node */
    OUT_LOST,        /* the store is gone */
};

typedef struct agent {
    const elastic_agent_opts *o;
    char *const *argv;
    char *path;
    int sigfd;
    int term_signal;
    elastic_sink out, err;
    elastic_store_server *srv;
    const char *master_addr;
    int master_port;
    char token[65];
    const char *tok; /* token in force, NULL = none */
    int multi;
    elastic_rdzv *rdzv;
    int restarts;
    elastic_guard guard;
    elastic_metrics *metrics;   /* NULL only when it could not be created */
    elastic_metrics_http *http; /* NULL = no --metrics-port */
    elastic_mem *mem;           /* NULL = no memory tier */
    int mem_replica;            /* the replica threads run */
    char mem_addr[96];          /* this agent's replica server, "host:port" */
    int mem_peer_pending;       /* the peer's address is still to be looked up */
    elastic_round mem_round;    /* the round it is looked up for */
    double mem_peer_tried;      /* monotonic time of the last look-up */
    int mem_dirty;              /* workers ran since the last flush (or success) */
} agent;

/* ------------------------------------------------------------------ checks and set-up */

static int valid_id(const char *s)
{
    size_t n = strlen(s);
    if (n < 1 || n > 64) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return 0;
    }
    return 1;
}

static int in(double v, double lo, double hi) { return v >= lo && v <= hi; }

static int check_opts(const elastic_agent_opts *o, char *const argv[])
{
    const char *bad = NULL;
    if (!argv || !argv[0] || !argv[0][0]) bad = "no worker command";
    else if (o->max_nodes < 1 || o->max_nodes > 4096) bad = "max nodes outside [1, 4096]";
    else if (o->min_nodes < 1 || o->min_nodes > o->max_nodes) bad = "min nodes outside [1, max]";
    else if (o->nproc_per_node < 1 || o->nproc_per_node > 4096)
        bad = "--nproc-per-node outside [1, 4096]";
    else if (o->max_restarts < 0 || o->max_restarts > 1000000)
        bad = "--max-restarts outside [0, 1000000]";
    else if (o->rdzv_port < 0 || o->rdzv_port > 65535) bad = "endpoint port outside [0, 65535]";
    else if (o->rdzv_id && !valid_id(o->rdzv_id))
        bad = "--rdzv-id must be 1-64 characters of [A-Za-z0-9_.-]";
    else if (!in(o->monitor_interval_s, 0.001, 60)) bad = "--monitor-interval outside [0.001, 60]";
    else if (!in(o->hang_timeout_s, 0, 1e6)) bad = "--hang-timeout outside [0, 1e6]";
    else if (!in(o->preempt_grace_s, 0, 86400)) bad = "--preempt-grace outside [0, 86400]";
    else if (!in(o->stop_grace_s, 0, 86400)) bad = "--stop-grace outside [0, 86400]";
    else if (!in(o->heartbeat_timeout_s, 0.1, 3600))
        bad = "--heartbeat-timeout outside [0.1, 3600]";
    else if (!in(o->last_call_s, 0, 3600)) bad = "--last-call outside [0, 3600]";
    else if (!in(o->join_timeout_s, 1, 86400)) bad = "--join-timeout outside [1, 86400]";
    else if (o->metrics_port < 0 || o->metrics_port > 65535)
        bad = "--metrics-port outside [0, 65535]";
    else if (o->metrics_addr && !*o->metrics_addr) bad = "--metrics-addr is empty";
    else if (o->mem_dir && !*o->mem_dir) bad = "--mem-dir is empty";
    else if (o->mem_replica_mbps < 0 || o->mem_replica_mbps > 1000000)
        bad = "--mem-replica-mbps outside [0, 1000000]";
    else if (o->max_nodes > 1 && (!o->rdzv_host || !*o->rdzv_host || o->rdzv_port < 1))
        bad = "several nodes need --rdzv-endpoint HOST:PORT with a port";
    else if (o->max_nodes > 1 && !o->rdzv_id)
        bad = "several nodes need --rdzv-id (the same on every node)";
    if (bad) LOG_E(EA_TAG, "%s", bad);
    return bad ? -EINVAL : 0;
}

/* argv[0] as execve wants it: a path with '/' as is, else searched in PATH. */
static char *resolve(const char *cmd)
{
    struct stat st;
    if (strchr(cmd, '/')) {
        if (stat(cmd, &st) != 0 || S_ISDIR(st.st_mode) || access(cmd, X_OK) != 0) return NULL;
        return strdup(cmd);
    }
    const char *path = getenv("PATH");
    if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
    size_t cl = strlen(cmd);
    while (*path) {
        const char *colon = strchr(path, ':');
        size_t dl = colon ? (size_t)(colon - path) : strlen(path);
        char *full = malloc(dl + cl + 3);
        if (!full) return NULL;
        if (dl == 0)
            snprintf(full, cl + 3, "./%s", cmd);
        else
            snprintf(full, dl + cl + 2, "%.*s/%s", (int)dl, path, cmd);
        if (stat(full, &st) == 0 && !S_ISDIR(st.st_mode) && access(full, X_OK) == 0) return full;
        free(full);
        path += dl + (colon ? 1 : 0);
    }
    return NULL;
}

static void warn_resume(char *const argv[])
{
    const char *base = strrchr(argv[0], '/');
    base = base ? base + 1 : argv[0];
    if (strcmp(base, "train") != 0) return;
    for (int i = 1; argv[i]; i++)
        if (!strcmp(argv[i], "--resume") || !strncmp(argv[i], "--resume=", 9)) return;
    LOG_W(EA_TAG, "the train command has no --resume: a restart would train again from step 0; "
          "add --resume auto (with --ckpt-dir) to continue from the newest snapshot");
}

static void fds_012(void)
{
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) >= 0) continue;
        int n = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
        if (n >= 0 && n != fd) close(n); /* cannot happen: lowest free fd is fd */
    }
}

static int random_token(char *out, size_t len)
{
    unsigned char b[16];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) return -EIO;
    if (len < 2 * sizeof b + 1) return -EINVAL;
    for (size_t i = 0; i < sizeof b; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
    explicit_bzero(b, sizeof b);
    return 0;
}

/* Is something listening at host:port? A plain TCP connect, at most timeout_s. */
static int endpoint_answers(const char *host, int port, double timeout_s)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    if (getaddrinfo(host, ps, &hints, &res) != 0) return 0;
    int ok = 0;
    for (struct addrinfo *ai = res; ai && !ok; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            ok = 1;
        } else if (errno == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            int e = 0;
            socklen_t el = sizeof e;
            if (poll(&p, 1, (int)(timeout_s * 1000)) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) == 0 && e == 0)
                ok = 1;
        }
        close(fd);
    }
    freeaddrinfo(res);
    return ok;
}

/* Single node: host the store, on a free port when the given one is busy. */
static int host_local_store(agent *a)
{
    const elastic_agent_opts *o = a->o;
    elastic_store_server_opts so = ELASTIC_STORE_SERVER_OPTS_INIT;
    so.host = o->rdzv_host ? o->rdzv_host : "127.0.0.1";
    so.port = o->rdzv_port;
    so.token = a->tok;
    /* a port that answers is taken: go to a free one without a bind error in the log */
    int rc = so.port != 0 && endpoint_answers(so.host, so.port, 0.5)
                 ? -EADDRINUSE
                 : elastic_store_server_start(&a->srv, &so);
    if (rc == -EADDRINUSE && so.port != 0) {
        LOG_W(EA_TAG, "store port %d on %s is busy: hosting the store on a free port instead "
              "(not a restart)", so.port, so.host);
        so.port = 0;
        rc = elastic_store_server_start(&a->srv, &so);
    }
    if (rc < 0) {
        LOG_E(EA_TAG, "cannot host the store on %s:%d: %s", so.host, so.port, strerror(-rc));
        return rc;
    }
    a->master_addr = so.host;
    a->master_port = elastic_store_server_port(a->srv);
    LOG_I(EA_TAG, "store on %s:%d (token required)", a->master_addr, a->master_port);
    return 0;
}

/* Does the endpoint's host resolve? One line and 0 when not (a usage error: the agent could
 * neither bind nor reach it). */
static int endpoint_resolves(const char *host, int port)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(host, NULL, &hints, &res);
    if (g == 0) {
        freeaddrinfo(res);
        return 1;
    }
    LOG_E(EA_TAG, "--rdzv-endpoint %s:%d: cannot resolve '%s': %s", host, port, host,
          g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
    return 0;
}

static int interrupted(void *arg);

/* Several nodes: host the store when the endpoint is free and ours, else join it. */
static int multi_store(agent *a)
{
    const elastic_agent_opts *o = a->o;
    const char *tok = getenv("ELASTIC_STORE_TOKEN");
    a->tok = tok && *tok ? tok : NULL;
    int hosting = 0;
    if (!endpoint_answers(o->rdzv_host, o->rdzv_port, 1.0)) {
        elastic_store_server_opts so = ELASTIC_STORE_SERVER_OPTS_INIT;
        so.host = o->rdzv_host;
        so.port = o->rdzv_port;
        so.token = a->tok;
        int rc = elastic_store_server_start(&a->srv, &so);
        if (rc == 0) {
            hosting = 1;
            LOG_I(EA_TAG, "hosting the rendezvous store at %s:%d (%s)", o->rdzv_host,
                  o->rdzv_port, a->tok ? "token from ELASTIC_STORE_TOKEN" : "no token");
        } else if (rc != -EADDRINUSE && rc != -EADDRNOTAVAIL) {
            LOG_E(EA_TAG, "cannot host the rendezvous store at %s:%d: %s", o->rdzv_host,
                  o->rdzv_port, strerror(-rc));
            return rc;
        }
    }
    if (!hosting)
        LOG_I(EA_TAG, "joining the rendezvous store at %s:%d", o->rdzv_host, o->rdzv_port);
    a->master_addr = o->rdzv_host;
    a->master_port = o->rdzv_port;
    elastic_rdzv_opts ro = {o->rdzv_host, o->rdzv_port, a->tok, o->rdzv_id, o->min_nodes,
                            o->max_nodes, o->nproc_per_node, o->last_call_s,
                            o->heartbeat_timeout_s, o->join_timeout_s, hosting, interrupted, a};
    return elastic_rdzv_open(&a->rdzv, &ro);
}

/* ------------------------------------------------------------------ signals between rounds */

/* Take pending signals: reap orphans, note SIGTERM/SIGINT. Returns the termination signal
 * seen (0 none). */
static int take_signals(agent *a)
{
    struct signalfd_siginfo si;
    while (read(a->sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
            a->term_signal = (int)si.ssi_signo;
            LOG_W(EA_TAG, "received %s", strsignal((int)si.ssi_signo));
        }
    }
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    return a->term_signal;
}

static int interrupted(void *arg) { return take_signals(arg) != 0; }

/* ------------------------------------------------------------------ memory tier */

/* A new round: publish this node's replica server and hand the sender no peer until the next
 * node's address is known (looked up from serve, without waiting). */
static void mem_round(agent *a, const elastic_round *rd)
{
    a->mem_peer_pending = 0;
    if (!a->mem_replica) return;
    elastic_mem_round(a->mem, rd->gen, rd->node_rank, rd->nnodes, NULL);
    if (rd->nnodes < 2) return;
    char k[64];
    snprintf(k, sizeof k, "mem/%d/%d", rd->gen, rd->node_rank);
    if (elastic_rdzv_set(a->rdzv, k, a->mem_addr) < 0) return; /* the store is lost: serve sees it */
    a->mem_round = *rd;
    a->mem_peer_pending = 1;
    a->mem_peer_tried = 0;
}

static void mem_peer_lookup(agent *a)
{
    double now = clock_now_s();
    if (!a->mem_peer_pending || now - a->mem_peer_tried < 0.2) return;
    a->mem_peer_tried = now;
    const elastic_round *rd = &a->mem_round;
    char k[64], *v = NULL;
    int peer = (rd->node_rank + 1) % rd->nnodes;
    snprintf(k, sizeof k, "mem/%d/%d", rd->gen, peer);
    int rc = elastic_rdzv_get(a->rdzv, k, &v);
    if (rc < 0) {
        a->mem_peer_pending = 0;
        return;
    }
    if (rc == 0) return;
    LOG_D(EA_TAG, "memory tier: round %d: replicas go to node %d at %s", rd->gen, peer, v);
    elastic_mem_round(a->mem, rd->gen, rd->node_rank, rd->nnodes, v);
    free(v);
    a->mem_peer_pending = 0;
}

/* Run the worker command in flush mode (agent.h "Memory tier") when a worker of this node made
 * a memory segment. preempt: a preemption (a further signal kills the flush at once). */
static void mem_flush(agent *a, const elastic_round *rd, const char *when, int preempt)
{
    const elastic_agent_opts *o = a->o;
    if (!a->mem_dirty) return; /* flushed already, or the workers succeeded */
    a->mem_dirty = 0;
    if (!a->mem || !elastic_mem_has_own(a->mem)) return;
    double limit = 6 * o->stop_grace_s < 60 ? 60 : 6 * o->stop_grace_s;
    elastic_wg_spec spec = {a->path, a->argv, 1, rd->node_rank, rd->nnodes, rd->gen,
                            o->max_restarts, a->master_addr, a->master_port, NULL,
                            o->rdzv_id ? o->rdzv_id : "none", &a->guard, NULL,
                            elastic_mem_path(a->mem), 1};
    LOG_I(EA_TAG, "flush %s: the newest memory snapshot goes to disk if it is newer (at most "
          "%g s)", when, limit);
    elastic_wg wg;
    int exec_errno = 0;
    double t0 = clock_now_s();
    int rc = elastic_wg_start(&wg, &spec, a->sigfd, &a->out, &a->err, &exec_errno);
    if (rc < 0) {
        LOG_E(EA_TAG, "flush failed: cannot start the worker command: %s",
              strerror(rc == -ENOEXEC ? exec_errno : -rc));
        if (wg.n) elastic_wg_stop(&wg, SIGKILL, 0, 0, "flush not started");
        elastic_wg_free(&wg);
        return;
    }
    int why_kill = 0; /* 1 timed out, 2 a signal */
    int warned = 0;
    /* elastic_wg_wait turns escalate 1 into 2 at the next SIGTERM/SIGINT: a preemption's flush
     * is armed from the start, a failure's after its first signal */
    wg.escalate = preempt ? 1 : 0;
    while (elastic_wg_running(&wg)) {
        double left = t0 + limit - clock_now_s();
        if (left <= 0) {
            why_kill = 1;
            break;
        }
        elastic_wg_wait(&wg, NULL, 0, left < 0.1 ? left : 0.1);
        if (wg.escalate == 2) {
            why_kill = 2;
            break;
        }
        if (wg.term_signal && !warned) {
            warned = 1;
            if (!a->term_signal) a->term_signal = wg.term_signal;
            LOG_W(EA_TAG, "flush: %s received: letting the flush finish, then exiting (a second "
                  "signal kills it)", strsignal(wg.term_signal));
            wg.escalate = 1;
        }
    }
    wg.escalate = 0;
    elastic_wg_stop(&wg, why_kill ? SIGKILL : SIGTERM, why_kill ? 0 : o->stop_grace_s, 0,
                    "flush");
    const elastic_worker *w = &wg.w[0];
    char how[96];
    elastic_wg_exit_text(w, how, sizeof how);
    double took = clock_now_s() - t0;
    if (why_kill == 1)
        LOG_E(EA_TAG, "flush timed out after %.1f s (limit max(60, 6 x --stop-grace)): killed",
              took);
    else if (why_kill == 2)
        LOG_E(EA_TAG, "flush killed after %.1f s by a second signal", took);
    else if (WIFEXITED(w->wstatus) && WEXITSTATUS(w->wstatus) == 0)
        LOG_I(EA_TAG, "flush finished: %s after %.3f s", how, took);
    else
        LOG_E(EA_TAG, "flush failed: %s after %.3f s", how, took);
    if (wg.term_signal && !a->term_signal) a->term_signal = wg.term_signal;
    elastic_wg_free(&wg);
}

/* Leaving the job with status: a failure or a preemption first flushes what workers left in
 * memory since the last flush (agent.h "Memory tier"). */
static int leave(agent *a, const elastic_round *rd, int status)
{
    if (status == ELASTIC_EXIT_FAILED || status == ELASTIC_EXIT_PREEMPTED)
        mem_flush(a, rd, status == ELASTIC_EXIT_PREEMPTED ? "on preemption" : "before exiting",
                  status == ELASTIC_EXIT_PREEMPTED);
    return status;
}

/* ------------------------------------------------------------------ one round */

static int serve(agent *a, elastic_wg *wg, char *why, size_t len)
{
    const elastic_agent_opts *o = a->o;
    struct pollfd ex[1];
    int nex = 0;
    if (a->rdzv) {
        ex[0] = (struct pollfd){elastic_rdzv_notify_fd(a->rdzv), POLLIN, 0};
        nex = 1;
    }
    for (;;) {
        elastic_wg_wait(wg, ex, nex, a->mem_peer_pending && o->monitor_interval_s > 0.2
                                         ? 0.2 : o->monitor_interval_s);
        mem_peer_lookup(a);
        if (wg->term_signal) {
            a->term_signal = wg->term_signal;
            snprintf(why, len, "%s received", strsignal(wg->term_signal));
            return OUT_PREEMPT;
        }
        if (a->rdzv) {
            unsigned ev = elastic_rdzv_events(a->rdzv);
            if (ev & ELASTIC_EV_LOST) return OUT_LOST;
            if (ev & ELASTIC_EV_END) return OUT_END;
            if (ev & ELASTIC_EV_STOP) return OUT_REMOTE_STOP;
        }
        const elastic_worker *f = elastic_wg_failed(wg);
        if (f) {
            char how[96];
            elastic_wg_exit_text(f, how, sizeof how);
            snprintf(why, len, "rank %d (pid %d) %s", f->rank, (int)f->pid, how);
            return WIFEXITED(f->wstatus) && WEXITSTATUS(f->wstatus) == 2 ? OUT_USAGE : OUT_FAIL;
        }
        if (elastic_wg_running(wg) == 0) return OUT_SUCCESS;
        if (o->hang_timeout_s > 0) {
            char desc[WHY_MAX - 64];
            if (elastic_wg_hung(wg, o->hang_timeout_s, clock_now_s(), desc, sizeof desc)) {
                snprintf(why, len, "hang watchdog (--hang-timeout %g s): %s", o->hang_timeout_s,
                         desc);
                return OUT_HANG;
            }
        }
    }
}

/* After a preemption stop: a rank that did not end by exit 0 or 143 (128 + SIGTERM, what a
 * worker that took its final snapshot returns) may not have written that snapshot. */
static void warn_lost_snapshots(const elastic_wg *wg)
{
    for (int i = 0; i < wg->n; i++) {
        const elastic_worker *w = &wg->w[i];
        if (w->pid <= 0 || !w->reaped) continue;
        int st = w->wstatus;
        if (WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 128 + SIGTERM)) continue;
        char how[64];
        if (WIFEXITED(st))
            snprintf(how, sizeof how, "status %d", WEXITSTATUS(st));
        else if (WIFSIGNALED(st))
            snprintf(how, sizeof how, "signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
        else
            snprintf(how, sizeof how, "wait status 0x%x", (unsigned)st);
        LOG_W(EA_TAG, "rank %d exited with %s during the preemption stop: its final snapshot may "
              "be missing; the next launch resumes from the newest committed one", w->rank, how);
    }
}

/* Several nodes, this node done: wait for the end of the job or a stop of the round. */
static int wait_done(agent *a)
{
    for (;;) {
        if (take_signals(a)) return OUT_PREEMPT;
        unsigned ev = elastic_rdzv_events(a->rdzv);
        if (ev & ELASTIC_EV_LOST) return OUT_LOST;
        if (ev & ELASTIC_EV_END) return OUT_END;
        if (ev & ELASTIC_EV_STOP) return OUT_REMOTE_STOP;
        int rc = elastic_rdzv_wait_end(a->rdzv, 0.1);
        if (rc < 0) return OUT_LOST;
        if (rc == 1) return OUT_END;
    }
}

static int lost_exit(agent *a)
{
    int rc = elastic_rdzv_lost(a->rdzv);
    LOG_E(EA_TAG, "lost the rendezvous store at %s:%d (%s): the agent hosting it is gone or "
          "unreachable; workers stopped, exiting", a->master_addr, a->master_port,
          strerror(rc < 0 ? -rc : ECONNRESET));
    return ELASTIC_EXIT_FAILED;
}

static int end_exit(agent *a)
{
    char why[WHY_MAX];
    int code = elastic_rdzv_end_code(a->rdzv, why, sizeof why);
    if (code == 0)
        LOG_I(EA_TAG, "job finished: %s", why);
    else
        LOG_E(EA_TAG, "job ended by another node (exit %d): %s", code, why);
    return code < 0 ? ELASTIC_EXIT_FAILED : code;
}

/* The whole job; returns the exit status. */
static int run_job(agent *a)
{
    const elastic_agent_opts *o = a->o;
    int gen = 0;
    char why[WHY_MAX], msg[WHY_MAX + 128];
    for (;;) {
        elastic_round rd = {gen, 0, 1};
        if (a->multi) {
            int rc = elastic_rdzv_join(a->rdzv, gen, &rd, interrupted, a);
            if (rc == -EINTR) {
                LOG_W(EA_TAG, "preempted while waiting for a round: exiting");
                return leave(a, &rd, ELASTIC_EXIT_PREEMPTED);
            }
            if (rc == -ECANCELED) return leave(a, &rd, end_exit(a));
            if (rc == -ETIMEDOUT && !elastic_rdzv_lost(a->rdzv)) {
                LOG_E(EA_TAG, "no round of %d..%d nodes could be formed within %g s "
                      "(--join-timeout)", o->min_nodes, o->max_nodes, o->join_timeout_s);
                return leave(a, &rd, ELASTIC_EXIT_FAILED);
            }
            if (rc == -EBADMSG || rc == -ENOMEM) { /* logged by the rendezvous (EBADMSG) */
                if (rc == -ENOMEM) LOG_E(EA_TAG, "joining a round: out of memory");
                return leave(a, &rd, ELASTIC_EXIT_FAILED);
            }
            if (rc < 0) return leave(a, &rd, lost_exit(a));
            elastic_rdzv_watch(a->rdzv, &rd, 0);
            mem_round(a, &rd);
        }
        int world = rd.nnodes * o->nproc_per_node;
        if (a->multi)
            LOG_I(EA_TAG, "round %d: node %d of %d, ranks %d..%d of world size %d", rd.gen,
                  rd.node_rank, rd.nnodes, rd.node_rank * o->nproc_per_node,
                  (rd.node_rank + 1) * o->nproc_per_node - 1, world);
        elastic_wg_spec spec = {a->path, a->argv, o->nproc_per_node, rd.node_rank, rd.nnodes,
                                rd.gen, o->max_restarts, a->master_addr, a->master_port, a->tok,
                                o->rdzv_id ? o->rdzv_id : "none", &a->guard, a->metrics,
                                a->mem ? elastic_mem_path(a->mem) : NULL, 0};
        elastic_wg wg;
        int exec_errno = 0, outcome;
        if (a->metrics &&
            elastic_metrics_round(a->metrics, rd.gen, rd.node_rank, world,
                                  rd.node_rank * o->nproc_per_node, o->nproc_per_node,
                                  clock_now_s()) < 0)
            LOG_W(EA_TAG, "metrics: out of memory for the per-rank series of round %d", rd.gen);
        int rc = elastic_wg_start(&wg, &spec, a->sigfd, &a->out, &a->err, &exec_errno);
        a->mem_dirty = 1;
        if (rc == -ENOEXEC) {
            snprintf(why, sizeof why, "cannot execute %s: %s", a->path, strerror(exec_errno));
            outcome = OUT_USAGE;
        } else if (rc < 0) {
            snprintf(why, sizeof why, "cannot start the workers: %s", strerror(-rc));
            outcome = OUT_FAIL;
        } else {
            why[0] = '\0';
            outcome = serve(a, &wg, why, sizeof why);
        }
        if (outcome != OUT_SUCCESS && a->metrics) {
            /* the goodput's restart window opens at the failure as the agent saw it: the
             * failed worker's exit, or now (a hang, a stop, a signal) */
            const elastic_worker *f = wg.n ? elastic_wg_failed(&wg) : NULL;
            double t = clock_now_s();
            elastic_metrics_interrupt(a->metrics, f && f->exited < t ? f->exited : t);
        }
        char kind = 0; /* multi: the kind of the round's stop in force */
        int exit_now = -1;
        switch (outcome) {
        case OUT_SUCCESS:
            elastic_wg_stop(&wg, SIGTERM, o->stop_grace_s, 0, "left over after success");
            elastic_wg_free(&wg);
            a->mem_dirty = 0; /* the workers finished: nothing to flush */
            if (!a->multi) {
                LOG_I(EA_TAG, "every worker exited 0");
                return ELASTIC_EXIT_OK;
            }
            if (elastic_rdzv_finish(a->rdzv, &rd) < 0) return lost_exit(a);
            LOG_I(EA_TAG, "round %d: every worker of this node exited 0; waiting for the other "
                  "nodes", rd.gen);
            outcome = wait_done(a);
            if (outcome == OUT_PREEMPT) {
                elastic_rdzv_stop_round(a->rdzv, rd.gen, 'P', "a finished node was preempted",
                                        NULL, NULL, 0);
                return ELASTIC_EXIT_PREEMPTED;
            }
            if (outcome == OUT_LOST) return lost_exit(a);
            if (outcome == OUT_END) return end_exit(a);
            /* OUT_REMOTE_STOP: another node failed after we finished: run the next round */
            if (a->metrics) elastic_metrics_interrupt(a->metrics, clock_now_s());
            if (elastic_rdzv_stop_round(a->rdzv, rd.gen, 0, NULL, &kind, why, sizeof why) < 0)
                return lost_exit(a);
            LOG_W(EA_TAG, "round %d stopped by another node: %s", rd.gen, why);
            break;
        case OUT_FAIL:
        case OUT_HANG:
            LOG_E(EA_TAG, "round %d: %s", rd.gen, why);
            if (a->multi) {
                snprintf(msg, sizeof msg, "node %d: %s", rd.node_rank, why);
                if (elastic_rdzv_stop_round(a->rdzv, rd.gen, 'F', msg, &kind, NULL, 0) < 0)
                    kind = 'F';
            }
            elastic_wg_stop(&wg, SIGTERM, o->stop_grace_s, 0,
                            outcome == OUT_HANG ? "hang" : "a worker failed");
            mem_flush(a, &rd, outcome == OUT_HANG ? "after the hang" : "after the failure", 0);
            break;
        case OUT_USAGE:
            LOG_E(EA_TAG, "round %d: %s: a usage or configuration error, not restarting", rd.gen,
                  why);
            if (a->multi) {
                snprintf(msg, sizeof msg, "node %d: %s (usage or configuration error)",
                         rd.node_rank, why);
                elastic_rdzv_end(a->rdzv, ELASTIC_EXIT_USAGE, msg);
            }
            elastic_wg_stop(&wg, SIGTERM, o->stop_grace_s, 0, "usage error");
            exit_now = ELASTIC_EXIT_USAGE;
            break;
        case OUT_PREEMPT:
            LOG_W(EA_TAG, "preempted (%s): SIGTERM to the workers, up to %g s (--preempt-grace) "
                  "for them to exit", why, o->preempt_grace_s);
            if (a->multi) {
                snprintf(msg, sizeof msg, "node %d was preempted", rd.node_rank);
                elastic_rdzv_stop_round(a->rdzv, rd.gen, 'P', msg, NULL, NULL, 0);
            }
            elastic_wg_stop(&wg, SIGTERM, o->preempt_grace_s, 1, "preemption");
            warn_lost_snapshots(&wg);
            mem_flush(a, &rd, "on preemption", 1);
            exit_now = ELASTIC_EXIT_PREEMPTED;
            break;
        case OUT_REMOTE_STOP:
            if (elastic_rdzv_stop_round(a->rdzv, rd.gen, 0, NULL, &kind, why, sizeof why) < 0) {
                elastic_wg_stop(&wg, SIGTERM, o->stop_grace_s, 0, "store lost");
                exit_now = lost_exit(a);
                break;
            }
            LOG_W(EA_TAG, "round %d stopped: %s", rd.gen, why);
            elastic_wg_stop(&wg, SIGTERM, kind == 'F' ? o->stop_grace_s : o->preempt_grace_s,
                            kind != 'F', kind == 'F' ? "the round failed" : "graceful stop");
            break;
        case OUT_END:
            elastic_wg_stop(&wg, SIGTERM, o->stop_grace_s, 0, "the job ended");
            exit_now = end_exit(a);
            break;
        case OUT_LOST:
        default:
            elastic_wg_stop(&wg, SIGTERM, o->stop_grace_s, 0, "store lost");
            exit_now = lost_exit(a);
            break;
        }
        if (exit_now < 0 && wg.n && elastic_wg_any_usage_error(&wg)) {
            const elastic_worker *f = elastic_wg_failed(&wg);
            char how[96];
            elastic_wg_exit_text(f, how, sizeof how);
            LOG_E(EA_TAG, "round %d: rank %d (pid %d) %s: a usage or configuration error, not "
                  "restarting", rd.gen, f->rank, (int)f->pid, how);
            if (a->multi) {
                snprintf(msg, sizeof msg, "node %d: rank %d %s (usage or configuration error)",
                         rd.node_rank, f->rank, how);
                elastic_rdzv_end(a->rdzv, ELASTIC_EXIT_USAGE, msg);
            }
            exit_now = ELASTIC_EXIT_USAGE;
        }
        if (exit_now < 0 && (wg.term_signal || a->term_signal)) {
            if (!a->term_signal) a->term_signal = wg.term_signal;
            LOG_W(EA_TAG, "preempted while stopping the workers: exiting");
            mem_flush(a, &rd, "on preemption", 1);
            if (a->multi)
                elastic_rdzv_stop_round(a->rdzv, rd.gen, 'P', "a node was preempted", NULL, NULL,
                                        0);
            exit_now = ELASTIC_EXIT_PREEMPTED;
        }
        elastic_wg_free(&wg);
        if (exit_now >= 0) return leave(a, &rd, exit_now);
        int counted = a->multi ? kind == 'F' : (outcome == OUT_FAIL || outcome == OUT_HANG);
        if (counted) {
            if (a->restarts >= o->max_restarts) {
                mem_flush(a, &rd, "before giving up", 0);
                snprintf(msg, sizeof msg, "restart budget exhausted: %d restart(s) used of "
                         "--max-restarts %d; last failure: %s", a->restarts, o->max_restarts,
                         why);
                LOG_E(EA_TAG, "giving up: %s", msg);
                if (a->multi) elastic_rdzv_end(a->rdzv, ELASTIC_EXIT_FAILED, msg);
                return ELASTIC_EXIT_FAILED;
            }
            a->restarts++;
            if (a->metrics) elastic_metrics_restart(a->metrics);
            LOG_W(EA_TAG, "restart %d of at most %d", a->restarts, o->max_restarts);
        }
        if (a->multi) elastic_rdzv_unwatch(a->rdzv);
        gen = rd.gen + 1;
    }
}

/* ------------------------------------------------------------------ entry */

int elastic_agent_run(const elastic_agent_opts *o, char *const argv[])
{
    static const elastic_agent_opts defaults = ELASTIC_AGENT_OPTS_INIT;
    if (!o) o = &defaults;
    if (check_opts(o, argv) < 0) return ELASTIC_EXIT_USAGE;
    agent a;
    memset(&a, 0, sizeof a);
    a.o = o;
    a.argv = argv;
    a.sigfd = -1;
    a.guard = (elastic_guard){0, -1, 0};
    a.multi = o->max_nodes > 1;
    a.path = resolve(argv[0]);
    if (!a.path) {
        LOG_E(EA_TAG, "cannot run '%s': %s", argv[0],
              strchr(argv[0], '/') ? "no such executable file" : "not found in PATH");
        return ELASTIC_EXIT_USAGE;
    }
    if (o->rdzv_host && !endpoint_resolves(o->rdzv_host, o->rdzv_port)) {
        free(a.path);
        return ELASTIC_EXIT_USAGE;
    }
    warn_resume(argv);
    fds_012();
    a.out = (elastic_sink){STDOUT_FILENO, 0, 0, 0};
    a.err = (elastic_sink){STDERR_FILENO, 0, 0, 0};

    /* signals: blocked in every thread (the store server's and the watcher's inherit the mask)
     * and read from a signalfd by the main loop */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* the guardian before any thread and fd of ours exists: it inherits the blocked mask, so a
     * ^C between its fork and its own set-up cannot kill it */
    elastic_guard_start(&a.guard);
    a.sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    int status = ELASTIC_EXIT_FAILED;
    if (a.sigfd < 0) {
        LOG_E(EA_TAG, "signalfd: %s", strerror(errno));
        goto out;
    }
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
        LOG_W(EA_TAG, "cannot become a child subreaper (%s): grandchildren of workers that "
              "outlive them are reaped by init", strerror(errno));

    /* the memory tier before any worker: its lease, the stale clean-up */
    {
        int rc = elastic_mem_open(&a.mem, o->mem_dir ? o->mem_dir : "/dev/shm",
                                  o->rdzv_id ? o->rdzv_id : "none", o->nproc_per_node);
        if (rc < 0 && o->mem_dir) {
            status = ELASTIC_EXIT_USAGE; /* logged: the folder given is unusable */
            goto out;
        }
        if (rc < 0)
            LOG_W(EA_TAG, "memory tier off: /dev/shm is unusable (give --mem-dir)");
    }

    /* metrics before the store: a port that cannot be served fails before this agent joins
     * anything; they also feed the goodput report, with or without a server */
    if (elastic_metrics_create(&a.metrics, clock_now_s()) < 0)
        LOG_W(EA_TAG, "out of memory for the metrics: running without them and the goodput "
              "report");
    if (o->metrics_port > 0) {
        int rc = a.metrics ? elastic_metrics_http_start(&a.http, o->metrics_addr ? o->metrics_addr
                                                        : "127.0.0.1", o->metrics_port,
                                                        a.metrics)
                           : -ENOMEM;
        if (rc < 0) {
            if (rc == -EINVAL) status = ELASTIC_EXIT_USAGE; /* the address does not resolve */
            elastic_metrics_free(a.metrics); /* nothing ran: no goodput report */
            a.metrics = NULL;
            goto out;
        }
    }

    if (a.multi) {
        int rc = multi_store(&a);
        if (rc == -EINTR) {
            LOG_W(EA_TAG, "preempted while waiting for the rendezvous store: exiting");
            status = ELASTIC_EXIT_PREEMPTED;
        }
        /* refused by the job (other settings) or the store serves another job (logged) */
        if (rc == -EINVAL || rc == -EBUSY) status = ELASTIC_EXIT_USAGE;
        if (rc < 0) goto out;
        char host[80];
        if (a.mem && o->mem_replica_mbps > 0) {
            if ((rc = elastic_rdzv_local_addr(a.rdzv, host, sizeof host)) < 0)
                LOG_W(EA_TAG, "memory tier: no local address of the store connection (%s): no "
                      "peer replica", strerror(-rc));
            else if (elastic_mem_replica_start(a.mem, host, a.tok, o->mem_replica_mbps,
                                               a.metrics, a.mem_addr, sizeof a.mem_addr) == 0)
                a.mem_replica = 1;
        }
    } else {
        if (random_token(a.token, sizeof a.token) < 0) {
            LOG_E(EA_TAG, "cannot draw a random store token");
            goto out;
        }
        a.tok = a.token;
        if (host_local_store(&a) < 0) goto out;
    }
    char hang[48] = "off";
    if (o->hang_timeout_s > 0) snprintf(hang, sizeof hang, "%g s", o->hang_timeout_s);
    LOG_I(EA_TAG, "%d worker(s) per node, %d..%d node(s), --max-restarts %d, hang timeout %s",
          o->nproc_per_node, o->min_nodes, o->max_nodes, o->max_restarts, hang);
    status = run_job(&a);
out:
    elastic_mem_close(a.mem); /* every worker and the flush are gone by now */
    if (a.metrics) {
        double now = clock_now_s();
        elastic_metrics_end(a.metrics, now);
        elastic_metrics_log_goodput(a.metrics, now);
    }
    elastic_sink_finish(&a.out);
    elastic_sink_finish(&a.err);
    elastic_rdzv_close(a.rdzv);
    elastic_store_server_stop(a.srv);
    explicit_bzero(a.token, sizeof a.token);
    if (a.sigfd >= 0) close(a.sigfd);
    elastic_guard_finish(&a.guard);
    elastic_metrics_http_stop(a.http); /* after the store: a last scrape sees the end */
    elastic_metrics_free(a.metrics);
    free(a.path);
    /* the signals stay blocked: a late SIGTERM must not turn the status into a signal death */
    return status;
}
