/* Synchronous snapshot writer: chunk -> filter -> zstd -> xxh3 -> io_uring -> commit. */
#include "ckpt.h"
#include "ckpt_internal.h"
#include "log.h"
#include "storage.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#define TAG "ckpt"

static int mkdir_p(const char *path)
{
    char tmp[CKPT_PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof tmp) return -EINVAL;
    memcpy(tmp, path, n + 1);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -errno;
        *p = '/';
    }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -errno;
    struct stat st;
    if (stat(tmp, &st) != 0) return -errno;
    if (!S_ISDIR(st.st_mode)) return -ENOTDIR;
    return 0;
}

static int check_opts(const ckpt_save_opts *o)
{
    if (!o || !o->dir || !*o->dir) return -EINVAL;
    if (strlen(o->dir) > CKPT_PATH_MAX - 128) return -EINVAL;
    if (o->chunk_bytes < 4096 || o->chunk_bytes > (1ull << 30) || o->chunk_bytes % 16) return -EINVAL;
    if (o->zstd_level < -7 || o->zstd_level > 19) return -EINVAL;
    if (o->filter != CKPT_FILTER_NONE && o->filter != CKPT_FILTER_SHUFFLE) return -EINVAL;
    if (o->queue_depth < 1 || o->queue_depth > 64) return -EINVAL;
    return 0;
}

static int check_buffers(const ckpt_buffer *bufs, size_t nbufs)
{
    for (size_t i = 0; i < nbufs; i++) {
        const ckpt_buffer *b = &bufs[i];
        if (!ckpt_valid_name(b->name) || !ckpt_valid_name(b->dtype)) return -EINVAL;
        if (b->elem_bytes != 1 && b->elem_bytes != 2 && b->elem_bytes != 4 && b->elem_bytes != 8)
            return -EINVAL;
        if (b->bytes && !b->data) return -EINVAL;
        if (b->offset > b->total_bytes || b->bytes > b->total_bytes - b->offset) return -EINVAL;
        if (b->total_bytes % b->elem_bytes || b->offset % b->elem_bytes) return -EINVAL;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(bufs[j].name, b->name)) return -EINVAL;
    }
    return 0;
}

/* Per-save scratch: one zstd context and the bounded buffers it needs. */
typedef struct save_ctx {
    ZSTD_CCtx *cctx;
    uint8_t *filtered; /* chunk_bytes, for the shuffle filter */
    uint8_t *frame;    /* ZSTD_compressBound(chunk_bytes) */
    size_t frame_cap;
    uint64_t step;
    uint64_t raw_done, raw_total; /* bytes handed to the writer so far, and in all */
    int half_reported;
} save_ctx;

/* Write one shard as chunks; append the chunk records to `chunks`. */
static int write_shard(save_ctx *sc, store_writer *w, const ckpt_save_opts *o,
                       const ckpt_buffer *b, json_t *chunks, uint64_t *stored_total)
{
    const uint8_t *src = b->data;
    for (uint64_t done = 0; done < b->bytes;) {
        size_t n = (size_t)(b->bytes - done < o->chunk_bytes ? b->bytes - done : o->chunk_bytes);
        const uint8_t *raw = src + done;
        const uint8_t *in = raw;
        if (o->filter == CKPT_FILTER_SHUFFLE) {
            ckpt_shuffle(sc->filtered, raw, n, b->elem_bytes);
            in = sc->filtered;
        }
        size_t z = ZSTD_compressCCtx(sc->cctx, sc->frame, sc->frame_cap, in, n, o->zstd_level);
        if (ZSTD_isError(z)) {
            LOG_E(TAG, "zstd compression of %s chunk at %llu failed: %s", b->name,
                  (unsigned long long)(b->offset + done), ZSTD_getErrorName(z));
            return -EIO;
        }
        uint64_t file_off = store_writer_offset(w);
        if (sc->raw_done == 0) ckpt_fault_point("before-chunk-write", sc->step);
        int rc = store_writer_append(w, sc->frame, z);
        if (rc < 0) return rc;
        sc->raw_done += n;
        if (!sc->half_reported && sc->raw_done * 2 >= sc->raw_total) {
            sc->half_reported = 1;
            ckpt_fault_point("mid-data", sc->step);
        }
        char hraw[17], hst[17];
        ckpt_hex64(XXH3_64bits(raw, n), hraw);
        ckpt_hex64(XXH3_64bits(sc->frame, z), hst);
        json_t *c = json_pack("{s:I, s:I, s:I, s:I, s:s, s:s, s:s, s:s}",
                              "offset", (json_int_t)(b->offset + done), "bytes", (json_int_t)n,
                              "file_offset", (json_int_t)file_off, "stored_bytes", (json_int_t)z,
                              "codec", "zstd", "filter",
                              o->filter == CKPT_FILTER_SHUFFLE ? "shuffle" : "none",
                              "xxh3_raw", hraw, "xxh3_stored", hst);
        if (!c || json_array_append_new(chunks, c) != 0) return -ENOMEM;
        *stored_total += z;
        done += n;
    }
    return 0;
}

/* The manifest file: the body's compact JSON without its final '}', then the checksum
 * member over exactly those bytes, then "}\n" (docs/FORMAT.md). */
static int write_manifest(const char *path, json_t *body)
{
    char *text = json_dumps(body, JSON_COMPACT | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    if (!text) return -ENOMEM;
    size_t n = strlen(text);
    int rc = -ENOMEM;
    char *file = NULL;
    if (n < 2 || text[n - 1] != '}') {
        rc = -EINVAL;
        goto out;
    }
    n -= 1; /* drop the closing brace */
    char hex[17];
    ckpt_hex64(XXH3_64bits(text, n), hex);
    size_t keylen = strlen(CKPT_MANIFEST_SUM_KEY);
    file = malloc(n + keylen + 16 + 3);
    if (!file) goto out;
    memcpy(file, text, n);
    memcpy(file + n, CKPT_MANIFEST_SUM_KEY, keylen);
    memcpy(file + n + keylen, hex, 16);
    memcpy(file + n + keylen + 16, "\"}\n", 3);
    rc = store_write_file_durable(path, file, n + keylen + 16 + 3);
out:
    free(file);
    free(text);
    return rc;
}

int ckpt_save(const ckpt_save_opts *opts, uint64_t step, const char *run_id,
              const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
              const char *trainer_json, ckpt_save_stats *stats)
{
    int rc = check_opts(opts);
    if (rc < 0) return rc;
    if (!ckpt_valid_name(run_id) || !ckpt_valid_name(config_hash) || (nbufs && !bufs))
        return -EINVAL;
    if ((rc = check_buffers(bufs, nbufs)) < 0) return rc;

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);

    json_error_t jerr;
    json_t *trainer = json_loads(trainer_json ? trainer_json : "{}", 0, &jerr);
    if (!trainer || !json_is_object(trainer)) {
        LOG_E(TAG, "trainer record for step %llu is not a JSON object: %s",
              (unsigned long long)step, trainer ? "not an object" : jerr.text);
        json_decref(trainer);
        return -EINVAL;
    }

    char final_dir[CKPT_PATH_MAX], tmp_dir[CKPT_PATH_MAX], path[CKPT_PATH_MAX], name[32];
    json_t *body = NULL, *jbufs = NULL;
    store_writer *w = NULL;
    save_ctx sc = {0};
    uint64_t raw_total = 0, stored_total = 0;
    int tmp_made = 0;

    if ((rc = mkdir_p(opts->dir)) < 0) {
        LOG_E(TAG, "cannot create snapshot folder %s: %s", opts->dir, strerror(-rc));
        goto out;
    }
    ckpt_step_dirname(step, name, sizeof name);
    if ((rc = ckpt_path_join(final_dir, sizeof final_dir, opts->dir, name)) < 0) goto out;
    struct stat st;
    if (stat(final_dir, &st) == 0) {
        LOG_E(TAG, "snapshot %s already exists; not overwriting it", final_dir);
        rc = -EEXIST;
        goto out;
    }
    char tmp_name[160];
    snprintf(tmp_name, sizeof tmp_name, ".tmp-%s-%s-%ld", name, run_id, (long)getpid());
    if ((rc = ckpt_path_join(tmp_dir, sizeof tmp_dir, opts->dir, tmp_name)) < 0) goto out;
    if (mkdir(tmp_dir, 0755) != 0) {
        rc = -errno;
        LOG_E(TAG, "cannot create %s: %s", tmp_dir, strerror(errno));
        goto out;
    }
    tmp_made = 1;

    sc.cctx = ZSTD_createCCtx();
    sc.frame_cap = ZSTD_compressBound((size_t)opts->chunk_bytes);
    sc.frame = malloc(sc.frame_cap);
    sc.filtered = opts->filter == CKPT_FILTER_SHUFFLE ? malloc((size_t)opts->chunk_bytes) : NULL;
    jbufs = json_array();
    if (!sc.cctx || !sc.frame || (opts->filter == CKPT_FILTER_SHUFFLE && !sc.filtered) || !jbufs) {
        rc = -ENOMEM;
        goto out;
    }

    sc.step = step;
    for (size_t i = 0; i < nbufs; i++) sc.raw_total += bufs[i].bytes;
    const char *file_name = "rank-00000.bin";
    if ((rc = ckpt_path_join(path, sizeof path, tmp_dir, file_name)) < 0) goto out;
    store_writer_opts wo = STORE_WRITER_OPTS_INIT;
    wo.queue_depth = opts->queue_depth;
    wo.direct = opts->direct_io;
    if ((rc = store_writer_open(&w, path, &wo)) < 0) {
        LOG_E(TAG, "cannot create %s: %s", path, strerror(-rc));
        goto out;
    }
    for (size_t i = 0; i < nbufs; i++) {
        const ckpt_buffer *b = &bufs[i];
        json_t *chunks = json_array();
        json_t *jb = json_pack("{s:s, s:s, s:i, s:I, s:[{s:i, s:s, s:I, s:I, s:o}]}", "name", b->name,
                               "dtype", b->dtype, "elem_bytes", (int)b->elem_bytes, "total_bytes",
                               (json_int_t)b->total_bytes, "shards", "rank", 0, "file", file_name,
                               "offset", (json_int_t)b->offset, "bytes", (json_int_t)b->bytes,
                               "chunks", chunks);
        if (!jb || json_array_append_new(jbufs, jb) != 0) {
            rc = -ENOMEM;
            goto out;
        }
        if ((rc = write_shard(&sc, w, opts, b, chunks, &stored_total)) < 0) {
            LOG_E(TAG, "writing %s of step %llu to %s failed: %s", b->name,
                  (unsigned long long)step, path, strerror(-rc));
            goto out;
        }
        raw_total += b->bytes;
    }
    uint64_t file_bytes = store_writer_offset(w);
    rc = store_writer_close(w, 1);
    w = NULL;
    if (rc < 0) {
        LOG_E(TAG, "finishing %s failed: %s", path, strerror(-rc));
        goto out;
    }
    ckpt_fault_point("after-data-fsync", step);

    body = json_pack("{s:s, s:i, s:I, s:I, s:i, s:s, s:s, s:I, s:[{s:s, s:i, s:I}], s:O, s:O}",
                     "format", CKPT_FORMAT_NAME, "format_version", CKPT_FORMAT_VERSION, "step",
                     (json_int_t)step, "created_unix", (json_int_t)time(NULL), "world_size", 1,
                     "run_id", run_id, "config_hash", config_hash, "chunk_bytes",
                     (json_int_t)opts->chunk_bytes, "files", "name", file_name, "rank", 0,
                     "bytes", (json_int_t)file_bytes, "buffers", jbufs, "trainer", trainer);
    if (!body) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = ckpt_path_join(path, sizeof path, tmp_dir, CKPT_MANIFEST_NAME)) < 0) goto out;
    if ((rc = write_manifest(path, body)) < 0) {
        LOG_E(TAG, "writing %s failed: %s", path, strerror(-rc));
        goto out;
    }
    if ((rc = store_fsync_dir(tmp_dir)) < 0) {
        LOG_E(TAG, "fsync of %s failed: %s", tmp_dir, strerror(-rc));
        goto out;
    }
    ckpt_fault_point("after-manifest", step);
    if (rename(tmp_dir, final_dir) != 0) {
        rc = -errno;
        LOG_E(TAG, "commit of step %llu (rename %s -> %s) failed: %s", (unsigned long long)step,
              tmp_dir, final_dir, strerror(-rc));
        goto out;
    }
    tmp_made = 0;
    ckpt_fault_point("after-rename", step);
    if ((rc = store_fsync_dir(opts->dir)) < 0) {
        /* the rename happened; a crash now may or may not keep it, so report the error */
        LOG_E(TAG, "fsync of %s after committing step %llu failed: %s", opts->dir,
              (unsigned long long)step, strerror(-rc));
        goto out;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (stats) {
        stats->raw_bytes = raw_total;
        stats->stored_bytes = stored_total;
        stats->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    rc = 0;
out:
    store_writer_abort(w);
    if (tmp_made) store_remove_tree(tmp_dir);
    ZSTD_freeCCtx(sc.cctx);
    free(sc.frame);
    free(sc.filtered);
    json_decref(body);
    json_decref(jbufs);
    json_decref(trainer);
    return rc;
}

int ckpt_set_aside(const char *dir, const char *name, char *newname, size_t newname_len)
{
    uint64_t step;
    char from[CKPT_PATH_MAX], to[CKPT_PATH_MAX], aside[96];
    if (!dir || !name || ckpt_parse_step_dirname(name, &step) != 0) return -EINVAL;
    snprintf(aside, sizeof aside, "%.40s.corrupt-%lld", name, (long long)time(NULL));
    int rc = ckpt_path_join(from, sizeof from, dir, name);
    if (rc == 0) rc = ckpt_path_join(to, sizeof to, dir, aside);
    if (rc < 0) return rc;
    if (rename(from, to) != 0) {
        rc = -errno;
        LOG_E(TAG, "cannot set %s aside as %s: %s", from, aside, strerror(errno));
        return rc;
    }
    if ((rc = store_fsync_dir(dir)) < 0) return rc;
    if (newname) snprintf(newname, newname_len, "%s", aside);
    return 0;
}

int ckpt_remove_temp(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : -errno;
    int removed = 0, rc = 0;
    struct dirent *e;
    char path[CKPT_PATH_MAX];
    while ((e = readdir(d)) != NULL) {
        uint64_t step;
        if (ckpt_parse_temp_dirname(e->d_name, &step) != 0) continue;
        int r = ckpt_path_join(path, sizeof path, dir, e->d_name);
        if (r == 0) r = store_remove_tree(path);
        if (r < 0) {
            LOG_E(TAG, "cannot remove leftover temp folder %s: %s", path, strerror(-r));
            if (!rc) rc = r;
            continue;
        }
        LOG_I(TAG, "removed leftover temp folder %s (interrupted save of step %llu)", path,
              (unsigned long long)step);
        removed++;
    }
    closedir(d);
    if (removed) {
        int r = store_fsync_dir(dir);
        if (r < 0 && !rc) rc = r;
    }
    return rc < 0 ? rc : removed;
}
