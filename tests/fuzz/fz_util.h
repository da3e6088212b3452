/* fz_util.h - helpers shared by the libFuzzer harnesses of tests/fuzz/.
 *
 * A harness reports a finding by aborting (FZ_ASSERT), which libFuzzer records as a crash
 * with the input that caused it; it never exits on its own. Every harness works in a private
 * folder under $TMPDIR (mkdtemp, so parallel fuzzing processes never share one) that is
 * removed at a normal exit; a crash leaves it behind, which is why scripts/fuzz and
 * fuzz_replay.sh point TMPDIR into a folder they remove themselves.
 */
#ifndef FZ_UTIL_H
#define FZ_UTIL_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A property the code under test promised and broke: print why, then abort so that libFuzzer
 * keeps the input as crash-<sha1>. */
#define FZ_ASSERT(cond, ...)                                                                   \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "FUZZ FINDING %s:%d: %s: ", __FILE__, __LINE__, #cond);            \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

/* The harness's own set-up failed (not a finding about the code under test). */
#define FZ_SETUP(cond, what)                                                                   \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "fuzz harness set-up failed: %s: %s\n", what, strerror(errno));    \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

/* Little-endian readers over the fuzzer's bytes: a cursor that yields zeros past the end, so
 * that every input, however short, means something. */
typedef struct fz_in {
    const uint8_t *p;
    size_t left;
} fz_in;

static inline uint8_t fz_u8(fz_in *in)
{
    if (!in->left) return 0;
    in->left--;
    return *in->p++;
}

static inline uint16_t fz_u16(fz_in *in)
{
    uint16_t lo = fz_u8(in);
    return (uint16_t)(lo | (uint16_t)fz_u8(in) << 8);
}

static inline uint32_t fz_u32(fz_in *in)
{
    uint32_t lo = fz_u16(in);
    return lo | (uint32_t)fz_u16(in) << 16;
}

static inline void fz_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Write len bytes to path, replacing it: 0 or -errno. */
static inline int fz_write_file(const char *path, const void *data, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -errno;
    const uint8_t *p = data;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            int err = n < 0 ? -errno : -EIO;
            close(fd);
            return err;
        }
        p += n;
        len -= (size_t)n;
    }
    return close(fd) == 0 ? 0 : -errno;
}

/* A fresh private folder $TMPDIR/<tag>-XXXXXX into out (at least 4096 bytes). */
static inline void fz_mkdtemp(char *out, size_t len, const char *tag)
{
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    snprintf(out, len, "%s/%s-XXXXXX", base, tag);
    FZ_SETUP(mkdtemp(out) != NULL, out);
}

static inline int fz_rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

/* rm -rf path without a shell (nftw, depth first, symbolic links not followed; nftw needs
 * _GNU_SOURCE or _XOPEN_SOURCE, which meson.build defines for every file). */
static inline void fz_rmrf(const char *path)
{
    nftw(path, fz_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

#endif /* FZ_UTIL_H */
