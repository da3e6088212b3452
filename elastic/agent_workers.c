/* agent_workers.c - the local worker group of the elastic agent: fork/exec in own process
 * groups, output relay, progress lines, reaping, the bounded stop (SIGTERM, grace, SIGKILL of
 * whole groups, reap everything), and the orphan guardian that kills those groups when the
 * agent dies (agent.h "Orphans").
 *
 * Why process groups: a worker may have children of its own (a data loader, a shell wrapper);
 * killing the worker alone would leave them holding memory, ports or files while its successor
 * starts (case C29). Each worker leads its own group, so kill(-pgid) reaches all of them, and
 * the agent is a child subreaper, so orphaned grandchildren come back to it to be reaped.
 * A group counts as gone only once kill(-pgid, 0) says ESRCH, which needs its zombies reaped.
 *
 * The child between fork and exec calls only async-signal-safe functions (the agent has other
 * threads: the store server and the rendezvous watcher); everything it needs (path, argv,
 * environment) is prepared before the fork.
 */
#include "clock.h"
#include "agent_internal.h"

#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define HB_FD 3       /* ELASTIC_HEARTBEAT_FD in every worker */
#define STATUS_FD 4   /* exec status pipe in the child until exec */
#define READS_PER_WAKE 16
#define KILL_WAIT_S 10.0

/* ------------------------------------------------------------------ sinks */

static int write_all(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t w = writev(fd, iov, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd p = {fd, POLLOUT, 0};
                if (poll(&p, 1, (int)(ELASTIC_SINK_WAIT_S * 1000)) <= 0) return -EAGAIN;
                continue;
            }
            return -errno;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

static const char *sink_name(const elastic_sink *s)
{
    return s->fd == STDOUT_FILENO ? "stdout" : s->fd == STDERR_FILENO ? "stderr" : "output";
}

static void stall(elastic_sink *s)
{
    if (!s->stalled && s->fd != STDERR_FILENO) /* a log line to a stalled stderr would block */
        LOG_W(EA_TAG, "output to the agent's %s is blocked: dropping worker lines until its "
              "reader catches up", sink_name(s));
    s->stalled = 1;
    s->dropped++;
}

void elastic_sink_finish(elastic_sink *s)
{
    if (!s->dead && s->stalled && s->dropped) {
        char note[128];
        int n = snprintf(note, sizeof note, "[elastic] %lu lines of worker output were dropped: "
                         "the reader of this output was too slow\n", s->dropped);
        struct pollfd p = {s->fd, POLLOUT, 0};
        if (poll(&p, 1, 0) == 1) {
            struct iovec v = {note, (size_t)n};
            write_all(s->fd, &v, 1);
        } else if (s->fd != STDERR_FILENO) {
            LOG_W(EA_TAG, "%lu lines of worker output were dropped: the reader of the agent's %s "
                  "was too slow", s->dropped, sink_name(s));
        }
    }
    s->stalled = 0;
    s->dropped = 0;
}

void elastic_sink_line(elastic_sink *s, const char *prefix, size_t plen, const char *line,
                       size_t len)
{
    if (s->dead) return;
    struct pollfd p = {s->fd, POLLOUT, 0};
    int r;
    do r = poll(&p, 1, s->stalled ? 0 : (int)(ELASTIC_SINK_WAIT_S * 1000));
    while (r < 0 && errno == EINTR);
    if (r <= 0) {
        stall(s);
        return;
    }
    if (s->stalled) {
        char note[128];
        int n = snprintf(note, sizeof note, "[elastic] %lu lines dropped: the reader of this "
                         "output was too slow\n", s->dropped);
        struct iovec v = {note, (size_t)n};
        s->stalled = 0;
        s->dropped = 0;
        if (write_all(s->fd, &v, 1) == -EPIPE) {
            s->dead = 1;
            return;
        }
    }
    struct iovec iov[3] = {{(void *)prefix, plen}, {(void *)line, len}, {"\n", 1}};
    int e = write_all(s->fd, iov, 3);
    if (e == -EAGAIN) {
        stall(s);
    } else if (e < 0) {
        s->dead = 1; /* EPIPE, EBADF, ...: the reader is gone for good */
    }
}

/* ------------------------------------------------------------------ orphan guardian */

/* The guardian's side. It was forked before the agent made any thread, so it may call
 * anything; it leaves by _exit (no atexit handlers, no leak check of the agent's memory). */
/* "<op><pid>\n" into buf (at least 24 bytes) without stdio: async-signal-safe. */
static size_t guard_line(char *buf, char op, pid_t pid)
{
    char digits[20];
    size_t n = 0, k = 0;
    unsigned long v = (unsigned long)pid;
    do digits[n++] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    buf[k++] = op;
    while (n) buf[k++] = digits[--n];
    buf[k++] = '\n';
    return k;
}

static void close_from(int lo);
static void guardian(int rfd) __attribute__((noreturn));

static void guardian(int rfd)
{
    setpgid(0, 0); /* out of the agent's (terminal's) group: ^C and killpg do not reach us */
    prctl(PR_SET_NAME, "elastic-guard");
    sigset_t set;
    sigemptyset(&set);
    int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU, SIGPIPE,
                  SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaddset(&set, sigs[i]);
    sigprocmask(SIG_SETMASK, &set, NULL);
    /* keep only the pipe (as fd 3) and /dev/null on 0..2: a reader of the agent's stdout or
     * stderr must see EOF when the agent ends, not when the guardian does */
    if (rfd != 3 && dup2(rfd, 3) < 0) _exit(1);
    int nul = open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3 && nul >= 0; fd++)
        if (nul != fd) dup2(nul, fd);
    close_from(4);
    pid_t *groups = NULL;
    size_t n = 0, cap = 0;
    char buf[4096];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(3, buf + len, sizeof buf - len);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* EOF: every write end is closed, the agent is gone */
        len += (size_t)r;
        size_t start = 0;
        for (size_t i = 0; i < len; i++) {
            if (buf[i] != '\n') continue;
            buf[i] = '\0';
            const char *line = buf + start;
            start = i + 1;
            if (!strcmp(line, "exit")) _exit(0);
            long pg = strtol(line + 1, NULL, 10);
            if (pg <= 1) continue;
            if (line[0] == '+') {
                if (n == cap) {
                    size_t nc = cap ? 2 * cap : 64;
                    pid_t *g = realloc(groups, nc * sizeof *g);
                    if (!g) continue; /* cannot list it: the death signal still gets the leader */
                    groups = g;
                    cap = nc;
                }
                groups[n++] = (pid_t)pg;
            } else if (line[0] == '-') {
                for (size_t k = 0; k < n; k++)
                    if (groups[k] == (pid_t)pg) {
                        groups[k] = groups[--n];
                        break;
                    }
            }
        }
        memmove(buf, buf + start, len - start);
        len -= start;
        if (len == sizeof buf) len = 0; /* no line is that long: resynchronise */
    }
    for (size_t k = 0; k < n; k++) {
        kill(-groups[k], SIGCONT);
        kill(-groups[k], SIGKILL);
    }
    _exit(0);
}

int elastic_guard_start(elastic_guard *g)
{
    int p[2];
    *g = (elastic_guard){0, -1, 0};
    if (pipe2(p, O_CLOEXEC) != 0) {
        int e = errno;
        LOG_W(EA_TAG, "cannot start the orphan guardian (pipe: %s): children of workers would "
              "survive a SIGKILL of the agent", strerror(e));
        return -e;
    }
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        close(p[0]);
        close(p[1]);
        LOG_W(EA_TAG, "cannot start the orphan guardian (fork: %s): children of workers would "
              "survive a SIGKILL of the agent", strerror(e));
        return -e;
    }
    if (pid == 0) {
        close(p[1]);
        guardian(p[0]);
    }
    setpgid(pid, pid); /* both sides, whichever runs first */
    close(p[0]);
    fcntl(p[1], F_SETFL, O_NONBLOCK); /* a stopped guardian must not stop the agent */
    g->pid = pid;
    g->fd = p[1];
    LOG_D(EA_TAG, "orphan guardian: pid %d", (int)pid);
    return 0;
}

void elastic_guard_note(elastic_guard *g, char op, pid_t pgid)
{
    if (!g || g->fd < 0 || g->broken) return;
    char line[24];
    size_t n = guard_line(line, op, pgid);
    ssize_t w;
    do w = write(g->fd, line, n);
    while (w < 0 && errno == EINTR);
    if (w == (ssize_t)n) return;
    g->broken = 1;
    LOG_W(EA_TAG, "the orphan guardian (pid %d) %s: children of workers would survive a "
          "SIGKILL of the agent", (int)g->pid,
          w < 0 && errno == EAGAIN ? "does not read its pipe" : "is gone");
}

void elastic_guard_finish(elastic_guard *g)
{
    if (g->fd >= 0) {
        ssize_t w = write(g->fd, "exit\n", 5);
        (void)w; /* a guardian that misses it sees EOF with no group listed, or kills leftovers */
        close(g->fd);
        g->fd = -1;
    }
    if (g->pid > 0) {
        for (int i = 0; i < 400; i++) { /* it exits at once; bounded all the same */
            pid_t r = waitpid(g->pid, NULL, WNOHANG);
            if (r != 0) break; /* reaped, or already reaped by a waitpid(-1) */
            struct timespec ts = {0, 5 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        g->pid = 0;
    }
}

/* ------------------------------------------------------------------ spawning */

static const char *const managed[] = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_STORE_HOSTED",
    "ELASTIC_STORE_TOKEN", "ELASTIC_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT",
    "ELASTIC_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS",
    "ELASTIC_HEARTBEAT_FD", "CKPT_MEM_PATH", "CKPT_MEM_FLUSH", NULL};

static int is_managed(const char *kv)
{
    for (int i = 0; managed[i]; i++) {
        size_t n = strlen(managed[i]);
        if (!strncmp(kv, managed[i], n) && kv[n] == '=') return 1;
    }
    return 0;
}

/* The environment of one worker: the agent's, minus the variables we set, plus ours. */
static char **build_env(const elastic_wg_spec *s, int local_rank)
{
    size_t n = 0;
    for (char **e = environ; e && *e; e++) n++;
    char **env = calloc(n + 24, sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (char **e = environ; e && *e; e++)
        if (!is_managed(*e) && !(env[k++] = strdup(*e))) goto fail;
    int world = s->nnodes * s->nproc;
    int rank = s->node_rank * s->nproc + local_rank;
    if (s->mem_path && !s->flush && asprintf(&env[k++], "CKPT_MEM_PATH=%s", s->mem_path) < 0) {
        env[--k] = NULL;
        goto fail;
    }
    if (s->flush) {
        /* the flush command (agent.h "Memory tier"): no rank, no world, no store */
        if (asprintf(&env[k++], "CKPT_MEM_PATH=%s", s->mem_path ? s->mem_path : "") < 0 ||
            asprintf(&env[k++], "CKPT_MEM_FLUSH=1") < 0 ||
            asprintf(&env[k++], "ELASTIC_RESTART_COUNT=%d", s->gen) < 0 ||
            asprintf(&env[k++], "ELASTIC_RUN_ID=%s", s->run_id) < 0 ||
            asprintf(&env[k++], "TORCHELASTIC_RUN_ID=%s", s->run_id) < 0 ||
            asprintf(&env[k++], "ELASTIC_HEARTBEAT_FD=%d", HB_FD) < 0) {
            env[--k] = NULL;
            goto fail;
        }
        env[k] = NULL;
        return env;
    }
#define ADD(...)                                                                               \
    do {                                                                                       \
        if (asprintf(&env[k], __VA_ARGS__) < 0) {                                              \
            env[k] = NULL;                                                                     \
            goto fail;                                                                         \
        }                                                                                      \
        k++;                                                                                   \
    } while (0)
    ADD("RANK=%d", rank);
    ADD("LOCAL_RANK=%d", local_rank);
    ADD("WORLD_SIZE=%d", world);
    ADD("LOCAL_WORLD_SIZE=%d", s->nproc);
    ADD("GROUP_RANK=%d", s->node_rank);
    ADD("GROUP_WORLD_SIZE=%d", s->nnodes);
    ADD("ROLE_RANK=%d", rank);
    ADD("ROLE_WORLD_SIZE=%d", world);
    ADD("MASTER_ADDR=%s", s->master_addr);
    ADD("MASTER_PORT=%d", s->master_port);
    ADD("ELASTIC_STORE_HOSTED=1");
    if (s->token && *s->token) ADD("ELASTIC_STORE_TOKEN=%s", s->token);
    ADD("ELASTIC_RESTART_COUNT=%d", s->gen);
    ADD("TORCHELASTIC_RESTART_COUNT=%d", s->gen);
    ADD("ELASTIC_RUN_ID=%s", s->run_id);
    ADD("TORCHELASTIC_RUN_ID=%s", s->run_id);
    ADD("TORCHELASTIC_MAX_RESTARTS=%d", s->max_restarts);
    ADD("ELASTIC_HEARTBEAT_FD=%d", HB_FD);
#undef ADD
    env[k] = NULL;
    return env;
fail:
    for (size_t i = 0; i < k; i++) free(env[i]);
    free(env);
    return NULL;
}

static void free_env(char **env)
{
    if (!env) return;
    for (char **e = env; *e; e++) free(*e);
    free(env);
}

static void close_from(int lo)
{
#ifdef SYS_close_range
    if (syscall(SYS_close_range, (unsigned)lo, ~0u, 0u) == 0) return;
#endif
    long max = sysconf(_SC_OPEN_MAX);
    if (max < 0 || max > 65536) max = 65536;
    for (int fd = lo; fd < max; fd++) close(fd);
}

/* In the child: async-signal-safe calls only. Never returns. */
static void child(const char *path, char *const argv[], char *const envp[], int out_w, int err_w,
                  int hb_w, int st_w, int devnull, pid_t parent, int guard_fd)
{
    int e = 0;
    setpgid(0, 0);
    /* the parent-death signal fires when the forking thread exits: we fork from the agent's
     * main thread, which lives as long as the agent. Check the parent after arming it, or a
     * parent that died in between would go unnoticed. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);
    /* list our group with the guardian before anything of the user's runs: an agent killed
     * from here on leaves no unlisted group behind (before, the death signal kills us). Done
     * before the dup2s below, which may reuse guard_fd's number. */
    if (guard_fd >= 0) {
        char line[24];
        ssize_t w = write(guard_fd, line, guard_line(line, '+', getpid()));
        (void)w;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPIPE, &sa, NULL); /* ignored dispositions survive exec */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    int hb = fcntl(hb_w, F_DUPFD, 10);
    int st = fcntl(st_w, F_DUPFD_CLOEXEC, 10);
    if (hb < 0 || st < 0 || dup2(devnull, 0) < 0 || dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0 ||
        dup2(hb, HB_FD) < 0 || dup3(st, STATUS_FD, O_CLOEXEC) < 0) {
        e = errno;
        if (st >= 0) {
            ssize_t w = write(st, &e, sizeof e);
            (void)w;
        }
        _exit(127);
    }
    close_from(STATUS_FD + 1);
    execve(path, argv, envp);
    e = errno;
    ssize_t w = write(STATUS_FD, &e, sizeof e);
    (void)w;
    _exit(127);
}

static void stream_init(elastic_stream *s, int fd, elastic_sink *sink)
{
    s->fd = fd;
    s->sink = sink;
    s->len = 0;
}

static int start_one(elastic_wg *wg, elastic_worker *w, const elastic_wg_spec *s, int devnull,
                     int *exec_errno)
{
    int out[2] = {-1, -1}, err[2] = {-1, -1}, hb[2] = {-1, -1}, st[2] = {-1, -1};
    char **env = build_env(s, w->local_rank);
    int rc = 0;
    if (!env) return -ENOMEM;
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(hb, O_CLOEXEC) ||
        pipe2(st, O_CLOEXEC)) {
        rc = -errno;
        LOG_E(EA_TAG, "cannot create the pipes of rank %d: %s", w->rank, strerror(-rc));
        goto out;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        rc = -errno;
        LOG_E(EA_TAG, "cannot fork rank %d: %s", w->rank, strerror(-rc));
        goto out;
    }
    if (pid == 0)
        child(s->path, s->argv, env, out[1], err[1], hb[1], st[1], devnull, parent,
              s->guard && !s->guard->broken ? s->guard->fd : -1);
    /* both sides set the group, whichever runs first (the child may already have exec'ed:
     * EACCES then, and its own setpgid has been done) */
    setpgid(pid, pid);
    w->pid = pid;
    w->started = w->last_progress = clock_now_s();
    if (wg->metrics) elastic_metrics_rank_up(wg->metrics, w->local_rank, 1);
    close(out[1]);
    close(err[1]);
    close(hb[1]);
    close(st[1]);
    out[1] = err[1] = hb[1] = st[1] = -1;
    int e = 0;
    ssize_t n;
    do n = read(st[0], &e, sizeof e);
    while (n < 0 && errno == EINTR);
    if (n == (ssize_t)sizeof e) {
        *exec_errno = e;
        rc = -ENOEXEC;
    }
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    fcntl(hb[0], F_SETFL, O_NONBLOCK);
    stream_init(&w->out, out[0], wg->out);
    stream_init(&w->err, err[0], wg->err);
    w->hb_fd = hb[0];
    out[0] = err[0] = hb[0] = -1;
    LOG_D(EA_TAG, "rank %d (local %d): pid %d", w->rank, w->local_rank, (int)pid);
out:
    for (int i = 0; i < 2; i++) {
        if (out[i] >= 0) close(out[i]);
        if (err[i] >= 0) close(err[i]);
        if (hb[i] >= 0) close(hb[i]);
        if (st[i] >= 0) close(st[i]);
    }
    free_env(env);
    return rc;
}

int elastic_wg_start(elastic_wg *wg, const elastic_wg_spec *s, int sigfd, elastic_sink *out,
                     elastic_sink *err, int *exec_errno)
{
    memset(wg, 0, sizeof *wg);
    wg->sigfd = sigfd;
    wg->gen = s->gen;
    wg->out = out;
    wg->err = err;
    wg->guard = s->guard;
    wg->metrics = s->metrics;
    wg->flush = s->flush;
    wg->started = clock_now_s();
    wg->w = calloc((size_t)s->nproc, sizeof *wg->w);
    wg->pfd = calloc(3 * (size_t)s->nproc + 1 + ELASTIC_WG_EXTRA_MAX, sizeof *wg->pfd);
    if (!wg->w || !wg->pfd) {
        free(wg->w);
        free(wg->pfd);
        wg->w = NULL;
        wg->pfd = NULL;
        return -ENOMEM;
    }
    wg->n = s->nproc;
    for (int i = 0; i < s->nproc; i++) {
        elastic_worker *w = &wg->w[i];
        w->local_rank = i;
        w->rank = s->node_rank * s->nproc + i;
        w->out.fd = w->err.fd = w->hb_fd = -1;
        w->last_step = -1;
        w->gone = 1; /* until started */
        w->prefix_len = (size_t)snprintf(w->prefix, sizeof w->prefix,
                                         s->flush ? "[flush] " : "[rank %d] ", w->rank);
    }
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) {
        int e = -errno;
        LOG_E(EA_TAG, "cannot open /dev/null: %s", strerror(-e));
        return e;
    }
    int rc = 0;
    for (int i = 0; i < s->nproc && rc == 0; i++) {
        rc = start_one(wg, &wg->w[i], s, devnull, exec_errno);
        if (wg->w[i].pid > 0) wg->w[i].gone = 0;
    }
    close(devnull);
    if (rc == 0 && s->flush) {
        LOG_I(EA_TAG, "flush: started the worker command with CKPT_MEM_FLUSH=1 (pid %d)",
              (int)wg->w[0].pid);
    } else if (rc == 0) {
        char pids[256];
        size_t off = 0;
        for (int i = 0; i < wg->n && off < sizeof pids - 16; i++)
            off += (size_t)snprintf(pids + off, sizeof pids - off, "%s%d", i ? " " : "",
                                    (int)wg->w[i].pid);
        LOG_I(EA_TAG, "round %d: started ranks %d..%d of %d (pids %s)", s->gen, wg->w[0].rank,
              wg->w[wg->n - 1].rank, s->nnodes * s->nproc, pids);
    }
    return rc;
}

/* ------------------------------------------------------------------ serving */

static void emit(elastic_worker *w, elastic_stream *s, const char *p, size_t len)
{
    elastic_sink_line(s->sink, w->prefix, w->prefix_len, p, len);
}

/* Relay what the pipe holds; at EOF flush a partial line and close. */
static void stream_read(elastic_worker *w, elastic_stream *s)
{
    for (int k = 0; k < READS_PER_WAKE && s->fd >= 0; k++) {
        ssize_t n = read(s->fd, s->buf + s->len, sizeof s->buf - s->len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            n = 0; /* treat other errors as the end */
        }
        if (n == 0) {
            if (s->len) emit(w, s, s->buf, s->len);
            s->len = 0;
            close(s->fd);
            s->fd = -1;
            return;
        }
        s->len += (size_t)n;
        size_t start = 0;
        for (size_t i = s->len - (size_t)n; i < s->len; i++) {
            if (s->buf[i] != '\n') continue;
            emit(w, s, s->buf + start, i - start);
            start = i + 1;
        }
        if (start == 0 && s->len == sizeof s->buf) { /* a line longer than the buffer: cut */
            emit(w, s, s->buf, s->len);
            start = s->len;
        }
        memmove(s->buf, s->buf + start, s->len - start);
        s->len -= start;
    }
}

static void hb_read(elastic_wg *wg, elastic_worker *w)
{
    char buf[512];
    for (int k = 0; k < READS_PER_WAKE && w->hb_fd >= 0; k++) {
        ssize_t n = read(w->hb_fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            n = 0;
        }
        if (n == 0) {
            close(w->hb_fd);
            w->hb_fd = -1;
            return;
        }
        double t = clock_now_s();
        for (ssize_t i = 0; i < n; i++) {
            char c = buf[i];
            if (c != '\n') {
                if (w->hb_len < sizeof w->hb_buf - 1) w->hb_buf[w->hb_len++] = c;
                else w->hb_long = 1;
                continue;
            }
            w->hb_buf[w->hb_len] = '\0';
            long long step;
            if (sscanf(w->hb_buf, "step %lld", &step) == 1) w->last_step = step;
            /* a cut line goes in at its full buffer size, which the parser counts as
             * malformed (over ELASTIC_REPORT_LINE_MAX - 1 bytes) */
            if (wg->metrics)
                elastic_metrics_line(wg->metrics, w->local_rank, w->hb_buf,
                                     w->hb_long ? sizeof w->hb_buf : w->hb_len, t);
            w->hb_long = 0;
            w->hb_len = 0;
            w->beats++;
            w->last_progress = t;
            if (!wg->progress_logged) {
                wg->progress_logged = 1;
                LOG_I(EA_TAG, "round %d: first progress after %.3f s (rank %d%s%s)", wg->gen,
                      t - wg->started, w->rank, w->last_step >= 0 ? ", " : "",
                      w->last_step >= 0 ? w->hb_buf : "");
            }
        }
    }
}

void elastic_wg_exit_text(const elastic_worker *w, char *buf, size_t len)
{
    if (!w->reaped)
        snprintf(buf, len, "is still running");
    else if (WIFEXITED(w->wstatus))
        snprintf(buf, len, "exited with status %d", WEXITSTATUS(w->wstatus));
    else if (WIFSIGNALED(w->wstatus))
        snprintf(buf, len, "was killed by signal %d (%s)", WTERMSIG(w->wstatus),
                 strsignal(WTERMSIG(w->wstatus)));
    else
        snprintf(buf, len, "ended with wait status 0x%x", (unsigned)w->wstatus);
}

static void reap(elastic_wg *wg)
{
    for (;;) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p <= 0) return;
        elastic_worker *w = NULL;
        for (int i = 0; i < wg->n; i++)
            if (wg->w[i].pid == p && !wg->w[i].reaped) w = &wg->w[i];
        if (!w) {
            LOG_D(EA_TAG, "reaped pid %d (a worker's orphaned child)", (int)p);
            continue;
        }
        w->reaped = 1;
        w->wstatus = st;
        w->exited = clock_now_s();
        if (wg->metrics) elastic_metrics_rank_up(wg->metrics, w->local_rank, 0);
        char how[96];
        elastic_wg_exit_text(w, how, sizeof how);
        int ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        ok |= wg->stopping; /* expected while the group is being stopped */
        if (wg->flush)
            LOG_D(EA_TAG, "flush command (pid %d) %s after %.3f s", (int)p, how,
                  w->exited - w->started);
        else
            log_msg(ok ? LOG_INFO : LOG_WARN, EA_TAG, "rank %d (pid %d) %s after %.3f s", w->rank,
                    (int)p, how, w->exited - w->started);
    }
}

static void read_signals(elastic_wg *wg)
{
    struct signalfd_siginfo si;
    while (read(wg->sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
            wg->term_signal = (int)si.ssi_signo;
            wg->escalate = wg->escalate ? 2 : 0;
            LOG_W(EA_TAG, "received %s", strsignal((int)si.ssi_signo));
        }
    }
}

int elastic_wg_wait(elastic_wg *wg, struct pollfd *extra, int nextra, double timeout_s)
{
    struct pollfd *p = wg->pfd;
    int k = 0;
    if (nextra > ELASTIC_WG_EXTRA_MAX) nextra = ELASTIC_WG_EXTRA_MAX;
    for (int i = 0; i < wg->n; i++) {
        p[k++] = (struct pollfd){wg->w[i].out.fd, POLLIN, 0};
        p[k++] = (struct pollfd){wg->w[i].err.fd, POLLIN, 0};
        p[k++] = (struct pollfd){wg->w[i].hb_fd, POLLIN, 0};
    }
    int sig_at = k;
    p[k++] = (struct pollfd){wg->sigfd, POLLIN, 0};
    int extra_at = k;
    for (int i = 0; i < nextra; i++) {
        extra[i].revents = 0;
        p[k++] = extra[i];
    }
    int ms = timeout_s <= 0 ? 0 : (int)(timeout_s * 1000.0 + 0.999);
    int r = poll(p, (nfds_t)k, ms);
    int ready = 0;
    if (r > 0) {
        for (int i = 0; i < wg->n; i++) {
            elastic_worker *w = &wg->w[i];
            if (p[3 * i].revents) stream_read(w, &w->out);
            if (p[3 * i + 1].revents) stream_read(w, &w->err);
            if (p[3 * i + 2].revents) hb_read(wg, w);
        }
        if (p[sig_at].revents) read_signals(wg);
        for (int i = 0; i < nextra; i++) {
            extra[i].revents = p[extra_at + i].revents;
            if (extra[i].revents) ready++;
        }
    }
    reap(wg);
    return ready;
}

int elastic_wg_running(const elastic_wg *wg)
{
    int n = 0;
    for (int i = 0; i < wg->n; i++)
        if (wg->w[i].pid > 0 && !wg->w[i].reaped) n++;
    return n;
}

static int failed(const elastic_worker *w)
{
    return w->reaped && !(WIFEXITED(w->wstatus) && WEXITSTATUS(w->wstatus) == 0);
}

static int usage_error(const elastic_worker *w)
{
    return w->reaped && WIFEXITED(w->wstatus) && WEXITSTATUS(w->wstatus) == 2;
}

int elastic_wg_any_usage_error(const elastic_wg *wg)
{
    for (int i = 0; i < wg->n; i++)
        if (usage_error(&wg->w[i])) return 1;
    return 0;
}

const elastic_worker *elastic_wg_failed(const elastic_wg *wg)
{
    const elastic_worker *best = NULL;
    for (int i = 0; i < wg->n; i++) {
        const elastic_worker *w = &wg->w[i];
        if (!failed(w)) continue;
        if (!best || (usage_error(w) && !usage_error(best)) ||
            (usage_error(w) == usage_error(best) && w->exited < best->exited))
            best = w;
    }
    return best;
}

const elastic_worker *elastic_wg_hung(const elastic_wg *wg, double timeout_s, double now,
                                      char *desc, size_t desc_len)
{
    const elastic_worker *first = NULL;
    size_t off = 0;
    if (desc && desc_len) desc[0] = '\0';
    for (int i = 0; i < wg->n; i++) {
        const elastic_worker *w = &wg->w[i];
        if (w->pid <= 0 || w->reaped || now - w->last_progress <= timeout_s) continue;
        if (!first) first = w;
        if (desc && off < desc_len) {
            char step[48] = "no progress line yet";
            if (w->beats)
                snprintf(step, sizeof step, "last step %lld", w->last_step);
            int m = snprintf(desc + off, desc_len - off, "%srank %d (pid %d, %s) silent for %.1f s",
                             off ? "; " : "", w->rank, (int)w->pid, step, now - w->last_progress);
            if (m > 0) off += (size_t)m;
        }
    }
    return first;
}

/* ------------------------------------------------------------------ stopping */

static int update_gone(elastic_wg *wg)
{
    int live = 0;
    for (int i = 0; i < wg->n; i++) {
        elastic_worker *w = &wg->w[i];
        if (w->gone) continue;
        if (w->reaped && kill(-w->pid, 0) < 0 && errno == ESRCH) {
            w->gone = 1;
            elastic_guard_note(wg->guard, '-', w->pid);
        } else
            live++;
    }
    return live;
}

static void drain(elastic_wg *wg)
{
    for (int i = 0; i < wg->n; i++) {
        elastic_worker *w = &wg->w[i];
        elastic_stream *ss[2] = {&w->out, &w->err};
        for (int j = 0; j < 2; j++) {
            elastic_stream *s = ss[j];
            for (int k = 0; k < 64 && s->fd >= 0; k++) {
                size_t before = s->len;
                int fd = s->fd;
                stream_read(w, s);
                if (s->fd == fd && s->len == before) break; /* EAGAIN: a writer escaped */
            }
            if (s->fd >= 0) {
                if (s->len) emit(w, s, s->buf, s->len);
                s->len = 0;
                close(s->fd);
                s->fd = -1;
            }
        }
        if (w->hb_fd >= 0) hb_read(wg, w);
        if (w->hb_fd >= 0) {
            close(w->hb_fd);
            w->hb_fd = -1;
        }
    }
}

static void kill_all(elastic_wg *wg, double t0, int sig, const char *after)
{
    double t = clock_now_s();
    for (int i = 0; i < wg->n; i++) {
        elastic_worker *w = &wg->w[i];
        if (w->gone || w->killed) continue;
        if (!w->reaped)
            LOG_W(EA_TAG, "rank %d (pid %d) still running %.1f s after %s: SIGKILL to its process "
                  "group", w->rank, (int)w->pid, t - t0, after);
        else
            LOG_W(EA_TAG, "rank %d (pid %d) exited but processes of its group %d are still running "
                  "%.1f s after %s: SIGKILL to the group", w->rank, (int)w->pid, (int)w->pid,
                  t - t0, after);
        kill(-w->pid, sig);
        w->killed = 1;
    }
}

void elastic_wg_stop(elastic_wg *wg, int sig, double grace_s, int escalate_on_signal,
                     const char *why)
{
    double t0 = clock_now_s();
    reap(wg);
    int live = update_gone(wg);
    const char *sname = sig == SIGKILL ? "SIGKILL" : sig == SIGTERM ? "SIGTERM" : "the signal";
    if (live) {
        int running = elastic_wg_running(wg);
        /* SIGKILL itself has no "SIGKILL after": it was "SIGKILL, SIGKILL after 0.0 s" */
        char after[48] = "";
        if (sig != SIGKILL) snprintf(after, sizeof after, ", SIGKILL after %.1f s", grace_s);
        if (running)
            LOG_I(EA_TAG, "stopping %d worker group(s) (%s): %s%s", live, why, sname, after);
        else
            LOG_I(EA_TAG, "%d worker group(s) still have processes after the workers exited (%s): "
                  "%s%s", live, why, sname, after);
        for (int i = 0; i < wg->n; i++) {
            elastic_worker *w = &wg->w[i];
            if (w->gone) continue;
            kill(-w->pid, sig);
            if (sig == SIGKILL) w->killed = 1;
            else kill(-w->pid, SIGCONT); /* a stopped process takes SIGTERM only once resumed */
        }
    }
    wg->escalate = escalate_on_signal ? 1 : 0;
    wg->stopping = 1;
    int killed = sig == SIGKILL;
    double kill_at = killed ? t0 : t0 + grace_s;
    while (live) {
        double t = clock_now_s();
        if (!killed && (t >= kill_at || wg->escalate == 2)) {
            kill_all(wg, t0, SIGKILL, wg->escalate == 2 ? "a second signal" : sname);
            killed = 1;
            kill_at = t;
        }
        if (killed && t >= kill_at + KILL_WAIT_S) {
            for (int i = 0; i < wg->n; i++)
                if (!wg->w[i].gone)
                    LOG_E(EA_TAG, "process group %d of rank %d is still there %.0f s after SIGKILL "
                          "(a process in uninterruptible sleep?); leaving it", (int)wg->w[i].pid,
                          wg->w[i].rank, KILL_WAIT_S);
            break;
        }
        double left = killed ? kill_at + KILL_WAIT_S - t : kill_at - t;
        elastic_wg_wait(wg, NULL, 0, left < 0.02 ? (left > 0 ? left : 0) : 0.02);
        live = update_gone(wg);
    }
    wg->escalate = 0;
    wg->stopping = 0;
    drain(wg);
    if (live == 0 && elastic_wg_running(wg) == 0)
        LOG_D(EA_TAG, "round %d: every worker process is gone (%.3f s)", wg->gen, clock_now_s() - t0);
}

void elastic_wg_free(elastic_wg *wg)
{
    if (!wg->w) return;
    for (int i = 0; i < wg->n; i++) {
        elastic_worker *w = &wg->w[i];
        if (w->out.fd >= 0) close(w->out.fd);
        if (w->err.fd >= 0) close(w->err.fd);
        if (w->hb_fd >= 0) close(w->hb_fd);
    }
    free(wg->w);
    free(wg->pfd);
    wg->w = NULL;
    wg->pfd = NULL;
    wg->n = 0;
}
