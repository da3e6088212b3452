/* ckpt_internal.h - helpers shared by the files of ckpt/ (not part of the public API). */
#ifndef CKPT_INTERNAL_H
#define CKPT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#define CKPT_MANIFEST_NAME "manifest.json"
#define CKPT_FORMAT_NAME "ckptsys.snapshot"
/* The manifest's checksum member; see docs/FORMAT.md "Manifest checksum". */
#define CKPT_MANIFEST_SUM_KEY ",\"manifest_xxh3\":\""

/* Byte-shuffle n bytes of elem_bytes-wide elements from src into dst (byte plane k of every
 * element first for k = 0..elem_bytes-1); a tail of n % elem_bytes bytes is copied as is.
 * dst and src must not overlap. */
void ckpt_shuffle(uint8_t *dst, const uint8_t *src, size_t n, uint32_t elem_bytes);
/* Inverse of ckpt_shuffle. */
void ckpt_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, uint32_t elem_bytes);

/* 16 lowercase hex digits of v into out (17 bytes with the NUL). */
void ckpt_hex64(uint64_t v, char out[17]);
/* Parse exactly 16 hex digits; 0 on success, -EBADMSG otherwise. */
int ckpt_parse_hex64(const char *s, uint64_t *v);

/* Name check for buffers, run ids and config hashes: [A-Za-z0-9_.-]{1,63}. */
int ckpt_valid_name(const char *s);

/* The name of the folder `path` names into out: its last component without trailing slashes
 * or "." components ("D/step-000000020/" and "D/step-000000020/." name step-000000020); the
 * real path's last component when that is ".." or nothing is left; "" when unknown. */
void ckpt_folder_name(const char *path, char *out, size_t len);

/* Non-zero when dir is a snapshot folder rather than a folder of snapshots: it holds a
 * manifest.json, or its last component (trailing slashes and "." ignored) parses as a step,
 * temp or set-aside folder name. */
int ckpt_is_snapshot_folder(const char *dir);
/* Non-zero when dir is a snapshot folder (ckpt_is_snapshot_folder), or one of the folders
 * above it (taken from the path's text: give an absolute or canonical path to see every one)
 * is named like one. */
int ckpt_within_snapshot_folder(const char *dir);

/* Data file name of a rank: "rank-%05u.bin" into buf (at least 32 bytes). */
void ckpt_rank_filename(uint32_t rank, char *buf, size_t len);

/* Parse "step-%09llu" exactly (9 or more digits, nothing after): 0 and *step, or -1. */
int ckpt_parse_step_dirname(const char *name, uint64_t *step);
/* Parse "step-<digits>.corrupt-<anything>" (a folder set aside): 0 and *step, or -1. */
int ckpt_parse_aside_dirname(const char *name, uint64_t *step);
/* Parse ".tmp-step-<digits>-<id>": 0 and *step, or -1. */
int ckpt_parse_temp_dirname(const char *name, uint64_t *step);

/* Absolute CLOCK_REALTIME time `seconds` from now, for pthread_cond_timedwait. */
struct timespec;
void ckpt_deadline(struct timespec *ts, double seconds);

/* out = dir + "/" + name; -ENAMETOOLONG when it does not fit in len bytes. */
int ckpt_path_join(char *out, size_t len, const char *dir, const char *name);

/* Fault points for crash tests (docs/FORMAT.md, "Crash safety"). When the environment
 * variable CKPT_FAULT_POINT is "<name>" or "<name>@<step>" and matches, the process kills
 * itself with SIGKILL here, as a crash at that instant would; with the suffix ":stop"
 * ("<name>@<step>:stop") it stops itself with SIGSTOP instead, once, so that a test can act at
 * that instant (arm a CKPT_FAULT_DIR fault, inspect files) and then send SIGCONT. An unknown
 * suffix is logged and the point never fires. Names along the save path:
 *   before-chunk-write  before the first chunk of the snapshot is handed to the writer
 *   mid-chunk           half of the middle chunk's stored bytes handed to the writer
 *   mid-data            after half of the snapshot's raw bytes were handed to the writer
 *   after-data-fsync    data file written and fsynced, no manifest yet
 *   after-part          (a rank != 0 of a sharded snapshot) part record durable, no vote yet
 *   after-manifest      manifest written and fsynced in the temp folder, not renamed
 *   after-rename        temp folder renamed to its final name, parent not yet fsynced
 *   during-retention    (step = the step being removed) renamed to its temp name, not yet
 *                       deleted
 *   mid-upload          (the S3 uploader) this rank's objects of the step uploaded, the
 *                       group's decision and the manifest object not yet
 *   during-remote-retention  (step = the step being removed from S3) its manifest object
 *                       deleted, its other objects not yet
 * Besides "mid-mem-copy" (ckpt_mem.h). One-shot faults for drivers that arm them at run time
 * (tests/chaos): when CKPT_FAULT_DIR is set, a point also fires (SIGKILL) in the one process
 * whose unlink of the file DIR/<name> succeeds: touching that file arms the point once for
 * every process of the job, restarts included. Thread-safe; reads the variables once. */
void ckpt_fault_point(const char *name, uint64_t step);

/* Compression pool and the save pipeline shared by ckpt_save and the engine (ckpt_write.c). */
#include "ckpt.h"

typedef struct ckpt_pool ckpt_pool;

/* Start `threads` compression workers with 2*threads ring slots for chunks of up to
 * chunk_bytes (plus shuffle scratch when shuffle != 0). Errors: -EINVAL, -ENOMEM. */
int ckpt_pool_create(ckpt_pool **out, unsigned threads, uint64_t chunk_bytes, int shuffle);
/* Stop the workers and free; accepts NULL. No job may be running. */
void ckpt_pool_destroy(ckpt_pool *p);

/* Let workers wait, before reading a chunk, until wait_ready(ctx, end) says the bytes before
 * `end` are in place; used by the engine to overlap its stage copy with the persist. The hook
 * must return within a bounded time (0, or a negative errno that fails the save). */
void ckpt_pool_set_ready_hook(ckpt_pool *p, int (*wait_ready)(void *ctx, const void *end), void *ctx);

/* Lower the calling thread's scheduling priority (nice 10): for the engine's and the pool's
 * threads, so that training and the stage copy win busy cores. */
void ckpt_thread_background(void);

/* Validate the arguments of a save: 0 or -EINVAL. */
int ckpt_check_save(const ckpt_save_opts *opts, const char *run_id, const char *config_hash,
                    const ckpt_buffer *bufs, size_t nbufs);

/* Validate a group (NULL is valid: no group): 0 or -EINVAL. */
int ckpt_check_group(const ckpt_group *g);
/* ckpt_check_save for a rank of a group (partial shards allowed); group may be NULL. */
int ckpt_check_save_group(const ckpt_save_opts *opts, const char *run_id, const char *config_hash,
                          const ckpt_buffer *bufs, size_t nbufs, const ckpt_group *group);

/* Write and commit one snapshot from bufs (read only during the call) with the pool's
 * workers; compress = 0 stores every chunk raw. Same contract as ckpt_save; with a group,
 * this rank's part of a sharded snapshot (ckpt.h, "sharded snapshots"): the result on every
 * rank is 0 only when the snapshot was committed. */
/* A deferred trainer record: with trainer_json NULL and trainer_wait set, ckpt_persist writes
 * the chunks first and calls trainer_wait(ctx, &json) only where the record is needed (the
 * manifest: a world of one, or rank 0 of a group), which returns 0 with *json malloc'ed (the
 * callee frees it) or a negative errno that fails the persist. */
typedef int (*ckpt_trainer_wait_fn)(void *ctx, char **json);

int ckpt_persist(ckpt_pool *pool, const ckpt_save_opts *opts, int compress, uint64_t step,
                 const char *run_id, const char *config_hash, const ckpt_buffer *bufs,
                 size_t nbufs, const char *trainer_json, ckpt_trainer_wait_fn trainer_wait,
                 void *trainer_ctx, const ckpt_group *group, ckpt_save_stats *stats);

#endif /* CKPT_INTERNAL_H */
