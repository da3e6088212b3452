/* test_train_tb.c - TensorBoard event files (tb_events.h) and the report sink that writes
 * them (report.h): CRC-32C against RFC 3720's vectors, the TFRecord mask, exact bytes of each
 * Event kind and a round trip through a protobuf decoder of this test's own, framing, the
 * writer's file names and records, the scalars each train_report_* call writes, and write
 * errors (a full tmpfs when this process may mount one; else a name that cannot be created)
 * that neither crash nor go on writing. */
#include "report.h"
#include "t_helpers.h"
#include "tb_events.h"

#include <dirent.h>
#include <float.h>
#include <inttypes.h>
#include <stdint.h>
#include <sys/mount.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------ a small decoder */

/* One decoded Event; unknown counts fields that this module never writes. */
typedef struct ev {
    double wall_time;
    int64_t step;
    int has_wall, has_step, has_fv, has_summary, has_session, has_value;
    char file_version[64];
    char tag[TRAIN_TB_TAG_MAX + 1];
    float value;
    int nvalues, status, unknown;
} ev;

static int rd_varint(const uint8_t *p, size_t n, size_t *i, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*i >= n) return -1;
        uint8_t b = p[(*i)++];
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}

static uint64_t rd_le(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int k = 0; k < bytes; k++) v |= (uint64_t)p[k] << (8 * k);
    return v;
}

/* Walk the fields of a message: fn gets each (field, wire type, varint value or payload). */
typedef int (*field_fn)(void *ctx, unsigned field, unsigned wire, uint64_t v, const uint8_t *p,
                        size_t len);

static int walk(const uint8_t *p, size_t n, field_fn fn, void *ctx)
{
    size_t i = 0;
    while (i < n) {
        uint64_t key, v = 0;
        if (rd_varint(p, n, &i, &key) < 0) return -1;
        unsigned field = (unsigned)(key >> 3), wire = (unsigned)(key & 7);
        const uint8_t *pl = NULL;
        size_t len = 0;
        switch (wire) {
        case 0:
            if (rd_varint(p, n, &i, &v) < 0) return -1;
            break;
        case 1:
            if (n - i < 8) return -1;
            v = rd_le(p + i, 8);
            i += 8;
            break;
        case 2:
            if (rd_varint(p, n, &i, &v) < 0 || v > n - i) return -1;
            pl = p + i;
            len = (size_t)v;
            i += len;
            break;
        case 5:
            if (n - i < 4) return -1;
            v = rd_le(p + i, 4);
            i += 4;
            break;
        default: return -1;
        }
        if (field == 0 || fn(ctx, field, wire, v, pl, len) < 0) return -1;
    }
    return 0;
}

static int value_field(void *ctx, unsigned f, unsigned w, uint64_t v, const uint8_t *p, size_t len)
{
    ev *e = ctx;
    if (f == 1 && w == 2 && len <= TRAIN_TB_TAG_MAX) {
        memcpy(e->tag, p, len);
        e->tag[len] = 0;
    } else if (f == 2 && w == 5) {
        uint32_t bits = (uint32_t)v;
        memcpy(&e->value, &bits, 4);
        e->has_value = 1;
    } else e->unknown++;
    return 0;
}

static int summary_field(void *ctx, unsigned f, unsigned w, uint64_t v, const uint8_t *p, size_t len)
{
    (void)v;
    ev *e = ctx;
    if (f == 1 && w == 2) {
        e->nvalues++;
        return walk(p, len, value_field, e);
    }
    e->unknown++;
    return 0;
}

static int session_field(void *ctx, unsigned f, unsigned w, uint64_t v, const uint8_t *p, size_t len)
{
    (void)p;
    (void)len;
    ev *e = ctx;
    if (f == 1 && w == 0) e->status = (int)v;
    else e->unknown++;
    return 0;
}

static int event_field(void *ctx, unsigned f, unsigned w, uint64_t v, const uint8_t *p, size_t len)
{
    ev *e = ctx;
    if (f == 1 && w == 1) {
        memcpy(&e->wall_time, &v, 8);
        e->has_wall = 1;
    } else if (f == 2 && w == 0) {
        e->step = (int64_t)v;
        e->has_step = 1;
    } else if (f == 3 && w == 2 && len < sizeof e->file_version) {
        memcpy(e->file_version, p, len);
        e->file_version[len] = 0;
        e->has_fv = 1;
    } else if (f == 5 && w == 2) {
        e->has_summary = 1;
        return walk(p, len, summary_field, e);
    } else if (f == 7 && w == 2) {
        e->has_session = 1;
        return walk(p, len, session_field, e);
    } else e->unknown++;
    return 0;
}

static int decode(const uint8_t *p, size_t n, ev *e)
{
    memset(e, 0, sizeof *e);
    return walk(p, n, event_field, e);
}

/* The records of an event file: each record's framing and both CRCs are checked; *truncated is
 * set when the file ends inside a record (then the records before it are returned). Returns
 * the number of events decoded into out (at most max), -1 on a bad CRC or message. */
static int read_records(const uint8_t *b, size_t n, ev *out, int max, int *truncated)
{
    size_t i = 0;
    int k = 0;
    *truncated = 0;
    while (i < n) {
        if (n - i < 12) {
            *truncated = 1;
            break;
        }
        uint64_t len = rd_le(b + i, 8);
        if ((uint32_t)rd_le(b + i + 8, 4) != train_tb_masked_crc32c(b + i, 8)) return -1;
        if (len > n - i - 12 || n - i - 12 - len < 4) {
            *truncated = 1;
            break;
        }
        const uint8_t *data = b + i + 12;
        if ((uint32_t)rd_le(data + len, 4) != train_tb_masked_crc32c(data, (size_t)len)) return -1;
        if (k >= max || decode(data, (size_t)len, &out[k]) < 0) return -1;
        k++;
        i += 12 + (size_t)len + 4;
    }
    return k;
}

/* ------------------------------------------------------------------ CRC-32C */

static void crc_vectors(void)
{
    uint8_t b[48];
    memset(b, 0, 32);
    T_CHECK(train_tb_crc32c(0, b, 32) == 0x8a9136aau, "32 x 0x00: %08x", train_tb_crc32c(0, b, 32));
    memset(b, 0xff, 32);
    T_CHECK(train_tb_crc32c(0, b, 32) == 0x62a8ab43u, "32 x 0xff: %08x", train_tb_crc32c(0, b, 32));
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    T_CHECK(train_tb_crc32c(0, b, 32) == 0x46dd794eu, "0..31: %08x", train_tb_crc32c(0, b, 32));
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)(31 - i);
    T_CHECK(train_tb_crc32c(0, b, 32) == 0x113fdb5cu, "31..0: %08x", train_tb_crc32c(0, b, 32));
    /* RFC 3720 B.4: an iSCSI SCSI Read (10) command PDU */
    static const uint8_t pdu[48] = {
        0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18,
        0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    T_CHECK(train_tb_crc32c(0, pdu, 48) == 0xd9963a56u, "PDU: %08x", train_tb_crc32c(0, pdu, 48));
    /* the customary check value, and a message given in pieces */
    T_CHECK(train_tb_crc32c(0, "123456789", 9) == 0xe3069283u, "check value");
    T_CHECK(train_tb_crc32c(train_tb_crc32c(0, "1234", 4), "56789", 5) == 0xe3069283u, "pieces");
    T_CHECK(train_tb_crc32c(0, NULL, 0) == 0, "empty");
    /* masked (values from python3-crc32c and the formula of tb_events.h) */
    T_CHECK(train_tb_masked_crc32c("123456789", 9) == 0xc78ab0e5u, "masked check value: %08x",
            train_tb_masked_crc32c("123456789", 9));
    T_CHECK(train_tb_masked_crc32c(NULL, 0) == 0xa282ead8u, "masked empty");
    memset(b, 0, 8); /* the length field of an empty record */
    T_CHECK(train_tb_masked_crc32c(b, 8) == 0x07980329u, "masked 8 x 0x00: %08x",
            train_tb_masked_crc32c(b, 8));
}

/* ------------------------------------------------------------------ encoding */

static void golden_bytes(void)
{
    uint8_t b[TRAIN_TB_EVENT_MAX];
    /* Event{wall_time 1.0, step 1, summary{value{tag "a", simple_value 1.0}}} */
    static const uint8_t scalar[] = {0x09, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f, 0x10, 0x01, 0x2a, 0x0a,
                                     0x0a, 0x08, 0x0a, 0x01, 'a', 0x15, 0, 0, 0x80, 0x3f};
    int n = train_tb_encode_scalar(b, sizeof b, "a", 1, 1.0f, 1.0);
    T_CHECK(n == (int)sizeof scalar && !memcmp(b, scalar, sizeof scalar), "scalar bytes (n %d)", n);
    /* Event{wall_time 2.0, step 300, session_log{status START}}: field 7, not 6 */
    static const uint8_t start[] = {0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x10, 0xac, 0x02,
                                    0x3a, 0x02, 0x08, 0x01};
    n = train_tb_encode_session_start(b, sizeof b, 300, 2.0);
    T_CHECK(n == (int)sizeof start && !memcmp(b, start, sizeof start), "start bytes (n %d)", n);
    /* Event{wall_time 0.5, file_version "brain.Event:2"}; step 0 is left out */
    static const uint8_t fv[] = {0x09, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f, 0x1a, 13, 'b', 'r', 'a', 'i',
                                 'n', '.', 'E', 'v', 'e', 'n', 't', ':', '2'};
    n = train_tb_encode_file_version(b, sizeof b, 0.5);
    T_CHECK(n == (int)sizeof fv && !memcmp(b, fv, sizeof fv), "file version bytes (n %d)", n);
    n = train_tb_encode_scalar(b, sizeof b, "a", 0, 1.0f, 1.0);
    T_CHECK(n == (int)sizeof scalar - 2 && b[9] == 0x2a, "step 0 left out (n %d)", n);
}

static void round_trip(void)
{
    static const int64_t steps[] = {0, 1, 127, 128, 300, 16383, 16384, INT32_MAX, 1ll << 40,
                                    INT64_MAX};
    const float values[] = {0.0f, -1.5f, 3.14159265f, 1e-42f /* subnormal */, FLT_MAX, -FLT_MIN,
                            INFINITY, NAN};
    static const double walls[] = {1.0, 1754000000.123456, 0.0, -5.25};
    char tags[4][TRAIN_TB_TAG_MAX + 1];
    const size_t tag_lens[4] = {1, 127, 128, TRAIN_TB_TAG_MAX};
    for (int t = 0; t < 4; t++) {
        for (size_t i = 0; i < tag_lens[t]; i++) tags[t][i] = (char)('a' + (i * 7 + (size_t)t) % 26);
        tags[t][tag_lens[t]] = 0;
    }
    tags[0][0] = '/';
    uint8_t b[TRAIN_TB_EVENT_MAX];
    int cases = 0;
    for (size_t s = 0; s < sizeof steps / sizeof *steps; s++)
        for (size_t v = 0; v < sizeof values / sizeof *values; v++)
            for (int t = 0; t < 4; t++) {
                double wall = walls[(s + v + (size_t)t) % 4];
                int n = train_tb_encode_scalar(b, sizeof b, tags[t], steps[s], values[v], wall);
                ev e;
                T_REQUIRE(n > 0 && n <= TRAIN_TB_EVENT_MAX && decode(b, (size_t)n, &e) == 0,
                          "scalar %zu/%zu/%d: n %d", s, v, t, n);
                uint32_t want_bits, got_bits;
                memcpy(&want_bits, &values[v], 4);
                memcpy(&got_bits, &e.value, 4);
                T_CHECK(e.has_wall && e.wall_time == wall && e.step == steps[s] &&
                            e.has_step == (steps[s] != 0) && e.has_summary && e.nvalues == 1 &&
                            e.has_value && got_bits == want_bits && !strcmp(e.tag, tags[t]) &&
                            !e.has_fv && !e.has_session && !e.unknown,
                        "scalar %zu/%zu/%d decoded wrong: step %" PRId64 " value %g tag len %zu", s,
                        v, t, e.step, (double)e.value, strlen(e.tag));
                cases++;
                /* every shorter buffer: -ENOBUFS, never a write past it */
                if (cases % 17 == 0)
                    for (int cap = 0; cap < n; cap++) {
                        uint8_t small[TRAIN_TB_EVENT_MAX + 1];
                        small[cap] = 0xa5;
                        int r = train_tb_encode_scalar(small, (size_t)cap, tags[t], steps[s],
                                                       values[v], wall);
                        T_CHECK(r == -ENOBUFS && small[cap] == 0xa5, "cap %d of %d: %d", cap, n, r);
                    }
            }
    for (size_t s = 0; s < sizeof steps / sizeof *steps; s++) {
        int n = train_tb_encode_session_start(b, sizeof b, steps[s], 7.5);
        ev e;
        T_REQUIRE(n > 0 && decode(b, (size_t)n, &e) == 0, "start %zu", s);
        T_CHECK(e.has_session && e.status == 1 && e.step == steps[s] && e.wall_time == 7.5 &&
                    !e.has_summary && !e.unknown,
                "start %zu decoded wrong", s);
    }
    int n = train_tb_encode_file_version(b, sizeof b, 1754000000.5);
    ev e;
    T_REQUIRE(n > 0 && decode(b, (size_t)n, &e) == 0, "file version");
    T_CHECK(e.has_fv && !strcmp(e.file_version, TRAIN_TB_FILE_VERSION) && !e.has_step &&
                e.wall_time == 1754000000.5,
            "file version decoded wrong");
    /* bad arguments */
    char longtag[TRAIN_TB_TAG_MAX + 2];
    memset(longtag, 'x', sizeof longtag - 1);
    longtag[sizeof longtag - 1] = 0;
    T_CHECK(train_tb_encode_scalar(b, sizeof b, longtag, 1, 1, 1) == -EINVAL, "tag too long");
    T_CHECK(train_tb_encode_scalar(b, sizeof b, "", 1, 1, 1) == -EINVAL, "empty tag");
    T_CHECK(train_tb_encode_scalar(b, sizeof b, NULL, 1, 1, 1) == -EINVAL, "NULL tag");
    T_CHECK(train_tb_encode_scalar(b, sizeof b, "a", -1, 1, 1) == -EINVAL, "negative step");
    T_CHECK(train_tb_encode_scalar(b, sizeof b, "a", 1, 1, NAN) == -EINVAL, "NaN wall time");
    T_CHECK(train_tb_encode_scalar(NULL, 64, "a", 1, 1, 1) == -EINVAL, "NULL buffer");
    T_CHECK(train_tb_encode_session_start(b, sizeof b, -2, 1) == -EINVAL, "negative step");
    T_CHECK(train_tb_encode_file_version(b, sizeof b, INFINITY) == -EINVAL, "infinite wall time");
    T_CHECK(train_tb_encode_file_version(b, 10, 1) == -ENOBUFS, "small buffer");
    printf("round trip: %d scalar encodings decoded\n", cases);
}

static void framing(void)
{
    uint8_t data[300], rec[400];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 13 + 5);
    int n = train_tb_frame(rec, sizeof rec, data, sizeof data);
    T_REQUIRE(n == (int)sizeof data + TRAIN_TB_FRAME_OVERHEAD, "frame length %d", n);
    T_CHECK(rd_le(rec, 8) == sizeof data, "length field");
    T_CHECK((uint32_t)rd_le(rec + 8, 4) == train_tb_masked_crc32c(rec, 8), "length CRC");
    T_CHECK(!memcmp(rec + 12, data, sizeof data), "data");
    T_CHECK((uint32_t)rd_le(rec + 12 + sizeof data, 4) == train_tb_masked_crc32c(data, sizeof data),
            "data CRC");
    n = train_tb_frame(rec, sizeof rec, NULL, 0);
    static const uint8_t empty[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0x29, 0x03, 0x98, 0x07,
                                      0xd8, 0xea, 0x82, 0xa2};
    T_CHECK(n == 16 && !memcmp(rec, empty, 16), "empty record bytes");
    T_CHECK(train_tb_frame(rec, sizeof data + 15, data, sizeof data) == -ENOBUFS, "small buffer");
    T_CHECK(train_tb_frame(NULL, 64, data, 1) == -EINVAL, "NULL out");
    T_CHECK(train_tb_frame(rec, 64, NULL, 1) == -EINVAL, "NULL data");
}

/* ------------------------------------------------------------------ writer */

static char *root;

/* The one event file in dir (malloc'ed path), NULL when there is none or more than one. */
static char *only_event_file(const char *dir, int *count)
{
    DIR *d = opendir(dir);
    char *found = NULL;
    *count = 0;
    if (!d) return NULL;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, "tfevents")) {
            (*count)++;
            free(found);
            found = t_path_in(dir, e->d_name);
        }
    closedir(d);
    if (*count != 1) {
        free(found);
        return NULL;
    }
    return found;
}

static int load(const char *path, ev *out, int max, int *truncated)
{
    unsigned char *b;
    long long n = t_slurp(path, &b);
    if (n < 0) return -1;
    int k = read_records(b, (size_t)n, out, max, truncated);
    free(b);
    return k;
}

static void writer(void)
{
    char *dir = t_path_in(root, "w/a/b"); /* created with its parents */
    double now = train_tb_wall_now();
    train_tb *tb = NULL;
    int rc = train_tb_open(&tb, dir, now);
    T_REQUIRE(rc == 0 && tb, "open: %d", rc);
    const char *path = train_tb_path(tb);
    const char *base = strrchr(path, '/') + 1;
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    long long secs;
    char rest[300];
    int got = sscanf(base, "events.out.tfevents.%10lld.%299s", &secs, rest);
    char tail[64];
    snprintf(tail, sizeof tail, ".%ld.", (long)getpid());
    T_CHECK(got == 2 && secs == (long long)now && base[20 + 10] == '.' && strstr(rest, tail),
            "name %s", base);
    T_CHECK(train_tb_session_start(tb, 41, now + 1) == 0, "start");
    T_CHECK(train_tb_scalar(tb, "train/loss", 41, 2.5, now + 2) == 0, "scalar");
    T_CHECK(train_tb_scalar(tb, "train/lr", 41, 1e-3, now + 2) == 0, "scalar");
    T_CHECK(train_tb_scalar(tb, "", 41, 1, now) == -EINVAL, "empty tag");
    T_CHECK(train_tb_scalar(tb, "x", -1, 1, now) == -EINVAL, "negative step");
    T_CHECK(train_tb_error(tb) == 0, "bad arguments are no write error");
    T_CHECK(train_tb_flush(tb) == 0, "flush");
    ev e[8];
    int trunc;
    int k = load(path, e, 8, &trunc);
    T_CHECK(k == 4 && !trunc, "records after the flush: %d", k);
    if (k == 4) {
        T_CHECK(e[0].has_fv && !strcmp(e[0].file_version, "brain.Event:2") && e[0].wall_time == now,
                "first record: the file version");
        T_CHECK(e[1].has_session && e[1].status == 1 && e[1].step == 41, "START");
        T_CHECK(!strcmp(e[2].tag, "train/loss") && e[2].value == 2.5f && e[2].step == 41 &&
                    e[2].wall_time == now + 2,
                "loss");
        T_CHECK(!strcmp(e[3].tag, "train/lr") && e[3].value == 1e-3f, "lr");
    }
    char *first = strdup(path);
    T_CHECK(train_tb_close(tb) == 0, "close");
    T_CHECK(train_tb_close(NULL) == 0, "close NULL");

    /* a second file in the same second sorts after the first; so does one after a file that
     * claims a later time */
    tb = NULL;
    T_REQUIRE(train_tb_open(&tb, dir, now) == 0, "second open");
    const char *b1 = strrchr(first, '/') + 1, *b2 = strrchr(train_tb_path(tb), '/') + 1;
    T_CHECK(strcmp(b2, b1) > 0, "%s must sort after %s", b2, b1);
    train_tb_close(tb);
    char fake[128];
    snprintf(fake, sizeof fake, "events.out.tfevents.%010lld.zzzz.1.0", (long long)now + 100);
    char *fp = t_path_in(dir, fake);
    T_REQUIRE(t_spit(fp, "", 0) == 0, "fake file");
    tb = NULL;
    T_REQUIRE(train_tb_open(&tb, dir, now) == 0, "third open");
    b2 = strrchr(train_tb_path(tb), '/') + 1;
    T_CHECK(strcmp(b2, fake) > 0 && atoll(b2 + 20) == (long long)now + 101, "%s after %s", b2, fake);
    train_tb_close(tb);
    free(fp);
    free(first);

    /* a folder that cannot be made: its parent is a file */
    char *file = t_path_in(root, "plain");
    T_REQUIRE(t_spit(file, "x", 1) == 0, "file");
    char *under = t_path_in(file, "tb");
    tb = (train_tb *)1;
    T_CHECK(train_tb_open(&tb, under, now) == -ENOTDIR && tb == (train_tb *)1, "under a file");
    T_CHECK(train_tb_open(&tb, file, now) == -ENOTDIR, "a file");
    T_CHECK(train_tb_open(&tb, "", now) == -EINVAL, "empty");
    T_CHECK(train_tb_open(&tb, dir, NAN) == -EINVAL, "NaN time");
    T_CHECK(train_tb_scalar(NULL, "a", 1, 1, 1) == -EINVAL && train_tb_flush(NULL) == -EINVAL &&
                train_tb_session_start(NULL, 1, 1) == -EINVAL,
            "NULL handle");
    free(under);
    free(file);
    free(dir);
}

/* ------------------------------------------------------------------ the report sink */

static void report_sink(void)
{
    unsetenv("ELASTIC_HEARTBEAT_FD");
    setenv("ELASTIC_RESTART_COUNT", "3", 1);
    char *dir = t_path_in(root, "report");
    train_report *r = NULL;
    T_REQUIRE(train_report_open(&r, 0) == 0, "open");
    double t0 = train_tb_wall_now();
    T_REQUIRE(train_report_tensorboard(r, dir) == 0, "tensorboard");
    T_CHECK(train_report_tensorboard(r, dir) == -EINVAL, "a second call");
    train_report_restore(r, 40, 0.25, "disk");
    train_report_step(r, 41, 0.5, 4.25, 1e-3, 1.5, 12345.5, 328);
    train_report_val(r, 41, 3.5);
    train_report_snapshot_staged(r, 41, 0.0625, 1449984);
    train_report_snapshot_done(r, 41, 0, 0.75, 3 << 20, 2 << 20);
    train_report_snapshot_done(r, 42, -28, 0.5, 1, 1); /* failed: no figures */
    train_report_snapshot_skipped(r, 43);
    /* the events are flushed by each call: readable before the close */
    int count;
    char *path = only_event_file(dir, &count);
    T_REQUIRE(path, "%d event files", count);
    ev e[32];
    int trunc, k = load(path, e, 32, &trunc);
    double t1 = train_tb_wall_now();
    train_report_close(r);
    int k2 = load(path, e, 32, &trunc);
    T_CHECK(k == k2, "all flushed before the close: %d then %d", k, k2);
    struct want {
        const char *tag;
        int64_t step;
        float value;
    } want[] = {
        {NULL, 41, 0}, /* START at the restored step + 1 */
        {"ckpt/restore_seconds", 40, 0.25f},
        {"elastic/restarts", 40, 3.0f},
        {"train/loss", 41, 4.25f},
        {"train/lr", 41, 1e-3f},
        {"train/grad_norm", 41, 1.5f},
        {"train/tokens_per_second", 41, 12345.5f},
        {"train/step_seconds", 41, 0.5f},
        {"train/val_loss", 41, 3.5f},
        {"ckpt/stall_seconds", 41, 0.0625f},
        {"ckpt/persist_seconds", 41, 0.75f},
        {"ckpt/persist_mib_per_second", 41, (float)(3.0 / 0.75)},
        {"ckpt/compression_ratio", 41, 1.5f},
    };
    const int nw = (int)(sizeof want / sizeof *want);
    T_CHECK(k == nw + 1 && !trunc, "%d records, want %d", k, nw + 1);
    for (int i = 0; i < nw && i + 1 < k; i++) {
        const ev *x = &e[i + 1];
        T_CHECK(x->wall_time >= t0 - 1e-3 && x->wall_time <= t1 + 1e-3, "%d: wall time", i);
        if (!want[i].tag) {
            T_CHECK(x->has_session && x->status == 1 && x->step == want[i].step, "%d: START at %" PRId64,
                    i, x->step);
            continue;
        }
        T_CHECK(x->has_summary && !strcmp(x->tag, want[i].tag) && x->step == want[i].step &&
                    x->value == want[i].value,
                "%d: got %s step %" PRId64 " value %.9g, want %s %" PRId64 " %.9g", i, x->tag,
                x->step, (double)x->value, want[i].tag, want[i].step, (double)want[i].value);
    }
    free(path);

    /* a fresh start: START at step 1, no restore_seconds; no restart count without the
     * variables; a rank other than 0 writes nothing */
    unsetenv("ELASTIC_RESTART_COUNT");
    setenv("TORCHELASTIC_RESTART_COUNT", "not a number", 1);
    char *dir2 = t_path_in(root, "report2");
    T_REQUIRE(train_report_open(&r, 0) == 0 && train_report_tensorboard(r, dir2) == 0, "open 2");
    train_report_restore(r, 0, 0.01, "none");
    train_report_step(r, 1, 0.5, 5.0, 1e-4, 2.0, 100, 8);
    train_report_step(r, 2, 0.5, NAN, NAN, NAN, NAN, 0); /* no loss: nothing */
    train_report_close(r);
    path = only_event_file(dir2, &count);
    T_REQUIRE(path, "%d event files", count);
    k = load(path, e, 32, &trunc);
    T_CHECK(k == 7 && e[1].has_session && e[1].step == 1 && !strcmp(e[2].tag, "train/loss") &&
                e[2].step == 1,
            "fresh start: %d records", k);
    free(path);
    unsetenv("TORCHELASTIC_RESTART_COUNT");
    char *dir3 = t_path_in(root, "report3");
    T_REQUIRE(train_report_open(&r, 1) == 0, "open rank 1");
    T_CHECK(train_report_tensorboard(r, dir3) == 0, "rank 1: no-op");
    train_report_restore(r, 0, 0.01, "none");
    train_report_step(r, 1, 0.5, 5.0, 1e-4, 2.0, 100, 8);
    train_report_close(r);
    struct stat st;
    T_CHECK(stat(dir3, &st) != 0, "rank 1 made no folder");
    /* a folder that cannot be made: logged, training goes on (every call a no-op) */
    char *file = t_path_in(root, "plain");
    char *under = t_path_in(file, "tb");
    T_REQUIRE(train_report_open(&r, 0) == 0, "open");
    T_CHECK(train_report_tensorboard(r, under) == -ENOTDIR, "under a file");
    train_report_restore(r, 0, 0.01, "none");
    train_report_step(r, 1, 0.5, 5.0, 1e-4, 2.0, 100, 8);
    train_report_close(r);
    free(under);
    free(file);
    free(dir3);
    free(dir2);
    free(dir);
}

/* ------------------------------------------------------------------ write errors */

/* Fill the file system of dir: a file written until ENOSPC. Returns its path. */
static char *fill(const char *dir)
{
    char *p = t_path_in(dir, "filler");
    FILE *f = fopen(p, "ab");
    T_REQUIRE(f, "filler");
    setvbuf(f, NULL, _IONBF, 0);
    char block[512];
    memset(block, 'f', sizeof block);
    while (fwrite(block, 1, sizeof block, f) == sizeof block) {}
    while (fwrite(block, 1, 1, f) == 1) {}
    fclose(f);
    return p;
}

static long long file_size(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 ? (long long)st.st_size : -1;
}

static void full_disk(void)
{
    char *mnt = t_path_in(root, "tmpfs");
    T_REQUIRE(mkdir(mnt, 0755) == 0, "mkdir");
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=64k,mode=0755") != 0) {
        printf("full tmpfs: cannot mount one (%s): only the name that cannot be created is "
               "tested\n", strerror(errno));
        free(mnt);
        return;
    }
    double now = train_tb_wall_now();
    /* full before the open: the first record cannot be written, no file is left */
    char *filler = fill(mnt);
    train_tb *tb = NULL;
    int rc = train_tb_open(&tb, mnt, now);
    int count;
    char *left = only_event_file(mnt, &count);
    T_CHECK(rc == -ENOSPC && !tb && count == 0, "open on a full disk: %d, %d files", rc, count);
    free(left);
    unlink(filler);

    /* full while writing: the first failure is the error of every later call, nothing more
     * is written (even with space again), and the records before it stay readable */
    T_REQUIRE(train_tb_open(&tb, mnt, now) == 0, "open with space");
    char *path = strdup(train_tb_path(tb));
    T_CHECK(train_tb_scalar(tb, "train/loss", 1, 1.0, now) == 0 && train_tb_flush(tb) == 0, "one step");
    free(filler);
    filler = fill(mnt);
    int first_err = 0, calls = 0;
    for (int step = 2; step < 2000 && !first_err; step++) {
        calls++;
        rc = train_tb_scalar(tb, "train/loss", step, 1.0, now);
        if (rc == 0) rc = train_tb_flush(tb);
        if (rc) first_err = rc;
    }
    T_CHECK(first_err == -ENOSPC && train_tb_error(tb) == -ENOSPC, "first error %d after %d calls",
            first_err, calls);
    long long size = file_size(path);
    unlink(filler); /* space again: still nothing is written */
    double t0 = t_now_s();
    for (int i = 0; i < 100000; i++)
        T_CHECK(train_tb_scalar(tb, "train/loss", 5000 + i, 1.0, now) == -ENOSPC || i > 0, "sticky");
    T_CHECK(t_now_s() - t0 < 2.0, "calls after the error must cost nothing");
    T_CHECK(train_tb_flush(tb) == -ENOSPC && train_tb_session_start(tb, 9, now) == -ENOSPC,
            "sticky");
    T_CHECK(train_tb_close(tb) == -ENOSPC, "close returns the error");
    T_CHECK(file_size(path) == size, "nothing written after the error: %lld then %lld", size,
            file_size(path));
    /* the records before the failure parse; the last one may be cut */
    unsigned char *b;
    long long n = t_slurp(path, &b);
    T_REQUIRE(n >= 0, "read back");
    ev *all = calloc(2048, sizeof *all);
    T_REQUIRE(all, "memory");
    int trunc, k = read_records(b, (size_t)n, all, 2048, &trunc);
    T_CHECK(k >= 3 && all[0].has_fv && !strcmp(all[1].tag, "train/loss") && all[k - 1].step >= 2,
            "records before the error: %d", k);
    printf("full tmpfs: %d records written, the first error after %d steps (%s), last record %s\n",
           k, calls, strerror(-first_err), trunc ? "cut" : "whole");
    free(all);
    free(b);

    /* the report sink on the full disk: every call goes on */
    filler = (free(filler), fill(mnt));
    train_report *r = NULL;
    T_REQUIRE(train_report_open(&r, 0) == 0, "report");
    char *sub = t_path_in(mnt, "sub");
    rc = train_report_tensorboard(r, sub);
    T_CHECK(rc == -ENOSPC, "report on a full disk: %d", rc);
    train_report_restore(r, 0, 0.01, "none");
    for (int i = 1; i <= 10; i++) train_report_step(r, i, 0.1, 1, 1, 1, 1, 1);
    train_report_close(r);
    free(sub);
    unlink(filler);
    free(filler);
    free(path);
    T_CHECK(umount2(mnt, MNT_DETACH) == 0, "umount: %s", strerror(errno));
    free(mnt);
}

int main(void)
{
    root = t_tmpdir("train-tb");
    crc_vectors();
    golden_bytes();
    round_trip();
    framing();
    writer();
    report_sink();
    full_disk();
    t_rmrf(root);
    free(root);
    return t_done("test_train_tb");
}
