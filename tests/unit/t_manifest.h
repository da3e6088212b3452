/* t_manifest.h - editing snapshot manifests in tests: change the body and reseal the checksum
 * the way ckpt_write.c write_manifest does, so that a test reaches the checks behind it.
 * Include after t_helpers.h. */
#ifndef T_MANIFEST_H
#define T_MANIFEST_H

#include "ckpt_internal.h"

#include <xxhash.h>

/* Rewrite the manifest of snapshot folder `snap`: the body (bytes before the last checksum
 * member) gets its first occurrence of `from` replaced with `to`, and the checksum is
 * recomputed the way ckpt_write.c write_manifest does (xxh3-64 over the body bytes). */
static inline int rewrite_manifest(const char *snap, const char *from, const char *to)
{
    char *mp = t_path_in(snap, CKPT_MANIFEST_NAME);
    unsigned char *text = NULL;
    long long n = t_slurp(mp, &text);
    int rc = -1;
    if (n < 0) goto out;
    const char *key = CKPT_MANIFEST_SUM_KEY, *last = NULL;
    for (const char *p = (const char *)text; (p = strstr(p, key)) != NULL; p++) last = p;
    if (!last) goto out;
    size_t blen = (size_t)(last - (const char *)text);
    char *body = malloc(blen + 1);
    if (!body) goto out;
    memcpy(body, text, blen);
    body[blen] = 0;
    char *hit = strstr(body, from);
    if (!hit) {
        fprintf(stderr, "rewrite_manifest: '%s' not in manifest\n", from);
        free(body);
        goto out;
    }
    size_t flen = strlen(from), tlen = strlen(to);
    size_t nlen = blen - flen + tlen;
    char *nb = malloc(nlen + strlen(key) + 16 + 4);
    if (!nb) {
        free(body);
        goto out;
    }
    size_t pre = (size_t)(hit - body);
    memcpy(nb, body, pre);
    memcpy(nb + pre, to, tlen);
    memcpy(nb + pre + tlen, hit + flen, blen - pre - flen);
    char hex[17];
    ckpt_hex64(XXH3_64bits(nb, nlen), hex);
    size_t k = nlen;
    memcpy(nb + k, key, strlen(key));
    k += strlen(key);
    memcpy(nb + k, hex, 16);
    k += 16;
    memcpy(nb + k, "\"}\n", 3);
    k += 3;
    rc = t_spit(mp, nb, k);
    free(nb);
    free(body);
out:
    free(text);
    free(mp);
    return rc;
}

#endif /* T_MANIFEST_H */
