/* ckpt.h - snapshots of flat state buffers: format, commit protocol, restore, listing.
 *
 * The module knows nothing about models. A snapshot holds named flat buffers (for example
 * "params", "adam_m", "adam_v"), each split into shards by rank and into chunks of at most
 * chunk_bytes raw bytes, plus an opaque trainer-state record (a JSON object given as text).
 * The layout and commit protocol are specified in docs/FORMAT.md:
 *
 *   <dir>/step-<9 digits>/manifest.json      written last: the commit record
 *   <dir>/step-<9 digits>/rank-<5 digits>.bin concatenated zstd frames, one per chunk
 *   <dir>/.tmp-step-<9 digits>-<id>/          in progress; never read; removed at start-up
 *
 * Commit: data files written and fsynced -> manifest written and fsynced -> temp folder
 * renamed to its final name -> parent folder fsynced. A folder without a valid manifest does
 * not exist for readers.
 *
 * Errors (negative errno, STYLE.md): -EINVAL bad argument, -EBADMSG corrupt data or checksum
 * mismatch, -EPROTONOSUPPORT newer format, -ENOENT no such snapshot, -EEXIST step already
 * committed, -ENOSPC, -EIO, -ENOMEM, other -errno from the file system.
 *
 * Thread-safety: handles are used by one thread at a time; distinct handles are independent.
 */
#ifndef CKPT_H
#define CKPT_H

#include <stddef.h>
#include <stdint.h>

/* Version of the snapshot format this code writes and the newest it reads. */
#define CKPT_FORMAT_VERSION 1

/* Longest snapshot folder path this module handles, bytes including the NUL. */
#define CKPT_PATH_MAX 4096
/* The longest snapshot root folder (--ckpt-dir, absolute): room for the names beneath it
 * (temp folders named with the run id, shard files) within CKPT_PATH_MAX. */
#define CKPT_DIR_MAX (CKPT_PATH_MAX - 512)

/* Limits of the format (docs/FORMAT.md, "Limits"): a reader rejects a manifest past any of
 * them as corrupt, and a writer refuses (-EINVAL, or -EFBIG for the manifest's size) to save
 * a snapshot that would pass one, so that everything written can be read. They are sized for
 * the largest jobs we can imagine - tens of thousands of ranks, tens of thousands of
 * tensors saved as separate buffers, tens of terabytes of state - and no more, because
 * every manifest is parsed whole (the value limit bounds the parser's memory to about 0.9 GiB
 * for a moment) and listing opens every snapshot's manifest. */
#define CKPT_MAX_MANIFEST_BYTES (96u << 20) /* manifest.json, bytes */
#define CKPT_MAX_WORLD_SIZE 65536u          /* ranks that saved it = data files at most */
#define CKPT_MAX_BUFFERS 65536u             /* state buffers */
#define CKPT_MAX_CHUNKS (1u << 18)          /* chunks over all buffers and ranks (262144:
                                               1 TiB of state at 4 MiB chunks, 64 TiB at
                                               256 MiB chunks) */
#define CKPT_MAX_TRAINER_BYTES (16u << 20)  /* the trainer record, compact JSON, bytes */
#define CKPT_MAX_JSON_VALUES 8000000u       /* JSON values in the manifest, counted as the
                                               ',' '[' '{' ':' outside strings (about 17 a
                                               chunk; the largest real manifest has about
                                               7.3 million): bounds the parser's memory to
                                               about 0.9 GiB whatever the manifest's shape */

/* Filters applied to a chunk before compression. */
enum ckpt_filter {
    CKPT_FILTER_NONE = 0,
    CKPT_FILTER_SHUFFLE = 1 /* byte planes of elem_bytes-wide elements (see FORMAT.md) */
};

/* ------------------------------------------------------------------ writing */

typedef struct ckpt_save_opts {
    const char *dir;       /* snapshot root folder; created if missing. Required. */
    uint64_t chunk_bytes;  /* raw bytes per chunk; default 4 MiB; range [4 KiB, 1 GiB];
                              a multiple of 16 so elements never straddle chunks */
    int zstd_level;        /* zstd compression level; default 1; range [-7, 19] */
    int filter;            /* enum ckpt_filter; default CKPT_FILTER_NONE */
    int direct_io;         /* 1: O_DIRECT data writes where allowed (default); 0: buffered */
    unsigned queue_depth;  /* io_uring writes in flight; default 8; range [1, 64] */
    const char *lock_owner;/* ckpt_mem_flush: the job named in the folder's lock while it
                              writes (ckpt_dir_lock_acquire_owned); NULL none */
    const struct ckpt_dir_lock *lock; /* the caller's lock on dir (ckpt_dir_lock_acquire), or
                              NULL: before each save (and the engine's retention) dir/.lock
                              must still be the file it locks (ckpt_dir_lock_check), else the
                              save fails with -ESTALE and dir is not created again */
    int dir_locked;        /* 1: dir was made and locked by the group's rank 0 (train, every
                              rank): no rank creates it, and a rank without `lock` writes
                              nothing while dir/.lock is missing (-ESTALE): a folder removed
                              under the run is a lost lock, not a folder to make again */
} ckpt_save_opts;

#define CKPT_SAVE_OPTS_INIT {NULL, 4u << 20, 1, CKPT_FILTER_NONE, 1, 8u, NULL, NULL, 0}

/* One buffer (or this rank's shard of it) to save. The bytes are only read. */
typedef struct ckpt_buffer {
    const char *name;     /* [A-Za-z0-9_.-]{1,63}, unique within the snapshot */
    const char *dtype;    /* element type for readers: "f32", "u16", "u8", ... */
    uint32_t elem_bytes;  /* bytes per element: 1, 2, 4 or 8 */
    uint64_t total_bytes; /* bytes of the whole buffer across all ranks */
    uint64_t offset;      /* where this rank's shard starts in the whole buffer, bytes; 0 in
                             a world of one rank */
    uint64_t bytes;       /* bytes of this rank's shard (may be 0); total_bytes in a world
                             of one rank */
    const void *data;     /* the shard's bytes; NULL only when bytes == 0 */
} ckpt_buffer;

/* Figures of one save, for logs and benchmarks. */
typedef struct ckpt_save_stats {
    uint64_t raw_bytes;    /* bytes of state saved by this call */
    uint64_t stored_bytes; /* bytes written to data files (after compression) */
    double seconds;        /* wall time of the call */
} ckpt_save_stats;

/* Save one snapshot of `step` synchronously, for a world of one rank: writes
 * rank-00000.bin with every buffer, then commits with the manifest. It runs the same
 * pipeline as the asynchronous engine below (compressing on one thread; a chunk that zstd
 * does not shrink is stored raw) and writes the same bytes. `trainer_json` must be
 * a JSON object (text); it is stored verbatim under "trainer". `run_id` and `config_hash`
 * are free-form identifiers ([A-Za-z0-9_.-]{1,63}) recorded for lineage checks.
 * On any error nothing is committed and the temp folder is removed; an existing committed
 * snapshot is never modified. stats may be NULL. Nothing past the format's limits is written
 * (CKPT_MAX_*): more buffers, chunks (ckpt_snapshot_max_chunks) or trainer-record bytes than
 * they allow give -EINVAL, a manifest over CKPT_MAX_MANIFEST_BYTES -EFBIG.
 * Errors: -EINVAL (bad options, names, JSON, limits), -EEXIST (step already committed),
 * -EFBIG, -ENOSPC, -EIO, -ENOMEM, other -errno. */
int ckpt_save(const ckpt_save_opts *opts, uint64_t step, const char *run_id,
              const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
              const char *trainer_json, ckpt_save_stats *stats);

/* Upper bound of the chunks a snapshot of these buffers (their total_bytes) takes when cut
 * into chunk_bytes pieces by world_size ranks: per buffer ceil(total / chunk_bytes) plus one
 * per shard boundary. UINT64_MAX on overflow or a zero argument. Thread-safe. */
uint64_t ckpt_snapshot_max_chunks(const ckpt_buffer *bufs, size_t nbufs, uint64_t chunk_bytes,
                                  uint32_t world_size);

/* The smallest chunk size of chunk_bytes x 2^k (k >= 0), at most 1 GiB, for which a snapshot
 * of these buffers by world_size ranks stays within CKPT_MAX_CHUNKS; 0 when none does or
 * chunk_bytes is not a multiple of 16 of at least 4096. A trainer calls it once with its
 * whole buffers (only total_bytes is read) so that huge states get larger chunks, not a
 * refused save. Thread-safe. */
uint64_t ckpt_fit_chunk_bytes(uint64_t chunk_bytes, const ckpt_buffer *bufs, size_t nbufs,
                              uint32_t world_size);

/* ------------------------------------------------------------------ asynchronous engine
 *
 * Two-phase snapshots (DESIGN section 3; CheckFreq, Mohan et al., FAST 2021):
 *   stage   - ckpt_engine_stage() copies the buffers and the trainer record into a staging
 *             area that is allocated once and reused (the only part that stalls training);
 *             with `overlap`, the persist starts with the copy and follows it chunk by chunk
 *             (the save is durable sooner; the copy, sharing cores and memory bandwidth,
 *             takes longer);
 *   persist - a background thread splits the staged bytes into chunks, compresses them on
 *             `threads` worker threads (each chunk an independent zstd frame, or stored raw
 *             when compression does not shrink it), checksums them, writes them in order
 *             through io_uring (queue depth `queue_depth`), fsyncs, commits (ckpt_save's
 *             protocol) and then applies retention.
 * The bytes a persist writes depend only on the staged bytes and the options, never on
 * timing: the files equal those of a synchronous ckpt_save of the same state.
 *
 * At most one persist is in flight. When a stage is requested while one is, the policy says
 * what happens: CKPT_POLICY_WAIT waits for it (bounded by wait_timeout_s), CKPT_POLICY_SKIP
 * skips the new snapshot and counts it.
 *
 * Memory, allocated at the first stage and reused (bounded, case C21):
 *   staging:  the sum of the staged buffers' bytes (exactly what was asked to be saved);
 *   pipeline: 2 x threads x ZSTD_compressBound(chunk_bytes) for compressed chunks, plus
 *             threads x chunk_bytes when the shuffle filter is on, plus
 *             queue_depth x 1 MiB io_uring write buffers.
 * A later stage with more bytes than the first grows the staging area once.
 *
 * Thread-safety: one thread drives an engine (stage/wait/destroy); the engine's own threads
 * never touch the caller's buffers after ckpt_engine_stage returns.
 */

enum ckpt_policy { CKPT_POLICY_WAIT = 0, CKPT_POLICY_SKIP = 1 };

/* ------------------------------------------------------------------ sharded snapshots
 *
 * In a job of W ranks every rank persists its own shard of each buffer (a byte range
 * [offset, offset + bytes) of the whole buffer, see ckpt_buffer) into its own data file
 * rank-<rank>.bin, and the snapshot commits only when every rank's file is durable: a
 * two-phase commit (DESIGN section 5) whose votes travel over a channel the caller provides
 * (train uses the elastic store; a test may use memory):
 *
 *   every rank: write rank-<r>.bin into the shared temp folder .tmp-step-<step>-<run>-<tag>,
 *               fsync it, write and fsync its part record rank-<r>.part.json (the file's
 *               size and its shards' chunk lists), then vote(step, 0) - or vote(step, -errno)
 *               as soon as anything fails;
 *   rank 0:     collect(step, timeout) waits for the votes of every other rank; when all
 *               are 0 it merges the part records into manifest.json (world_size W), checks the
 *               result with the reader's own validation, then commits exactly as a world of
 *               one does (fsync, rename, fsync of the parent) and calls decide(step, 0); on
 *               any failure (a negative vote, a vote missing at the timeout, its own error) it
 *               removes the temp folder and calls decide(step, -errno);
 *   ranks != 0: outcome(step, timeout) waits for rank 0's decision, which becomes the
 *               result of their persist (ckpt_engine_last): 0 means committed. A rank that
 *               failed before voting, or learned a negative decision, removes its own files
 *               from the temp folder (and the folder when it is then empty), so that a rank
 *               arriving after rank 0 gave up leaves nothing behind.
 * A rank that dies before voting means no commit (rank 0 times out); rank 0 dying means no
 * commit (the temp folder is left for the next start's ckpt_remove_temp). Nothing ever
 * becomes visible under a step-* name unless every shard is durable and the merged manifest
 * validates. Only rank 0 applies retention (give the other ranks keep_last = keep_every = 0).
 *
 * The callbacks run on the engine's persist thread; each must return within its timeout (or
 * within a few seconds for vote/decide) and report failures as a negative errno. */
typedef struct ckpt_group {
    uint32_t rank;        /* this rank, [0, world_size) */
    uint32_t world_size;  /* ranks that save each snapshot, [1, 65536]; 1 behaves as no group
                             but still calls the callbacks */
    const char *tag;      /* [A-Za-z0-9_.-]{1,63}, the same on every rank and unique to this
                             launch: names the shared temp folder. Copied by the engine. */
    void *ctx;            /* passed to the callbacks */
    int (*vote)(void *ctx, uint64_t step, int result);            /* ranks != 0 */
    int (*collect)(void *ctx, uint64_t step, double timeout_s);   /* rank 0: 0 when every other
                                                                     rank voted 0 */
    int (*decide)(void *ctx, uint64_t step, int result);          /* rank 0 */
    int (*outcome)(void *ctx, uint64_t step, double timeout_s, int *decision);
                          /* ranks != 0: 0 when rank 0's decision was read into *decision
                             (0 committed, or the negative errno of the failure); a negative
                             errno when none could be read (timeout, channel gone) - then
                             the rank cannot know whether the snapshot was committed and
                             leaves its files alone */
    double timeout_s;     /* bound of collect and outcome, seconds; > 0; e.g. 600 */
} ckpt_group;

typedef struct ckpt_engine_opts {
    ckpt_save_opts save;    /* folder, chunking, codec, I/O; see ckpt_save_opts */
    int compress;           /* 1: zstd (default); 0: every chunk stored raw (codec "none") */
    unsigned threads;       /* compression worker threads; default 2; range [1, 64] */
    int policy;             /* enum ckpt_policy; default CKPT_POLICY_WAIT */
    double wait_timeout_s;  /* longest wait for a persist in flight; default 3600 s */
    unsigned keep_last;     /* retention: keep the newest K committed snapshots; 0 = keep all */
    uint64_t keep_every;    /* retention: also keep every snapshot whose step is a multiple
                               of N; 0 = none */
    size_t reserve_bytes;   /* staging bytes to allocate (and fault in) at create, so that
                               the first stage does not pay for it; 0 = at the first stage */
    int overlap;            /* 0 (default): the persist starts after the copy (smallest stall);
                               1: it starts with the copy (shortest time to durable) */
    const ckpt_group *group;/* NULL (default): a world of one rank, whole buffers; else this
                               rank's part in a sharded snapshot (copied at create; the
                               callbacks and ctx must outlive the engine) */
    void (*on_commit)(void *ctx, uint64_t step); /* NULL, or called on the persist thread
                               when a snapshot committed (ranks != 0: when rank 0's decision
                               said so), before retention runs: e.g. to hand it to the S3
                               uploader. Must not block long. */
    void *on_commit_ctx;
} ckpt_engine_opts;

#define CKPT_ENGINE_OPTS_INIT {CKPT_SAVE_OPTS_INIT, 1, 2u, CKPT_POLICY_WAIT, 3600.0, 0u, 0u, 0u, 0, NULL, NULL, NULL}

/* Figures of the last finished persist. */
typedef struct ckpt_persist_stats {
    uint64_t step;
    int result;            /* 0 committed, or the negative errno of the failure */
    uint64_t raw_bytes, stored_bytes;
    double stage_seconds;  /* the stall of its stage (the copy) */
    double persist_seconds;/* from the start of the stage to the end of the commit: the
                              whole save, stall included */
    unsigned removed;      /* snapshots removed by retention after it committed */
} ckpt_persist_stats;

typedef struct ckpt_engine ckpt_engine;

/* Create an engine; starts no thread until the first stage. The caller frees it with
 * ckpt_engine_destroy. Errors: -EINVAL bad options, -ENOMEM. */
int ckpt_engine_create(ckpt_engine **out, const ckpt_engine_opts *opts);

/* Stage a snapshot of `step` (arguments as for ckpt_save, world of one rank) and start its
 * persist in the background. Returns 0 when staged, 1 when skipped by CKPT_POLICY_SKIP
 * (counted in ckpt_engine_skipped). *stall_s (may be NULL) gets the time this call took.
 * Errors: -EINVAL bad arguments, -ETIMEDOUT the persist in flight did not finish within
 * wait_timeout_s (nothing staged), -ENOMEM. The result of the previous persist is not
 * returned here: see ckpt_engine_last. */
int ckpt_engine_stage(ckpt_engine *e, uint64_t step, const char *run_id, const char *config_hash,
                      const ckpt_buffer *bufs, size_t nbufs, const char *trainer_json,
                      double *stall_s);

/* Like ckpt_engine_stage, but the bytes are NOT copied: the persist reads bufs[i].data
 * itself (for the memory tier: the slot ckpt_mem_write just filled, via its staged_out).
 * Contract: the caller keeps every bufs[i].data byte unchanged and mapped from this call
 * until the persist has finished (ckpt_engine_busy() == 0, or ckpt_engine_wait returned);
 * with the memory tier, pass the slot of the persist in flight as avoid_slot to the next
 * ckpt_mem_write. The bufs array, names, dtypes and trainer_json are copied (they may go
 * after the call). The files written equal those of ckpt_engine_stage of the same bytes;
 * `overlap` does not apply (there is no copy to follow). The policy (wait / skip) applies
 * as for a stage: with a persist in flight it waits for it or skips.
 * Returns 0 when the persist started, 1 when skipped by CKPT_POLICY_SKIP. *stall_s (may be
 * NULL) gets the time the call took (the wait for a persist in flight, if any).
 * Errors: as ckpt_engine_stage (-EINVAL, -ETIMEDOUT, -ENOMEM); a buffer with bytes > 0 and
 * data NULL is -EINVAL. */
int ckpt_engine_persist_staged(ckpt_engine *e, uint64_t step, const char *run_id,
                               const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
                               const char *trainer_json, double *stall_s);

/* Staging from device memory (GPU shards): the caller's copier moves the bytes.
 *
 * ckpt_engine_stage_device() is ckpt_engine_stage() for buffers whose data are DEVICE
 * pointers (train/device.h). Instead of memcpy, the engine cuts each buffer into pieces of
 * save.chunk_bytes (the snapshot's chunks, so that each chunk is one copy) and calls
 * copier->copy for each, in order, which only QUEUES an asynchronous copy into the staging
 * area (train: cudaMemcpyAsync on a dedicated copy stream, or the CPU device layer's worker
 * thread) and returns a ticket; then it starts the persist and returns: the stall is the time
 * to queue the copies, not to do them. The persist's compression workers call
 * copier->wait(ticket of the chunk they read) before reading a chunk, so compression and
 * writing start with the first chunk copied, not the last. The files written equal those of
 * ckpt_engine_stage of the same bytes.
 *
 * The staging area is allocated once (reserve_bytes or the first stage) and passed to
 * copier->pin once per allocation (train: train_host_register, so that the copies are true
 * DMA), and to copier->unpin before it is freed or grown. (Added with the implementation:)
 * the unpin goes to the copier that pinned it, which may be at ckpt_engine_destroy, so the
 * pinning copier's ctx must outlive the engine; a plain ckpt_engine_stage that grows a
 * pinned area unpins it too. After a failed persist the engine waits (bounded) for the
 * copies it did not wait for, so that the staging area is never reused under a copy.
 *
 * Contract: the caller keeps the device buffers unchanged until every copy queued by this
 * call is complete: it waits on its own event recorded after the call on the copy stream
 * (or copier->wait(last ticket)) before the next optimizer update writes them. The copier
 * must order the copies after the work that produced the bytes (train: the copy stream waits
 * on an event recorded after the optimizer update).
 *
 * Every callback returns 0 or a negative errno; a failed copy or wait fails the persist
 * (ckpt_engine_last reports it; nothing is committed); a failed pin fails the stage with its
 * error (nothing staged). wait must return within timeout_s. Callbacks run on the calling
 * thread (pin, unpin, copy) and on the persist's worker threads (wait: concurrently, from
 * several threads). */
typedef struct ckpt_copier {
    void *ctx;
    int (*pin)(void *ctx, void *host, size_t bytes);   /* may be NULL */
    void (*unpin)(void *ctx, void *host);              /* may be NULL */
    int (*copy)(void *ctx, void *host_dst, const void *device_src, size_t bytes,
                uint64_t *ticket);
    int (*wait)(void *ctx, uint64_t ticket, double timeout_s);
    double timeout_s;                                  /* bound of each wait; > 0 */
} ckpt_copier;

/* Arguments and results as ckpt_engine_stage (bufs[i].data are device pointers, read only by
 * the copier), plus the copier (copied; its ctx must outlive the persist). *last_ticket
 * (may be NULL) gets the ticket of the last copy queued (unchanged when nothing was queued:
 * skipped, or no bytes). Errors: as ckpt_engine_stage; -EINVAL a NULL copier, copy or wait;
 * a negative errno of pin or copy (nothing staged, no persist started; copies already
 * queued are waited for before the call returns). */
int ckpt_engine_stage_device(ckpt_engine *e, uint64_t step, const char *run_id,
                             const char *config_hash, const ckpt_buffer *bufs, size_t nbufs,
                             const char *trainer_json, const ckpt_copier *copier,
                             uint64_t *last_ticket, double *stall_s);

/* A deferred trainer record. ckpt_engine_stage_device with trainer_json NULL stages the
 * snapshot without its record: the persist copies, compresses and writes every chunk, then
 * (only where the record is needed: a world of one, or rank 0 of a group, before the
 * manifest) waits at most copier->timeout_s for this call, which hands it the record of
 * `step` (copied; checked as at a stage). The trainer uses it to compute the digests of the
 * state after the copies, off the stage's stall. trainer_json NULL withdraws the record: the
 * persist fails (-ECANCELED) and nothing is committed; ckpt_engine_destroy withdraws a record
 * still missing. Returns 0, -ENOENT when no persist of `step` waits for a record (it finished,
 * failed before, was skipped, or its record was already given: nothing changed), -EINVAL
 * (e NULL), -ENOMEM. A record that turns out invalid fails the persist (-EINVAL). */
int ckpt_engine_set_trainer(ckpt_engine *e, uint64_t step, const char *trainer_json);

/* Wait until no persist is in flight, at most timeout_s seconds. Returns the result of the
 * last persist (0 or its negative errno, which may itself be -ETIMEDOUT, e.g. a group vote
 * that timed out; 0 if none ran), or -EINPROGRESS when a persist is still in flight at the
 * end of the wait. */
int ckpt_engine_wait(ckpt_engine *e, double timeout_s);

/* Non-zero while a persist is in flight. */
int ckpt_engine_busy(ckpt_engine *e);

/* Copy the figures of the last finished persist into *st; returns 0, or -ENOENT when none
 * has finished yet. */
int ckpt_engine_last(ckpt_engine *e, ckpt_persist_stats *st);

/* Finished persists since creation (committed or failed), and snapshots skipped. */
uint64_t ckpt_engine_completed(ckpt_engine *e);
uint64_t ckpt_engine_skipped(ckpt_engine *e);

/* Wait for the persist in flight (at most wait_timeout_s), stop the threads and free
 * everything. Returns the last persist's result like ckpt_engine_wait; -EINPROGRESS when the
 * persist did not finish in time: the engine is then abandoned (its memory leaked, never
 * freed under a running thread). Accepts NULL. */
int ckpt_engine_destroy(ckpt_engine *e);

/* Apply retention to dir now. Considers the committed snapshots of lineage run_id (all
 * lineages when run_id is NULL); keeps the newest keep_last of them (0 = all) and those whose
 * step is a multiple of keep_every (0 = none); removes the others. The newest committed
 * snapshot is never removed, nor anything that is not a committed snapshot. A snapshot is
 * removed by renaming it to a temp name (".tmp-step-<step>-retired") and fsyncing dir first,
 * so a crash never leaves a half-deleted snapshot under a final name; leftovers go with
 * ckpt_remove_temp. Returns the number removed, or -errno (the first failure; it goes on
 * with the others). */
int ckpt_retain(const char *dir, unsigned keep_last, uint64_t keep_every, const char *run_id);

/* ------------------------------------------------------------------ folder lock */

typedef struct ckpt_dir_lock ckpt_dir_lock;

/* Create dir (and its parents) when missing, and take an exclusive advisory lock (flock) on
 * dir/.lock for the caller's lifetime, so that two runs never write the same snapshot
 * folder (they would remove each other's temp folders and collide on step names). The
 * lock file holds the owner's pid; the kernel drops the lock when the process dies, so a
 * crash never leaves the folder locked. Readers (ckpt-inspect) take no lock. dir/.lock is
 * opened without following a symbolic link and only as a regular file, so that no link
 * makes another file receive the pid and no FIFO blocks the call.
 * A dir that is a snapshot folder or lies inside one (it holds manifest.json, or it or a
 * folder above it in the path is named like a snapshot, a temp folder or a set-aside one) is
 * refused: saving there would write into a committed snapshot. A .lock with other hard links is refused too (its pid would overwrite
 * the other names' file).
 * Errors: -EBUSY another process holds it (*holder_pid, when not NULL, gets its pid or 0),
 * -ELOOP dir/.lock is a symbolic link, -EISDIR / -ENODEV it is a folder / a FIFO, socket or
 * device, -EMLINK it has other hard links, -EINVAL dir is a snapshot folder, -ENOTDIR /
 * -EACCES / -EROFS / other -errno of mkdir or open (the folder is unusable), -ENOMEM. */
int ckpt_dir_lock_acquire(const char *dir, ckpt_dir_lock **out, long *holder_pid);

/* As ckpt_dir_lock_acquire; the lock file then reads "<pid> <owner>\n", owner (1-64
 * characters of [A-Za-z0-9_.-], or NULL for none) naming the job that holds it (train passes
 * the launcher's ELASTIC_RUN_ID). On -EBUSY, holder_owner (holder_len bytes, may be NULL)
 * gets the holder's owner, "" when it named none: a caller can tell a rank of an earlier
 * round of its own job, still stopping, from another run. Errors: those of
 * ckpt_dir_lock_acquire, and -EINVAL for an owner outside that alphabet. Thread-safe. */
int ckpt_dir_lock_acquire_owned(const char *dir, const char *owner, ckpt_dir_lock **out,
                                long *holder_pid, char *holder_owner, size_t holder_len);

/* Whether l still locks dir: dir/.lock is the file l holds open (same device and inode).
 * 0 yes; -ESTALE no (dir or its .lock was removed or replaced - by hand, or by a cleanup -
 * so that another run could take a new lock there); -ENOENT dir/.lock is missing; -EINVAL
 * l or dir NULL; other -errno of fstat or lstat (EACCES, EIO: the check failed, which says
 * nothing about the lock). A save under a lost lock could collide with that other run (its temp
 * folders, its retention). Thread-safe; a few system calls. */
int ckpt_dir_lock_check(const ckpt_dir_lock *l, const char *dir);

/* Release the lock and free the handle; accepts NULL. */
void ckpt_dir_lock_release(ckpt_dir_lock *l);

/* Set a corrupt snapshot folder aside so that its step can be saved again while the bad
 * bytes stay for inspection: renames dir/name to dir/name.corrupt-<unix seconds>, or
 * .corrupt-<unix seconds>-<k> (k = 1, 2, ...) when that name is taken, never replacing one (a name
 * that readers never take for a snapshot) and fsyncs dir. The new name goes into newname
 * (at least 64 bytes) when not NULL.
 * Errors: -EINVAL (name is not a snapshot folder name), -errno of rename or fsync. */
int ckpt_set_aside(const char *dir, const char *name, char *newname, size_t newname_len);

/* Remove leftover temp folders (".tmp-step-*") under dir, logging each one removed.
 * Returns the number removed, or -errno. A missing dir returns 0. */
int ckpt_remove_temp(const char *dir);

/* ------------------------------------------------------------------ reading */

typedef struct ckpt_snapshot ckpt_snapshot;

/* Open the snapshot folder `path` (".../step-000000020"): read manifest.json, check its
 * checksum, format and version, the format's limits, and that the described layout is
 * consistent (chunks cover each shard exactly, shards cover each buffer exactly once, data
 * files are named for their rank and exist as regular files with the sizes the manifest
 * gives). Does not read chunk data. manifest.json and the data files are opened without
 * following symbolic links and only when they are regular files, so a FIFO never blocks.
 * On failure, `why` (if not NULL) receives a one-line reason of at most why_len bytes. The
 * caller frees *out with ckpt_snapshot_close().
 *
 * Only evidence about the folder's contents makes -EBADMSG (DESIGN I7): any other error is
 * returned as it is and says nothing about the snapshot, which may be fine.
 * Errors: -ENOENT (no such folder), -EBADMSG (no manifest, manifest corrupt or over the
 * limits, checksum mismatch, inconsistent layout, a data file missing, of the wrong type or
 * size, or a file name the format does not define), -EPROTONOSUPPORT (format_version newer
 * than CKPT_FORMAT_VERSION), -EINVAL (path NULL or too long), -ENOMEM, and the environment's
 * errors, which never mean corrupt: -EMFILE, -ENFILE, -EACCES, -EIO, ... */
int ckpt_snapshot_open(ckpt_snapshot **out, const char *path, char *why, size_t why_len);

/* Frees the handle; accepts NULL. */
void ckpt_snapshot_close(ckpt_snapshot *s);

/* Accessors; strings are owned by the handle and live until ckpt_snapshot_close. */
uint64_t ckpt_snapshot_step(const ckpt_snapshot *s);
uint32_t ckpt_snapshot_world_size(const ckpt_snapshot *s);
const char *ckpt_snapshot_run_id(const ckpt_snapshot *s);
const char *ckpt_snapshot_config_hash(const ckpt_snapshot *s);
const char *ckpt_snapshot_path(const ckpt_snapshot *s);
int64_t ckpt_snapshot_created(const ckpt_snapshot *s); /* unix seconds */
/* The trainer record as compact JSON text. */
const char *ckpt_snapshot_trainer_json(const ckpt_snapshot *s);

/* Total bytes of buffer `name`, or -ENOENT when the snapshot has no such buffer. */
int64_t ckpt_snapshot_buffer_bytes(const ckpt_snapshot *s, const char *name);

/* Description of one buffer of an open snapshot; strings owned by the handle. */
typedef struct ckpt_buffer_info {
    const char *name;
    const char *dtype;
    uint32_t elem_bytes;
    uint64_t total_bytes;  /* raw bytes of the whole buffer */
    uint64_t stored_bytes; /* bytes its chunks take in the data files */
    size_t nchunks;
} ckpt_buffer_info;

/* Number of buffers in the snapshot. */
size_t ckpt_snapshot_nbuffers(const ckpt_snapshot *s);

/* Fill *info for buffer i (0 <= i < ckpt_snapshot_nbuffers). Errors: -EINVAL bad index. */
int ckpt_snapshot_buffer_info(const ckpt_snapshot *s, size_t i, ckpt_buffer_info *info);

/* Sums over all chunks: raw bytes and stored bytes. */
void ckpt_snapshot_sizes(const ckpt_snapshot *s, uint64_t *raw_bytes, uint64_t *stored_bytes);

/* Threads that ckpt_snapshot_read and ckpt_snapshot_verify use to read and decode chunks in
 * parallel (each with its own io_uring readers and zstd context, and the reads of its next
 * two chunks in flight while it decodes one); default 2, range [1, 64].
 * Memory per thread: 3 x (the largest stored chunk + 8 KiB) + 4 x the largest raw chunk.
 * Errors: -EINVAL. */
int ckpt_snapshot_set_threads(ckpt_snapshot *s, unsigned threads);

/* Read bytes [offset, offset+len) of buffer `name` into dst. Only the chunks that overlap
 * the range are read (io_uring), on the snapshot's reading threads, each decompressed and
 * checked against both its stored and its raw xxh3 checksum; a chunk that lies wholly in the
 * range is decoded straight into dst. When several chunks are bad, the first one in buffer
 * order is reported. On -EBADMSG, *bad (if not NULL) receives a one-line description
 * naming the file and chunk (at most bad_len bytes).
 * Errors: -ENOENT (no such buffer), -EINVAL (range outside the buffer), -EBADMSG (checksum
 * mismatch, undecodable frame, short file), -EIO, -ENOMEM; for a memory handle
 * (ckpt_mem_snapshot_open) also -ESTALE (a slot was rewritten since the open). */
int ckpt_snapshot_read(ckpt_snapshot *s, const char *name, uint64_t offset, uint64_t len,
                       void *dst, char *bad, size_t bad_len);

/* Progress callback for verify, called on the caller's thread once per chunk checked, in
 * chunk order: bytes checked so far and in all. Return non-zero to stop (verify then returns
 * -ECANCELED). */
typedef int (*ckpt_progress_fn)(void *ctx, uint64_t done_bytes, uint64_t total_bytes);

/* Read and check every chunk of every shard, on the snapshot's reading threads. On -EBADMSG
 * *bad names the first bad file and chunk. progress may be NULL.
 * Errors: -EBADMSG, -ECANCELED, -EIO, -ENOMEM; -ESTALE as for ckpt_snapshot_read. */
int ckpt_snapshot_verify(ckpt_snapshot *s, char *bad, size_t bad_len, ckpt_progress_fn progress,
                         void *ctx);

/* ------------------------------------------------------------------ listing */

enum ckpt_status {
    CKPT_STATUS_COMMITTED = 0,  /* manifest present and valid (chunks not read) */
    CKPT_STATUS_CORRUPT = 1,    /* final name, but manifest missing, corrupt or inconsistent */
    CKPT_STATUS_NEWER = 2,      /* manifest of a newer format version */
    CKPT_STATUS_INCOMPLETE = 3, /* a temp folder: a save in progress or interrupted */
    CKPT_STATUS_SET_ASIDE = 4,  /* a corrupt snapshot renamed by ckpt_set_aside */
    CKPT_STATUS_UNREADABLE = 5  /* final name, but reading its manifest or stat-ing its files
                                   failed for a reason that says nothing about its bytes
                                   (ckpt_entry.error: -EMFILE, -EACCES, -EIO, ...): it may be
                                   fine; never set aside, never skipped silently */
};

typedef struct ckpt_entry {
    uint64_t step;
    int status;            /* enum ckpt_status */
    int64_t created;       /* unix seconds; 0 when unknown */
    uint64_t raw_bytes;    /* 0 when unknown */
    uint64_t stored_bytes; /* 0 when unknown */
    char name[256];        /* folder name */
    char run_id[64];       /* lineage; empty when unknown */
    char reason[400];      /* why not committed; empty when committed */
    int error;             /* CKPT_STATUS_UNREADABLE: the negative errno; else 0 */
} ckpt_entry;

/* List snapshot folders under dir, sorted by step (numerically, ascending; temp folders
 * after final ones of the same step). Each final-name folder is opened (ckpt_snapshot_open)
 * to tell committed from corrupt, newer-format or unreadable; one that disappears while it is
 * examined (retention or a set-aside renamed it) is left out. The caller frees *entries with
 * free(). A missing dir gives 0 entries. Errors: -errno of opendir, -ENOMEM. */
int ckpt_list(const char *dir, ckpt_entry **entries, size_t *n);

/* Name of a status for humans and JSON: "committed", "corrupt", "newer-format",
 * "incomplete", "set-aside", "unreadable". */
const char *ckpt_status_name(int status);

/* Folder name of a step: "step-%09llu" into buf (at least 32 bytes). */
void ckpt_step_dirname(uint64_t step, char *buf, size_t len);

#endif /* CKPT_H */
