/* Snapshot reader: manifest validation, range reads with checksums, verify, listing. */
#include "ckpt.h"
#include "ckpt_internal.h"
#include "ckpt_snap.h"
#include "ckpt_s3.h"
#include "log.h"
#include "storage.h"
#include "thread.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>
#include <zstd.h>
#include <unistd.h>

#define TAG "ckpt"

static void rctx_free(rctx *c, size_t nfiles);

void ckpt_snapshot_close(ckpt_snapshot *s)
{
    if (!s) return;
    for (size_t i = 0; i < s->nfiles; i++) free(s->files[i].name);
    for (size_t i = 0; i < s->nbuffers; i++) {
        free(s->buffers[i].name);
        free(s->buffers[i].dtype);
        free(s->buffers[i].chunks);
    }
    free(s->files);
    free(s->buffers);
    free(s->run_id);
    free(s->config_hash);
    free(s->trainer_json);
    for (unsigned t = 0; s->ctx && t < s->threads; t++) rctx_free(&s->ctx[t], s->nfiles);
    free(s->ctx);
    free(s->text);
    for (size_t i = 0; s->copy_fds && i < s->nfiles; i++)
        if (s->copy_fds[i] >= 0) close(s->copy_fds[i]);
    free(s->copy_fds);
    if (s->own_os) objstore_close(s->os);
    if (s->src_close) s->src_close(s->src_ctx);
    free(s);
}

/* Non-negative integer member, or -1. */
static int64_t get_u(const json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v)) return -1;
    json_int_t x = json_integer_value(v);
    return x < 0 ? -1 : (int64_t)x;
}

static const char *get_s(const json_t *o, const char *key)
{
    return json_string_value(json_object_get(o, key));
}

static int cmp_chunk(const void *a, const void *b)
{
    const chunk *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Check the manifest's checksum member (docs/FORMAT.md) over the raw file bytes: the file
 * ends with the member's key, exactly 16 lowercase hex digits, '"}' and a newline (which may
 * be missing: JSON tools often drop it); nothing else may follow. */
static int check_manifest_sum(const char *text, size_t len, char *why, size_t why_len)
{
    const char *key = CKPT_MANIFEST_SUM_KEY;
    size_t klen = strlen(key);
    if (memchr(text, '\0', len)) {
        log_why(why, why_len, "manifest contains a NUL byte");
        return -EBADMSG;
    }
    size_t tlen = len > 0 && text[len - 1] == '\n' ? 3 : 2; /* '"}' and the newline */
    if (len < klen + 16 + tlen || memcmp(text + len - klen - 16 - tlen, key, klen) != 0 ||
        memcmp(text + len - tlen, "\"}\n", tlen) != 0) {
        log_why(why, why_len, "manifest does not end with its manifest_xxh3 member (16 hex "
                "digits, '\"}', a newline)");
        return -EBADMSG;
    }
    const char *last = text + len - klen - 16 - tlen, *hex = last + klen;
    char tmp[17];
    memcpy(tmp, hex, 16);
    tmp[16] = '\0';
    uint64_t want;
    if (ckpt_parse_hex64(tmp, &want) < 0) {
        log_why(why, why_len, "manifest checksum is not 16 lowercase hex digits");
        return -EBADMSG;
    }
    uint64_t got = XXH3_64bits(text, (size_t)(last - text));
    if (got != want) {
        log_why(why, why_len, "manifest checksum mismatch (stored %016llx, computed %016llx)",
                (unsigned long long)want, (unsigned long long)got);
        return -EBADMSG;
    }
    return 0;
}

/* An upper bound of the JSON values in text: one per ',' '[' '{' ':' outside strings, plus
 * one. O(n), no allocation: it bounds what the parser would allocate (each value costs the
 * parser tens of bytes, so tiny values would otherwise make a manifest under the byte limit
 * cost gigabytes). */
static size_t json_values_upper_bound(const char *text, size_t len)
{
    size_t n = 1;
    int in_string = 0;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (in_string) {
            if (c == '\\') i++;
            else if (c == '"') in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c == ',' || c == '[' || c == '{' || c == ':') {
            n++;
        }
    }
    return n;
}

/* A failure to open or inspect a file of the snapshot: evidence about the folder's contents
 * (missing, wrong type) is corruption; anything else (EMFILE, EACCES, EIO, ...) says nothing
 * about the bytes and is passed on as it is (DESIGN I7). */
static int file_error(int rc)
{
    switch (rc) {
    case -ENOENT: case -ENOTDIR: case -EISDIR: case -ELOOP: case -ENODEV: case -EFBIG:
        return -EBADMSG;
    default:
        return rc;
    }
}

static const char *file_error_text(int rc)
{
    switch (rc) {
    case -ENOENT: return "is missing";
    case -ENOTDIR: case -EISDIR: case -ELOOP: case -ENODEV: return "is not a regular file";
    default: return strerror(-rc);
    }
}

/* The snapshot folder is gone (renamed by retention or a set-aside while it was read): a
 * missing file then says nothing about the bytes. */
static int folder_gone(const char *path)
{
    struct stat st;
    return lstat(path, &st) != 0 && errno == ENOENT;
}

/* a + b into *sum; -1 on overflow */
static int add_u64(uint64_t a, uint64_t b, uint64_t *sum)
{
    return __builtin_add_overflow(a, b, sum) ? -1 : 0;
}

static int parse_chunks(ckpt_snapshot *s, buffer *b, const json_t *jshards,
                        const uint32_t *rank_file, size_t *nchunks_all, char *why,
                        size_t why_len)
{
    size_t n = 0, i, j;
    json_t *sh;
    json_array_foreach(jshards, i, sh) {
        json_t *cs = json_object_get(sh, "chunks");
        if (!json_is_array(cs)) {
            log_why(why, why_len, "buffer %s: shard %zu has no chunk list", b->name, i);
            return -EBADMSG;
        }
        n += json_array_size(cs);
        if (n > CKPT_MAX_CHUNKS - *nchunks_all) {
            log_why(why, why_len, "more than %u chunks in all (the format's limit)",
                    (unsigned)CKPT_MAX_CHUNKS);
            return -EBADMSG;
        }
    }
    *nchunks_all += n;
    b->chunks = calloc(n ? n : 1, sizeof *b->chunks);
    if (!b->chunks) return -ENOMEM;
    b->nchunks = 0;
    json_array_foreach(jshards, i, sh) {
        const char *fname = get_s(sh, "file");
        int64_t soff = get_u(sh, "offset"), sbytes = get_u(sh, "bytes"), srank = get_u(sh, "rank");
        uint32_t fidx = srank >= 0 && srank < (int64_t)s->world_size ? rank_file[srank] : UINT32_MAX;
        uint64_t send;
        if (fidx == UINT32_MAX || !fname || strcmp(s->files[fidx].name, fname) != 0 || soff < 0 ||
            sbytes < 0 || add_u64((uint64_t)soff, (uint64_t)sbytes, &send) < 0 ||
            send > b->total_bytes) {
            log_why(why, why_len, "buffer %s: shard %zu names an unknown rank or file, lacks "
                    "offset/bytes, or lies outside the buffer", b->name, i);
            return -EBADMSG;
        }
        uint64_t expect = (uint64_t)soff;
        json_t *c;
        json_array_foreach(json_object_get(sh, "chunks"), j, c) {
            chunk *k = &b->chunks[b->nchunks];
            int64_t off = get_u(c, "offset"), bytes = get_u(c, "bytes");
            int64_t foff = get_u(c, "file_offset"), sb = get_u(c, "stored_bytes");
            const char *codec = get_s(c, "codec"), *filter = get_s(c, "filter");
            uint64_t fend;
            if (off < 0 || bytes <= 0 || foff < 0 || sb < 0 || !codec || !filter ||
                ckpt_parse_hex64(get_s(c, "xxh3_raw"), &k->xxh_raw) < 0 ||
                ckpt_parse_hex64(get_s(c, "xxh3_stored"), &k->xxh_stored) < 0) {
                log_why(why, why_len, "buffer %s: chunk %zu of %s is malformed", b->name, j, fname);
                return -EBADMSG;
            }
            if (!strcmp(codec, "zstd")) k->codec_zstd = 1;
            else if (!strcmp(codec, "none")) k->codec_zstd = 0;
            else {
                log_why(why, why_len, "buffer %s: chunk %zu of %s has unknown codec '%s'", b->name,
                        j, fname, codec);
                return -EBADMSG;
            }
            if (!strcmp(filter, "none")) k->filter = CKPT_FILTER_NONE;
            else if (!strcmp(filter, "shuffle")) k->filter = CKPT_FILTER_SHUFFLE;
            else {
                log_why(why, why_len, "buffer %s: chunk %zu of %s has unknown filter '%s'", b->name,
                        j, fname, filter);
                return -EBADMSG;
            }
            if ((uint64_t)bytes > s->chunk_max) {
                log_why(why, why_len, "buffer %s: chunk %zu of %s has %lld bytes, more than "
                        "chunk_bytes", b->name, j, fname, (long long)bytes);
                return -EBADMSG;
            }
            /* the stored size is bounded by the raw size, so that no manifest makes a reader
             * allocate more than the chunk can need (a sparse file is long but says nothing) */
            if (k->codec_zstd ? (uint64_t)sb > ZSTD_compressBound((size_t)bytes) || sb == 0
                              : sb != bytes || k->filter != CKPT_FILTER_NONE) {
                log_why(why, why_len, "buffer %s: chunk %zu of %s: %lld stored bytes for %lld raw "
                        "bytes is impossible for codec %s, filter %s", b->name, j, fname,
                        (long long)sb, (long long)bytes, codec, filter);
                return -EBADMSG;
            }
            if ((uint64_t)off != expect) {
                log_why(why, why_len, "buffer %s: chunk %zu of %s does not follow its predecessor",
                        b->name, j, fname);
                return -EBADMSG;
            }
            if (add_u64((uint64_t)foff, (uint64_t)sb, &fend) < 0 || fend > s->files[fidx].bytes) {
                log_why(why, why_len, "buffer %s: chunk %zu lies past the end of %s (%llu bytes)",
                        b->name, j, fname, (unsigned long long)s->files[fidx].bytes);
                return -EBADMSG;
            }
            k->offset = (uint64_t)off;
            k->bytes = (uint64_t)bytes;
            k->file_offset = (uint64_t)foff;
            k->stored_bytes = (uint64_t)sb;
            k->file = fidx;
            k->index = (uint32_t)j;
            if (add_u64(expect, (uint64_t)bytes, &expect) < 0 || expect > send) {
                log_why(why, why_len, "buffer %s: chunks of shard %zu run past its %lld bytes",
                        b->name, i, (long long)sbytes);
                return -EBADMSG;
            }
            if (k->stored_bytes > s->max_stored) s->max_stored = k->stored_bytes;
            if (k->bytes > s->max_raw) s->max_raw = k->bytes;
            b->nchunks++;
        }
        if (expect != send) {
            log_why(why, why_len, "buffer %s: chunks of shard %zu do not add up to its %lld bytes",
                    b->name, i, (long long)sbytes);
            return -EBADMSG;
        }
    }
    qsort(b->chunks, b->nchunks, sizeof *b->chunks, cmp_chunk);
    uint64_t pos = 0;
    for (i = 0; i < b->nchunks; i++) {
        if (b->chunks[i].offset != pos) break;
        pos += b->chunks[i].bytes; /* <= the shard's end, checked above */
    }
    if (i != b->nchunks || pos != b->total_bytes) {
        log_why(why, why_len, "buffer %s: shards do not cover its %llu bytes exactly once", b->name,
                (unsigned long long)b->total_bytes);
        return -EBADMSG;
    }
    return 0;
}

/* Check data file `name` of the snapshot: it must exist as a regular file (not a link) of
 * exactly `bytes` bytes. */
static int check_data_file(const ckpt_snapshot *s, const char *name, uint64_t bytes, char *why,
                           size_t why_len)
{
    char p[CKPT_PATH_MAX];
    struct stat st;
    if (s->os) return 0; /* S3: the objects are HEAD-checked after parsing (ckpt_s3.c) */
    if (ckpt_path_join(p, sizeof p, s->path, name) < 0) return -ENAMETOOLONG;
    if (lstat(p, &st) != 0) {
        int rc = -errno;
        if (rc == -ENOENT && folder_gone(s->path)) {
            log_why(why, why_len, "the snapshot folder was removed while it was read");
            return -ENOENT;
        }
        log_why(why, why_len, "data file %s %s", p, file_error_text(rc));
        return file_error(rc);
    }
    if (!S_ISREG(st.st_mode)) {
        log_why(why, why_len, "data file %s is not a regular file", p);
        return -EBADMSG;
    }
    if ((uint64_t)st.st_size != bytes) {
        log_why(why, why_len, "data file %s has %lld bytes, manifest says %llu", p,
                (long long)st.st_size, (unsigned long long)bytes);
        return -EBADMSG;
    }
    return 0;
}

static int cmp_name_index(const void *a, const void *b, void *arg)
{
    const buffer *bufs = arg;
    return strcmp(bufs[*(const size_t *)a].name, bufs[*(const size_t *)b].name);
}

/* Buffer names must be unique: sort an index by name and compare neighbours (n log n; a
 * pairwise check took minutes on a large manifest). */
static int check_unique_buffers(const ckpt_snapshot *s, char *why, size_t why_len)
{
    if (s->nbuffers < 2) return 0;
    size_t *idx = malloc(s->nbuffers * sizeof *idx);
    if (!idx) return -ENOMEM;
    for (size_t i = 0; i < s->nbuffers; i++) idx[i] = i;
    qsort_r(idx, s->nbuffers, sizeof *idx, cmp_name_index, s->buffers);
    int rc = 0;
    for (size_t i = 1; i < s->nbuffers && rc == 0; i++)
        if (!strcmp(s->buffers[idx[i - 1]].name, s->buffers[idx[i]].name)) {
            log_why(why, why_len, "buffer %s appears twice", s->buffers[idx[i]].name);
            rc = -EBADMSG;
        }
    free(idx);
    return rc;
}

static int parse_manifest(ckpt_snapshot *s, const json_t *m, char *why, size_t why_len)
{
    const char *fmt = get_s(m, "format");
    int64_t ver = get_u(m, "format_version");
    if (!fmt || strcmp(fmt, CKPT_FORMAT_NAME) != 0 || ver < 1) {
        log_why(why, why_len, "not a %s manifest", CKPT_FORMAT_NAME);
        return -EBADMSG;
    }
    if (ver > CKPT_FORMAT_VERSION) {
        log_why(why, why_len, "format_version %lld is newer than this program reads (%d)",
                (long long)ver, CKPT_FORMAT_VERSION);
        return -EPROTONOSUPPORT;
    }
    int64_t step = get_u(m, "step"), ws = get_u(m, "world_size"), created = get_u(m, "created_unix");
    const char *run_id = get_s(m, "run_id"), *chash = get_s(m, "config_hash");
    json_t *jfiles = json_object_get(m, "files"), *jbufs = json_object_get(m, "buffers");
    json_t *trainer = json_object_get(m, "trainer");
    int64_t chunk_max = get_u(m, "chunk_bytes");
    if (step < 0 || ws < 1 || !run_id || !chash || !json_is_array(jfiles) ||
        !json_is_array(jbufs) || !json_is_object(trainer)) {
        log_why(why, why_len, "manifest lacks step, world_size, run_id, config_hash, files, "
                              "buffers or trainer");
        return -EBADMSG;
    }
    if (ws > CKPT_MAX_WORLD_SIZE || json_array_size(jfiles) != (size_t)ws ||
        json_array_size(jbufs) > CKPT_MAX_BUFFERS) {
        log_why(why, why_len, "world_size %lld with %zu data files and %zu buffers: a snapshot of "
                "W ranks has W data files, and the format allows %u ranks and %u buffers",
                (long long)ws, json_array_size(jfiles), json_array_size(jbufs),
                (unsigned)CKPT_MAX_WORLD_SIZE, (unsigned)CKPT_MAX_BUFFERS);
        return -EBADMSG;
    }
    if (!ckpt_valid_name(run_id) || !ckpt_valid_name(chash)) {
        log_why(why, why_len, "run_id or config_hash is not 1-63 characters of [A-Za-z0-9_.-]");
        return -EBADMSG;
    }
    if (chunk_max < 4096 || chunk_max > (1ll << 30)) {
        log_why(why, why_len, "chunk_bytes %lld is outside [4096, 2^30]", (long long)chunk_max);
        return -EBADMSG;
    }
    /* the folder's name, when it names a step, must name this one */
    char base[256];
    ckpt_folder_name(s->path, base, sizeof base);
    uint64_t named;
    if ((ckpt_parse_step_dirname(base, &named) == 0 || ckpt_parse_aside_dirname(base, &named) == 0) &&
        named != (uint64_t)step) {
        log_why(why, why_len, "manifest says step %lld but the folder is %s", (long long)step, base);
        return -EBADMSG;
    }
    s->chunk_max = (uint64_t)chunk_max;
    s->step = (uint64_t)step;
    s->world_size = (uint32_t)ws;
    s->created = created < 0 ? 0 : created;
    s->run_id = strdup(run_id);
    s->config_hash = strdup(chash);
    s->trainer_json = json_dumps(trainer, JSON_COMPACT | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    if (!s->run_id || !s->config_hash || !s->trainer_json) return -ENOMEM;
    if (strlen(s->trainer_json) > CKPT_MAX_TRAINER_BYTES) {
        log_why(why, why_len, "trainer record of %zu bytes is over the format's limit (%u)",
                strlen(s->trainer_json), (unsigned)CKPT_MAX_TRAINER_BYTES);
        return -EBADMSG;
    }

    /* files: exactly the names the format defines, rank-<5 digits>.bin of their own rank, at
     * most one per rank; rank_file maps a rank to its file (UINT32_MAX: none) */
    int rc = 0;
    uint32_t *rank_file = malloc((size_t)ws * sizeof *rank_file);
    if (!rank_file) return -ENOMEM;
    memset(rank_file, 0xff, (size_t)ws * sizeof *rank_file);
    s->nfiles = json_array_size(jfiles);
    s->files = calloc(s->nfiles ? s->nfiles : 1, sizeof *s->files);
    if (!s->files) {
        rc = -ENOMEM;
        goto out;
    }
    size_t i;
    json_t *jf;
    json_array_foreach(jfiles, i, jf) {
        const char *name = get_s(jf, "name");
        int64_t bytes = get_u(jf, "bytes");
        int64_t frank = get_u(jf, "rank");
        char want[32];
        if (frank >= 0) ckpt_rank_filename((uint32_t)frank, want, sizeof want);
        if (!name || bytes < 0 || frank < 0 || frank >= ws || strcmp(name, want) != 0) {
            log_why(why, why_len, "file entry %zu is malformed (name rank-<5 digits>.bin of its "
                    "rank, bytes, rank in [0, %lld))", i, (long long)ws);
            rc = -EBADMSG;
            goto out;
        }
        if (rank_file[frank] != UINT32_MAX) {
            log_why(why, why_len, "data file %s is listed twice", name);
            rc = -EBADMSG;
            goto out;
        }
        if ((rc = check_data_file(s, name, (uint64_t)bytes, why, why_len)) < 0) goto out;
        s->files[i].name = strdup(name);
        if (!s->files[i].name) {
            rc = -ENOMEM;
            goto out;
        }
        s->files[i].bytes = (uint64_t)bytes;
        rank_file[frank] = (uint32_t)i;
    }

    s->nbuffers = json_array_size(jbufs);
    s->buffers = calloc(s->nbuffers ? s->nbuffers : 1, sizeof *s->buffers);
    if (!s->buffers) {
        rc = -ENOMEM;
        goto out;
    }
    size_t nchunks_all = 0;
    json_t *jb;
    json_array_foreach(jbufs, i, jb) {
        buffer *b = &s->buffers[i];
        const char *name = get_s(jb, "name"), *dtype = get_s(jb, "dtype");
        int64_t eb = get_u(jb, "elem_bytes"), total = get_u(jb, "total_bytes");
        json_t *shards = json_object_get(jb, "shards");
        if (!name || !ckpt_valid_name(name) || !ckpt_valid_name(dtype) ||
            !(eb == 1 || eb == 2 || eb == 4 || eb == 8) || total < 0 || total % eb != 0 ||
            !json_is_array(shards)) {
            log_why(why, why_len, "buffer entry %zu is malformed", i);
            rc = -EBADMSG;
            goto out;
        }
        b->name = strdup(name);
        b->dtype = strdup(dtype);
        if (!b->name || !b->dtype) {
            rc = -ENOMEM;
            goto out;
        }
        b->elem_bytes = (uint32_t)eb;
        b->total_bytes = (uint64_t)total;
        if ((rc = parse_chunks(s, b, shards, rank_file, &nchunks_all, why, why_len)) < 0) goto out;
    }
    rc = check_unique_buffers(s, why, why_len);
out:
    free(rank_file);
    return rc;
}

uint64_t ckpt_snapshot_step(const ckpt_snapshot *s) { return s->step; }
uint32_t ckpt_snapshot_world_size(const ckpt_snapshot *s) { return s->world_size; }
const char *ckpt_snapshot_run_id(const ckpt_snapshot *s) { return s->run_id; }
const char *ckpt_snapshot_config_hash(const ckpt_snapshot *s) { return s->config_hash; }
const char *ckpt_snapshot_path(const ckpt_snapshot *s) { return s->path; }
int64_t ckpt_snapshot_created(const ckpt_snapshot *s) { return s->created; }
const char *ckpt_snapshot_trainer_json(const ckpt_snapshot *s) { return s->trainer_json; }

static buffer *find_buffer(const ckpt_snapshot *s, const char *name)
{
    for (size_t i = 0; i < s->nbuffers; i++)
        if (!strcmp(s->buffers[i].name, name)) return &s->buffers[i];
    return NULL;
}

int64_t ckpt_snapshot_buffer_bytes(const ckpt_snapshot *s, const char *name)
{
    buffer *b = name ? find_buffer(s, name) : NULL;
    return b ? (int64_t)b->total_bytes : -ENOENT;
}

size_t ckpt_snapshot_nbuffers(const ckpt_snapshot *s) { return s->nbuffers; }

int ckpt_snapshot_buffer_info(const ckpt_snapshot *s, size_t i, ckpt_buffer_info *info)
{
    if (i >= s->nbuffers || !info) return -EINVAL;
    const buffer *b = &s->buffers[i];
    info->name = b->name;
    info->dtype = b->dtype;
    info->elem_bytes = b->elem_bytes;
    info->total_bytes = b->total_bytes;
    info->nchunks = b->nchunks;
    info->stored_bytes = 0;
    for (size_t j = 0; j < b->nchunks; j++) info->stored_bytes += b->chunks[j].stored_bytes;
    return 0;
}

void ckpt_snapshot_sizes(const ckpt_snapshot *s, uint64_t *raw_bytes, uint64_t *stored_bytes)
{
    uint64_t r = 0, st = 0;
    for (size_t i = 0; i < s->nbuffers; i++)
        for (size_t j = 0; j < s->buffers[i].nchunks; j++) {
            r += s->buffers[i].chunks[j].bytes;
            st += s->buffers[i].chunks[j].stored_bytes;
        }
    if (raw_bytes) *raw_bytes = r;
    if (stored_bytes) *stored_bytes = st;
}

static void rctx_free(rctx *c, size_t nfiles)
{
    if (!c) return;
    ZSTD_freeDCtx(c->dctx);
    for (int j = 0; j < CKPT_READ_SLOTS; j++) {
        free(c->stored[j]);
        free(c->raw[j]);
    }
    free(c->filt);
    for (size_t i = 0; c->readers && i < CKPT_READ_SLOTS * nfiles; i++) store_reader_close(c->readers[i]);
    free(c->readers);
}

static int ensure_read_state(ckpt_snapshot *s)
{
    if (s->ctx) return 0;
    s->ctx = calloc(s->threads, sizeof *s->ctx);
    if (!s->ctx) return -ENOMEM;
    int ok = 1;
    for (unsigned t = 0; t < s->threads && ok; t++) {
        rctx *c = &s->ctx[t];
        c->dctx = ZSTD_createDCtx();
        for (int j = 0; j < CKPT_READ_SLOTS && ok; j++) {
            /* a frame is read in whole aligned blocks around it (chunk_start) */
            void *m = NULL;
            ok = posix_memalign(&m, STORE_ALIGN, (size_t)s->max_stored + 2 * STORE_ALIGN) == 0;
            c->stored[j] = ok ? m : NULL;
            ok = ok && (c->raw[j] = malloc(s->max_raw ? s->max_raw : 1)) != NULL;
        }
        c->filt = malloc(s->max_raw ? s->max_raw : 1);
        c->readers = calloc(s->nfiles ? CKPT_READ_SLOTS * s->nfiles : 1, sizeof *c->readers);
        ok = ok && c->dctx && c->filt && c->readers;
    }
    if (!ok) { /* no half-made state for the next call to take as ready */
        for (unsigned t = 0; t < s->threads; t++) rctx_free(&s->ctx[t], s->nfiles);
        free(s->ctx);
        s->ctx = NULL;
        return -ENOMEM;
    }
    return 0;
}

int ckpt_snapshot_set_threads(ckpt_snapshot *s, unsigned threads)
{
    if (!s || threads < 1 || threads > 64) return -EINVAL;
    if (s->ctx) {
        for (unsigned t = 0; t < s->threads; t++) rctx_free(&s->ctx[t], s->nfiles);
        free(s->ctx);
        s->ctx = NULL;
    }
    s->threads = threads;
    return 0;
}

/* One unit of work: a chunk and where its bytes go. dst NULL: check only (verify). */
typedef struct work {
    const buffer *b;
    const chunk *k;
    uint8_t *dst;    /* where range [from, to) of the buffer lands */
    uint64_t from, to;
} work;

/* A chunk in the hands of a reading thread: started (its read in flight, on local files),
 * then finished (waited for, checked, decoded). A thread keeps CKPT_READ_SLOTS of them, so
 * that the next chunks are read while the current one is decoded. */
typedef struct pending {
    const work *w;
    uint8_t *out;          /* k->bytes bytes: the destination (whole chunks) or c->raw[slot] */
    uint8_t *stored;       /* where the stored bytes arrive */
    store_reader *reader;  /* the reader with the read in flight, or NULL */
    store_read_req req;
    int rc;                /* a failure of the start, reported by the finish */
    char bad[512];
} pending;

static uint64_t align_down(uint64_t x) { return x & ~(uint64_t)(STORE_ALIGN - 1); }

/* Start loading w's chunk with the thread's buffers and readers of `slot`: open the
 * data file's reader on first use and submit the read of the stored bytes (S3: fetch them).
 * A chunk stored raw without filter is read straight into its destination; a frame is read
 * whole 4096-byte blocks around it into the aligned slot buffer, so that O_DIRECT puts it
 * there without a bounce copy. Failures go to pd->rc and pd->bad. */
static void chunk_start(const ckpt_snapshot *s, rctx *c, unsigned slot, const work *w, pending *pd)
{
    const chunk *k = w->k;
    const buffer *b = w->b;
    const file *f = &s->files[k->file];
    int whole = w->dst && w->from == k->offset && w->to == k->offset + k->bytes;
    char p[CKPT_PATH_MAX];
    pd->w = w;
    pd->out = whole ? w->dst : c->raw[slot];
    pd->reader = NULL;
    pd->rc = 0;
    pd->bad[0] = '\0';
    int in_place = !k->codec_zstd && k->filter == CKPT_FILTER_NONE;
    if (s->src_read) { /* a byte source of its own (the memory tier): read now */
        pd->stored = in_place ? pd->out : c->stored[slot];
        pd->rc = s->src_read(s->src_ctx, k->file, k->file_offset, k->stored_bytes, pd->stored,
                             pd->bad, sizeof pd->bad);
        return;
    }
    if (s->os) {
        pd->stored = in_place ? pd->out : c->stored[slot];
        pd->rc = ckpt_s3_read_stored(s, k->file, k->file_offset, k->stored_bytes, pd->stored,
                                     pd->bad, sizeof pd->bad);
        return;
    }
    if (ckpt_path_join(p, sizeof p, s->path, f->name) < 0) {
        pd->rc = -ENAMETOOLONG;
        return;
    }
    if (in_place) {
        pd->stored = pd->out;
        pd->req = (store_read_req){k->file_offset, (size_t)k->stored_bytes, pd->out};
    } else {
        /* [a0, a1) within the file (its last block may be short): at most 2 x 4095 bytes
         * more than the frame, which the slot buffer has room for */
        uint64_t a0 = align_down(k->file_offset);
        uint64_t a1 = align_down(k->file_offset + k->stored_bytes + STORE_ALIGN - 1);
        if (a1 > f->bytes) a1 = f->bytes;
        pd->stored = c->stored[slot] + (k->file_offset - a0);
        pd->req = (store_read_req){a0, (size_t)(a1 - a0), c->stored[slot]};
    }
    store_reader **rd = &c->readers[(size_t)slot * s->nfiles + k->file];
    int rc;
    if (!*rd) {
        uint64_t size = 0;
        rc = store_reader_open(rd, p, 8, STORE_NOFOLLOW, &size);
        if (rc == -ENOENT && folder_gone(s->path)) {
            log_why(pd->bad, sizeof pd->bad, "%s: the snapshot folder was removed while it was read", p);
            pd->rc = -ENOENT;
            return;
        }
        if (rc < 0) {
            log_why(pd->bad, sizeof pd->bad, "%s: cannot open: %s", p, file_error_text(rc));
            pd->rc = file_error(rc);
            return;
        }
        if (size != f->bytes) {
            log_why(pd->bad, sizeof pd->bad, "%s: %llu bytes, manifest says %llu", p,
                    (unsigned long long)size, (unsigned long long)f->bytes);
            pd->rc = -EBADMSG;
            return;
        }
    }
    if ((rc = store_reader_submit(*rd, &pd->req, 1)) < 0) {
        log_why(pd->bad, sizeof pd->bad, "%s: chunk %u of %s (file offset %llu): read failed: %s",
                p, k->index, b->name, (unsigned long long)k->file_offset, strerror(-rc));
        pd->rc = rc;
        return;
    }
    pd->reader = *rd;
}

/* Finish loading a started chunk into pd->out (k->bytes bytes): wait for its read, check the
 * stored checksum, decode, unfilter, check the raw checksum; then copy the requested part of
 * a chunk that is not wholly in the range. */
static int chunk_finish(const ckpt_snapshot *s, rctx *c, pending *pd)
{
    const work *w = pd->w;
    const buffer *b = w->b;
    const chunk *k = w->k;
    const file *f = &s->files[k->file];
    char *bad = pd->bad;
    size_t bad_len = sizeof pd->bad;
    char p[CKPT_PATH_MAX];
    uint8_t *out = pd->out, *stored = pd->stored;
    if (s->src_read || ckpt_path_join(p, sizeof p, s->path, f->name) < 0)
        snprintf(p, sizeof p, "%s", f->name); /* a byte source names its place itself */
    if (pd->reader) {
        int rc = store_reader_wait(pd->reader);
        pd->reader = NULL;
        if (rc < 0) {
            log_why(bad, bad_len, "%s: chunk %u of %s (file offset %llu): read failed: %s", p,
                    k->index, b->name, (unsigned long long)k->file_offset, strerror(-rc));
            return rc;
        }
    }
    if (pd->rc < 0) return pd->rc;
    if (XXH3_64bits(stored, (size_t)k->stored_bytes) != k->xxh_stored) {
        log_why(bad, bad_len, "%s: chunk %u of %s (file offset %llu, %llu bytes): stored checksum "
                "mismatch", p, k->index, b->name, (unsigned long long)k->file_offset,
                (unsigned long long)k->stored_bytes);
        return -EBADMSG;
    }
    if (s->copy_fds) ckpt_s3_copy_chunk(s, k->file, k->file_offset, stored, k->stored_bytes);
    uint8_t *dec = k->filter == CKPT_FILTER_NONE ? out : c->filt;
    if (k->codec_zstd) {
        /* exactly one frame: zstd would also decode concatenated or skippable frames */
        size_t fsz = ZSTD_findFrameCompressedSize(stored, (size_t)k->stored_bytes);
        if (ZSTD_isError(fsz) || fsz != k->stored_bytes) {
            log_why(bad, bad_len, "%s: chunk %u of %s: the stored bytes are not one zstd frame",
                    p, k->index, b->name);
            return -EBADMSG;
        }
        size_t n = ZSTD_decompressDCtx(c->dctx, dec, (size_t)k->bytes, stored, (size_t)k->stored_bytes);
        if (ZSTD_isError(n) || n != k->bytes) {
            log_why(bad, bad_len, "%s: chunk %u of %s: zstd frame does not decode to %llu bytes%s%s",
                    p, k->index, b->name, (unsigned long long)k->bytes, ZSTD_isError(n) ? ": " : "",
                    ZSTD_isError(n) ? ZSTD_getErrorName(n) : "");
            return -EBADMSG;
        }
    } else if (dec != stored) {
        memcpy(dec, stored, (size_t)k->bytes);
    }
    if (k->filter == CKPT_FILTER_SHUFFLE) ckpt_unshuffle(out, dec, (size_t)k->bytes, b->elem_bytes);
    /* a raw chunk read in place was just hashed: the same bytes need no second pass */
    int same_bytes = stored == out && k->xxh_raw == k->xxh_stored;
    if (!same_bytes && XXH3_64bits(out, (size_t)k->bytes) != k->xxh_raw) {
        log_why(bad, bad_len, "%s: chunk %u of %s: raw checksum mismatch after decoding", p,
                k->index, b->name);
        return -EBADMSG;
    }
    if (w->dst && out != w->dst)
        memcpy(w->dst, out + (w->from - k->offset), (size_t)(w->to - w->from));
    return 0;
}

typedef struct batch {
    const ckpt_snapshot *s;
    const work *w;
    size_t n;
    size_t next;     /* guarded by mu */
    int failed;
    size_t bad_index;
    int bad_rc;
    char bad[512];
    pthread_mutex_t mu;
} batch;

/* Take the next work item: 1 and *i, or 0 when there is none or a chunk failed. */
static int claim(batch *bt, size_t *i)
{
    pthread_mutex_lock(&bt->mu);
    *i = bt->next++;
    int go = !bt->failed && *i < bt->n;
    pthread_mutex_unlock(&bt->mu);
    return go;
}

/* A claimed chunk is always finished (its read may be in flight, and a bad chunk before the
 * one that failed first must still be found). Up to CKPT_READ_SLOTS chunks are started
 * before the oldest is finished, so the disk reads ahead while the core decodes. */
static void do_work(batch *bt, rctx *c)
{
    pending pd[CKPT_READ_SLOTS];
    size_t idx[CKPT_READ_SLOTS];
    unsigned head = 0, count = 0;
    int more = 1;
    for (;;) {
        while (more && count < CKPT_READ_SLOTS) {
            unsigned sl = (head + count) % CKPT_READ_SLOTS;
            if (!(more = claim(bt, &idx[sl]))) break;
            chunk_start(bt->s, c, sl, &bt->w[idx[sl]], &pd[sl]);
            count++;
        }
        if (!count) break;
        int rc = chunk_finish(bt->s, c, &pd[head]);
        if (rc < 0) {
            pthread_mutex_lock(&bt->mu);
            if (!bt->failed || idx[head] < bt->bad_index) { /* the first bad chunk in order */
                bt->failed = 1;
                bt->bad_index = idx[head];
                bt->bad_rc = rc;
                snprintf(bt->bad, sizeof bt->bad, "%s", pd[head].bad);
            }
            pthread_mutex_unlock(&bt->mu);
        }
        head = (head + 1) % CKPT_READ_SLOTS;
        count--;
    }
}

typedef struct thread_arg {
    batch *bt;
    rctx *c;
} thread_arg;

static void *work_main(void *arg)
{
    thread_arg *ta = arg;
    do_work(ta->bt, ta->c);
    return NULL;
}

/* Run the work items on up to s->threads threads (the caller's among them). */
static int run_batch(ckpt_snapshot *s, const work *w, size_t n, char *bad, size_t bad_len)
{
    batch bt = {.s = s, .w = w, .n = n};
    pthread_mutex_init(&bt.mu, NULL);
    unsigned extra = s->threads - 1;
    if (extra > n - 1) extra = (unsigned)(n - 1);
    pthread_t tid[64];
    thread_arg ta[64];
    unsigned started = 0;
    for (unsigned t = 0; t < extra; t++) {
        ta[t].bt = &bt;
        ta[t].c = &s->ctx[t + 1];
        if (common_thread_start(&tid[t], work_main, &ta[t]) != 0) break;
        started++;
    }
    do_work(&bt, &s->ctx[0]);
    for (unsigned t = 0; t < started; t++) pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&bt.mu);
    if (bt.failed) {
        log_why(bad, bad_len, "%s", bt.bad);
        return bt.bad_rc;
    }
    return 0;
}

int ckpt_snapshot_read(ckpt_snapshot *s, const char *name, uint64_t offset, uint64_t len,
                       void *dst, char *bad, size_t bad_len)
{
    buffer *b = name ? find_buffer(s, name) : NULL;
    if (!b) return -ENOENT;
    if (offset > b->total_bytes || len > b->total_bytes - offset || (len && !dst)) return -EINVAL;
    if (len == 0) return 0;
    int rc = ensure_read_state(s);
    if (rc < 0) return rc;
    /* first chunk that ends after offset (binary search over sorted offsets) */
    size_t lo = 0, hi = b->nchunks;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (b->chunks[mid].offset + b->chunks[mid].bytes <= offset) lo = mid + 1;
        else hi = mid;
    }
    uint64_t end = offset + len;
    size_t last = lo;
    while (last < b->nchunks && b->chunks[last].offset < end) last++;
    work *w = calloc(last - lo ? last - lo : 1, sizeof *w);
    if (!w) return -ENOMEM;
    for (size_t i = lo; i < last; i++) {
        const chunk *k = &b->chunks[i];
        uint64_t from = k->offset > offset ? k->offset : offset;
        uint64_t to = k->offset + k->bytes < end ? k->offset + k->bytes : end;
        w[i - lo] = (work){b, k, (uint8_t *)dst + (from - offset), from, to};
    }
    rc = run_batch(s, w, last - lo, bad, bad_len);
    free(w);
    return rc;
}

/* Check the n chunks of w, then report them chunk by chunk, in order. */
static int verify_batch(ckpt_snapshot *s, const work *w, size_t n, uint64_t *done,
                        uint64_t total, ckpt_progress_fn progress, void *ctx, char *bad,
                        size_t bad_len)
{
    int rc = run_batch(s, w, n, bad, bad_len);
    for (size_t q = 0; rc == 0 && q < n; q++) {
        *done += w[q].k->bytes;
        if (progress && progress(ctx, *done, total)) rc = -ECANCELED;
    }
    return rc;
}

int ckpt_snapshot_verify(ckpt_snapshot *s, char *bad, size_t bad_len, ckpt_progress_fn progress,
                         void *ctx)
{
    int rc = ensure_read_state(s);
    if (rc < 0) return rc;
    uint64_t total = 0, done = 0;
    ckpt_snapshot_sizes(s, &total, NULL);
    size_t cap = 4 * (size_t)s->threads, n = 0;
    work w[4 * 64];
    for (size_t i = 0; i < s->nbuffers; i++) {
        const buffer *b = &s->buffers[i];
        for (size_t j = 0; j < b->nchunks; j++) {
            w[n++] = (work){b, &b->chunks[j], NULL, 0, 0};
            if (n == cap) {
                if ((rc = verify_batch(s, w, n, &done, total, progress, ctx, bad, bad_len)) < 0)
                    return rc;
                n = 0;
            }
        }
    }
    /* the last, short batch: also when the last buffers have no chunks (a flush at "the last
     * chunk of the last buffer" never ran then, and a tail of chunks went unchecked) */
    return n ? verify_batch(s, w, n, &done, total, progress, ctx, bad, bad_len) : 0;
}

int ckpt_snapshot_open(ckpt_snapshot **out, const char *path, char *why, size_t why_len)
{
    *out = NULL;
    if (!path || strlen(path) > CKPT_PATH_MAX - 64) return -EINVAL;
    char mpath[CKPT_PATH_MAX];
    char *text = NULL;
    size_t len = 0;
    ckpt_snapshot *s = ckpt_snapshot_alloc(path);
    if (!s) return -ENOMEM;
    ckpt_path_join(mpath, sizeof mpath, path, CKPT_MANIFEST_NAME); /* length checked above */
    int rc = store_read_file(mpath, CKPT_MAX_MANIFEST_BYTES, STORE_NOFOLLOW, &text, &len);
    if (rc == -ENOENT) {
        struct stat st;
        if (stat(path, &st) != 0 && errno == ENOENT) {
            log_why(why, why_len, "no such snapshot folder");
            goto out; /* -ENOENT: nothing there (or it was just removed) */
        }
        /* the folder may have appeared since the read: a commit renames a temp folder that
         * already holds its manifest, so now that the folder is there the manifest is too,
         * unless the folder really lacks one; read again before calling it corrupt */
        rc = store_read_file(mpath, CKPT_MAX_MANIFEST_BYTES, STORE_NOFOLLOW, &text, &len);
    }
    if (rc < 0) {
        struct stat st;
        if (rc == -ENOENT && stat(path, &st) != 0 && errno == ENOENT) {
            log_why(why, why_len, "no such snapshot folder");
            goto out; /* -ENOENT: removed since (retention, a set-aside) */
        }
        if (rc == -EFBIG)
            log_why(why, why_len, "%s is larger than the format's limit of %u bytes",
                    CKPT_MANIFEST_NAME, (unsigned)CKPT_MAX_MANIFEST_BYTES);
        else if (rc == -ENOTDIR)
            log_why(why, why_len, "not a folder");
        else if (rc == -ENOENT)
            log_why(why, why_len, "no %s", CKPT_MANIFEST_NAME);
        else
            log_why(why, why_len, "cannot read %s: %s", CKPT_MANIFEST_NAME, file_error_text(rc));
        rc = file_error(rc);
        goto out;
    }
    rc = ckpt_snapshot_parse_text(s, text, len, why, why_len);
out:
    free(text);
    if (rc < 0) {
        ckpt_snapshot_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

ckpt_snapshot *ckpt_snapshot_alloc(const char *path)
{
    ckpt_snapshot *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->threads = 2;
    snprintf(s->path, sizeof s->path, "%s", path);
    return s;
}

int ckpt_snapshot_parse_text(ckpt_snapshot *s, const char *text, size_t len, char *why,
                             size_t why_len)
{
    json_t *m = NULL;
    int rc;
    if ((rc = check_manifest_sum(text, len, why, why_len)) < 0) goto out;
    size_t values = json_values_upper_bound(text, len);
    if (values > CKPT_MAX_JSON_VALUES) {
        log_why(why, why_len, "manifest holds about %zu JSON values, more than the format's limit "
                "(%u)", values, (unsigned)CKPT_MAX_JSON_VALUES);
        rc = -EBADMSG;
        goto out;
    }
    json_error_t jerr;
    m = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!m && (json_error_code(&jerr) == json_error_out_of_memory || !jerr.text[0])) {
        /* says nothing about the bytes (DESIGN I7); jansson gives every syntax error a
         * message, but leaves some allocation failures without one (an array that could
         * not grow) */
        log_why(why, why_len, "out of memory parsing %s", CKPT_MANIFEST_NAME);
        rc = -ENOMEM;
        goto out;
    }
    if (!json_is_object(m)) {
        log_why(why, why_len, "manifest is not valid JSON: %s", jerr.text);
        rc = -EBADMSG;
        goto out;
    }
    rc = parse_manifest(s, m, why, why_len);
out:
    json_decref(m);
    return rc;
}

static int cmp_entry(const void *a, const void *b)
{
    const ckpt_entry *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    int tx = x->status >= CKPT_STATUS_INCOMPLETE, ty = y->status >= CKPT_STATUS_INCOMPLETE;
    if (tx != ty) return tx - ty;
    return strcmp(x->name, y->name);
}

int ckpt_list(const char *dir, ckpt_entry **entries, size_t *n)
{
    *entries = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : -errno;
    size_t cap = 16, cnt = 0;
    ckpt_entry *v = malloc(cap * sizeof *v);
    if (!v) {
        closedir(d);
        return -ENOMEM;
    }
    struct dirent *e;
    char path[CKPT_PATH_MAX];
    while ((e = readdir(d)) != NULL) {
        uint64_t step;
        int final = ckpt_parse_step_dirname(e->d_name, &step) == 0;
        int temp = !final && ckpt_parse_temp_dirname(e->d_name, &step) == 0;
        int aside = !final && !temp && ckpt_parse_aside_dirname(e->d_name, &step) == 0;
        if (!final && !temp && !aside) continue;
        if (strlen(e->d_name) >= sizeof v->name) continue;
        if (cnt == cap) {
            ckpt_entry *nv = realloc(v, 2 * cap * sizeof *v);
            if (!nv) {
                free(v);
                closedir(d);
                return -ENOMEM;
            }
            v = nv;
            cap *= 2;
        }
        ckpt_entry *en = &v[cnt++];
        memset(en, 0, sizeof *en);
        en->step = step;
        snprintf(en->name, sizeof en->name, "%s", e->d_name);
        if (temp) {
            en->status = CKPT_STATUS_INCOMPLETE;
            size_t nl = strlen(e->d_name);
            int retired = nl > 8 && !strcmp(e->d_name + nl - 8, "-retired");
            snprintf(en->reason, sizeof en->reason, "%s",
                     retired ? "temp folder: removal by retention in progress or interrupted"
                             : "temp folder: save in progress or interrupted");
            continue;
        }
        if (aside) {
            en->status = CKPT_STATUS_SET_ASIDE;
            snprintf(en->reason, sizeof en->reason, "found corrupt and set aside by a resume");
            continue;
        }
        ckpt_snapshot *s = NULL;
        int rc = ckpt_path_join(path, sizeof path, dir, e->d_name);
        if (rc == 0) rc = ckpt_snapshot_open(&s, path, en->reason, sizeof en->reason);
        if (rc == -ENOENT) {
            /* gone since readdir saw it (the reader says -ENOENT only for a folder that is
             * not there, or went while it was read): retention renamed it away, or a resume
             * set it aside; it was never corrupt, so it is not listed */
            cnt--;
            continue;
        }
        if (rc == 0) {
            en->status = CKPT_STATUS_COMMITTED;
            en->created = s->created;
            snprintf(en->run_id, sizeof en->run_id, "%s", s->run_id);
            ckpt_snapshot_sizes(s, &en->raw_bytes, &en->stored_bytes);
            if (s->step != step) {
                en->status = CKPT_STATUS_CORRUPT;
                snprintf(en->reason, sizeof en->reason, "manifest says step %llu",
                         (unsigned long long)s->step);
            }
            ckpt_snapshot_close(s);
        } else if (rc == -EPROTONOSUPPORT) {
            en->status = CKPT_STATUS_NEWER;
        } else if (rc == -EBADMSG || rc == -ENOENT) {
            en->status = CKPT_STATUS_CORRUPT;
        } else {
            /* EMFILE, EACCES, EIO, ENOMEM...: nothing is known about the bytes */
            en->status = CKPT_STATUS_UNREADABLE;
            en->error = rc;
        }
    }
    closedir(d);
    qsort(v, cnt, sizeof *v, cmp_entry);
    *entries = v;
    *n = cnt;
    return 0;
}

/* ------------------------------------------------------------------ layout accessors
 * Declared in ckpt_plan.h (the re-sharding planner's read-only view of the manifest). */
#include "ckpt_plan.h"

size_t ckpt_snapshot_nfiles(const ckpt_snapshot *s) { return s->nfiles; }

int ckpt_snapshot_chunk_info(const ckpt_snapshot *s, size_t bi, size_t ci, ckpt_chunk_info *info)
{
    if (!info || bi >= s->nbuffers || ci >= s->buffers[bi].nchunks) return -EINVAL;
    const chunk *k = &s->buffers[bi].chunks[ci];
    *info = (ckpt_chunk_info){k->offset, k->bytes, k->file_offset, k->stored_bytes, k->file};
    return 0;
}
