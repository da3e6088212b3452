/* metrics_report.c - the parser of the workers' progress lines (metrics.h,
 * elastic_report_parse). The lines come from the user's processes: every value is checked,
 * nothing is trusted to be NUL-terminated, and nothing here allocates. */
#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A value of at most this many bytes is copied to a NUL-terminated buffer for strto*: a line
 * is at most ELASTIC_REPORT_LINE_MAX bytes, so every value fits. */
#define VAL_MAX ELASTIC_REPORT_LINE_MAX

static int parse_u64(const char *v, size_t n, uint64_t *out)
{
    if (n == 0 || n > 20) return -EINVAL;
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9') return -EINVAL;
        unsigned d = (unsigned)(v[i] - '0');
        if (x > (UINT64_MAX - d) / 10) return -EINVAL;
        x = x * 10 + d;
    }
    *out = x;
    return 0;
}

static int parse_step(const char *v, size_t n, int64_t *out)
{
    uint64_t x;
    if (parse_u64(v, n, &x) < 0 || x > (uint64_t)INT64_MAX) return -EINVAL;
    *out = (int64_t)x;
    return 0;
}

static int parse_result(const char *v, size_t n, int *out)
{
    int neg = n > 0 && v[0] == '-';
    uint64_t x;
    if (parse_u64(v + neg, n - (size_t)neg, &x) < 0 || x > 4095 || (!neg && x != 0))
        return -EINVAL;
    *out = -(int)x;
    return 0;
}

/* remote_step: a step, or -1 (nothing on S3 yet) */
static int parse_remote_step(const char *v, size_t n, int64_t *out)
{
    if (n == 2 && v[0] == '-' && v[1] == '1') {
        *out = -1;
        return 0;
    }
    return parse_step(v, n, out);
}

static int parse_real(const char *v, size_t n, double *out)
{
    char buf[VAL_MAX];
    if (n == 0 || n >= sizeof buf) return -EINVAL;
    memcpy(buf, v, n);
    buf[n] = '\0';
    char *end;
    double x = strtod(buf, &end); /* ERANGE: an overflow is an infinity, an underflow ~0: kept */
    if (end != buf + n) return -EINVAL;
    *out = x;
    return 0;
}

static int parse_duration(const char *v, size_t n, double *out)
{
    double x;
    if (parse_real(v, n, &x) < 0 || !isfinite(x) || x < 0 || x > ELASTIC_REPORT_SECONDS_MAX)
        return -EINVAL;
    *out = x;
    return 0;
}

static int parse_source(const char *v, size_t n, char *out)
{
    if (n == 0 || n >= ELASTIC_REPORT_SOURCE_MAX) return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        char c = v[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return -EINVAL;
    }
    memcpy(out, v, n);
    out[n] = '\0';
    return 0;
}

/* The keys of the protocol; bit = the key's bit in the "seen" set. */
enum key {
    K_STEP, K_SECONDS, K_LOSS, K_LR, K_GRAD_NORM, K_TPS, K_SAMPLES, K_STALL, K_BYTES, K_RESULT,
    K_PERSIST, K_RAW, K_STORED, K_SOURCE, K_LAG_STEPS, K_LAG_SECONDS, K_REMOTE_STEP, K_N
};
static const char *const key_names[K_N] = {
    "step", "seconds", "loss", "lr", "grad_norm", "tokens_per_second", "samples",
    "stall_seconds", "bytes", "result", "persist_seconds", "raw_bytes", "stored_bytes", "source",
    "lag_steps", "lag_seconds", "remote_step"};

/* Which keys each event knows (others are ignored), and which it needs. */
#define B(k) (1u << (k))
#define UPLOAD_KEYS                                                                           \
    (B(K_STEP) | B(K_BYTES) | B(K_SECONDS) | B(K_RESULT) | B(K_LAG_STEPS) | B(K_LAG_SECONDS) | \
     B(K_REMOTE_STEP))
static const struct {
    const char *name;
    int kind;
    unsigned known, required;
} events[] = {
    {"step", ELASTIC_REPORT_STEP,
     B(K_SECONDS) | B(K_LOSS) | B(K_LR) | B(K_GRAD_NORM) | B(K_TPS) | B(K_SAMPLES), 0},
    {"val", ELASTIC_REPORT_VAL, B(K_STEP) | B(K_LOSS), B(K_STEP) | B(K_LOSS)},
    {"snapshot_staged", ELASTIC_REPORT_STAGED, B(K_STEP) | B(K_STALL) | B(K_BYTES),
     B(K_STEP) | B(K_STALL)},
    {"snapshot_skipped", ELASTIC_REPORT_SKIPPED, B(K_STEP), B(K_STEP)},
    {"snapshot_done", ELASTIC_REPORT_DONE,
     B(K_STEP) | B(K_RESULT) | B(K_PERSIST) | B(K_RAW) | B(K_STORED), B(K_STEP) | B(K_RESULT)},
    {"restore", ELASTIC_REPORT_RESTORE, B(K_STEP) | B(K_SECONDS) | B(K_SOURCE),
     B(K_STEP) | B(K_SECONDS) | B(K_SOURCE)},
    {"snapshot_failed", ELASTIC_REPORT_STAGE_FAILED, B(K_STEP) | B(K_RESULT),
     B(K_STEP) | B(K_RESULT)},
    {"upload_done", ELASTIC_REPORT_UPLOAD_DONE, UPLOAD_KEYS, B(K_STEP) | B(K_RESULT)},
    {"upload_failed", ELASTIC_REPORT_UPLOAD_FAILED, UPLOAD_KEYS, B(K_STEP) | B(K_RESULT)},
    {"upload_skipped", ELASTIC_REPORT_UPLOAD_SKIPPED, UPLOAD_KEYS, B(K_STEP) | B(K_RESULT)},
    {"mem_snapshot", ELASTIC_REPORT_MEM_SNAPSHOT, B(K_STEP) | B(K_STALL) | B(K_BYTES),
     B(K_STEP) | B(K_STALL)},
    {"mem_snapshot_failed", ELASTIC_REPORT_MEM_FAILED, B(K_STEP) | B(K_RESULT),
     B(K_STEP) | B(K_RESULT)},
    {"snapshot_wait", ELASTIC_REPORT_SNAPSHOT_WAIT, B(K_STEP) | B(K_STALL), B(K_STEP) | B(K_STALL)},
};

static int word_is(const char *w, size_t n, const char *name)
{
    return strlen(name) == n && memcmp(w, name, n) == 0;
}

static int set_key(elastic_report_event *ev, int k, const char *v, size_t n)
{
    switch (k) {
    case K_STEP: return parse_step(v, n, &ev->step);
    case K_SECONDS: ev->has |= ELASTIC_RF_SECONDS; return parse_duration(v, n, &ev->seconds);
    case K_LOSS: ev->has |= ELASTIC_RF_LOSS; return parse_real(v, n, &ev->loss);
    case K_LR: ev->has |= ELASTIC_RF_LR; return parse_real(v, n, &ev->lr);
    case K_GRAD_NORM: ev->has |= ELASTIC_RF_GRAD_NORM; return parse_real(v, n, &ev->grad_norm);
    case K_TPS: ev->has |= ELASTIC_RF_TPS; return parse_real(v, n, &ev->tokens_per_second);
    case K_SAMPLES: ev->has |= ELASTIC_RF_SAMPLES; return parse_u64(v, n, &ev->samples);
    case K_STALL: return parse_duration(v, n, &ev->stall_seconds);
    case K_BYTES: ev->has |= ELASTIC_RF_BYTES; return parse_u64(v, n, &ev->bytes);
    case K_RESULT: return parse_result(v, n, &ev->result);
    case K_PERSIST:
        ev->has |= ELASTIC_RF_PERSIST_SECONDS;
        return parse_duration(v, n, &ev->persist_seconds);
    case K_RAW: ev->has |= ELASTIC_RF_RAW_BYTES; return parse_u64(v, n, &ev->raw_bytes);
    case K_STORED: ev->has |= ELASTIC_RF_STORED_BYTES; return parse_u64(v, n, &ev->stored_bytes);
    case K_SOURCE: return parse_source(v, n, ev->source);
    case K_LAG_STEPS: ev->has |= ELASTIC_RF_LAG_STEPS; return parse_u64(v, n, &ev->lag_steps);
    case K_LAG_SECONDS:
        ev->has |= ELASTIC_RF_LAG_SECONDS;
        return parse_duration(v, n, &ev->lag_seconds);
    case K_REMOTE_STEP:
        ev->has |= ELASTIC_RF_REMOTE_STEP;
        return parse_remote_step(v, n, &ev->remote_step);
    default: return -EINVAL;
    }
}

int elastic_report_parse(const char *line, size_t len, elastic_report_event *ev)
{
    memset(ev, 0, sizeof *ev);
    if (len == 0 || len > ELASTIC_REPORT_LINE_MAX - 1 || !line) return -EINVAL;
    for (size_t i = 0; i < len; i++)
        if (line[i] != ' ' && (line[i] < 0x21 || line[i] > 0x7e)) return -EINVAL;
    size_t i = 0;
    while (i < len && line[i] == ' ') i++;
    size_t w0 = i;
    while (i < len && line[i] != ' ') i++;
    int e = -1;
    for (size_t k = 0; k < sizeof events / sizeof events[0]; k++)
        if (word_is(line + w0, i - w0, events[k].name)) e = (int)k;
    if (i == w0) return -EINVAL; /* only spaces */
    if (e < 0) return 0;         /* an event of a newer writer */
    ev->kind = events[e].kind;
    unsigned seen = 0;
    int positional = ev->kind == ELASTIC_REPORT_STEP; /* "step <n>" */
    for (;;) {
        while (i < len && line[i] == ' ') i++;
        if (i == len) break;
        size_t ws = i;
        while (i < len && line[i] != ' ') i++;
        const char *w = line + ws;
        size_t wn = i - ws;
        if (positional) {
            if (parse_step(w, wn, &ev->step) < 0) return -EINVAL;
            seen |= B(K_STEP);
            positional = 0;
            continue;
        }
        const char *eq = memchr(w, '=', wn);
        if (!eq || eq == w) return -EINVAL;
        size_t kn = (size_t)(eq - w);
        int k = -1;
        for (int j = 0; j < K_N; j++)
            if (word_is(w, kn, key_names[j])) k = j;
        if (k < 0 || !(events[e].known & B(k))) continue; /* unknown key: ignored */
        if (seen & B(k)) return -EINVAL;                  /* given twice */
        seen |= B(k);
        if (set_key(ev, k, eq + 1, wn - kn - 1) < 0) return -EINVAL;
    }
    if (ev->kind == ELASTIC_REPORT_STEP && !(seen & B(K_STEP))) return -EINVAL;
    if ((seen & events[e].required) != events[e].required) return -EINVAL;
    return 1;
}
