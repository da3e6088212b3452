/* test_elastic_metrics.c - the agent's metrics (elastic/metrics.h): the parser of the workers'
 * progress lines (every event train writes, unknown events and keys, malformed lines, huge
 * values, NaN and infinities, a line that is not NUL-terminated), the exposition writer (exact
 * text, label and HELP escaping, special values, histograms, bad names), the aggregation
 * across rounds (counters never go down, the last committed step never decreases, no duplicate
 * series), the goodput arithmetic over recorded event sequences, and the real HTTP server
 * (libmicrohttpd) on a loopback port: status codes, content type, a busy port, the signal mask
 * of its thread, the port free again after stop. */
#include "metrics.h"
#include "t_helpers.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/syscall.h>

static int parse(const char *line, elastic_report_event *ev)
{
    return elastic_report_parse(line, strlen(line), ev);
}

/* ------------------------------------------------------------------ parser */

static void parser_events(void)
{
    elastic_report_event ev;
    /* the lines train/report.c writes (tests/unit/test_train_report.c) */
    T_CHECK(parse("restore step=40 seconds=0.25 source=disk", &ev) == 1, "restore");
    T_CHECK(ev.kind == ELASTIC_REPORT_RESTORE && ev.step == 40 && ev.seconds == 0.25 &&
            !strcmp(ev.source, "disk"), "restore fields");
    T_CHECK(parse("step 41 seconds=0.5 loss=4.25 lr=0.001 grad_norm=1.5 tokens_per_second="
                  "12345.5 samples=328", &ev) == 1, "step rank 0");
    T_CHECK(ev.kind == ELASTIC_REPORT_STEP && ev.step == 41 && ev.seconds == 0.5 &&
            ev.loss == 4.25 && ev.lr == 0.001 && ev.grad_norm == 1.5 &&
            ev.tokens_per_second == 12345.5 && ev.samples == 328, "step fields");
    T_CHECK(ev.has == (ELASTIC_RF_SECONDS | ELASTIC_RF_LOSS | ELASTIC_RF_LR |
                       ELASTIC_RF_GRAD_NORM | ELASTIC_RF_TPS | ELASTIC_RF_SAMPLES), "has %x", ev.has);
    T_CHECK(parse("step 42 seconds=0.125", &ev) == 1 && ev.has == ELASTIC_RF_SECONDS, "step");
    T_CHECK(parse("step 12", &ev) == 1 && ev.step == 12 && ev.has == 0, "a bare heartbeat");
    T_CHECK(parse("val step=42 loss=3.5", &ev) == 1 && ev.kind == ELASTIC_REPORT_VAL &&
            ev.loss == 3.5, "val");
    T_CHECK(parse("snapshot_staged step=42 stall_seconds=0.0625 bytes=1449984", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_STAGED && ev.stall_seconds == 0.0625 &&
            ev.bytes == 1449984, "staged");
    T_CHECK(parse("snapshot_skipped step=43", &ev) == 1 && ev.kind == ELASTIC_REPORT_SKIPPED &&
            ev.step == 43, "skipped");
    T_CHECK(parse("snapshot_failed step=45 result=-12", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_STAGE_FAILED && ev.result == -12, "stage failed");
    T_CHECK(parse("mem_snapshot step=46 stall_seconds=0.003 bytes=4096 slot=1", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_MEM_SNAPSHOT && ev.step == 46 && ev.stall_seconds == 0.003 &&
            ev.bytes == 4096, "memory snapshot (slot: a key the agent does not use)");
    T_CHECK(parse("mem_snapshot_failed step=47 result=-28", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_MEM_FAILED && ev.result == -28, "memory snapshot failed");
    T_CHECK(parse("mem_snapshot step=46", &ev) == -EINVAL, "memory snapshot without its stall");
    T_CHECK(parse("snapshot_wait step=48 stall_seconds=0.0125", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_SNAPSHOT_WAIT && ev.step == 48 && ev.stall_seconds == 0.0125,
            "snapshot wait");
    T_CHECK(parse("snapshot_wait step=48", &ev) == -EINVAL, "snapshot wait without its stall");
    T_CHECK(parse("snapshot_done step=42 result=0 persist_seconds=0.75 raw_bytes=1449984 "
                  "stored_bytes=1235380", &ev) == 1, "done");
    T_CHECK(ev.kind == ELASTIC_REPORT_DONE && ev.result == 0 && ev.persist_seconds == 0.75 &&
            ev.raw_bytes == 1449984 && ev.stored_bytes == 1235380, "done fields");
    T_CHECK(parse("snapshot_done step=44 result=-28 persist_seconds=0.5 raw_bytes=0 "
                  "stored_bytes=0", &ev) == 1 && ev.result == -28, "done failed");
    T_CHECK(parse("snapshot_done step=44 result=0", &ev) == 1 && ev.has == 0, "done, bare");
    /* the S3 uploader's lines (train --s3, train_report_upload) */
    T_CHECK(parse("upload_done step=40 bytes=1449984 seconds=2.5 result=0 lag_steps=10 "
                  "lag_seconds=3.25 remote_step=40", &ev) == 1, "upload done");
    T_CHECK(ev.kind == ELASTIC_REPORT_UPLOAD_DONE && ev.step == 40 && ev.bytes == 1449984 &&
            ev.seconds == 2.5 && ev.result == 0 && ev.lag_steps == 10 &&
            ev.lag_seconds == 3.25 && ev.remote_step == 40, "upload done fields");
    T_CHECK(ev.has == (ELASTIC_RF_BYTES | ELASTIC_RF_SECONDS | ELASTIC_RF_LAG_STEPS |
                       ELASTIC_RF_LAG_SECONDS | ELASTIC_RF_REMOTE_STEP), "upload has %x", ev.has);
    T_CHECK(parse("upload_failed step=50 bytes=4096 seconds=30 result=-110 lag_steps=20 "
                  "lag_seconds=61 remote_step=-1", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_UPLOAD_FAILED && ev.result == -110 && ev.bytes == 4096 &&
            ev.remote_step == -1 && ev.lag_steps == 20, "upload failed, nothing on S3 yet");
    T_CHECK(parse("upload_skipped step=60 bytes=0 seconds=0 result=-125 lag_steps=0 "
                  "lag_seconds=0 remote_step=0", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_UPLOAD_SKIPPED && ev.result == -125 && ev.step == 60 &&
            ev.remote_step == 0, "upload skipped");
    T_CHECK(parse("upload_done step=7 result=0", &ev) == 1 &&
            ev.kind == ELASTIC_REPORT_UPLOAD_DONE && ev.has == 0, "upload, bare");
    T_CHECK(parse("upload_done step=7 result=0 requests=12 lag=3 remote=9", &ev) == 1 &&
            ev.has == 0, "upload: unknown keys ignored");
    T_CHECK(parse("upload_done step=7 result=0 loss=oops stall_seconds=x source=A", &ev) == 1,
            "upload: the keys of other events are unknown here");
    T_CHECK(parse("step 7 lag_steps=x remote_step=-5", &ev) == 1,
            "the upload keys are unknown in other events");
    T_CHECK(parse("upload_started step=7", &ev) == 0, "an upload event of a newer writer");
    /* several spaces and leading/trailing spaces are fine */
    T_CHECK(parse("  step   7    seconds=1  ", &ev) == 1 && ev.step == 7 && ev.seconds == 1,
            "spaces");
    /* a newer writer: unknown events and keys are ignored */
    T_CHECK(parse("snapshot_uploaded step=5 seconds=1", &ev) == 0 && ev.kind == 0, "unknown");
    T_CHECK(parse("x", &ev) == 0, "unknown word");
    T_CHECK(parse("step 5 seconds=1 colour=blue future=a=b", &ev) == 1 && ev.seconds == 1,
            "unknown keys");
    T_CHECK(parse("val step=3 loss=2 seconds=oops", &ev) == 1, "a key of another event");
    /* the protocol's limits: 255 bytes and the newline */
    char buf[300];
    memset(buf, ' ', sizeof buf);
    memcpy(buf, "step 1", 6);
    T_CHECK(elastic_report_parse(buf, ELASTIC_REPORT_LINE_MAX - 1, &ev) == 1, "255 bytes");
    T_CHECK(elastic_report_parse(buf, ELASTIC_REPORT_LINE_MAX, &ev) == -EINVAL, "256 bytes");
    /* not NUL-terminated: only len bytes are read */
    const char cut[] = "step 12 seconds=0.5XXXX";
    T_CHECK(elastic_report_parse(cut, 19, &ev) == 1 && ev.step == 12 && ev.seconds == 0.5,
            "len bounds the line");
    T_CHECK(elastic_report_parse(cut, 7, &ev) == 1 && ev.step == 12, "len 7");
    T_CHECK(elastic_report_parse(NULL, 0, &ev) == -EINVAL, "NULL");
}

static void parser_malformed(void)
{
    elastic_report_event ev;
    static const char *const bad[] = {
        "", " ", "   ",
        "step", "step x", "step -1", "step 1.5", "step +3", "step 0x10", "step 1e3",
        "step 9223372036854775808", "step 99999999999999999999999", "step 5 6",
        "step 5 seconds", "step 5 =1", "step 5 seconds=", "step 5 seconds=abc",
        "step 5 seconds=nan", "step 5 seconds=inf", "step 5 seconds=-inf", "step 5 seconds=-1",
        "step 5 seconds=1e10", "step 5 seconds=1e999", "step 5 seconds=1 seconds=2",
        "step 5 samples=-1", "step 5 samples=1.5", "step 5 samples=18446744073709551616",
        "step 5 loss=", "step 5 loss=1x",
        "val step=1", "val loss=3", "val step=1 loss", "val step=-2 loss=3",
        "snapshot_staged step=1", "snapshot_staged stall_seconds=1",
        "snapshot_staged step=1 stall_seconds=nan", "snapshot_staged step=1 stall_seconds=1 "
        "bytes=-5",
        "snapshot_skipped", "snapshot_skipped step=",
        "snapshot_done step=1", "snapshot_done result=0", "snapshot_done step=1 result=1",
        "snapshot_done step=1 result=-4096", "snapshot_done step=1 result=--1",
        "snapshot_done step=1 result=-", "snapshot_done step=1 result=0 persist_seconds=inf",
        "snapshot_done step=1 result=0 stored_bytes=1e3",
        "snapshot_failed step=1", "snapshot_failed step=1 result=3",
        "upload_done", "upload_done step=1", "upload_done result=0", "upload_failed step=1",
        "upload_skipped result=-125", "upload_done step=-1 result=0",
        "upload_done step=1 result=1", "upload_failed step=1 result=-4096",
        "upload_done step=1 result=0 result=0", "upload_done step=1 step=1 result=0",
        "upload_done step=1 result=0 bytes=-1", "upload_done step=1 result=0 bytes=1.5",
        "upload_done step=1 result=0 bytes=18446744073709551616",
        "upload_done step=1 result=0 bytes=1 bytes=1",
        "upload_done step=1 result=0 seconds=-1", "upload_done step=1 result=0 seconds=nan",
        "upload_done step=1 result=0 seconds=1e10", "upload_done step=1 result=0 seconds=",
        "upload_done step=1 result=0 seconds=1 seconds=1",
        "upload_done step=1 result=0 lag_steps=-1", "upload_done step=1 result=0 lag_steps=",
        "upload_done step=1 result=0 lag_steps=2.5", "upload_done step=1 result=0 lag_steps=1e3",
        "upload_done step=1 result=0 lag_steps=18446744073709551616",
        "upload_done step=1 result=0 lag_steps=1 lag_steps=1",
        "upload_done step=1 result=0 lag_seconds=-0.5",
        "upload_done step=1 result=0 lag_seconds=inf",
        "upload_done step=1 result=0 lag_seconds=nan", "upload_done step=1 result=0 lag_seconds=",
        "upload_done step=1 result=0 lag_seconds=1 lag_seconds=2",
        "upload_done step=1 result=0 remote_step=-2", "upload_done step=1 result=0 remote_step=-",
        "upload_done step=1 result=0 remote_step=--1", "upload_done step=1 result=0 remote_step=-0",
        "upload_done step=1 result=0 remote_step=-10", "upload_done step=1 result=0 remote_step=",
        "upload_done step=1 result=0 remote_step=+1", "upload_done step=1 result=0 remote_step=1.0",
        "upload_done step=1 result=0 remote_step=9223372036854775808",
        "upload_done step=1 result=0 remote_step=1 remote_step=1",
        "upload_skipped step=1 result=0 remote_step", "upload_failed step=1 result=-5 =3",
        "restore step=1 seconds=1", "restore step=1 source=disk", "restore seconds=1 source=disk",
        "restore step=1 seconds=1 source=DISK", "restore step=1 seconds=1 source=",
        "restore step=1 seconds=1 source=a/b", "restore step=1 seconds=1 source=abcdefghijklmnop",
        "step\t5", "step 5\r", "step 5 seconds=1\x01", "step 5 seconds=1\x7f",
        "step 5 source=\xc3\xa9", "\xff\xfe",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        T_CHECK(parse(bad[i], &ev) == -EINVAL, "malformed: '%s'", bad[i]);
    /* a NUL inside the line */
    const char nul[] = "step 5\0 seconds=1";
    T_CHECK(elastic_report_parse(nul, sizeof nul - 1, &ev) == -EINVAL, "NUL inside");
}

static void parser_values(void)
{
    elastic_report_event ev;
    T_CHECK(parse("step 9223372036854775807", &ev) == 1 && ev.step == INT64_MAX, "max step");
    T_CHECK(parse("step 0", &ev) == 1 && ev.step == 0, "step 0");
    T_CHECK(parse("step 00000000000000000000000001", &ev) == -EINVAL, "26 digits");
    T_CHECK(parse("snapshot_done step=1 result=0 stored_bytes=18446744073709551615", &ev) == 1 &&
            ev.stored_bytes == UINT64_MAX, "max bytes");
    T_CHECK(parse("snapshot_done step=1 result=-4095", &ev) == 1 && ev.result == -4095, "errno");
    T_CHECK(parse("snapshot_done step=1 result=-0", &ev) == 1 && ev.result == 0, "-0");
    T_CHECK(parse("step 1 seconds=1e9", &ev) == 1 && ev.seconds == 1e9, "longest duration");
    T_CHECK(parse("step 1 seconds=0", &ev) == 1 && ev.seconds == 0, "zero duration");
    T_CHECK(parse("step 1 seconds=1e-320", &ev) == 1 && ev.seconds >= 0, "subnormal");
    /* the reals that may diverge keep NaN and infinities */
    T_CHECK(parse("step 1 loss=nan", &ev) == 1 && isnan(ev.loss), "NaN loss");
    T_CHECK(parse("step 1 loss=-nan", &ev) == 1 && isnan(ev.loss), "-NaN loss");
    T_CHECK(parse("step 1 loss=inf grad_norm=-inf", &ev) == 1 && isinf(ev.loss) && ev.loss > 0 &&
            isinf(ev.grad_norm) && ev.grad_norm < 0, "infinities");
    T_CHECK(parse("step 1 loss=1e999", &ev) == 1 && isinf(ev.loss), "overflow is +Inf");
    T_CHECK(parse("step 1 lr=3.000000001e-03", &ev) == 1 && ev.lr == 3.000000001e-03, "%%.9g");
    T_CHECK(parse("upload_done step=1 result=0 lag_steps=18446744073709551615 lag_seconds=1e9 "
                  "remote_step=9223372036854775807 bytes=18446744073709551615", &ev) == 1 &&
            ev.lag_steps == UINT64_MAX && ev.lag_seconds == 1e9 && ev.remote_step == INT64_MAX &&
            ev.bytes == UINT64_MAX, "upload: the largest values");
    T_CHECK(parse("upload_done step=0 result=0 remote_step=0 lag_seconds=0", &ev) == 1 &&
            ev.step == 0 && ev.remote_step == 0, "upload: step 0");
    T_CHECK(parse("restore step=0 seconds=0.01 source=s3-tier_2", &ev) == 1 &&
            !strcmp(ev.source, "s3-tier_2"), "source charset");
}

/* ------------------------------------------------------------------ exposition */

static char *finish(elastic_expo *e)
{
    char *text = NULL;
    size_t len = 0;
    int rc = elastic_expo_finish(e, &text, &len);
    T_REQUIRE(rc == 0 && text && strlen(text) == len, "finish: %d", rc);
    return text;
}

static void expo_text(void)
{
    elastic_expo e = ELASTIC_EXPO_INIT;
    elastic_expo_family(&e, "a_total", "counter", "Lines, with a \\ backslash\nand a newline.");
    elastic_expo_sample_u64(&e, "a_total", NULL, UINT64_MAX);
    const char *const l1[] = {"x", "plain", "y", "q\"uo\\te\nnl", NULL};
    elastic_expo_family(&e, "b", "gauge", "");
    elastic_expo_sample(&e, "b", l1, 0.1);
    elastic_expo_sample(&e, "b", NULL, NAN);
    elastic_expo_sample(&e, "b", NULL, INFINITY);
    elastic_expo_sample(&e, "b", NULL, -INFINITY);
    elastic_expo_sample(&e, "b", NULL, -0.0);
    elastic_expo_sample(&e, "b", NULL, 1e300);
    elastic_expo_sample(&e, "b", NULL, 3.0737899099999999);
    const char *const l2[] = {"v", "ctl\x01 bad\xff utf8 \xc3\xa9 {}=,", NULL};
    elastic_expo_sample(&e, "b", l2, 2);
    char *t = finish(&e);
    static const char want[] =
        "# HELP a_total Lines, with a \\\\ backslash\\nand a newline.\n"
        "# TYPE a_total counter\n"
        "a_total 18446744073709551615\n"
        "# HELP b \n"
        "# TYPE b gauge\n"
        "b{x=\"plain\",y=\"q\\\"uo\\\\te\\nnl\"} 0.1\n"
        "b NaN\n"
        "b +Inf\n"
        "b -Inf\n"
        "b -0\n"
        "b 1e+300\n"
        "b 3.07378991\n"
        "b{v=\"ctl\\\\x01 bad\\\\xff utf8 \xc3\xa9 {}=,\"} 2\n";
    T_CHECK(!strcmp(t, want), "got:\n%s\nwant:\n%s", t, want);
    free(t);
}

static void expo_histogram(void)
{
    elastic_hist h;
    memset(&h, 0, sizeof h);
    elastic_hist_observe(&h, 0.0005); /* first bucket */
    elastic_hist_observe(&h, 0.001);  /* le is inclusive */
    elastic_hist_observe(&h, 0.3);
    elastic_hist_observe(&h, 1000);   /* +Inf only */
    elastic_hist_observe(&h, NAN);    /* ignored */
    elastic_hist_observe(&h, -1);     /* ignored */
    elastic_hist_observe(&h, INFINITY);
    T_CHECK(h.count == 4 && h.sum == 0.0005 + 0.001 + 0.3 + 1000, "count %" PRIu64, h.count);
    elastic_expo e = ELASTIC_EXPO_INIT;
    const char *const l[] = {"node", "0", NULL};
    elastic_expo_family(&e, "h_seconds", "histogram", "H.");
    elastic_expo_histogram(&e, "h_seconds", l, &h);
    char *t = finish(&e);
    T_CHECK(strstr(t, "h_seconds_bucket{node=\"0\",le=\"0.001\"} 2\n"), "%s", t);
    T_CHECK(strstr(t, "h_seconds_bucket{node=\"0\",le=\"0.25\"} 2\n"), "%s", t);
    T_CHECK(strstr(t, "h_seconds_bucket{node=\"0\",le=\"0.5\"} 3\n"), "%s", t);
    T_CHECK(strstr(t, "h_seconds_bucket{node=\"0\",le=\"600\"} 3\n"), "%s", t);
    T_CHECK(strstr(t, "h_seconds_bucket{node=\"0\",le=\"+Inf\"} 4\n"), "%s", t);
    T_CHECK(strstr(t, "h_seconds_count{node=\"0\"} 4\n"), "%s", t);
    T_CHECK(strstr(t, "h_seconds_sum{node=\"0\"} 1000.3015\n"), "%s", t);
    /* buckets are cumulative and ascending */
    uint64_t last = 0;
    int n = 0;
    for (char *p = strstr(t, "_bucket"); p; p = strstr(p + 1, "_bucket")) {
        uint64_t v = strtoull(strchr(p, '}') + 2, NULL, 10);
        T_CHECK(v >= last, "cumulative");
        last = v;
        n++;
    }
    T_CHECK(n == ELASTIC_HIST_BUCKETS + 1, "%d buckets", n);
    free(t);
    elastic_hist z;
    memset(&z, 0, sizeof z);
    e = (elastic_expo)ELASTIC_EXPO_INIT;
    elastic_expo_histogram(&e, "z", NULL, &z);
    t = finish(&e);
    T_CHECK(strstr(t, "z_bucket{le=\"+Inf\"} 0\n") && strstr(t, "z_sum 0\n") &&
            strstr(t, "z_count 0\n"), "%s", t);
    free(t);
}

static void expo_errors(void)
{
    static const char *const bad_names[] = {"", "1abc", "a-b", "a b", "a\"", "é"};
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        elastic_expo e = ELASTIC_EXPO_INIT;
        elastic_expo_family(&e, bad_names[i], "gauge", "x");
        char *t = NULL;
        T_CHECK(elastic_expo_finish(&e, &t, NULL) == -EINVAL && !t, "name '%s'", bad_names[i]);
        e = (elastic_expo)ELASTIC_EXPO_INIT;
        elastic_expo_sample(&e, bad_names[i], NULL, 1);
        T_CHECK(elastic_expo_finish(&e, &t, NULL) == -EINVAL, "sample '%s'", bad_names[i]);
    }
    static const char *const bad_labels[] = {"", "a:b", "__name__", "9", "le-x"};
    for (size_t i = 0; i < sizeof bad_labels / sizeof bad_labels[0]; i++) {
        elastic_expo e = ELASTIC_EXPO_INIT;
        const char *const l[] = {bad_labels[i], "v", NULL};
        elastic_expo_sample(&e, "ok", l, 1);
        char *t = NULL;
        T_CHECK(elastic_expo_finish(&e, &t, NULL) == -EINVAL, "label '%s'", bad_labels[i]);
    }
    /* sticky: a good call after a bad one writes nothing */
    elastic_expo e = ELASTIC_EXPO_INIT;
    elastic_expo_sample(&e, "ok:name_1", NULL, 1);
    elastic_expo_sample(&e, "bad name", NULL, 1);
    elastic_expo_sample(&e, "ok", NULL, 1);
    char *t = NULL;
    T_CHECK(elastic_expo_finish(&e, &t, NULL) == -EINVAL && e.buf == NULL, "sticky");
    /* a large text grows the buffer */
    e = (elastic_expo)ELASTIC_EXPO_INIT;
    for (int i = 0; i < 20000; i++) elastic_expo_sample(&e, "big", NULL, i);
    t = finish(&e);
    T_CHECK(strlen(t) > 100000 && strstr(t, "big 19999\n"), "big");
    free(t);
}

/* Every sample line's series appears once, after its family's HELP and TYPE; returns the
 * number of samples. */
static int check_exposition(const char *text)
{
    char *copy = strdup(text);
    T_REQUIRE(copy, "strdup");
    char **series = NULL;
    int n = 0;
    char fam_help[128] = "", fam_type[128] = "", type[32] = "";
    for (char *line = strtok(copy, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "# HELP ", 7)) {
            sscanf(line + 7, "%127s", fam_help);
            continue;
        }
        if (!strncmp(line, "# TYPE ", 7)) {
            sscanf(line + 7, "%127s %31s", fam_type, type);
            T_CHECK(!strcmp(fam_help, fam_type), "TYPE %s after HELP %s", fam_type, fam_help);
            continue;
        }
        T_CHECK(line[0] != '#', "comment '%s'", line);
        char *sp = strrchr(line, ' ');
        T_REQUIRE(sp, "sample '%s'", line);
        *sp = '\0';
        size_t fl = strlen(fam_type);
        T_CHECK(!strncmp(line, fam_type, fl) &&
                (line[fl] == '{' || line[fl] == '\0' ||
                 (!strcmp(type, "histogram") && (!strncmp(line + fl, "_bucket{", 8) ||
                                                 !strncmp(line + fl, "_sum", 4) ||
                                                 !strncmp(line + fl, "_count", 6)))),
                "sample %s outside its family %s", line, fam_type);
        for (int i = 0; i < n; i++) T_CHECK(strcmp(series[i], line) != 0, "duplicate %s", line);
        series = realloc(series, (size_t)(n + 1) * sizeof *series);
        T_REQUIRE(series, "realloc");
        series[n++] = strdup(line);
    }
    for (int i = 0; i < n; i++) free(series[i]);
    free(series);
    free(copy);
    return n;
}

/* ------------------------------------------------------------------ aggregation */

static char *render(elastic_metrics *m, double now)
{
    char *t = NULL;
    size_t len = 0;
    T_REQUIRE(elastic_metrics_render(m, now, &t, &len) == 0 && t, "render");
    return t;
}

/* The value of the sample `series` (name with labels, exactly) in text; NAN when absent. */
static double value_of(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; (p = strstr(p, series)); p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ') return strtod(p + n + 1, NULL);
    return NAN;
}

static void line(elastic_metrics *m, int local, const char *l, double t)
{
    elastic_metrics_line(m, local, l, strlen(l), t);
}

static void aggregation(void)
{
    elastic_metrics *m;
    T_REQUIRE(elastic_metrics_create(&m, 100.0) == 0, "create");
    char *t = render(m, 100.0);
    T_CHECK(check_exposition(t) > 0, "empty metrics");
    T_CHECK(isnan(value_of(t, "train_step{node=\"0\"}")), "no step yet");
    T_CHECK(value_of(t, "elastic_restarts_total") == 0, "restarts 0");
    T_CHECK(value_of(t, "ckpt_snapshot_failures_total{stage=\"stage\"}") == 0, "failures 0");
    free(t);

    /* round 0: node 1 of a 2-node job, ranks 2 and 3 */
    T_CHECK(elastic_metrics_round(m, 0, 1, 4, 2, 2, 101.0) == 0, "round");
    elastic_metrics_rank_up(m, 0, 1);
    elastic_metrics_rank_up(m, 1, 1);
    elastic_metrics_rank_up(m, 7, 1); /* not a local rank: ignored */
    line(m, 0, "restore step=0 seconds=0.5 source=none", 101.5);
    for (int s = 1; s <= 10; s++) {
        char l[128];
        snprintf(l, sizeof l, "step %d seconds=0.25 loss=%d lr=0.001 grad_norm=1 "
                 "tokens_per_second=1000 samples=%d", s, 10 - s, 8 * s);
        line(m, 0, l, 102.0 + 0.25 * s);
        snprintf(l, sizeof l, "step %d seconds=0.25", s);
        line(m, 1, l, 102.0 + 0.25 * s);
        if (s % 5 == 0) {
            snprintf(l, sizeof l, "snapshot_staged step=%d stall_seconds=0.002 bytes=100", s);
            line(m, 0, l, 102.0 + 0.25 * s);
            line(m, 1, l, 102.0 + 0.25 * s);
            snprintf(l, sizeof l, "snapshot_done step=%d result=0 persist_seconds=0.1 "
                     "raw_bytes=100 stored_bytes=18446744073709551615", s);
            line(m, 0, l, 102.0 + 0.25 * s);
            line(m, 1, l, 102.0 + 0.25 * s);
            line(m, 0, l, 102.0 + 0.25 * s); /* the same report twice counts once */
        }
    }
    line(m, 1, "snapshot_failed step=11 result=-28", 105);
    line(m, 0, "snapshot_failed step=11 result=-28", 105); /* the same snapshot: once */
    line(m, 0, "snapshot_skipped step=12", 105);
    line(m, 1, "snapshot_skipped step=12", 105); /* the first local rank speaks */
    line(m, 0, "val step=10 loss=2.5", 105);
    line(m, 0, "step 11 seconds=nan", 105);      /* malformed */
    line(m, 1, "snapshot_uploaded step=10", 105); /* unknown */
    line(m, 0, "step 11 loss=nan seconds=0.25", 105.25);
    t = render(m, 106.0);
    check_exposition(t);
    T_CHECK(value_of(t, "train_step{node=\"1\"}") == 11, "step\n%s", t);
    T_CHECK(strstr(t, "train_loss{node=\"1\"} NaN\n"), "NaN loss");
    T_CHECK(value_of(t, "train_val_loss{node=\"1\"}") == 2.5, "val");
    T_CHECK(value_of(t, "train_samples{node=\"1\"}") == 80, "samples");
    T_CHECK(value_of(t, "train_step_seconds_count") == 11, "step histogram: the first rank");
    T_CHECK(value_of(t, "ckpt_snapshot_stall_seconds_count") == 4, "stall: every local rank");
    T_CHECK(value_of(t, "ckpt_persist_seconds_count") == 6, "persist: every report");
    T_CHECK(strstr(t, "\nckpt_persist_bytes_total 18446744073709551615\n"), "bytes saturate");
    T_CHECK(value_of(t, "ckpt_snapshots_committed_total") == 2, "committed");
    T_CHECK(value_of(t, "ckpt_snapshot_failures_total{stage=\"stage\"}") == 1, "stage failure");
    T_CHECK(value_of(t, "ckpt_snapshot_failures_total{stage=\"persist\"}") == 0, "persist");
    T_CHECK(value_of(t, "ckpt_snapshots_skipped_total") == 1, "skipped");
    T_CHECK(value_of(t, "ckpt_last_committed_step{node=\"1\"}") == 10, "last committed");
    T_CHECK(value_of(t, "ckpt_last_commit_timestamp_seconds{node=\"1\"}") > 1.6e9, "timestamp");
    T_CHECK(value_of(t, "ckpt_restore_seconds{node=\"1\",source=\"none\"}") == 0.5, "restore");
    T_CHECK(value_of(t, "elastic_rank_up{node=\"1\",rank=\"2\"}") == 1, "rank 2 up");
    T_CHECK(value_of(t, "elastic_rank_up{node=\"1\",rank=\"3\"}") == 1, "rank 3 up");
    T_CHECK(value_of(t, "elastic_world_size{node=\"1\"}") == 4, "world");
    T_CHECK(value_of(t, "elastic_round{node=\"1\"}") == 0, "round 0");
    T_CHECK(value_of(t, "elastic_report_lines_total{outcome=\"malformed\"}") == 1, "malformed");
    T_CHECK(value_of(t, "elastic_report_lines_total{outcome=\"unknown\"}") == 1, "unknown");
    double g = value_of(t, "train_goodput_ratio{node=\"1\"}");
    T_CHECK(t_close(g, 11 * 0.25 / 6.0, 1e-12, 0), "goodput %g", g);
    free(t);

    /* rank 3 dies; the group restarts as node 0 of a smaller job and resumes from step 5 */
    elastic_metrics_rank_up(m, 1, 0);
    elastic_metrics_interrupt(m, 106.0);
    elastic_metrics_rank_up(m, 0, 0);
    elastic_metrics_restart(m);
    T_CHECK(elastic_metrics_round(m, 1, 0, 2, 0, 2, 107.0) == 0, "round 1");
    elastic_metrics_rank_up(m, 0, 1);
    elastic_metrics_rank_up(m, 1, 1);
    line(m, 0, "restore step=5 seconds=0.25 source=disk", 107.5);
    line(m, 0, "step 6 seconds=0.5", 108.5);
    /* an older snapshot committed again must not lower the last committed step */
    line(m, 0, "snapshot_done step=6 result=0 persist_seconds=0.1", 108.5);
    line(m, 0, "snapshot_done step=7 result=-5", 108.5);
    t = render(m, 109.0);
    check_exposition(t);
    T_CHECK(value_of(t, "train_step{node=\"0\"}") == 6, "the step went back");
    T_CHECK(value_of(t, "elastic_restarts_total") == 1, "restarts");
    T_CHECK(value_of(t, "ckpt_snapshots_committed_total") == 3, "committed never goes down");
    T_CHECK(value_of(t, "ckpt_snapshot_failures_total{stage=\"persist\"}") == 1, "persist fail");
    T_CHECK(value_of(t, "ckpt_last_committed_step{node=\"0\"}") == 10, "never decreases");
    T_CHECK(value_of(t, "train_step_seconds_count") == 12, "histograms keep counting");
    T_CHECK(value_of(t, "ckpt_persist_seconds_count") == 7, "persist of step 6");
    T_CHECK(value_of(t, "ckpt_restore_seconds{node=\"0\",source=\"disk\"}") == 0.25, "disk");
    T_CHECK(value_of(t, "ckpt_restore_seconds{node=\"0\",source=\"none\"}") == 0.5, "none kept");
    T_CHECK(value_of(t, "elastic_rank_up{node=\"0\",rank=\"0\"}") == 1, "new ranks");
    T_CHECK(isnan(value_of(t, "elastic_rank_up{node=\"1\",rank=\"2\"}")), "old ranks gone");
    T_CHECK(isnan(value_of(t, "train_step{node=\"1\"}")), "one node label at a time");
    free(t);
    elastic_goodput_report r;
    elastic_metrics_goodput(m, 109.0, &r);
    /* 11 x 0.25 s, of which steps 6..11 (1.5 s) were recomputed, then 0.5 s */
    T_CHECK(t_close(r.productive_s, 5 * 0.25 + 0.5, 1e-12, 0), "productive %g", r.productive_s);
    T_CHECK(t_close(r.recomputed_s, 1.5, 1e-12, 0) && r.steps_recomputed == 6, "recomputed");
    T_CHECK(t_close(r.restart_s, 108.0 - 106.0, 1e-12, 0), "restart %g", r.restart_s);
    T_CHECK(t_close(r.stall_s, 0.004, 1e-12, 0), "stall: the first rank %g", r.stall_s);
    T_CHECK(t_close(r.wall_s, 9.0, 1e-12, 0), "wall");

    /* restore sources are bounded: a worker cannot grow the series set */
    for (int i = 0; i < 20; i++) {
        char l[96];
        snprintf(l, sizeof l, "restore step=5 seconds=1 source=src%d", i);
        line(m, 0, l, 110);
    }
    t = render(m, 110.0);
    int nsrc = 0;
    for (char *p = t; (p = strstr(p, "\nckpt_restore_seconds{")); p++) nsrc++;
    T_CHECK(nsrc == 4, "%d sources", nsrc);
    free(t);
    elastic_metrics_end(m, 111.0);
    t = render(m, 200.0);
    T_CHECK(value_of(t, "elastic_rank_up{node=\"0\",rank=\"0\"}") == 0, "down at the end");
    g = value_of(t, "train_goodput_ratio{node=\"0\"}");
    T_CHECK(t_close(g, 1.75 / 11.0, 1e-12, 0), "the wall time stops at the end: %g", g);
    free(t);
    elastic_metrics_log_goodput(m, 200.0);
    elastic_metrics_free(m);
    elastic_metrics_free(NULL);
}

/* The S3 uploader's lines: one count per snapshot from the node's first rank (the same line
 * twice, or another local rank's, counts once), the bytes of every local rank's upload_done,
 * the lag gauges from global rank 0 only, the newest S3 step never going down. */
static void upload_aggregation(void)
{
    elastic_metrics *m;
    T_REQUIRE(elastic_metrics_create(&m, 0) == 0, "create");
    char *t = render(m, 0);
    check_exposition(t);
    T_CHECK(strstr(t, "# TYPE ckpt_snapshot_uploads_total counter\n"
                      "ckpt_snapshot_uploads_total{result=\"done\"} 0\n"
                      "ckpt_snapshot_uploads_total{result=\"failed\"} 0\n"
                      "ckpt_snapshot_uploads_total{result=\"skipped\"} 0\n"), "%s", t);
    T_CHECK(strstr(t, "# TYPE ckpt_upload_bytes_total counter\nckpt_upload_bytes_total 0\n"),
            "bytes 0");
    /* the gauges have no sample before the first line, only their HELP and TYPE */
    static const char *const gauges[] = {"ckpt_upload_lag_steps", "ckpt_upload_lag_seconds",
                                         "ckpt_last_uploaded_step"};
    for (int i = 0; i < 3; i++) {
        char type[96], sample[96];
        snprintf(type, sizeof type, "# TYPE %s gauge\n", gauges[i]);
        snprintf(sample, sizeof sample, "\n%s{", gauges[i]);
        T_CHECK(strstr(t, type) && !strstr(t, sample), "%s: no sample yet\n%s", gauges[i], t);
    }
    free(t);

    /* node 0 of a 2-node job: global ranks 0 and 1 */
    elastic_metrics_round(m, 0, 0, 4, 0, 2, 1.0);
    /* the first upload fails: nothing on S3 yet */
    line(m, 0, "upload_failed step=10 bytes=100 seconds=1.5 result=-110 lag_steps=10 "
         "lag_seconds=5 remote_step=-1", 2);
    line(m, 1, "upload_failed step=10 bytes=100 seconds=1.5 result=-110 lag_steps=0 "
         "lag_seconds=0 remote_step=-1", 2);
    t = render(m, 2);
    check_exposition(t);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"failed\"}") == 1, "failed once");
    T_CHECK(value_of(t, "ckpt_upload_bytes_total") == 0, "a failed upload adds no bytes");
    T_CHECK(value_of(t, "ckpt_upload_lag_steps{node=\"0\"}") == 10, "lag steps\n%s", t);
    T_CHECK(value_of(t, "ckpt_upload_lag_seconds{node=\"0\"}") == 5, "lag seconds");
    T_CHECK(!strstr(t, "\nckpt_last_uploaded_step{"), "-1: no step on S3 yet\n%s", t);
    free(t);
    /* rank 1 finishes its part first; then rank 0 completes the snapshot (twice: once) */
    line(m, 1, "upload_done step=20 bytes=1000 seconds=2 result=0 lag_steps=0 lag_seconds=0 "
         "remote_step=-1", 3);
    t = render(m, 3);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"done\"}") == 0, "not rank 0's");
    T_CHECK(value_of(t, "ckpt_upload_bytes_total") == 1000, "but its bytes");
    T_CHECK(value_of(t, "ckpt_upload_lag_steps{node=\"0\"}") == 10, "nor its lag");
    free(t);
    const char *done20 = "upload_done step=20 bytes=2000 seconds=2.25 result=0 lag_steps=0 "
                         "lag_seconds=0 remote_step=20";
    line(m, 0, done20, 4);
    line(m, 0, done20, 4);
    line(m, 0, "upload_skipped step=30 bytes=0 seconds=0 result=-125 lag_steps=10 "
         "lag_seconds=7.5 remote_step=20", 5);
    line(m, 1, "upload_skipped step=30 bytes=0 seconds=0 result=-125 lag_steps=0 "
         "lag_seconds=0 remote_step=-1", 5);
    line(m, 0, "upload_done step=40 result=0", 6); /* bare: the gauges stay */
    line(m, 0, "upload_done step=50 result=0 remote_step=-2", 6); /* malformed */
    line(m, 0, "upload_started step=50", 6);                     /* unknown */
    t = render(m, 7);
    check_exposition(t);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"done\"}") == 2, "done\n%s", t);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"failed\"}") == 1, "failed");
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"skipped\"}") == 1, "skipped");
    T_CHECK(value_of(t, "ckpt_upload_bytes_total") == 1000 + 2 * 2000, "bytes: every report");
    T_CHECK(value_of(t, "ckpt_upload_lag_steps{node=\"0\"}") == 10, "lag steps");
    T_CHECK(value_of(t, "ckpt_upload_lag_seconds{node=\"0\"}") == 7.5, "lag seconds");
    T_CHECK(value_of(t, "ckpt_last_uploaded_step{node=\"0\"}") == 20, "on S3");
    T_CHECK(value_of(t, "elastic_report_lines_total{outcome=\"malformed\"}") == 1, "malformed");
    T_CHECK(value_of(t, "elastic_report_lines_total{outcome=\"unknown\"}") == 1, "unknown");
    free(t);

    /* a restart: the new trainer's uploader starts from -1; the same step in a new round
     * counts again; the newest S3 step does not go back */
    elastic_metrics_interrupt(m, 8);
    elastic_metrics_restart(m);
    elastic_metrics_round(m, 1, 0, 4, 0, 2, 9);
    line(m, 0, "upload_failed step=40 bytes=0 seconds=30 result=-5 lag_steps=40 "
         "lag_seconds=2 remote_step=-1", 10);
    t = render(m, 10);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"failed\"}") == 2, "a new round");
    T_CHECK(value_of(t, "ckpt_last_uploaded_step{node=\"0\"}") == 20, "kept over -1");
    T_CHECK(value_of(t, "ckpt_upload_lag_steps{node=\"0\"}") == 40, "the new view");
    free(t);
    line(m, 0, "upload_done step=50 bytes=7 seconds=1 result=0 lag_steps=0 lag_seconds=0 "
         "remote_step=50", 11);
    line(m, 0, "upload_done step=60 bytes=7 seconds=1 result=0 lag_steps=0 lag_seconds=0 "
         "remote_step=45", 12); /* an older report: kept at 50 */
    t = render(m, 12);
    check_exposition(t);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"done\"}") == 4, "done");
    T_CHECK(value_of(t, "ckpt_upload_bytes_total") == 5014, "bytes");
    T_CHECK(value_of(t, "ckpt_last_uploaded_step{node=\"0\"}") == 50, "never decreases");
    T_CHECK(value_of(t, "ckpt_upload_lag_seconds{node=\"0\"}") == 0, "caught up");
    free(t);
    /* bytes saturate */
    line(m, 1, "upload_done step=70 bytes=18446744073709551615 result=0", 13);
    t = render(m, 13);
    T_CHECK(strstr(t, "\nckpt_upload_bytes_total 18446744073709551615\n"), "saturate");
    free(t);
    elastic_metrics_free(m);

    /* the other node's agent: its first rank (global rank 2) counts, its lag keys are
     * placeholders and are not exported */
    T_REQUIRE(elastic_metrics_create(&m, 0) == 0, "create");
    elastic_metrics_round(m, 0, 1, 4, 2, 2, 1.0);
    line(m, 0, "upload_done step=20 bytes=300 seconds=1 result=0 lag_steps=0 lag_seconds=0 "
         "remote_step=-1", 2);
    line(m, 1, "upload_done step=20 bytes=400 seconds=1 result=0 lag_steps=0 lag_seconds=0 "
         "remote_step=-1", 2);
    line(m, 0, "upload_failed step=30 bytes=0 seconds=1 result=-110 lag_steps=0 lag_seconds=0 "
         "remote_step=-1", 3);
    t = render(m, 3);
    check_exposition(t);
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"done\"}") == 1, "node 1 done");
    T_CHECK(value_of(t, "ckpt_snapshot_uploads_total{result=\"failed\"}") == 1, "node 1 fail");
    T_CHECK(value_of(t, "ckpt_upload_bytes_total") == 700, "node 1 bytes");
    T_CHECK(!strstr(t, "\nckpt_upload_lag_steps{") && !strstr(t, "\nckpt_upload_lag_seconds{") &&
            !strstr(t, "\nckpt_last_uploaded_step{"), "no lag off rank 0's node\n%s", t);
    free(t);
    elastic_metrics_free(m);
}

/* Metrics of node 0 of a one-node job, round 0 at t = 1 s, local ranks 0 and 1 up. */
static elastic_metrics *two_local_ranks(void)
{
    elastic_metrics *m;
    T_REQUIRE(elastic_metrics_create(&m, 0) == 0, "create");
    elastic_metrics_round(m, 0, 0, 2, 0, 2, 1.0);
    elastic_metrics_rank_up(m, 0, 1);
    elastic_metrics_rank_up(m, 1, 1);
    return m;
}

/* Memory snapshots (train's memory tier): the stall histogram of every local rank, the
 * failures of any, the newest step of the first rank; the stall counts in the goodput. */
static void mem_aggregation(void)
{
    elastic_metrics *m = two_local_ranks();
    char *t = render(m, 1.5);
    T_CHECK(value_of(t, "ckpt_mem_snapshot_stall_seconds_count") == 0, "none yet\n%s", t);
    T_CHECK(isnan(value_of(t, "ckpt_mem_snapshot_step{node=\"0\"}")), "no step yet");
    free(t);
    for (int s = 1; s <= 3; s++) {
        char l[128];
        snprintf(l, sizeof l, "step %d seconds=0.25", s);
        line(m, 0, l, 1.0 + 0.25 * s);
        line(m, 1, l, 1.0 + 0.25 * s);
        snprintf(l, sizeof l, "mem_snapshot step=%d stall_seconds=0.004 bytes=8192 slot=%d", s, s % 2);
        line(m, 0, l, 1.0 + 0.25 * s);
        line(m, 1, l, 1.0 + 0.25 * s);
    }
    line(m, 1, "mem_snapshot_failed step=4 result=-28", 2.0);
    t = render(m, 2.0);
    check_exposition(t);
    T_CHECK(value_of(t, "ckpt_mem_snapshot_stall_seconds_count") == 6, "every local rank\n%s", t);
    T_CHECK(value_of(t, "ckpt_mem_snapshot_step{node=\"0\"}") == 3, "newest step");
    T_CHECK(value_of(t, "ckpt_mem_snapshot_failures_total") == 1, "failures");
    free(t);
    elastic_metrics_free(m);
}

/* The wait of the next optimizer update for a snapshot's copies (asynchronous staging): a
 * histogram of every local rank, and the first rank's waits add to the goodput's stall next
 * to the stage's stall (the step's seconds exclude it: nothing counts twice). */
static void wait_aggregation(void)
{
    elastic_metrics *m = two_local_ranks();
    char *t = render(m, 1.0);
    T_CHECK(value_of(t, "ckpt_snapshot_wait_seconds_count") == 0, "none yet\n%s", t);
    free(t);
    for (int s = 1; s <= 4; s++) {
        char l[128];
        snprintf(l, sizeof l, "step %d seconds=0.25", s);
        line(m, 0, l, 1.0 + 0.5 * s);
        line(m, 1, l, 1.0 + 0.5 * s);
        if (s % 2 == 0) {
            snprintf(l, sizeof l, "snapshot_staged step=%d stall_seconds=0.001 bytes=100", s);
            line(m, 0, l, 1.0 + 0.5 * s);
            line(m, 1, l, 1.0 + 0.5 * s);
        } else if (s > 1) {
            snprintf(l, sizeof l, "snapshot_wait step=%d stall_seconds=0.125", s - 1);
            line(m, 0, l, 1.0 + 0.5 * s);
            line(m, 1, l, 1.0 + 0.5 * s);
        }
    }
    t = render(m, 3.0);
    check_exposition(t);
    T_CHECK(value_of(t, "ckpt_snapshot_wait_seconds_count") == 2, "every local rank\n%s", t);
    T_CHECK(t_close(value_of(t, "ckpt_snapshot_wait_seconds_sum"), 0.25, 1e-12, 0), "sum\n%s", t);
    T_CHECK(value_of(t, "ckpt_snapshot_stall_seconds_count") == 4, "the stage's stall apart");
    free(t);
    elastic_goodput_report r;
    elastic_metrics_goodput(m, 3.0, &r);
    T_CHECK(t_close(r.stall_s, 2 * 0.001 + 0.125, 1e-12, 0), "stall: stage + wait, first rank %g",
            r.stall_s);
    T_CHECK(t_close(r.productive_s, 4 * 0.25, 1e-12, 0), "productive %g", r.productive_s);
    elastic_metrics_free(m);
}

/* ------------------------------------------------------------------ goodput */

#define EV(k, t, s, d) {ELASTIC_GP_##k, t, s, d}

static void goodput_sequences(void)
{
    elastic_goodput_report r;
    /* a failure after step 4, a resume from step 2 */
    static const elastic_goodput_ev a[] = {
        EV(START, 0, 0, 0), EV(ROUND, 1, 0, 0),
        EV(STEP, 2, 1, 1), EV(STEP, 3, 2, 1), EV(STALL, 3.5, 2, 0.5), EV(STEP, 4.5, 3, 1),
        EV(STEP, 5.5, 4, 1), EV(INTERRUPT, 6, 0, 0), EV(ROUND, 7, 0, 0),
        EV(STEP, 9, 3, 1), EV(STEP, 10, 4, 1), EV(STEP, 11, 5, 1), EV(END, 12, 0, 0)};
    T_CHECK(elastic_goodput_compute(a, sizeof a / sizeof a[0], 99, &r) == 0, "compute");
    T_CHECK(r.wall_s == 12 && r.productive_s == 5 && r.recomputed_s == 2 && r.restart_s == 2 &&
            r.stall_s == 0.5 && r.other_s == 2.5, "a: wall %g prod %g rec %g restart %g stall %g "
            "other %g", r.wall_s, r.productive_s, r.recomputed_s, r.restart_s, r.stall_s, r.other_s);
    T_CHECK(r.steps_recomputed == 2 && r.resumes == 1 && r.interrupts == 1 &&
            r.restart_windows == 1 && r.steps_kept == 5, "a: counts");
    T_CHECK(r.ratio == 5.0 / 12.0, "a: ratio %g", r.ratio);

    /* rounds that fail before their first step stay in one window */
    static const elastic_goodput_ev b[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(STEP, 1, 1, 1), EV(STEP, 2, 2, 1),
        EV(INTERRUPT, 3, 0, 0), EV(ROUND, 4, 0, 0), EV(INTERRUPT, 5, 0, 0), EV(ROUND, 6, 0, 0),
        EV(STEP, 9, 3, 2), EV(END, 10, 0, 0)};
    elastic_goodput_compute(b, sizeof b / sizeof b[0], 0, &r);
    T_CHECK(r.restart_s == 4 && r.restart_windows == 1 && r.interrupts == 2 && r.resumes == 0 &&
            r.productive_s == 4 && r.recomputed_s == 0, "b: restart %g", r.restart_s);

    /* the interrupted round's first step line is read only while its group stops: the window
     * stays open until the next round steps */
    static const elastic_goodput_ev b2[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(INTERRUPT, 2, 0, 0), EV(STEP, 2.1, 1, 1.5),
        EV(ROUND, 3, 0, 0), EV(STEP, 5, 1, 1), EV(END, 6, 0, 0)};
    elastic_goodput_compute(b2, sizeof b2 / sizeof b2[0], 0, &r);
    T_CHECK(r.restart_s == 2 && r.restart_windows == 1 && r.productive_s == 1 &&
            r.recomputed_s == 1.5 && r.steps_recomputed == 1 && r.resumes == 1, "b2: %g %g %g",
            r.restart_s, r.productive_s, r.recomputed_s);

    /* the job ends after a failure (budget spent): no restart, the time is other */
    static const elastic_goodput_ev c[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(STEP, 1, 1, 1), EV(INTERRUPT, 2, 0, 0),
        EV(END, 5, 0, 0)};
    elastic_goodput_compute(c, sizeof c / sizeof c[0], 0, &r);
    T_CHECK(r.restart_s == 0 && r.other_s == 4 && r.ratio == 0.2, "c: %g %g", r.restart_s,
            r.other_s);

    /* a new round that never steps: the window runs to the end; live: to now */
    static const elastic_goodput_ev d[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(STEP, 1, 1, 1), EV(INTERRUPT, 2, 0, 0),
        EV(ROUND, 3, 0, 0)};
    elastic_goodput_compute(d, sizeof d / sizeof d[0], 7, &r);
    T_CHECK(r.restart_s == 5 && r.restart_windows == 1 && r.wall_s == 7, "d: %g", r.restart_s);
    /* ... and when that round fails too and the job gives up, the window ends at its failure:
     * the shutdown after it is other */
    static const elastic_goodput_ev d2[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(STEP, 1, 1, 1), EV(INTERRUPT, 2, 0, 0),
        EV(ROUND, 3, 0, 0), EV(INTERRUPT, 4.5, 0, 0), EV(END, 6, 0, 0)};
    elastic_goodput_compute(d2, sizeof d2 / sizeof d2[0], 0, &r);
    T_CHECK(r.restart_s == 2.5 && r.restart_windows == 1 && r.interrupts == 2 &&
            r.other_s == 2.5, "d2: %g %g", r.restart_s, r.other_s);

    /* lost lines: steps 3 and 4 never arrived; steps without seconds count 0 s */
    static const elastic_goodput_ev e[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(STEP, 1, 1, 1), EV(STEP, 2, 2, 1),
        EV(STEP, 5, 5, 1), EV(STEP, 6, 6, -1), EV(END, 6, 0, 0)};
    elastic_goodput_compute(e, sizeof e / sizeof e[0], 0, &r);
    T_CHECK(r.productive_s == 3 && r.steps_kept == 6 && r.resumes == 0, "e: %g %" PRId64,
            r.productive_s, r.steps_kept);

    /* a job that starts from a snapshot (first step 101); a later resume before that point
     * recomputes everything this agent did; a resume to where it is recomputes nothing */
    static const elastic_goodput_ev f[] = {
        EV(START, 0, 0, 0), EV(ROUND, 0, 0, 0), EV(STEP, 1, 101, 1), EV(STEP, 2, 102, 1),
        EV(INTERRUPT, 2, 0, 0), EV(ROUND, 2, 0, 0), EV(STEP, 4, 51, 1), EV(STEP, 5, 52, 1),
        EV(INTERRUPT, 5, 0, 0), EV(ROUND, 5, 0, 0), EV(STEP, 7, 53, 1), EV(END, 7, 0, 0)};
    elastic_goodput_compute(f, sizeof f / sizeof f[0], 0, &r);
    T_CHECK(r.recomputed_s == 2 && r.steps_recomputed == 102 - 50 && r.productive_s == 3 &&
            r.resumes == 1 && r.restart_s == 2 && r.interrupts == 2, "f: rec %g steps %" PRId64
            " prod %g resumes %d restart %g", r.recomputed_s, r.steps_recomputed, r.productive_s,
            r.resumes, r.restart_s);

    /* nothing at all */
    static const elastic_goodput_ev z[] = {EV(START, 5, 0, 0), EV(END, 5, 0, 0)};
    elastic_goodput_compute(z, 2, 0, &r);
    T_CHECK(r.wall_s == 0 && r.ratio == 0 && r.other_s == 0, "empty");
    static const elastic_goodput_ev bad[] = {EV(START, 0, 0, 0), {99, 1, 0, 0},
                                             EV(STEP, 1, -3, 1)};
    T_CHECK(elastic_goodput_compute(bad, 3, 1, &r) == -EINVAL, "bad events");
}

static void goodput_long(void)
{
    /* 5M one-second steps pass the fold at 2^22: a resume after the folded part is still
     * exact; one into it keeps the folded time productive (it cannot be split any more) */
    elastic_goodput g = ELASTIC_GOODPUT_INIT;
    elastic_goodput_ev ev = {ELASTIC_GP_START, 0, 0, 0};
    elastic_goodput_add(&g, &ev);
    ev.kind = ELASTIC_GP_ROUND;
    elastic_goodput_add(&g, &ev);
    const int64_t N = 5000000;
    int64_t failed_at = 0;
    for (int64_t s = 1; s <= N; s++) {
        elastic_goodput_ev st = {ELASTIC_GP_STEP, (double)s, s, 1.0};
        if (elastic_goodput_add(&g, &st) != 0 && !failed_at) failed_at = s;
    }
    T_REQUIRE(failed_at == 0, "step %" PRId64, failed_at);
    elastic_goodput_report r;
    elastic_goodput_get(&g, (double)N, &r);
    T_CHECK(r.productive_s == (double)N && r.steps_kept == N, "long: %g", r.productive_s);
    ev = (elastic_goodput_ev){ELASTIC_GP_ROUND, (double)N, 0, 0};
    elastic_goodput_add(&g, &ev);
    ev = (elastic_goodput_ev){ELASTIC_GP_STEP, (double)N + 1, 3000001, 1.0};
    elastic_goodput_add(&g, &ev);
    elastic_goodput_get(&g, (double)N + 1, &r);
    T_CHECK(r.recomputed_s == 2000000.0 && r.productive_s == 3000001.0 &&
            r.steps_recomputed == 2000000, "long resume: %g %g", r.recomputed_s, r.productive_s);
    ev = (elastic_goodput_ev){ELASTIC_GP_ROUND, (double)N + 1, 0, 0};
    elastic_goodput_add(&g, &ev);
    ev = (elastic_goodput_ev){ELASTIC_GP_STEP, (double)N + 2, 1000001, 1.0};
    elastic_goodput_add(&g, &ev);
    elastic_goodput_get(&g, (double)N + 2, &r);
    T_CHECK(r.productive_s == (double)((int64_t)1 << 21) + 1.0 &&
            r.steps_recomputed == 2000000 + 3000001 - 1000000, "into the folded part: %g %"
            PRId64, r.productive_s, r.steps_recomputed);
    elastic_goodput_free(&g);
}

/* ------------------------------------------------------------------ HTTP */

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    T_REQUIRE(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
              getsockname(fd, (struct sockaddr *)&a, &l) == 0, "free port");
    close(fd);
    return ntohs(a.sin_port);
}

/* One HTTP/1.0 exchange with 127.0.0.1:port (5 s socket timeouts); the reply into buf. */
static size_t http(int port, const char *request, char *buf, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    T_REQUIRE(connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "connect: %s", strerror(errno));
    T_REQUIRE(write(fd, request, strlen(request)) == (ssize_t)strlen(request), "send");
    size_t n = 0;
    for (;;) {
        ssize_t k = read(fd, buf + n, cap - 1 - n);
        if (k <= 0) break;
        n += (size_t)k;
    }
    buf[n] = '\0';
    close(fd);
    return n;
}

/* SigBlk of every thread but the caller's (/proc/self/task/<tid>/status): all must block
 * SIGTERM, SIGINT and SIGCHLD. Returns the number of other threads. */
static int other_threads_block_signals(void)
{
    pid_t me = (pid_t)syscall(SYS_gettid);
    DIR *d = opendir("/proc/self/task");
    T_REQUIRE(d, "task dir");
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || atoi(de->d_name) == me) continue;
        char path[300], l[256];
        snprintf(path, sizeof path, "/proc/self/task/%s/status", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        unsigned long long blk = 0;
        while (fgets(l, sizeof l, f))
            if (!strncmp(l, "SigBlk:", 7)) blk = strtoull(l + 7, NULL, 16);
        fclose(f);
        unsigned long long need = (1ull << (SIGTERM - 1)) | (1ull << (SIGINT - 1)) |
                                  (1ull << (SIGCHLD - 1)) | (1ull << (SIGHUP - 1));
        T_CHECK((blk & need) == need, "thread %s blocks %llx", de->d_name, blk);
        n++;
    }
    closedir(d);
    return n;
}

static void http_server(void)
{
    elastic_metrics *m;
    T_REQUIRE(elastic_metrics_create(&m, 0) == 0, "create");
    elastic_metrics_round(m, 0, 0, 1, 0, 1, 0);
    line(m, 0, "step 3 seconds=0.5 loss=1.25", 1);
    int port = free_port();
    sigset_t before, after;
    pthread_sigmask(SIG_SETMASK, NULL, &before);
    int threads0 = other_threads_block_signals();
    elastic_metrics_http *h = NULL;
    T_REQUIRE(elastic_metrics_http_start(&h, "127.0.0.1", port, m) == 0 && h, "start");
    pthread_sigmask(SIG_SETMASK, NULL, &after);
    T_CHECK(sigismember(&after, SIGTERM) == sigismember(&before, SIGTERM) &&
            sigismember(&after, SIGHUP) == sigismember(&before, SIGHUP), "the mask is restored");
    T_CHECK(other_threads_block_signals() > threads0, "the server's thread blocks the signals");

    static char buf[1 << 16];
    http(port, "GET /metrics HTTP/1.0\r\n\r\n", buf, sizeof buf);
    T_CHECK(!strncmp(buf, "HTTP/1.0 200", 12) || !strncmp(buf, "HTTP/1.1 200", 12), "%.80s", buf);
    T_CHECK(strstr(buf, "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), "type");
    char *body = strstr(buf, "\r\n\r\n");
    T_REQUIRE(body, "body");
    body += 4;
    T_CHECK(strstr(body, "# TYPE train_step gauge\ntrain_step{node=\"0\"} 3\n"), "%s", body);
    T_CHECK(strstr(body, "train_loss{node=\"0\"} 1.25\n"), "loss");
    T_CHECK(check_exposition(body) > 30, "exposition");
    http(port, "HEAD /metrics HTTP/1.0\r\n\r\n", buf, sizeof buf);
    T_CHECK(strstr(buf, " 200 ") && !strstr(buf, "train_step"), "HEAD: %.200s", buf);
    http(port, "GET /other HTTP/1.0\r\n\r\n", buf, sizeof buf);
    T_CHECK(strstr(buf, " 404 "), "404: %.80s", buf);
    http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc", buf, sizeof buf);
    T_CHECK(strstr(buf, " 405 ") && strstr(buf, "Allow: GET, HEAD"), "405: %.200s", buf);
    http(port, "garbage\r\n\r\n", buf, sizeof buf);
    T_CHECK(strncmp(buf, "HTTP/1.1 200", 12) != 0, "garbage is no scrape: %.80s", buf);

    /* the port is taken now */
    elastic_metrics_http *h2 = NULL;
    T_CHECK(elastic_metrics_http_start(&h2, "127.0.0.1", port, m) == -EADDRINUSE && !h2,
            "busy port");
    T_CHECK(elastic_metrics_http_start(&h2, "no-such-host.invalid", port, m) == -EINVAL,
            "unresolvable address");
    T_CHECK(elastic_metrics_http_start(&h2, "127.0.0.1", 0, m) == -EINVAL, "port 0");
    T_CHECK(elastic_metrics_http_start(&h2, "", port, m) == -EINVAL, "empty address");

    /* updates during scrapes: the mutex keeps every text whole */
    for (int i = 0; i < 50; i++) {
        char l[64];
        snprintf(l, sizeof l, "step %d seconds=0.01", 4 + i);
        line(m, 0, l, 2 + i);
        http(port, "GET /metrics HTTP/1.0\r\n\r\n", buf, sizeof buf);
        body = strstr(buf, "\r\n\r\n");
        T_CHECK(body && check_exposition(body + 4) > 30, "scrape %d", i);
    }
    elastic_metrics_http_stop(h);
    elastic_metrics_http_stop(NULL);
    /* the listening socket was closed: the port can be bound again */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    T_CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0, "port free after stop: %s",
            strerror(errno));
    close(fd);
    /* IPv6 loopback, where the machine has it */
    if (elastic_metrics_http_start(&h, "::1", port, m) == 0) {
        elastic_metrics_http_stop(h);
    }
    elastic_metrics_free(m);
}

int main(void)
{
    parser_events();
    parser_malformed();
    parser_values();
    expo_text();
    expo_histogram();
    expo_errors();
    aggregation();
    upload_aggregation();
    mem_aggregation();
    wait_aggregation();
    goodput_sequences();
    goodput_long();
    http_server();
    return t_done("test_elastic_metrics");
}
