/* t_helpers.h - shared helpers for the C test programs (exit 0 pass, 1 fail, 77 skip).
 *
 * T_CHECK(cond, fmt, ...) records a failure with file:line and the message and goes on;
 * T_REQUIRE stops the test at once. t_done() returns the exit status to use from main.
 */
#ifndef T_HELPERS_H
#define T_HELPERS_H

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int t_failures;
static int t_checks;

#define T_CHECK(cond, ...)                                                                     \
    do {                                                                                       \
        t_checks++;                                                                            \
        if (!(cond)) {                                                                         \
            t_failures++;                                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                    \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
        }                                                                                      \
    } while (0)

/* Evaluates cond once (it may have side effects). */
#define T_REQUIRE(cond, ...)                                                                   \
    do {                                                                                       \
        int t_ok_ = !!(cond);                                                                  \
        t_checks++;                                                                            \
        if (!t_ok_) {                                                                          \
            t_failures++;                                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                    \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

/* |a-b| <= atol + rtol*|ref|, as llm.c compares kernels. */
static inline int t_close(double a, double ref, double atol, double rtol)
{
    return fabs(a - ref) <= atol + rtol * fabs(ref);
}

/* A fresh temporary folder under $TMPDIR (or /tmp); the caller removes it. */
static inline char *t_tmpdir(const char *tag)
{
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    char *p = malloc(4096);
    if (!p) exit(1);
    snprintf(p, 4096, "%s/t-%s-XXXXXX", base, tag);
    if (!mkdtemp(p)) {
        fprintf(stderr, "mkdtemp %s: %s\n", p, strerror(errno));
        exit(1);
    }
    return p;
}

static inline void t_rmrf(const char *path)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", path);
}

/* dir + "/" + name in malloc'ed memory (the caller frees). */
static inline char *t_path_in(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (!p) exit(1);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* A whole file into malloc'ed memory with a trailing NUL (*out; the caller frees); its size,
 * or -1. */
static inline long long t_slurp(const char *path, unsigned char **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return -1;
    }
    long n = ftell(f);
    rewind(f);
    unsigned char *b = n >= 0 ? malloc((size_t)n + 1) : NULL;
    size_t got = b ? fread(b, 1, (size_t)n, f) : 0;
    fclose(f);
    if (!b || got != (size_t)n) {
        free(b);
        return -1;
    }
    b[got] = 0;
    *out = b;
    return n;
}

/* 1 when both files can be read and hold the same bytes, else 0. */
static inline int t_file_equal(const char *a, const char *b)
{
    unsigned char *x, *y;
    long long na = t_slurp(a, &x), nb = t_slurp(b, &y);
    int eq = na >= 0 && na == nb && memcmp(x, y, (size_t)na) == 0;
    free(x);
    free(y);
    return eq;
}

/* Write len bytes to path (created or truncated): 0 or -1. */
static inline int t_spit(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t put = len ? fwrite(data, 1, len, f) : 0;
    int rc = fclose(f);
    return put == len && rc == 0 ? 0 : -1;
}

static inline int t_exists(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL || errno == EACCES || errno == EISDIR;
}

/* Monotonic clock in seconds, and a sleep of s seconds (for timing assertions in tests). */
static inline double t_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void t_sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static inline int t_done(const char *name)
{
    if (t_failures) {
        fprintf(stderr, "%s: %d of %d checks failed\n", name, t_failures, t_checks);
        return 1;
    }
    printf("%s: all %d checks passed\n", name, t_checks);
    return 0;
}

#endif /* T_HELPERS_H */
