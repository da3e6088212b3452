/* Synchronous snapshot writer: chunk -> filter -> zstd -> xxh3 -> io_uring -> commit. */
#include "ckpt.h"
#include "ckpt_internal.h"
#include "log.h"
#include "storage.h"
#include "thread.h"

#include <dirent.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
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

static int cmp_buffer_name(const void *a, const void *b)
{
    return strcmp((*(const ckpt_buffer *const *)a)->name, (*(const ckpt_buffer *const *)b)->name);
}

static int check_buffers(const ckpt_buffer *bufs, size_t nbufs, int sharded)
{
    if (nbufs > CKPT_MAX_BUFFERS) return -EINVAL;
    for (size_t i = 0; i < nbufs; i++) {
        const ckpt_buffer *b = &bufs[i];
        if (!ckpt_valid_name(b->name) || !ckpt_valid_name(b->dtype)) return -EINVAL;
        if (b->elem_bytes != 1 && b->elem_bytes != 2 && b->elem_bytes != 4 && b->elem_bytes != 8)
            return -EINVAL;
        if (b->bytes && !b->data) return -EINVAL;
        if (b->offset > b->total_bytes || b->bytes > b->total_bytes - b->offset) return -EINVAL;
        if (b->total_bytes % b->elem_bytes || b->offset % b->elem_bytes) return -EINVAL;
        if (b->total_bytes > (uint64_t)INT64_MAX) return -EINVAL; /* a JSON integer */
        /* a world of one rank saves whole buffers: a partial one could never be restored */
        if (!sharded && (b->offset != 0 || b->bytes != b->total_bytes)) return -EINVAL;
    }
    if (nbufs < 2) return 0;
    /* unique names: sorted, neighbours compared (a pairwise check is quadratic) */
    const ckpt_buffer **v = malloc(nbufs * sizeof *v);
    if (!v) return -ENOMEM;
    for (size_t i = 0; i < nbufs; i++) v[i] = &bufs[i];
    qsort(v, nbufs, sizeof *v, cmp_buffer_name);
    int rc = 0;
    for (size_t i = 1; i < nbufs && rc == 0; i++)
        if (!strcmp(v[i - 1]->name, v[i]->name)) rc = -EINVAL;
    free(v);
    return rc;
}

uint64_t ckpt_snapshot_max_chunks(const ckpt_buffer *bufs, size_t nbufs, uint64_t chunk_bytes,
                                  uint32_t world_size)
{
    if (!chunk_bytes || !world_size) return UINT64_MAX;
    uint64_t n = 0;
    for (size_t i = 0; i < nbufs; i++) {
        /* cutting a buffer into W shards adds at most one chunk per shard boundary */
        uint64_t k = bufs[i].total_bytes / chunk_bytes + (bufs[i].total_bytes % chunk_bytes != 0) +
                     (world_size - 1);
        if (__builtin_add_overflow(n, k, &n)) return UINT64_MAX;
    }
    return n;
}

uint64_t ckpt_fit_chunk_bytes(uint64_t chunk_bytes, const ckpt_buffer *bufs, size_t nbufs,
                              uint32_t world_size)
{
    if (chunk_bytes < 4096 || chunk_bytes % 16) return 0;
    for (; chunk_bytes <= (1ull << 30); chunk_bytes *= 2)
        if (ckpt_snapshot_max_chunks(bufs, nbufs, chunk_bytes, world_size) <= CKPT_MAX_CHUNKS)
            return chunk_bytes;
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
    if (n + strlen(CKPT_MANIFEST_SUM_KEY) + 16 + 3 > CKPT_MAX_MANIFEST_BYTES) {
        LOG_E(TAG, "the manifest would have %zu bytes, more than readers accept (%u)", n,
              (unsigned)CKPT_MAX_MANIFEST_BYTES);
        rc = -EFBIG;
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

/* ------------------------------------------------------------------ compression pool
 *
 * Chunks are numbered in file order. Workers take the next chunk number, wait until its
 * ring slot (number % nslots) is free, compress (or just checksum) into the slot and mark it
 * ready; the writer consumes slots strictly in chunk order, appends the stored bytes to the
 * data file and frees the slot. Output bytes therefore depend only on the input, never on
 * which worker did what. Memory is bounded by the slots, allocated once. */

typedef struct chunk_job {
    uint32_t buf;  /* index into the job's buffers */
    uint64_t off;  /* offset within that buffer's shard, bytes */
    size_t len;
} chunk_job;

typedef struct slot {
    uint8_t *frame;    /* ZSTD_compressBound(chunk_bytes) */
    uint8_t *filtered; /* chunk_bytes when the shuffle filter may be used */
    int64_t chunk;     /* chunk held, -1 when free */
    int ready;
    int err;
    int codec_zstd;
    const uint8_t *stored; /* frame, or the raw bytes when stored raw */
    size_t stored_len;
    uint64_t xxh_raw, xxh_stored;
} slot;

struct ckpt_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_ready, cv_free;
    unsigned nthreads, nslots, started;
    pthread_t *threads;
    slot *slots;
    uint64_t chunk_bytes;
    int shuffle; /* slots have shuffle scratch */
    void *wmem;  /* io_uring write buffers, reused by every save (flat memory, case C21) */
    size_t wmem_bytes;
    int stop;
    /* the job in progress */
    int have_job, abort, busy;
    uint64_t gen;   /* job number: a worker that took a chunk of an earlier job drops it */
    size_t written; /* chunks the writer has consumed; chunk i may use its slot once
                       chunk i - nslots is written, i.e. i < written + nslots */
    const ckpt_buffer *bufs;
    const chunk_job *chunks;
    size_t nchunks, next;
    int compress, level, filter;
    /* optional: blocks until the bytes before `end` are in place (the engine's stage may still
     * be copying while the persist starts); returns 0 or a negative errno */
    int (*wait_ready)(void *ctx, const void *end);
    void *ready_ctx;
};

/* Seconds a pipeline wait may last before the save fails (DESIGN I4: no unbounded wait). */
#define POOL_WAIT_S 600


static void compress_chunk(ckpt_pool *p, ZSTD_CCtx *cctx, slot *s, const chunk_job *c)
{
    const ckpt_buffer *b = &p->bufs[c->buf];
    const uint8_t *raw = (const uint8_t *)b->data + c->off;
    s->err = 0;
    if (p->wait_ready && (s->err = p->wait_ready(p->ready_ctx, raw + c->len)) < 0) return;
    s->xxh_raw = XXH3_64bits(raw, c->len);
    if (p->compress) {
        const uint8_t *in = raw;
        if (p->filter == CKPT_FILTER_SHUFFLE && b->elem_bytes > 1) {
            ckpt_shuffle(s->filtered, raw, c->len, b->elem_bytes);
            in = s->filtered;
        }
        size_t z = ZSTD_compressCCtx(cctx, s->frame, ZSTD_compressBound((size_t)p->chunk_bytes), in,
                                     c->len, p->level);
        if (ZSTD_isError(z)) {
            LOG_E(TAG, "zstd compression of %s at %llu failed: %s", b->name,
                  (unsigned long long)(b->offset + c->off), ZSTD_getErrorName(z));
            s->err = -EIO;
            return;
        }
        if (z < c->len) { /* a chunk that does not shrink is stored raw */
            s->codec_zstd = 1;
            s->stored = s->frame;
            s->stored_len = z;
            s->xxh_stored = XXH3_64bits(s->frame, z);
            return;
        }
    }
    s->codec_zstd = 0;
    s->stored = raw;
    s->stored_len = c->len;
    s->xxh_stored = s->xxh_raw;
}

typedef struct worker_arg {
    ckpt_pool *p;
    ZSTD_CCtx *cctx;
} worker_arg;

/* Background threads of the snapshot path run at a lower priority than training: when the
 * cores are busy, the stage copy (which training waits for) and the training step win. */
void ckpt_thread_background(void)
{
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10) != 0)
        LOG_D(TAG, "setpriority of a background thread failed: %s", strerror(errno));
}

static void *worker_main(void *arg)
{
    worker_arg *wa = arg;
    ckpt_thread_background();
    ckpt_pool *p = wa->p;
    struct timespec ts;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !(p->have_job && !p->abort && p->next < p->nchunks)) {
            ckpt_deadline(&ts, 1.0); /* idle: re-check once a second */
            pthread_cond_timedwait(&p->cv_work, &p->mu, &ts);
        }
        if (p->stop) break;
        size_t i = p->next++;
        uint64_t gen = p->gen;
        slot *s = &p->slots[i % p->nslots];
        /* wait for this chunk's own turn at the slot, not just a free slot: a worker holding
         * chunk i + nslots must not take the slot that chunk i needs (that deadlocks) */
        while (!(i < p->written + p->nslots) && !p->abort && !p->stop && p->gen == gen) {
            ckpt_deadline(&ts, 1.0);
            pthread_cond_timedwait(&p->cv_free, &p->mu, &ts);
        }
        if (p->abort || p->stop || p->gen != gen) continue;
        s->chunk = (int64_t)i;
        s->ready = 0;
        p->busy++;
        const chunk_job c = p->chunks[i];
        pthread_mutex_unlock(&p->mu);
        compress_chunk(p, wa->cctx, s, &c);
        pthread_mutex_lock(&p->mu);
        s->ready = 1;
        p->busy--;
        pthread_cond_broadcast(&p->cv_ready);
    }
    pthread_mutex_unlock(&p->mu);
    ZSTD_freeCCtx(wa->cctx);
    free(wa);
    return NULL;
}

void ckpt_pool_destroy(ckpt_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv_work);
    pthread_cond_broadcast(&p->cv_free);
    pthread_mutex_unlock(&p->mu);
    for (unsigned i = 0; i < p->started; i++) pthread_join(p->threads[i], NULL);
    for (unsigned i = 0; p->slots && i < p->nslots; i++) {
        free(p->slots[i].frame);
        free(p->slots[i].filtered);
    }
    free(p->slots);
    free(p->threads);
    if (p->wmem) munmap(p->wmem, p->wmem_bytes);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_ready);
    pthread_cond_destroy(&p->cv_free);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int ckpt_pool_create(ckpt_pool **out, unsigned threads, uint64_t chunk_bytes, int shuffle)
{
    *out = NULL;
    if (threads < 1 || threads > 64 || chunk_bytes < 4096 || chunk_bytes > (1ull << 30)) return -EINVAL;
    ckpt_pool *p = calloc(1, sizeof *p);
    if (!p) return -ENOMEM;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_ready, NULL);
    pthread_cond_init(&p->cv_free, NULL);
    p->nthreads = threads;
    p->nslots = 2 * threads;
    p->chunk_bytes = chunk_bytes;
    p->shuffle = shuffle != 0;
    p->threads = calloc(threads, sizeof *p->threads);
    p->slots = calloc(p->nslots, sizeof *p->slots);
    if (!p->threads || !p->slots) goto fail;
    for (unsigned i = 0; i < p->nslots; i++) {
        p->slots[i].chunk = -1;
        p->slots[i].frame = malloc(ZSTD_compressBound((size_t)chunk_bytes));
        if (!p->slots[i].frame) goto fail;
        if (shuffle && !(p->slots[i].filtered = malloc((size_t)chunk_bytes))) goto fail;
    }
    for (unsigned i = 0; i < threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) goto fail;
        wa->p = p;
        wa->cctx = ZSTD_createCCtx();
        if (!wa->cctx || common_thread_start(&p->threads[i], worker_main, wa) != 0) {
            ZSTD_freeCCtx(wa->cctx);
            free(wa);
            goto fail;
        }
        p->started++;
    }
    *out = p;
    return 0;
fail:
    ckpt_pool_destroy(p);
    return -ENOMEM;
}

/* Build the chunk list of a save: every shard cut into chunk_bytes pieces, in order. */
static int plan_chunks(const ckpt_buffer *bufs, size_t nbufs, uint64_t chunk_bytes,
                       chunk_job **out, size_t *n)
{
    size_t cnt = 0;
    for (size_t i = 0; i < nbufs; i++) cnt += (size_t)((bufs[i].bytes + chunk_bytes - 1) / chunk_bytes);
    chunk_job *c = calloc(cnt ? cnt : 1, sizeof *c);
    if (!c) return -ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < nbufs; i++)
        for (uint64_t off = 0; off < bufs[i].bytes; off += chunk_bytes) {
            c[k].buf = (uint32_t)i;
            c[k].off = off;
            c[k].len = (size_t)(bufs[i].bytes - off < chunk_bytes ? bufs[i].bytes - off : chunk_bytes);
            k++;
        }
    *out = c;
    *n = cnt;
    return 0;
}

/* Chunks of an uncompressed save handed to the writer ahead of the one whose record is
 * written: its bytes need no worker, only their checksums do, so the disk need not wait for
 * the hashing (nice 10, starved on busy cores) and the hashing not for the disk. */
#define RAW_AHEAD 16

/* Progress of the appends of one save, for its fault points. */
typedef struct append_state {
    uint64_t step, raw_total, raw_done;
    int half_reported;
} append_state;

/* Hand chunk i's stored bytes to the writer, with the fault points of the save path:
 * in place (append_ref) when they lie in the job's buffers, which outlive the writer, else
 * copied (a frame in a slot, which is reused at once). */
static int append_chunk(store_writer *w, append_state *as, size_t i, size_t nchunks,
                        const chunk_job *c, const uint8_t *stored, size_t len, int in_place)
{
    int (*append)(store_writer *, const void *, size_t) =
        in_place ? store_writer_append_ref : store_writer_append;
    int rc;
    if (as->raw_done == 0) ckpt_fault_point("before-chunk-write", as->step);
    /* the middle chunk goes in two halves, with a fault point between them */
    size_t first = i == nchunks / 2 ? len / 2 : len;
    if ((rc = append(w, stored, first)) < 0) return rc;
    if (first < len) {
        ckpt_fault_point("mid-chunk", as->step);
        if ((rc = append(w, stored + first, len - first)) < 0) return rc;
    }
    as->raw_done += c->len;
    if (!as->half_reported && as->raw_done * 2 >= as->raw_total) {
        as->half_reported = 1;
        ckpt_fault_point("mid-data", as->step);
    }
    return 0;
}

/* Write every chunk of the job through w, in order; chunk records go to jchunks[buf]. */
static int run_pipeline(ckpt_pool *p, store_writer *w, const ckpt_save_opts *o, int compress,
                        uint64_t step, const ckpt_buffer *bufs, const chunk_job *chunks,
                        size_t nchunks, json_t **jchunks, uint64_t *stored_total)
{
    int rc = 0;
    append_state as = {step, 0, 0, 0};
    uint64_t file_off = 0;
    size_t appended = 0; /* chunks handed to the writer */
    for (size_t i = 0; i < nchunks; i++) as.raw_total += chunks[i].len;
    pthread_mutex_lock(&p->mu);
    p->bufs = bufs;
    p->chunks = chunks;
    p->nchunks = nchunks;
    p->next = 0;
    p->compress = compress;
    p->level = o->zstd_level;
    p->filter = o->filter;
    p->abort = 0;
    p->written = 0;
    p->gen++;
    p->have_job = 1;
    for (unsigned s = 0; s < p->nslots; s++) {
        p->slots[s].chunk = -1;
        p->slots[s].ready = 0;
    }
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    for (size_t i = 0; i < nchunks && rc == 0; i++) {
        slot *s = &p->slots[i % p->nslots];
        /* uncompressed: every chunk is stored raw, from the job's buffers */
        for (; !compress && rc == 0 && appended < nchunks && appended <= i + RAW_AHEAD; appended++) {
            const chunk_job *a = &chunks[appended];
            const uint8_t *raw = (const uint8_t *)bufs[a->buf].data + a->off;
            if (p->wait_ready && (rc = p->wait_ready(p->ready_ctx, raw + a->len)) < 0) break;
            rc = append_chunk(w, &as, appended, nchunks, a, raw, a->len, 1);
        }
        if (rc < 0) break;
        struct timespec ts;
        ckpt_deadline(&ts, POOL_WAIT_S);
        pthread_mutex_lock(&p->mu);
        while (!(s->chunk == (int64_t)i && s->ready) && rc == 0)
            if (pthread_cond_timedwait(&p->cv_ready, &p->mu, &ts) == ETIMEDOUT) rc = -ETIMEDOUT;
        pthread_mutex_unlock(&p->mu);
        if (rc < 0) {
            LOG_E(TAG, "step %llu: chunk %zu was not compressed within %d s", (unsigned long long)step,
                  i, POOL_WAIT_S);
            break;
        }
        if (s->err) {
            rc = s->err;
            break;
        }
        const chunk_job *c = &chunks[i];
        const ckpt_buffer *b = &bufs[c->buf];
        if (compress) {
            /* a chunk stored raw lies in the job's buffers: written from there where its
             * alignment allows; a frame is copied out of its slot */
            if ((rc = append_chunk(w, &as, i, nchunks, c, s->stored, s->stored_len, !s->codec_zstd)) < 0)
                break;
        } else if (s->codec_zstd || s->stored_len != c->len) { /* written above as raw */
            rc = -EIO;
            break;
        }
        char hraw[17], hst[17];
        ckpt_hex64(s->xxh_raw, hraw);
        ckpt_hex64(s->xxh_stored, hst);
        int shuffled = s->codec_zstd && o->filter == CKPT_FILTER_SHUFFLE && b->elem_bytes > 1;
        json_t *jc = json_pack("{s:I, s:I, s:I, s:I, s:s, s:s, s:s, s:s}", "offset",
                               (json_int_t)(b->offset + c->off), "bytes", (json_int_t)c->len,
                               "file_offset", (json_int_t)file_off, "stored_bytes",
                               (json_int_t)s->stored_len, "codec", s->codec_zstd ? "zstd" : "none",
                               "filter", shuffled ? "shuffle" : "none", "xxh3_raw", hraw,
                               "xxh3_stored", hst);
        if (!jc || json_array_append_new(jchunks[c->buf], jc) != 0) rc = -ENOMEM;
        *stored_total += s->stored_len;
        file_off += s->stored_len;
        pthread_mutex_lock(&p->mu);
        s->chunk = -1;
        s->ready = 0;
        p->written = i + 1;
        pthread_cond_broadcast(&p->cv_free);
        pthread_mutex_unlock(&p->mu);
    }
    /* end the job: workers stop taking chunks; wait for those still compressing, since they
     * read the caller's buffers and write the slots */
    struct timespec ts;
    ckpt_deadline(&ts, POOL_WAIT_S);
    pthread_mutex_lock(&p->mu);
    p->abort = 1;
    p->have_job = 0;
    pthread_cond_broadcast(&p->cv_free);
    while (p->busy > 0)
        if (pthread_cond_timedwait(&p->cv_ready, &p->mu, &ts) == ETIMEDOUT) {
            LOG_E(TAG, "step %llu: compression workers did not stop within %d s",
                  (unsigned long long)step, POOL_WAIT_S);
            if (rc == 0) rc = -ETIMEDOUT;
            break;
        }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int ckpt_check_save(const ckpt_save_opts *opts, const char *run_id, const char *config_hash,
                    const ckpt_buffer *bufs, size_t nbufs)
{
    return ckpt_check_save_group(opts, run_id, config_hash, bufs, nbufs, NULL);
}

int ckpt_check_group(const ckpt_group *g)
{
    if (!g) return 0;
    if (g->world_size < 1 || g->world_size > 65536 || g->rank >= g->world_size ||
        !ckpt_valid_name(g->tag) || !(g->timeout_s > 0))
        return -EINVAL;
    if (g->rank == 0 ? (!g->collect || !g->decide) : (!g->vote || !g->outcome)) return -EINVAL;
    return 0;
}

int ckpt_check_save_group(const ckpt_save_opts *opts, const char *run_id, const char *config_hash,
                          const ckpt_buffer *bufs, size_t nbufs, const ckpt_group *group)
{
    int rc = check_opts(opts);
    if (rc < 0) return rc;
    if (!ckpt_valid_name(run_id) || !ckpt_valid_name(config_hash) || (nbufs && !bufs)) return -EINVAL;
    if ((rc = ckpt_check_group(group)) < 0) return rc;
    if ((rc = check_buffers(bufs, nbufs, group != NULL)) < 0) return rc;
    uint64_t most = ckpt_snapshot_max_chunks(bufs, nbufs, opts->chunk_bytes,
                                             group ? group->world_size : 1);
    if (most > CKPT_MAX_CHUNKS) {
        LOG_E(TAG, "a snapshot of this state could need %llu chunks of %llu bytes, more than the "
              "format allows (%u): use larger chunks (ckpt_fit_chunk_bytes)",
              (unsigned long long)most, (unsigned long long)opts->chunk_bytes,
              (unsigned)CKPT_MAX_CHUNKS);
        return -EINVAL;
    }
    return 0;
}

/* ------------------------------------------------------------------ sharded commit */

#define PART_SUFFIX ".part.json"

/* Rank 0: fold the part records of ranks 1..W-1 (rank-<r>.part.json in tmp_dir) into files
 * and the shards of jbufs (rank 0's buffers, in its order), then delete the part files.
 * Every part must list exactly rank 0's buffers with the same dtype, elem_bytes and
 * total_bytes. Errors: -EBADMSG (missing or inconsistent part), -ENOMEM. */
static int merge_parts(const char *tmp_dir, uint32_t world, json_t *files, json_t *jbufs)
{
    char path[CKPT_PATH_MAX], name[64];
    for (uint32_t r = 1; r < world; r++) {
        snprintf(name, sizeof name, "rank-%05u" PART_SUFFIX, r);
        if (ckpt_path_join(path, sizeof path, tmp_dir, name) < 0) return -EINVAL;
        json_error_t jerr;
        json_t *part = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
        json_t *pfile = json_object_get(part, "file"), *pbufs = json_object_get(part, "buffers");
        int rc = 0;
        if (!json_is_object(pfile) || !json_is_array(pbufs) ||
            json_integer_value(json_object_get(pfile, "rank")) != (json_int_t)r ||
            json_array_size(pbufs) != json_array_size(jbufs)) {
            LOG_E(TAG, "part record %s is missing or malformed%s%s", path, part ? "" : ": ",
                  part ? "" : jerr.text);
            rc = -EBADMSG;
        }
        for (size_t i = 0; rc == 0 && i < json_array_size(jbufs); i++) {
            json_t *mine = json_array_get(jbufs, i), *theirs = json_array_get(pbufs, i);
            static const char *same[] = {"name", "dtype", "elem_bytes", "total_bytes"};
            for (size_t k = 0; k < 4 && rc == 0; k++)
                if (!json_equal(json_object_get(mine, same[k]), json_object_get(theirs, same[k]))) {
                    LOG_E(TAG, "part record %s: buffer %zu disagrees with rank 0 about %s", path, i,
                          same[k]);
                    rc = -EBADMSG;
                }
            json_t *tsh = json_object_get(theirs, "shards");
            if (rc == 0 && (!json_is_array(tsh) ||
                            json_array_extend(json_object_get(mine, "shards"), tsh) != 0))
                rc = -EBADMSG;
        }
        if (rc == 0 && json_array_append(files, pfile) != 0) rc = -ENOMEM;
        json_decref(part);
        if (rc < 0) return rc;
        unlink(path);
    }
    return 0;
}

void ckpt_pool_set_ready_hook(ckpt_pool *p, int (*wait_ready)(void *ctx, const void *end), void *ctx)
{
    pthread_mutex_lock(&p->mu);
    p->wait_ready = wait_ready;
    p->ready_ctx = ctx;
    pthread_mutex_unlock(&p->mu);
}

/* Parse and check a trainer record (a JSON object within the readers' size limit) into
 * *out. Returns 0, -EINVAL (logged) or -ENOMEM. */
static int parse_trainer(const char *trainer_json, uint64_t step, json_t **out)
{
    json_error_t jerr;
    json_t *trainer = json_loads(trainer_json ? trainer_json : "{}", 0, &jerr);
    *out = NULL;
    if (!trainer || !json_is_object(trainer)) {
        LOG_E(TAG, "trainer record for step %llu is not a JSON object: %s",
              (unsigned long long)step, trainer ? "not an object" : jerr.text);
        json_decref(trainer);
        return -EINVAL;
    }
    /* as the reader measures it: compact, sorted */
    char *compact = json_dumps(trainer, JSON_COMPACT | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    size_t tlen = compact ? strlen(compact) : 0;
    free(compact);
    if (!compact || tlen > CKPT_MAX_TRAINER_BYTES) {
        if (compact)
            LOG_E(TAG, "trainer record for step %llu has %zu bytes, more than readers accept "
                  "(%u)", (unsigned long long)step, tlen, (unsigned)CKPT_MAX_TRAINER_BYTES);
        json_decref(trainer);
        return compact ? -EINVAL : -ENOMEM;
    }
    *out = trainer;
    return 0;
}

int ckpt_persist(ckpt_pool *pool, const ckpt_save_opts *opts, int compress, uint64_t step,
                 const char *run_id, const char *config_hash, const ckpt_buffer *bufs,
                 size_t nbufs, const char *trainer_json, ckpt_trainer_wait_fn trainer_wait,
                 void *trainer_ctx, const ckpt_group *group, ckpt_save_stats *stats)
{
    int rc = ckpt_check_save_group(opts, run_id, config_hash, bufs, nbufs, group);
    if (rc < 0) return rc;
    const uint32_t rank = group ? group->rank : 0, world = group ? group->world_size : 1;
    int voted = 0; /* ranks != 0: the vote was sent; rank 0: the decision was sent */
    if (pool->chunk_bytes < opts->chunk_bytes || (opts->filter == CKPT_FILTER_SHUFFLE && !pool->shuffle))
        return -EINVAL;

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);

    char final_dir[CKPT_PATH_MAX], tmp_dir[CKPT_PATH_MAX] = "", path[CKPT_PATH_MAX], name[32];
    json_t *body = NULL, *jbufs = NULL, **jchunks = NULL, *files = NULL, *trainer = NULL;
    chunk_job *chunks = NULL;
    size_t nchunks = 0;
    store_writer *w = NULL;
    uint64_t raw_total = 0, stored_total = 0;
    int tmp_made = 0;  /* remove tmp_dir on failure (a world of one, or rank 0 of a group) */
    int own_files = 0; /* rank != 0: its files may lie in tmp_dir */
    int decision_known = 0; /* rank != 0: rank 0's negative decision was read */
    char file_name[32];
    ckpt_rank_filename(rank, file_name, sizeof file_name);

    ckpt_step_dirname(step, name, sizeof name);
    char tmp_name[160];
    if (group) snprintf(tmp_name, sizeof tmp_name, ".tmp-%s-%s-%s", name, run_id, group->tag);
    else snprintf(tmp_name, sizeof tmp_name, ".tmp-%s-%s-%ld", name, run_id, (long)getpid());
    if ((rc = ckpt_path_join(tmp_dir, sizeof tmp_dir, opts->dir, tmp_name)) < 0 ||
        (rc = ckpt_path_join(final_dir, sizeof final_dir, opts->dir, name)) < 0) {
        tmp_dir[0] = '\0';
        goto out;
    }
    /* rank 0 removes the shared folder after any failure: other ranks may have written there */
    tmp_made = group && rank == 0;

    const int deferred = !trainer_json && trainer_wait;
    if (!deferred && (rc = parse_trainer(trainer_json, step, &trainer)) < 0) goto out;
    if (opts->lock && (rc = ckpt_dir_lock_check(opts->lock, opts->dir)) < 0 && rc != -ENOENT &&
        rc != -ESTALE && rc != -ENOTDIR) {
        /* the check itself failed (EACCES, EIO, ...): says nothing about the lock */
        LOG_E(TAG, "snapshot folder %s: cannot check this run's lock on it: %s; not saving step "
              "%llu", opts->dir, strerror(-rc), (unsigned long long)step);
        goto out;
    }
    if (rc < 0 && opts->lock) {
        LOG_E(TAG, "snapshot folder %s: this run's lock on it is gone (%s: the folder or its "
              ".lock was removed or replaced, and another run may hold it now); not saving step "
              "%llu there", opts->dir, rc == -ENOENT ? "no .lock" : "another .lock",
              (unsigned long long)step);
        rc = -ESTALE;
        goto out;
    }
    if (opts->dir_locked && !opts->lock) { /* another rank's lock: at least its file is there */
        char lp[CKPT_PATH_MAX];
        struct stat lst;
        if ((rc = ckpt_path_join(lp, sizeof lp, opts->dir, ".lock")) < 0) goto out;
        const int le = lstat(lp, &lst) == 0 ? 0 : errno;
        if (le && le != ENOENT && le != ENOTDIR) {
            rc = -le; /* EACCES, EIO, ...: says nothing about the lock */
            LOG_E(TAG, "snapshot folder %s: cannot check rank 0's lock on it: %s; not writing "
                  "this rank's part of step %llu", opts->dir, strerror(le),
                  (unsigned long long)step);
            goto out;
        }
        if (le) {
            LOG_E(TAG, "snapshot folder %s is gone or has no .lock (rank 0's lock on it was lost); "
                  "not writing this rank's part of step %llu there", opts->dir,
                  (unsigned long long)step);
            rc = -ESTALE;
            goto out;
        }
    }
    if (!opts->dir_locked && (rc = mkdir_p(opts->dir)) < 0) {
        LOG_E(TAG, "cannot create snapshot folder %s: %s", opts->dir, strerror(-rc));
        goto out;
    }
    struct stat st;
    if (stat(final_dir, &st) == 0) {
        LOG_E(TAG, "snapshot %s already exists; not overwriting it", final_dir);
        rc = -EEXIST;
        goto out;
    }
    /* in a group every rank creates the shared temp folder (the first one wins) */
    if (mkdir(tmp_dir, 0755) != 0 && !(group && errno == EEXIST)) {
        rc = -errno;
        LOG_E(TAG, "cannot create %s: %s", tmp_dir, strerror(errno));
        goto out;
    }
    if (!group) tmp_made = 1;
    else if (rank != 0) own_files = 1;

    jbufs = json_array();
    jchunks = calloc(nbufs ? nbufs : 1, sizeof *jchunks);
    if (!jbufs || !jchunks || (rc = plan_chunks(bufs, nbufs, opts->chunk_bytes, &chunks, &nchunks)) < 0) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < nbufs; i++) {
        const ckpt_buffer *b = &bufs[i];
        jchunks[i] = json_array();
        json_t *jb = json_pack("{s:s, s:s, s:i, s:I, s:[{s:i, s:s, s:I, s:I, s:O}]}", "name", b->name,
                               "dtype", b->dtype, "elem_bytes", (int)b->elem_bytes, "total_bytes",
                               (json_int_t)b->total_bytes, "shards", "rank", (int)rank, "file", file_name,
                               "offset", (json_int_t)b->offset, "bytes", (json_int_t)b->bytes,
                               "chunks", jchunks[i]);
        if (!jchunks[i] || !jb || json_array_append_new(jbufs, jb) != 0) {
            rc = -ENOMEM;
            goto out;
        }
        raw_total += b->bytes;
    }

    if ((rc = ckpt_path_join(path, sizeof path, tmp_dir, file_name)) < 0) goto out;
    store_writer_opts wo = STORE_WRITER_OPTS_INIT;
    wo.queue_depth = opts->queue_depth;
    wo.direct = opts->direct_io;
    size_t need = (size_t)wo.queue_depth * wo.buffer_bytes;
    if (pool->wmem_bytes < need) {
        void *m = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            rc = -ENOMEM;
            goto out;
        }
        memset(m, 0, need); /* fault in now */
        if (pool->wmem) munmap(pool->wmem, pool->wmem_bytes);
        pool->wmem = m;
        pool->wmem_bytes = need;
    }
    wo.memory = pool->wmem;
    if ((rc = store_writer_open(&w, path, &wo)) < 0) {
        LOG_E(TAG, "cannot create %s: %s", path, strerror(-rc));
        goto out;
    }
    /* no chunk is stored larger than it is raw: raw_total bounds the file */
    store_writer_reserve(w, raw_total);
    rc = run_pipeline(pool, w, opts, compress, step, bufs, chunks, nchunks, jchunks, &stored_total);
    if (rc < 0) {
        LOG_E(TAG, "writing step %llu to %s failed: %s", (unsigned long long)step, path, strerror(-rc));
        goto out;
    }
    uint64_t file_bytes = store_writer_offset(w);
    rc = store_writer_close(w, 1);
    w = NULL;
    if (rc < 0) {
        LOG_E(TAG, "finishing %s failed: %s", path, strerror(-rc));
        goto out;
    }
    ckpt_fault_point("after-data-fsync", step);

    files = json_pack("[{s:s, s:i, s:I}]", "name", file_name, "rank", (int)rank, "bytes",
                      (json_int_t)file_bytes);
    if (!files) {
        rc = -ENOMEM;
        goto out;
    }
    if (group && rank != 0) {
        /* phase one: publish this rank's part, durable, then vote and wait for rank 0 */
        json_t *part = json_pack("{s:O, s:O}", "file", json_array_get(files, 0), "buffers", jbufs);
        char *text = part ? json_dumps(part, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
        json_decref(part);
        char pname[64];
        snprintf(pname, sizeof pname, "rank-%05u" PART_SUFFIX, rank);
        if (!text) rc = -ENOMEM;
        else if ((rc = ckpt_path_join(path, sizeof path, tmp_dir, pname)) == 0)
            rc = store_write_file_durable(path, text, strlen(text));
        free(text);
        if (rc < 0) {
            if (rc == -ENOENT) /* rank 0 removes the shared folder when it gives up */
                LOG_E(TAG, "step %llu not committed: the shared temp folder %s is gone (rank 0 "
                      "gave up on this snapshot: see its log)", (unsigned long long)step, tmp_dir);
            else
                LOG_E(TAG, "writing the part record %s failed: %s", path, strerror(-rc));
            goto out;
        }
        ckpt_fault_point("after-part", step);
        voted = 1;
        if ((rc = group->vote(group->ctx, step, 0)) < 0) {
            LOG_E(TAG, "rank %u could not vote for step %llu: %s", rank, (unsigned long long)step,
                  strerror(-rc));
            goto out;
        }
        int decision = 0;
        rc = group->outcome(group->ctx, step, group->timeout_s, &decision);
        if (rc < 0) {
            LOG_E(TAG, "step %llu: no decision from rank 0 (%s); leaving this rank's shard in "
                  "place", (unsigned long long)step,
                  rc == -ETIMEDOUT ? "timed out" : strerror(-rc));
        } else if (decision < 0) {
            rc = decision;
            decision_known = 1;
            LOG_E(TAG, "step %llu was not committed: %s", (unsigned long long)step, strerror(-rc));
        }
        goto done;
    }
    if (group) {
        /* rank 0, phase one: wait for every other rank's durable part */
        if ((rc = group->collect(group->ctx, step, group->timeout_s)) < 0) {
            LOG_E(TAG, "step %llu not committed: %s", (unsigned long long)step,
                  rc == -ETIMEDOUT ? "some rank did not report its shard durable in time"
                                   : "some rank failed to write its shard");
            goto out;
        }
        if ((rc = merge_parts(tmp_dir, world, files, jbufs)) < 0) goto out;
    }

    if (deferred) { /* the record arrives now, after the chunks (ckpt_trainer_wait_fn) */
        char *json = NULL;
        if ((rc = trainer_wait(trainer_ctx, &json)) < 0) {
            LOG_E(TAG, "step %llu not committed: its trainer record did not come: %s",
                  (unsigned long long)step, strerror(-rc));
            goto out;
        }
        rc = parse_trainer(json, step, &trainer);
        free(json);
        if (rc < 0) goto out;
    }
    body = json_pack("{s:s, s:i, s:I, s:I, s:i, s:s, s:s, s:I, s:O, s:O, s:O}",
                     "format", CKPT_FORMAT_NAME, "format_version", CKPT_FORMAT_VERSION, "step",
                     (json_int_t)step, "created_unix", (json_int_t)time(NULL), "world_size",
                     (int)world, "run_id", run_id, "config_hash", config_hash, "chunk_bytes",
                     (json_int_t)opts->chunk_bytes, "files", files, "buffers", jbufs, "trainer",
                     trainer);
    if (!body) {
        rc = -ENOMEM;
        goto out;
    }
    if ((rc = ckpt_path_join(path, sizeof path, tmp_dir, CKPT_MANIFEST_NAME)) < 0) goto out;
    if ((rc = write_manifest(path, body)) < 0) {
        LOG_E(TAG, "writing %s failed: %s", path, strerror(-rc));
        goto out;
    }
    if (group) {
        /* the merged manifest must pass the reader's own checks before it may commit */
        ckpt_snapshot *probe;
        char why[512];
        if ((rc = ckpt_snapshot_open(&probe, tmp_dir, why, sizeof why)) < 0) {
            LOG_E(TAG, "merged manifest of step %llu does not validate: %s",
                  (unsigned long long)step, why);
            if (rc == -ENOENT || rc == -EPROTONOSUPPORT) rc = -EBADMSG;
            goto out;
        }
        ckpt_snapshot_close(probe);
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
    if (group) {
        voted = 1;
        int dr = group->decide(group->ctx, step, 0);
        if (dr < 0)
            LOG_W(TAG, "step %llu committed, but telling the other ranks failed: %s",
                  (unsigned long long)step, strerror(-dr));
    }
done:
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (stats && rc == 0) {
        stats->raw_bytes = raw_total;
        stats->stored_bytes = stored_total;
        stats->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    if (rc < 0) goto out; /* a rank != 0 whose snapshot was not committed */
    rc = 0;
out:
    store_writer_abort(w);
    if (group && !voted && rc < 0) {
        /* tell the others at once instead of letting them wait for the timeout */
        int vr = rank == 0 ? group->decide(group->ctx, step, rc) : group->vote(group->ctx, step, rc);
        if (vr < 0) LOG_W(TAG, "rank %u could not report its failure: %s", rank, strerror(-vr));
    }
    if (tmp_made && tmp_dir[0]) store_remove_tree(tmp_dir);
    if (own_files && rc < 0 && (!voted || decision_known)) {
        /* this rank's shard can never be part of a commit: take it back; the folder goes too
         * once it is empty (rank 0 may have given up and removed it already) */
        char pname[64];
        snprintf(pname, sizeof pname, "rank-%05u" PART_SUFFIX, rank);
        if (ckpt_path_join(path, sizeof path, tmp_dir, file_name) == 0) unlink(path);
        if (ckpt_path_join(path, sizeof path, tmp_dir, pname) == 0) unlink(path);
        rmdir(tmp_dir);
    }
    for (size_t i = 0; jchunks && i < nbufs; i++) json_decref(jchunks[i]);
    free(jchunks);
    free(chunks);
    json_decref(body);
    json_decref(jbufs);
    json_decref(files);
    json_decref(trainer);
    return rc;
}

int ckpt_save(const ckpt_save_opts *opts, uint64_t step, const char *run_id,
              const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
              const char *trainer_json, ckpt_save_stats *stats)
{
    int rc = ckpt_check_save(opts, run_id, config_hash, bufs, nbufs);
    if (rc < 0) return rc;
    ckpt_pool *pool;
    if ((rc = ckpt_pool_create(&pool, 1, opts->chunk_bytes, opts->filter == CKPT_FILTER_SHUFFLE)) < 0)
        return rc;
    rc = ckpt_persist(pool, opts, 1, step, run_id, config_hash, bufs, nbufs, trainer_json, NULL, NULL, NULL,
                      stats);
    ckpt_pool_destroy(pool);
    return rc;
}

int ckpt_set_aside(const char *dir, const char *name, char *newname, size_t newname_len)
{
    uint64_t step;
    char from[CKPT_PATH_MAX], to[CKPT_PATH_MAX], aside[96];
    if (!dir || !name || ckpt_parse_step_dirname(name, &step) != 0) return -EINVAL;
    int rc = ckpt_path_join(from, sizeof from, dir, name);
    if (rc < 0) return rc;
    /* a name of its own: .corrupt-<seconds>, then -1, -2, ... when that one is taken (the
     * same step found corrupt twice within a second, or a name made by hand); never
     * replacing what is there (store_rename_noreplace: a plain rename would replace an
     * empty folder) */
    const long long now = (long long)time(NULL);
    for (int k = 0;; k++) {
        if (k == 0) snprintf(aside, sizeof aside, "%.40s.corrupt-%lld", name, now);
        else snprintf(aside, sizeof aside, "%.40s.corrupt-%lld-%d", name, now, k);
        if ((rc = ckpt_path_join(to, sizeof to, dir, aside)) < 0) return rc;
        if ((rc = store_rename_noreplace(from, to)) == 0) break;
        if ((rc == -EEXIST || rc == -ENOTEMPTY) && k < 1000) continue;
        LOG_E(TAG, "cannot set %s aside as %s: %s", from, aside, strerror(-rc));
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
        size_t nl = strlen(e->d_name);
        int retired = nl > 8 && !strcmp(e->d_name + nl - 8, "-retired");
        LOG_I(TAG, "removed leftover temp folder %s (interrupted %s of step %llu)", path,
              retired ? "removal by retention" : "save", (unsigned long long)step);
        removed++;
    }
    closedir(d);
    if (removed) {
        int r = store_fsync_dir(dir);
        if (r < 0 && !rc) rc = r;
    }
    return rc < 0 ? rc : removed;
}

int ckpt_retain(const char *dir, unsigned keep_last, uint64_t keep_every, const char *run_id)
{
    ckpt_entry *e;
    size_t n;
    int rc = ckpt_list(dir, &e, &n);
    if (rc < 0) return rc;
    /* committed snapshots of the lineage, oldest first (ckpt_list sorts by step) */
    size_t ncommitted = 0;
    for (size_t i = 0; i < n; i++)
        if (e[i].status == CKPT_STATUS_COMMITTED && (!run_id || !strcmp(e[i].run_id, run_id)))
            e[ncommitted++] = e[i];
    int removed = 0, first_err = 0;
    for (size_t i = 0; i + 1 < ncommitted; i++) { /* never the newest */
        int keep = (keep_last == 0) || (ncommitted - i <= keep_last) ||
                   (keep_every > 0 && e[i].step % keep_every == 0);
        if (keep) continue;
        char from[CKPT_PATH_MAX], to[CKPT_PATH_MAX], tmp_name[64];
        snprintf(tmp_name, sizeof tmp_name, ".tmp-step-%09llu-retired", (unsigned long long)e[i].step);
        int r = ckpt_path_join(from, sizeof from, dir, e[i].name);
        if (r == 0) r = ckpt_path_join(to, sizeof to, dir, tmp_name);
        if (r == 0 && rename(from, to) != 0) r = -errno;
        if (r == 0) r = store_fsync_dir(dir);
        if (r < 0) {
            LOG_W(TAG, "retention: cannot remove %s: %s", from, strerror(-r));
            if (!first_err) first_err = r;
            continue;
        }
        /* renamed durably: no longer a snapshot. Said before its files are deleted, so that a
         * crash during the deletion leaves a log that accounts for the step (the temp folder
         * is removed at the next start, "interrupted removal by retention") */
        LOG_I(TAG, "retention: removed %s", from);
        removed++;
        ckpt_fault_point("during-retention", e[i].step);
        r = store_remove_tree(to);
        if (r < 0) {
            LOG_W(TAG, "retention: deleting the files of %s (now %s) failed: %s; the next start "
                  "removes them", from, to, strerror(-r));
            if (!first_err) first_err = r;
        }
    }
    if (removed) {
        int r = store_fsync_dir(dir);
        if (r < 0 && !first_err) first_err = r;
    }
    free(e);
    return first_err ? first_err : removed;
}

struct ckpt_dir_lock {
    int fd;
};

int ckpt_dir_lock_acquire(const char *dir, ckpt_dir_lock **out, long *holder_pid)
{
    return ckpt_dir_lock_acquire_owned(dir, NULL, out, holder_pid, NULL, 0);
}

static int owner_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64) return 0;
    for (size_t i = 0; i < n; i++)
        if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == '.' || s[i] == '-')) return 0;
    return 1;
}

int ckpt_dir_lock_acquire_owned(const char *dir, const char *owner, ckpt_dir_lock **out,
                                long *holder_pid, char *holder_owner, size_t holder_len)
{
    *out = NULL;
    if (holder_pid) *holder_pid = 0;
    if (holder_owner && holder_len) holder_owner[0] = '\0';
    if (owner && !owner_ok(owner)) return -EINVAL;
    if (ckpt_within_snapshot_folder(dir)) return -EINVAL;
    int rc = mkdir_p(dir);
    if (rc < 0) return rc;
    char path[CKPT_PATH_MAX];
    if ((rc = ckpt_path_join(path, sizeof path, dir, ".lock")) < 0) return rc;
    /* never through a link (a .lock -> /some/file link would have that file overwritten with
     * our pid), never a FIFO (O_NONBLOCK: the open does not wait), only a regular file */
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0) return errno == ENXIO ? -ENODEV : -errno; /* ENXIO: a socket */
    struct stat st;
    rc = fstat(fd, &st) != 0 ? -errno : !S_ISREG(st.st_mode) ? -ENODEV
                                        : st.st_nlink != 1   ? -EMLINK : 0;
    if (rc < 0) {
        close(fd);
        return rc;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
        char buf[96] = "";
        ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
        if (n > 0) {
            buf[n] = '\0';
            char *end = NULL;
            long pid = strtol(buf, &end, 10);
            if (holder_pid) *holder_pid = pid;
            /* "<pid> <owner>\n": the owner only when it is one (a garbled file names none) */
            if (holder_owner && holder_len && end && *end == ' ') {
                char *o = end + 1, *nl = strchr(o, '\n');
                if (nl) *nl = '\0';
                if (owner_ok(o)) snprintf(holder_owner, holder_len, "%s", o);
            }
        }
        close(fd);
        return rc;
    }
    char buf[96];
    int n = owner ? snprintf(buf, sizeof buf, "%ld %s\n", (long)getpid(), owner)
                  : snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n) {
        rc = -errno;
        close(fd);
        return rc;
    }
    ckpt_dir_lock *l = malloc(sizeof *l);
    if (!l) {
        close(fd);
        return -ENOMEM;
    }
    l->fd = fd;
    *out = l;
    return 0;
}

int ckpt_dir_lock_check(const ckpt_dir_lock *l, const char *dir)
{
    if (!l || !dir) return -EINVAL;
    char path[CKPT_PATH_MAX];
    int rc = ckpt_path_join(path, sizeof path, dir, ".lock");
    if (rc < 0) return rc;
    struct stat held, now;
    if (fstat(l->fd, &held) != 0) return -errno;
    if (lstat(path, &now) != 0) return errno == ENOENT ? -ENOENT : -errno;
    return held.st_dev == now.st_dev && held.st_ino == now.st_ino ? 0 : -ESTALE;
}

void ckpt_dir_lock_release(ckpt_dir_lock *l)
{
    if (!l) return;
    close(l->fd); /* drops the flock */
    free(l);
}
