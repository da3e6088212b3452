/* shmseg.h - a shared-memory segment with two or three slots, for the memory tier (issue 13).
 *
 * A segment is one regular file (normally in /dev/shm) that holds a fixed-size header and
 * nslots (SHMSEG_MIN_SLOTS = 2 to SHMSEG_MAX_SLOTS = 3, chosen at shmseg_create) slots of
 * equal capacity. A writer fills one slot while another keeps the previous complete
 * payload, so a crash during a write (SIGKILL, OOM) never loses the last complete one. A
 * third slot is for a writer that must also leave one slot alone for a while (the trainer's
 * disk persist reads one in sync mode): its writes then alternate between the other two,
 * and a crash in one of them still leaves the newest complete step beside the one being
 * read. This module knows nothing about what a slot holds (ckpt/ckpt_mem.h
 * defines the payload of the checkpoint engine); it owns the layout, the state words and the
 * file's safety checks. Used by the trainer (through ckpt/) and by the agent (elastic/).
 *
 * Layout (little-endian, every offset and size a multiple of 4096; docs/FORMAT.md, "Memory
 * tier", is the normative copy):
 *
 *   offset 0     segment header, 4096 bytes:
 *                  magic "CKPTSEG1" (8) | version u32 = 1 | header_bytes u32 = 4096 |
 *                  slot_bytes u64 (capacity of each slot, a multiple of 4096) |
 *                  nslots u32 (2 or 3) | pad u32 | zero to 4096.
 *                The fields are checked for sanity on open (no checksum: they are written
 *                once, before the magic, which is stored last).
 *   offset 4096 + i*(4096 + slot_bytes)          slot i's header, 4096 bytes:
 *                  state u32 (0 empty, 1 writing, 2 complete) | pad u32 |
 *                  seq u64 (see below) | payload_bytes u64 | payload_xxh3 u64 (XXH3-64 of
 *                  the payload's first min(payload_bytes, 4096) bytes) | step u64 (a copy
 *                  from the payload, for listing without parsing) | zero to 4096.
 *   offset 4096 + i*(4096 + slot_bytes) + 4096   slot i's payload, slot_bytes bytes.
 *   file size    4096 + nslots*(4096 + slot_bytes).
 *
 * Consistency: state is written last with a release store and read with an acquire load
 * (a seqlock): shmseg_begin stores state = writing before any payload byte changes,
 * shmseg_commit writes seq, payload_bytes, payload_xxh3 and step, then state = complete.
 * seq is 1 + the largest seq of the segment's slots at commit: of two complete slots the
 * newer has the larger seq; it changes on every commit of the slot, so a reader that sees
 * the same (state complete, seq) before and after copying bytes got an untorn copy
 * (shmseg_copy_out). A slot left writing by a crash is never reported as complete; the next
 * shmseg_begin may pick it.
 *
 * Safety: files are created mode 0600 with O_NOFOLLOW|O_CLOEXEC; a path that is a symbolic
 * link, not a regular file, or owned by another uid is refused (-EPERM) before it is mapped.
 *
 * Thread-safety and processes: one writer per segment at a time (the worker for its own
 * segment, the agent's receiver for a replica), enforced: shmseg_create holds an exclusive
 * flock on the file for the handle's life (a second create of the same file, from any
 * process or from this one, gets -EBUSY until shmseg_close); shmseg_open takes no lock, for
 * readers (a writable shmseg_open is the caller's promise that no one else writes). Any
 * number of readers in any process. A
 * handle is not safe for concurrent begin/commit from two threads; slot_info, newest,
 * payload and copy_out may be called from any thread while one thread writes.
 */
#ifndef COMMON_SHMSEG_H
#define COMMON_SHMSEG_H

#include <stddef.h>
#include <stdint.h>

#define SHMSEG_MIN_SLOTS 2
#define SHMSEG_MAX_SLOTS 3
/* Slots of a replica segment (the copy of a peer node's rank segment that elastic's agent
 * keeps, elastic/agent_mem.c): the agent writes it only from a complete slot of the sender and
 * nothing reads it for long, so two keep the previous replica while one is received. train's
 * memory-tier budget (train/train_mem.c) counts replicas with this same figure. */
#define SHMSEG_REPLICA_SLOTS SHMSEG_MIN_SLOTS
#define SHMSEG_PAGE 4096u
#define SHMSEG_VERSION 1u

/* Slot states (the u32 state word). */
enum shmseg_state { SHMSEG_EMPTY = 0, SHMSEG_WRITING = 1, SHMSEG_COMPLETE = 2 };

typedef struct shmseg shmseg;

/* One consistent reading of a slot header (shmseg_slot_info). */
typedef struct shmseg_info {
    uint32_t state;         /* enum shmseg_state; any other value is reported as is */
    uint64_t seq;           /* commit sequence number (0 = never committed) */
    uint64_t payload_bytes; /* bytes of the payload written by the last commit */
    uint64_t payload_xxh3;  /* XXH3-64 of the payload's first min(payload_bytes, 4096) */
    uint64_t step;          /* the step the committer passed */
} shmseg_info;

/* Total file size in bytes of a segment of nslots slots of slot_bytes each, or 0 when nslots
 * is outside [SHMSEG_MIN_SLOTS, SHMSEG_MAX_SLOTS], slot_bytes is 0 or not a multiple of
 * 4096, or the size would overflow. */
uint64_t shmseg_file_bytes(int nslots, uint64_t slot_bytes);

/* Open or create the segment at path for writing and map it (MAP_SHARED).
 * - The file is opened O_RDWR|O_CREAT|O_NOFOLLOW|O_CLOEXEC with mode 0600 (an existing
 *   file of this uid is chmod'ed to 0600).
 * - An existing segment with a valid header, the same nslots and the same slot_bytes keeps
 *   its slots (a restarted worker with the same layout finds its previous snapshots).
 * - A new or empty file is sized in place to shmseg_file_bytes(nslots, slot_bytes) (zero
 *   pages: every slot empty) with the pages reserved (posix_fallocate), and the header's magic is
 *   stored last.
 * - Any other content (other nslots or slot_bytes, garbage) is replaced: the new layout is built in
 *   "<path>.new-XXXXXX" (0600) and renamed over path; a valid old layout first gets all its
 *   slots marked empty and its magic cleared, so a process that still maps the old file
 *   sees empty slots (never a SIGBUS, never stale bytes as complete).
 * The mapping is populated (MAP_POPULATE): the call costs about what touching every page
 * costs, so the first write into a slot runs as fast as later ones.
 * The file is locked (flock LOCK_EX|LOCK_NB, advisory: only shmseg_create takes it) until
 * shmseg_close: a second writer of the same path gets -EBUSY and nothing is changed.
 * nslots: SHMSEG_MIN_SLOTS (2) or SHMSEG_MAX_SLOTS (3).
 * slot_bytes: capacity of each slot in bytes, > 0 and a multiple of 4096.
 * *out gets the handle (close with shmseg_close); NULL on failure.
 * Returns 0, or -EINVAL (NULL argument, bad nslots or slot_bytes), -EPERM (path is a symbolic link,
 * a directory or another non-regular file, or owned by another uid), -EBUSY (another handle
 * from shmseg_create, in this or another process, holds the file), -ENOSPC / -ENOMEM
 * (ftruncate or mmap refused: the tmpfs is full), or another -errno of
 * open/fstat/flock/ftruncate/mmap. */
int shmseg_create(const char *path, int nslots, uint64_t slot_bytes, shmseg **out);

/* Map an existing segment: writable != 0 maps it read-write (for shmseg_begin/commit),
 * 0 read-only. The same file checks as shmseg_create (O_NOFOLLOW, regular, own uid), then
 * the header: magic, version 1, header_bytes 4096, nslots 2 or 3, slot_bytes a non-zero
 * multiple of 4096, and the file size equal to shmseg_file_bytes(nslots, slot_bytes).
 * Returns 0, or -EINVAL (NULL argument), -ENOENT (no such file), -EPERM (link, not regular,
 * other uid), -EBADMSG (bad magic, header fields or size: not a segment, or one being
 * rebuilt), -EPROTONOSUPPORT (a newer version), or another -errno of open/mmap. */
int shmseg_open(const char *path, int writable, shmseg **out);

/* Unmap and close (releasing shmseg_create's lock); NULL is accepted. The file stays (the
 * agent unlinks it). */
void shmseg_close(shmseg *seg);

/* Capacity of each slot in bytes (what shmseg_create was given). */
uint64_t shmseg_slot_bytes(const shmseg *seg);

/* Number of slots (2 or 3: the header's nslots); 0 for NULL. Slots are numbered from 0. */
int shmseg_nslots(const shmseg *seg);

/* Non-zero when the handle was mapped writable. */
int shmseg_writable(const shmseg *seg);

/* The path the handle was opened with (owned by the handle). */
const char *shmseg_path(const shmseg *seg);

/* Pointer to slot i's payload (slot_bytes bytes, 4096-aligned), or NULL when i is out of
 * range. Writable only when the handle is. The pointer lives until shmseg_close. */
void *shmseg_payload(shmseg *seg, int slot);

/* Fill the page tables of slot i's payload (its first `bytes` bytes, all when bytes is 0
 * or larger than slot_bytes) now, in one batch (madvise MADV_POPULATE_READ, or _WRITE on a
 * writable handle), so that a reader that then copies the whole slot (a restore) does not
 * take a page fault per page. Reads no data; the slot may change meanwhile.
 * Returns 0, or -EINVAL (NULL, slot out of range), -EOPNOTSUPP (a kernel before 5.14: the
 * pages are faulted in by the copy instead), or madvise's -errno (-ENOMEM, -EFAULT). */
int shmseg_prefault(shmseg *seg, int slot, uint64_t bytes);

/* A consistent reading of slot i's header: state is loaded with acquire before and after
 * the other fields, retried until both agree (bounded; -EAGAIN when a writer keeps
 * changing it). Returns 0, or -EINVAL (NULL, i out of range), -EAGAIN. */
int shmseg_slot_info(const shmseg *seg, int slot, shmseg_info *info);

/* The complete slot with the largest seq into *slot. Returns 0, -ENOENT when no slot is
 * complete, -EINVAL, or -EAGAIN (as shmseg_slot_info). */
int shmseg_newest(const shmseg *seg, int *slot);

/* Choose the slot to write and mark it writing (release store), before any payload byte is
 * touched. avoid: a slot that must not be written (the one a disk persist is still reading
 * from), or -1 for none. The slot taken is neither avoid nor the newest complete one; among
 * the others, one that is not complete (empty, or torn by a crash) comes first, else the
 * one with the smallest seq; ties go to the lowest index (slot 0 of a new segment). The
 * one exception: with two slots, when avoid is one and the other is the newest complete,
 * the other is taken all the same (the avoided one then stays complete, but a crash during
 * this write leaves only it: what the third slot is for). *slot gets the index.
 * Returns 0, or -EINVAL (NULL, avoid outside -1..nslots-1), -EBADF (read-only handle),
 * -EAGAIN (as shmseg_slot_info). */
int shmseg_begin(shmseg *seg, int avoid, int *slot);

/* Finish a write begun with shmseg_begin: seq = 1 + the largest seq of the slots,
 * payload_bytes, step and payload_xxh3 (computed here over the payload's first
 * min(payload_bytes, 4096) bytes) are written, then state = complete (release).
 * payload_bytes: bytes written, <= slot_bytes. step: copied into the slot header.
 * Returns 0, or -EINVAL (NULL, slot out of range, payload_bytes > slot_bytes, the slot is
 * not in state writing), -EBADF (read-only handle). */
int shmseg_commit(shmseg *seg, int slot, uint64_t payload_bytes, uint64_t step);

/* Non-zero when slot i's first min(payload_bytes, 4096) payload bytes hash to the
 * payload_xxh3 in info (info from shmseg_slot_info of the same slot). Reads the payload:
 * a concurrent writer can make it fail (check the seq again, as copy_out does). */
int shmseg_head_ok(const shmseg *seg, int slot, const shmseg_info *info);

/* Copy len bytes at offset off of complete slot i's payload into dst and check that the
 * slot did not change meanwhile (state and seq loaded with acquire before, and after an
 * acquire fence). *seq_inout: 0 = any seq; otherwise the seq the slot must still have (to
 * copy one payload in several pieces); on success it gets the slot's seq.
 * Returns 0, or -EINVAL (NULL, slot out of range, off + len beyond payload_bytes),
 * -ENOENT (the slot is not complete), -EAGAIN (torn: the slot's state or seq changed during
 * the copy, or seq is not *seq_inout; dst holds garbage - try again later). */
int shmseg_copy_out(const shmseg *seg, int slot, void *dst, uint64_t off, uint64_t len,
                    uint64_t *seq_inout);

/* Names of the memory tier's segments under a path prefix P (memtier-design.md; the prefix
 * is CKPT_MEM_PATH, e.g. "/dev/shm/ckptmem-<jobhash16>-<rand16>"):
 *   shmseg_own_path:  "P.own-<local_rank>"          (written by that worker)
 *   shmseg_rep_path:  "P.rep-<agent16>-<local_rank>" (a peer's replica, written by the agent)
 * into out (len bytes with the NUL); local_rank in decimal (no sign, no padding), agent16 the
 * sending agent's id in 16 lowercase hex digits (the random part of its own prefix: it stays
 * the same for the agent's life, whereas node ranks change between rounds, so one agent's
 * replica is never overwritten by another that took its old node rank). Return 0, or -EINVAL
 * (NULL), -ENAMETOOLONG (does not fit). ckpt_mem_list reads these names. Thread-safe. */
int shmseg_own_path(char *out, size_t len, const char *prefix, unsigned local_rank);
int shmseg_rep_path(char *out, size_t len, const char *prefix, uint64_t agent, unsigned local_rank);

#endif /* COMMON_SHMSEG_H */
