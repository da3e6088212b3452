/* ckpt_snap.h - the open snapshot handle, shared by the local reader (ckpt_read.c) and the
 * S3 tier (ckpt_s3.c). Internal. */
#ifndef CKPT_SNAP_H
#define CKPT_SNAP_H

#include "ckpt.h"
#include "objstore.h"
#include "storage.h"

#include <stdint.h>
#include <zstd.h>

typedef struct chunk {
    uint64_t offset;       /* raw offset within the buffer */
    uint64_t bytes;        /* raw bytes */
    uint64_t file_offset;  /* where the stored frame starts in its file */
    uint64_t stored_bytes;
    uint64_t xxh_raw, xxh_stored;
    uint32_t file;         /* index into files */
    int filter;            /* enum ckpt_filter */
    int codec_zstd;        /* 1 zstd frame, 0 stored raw */
    uint32_t index;        /* chunk number within its shard, for messages */
} chunk;

typedef struct buffer {
    char *name;
    char *dtype;
    uint32_t elem_bytes;
    uint64_t total_bytes;
    size_t nchunks;
    chunk *chunks; /* sorted by offset, covering [0, total_bytes) exactly */
} buffer;

typedef struct file {
    char *name;
    uint64_t bytes;
} file;

/* Chunks a reading thread has in hand at once: one decoded, the others' reads in flight. */
#define CKPT_READ_SLOTS 3

/* Decode state of one reading thread: zstd context, bounded buffers and io_uring readers for
 * CKPT_READ_SLOTS chunks at a time: slot j has stored[j] (STORE_ALIGN-aligned, max_stored +
 * 2 x STORE_ALIGN bytes), raw[j] and the readers readers[j * nfiles + file] (opened on first
 * use); filt is used during a decode. */
typedef struct rctx {
    ZSTD_DCtx *dctx;
    uint8_t *stored[CKPT_READ_SLOTS], *raw[CKPT_READ_SLOTS], *filt;
    store_reader **readers;
} rctx;

struct ckpt_snapshot {
    char path[CKPT_PATH_MAX];
    uint64_t step;
    uint32_t world_size;
    int64_t created;
    char *run_id, *config_hash, *trainer_json;
    size_t nfiles, nbuffers;
    file *files;
    buffer *buffers;
    uint64_t max_stored, max_raw;
    uint64_t chunk_max; /* the manifest's chunk_bytes */
    unsigned threads; /* reading threads; default 2 */
    rctx *ctx;        /* (threads) decode states, allocated on first read */
    /* the S3 tier (ckpt_s3.c): NULL os = local files under path */
    objstore *os;
    int own_os;           /* close os with the handle */
    uint64_t part_bytes;  /* object size cap the snapshot was uploaded with */
    char *text;           /* the manifest as read (S3 handles only) */
    size_t text_len;
    int *copy_fds;        /* (nfiles) S3: where verified stored chunks are also written
                             (ckpt_s3_copy_begin), -1 none; NULL when not copying */
    /* A source of stored bytes other than local files and S3 (the memory tier,
     * ckpt_mem.c); NULL src_read = none. When set, the reading threads call
     * src_read(src_ctx, file, off, len, dst, bad, bad_len) instead of io_uring to get len
     * stored bytes of "data file" `file` at offset off; it returns 0, or a negative errno
     * with a one-line reason in bad (which names the place), and must be safe to call from
     * several reading threads at once. The checksums are checked by the reader as for files;
     * messages name files[i].name as it is (the source sets it to something a human can
     * find, e.g. a segment path and slot). src_close(src_ctx) runs in ckpt_snapshot_close
     * (may be NULL). src_kind tells the sources apart (CKPT_SRC_*). */
    int (*src_read)(void *src_ctx, uint32_t file, uint64_t off, uint64_t len, uint8_t *dst,
                    char *bad, size_t bad_len);
    void (*src_close)(void *src_ctx);
    void *src_ctx;
    int src_kind;
};

enum { CKPT_SRC_FILES = 0, CKPT_SRC_MEM = 1 };



/* Check and parse manifest text into s (s->path set by the caller): checksum, limits, JSON,
 * layout; local data files are stat-ed unless s->os is set. */
int ckpt_snapshot_parse_text(ckpt_snapshot *s, const char *text, size_t len, char *why,
                             size_t why_len);

/* S3 handles: read len stored bytes of data file `file` at offset off into dst (ckpt_s3.c). */
int ckpt_s3_read_stored(const ckpt_snapshot *s, uint32_t file, uint64_t off, uint64_t len,
                        uint8_t *dst, char *bad, size_t bad_len);

/* S3 handles with a copy folder (ckpt_s3_copy_begin): write the verified stored bytes of a
 * chunk of file `file` at off into the local copy; failures are ignored (the copy pass
 * refetches what is missing). */
void ckpt_s3_copy_chunk(const ckpt_snapshot *s, uint32_t file, uint64_t off, const uint8_t *p,
                        uint64_t len);

/* A new handle with the defaults (2 threads) for path; NULL when out of memory. */
ckpt_snapshot *ckpt_snapshot_alloc(const char *path);

#endif /* CKPT_SNAP_H */
