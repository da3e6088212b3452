/* tb_events.h - TensorBoard event files: a writer of scalar summaries, for rank 0 of train.
 *
 * File format (what TensorBoard, torch.utils.tensorboard and tf.summary read and write):
 *
 *   a sequence of TFRecord records, each
 *     uint64  length of data, little-endian
 *     uint32  masked CRC-32C of those 8 length bytes, little-endian
 *     byte    data[length]: one serialized tensorboard.Event protobuf message
 *     uint32  masked CRC-32C of data, little-endian
 *   masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2^32)
 *
 * The messages (field numbers of TensorBoard's tensorboard/compat/proto/event.proto and
 * summary.proto; tests/tools/tensorboard/ holds the subset written here):
 *
 *   Event      { double wall_time = 1; int64 step = 2;
 *                oneof what { string file_version = 3; Summary summary = 5;
 *                             SessionLog session_log = 7; ... } }
 *   Summary    { repeated Value value = 1; }
 *   Value      { string tag = 1; oneof value { float simple_value = 2; ... } }
 *   SessionLog { SessionStatus status = 1; }      START = 1
 *
 * Field 6 of Event is the deprecated LogMessage, not SessionLog. The first record of every
 * file is Event{wall_time, file_version: "brain.Event:2"} (version 2 tells TensorBoard to use
 * SessionLog START events, not out-of-order steps, to detect restarts). Every scalar is its
 * own Event with one Value. Fields are written in field-number order; a step of 0 is left out
 * (proto3's default, as protobuf's own serializer does).
 *
 * File names: events.out.tfevents.<seconds>.<host>.<pid>.<n> in the folder, <seconds> the
 * wall-clock time of the open as 10 digits, <host> gethostname() with any byte outside
 * [A-Za-z0-9._-] replaced by '_', <pid> the process id, <n> how many files this process opened
 * before (0, 1, ...). TensorBoard reads only names that contain "tfevents", and reads the
 * files of a folder in name order, which decides which events a restart discards (report.h):
 * so when a file already there has a <seconds> at or after the present one, <seconds> is
 * that value + 1, and the new file sorts after every event file already in the folder.
 *
 * Why a hand encoder and not protobuf-c (which DESIGN section 8 names): the writer produces
 * three message shapes with six fields of four wire types (varint, 64-bit, 32-bit,
 * length-delimited). Encoding them takes about sixty lines here. protobuf-c would need
 * protoc-c at build time, a runtime library, and generated code from TensorBoard's .proto
 * files, whose imports (histogram, tensor, tensor_shape, resource_handle, types) would have
 * to be vendored or trimmed by hand anyway. The encoder is checked as strictly: the
 * integration test (tests/integration/test_tensorboard.py) decodes every record that train
 * writes with `protoc --decode=tensorboard.Event` against TensorBoard's own field numbers,
 * and with python3-protobuf, and checks the framing and both CRCs with python3-crc32c. The
 * unit test (tests/unit/test_train_tb.c) decodes the encodings with a decoder of its own.
 *
 * CRC-32C (Castagnoli, reflected polynomial 0x82f63b78): Debian 12 packages no C library for
 * it (`apt-cache search crc32c` lists python3-crc32c only), so this is a byte-wise table
 * implementation, checked against the test vectors of RFC 3720 appendix B.4 in the unit test
 * and against python3-crc32c in the integration test. Its speed does not matter here: a few
 * hundred bytes per training step.
 *
 * Failures: every function returns 0 or a negative errno and never exits. Writes go through
 * stdio to the file; train_tb_flush hands them to the kernel (no fsync: a SIGKILL loses
 * nothing flushed, a power loss may). The first failed write is logged once (a warning naming
 * the file and the reason); the writer then stops writing for good and every later call
 * returns that error without touching the file, so a full disk never stops training. A
 * write to a file system that hangs blocks the caller, as a write to stderr would.
 *
 * Thread-safety: a handle is used by one thread at a time. train_tb_crc32c,
 * train_tb_masked_crc32c and the train_tb_encode_* functions are thread-safe.
 */
#ifndef TRAIN_TB_EVENTS_H
#define TRAIN_TB_EVENTS_H

#include <stddef.h>
#include <stdint.h>

/* The file version string of the first record. */
#define TRAIN_TB_FILE_VERSION "brain.Event:2"
/* Longest tag in bytes (without the NUL). */
#define TRAIN_TB_TAG_MAX 255
/* Largest encoded Event of this module, in bytes (a scalar with a tag of TRAIN_TB_TAG_MAX). */
#define TRAIN_TB_EVENT_MAX 320
/* Bytes that framing adds to an Event: the length, its CRC and the data's CRC. */
#define TRAIN_TB_FRAME_OVERHEAD 16

typedef struct train_tb train_tb;

/* ------------------------------------------------------------------ CRC-32C */

/* CRC-32C of len bytes at data, continuing from crc (0 to start; the result of an earlier
 * call to continue a message given in pieces). data may be NULL when len is 0. */
uint32_t train_tb_crc32c(uint32_t crc, const void *data, size_t len);

/* The TFRecord mask of the CRC-32C of len bytes at data. */
uint32_t train_tb_masked_crc32c(const void *data, size_t len);

/* ------------------------------------------------------------------ encoding */

/* Each train_tb_encode_* writes one serialized Event into buf (cap bytes) and returns its
 * length in bytes; TRAIN_TB_EVENT_MAX bytes are always enough. wall_time: seconds since the
 * Unix epoch (any finite value). step: >= 0.
 * Errors: -EINVAL a NULL buf or tag, an empty tag or one longer than TRAIN_TB_TAG_MAX, a
 * negative step, a wall_time that is not finite; -ENOBUFS cap too small (nothing useful in
 * buf). */

/* Event{wall_time, file_version: TRAIN_TB_FILE_VERSION}. */
int train_tb_encode_file_version(uint8_t *buf, size_t cap, double wall_time);

/* Event{wall_time, step, session_log: {status: START}}. */
int train_tb_encode_session_start(uint8_t *buf, size_t cap, int64_t step, double wall_time);

/* Event{wall_time, step, summary: {value: [{tag, simple_value: value}]}}. value is stored as
 * a float (rounded to nearest; NaN and infinities are stored as they are). */
int train_tb_encode_scalar(uint8_t *buf, size_t cap, const char *tag, int64_t step,
                           float value, double wall_time);

/* One TFRecord of the len bytes at data into out (cap bytes): returns len +
 * TRAIN_TB_FRAME_OVERHEAD. Errors: -EINVAL NULL out (or NULL data with len > 0); -ENOBUFS
 * cap too small. */
int train_tb_frame(uint8_t *out, size_t cap, const void *data, size_t len);

/* ------------------------------------------------------------------ writer */

/* Seconds since the Unix epoch (CLOCK_REALTIME), for the wall_time arguments. */
double train_tb_wall_now(void);

/* Create a new event file in the folder dir (created with its parents when missing, mode 0777
 * less the umask) and write its first record, Event{file_version} at wall_time (seconds since
 * the epoch; train_tb_wall_now()). The name is chosen as described above; an existing file is
 * never opened or overwritten (O_EXCL). *out is set on success only; free with
 * train_tb_close. Not logged: the caller decides (it names dir).
 * Errors: -EINVAL NULL out or dir, an empty dir, a non-finite wall_time; -ENAMETOOLONG;
 * -ENOTDIR (dir or a parent is not a folder); -ENOMEM; -EEXIST (no free name after 100
 * tries); the errno of mkdir, open or the first write (-EACCES, -EROFS, -ENOSPC, -EDQUOT,
 * -EIO, ...); in which case no file is left behind when it could be removed. */
int train_tb_open(train_tb **out, const char *dir, double wall_time);

/* Append Event{step, session_log: START} (see train_report_restore in report.h for why).
 * Errors: -EINVAL NULL tb or a bad step or wall_time (nothing written, the writer goes on);
 * the writer's first write error (see Failures above). */
int train_tb_session_start(train_tb *tb, int64_t step, double wall_time);

/* Append the scalar `value` (rounded to float) of `tag` at `step` (TensorBoard's x axis)
 * and wall_time (seconds since the epoch). Buffered: train_tb_flush writes it out.
 * Errors: -EINVAL NULL tb, a bad tag, step or wall_time (nothing written, the writer goes
 * on); the writer's first write error (see Failures above). */
int train_tb_scalar(train_tb *tb, const char *tag, int64_t step, double value,
                    double wall_time);

/* Hand the buffered records to the kernel (fflush; no fsync). Errors: -EINVAL NULL tb; the
 * writer's first write error. */
int train_tb_flush(train_tb *tb);

/* The path of the event file (owned by tb, valid until train_tb_close). NULL for NULL. */
const char *train_tb_path(const train_tb *tb);

/* The writer's first write error (a negative errno), 0 while it writes. */
int train_tb_error(const train_tb *tb);

/* Flush, close and free; accepts NULL (returns 0). Returns 0, the writer's first write
 * error, or the error of the final flush or close (logged once, like a write error). */
int train_tb_close(train_tb *tb);

#endif /* TRAIN_TB_EVENTS_H */
