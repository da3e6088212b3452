/* objstore_cli.c - a small command line over objstore.h, for the integration tests.
 *
 *   objstore-cli [options] put  s3://bucket/KEY FILE [--meta NAME=VALUE]
 *   objstore-cli [options] get  s3://bucket/KEY OUT [--range OFF LEN | --whole]
 *   objstore-cli [options] head s3://bucket/KEY [--meta NAME]
 *   objstore-cli [options] rm   s3://bucket/KEY
 *   objstore-cli [options] ls   s3://bucket[/PREFIX] [--delimiter /]
 *   objstore-cli [options] put-many s3://bucket/PREFIX COUNT SIZE   (COUNT keys PREFIX%06d)
 *
 * Options: --sig v2|v4, --timeout S (per attempt), --connect-timeout S, --attempts N,
 * --deadline S (per call), --backoff BASE_S, --page N (keys per listing page), --jobs N
 * (max_in_flight), --part BYTES (get without --range: HEAD, then ranged GETs of this size in
 * one batch; default 8 MiB), --threads T (get --range: T threads read the same range at once
 * through one handle and must agree), --repeat N --interval S (run the command N times),
 * --cancel-after S (a thread calls objstore_cancel).
 *
 * Each run of the command prints one JSON line on stdout ({"op":..., "rc":0, ...}); on
 * failure the line has "rc" (negative errno), "errno" (its name) and "why", and the why also
 * goes to stderr. Exit status: 0 when every run succeeded, 1 otherwise, 2 on a usage error.
 */
#include "objstore.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static const char *errname(int rc)
{
    switch (-rc) {
    case 0: return "OK";
    case ENOENT: return "ENOENT";
    case ENXIO: return "ENXIO";
    case EACCES: return "EACCES";
    case EINVAL: return "EINVAL";
    case ETIMEDOUT: return "ETIMEDOUT";
    case ECONNREFUSED: return "ECONNREFUSED";
    case ECONNRESET: return "ECONNRESET";
    case EHOSTUNREACH: return "EHOSTUNREACH";
    case EIO: return "EIO";
    case ECANCELED: return "ECANCELED";
    case ENOMEM: return "ENOMEM";
    case EFBIG: return "EFBIG";
    case ERANGE: return "ERANGE";
    case EBADMSG: return "EBADMSG";
    default: return "other";
    }
}

/* JSON string body (the why texts are printable already; escape quotes and backslashes). */
static void jstr(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        if ((unsigned char)*s < 0x20) {
            fprintf(f, "\\u%04x", (unsigned char)*s);
            continue;
        }
        fputc(*s, f);
    }
    fputc('"', f);
}

static void fail_line(const char *op, int rc, const char *why, unsigned attempts, double secs)
{
    printf("{\"op\":\"%s\",\"rc\":%d,\"errno\":\"%s\",\"attempts\":%u,\"seconds\":%.3f,\"why\":",
           op, rc, errname(rc), attempts, secs);
    jstr(stdout, why);
    printf("}\n");
    fflush(stdout);
    fprintf(stderr, "objstore-cli: %s\n", why);
}

static void usage(void)
{
    fprintf(stderr, "usage: objstore-cli [--sig v2|v4] [--timeout S] [--attempts N] "
            "[--deadline S] ... put URL/KEY FILE | get URL/KEY OUT [--range OFF LEN] | "
            "head URL/KEY | rm URL/KEY | ls URL [--delimiter /] | put-many URL/PREFIX N SIZE\n");
    exit(2);
}

/* "s3://bucket/rest" -> "s3://bucket" and rest. */
static int split_url(const char *in, char *url, size_t ul, const char **rest)
{
    if (strncmp(in, "s3://", 5)) return -1;
    const char *sl = strchr(in + 5, '/');
    size_t n = sl ? (size_t)(sl - in) : strlen(in);
    if (n + 1 > ul) return -1;
    memcpy(url, in, n);
    url[n] = 0;
    *rest = sl ? sl + 1 : "";
    return 0;
}

typedef struct cancel_arg {
    objstore *s;
    double after;
} cancel_arg;

static void *cancel_thread(void *p)
{
    cancel_arg *a = p;
    sleep_s(a->after);
    objstore_cancel(a->s);
    return NULL;
}

typedef struct par_arg {
    objstore *s;
    const char *key;
    uint64_t off, len;
    unsigned char *buf;
    double deadline;
    int rc;
    char why[320];
} par_arg;

static void *par_get(void *p)
{
    par_arg *a = p;
    objstore_op op;
    memset(&op, 0, sizeof op);
    op.kind = OBJSTORE_GET;
    op.key = a->key;
    op.get_buf = a->buf;
    op.get_offset = a->off;
    op.get_len = a->len;
    a->rc = objstore_run(a->s, &op, 1, a->deadline);
    memcpy(a->why, op.why, sizeof a->why);
    return NULL;
}

typedef struct args {
    const char *cmd, *target, *arg2, *arg3;
    const char *meta, *delim;
    int have_range, whole;
    uint64_t off, len, part;
    unsigned threads;
    double deadline;
} args;

static int write_all(int fd, const void *p, size_t n, uint64_t off)
{
    const char *c = p;
    while (n) {
        ssize_t w = pwrite(fd, c, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

static int do_put(objstore *s, const args *a, const char *key)
{
    double t0 = now_s();
    int fd = open(a->arg2, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
        char why[300];
        snprintf(why, sizeof why, "%s: %s", a->arg2, strerror(errno));
        fail_line("put", -errno, why, 0, 0);
        if (fd >= 0) close(fd);
        return 1;
    }
    objstore_op op;
    memset(&op, 0, sizeof op);
    op.kind = OBJSTORE_PUT;
    op.key = key;
    op.put_fd = fd;
    op.put_len = (uint64_t)st.st_size;
    char name[80] = "";
    if (a->meta) {
        const char *eq = strchr(a->meta, '=');
        if (!eq || (size_t)(eq - a->meta) >= sizeof name) usage();
        memcpy(name, a->meta, (size_t)(eq - a->meta));
        name[eq - a->meta] = 0;
        op.meta_name = name;
        snprintf(op.meta_value, sizeof op.meta_value, "%s", eq + 1);
    }
    int rc = objstore_run(s, &op, 1, a->deadline);
    close(fd);
    double dt = now_s() - t0;
    if (rc) {
        fail_line("put", rc, op.why, op.attempts, dt);
        return 1;
    }
    printf("{\"op\":\"put\",\"rc\":0,\"key\":");
    jstr(stdout, key);
    printf(",\"size\":%llu,\"etag\":\"%s\",\"attempts\":%u,\"http\":%d,\"seconds\":%.3f}\n",
           (unsigned long long)op.size, op.etag, op.attempts, op.http_status, dt);
    fflush(stdout);
    return 0;
}

static int do_get(objstore *s, const args *a, const char *key)
{
    double t0 = now_s();
    int rc = 0;
    unsigned attempts = 0;
    char why[320] = "";
    int fd = open(a->arg2, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(why, sizeof why, "%s: %s", a->arg2, strerror(errno));
        fail_line("get", -errno, why, 0, 0);
        return 1;
    }
    uint64_t total = 0;
    if (a->whole) {
        objstore_op op;
        memset(&op, 0, sizeof op);
        op.kind = OBJSTORE_GET;
        op.key = key;
        op.get_max = 1ull << 32;
        rc = objstore_run(s, &op, 1, a->deadline);
        attempts = op.attempts;
        snprintf(why, sizeof why, "%s", op.why);
        if (!rc) {
            total = op.size;
            if (write_all(fd, op.get_whole, (size_t)op.size, 0)) rc = -EIO;
        }
        free(op.get_whole);
    } else if (a->have_range && a->threads > 1) {
        unsigned t = a->threads;
        par_arg *pa = calloc(t, sizeof *pa);
        pthread_t *th = calloc(t, sizeof *th);
        for (unsigned i = 0; i < t; i++) {
            pa[i] = (par_arg){s, key, a->off, a->len, malloc(a->len ? a->len : 1), a->deadline,
                              0, ""};
            pthread_create(&th[i], NULL, par_get, &pa[i]);
        }
        for (unsigned i = 0; i < t; i++) pthread_join(th[i], NULL);
        for (unsigned i = 0; i < t; i++) {
            if (pa[i].rc && !rc) {
                rc = pa[i].rc;
                snprintf(why, sizeof why, "%s", pa[i].why);
            }
            if (!pa[i].rc && !rc && memcmp(pa[i].buf, pa[0].buf, a->len)) {
                rc = -EIO;
                snprintf(why, sizeof why, "thread %u read other bytes than thread 0", i);
            }
        }
        if (!rc) {
            total = a->len;
            if (write_all(fd, pa[0].buf, (size_t)a->len, 0)) rc = -EIO;
        }
        for (unsigned i = 0; i < t; i++) free(pa[i].buf);
        free(pa);
        free(th);
    } else {
        uint64_t off = a->off, len = a->len;
        if (!a->have_range) {
            objstore_op h;
            memset(&h, 0, sizeof h);
            h.kind = OBJSTORE_HEAD;
            h.key = key;
            rc = objstore_run(s, &h, 1, a->deadline);
            attempts += h.attempts;
            snprintf(why, sizeof why, "%s", h.why);
            off = 0;
            len = h.size;
        }
        uint64_t part = a->part ? a->part : 8u << 20;
        size_t nparts = len ? (size_t)((len + part - 1) / part) : 0;
        objstore_op *ops = calloc(nparts ? nparts : 1, sizeof *ops);
        unsigned char *buf = malloc(len ? (size_t)len : 1);
        if (!rc && (!ops || !buf)) rc = -ENOMEM;
        for (size_t i = 0; !rc && i < nparts; i++) {
            ops[i].kind = OBJSTORE_GET;
            ops[i].key = key;
            ops[i].get_offset = off + i * part;
            ops[i].get_len = i + 1 < nparts ? part : len - i * part;
            ops[i].get_buf = buf + i * part;
        }
        if (!rc && nparts) {
            rc = objstore_run(s, ops, nparts, a->deadline);
            for (size_t i = 0; i < nparts; i++) {
                attempts += ops[i].attempts;
                if (ops[i].rc && !why[0]) snprintf(why, sizeof why, "%s", ops[i].why);
            }
            if (rc && !why[0]) snprintf(why, sizeof why, "%s", ops[0].why);
        }
        if (!rc) {
            total = len;
            if (write_all(fd, buf, (size_t)len, 0)) rc = -EIO;
        }
        free(ops);
        free(buf);
    }
    close(fd);
    double dt = now_s() - t0;
    if (rc) {
        fail_line("get", rc, why[0] ? why : strerror(-rc), attempts, dt);
        return 1;
    }
    printf("{\"op\":\"get\",\"rc\":0,\"key\":");
    jstr(stdout, key);
    printf(",\"size\":%llu,\"attempts\":%u,\"seconds\":%.3f}\n", (unsigned long long)total,
           attempts, dt);
    fflush(stdout);
    return 0;
}

static int do_simple(objstore *s, const args *a, const char *key, int kind)
{
    double t0 = now_s();
    objstore_op op;
    memset(&op, 0, sizeof op);
    op.kind = kind;
    op.key = key;
    if (kind == OBJSTORE_HEAD) op.meta_name = a->meta;
    int rc = objstore_run(s, &op, 1, a->deadline);
    double dt = now_s() - t0;
    const char *name = kind == OBJSTORE_HEAD ? "head" : "rm";
    if (rc) {
        fail_line(name, rc, op.why, op.attempts, dt);
        return 1;
    }
    printf("{\"op\":\"%s\",\"rc\":0,\"key\":", name);
    jstr(stdout, key);
    if (kind == OBJSTORE_HEAD) {
        printf(",\"size\":%llu,\"etag\":\"%s\",\"meta\":", (unsigned long long)op.size, op.etag);
        jstr(stdout, op.meta_value);
    }
    printf(",\"attempts\":%u,\"http\":%d,\"seconds\":%.3f}\n", op.attempts, op.http_status, dt);
    fflush(stdout);
    return 0;
}

static int do_ls(objstore *s, const args *a, const char *prefix)
{
    double t0 = now_s();
    objstore_entry *e = NULL;
    size_t n = 0;
    char why[320];
    int rc = objstore_list(s, prefix, a->delim, &e, &n, 0, why, sizeof why);
    double dt = now_s() - t0;
    if (rc) {
        fail_line("ls", rc, why, 0, dt);
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        printf("{\"key\":");
        jstr(stdout, e[i].key);
        printf(",\"size\":%llu,\"prefix\":%s,\"etag\":\"%s\"}\n", (unsigned long long)e[i].size,
               e[i].is_prefix ? "true" : "false", e[i].etag);
    }
    printf("{\"op\":\"ls\",\"rc\":0,\"count\":%zu,\"seconds\":%.3f}\n", n, dt);
    fflush(stdout);
    objstore_entries_free(e, n);
    return 0;
}

static int do_put_many(objstore *s, const args *a, const char *prefix)
{
    size_t count = strtoul(a->arg2, NULL, 10);
    size_t size = strtoul(a->arg3, NULL, 10);
    double t0 = now_s();
    objstore_op *ops = calloc(count ? count : 1, sizeof *ops);
    char *keys = calloc(count ? count : 1, 1100);
    unsigned char *data = malloc(size ? size : 1);
    if (!ops || !keys || !data) return 1;
    for (size_t i = 0; i < size; i++) data[i] = (unsigned char)(i * 131u + 7u);
    for (size_t i = 0; i < count; i++) {
        snprintf(keys + i * 1100, 1100, "%s%06zu", prefix, i);
        ops[i].kind = OBJSTORE_PUT;
        ops[i].key = keys + i * 1100;
        ops[i].put_data = data;
        ops[i].put_len = size;
    }
    int rc = objstore_run(s, ops, count, a->deadline);
    double dt = now_s() - t0;
    unsigned attempts = 0;
    for (size_t i = 0; i < count; i++) attempts += ops[i].attempts;
    if (rc) {
        const char *why = "";
        for (size_t i = 0; i < count && !*why; i++)
            if (ops[i].rc) why = ops[i].why;
        fail_line("put-many", rc, why, attempts, dt);
    } else {
        printf("{\"op\":\"put-many\",\"rc\":0,\"count\":%zu,\"attempts\":%u,\"seconds\":%.3f}\n",
               count, attempts, dt);
        fflush(stdout);
    }
    free(ops);
    free(keys);
    free(data);
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    objstore_opts o = OBJSTORE_OPTS_INIT;
    args a;
    memset(&a, 0, sizeof a);
    unsigned repeat = 1;
    double interval = 0, cancel_after = 0;
    const char *pos[4] = {NULL, NULL, NULL, NULL};
    int npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_ARG                                                                               \
    do {                                                                                       \
        if (!v) usage();                                                                       \
        i++;                                                                                   \
    } while (0)
        if (!strcmp(s, "--sig")) {
            NEED_ARG;
            o.signature = !strcmp(v, "v2") ? OBJSTORE_SIG_V2 : !strcmp(v, "v4") ? OBJSTORE_SIG_V4 : -1;
            if (o.signature < 0) usage();
        } else if (!strcmp(s, "--timeout")) {
            NEED_ARG;
            o.request_timeout_s = atof(v);
        } else if (!strcmp(s, "--connect-timeout")) {
            NEED_ARG;
            o.connect_timeout_s = atof(v);
        } else if (!strcmp(s, "--attempts")) {
            NEED_ARG;
            o.max_attempts = (unsigned)atoi(v);
        } else if (!strcmp(s, "--deadline")) {
            NEED_ARG;
            a.deadline = atof(v);
        } else if (!strcmp(s, "--backoff")) {
            NEED_ARG;
            o.backoff_base_s = atof(v);
            if (o.backoff_max_s < o.backoff_base_s) o.backoff_max_s = o.backoff_base_s;
        } else if (!strcmp(s, "--page")) {
            NEED_ARG;
            o.list_page_keys = (unsigned)atoi(v);
        } else if (!strcmp(s, "--jobs")) {
            NEED_ARG;
            o.max_in_flight = (unsigned)atoi(v);
        } else if (!strcmp(s, "--part")) {
            NEED_ARG;
            a.part = strtoull(v, NULL, 10);
        } else if (!strcmp(s, "--threads")) {
            NEED_ARG;
            a.threads = (unsigned)atoi(v);
        } else if (!strcmp(s, "--repeat")) {
            NEED_ARG;
            repeat = (unsigned)atoi(v);
        } else if (!strcmp(s, "--interval")) {
            NEED_ARG;
            interval = atof(v);
        } else if (!strcmp(s, "--cancel-after")) {
            NEED_ARG;
            cancel_after = atof(v);
        } else if (!strcmp(s, "--meta")) {
            NEED_ARG;
            a.meta = v;
        } else if (!strcmp(s, "--delimiter")) {
            NEED_ARG;
            a.delim = v;
        } else if (!strcmp(s, "--whole")) {
            a.whole = 1;
        } else if (!strcmp(s, "--range")) {
            if (i + 2 >= argc) usage();
            a.have_range = 1;
            a.off = strtoull(argv[i + 1], NULL, 10);
            a.len = strtoull(argv[i + 2], NULL, 10);
            i += 2;
        } else if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
            usage();
        } else if (s[0] == '-' && s[1] == '-') {
            usage();
        } else {
            if (npos == 4) usage();
            pos[npos++] = s;
        }
    }
    if (npos < 2) usage();
    a.cmd = pos[0];
    a.target = pos[1];
    a.arg2 = pos[2];
    a.arg3 = pos[3];
    char url[128];
    const char *rest;
    if (split_url(a.target, url, sizeof url, &rest)) usage();
    int need = !strcmp(a.cmd, "put") || !strcmp(a.cmd, "get") ? 3
               : !strcmp(a.cmd, "put-many")                  ? 4
               : !strcmp(a.cmd, "head") || !strcmp(a.cmd, "rm") || !strcmp(a.cmd, "ls") ? 2
                                                                                      : -1;
    if (need != npos) usage();

    o.url = url;
    objstore *s = NULL;
    char why[320];
    int rc = objstore_open(&s, &o, why, sizeof why);
    if (rc) {
        fail_line(a.cmd, rc, why, 0, 0);
        return 1;
    }
    pthread_t ct;
    cancel_arg ca = {s, cancel_after};
    if (cancel_after > 0) pthread_create(&ct, NULL, cancel_thread, &ca);
    int bad = 0;
    for (unsigned r = 0; r < (repeat ? repeat : 1); r++) {
        if (r) sleep_s(interval);
        int f;
        if (!strcmp(a.cmd, "put")) f = do_put(s, &a, rest);
        else if (!strcmp(a.cmd, "get")) f = do_get(s, &a, rest);
        else if (!strcmp(a.cmd, "head")) f = do_simple(s, &a, rest, OBJSTORE_HEAD);
        else if (!strcmp(a.cmd, "rm")) f = do_simple(s, &a, rest, OBJSTORE_DELETE);
        else if (!strcmp(a.cmd, "ls")) f = do_ls(s, &a, rest);
        else f = do_put_many(s, &a, rest);
        bad |= f;
    }
    if (cancel_after > 0) pthread_join(ct, NULL);
    objstore_close(s);
    return bad ? 1 : 0;
}
