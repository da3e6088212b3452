/* device.h - the device layer: device memory, host<->device copies, streams, events and
 * pinned host memory, with a CPU and a CUDA implementation behind one interface.
 *
 * The model, the optimizer, the collectives and the snapshot staging call this layer (and the
 * kernels of kern_ops.h), never the CUDA runtime directly.
 *
 * Two kinds:
 *   TRAIN_DEVICE_CPU  - "device" memory is ordinary host memory (64-byte aligned, zeroed).
 *                       The compute stream (train_device_compute_stream) is synchronous: work
 *                       put on it runs in the calling thread before the call returns, as the
 *                       CPU kernels do, and an event recorded on it is complete at once.
 *                       Every stream made with train_stream_create is a worker thread with a
 *                       FIFO queue, so asynchronous copies really are asynchronous and events
 *                       really are pending until the worker reaches them: the staging logic
 *                       above this layer is exercised in CI without a GPU. Pinned memory is
 *                       ordinary memory; train_host_register only checks its arguments and
 *                       remembers the range (so that unregister can check it too).
 *   TRAIN_DEVICE_CUDA - the CUDA runtime API (libcudart, never the driver API: these machines
 *                       have no libcuda). The compute stream is a non-blocking stream created
 *                       at open; train_stream_create makes further non-blocking streams.
 *                       Events are created with cudaEventDisableTiming. Available only when the
 *                       build found nvcc (CKPT_HAVE_CUDA); otherwise open returns -ENOTSUP.
 *
 * Copies: `kind` says where each side lives (TRAIN_COPY_H2D, D2H, D2D, H2H). On the CPU kind
 * every kind is a memcpy. For CUDA, asynchronous copies to or from host memory that is not
 * pinned (train_host_alloc_pinned or train_host_register) are legal but synchronous in
 * practice (the CUDA rule); the staging code always uses pinned memory.
 *
 * Ordering: work on one stream runs in the order it was queued. train_stream_wait_event makes
 * later work on a stream wait for an event recorded on another stream (cudaStreamWaitEvent).
 *
 * Timeouts: every wait (train_stream_sync, train_event_wait, train_stream_destroy) takes a
 * bound in seconds and returns -ETIMEDOUT when it passes; the CUDA waits poll
 * cudaEventQuery / cudaStreamQuery with a short sleep rather than block in the driver.
 *
 * Errors (negative errno, STYLE.md): -EINVAL bad argument (NULL where not allowed, a size of 0
 * where not allowed, an event never recorded where one must be, a range not registered);
 * -ENOMEM out of host or device memory; -ENOTSUP the kind is not built in; -ENODEV no such
 * device (CUDA: cudaGetDeviceCount reports none or fails, e.g. error 35 without a driver);
 * -ETIMEDOUT a wait passed its bound; -EIO a CUDA call failed (the CUDA error's name and
 * string are logged once, with the call); a stream or event that failed stays failed (sticky
 * error, returned by every later wait on it).
 *
 * Memory ownership: everything returned through an out pointer is owned by the caller and
 * freed with the matching free/destroy, which all accept NULL. A device outlives its streams,
 * events and allocations.
 *
 * Thread-safety: a device may be used from several threads (allocation and the synchronous
 * copies are thread-safe); one stream or event is driven by one thread at a time, except that
 * train_event_query/train_event_wait may be called from any thread once the event was
 * recorded (the engine's persist workers wait on events the training thread recorded).
 */
#ifndef TRAIN_DEVICE_H
#define TRAIN_DEVICE_H

#include <stddef.h>

typedef enum train_device_kind { TRAIN_DEVICE_CPU = 0, TRAIN_DEVICE_CUDA = 1 } train_device_kind;

typedef enum train_copy_kind {
    TRAIN_COPY_H2D = 0, /* host to device */
    TRAIN_COPY_D2H = 1, /* device to host */
    TRAIN_COPY_D2D = 2, /* device to device */
    TRAIN_COPY_H2H = 3  /* host to host */
} train_copy_kind;

typedef struct train_device train_device;
typedef struct train_stream train_stream;
typedef struct train_event train_event;

/* Parse "cpu" or "cuda" (also "cuda:N": *ordinal = N, else 0). Returns 0 or -EINVAL. */
int train_device_parse(const char *text, train_device_kind *kind, int *ordinal);

/* Number of devices of the kind: 1 for CPU; for CUDA cudaGetDeviceCount, -ENODEV when it
 * fails or reports none, -ENOTSUP when not built with CUDA. */
int train_device_count(train_device_kind kind);

/* Open device `ordinal` of the kind (CPU: ordinal 0). On failure writes one line into why
 * (may be NULL), e.g. "--device cuda: no CUDA device (cudaGetDeviceCount: error 35,
 * CUDA driver version is insufficient...)".
 * Errors: -EINVAL, -ENOTSUP, -ENODEV, -ENOMEM, -EIO. */
int train_device_open(train_device **out, train_device_kind kind, int ordinal, char *why,
                      size_t why_len);

/* Wait (at most 60 s) for the compute stream, then free the device. Accepts NULL. */
void train_device_close(train_device *d);

train_device_kind train_device_kind_of(const train_device *d);

/* One line naming the device: "cpu" or e.g. "cuda:0 NVIDIA H200 (sm_90, 139 GiB)". Owned by
 * the device. */
const char *train_device_describe(const train_device *d);

/* Allocate `bytes` (> 0) of zeroed device memory, aligned to 256 bytes. Errors: -EINVAL,
 * -ENOMEM. */
int train_device_alloc(train_device *d, void **out, size_t bytes);
void train_device_free(train_device *d, void *p); /* accepts NULL */

/* Set `bytes` of device memory to zero, on the compute stream (CPU: at once). */
int train_device_zero(train_device *d, void *p, size_t bytes);

/* Synchronous copy: returns when the bytes are in place. Also waits for the work queued
 * before it on the compute stream (so that results of kernels are visible), at most 300 s.
 * bytes may be 0. CUDA: a host side in pinned memory (train_host_alloc_pinned,
 * train_host_register) is copied directly; pageable host memory goes through the device's
 * pinned bounce buffer of 8 MiB, one chunk at a time (so the driver never stages it with an
 * unbounded wait), one such copy at a time per device. Errors: -EINVAL, -EIO, -ENOMEM (the
 * bounce buffer), -ETIMEDOUT (the compute stream did not finish within the bound). */
int train_device_copy(train_device *d, void *dst, const void *src, size_t bytes,
                      train_copy_kind kind);

/* Pinned (page-locked) host memory: zeroed, 64-byte aligned. CPU: ordinary memory. */
int train_host_alloc_pinned(train_device *d, void **out, size_t bytes);
void train_host_free_pinned(train_device *d, void *p); /* accepts NULL */

/* Register existing host memory [p, p + bytes) as pinned (cudaHostRegister, e.g. a shared
 * memory segment the agent holds) / undo it. -EINVAL for a bad or unknown range; -EIO when
 * CUDA refuses. */
int train_host_register(train_device *d, void *p, size_t bytes);
int train_host_unregister(train_device *d, void *p);

/* The compute stream (owned by the device): kernels run on it. */
train_stream *train_device_compute_stream(train_device *d);

/* A new stream (CPU: a worker thread). Errors: -ENOMEM, -EIO, -EAGAIN (no thread). */
int train_stream_create(train_device *d, train_stream **out);
/* Wait (at most timeout_s) for the queued work, then free. Returns 0, -ETIMEDOUT (the stream
 * is then abandoned: its memory leaked, never freed under a running worker) or the stream's
 * sticky error. Accepts NULL (returns 0). */
int train_stream_destroy(train_stream *s, double timeout_s);

/* The backend's handle: cudaStream_t for CUDA, NULL for CPU. For the kernels' context. */
void *train_stream_native(train_stream *s);

/* Queue a copy of `bytes` on stream s; returns when queued (not done). The caller keeps both
 * buffers alive and unchanged (src) / untouched (dst) until an event recorded after it is
 * complete. bytes may be 0. Errors: -EINVAL, -EIO, the stream's sticky error. */
int train_stream_copy_async(train_stream *s, void *dst, const void *src, size_t bytes,
                            train_copy_kind kind);

/* Queue a call of fn(ctx) on stream s (CPU: on its worker; CUDA: cudaLaunchHostFunc). fn
 * must not call the device layer. For tests and host-side steps that must be ordered with
 * copies. Errors: -EINVAL, -EIO. */
int train_stream_host_fn(train_stream *s, void (*fn)(void *ctx), void *ctx);

/* Wait until all work queued on s so far is done. 0, -ETIMEDOUT or the sticky error. */
int train_stream_sync(train_stream *s, double timeout_s);

/* Events. An event marks a point in a stream's queue; recording it again moves the mark. */
int train_event_create(train_device *d, train_event **out);
void train_event_destroy(train_event *e); /* accepts NULL; waits (60 s) if still pending */

/* Mark the current end of s's queue. s NULL = the compute stream. */
int train_event_record(train_event *e, train_stream *s);

/* Later work queued on s waits until e (recorded on another stream) is complete.
 * -EINVAL when e was never recorded. */
int train_stream_wait_event(train_stream *s, train_event *e);

/* 1 when complete, 0 when pending, or a negative errno: -EINVAL never recorded, the stream's
 * sticky error. Does not wait. */
int train_event_query(train_event *e);

/* Wait until e is complete: 0, -ETIMEDOUT, -EINVAL (never recorded), the sticky error. */
int train_event_wait(train_event *e, double timeout_s);

#endif /* TRAIN_DEVICE_H */
