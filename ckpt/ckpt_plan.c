/* Re-sharding planner: range arithmetic over shard bounds, and chunk plans over a snapshot. */
#include "ckpt_plan.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* A row of world+1 bounds: starts at 0 and never decreases. */
static int row_ok(const uint64_t *row, uint32_t world)
{
    if (row[0] != 0) return 0;
    for (uint32_t i = 0; i < world; i++)
        if (row[i + 1] < row[i]) return 0;
    return 1;
}

/* Walk the intersections of one buffer's old and new rows in offset order (two pointers:
 * each step advances past the range that ends first). count != NULL: count pieces per new
 * rank; otherwise place each piece at out[next[new_rank]++]. */
static void merge_rows(uint32_t buffer, uint32_t ow, const uint64_t *ob, uint32_t nw,
                       const uint64_t *nb, size_t *count, size_t *next, ckpt_plan_piece *out)
{
    uint32_t i = 0, j = 0;
    while (i < ow && j < nw) {
        uint64_t lo = ob[i] > nb[j] ? ob[i] : nb[j];
        uint64_t hi = ob[i + 1] < nb[j + 1] ? ob[i + 1] : nb[j + 1];
        if (lo < hi) {
            if (count) count[j]++;
            else out[next[j]++] = (ckpt_plan_piece){buffer, j, i, lo, hi - lo};
        }
        if (ob[i + 1] < nb[j + 1]) i++;
        else if (ob[i + 1] > nb[j + 1]) j++;
        else {
            i++;
            j++;
        }
    }
}

int ckpt_plan_reshard(size_t nbuffers, uint32_t old_world, const uint64_t *old_bounds,
                      uint32_t new_world, const uint64_t *new_bounds, ckpt_plan_piece **out,
                      size_t *npieces)
{
    if (!out || !npieces) return -EINVAL;
    *out = NULL;
    *npieces = 0;
    if (old_world == 0 || new_world == 0) return -EINVAL;
    if (nbuffers == 0) return 0;
    if (!old_bounds || !new_bounds) return -EINVAL;
    if (nbuffers > UINT32_MAX) return -EOVERFLOW;
    const size_t ostride = (size_t)old_world + 1, nstride = (size_t)new_world + 1;
    if (nbuffers > SIZE_MAX / ostride || nbuffers > SIZE_MAX / nstride) return -EOVERFLOW;
    for (size_t b = 0; b < nbuffers; b++) {
        const uint64_t *ob = old_bounds + b * ostride, *nb = new_bounds + b * nstride;
        if (!row_ok(ob, old_world) || !row_ok(nb, new_world) || ob[old_world] != nb[new_world])
            return -EINVAL;
    }

    /* pass 1: pieces per new rank; pass 2: place them (a counting sort by new rank, and
     * buffer-major emission keeps (buffer, offset) order inside each rank) */
    size_t *count = calloc(nstride, sizeof *count);
    if (!count) return -ENOMEM;
    for (size_t b = 0; b < nbuffers; b++)
        merge_rows((uint32_t)b, old_world, old_bounds + b * ostride, new_world,
                   new_bounds + b * nstride, count, NULL, NULL);
    size_t total = 0;
    for (uint32_t r = 0; r < new_world; r++) {
        size_t c = count[r];
        count[r] = total; /* now the first slot of rank r */
        if (c > SIZE_MAX - total) {
            free(count);
            return -EOVERFLOW;
        }
        total += c;
    }
    if (total == 0) {
        free(count);
        return 0;
    }
    if (total > SIZE_MAX / sizeof(ckpt_plan_piece)) {
        free(count);
        return -EOVERFLOW;
    }
    ckpt_plan_piece *p = malloc(total * sizeof *p);
    if (!p) {
        free(count);
        return -ENOMEM;
    }
    for (size_t b = 0; b < nbuffers; b++)
        merge_rows((uint32_t)b, old_world, old_bounds + b * ostride, new_world,
                   new_bounds + b * nstride, NULL, count, p);
    free(count);
    *out = p;
    *npieces = total;
    return 0;
}

/* Bound r of the even partition (see ckpt_even_bounds), in O(1). */
static uint64_t even_bound(uint64_t total, uint64_t align, uint32_t world, uint32_t r)
{
    if (align == 0) align = 1;
    uint64_t n = total / align + (total % align != 0);
    uint64_t q = n / world, rem = n % world;
    uint64_t units = (uint64_t)r * q + (r < rem ? r : rem); /* <= n */
    /* units < n means units * align < total: no overflow */
    return units >= n ? total : units * align;
}

void ckpt_even_bounds(uint64_t total, uint64_t align, uint32_t world, uint64_t *bounds)
{
    if (world == 0 || !bounds) return;
    for (uint32_t r = 0; r <= world; r++) bounds[r] = even_bound(total, align, world, r);
}

int ckpt_snapshot_plan(const ckpt_snapshot *s, uint64_t align, uint32_t new_world,
                       ckpt_rank_reads *out)
{
    if (!s || !out || align == 0 || new_world == 0) return -EINVAL;
    size_t nb = ckpt_snapshot_nbuffers(s), nf = ckpt_snapshot_nfiles(s);
    /* cursor[b]: first chunk of buffer b that the next rank may need (ranges only move
     * forward with r); stamp[f] = r + 1 once rank r has counted file f */
    size_t *cursor = calloc(nb ? nb : 1, sizeof *cursor);
    uint32_t *stamp = calloc(nf ? nf : 1, sizeof *stamp);
    uint64_t *total = calloc(nb ? nb : 1, sizeof *total);
    size_t *nchunks = calloc(nb ? nb : 1, sizeof *nchunks);
    int rc = 0;
    if (!cursor || !stamp || !total || !nchunks) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t b = 0; b < nb; b++) {
        ckpt_buffer_info bi;
        if ((rc = ckpt_snapshot_buffer_info(s, b, &bi)) < 0) goto out;
        total[b] = bi.total_bytes;
        nchunks[b] = bi.nchunks;
    }
    memset(out, 0, (size_t)new_world * sizeof *out);
    for (uint32_t r = 0; r < new_world; r++) {
        ckpt_rank_reads *o = &out[r];
        for (size_t b = 0; b < nb; b++) {
            uint64_t lo = even_bound(total[b], align, new_world, r);
            uint64_t hi = even_bound(total[b], align, new_world, r + 1);
            if (lo == hi) continue;
            o->need_bytes += hi - lo;
            size_t j = cursor[b];
            ckpt_chunk_info k = {0, 0, 0, 0, 0};
            for (; j < nchunks[b]; j++) { /* first chunk that ends after lo */
                if ((rc = ckpt_snapshot_chunk_info(s, b, j, &k)) < 0) goto out;
                if (k.offset + k.bytes > lo) break;
            }
            while (j < nchunks[b]) { /* k holds chunk j here */
                o->read_raw_bytes += k.bytes;
                o->read_stored_bytes += k.stored_bytes;
                o->chunks++;
                if (stamp[k.file] != r + 1) {
                    stamp[k.file] = r + 1;
                    o->files++;
                }
                if (k.offset + k.bytes >= hi) break; /* the last chunk of the range */
                if (++j < nchunks[b] && (rc = ckpt_snapshot_chunk_info(s, b, j, &k)) < 0)
                    goto out;
            }
            /* the next rank starts at hi: at chunk j itself when it straddles hi */
            cursor[b] = j < nchunks[b] && k.offset + k.bytes == hi ? j + 1 : j;
        }
    }
out:
    free(cursor);
    free(stamp);
    free(total);
    free(nchunks);
    return rc;
}
