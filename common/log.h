/* log.h - one leveled logger for every module: "<time> <LEVEL> [<tag>] rank <r>: message".
 *
 * Lines go to stderr, written with one write(2) each so that lines of concurrent threads and
 * processes do not interleave. The level comes from CKPT_LOG_LEVEL (error, warn, info,
 * debug; default info) on first use, or from log_set_level(). The rank prefix is set once by
 * the program (log_set_rank; -1 = no rank, the default).
 *
 * Thread-safety: log_msg may be called from any thread; the setters are for start-up.
 * Secrets never reach the logger: callers pass no keys or tokens (DESIGN I6).
 */
#ifndef COMMON_LOG_H
#define COMMON_LOG_H

#include <stddef.h>

enum log_level { LOG_ERROR = 0, LOG_WARN = 1, LOG_INFO = 2, LOG_DEBUG = 3 };

/* Set the threshold: messages above it are dropped. */
void log_set_level(enum log_level level);

/* Set the rank shown in every line; -1 shows none. */
void log_set_rank(int rank);

/* Non-zero when a message at `level` would be printed. */
int log_enabled(enum log_level level);

/* printf-style message with a subsystem tag ("ckpt", "train", "store", ...). A trailing
 * newline is added. Lines longer than 2 KiB are cut. The message is made printable
 * (log_printable), so names from outside never put escape sequences on a terminal. */
void log_msg(enum log_level level, const char *tag, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* printf-style one-line reason into a caller's buffer (the `why` out-parameters of the
 * library: the caller decides whether and how to print it). Made printable as
 * log_printable does, truncated to why_len - 1 bytes and NUL-terminated; does nothing when
 * why is NULL or why_len is 0. Thread-safe. */
void log_why(char *why, size_t why_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Copy n bytes of src into dst (dst_len bytes with the NUL) as printable, valid UTF-8 text:
 * printable ASCII and valid UTF-8 sequences of printable characters are kept; every other
 * byte - control characters (newline and ESC included), DEL, C1 controls U+0080..U+009F,
 * invalid or cut UTF-8 - becomes the four characters \xNN. The output is cut at a whole
 * character when it does not fit. Returns its length in bytes (0 when dst_len is 0).
 * Thread-safe. Used for log lines, reasons, and names that programs print or put in JSON. */
size_t log_printable(char *dst, size_t dst_len, const char *src, size_t n);

#define LOG_E(tag, ...) log_msg(LOG_ERROR, tag, __VA_ARGS__)
#define LOG_W(tag, ...) log_msg(LOG_WARN, tag, __VA_ARGS__)
#define LOG_I(tag, ...) log_msg(LOG_INFO, tag, __VA_ARGS__)
#define LOG_D(tag, ...) log_msg(LOG_DEBUG, tag, __VA_ARGS__)

#endif /* COMMON_LOG_H */
