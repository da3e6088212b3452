/* report.c - progress events of a rank, to the launcher's pipe and to TensorBoard (see
 * report.h). */
#include "report.h"

#include "log.h"
#include "tb_events.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TAG "train"

struct train_report {
    int fd;   /* the launcher's pipe, -1 when none */
    int rank;
    train_tb *tb; /* rank 0's TensorBoard event file, NULL when none */
    int tb_set;   /* train_report_tensorboard was called */
};

/* ELASTIC_HEARTBEAT_FD: the write end of a pipe from the elastic agent; -1 when absent. The
 * fd is made non-blocking: a full pipe or a gone agent never stalls training. */
static int pipe_from_env(void)
{
    const char *v = getenv("ELASTIC_HEARTBEAT_FD");
    if (!v || !*v) return -1;
    char *end;
    errno = 0;
    long fd = strtol(v, &end, 10);
    if (errno || *end || fd < 0 || fd > 65535 || fcntl((int)fd, F_GETFD) < 0) {
        LOG_W(TAG, "ignoring ELASTIC_HEARTBEAT_FD=%s: not an open file descriptor", v);
        return -1;
    }
    int fl = fcntl((int)fd, F_GETFL);
    if (fl >= 0) fcntl((int)fd, F_SETFL, fl | O_NONBLOCK);
    fcntl((int)fd, F_SETFD, FD_CLOEXEC);
    return (int)fd;
}

int train_report_open(train_report **out, int rank)
{
    train_report *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    r->fd = pipe_from_env();
    r->rank = rank;
    *out = r;
    return 0;
}

void train_report_close(train_report *r)
{
    if (!r) return;
    train_tb_close(r->tb); /* a failure was logged by the writer */
    free(r); /* the pipe belongs to the launcher: it stays open until exit */
}

int train_report_tensorboard(train_report *r, const char *dir)
{
    if (!r || !dir || !*dir || r->tb_set) return -EINVAL;
    r->tb_set = 1;
    if (r->rank != 0) return 0;
    int rc = train_tb_open(&r->tb, dir, train_tb_wall_now());
    if (rc < 0) {
        char shown[512];
        log_printable(shown, sizeof shown, dir, strlen(dir));
        LOG_W(TAG, "TensorBoard folder %s: cannot write events: %s; training goes on without "
              "them", shown, strerror(-rc));
        r->tb = NULL;
        return rc;
    }
    LOG_I(TAG, "TensorBoard events: %s", train_tb_path(r->tb));
    return 0;
}

/* One scalar for TensorBoard, when a writer is open (errors: logged once by the writer). */
static void tb_scalar(train_report *r, const char *tag, int64_t step, double value, double wall)
{
    if (r && r->tb) train_tb_scalar(r->tb, tag, step, value, wall);
}

static void tb_flush(train_report *r)
{
    if (r && r->tb) train_tb_flush(r->tb);
}

/* The restart count from the launcher's environment, -1 when unset or not an integer >= 0. */
static long long restart_count(void)
{
    const char *names[] = {"ELASTIC_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        const char *v = getenv(names[i]);
        if (!v || !*v) continue;
        char *end;
        errno = 0;
        long long n = strtoll(v, &end, 10);
        if (errno || *end || n < 0) return -1;
        return n;
    }
    return -1;
}

/* One line: printf-style text plus the newline, written at once (a pipe write of at most
 * PIPE_BUF bytes is atomic); errors (EAGAIN, EPIPE) are ignored. */
static void emit(train_report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(train_report *r, const char *fmt, ...)
{
    if (!r || r->fd < 0) return;
    char line[TRAIN_REPORT_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n > sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(r->fd, line, (size_t)n) < 0) { /* the agent notices silence, not our errors */ }
}

void train_report_step(train_report *r, int64_t step, double seconds, double loss, double lr,
                       double grad_norm, double tokens_per_second, uint64_t samples)
{
    if (isnan(loss))
        emit(r, "step %" PRId64 " seconds=%.9g", step, seconds);
    else
        emit(r, "step %" PRId64 " seconds=%.9g loss=%.9g lr=%.9g grad_norm=%.9g "
             "tokens_per_second=%.9g samples=%" PRIu64, step, seconds, loss, lr, grad_norm,
             tokens_per_second, samples);
    if (!r || !r->tb || isnan(loss)) return;
    double wall = train_tb_wall_now();
    tb_scalar(r, "train/loss", step, loss, wall);
    tb_scalar(r, "train/lr", step, lr, wall);
    tb_scalar(r, "train/grad_norm", step, grad_norm, wall);
    tb_scalar(r, "train/tokens_per_second", step, tokens_per_second, wall);
    tb_scalar(r, "train/step_seconds", step, seconds, wall);
    tb_flush(r);
}

void train_report_val(train_report *r, int64_t step, double loss)
{
    emit(r, "val step=%" PRId64 " loss=%.9g", step, loss);
    if (!r || !r->tb) return;
    tb_scalar(r, "train/val_loss", step, loss, train_tb_wall_now());
    tb_flush(r);
}

void train_report_snapshot_staged(train_report *r, int64_t step, double stall_seconds,
                                  uint64_t bytes)
{
    emit(r, "snapshot_staged step=%" PRId64 " stall_seconds=%.9g bytes=%" PRIu64, step,
         stall_seconds, bytes);
    if (!r || !r->tb) return;
    tb_scalar(r, "ckpt/stall_seconds", step, stall_seconds, train_tb_wall_now());
    tb_flush(r);
}

void train_report_snapshot_wait(train_report *r, int64_t step, double stall_seconds)
{
    emit(r, "snapshot_wait step=%" PRId64 " stall_seconds=%.9g", step, stall_seconds);
    if (!r || !r->tb) return;
    tb_scalar(r, "ckpt/wait_seconds", step, stall_seconds, train_tb_wall_now());
    tb_flush(r);
}

void train_report_mem_snapshot(train_report *r, int64_t step, double stall_seconds,
                               uint64_t bytes, int slot)
{
    emit(r, "mem_snapshot step=%" PRId64 " stall_seconds=%.9g bytes=%" PRIu64 " slot=%d", step,
         stall_seconds, bytes, slot);
    if (!r || !r->tb) return;
    tb_scalar(r, "ckpt/mem_stall_seconds", step, stall_seconds, train_tb_wall_now());
    tb_flush(r);
}

void train_report_mem_snapshot_failed(train_report *r, int64_t step, int result)
{
    emit(r, "mem_snapshot_failed step=%" PRId64 " result=%d", step, result);
}

void train_report_snapshot_skipped(train_report *r, int64_t step)
{
    emit(r, "snapshot_skipped step=%" PRId64, step);
}

void train_report_snapshot_failed(train_report *r, int64_t step, int result)
{
    emit(r, "snapshot_failed step=%" PRId64 " result=%d", step, result);
}

void train_report_snapshot_done(train_report *r, int64_t step, int result,
                                double persist_seconds, uint64_t raw_bytes,
                                uint64_t stored_bytes)
{
    emit(r, "snapshot_done step=%" PRId64 " result=%d persist_seconds=%.9g raw_bytes=%" PRIu64
         " stored_bytes=%" PRIu64, step, result, persist_seconds, raw_bytes, stored_bytes);
    if (!r || !r->tb || result != 0) return;
    double wall = train_tb_wall_now();
    tb_scalar(r, "ckpt/persist_seconds", step, persist_seconds, wall);
    if (persist_seconds > 0)
        tb_scalar(r, "ckpt/persist_mib_per_second", step,
                  (double)raw_bytes / 1048576.0 / persist_seconds, wall);
    if (stored_bytes > 0)
        tb_scalar(r, "ckpt/compression_ratio", step, (double)raw_bytes / (double)stored_bytes,
                  wall);
    tb_flush(r);
}

void train_report_upload(train_report *r, const char *kind, int64_t step, uint64_t bytes,
                         double seconds, int result, uint64_t lag_steps, double lag_seconds,
                         int64_t remote_step)
{
    emit(r, "upload_%s step=%" PRId64 " bytes=%" PRIu64 " seconds=%.9g result=%d lag_steps=%"
         PRIu64 " lag_seconds=%.9g remote_step=%" PRId64, kind, step, bytes, seconds, result,
         lag_steps, lag_seconds, remote_step);
}

void train_report_uploads_draining(train_report *r, int64_t step)
{
    emit(r, "uploads_draining step=%" PRId64, step);
}

void train_report_restore(train_report *r, int64_t step, double seconds, const char *source)
{
    emit(r, "restore step=%" PRId64 " seconds=%.9g source=%s", step, seconds, source);
    if (!r || !r->tb) return;
    /* at step + 1: TensorBoard drops the earlier files' events at steps >= it (report.h) */
    double wall = train_tb_wall_now();
    train_tb_session_start(r->tb, step + 1, wall);
    if (source && strcmp(source, "none") != 0)
        tb_scalar(r, "ckpt/restore_seconds", step, seconds, wall);
    long long restarts = restart_count();
    if (restarts >= 0) tb_scalar(r, "elastic/restarts", step, (double)restarts, wall);
    tb_flush(r);
}
