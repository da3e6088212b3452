/* metrics_expo.c - the Prometheus text exposition format, version 0.0.4 (metrics.h,
 * elastic_expo_*), and the agent's histograms. The format: "# HELP name text" and
 * "# TYPE name type" before a family's samples; a sample is name{label="value",...} value;
 * label values escape backslash, double quote and newline; HELP text backslash and newline. */
#include "metrics.h"

#include "log.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double elastic_hist_bounds[ELASTIC_HIST_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
    600};

void elastic_hist_observe(elastic_hist *h, double v)
{
    if (!isfinite(v) || v < 0) return;
    int b = 0;
    while (b < ELASTIC_HIST_BUCKETS && v > elastic_hist_bounds[b]) b++;
    h->bucket[b]++;
    h->count++;
    h->sum += v;
}

static int reserve(elastic_expo *e, size_t more)
{
    if (e->err) return e->err;
    if (e->len + more + 1 <= e->cap) return 0;
    size_t cap = e->cap ? e->cap : 4096;
    while (cap < e->len + more + 1) {
        if (cap > SIZE_MAX / 2) return e->err = -ENOMEM;
        cap *= 2;
    }
    char *b = realloc(e->buf, cap);
    if (!b) return e->err = -ENOMEM;
    e->buf = b;
    e->cap = cap;
    return 0;
}

static void put(elastic_expo *e, const char *s, size_t n)
{
    if (reserve(e, n) < 0) return;
    memcpy(e->buf + e->len, s, n);
    e->len += n;
    e->buf[e->len] = '\0';
}

static void puts_(elastic_expo *e, const char *s) { put(e, s, strlen(s)); }

static void putf(elastic_expo *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(elastic_expo *e, const char *fmt, ...)
{
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) put(e, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static int valid_name(const char *s, int colon)
{
    if (!s || !*s) return 0;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                 (colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
        if (!ok) return 0;
    }
    return 1;
}

/* Escape s: the format's escapes for backslash, newline and (in label values) the double
 * quote; any other byte that is not printable UTF-8 becomes the text \xNN (through
 * log_printable, whose backslash is then escaped itself). */
static void put_escaped(elastic_expo *e, const char *s, int quote)
{
    size_t i = 0, n = strlen(s);
    while (i < n) {
        char c = s[i];
        if (c == '\\') { puts_(e, "\\\\"); i++; continue; }
        if (c == '\n') { puts_(e, "\\n"); i++; continue; }
        if (quote && c == '"') { puts_(e, "\\\""); i++; continue; }
        size_t j = i;
        while (j < n && s[j] != '\\' && s[j] != '\n' && !(quote && s[j] == '"')) j++;
        /* the run [i, j): printable as it is, or with \xNN for what is not */
        char tmp[4 * 256 + 1];
        while (i < j) {
            size_t chunk = j - i > 256 ? 256 : j - i;
            /* do not cut a UTF-8 sequence: back up to a lead byte when more follows */
            while (chunk > 1 && i + chunk < j && ((unsigned char)s[i + chunk] & 0xC0) == 0x80)
                chunk--;
            size_t m = log_printable(tmp, sizeof tmp, s + i, chunk);
            for (size_t k = 0; k < m; k++) {
                if (tmp[k] == '\\') puts_(e, "\\\\");
                else put(e, tmp + k, 1);
            }
            i += chunk;
        }
    }
}

void elastic_expo_family(elastic_expo *e, const char *name, const char *type, const char *help)
{
    if (e->err) return;
    if (!valid_name(name, 1) || !type) {
        e->err = -EINVAL;
        return;
    }
    puts_(e, "# HELP ");
    puts_(e, name);
    puts_(e, " ");
    put_escaped(e, help ? help : "", 0);
    puts_(e, "\n# TYPE ");
    puts_(e, name);
    puts_(e, " ");
    puts_(e, type);
    puts_(e, "\n");
}

static void put_labels(elastic_expo *e, const char *const *labels, const char *le)
{
    int any = 0;
    for (size_t i = 0; labels && labels[i]; i += 2) {
        if (!valid_name(labels[i], 0) || !strncmp(labels[i], "__", 2)) {
            e->err = e->err ? e->err : -EINVAL;
            return;
        }
        puts_(e, any ? "," : "{");
        puts_(e, labels[i]);
        puts_(e, "=\"");
        put_escaped(e, labels[i + 1] ? labels[i + 1] : "", 1);
        puts_(e, "\"");
        any = 1;
    }
    if (le) {
        puts_(e, any ? ",le=\"" : "{le=\"");
        puts_(e, le);
        puts_(e, "\"");
        any = 1;
    }
    if (any) puts_(e, "}");
}

static void put_double(elastic_expo *e, double v)
{
    if (isnan(v)) puts_(e, "NaN");
    else if (isinf(v)) puts_(e, v > 0 ? "+Inf" : "-Inf");
    else {
        /* the shortest of %.15g, %.16g, %.17g that reads back as v (17 always does) */
        char tmp[40];
        for (int prec = 15; prec <= 17; prec++) {
            snprintf(tmp, sizeof tmp, "%.*g", prec, v);
            if (prec == 17 || strtod(tmp, NULL) == v) break;
        }
        puts_(e, tmp);
    }
}

static void sample_head(elastic_expo *e, const char *name, const char *suffix,
                        const char *const *labels, const char *le)
{
    if (e->err) return;
    if (!valid_name(name, 1)) {
        e->err = -EINVAL;
        return;
    }
    puts_(e, name);
    if (suffix) puts_(e, suffix);
    put_labels(e, labels, le);
    puts_(e, " ");
}

void elastic_expo_sample(elastic_expo *e, const char *name, const char *const *labels,
                         double value)
{
    sample_head(e, name, NULL, labels, NULL);
    put_double(e, value);
    puts_(e, "\n");
}

void elastic_expo_sample_u64(elastic_expo *e, const char *name, const char *const *labels,
                             uint64_t value)
{
    sample_head(e, name, NULL, labels, NULL);
    putf(e, "%" PRIu64 "\n", value);
}

void elastic_expo_histogram(elastic_expo *e, const char *name, const char *const *labels,
                            const elastic_hist *h)
{
    uint64_t cum = 0;
    for (int b = 0; b <= ELASTIC_HIST_BUCKETS; b++) {
        char le[32];
        if (b < ELASTIC_HIST_BUCKETS) snprintf(le, sizeof le, "%g", elastic_hist_bounds[b]);
        else snprintf(le, sizeof le, "+Inf");
        cum += h->bucket[b];
        sample_head(e, name, "_bucket", labels, le);
        putf(e, "%" PRIu64 "\n", cum);
    }
    sample_head(e, name, "_sum", labels, NULL);
    put_double(e, h->sum);
    puts_(e, "\n");
    sample_head(e, name, "_count", labels, NULL);
    putf(e, "%" PRIu64 "\n", h->count);
}

int elastic_expo_finish(elastic_expo *e, char **text, size_t *len)
{
    int rc = e->err;
    if (rc == 0 && reserve(e, 0) < 0) rc = e->err;
    if (rc < 0) {
        free(e->buf);
    } else {
        e->buf[e->len] = '\0';
        *text = e->buf;
        if (len) *len = e->len;
    }
    *e = (elastic_expo)ELASTIC_EXPO_INIT;
    return rc;
}
