/* data.h - token shards in the llm.c layout, the global sample order, and the prepare step.
 *
 * Shard file (llm.c, karpathy/llm.c dev/data/data_common.py): a header of 256 little-endian
 * int32 (header[0] = 20240520 magic, header[1] = 1 version, header[2] = token count), then
 * token count uint16 tokens. Byte-level data uses token = byte value (vocabulary 256).
 *
 * A dataset is the shards matched by a glob, in sorted path order. A sample is seq_len + 1
 * consecutive tokens of one shard: sample i of a shard starts at token i * seq_len, so a
 * shard of n tokens holds (n - 1) / seq_len samples. Samples are numbered across shards in
 * order.
 *
 * Sample order (DESIGN section 4): epoch e visits the samples in a permutation drawn by a
 * Fisher-Yates shuffle with the counter-based generator of rng.h on (seed, e). The k-th
 * sample consumed since the start of training is perm_{k / n}[k % n]; it depends on the
 * seed and the count consumed only, never on the world size.
 *
 * Thread-safety: a dataset is read-only after open (its permutation cache is not: use one
 * per thread). Tokens are read with pread, never mapped, so a shard rewritten under a running
 * job is an error, not a crash.
 */
#ifndef TRAIN_DATA_H
#define TRAIN_DATA_H

#include <stddef.h>
#include <stdint.h>

#define TRAIN_SHARD_MAGIC 20240520
#define TRAIN_SHARD_VERSION 1
#define TRAIN_SHARD_HEADER_INTS 256

typedef struct train_dataset train_dataset;

/* Open every file matching `glob_pattern` (sorted) read-only, check its header and size and
 * read every token once (range check and hash); the files stay open. `seq_len` fixes the sample length; `vocab` bounds the tokens (every token is
 * checked < vocab). On error a one-line reason naming the file goes into why.
 * Errors: -ENOENT (no file matches), -EBADMSG (bad magic/version, short or long file,
 * token >= vocab, a shard too small for one sample), -EINVAL, -ENOMEM, -errno of open/mmap. */
int train_dataset_open(train_dataset **out, const char *glob_pattern, int seq_len, int vocab,
                       char *why, size_t why_len);

/* Unmap and free; accepts NULL. */
void train_dataset_close(train_dataset *d);

/* Samples in the dataset (n above), and tokens in all its shards. */
uint64_t train_dataset_num_samples(const train_dataset *d);
uint64_t train_dataset_num_tokens(const train_dataset *d);
size_t train_dataset_num_files(const train_dataset *d);

/* xxh3-64 over the token contents of every shard, in order: identifies the data for
 * resume checks (case C15). */
uint64_t train_dataset_hash(const train_dataset *d);

/* Read sample `index` (0 <= index < num_samples) with pread: inputs (seq_len) = tokens
 * [0, T), targets (seq_len) = tokens [1, T+1). Thread-safe (no shared state).
 * Errors: -EINVAL index out of range, -EIO the file cannot be read or got shorter since open
 * (why names the file), -ENOMEM. */
int train_dataset_sample(const train_dataset *d, uint64_t index, int32_t *inputs, int32_t *targets,
                         char *why, size_t why_len);

/* The sample index that is consumed k-th overall (k counts from 0 across epochs) for the
 * given seed. Caches one epoch's permutation inside d (not thread-safe).
 * Errors: -ENOMEM (returned as a negative value). */
int64_t train_dataset_order(train_dataset *d, uint64_t seed, uint64_t k);

/* ------------------------------------------------------------------ prepare */

enum train_text_format {
    TRAIN_TEXT_PLAIN = 0, /* bytes as they are */
    TRAIN_TEXT_BROWN = 1  /* Brown corpus "word/tag" files: tags stripped, one output line per
                             input line (a sentence in the Brown files) */
};

/* Turn text files into byte-level shards DIR/train_000000.bin ... and DIR/val_000000.bin ...
 * (at most 100M tokens per shard). Documents are joined with a blank line. Validation
 * split: with several files, file i (0-based, in the order given) goes to validation when
 * floor((i+1)*val_fraction) > floor(i*val_fraction), so the split is spread evenly; with one
 * file, its last val_fraction of bytes. val_fraction in [0, 0.5]. out_dir and its parents
 * are created. Shards are written to a temp name, fsynced and renamed; shards with higher
 * numbers left by an earlier prepare into the same folder are removed.
 * *train_tokens and *val_tokens (may be NULL) get the counts.
 * Errors: -EINVAL (no files, bad fraction, empty input after conversion, a split that
 * leaves no training or validation data), -errno of file operations; why names the file. */
int train_prepare(const char *out_dir, const char *const *files, size_t nfiles,
                  double val_fraction, int format, uint64_t *train_tokens, uint64_t *val_tokens,
                  char *why, size_t why_len);

/* Convert one Brown corpus file's text (word/tag tokens) to plain text in place; returns
 * the new length. Exposed for tests. */
size_t train_brown_to_text(char *buf, size_t len);

#endif /* TRAIN_DATA_H */
