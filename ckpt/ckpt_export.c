/* ckpt_export.c - safetensors export of a snapshot's tensor table (see ckpt_export.h). */
#include "clock.h"
#include "log.h"
#include "ckpt_export.h"
#include "ckpt_internal.h"

#include "config.h"
#include "storage.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Safetensors readers refuse headers larger than this (MAX_HEADER_SIZE in safetensors). */
#define HEADER_MAX_BYTES 100000000u

typedef struct tensor_desc {
    const char *name;  /* owned by the trainer JSON */
    uint64_t offset;   /* in the buffer, bytes */
    uint64_t bytes;    /* length, bytes */
    uint64_t out_off;  /* in the data section of the output, bytes */
} tensor_desc;

static const struct {
    const char *ckpt; /* dtype as the manifest names it */
    const char *st;   /* dtype as safetensors names it */
    uint32_t elem_bytes;
} dtypes[] = {{"f32", "F32", 4}, {"f16", "F16", 2}, {"bf16", "BF16", 2}, {"f64", "F64", 8}};


/* pwrite all of buf, resuming short writes and EINTR. Returns 0 or -errno. */
static int pwrite_all(int fd, const void *buf, size_t len, uint64_t off)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = pwrite(fd, p, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) return -EIO;
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

static int cmp_desc_offset(const void *a, const void *b)
{
    const tensor_desc *x = *(const tensor_desc *const *)a, *y = *(const tensor_desc *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* 0 when no two tensors of t share a byte of the buffer (empty tensors share none), else
 * -EINVAL naming two that do. Sorts a copy by offset: n log n. */
static int check_disjoint(const tensor_desc *t, size_t n, const char *bufname, char *why,
                          size_t why_len)
{
    const tensor_desc **v = malloc((n ? n : 1) * sizeof *v);
    if (!v) return -ENOMEM;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (t[i].bytes) v[m++] = &t[i];
    qsort(v, m, sizeof *v, cmp_desc_offset);
    int rc = 0;
    for (size_t i = 1; i < m && rc == 0; i++)
        if (v[i - 1]->offset + v[i - 1]->bytes > v[i]->offset) {
            log_why(why, why_len, "tensors %s and %s overlap in buffer %s", v[i - 1]->name,
                    v[i]->name, bufname);
            rc = -EINVAL;
        }
    free(v);
    return rc;
}

/* Validate the tensor table against a buffer of `elems` elements of `elem_bytes` bytes, add
 * one header entry per tensor to hdr, and fill *out (malloc'ed) in table order. */
static int parse_table(const json_t *trainer, const char *bufname, uint64_t elems,
                       uint32_t elem_bytes, const char *st_dtype, json_t *hdr, tensor_desc **out,
                       size_t *nout, uint64_t *data_bytes, char *why, size_t why_len)
{
    const json_t *tensors = json_object_get(trainer, "tensors");
    if (!json_is_array(tensors) || json_array_size(tensors) == 0) {
        log_why(why, why_len, "trainer record has no tensor table (\"tensors\")");
        return -EINVAL;
    }
    size_t n = json_array_size(tensors);
    tensor_desc *t = calloc(n, sizeof *t);
    if (!t) return -ENOMEM;
    uint64_t pos = 0;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(tensors, i);
        const char *name = json_string_value(json_object_get(e, "name"));
        const json_t *shape = json_object_get(e, "shape");
        const json_t *off = json_object_get(e, "offset");
        if (!name || !name[0]) {
            log_why(why, why_len, "tensor %zu of the trainer record has no name", i);
            rc = -EINVAL;
            goto out;
        }
        if (!strcmp(name, "__metadata__") || json_object_get(hdr, name)) {
            log_why(why, why_len, "tensor name %s is reserved or used twice", name);
            rc = -EINVAL;
            goto out;
        }
        if (!json_is_array(shape) || !json_is_integer(off) || json_integer_value(off) < 0) {
            log_why(why, why_len, "tensor %s: shape or offset missing or malformed", name);
            rc = -EINVAL;
            goto out;
        }
        json_t *dims = json_array();
        json_t *ent = json_object();
        if (!dims || !ent) {
            json_decref(dims);
            json_decref(ent);
            rc = -ENOMEM;
            goto out;
        }
        if (json_object_set_new(hdr, name, ent)) { /* ent is freed by the failed set */
            json_decref(dims);
            rc = -ENOMEM;
            goto out;
        }
        uint64_t numel = 1;
        int bad_shape = 0;
        size_t j;
        const json_t *d;
        json_array_foreach(shape, j, d) {
            if (!json_is_integer(d) || json_integer_value(d) < 0) {
                bad_shape = 1;
                break;
            }
            uint64_t dim = (uint64_t)json_integer_value(d);
            if (dim && numel > elems / dim) numel = elems + 1; /* too big, and no overflow */
            else numel *= dim;
            json_array_append_new(dims, json_integer(json_integer_value(d)));
        }
        uint64_t first = (uint64_t)json_integer_value(off);
        if (bad_shape || json_array_size(dims) != json_array_size(shape)) {
            json_decref(dims);
            log_why(why, why_len, "tensor %s: shape malformed", name);
            rc = -EINVAL;
            goto out;
        }
        if (numel > elems || first > elems - numel) {
            json_decref(dims);
            log_why(why, why_len,
                    "tensor %s: elements [%llu, %llu) lie outside buffer %s (%llu elements)", name,
                    (unsigned long long)first, (unsigned long long)(first + numel), bufname,
                    (unsigned long long)elems);
            rc = -EINVAL;
            goto out;
        }
        t[i] = (tensor_desc){name, first * elem_bytes, numel * elem_bytes, pos};
        if (json_object_set_new(ent, "dtype", json_string(st_dtype)) ||
            json_object_set_new(ent, "shape", dims) ||
            json_object_set_new(ent, "data_offsets",
                                json_pack("[I, I]", (json_int_t)pos,
                                          (json_int_t)(pos + t[i].bytes)))) {
            rc = -ENOMEM;
            goto out;
        }
        pos += t[i].bytes;
    }
    /* tensors lie disjoint in their buffer: the output is then no larger than the buffer (a
     * table of overlapping tensors made a 1.2 MB snapshot export 966 MB) */
    if ((rc = check_disjoint(t, n, bufname, why, why_len)) < 0) goto out;
    *data_bytes = pos;
out:
    if (rc < 0) {
        free(t);
        return rc;
    }
    *out = t;
    *nout = n;
    return 0;
}

/* Folder of a path, for fsync after the rename: "." for a bare name, "/" for "/x". */
static void parent_of(const char *path, char *dir, size_t len)
{
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, len, ".");
    else if (slash == path) snprintf(dir, len, "/");
    else snprintf(dir, len, "%.*s", (int)(slash - path), path);
}

/* Rename tmp to out; without force never replace out (RENAME_NOREPLACE, or a check just
 * before rename where the file system lacks the flag). */
static int commit_rename(const char *tmp, const char *out, int force)
{
    if (force) return rename(tmp, out) ? -errno : 0;
    return store_rename_noreplace(tmp, out);
}

int ckpt_export_safetensors(ckpt_snapshot *s, const char *out_path, const ckpt_export_opts *opts,
                            ckpt_export_stats *stats, char *why, size_t why_len)
{
    static const ckpt_export_opts defaults = CKPT_EXPORT_OPTS_INIT;
    double t0 = clock_now_s();
    int rc = 0, fd = -1, tmp_made = 0;
    json_t *trainer = NULL, *hdr = NULL;
    char *hdr_text = NULL;
    uint8_t *prefix = NULL, *win = NULL;
    tensor_desc *t = NULL;
    size_t nt = 0;
    uint64_t data_bytes = 0;
    char tmp[CKPT_PATH_MAX + 32], dir[CKPT_PATH_MAX];
    char *source = NULL;
    if (why && why_len) why[0] = '\0';
    if (!opts) opts = &defaults;
    const int force = opts->force;
    const uint64_t W = opts->window_bytes;
    if (!s || !out_path || !out_path[0] || W < 4096 || W > (4ull << 30)) return -EINVAL;
    if (strlen(out_path) >= CKPT_PATH_MAX) {
        log_why(why, why_len, "%s: path too long", out_path);
        return -EINVAL;
    }
    struct stat st;
    if (lstat(out_path, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
        /* a folder, a device (--force would replace /dev/null with a file), a FIFO, a socket:
         * never an export's output, forced or not */
        log_why(why, why_len, "%s: exists and is not a regular file (%s): not replacing it",
                out_path, S_ISDIR(st.st_mode) ? "a folder" : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)
                              ? "a device" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a socket");
        return -EINVAL;
    }
    if (!force && lstat(out_path, &st) == 0) {
        log_why(why, why_len, "%s: exists", out_path);
        return -EEXIST;
    }
    {
        /* never write into a snapshot folder (or a temp one): even with --force that would
         * damage a committed snapshot; and never under a snapshot's name, which a listing
         * would call corrupt and a resume would set aside */
        char parent[CKPT_PATH_MAX], name[256];
        snprintf(parent, sizeof parent, "%s", out_path);
        char *slash = strrchr(parent, '/');
        if (slash) *slash = '\0';
        else snprintf(parent, sizeof parent, ".");
        ckpt_folder_name(out_path, name, sizeof name);
        uint64_t step;
        if (ckpt_is_snapshot_folder(parent)) {
            log_why(why, why_len, "%s: refusing to write inside a snapshot folder", out_path);
            return -EINVAL;
        }
        if (ckpt_parse_step_dirname(name, &step) == 0 || ckpt_parse_temp_dirname(name, &step) == 0 ||
            ckpt_parse_aside_dirname(name, &step) == 0) {
            log_why(why, why_len, "%s: refusing a snapshot folder's name for the output", out_path);
            return -EINVAL;
        }
    }

    json_error_t jerr;
    trainer = json_loads(ckpt_snapshot_trainer_json(s), 0, &jerr);
    if (!trainer && (json_error_code(&jerr) == json_error_out_of_memory || !jerr.text[0])) {
        rc = -ENOMEM; /* jansson leaves some allocation failures without a message */
        goto out;
    }
    if (!json_is_object(trainer)) {
        log_why(why, why_len, "trainer record is not a JSON object: %s", jerr.text);
        rc = -EINVAL;
        goto out;
    }
    const char *bufname = json_string_value(json_object_get(trainer, "tensor_buffer"));
    if (!bufname) bufname = "params";
    ckpt_buffer_info bi;
    size_t nb = ckpt_snapshot_nbuffers(s), bidx;
    for (bidx = 0; bidx < nb; bidx++) {
        if (ckpt_snapshot_buffer_info(s, bidx, &bi) == 0 && !strcmp(bi.name, bufname)) break;
    }
    if (bidx == nb) {
        log_why(why, why_len, "no buffer %s (the trainer's tensor_buffer) in the snapshot",
                bufname);
        rc = -ENOENT;
        goto out;
    }
    const char *st_dtype = NULL;
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
        if (!strcmp(bi.dtype, dtypes[i].ckpt) && bi.elem_bytes == dtypes[i].elem_bytes)
            st_dtype = dtypes[i].st;
    }
    if (!st_dtype) {
        log_why(why, why_len, "buffer %s has dtype %s of %u bytes: no safetensors dtype for it",
                bufname, bi.dtype, bi.elem_bytes);
        rc = -EINVAL;
        goto out;
    }

    /* header: metadata first, then the tensors in table order */
    char step[32];
    snprintf(step, sizeof step, "%llu", (unsigned long long)ckpt_snapshot_step(s));
    {
        /* metadata values must be UTF-8 (safetensors readers, and jansson refuses others):
         * a path that is not gets \xNN for its odd bytes */
        char *real = realpath(ckpt_snapshot_path(s), NULL);
        const char *p = real ? real : ckpt_snapshot_path(s);
        size_t cap = 4 * strlen(p) + 1;
        source = malloc(cap);
        if (source) log_printable(source, cap, p, strlen(p));
        free(real);
        if (!source) {
            rc = -ENOMEM;
            goto out;
        }
    }
    const char *digest = json_string_value(json_object_get(trainer, "params_digest"));
    json_t *meta = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "format", "pt", "step", step,
                             "run_id", ckpt_snapshot_run_id(s) ? ckpt_snapshot_run_id(s) : "",
                             "config_hash",
                             ckpt_snapshot_config_hash(s) ? ckpt_snapshot_config_hash(s) : "",
                             "source_snapshot", source,
                             "producer", "ckpt-inspect " CKPT_VERSION);
    hdr = json_object();
    if (!meta || !hdr || json_object_set_new(hdr, "__metadata__", meta) ||
        (digest && json_object_set_new(meta, "params_digest", json_string(digest)))) {
        if (!hdr) json_decref(meta);
        rc = -ENOMEM;
        goto out;
    }
    rc = parse_table(trainer, bufname, bi.total_bytes / bi.elem_bytes, bi.elem_bytes, st_dtype,
                     hdr, &t, &nt, &data_bytes, why, why_len);
    if (rc < 0) goto out;
    hdr_text = json_dumps(hdr, JSON_COMPACT);
    if (!hdr_text) {
        rc = -ENOMEM;
        goto out;
    }
    size_t hlen = strlen(hdr_text), padded = (hlen + 7) & ~(size_t)7;
    if (padded > HEADER_MAX_BYTES) {
        log_why(why, why_len, "safetensors header of %zu bytes is over the %u-byte limit", padded,
                HEADER_MAX_BYTES);
        rc = -EINVAL;
        goto out;
    }
    prefix = malloc(8 + padded);
    if (!prefix) {
        rc = -ENOMEM;
        goto out;
    }
    for (int i = 0; i < 8; i++) prefix[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(prefix + 8, hdr_text, hlen);
    memset(prefix + 8 + hlen, ' ', padded - hlen);
    uint64_t data_start = 8 + (uint64_t)padded;

    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", out_path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = -errno;
        log_why(why, why_len, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    tmp_made = 1;
    if ((rc = pwrite_all(fd, prefix, 8 + padded, 0)) < 0) {
        log_why(why, why_len, "write %s: %s", tmp, strerror(-rc));
        goto out;
    }

    /* Sweep the buffer in windows aligned to W; each window reads the
     * hull of the tensor bytes inside it once and scatters them to their output offsets, so a
     * chunk is decoded once whatever the table order and however tensors straddle chunks. */
    uint64_t lo = UINT64_MAX, hi = 0, written = 0;
    for (size_t i = 0; i < nt; i++) {
        if (!t[i].bytes) continue;
        if (t[i].offset < lo) lo = t[i].offset;
        if (t[i].offset + t[i].bytes > hi) hi = t[i].offset + t[i].bytes;
    }
    if (hi > 0) {
        uint64_t first_w = lo - lo % W;
        win = malloc((size_t)(hi - first_w < W ? hi - first_w : W));
        if (!win) {
            rc = -ENOMEM;
            goto out;
        }
        for (uint64_t w = first_w; w < hi; w += W) {
            uint64_t a = UINT64_MAX, b = 0;
            for (size_t i = 0; i < nt; i++) {
                uint64_t ia = t[i].offset > w ? t[i].offset : w;
                uint64_t ib = t[i].offset + t[i].bytes < w + W ? t[i].offset + t[i].bytes : w + W;
                if (ia >= ib) continue;
                if (ia < a) a = ia;
                if (ib > b) b = ib;
            }
            if (a >= b) continue;
            char bad[512] = "";
            rc = ckpt_snapshot_read(s, bufname, a, b - a, win, bad, sizeof bad);
            if (rc < 0) {
                if (bad[0]) log_why(why, why_len, "%s", bad);
                else
                    log_why(why, why_len, "reading bytes [%llu, %llu) of %s: %s",
                            (unsigned long long)a, (unsigned long long)b, bufname, strerror(-rc));
                goto out;
            }
            for (size_t i = 0; i < nt; i++) {
                uint64_t ia = t[i].offset > a ? t[i].offset : a;
                uint64_t ib = t[i].offset + t[i].bytes < b ? t[i].offset + t[i].bytes : b;
                if (ia >= ib) continue;
                rc = pwrite_all(fd, win + (ia - a), (size_t)(ib - ia),
                                data_start + t[i].out_off + (ia - t[i].offset));
                if (rc < 0) {
                    log_why(why, why_len, "write %s: %s", tmp, strerror(-rc));
                    goto out;
                }
                written += ib - ia;
            }
            if (opts->progress && opts->progress(opts->progress_ctx, written, data_bytes)) {
                rc = -ECANCELED;
                goto out;
            }
        }
    }

    if (fsync(fd)) {
        rc = -errno;
        log_why(why, why_len, "fsync %s: %s", tmp, strerror(errno));
        goto out;
    }
    int cfd = fd;
    fd = -1;
    if (close(cfd)) {
        rc = -errno;
        log_why(why, why_len, "close %s: %s", tmp, strerror(errno));
        goto out;
    }
    if ((rc = commit_rename(tmp, out_path, force)) < 0) {
        if (rc == -EEXIST) log_why(why, why_len, "%s: exists", out_path);
        else log_why(why, why_len, "rename %s to %s: %s", tmp, out_path, strerror(-rc));
        goto out;
    }
    tmp_made = 0;
    parent_of(out_path, dir, sizeof dir);
    if ((rc = store_fsync_dir(dir)) < 0) {
        log_why(why, why_len, "fsync folder %s after renaming %s: %s", dir, out_path,
                strerror(-rc));
        goto out;
    }
    if (stats) {
        stats->tensors = nt;
        stats->data_bytes = data_bytes;
        stats->file_bytes = data_start + data_bytes;
        stats->seconds = clock_now_s() - t0;
    }
out:
    if (fd >= 0) close(fd);
    if (tmp_made) unlink(tmp);
    free(win);
    free(prefix);
    free(hdr_text);
    free(t);
    free(source);
    json_decref(hdr);
    json_decref(trainer);
    return rc;
}
