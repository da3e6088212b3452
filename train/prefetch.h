/* prefetch.h - one rank's background reader that keeps the next steps' samples ready.
 *
 * A batch is `count` consecutive sample numbers of the global order (data.h) starting at
 * `first`: for k in [first, first + count), idx = train_dataset_order(ds, seed, k), then
 * train_dataset_sample(ds, idx, ...). A rank asks for its batches in order, first, first +
 * stride, first + 2 * stride, ... (rank r of W with micro-batch b and A accumulation steps
 * reads at samples + r * A * b each step, so stride = the global batch size in samples); the
 * thread reads the following `depth` batches ahead while the caller computes. A request that
 * is not the next one expected (a resume, a jump) drops what was read ahead and restarts
 * there. The thread starts reading at the first get, not at create.
 *
 * Results are bit-identical to reading synchronously: the same two calls, on the same
 * dataset, into the prefetcher's own buffers, which get copies out.
 *
 * Dataset sharing: train_dataset_sample reads with pread at an explicit offset (no shared
 * file position) and touches no state of the dataset, so other threads may keep calling it
 * and the read-only accessors (num_samples, hash, ...) on the same dataset while the
 * prefetcher runs. train_dataset_order is not thread-safe (it caches one epoch's permutation
 * inside the dataset) and the prefetch thread calls it: while a prefetcher exists, nothing
 * else may call train_dataset_order on its dataset (open a second handle for that; get returns
 * the sample indices, so the owner rarely needs one). The dataset must outlive the prefetcher.
 *
 * Errors met by the thread are kept with their batch and returned, with the dataset's one-line
 * reason, by the get that asks for that batch; nothing is logged here (the caller logs the
 * reason once).
 *
 * Thread-safety: one thread at a time calls get (and free, after its last get); the handle
 * owns one background thread.
 */
#ifndef TRAIN_PREFETCH_H
#define TRAIN_PREFETCH_H

#include "data.h"

#include <stddef.h>
#include <stdint.h>

typedef struct train_prefetch train_prefetch;

/* Start a prefetcher for batches of `count` samples of `seq_len` tokens from `ds` in the order
 * of `seed`. stride (>= 1, in samples) is the distance between this rank's consecutive batch
 * starts; depth (>= 1) is how many batches the thread reads ahead of the caller, e.g. 2.
 * seq_len must be the one ds was opened with (data.h has no accessor to check it; another
 * value overruns or underfills the buffers). The thread idles until the first get.
 * Memory: depth * count * seq_len * 2 int32 plus depth * count uint64, allocated here.
 * *out is owned by the caller and freed with train_prefetch_free; ds is borrowed.
 * Errors: -EINVAL (NULL out or ds, count, seq_len, depth or stride < 1, a size that overflows),
 * -ENOMEM, -errno of pthread_create (-EAGAIN). On error *out is NULL. */
int train_prefetch_create(train_prefetch **out, train_dataset *ds, uint64_t seed, int seq_len,
                          int count, uint64_t stride, int depth);

/* Return the batch that starts at sample number `first`, and let the thread go on reading the
 * batches at first + stride, first + 2 * stride, ... (up to depth ahead). When first is the
 * next expected start (the previous successful get's first + stride, or a repeat of a get that
 * timed out) the read-ahead batch is used; otherwise everything read ahead is dropped and
 * reading restarts at first.
 * inputs and targets (count * seq_len int32 each, sample-major: sample j's tokens at
 * [j * seq_len, (j + 1) * seq_len)) receive copies; idx (count uint64, may be NULL) receives the
 * dataset sample indices. They are written only on success.
 * Waits at most timeout_s seconds (>= 0; 0 polls; values above 1e9 are taken as 1e9) for the
 * thread to finish the batch.
 * Errors: -EINVAL (NULL p, inputs or targets, timeout_s negative or NaN), -ETIMEDOUT (not read
 * yet: the batch stays queued and the same get may be repeated), and the batch's error from
 * the dataset: -EIO (a shard cannot be read or got shorter since open), -EINVAL (a sample index
 * out of range), -ENOMEM; for these why (may be NULL; why_len bytes, NUL-terminated) gets a
 * one-line reason naming the file where the dataset gives one, and the read-ahead is dropped so
 * the next get reads afresh. */
int train_prefetch_get(train_prefetch *p, uint64_t first, int32_t *inputs, int32_t *targets,
                       uint64_t *idx, double timeout_s, char *why, size_t why_len);

/* Stop the thread, join it and free everything; accepts NULL. The thread checks for the stop
 * between samples, so this waits for at most one sample's pread (microseconds from the page
 * cache; on a hung file system, as long as that pread). */
void train_prefetch_free(train_prefetch *p);

#endif /* TRAIN_PREFETCH_H */
