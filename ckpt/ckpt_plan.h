/* ckpt_plan.h - re-sharding planner: which saved bytes each rank of a new world size needs.
 *
 * A snapshot saved by W ranks holds each flat buffer as W contiguous shards in rank order
 * (DESIGN section 3: re-sharding is range arithmetic). A job restarted with W' ranks needs,
 * on new rank r, only the byte range [lo'_r, hi'_r) of each buffer; this module says which
 * pieces of which saved shards make up that range (ckpt_plan_reshard, pure arithmetic over
 * any layout) and which chunks of an open snapshot a new rank must read and decode to get it
 * (ckpt_snapshot_plan). Neither reads chunk data.
 *
 * Cost (case C11 of CASES.md): linear in the size of the layouts, never in their product:
 * O(buffers x (W + W') + pieces) for ckpt_plan_reshard and O(buffers x W' + chunks) for
 * ckpt_snapshot_plan. A rank's plan covers exactly its range, never whole shards.
 *
 * Errors (negative errno, STYLE.md): -EINVAL bad argument, -ENOMEM, -EOVERFLOW a count or
 * size that does not fit its type.
 *
 * Thread-safety: every function here is reentrant and keeps no state; ckpt_snapshot_plan
 * only reads the handle's manifest data and follows the handle's rule (ckpt.h: one thread at
 * a time per handle).
 */
#ifndef CKPT_PLAN_H
#define CKPT_PLAN_H

#include "ckpt.h"

#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------ range planner */

/* One piece of a re-shard: bytes [offset, offset+bytes) of buffer `buffer`, needed by new
 * rank `new_rank`, held in the shard that old rank `old_rank` saved. It is the whole
 * intersection of that old shard and that new range, and never empty. */
typedef struct ckpt_plan_piece {
    uint32_t buffer;   /* index of the buffer, in [0, nbuffers) */
    uint32_t new_rank; /* rank that needs the bytes, in [0, new_world) */
    uint32_t old_rank; /* rank whose saved shard holds them, in [0, old_world) */
    uint64_t offset;   /* byte offset in the whole buffer */
    uint64_t bytes;    /* length, bytes; > 0 */
} ckpt_plan_piece;

/* Plan a re-shard of nbuffers buffers from old_world ranks to new_world ranks.
 *
 * old_bounds: nbuffers rows of (old_world + 1) byte offsets, row-major (row b starts at
 *   old_bounds[b * (old_world + 1)]): old rank i saved bytes [row[i], row[i+1]) of buffer b.
 *   Each row starts at 0, never decreases and ends at the buffer's total bytes. Equal
 *   neighbours (an empty shard) and empty buffers (a row of zeros) are allowed.
 * new_bounds: nbuffers rows of (new_world + 1) offsets, likewise for the new ranks; row b
 *   must end at the same total as old row b.
 * out, npieces: on success *out receives a malloc'ed array of *npieces pieces that the
 *   caller frees with free(); *out is NULL when *npieces is 0. On failure *out is NULL and
 *   *npieces 0.
 *
 * The pieces are sorted by (new_rank, buffer, offset), so each new rank's pieces are one
 * run of the array; within a rank and buffer they tile [new row[r], new row[r+1]) exactly,
 * in order, and piece k lies inside the old shard of its old_rank. Sorting is a counting
 * sort by new rank over a per-buffer two-pointer merge of the rows (no comparison sort).
 *
 * Cost: O(nbuffers x (old_world + new_world) + pieces) time; memory: the output (at most
 * nbuffers x (old_world + new_world - 1) pieces) plus new_world + 1 counters.
 * Thread-safety: reentrant; the inputs are only read.
 * Errors: -EINVAL (NULL argument where a row is needed, world size 0, a row that does not
 * start at 0, decreases, or ends at a different total than its twin), -EOVERFLOW (nbuffers
 * over UINT32_MAX, or the output does not fit in memory's address range), -ENOMEM. */
int ckpt_plan_reshard(size_t nbuffers, uint32_t old_world, const uint64_t *old_bounds,
                      uint32_t new_world, const uint64_t *new_bounds, ckpt_plan_piece **out,
                      size_t *npieces);

/* The even partition the trainer uses for a flat buffer of `total` bytes over `world` ranks:
 * the buffer is cut into n = ceil(total / align) units of `align` bytes (the last unit may
 * be shorter; the trainer uses 2048 floats = 8192 bytes) and rank r gets the
 * floor(n / world) units that follow those of ranks 0..r-1, plus one more when
 * r < n % world (the first n % world ranks hold one unit more). Rank r's bytes are
 * [bounds[r], bounds[r+1]).
 * bounds: caller-allocated, world + 1 entries; receives 0 = bounds[0] <= ... <=
 *   bounds[world] = total. Ranks past the last unit get empty ranges at total.
 * align 0 is taken as 1; world must be at least 1 (world 0 writes nothing).
 * Cost: O(world). Never fails; no overflow for any total. Reentrant. */
void ckpt_even_bounds(uint64_t total, uint64_t align, uint32_t world, uint64_t *bounds);

/* ------------------------------------------------------------------ snapshot planner */

/* What one new rank reads from a snapshot to restore its ranges, summed over buffers. */
typedef struct ckpt_rank_reads {
    uint64_t need_bytes;        /* raw bytes the rank needs: the sum of its range sizes */
    uint64_t read_raw_bytes;    /* raw bytes of the chunks it must decode (>= need_bytes: a
                                   chunk that straddles a range end is decoded whole) */
    uint64_t read_stored_bytes; /* bytes it reads from data files: those chunks' stored bytes */
    size_t chunks;              /* chunks it reads; a chunk shared with a neighbour rank
                                   counts for both */
    size_t files;               /* distinct data files it touches */
} ckpt_rank_reads;

/* Plan a restore of the open snapshot s at world size new_world with the trainer's even
 * partition: for each buffer of s and each new rank r, the chunks that overlap
 * [bounds[r], bounds[r+1]) where bounds = ckpt_even_bounds(buffer's total bytes, align,
 * new_world). These are exactly the chunks ckpt_snapshot_read(s, buffer, bounds[r],
 * bounds[r+1] - bounds[r], ...) reads. The snapshot's own world size does not matter.
 * align: bytes per partition unit, >= 1 (the trainer: 8192).
 * out: caller-allocated array of new_world entries; entry r receives new rank r's totals
 *   over all buffers (zeroed first). Unspecified on error.
 * Cost: O(buffers x new_world + chunks) time (one forward sweep per buffer); memory:
 *   buffers + data files counters. Reads no chunk data and does no I/O.
 * Thread-safety: see the top.
 * Errors: -EINVAL (NULL s or out, align 0, new_world 0), -ENOMEM. */
int ckpt_snapshot_plan(const ckpt_snapshot *s, uint64_t align, uint32_t new_world,
                       ckpt_rank_reads *out);

/* ------------------------------------------------------------------ manifest accessors
 * Read-only views of an open snapshot's layout, for planners and tools (defined in
 * ckpt_read.c). They read only the manifest data held by the handle. */

/* Where one chunk of a buffer lies, raw and stored. */
typedef struct ckpt_chunk_info {
    uint64_t offset;       /* raw offset of the chunk in its buffer, bytes */
    uint64_t bytes;        /* raw bytes */
    uint64_t file_offset;  /* where its stored bytes start in its data file */
    uint64_t stored_bytes; /* length of its stored bytes */
    uint32_t file;         /* index of its data file, in [0, ckpt_snapshot_nfiles(s)) */
} ckpt_chunk_info;

/* Number of data files of the snapshot. */
size_t ckpt_snapshot_nfiles(const ckpt_snapshot *s);

/* Fill *info for chunk `chunk` of buffer `buffer`; a buffer's chunks are numbered in offset
 * order (0 <= chunk < ckpt_buffer_info.nchunks) and tile [0, total_bytes) back to back.
 * O(1). Errors: -EINVAL (NULL info, index out of range). */
int ckpt_snapshot_chunk_info(const ckpt_snapshot *s, size_t buffer, size_t chunk,
                             ckpt_chunk_info *info);

#endif /* CKPT_PLAN_H */
