#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static atomic_int g_level = -1; /* -1: not read from the environment yet */
static atomic_int g_rank = -1;

static int level_from_env(void)
{
    const char *s = getenv("CKPT_LOG_LEVEL");
    if (!s || !*s) return LOG_INFO;
    if (!strcasecmp(s, "error")) return LOG_ERROR;
    if (!strcasecmp(s, "warn")) return LOG_WARN;
    if (!strcasecmp(s, "debug")) return LOG_DEBUG;
    if (strcasecmp(s, "info") != 0) {
        char msg[160];
        int n = snprintf(msg, sizeof msg, "warning: CKPT_LOG_LEVEL=\"%.60s\" is not error, warn, info "
                         "or debug; using info\n", s);
        ssize_t w = write(STDERR_FILENO, msg, n > 0 ? (size_t)n : 0);
        (void)w;
    }
    return LOG_INFO;
}

void log_set_level(enum log_level level) { atomic_store(&g_level, (int)level); }
void log_set_rank(int rank) { atomic_store(&g_rank, rank); }

int log_enabled(enum log_level level)
{
    int cur = atomic_load(&g_level);
    if (cur < 0) {
        cur = level_from_env();
        atomic_store(&g_level, cur);
    }
    return (int)level <= cur;
}

/* Length of the valid UTF-8 sequence of a printable character at s (at most n bytes), or 0:
 * ASCII controls, DEL, C1 controls (U+0080..U+009F, which some terminals obey like ESC),
 * overlong forms, surrogates and cut or invalid sequences are not printable. */
static size_t printable_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c >= 0x20 && c < 0x7f) return 1;
    size_t k;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) k = 2;
    else if (c >= 0xe0 && c <= 0xef) k = 3;
    else if (c >= 0xf0 && c <= 0xf4) k = 4;
    else return 0;
    if (c == 0xc2) lo = 0xa0;          /* C1 controls */
    else if (c == 0xe0) lo = 0xa0;     /* overlong */
    else if (c == 0xed) hi = 0x9f;     /* surrogates */
    else if (c == 0xf0) lo = 0x90;     /* overlong */
    else if (c == 0xf4) hi = 0x8f;     /* past U+10FFFF */
    if (n < k || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if (s[i] < 0x80 || s[i] > 0xbf) return 0;
    return k;
}

size_t log_printable(char *dst, size_t dst_len, const char *src, size_t n)
{
    if (!dst || !dst_len) return 0;
    const unsigned char *s = (const unsigned char *)src;
    size_t out = 0;
    for (size_t i = 0; src && i < n;) {
        size_t k = printable_len(s + i, n - i);
        if (k) {
            if (out + k >= dst_len) break;
            memcpy(dst + out, s + i, k);
            out += k;
            i += k;
        } else {
            if (out + 4 >= dst_len) break;
            snprintf(dst + out, 5, "\\x%02x", s[i]);
            out += 4;
            i++;
        }
    }
    dst[out] = '\0';
    return out;
}

void log_msg(enum log_level level, const char *tag, const char *fmt, ...)
{
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    if (!log_enabled(level)) return;
    char line[12288], text[9216]; /* two paths of CKPT_PATH_MAX and the text around them */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = (int)strftime(line, sizeof line, "%H:%M:%S", &tm);
    int rank = atomic_load(&g_rank);
    if (rank >= 0)
        n += snprintf(line + n, sizeof line - (size_t)n, ".%03ld %-5s [%s] rank %d: ",
                      ts.tv_nsec / 1000000, names[level], tag, rank);
    else
        n += snprintf(line + n, sizeof line - (size_t)n, ".%03ld %-5s [%s] ",
                      ts.tv_nsec / 1000000, names[level], tag);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (m < 0) m = 0;
    if (m > (int)sizeof text - 1) m = (int)sizeof text - 1;
    /* file and tensor names come from outside: no escape sequence reaches a terminal */
    n += (int)log_printable(line + n, sizeof line - (size_t)n - 1, text, (size_t)m);
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}

void log_why(char *why, size_t why_len, const char *fmt, ...)
{
    if (!why || !why_len) return;
    char text[8192];
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (m < 0) m = 0;
    if (m > (int)sizeof text - 1) m = (int)sizeof text - 1;
    log_printable(why, why_len, text, (size_t)m);
}
