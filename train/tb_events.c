/* tb_events.c - TensorBoard event files (see tb_events.h). */
#include "tb_events.h"

#include "log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdio_ext.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TAG "train"
#define NAME_PREFIX "events.out.tfevents."
#define STDIO_BUFFER (64u << 10)

/* ------------------------------------------------------------------ CRC-32C */

static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
        crc_table[i] = c;
    }
}

uint32_t train_tb_crc32c(uint32_t crc, const void *data, size_t len)
{
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < len; i++) crc = crc_table[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
    return ~crc;
}

uint32_t train_tb_masked_crc32c(const void *data, size_t len)
{
    uint32_t c = train_tb_crc32c(0, data, len);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* ------------------------------------------------------------------ protobuf wire format */

enum { WIRE_VARINT = 0, WIRE_I64 = 1, WIRE_LEN = 2, WIRE_I32 = 5 };

/* An output buffer that counts what did not fit instead of writing past its end. */
typedef struct wbuf {
    uint8_t *p;
    size_t cap, n;
} wbuf;

static void put_byte(wbuf *w, uint8_t b)
{
    if (w->n < w->cap) w->p[w->n] = b;
    w->n++;
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static void put_varint(wbuf *w, uint64_t v)
{
    while (v >= 0x80) {
        put_byte(w, (uint8_t)(v | 0x80));
        v >>= 7;
    }
    put_byte(w, (uint8_t)v);
}

static void put_key(wbuf *w, unsigned field, unsigned wire)
{
    put_varint(w, ((uint64_t)field << 3) | wire);
}

static void put_le(wbuf *w, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++) put_byte(w, (uint8_t)(v >> (8 * i)));
}

static void put_double(wbuf *w, unsigned field, double d)
{
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    put_key(w, field, WIRE_I64);
    put_le(w, bits, 8);
}

static void put_float(wbuf *w, unsigned field, float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    put_key(w, field, WIRE_I32);
    put_le(w, bits, 4);
}

/* The header of a length-delimited field; its len bytes follow. */
static void put_len(wbuf *w, unsigned field, size_t len)
{
    put_key(w, field, WIRE_LEN);
    put_varint(w, len);
}

/* Event fields 1 and 2 (step left out when 0, as proto3 serializers do). */
static void put_event_head(wbuf *w, double wall_time, int64_t step)
{
    put_double(w, 1, wall_time);
    if (step != 0) {
        put_key(w, 2, WIRE_VARINT);
        put_varint(w, (uint64_t)step);
    }
}

static int finish(const wbuf *w)
{
    return w->n <= w->cap ? (int)w->n : -ENOBUFS;
}

int train_tb_encode_file_version(uint8_t *buf, size_t cap, double wall_time)
{
    if (!buf || !isfinite(wall_time)) return -EINVAL;
    wbuf w = {buf, cap, 0};
    put_event_head(&w, wall_time, 0);
    size_t n = strlen(TRAIN_TB_FILE_VERSION);
    put_len(&w, 3, n);
    for (size_t i = 0; i < n; i++) put_byte(&w, (uint8_t)TRAIN_TB_FILE_VERSION[i]);
    return finish(&w);
}

int train_tb_encode_session_start(uint8_t *buf, size_t cap, int64_t step, double wall_time)
{
    if (!buf || step < 0 || !isfinite(wall_time)) return -EINVAL;
    wbuf w = {buf, cap, 0};
    put_event_head(&w, wall_time, step);
    put_len(&w, 7, 2);       /* SessionLog: */
    put_key(&w, 1, WIRE_VARINT); /*   status = */
    put_varint(&w, 1);       /*   START */
    return finish(&w);
}

int train_tb_encode_scalar(uint8_t *buf, size_t cap, const char *tag, int64_t step,
                           float value, double wall_time)
{
    if (!buf || !tag || step < 0 || !isfinite(wall_time)) return -EINVAL;
    size_t tn = strlen(tag);
    if (tn == 0 || tn > TRAIN_TB_TAG_MAX) return -EINVAL;
    /* Value{tag = 1, simple_value = 2}, inside Summary{value = 1} */
    size_t value_len = 1 + varint_len(tn) + tn + 1 + 4;
    size_t summary_len = 1 + varint_len(value_len) + value_len;
    wbuf w = {buf, cap, 0};
    put_event_head(&w, wall_time, step);
    put_len(&w, 5, summary_len);
    put_len(&w, 1, value_len);
    put_len(&w, 1, tn);
    for (size_t i = 0; i < tn; i++) put_byte(&w, (uint8_t)tag[i]);
    put_float(&w, 2, value);
    return finish(&w);
}

int train_tb_frame(uint8_t *out, size_t cap, const void *data, size_t len)
{
    if (!out || (!data && len > 0)) return -EINVAL;
    if (len > (size_t)INT_MAX - TRAIN_TB_FRAME_OVERHEAD || cap < len + TRAIN_TB_FRAME_OVERHEAD)
        return -ENOBUFS;
    wbuf w = {out, cap, 0};
    put_le(&w, (uint64_t)len, 8);
    put_le(&w, train_tb_masked_crc32c(out, 8), 4);
    if (len) memcpy(out + 12, data, len);
    w.n += len;
    put_le(&w, train_tb_masked_crc32c(data, len), 4);
    return (int)w.n;
}

/* ------------------------------------------------------------------ writer */

struct train_tb {
    FILE *f;
    char *path;
    int err; /* the first write error (negative errno), 0 while the writer writes */
};

double train_tb_wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Record the first write error (errno e) and log it once; returns the sticky error. */
static int fail(train_tb *tb, int e)
{
    if (!tb->err) {
        tb->err = -(e > 0 ? e : EIO);
        LOG_W(TAG, "tensorboard: %s: %s; no more events are written (training goes on)",
              tb->path, strerror(-tb->err));
    }
    return tb->err;
}

static int append(train_tb *tb, const uint8_t *ev, int len)
{
    uint8_t rec[TRAIN_TB_EVENT_MAX + TRAIN_TB_FRAME_OVERHEAD];
    int n = train_tb_frame(rec, sizeof rec, ev, (size_t)len);
    if (n < 0) return n;
    errno = 0;
    if (fwrite(rec, 1, (size_t)n, tb->f) != (size_t)n) return fail(tb, errno);
    return 0;
}

/* mkdir -p: every missing folder of path, in order. */
static int make_dirs(const char *path)
{
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n >= sizeof buf) return -ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0') continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) return -errno;
        buf[i] = c;
    }
    struct stat st;
    if (stat(path, &st) != 0) return -errno;
    return S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
}

/* The largest <seconds> of the event files in dir, -1 when there are none. */
static int newest_seconds(const char *dir, long long *out)
{
    *out = -1;
    DIR *d = opendir(dir);
    if (!d) return -errno;
    const size_t pl = strlen(NAME_PREFIX);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, NAME_PREFIX, pl) != 0) continue;
        const char *s = e->d_name + pl;
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno || end == s || (*end != '.' && *end != '\0') || v < 0) continue;
        if (v > *out) *out = v;
    }
    closedir(d);
    return 0;
}

static atomic_uint files_opened;

int train_tb_open(train_tb **out, const char *dir, double wall_time)
{
    if (!out || !dir || !*dir || !isfinite(wall_time)) return -EINVAL;
    int rc = make_dirs(dir);
    if (rc < 0) return rc;
    long long newest;
    if ((rc = newest_seconds(dir, &newest)) < 0) return rc;
    long long secs = wall_time > 0 ? (long long)wall_time : 0;
    if (newest >= secs) secs = newest + 1; /* sort after every file already there */

    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0 || !host[0]) snprintf(host, sizeof host, "localhost");
    for (char *p = host; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '.' || *p == '_' || *p == '-'))
            *p = '_';

    train_tb *tb = calloc(1, sizeof *tb);
    char *path = malloc(PATH_MAX);
    if (!tb || !path) {
        free(tb);
        free(path);
        return -ENOMEM;
    }
    tb->path = path;
    int fd = -1;
    for (int tries = 0; tries < 100 && fd < 0; tries++) {
        unsigned n = atomic_fetch_add(&files_opened, 1u);
        int len = snprintf(path, PATH_MAX, "%s/" NAME_PREFIX "%010lld.%s.%ld.%u", dir, secs, host,
                           (long)getpid(), n);
        if (len < 0 || len >= PATH_MAX) {
            rc = -ENAMETOOLONG;
            goto fail;
        }
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) {
            rc = -errno;
            goto fail;
        }
    }
    if (fd < 0) {
        rc = -EEXIST;
        goto fail;
    }
    tb->f = fdopen(fd, "wb");
    if (!tb->f) {
        rc = -errno;
        close(fd);
        unlink(path);
        goto fail;
    }
    setvbuf(tb->f, NULL, _IOFBF, STDIO_BUFFER);
    uint8_t ev[TRAIN_TB_EVENT_MAX];
    int len = train_tb_encode_file_version(ev, sizeof ev, wall_time);
    uint8_t rec[TRAIN_TB_EVENT_MAX + TRAIN_TB_FRAME_OVERHEAD];
    int n = len < 0 ? len : train_tb_frame(rec, sizeof rec, ev, (size_t)len);
    errno = 0;
    if (n < 0) rc = n;
    else if (fwrite(rec, 1, (size_t)n, tb->f) != (size_t)n || fflush(tb->f) != 0)
        rc = errno ? -errno : -EIO;
    if (rc < 0) {
        __fpurge(tb->f);
        fclose(tb->f);
        unlink(path);
        goto fail;
    }
    *out = tb;
    return 0;
fail:
    free(path);
    free(tb);
    return rc;
}

int train_tb_session_start(train_tb *tb, int64_t step, double wall_time)
{
    if (!tb) return -EINVAL;
    if (tb->err) return tb->err;
    uint8_t ev[TRAIN_TB_EVENT_MAX];
    int len = train_tb_encode_session_start(ev, sizeof ev, step, wall_time);
    return len < 0 ? len : append(tb, ev, len);
}

int train_tb_scalar(train_tb *tb, const char *tag, int64_t step, double value,
                    double wall_time)
{
    if (!tb) return -EINVAL;
    if (tb->err) return tb->err;
    uint8_t ev[TRAIN_TB_EVENT_MAX];
    int len = train_tb_encode_scalar(ev, sizeof ev, tag, step, (float)value, wall_time);
    return len < 0 ? len : append(tb, ev, len);
}

int train_tb_flush(train_tb *tb)
{
    if (!tb) return -EINVAL;
    if (tb->err) return tb->err;
    errno = 0;
    if (fflush(tb->f) != 0) return fail(tb, errno);
    return 0;
}

const char *train_tb_path(const train_tb *tb)
{
    return tb ? tb->path : NULL;
}

int train_tb_error(const train_tb *tb)
{
    return tb ? tb->err : 0;
}

int train_tb_close(train_tb *tb)
{
    if (!tb) return 0;
    int rc = tb->err;
    if (!rc) rc = train_tb_flush(tb);
    /* after a write error nothing more reaches the file: stdio would try the bytes it still
     * holds again at fclose */
    if (rc) __fpurge(tb->f);
    errno = 0;
    if (fclose(tb->f) != 0 && !rc) rc = fail(tb, errno);
    free(tb->path);
    free(tb);
    return rc;
}
