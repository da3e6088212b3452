/* ckpt_mem.h - the memory tier of the snapshot engine (issue 13): memory snapshots in
 * shared-memory slots (common/shmseg.h), listed, opened as ordinary snapshot handles (so
 * ckpt_snapshot_read re-shards from memory exactly as from files), and flushed to disk.
 *
 * Where the segments are. A node's memory tier is the set of files "<prefix>.*" where
 * prefix is a path prefix such as "/dev/shm/ckptmem-<jobhash16>-<rand16>" (the agent gives
 * it to each worker as CKPT_MEM_PATH; memtier-design.md):
 *   <prefix>.own-<L>      the segment of local rank slot L, written by that worker;
 *   <prefix>.rep-<A>-<L>  a replica of local slot L of the node whose agent has id A (16 hex
 *                         digits; common/shmseg.h), written by this node's agent.
 * Any other name under the prefix (".lease", a shmseg rebuild's ".own-0.new-XXXXXX") is not
 * a segment and is skipped. No CKPT_MEM_PATH = no memory tier.
 *
 * What a slot holds (docs/FORMAT.md, "Memory tier", is normative). One rank's memory
 * snapshot of one step, little-endian:
 *
 *   payload header, 4096 bytes:
 *     0    magic "CKPTMEM1" (8)        8    version u32 = 1     12   nbufs u32 (<= 16)
 *     16   step u64                    24   world_size u32      28   rank u32
 *     32   created i64 (unix s)        40   chunk_bytes u64
 *     48   run_id[64]   112 config_hash[64]   176 tag[64]   (NUL-padded, [A-Za-z0-9_.-]{1,63})
 *     240  trainer_off u64   248 trainer_len u64   256 sums_off u64   264 nsums u64
 *     272  trainer_xxh3 u64 (XXH3-64 of the trainer record)
 *     280  bufs[16], 120 bytes each: name[64] | dtype[16] | elem_bytes u32 | pad u32 |
 *          total_bytes u64 (whole buffer) | offset u64 (shard start in the whole buffer) |
 *          bytes u64 (shard bytes) | data_off u64 (in the payload, a multiple of 4096)
 *     2200 header_xxh3 u64: XXH3-64 of bytes [0, 2200)
 *     2208 zero to 4096
 *   each buffer's shard at its data_off, in buffer order, each start rounded up to 4096;
 *   the trainer record (compact JSON object, trainer_len bytes, no NUL) at trainer_off;
 *   the checksums at sums_off (8-aligned): nsums u64, XXH3-64 of every chunk_bytes piece of
 *   each shard (the last piece of a shard shorter), shard by shard in buffer order; a shard
 *   of 0 bytes has none.
 *   payload_bytes = sums_off + 8 * nsums.
 * The slots of one memory snapshot share step, world_size, run_id and tag (the saving
 * launch's tag); it is "complete here" when slots of every rank 0..W-1 are found under the
 * prefix. A slot is used only when shmseg says complete, its payload head hashes to the
 * shmseg slot header's payload_xxh3, its header checksum and fields check, and (when read)
 * each chunk's checksum.
 *
 * Errors follow ckpt.h: -EINVAL bad argument, -EBADMSG corrupt, -ENOENT not found,
 * -ENOSPC does not fit, -ENOMEM, other -errno.
 */
#ifndef CKPT_MEM_H
#define CKPT_MEM_H

#include "ckpt.h"
#include "shmseg.h"

#include <stddef.h>
#include <stdint.h>

#define CKPT_MEM_VERSION 1u
#define CKPT_MEM_MAX_BUFFERS 16u  /* buffers one memory snapshot holds */
#define CKPT_MEM_HEADER_BYTES 4096u
#define CKPT_MEM_ID_MAX 200       /* bytes of a "mem:..." id with the NUL */
#define CKPT_MEM_WHERE_MAX 4200   /* bytes of a slot's place in messages, with the NUL */

/* Environment variable holding the path prefix (set by the agent for its workers). */
#define CKPT_MEM_PATH_ENV "CKPT_MEM_PATH"

/* Non-zero when prefix is a path prefix this module can list and open: not empty, shorter
 * than CKPT_PATH_MAX - 64 bytes (room for ".own-<L>" and ".rep-<A>-<L>"), and with a file
 * name part after its last '/' ("/" and "/dev/shm/" are refused: their segments would be
 * hidden files nobody lists). The rule of ckpt_mem_list and ckpt_mem_snapshot_open; a writer
 * checks CKPT_MEM_PATH with it once at start. NULL gives 0. Thread-safe. */
int ckpt_mem_prefix_ok(const char *prefix);

/* Slot bytes (a multiple of 4096) that one rank's memory snapshot of these shards needs:
 * the header, each shard rounded up to 4096, trainer_len_max bytes of trainer record, and
 * the checksums of chunk_bytes pieces. Only bufs[i].bytes is read. Give the result to
 * shmseg_create; a segment holds 2 or 3 of these (shmseg_file_bytes). 0 when an
 * argument is invalid (nbufs > CKPT_MEM_MAX_BUFFERS, chunk_bytes 0) or the size overflows.
 * Thread-safe. */
uint64_t ckpt_mem_need(const ckpt_buffer *bufs, size_t nbufs, uint64_t trainer_len_max,
                       uint64_t chunk_bytes);

/* Write this rank's memory snapshot of `step` into a slot of seg (writable, from
 * shmseg_create) and commit it:
 *   shmseg_begin(seg, avoid_slot) marks a slot writing; each shard is copied into it piece
 *   by piece, each piece hashed right after its copy while it is in cache (XXH3-64 per
 *   chunk_bytes chunk); the trainer record, the checksums and the header follow, then
 *   shmseg_commit. A crash at any point before the commit leaves the slot "writing": never
 *   used, the newest complete slot stays what it was (shmseg_begin never takes it).
 * Fault point "mid-mem-copy" (ckpt_fault_point, CKPT_FAULT_POINT=mid-mem-copy[@step]) is
 * passed once after half of the shard bytes are copied.
 * step: the training step. run_id, config_hash, tag: [A-Za-z0-9_.-]{1,63}; tag names the
 * saving launch (the same on every rank of it). world_size >= 1, rank < world_size.
 * bufs: nbufs (<= CKPT_MEM_MAX_BUFFERS) shards as for a sharded ckpt_engine_stage (name,
 * dtype [A-Za-z0-9_.-]{1,15}, elem_bytes 1/2/4/8, offset + bytes <= total_bytes); only read.
 * trainer_json: a JSON object (NULL = "{}"), stored as given (at most CKPT_MAX_TRAINER_BYTES).
 * chunk_bytes: checksum granularity, a multiple of 16 in [4096, 1 GiB] (use the disk
 * snapshots' chunk_bytes: a chunk read from memory then costs what it costs from disk).
 * slot_out (may be NULL): the slot written. staged_out (may be NULL): nbufs entries that get
 * bufs[i] with data pointing into the slot (name and dtype too), for
 * ckpt_engine_persist_staged; valid until that slot is written again (pass it as avoid_slot
 * of the next call while the persist runs) or seg is closed.
 * Not thread-safe for one seg (one writer per segment).
 * Returns 0, or -EINVAL (bad argument), -ENOSPC (ckpt_mem_need of these buffers with this
 * record exceeds shmseg_slot_bytes: nothing written, no slot touched), -EBADF (seg is
 * read-only). */
int ckpt_mem_write(shmseg *seg, int avoid_slot, uint64_t step, const char *run_id,
                   const char *config_hash, const char *tag, uint32_t world_size, uint32_t rank,
                   const ckpt_buffer *bufs, size_t nbufs, const char *trainer_json,
                   uint64_t chunk_bytes, int *slot_out, ckpt_buffer *staged_out);

/* ckpt_mem_write in two phases, for bytes that arrive asynchronously: the trainer's
 * device-to-host copies go straight into the slot (train/train_snapshot.c) and the slot is
 * committed once they are done and the trainer record (whose digests need the copied state)
 * is known.
 *
 * ckpt_mem_begin checks bufs (names, dtypes, sizes as for ckpt_mem_write; data is not read
 * and may be NULL) and chunk_bytes, marks a slot writing (shmseg_begin(seg, avoid_slot)) and
 * fills staged_out (nbufs entries): bufs[i] with data pointing where shard i goes in the slot
 * (NULL for a shard of 0 bytes); name and dtype stay the caller's pointers, which must stay
 * valid until the commit. *slot_out gets the slot (-1 on failure). The caller then writes
 * exactly staged_out[i].bytes bytes at each staged_out[i].data, nothing else of the slot,
 * by any means (a DMA copy from the device too). Returns 0, or -EINVAL (bad argument,
 * slot_out or staged_out NULL), -ENOSPC (the shards alone exceed the slot: nothing touched),
 * -EBADF (read-only seg).
 *
 * ckpt_mem_commit, once every byte is in place: hashes the shards where they lie (XXH3-64
 * per chunk_bytes chunk, as ckpt_mem_write) unless sums (ckpt_mem_sum_count entries, NULL =
 * hash here) gives them, writes the trainer record, the checksums and the header, and
 * commits (shmseg_commit). Arguments as ckpt_mem_write, with staged = what ckpt_mem_begin
 * gave for this slot (same nbufs, chunk_bytes and shard sizes). Given sums are stored as
 * they are: a wrong one makes the slot's reads fail their checksum (-EBADMSG), never pass a
 * wrong byte. The fault point "mid-mem-copy" is passed once after half of the shard bytes
 * are hashed, or before the header when sums are given (the slot is still writing there, as
 * in ckpt_mem_write's copy). Returns 0, or -EINVAL (bad argument,
 * staged not this slot's layout, the slot not in state writing: never begun or already
 * committed), -ENOSPC (the record makes the payload exceed the slot; the slot stays
 * writing), -EBADF.
 *
 * A slot begun and never committed stays writing, as after a crash: never listed, the newest
 * complete slot stays what it was, and a later ckpt_mem_begin or ckpt_mem_write may take
 * it. Not thread-safe for one seg: between begin and commit the segment has no other writer
 * call (the caller's copies are its own business). */
int ckpt_mem_begin(shmseg *seg, int avoid_slot, const ckpt_buffer *bufs, size_t nbufs,
                   uint64_t chunk_bytes, int *slot_out, ckpt_buffer *staged_out);
int ckpt_mem_commit(shmseg *seg, int slot, uint64_t step, const char *run_id,
                    const char *config_hash, const char *tag, uint32_t world_size, uint32_t rank,
                    const ckpt_buffer *staged, size_t nbufs, const char *trainer_json,
                    uint64_t chunk_bytes, const uint64_t *sums);

/* The slot checksums ahead of ckpt_mem_commit, where the bytes land (a copy stream's host
 * callback after each shard's copy, off the training thread). ckpt_mem_sum_count: the number
 * of checksums of these shards (every shard's chunk_bytes pieces, buffer order; only
 * bufs[i].bytes is read), 0 on a bad argument (chunk_bytes as ckpt_mem_write's).
 * ckpt_mem_sum_buffer: writes shard i's checksums (XXH3-64 of each chunk_bytes piece of
 * staged[i].data, staged[i].bytes bytes) at their place in sums (ckpt_mem_sum_count(staged,
 * nbufs) entries: after those of shards 0..i-1). Thread-safe for different i into one sums
 * array (disjoint entries). Returns 0 or -EINVAL (NULL, i >= nbufs, bad chunk_bytes). */
uint64_t ckpt_mem_sum_count(const ckpt_buffer *bufs, size_t nbufs, uint64_t chunk_bytes);
int ckpt_mem_sum_buffer(const ckpt_buffer *staged, size_t nbufs, size_t i, uint64_t chunk_bytes,
                        uint64_t *sums);

/* Where a rank's slot was found. */
enum ckpt_mem_source {
    CKPT_MEM_SRC_OWN = 0,    /* a "<prefix>.own-<L>" segment (this node's worker wrote it) */
    CKPT_MEM_SRC_REPLICA = 1, /* a "<prefix>.rep-<A>-<L>" segment (a peer's, received) */
    CKPT_MEM_SRC_REMOTE = 2   /* a slot on another node, read through a ckpt_mem_remote */
};

/* Memory slots held elsewhere (another node's segments, read through its agent): a source the
 * caller provides as callbacks, so that this module stays ignorant of how they are reached
 * (train builds them on elastic/mem_client.h). A remote's slots are checked exactly as local
 * ones: the payload header's checksum and fields when listed, every chunk's checksum when read
 * (ckpt_snapshot_read), so a remote can lie only by failing. */
typedef struct ckpt_mem_remote_slot {
    uint64_t ref;            /* the remote's own name for the slot, given back to read() */
    uint64_t payload_bytes;  /* bytes of the slot's payload */
    uint8_t head[CKPT_MEM_HEADER_BYTES]; /* its first min(payload_bytes, 4096) bytes, zero after */
    char where[CKPT_MEM_WHERE_MAX]; /* for messages, e.g. "peer agent 10.0.0.2:4100 rep-<A>-0 slot 1" */
} ckpt_mem_remote_slot;

typedef struct ckpt_mem_remote {
    const char *name; /* for messages and ckpt_mem_snapshot_remote_name, e.g. "peer agent
                         10.0.0.2:4100"; borrowed (must outlive the handles that use it) */
    void *ctx;        /* passed to both callbacks; borrowed likewise */
    /* The complete slots the remote holds now: *slots (malloc'ed by the callback, free()d by
     * the caller) gets *n entries. Returns 0 or a negative errno (the remote is then skipped
     * with a warning; -ENOMEM fails the call). */
    int (*list)(void *ctx, ckpt_mem_remote_slot **slots, size_t *n);
    /* len bytes at off of the payload of slot ref (as listed) into dst. Returns 0, -ESTALE
     * (the slot was rewritten since it was listed), -ERANGE (past its payload), or another
     * negative errno (-ETIMEDOUT, -ECONNRESET...). Called from several reading threads at once:
     * must be thread-safe. */
    int (*read)(void *ctx, uint64_t ref, uint64_t off, uint64_t len, void *dst);
} ckpt_mem_remote;

/* Status of a listed memory snapshot. */
enum ckpt_mem_status {
    CKPT_MEM_COMPLETE = 0, /* a verified slot of every rank 0..W-1 is here: can be opened */
    CKPT_MEM_PARTIAL = 1,  /* some ranks' slots are not here (ranks_present < world_size) */
    CKPT_MEM_CORRUPT = 2   /* one slot whose payload head or header fails its checksum or
                              checks (a payload of a newer version too: reason says so):
                              nothing in it is trusted; step is shmseg's copy, world_size
                              0, name the segment and slot, reason why */
};

typedef struct ckpt_mem_entry {
    int status;               /* enum ckpt_mem_status */
    uint64_t step;
    uint32_t world_size;
    uint32_t ranks_present;   /* distinct ranks with a verified slot here */
    uint32_t ranks_own;       /* of those, found in an own segment (preferred) */
    uint32_t ranks_replica;   /* the others: found only in a replica segment ... */
    uint32_t ranks_remote;    /* ... or only on a remote (ckpt_mem_list_ex) */
    int source;               /* enum ckpt_mem_source: REMOTE when any rank comes from a
                                 remote, else REPLICA when any from a replica, else OWN */
    int64_t created;          /* unix seconds (rank 0's slot, else the first found) */
    uint64_t raw_bytes;       /* shard bytes over the ranks present */
    char run_id[64], config_hash[64], tag[64];
    char id[CKPT_MEM_ID_MAX]; /* "mem:<run_id>/<tag>/<step>/<world_size>" (COMPLETE, PARTIAL) */
    char name[512];           /* CORRUPT: "<segment path> slot <i>"; else empty */
    char reason[256];         /* PARTIAL: the first missing rank; CORRUPT: what failed */
} ckpt_mem_entry;

/* List the memory snapshots under path_prefix: every complete slot of every segment
 * "<prefix>.own-<L>" and "<prefix>.rep-<A>-<L>" (opened read-only; a segment that fails
 * shmseg_open is skipped with a debug log line), checked as the file header says and
 * grouped by (step, world_size, run_id, tag) into one entry each, plus one CORRUPT entry per
 * slot that fails its checks. Chunk checksums are not read (ckpt_snapshot_verify of the
 * opened handle does). Sorted newest step first; within a step COMPLETE, then PARTIAL,
 * then CORRUPT. *out (free() it) gets *n entries; a missing folder or no segment gives 0.
 * Thread-safe (no shared state). Returns 0, or -EINVAL (NULL, a prefix without a file
 * name part or too long), -ENOMEM, the -errno of opendir other than ENOENT. */
int ckpt_mem_list(const char *path_prefix, ckpt_mem_entry **out, size_t *n);

/* ckpt_mem_list with the slots of nremotes remotes as well: each remote's list() is called
 * once; its slots take part in the grouping after the local ones (per rank the own segment,
 * then a replica, then the remotes in their order), so "complete" counts a rank found only on
 * a remote (ranks_remote). A remote whose list() fails is skipped with one warning; a slot
 * whose header fails its checks is listed CORRUPT with the remote's `where` as name.
 * path_prefix NULL: remotes only (neither a path nor a remote: 0 entries). Returns 0, or
 * -EINVAL (NULL out or n, nremotes without remotes, a remote without list or read), -ENOMEM
 * (also from a remote's list), the other errors of ckpt_mem_list. */
int ckpt_mem_list_ex(const char *path_prefix, const ckpt_mem_remote *remotes, size_t nremotes,
                     ckpt_mem_entry **out, size_t *n);

/* Open memory snapshot `id` ("mem:<run_id>/<tag>/<step>/<world_size>", as listed) under
 * path_prefix as a ckpt_snapshot handle: its W "data files" are the ranks' slots (per rank
 * the own segment's slot when one verifies, else a replica's), each rank's shard chunks
 * described with codec none and the chunk checksum as both raw and stored checksum, so
 * ckpt_snapshot_read (any range, any re-sharding), _verify and the accessors work as for a
 * disk snapshot; ckpt_snapshot_path gives the id; ckpt_snapshot_manifest_text gives NULL.
 * The segments stay mapped read-only until ckpt_snapshot_close. Each read copies the bytes
 * out of the slot and checks that the slot was not rewritten meanwhile (shmseg_copy_out):
 * a read after a slot was overwritten fails with -ESTALE (a new memory snapshot of that
 * rank's segment replaced it), a flipped byte with -EBADMSG naming the segment, slot,
 * chunk and buffer. The caller frees *out with ckpt_snapshot_close. why (may be NULL) gets
 * a one-line reason on failure. Thread-safety as ckpt.h's handles.
 * Returns 0, or -EINVAL (NULL, id malformed, prefix unusable), -ENOENT (some rank's slot is
 * not here, or no such snapshot), -EBADMSG (the ranks' slots disagree: buffers, chunking,
 * config_hash, shards that do not cover each buffer exactly once; a bad trainer record),
 * -ESTALE (a picked slot was rewritten while the handle was built), -ENOMEM, the -errno of
 * opendir. */
int ckpt_mem_snapshot_open(ckpt_snapshot **out, const char *path_prefix, const char *id,
                           char *why, size_t why_len);

/* ckpt_mem_snapshot_open where some ranks' slots may be on remotes: the local segments under
 * path_prefix (NULL = none) are scanned first, then each remote is listed once; per rank a
 * local slot is preferred (own, then replica), a remote's is used only for a rank not found
 * here (the first remote listing one). Reads of a remote slot go through its read() from the
 * handle's reading threads, and each chunk is checked against its checksum as for a local one
 * (a flipped byte on the wire or on the peer is -EBADMSG naming the remote's `where`; a
 * rewritten slot -ESTALE). The handle keeps a copy of the remotes array but borrows each
 * remote's name and ctx: they must stay valid until ckpt_snapshot_close.
 * Returns as ckpt_mem_snapshot_open; -EINVAL also for neither a path nor a remote, or a remote
 * without list or read; the errors of a remote's read() (-ETIMEDOUT, -ECONNRESET...) while the
 * handle is built. */
int ckpt_mem_snapshot_open_ex(ckpt_snapshot **out, const char *path_prefix, const char *id,
                              const ckpt_mem_remote *remotes, size_t nremotes, char *why,
                              size_t why_len);

/* For a handle from ckpt_mem_snapshot_open_ex: the number of ranks read from remotes, and the
 * name of the remote rank `rank`'s slot is read from (NULL when it is local, or s is not a
 * memory handle, or rank is out of range). */
int ckpt_mem_snapshot_remotes(const ckpt_snapshot *s);
const char *ckpt_mem_snapshot_remote_name(const ckpt_snapshot *s, uint32_t rank);

/* For a handle from ckpt_mem_snapshot_open: where rank `rank`'s slot came from (enum
 * ckpt_mem_source), -EINVAL when s is not a memory handle or rank >= its world size. */
int ckpt_mem_snapshot_source(const ckpt_snapshot *s, uint32_t rank);

/* For a handle from ckpt_mem_snapshot_open: the number of ranks read from replica segments
 * (0 = all own: log "memory (own)", else "memory (replica)"); -EINVAL for another handle. */
int ckpt_mem_snapshot_replicas(const ckpt_snapshot *s);

/* Non-zero when s was opened by ckpt_mem_snapshot_open; non-zero when id starts "mem:". */
int ckpt_snapshot_is_mem(const ckpt_snapshot *s);
int ckpt_mem_is_id(const char *id);

/* "own" / "replica" / "peer". */
const char *ckpt_mem_source_name(int source);

/* Persist the newest memory snapshot that is worth it to disk, as a world-of-one snapshot
 * (ckpt_save of the whole buffers, so a restore of any world size re-shards it):
 *   takes ckpt_dir's lock (ckpt_dir_lock_acquire) for the whole call; lists the memory
 *   snapshots (ckpt_mem_list) and the committed disk snapshots (ckpt_list); the candidates
 *   are the COMPLETE memory snapshots (of run_id, when not NULL) whose step is larger than
 *   the newest committed disk snapshot of ANY run in ckpt_dir (not only their own: a step
 *   written below another run's newer snapshot would be "a later snapshot in the way" of
 *   the run continuing from it), newest first; the first that
 *   opens and reads back with every chunk checksum right is saved (ckpt_save with opts, dir
 *   = ckpt_dir). A candidate that fails (-EBADMSG, -ESTALE, -ENOENT...) is logged and the
 *   next is tried. Step 0 is never flushed (it cannot be told from "nothing done").
 * Memory: the whole buffers of the snapshot, once, in anonymous memory for the call.
 * opts: chunking and codec (NULL = CKPT_SAVE_OPTS_INIT); its dir is ignored. run_id: NULL
 * for any run. why (may be NULL): one line (what was flushed, or why nothing - no memory
 * snapshot, only other runs' ones, not newer than the folder's newest - or the error).
 * Returns the step written (> 0), 0 when nothing is newer than the disk (or no memory
 * snapshot), or -EINVAL (NULL prefix or dir), -EBUSY (another process holds the folder's
 * lock), the error of the newest failed candidate when every candidate failed (-EBADMSG,
 * ...), ckpt_save's errors (-ENOSPC, -EIO, -EEXIST...), ckpt_list's, -ENOMEM. */
int64_t ckpt_mem_flush(const char *path_prefix, const char *ckpt_dir, const ckpt_save_opts *opts,
                       const char *run_id, char *why, size_t why_len);

/* The caller's judgement of a flush candidate (ckpt_mem_flush_checked): called once per
 * candidate that opened and read back whole with every chunk checksum right, before anything
 * is written. s: the open memory snapshot handle (step, run id, trainer record, buffer
 * info; valid for the call only). bufs: its nbufs whole buffers as ckpt_save will get them
 * (name, dtype, elem_bytes, total_bytes, offset 0, bytes = total_bytes, data: the bytes read,
 * read-only, valid for the call only). why: why_len bytes for one line on rejection.
 * Return 0 to flush it, or a negative errno (-EBADMSG inconsistent or forged, -EINVAL not
 * this job's) to skip it: it is logged with why and the next candidate is tried; a positive
 * value counts as -EBADMSG. Called from the thread that called the flush. */
typedef int (*ckpt_mem_check_fn)(void *ctx, ckpt_snapshot *s, const ckpt_buffer *bufs, size_t nbufs,
                                 char *why, size_t why_len);

/* ckpt_mem_flush with a check of each candidate (NULL = none: ckpt_mem_flush), so that what
 * a restore would reject (the trainer's own checks of its record and digests, which this
 * module does not know) is never committed. check_ctx is passed to check as is. The same
 * return values as ckpt_mem_flush; a candidate that check rejects is a failed candidate
 * (its error is returned when every candidate failed). */
int64_t ckpt_mem_flush_checked(const char *path_prefix, const char *ckpt_dir, const ckpt_save_opts *opts,
                               const char *run_id, ckpt_mem_check_fn check, void *check_ctx, char *why,
                               size_t why_len);

#endif /* CKPT_MEM_H */
