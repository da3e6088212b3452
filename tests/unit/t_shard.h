/* t_shard.h - writes llm.c token shards (train/data.h layout) for the data tests. */
#ifndef T_SHARD_H
#define T_SHARD_H

#include "data.h"
#include "t_helpers.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HDR_BYTES (TRAIN_SHARD_HEADER_INTS * 4)

/* A shard file with the given header fields (the rest of the header zero) and tokens.
 * Returns 0 or -1. */
static inline int write_shard(const char *path, int32_t magic, int32_t version, int32_t count,
                              const uint16_t *tok, size_t ntok)
{
    size_t bytes = HDR_BYTES + 2 * ntok;
    unsigned char *b = calloc(1, bytes);
    if (!b) return -1;
    int32_t h[3] = {magic, version, count};
    memcpy(b, h, sizeof h);
    if (ntok) memcpy(b + HDR_BYTES, tok, 2 * ntok);
    int rc = t_spit(path, b, bytes);
    free(b);
    return rc;
}

#endif /* T_SHARD_H */
