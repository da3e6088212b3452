/* stage.h - snapshot staging from device memory and restore into it, over train/device.h.
 *
 * Saving (issue 11, section 4). The trainer's shard lives in device memory. A stager owns one
 * dedicated copy stream and hands the checkpoint engine a ckpt_copier (ckpt/ckpt.h,
 * ckpt_engine_stage_device) whose copy queues a device-to-host copy of one chunk on that
 * stream into the engine's staging area, followed by an event: the event is the chunk's
 * ticket. The engine's compression workers wait for the ticket of the chunk they read, so
 * compression and writing start with the first chunk copied. A step then goes:
 *
 *   optimizer update (compute stream)
 *   train_stager_after_compute()      the copy stream waits for the update (an event)
 *   ckpt_engine_stage_device(..., copier of the stager, ...)   queues the copies; returns
 *   forward + backward of the next step (compute stream), while the copies run
 *   train_stager_wait_all()           before the next optimizer update writes the shard
 *   optimizer update ...
 *
 * The staging area is registered as pinned host memory (train_host_register) once per
 * allocation by the engine through the copier's pin, so the copies are true DMA; the engine
 * unregisters it (unpin) before it frees or grows it.
 *
 * Restoring (issue 11, section 4, "Restore"). train_stage_restore reads a byte range of a
 * snapshot buffer slice by slice into two pinned bounce buffers, alternately, and queues the
 * host-to-device copy of each slice on the copy stream; while the copy of slice k runs, slice
 * k + 1 is read and decompressed (ckpt_snapshot_read, on the snapshot's reading threads) into
 * the other bounce buffer; a bounce buffer is reused only after its previous copy is done.
 *
 * Tickets: 1, 2, 3, ... in the order of the copies. Each ticket has its own event, kept in a
 * ring that grows when every event is still pending or still being waited for, and whose
 * events are reused once complete (memory stays bounded by the copies in flight, not by the
 * copies ever made). Because all copies run on one stream in order, "ticket t done" implies
 * "every ticket before t done".
 *
 * Threads: one thread (the training thread) drives a stager: create, destroy, copy (the
 * copier's copy), pin/unpin, after/after_compute, wait_all, restore. train_stager_wait (the
 * copier's wait) may be called from any number of threads at once (the engine's compression
 * workers) while the driving thread queues further copies.
 *
 * Timeouts: every wait is bounded: the copier's waits by the copier's timeout_s (set to the
 * stager's timeout_s), train_stager_wait_all and the restore's waits by their argument or
 * the stager's timeout_s; a wait that passes its bound returns -ETIMEDOUT.
 *
 * Errors (negative errno): -EINVAL bad argument (also a ticket never handed out), -ENOMEM,
 * -ETIMEDOUT, -EIO a device call failed (logged by the device layer), and the copy stream's
 * sticky error: after a failed copy every later copy and wait on the stager fails with it
 * (destroy the stager and make a new one).
 */
#ifndef TRAIN_STAGE_H
#define TRAIN_STAGE_H

#include "ckpt.h"
#include "device.h"

#include <stddef.h>
#include <stdint.h>

/* Default bytes per restore slice (each of the two bounce buffers): 8 MiB. */
#define TRAIN_STAGE_SLICE_DEFAULT ((size_t)8 << 20)

typedef struct train_stager train_stager;

/* Create a stager on device dev (which must outlive it): makes its copy stream
 * (train_stream_create) and its first events. timeout_s (> 0, seconds) bounds each wait of
 * the copier and of the restore. The caller frees *out with train_stager_destroy.
 * Errors: -EINVAL (dev NULL, timeout_s not > 0), -ENOMEM, and train_stream_create's errors
 * (-EIO, -EAGAIN). */
int train_stager_create(train_stager **out, train_device *dev, double timeout_s);

/* Wait (at most the stager's timeout_s) for the copy stream's work, then free the stream, the
 * events and the stager. No copier wait may be running or start (destroy the engine, or wait
 * for its persist, first). Returns 0, the copy stream's sticky error, or -ETIMEDOUT: the copy
 * stream is then abandoned and the stager's memory leaked, never freed under a running
 * copy. Accepts NULL (returns 0). */
int train_stager_destroy(train_stager *st);

/* The copy stream (owned by the stager), e.g. to record an event after the last copy. */
train_stream *train_stager_stream(train_stager *st);

/* Fill *out with the stager's copier for ckpt_engine_stage_device: ctx = st, pin/unpin =
 * train_host_register/train_host_unregister on the stager's device, copy =
 * train_stager_copy, wait = train_stager_wait, timeout_s = the stager's. The stager must
 * outlive the engine that uses it (the engine unpins its staging area at destroy). */
void train_stager_copier(train_stager *st, ckpt_copier *out);

/* Later copies on the copy stream wait until ev (recorded on another stream, e.g. after the
 * optimizer update on the compute stream) is complete. Errors: -EINVAL (NULL, or ev never
 * recorded), the device layer's errors. */
int train_stager_after(train_stager *st, train_event *ev);

/* train_stager_after for the current end of the compute stream: records the stager's own
 * ordering event there and makes the copy stream wait for it. Call it after the optimizer
 * update and before the stage. Errors: as train_stager_after. */
int train_stager_after_compute(train_stager *st);

/* Queue an asynchronous device-to-host copy of `bytes` from device_src into host_dst (pinned,
 * e.g. the engine's staging area) on the copy stream, and an event after it; *ticket gets its
 * ticket. Returns when queued. The caller keeps device_src unchanged and host_dst untouched
 * until the ticket is done (train_stager_wait or train_stager_wait_all). bytes may be 0.
 * Driving thread only. Errors: -EINVAL, -ENOMEM (growing the event ring), the device layer's
 * errors and the sticky error; when the copy was queued but its event could not be recorded,
 * the call waits for the stream (bounded) before it returns the error, so that no untracked
 * copy is left writing into host_dst. */
int train_stager_copy(train_stager *st, void *host_dst, const void *device_src, size_t bytes,
                      uint64_t *ticket);

/* Wait until the copy of `ticket` is done, at most timeout_s. Thread-safe: any number of
 * threads may wait at once, on the same or different tickets. Returns 0, -EINVAL (ticket 0 or
 * not handed out yet), -ETIMEDOUT, or the copy stream's sticky error. */
int train_stager_wait(train_stager *st, uint64_t ticket, double timeout_s);

/* Wait until every copy queued so far is done (train_stream_sync of the copy stream), at most
 * timeout_s: what the trainer calls before its next optimizer update overwrites the shard.
 * Driving thread only. Returns 0, -EINVAL, -ETIMEDOUT or the sticky error. */
int train_stager_wait_all(train_stager *st, double timeout_s);

/* Tickets handed out so far (the last ticket; 0 before the first copy). */
uint64_t train_stager_tickets(train_stager *st);

/* Reads len bytes starting at byte `offset` of the source into host_dst (a pinned bounce
 * buffer, len bytes). Returns 0 or a negative errno. Runs on the thread calling the
 * restore. */
typedef int (*train_stage_read_fn)(void *ctx, uint64_t offset, uint64_t len, void *host_dst);

/* Restore bytes [offset, offset + len) of a source into device memory dst_dev (len bytes;
 * dst_dev[0] receives byte `offset`), slice_bytes at a time (0 = TRAIN_STAGE_SLICE_DEFAULT;
 * the last slice may be shorter; len need not be a multiple of it), through two pinned
 * bounce buffers (train_host_alloc_pinned, min(slice_bytes, len) bytes each, allocated and
 * freed by the call): slice k is read with read(ctx, ...) into bounce buffer k % 2 once that
 * buffer's previous host-to-device copy is done, then its copy is queued on the copy stream,
 * so reading (and decompressing) slice k + 1 overlaps the copy of slice k. The copies are
 * ordered after the work queued on the compute stream before the call (e.g. the zeroing of a
 * fresh model: train_stager_after_compute). Returns when every
 * byte is in dst_dev (the copy stream is synchronized), or at the first error, after waiting
 * for the copies already queued (bounded; on -ETIMEDOUT there the bounce buffers are leaked
 * rather than freed under a copy). Driving thread only; len 0 does nothing.
 * Errors: -EINVAL (NULL arguments), -ENOMEM, the read's error (first error kept), -ETIMEDOUT,
 * the device layer's errors. */
int train_stage_restore_fn(train_stager *st, train_stage_read_fn read, void *ctx,
                           uint64_t offset, uint64_t len, void *dst_dev, size_t slice_bytes);

/* train_stage_restore_fn reading bytes of buffer `name` of an open snapshot (file or memory
 * handle) with ckpt_snapshot_read; on -EBADMSG the reader's description of the bad chunk is
 * logged. The snapshot handle is used only by this call's thread for its duration.
 * Errors: those of train_stage_restore_fn and of ckpt_snapshot_read (-ENOENT no such buffer,
 * -EINVAL range outside it, -EBADMSG, -EIO, -ESTALE). */
int train_stage_restore(train_stager *st, ckpt_snapshot *s, const char *name, uint64_t offset,
                        uint64_t len, void *dst_dev, size_t slice_bytes);

#endif /* TRAIN_STAGE_H */
