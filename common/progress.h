/* progress.h - progress of long work (verify, export, restore) on stderr, for people.
 *
 * Quiet for the first PROGRESS_DELAY_S seconds, so that quick work prints nothing. Then, on a
 * terminal, one line redrawn in place every PROGRESS_TTY_PERIOD_S: what, percent, bytes done
 * of total, rate, time left; the line is erased at the end. When stderr is not a terminal
 * (a log file, a launcher's pipe), or the caller asks for log lines (a program whose stderr is
 * a log, like train), a plain line every PROGRESS_LOG_PERIOD_S instead (through log.h at INFO
 * when log_lines), and none at the end (the caller reports its result).
 *
 * Thread-safety: a progress object is used by one thread; it writes to stderr only.
 */
#ifndef COMMON_PROGRESS_H
#define COMMON_PROGRESS_H

#include <stdint.h>

#define PROGRESS_DELAY_S 2.0       /* nothing before, seconds */
#define PROGRESS_TTY_PERIOD_S 0.25 /* redraw period on a terminal, seconds */
#define PROGRESS_LOG_PERIOD_S 10.0 /* period of log lines otherwise, seconds */

typedef struct progress {
    char what[64];     /* "verify", "export", "restore", ... */
    uint64_t total;    /* bytes in all; 0 = unknown (no percent, no time left) */
    double start;      /* monotonic seconds */
    double last;       /* when the last report was written */
    int tty;           /* stderr is a terminal */
    int quiet;         /* report nothing */
    int drawn;         /* a report was written (on a terminal: a line is on screen) */
    int log;           /* lines through the logger (INFO) rather than plain stderr lines */
} progress;

/* Start: `what` (copied, at most 63 bytes), the total bytes, quiet (non-zero: nothing),
 * log_lines (non-zero: log lines, never a redrawn line). */
void progress_begin(progress *p, const char *what, uint64_t total_bytes, int quiet, int log_lines);

/* done_bytes so far (monotone); reports when a period has passed. Cheap: call it often. */
void progress_update(progress *p, uint64_t done_bytes);

/* The end: erases the terminal line, if any. */
void progress_end(progress *p);

#endif /* COMMON_PROGRESS_H */
