/* test_train_report.c - the progress events a rank writes to its launcher's pipe (report.h):
 * the exact lines of line protocol version 1, nothing without ELASTIC_HEARTBEAT_FD, an
 * invalid descriptor ignored, and a full or closed pipe never blocking or killing the rank. */
#include "report.h"
#include "t_helpers.h"

#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>

static int g_pipe[2];

static train_report *open_with_pipe(void)
{
    T_REQUIRE(pipe(g_pipe) == 0, "pipe");
    char v[16];
    snprintf(v, sizeof v, "%d", g_pipe[1]);
    setenv("ELASTIC_HEARTBEAT_FD", v, 1);
    train_report *r = NULL;
    T_REQUIRE(train_report_open(&r, 0) == 0 && r, "open");
    return r;
}

static size_t drain(char *buf, size_t cap)
{
    int fl = fcntl(g_pipe[0], F_GETFL);
    fcntl(g_pipe[0], F_SETFL, fl | O_NONBLOCK);
    size_t n = 0;
    for (;;) {
        ssize_t k = read(g_pipe[0], buf + n, cap - 1 - n);
        if (k <= 0) break;
        n += (size_t)k;
    }
    buf[n] = '\0';
    return n;
}

static void lines(void)
{
    train_report *r = open_with_pipe();
    train_report_restore(r, 40, 0.25, "disk");
    train_report_step(r, 41, 0.5, 4.25, 1e-3, 1.5, 12345.5, 328);
    train_report_step(r, 42, 0.125, NAN, NAN, NAN, NAN, 0); /* a rank other than 0 */
    train_report_val(r, 42, 3.5);
    train_report_snapshot_staged(r, 42, 0.0625, 1449984);
    train_report_snapshot_skipped(r, 43);
    train_report_snapshot_failed(r, 45, -12);
    train_report_snapshot_done(r, 42, 0, 0.75, 1449984, 1235380);
    train_report_snapshot_done(r, 44, -28, 0.5, 0, 0);
    static const char want[] =
        "restore step=40 seconds=0.25 source=disk\n"
        "step 41 seconds=0.5 loss=4.25 lr=0.001 grad_norm=1.5 tokens_per_second=12345.5 "
        "samples=328\n"
        "step 42 seconds=0.125\n"
        "val step=42 loss=3.5\n"
        "snapshot_staged step=42 stall_seconds=0.0625 bytes=1449984\n"
        "snapshot_skipped step=43\n"
        "snapshot_failed step=45 result=-12\n"
        "snapshot_done step=42 result=0 persist_seconds=0.75 raw_bytes=1449984 "
        "stored_bytes=1235380\n"
        "snapshot_done step=44 result=-28 persist_seconds=0.5 raw_bytes=0 stored_bytes=0\n";
    char got[4096];
    drain(got, sizeof got);
    T_CHECK(!strcmp(got, want), "lines:\n%s\nwant:\n%s", got, want);
    for (char *p = got; *p;) { /* every line within the limit */
        char *e = strchr(p, '\n');
        T_CHECK(e && (size_t)(e - p) + 1 <= TRAIN_REPORT_LINE_MAX, "line length");
        p = e ? e + 1 : p + strlen(p);
    }

    /* a full pipe: the writes return at once (the lines are dropped), nothing blocks */
    char fill[65536];
    memset(fill, 'x', sizeof fill);
    int fl = fcntl(g_pipe[1], F_GETFL);
    T_CHECK(fl & O_NONBLOCK, "the pipe was made non-blocking");
    while (write(g_pipe[1], fill, sizeof fill) > 0) {}
    double t0 = t_now_s();
    for (int i = 0; i < 1000; i++) train_report_step(r, i, 0.1, 1, 1, 1, 1, 1);
    T_CHECK(t_now_s() - t0 < 5.0, "a full pipe blocked the rank");
    /* a gone reader: EPIPE, ignored (train ignores SIGPIPE; so does this test) */
    close(g_pipe[0]);
    train_report_step(r, 1, 0.1, 1, 1, 1, 1, 1);
    train_report_close(r);
    close(g_pipe[1]);
}

static void no_pipe(void)
{
    unsetenv("ELASTIC_HEARTBEAT_FD");
    train_report *r = NULL;
    T_REQUIRE(train_report_open(&r, 1) == 0 && r, "open without a pipe");
    train_report_step(r, 1, 0.1, NAN, NAN, NAN, NAN, 0);
    train_report_close(r);
    setenv("ELASTIC_HEARTBEAT_FD", "999", 1); /* not open: logged, ignored */
    T_REQUIRE(train_report_open(&r, 1) == 0 && r, "open with a closed descriptor");
    train_report_step(r, 1, 0.1, NAN, NAN, NAN, NAN, 0);
    train_report_close(r);
    train_report_close(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    lines();
    no_pipe();
    return t_done("test_train_report");
}
