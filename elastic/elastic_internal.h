/* elastic_internal.h - wire constants and helpers shared by the files of elastic/ (not part
 * of the public API). The protocol itself is specified in store.h ("Format spec"). */
#ifndef ELASTIC_INTERNAL_H
#define ELASTIC_INTERNAL_H

#include "clock.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define ES_TAG "elastic"

#define ES_MAGIC "ESTR"
#define ES_HDR 9u          /* len:u32 | op:u8 | id:u32 */
#define ES_RESP 0x80u      /* response op = request op | ES_RESP */

enum es_op {
    ES_OP_HELLO = 0x01,
    ES_OP_SET = 0x02,
    ES_OP_GET = 0x03,
    ES_OP_WAIT = 0x04,
    ES_OP_ADD = 0x05,
    ES_OP_CAS = 0x06,
    ES_OP_DELETE = 0x07,
};

enum es_status {
    ES_ST_OK = 0,
    ES_ST_TIMEDOUT = 1,
    ES_ST_DENIED = 2,
    ES_ST_VERSION = 3,
    ES_ST_TOOBIG = 4,
    ES_ST_INVALID = 5,
    ES_ST_NOTFOUND = 6,
    ES_ST_RANGE = 7,
    ES_ST_NOMEM = 8,
};

/* Largest request len the server accepts after the HELLO (store.h "Rules"). */
static inline uint64_t es_frame_limit(uint32_t max_key, uint32_t max_value)
{
    return 64u + (uint64_t)max_key + 2u * (uint64_t)max_value;
}

static inline void es_put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void es_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline void es_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint16_t es_get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t es_get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static inline uint64_t es_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Bounds-checked reader over a frame body. A read past the end sets bad and yields zeros. */
typedef struct es_reader {
    const uint8_t *p;
    size_t left;
    int bad;
} es_reader;

static inline int es_rd_take(es_reader *r, size_t n, const uint8_t **out)
{
    if (r->bad || r->left < n) {
        r->bad = 1;
        *out = NULL;
        return -1;
    }
    *out = r->p;
    r->p += n;
    r->left -= n;
    return 0;
}

static inline uint8_t es_rd_u8(es_reader *r)
{
    const uint8_t *p;
    return es_rd_take(r, 1, &p) ? 0 : p[0];
}

static inline uint16_t es_rd_u16(es_reader *r)
{
    const uint8_t *p;
    return es_rd_take(r, 2, &p) ? 0 : es_get_u16(p);
}

static inline uint32_t es_rd_u32(es_reader *r)
{
    const uint8_t *p;
    return es_rd_take(r, 4, &p) ? 0 : es_get_u32(p);
}

static inline uint64_t es_rd_u64(es_reader *r)
{
    const uint8_t *p;
    return es_rd_take(r, 8, &p) ? 0 : es_get_u64(p);
}

/* bytes := n:u32 | n bytes; *len gets n. */
static inline const uint8_t *es_rd_bytes(es_reader *r, uint32_t *len)
{
    const uint8_t *p;
    *len = es_rd_u32(r);
    if (es_rd_take(r, *len, &p)) *len = 0;
    return p;
}

/* ceil(x) for the deadline arithmetic, without libm; x <= 0 gives 0. */
static inline double es_ceil(double x)
{
    if (!(x > 0)) return 0;
    if (x >= 9e15) return x;
    double t = (double)(long long)x;
    return t < x ? t + 1 : t;
}

#endif /* ELASTIC_INTERNAL_H */
