#include "progress.h"

#include "clock.h"
#include "log.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

void progress_begin(progress *p, const char *what, uint64_t total_bytes, int quiet, int log_lines)
{
    memset(p, 0, sizeof *p);
    snprintf(p->what, sizeof p->what, "%s", what ? what : "");
    p->total = total_bytes;
    p->start = p->last = clock_now_s();
    p->tty = isatty(STDERR_FILENO) && !log_lines;
    p->log = log_lines;
    p->quiet = quiet;
}

/* "1.23 GiB" style */
static void human(double b, char *out, size_t len)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4) {
        b /= 1024;
        i++;
    }
    snprintf(out, len, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

void progress_update(progress *p, uint64_t done_bytes)
{
    if (p->quiet) return;
    double now = clock_now_s(), el = now - p->start;
    if (el < PROGRESS_DELAY_S) return;
    if (p->drawn && now - p->last < (p->tty ? PROGRESS_TTY_PERIOD_S : PROGRESS_LOG_PERIOD_S))
        return;
    p->last = now;
    double rate = el > 0 ? (double)done_bytes / el : 0;
    char done[32], tot[32], r[32], left[48] = "";
    human((double)done_bytes, done, sizeof done);
    human((double)p->total, tot, sizeof tot);
    human(rate, r, sizeof r);
    double pct = p->total ? 100.0 * (double)done_bytes / (double)p->total : 0;
    if (p->total && rate > 0 && done_bytes < p->total)
        snprintf(left, sizeof left, ", %.0f s left", (double)(p->total - done_bytes) / rate);
    if (p->tty) {
        fprintf(stderr, "\r\033[K%s: %.1f%% (%s of %s, %s/s%s)", p->what, pct, done, tot, r, left);
        fflush(stderr);
        p->drawn = 1;
    } else if (p->log) {
        LOG_I("progress", "%s: %.1f%% (%s of %s, %s/s%s)", p->what, pct, done, tot, r, left);
        p->drawn = 1;
    } else {
        fprintf(stderr, "%s: %.1f%% (%s of %s, %s/s%s)\n", p->what, pct, done, tot, r, left);
        p->drawn = 1;
    }
}

void progress_end(progress *p)
{
    if (p->tty && p->drawn && !p->quiet) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
    p->drawn = 0;
}
