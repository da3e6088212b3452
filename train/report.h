/* report.h - what a rank of train reports about its progress, for its launcher's metrics.
 *
 * Under `elastic`, the agent gives every worker the write end of a pipe (ELASTIC_HEARTBEAT_FD).
 * A rank writes one line per event to it; the agent's hang watchdog counts them as progress,
 * and its metrics endpoint (elastic --metrics-port) turns them into Prometheus series. Without
 * the variable nothing is written. The pipe is non-blocking: a full pipe or a gone agent
 * drops the line (never stalls training); so the agent must treat the stream as a sample.
 *
 * Line protocol, version 1 (ASCII, one event per line, at most TRAIN_REPORT_LINE_MAX bytes
 * with the newline; the first word names the event; then key=value pairs separated by one
 * space, values without spaces; numbers in C locale: integers, or reals as %.9g; units in the
 * key's suffix: _seconds, _bytes; unknown keys and events are to be ignored by readers):
 *
 *   step <n> seconds=<s> [loss=<x> lr=<x> grad_norm=<x> tokens_per_second=<x> samples=<n>]
 *       optimizer step n completed, its wall time; the bracketed keys on rank 0 only (the
 *       others do not know the global loss). Written after every step: the progress signal.
 *   val step=<n> loss=<x>                                                       (rank 0)
 *   snapshot_staged step=<n> stall_seconds=<s> bytes=<b>        a snapshot's copy (the stall)
 *   snapshot_wait step=<n> stall_seconds=<s>   the wait of the next optimizer update (or of
 *       the end of the run) for the device-to-host copies of snapshot n, which were queued at
 *       its stage (asynchronous staging, train/stage.h), plus the snapshot's digests computed
 *       once the copies are done: a stall too, the second part of the snapshot's. The step
 *       event's seconds do not include it (so the two never count twice)
 *   snapshot_skipped step=<n>                         policy skip: the previous one persisted
 *   snapshot_failed step=<n> result=<r>     the stage of a snapshot failed (a negative errno):
 *       the snapshot was not taken on this rank
 *   snapshot_done step=<n> result=<r> persist_seconds=<s> raw_bytes=<b> stored_bytes=<b>
 *       the persist finished: result 0 committed (on rank 0: the whole snapshot is; on the
 *       others: their shard is part of a committed snapshot), or a negative errno;
 *       persist_seconds from the start of the stage to the commit
 *   upload_<done|failed|skipped> step=<n> bytes=<b> seconds=<s> result=<r> lag_steps=<n>
 *       lag_seconds=<s> remote_step=<n>          the S3 uploader (train --s3) finished with the
 *       snapshot of step n on this rank; the lag keys: rank 0's view (newest local commit vs
 *       newest complete snapshot on S3; remote_step -1 when none yet)
 *   uploads_draining step=<n>        the run ended at step n and waits for its last uploads
 *   mem_snapshot step=<n> stall_seconds=<s> bytes=<b> slot=<i>
 *       a memory snapshot (train_mem.c) completed in slot i of this rank's segment: the stall
 *       (record, digests and the copy), the bytes of its payload
 *   mem_snapshot_failed step=<n> result=<r>    writing the memory snapshot failed (a negative
 *       errno); training goes on, the previous complete slot stays
 *   restore step=<n> seconds=<s> source=<memory|disk|s3|none>   (rank 0) where training starts:
 *       the step restored, the time the restore took and the tier it came from (memory: a
 *       shared-memory segment of this node, own or replica); source none for a fresh start
 *
 * TensorBoard (train --tensorboard-dir, or the config's "tensorboard" section): after
 * train_report_tensorboard, rank 0 also writes each event as TensorBoard scalars into an event
 * file of its own (tb_events.h), at the step the event names (optimizer steps: TensorBoard's
 * x axis) and the wall-clock time of the call:
 *
 *   train_report_step            train/loss, train/lr, train/grad_norm,
 *                                train/tokens_per_second, train/step_seconds
 *   train_report_val             train/val_loss
 *   train_report_snapshot_staged ckpt/stall_seconds                   at the snapshot's step
 *   train_report_snapshot_wait   ckpt/wait_seconds                    at the snapshot's step
 *   train_report_mem_snapshot    ckpt/mem_stall_seconds       at the memory snapshot's step
 *   train_report_snapshot_done   ckpt/persist_seconds, ckpt/persist_mib_per_second (raw MiB
 *                                / persist seconds), ckpt/compression_ratio (raw / stored),
 *                                of rank 0's shard, at the snapshot's step (reported a step
 *                                or more later); only for a committed snapshot (result 0)
 *   train_report_restore         a SessionLog START at step + 1 (below); ckpt/restore_seconds
 *                                at the restored step (not on a fresh start); elastic/restarts
 *                                at that step, from ELASTIC_RESTART_COUNT, else
 *                                TORCHELASTIC_RESTART_COUNT, when one is set to an integer >= 0
 *
 * Not yet: upload time and remote lag (they come with the S3 tier). Each call's events are
 * handed to the kernel (fflush, no fsync) before it returns, so a SIGKILL loses none that
 * were reported. A write error is logged once and ends the event file; training goes on.
 *
 * Steps redone after a restart. A run resumed from the snapshot of step S trains steps S+1,
 * S+2, ... again; the run before it may have written events for some of them (up to where it
 * died), and for snapshots after S that never committed. Every run starts its event file with
 * SessionLog START at step S+1 (step 1 on a fresh start, S = 0), written before any of its
 * scalars. TensorBoard then drops every event of an earlier file (name order, which
 * tb_events.h keeps equal to run order) whose step is >= S+1, and keeps those below: each step
 * keeps one value, the one of the run that completed it last, and the curve goes on from the
 * restored step without a jump. The START is at S+1 and not at S because TensorBoard drops
 * steps >= the START's step (event_accumulator.py: `x.step < event.step` is kept): a START at
 * S would also drop the loss of step S, and the val_loss and snapshot figures of step S,
 * which no later run writes again. The first START of a folder drops nothing (TensorBoard
 * counts it as the first session); a fresh start (START at 1) in a folder of an earlier run
 * drops all of that run's values, so an unrelated new run wants a new folder. TensorBoard's
 * Rust data server (the default since 2.5) ignores SessionLog and drops, per tag, the values
 * at steps >= a newly read step; the two rules agree here, except that the Rust server keeps
 * a value at a step after S of a tag that the new run does not write again at that step or a
 * later one (say, the stall of a snapshot that the new run skips). Runs after a resume are
 * bit-identical (DESIGN section 4), so a redone step's value is the one the earlier run
 * wrote, whichever rule applies.
 *
 * Thread-safety: one thread (the rank's main thread) uses a handle.
 */
#ifndef TRAIN_REPORT_H
#define TRAIN_REPORT_H

#include <stddef.h>
#include <stdint.h>

#define TRAIN_REPORT_VERSION 1
#define TRAIN_REPORT_LINE_MAX 256

typedef struct train_report train_report;

/* Open the reporting of this rank: the launcher's pipe from ELASTIC_HEARTBEAT_FD when set (an
 * invalid value is logged once and ignored). *out is never NULL on success, even with nothing
 * to report to (every call is then a no-op). Free with train_report_close.
 * Errors: -ENOMEM. */
int train_report_open(train_report **out, int rank);

/* Close and free; accepts NULL. Closes the TensorBoard event file. */
void train_report_close(train_report *r);

/* Rank 0: also write TensorBoard events into the folder dir (created with its parents when
 * missing): opens a new event file (tb_events.h, train_tb_open) at once. Call when the run is
 * about to train, before train_report_restore, at most once. Other ranks: nothing (returns 0).
 * A failure is logged here (a warning naming dir and the reason) and training goes on without
 * the events. Returns 0, -EINVAL (NULL r or dir, an empty dir, a second call), or
 * train_tb_open's error. */
int train_report_tensorboard(train_report *r, const char *dir);

/* Step `step` completed in `seconds`. On rank 0 also the mean loss, the learning rate used,
 * the global gradient norm before clipping, the throughput (tokens/s) and the samples consumed
 * so far; other ranks pass NAN for the reals (and 0 samples): they are not written. */
void train_report_step(train_report *r, int64_t step, double seconds, double loss, double lr,
                       double grad_norm, double tokens_per_second, uint64_t samples);

/* Validation loss at `step` (rank 0). */
void train_report_val(train_report *r, int64_t step, double loss);

/* A snapshot of `step` was staged: the stall in seconds and the bytes copied. */
void train_report_snapshot_staged(train_report *r, int64_t step, double stall_seconds,
                                  uint64_t bytes);

/* A memory snapshot of `step` completed in slot `slot` of this rank's segment: the stall in
 * seconds and the payload bytes. */
/* snapshot_wait: the optimizer update waited stall_seconds (seconds) for the copies and the
 * digests of the snapshot of step `step`. */
void train_report_snapshot_wait(train_report *r, int64_t step, double stall_seconds);

void train_report_mem_snapshot(train_report *r, int64_t step, double stall_seconds,
                               uint64_t bytes, int slot);

/* Writing the memory snapshot of `step` failed with result (a negative errno). */
void train_report_mem_snapshot_failed(train_report *r, int64_t step, int result);

/* The snapshot of `step` was skipped by the wait/skip policy. */
void train_report_snapshot_skipped(train_report *r, int64_t step);

/* The stage of the snapshot of `step` failed with result (a negative errno). */
void train_report_snapshot_failed(train_report *r, int64_t step, int result);

/* A persist finished: result 0 (committed) or a negative errno; the figures of
 * ckpt_persist_stats. */
void train_report_snapshot_done(train_report *r, int64_t step, int result,
                                double persist_seconds, uint64_t raw_bytes,
                                uint64_t stored_bytes);

/* The S3 uploader's outcome for the snapshot of `step` (ckpt_s3.h events): kind "done"
 * (bytes PUT by this rank, seconds), "failed" (result) or "skipped" (a full backlog dropped
 * it); on rank 0 with the lag (steps and seconds) and the newest complete step on S3 (-1 none).
 * Safe to call from the uploader's thread (one write of one line; no TensorBoard event). */
void train_report_upload(train_report *r, const char *kind, int64_t step, uint64_t bytes,
                         double seconds, int result, uint64_t lag_steps, double lag_seconds,
                         int64_t remote_step);

/* The run is over at `step` and waits for its last uploads to S3 (every few seconds while it
 * does: progress for a hang watchdog). */
void train_report_uploads_draining(train_report *r, int64_t step);

/* Training starts at `step`, restored in `seconds` from `source` ("memory", "disk", "s3";
 * "none" for a fresh start, step 0). */
void train_report_restore(train_report *r, int64_t step, double seconds, const char *source);

#endif /* TRAIN_REPORT_H */
