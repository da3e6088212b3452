/* The memory tier: memory snapshots in shared-memory slots, their listing, a snapshot
 * handle over them, and the flush to disk (ckpt_mem.h). */
#include "ckpt_mem.h"
#include "ckpt_internal.h"
#include "ckpt_snap.h"
#include "log.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <xxhash.h>

#define TAG "ckpt"

/* Payload header offsets (ckpt_mem.h, docs/FORMAT.md "Memory tier"). */
enum {
    H_MAGIC = 0, H_VERSION = 8, H_NBUFS = 12, H_STEP = 16, H_WORLD = 24, H_RANK = 28,
    H_CREATED = 32, H_CHUNK = 40, H_RUN = 48, H_CFG = 112, H_TAG = 176, H_TRAINER_OFF = 240,
    H_TRAINER_LEN = 248, H_SUMS_OFF = 256, H_NSUMS = 264, H_TRAINER_XXH = 272, H_BUFS = 280,
    B_SIZE = 120, H_SUM = H_BUFS + 16 * B_SIZE, /* 2200 */
    B_NAME = 0, B_DTYPE = 64, B_ELEM = 80, B_TOTAL = 88, B_OFFSET = 96, B_BYTES = 104,
    B_DATA_OFF = 112
};
static const char mem_magic[8] = {'C', 'K', 'P', 'T', 'M', 'E', 'M', '1'};

#define PIECE (256u << 10) /* copy-and-hash granularity: stays in L2 between copy and hash */

typedef struct mbuf {
    char name[64], dtype[16];
    uint32_t elem_bytes;
    uint64_t total, offset, bytes, data_off;
} mbuf;

/* A parsed, checked payload header. */
typedef struct mhdr {
    uint32_t nbufs, world, rank;
    uint64_t step, chunk_bytes, trainer_off, trainer_len, sums_off, nsums, trainer_xxh;
    int64_t created;
    char run_id[64], config_hash[64], tag[64];
    mbuf b[CKPT_MEM_MAX_BUFFERS];
} mhdr;

static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static uint64_t nchunks_of(uint64_t bytes, uint64_t cb) { return bytes ? (bytes - 1) / cb + 1 : 0; }

/* A NUL-terminated name of at most cap - 1 bytes in a fixed field, valid per ckpt_valid_name. */
static int get_name(const uint8_t *p, size_t cap, char *out)
{
    if (!memchr(p, '\0', cap)) return -1;
    memcpy(out, p, cap);
    return ckpt_valid_name(out) ? 0 : -1;
}

/* Offsets of the payload's parts for these shard sizes; -EINVAL on overflow. */
static int layout(const uint64_t *bytes, size_t nbufs, uint64_t trainer_len, uint64_t cb,
                  uint64_t *data_off, uint64_t *trainer_off, uint64_t *sums_off, uint64_t *nsums,
                  uint64_t *payload_bytes)
{
    uint64_t pos = CKPT_MEM_HEADER_BYTES, n = 0;
    const uint64_t lim = UINT64_MAX / 4;
    for (size_t i = 0; i < nbufs; i++) {
        if (bytes[i] > lim || pos > lim - bytes[i]) return -EINVAL;
        if (data_off) data_off[i] = pos;
        pos = round_up(pos + bytes[i], 4096);
        n += nchunks_of(bytes[i], cb);
    }
    if (trainer_len > lim || pos > lim - trainer_len) return -EINVAL;
    if (trainer_off) *trainer_off = pos;
    pos = round_up(pos + trainer_len, 8);
    if (n > lim / 8 || pos > lim - 8 * n) return -EINVAL;
    if (sums_off) *sums_off = pos;
    if (nsums) *nsums = n;
    *payload_bytes = pos + 8 * n;
    return 0;
}

static int valid_chunk_bytes(uint64_t cb)
{
    return cb >= 4096 && cb <= (1ull << 30) && cb % 16 == 0;
}

uint64_t ckpt_mem_need(const ckpt_buffer *bufs, size_t nbufs, uint64_t trainer_len_max,
                       uint64_t chunk_bytes)
{
    if ((nbufs && !bufs) || nbufs > CKPT_MEM_MAX_BUFFERS || chunk_bytes == 0) return 0;
    uint64_t bytes[CKPT_MEM_MAX_BUFFERS], payload;
    for (size_t i = 0; i < nbufs; i++) bytes[i] = bufs[i].bytes;
    if (layout(bytes, nbufs, trainer_len_max, chunk_bytes, NULL, NULL, NULL, NULL, &payload) < 0) return 0;
    return round_up(payload, 4096);
}

/* Parse and check the header page p of a payload of payload_bytes bytes. */
static int parse_header(const uint8_t *p, uint64_t payload_bytes, mhdr *h, char *why, size_t why_len)
{
    memset(h, 0, sizeof *h);
    if (payload_bytes < CKPT_MEM_HEADER_BYTES || memcmp(p + H_MAGIC, mem_magic, 8) != 0) {
        log_why(why, why_len, "not a memory snapshot (magic)");
        return -EBADMSG;
    }
    uint64_t want = get64(p + H_SUM), got = XXH3_64bits(p, H_SUM);
    if (want != got) {
        log_why(why, why_len, "header checksum mismatch (stored %016" PRIx64 ", computed %016" PRIx64 ")",
                want, got);
        return -EBADMSG;
    }
    uint32_t ver = get32(p + H_VERSION);
    if (ver != CKPT_MEM_VERSION) {
        log_why(why, why_len, "memory snapshot version %u, this program reads %u", ver, CKPT_MEM_VERSION);
        return ver > CKPT_MEM_VERSION ? -EPROTONOSUPPORT : -EBADMSG;
    }
    h->nbufs = get32(p + H_NBUFS);
    h->step = get64(p + H_STEP);
    h->world = get32(p + H_WORLD);
    h->rank = get32(p + H_RANK);
    h->created = (int64_t)get64(p + H_CREATED);
    h->chunk_bytes = get64(p + H_CHUNK);
    h->trainer_off = get64(p + H_TRAINER_OFF);
    h->trainer_len = get64(p + H_TRAINER_LEN);
    h->sums_off = get64(p + H_SUMS_OFF);
    h->nsums = get64(p + H_NSUMS);
    h->trainer_xxh = get64(p + H_TRAINER_XXH);
    if (h->nbufs > CKPT_MEM_MAX_BUFFERS || h->world < 1 || h->world > CKPT_MAX_WORLD_SIZE ||
        h->rank >= h->world || !valid_chunk_bytes(h->chunk_bytes) ||
        get_name(p + H_RUN, 64, h->run_id) || get_name(p + H_CFG, 64, h->config_hash) ||
        get_name(p + H_TAG, 64, h->tag)) {
        log_why(why, why_len, "header fields out of range (buffers, world size, rank, chunk bytes, names)");
        return -EBADMSG;
    }
    uint64_t bytes[CKPT_MEM_MAX_BUFFERS], doff[CKPT_MEM_MAX_BUFFERS], toff, soff, ns, pb;
    for (uint32_t i = 0; i < h->nbufs; i++) {
        const uint8_t *q = p + H_BUFS + (size_t)i * B_SIZE;
        mbuf *b = &h->b[i];
        b->elem_bytes = get32(q + B_ELEM);
        b->total = get64(q + B_TOTAL);
        b->offset = get64(q + B_OFFSET);
        b->bytes = get64(q + B_BYTES);
        b->data_off = get64(q + B_DATA_OFF);
        if (get_name(q + B_NAME, 64, b->name) || get_name(q + B_DTYPE, 16, b->dtype) ||
            !(b->elem_bytes == 1 || b->elem_bytes == 2 || b->elem_bytes == 4 || b->elem_bytes == 8) ||
            b->total % b->elem_bytes || b->offset > b->total || b->bytes > b->total - b->offset) {
            log_why(why, why_len, "buffer entry %u is malformed", i);
            return -EBADMSG;
        }
        for (uint32_t j = 0; j < i; j++)
            if (!strcmp(h->b[j].name, b->name)) {
                log_why(why, why_len, "buffer %s appears twice", b->name);
                return -EBADMSG;
            }
        bytes[i] = b->bytes;
    }
    /* the writer's layout is the only one: every offset must be what it computes */
    if (layout(bytes, h->nbufs, h->trainer_len, h->chunk_bytes, doff, &toff, &soff, &ns, &pb) < 0 ||
        toff != h->trainer_off || soff != h->sums_off || ns != h->nsums || pb != payload_bytes ||
        h->trainer_len > CKPT_MAX_TRAINER_BYTES) {
        log_why(why, why_len, "layout does not match the header (trainer record, checksums, %" PRIu64
                " payload bytes)", payload_bytes);
        return -EBADMSG;
    }
    for (uint32_t i = 0; i < h->nbufs; i++)
        if (doff[i] != h->b[i].data_off) {
            log_why(why, why_len, "buffer %s: data offset %" PRIu64 ", expected %" PRIu64, h->b[i].name,
                    h->b[i].data_off, doff[i]);
            return -EBADMSG;
        }
    return 0;
}

/* ------------------------------------------------------------------ writing */

static int check_write_args(const shmseg *seg, int avoid_slot, const char *run_id, const char *config_hash,
                            const char *tag, uint32_t world_size, uint32_t rank, const ckpt_buffer *bufs,
                            size_t nbufs, uint64_t chunk_bytes, int need_data)
{
    if (!seg || avoid_slot < -1 || avoid_slot >= shmseg_nslots(seg) || !ckpt_valid_name(run_id) ||
        !ckpt_valid_name(config_hash) || !ckpt_valid_name(tag) || world_size < 1 ||
        world_size > CKPT_MAX_WORLD_SIZE || rank >= world_size || (nbufs && !bufs) ||
        nbufs > CKPT_MEM_MAX_BUFFERS || !valid_chunk_bytes(chunk_bytes))
        return -EINVAL;
    for (size_t i = 0; i < nbufs; i++) {
        const ckpt_buffer *b = &bufs[i];
        if (!ckpt_valid_name(b->name) || !ckpt_valid_name(b->dtype) || strlen(b->dtype) > 15 ||
            !(b->elem_bytes == 1 || b->elem_bytes == 2 || b->elem_bytes == 4 || b->elem_bytes == 8) ||
            b->total_bytes % b->elem_bytes || b->offset > b->total_bytes ||
            b->bytes > b->total_bytes - b->offset || (need_data && b->bytes && !b->data))
            return -EINVAL;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(bufs[j].name, b->name)) return -EINVAL;
    }
    return 0;
}

static int valid_trainer(const char *text, size_t len)
{
    if (len > CKPT_MAX_TRAINER_BYTES) return 0;
    json_error_t err;
    json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    int ok = json_is_object(j);
    json_decref(j);
    return ok;
}

/* Where a slot's parts go (layout()), for these shards and a record of tlen bytes. */
typedef struct mem_layout {
    uint64_t doff[CKPT_MEM_MAX_BUFFERS], toff, soff, ns, pb;
} mem_layout;

static int slot_layout(const shmseg *seg, const ckpt_buffer *bufs, size_t nbufs, size_t tlen,
                       uint64_t chunk_bytes, mem_layout *l)
{
    uint64_t bytes[CKPT_MEM_MAX_BUFFERS];
    for (size_t i = 0; i < nbufs; i++) bytes[i] = bufs[i].bytes;
    if (layout(bytes, nbufs, tlen, chunk_bytes, l->doff, &l->toff, &l->soff, &l->ns, &l->pb) < 0)
        return -EINVAL;
    if (l->pb > shmseg_slot_bytes(seg)) return -ENOSPC;
    return shmseg_writable(seg) ? 0 : -EBADF;
}

/* The trainer record, the header and the commit of slot `slot` (payload p), whose shards and
 * checksums are in place. */
static int finish_slot(shmseg *seg, int slot, uint8_t *p, const mem_layout *l, uint64_t step,
                       const char *run_id, const char *config_hash, const char *tag,
                       uint32_t world_size, uint32_t rank, const ckpt_buffer *bufs, size_t nbufs,
                       const char *trainer_json, size_t tlen, uint64_t chunk_bytes)
{
    memcpy(p + l->toff, trainer_json, tlen);
    memset(p, 0, CKPT_MEM_HEADER_BYTES);
    memcpy(p + H_MAGIC, mem_magic, 8);
    put32(p + H_VERSION, CKPT_MEM_VERSION);
    put32(p + H_NBUFS, (uint32_t)nbufs);
    put64(p + H_STEP, step);
    put32(p + H_WORLD, world_size);
    put32(p + H_RANK, rank);
    put64(p + H_CREATED, (uint64_t)(int64_t)time(NULL));
    put64(p + H_CHUNK, chunk_bytes);
    memcpy(p + H_RUN, run_id, strlen(run_id));
    memcpy(p + H_CFG, config_hash, strlen(config_hash));
    memcpy(p + H_TAG, tag, strlen(tag));
    put64(p + H_TRAINER_OFF, l->toff);
    put64(p + H_TRAINER_LEN, tlen);
    put64(p + H_SUMS_OFF, l->soff);
    put64(p + H_NSUMS, l->ns);
    put64(p + H_TRAINER_XXH, XXH3_64bits(trainer_json, tlen));
    for (size_t i = 0; i < nbufs; i++) {
        uint8_t *q = p + H_BUFS + i * B_SIZE;
        memcpy(q + B_NAME, bufs[i].name, strlen(bufs[i].name));
        memcpy(q + B_DTYPE, bufs[i].dtype, strlen(bufs[i].dtype));
        put32(q + B_ELEM, bufs[i].elem_bytes);
        put64(q + B_TOTAL, bufs[i].total_bytes);
        put64(q + B_OFFSET, bufs[i].offset);
        put64(q + B_BYTES, bufs[i].bytes);
        put64(q + B_DATA_OFF, l->doff[i]);
    }
    put64(p + H_SUM, XXH3_64bits(p, H_SUM));
    return shmseg_commit(seg, slot, l->pb, step);
}

/* The checks of a write or a commit of these shards with this record (NULL = "{}"), and
 * where the slot's parts go: 0 or a negative errno (check_write_args, the record, the
 * layout). *tlen gets the record's length. */
static int check_slot_write(const shmseg *seg, int avoid_slot, const char *run_id,
                            const char *config_hash, const char *tag, uint32_t world_size,
                            uint32_t rank, const ckpt_buffer *bufs, size_t nbufs,
                            const char **trainer_json, uint64_t chunk_bytes, size_t *tlen,
                            mem_layout *l)
{
    int rc = check_write_args(seg, avoid_slot, run_id, config_hash, tag, world_size, rank, bufs, nbufs,
                              chunk_bytes, 1);
    if (rc < 0) return rc;
    if (!*trainer_json) *trainer_json = "{}";
    *tlen = strlen(*trainer_json);
    if (!valid_trainer(*trainer_json, *tlen)) return -EINVAL;
    return slot_layout(seg, bufs, nbufs, *tlen, chunk_bytes, l);
}

/* staged_out of ckpt_mem_write and ckpt_mem_begin: bufs with data (and name, dtype) in the
 * slot; names_in_slot 0 keeps the caller's name and dtype (the header is not written yet). */
static void fill_staged(uint8_t *p, const mem_layout *l, const ckpt_buffer *bufs, size_t nbufs,
                        int names_in_slot, ckpt_buffer *staged_out)
{
    for (size_t i = 0; staged_out && i < nbufs; i++) {
        staged_out[i] = bufs[i];
        if (names_in_slot) {
            staged_out[i].name = (const char *)(p + H_BUFS + i * B_SIZE + B_NAME);
            staged_out[i].dtype = (const char *)(p + H_BUFS + i * B_SIZE + B_DTYPE);
        }
        staged_out[i].data = bufs[i].bytes ? p + l->doff[i] : NULL;
    }
}

int ckpt_mem_write(shmseg *seg, int avoid_slot, uint64_t step, const char *run_id,
                   const char *config_hash, const char *tag, uint32_t world_size, uint32_t rank,
                   const ckpt_buffer *bufs, size_t nbufs, const char *trainer_json,
                   uint64_t chunk_bytes, int *slot_out, ckpt_buffer *staged_out)
{
    mem_layout l;
    size_t tlen;
    int rc = check_slot_write(seg, avoid_slot, run_id, config_hash, tag, world_size, rank, bufs,
                              nbufs, &trainer_json, chunk_bytes, &tlen, &l);
    if (rc < 0) return rc;
    uint64_t total = 0;
    for (size_t i = 0; i < nbufs; i++) total += bufs[i].bytes;
    XXH3_state_t *hs = XXH3_createState();
    if (!hs) return -ENOMEM;

    int slot;
    if ((rc = shmseg_begin(seg, avoid_slot, &slot)) < 0) {
        XXH3_freeState(hs);
        return rc;
    }
    uint8_t *p = shmseg_payload(seg, slot);
    memset(p, 0, CKPT_MEM_HEADER_BYTES);
    uint64_t *sums = (uint64_t *)(void *)(p + l.soff); /* 8-aligned in a page-aligned payload */
    uint64_t copied = 0, k = 0;
    int fault_passed = 0;
    for (size_t i = 0; i < nbufs; i++) {
        const uint8_t *src = bufs[i].data;
        uint8_t *dst = p + l.doff[i];
        for (uint64_t c = 0; c < bufs[i].bytes; c += chunk_bytes) {
            uint64_t clen = bufs[i].bytes - c < chunk_bytes ? bufs[i].bytes - c : chunk_bytes;
            XXH3_64bits_reset(hs);
            for (uint64_t q = 0; q < clen; q += PIECE) {
                size_t n = (size_t)(clen - q < PIECE ? clen - q : PIECE);
                memcpy(dst + c + q, src + c + q, n);
                XXH3_64bits_update(hs, dst + c + q, n); /* the bytes just written, still in cache */
                copied += n;
                if (!fault_passed && 2 * copied >= total) {
                    fault_passed = 1;
                    ckpt_fault_point("mid-mem-copy", step);
                }
            }
            sums[k++] = XXH3_64bits_digest(hs);
        }
    }
    XXH3_freeState(hs);
    if (!fault_passed) ckpt_fault_point("mid-mem-copy", step);
    if ((rc = finish_slot(seg, slot, p, &l, step, run_id, config_hash, tag, world_size, rank, bufs,
                          nbufs, trainer_json, tlen, chunk_bytes)) < 0)
        return rc;
    if (slot_out) *slot_out = slot;
    fill_staged(p, &l, bufs, nbufs, 1, staged_out);
    return 0;
}

int ckpt_mem_begin(shmseg *seg, int avoid_slot, const ckpt_buffer *bufs, size_t nbufs,
                   uint64_t chunk_bytes, int *slot_out, ckpt_buffer *staged_out)
{
    if (!slot_out || !staged_out) return -EINVAL;
    *slot_out = -1;
    int rc = check_write_args(seg, avoid_slot, "x", "x", "x", 1, 0, bufs, nbufs, chunk_bytes, 0);
    if (rc < 0) return rc;
    mem_layout l;
    if ((rc = slot_layout(seg, bufs, nbufs, 0, chunk_bytes, &l)) < 0) return rc;
    int slot;
    if ((rc = shmseg_begin(seg, avoid_slot, &slot)) < 0) return rc;
    uint8_t *p = shmseg_payload(seg, slot);
    memset(p, 0, CKPT_MEM_HEADER_BYTES);
    *slot_out = slot;
    fill_staged(p, &l, bufs, nbufs, 0, staged_out);
    return 0;
}

uint64_t ckpt_mem_sum_count(const ckpt_buffer *bufs, size_t nbufs, uint64_t chunk_bytes)
{
    if ((nbufs && !bufs) || nbufs > CKPT_MEM_MAX_BUFFERS || !valid_chunk_bytes(chunk_bytes)) return 0;
    uint64_t n = 0;
    for (size_t i = 0; i < nbufs; i++) n += nchunks_of(bufs[i].bytes, chunk_bytes);
    return n;
}

int ckpt_mem_sum_buffer(const ckpt_buffer *staged, size_t nbufs, size_t i, uint64_t chunk_bytes,
                        uint64_t *sums)
{
    if (!staged || !sums || i >= nbufs || nbufs > CKPT_MEM_MAX_BUFFERS || !valid_chunk_bytes(chunk_bytes) ||
        (staged[i].bytes && !staged[i].data))
        return -EINVAL;
    uint64_t k = ckpt_mem_sum_count(staged, i, chunk_bytes); /* the sums of the buffers before */
    const uint8_t *src = staged[i].data;
    for (uint64_t c = 0; c < staged[i].bytes; c += chunk_bytes) {
        uint64_t clen = staged[i].bytes - c < chunk_bytes ? staged[i].bytes - c : chunk_bytes;
        sums[k++] = XXH3_64bits(src + c, (size_t)clen);
    }
    return 0;
}

int ckpt_mem_commit(shmseg *seg, int slot, uint64_t step, const char *run_id,
                    const char *config_hash, const char *tag, uint32_t world_size, uint32_t rank,
                    const ckpt_buffer *staged, size_t nbufs, const char *trainer_json,
                    uint64_t chunk_bytes, const uint64_t *sums_given)
{
    if (slot < 0 || slot >= shmseg_nslots(seg)) return -EINVAL; /* 0 slots for NULL */
    mem_layout l;
    size_t tlen;
    int rc = check_slot_write(seg, -1, run_id, config_hash, tag, world_size, rank, staged, nbufs,
                              &trainer_json, chunk_bytes, &tlen, &l);
    if (rc < 0) return rc;
    shmseg_info info;
    if ((rc = shmseg_slot_info(seg, slot, &info)) < 0) return rc;
    if (info.state != SHMSEG_WRITING) return -EINVAL; /* not begun, or committed already */
    uint8_t *p = shmseg_payload(seg, slot);
    uint64_t total = 0;
    for (size_t i = 0; i < nbufs; i++) {
        if (staged[i].bytes && staged[i].data != p + l.doff[i]) return -EINVAL; /* not begin's */
        total += staged[i].bytes;
    }
    /* the checksums of the bytes in place (the copies into the slot are done), or the
     * caller's (ckpt_mem_sum_buffer, e.g. on the copy stream as each shard landed) */
    uint64_t *sums = (uint64_t *)(void *)(p + l.soff);
    uint64_t hashed = 0, k = 0;
    int fault_passed = 0;
    if (sums_given) {
        memcpy(sums, sums_given, (size_t)l.ns * sizeof *sums);
    }
    for (size_t i = 0; !sums_given && i < nbufs; i++) {
        const uint8_t *src = p + l.doff[i];
        for (uint64_t c = 0; c < staged[i].bytes; c += chunk_bytes) {
            uint64_t clen = staged[i].bytes - c < chunk_bytes ? staged[i].bytes - c : chunk_bytes;
            sums[k++] = XXH3_64bits(src + c, (size_t)clen);
            hashed += clen;
            if (!fault_passed && 2 * hashed >= total) {
                fault_passed = 1;
                ckpt_fault_point("mid-mem-copy", step);
            }
        }
    }
    if (!fault_passed) ckpt_fault_point("mid-mem-copy", step);
    return finish_slot(seg, slot, p, &l, step, run_id, config_hash, tag, world_size, rank, staged,
                       nbufs, trainer_json, tlen, chunk_bytes);
}

/* ------------------------------------------------------------------ scanning segments */

typedef struct seg_ref {
    char *path;
    shmseg *seg;
    int kind; /* enum ckpt_mem_source */
} seg_ref;

/* One verified slot: a local one (remote -1: segment seg, slot, seq) or a remote's (remote
 * index into the remotes, ref its name for it). */
typedef struct slot_rec {
    mhdr h;
    size_t seg; /* index into the scan's segments */
    int slot;
    int kind;
    uint64_t seq, payload_bytes;
    int remote;
    uint64_t ref;
    char where[CKPT_MEM_WHERE_MAX]; /* "<segment path> slot <i>" or the remote's where */
} slot_rec;

typedef struct scan {
    seg_ref *segs;
    size_t nsegs;
    slot_rec *recs;
    size_t nrecs;
    ckpt_mem_entry *bad; /* CORRUPT entries */
    size_t nbad;
} scan;

static void scan_free(scan *sc)
{
    for (size_t i = 0; i < sc->nsegs; i++) {
        shmseg_close(sc->segs[i].seg);
        free(sc->segs[i].path);
    }
    free(sc->segs);
    free(sc->recs);
    free(sc->bad);
    memset(sc, 0, sizeof *sc);
}

/* Digits only, at least one, fitting in 32 bits: 0, or -1. */
static int parse_u32(const char *s, size_t n, uint32_t *v)
{
    if (n == 0 || n > 9) return -1;
    uint32_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        x = x * 10 + (uint32_t)(s[i] - '0');
    }
    *v = x;
    return 0;
}

/* The kind of segment a name under the prefix names ("own-<L>", "rep-<A>-<L>"), or -1. A is
 * the sending agent's id, 16 lowercase hex digits (common/shmseg.h shmseg_rep_path); the
 * names of the node-rank era ("rep-<N>-<L>", 1 to 9 digits) are read as well. */
static int segment_kind(const char *rest)
{
    uint32_t a, b;
    if (!strncmp(rest, "own-", 4)) return parse_u32(rest + 4, strlen(rest + 4), &a) == 0 ? CKPT_MEM_SRC_OWN : -1;
    if (!strncmp(rest, "rep-", 4)) {
        const char *src = rest + 4, *dash = strchr(src, '-');
        size_t n = dash ? (size_t)(dash - src) : 0;
        int hex = n == 16 && strspn(src, "0123456789abcdef") == 16;
        if (!dash || (!hex && parse_u32(src, n, &a) < 0) ||
            parse_u32(dash + 1, strlen(dash + 1), &b) < 0)
            return -1;
        return CKPT_MEM_SRC_REPLICA;
    }
    return -1;
}

/* Split the prefix into its folder and the file name part. */
static int split_prefix(const char *prefix, char *dir, size_t dlen, const char **base)
{
    if (!prefix || !*prefix || strlen(prefix) >= CKPT_PATH_MAX - 64) return -EINVAL;
    const char *slash = strrchr(prefix, '/');
    *base = slash ? slash + 1 : prefix;
    if (!**base) return -EINVAL;
    if (!slash) snprintf(dir, dlen, ".");
    else if (slash == prefix) snprintf(dir, dlen, "/");
    else snprintf(dir, dlen, "%.*s", (int)(slash - prefix), prefix);
    return 0;
}

int ckpt_mem_prefix_ok(const char *prefix)
{
    char dir[CKPT_PATH_MAX];
    const char *base;
    return split_prefix(prefix, dir, sizeof dir, &base) == 0;
}

static int add_bad(scan *sc, const char *path, int slot, uint64_t step, const char *reason)
{ /* slot -1: path names the slot already (a remote's) */
    ckpt_mem_entry *nb = realloc(sc->bad, (sc->nbad + 1) * sizeof *nb);
    if (!nb) return -ENOMEM;
    sc->bad = nb;
    ckpt_mem_entry *e = &nb[sc->nbad++];
    memset(e, 0, sizeof *e);
    e->status = CKPT_MEM_CORRUPT;
    e->step = step;
    if (slot < 0) snprintf(e->name, sizeof e->name, "%.500s", path);
    else snprintf(e->name, sizeof e->name, "%s slot %d", path, slot);
    snprintf(e->reason, sizeof e->reason, "%s", reason);
    return 0;
}

/* Read the complete slots of one segment into sc. */
static int scan_segment(scan *sc, size_t si)
{
    const seg_ref *r = &sc->segs[si];
    for (int i = 0; i < shmseg_nslots(r->seg); i++) {
        shmseg_info in;
        if (shmseg_slot_info(r->seg, i, &in) < 0 || in.state != SHMSEG_COMPLETE) continue;
        uint8_t page[CKPT_MEM_HEADER_BYTES];
        char why[200] = "";
        uint64_t seq = 0;
        int rc = -EAGAIN;
        if (in.payload_bytes < CKPT_MEM_HEADER_BYTES) {
            snprintf(why, sizeof why, "payload of %" PRIu64 " bytes is shorter than its header", in.payload_bytes);
            rc = -EBADMSG;
        } else {
            for (int t = 0; t < 3 && rc == -EAGAIN; t++)
                rc = shmseg_copy_out(r->seg, i, page, 0, sizeof page, &seq);
            if (rc == -EAGAIN || rc == -ENOENT) continue; /* being rewritten: not a snapshot now */
            if (rc == 0 && XXH3_64bits(page, sizeof page) != in.payload_xxh3) {
                snprintf(why, sizeof why, "payload head does not match the slot header's checksum");
                rc = -EBADMSG;
            }
        }
        mhdr h;
        if (rc == 0) {
            /* payload_bytes from the same consistent reading as seq */
            shmseg_info in2;
            if (shmseg_slot_info(r->seg, i, &in2) < 0 || in2.seq != seq) continue;
            rc = parse_header(page, in2.payload_bytes, &h, why, sizeof why);
            in = in2;
        }
        if (rc < 0) {
            LOG_D(TAG, "memory segment %s slot %d: %s", r->path, i, why);
            if (add_bad(sc, r->path, i, in.step, why) < 0) return -ENOMEM;
            continue;
        }
        slot_rec *nr = realloc(sc->recs, (sc->nrecs + 1) * sizeof *nr);
        if (!nr) return -ENOMEM;
        sc->recs = nr;
        slot_rec *rec = &nr[sc->nrecs++];
        *rec = (slot_rec){h, si, i, r->kind, seq, in.payload_bytes, -1, 0, ""};
        snprintf(rec->where, sizeof rec->where, "%s slot %d", r->path, i);
    }
    return 0;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const seg_ref *)a)->path, ((const seg_ref *)b)->path);
}

/* The slots remote k lists, checked as local ones are (header checksum and fields); a
 * remote that cannot list is logged and skipped (the restore then goes without it). */
static int scan_remote(scan *sc, const ckpt_mem_remote *rm, int k)
{
    ckpt_mem_remote_slot *v = NULL;
    size_t n = 0;
    int rc = rm->list(rm->ctx, &v, &n);
    if (rc < 0) {
        LOG_W(TAG, "memory tier: cannot list the slots of %s: %s; going on without them",
              rm->name ? rm->name : "a remote", strerror(-rc));
        free(v);
        return rc == -ENOMEM ? rc : 0;
    }
    for (size_t i = 0; i < n && rc == 0; i++) {
        const ckpt_mem_remote_slot *rs = &v[i];
        char why[200] = "";
        mhdr h;
        if (parse_header(rs->head, rs->payload_bytes, &h, why, sizeof why) < 0) {
            LOG_D(TAG, "memory slot %s: %s", rs->where, why);
            if (add_bad(sc, rs->where, -1, 0, why) < 0) rc = -ENOMEM;
            continue;
        }
        slot_rec *nr = realloc(sc->recs, (sc->nrecs + 1) * sizeof *nr);
        if (!nr) {
            rc = -ENOMEM;
            break;
        }
        sc->recs = nr;
        slot_rec *rec = &nr[sc->nrecs++];
        *rec = (slot_rec){h, 0, -1, CKPT_MEM_SRC_REMOTE, 0, rs->payload_bytes, k, rs->ref, ""};
        snprintf(rec->where, sizeof rec->where, "%s", rs->where);
    }
    free(v);
    return rc;
}

/* Open every segment under the prefix and read its complete slots, then the remotes'. */
static int scan_run(const char *prefix, const ckpt_mem_remote *remotes, size_t nremotes, scan *sc)
{
    memset(sc, 0, sizeof *sc);
    char dir[CKPT_PATH_MAX];
    const char *base;
    if (!prefix) { /* remotes only */
        int rc = 0;
        for (size_t k = 0; k < nremotes && rc == 0; k++) rc = scan_remote(sc, &remotes[k], (int)k);
        if (rc < 0) scan_free(sc);
        return rc;
    }
    if (split_prefix(prefix, dir, sizeof dir, &base) < 0) return -EINVAL;
    size_t blen = strlen(base);
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? scan_run(NULL, remotes, nremotes, sc) : -errno;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, base, blen) != 0 || e->d_name[blen] != '.') continue;
        int kind = segment_kind(e->d_name + blen + 1);
        if (kind < 0) continue;
        char path[CKPT_PATH_MAX];
        if (ckpt_path_join(path, sizeof path, dir, e->d_name) < 0) continue;
        shmseg *seg;
        int orc = shmseg_open(path, 0, &seg);
        if (orc < 0) {
            LOG_D(TAG, "memory segment %s skipped: %s", path, strerror(-orc));
            continue;
        }
        seg_ref *ns = realloc(sc->segs, (sc->nsegs + 1) * sizeof *ns);
        char *pc = strdup(path);
        if (!ns || !pc) {
            if (ns) sc->segs = ns;
            free(pc);
            shmseg_close(seg);
            rc = -ENOMEM;
            break;
        }
        sc->segs = ns;
        ns[sc->nsegs++] = (seg_ref){pc, seg, kind};
    }
    closedir(d);
    /* a stable order (readdir's is not), so that ties pick the same slot every time */
    if (rc == 0 && sc->nsegs) {
        qsort(sc->segs, sc->nsegs, sizeof *sc->segs, cmp_name);
        for (size_t i = 0; i < sc->nsegs && rc == 0; i++) rc = scan_segment(sc, i);
    }
    for (size_t k = 0; k < nremotes && rc == 0; k++) rc = scan_remote(sc, &remotes[k], (int)k);
    if (rc < 0) scan_free(sc);
    return rc;
}

/* Same snapshot: step, world size, run and launch tag. */
static int same_snap(const mhdr *a, const mhdr *b)
{
    return a->step == b->step && a->world == b->world && !strcmp(a->run_id, b->run_id) && !strcmp(a->tag, b->tag);
}

/* Newest step first, then world, run, tag; within a snapshot by rank, own before replica. */
static int cmp_rec(const void *x, const void *y)
{
    const slot_rec *a = x, *b = y;
    if (a->h.step != b->h.step) return a->h.step > b->h.step ? -1 : 1;
    if (a->h.world != b->h.world) return a->h.world < b->h.world ? -1 : 1;
    int c = strcmp(a->h.run_id, b->h.run_id);
    if (c) return c;
    if ((c = strcmp(a->h.tag, b->h.tag)) != 0) return c;
    if (a->h.rank != b->h.rank) return a->h.rank < b->h.rank ? -1 : 1;
    if (a->kind != b->kind) return a->kind < b->kind ? -1 : 1;
    if (a->remote != b->remote) return a->remote < b->remote ? -1 : 1;
    if (a->seg != b->seg) return a->seg < b->seg ? -1 : 1;
    return a->ref < b->ref ? -1 : a->ref > b->ref;
}

static int cmp_entry(const void *x, const void *y)
{
    const ckpt_mem_entry *a = x, *b = y;
    if (a->step != b->step) return a->step > b->step ? -1 : 1;
    if (a->status != b->status) return a->status < b->status ? -1 : 1;
    int c = strcmp(a->run_id, b->run_id);
    if (c) return c;
    if ((c = strcmp(a->tag, b->tag)) != 0) return c;
    return strcmp(a->name, b->name);
}

static void format_id(char *out, size_t len, const mhdr *h)
{
    snprintf(out, len, "mem:%s/%s/%" PRIu64 "/%u", h->run_id, h->tag, h->step, h->world);
}

int ckpt_mem_list(const char *path_prefix, ckpt_mem_entry **out, size_t *n)
{
    return ckpt_mem_list_ex(path_prefix, NULL, 0, out, n);
}

int ckpt_mem_list_ex(const char *path_prefix, const ckpt_mem_remote *remotes, size_t nremotes,
                     ckpt_mem_entry **out, size_t *n)
{
    if (!out || !n || (nremotes && !remotes)) return -EINVAL;
    *out = NULL;
    *n = 0;
    for (size_t k = 0; k < nremotes; k++)
        if (!remotes[k].list || !remotes[k].read) return -EINVAL;
    scan sc;
    int rc = scan_run(path_prefix, remotes, nremotes, &sc);
    if (rc < 0) return rc;
    if (sc.nrecs) qsort(sc.recs, sc.nrecs, sizeof *sc.recs, cmp_rec);
    ckpt_mem_entry *v = calloc(sc.nrecs + sc.nbad + 1, sizeof *v);
    if (!v) {
        scan_free(&sc);
        return -ENOMEM;
    }
    size_t cnt = 0;
    for (size_t i = 0; i < sc.nrecs;) {
        size_t j = i;
        while (j < sc.nrecs && same_snap(&sc.recs[i].h, &sc.recs[j].h)) j++;
        ckpt_mem_entry *e = &v[cnt++];
        const mhdr *h = &sc.recs[i].h;
        e->status = CKPT_MEM_COMPLETE;
        e->step = h->step;
        e->world_size = h->world;
        e->created = h->created;
        snprintf(e->run_id, sizeof e->run_id, "%s", h->run_id);
        snprintf(e->config_hash, sizeof e->config_hash, "%s", h->config_hash);
        snprintf(e->tag, sizeof e->tag, "%s", h->tag);
        format_id(e->id, sizeof e->id, h);
        uint32_t expect = 0; /* the next rank not yet seen; recs are sorted by rank */
        for (size_t q = i; q < j; q++) {
            const slot_rec *r = &sc.recs[q];
            if (q > i && r->h.rank == sc.recs[q - 1].h.rank) continue; /* the preferred one came first */
            if (r->h.rank != expect && !e->reason[0])
                snprintf(e->reason, sizeof e->reason, "rank %u of %u has no slot here", expect, h->world);
            expect = r->h.rank + 1;
            e->ranks_present++;
            if (r->kind == CKPT_MEM_SRC_OWN) e->ranks_own++;
            else if (r->kind == CKPT_MEM_SRC_REPLICA) e->ranks_replica++;
            else e->ranks_remote++;
            if (r->h.rank == 0) e->created = r->h.created;
            for (uint32_t b = 0; b < r->h.nbufs; b++) e->raw_bytes += r->h.b[b].bytes;
        }
        if (expect != h->world && !e->reason[0])
            snprintf(e->reason, sizeof e->reason, "rank %u of %u has no slot here", expect, h->world);
        if (e->ranks_present < h->world) e->status = CKPT_MEM_PARTIAL;
        else e->reason[0] = '\0';
        e->source = e->ranks_remote ? CKPT_MEM_SRC_REMOTE
                    : e->ranks_replica ? CKPT_MEM_SRC_REPLICA : CKPT_MEM_SRC_OWN;
        i = j;
    }
    for (size_t i = 0; i < sc.nbad; i++) v[cnt + i] = sc.bad[i];
    cnt += sc.nbad;
    scan_free(&sc);
    qsort(v, cnt, sizeof *v, cmp_entry);
    *out = v;
    *n = cnt;
    return 0;
}

/* ------------------------------------------------------------------ the snapshot handle */

typedef struct mem_rank {
    shmseg *seg; /* borrowed from segs; NULL for a remote's slot */
    int slot;
    uint64_t seq;
    int kind;
    const ckpt_mem_remote *rm; /* a remote's slot: rm->read(rm->ctx, ref, ...) */
    uint64_t ref;
    char where[CKPT_MEM_WHERE_MAX];
} mem_rank;

typedef struct mem_src {
    uint32_t world;
    mem_rank *r;  /* (world) */
    shmseg **segs;
    size_t nsegs;
    ckpt_mem_remote *remotes; /* a copy of the caller's (their ctx borrowed) */
    size_t nremotes;
} mem_src;

/* A remote's read of rank r's slot, its errors in the local reads' terms. */
static int remote_read(const mem_rank *r, uint64_t off, uint64_t len, void *dst, char *bad, size_t bad_len)
{
    int rc = r->rm->read(r->rm->ctx, r->ref, off, len, dst);
    if (rc == -ESTALE) {
        log_why(bad, bad_len, "%s: rewritten since the memory snapshot was opened", r->where);
        return -ESTALE;
    }
    if (rc == -ERANGE || rc == -EINVAL) {
        log_why(bad, bad_len, "%s: bytes [%" PRIu64 ", +%" PRIu64 ") lie past its payload", r->where, off, len);
        return -EBADMSG;
    }
    if (rc < 0) log_why(bad, bad_len, "%s: %s", r->where, strerror(-rc));
    return rc < 0 ? rc : 0;
}

static void mem_src_close(void *ctx)
{
    mem_src *m = ctx;
    if (!m) return;
    for (size_t i = 0; i < m->nsegs; i++) shmseg_close(m->segs[i]);
    free(m->segs);
    free(m->remotes);
    free(m->r);
    free(m);
}

static int mem_src_read(void *ctx, uint32_t file, uint64_t off, uint64_t len, uint8_t *dst, char *bad,
                        size_t bad_len)
{
    const mem_src *m = ctx;
    if (file >= m->world) return -EINVAL;
    const mem_rank *r = &m->r[file];
    if (r->rm) return remote_read(r, off, len, dst, bad, bad_len);
    uint64_t seq = r->seq;
    int rc = shmseg_copy_out(r->seg, r->slot, dst, off, len, &seq);
    if (rc == -EAGAIN || rc == -ENOENT) {
        log_why(bad, bad_len, "%s slot %d: rewritten since the memory snapshot was opened", shmseg_path(r->seg),
                r->slot);
        return -ESTALE;
    }
    if (rc == -EINVAL) {
        log_why(bad, bad_len, "%s slot %d: bytes [%" PRIu64 ", +%" PRIu64 ") lie past its payload",
                shmseg_path(r->seg), r->slot, off, len);
        return -EBADMSG;
    }
    return rc;
}

int ckpt_mem_is_id(const char *id)
{
    return id && !strncmp(id, "mem:", 4);
}

int ckpt_snapshot_is_mem(const ckpt_snapshot *s)
{
    return s && s->src_kind == CKPT_SRC_MEM;
}

int ckpt_mem_snapshot_source(const ckpt_snapshot *s, uint32_t rank)
{
    if (!ckpt_snapshot_is_mem(s)) return -EINVAL;
    const mem_src *m = s->src_ctx;
    return rank < m->world ? m->r[rank].kind : -EINVAL;
}

int ckpt_mem_snapshot_replicas(const ckpt_snapshot *s)
{
    if (!ckpt_snapshot_is_mem(s)) return -EINVAL;
    const mem_src *m = s->src_ctx;
    int n = 0;
    for (uint32_t i = 0; i < m->world; i++) n += m->r[i].kind == CKPT_MEM_SRC_REPLICA;
    return n;
}

const char *ckpt_mem_source_name(int source)
{
    return source == CKPT_MEM_SRC_REMOTE ? "peer" : source == CKPT_MEM_SRC_REPLICA ? "replica" : "own";
}

int ckpt_mem_snapshot_remotes(const ckpt_snapshot *s)
{
    if (!ckpt_snapshot_is_mem(s)) return -EINVAL;
    const mem_src *m = s->src_ctx;
    int n = 0;
    for (uint32_t i = 0; i < m->world; i++) n += m->r[i].rm != NULL;
    return n;
}

const char *ckpt_mem_snapshot_remote_name(const ckpt_snapshot *s, uint32_t rank)
{
    if (!ckpt_snapshot_is_mem(s)) return NULL;
    const mem_src *m = s->src_ctx;
    if (rank >= m->world || !m->r[rank].rm) return NULL;
    return m->r[rank].rm->name ? m->r[rank].rm->name : "a remote";
}

/* "mem:<run_id>/<tag>/<step>/<world>" */
static int parse_id(const char *id, char *run_id, char *tag, uint64_t *step, uint32_t *world)
{
    if (!ckpt_mem_is_id(id)) return -EINVAL;
    const char *p = id + 4, *s1 = strchr(p, '/');
    if (!s1 || s1 - p > 63) return -EINVAL;
    memcpy(run_id, p, (size_t)(s1 - p));
    run_id[s1 - p] = '\0';
    const char *s2 = strchr(s1 + 1, '/');
    if (!s2 || s2 - s1 - 1 > 63) return -EINVAL;
    memcpy(tag, s1 + 1, (size_t)(s2 - s1 - 1));
    tag[s2 - s1 - 1] = '\0';
    const char *s3 = strchr(s2 + 1, '/');
    if (!s3 || s3 == s2 + 1 || s3 - s2 - 1 > 20) return -EINVAL;
    uint64_t st = 0;
    for (const char *c = s2 + 1; c < s3; c++) {
        if (*c < '0' || *c > '9') return -EINVAL;
        uint64_t d = (uint64_t)(*c - '0');
        if (st > UINT64_MAX / 10 || st * 10 > UINT64_MAX - d) return -EINVAL;
        st = st * 10 + d;
    }
    if (parse_u32(s3 + 1, strlen(s3 + 1), world) < 0 || *world < 1 || *world > CKPT_MAX_WORLD_SIZE)
        return -EINVAL;
    if (!ckpt_valid_name(run_id) || !ckpt_valid_name(tag)) return -EINVAL;
    *step = st;
    return 0;
}

/* Copy len bytes of rank r's slot at off, as the handle will read them. */
static int copy_rank(const mem_rank *r, void *dst, uint64_t off, uint64_t len, char *why, size_t why_len)
{
    if (r->rm) return remote_read(r, off, len, dst, why, why_len);
    uint64_t seq = r->seq;
    int rc = shmseg_copy_out(r->seg, r->slot, dst, off, len, &seq);
    if (rc == -EAGAIN || rc == -ENOENT) {
        log_why(why, why_len, "%s slot %d was rewritten while it was opened", shmseg_path(r->seg), r->slot);
        return -ESTALE;
    }
    if (rc < 0) log_why(why, why_len, "%s slot %d: %s", shmseg_path(r->seg), r->slot, strerror(-rc));
    return rc == -EINVAL ? -EBADMSG : rc;
}

static int cmp_chunk_off(const void *a, const void *b)
{
    const chunk *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Fill s from the chosen slots (one per rank). */
static int build_handle(ckpt_snapshot *s, slot_rec *const *pick, mem_src *m, char *why,
                        size_t why_len)
{
    const mhdr *h0 = &pick[0]->h;
    uint32_t W = h0->world;
    for (uint32_t r = 1; r < W; r++) {
        const mhdr *h = &pick[r]->h;
        int same = h->nbufs == h0->nbufs && h->chunk_bytes == h0->chunk_bytes && !strcmp(h->config_hash, h0->config_hash);
        for (uint32_t b = 0; same && b < h0->nbufs; b++)
            same = !strcmp(h->b[b].name, h0->b[b].name) && !strcmp(h->b[b].dtype, h0->b[b].dtype) &&
                   h->b[b].elem_bytes == h0->b[b].elem_bytes && h->b[b].total == h0->b[b].total;
        if (!same) {
            log_why(why, why_len, "rank %u's slot (%s) disagrees with rank 0's on buffers, chunking or config "
                    "hash", r, pick[r]->where);
            return -EBADMSG;
        }
    }
    s->step = h0->step;
    s->world_size = W;
    s->created = h0->created;
    s->chunk_max = h0->chunk_bytes;
    s->src_kind = CKPT_SRC_MEM;
    s->src_read = mem_src_read;
    s->run_id = strdup(h0->run_id);
    s->config_hash = strdup(h0->config_hash);
    s->files = calloc(W, sizeof *s->files);
    s->buffers = calloc(h0->nbufs ? h0->nbufs : 1, sizeof *s->buffers);
    if (!s->run_id || !s->config_hash || !s->files || !s->buffers) return -ENOMEM;
    s->nfiles = W;
    for (uint32_t r = 0; r < W; r++) {
        if (!(s->files[r].name = strdup(pick[r]->where))) return -ENOMEM;
        s->files[r].bytes = pick[r]->payload_bytes;
    }

    /* the trainer record: rank 0's */
    const slot_rec *p0 = pick[0];
    char *t = malloc(p0->h.trainer_len + 1);
    if (!t) return -ENOMEM;
    int rc = copy_rank(&m->r[0], t, p0->h.trainer_off, p0->h.trainer_len, why, why_len);
    if (rc == 0 && XXH3_64bits(t, p0->h.trainer_len) != p0->h.trainer_xxh) {
        log_why(why, why_len, "%s: trainer record checksum mismatch", p0->where);
        rc = -EBADMSG;
    }
    json_t *j = NULL;
    if (rc == 0) {
        json_error_t err;
        j = json_loadb(t, p0->h.trainer_len, JSON_REJECT_DUPLICATES, &err);
        if (!json_is_object(j)) {
            log_why(why, why_len, "%s: trainer record is not a JSON object", p0->where);
            rc = -EBADMSG;
        } else if (!(s->trainer_json = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS | JSON_REAL_PRECISION(17)))) {
            rc = -ENOMEM;
        }
    }
    json_decref(j);
    free(t);
    if (rc < 0) return rc;

    /* chunks: each rank's checksums, shard by shard */
    s->nbuffers = h0->nbufs;
    uint64_t nall = 0;
    for (uint32_t r = 0; r < W; r++) nall += pick[r]->h.nsums;
    if (nall > CKPT_MAX_CHUNKS) {
        log_why(why, why_len, "%" PRIu64 " chunks in all, more than the format's limit", nall);
        return -EBADMSG;
    }
    for (uint32_t b = 0; b < h0->nbufs; b++) {
        buffer *bb = &s->buffers[b];
        bb->name = strdup(h0->b[b].name);
        bb->dtype = strdup(h0->b[b].dtype);
        if (!bb->name || !bb->dtype) return -ENOMEM;
        bb->elem_bytes = h0->b[b].elem_bytes;
        bb->total_bytes = h0->b[b].total;
        size_t nb = 0;
        for (uint32_t r = 0; r < W; r++) nb += (size_t)nchunks_of(pick[r]->h.b[b].bytes, h0->chunk_bytes);
        bb->chunks = calloc(nb ? nb : 1, sizeof *bb->chunks);
        if (!bb->chunks) return -ENOMEM;
    }
    uint64_t cb = h0->chunk_bytes;
    for (uint32_t r = 0; r < W; r++) {
        const mhdr *h = &pick[r]->h;
        uint64_t *sums = malloc(h->nsums ? h->nsums * 8 : 8);
        if (!sums) return -ENOMEM;
        rc = copy_rank(&m->r[r], sums, h->sums_off, h->nsums * 8, why, why_len);
        uint64_t k = 0;
        for (uint32_t b = 0; rc == 0 && b < h->nbufs; b++) {
            buffer *bb = &s->buffers[b];
            for (uint64_t c = 0, idx = 0; c < h->b[b].bytes; c += cb, idx++) {
                chunk *ch = &bb->chunks[bb->nchunks++];
                ch->offset = h->b[b].offset + c;
                ch->bytes = h->b[b].bytes - c < cb ? h->b[b].bytes - c : cb;
                ch->file_offset = h->b[b].data_off + c;
                ch->stored_bytes = ch->bytes;
                ch->xxh_raw = ch->xxh_stored = sums[k++];
                ch->file = r;
                ch->filter = CKPT_FILTER_NONE;
                ch->codec_zstd = 0;
                ch->index = (uint32_t)idx;
                if (ch->bytes > s->max_raw) s->max_raw = s->max_stored = ch->bytes;
            }
        }
        free(sums);
        if (rc < 0) return rc;
    }
    /* the shards of the W ranks must cover each buffer exactly once */
    for (uint32_t b = 0; b < h0->nbufs; b++) {
        buffer *bb = &s->buffers[b];
        qsort(bb->chunks, bb->nchunks, sizeof *bb->chunks, cmp_chunk_off);
        uint64_t pos = 0;
        size_t i;
        for (i = 0; i < bb->nchunks && bb->chunks[i].offset == pos; i++) pos += bb->chunks[i].bytes;
        if (i != bb->nchunks || pos != bb->total_bytes) {
            log_why(why, why_len, "buffer %s: the ranks' shards do not cover its %" PRIu64 " bytes exactly once",
                    bb->name, bb->total_bytes);
            return -EBADMSG;
        }
    }
    return 0;
}

int ckpt_mem_snapshot_open(ckpt_snapshot **out, const char *path_prefix, const char *id, char *why,
                           size_t why_len)
{
    if (!path_prefix) {
        if (out) *out = NULL;
        log_why(why, why_len, "no memory tier path");
        return -EINVAL;
    }
    return ckpt_mem_snapshot_open_ex(out, path_prefix, id, NULL, 0, why, why_len);
}

int ckpt_mem_snapshot_open_ex(ckpt_snapshot **out, const char *path_prefix, const char *id,
                              const ckpt_mem_remote *remotes, size_t nremotes, char *why, size_t why_len)
{
    if (out) *out = NULL;
    char run_id[64], tag[64];
    uint64_t step;
    uint32_t W;
    if (!out || !id || parse_id(id, run_id, tag, &step, &W) < 0) {
        log_why(why, why_len, "not a memory snapshot id (mem:<run_id>/<tag>/<step>/<world_size>)");
        return -EINVAL;
    }
    int bad_remote = (!path_prefix && !nremotes) || (nremotes && !remotes);
    for (size_t k = 0; !bad_remote && k < nremotes; k++) bad_remote = !remotes[k].list || !remotes[k].read;
    if (bad_remote) {
        log_why(why, why_len, "no memory tier path and no usable remote");
        return -EINVAL;
    }
    scan sc;
    int rc = scan_run(path_prefix, remotes, nremotes, &sc);
    if (rc < 0) {
        log_why(why, why_len, "cannot scan memory segments under %s: %s", path_prefix, strerror(-rc));
        return rc;
    }
    slot_rec **pick = calloc(W, sizeof *pick);
    mem_src *m = calloc(1, sizeof *m);
    ckpt_snapshot *s = ckpt_snapshot_alloc(id);
    if (m) {
        m->r = calloc(W, sizeof *m->r);
        m->segs = calloc(sc.nsegs ? sc.nsegs : 1, sizeof *m->segs);
    }
    if (m && nremotes && (m->remotes = calloc(nremotes, sizeof *m->remotes)) != NULL) {
        memcpy(m->remotes, remotes, nremotes * sizeof *remotes);
        m->nremotes = nremotes;
    }
    if (!pick || !m || !m->r || !m->segs || !s || (nremotes && !m->remotes)) {
        rc = -ENOMEM;
        goto out;
    }
    m->world = W;
    if (sc.nrecs) qsort(sc.recs, sc.nrecs, sizeof *sc.recs, cmp_rec); /* own before replica per rank */
    for (size_t i = 0; i < sc.nrecs; i++) {
        slot_rec *r = &sc.recs[i];
        if (r->h.step == step && r->h.world == W && !strcmp(r->h.run_id, run_id) && !strcmp(r->h.tag, tag) &&
            !pick[r->h.rank])
            pick[r->h.rank] = r;
    }
    for (uint32_t r = 0; r < W; r++)
        if (!pick[r]) {
            log_why(why, why_len, "%s: rank %u of %u has no verified slot under %s%s%s", id, r, W,
                    path_prefix ? path_prefix : "(no local path)", nremotes ? " nor on the remotes" : "",
                    sc.nbad ? " (some slots failed their header checks)" : "");
            rc = -ENOENT;
            goto out;
        }
    /* keep the segments the picked slots are in; the handle owns them from here */
    for (size_t i = 0; i < sc.nsegs; i++) {
        int used = 0;
        for (uint32_t r = 0; r < W && !used; r++) used = pick[r]->remote < 0 && pick[r]->seg == i;
        if (!used) continue;
        for (uint32_t r = 0; r < W; r++)
            if (pick[r]->remote < 0 && pick[r]->seg == i)
                m->r[r] = (mem_rank){sc.segs[i].seg, pick[r]->slot, pick[r]->seq, pick[r]->kind, NULL, 0, ""};
        m->segs[m->nsegs++] = sc.segs[i].seg;
        sc.segs[i].seg = NULL;
    }
    for (uint32_t r = 0; r < W; r++) {
        if (pick[r]->remote >= 0)
            m->r[r] = (mem_rank){NULL, -1, 0, CKPT_MEM_SRC_REMOTE, &m->remotes[pick[r]->remote], pick[r]->ref, ""};
        snprintf(m->r[r].where, sizeof m->r[r].where, "%s", pick[r]->where);
    }
    /* a restore copies every byte: fill the page tables in one batch rather than by a fault
     * per page (measured on a fresh 256 MiB mapping: first read 1.2 GB/s, later ones 5) */
    for (uint32_t r = 0; r < W; r++)
        if (m->r[r].seg) (void)shmseg_prefault(m->r[r].seg, m->r[r].slot, pick[r]->payload_bytes);
    s->src_ctx = m;
    s->src_close = mem_src_close;
    m = NULL;
    rc = build_handle(s, pick, s->src_ctx, why, why_len);
out:
    scan_free(&sc);
    free(pick);
    mem_src_close(m);
    if (rc < 0) {
        ckpt_snapshot_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* ------------------------------------------------------------------ flush */

/* The newest committed disk snapshot of any run in the listing (its index), -1 when none. Any
 * run: a flushed step below another run's newer snapshot would block continuing there
 * (train's "later snapshots in the way"). */
static ptrdiff_t disk_newest(const ckpt_entry *e, size_t n)
{
    ptrdiff_t best = -1;
    for (size_t i = 0; i < n; i++)
        if (e[i].status == CKPT_STATUS_COMMITTED && (best < 0 || e[i].step > e[best].step)) best = (ptrdiff_t)i;
    return best;
}

/* Read memory snapshot `id` whole, let check judge it, and save it to dir as a world of one. */
static int flush_one(const char *prefix, const char *id, const ckpt_save_opts *opts, ckpt_mem_check_fn check,
                     void *check_ctx, char *why, size_t why_len)
{
    ckpt_snapshot *s;
    int rc = ckpt_mem_snapshot_open(&s, prefix, id, why, why_len);
    if (rc < 0) return rc;
    ckpt_snapshot_set_threads(s, 4);
    size_t nb = ckpt_snapshot_nbuffers(s);
    uint64_t total = 0;
    ckpt_buffer bufs[CKPT_MEM_MAX_BUFFERS];
    ckpt_buffer_info bi[CKPT_MEM_MAX_BUFFERS];
    for (size_t i = 0; i < nb; i++) {
        ckpt_snapshot_buffer_info(s, i, &bi[i]);
        total += round_up(bi[i].total_bytes, 4096);
    }
    uint8_t *mem = NULL;
    if (total) {
        void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            ckpt_snapshot_close(s);
            log_why(why, why_len, "cannot allocate %" PRIu64 " bytes for the flush", total);
            return -ENOMEM;
        }
        mem = p;
    }
    uint64_t off = 0;
    char bad[512] = "";
    for (size_t i = 0; i < nb && rc == 0; i++) {
        bufs[i] = (ckpt_buffer){bi[i].name, bi[i].dtype, bi[i].elem_bytes, bi[i].total_bytes, 0,
                                bi[i].total_bytes, bi[i].total_bytes ? mem + off : NULL};
        rc = ckpt_snapshot_read(s, bi[i].name, 0, bi[i].total_bytes, mem + off, bad, sizeof bad);
        if (rc < 0) log_why(why, why_len, "%s: %s", id, bad[0] ? bad : strerror(-rc));
        off += round_up(bi[i].total_bytes, 4096);
    }
    if (rc == 0 && check) {
        /* what a restore checks, before anything is committed: a snapshot the restore would
         * reject and set aside must not become the newest one on disk */
        char cw[512] = "";
        rc = check(check_ctx, s, bufs, nb, cw, sizeof cw);
        if (rc > 0) rc = -EBADMSG;
        if (rc < 0) log_why(why, why_len, "%s: rejected by the caller's check: %s", id, cw[0] ? cw : strerror(-rc));
    }
    if (rc == 0) {
        ckpt_save_opts o = *opts;
        uint64_t cb = ckpt_fit_chunk_bytes(o.chunk_bytes, bufs, nb, 1);
        if (cb) o.chunk_bytes = cb;
        ckpt_save_stats st = {0};
        rc = ckpt_save(&o, ckpt_snapshot_step(s), ckpt_snapshot_run_id(s), ckpt_snapshot_config_hash(s), bufs, nb,
                       ckpt_snapshot_trainer_json(s), &st);
        if (rc < 0)
            log_why(why, why_len, "saving %s to %s failed: %s", id, o.dir, strerror(-rc));
        else
            log_why(why, why_len, "flushed memory snapshot %s (%d of %u ranks from replicas) to %s: %.1f MiB in "
                    "%.0f ms", id, ckpt_mem_snapshot_replicas(s), ckpt_snapshot_world_size(s), o.dir,
                    (double)st.raw_bytes / 1048576.0, st.seconds * 1e3);
    }
    if (mem) munmap(mem, total);
    ckpt_snapshot_close(s);
    return rc;
}

int64_t ckpt_mem_flush(const char *path_prefix, const char *ckpt_dir, const ckpt_save_opts *opts,
                       const char *run_id, char *why, size_t why_len)
{
    return ckpt_mem_flush_checked(path_prefix, ckpt_dir, opts, run_id, NULL, NULL, why, why_len);
}

int64_t ckpt_mem_flush_checked(const char *path_prefix, const char *ckpt_dir, const ckpt_save_opts *opts,
                               const char *run_id, ckpt_mem_check_fn check, void *check_ctx, char *why,
                               size_t why_len)
{
    if (!path_prefix || !ckpt_dir || strlen(ckpt_dir) >= CKPT_PATH_MAX - 128) return -EINVAL;
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    if (opts) o = *opts;
    o.dir = ckpt_dir;
    ckpt_dir_lock *lock = NULL;
    long holder = 0;
    int rc = ckpt_dir_lock_acquire_owned(ckpt_dir, o.lock_owner, &lock, &holder, NULL, 0);
    if (rc < 0) {
        if (rc == -EBUSY) log_why(why, why_len, "%s is locked by process %ld", ckpt_dir, holder);
        else log_why(why, why_len, "cannot lock %s: %s", ckpt_dir, strerror(-rc));
        return rc;
    }
    ckpt_mem_entry *me = NULL;
    ckpt_entry *de = NULL;
    size_t nm = 0, nd = 0;
    int64_t result = 0;
    if ((rc = ckpt_mem_list(path_prefix, &me, &nm)) < 0) {
        log_why(why, why_len, "cannot list memory snapshots under %s: %s", path_prefix, strerror(-rc));
        result = rc;
        goto out;
    }
    if ((rc = ckpt_list(ckpt_dir, &de, &nd)) < 0) {
        log_why(why, why_len, "cannot list %s: %s", ckpt_dir, strerror(-rc));
        result = rc;
        goto out;
    }
    int tried = 0, first_err = 0;
    uint64_t newest_mem = 0;
    const ckpt_mem_entry *other = NULL; /* a complete one of another run (run_id given) */
    const ptrdiff_t dn = disk_newest(de, nd);
    const uint64_t disk_step = dn >= 0 ? de[dn].step : 0;
    for (size_t i = 0; i < nm; i++) {
        const ckpt_mem_entry *e = &me[i];
        if (e->status != CKPT_MEM_COMPLETE || e->step == 0) continue;
        if (run_id && strcmp(run_id, e->run_id) != 0) {
            if (!other) other = e;
            continue;
        }
        if (!newest_mem) newest_mem = e->step;
        if (e->step <= disk_step) continue;
        char w[512] = "";
        tried++;
        rc = flush_one(path_prefix, e->id, &o, check, check_ctx, w, sizeof w);
        if (rc == 0) {
            LOG_I(TAG, "%s", w);
            log_why(why, why_len, "%s", w);
            result = (int64_t)e->step;
            goto out;
        }
        LOG_W(TAG, "memory snapshot %s not flushed: %s", e->id, w[0] ? w : strerror(-rc));
        if (!first_err) {
            first_err = rc;
            log_why(why, why_len, "memory snapshot %s not flushed: %s", e->id, w[0] ? w : strerror(-rc));
        }
    }
    if (tried) result = first_err;
    else if (newest_mem)
        log_why(why, why_len, "nothing to flush: the newest memory snapshot (step %" PRIu64 ") is not newer than "
                "the newest committed snapshot in %s (%s, run %s)", newest_mem, ckpt_dir, de[dn].name,
                de[dn].run_id[0] ? de[dn].run_id : "?");
    else if (other)
        log_why(why, why_len, "nothing to flush: the complete memory snapshots under %s belong to other runs "
                "(such as %s), none to run %s", path_prefix, other->id, run_id);
    else
        log_why(why, why_len, "nothing to flush: no complete memory snapshot under %s", path_prefix);
out:
    free(me);
    free(de);
    ckpt_dir_lock_release(lock);
    return result;
}
