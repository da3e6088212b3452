#include "ckpt.h"
#include "ckpt_internal.h"
#include "clock.h"

#include "log.h"
#include "storage.h"

#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void ckpt_shuffle(uint8_t *dst, const uint8_t *src, size_t n, uint32_t elem_bytes)
{
    if (elem_bytes <= 1) {
        memcpy(dst, src, n);
        return;
    }
    size_t count = n / elem_bytes;
    if (elem_bytes == 4) { /* f32: one pass that the compiler vectorizes (about 10x the
                              generic loop, which strides through the source 4 times) */
        uint8_t *p0 = dst, *p1 = dst + count, *p2 = dst + 2 * count, *p3 = dst + 3 * count;
        for (size_t i = 0; i < count; i++) {
            p0[i] = src[4 * i];
            p1[i] = src[4 * i + 1];
            p2[i] = src[4 * i + 2];
            p3[i] = src[4 * i + 3];
        }
    } else if (elem_bytes == 2) {
        uint8_t *p0 = dst, *p1 = dst + count;
        for (size_t i = 0; i < count; i++) {
            p0[i] = src[2 * i];
            p1[i] = src[2 * i + 1];
        }
    } else for (uint32_t k = 0; k < elem_bytes; k++) {
        uint8_t *plane = dst + (size_t)k * count;
        const uint8_t *s = src + k;
        for (size_t i = 0; i < count; i++) plane[i] = s[i * elem_bytes];
    }
    memcpy(dst + count * elem_bytes, src + count * elem_bytes, n - count * elem_bytes);
}

void ckpt_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, uint32_t elem_bytes)
{
    if (elem_bytes <= 1) {
        memcpy(dst, src, n);
        return;
    }
    size_t count = n / elem_bytes;
    if (elem_bytes == 4) { /* as in ckpt_shuffle */
        const uint8_t *p0 = src, *p1 = src + count, *p2 = src + 2 * count, *p3 = src + 3 * count;
        for (size_t i = 0; i < count; i++) {
            dst[4 * i] = p0[i];
            dst[4 * i + 1] = p1[i];
            dst[4 * i + 2] = p2[i];
            dst[4 * i + 3] = p3[i];
        }
    } else if (elem_bytes == 2) {
        const uint8_t *p0 = src, *p1 = src + count;
        for (size_t i = 0; i < count; i++) {
            dst[2 * i] = p0[i];
            dst[2 * i + 1] = p1[i];
        }
    } else for (uint32_t k = 0; k < elem_bytes; k++) {
        const uint8_t *plane = src + (size_t)k * count;
        uint8_t *d = dst + k;
        for (size_t i = 0; i < count; i++) d[i * elem_bytes] = plane[i];
    }
    memcpy(dst + count * elem_bytes, src + count * elem_bytes, n - count * elem_bytes);
}

void ckpt_hex64(uint64_t v, char out[17])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 15; i >= 0; i--) {
        out[i] = digits[v & 15u];
        v >>= 4;
    }
    out[16] = '\0';
}

int ckpt_parse_hex64(const char *s, uint64_t *v)
{
    uint64_t x = 0;
    if (!s) return -EBADMSG;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        unsigned d;
        if (c >= '0' && c <= '9') d = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') d = (unsigned)(c - 'a' + 10);
        else return -EBADMSG;
        x = (x << 4) | d;
    }
    if (s[16] != '\0') return -EBADMSG;
    *v = x;
    return 0;
}

int ckpt_valid_name(const char *s)
{
    if (!s) return 0;
    size_t n = strlen(s);
    if (n == 0 || n > 63) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '_' || c == '.' || c == '-';
        if (!ok) return 0;
    }
    return 1;
}

static int parse_digits(const char *s, uint64_t *step, const char **end)
{
    uint64_t v = 0;
    const char *p = s;
    while (*p >= '0' && *p <= '9') {
        if (v > (UINT64_MAX - 9) / 10) return -1;
        v = v * 10 + (uint64_t)(*p - '0');
        p++;
    }
    if (p - s < 9) return -1;
    *step = v;
    *end = p;
    return 0;
}

int ckpt_parse_step_dirname(const char *name, uint64_t *step)
{
    const char *end;
    if (strncmp(name, "step-", 5) != 0) return -1;
    if (parse_digits(name + 5, step, &end) != 0 || *end != '\0') return -1;
    /* only the canonical spelling: step-0000000020 is not a second name for step 20 */
    char canon[40];
    ckpt_step_dirname(*step, canon, sizeof canon);
    return strcmp(canon, name) == 0 ? 0 : -1;
}

int ckpt_parse_aside_dirname(const char *name, uint64_t *step)
{
    const char *end;
    if (strncmp(name, "step-", 5) != 0) return -1;
    if (parse_digits(name + 5, step, &end) != 0 || strncmp(end, ".corrupt-", 9) != 0) return -1;
    return 0;
}

int ckpt_parse_temp_dirname(const char *name, uint64_t *step)
{
    const char *end;
    if (strncmp(name, ".tmp-step-", 10) != 0) return -1;
    if (parse_digits(name + 10, step, &end) != 0 || *end != '-') return -1;
    return 0;
}

void ckpt_folder_name(const char *path, char *out, size_t len)
{
    size_t n = strlen(path);
    for (;;) {
        while (n > 1 && path[n - 1] == '/') n--;
        if (n >= 2 && path[n - 1] == '.' && path[n - 2] == '/') n -= 2;
        else if (n == 1 && path[0] == '.') n = 0;
        else break;
    }
    size_t start = n;
    while (start > 0 && path[start - 1] != '/') start--;
    size_t k = n - start;
    if (k == 0 || (k == 2 && path[start] == '.' && path[start + 1] == '.')) {
        char *real = realpath(path[0] ? path : ".", NULL);
        const char *b = real ? strrchr(real, '/') : NULL;
        snprintf(out, len, "%s", b ? b + 1 : "");
        free(real);
        return;
    }
    snprintf(out, len, "%.*s", (int)k, path + start);
}

int ckpt_within_snapshot_folder(const char *dir)
{
    char p[CKPT_PATH_MAX];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return 0;
    if (ckpt_is_snapshot_folder(p)) return 1;
    for (;;) {
        /* above it, the names only: a folder with some other manifest.json (a web project)
         * may well hold a folder of snapshots */
        char name[256];
        uint64_t step;
        ckpt_folder_name(p, name, sizeof name);
        if (ckpt_parse_step_dirname(name, &step) == 0 || ckpt_parse_temp_dirname(name, &step) == 0 ||
            ckpt_parse_aside_dirname(name, &step) == 0)
            return 1;
        size_t n = strlen(p);
        while (n > 1 && p[n - 1] == '/') n--; /* the parent: drop the last component */
        while (n > 0 && p[n - 1] != '/') n--;
        while (n > 1 && p[n - 1] == '/') n--;
        if (n == 0 || (n == 1 && p[0] == '/' && strlen(p) == 1)) return 0;
        p[n] = '\0';
    }
}

int ckpt_is_snapshot_folder(const char *dir)
{
    char name[256], m[CKPT_PATH_MAX + 32];
    uint64_t step;
    struct stat st;
    ckpt_folder_name(dir, name, sizeof name);
    snprintf(m, sizeof m, "%s/%s", dir, CKPT_MANIFEST_NAME);
    return lstat(m, &st) == 0 || ckpt_parse_step_dirname(name, &step) == 0 ||
           ckpt_parse_temp_dirname(name, &step) == 0 || ckpt_parse_aside_dirname(name, &step) == 0;
}

void ckpt_rank_filename(uint32_t rank, char *buf, size_t len)
{
    snprintf(buf, len, "rank-%05u.bin", rank);
}

void ckpt_step_dirname(uint64_t step, char *buf, size_t len)
{
    snprintf(buf, len, "step-%09llu", (unsigned long long)step);
}

const char *ckpt_status_name(int status)
{
    switch (status) {
    case CKPT_STATUS_COMMITTED: return "committed";
    case CKPT_STATUS_CORRUPT: return "corrupt";
    case CKPT_STATUS_NEWER: return "newer-format";
    case CKPT_STATUS_INCOMPLETE: return "incomplete";
    case CKPT_STATUS_SET_ASIDE: return "set-aside";
    case CKPT_STATUS_UNREADABLE: return "unreadable";
    default: return "unknown";
    }
}

int ckpt_path_join(char *out, size_t len, const char *dir, const char *name)
{
    int n = snprintf(out, len, "%s/%s", dir, name);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/* CKPT_FAULT_POINT="<name>[@<step>][:stop]": read once; matching points kill the process
 * (SIGKILL), or with ":stop" stop it (SIGSTOP) until a driver sends SIGCONT. */
void ckpt_fault_point(const char *name, uint64_t step)
{
    static int loaded;
    static char want[64];
    static long long want_step = -1;
    static int want_stop;
    if (store_fault_armed(name)) { /* CKPT_FAULT_DIR/<name> (storage.h) */
        LOG_W("ckpt", "fault point %s reached at step %llu: killing this process (armed in "
              "CKPT_FAULT_DIR)", name, (unsigned long long)step);
        raise(SIGKILL);
    }
    if (!__atomic_load_n(&loaded, __ATOMIC_ACQUIRE)) {
        const char *s = getenv("CKPT_FAULT_POINT");
        if (s && *s) {
            snprintf(want, sizeof want, "%s", s);
            char *colon = strchr(want, ':');
            if (colon) {
                want_stop = strcmp(colon + 1, "stop") == 0;
                if (!want_stop) /* an unknown action: the point never fires */
                    LOG_W("ckpt", "ignoring CKPT_FAULT_POINT=\"%s\": unknown action (want "
                          "<point>[@<step>][:stop])", s);
                *colon = '\0';
                if (!want_stop) want[0] = '\0';
            }
            char *at = strchr(want, '@');
            if (at) {
                *at = '\0';
                want_step = strtoll(at + 1, NULL, 10);
            }
        }
        __atomic_store_n(&loaded, 1, __ATOMIC_RELEASE);
    }
    if (!want[0] || strcmp(want, name) != 0) return;
    if (want_step >= 0 && (uint64_t)want_step != step) return;
    if (want_stop) {
        /* One-shot: a driver that sends SIGCONT wants the run to go on past this point. */
        static int stopped;
        if (__atomic_exchange_n(&stopped, 1, __ATOMIC_ACQ_REL)) return;
        LOG_W("ckpt", "fault point %s reached at step %llu: stopping this process (SIGSTOP; "
              "CKPT_FAULT_POINT)", name, (unsigned long long)step);
        raise(SIGSTOP);
        return;
    }
    LOG_W("ckpt", "fault point %s reached at step %llu: killing this process (CKPT_FAULT_POINT)",
          name, (unsigned long long)step);
    raise(SIGKILL);
}

void ckpt_deadline(struct timespec *ts, double seconds)
{
    clock_deadline_in(CLOCK_REALTIME, ts, seconds);
}
