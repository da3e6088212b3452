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
 *   snapshot_skipped step=<n>                         policy skip: the previous one persisted
 *   snapshot_failed step=<n> result=<r>     the stage of a snapshot failed (a negative errno):
 *       the snapshot was not taken on this rank
 *   snapshot_done step=<n> result=<r> persist_seconds=<s> raw_bytes=<b> stored_bytes=<b>
 *       the persist finished: result 0 committed (on rank 0: the whole snapshot is; on the
 *       others: their shard is part of a committed snapshot), or a negative errno;
 *       persist_seconds from the start of the stage to the commit
 *   restore step=<n> seconds=<s> source=<disk|none>            (rank 0) where training starts:
 *       the step restored and the time the restore took; source none for a fresh start
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

/* Close and free; accepts NULL. */
void train_report_close(train_report *r);

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

/* The snapshot of `step` was skipped by the wait/skip policy. */
void train_report_snapshot_skipped(train_report *r, int64_t step);

/* The stage of the snapshot of `step` failed with result (a negative errno). */
void train_report_snapshot_failed(train_report *r, int64_t step, int result);

/* A persist finished: result 0 (committed) or a negative errno; the figures of
 * ckpt_persist_stats. */
void train_report_snapshot_done(train_report *r, int64_t step, int result,
                                double persist_seconds, uint64_t raw_bytes,
                                uint64_t stored_bytes);

/* Training starts at `step`, restored in `seconds` from `source` ("disk"; "none" for a fresh
 * start, step 0). */
void train_report_restore(train_report *r, int64_t step, double seconds, const char *source);

#endif /* TRAIN_REPORT_H */
