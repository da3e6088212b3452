/* shmseg-tool: write and inspect common/shmseg.h segments from the integration tests (the
 * memory tier's fake workers, test_mem_agent.py).
 *
 *   shmseg-tool write PATH SLOT_BYTES STEP NBYTES SEED
 *       create (or reuse) the segment at PATH with SLOT_BYTES per slot, fill a slot
 *       (shmseg_begin(-1)) with NBYTES pseudo-random bytes drawn from SEED, commit it with
 *       STEP; prints "slot=<i> seq=<s> step=<t> bytes=<n> xxh=<XXH3-64 of the bytes, hex>".
 *   shmseg-tool info PATH
 *       the newest complete slot of PATH, the same line (exit 1 when none is complete);
 *       a slot in state writing is printed as "slot=<i> state=writing" first.
 *   shmseg-tool forge PATH step N | swap
 *       forge the newest complete slot of PATH, a memory snapshot (ckpt/ckpt_mem.h), as a
 *       hostile writer would and reseal it so that every checksum still holds: "step N"
 *       writes N as the payload's and the slot header's step; "swap" swaps the names of its
 *       buffers 0 and 1. The header checksum and the slot's payload_xxh3 are recomputed
 *       (the chunk checksums stay right: no data byte changes). Prints the slot line.
 * Exit status: 0, 1 (an error, one line on stderr), 2 usage.
 */
#include "shmseg.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static void print_slot(shmseg *seg, int slot, const shmseg_info *in)
{
    unsigned long long h = XXH3_64bits(shmseg_payload(seg, slot), (size_t)in->payload_bytes);
    printf("slot=%d seq=%" PRIu64 " step=%" PRIu64 " bytes=%" PRIu64 " xxh=%016llx\n", slot,
           in->seq, in->step, in->payload_bytes, h);
}

int main(int argc, char **argv)
{
    shmseg *seg = NULL;
    shmseg_info in;
    int slot, rc;
    if (argc == 7 && !strcmp(argv[1], "write")) {
        uint64_t sb = strtoull(argv[3], NULL, 10), step = strtoull(argv[4], NULL, 10);
        uint64_t n = strtoull(argv[5], NULL, 10), x = strtoull(argv[6], NULL, 10) * 2654435761u + 1;
        if ((rc = shmseg_create(argv[2], 2, sb, &seg)) < 0 || (rc = shmseg_begin(seg, -1, &slot)) < 0) {
            fprintf(stderr, "shmseg-tool: %s: %s\n", argv[2], strerror(-rc));
            return 1;
        }
        unsigned char *p = shmseg_payload(seg, slot);
        if (n > shmseg_slot_bytes(seg)) n = shmseg_slot_bytes(seg);
        for (uint64_t i = 0; i < n; i++) { /* xorshift64 */
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            p[i] = (unsigned char)(x >> 24);
        }
        if ((rc = shmseg_commit(seg, slot, n, step)) < 0 || (rc = shmseg_slot_info(seg, slot, &in)) < 0) {
            fprintf(stderr, "shmseg-tool: %s: commit: %s\n", argv[2], strerror(-rc));
            return 1;
        }
        print_slot(seg, slot, &in);
        shmseg_close(seg);
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "info")) {
        if ((rc = shmseg_open(argv[2], 0, &seg)) < 0) {
            fprintf(stderr, "shmseg-tool: %s: %s\n", argv[2], strerror(-rc));
            return 1;
        }
        for (int i = 0; i < shmseg_nslots(seg); i++)
            if (shmseg_slot_info(seg, i, &in) == 0 && in.state == SHMSEG_WRITING)
                printf("slot=%d state=writing\n", i);
        if ((rc = shmseg_newest(seg, &slot)) < 0 || (rc = shmseg_slot_info(seg, slot, &in)) < 0) {
            fprintf(stderr, "shmseg-tool: %s: no complete slot: %s\n", argv[2], strerror(-rc));
            return 1;
        }
        print_slot(seg, slot, &in);
        shmseg_close(seg);
        return 0;
    }
    if ((argc == 5 && !strcmp(argv[1], "forge") && !strcmp(argv[3], "step")) ||
        (argc == 4 && !strcmp(argv[1], "forge") && !strcmp(argv[3], "swap"))) {
        if ((rc = shmseg_open(argv[2], 1, &seg)) < 0 || (rc = shmseg_newest(seg, &slot)) < 0 ||
            (rc = shmseg_slot_info(seg, slot, &in)) < 0) {
            fprintf(stderr, "shmseg-tool: %s: %s\n", argv[2], strerror(-rc));
            return 1;
        }
        unsigned char *p = shmseg_payload(seg, slot);
        uint64_t step = in.step;
        if (argc == 5) {
            step = strtoull(argv[4], NULL, 10);
            memcpy(p + 16, &step, 8); /* payload header: step u64 at 16 */
        } else {
            unsigned char t[64]; /* bufs[16] at 280, 120 bytes each, name[64] first */
            memcpy(t, p + 280, 64);
            memcpy(p + 280, p + 400, 64);
            memcpy(p + 400, t, 64);
        }
        uint64_t h = XXH3_64bits(p, 2200); /* header_xxh3 at 2200 over [0, 2200) */
        memcpy(p + 2200, &h, 8);
        /* the slot header (common/shmseg.h): payload_xxh3 u64 at 24, step u64 at 32, at
         * 4096 + slot * (4096 + slot_bytes) */
        unsigned char *sh = p - 4096;
        uint64_t ph = XXH3_64bits(p, in.payload_bytes < 4096 ? in.payload_bytes : 4096);
        memcpy(sh + 24, &ph, 8);
        memcpy(sh + 32, &step, 8);
        if ((rc = shmseg_slot_info(seg, slot, &in)) < 0 || !shmseg_head_ok(seg, slot, &in)) {
            fprintf(stderr, "shmseg-tool: %s: the reseal did not hold\n", argv[2]);
            return 1;
        }
        print_slot(seg, slot, &in);
        shmseg_close(seg);
        return 0;
    }
    fprintf(stderr, "usage: shmseg-tool write PATH SLOT_BYTES STEP NBYTES SEED | info PATH | "
            "forge PATH step N | forge PATH swap\n");
    return 2;
}
