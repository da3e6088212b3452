/* store_fsutil.c - small whole-file helpers and durable directory operations. */
#include "storage.h"

#include "log.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TAG "store"

/* Deeper trees than this are refused by store_remove_tree (one open fd per level). */
#define REMOVE_MAX_DEPTH 128

int store_open_regular(const char *path, unsigned flags, int oflags, struct stat *st_out)
{
    if (!path || (flags & ~STORE_NOFOLLOW) || (oflags & ~O_DIRECT) != 0) return -EINVAL;
    /* O_NONBLOCK so that opening a FIFO returns at once instead of waiting for a writer
     * (a regular file ignores it; it is cleared below all the same) */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | oflags |
                            ((flags & STORE_NOFOLLOW) ? O_NOFOLLOW : 0));
    if (fd < 0) return -errno;
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0) rc = -errno;
    else if (S_ISDIR(st.st_mode)) rc = -EISDIR;
    else if (!S_ISREG(st.st_mode)) rc = -ENODEV;
    else {
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) rc = -errno;
    }
    if (rc < 0) {
        close(fd);
        return rc;
    }
    if (st_out) *st_out = st;
    return fd;
}

int store_read_file(const char *path, size_t max_bytes, unsigned flags, char **buf_out,
                    size_t *len_out)
{
    if (!path || !buf_out) return -EINVAL;
    *buf_out = NULL;
    if (len_out) *len_out = 0;
    int rc = 0;
    char *buf = NULL;
    struct stat st;
    int fd = store_open_regular(path, flags, 0, &st);
    if (fd < 0) {
        rc = fd;
        /* a missing file or one of the wrong type is the caller's verdict to give */
        if (rc != -ENOENT && rc != -ELOOP && rc != -EISDIR && rc != -ENODEV && rc != -ENOTDIR)
            LOG_E(TAG, "open %s: %s", path, strerror(-rc));
        else
            LOG_D(TAG, "open %s: %s", path, strerror(-rc));
        return rc;
    }
    if ((uint64_t)st.st_size > max_bytes) {
        rc = -EFBIG;
        goto out;
    }
    /* Read up to max_bytes + 1 so that a file that grew since fstat is still caught. */
    size_t cap = (size_t)st.st_size + 1, len = 0;
    buf = malloc(cap + 1);
    if (!buf) {
        rc = -ENOMEM;
        goto out;
    }
    for (;;) {
        if (len == cap) {
            if (len > max_bytes) {
                rc = -EFBIG;
                goto out;
            }
            size_t ncap = cap * 2 > max_bytes + 1 ? max_bytes + 1 : cap * 2;
            char *nb = realloc(buf, ncap + 1);
            if (!nb) {
                rc = -ENOMEM;
                goto out;
            }
            buf = nb;
            cap = ncap;
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = -errno;
            LOG_E(TAG, "read %s: %s", path, strerror(errno));
            goto out;
        }
        if (n == 0) break;
        len += (size_t)n;
    }
    if (len > max_bytes) {
        rc = -EFBIG;
        goto out;
    }
    buf[len] = '\0';
    *buf_out = buf;
    buf = NULL;
    if (len_out) *len_out = len;
out:
    free(buf);
    close(fd);
    return rc;
}

int store_canonical_path(const char *path, char *out, size_t len)
{
    char abs[2 * 4096];
    if (!path || !*path) return -EINVAL;
    if (path[0] == '/') {
        if (snprintf(abs, sizeof abs, "%s", path) >= (int)sizeof abs) return -ENAMETOOLONG;
    } else {
        char cwd[4096];
        if (!getcwd(cwd, sizeof cwd)) return -errno;
        if (snprintf(abs, sizeof abs, "%s/%s", cwd, path) >= (int)sizeof abs) return -ENAMETOOLONG;
    }
    /* the longest prefix that exists, resolved; cut at a '/' each time it does not */
    size_t n = strlen(abs);
    char real[PATH_MAX];
    for (;;) {
        char save = abs[n];
        abs[n] = '\0';
        char *r = realpath(n ? abs : "/", real);
        abs[n] = save;
        if (r) break;
        if (errno != ENOENT && errno != ENOTDIR) return -errno;
        while (n > 0 && abs[n - 1] != '/') n--; /* drop the last component */
        while (n > 1 && abs[n - 1] == '/') n--;
        if (n <= 1) {
            snprintf(real, sizeof real, "/");
            n = 0;
            break;
        }
    }
    /* the rest, component by component: "." dropped, ".." takes one back */
    size_t o = (size_t)snprintf(out, len, "%s", real);
    if (o >= len) return -ENAMETOOLONG;
    const char *p = abs + n;
    while (*p) {
        while (*p == '/') p++;
        const char *e = p;
        while (*e && *e != '/') e++;
        size_t k = (size_t)(e - p);
        if (k == 0) break;
        if (k == 1 && p[0] == '.') {
        } else if (k == 2 && p[0] == '.' && p[1] == '.') {
            while (o > 1 && out[o - 1] != '/') o--;
            if (o > 1) o--;
            out[o] = '\0';
        } else {
            if (o + (o > 1) + k + 1 > len) return -ENAMETOOLONG;
            if (o > 1) out[o++] = '/';
            memcpy(out + o, p, k);
            o += k;
            out[o] = '\0';
        }
        p = e;
    }
    return 0;
}

int store_write_file_durable(const char *path, const void *buf, size_t len)
{
    if (!path || (len && !buf)) return -EINVAL;
    int rc = 0;
    int fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = -errno;
        if (rc != -EEXIST) LOG_E(TAG, "create %s: %s", path, strerror(errno));
        return rc;
    }
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = -errno;
            LOG_E(TAG, "write %s: %s", path, strerror(errno));
            goto out;
        }
        if (n == 0) { /* not expected from a regular file; avoid spinning */
            rc = -EIO;
            LOG_E(TAG, "write %s: no progress", path);
            goto out;
        }
        p += n;
        len -= (size_t)n;
    }
    if (fsync(fd)) {
        rc = -errno;
        LOG_E(TAG, "fsync %s: %s", path, strerror(errno));
    }
out:
    if (close(fd) && !rc) {
        rc = -errno;
        LOG_E(TAG, "close %s: %s", path, strerror(errno));
    }
    if (rc) unlink(path);
    return rc;
}

int store_rename_noreplace(const char *from, const char *to)
{
    if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0) return 0;
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) return -errno;
    struct stat st;
    if (lstat(to, &st) == 0) return -EEXIST;
    return rename(from, to) ? -errno : 0;
}

int store_fsync_dir(const char *path)
{
    if (!path) return -EINVAL;
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        int rc = -errno;
        LOG_E(TAG, "open directory %s: %s", path, strerror(errno));
        return rc;
    }
    int rc = 0;
    if (fsync(fd)) {
        rc = -errno;
        LOG_E(TAG, "fsync directory %s: %s", path, strerror(errno));
    }
    close(fd);
    return rc;
}

/* The folder holding `path` ("." when it has no slash), as a malloc'ed string. */
static char *parent_of(const char *path)
{
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "a/b/" names b */
    while (n > 0 && path[n - 1] != '/') n--;
    if (n == 0) return strdup(".");
    while (n > 1 && path[n - 1] == '/') n--;
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, path, n);
    p[n] = '\0';
    return p;
}

int store_rename_durable(const char *from, const char *to)
{
    if (!from || !to) return -EINVAL;
    if (rename(from, to)) {
        int rc = -errno;
        LOG_E(TAG, "rename %s -> %s: %s", from, to, strerror(errno));
        return rc;
    }
    char *pto = parent_of(to), *pfrom = parent_of(from);
    int rc = (pto && pfrom) ? 0 : -ENOMEM;
    if (!rc) rc = store_fsync_dir(pto);
    if (!rc && strcmp(pto, pfrom) != 0) rc = store_fsync_dir(pfrom);
    free(pto);
    free(pfrom);
    return rc;
}

/* Remove `name` in folder fd `parent`, and what is below it when it is a folder; keeps the
 * first error. */
static int remove_at(int parent, const char *name, int depth)
{
    struct stat st;
    if (fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW)) {
        if (errno == ENOENT) return 0;
        int rc = -errno;
        LOG_E(TAG, "stat %s: %s", name, strerror(errno));
        return rc;
    }
    if (!S_ISDIR(st.st_mode)) {
        if (unlinkat(parent, name, 0) && errno != ENOENT) {
            int rc = -errno;
            LOG_E(TAG, "unlink %s: %s", name, strerror(errno));
            return rc;
        }
        return 0;
    }
    if (depth >= REMOVE_MAX_DEPTH) {
        LOG_E(TAG, "remove %s: deeper than %d levels", name, REMOVE_MAX_DEPTH);
        return -ELOOP;
    }
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int rc = -errno;
        if (rc == -ENOENT) return 0;
        LOG_E(TAG, "open directory %s: %s", name, strerror(errno));
        return rc;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        int rc = -errno;
        LOG_E(TAG, "fdopendir %s: %s", name, strerror(errno));
        close(fd);
        return rc;
    }
    int rc = 0;
    struct dirent *e;
    for (;;) {
        errno = 0;
        e = readdir(d);
        if (!e) {
            if (errno && !rc) {
                rc = -errno;
                LOG_E(TAG, "readdir %s: %s", name, strerror(errno));
            }
            break;
        }
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        int r2 = remove_at(dirfd(d), e->d_name, depth + 1);
        if (r2 && !rc) rc = r2;
    }
    closedir(d);
    if (!rc && unlinkat(parent, name, AT_REMOVEDIR) && errno != ENOENT) {
        rc = -errno;
        LOG_E(TAG, "rmdir %s: %s", name, strerror(errno));
    }
    return rc;
}

int store_remove_tree(const char *path)
{
    if (!path || !*path) return -EINVAL;
    return remove_at(AT_FDCWD, path, 0);
}
