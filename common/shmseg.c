/* shmseg.c - the shared-memory segment of two or three slots (shmseg.h). */
#include "shmseg.h"

#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shmseg: the segment layout is little-endian and mapped as is"
#endif

static const char seg_magic[8] = {'C', 'K', 'P', 'T', 'S', 'E', 'G', '1'};

/* The fields of the 4096-byte segment header; the rest of the page is zero. */
struct seg_hdr {
    uint64_t magic; /* "CKPTSEG1", stored last */
    uint32_t version;
    uint32_t header_bytes;
    uint64_t slot_bytes;
    uint32_t nslots;
    uint32_t pad;
};

/* The fields of a 4096-byte slot header. Every field is accessed with __atomic builtins:
 * other processes read them while this one writes. */
struct slot_hdr {
    uint32_t state;
    uint32_t pad;
    uint64_t seq;
    uint64_t payload_bytes;
    uint64_t payload_xxh3;
    uint64_t step;
};

struct shmseg {
    unsigned char *base;
    uint64_t size;
    uint64_t slot_bytes;
    int nslots;  /* SHMSEG_MIN_SLOTS..SHMSEG_MAX_SLOTS, from the header */
    int writable;
    int lock_fd; /* shmseg_create: the file, flock'ed LOCK_EX for the handle's life; else -1 */
    char *path;
};

uint64_t shmseg_file_bytes(int nslots, uint64_t slot_bytes)
{
    if (nslots < SHMSEG_MIN_SLOTS || nslots > SHMSEG_MAX_SLOTS) return 0;
    if (slot_bytes == 0 || slot_bytes % SHMSEG_PAGE) return 0;
    if (slot_bytes > (UINT64_MAX / 4 - 3 * SHMSEG_PAGE)) return 0;
    return SHMSEG_PAGE + (uint64_t)nslots * (SHMSEG_PAGE + slot_bytes);
}

static uint64_t magic_u64(void)
{
    uint64_t m;
    memcpy(&m, seg_magic, 8);
    return m;
}

static struct slot_hdr *slot_hdr(const shmseg *seg, int i)
{
    return (struct slot_hdr *)(seg->base + SHMSEG_PAGE + (uint64_t)i * (SHMSEG_PAGE + seg->slot_bytes));
}

/* 0 when h is a version-1 header; -EPROTONOSUPPORT newer; -EBADMSG otherwise. */
static int hdr_check(const struct seg_hdr *h)
{
    if (h->magic != magic_u64()) return -EBADMSG;
    if (h->version > SHMSEG_VERSION) return -EPROTONOSUPPORT;
    if (h->version != SHMSEG_VERSION || h->header_bytes != SHMSEG_PAGE) return -EBADMSG;
    if (shmseg_file_bytes((int)h->nslots, h->slot_bytes) == 0) return -EBADMSG; /* checks nslots */
    return 0;
}

/* Open with the safety checks of the header: O_NOFOLLOW, regular file, own uid. */
static int open_checked(const char *path, int flags, struct stat *st)
{
    int fd = open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        /* O_NOFOLLOW on a final symbolic link gives ELOOP; opening a FIFO or socket may
         * give ENXIO/EOPNOTSUPP: all "not a file we may use". */
        if (e == ELOOP || e == ENXIO || e == EOPNOTSUPP || e == EISDIR) return -EPERM;
        return -e;
    }
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    if (!S_ISREG(st->st_mode) || st->st_uid != geteuid()) {
        close(fd);
        return -EPERM;
    }
    return fd;
}

static shmseg *handle_new(const char *path, unsigned char *base, uint64_t size, int nslots,
                          uint64_t slot_bytes, int writable)
{
    shmseg *seg = calloc(1, sizeof *seg);
    char *p = strdup(path);
    if (!seg || !p) {
        free(seg);
        free(p);
        return NULL;
    }
    seg->base = base;
    seg->size = size;
    seg->slot_bytes = slot_bytes;
    seg->nslots = nslots;
    seg->writable = writable;
    seg->lock_fd = -1;
    seg->path = p;
    return seg;
}

/* Mark every slot of an old valid layout empty and clear its magic, so that a reader that
 * still has it mapped never takes a slot of a segment being replaced. */
static void retire_old(int fd, const struct seg_hdr *old)
{
    uint64_t old_size = shmseg_file_bytes((int)old->nslots, old->slot_bytes);
    unsigned char *ob = mmap(NULL, old_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ob == MAP_FAILED) return;
    for (uint32_t i = 0; i < old->nslots; i++) {
        struct slot_hdr *sh = (struct slot_hdr *)(ob + SHMSEG_PAGE + (uint64_t)i * (SHMSEG_PAGE + old->slot_bytes));
        __atomic_store_n(&sh->state, (uint32_t)SHMSEG_EMPTY, __ATOMIC_RELEASE);
    }
    __atomic_store_n((uint64_t *)ob, (uint64_t)0, __ATOMIC_RELEASE);
    munmap(ob, old_size);
}

/* Size fd to `want` zero bytes with the pages reserved. */
static int size_file(int fd, uint64_t want)
{
    if (ftruncate(fd, 0) != 0 || ftruncate(fd, (off_t)want) != 0) return -errno;
    /* Reserve the pages now: on a full tmpfs a store into a mapped hole is SIGBUS, an error
     * here is -ENOSPC. File systems without fallocate keep the sparse file. */
    int fe = posix_fallocate(fd, 0, (off_t)want);
    if (fe != 0 && fe != EOPNOTSUPP && fe != EINVAL) return -fe;
    return 0;
}

int shmseg_create(const char *path, int nslots, uint64_t slot_bytes, shmseg **out)
{
    if (out) *out = NULL;
    if (!path || !out) return -EINVAL;
    uint64_t want = shmseg_file_bytes(nslots, slot_bytes);
    if (want == 0 || want > (uint64_t)INT64_MAX) return -EINVAL;

    struct stat st;
    int fd = open_checked(path, O_RDWR | O_CREAT, &st);
    if (fd < 0) return fd;
    int rc = 0, keep = 0;
    unsigned char *base = MAP_FAILED;
    char *tmp = NULL;
    /* one writer per segment: a second process with the same CKPT_MEM_PATH and LOCAL_RANK
     * would interleave its slots with ours unnoticed */
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
        goto out;
    }
    struct stat now;
    if (stat(path, &now) != 0 || now.st_ino != st.st_ino || now.st_dev != st.st_dev) {
        /* we locked a file that a writer's rebuild has just renamed away: that writer holds
         * the one at path */
        rc = -EBUSY;
        goto out;
    }
    if ((st.st_mode & 07777) != 0600 && fchmod(fd, 0600) != 0) {
        rc = -errno;
        goto out;
    }
    struct seg_hdr old;
    int old_ok = (uint64_t)st.st_size >= SHMSEG_PAGE && pread(fd, &old, sizeof old, 0) == (ssize_t)sizeof old &&
                 hdr_check(&old) == 0 && (uint64_t)st.st_size == shmseg_file_bytes((int)old.nslots, old.slot_bytes);
    if (old_ok && old.slot_bytes == slot_bytes && old.nslots == (uint32_t)nslots) {
        keep = 1;
    } else if (st.st_size == 0) {
        /* A new (or empty) file: nobody can have a layout mapped, build it in place. */
        rc = size_file(fd, want);
        if (rc) goto out;
    } else {
        /* Another layout: build the new one in a fresh file and rename it over the path, so
         * a process that still maps the old file keeps valid memory (empty slots) instead of
         * SIGBUS from a truncated mapping. */
        size_t n = strlen(path) + 16;
        tmp = malloc(n);
        if (!tmp) {
            rc = -ENOMEM;
            goto out;
        }
        snprintf(tmp, n, "%s.new-XXXXXX", path);
        int nfd = mkostemp(tmp, O_CLOEXEC);
        if (nfd < 0) {
            rc = -errno;
            free(tmp);
            tmp = NULL;
            goto out;
        }
        rc = fchmod(nfd, 0600) != 0 || flock(nfd, LOCK_EX | LOCK_NB) != 0 ? -errno : size_file(nfd, want);
        if (rc) {
            close(nfd);
            goto out;
        }
        if (old_ok) retire_old(fd, &old);
        close(fd);
        fd = nfd;
    }

    /* MAP_POPULATE: the writer's page tables are filled here, once, and not by faults during
     * the first copy into each slot (measured: the first write of a 256 MiB slot ran at a
     * quarter of the speed of later ones) */
    base = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) {
        rc = -errno;
        goto out;
    }
    if (!keep) {
        struct seg_hdr *h = (struct seg_hdr *)base;
        h->version = SHMSEG_VERSION;
        h->header_bytes = SHMSEG_PAGE;
        h->slot_bytes = slot_bytes;
        h->nslots = (uint32_t)nslots;
        __atomic_store_n(&h->magic, magic_u64(), __ATOMIC_RELEASE);
    }
    if (tmp && rename(tmp, path) != 0) {
        rc = -errno;
        goto out;
    }
    *out = handle_new(path, base, want, nslots, slot_bytes, 1);
    if (!*out) rc = -ENOMEM;
    else (*out)->lock_fd = fd; /* the lock lives as long as the handle */
out:
    if (rc && base != MAP_FAILED) munmap(base, want);
    if (rc && tmp) unlink(tmp);
    free(tmp);
    if (rc) close(fd);
    return rc;
}

int shmseg_open(const char *path, int writable, shmseg **out)
{
    if (out) *out = NULL;
    if (!path || !out) return -EINVAL;
    struct stat st;
    int fd = open_checked(path, writable ? O_RDWR : O_RDONLY, &st);
    if (fd < 0) return fd;
    int rc = 0;
    struct seg_hdr h;
    if ((uint64_t)st.st_size < SHMSEG_PAGE || pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
        rc = -EBADMSG;
        goto out;
    }
    rc = hdr_check(&h);
    if (rc) goto out;
    uint64_t size = shmseg_file_bytes((int)h.nslots, h.slot_bytes);
    if ((uint64_t)st.st_size != size) {
        rc = -EBADMSG;
        goto out;
    }
    unsigned char *base = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        rc = -errno;
        goto out;
    }
    /* The header again through the mapping: a rebuild between pread and mmap changes it. */
    struct seg_hdr h2;
    memcpy(&h2, base, sizeof h2);
    if (hdr_check(&h2) != 0 || h2.slot_bytes != h.slot_bytes || h2.nslots != h.nslots) {
        munmap(base, size);
        rc = -EBADMSG;
        goto out;
    }
    *out = handle_new(path, base, size, (int)h.nslots, h.slot_bytes, writable != 0);
    if (!*out) {
        munmap(base, size);
        rc = -ENOMEM;
    }
out:
    close(fd);
    return rc;
}

void shmseg_close(shmseg *seg)
{
    if (!seg) return;
    munmap(seg->base, seg->size);
    if (seg->lock_fd >= 0) close(seg->lock_fd);
    free(seg->path);
    free(seg);
}

uint64_t shmseg_slot_bytes(const shmseg *seg)
{
    return seg ? seg->slot_bytes : 0;
}

int shmseg_nslots(const shmseg *seg)
{
    return seg ? seg->nslots : 0;
}

int shmseg_writable(const shmseg *seg)
{
    return seg && seg->writable;
}

const char *shmseg_path(const shmseg *seg)
{
    return seg ? seg->path : NULL;
}

void *shmseg_payload(shmseg *seg, int slot)
{
    if (!seg || slot < 0 || slot >= seg->nslots) return NULL;
    return (unsigned char *)slot_hdr(seg, slot) + SHMSEG_PAGE;
}

int shmseg_slot_info(const shmseg *seg, int slot, shmseg_info *info)
{
    if (!seg || !info || slot < 0 || slot >= seg->nslots) return -EINVAL;
    const struct slot_hdr *sh = slot_hdr(seg, slot);
    for (int tries = 0; tries < 10000; tries++) {
        uint32_t s1 = __atomic_load_n(&sh->state, __ATOMIC_ACQUIRE);
        shmseg_info v = {
            .state = s1,
            .seq = __atomic_load_n(&sh->seq, __ATOMIC_RELAXED),
            .payload_bytes = __atomic_load_n(&sh->payload_bytes, __ATOMIC_RELAXED),
            .payload_xxh3 = __atomic_load_n(&sh->payload_xxh3, __ATOMIC_RELAXED),
            .step = __atomic_load_n(&sh->step, __ATOMIC_RELAXED),
        };
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint32_t s2 = __atomic_load_n(&sh->state, __ATOMIC_RELAXED);
        uint64_t q2 = __atomic_load_n(&sh->seq, __ATOMIC_RELAXED);
        if (s1 == s2 && v.seq == q2) {
            *info = v;
            return 0;
        }
    }
    return -EAGAIN;
}

int shmseg_newest(const shmseg *seg, int *slot)
{
    if (!seg || !slot) return -EINVAL;
    int best = -1;
    uint64_t best_seq = 0;
    for (int i = 0; i < seg->nslots; i++) {
        shmseg_info in;
        int rc = shmseg_slot_info(seg, i, &in);
        if (rc) return rc;
        if (in.state == SHMSEG_COMPLETE && (best < 0 || in.seq > best_seq)) {
            best = i;
            best_seq = in.seq;
        }
    }
    if (best < 0) return -ENOENT;
    *slot = best;
    return 0;
}

/* The slot that shmseg_begin writes: never `avoid` nor the newest complete slot (it stays
 * the reader's fallback while this one is torn), and of the others the one least worth
 * keeping: not complete (empty, torn, unknown state) before complete, then the smallest seq.
 * With two slots and an `avoid` that leaves nothing, the slot that is not `avoid`. */
static int pick_slot(const shmseg *seg, int avoid, int *slot)
{
    int newest = -1, rc = shmseg_newest(seg, &newest);
    if (rc && rc != -ENOENT) return rc;
    int best = -1, best_complete = 0;
    uint64_t best_seq = 0;
    for (int i = 0; i < seg->nslots; i++) {
        if (i == avoid || i == newest) continue;
        shmseg_info in;
        if ((rc = shmseg_slot_info(seg, i, &in)) < 0) return rc;
        int complete = in.state == SHMSEG_COMPLETE;
        if (best < 0 || (best_complete && !complete) ||
            (best_complete == complete && complete && in.seq < best_seq)) {
            best = i;
            best_complete = complete;
            best_seq = in.seq;
        }
    }
    if (best < 0) best = avoid == 0 ? 1 : 0; /* two slots, avoid and newest differ */
    *slot = best;
    return 0;
}

int shmseg_begin(shmseg *seg, int avoid, int *slot)
{
    if (!seg || !slot || avoid < -1 || avoid >= seg->nslots) return -EINVAL;
    if (!seg->writable) return -EBADF;
    int i, rc = pick_slot(seg, avoid, &i);
    if (rc) return rc;
    struct slot_hdr *sh = slot_hdr(seg, i);
    __atomic_store_n(&sh->state, (uint32_t)SHMSEG_WRITING, __ATOMIC_RELEASE);
    /* No payload store may become visible before the state word says writing. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    *slot = i;
    return 0;
}

static uint64_t head_hash(const shmseg *seg, int slot, uint64_t payload_bytes)
{
    const unsigned char *p = (const unsigned char *)slot_hdr(seg, slot) + SHMSEG_PAGE;
    return XXH3_64bits(p, payload_bytes < SHMSEG_PAGE ? payload_bytes : SHMSEG_PAGE);
}

int shmseg_commit(shmseg *seg, int slot, uint64_t payload_bytes, uint64_t step)
{
    if (!seg || slot < 0 || slot >= seg->nslots || payload_bytes > seg->slot_bytes) return -EINVAL;
    if (!seg->writable) return -EBADF;
    struct slot_hdr *sh = slot_hdr(seg, slot);
    if (__atomic_load_n(&sh->state, __ATOMIC_ACQUIRE) != SHMSEG_WRITING) return -EINVAL;
    uint64_t max = 0;
    for (int i = 0; i < seg->nslots; i++) {
        uint64_t q = __atomic_load_n(&slot_hdr(seg, i)->seq, __ATOMIC_RELAXED);
        if (q > max) max = q;
    }
    __atomic_store_n(&sh->seq, max + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&sh->payload_bytes, payload_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&sh->payload_xxh3, head_hash(seg, slot, payload_bytes), __ATOMIC_RELAXED);
    __atomic_store_n(&sh->step, step, __ATOMIC_RELAXED);
    __atomic_store_n(&sh->state, (uint32_t)SHMSEG_COMPLETE, __ATOMIC_RELEASE);
    return 0;
}

int shmseg_head_ok(const shmseg *seg, int slot, const shmseg_info *info)
{
    if (!seg || !info || slot < 0 || slot >= seg->nslots || info->payload_bytes > seg->slot_bytes) return 0;
    return head_hash(seg, slot, info->payload_bytes) == info->payload_xxh3;
}

int shmseg_copy_out(const shmseg *seg, int slot, void *dst, uint64_t off, uint64_t len, uint64_t *seq_inout)
{
    if (!seg || (!dst && len) || !seq_inout || slot < 0 || slot >= seg->nslots) return -EINVAL;
    shmseg_info a;
    int rc = shmseg_slot_info(seg, slot, &a);
    if (rc) return rc;
    if (a.state != SHMSEG_COMPLETE) return -ENOENT;
    if (*seq_inout && a.seq != *seq_inout) return -EAGAIN;
    if (off > a.payload_bytes || len > a.payload_bytes - off) return -EINVAL;
    if (len) memcpy(dst, (const unsigned char *)slot_hdr(seg, slot) + SHMSEG_PAGE + off, len);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    const struct slot_hdr *sh = slot_hdr(seg, slot);
    if (__atomic_load_n(&sh->state, __ATOMIC_RELAXED) != SHMSEG_COMPLETE ||
        __atomic_load_n(&sh->seq, __ATOMIC_RELAXED) != a.seq)
        return -EAGAIN;
    *seq_inout = a.seq;
    return 0;
}

int shmseg_own_path(char *out, size_t len, const char *prefix, unsigned local_rank)
{
    if (!out || !prefix) return -EINVAL;
    int n = snprintf(out, len, "%s.own-%u", prefix, local_rank);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

int shmseg_rep_path(char *out, size_t len, const char *prefix, uint64_t agent, unsigned local_rank)
{
    if (!out || !prefix) return -EINVAL;
    int n = snprintf(out, len, "%s.rep-%016" PRIx64 "-%u", prefix, agent, local_rank);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

int shmseg_prefault(shmseg *seg, int slot, uint64_t bytes)
{
    if (!seg || slot < 0 || slot >= seg->nslots) return -EINVAL;
    if (bytes == 0 || bytes > seg->slot_bytes) bytes = seg->slot_bytes;
#ifdef MADV_POPULATE_READ
    bytes = (bytes + SHMSEG_PAGE - 1) / SHMSEG_PAGE * SHMSEG_PAGE;
    if (madvise(shmseg_payload(seg, slot), bytes, seg->writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) != 0)
        return errno == EINVAL ? -EOPNOTSUPP : -errno;
    return 0;
#else
    (void)bytes;
    return -EOPNOTSUPP;
#endif
}
