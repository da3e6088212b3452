/* report.c - progress events of a rank, to the launcher's pipe (see report.h). */
#include "report.h"

#include "log.h"

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
    free(r); /* the pipe belongs to the launcher: it stays open until exit */
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
}

void train_report_val(train_report *r, int64_t step, double loss)
{
    emit(r, "val step=%" PRId64 " loss=%.9g", step, loss);
}

void train_report_snapshot_staged(train_report *r, int64_t step, double stall_seconds,
                                  uint64_t bytes)
{
    emit(r, "snapshot_staged step=%" PRId64 " stall_seconds=%.9g bytes=%" PRIu64, step,
         stall_seconds, bytes);
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
}

void train_report_restore(train_report *r, int64_t step, double seconds, const char *source)
{
    emit(r, "restore step=%" PRId64 " seconds=%.9g source=%s", step, seconds, source);
}
