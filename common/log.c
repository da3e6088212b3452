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

void log_msg(enum log_level level, const char *tag, const char *fmt, ...)
{
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    if (!log_enabled(level)) return;
    char line[2048];
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
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0) m = 0;
    n += m;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}

void log_why(char *why, size_t why_len, const char *fmt, ...)
{
    if (!why || !why_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, why_len, fmt, ap);
    va_end(ap);
}
