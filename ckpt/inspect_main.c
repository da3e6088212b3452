/* ckpt-inspect: list, show, verify, export and plan re-shards of snapshots. Exit 0 success, 1 failure, 2 usage. */
#include "ckpt.h"
#include "ckpt_export.h"
#include "ckpt_plan.h"
#include "ckpt_s3.h"
#include "storage.h"
#include "clock.h"
#include "log.h"
#include "progress.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char usage_text[] =
    "usage: ckpt-inspect [--json] COMMAND ARGS\n"
    "\n"
    "Commands:\n"
    "  list DIR|URL       snapshots under DIR (and, when train --s3 uploads from it, each\n"
    "                     one's upload state and the lag of the bucket) or under\n"
    "                     s3://BUCKET/PREFIX: step, time, raw and stored bytes, ratio, status\n"
    "  show SNAPSHOT      buffers, tensors and trainer state of one snapshot: a folder, or\n"
    "                     s3://BUCKET/PREFIX/step-NNNNNNNNN (show, verify and plan read both;\n"
    "                     S3 settings from the AWS variables, as train --s3)\n"
    "  verify SNAPSHOT    read every chunk and check its checksums; exit 1 naming the first\n"
    "                     bad file and chunk\n"
    "  export SNAPSHOT OUT\n"
    "                     write the tensors of the trainer record (fp32 weights) to OUT in\n"
    "                     the safetensors layout, durably (temp file, fsync, rename); refuses\n"
    "                     an existing OUT without --force; exit 1 naming a bad file and chunk\n"
    "  plan SNAPSHOT --world-size N\n"
    "                     re-sharding plan for a restore by N ranks with the trainer's even\n"
    "                     partition (units of 2048 fp32 = 8192 bytes): per new rank the bytes\n"
    "                     it needs, the chunks it decodes (raw bytes), the bytes it reads from\n"
    "                     data files and the files it touches; reads no chunk data\n"
    "\n"
    "Options:\n"
    "  --json             machine-readable output (list, show, verify, export, plan)\n"
    "  -f, --force        export: replace an existing OUT\n"
    "  --window-mib N     export: MiB of the buffer read at a time (memory), 1..4096;\n"
    "                     default 64\n"
    "  --world-size N     plan: ranks of the restoring job, 1..65536\n"
    "  --s3-signature V   v4 (default) or v2, for s3:// URLs\n"
    "  -q, --quiet        no progress (verify and export show it after 2 s: on a terminal one\n"
    "                     line redrawn in place, otherwise a log line every 10 s)\n"
    "  -h, --help         this text\n"
    "\n"
    "Names and paths that are not printable UTF-8 are shown with \\xNN for each such byte,\n"
    "in text and in JSON.\n"
    "\n"
    "Exit status: 0 success; 1 the snapshot is corrupt, missing (or removed while read),\n"
    "of a newer format or refused (export: also OUT's file system full or read-only, or\n"
    "OUT named like a snapshot); 2 usage error (export: OUT exists, or is a link, without\n"
    "--force); 3 the snapshot could not be read, or OUT written, for a reason that says\n"
    "nothing about the snapshot (too many open files, permission, I/O error, out of\n"
    "memory): it may be fine.\n";

enum { EXIT_FAILURE_ = 1, EXIT_USAGE = 2, EXIT_UNREADABLE = 3 };

/* Exit status for a failure to open or read a snapshot: only evidence about the snapshot
 * (corrupt, missing, newer format, refused) is 1 (DESIGN I7). */
static objstore_opts g_sopts = OBJSTORE_OPTS_INIT;

static int status_of(int rc)
{
    switch (rc) {
    case -EBADMSG: case -ENOENT: case -EPROTONOSUPPORT: case -EINVAL: return EXIT_FAILURE_;
    default: return EXIT_UNREADABLE;
    }
}

/* What a failure means, for JSON: "corrupt", "missing", "newer-format", "refused" or
 * "unreadable". */
static const char *verdict_of(int rc)
{
    switch (rc) {
    case -EBADMSG: return "corrupt";
    case -ENOENT: return "missing";
    case -EPROTONOSUPPORT: return "newer-format";
    case -EINVAL: return "refused";
    default: return "unreadable";
    }
}

/* Printable form of a name or path from outside (log_printable), for text output: one of a
 * few rotating buffers, valid until the call after next-but-six. */
static const char *P(const char *s)
{
    static char bufs[8][4 * CKPT_PATH_MAX + 1];
    static unsigned next;
    char *b = bufs[next++ % 8];
    log_printable(b, sizeof bufs[0], s ? s : "", s ? strlen(s) : 0);
    return b;
}

/* A JSON string of any bytes (printable UTF-8, as P): json_pack's "s" returns NULL on text
 * that is not valid UTF-8, and a NULL output crashed the program. */
static json_t *J(const char *s) { return json_string(P(s)); }

/* v with every string and key made printable (P): JSON escapes a control character as
 * \u001b, which a consumer decodes back into the raw byte. A new reference. */
static json_t *printable_json(json_t *v)
{
    if (json_is_string(v)) return J(json_string_value(v));
    if (json_is_array(v)) {
        json_t *a = json_array();
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) json_array_append_new(a, printable_json(x));
        return a;
    }
    if (json_is_object(v)) {
        json_t *o = json_object();
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) json_object_set_new(o, P(k), printable_json(x));
        return o;
    }
    return json_incref(v);
}

/* Print a JSON value, or a one-line error when it could not be built or dumped. ASCII only
 * (JSON_ENSURE_ASCII): a string from a manifest may hold C1 controls, which a terminal can
 * obey, and JSON escapes them only on request. */
static int print_json(json_t *o, size_t flags)
{
    char *t = o ? json_dumps(o, flags | JSON_ENSURE_ASCII) : NULL;
    json_decref(o);
    if (!t) {
        fprintf(stderr, "ckpt-inspect: out of memory building the JSON output\n");
        return -1;
    }
    printf("%s\n", t);
    free(t);
    return 0;
}

static void fmt_time(int64_t t, char *buf, size_t len)
{
    if (t <= 0) {
        snprintf(buf, len, "-");
        return;
    }
    time_t tt = (time_t)t;
    struct tm tm;
    if (!gmtime_r(&tt, &tm) || tm.tm_year > 9999 - 1900 || !strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm))
        snprintf(buf, len, "-"); /* out of range for a calendar date */
}

static void fmt_bytes(uint64_t b, char *buf, size_t len)
{
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1024 && i < 4) {
        v /= 1024;
        i++;
    }
    if (i == 0) snprintf(buf, len, "%llu B", (unsigned long long)b);
    else snprintf(buf, len, "%.2f %s", v, u[i]);
}

/* A listing that could not be made: one line, the JSON failure object, the exit status. */
static int list_failed(const char *dir, int json, int rc, const char *why)
{
    if (json)
        print_json(json_pack("{s:o, s:b, s:s, s:o}", "dir", J(dir), "ok", 0, "status",
                             verdict_of(rc), "error", J(why)),
                   JSON_INDENT(2));
    fprintf(stderr, "ckpt-inspect: cannot list %s: %s\n", P(dir), why);
    return status_of(rc);
}

/* The uploader's state file of a local folder (train --s3), or NULL. */
static json_t *upload_state(const char *dir)
{
    char p[CKPT_PATH_MAX + 64], *text = NULL;
    snprintf(p, sizeof p, "%s/%s", dir, CKPT_UPLOAD_STATE_NAME);
    if (store_read_file(p, 16u << 20, STORE_NOFOLLOW, &text, NULL) < 0) return NULL;
    json_t *doc = json_loads(text, 0, NULL);
    free(text);
    if (!json_is_object(doc) || !json_is_array(json_object_get(doc, "steps"))) {
        json_decref(doc);
        return NULL;
    }
    return doc;
}

/* The state the uploader recorded for `step`: "uploaded", "failed", ...; "-" when none. */
static const char *upload_of(json_t *doc, uint64_t step, int64_t remote_step)
{
    if (!doc) return NULL;
    size_t i;
    json_t *o;
    json_array_foreach(json_object_get(doc, "steps"), i, o) {
        if ((uint64_t)json_integer_value(json_object_get(o, "step")) == step) {
            const char *st = json_string_value(json_object_get(o, "state"));
            return st ? st : "-";
        }
    }
    (void)remote_step; /* older than the uploader's history, or never uploaded: unknown */
    return "-";
}

static int cmd_list(const char *dir, int json)
{
    ckpt_entry *e;
    size_t n;
    struct stat st;
    json_t *up = NULL;
    int64_t remote_step = -1;
    if (ckpt_is_s3_url(dir)) {
        objstore_opts so = g_sopts;
        so.url = dir;
        objstore *os;
        char why[400] = "";
        int rc = objstore_open(&os, &so, why, sizeof why);
        if (rc < 0) return rc == -EINVAL ? (fprintf(stderr, "ckpt-inspect: %s: %s\n", P(dir), why), EXIT_USAGE)
                                         : list_failed(dir, json, rc, why);
        rc = ckpt_list_s3(os, &e, &n, why, sizeof why);
        objstore_close(os);
        if (rc < 0) return list_failed(dir, json, rc, why[0] ? why : strerror(-rc));
        goto print;
    }
    if (stat(dir, &st) != 0) {
        int err = errno;
        return list_failed(dir, json, err == ENOTDIR ? -ENOENT : -err, strerror(err));
    }
    if (!S_ISDIR(st.st_mode)) return list_failed(dir, json, -ENOENT, "not a folder");
    int rc = ckpt_list(dir, &e, &n);
    if (rc < 0) return list_failed(dir, json, rc, strerror(-rc));
    up = upload_state(dir);
    if (up) remote_step = (int64_t)json_integer_value(json_object_get(up, "remote_step"));
print:
    if (json) {
        json_t *arr = json_array();
        for (size_t i = 0; i < n; i++) {
            json_t *o = json_pack("{s:o, s:I, s:s, s:I, s:I, s:I}", "name", J(e[i].name), "step",
                                  (json_int_t)e[i].step, "status", ckpt_status_name(e[i].status),
                                  "created_unix", (json_int_t)e[i].created, "raw_bytes",
                                  (json_int_t)e[i].raw_bytes, "stored_bytes",
                                  (json_int_t)e[i].stored_bytes);
            if (o && e[i].reason[0]) json_object_set_new(o, "reason", J(e[i].reason));
            if (o && e[i].run_id[0]) json_object_set_new(o, "run_id", J(e[i].run_id));
            if (o && e[i].error) json_object_set_new(o, "error", J(strerror(-e[i].error)));
            if (o && up) json_object_set_new(o, "upload", J(upload_of(up, e[i].step, remote_step)));
            json_array_append_new(arr, o);
        }
        json_t *doc = json_pack("{s:o, s:o}", "dir", J(dir), "snapshots", arr);
        if (doc && up) {
            json_t *s3 = json_object();
            const char *keys[] = {"url", "remote_step", "lag_steps", "lag_seconds", "updated_unix",
                                  "uploaded", "failed", "skipped"};
            for (size_t k = 0; s3 && k < sizeof keys / sizeof keys[0]; k++) {
                json_t *v = json_object_get(up, keys[k]);
                if (json_is_string(v)) json_object_set_new(s3, keys[k], J(json_string_value(v)));
                else if (v) json_object_set(s3, keys[k], v);
            }
            json_object_set_new(doc, "s3", s3);
        }
        json_decref(up);
        if (print_json(doc, JSON_INDENT(2))) {
            free(e);
            return EXIT_UNREADABLE;
        }
    } else {
        printf("%-12s %-20s %12s %12s %6s  %s%s\n", "step", "time (UTC)", "raw", "stored", "ratio",
               up ? "s3        " : "", "status");
        for (size_t i = 0; i < n; i++) {
            char t[32], r[32], s[32], ratio[16];
            fmt_time(e[i].created, t, sizeof t);
            if (e[i].status == CKPT_STATUS_COMMITTED) {
                fmt_bytes(e[i].raw_bytes, r, sizeof r);
                fmt_bytes(e[i].stored_bytes, s, sizeof s);
                snprintf(ratio, sizeof ratio, "%.3f",
                         e[i].stored_bytes ? (double)e[i].raw_bytes / (double)e[i].stored_bytes : 0.0);
            } else {
                snprintf(r, sizeof r, "-");
                snprintf(s, sizeof s, "-");
                snprintf(ratio, sizeof ratio, "-");
            }
            char u[16] = "";
            if (up) snprintf(u, sizeof u, "%-10s", upload_of(up, e[i].step, remote_step));
            printf("%-12llu %-20s %12s %12s %6s  %s%s%s%s\n", (unsigned long long)e[i].step, t, r, s,
                   ratio, u, ckpt_status_name(e[i].status), e[i].reason[0] ? ": " : "", P(e[i].reason));
        }
        if (n == 0) printf("(no snapshots in %s)\n", P(dir));
        if (up) {
            char t[32];
            fmt_time((int64_t)json_integer_value(json_object_get(up, "updated_unix")), t, sizeof t);
            const char *url = json_string_value(json_object_get(up, "url"));
            char rs[48] = "no complete snapshot";
            if (remote_step >= 0)
                snprintf(rs, sizeof rs, "newest complete step %lld", (long long)remote_step);
            printf("S3 %s: %s, lag %lld steps, %.0f s (as of %s UTC)\n",
                   P(url ? url : "?"), rs,
                   (long long)json_integer_value(json_object_get(up, "lag_steps")),
                   json_number_value(json_object_get(up, "lag_seconds")), t);
        }
        json_decref(up);
    }
    free(e);
    return 0;
}

/* Open a snapshot; on failure report it (stderr, and JSON on stdout) and return the exit
 * status, else 0. */
static int open_or_report(ckpt_snapshot **s, const char *path, int json)
{
    char why[512] = "";
    int rc = ckpt_snapshot_open_any(s, path, &g_sopts, why, sizeof why);
    if (rc < 0) {
        if (json)
            print_json(json_pack("{s:o, s:b, s:s, s:o}", "snapshot", J(path), "ok", 0, "status",
                                 verdict_of(rc), "error", J(why[0] ? why : strerror(-rc))),
                       JSON_INDENT(2));
        fprintf(stderr, "ckpt-inspect: %s: %s%s\n", P(path), why[0] ? why : strerror(-rc),
                status_of(rc) == EXIT_UNREADABLE ? " (could not read; the snapshot may be fine)"
                                                 : "");
        return status_of(rc);
    }
    return 0;
}

static int cmd_show(const char *path, int json)
{
    ckpt_snapshot *s;
    int orc = open_or_report(&s, path, json);
    if (orc) return orc;
    uint64_t raw, stored;
    ckpt_snapshot_sizes(s, &raw, &stored);
    json_error_t jerr;
    json_t *trainer = json_loads(ckpt_snapshot_trainer_json(s), 0, &jerr);
    if (json) {
        json_t *bufs = json_array();
        for (size_t i = 0; i < ckpt_snapshot_nbuffers(s); i++) {
            ckpt_buffer_info bi;
            ckpt_snapshot_buffer_info(s, i, &bi);
            json_array_append_new(bufs, json_pack("{s:o, s:o, s:i, s:I, s:I, s:I}", "name", J(bi.name),
                                                  "dtype", J(bi.dtype), "elem_bytes", (int)bi.elem_bytes,
                                                  "raw_bytes", (json_int_t)bi.total_bytes,
                                                  "stored_bytes", (json_int_t)bi.stored_bytes,
                                                  "chunks", (json_int_t)bi.nchunks));
        }
        json_t *o = json_pack("{s:o, s:I, s:i, s:s, s:s, s:I, s:I, s:I, s:o, s:o}", "snapshot",
                              J(path), "step", (json_int_t)ckpt_snapshot_step(s), "world_size",
                              (int)ckpt_snapshot_world_size(s), "run_id", ckpt_snapshot_run_id(s),
                              "config_hash", ckpt_snapshot_config_hash(s), "created_unix",
                              (json_int_t)ckpt_snapshot_created(s), "raw_bytes", (json_int_t)raw,
                              "stored_bytes", (json_int_t)stored, "buffers", bufs, "trainer",
                              trainer ? printable_json(trainer) : json_object());
        int prc = print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
        json_decref(trainer);
        ckpt_snapshot_close(s);
        return prc ? EXIT_UNREADABLE : 0;
    }
    char t[32], r[32], st[32];
    fmt_time(ckpt_snapshot_created(s), t, sizeof t);
    fmt_bytes(raw, r, sizeof r);
    fmt_bytes(stored, st, sizeof st);
    printf("snapshot     %s\n", P(path));
    printf("step         %llu\n", (unsigned long long)ckpt_snapshot_step(s));
    printf("world size   %u\n", ckpt_snapshot_world_size(s));
    printf("run id       %s\n", ckpt_snapshot_run_id(s));
    printf("config hash  %s\n", ckpt_snapshot_config_hash(s));
    printf("created      %s\n", t);
    printf("size         raw %s, stored %s, ratio %.3f\n", r, st,
           stored ? (double)raw / (double)stored : 0.0);
    printf("\nbuffers\n  %-16s %-6s %14s %12s %12s %7s\n", "name", "dtype", "elements", "raw",
           "stored", "chunks");
    for (size_t i = 0; i < ckpt_snapshot_nbuffers(s); i++) {
        ckpt_buffer_info bi;
        ckpt_snapshot_buffer_info(s, i, &bi);
        fmt_bytes(bi.total_bytes, r, sizeof r);
        fmt_bytes(bi.stored_bytes, st, sizeof st);
        printf("  %-16s %-6s %14llu %12s %12s %7zu\n", bi.name, bi.dtype,
               (unsigned long long)(bi.total_bytes / bi.elem_bytes), r, st, bi.nchunks);
    }
    json_t *tensors = json_object_get(trainer, "tensors");
    if (json_is_array(tensors)) {
        const char *tb = json_string_value(json_object_get(trainer, "tensor_buffer"));
        printf("\ntensors (%zu, offsets in elements of buffer %s)\n", json_array_size(tensors),
               tb ? P(tb) : "params");
        size_t i;
        json_t *tt;
        json_array_foreach(tensors, i, tt) {
            char shape[96] = "";
            size_t j, off = 0;
            json_t *d;
            json_array_foreach(json_object_get(tt, "shape"), j, d) {
                off += (size_t)snprintf(shape + off, sizeof shape - off, "%s%lld", j ? ", " : "",
                                        (long long)json_integer_value(d));
                if (off >= sizeof shape) break;
            }
            printf("  %-28s (%s) at %lld\n", P(json_string_value(json_object_get(tt, "name"))), shape,
                   (long long)json_integer_value(json_object_get(tt, "offset")));
        }
    }
    printf("\ntrainer state\n");
    const char *key;
    json_t *val;
    json_object_foreach(trainer, key, val) {
        if (!strcmp(key, "tensors") || !strcmp(key, "tensor_buffer")) continue;
        /* ASCII only: every control or non-ASCII character as a \\u escape */
        char *txt = json_dumps(val, JSON_COMPACT | JSON_ENCODE_ANY | JSON_ENSURE_ASCII |
                                        JSON_REAL_PRECISION(10));
        printf("  %-12s %s\n", P(key), txt ? txt : "?");
        free(txt);
    }
    json_decref(trainer);
    ckpt_snapshot_close(s);
    return 0;
}

static int on_progress(void *ctx, uint64_t done, uint64_t total)
{
    progress *p = ctx;
    p->total = total;
    progress_update(p, done);
    return 0;
}

static int cmd_verify(const char *path, int json, int quiet)
{
    ckpt_snapshot *s;
    int orc = open_or_report(&s, path, json);
    if (orc) return orc;
    uint64_t total = 0;
    ckpt_snapshot_sizes(s, &total, NULL);
    progress p;
    progress_begin(&p, "verify", total, quiet || json, 0);
    double t0 = clock_now_s();
    char bad[512] = "";
    int rc = ckpt_snapshot_verify(s, bad, sizeof bad, on_progress, &p);
    progress_end(&p);
    double el = clock_now_s() - t0;
    uint64_t raw, stored;
    ckpt_snapshot_sizes(s, &raw, &stored);
    if (json) {
        json_t *o = json_pack("{s:o, s:b, s:I, s:I, s:f}", "snapshot", J(path), "ok", rc == 0,
                              "raw_bytes", (json_int_t)raw, "stored_bytes", (json_int_t)stored,
                              "seconds", (double)(int64_t)(el * 1e6) / 1e6);
        if (o && rc < 0) {
            json_object_set_new(o, "status", json_string(verdict_of(rc)));
            json_object_set_new(o, "error", J(bad[0] ? bad : strerror(-rc)));
        }
        print_json(o, JSON_INDENT(2));
    }
    if (rc < 0) {
        fprintf(stderr, "ckpt-inspect: verify %s failed: %s%s\n", P(path), bad[0] ? bad : strerror(-rc),
                status_of(rc) == EXIT_UNREADABLE ? " (could not read; the snapshot may be fine)"
                                                 : "");
    } else if (!json) {
        printf("OK %s: step %llu, %llu raw bytes in %.2f s (%.1f MiB/s)\n", P(path),
               (unsigned long long)ckpt_snapshot_step(s), (unsigned long long)raw, el,
               el > 0 ? (double)raw / 1048576.0 / el : 0.0);
    }
    ckpt_snapshot_close(s);
    return rc < 0 ? status_of(rc) : 0;
}

/* Exit status of a failed export: an existing OUT without --force is a usage error; a
 * corrupt chunk or a refused table 1; an error of the environment while reading the snapshot
 * or writing OUT (too many open files, permission, I/O error, out of memory) 3, except the
 * output's file system being full or read-only, which is 1. */
static int export_status(int rc, int exists)
{
    if (exists) return EXIT_USAGE;
    if (rc == -ENOSPC || rc == -EROFS || rc == -EDQUOT || rc == -EFBIG || rc == -EEXIST ||
        rc == -ENAMETOOLONG)
        return EXIT_FAILURE_;
    return status_of(rc);
}

static int cmd_export(const char *path, const char *out, int json, int quiet,
                      const ckpt_export_opts *eo)
{
    const int force = eo->force;
    ckpt_snapshot *s;
    int orc = open_or_report(&s, path, json);
    if (orc) return orc;
    char why[768] = "";
    ckpt_export_stats st = {0};
    progress p;
    progress_begin(&p, "export", 0, quiet || json, 0);
    ckpt_export_opts o = *eo;
    o.progress = on_progress;
    o.progress_ctx = &p;
    int rc = ckpt_export_safetensors(s, out, &o, &st, why, sizeof why);
    progress_end(&p);
    ckpt_snapshot_close(s);
    const char *msg = why[0] ? why : strerror(-rc);
    struct stat ost;
    int exists = rc == -EEXIST && !force && lstat(out, &ost) == 0; /* a dangling link too */
    /* an OUT that is a folder, device, FIFO or socket: refused even with --force, a usage
     * error like an existing OUT (ckpt_export_safetensors says which) */
    const int not_file = rc == -EINVAL && lstat(out, &ost) == 0 && !S_ISREG(ost.st_mode) &&
                         !S_ISLNK(ost.st_mode);
    if (json) {
        json_t *o = json_pack("{s:o, s:o, s:b}", "snapshot", J(path), "output", J(out), "ok", rc == 0);
        if (o && rc < 0) {
            int es = export_status(rc, exists || not_file);
            json_object_set_new(o, "status", json_string(es == EXIT_USAGE        ? "refused"
                                                         : es == EXIT_UNREADABLE ? "unreadable"
                                                                                 : verdict_of(rc)));
            json_object_set_new(o, "error", J(msg));
        } else if (o) {
            json_object_set_new(o, "tensors", json_integer((json_int_t)st.tensors));
            json_object_set_new(o, "data_bytes", json_integer((json_int_t)st.data_bytes));
            json_object_set_new(o, "file_bytes", json_integer((json_int_t)st.file_bytes));
            json_object_set_new(o, "seconds", json_real(st.seconds));
        }
        print_json(o, JSON_INDENT(2));
    }
    if (rc < 0) {
        fprintf(stderr, "ckpt-inspect: export %s failed: %s%s\n", P(path), msg,
                exists ? " (--force replaces it)" : "");
        return export_status(rc, exists || not_file);
    }
    if (!json)
        printf("exported %zu tensors (%llu bytes of data, %llu bytes in all) from %s to %s in "
               "%.2f s\n",
               st.tensors, (unsigned long long)st.data_bytes, (unsigned long long)st.file_bytes,
               P(path), P(out), st.seconds);
    return 0;
}

/* Unit of the trainer's even partition, bytes (TRAIN_BLOCK floats, train/model.h). */
#define PLAN_ALIGN_BYTES 8192u

static int cmd_plan(const char *path, uint32_t world, int json)
{
    ckpt_snapshot *s;
    int orc = open_or_report(&s, path, json);
    if (orc) return orc;
    ckpt_rank_reads *rr = calloc(world, sizeof *rr);
    int rc = rr ? ckpt_snapshot_plan(s, PLAN_ALIGN_BYTES, world, rr) : -ENOMEM;
    if (rc < 0) {
        if (json)
            print_json(json_pack("{s:o, s:b, s:s, s:o}", "snapshot", J(path), "ok", 0, "status",
                                 verdict_of(rc), "error", J(strerror(-rc))),
                       JSON_INDENT(2));
        fprintf(stderr, "ckpt-inspect: plan %s: %s\n", P(path), strerror(-rc));
        free(rr);
        ckpt_snapshot_close(s);
        return status_of(rc);
    }
    ckpt_rank_reads tot = {0, 0, 0, 0, 0};
    for (uint32_t r = 0; r < world; r++) {
        tot.need_bytes += rr[r].need_bytes;
        tot.read_raw_bytes += rr[r].read_raw_bytes;
        tot.read_stored_bytes += rr[r].read_stored_bytes;
        tot.chunks += rr[r].chunks;
        tot.files += rr[r].files;
    }
    if (json) {
        json_t *ranks = json_array();
        for (uint32_t r = 0; r < world; r++)
            json_array_append_new(ranks, json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "rank",
                                                   (json_int_t)r, "need_bytes",
                                                   (json_int_t)rr[r].need_bytes, "read_raw_bytes",
                                                   (json_int_t)rr[r].read_raw_bytes,
                                                   "read_stored_bytes",
                                                   (json_int_t)rr[r].read_stored_bytes, "chunks",
                                                   (json_int_t)rr[r].chunks, "files",
                                                   (json_int_t)rr[r].files));
        json_t *o = json_pack("{s:o, s:I, s:i, s:i, s:I, s:I, s:I, s:I, s:o}", "snapshot", J(path),
                              "step", (json_int_t)ckpt_snapshot_step(s), "saved_world_size",
                              (int)ckpt_snapshot_world_size(s), "world_size", (int)world,
                              "align_bytes", (json_int_t)PLAN_ALIGN_BYTES, "need_bytes",
                              (json_int_t)tot.need_bytes, "read_raw_bytes",
                              (json_int_t)tot.read_raw_bytes, "read_stored_bytes",
                              (json_int_t)tot.read_stored_bytes, "ranks", ranks);
        print_json(o, JSON_INDENT(2));
    } else {
        printf("plan %s: step %llu, saved by %u rank%s, restored by %u (units of %u bytes)\n",
               P(path), (unsigned long long)ckpt_snapshot_step(s), ckpt_snapshot_world_size(s),
               ckpt_snapshot_world_size(s) == 1 ? "" : "s", world, PLAN_ALIGN_BYTES);
        printf("  %-8s %14s %14s %14s %8s %6s\n", "rank", "needs", "decodes", "reads", "chunks",
               "files");
        char a[32], b[32], c[32];
        for (uint32_t r = 0; r <= world; r++) {
            const ckpt_rank_reads *x = r < world ? &rr[r] : &tot;
            fmt_bytes(x->need_bytes, a, sizeof a);
            fmt_bytes(x->read_raw_bytes, b, sizeof b);
            fmt_bytes(x->read_stored_bytes, c, sizeof c);
            char name[16];
            if (r < world) snprintf(name, sizeof name, "%u", r);
            else snprintf(name, sizeof name, "total");
            printf("  %-8s %14s %14s %14s %8zu %6zu\n", name, a, b, c, x->chunks, x->files);
        }
    }
    free(rr);
    ckpt_snapshot_close(s);
    return 0;
}

/* --world-size N: 1..CKPT_MAX_WORLD_SIZE (the format's limit) into *world; 0 or -1 (bad value, reported). */
static int parse_world(const char *v, uint32_t *world)
{
    char *end;
    errno = 0;
    unsigned long long n = v ? strtoull(v, &end, 10) : 0;
    if (!v || !*v || *end || errno || n < 1 || n > CKPT_MAX_WORLD_SIZE) {
        fprintf(stderr, "ckpt-inspect: --world-size wants 1..%u, got '%s'\n",
                (unsigned)CKPT_MAX_WORLD_SIZE, P(v));
        return -1;
    }
    *world = (uint32_t)n;
    return 0;
}

/* --window-mib N: 1..4096 MiB into *bytes; 0 or -1 (bad value, reported). */
static int parse_window(const char *v, uint64_t *bytes)
{
    char *end;
    errno = 0;
    unsigned long long n = v ? strtoull(v, &end, 10) : 0;
    if (!v || !*v || *end || errno || n < 1 || n > 4096) {
        fprintf(stderr, "ckpt-inspect: --window-mib wants 1..4096, got '%s'\n", P(v));
        return -1;
    }
    *bytes = (uint64_t)n << 20;
    return 0;
}

int main(int argc, char **argv)
{
    enum { O_WINDOW = 256, O_WORLD, O_SIG };
    static const struct option opts[] = {{"json", no_argument, 0, 'j'},
                                         {"quiet", no_argument, 0, 'q'},
                                         {"force", no_argument, 0, 'f'},
                                         {"window-mib", required_argument, 0, O_WINDOW},
                                         {"world-size", required_argument, 0, O_WORLD},
                                         {"s3-signature", required_argument, 0, O_SIG},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    ckpt_export_opts eo = CKPT_EXPORT_OPTS_INIT;
    int json = 0, quiet = 0, c;
    uint32_t world = 0; /* plan: 0 until --world-size is given */
    /* options anywhere (GNU getopt permutes: "list DIR --json" as "--json list DIR"), and
     * "--" ends them, so a path may start with '-' */
    opterr = 0;
    while ((c = getopt_long(argc, argv, "jqfh", opts, NULL)) != -1) {
        switch (c) {
        case 'j': json = 1; break;
        case 'q': quiet = 1; break;
        case 'f': eo.force = 1; break;
        case O_WINDOW:
            if (parse_window(optarg, &eo.window_bytes)) return 2;
            break;
        case O_WORLD:
            if (parse_world(optarg, &world)) return 2;
            break;
        case O_SIG:
            if (!strcmp(optarg, "v4")) g_sopts.signature = OBJSTORE_SIG_V4;
            else if (!strcmp(optarg, "v2")) g_sopts.signature = OBJSTORE_SIG_V2;
            else {
                fprintf(stderr, "ckpt-inspect: --s3-signature: '%s' is not v4 or v2\n", P(optarg));
                return 2;
            }
            break;
        case 'h': fputs(usage_text, stdout); return 0;
        default:
            if (optopt && optopt < 256)
                fprintf(stderr, "ckpt-inspect: unknown option or missing value: -%c\n", optopt);
            else
                fprintf(stderr, "ckpt-inspect: unknown option or missing value: %s\n",
                        P(argv[optind - 1]));
            fputs(usage_text, stderr);
            return 2;
        }
    }
    int nargs = argc - optind;
    const char *const *args = (const char *const *)argv + optind;
    int want = nargs > 0 && !strcmp(args[0], "export") ? 3 : 2;
    if (nargs > 0 && strcmp(args[0], "list") && strcmp(args[0], "show") && strcmp(args[0], "verify") &&
        strcmp(args[0], "export") && strcmp(args[0], "plan")) {
        fprintf(stderr, "ckpt-inspect: unknown command '%s' (list, show, verify, export, plan)\n",
                P(args[0]));
        return 2;
    }
    if (nargs != want) {
        fprintf(stderr, "ckpt-inspect: %s\n%s",
                nargs == 0 ? "missing command" : nargs < want ? "missing argument"
                                                              : "too many arguments",
                usage_text);
        return 2;
    }
    if (!strcmp(args[0], "plan") && world == 0) {
        fprintf(stderr, "ckpt-inspect: plan needs --world-size N\n%s", usage_text);
        return 2;
    }
    log_set_level(LOG_WARN);
    if (!strcmp(args[0], "list")) return cmd_list(args[1], json);
    if (!strcmp(args[0], "show")) return cmd_show(args[1], json);
    if (!strcmp(args[0], "verify")) return cmd_verify(args[1], json, quiet);
    if (!strcmp(args[0], "export")) return cmd_export(args[1], args[2], json, quiet, &eo);
    if (!strcmp(args[0], "plan")) return cmd_plan(args[1], world, json);
    fprintf(stderr, "ckpt-inspect: unknown command '%s' (list, show, verify, export, plan)\n",
            P(args[0]));
    return 2;
}
