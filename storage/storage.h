/* storage.h - moving bytes to and from local files with io_uring and O_DIRECT.
 *
 * Knows nothing about checkpoints. Every function returns 0 (or a count) on success and a
 * negative errno-style code on failure; it never exits and never prints except through the
 * logger on the error's origin.
 *
 * Files are written sequentially through 4096-byte-aligned buffers with O_DIRECT, several
 * writes in flight (queue depth), short writes and -EAGAIN resubmitted (as liburing's
 * examples/io_uring-cp.c does); bytes the caller keeps in place until the file is closed can
 * instead be written from where they are (store_writer_append_ref), without the copy. The unaligned tail is written padded to the alignment and
 * the file is then truncated to its logical size. Where the file system refuses O_DIRECT
 * (EINVAL), the writer and the reader fall back to buffered I/O through the same ring
 * (logged at debug level).
 *
 * No wait is unbounded: every wait for a completion gives up after STORE_WAIT_TIMEOUT_S and
 * the operation fails with -ETIMEDOUT (requests still in flight are cancelled; if even that
 * does not finish them, their memory is leaked rather than reused while the kernel may
 * still touch it, and a reader handle then fails every later read with -EIO).
 *
 * Fault injection (tests): CKPT_FAULT_STORE="enospc:N" or "eio:N" makes the N-th data write
 * (N >= 1) submitted by any store_writer of the process fail with -ENOSPC or -EIO, as if
 * the device had returned it. Writes are counted from the start of the process across all
 * writers and threads; resubmissions of a short write do not count. The variable is read
 * once, at the first write; a malformed value is logged and ignored. "slow:MS" instead
 * delays every data write by MS milliseconds on the submitting thread (a slow disk), and
 * "eio-read:N" makes the N-th store_reader_read call of the process fail with -EIO (a
 * device read error: transient, never a verdict on the bytes), and "slow-read:MS" delays
 * every store_reader_read call by MS milliseconds (a slow disk, for progress displays).
 * One-shot faults armed at run time (tests/chaos): when CKPT_FAULT_DIR is set, the process
 * whose unlink of DIR/store-enospc or DIR/store-eio succeeds fails its next data write with
 * -ENOSPC or -EIO, and the one that removes DIR/store-eio-read fails its next read call with
 * -EIO; touching the file arms the fault once for all processes of a job. store_fault_armed
 * is that test, for other layers' fault points too (ckpt_fault_point).
 *
 * Thread-safety: a writer or reader handle is used by one thread at a time; different
 * handles are independent (each owns its ring).
 */
#ifndef STORAGE_H
#define STORAGE_H

#include <stddef.h>
#include <stdint.h>

/* Alignment of O_DIRECT buffers, offsets and lengths, in bytes. */
#define STORE_ALIGN 4096u

/* Longest wait for one I/O completion, in seconds, before -ETIMEDOUT. */
#define STORE_WAIT_TIMEOUT_S 60

typedef struct store_writer_opts {
    size_t buffer_bytes; /* size of each aligned buffer; multiple of STORE_ALIGN;
                            default 1 MiB, range [STORE_ALIGN, 64 MiB] */
    unsigned queue_depth; /* buffers (= writes) in flight; default 8, range [1, 64] */
    int direct;           /* 1: O_DIRECT when the file system allows it (default); 0: never */
    void *memory;         /* NULL (default): the writer allocates its buffers; else caller-owned
                             memory of queue_depth * buffer_bytes bytes, STORE_ALIGN-aligned,
                             that outlives the writer: a caller that writes many files keeps
                             its memory use flat this way (no allocator churn) */
} store_writer_opts;

#define STORE_WRITER_OPTS_INIT {1u << 20, 8u, 1, NULL}

typedef struct store_writer store_writer;

/* Create `path` (O_CREAT|O_EXCL, mode 0644) and return a writer in *out.
 * opts may be NULL for the defaults. Memory: queue_depth * buffer_bytes, allocated here
 * once unless opts->memory provides it. The caller owns *out and releases it with store_writer_close() or
 * store_writer_abort().
 * Errors: -EINVAL bad options (or misaligned memory), -EEXIST path exists, -ENOMEM, other -errno from open or
 * io_uring_queue_init. */
int store_writer_open(store_writer **out, const char *path, const store_writer_opts *opts);

/* Append len bytes from buf (any alignment) at the end of the file. The bytes are copied;
 * buf may be reused at once. Full buffers are submitted as they fill.
 * Errors: -EINVAL w NULL or buf NULL with len > 0; -EIO, -ENOSPC, -ETIMEDOUT, other -errno
 * of a completed write; once a write failed every later call returns the same (sticky)
 * error. */
int store_writer_append(store_writer *w, const void *buf, size_t len);

/* Append len bytes from buf like store_writer_append, but write them to the file from where
 * they are instead of copying them, where the file allows it: buf must then stay valid and
 * unchanged until store_writer_close or store_writer_abort returns (the kernel reads it while
 * the writes are in flight; after a timeout that left writes stuck, possibly later still).
 * In O_DIRECT mode only memory aligned like the file offset it goes to, i.e. (buf - offset)
 * a multiple of STORE_ALIGN with offset = store_writer_offset(w), can be written in place:
 * the bytes up to the next aligned file offset and a tail under STORE_ALIGN are copied
 * (with buf of any other alignment, or len under 64 KiB, everything is: it behaves as
 * store_writer_append). In-place writes are up to 4 MiB each and count, as writes of the
 * buffers do, towards queue_depth and the fault injection. The file's bytes are the same as
 * with store_writer_append.
 * Errors: as store_writer_append. */
int store_writer_append_ref(store_writer *w, const void *buf, size_t len);

/* Preallocate the first `bytes` bytes of the file (fallocate mode 0, which also sets its
 * size; close truncates it to the bytes appended): writes into allocated space inside the
 * file are faster than writes that extend it (ext4 with O_DIRECT: about 1.5x). A hint: where
 * the file system cannot preallocate (no support, no space), it does nothing and the writes
 * extend the file as usual. A smaller or equal `bytes` than an earlier call does nothing.
 * Call it before the first append. Returns 0; -EINVAL for a NULL w. */
int store_writer_reserve(store_writer *w, uint64_t bytes);

/* Logical bytes appended so far (the offset at which the next append lands); 0 for NULL. */
uint64_t store_writer_offset(const store_writer *w);

/* Write what is buffered, wait for every write, truncate to the logical size, fsync the
 * file (data and size) when do_fsync is non-zero, close and free the writer (also on error).
 * On error the (partial) file stays where it is; the caller removes it.
 * Errors: -EINVAL w NULL; the sticky error, or -errno of ftruncate/fsync/close. */
int store_writer_close(store_writer *w, int do_fsync);

/* Abandon a writer: wait for writes in flight, close and free it, unlink the file.
 * Accepts NULL. */
void store_writer_abort(store_writer *w);

typedef struct store_reader store_reader;

/* Flags of the functions that open a file for reading. */
#define STORE_NOFOLLOW 1u /* refuse a symbolic link as the last component (-ELOOP) */

/* Open `path` read-only, only when it is a regular file: a FIFO, socket or device is never
 * waited on (the open is non-blocking, then fstat decides) and gives -ENODEV, a directory
 * -EISDIR; with STORE_NOFOLLOW a symbolic link gives -ELOOP. oflags may add O_DIRECT (the
 * only flag accepted). Returns the descriptor (blocking mode, close-on-exec; the caller
 * closes it) with *st_out (may be NULL) from its fstat.
 * Errors: -EINVAL bad path, flags or oflags; -ENODEV, -EISDIR, -ELOOP (above); -ENOENT,
 * -ENOTDIR, -EACCES, -EMFILE, ... of open(2) (O_DIRECT refused: -EINVAL). */
struct stat;
int store_open_regular(const char *path, unsigned flags, int oflags, struct stat *st_out);

/* Open the regular file `path` read-only (O_DIRECT when allowed; as store_open_regular, so a
 * FIFO never blocks) with a ring of queue_depth entries (reads in flight; 0 = default 8,
 * range [1, 64]). flags: 0 or STORE_NOFOLLOW. *size_out (may be NULL) gets the file size in
 * bytes. Memory: in O_DIRECT mode up to about 4 MiB of bounce buffers, allocated on first
 * need and kept until close, whatever the request sizes.
 * Errors: -EINVAL out or path NULL, queue_depth > 64 or unknown flags; -ENODEV, -EISDIR,
 * -ELOOP not a regular file (store_open_regular); -ENOENT, -EACCES, -EMFILE, -ENOMEM, other
 * -errno of open(2) or io_uring_queue_init. */
int store_reader_open(store_reader **out, const char *path, unsigned queue_depth,
                      unsigned flags, uint64_t *size_out);

/* One range to read: file offset and length in bytes, destination (any alignment). */
typedef struct store_read_req {
    uint64_t offset;
    size_t len;
    void *dst;
} store_read_req;

/* Read n ranges, several in flight. Each request is filled completely or the call fails
 * (then the contents of every dst are unspecified). Ranges may overlap; zero-length ranges
 * are allowed (dst may then be NULL). Aligned ranges into aligned memory are read straight
 * into dst; the others go through the bounce buffers.
 * Errors: -EINVAL r NULL, reqs NULL with n > 0, dst NULL with len > 0, offset + len
 * overflows; -EBADMSG a range runs past the end of the file (short file); -EIO, -ENOMEM,
 * -ETIMEDOUT, other -errno. */
int store_reader_read(store_reader *r, const store_read_req *reqs, size_t n);

/* store_reader_read in two halves, so that the caller can work while the reads are in
 * flight (e.g. decode one chunk while the next one is read): submit starts reading the n
 * ranges and returns without waiting; wait waits for all of them and gives the result that
 * store_reader_read would have given. Until wait returns, reqs and every dst belong to the
 * reader (neither may be touched or freed), and no other read may start on r (one batch at
 * a time; use another reader of the same file for a second one). Pieces beyond the queue
 * depth are submitted as earlier ones complete, during wait. Fault injection counts the
 * submit as one store_reader_read call.
 * Errors of submit: -EINVAL (bad arguments as store_reader_read, or a batch already in
 * progress), -EIO (a reader stuck after a timeout, or injected); then no batch is in progress.
 * Errors of wait: -EINVAL no batch in progress; else those of store_reader_read. */
int store_reader_submit(store_reader *r, const store_read_req *reqs, size_t n);
int store_reader_wait(store_reader *r);

/* Close and free (waiting for a batch still in progress first); accepts NULL. */
void store_reader_close(store_reader *r);

/* Read a whole (small) regular file into a malloc'ed buffer with a terminating NUL;
 * *len_out (may be NULL) gets its size without the NUL; *buf_out is NULL on error. max_bytes
 * bounds the size (-EFBIG past it). flags: 0 or STORE_NOFOLLOW. The file is opened as
 * store_open_regular does, so a FIFO never blocks. The caller frees.
 * Errors: -ENOENT, -EFBIG, -ENODEV / -EISDIR / -ELOOP (not a regular file), -ENOMEM, other
 * -errno (-EACCES, -EMFILE, -EIO, ...). */
int store_read_file(const char *path, size_t max_bytes, unsigned flags, char **buf_out,
                    size_t *len_out);

/* The canonical absolute form of path into out (len bytes): the real path of its longest
 * existing prefix (links resolved, relative paths taken from the working folder), then the
 * rest with "." and ".." folded and repeated slashes dropped, so that two processes get the
 * same text for the same folder whether or not it exists yet (one of them may be creating
 * it). Thread-safe. Errors: -EINVAL path NULL or empty, -ENAMETOOLONG, -errno of getcwd or
 * realpath other than ENOENT and ENOTDIR (-EACCES, -ELOOP, ...). */
int store_canonical_path(const char *path, char *out, size_t len);

/* Create `path` with the given bytes, fsync it and close it (buffered I/O).
 * Errors: -EEXIST, -ENOSPC, -EIO, other -errno. A partial file is unlinked on error. */
int store_write_file_durable(const char *path, const void *buf, size_t len);

/* fsync a directory so that creations, renames and removals in it are durable.
 * Errors: -errno of open or fsync. */
int store_fsync_dir(const char *path);

/* rename(2) from -> to, then fsync the parent folder of `to` (and that of `from` when it
 * is a different path).
 * Errors: -errno of rename, or of store_fsync_dir. */
int store_rename_durable(const char *from, const char *to);

/* rename(2) from -> to that never replaces an existing `to` (a file, a link, an empty
 * folder): renameat2 RENAME_NOREPLACE, or, where the file system lacks the flag, a check
 * just before a plain rename (a race with another creator is then possible). Not durable by
 * itself. Errors: -EEXIST `to` exists; -errno of renameat2 or rename. */
int store_rename_noreplace(const char *from, const char *to);

/* Remove a folder and everything below it (no symlinks followed: a link is removed, not
 * its target); `path` may also name a file or a link. Missing is not an error. Goes on after
 * a failure and removes what it can. Not durable by itself: fsync the parent afterwards if
 * that matters.
 * Errors: -EINVAL path NULL or empty; -errno of the first failing stat/open/unlink/rmdir;
 * -ELOOP deeper than 128 levels. */
int store_remove_tree(const char *path);

/* 1 when CKPT_FAULT_DIR is set and this call's unlink of CKPT_FAULT_DIR/<name> succeeded (the
 * one-shot fault named `name` is armed and this process takes it), else 0. Thread-safe; reads
 * the variable once per process. */
int store_fault_armed(const char *name);

#endif /* STORAGE_H */
