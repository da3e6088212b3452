/* device_internal.h - what device.c (the kind dispatch) shares with the two implementations
 * of device.h (device_cpu.c, device_cuda.c / device_cuda_stub.c), and two test hooks of the CPU
 * kind. Not a public header: the model, the engine and the staging code use device.h only.
 *
 * Each public object starts with a base struct naming its kind's ops table; device.c checks
 * the arguments that do not depend on the kind (NULL pointers, copy kinds, timeouts) and calls
 * through the table, so an implementation only sees valid arguments:
 *   - pointers that must not be NULL are not NULL; bytes > 0 where device.h requires it;
 *   - dst and src are not NULL when bytes > 0 (a copy of 0 bytes never reaches an
 *     implementation);
 *   - timeouts are finite, >= 0 and at most 1e9 s;
 *   - stream and event belong to the same kind.
 * The registered-range table of train_host_register lives in the base device (device.c), so
 * that both kinds check ranges the same way; the implementation only pins or unpins.
 */
#ifndef TRAIN_DEVICE_INTERNAL_H
#define TRAIN_DEVICE_INTERNAL_H

#include "device.h"

#include <pthread.h>

typedef struct train_device_ops train_device_ops;

typedef struct train_reg_range {
    char *p;
    size_t bytes;
} train_reg_range;

/* The first member of every implementation's device. ops and kind are set by device.c after
 * ops->open; reg_* belong to device.c. */
struct train_device {
    const train_device_ops *ops;
    train_device_kind kind;
    pthread_mutex_t reg_mu;
    train_reg_range *reg;
    size_t nreg, capreg;
};

/* The first member of every implementation's stream and event; set by the implementation. */
struct train_stream {
    const train_device_ops *ops;
    train_device *dev;
};
struct train_event {
    const train_device_ops *ops;
    train_device *dev;
};

/* One kind. The functions have device.h's meaning, with the argument checks above done. */
struct train_device_ops {
    train_device_kind kind;
    int (*count)(void);
    /* Allocates the implementation's device (base zeroed except what the kind sets). */
    int (*open)(train_device **out, int ordinal, char *why, size_t why_len);
    void (*close)(train_device *d);
    const char *(*describe)(const train_device *d);
    int (*alloc)(train_device *d, void **out, size_t bytes);
    void (*free)(train_device *d, void *p); /* p not NULL */
    int (*zero)(train_device *d, void *p, size_t bytes);
    int (*copy)(train_device *d, void *dst, const void *src, size_t bytes, train_copy_kind kind);
    int (*host_alloc)(train_device *d, void **out, size_t bytes);
    void (*host_free)(train_device *d, void *p);       /* p not NULL */
    int (*host_pin)(train_device *d, void *p, size_t bytes); /* range checked by device.c */
    int (*host_unpin)(train_device *d, void *p);       /* p is a registered range's start */
    train_stream *(*compute_stream)(train_device *d);
    int (*stream_create)(train_device *d, train_stream **out);
    int (*stream_destroy)(train_stream *s, double timeout_s); /* never the compute stream */
    void *(*stream_native)(train_stream *s);
    int (*copy_async)(train_stream *s, void *dst, const void *src, size_t bytes,
                      train_copy_kind kind);
    int (*host_fn)(train_stream *s, void (*fn)(void *ctx), void *ctx);
    int (*stream_sync)(train_stream *s, double timeout_s);
    int (*event_create)(train_device *d, train_event **out);
    void (*event_destroy)(train_event *e); /* e not NULL */
    int (*event_record)(train_event *e, train_stream *s); /* s not NULL */
    int (*stream_wait_event)(train_stream *s, train_event *e);
    int (*event_query)(train_event *e);
    int (*event_wait)(train_event *e, double timeout_s);
};

extern const train_device_ops train_device_cpu_ops;
/* device_cuda.c, or device_cuda_stub.c (count and open return -ENOTSUP, the rest NULL) when
 * the build has no CUDA. */
extern const train_device_ops train_device_cuda_ops;

/* Test hooks of the CPU kind (tests/unit/test_device.c, the staging tests). */

/* The bound on one cross-stream wait (train_stream_wait_event) of the CPU kind, in seconds
 * (default 300; > 0): a worker stream whose wait passes it fails with -ETIMEDOUT (sticky);
 * on the compute stream the call itself returns -ETIMEDOUT and the stream fails. Applies to
 * waits queued after the call. Returns 0, or -EINVAL (not a CPU device, bound not > 0). */
int train_device_cpu_set_wait_bound(train_device *d, double seconds);

/* Queue on a CPU worker stream an operation that fails the stream with err (a negative
 * errno, e.g. -EIO) when the worker reaches it, as a failed CUDA copy would: the work queued
 * after it is skipped, events recorded after it report err, train_stream_sync and
 * train_stream_destroy return it. Returns 0 (queued), -EINVAL (not a CPU worker stream, err
 * not negative), -ENOMEM, or the stream's sticky error. */
int train_stream_cpu_inject_error(train_stream *s, int err);

#endif /* TRAIN_DEVICE_INTERNAL_H */
