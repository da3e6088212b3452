/* ckpt_s3.h - the S3 tier of snapshots: reading, listing, remote retention, a local copy of a
 * remote snapshot, and the background uploader. The bytes move through storage/objstore.h.
 *
 * Key layout under s3://<bucket>/<prefix>/ (docs/FORMAT.md, "S3 layout"); keys use only
 * [A-Za-z0-9._/-]:
 *   <prefix>/step-%09llu/rank-%05u.bin             the rank's data file, when it has at most
 *                                                  part_bytes bytes, byte for byte
 *   <prefix>/step-%09llu/rank-%05u.bin.part-%05u   otherwise parts of exactly part_bytes bytes
 *                                                  (the last one shorter), in file order
 *   <prefix>/step-%09llu/manifest.json             the local manifest byte for byte, written
 *                                                  last, with the metadata header
 *                                                  x-amz-meta-ckpt-part-bytes: <part_bytes>
 * A snapshot is on S3 when, and only when, its manifest object is there and verifies (its
 * checksum); listing never decides completeness. Every data object is checked by size (HEAD)
 * before use and every chunk by its checksums (as from local files), so a partial object an
 * interrupted PUT left on a weak server is never taken as good data.
 *
 * Errors follow DESIGN I7: -EBADMSG only for evidence about the bytes (a manifest that does
 * not verify, a data object missing under a present manifest or of the wrong size, a chunk
 * checksum); an S3 outage, a timeout, denied access are returned as themselves and never
 * make a snapshot corrupt.
 */
#ifndef CKPT_S3_H
#define CKPT_S3_H

#include "ckpt.h"
#include "objstore.h"

/* Default object size cap: data files larger than this become several objects (libs3 2.0 has
 * no multipart upload; a retry then costs one part). */
#define CKPT_S3_PART_BYTES_DEFAULT (256ull << 20)
/* Range of the cap, bytes. */
#define CKPT_S3_PART_BYTES_MIN (1ull << 20)
#define CKPT_S3_PART_BYTES_MAX (4ull << 30)

/* The uploader's state file in the local folder of snapshots (rank 0 writes it; ckpt-inspect
 * list shows it): JSON, replaced atomically; not a snapshot, ignored by the listing. */
#define CKPT_UPLOAD_STATE_NAME ".s3-upload-state.json"

/* Non-zero when path starts with "s3://". */
int ckpt_is_s3_url(const char *path);

/* Open the snapshot of `step` under the store's prefix: GET its manifest (checksum, format,
 * limits and layout checked as ckpt_snapshot_open does), HEAD every data object (sizes).
 * The handle reads through os (borrowed: it must outlive the handle) with 8 reading threads
 * by default (ckpt_snapshot_set_threads), each chunk by one ranged GET (two when it straddles
 * a part boundary), started in buffer-offset order. ckpt_snapshot_path gives the URL
 * "s3://bucket/prefix/step-%09llu".
 * Errors: -ENOENT (no manifest object: not on S3, or not complete), -EBADMSG (evidence, why
 * says what), -EPROTONOSUPPORT, and objstore's errors (-EACCES, -ETIMEDOUT, -EIO, ...). */
int ckpt_snapshot_open_s3(ckpt_snapshot **out, objstore *os, uint64_t step, char *why,
                          size_t why_len);

/* Open a snapshot named by a local path, by "s3://bucket[/prefix]/step-%09llu", or by a
 * memory snapshot id "mem:<run_id>/<tag>/<step>/<world_size>" (ckpt_mem.h): for a URL
 * an objstore is opened from the environment with sopts (NULL = defaults; its url is
 * ignored) and owned by the handle; a "mem:" id is opened with ckpt_mem_snapshot_open under
 * the path prefix in the environment variable CKPT_MEM_PATH (sopts unused).
 * Errors: those of ckpt_snapshot_open / _open_s3 / objstore_open / ckpt_mem_snapshot_open;
 * -EINVAL for a URL whose last component is not a step folder name; -ENOENT for a "mem:" id
 * when CKPT_MEM_PATH is unset or empty (no memory tier in this process). */
int ckpt_snapshot_open_any(ckpt_snapshot **out, const char *path, const objstore_opts *sopts,
                           char *why, size_t why_len);

/* Text of the manifest as read (local or S3), owned by the handle; *len its bytes. */
const char *ckpt_snapshot_manifest_text(const ckpt_snapshot *s, size_t *len);

/* List the snapshots under the store's prefix: the step folders (ListObjects with delimiter
 * "/"), each manifest GET and checked: status committed (the manifest verifies), incomplete
 * (no manifest object: an upload in progress, interrupted or being deleted), corrupt,
 * newer-format or unreadable (a GET failed for a reason that says nothing about the bytes;
 * entry.error). name is "step-%09llu". Sorted by step. The caller frees *entries.
 * Errors: objstore's (the listing itself failed), -ENOMEM. why gets one line. */
int ckpt_list_s3(objstore *os, ckpt_entry **entries, size_t *n, char *why, size_t why_len);

/* Remote retention: keep the newest keep_last (>= 1) committed snapshots on S3 (numeric step
 * order; of lineage run_id when not NULL, others untouched) and remove every committed,
 * corrupt or incomplete snapshot older than the oldest one kept (corrupt and incomplete ones
 * only when no other lineage has snapshots under the prefix: they may be its upload in
 * progress); never the newest committed
 * one, never anything newer than it (an upload in progress). A snapshot is removed manifest
 * first (so it stops existing at once), then its data objects. Returns the number removed or
 * a negative errno (the listing failed; failures of single deletes are logged and counted
 * out). */
int ckpt_s3_retain(objstore *os, unsigned keep_last, const char *run_id, char *why,
                   size_t why_len);

/* Before reading a snapshot opened from S3: also write every chunk's stored bytes that a read
 * fetches and verifies into the same-named data files in tmpdir (created when missing; files
 * opened without truncation, so several ranks may share the folder), so that
 * ckpt_s3_copy_files later fetches only what no read did. Errors: -EINVAL (not an S3 handle,
 * or called twice), -errno of mkdir, -ENOMEM; a file that cannot be opened is skipped. */
int ckpt_s3_copy_begin(ckpt_snapshot *s, const char *tmpdir);

/* Copy the data files of a snapshot opened with ckpt_snapshot_open_s3 whose index f
 * satisfies f % nparts == part into the folder tmpdir (created by the caller), each chunk
 * range-read and checked against its stored checksum before it is written, then fsynced; a
 * chunk already in the file with the right checksum (ckpt_s3_copy_begin) is not fetched.
 * *fetched (may be NULL) gets the stored bytes that had to be fetched.
 * Used by ranks together (part = rank, nparts = world size) to leave a verified local copy
 * after a restore from S3; ckpt_s3_commit_local then makes it a snapshot.
 * Errors: -EBADMSG (a chunk that does not verify), objstore's, -errno of the writes. */
int ckpt_s3_copy_files(ckpt_snapshot *s, const char *tmpdir, uint32_t part, uint32_t nparts,
                       uint64_t *fetched, char *why, size_t why_len);

/* Write the snapshot's manifest into tmpdir, fsync, rename tmpdir to dir/step-%09llu and fsync
 * dir: the commit of a local copy (every data file must be in tmpdir). Errors: -EEXIST (the
 * step folder exists), -errno. */
int ckpt_s3_commit_local(ckpt_snapshot *s, const char *tmpdir, const char *dir);

/* ------------------------------------------------------------------ the uploader
 *
 * One per rank, one thread. ckpt_uploader_submit hands it a committed local snapshot (the
 * data file is opened at once, so local retention removing the folder later does not matter);
 * the thread PUTs the rank's objects (several in flight; the stale manifest object of the same
 * step, if any, is deleted first so that a re-save never mixes with it: case C32), then
 *   ranks != 0: vote(step, result) on the group;
 *   rank 0:     collect(step, timeout) waits for every other rank's vote; when all are 0 it
 *               PUTs the manifest object (last), then applies remote retention, and
 *               decide(step, result).
 * The thread takes the newest waiting snapshot first (the one a restart wants). The backlog
 * holds at most `backlog` snapshots not yet started: when a new one comes and it is full, the
 * oldest waiting one is dropped (skipped: counted, logged, and voted -ECANCELED
 * so rank 0 learns at once), never the newest. Nothing here ever blocks the caller. */

enum ckpt_upload_event_kind {
    CKPT_UPLOAD_DONE = 1,    /* this rank's objects are up (rank 0: the snapshot is complete) */
    CKPT_UPLOAD_FAILED = 2,  /* not uploaded (why) */
    CKPT_UPLOAD_SKIPPED = 3, /* dropped from a full backlog */
    CKPT_UPLOAD_LAG = 4      /* rank 0: the lag passed lag_warn_s (once per crossing) */
};

typedef struct ckpt_upload_event {
    int kind;
    uint64_t step;
    uint64_t bytes;          /* bytes this rank PUT for it */
    double seconds;          /* from submit to the end */
    unsigned requests, retries;
    int result;              /* 0 or the negative errno */
    const char *why;         /* FAILED: one line (endpoint, bucket, key, reason) */
    /* rank 0: newest local commit vs newest complete S3 snapshot */
    uint64_t lag_steps;
    double lag_seconds;      /* age of the oldest local commit not yet on S3; 0 caught up */
    int64_t remote_step;     /* newest complete on S3, -1 none yet */
} ckpt_upload_event;

typedef struct ckpt_uploader_opts {
    objstore *os;            /* the uploader's own store handle (not shared: destroy cancels
                                it); the caller closes it after ckpt_uploader_destroy */
    const char *dir;         /* the local folder of snapshots */
    const ckpt_group *group; /* NULL: a world of one; else as for the engine (rank, world size,
                                vote/collect/decide callbacks on a channel of its own) */
    uint64_t part_bytes;     /* object size cap; default CKPT_S3_PART_BYTES_DEFAULT */
    unsigned backlog;        /* snapshots waiting at most; default 2, range [1, 64] */
    unsigned keep_last;      /* rank 0: remote retention; 0 = keep all */
    const char *run_id;      /* lineage for remote retention (copied) */
    double snapshot_timeout_s; /* bound of one snapshot's upload (and of collect); default 1800 */
    double lag_warn_s;       /* rank 0: CKPT_UPLOAD_LAG when the lag passes it; default 1800 */
    int64_t remote_step;     /* rank 0: the newest complete step already on S3 when the run
                                starts (from the resume's listing), -1 none or unknown: the lag
                                starts from it */
    const char *state_file;  /* rank 0: where the upload state is written (JSON, replaced
                                atomically; read by ckpt-inspect list); NULL = none */
    void (*on_event)(void *ctx, const ckpt_upload_event *ev); /* on the uploader's thread */
    void *ctx;
} ckpt_uploader_opts;

typedef struct ckpt_uploader ckpt_uploader;

/* Start the uploader's thread. Errors: -EINVAL bad options, -ENOMEM. */
int ckpt_uploader_create(ckpt_uploader **out, const ckpt_uploader_opts *opts);

/* Queue the committed snapshot dir/step-<step> (committed_unix: its commit time, for the
 * lag). Thread-safe; never blocks on I/O beyond opening the data file (and, on rank 0,
 * reading the manifest). Returns 0 queued, 1 queued and an older one dropped, or -errno
 * (the file could not be opened: counted failed). */
int ckpt_uploader_submit(ckpt_uploader *u, uint64_t step, double committed_unix);

/* Wait until the backlog is empty and nothing is in flight, at most timeout_s. Returns 0, or
 * -ETIMEDOUT. */
int ckpt_uploader_drain(ckpt_uploader *u, double timeout_s);

typedef struct ckpt_upload_stats {
    uint64_t uploaded, failed, skipped;
    uint64_t bytes;
    int64_t remote_step;     /* rank 0: newest complete; -1 none */
    uint64_t lag_steps;
    double lag_seconds;
} ckpt_upload_stats;

void ckpt_uploader_stats(ckpt_uploader *u, ckpt_upload_stats *st);

/* "step 40 (in progress), 38, 36" - what is not uploaded yet, newest first - into out. */
void ckpt_uploader_pending(ckpt_uploader *u, char *out, size_t len);

/* Stop: drop what waits (voted -ECANCELED), cancel what is in flight (objstore_cancel on the
 * uploader's store), join the thread, free. Call ckpt_uploader_drain first to let the backlog
 * finish. Accepts NULL. */
void ckpt_uploader_destroy(ckpt_uploader *u);

/* "s3://bucket/prefix/step-%09llu" of the store's prefix into out (len bytes). */
void ckpt_s3_step_url(const objstore *os, uint64_t step, char *out, size_t len);

/* The key of data object `part` of file `file` of `step` (nparts 1: the file's own name). */
int ckpt_s3_object_key(const objstore *os, uint64_t step, const char *file, uint32_t part,
                       uint32_t nparts, char *out, size_t len);

#endif /* CKPT_S3_H */
