/* The S3 tier of snapshots (ckpt_s3.h): open and read a snapshot from objects, list, remote
 * retention, a verified local copy. The uploader is in ckpt_upload.c. */
#include "ckpt_s3.h"
#include "ckpt_mem.h"
#include "ckpt_internal.h"
#include "ckpt_snap.h"
#include "log.h"
#include "storage.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define TAG "ckpt"
#define PART_META "ckpt-part-bytes"
#define MAX_PARTS 99999u

int ckpt_is_s3_url(const char *path) { return path && !strncmp(path, "s3://", 5); }

/* Parts of a file of `bytes` bytes under the cap (1 when it fits: the file's own name). */
static uint64_t nparts_of(uint64_t bytes, uint64_t part_bytes)
{
    if (part_bytes == 0 || bytes <= part_bytes) return 1;
    return (bytes + part_bytes - 1) / part_bytes;
}

int ckpt_s3_object_key(const objstore *os, uint64_t step, const char *file, uint32_t part,
                       uint32_t nparts, char *out, size_t len)
{
    char d[32];
    ckpt_step_dirname(step, d, sizeof d);
    const char *p = objstore_prefix(os);
    int n;
    if (nparts <= 1)
        n = snprintf(out, len, "%s%s%s/%s", p, *p ? "/" : "", d, file);
    else
        n = snprintf(out, len, "%s%s%s/%s.part-%05u", p, *p ? "/" : "", d, file, part);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

void ckpt_s3_step_url(const objstore *os, uint64_t step, char *out, size_t len)
{
    char d[32];
    ckpt_step_dirname(step, d, sizeof d);
    const char *p = objstore_prefix(os);
    snprintf(out, len, "s3://%s/%s%s%s", objstore_bucket(os), p, *p ? "/" : "", d);
}

/* HEAD every data object of s and compare sizes. */
static int check_objects(ckpt_snapshot *s, uint64_t step, char *why, size_t why_len)
{
    size_t n = 0;
    for (size_t i = 0; i < s->nfiles; i++) {
        uint64_t np = nparts_of(s->files[i].bytes, s->part_bytes);
        if (np > MAX_PARTS) {
            log_why(why, why_len, "data file %s of %" PRIu64 " bytes would be %" PRIu64 " objects "
                    "of %" PRIu64 " bytes, more than the layout allows (%u)", s->files[i].name,
                    s->files[i].bytes, np, s->part_bytes, MAX_PARTS);
            return -EBADMSG;
        }
        n += (size_t)np;
    }
    objstore_op *ops = calloc(n ? n : 1, sizeof *ops);
    char (*keys)[1100] = calloc(n ? n : 1, sizeof *keys);
    uint64_t *want = calloc(n ? n : 1, sizeof *want);
    if (!ops || !keys || !want) {
        free(ops);
        free(keys);
        free(want);
        return -ENOMEM;
    }
    int rc = 0;
    size_t j = 0;
    for (size_t i = 0; i < s->nfiles && rc == 0; i++) {
        uint64_t np = nparts_of(s->files[i].bytes, s->part_bytes);
        for (uint64_t p = 0; p < np && rc == 0; p++, j++) {
            rc = ckpt_s3_object_key(s->os, step, s->files[i].name, (uint32_t)p, (uint32_t)np,
                                    keys[j], sizeof keys[j]);
            ops[j].kind = OBJSTORE_HEAD;
            ops[j].key = keys[j];
            want[j] = np == 1 ? s->files[i].bytes
                              : (p + 1 < np ? s->part_bytes : s->files[i].bytes - p * s->part_bytes);
        }
    }
    if (rc == 0) {
        objstore_run(s->os, ops, n, 0);
        for (j = 0; j < n; j++) {
            if (ops[j].rc == -ENOENT) {
                log_why(why, why_len, "data object %s is missing (the manifest object is there%s)",
                        keys[j], s->part_bytes ? "" : " without the x-amz-meta-ckpt-part-bytes "
                        "metadata: if the files were split into parts, the metadata was lost");
                rc = -EBADMSG;
                break;
            }
            if (ops[j].rc < 0) {
                log_why(why, why_len, "%s", ops[j].why);
                rc = ops[j].rc;
                break;
            }
            if (ops[j].size != want[j]) {
                log_why(why, why_len, "data object %s has %" PRIu64 " bytes, the manifest says %"
                        PRIu64, keys[j], ops[j].size, want[j]);
                rc = -EBADMSG;
                break;
            }
        }
    }
    free(ops);
    free(keys);
    free(want);
    return rc;
}

/* GET and parse the manifest object of `step`; with objects, HEAD the data objects too. */
static int open_s3(ckpt_snapshot **out, objstore *os, uint64_t step, int objects, char *why,
                   size_t why_len)
{
    *out = NULL;
    char url[CKPT_PATH_MAX], key[1100];
    ckpt_s3_step_url(os, step, url, sizeof url);
    ckpt_snapshot *s = ckpt_snapshot_alloc(url);
    if (!s) return -ENOMEM;
    s->os = os;
    s->threads = 8;
    int rc = ckpt_s3_object_key(os, step, CKPT_MANIFEST_NAME, 0, 1, key, sizeof key);
    objstore_op op = {.kind = OBJSTORE_GET, .key = key, .get_max = CKPT_MAX_MANIFEST_BYTES,
                      .meta_name = PART_META};
    if (rc == 0) rc = objstore_run(os, &op, 1, 0);
    if (rc == -ENOENT) {
        log_why(why, why_len, "no manifest object %s: not uploaded, or not complete", key);
    } else if (rc == -EFBIG) {
        log_why(why, why_len, "manifest object %s is larger than the format's limit of %u bytes",
                key, (unsigned)CKPT_MAX_MANIFEST_BYTES);
        rc = -EBADMSG;
    } else if (rc < 0) {
        log_why(why, why_len, "%s", op.why);
    } else {
        s->text = op.get_whole;
        s->text_len = (size_t)op.size;
        op.get_whole = NULL;
        char *end = NULL;
        errno = 0;
        unsigned long long pb = op.meta_value[0] ? strtoull(op.meta_value, &end, 10) : 0;
        if (op.meta_value[0] && (errno || !end || *end || pb < CKPT_S3_PART_BYTES_MIN ||
                                 pb > CKPT_S3_PART_BYTES_MAX)) {
            log_why(why, why_len, "manifest object %s: metadata %s is not a part size in [%llu, "
                    "%llu]", key, PART_META, (unsigned long long)CKPT_S3_PART_BYTES_MIN,
                    (unsigned long long)CKPT_S3_PART_BYTES_MAX);
            rc = -EBADMSG;
        } else {
            s->part_bytes = pb; /* 0: every file is one object */
            rc = ckpt_snapshot_parse_text(s, s->text, s->text_len, why, why_len);
            if (rc == 0 && s->step != step) {
                log_why(why, why_len, "manifest object %s says step %" PRIu64, key, s->step);
                rc = -EBADMSG;
            }
            if (rc == 0 && objects) rc = check_objects(s, step, why, why_len);
        }
    }
    free(op.get_whole);
    if (rc < 0) {
        s->os = NULL;
        ckpt_snapshot_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

int ckpt_snapshot_open_s3(ckpt_snapshot **out, objstore *os, uint64_t step, char *why,
                          size_t why_len)
{
    if (!out || !os) return -EINVAL;
    return open_s3(out, os, step, 1, why, why_len);
}

int ckpt_snapshot_open_any(ckpt_snapshot **out, const char *path, const objstore_opts *sopts,
                           char *why, size_t why_len)
{
    if (!out || !path) return -EINVAL;
    *out = NULL;
    if (ckpt_mem_is_id(path)) {
        const char *prefix = getenv(CKPT_MEM_PATH_ENV);
        if (!prefix || !*prefix) {
            log_why(why, why_len, "%s: no memory tier here (%s is not set)", path, CKPT_MEM_PATH_ENV);
            return -ENOENT;
        }
        return ckpt_mem_snapshot_open(out, prefix, path, why, why_len);
    }
    if (!ckpt_is_s3_url(path)) return ckpt_snapshot_open(out, path, why, why_len);
    char url[CKPT_PATH_MAX];
    snprintf(url, sizeof url, "%s", path);
    size_t n = strlen(url);
    while (n > 5 && url[n - 1] == '/') url[--n] = '\0';
    char *slash = strrchr(url + 5, '/');
    uint64_t step;
    if (!slash || ckpt_parse_step_dirname(slash + 1, &step) != 0) {
        log_why(why, why_len, "%s does not end in a snapshot's step-NNNNNNNNN folder", path);
        return -EINVAL;
    }
    *slash = '\0';
    objstore_opts o = OBJSTORE_OPTS_INIT;
    if (sopts) o = *sopts;
    o.url = url;
    objstore *os;
    int rc = objstore_open(&os, &o, why, why_len);
    if (rc < 0) return rc;
    rc = open_s3(out, os, step, 1, why, why_len);
    if (rc < 0) {
        objstore_close(os);
        return rc;
    }
    (*out)->own_os = 1;
    return 0;
}

const char *ckpt_snapshot_manifest_text(const ckpt_snapshot *s, size_t *len)
{
    if (len) *len = s ? s->text_len : 0;
    return s ? s->text : NULL;
}

int ckpt_s3_read_stored(const ckpt_snapshot *s, uint32_t fi, uint64_t off, uint64_t len,
                        uint8_t *dst, char *bad, size_t bad_len)
{
    const file *f = &s->files[fi];
    if (off > f->bytes || len > f->bytes - off) {
        log_why(bad, bad_len, "%s/%s: bytes [%" PRIu64 ", +%" PRIu64 ") lie past its %" PRIu64
                " bytes", s->path, f->name, off, len, f->bytes);
        return -EBADMSG;
    }
    uint64_t np = nparts_of(f->bytes, s->part_bytes);
    objstore_op ops[4];
    char keys[4][1100];
    size_t n = 0;
    uint64_t at = off, left = len;
    int rc = 0;
    while (left > 0) {
        uint64_t p = np == 1 ? 0 : at / s->part_bytes;
        uint64_t pbase = np == 1 ? 0 : p * s->part_bytes;
        uint64_t pend = np == 1 ? f->bytes : (p + 1 < np ? pbase + s->part_bytes : f->bytes);
        uint64_t take = pend - at < left ? pend - at : left;
        if (n == 4) { /* a chunk over more than 4 parts: read the rest in a second round */
            if ((rc = objstore_run(s->os, ops, n, 0)) < 0) break;
            n = 0;
        }
        if ((rc = ckpt_s3_object_key(s->os, s->step, f->name, (uint32_t)p, (uint32_t)np, keys[n],
                                     sizeof keys[n])) < 0)
            break;
        memset(&ops[n], 0, sizeof ops[n]);
        ops[n].kind = OBJSTORE_GET;
        ops[n].key = keys[n];
        ops[n].get_buf = dst + (at - off);
        ops[n].get_offset = at - pbase;
        ops[n].get_len = take;
        n++;
        at += take;
        left -= take;
    }
    if (rc == 0 && n > 0) rc = objstore_run(s->os, ops, n, 0);
    if (rc < 0) {
        for (size_t i = 0; i < n; i++)
            if (ops[i].rc < 0) {
                log_why(bad, bad_len, "%s", ops[i].why);
                break;
            }
        if (rc == -ENOENT) {
            /* the object went away after the HEAD check: a removal (retention) under us */
            log_why(bad, bad_len, "%s/%s: a data object disappeared while it was read", s->path,
                    f->name);
        }
    }
    return rc;
}

/* ------------------------------------------------------------------ listing */

static int cmp_step(const void *a, const void *b)
{
    const ckpt_entry *x = a, *y = b;
    return x->step < y->step ? -1 : x->step > y->step;
}

int ckpt_list_s3(objstore *os, ckpt_entry **entries, size_t *n, char *why, size_t why_len)
{
    *entries = NULL;
    *n = 0;
    char pfx[1100];
    const char *p = objstore_prefix(os);
    snprintf(pfx, sizeof pfx, "%s%s", p, *p ? "/" : "");
    objstore_entry *le = NULL;
    size_t ln = 0;
    int rc = objstore_list(os, pfx, "/", &le, &ln, 0, why, why_len);
    if (rc < 0) return rc;
    ckpt_entry *v = calloc(ln ? ln : 1, sizeof *v);
    if (!v) {
        objstore_entries_free(le, ln);
        return -ENOMEM;
    }
    size_t cnt = 0;
    for (size_t i = 0; i < ln; i++) {
        if (!le[i].is_prefix) continue;
        const char *name = le[i].key + strlen(pfx);
        char nm[256];
        snprintf(nm, sizeof nm, "%s", name);
        size_t l = strlen(nm);
        if (l && nm[l - 1] == '/') nm[l - 1] = '\0';
        uint64_t step;
        if (ckpt_parse_step_dirname(nm, &step) != 0) continue;
        ckpt_entry *en = &v[cnt++];
        en->step = step;
        snprintf(en->name, sizeof en->name, "%s", nm);
        ckpt_snapshot *s = NULL;
        int r = open_s3(&s, os, step, 0, en->reason, sizeof en->reason);
        if (r == 0) {
            en->status = CKPT_STATUS_COMMITTED;
            en->created = s->created;
            snprintf(en->run_id, sizeof en->run_id, "%s", s->run_id);
            ckpt_snapshot_sizes(s, &en->raw_bytes, &en->stored_bytes);
            en->reason[0] = '\0';
            s->os = NULL;
            ckpt_snapshot_close(s);
        } else if (r == -ENOENT) {
            en->status = CKPT_STATUS_INCOMPLETE;
            snprintf(en->reason, sizeof en->reason, "no manifest object: upload in progress, "
                     "interrupted or being removed");
        } else if (r == -EPROTONOSUPPORT) {
            en->status = CKPT_STATUS_NEWER;
        } else if (r == -EBADMSG) {
            en->status = CKPT_STATUS_CORRUPT;
        } else {
            en->status = CKPT_STATUS_UNREADABLE;
            en->error = r;
        }
    }
    objstore_entries_free(le, ln);
    qsort(v, cnt, sizeof *v, cmp_step);
    *entries = v;
    *n = cnt;
    return 0;
}

/* ------------------------------------------------------------------ retention */

/* Remove one step from S3: the manifest first, then the objects directly in the step folder
 * (not below a deeper "/": those are not the snapshot's, e.g. another job's prefix that is
 * named like a step folder). */
static int remove_step(objstore *os, uint64_t step, char *why, size_t why_len)
{
    char key[1100], pfx[1100];
    int rc = ckpt_s3_object_key(os, step, CKPT_MANIFEST_NAME, 0, 1, key, sizeof key);
    if (rc < 0) return rc;
    objstore_op op = {.kind = OBJSTORE_DELETE, .key = key};
    if ((rc = objstore_run(os, &op, 1, 0)) < 0) {
        log_why(why, why_len, "%s", op.why);
        return rc;
    }
    ckpt_fault_point("during-remote-retention", step);
    size_t kl = strlen(key) - strlen(CKPT_MANIFEST_NAME);
    memcpy(pfx, key, kl);
    pfx[kl] = '\0';
    objstore_entry *le = NULL;
    size_t ln = 0;
    if ((rc = objstore_list(os, pfx, "/", &le, &ln, 0, why, why_len)) < 0) return rc;
    objstore_op *ops = calloc(ln ? ln : 1, sizeof *ops);
    if (!ops) {
        objstore_entries_free(le, ln);
        return -ENOMEM;
    }
    size_t nops = 0;
    for (size_t i = 0; i < ln; i++) {
        if (le[i].is_prefix) continue;
        ops[nops].kind = OBJSTORE_DELETE;
        ops[nops].key = le[i].key;
        nops++;
    }
    rc = nops ? objstore_run(os, ops, nops, 0) : 0;
    for (size_t i = 0; rc < 0 && i < nops; i++)
        if (ops[i].rc < 0) {
            log_why(why, why_len, "%s", ops[i].why);
            break;
        }
    free(ops);
    objstore_entries_free(le, ln);
    return rc;
}

int ckpt_s3_retain(objstore *os, unsigned keep_last, const char *run_id, char *why,
                   size_t why_len)
{
    if (!os || keep_last < 1) return -EINVAL;
    ckpt_entry *e;
    size_t n;
    int rc = ckpt_list_s3(os, &e, &n, why, why_len);
    if (rc < 0) return rc;
    /* the oldest step kept: the keep_last-th newest committed one of the lineage */
    unsigned seen = 0;
    uint64_t oldest_kept = 0;
    int have = 0;
    for (size_t i = n; i-- > 0;) {
        if (e[i].status != CKPT_STATUS_COMMITTED) continue;
        if (run_id && strcmp(e[i].run_id, run_id) != 0) continue;
        if (++seen <= keep_last) {
            oldest_kept = e[i].step;
            have = 1;
        }
    }
    /* folders without a lineage (incomplete, corrupt) go only when the prefix holds no other
     * lineage: they may be another run's upload in progress */
    int others = 0;
    for (size_t i = 0; run_id && i < n; i++)
        others |= e[i].status == CKPT_STATUS_COMMITTED && strcmp(e[i].run_id, run_id) != 0;
    int removed = 0;
    for (size_t i = 0; have && i < n && e[i].step < oldest_kept; i++) {
        if (e[i].status == CKPT_STATUS_UNREADABLE || e[i].status == CKPT_STATUS_NEWER) continue;
        if (e[i].status == CKPT_STATUS_COMMITTED && run_id && strcmp(e[i].run_id, run_id) != 0)
            continue; /* another lineage's */
        if (e[i].status != CKPT_STATUS_COMMITTED && others) continue;
        char w[320] = "";
        /* said before the first DELETE, so that a process killed during the removal (or
         * before the line after it) leaves a log that accounts for the step: S3 has no rename,
         * and nothing finishes an interrupted removal but the next pass (the step is then
         * incomplete, or still whole when the manifest's DELETE did not happen) */
        LOG_I(TAG, "remote retention: removing %s (%s) from s3://%s/%s", e[i].name,
              ckpt_status_name(e[i].status), objstore_bucket(os), objstore_prefix(os));
        int r = remove_step(os, e[i].step, w, sizeof w);
        if (r < 0) {
            LOG_W(TAG, "remote retention: could not remove %s: %s (the next pass retries)",
                  e[i].name, w[0] ? w : strerror(-r));
            continue;
        }
        LOG_I(TAG, "remote retention: removed %s", e[i].name);
        removed++;
    }
    free(e);
    return removed;
}

/* ------------------------------------------------------------------ local copy */

typedef struct span {
    uint64_t off, len, xxh;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

int ckpt_s3_copy_begin(ckpt_snapshot *s, const char *tmpdir)
{
    if (!s || !s->os || !tmpdir || s->copy_fds) return -EINVAL;
    if (mkdir(tmpdir, 0755) != 0 && errno != EEXIST) return -errno;
    int *fds = malloc((s->nfiles ? s->nfiles : 1) * sizeof *fds);
    if (!fds) return -ENOMEM;
    for (size_t i = 0; i < s->nfiles; i++) {
        char path[CKPT_PATH_MAX];
        fds[i] = ckpt_path_join(path, sizeof path, tmpdir, s->files[i].name) < 0 ? -1
                 : open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    }
    s->copy_fds = fds;
    return 0;
}

void ckpt_s3_copy_chunk(const ckpt_snapshot *s, uint32_t fi, uint64_t off, const uint8_t *p,
                        uint64_t len)
{
    int fd = s->copy_fds[fi];
    for (uint64_t done = 0; fd >= 0 && done < len;) {
        ssize_t w = pwrite(fd, p + done, (size_t)(len - done), (off_t)(off + done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return; /* the copy pass fetches it again */
        done += (uint64_t)w;
    }
}

static int copy_file(ckpt_snapshot *s, uint32_t fi, const char *tmpdir, uint64_t *fetched_out,
                     char *why, size_t why_len)
{
    const file *f = &s->files[fi];
    size_t nk = 0;
    for (size_t b = 0; b < s->nbuffers; b++)
        for (size_t c = 0; c < s->buffers[b].nchunks; c++) nk += s->buffers[b].chunks[c].file == fi;
    span *sp = calloc(nk ? nk : 1, sizeof *sp);
    uint8_t *buf = malloc(s->max_stored ? s->max_stored : 1);
    char path[CKPT_PATH_MAX];
    int rc = ckpt_path_join(path, sizeof path, tmpdir, f->name);
    if (!sp || !buf) rc = -ENOMEM;
    int fd = -1;
    if (rc == 0) {
        /* the file may hold chunks the restore already fetched (ckpt_s3_copy_begin) */
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0) {
            rc = -errno;
            log_why(why, why_len, "cannot create %s: %s", path, strerror(errno));
        }
    }
    uint64_t reused = 0, fetched = 0;
    size_t k = 0;
    for (size_t b = 0; rc == 0 && b < s->nbuffers; b++)
        for (size_t c = 0; c < s->buffers[b].nchunks; c++) {
            const chunk *ch = &s->buffers[b].chunks[c];
            if (ch->file == fi) sp[k++] = (span){ch->file_offset, ch->stored_bytes, ch->xxh_stored};
        }
    if (rc == 0) qsort(sp, nk, sizeof *sp, cmp_span);
    for (size_t i = 0; rc == 0 && i < nk; i++) {
        ssize_t got = pread(fd, buf, (size_t)sp[i].len, (off_t)sp[i].off);
        if (got == (ssize_t)sp[i].len && XXH3_64bits(buf, (size_t)sp[i].len) == sp[i].xxh) {
            reused += sp[i].len; /* written by a restore read, and still good */
            continue;
        }
        fetched += sp[i].len;
        if ((rc = ckpt_s3_read_stored(s, fi, sp[i].off, sp[i].len, buf, why, why_len)) < 0) break;
        if (XXH3_64bits(buf, (size_t)sp[i].len) != sp[i].xxh) {
            log_why(why, why_len, "%s/%s: the stored bytes at offset %" PRIu64 " do not match "
                    "their checksum", s->path, f->name, sp[i].off);
            rc = -EBADMSG;
            break;
        }
        uint64_t done = 0;
        while (done < sp[i].len) {
            ssize_t w = pwrite(fd, buf + done, (size_t)(sp[i].len - done), (off_t)(sp[i].off + done));
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                rc = w < 0 ? -errno : -EIO;
                log_why(why, why_len, "cannot write %s: %s", path, strerror(-rc));
                break;
            }
            done += (uint64_t)w;
        }
    }
    if (rc == 0) LOG_D(TAG, "local copy of %s/%s: %" PRIu64 " bytes from the restore's reads, %"
                       PRIu64 " fetched", s->path, f->name, reused, fetched);
    *fetched_out += fetched;
    if (rc == 0 && ftruncate(fd, (off_t)f->bytes) != 0) rc = -errno;
    if (rc == 0 && fsync(fd) != 0) {
        rc = -errno;
        log_why(why, why_len, "cannot fsync %s: %s", path, strerror(-rc));
    }
    if (fd >= 0 && close(fd) != 0 && rc == 0) rc = -errno;
    free(sp);
    free(buf);
    return rc;
}

int ckpt_s3_copy_files(ckpt_snapshot *s, const char *tmpdir, uint32_t part, uint32_t nparts,
                       uint64_t *fetched, char *why, size_t why_len)
{
    uint64_t dummy = 0;
    if (!fetched) fetched = &dummy;
    *fetched = 0;
    if (!s || !s->os || !tmpdir || nparts == 0 || part >= nparts) return -EINVAL;
    for (size_t f = part; f < s->nfiles; f += nparts) {
        int rc = copy_file(s, (uint32_t)f, tmpdir, fetched, why, why_len);
        if (rc < 0) return rc;
    }
    return 0;
}

int ckpt_s3_commit_local(ckpt_snapshot *s, const char *tmpdir, const char *dir)
{
    if (!s || !s->text || !tmpdir || !dir) return -EINVAL;
    char mp[CKPT_PATH_MAX], final[CKPT_PATH_MAX], d[32];
    int rc = ckpt_path_join(mp, sizeof mp, tmpdir, CKPT_MANIFEST_NAME);
    ckpt_step_dirname(s->step, d, sizeof d);
    if (rc == 0) rc = ckpt_path_join(final, sizeof final, dir, d);
    if (rc < 0) return rc;
    if ((rc = store_write_file_durable(mp, s->text, s->text_len)) < 0) return rc;
    if ((rc = store_fsync_dir(tmpdir)) < 0) return rc;
    if (renameat2(AT_FDCWD, tmpdir, AT_FDCWD, final, RENAME_NOREPLACE) != 0) return -errno;
    return store_fsync_dir(dir);
}
