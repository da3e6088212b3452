/* ckpt_export.h - export the tensors of a snapshot as one safetensors file.
 *
 * The tensor table comes from the snapshot's trainer record (docs/FORMAT.md, "The trainer
 * record"): `tensor_buffer` names the flat buffer (default "params" when absent) and
 * `tensors` is an array of {name, shape, offset}, offset in elements of that buffer. The
 * output is the safetensors layout (huggingface/safetensors):
 *
 *   u64 N, little-endian          length of the header in bytes, a multiple of 8
 *   N bytes of UTF-8 JSON         {"__metadata__": {...strings...},
 *                                  "<name>": {"dtype": "F32", "shape": [...],
 *                                             "data_offsets": [begin, end]}, ...}
 *                                 padded with spaces to N bytes
 *   the data                      the tensors in table order, contiguous, no padding;
 *                                 data_offsets are bytes relative to the start of the data
 *
 * __metadata__ holds "format": "pt", "step", "run_id", "config_hash", "params_digest" (when
 * the trainer record has one), "source_snapshot" (the snapshot folder, made absolute) and
 * "producer".
 *
 * Not part of the ckpt library: built into ckpt-inspect only.
 */
#ifndef CKPT_EXPORT_H
#define CKPT_EXPORT_H

#include "ckpt.h"

#include <stddef.h>
#include <stdint.h>

typedef struct ckpt_export_opts {
    int force;             /* non-zero: replace an existing output file; default 0 */
    uint64_t window_bytes; /* bytes of the buffer read (and decoded) at a time, which is the
                              memory an export takes besides the reader's; windows start at
                              multiples of it in the buffer, so chunks of a size dividing it
                              (4 MiB by default) are decoded once, others at most twice.
                              Default 64 MiB; range [4 KiB, 4 GiB] */
    ckpt_progress_fn progress; /* NULL (default), or called on the caller's thread after each
                                  window with the tensor bytes written so far and in all;
                                  non-zero stops the export (-ECANCELED) */
    void *progress_ctx;        /* passed to progress */
} ckpt_export_opts;

#define CKPT_EXPORT_OPTS_INIT {0, 64u << 20, NULL, NULL}

/* Figures of one export. */
typedef struct ckpt_export_stats {
    size_t tensors;      /* tensors written */
    uint64_t data_bytes; /* bytes of tensor data (the data section) */
    uint64_t file_bytes; /* bytes of the whole output file: 8 + header + data */
    double seconds;      /* wall time of the call */
} ckpt_export_stats;

/* Write the tensors of the open snapshot `s` to `out_path` as safetensors.
 *
 * The buffer's dtype must be one safetensors knows (f32 -> F32, f16 -> F16, bf16 -> BF16,
 * f64 -> F64) with a matching elem_bytes. Tensor bytes are read with ckpt_snapshot_read in
 * windows of opts->window_bytes (memory: one window), so every chunk read is checked
 * against its checksums; only the windows that hold tensor bytes are read. opts may be NULL
 * for CKPT_EXPORT_OPTS_INIT.
 *
 * Durable and atomic: the file is written as "<out_path>.tmp-<pid>" (created with O_EXCL),
 * fsynced, renamed to out_path and the folder of out_path fsynced. On any error the temp
 * file is removed and out_path is neither created nor changed, except when the final fsync
 * of the folder fails (the file is then complete under out_path but its name may not be
 * durable yet). A crash mid-export may leave the temp file behind. An existing out_path is
 * refused unless opts->force is non-zero (then it is replaced atomically); without it the
 * rename itself also refuses to replace (RENAME_NOREPLACE where the file system has it).
 *
 * `why` (may be NULL) receives a one-line reason of at most why_len bytes on error, naming
 * the file and chunk for corrupt data. `stats` may be NULL.
 *
 * Errors: -EINVAL (s or out_path NULL, window_bytes out of range; the trainer record has no usable tensor table: not
 * JSON, missing or malformed tensors, duplicate names, a tensor outside the buffer or two
 * tensors that overlap in it; an
 * unsupported dtype), -ENOENT (no tensor buffer of that name), -EEXIST (out_path exists and
 * force is 0, or the temp file exists), -EBADMSG (a chunk is corrupt), -ECANCELED (the
 * progress callback asked to stop), -ENOMEM, -ENOSPC,
 * -EIO, other -errno of open, write, fsync, rename.
 *
 * Thread-safety: uses s, which is used by one thread at a time (ckpt.h). */
int ckpt_export_safetensors(ckpt_snapshot *s, const char *out_path, const ckpt_export_opts *opts,
                            ckpt_export_stats *stats, char *why, size_t why_len);

#endif /* CKPT_EXPORT_H */
