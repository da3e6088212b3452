/* fuzz_chunk.c - libFuzzer harness: the chunk decoder (read stored bytes, check xxh3_stored,
 * decode the zstd frame to exactly `bytes`, undo the shuffle filter, check xxh3_raw), reached
 * through the public reader (ckpt_snapshot_verify and ckpt_snapshot_read).
 *
 * The decoder is a static function of ckpt/ckpt_read.c (load_chunk) that needs an open
 * snapshot anyway (file table, reading threads, io_uring readers), so the harness builds a
 * real one-chunk snapshot around the fuzzed bytes instead of exposing internals: the layout
 * is always valid, so every input reaches the decoder.
 *
 * Input: an 8-byte header, then the chunk's stored bytes (the data file rank-00000.bin).
 *   byte 0, bit 0: codec zstd (else none: stored raw, bytes = stored_bytes)
 *           bit 1: filter shuffle
 *           bits 2-3: elem_bytes 1, 2, 4 or 8
 *           bit 4: xxh3_stored wrong (else right)
 *           bit 5: xxh3_raw wrong (else right, whenever the harness can decode the chunk)
 *           bit 6: a second, valid raw chunk of 4096 bytes follows in the same file
 *           bit 7: two reading threads (else one)
 *   byte 1, bit 0: zstd: bytes = the frame's declared content size when it has one of at
 *           most 1 MiB (else from bytes 2-3)
 *   bytes 2-3: zstd: bytes = this + 1 (1..65536) unless taken from the frame
 *   bytes 4-7: where the range read starts and how long it is
 *
 * The harness decodes the chunk itself (libzstd's one-shot API and the shuffle of
 * docs/FORMAT.md written out again here), so it knows the answer: verify must succeed
 * exactly when the stored checksum is right, the frame decodes to `bytes` bytes and the raw
 * checksum is right, and fail with -EBADMSG and a one-line reason otherwise; reads must
 * return the reference bytes, whole and for the range. A disagreement aborts (a finding).
 * FUZZ_LAX=1 relaxes the error code and reason checks (see fuzz_manifest.c).
 */
#include "ckpt.h"
#include "fz_util.h"
#include "log.h"

#include <jansson.h>
#include <xxhash.h>
#include <zstd.h>

#define RAW_MAX (1u << 20) /* largest raw chunk the harness makes (chunk_bytes) */
#define TAIL_BYTES 4096u   /* the optional second chunk */

static char g_root[4096];
static char g_snap[4200];
static char g_data[4300];
static char g_manifest[4300];
static int g_lax;
static uint8_t *g_ref;  /* reference raw bytes: RAW_MAX + TAIL_BYTES */
static uint8_t *g_filt; /* reference decode before unshuffling */
static uint8_t *g_out;  /* what the reader returned */
static ZSTD_DCtx *g_dctx;

static void cleanup(void)
{
    if (g_root[0]) fz_rmrf(g_root);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    log_set_level(LOG_ERROR);
    const char *lax = getenv("FUZZ_LAX");
    g_lax = lax && *lax && strcmp(lax, "0") != 0;
    fz_mkdtemp(g_root, sizeof g_root, "fuzz-chunk");
    atexit(cleanup);
    snprintf(g_snap, sizeof g_snap, "%s/snap", g_root);
    snprintf(g_data, sizeof g_data, "%s/rank-00000.bin", g_snap);
    snprintf(g_manifest, sizeof g_manifest, "%s/manifest.json", g_snap);
    FZ_SETUP(mkdir(g_snap, 0755) == 0, g_snap);
    g_ref = malloc(RAW_MAX + TAIL_BYTES);
    g_filt = malloc(RAW_MAX);
    g_out = malloc(RAW_MAX + TAIL_BYTES);
    g_dctx = ZSTD_createDCtx();
    errno = ENOMEM;
    FZ_SETUP(g_ref && g_filt && g_out && g_dctx, "buffers");
    return 0;
}

/* docs/FORMAT.md, "Shuffle filter", inverted: byte k of element i is at k*c + i. */
static void unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t e)
{
    size_t c = n / e;
    for (size_t k = 0; k < e; k++)
        for (size_t i = 0; i < c; i++) dst[i * e + k] = src[k * c + i];
    memcpy(dst + c * e, src + c * e, n - c * e);
}

static void tail_bytes(uint8_t *out)
{
    for (size_t i = 0; i < TAIL_BYTES; i++) out[i] = (uint8_t)(i * 7u + 3u);
}

static void hex64(uint64_t v, char out[17]) { snprintf(out, 17, "%016llx", (unsigned long long)v); }

static json_t *chunk_json(uint64_t off, uint64_t bytes, uint64_t foff, uint64_t sb, int zstd,
                          int shuffled, uint64_t xraw, uint64_t xst)
{
    char hraw[17], hst[17];
    hex64(xraw, hraw);
    hex64(xst, hst);
    return json_pack("{s:I, s:I, s:I, s:I, s:s, s:s, s:s, s:s}", "offset", (json_int_t)off,
                     "bytes", (json_int_t)bytes, "file_offset", (json_int_t)foff,
                     "stored_bytes", (json_int_t)sb, "codec", zstd ? "zstd" : "none", "filter",
                     shuffled ? "shuffle" : "none", "xxh3_raw", hraw, "xxh3_stored", hst);
}

/* The sealed manifest of a one-file snapshot with the given chunk list (the writer's
 * serialisation: compact, sorted keys, then the checksum member). */
static void write_manifest(json_t *chunks, uint64_t total, uint64_t file_bytes, int elem_bytes)
{
    json_t *body = json_pack(
        "{s:s, s:i, s:I, s:I, s:i, s:s, s:s, s:I, s:[{s:s, s:i, s:I}], "
        "s:[{s:s, s:s, s:i, s:I, s:[{s:i, s:s, s:I, s:I, s:o}]}], s:{s:I}}",
        "format", "ckptsys.snapshot", "format_version", 1, "step", (json_int_t)7, "created_unix",
        (json_int_t)1700000000, "world_size", 1, "run_id", "fuzz-chunk", "config_hash",
        "0123456789abcdef", "chunk_bytes", (json_int_t)RAW_MAX, "files", "name", "rank-00000.bin",
        "rank", 0, "bytes", (json_int_t)file_bytes, "buffers", "name", "params", "dtype", "raw",
        "elem_bytes", elem_bytes, "total_bytes", (json_int_t)total, "shards", "rank", 0, "file",
        "rank-00000.bin", "offset", (json_int_t)0, "bytes", (json_int_t)total, "chunks", chunks,
        "trainer", "step", (json_int_t)7);
    errno = ENOMEM;
    FZ_SETUP(body != NULL, "manifest");
    char *text = json_dumps(body, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(body);
    FZ_SETUP(text != NULL, "manifest");
    size_t n = strlen(text) - 1; /* without the final '}' */
    static const char key[] = ",\"manifest_xxh3\":\"";
    char *file = malloc(n + sizeof key + 20);
    FZ_SETUP(file != NULL, "manifest");
    memcpy(file, text, n);
    memcpy(file + n, key, sizeof key - 1);
    hex64(XXH3_64bits(text, n), file + n + sizeof key - 1);
    memcpy(file + n + sizeof key - 1 + 16, "\"}\n", 3);
    FZ_SETUP(fz_write_file(g_manifest, file, n + sizeof key - 1 + 19) == 0, g_manifest);
    free(file);
    free(text);
}

static int one_line(const char *s) { return s[0] != '\0' && strchr(s, '\n') == NULL; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    uint8_t flags = fz_u8(&in), mode = fz_u8(&in);
    uint16_t hint = fz_u16(&in);
    uint32_t sel = fz_u32(&in);
    const uint8_t *stored = in.p;
    size_t slen = in.left;
    int zstd = flags & 1, shuffled = (flags >> 1) & 1, eb = 1 << ((flags >> 2) & 3);
    int bad_stored = (flags >> 4) & 1, bad_raw = (flags >> 5) & 1, tail = (flags >> 6) & 1;
    unsigned threads = 1 + ((flags >> 7) & 1);

    /* raw size: stored raw chunks are their stored bytes; zstd ones as the header says */
    uint64_t bytes = hint + 1u;
    if (!zstd) bytes = slen;
    else if (mode & 1) {
        unsigned long long fcs = ZSTD_getFrameContentSize(stored, slen);
        if (fcs != ZSTD_CONTENTSIZE_UNKNOWN && fcs != ZSTD_CONTENTSIZE_ERROR && fcs > 0 &&
            fcs <= RAW_MAX)
            bytes = fcs;
    }
    if (bytes == 0 || bytes > RAW_MAX) return 0; /* no chunk to make (an empty input) */
    /* FORMAT.md: a raw chunk is unfiltered, and a buffer holds whole elements */
    if (!zstd) shuffled = 0;
    while ((bytes + (tail ? TAIL_BYTES : 0)) % (uint64_t)eb) eb >>= 1;

    /* the reference decode */
    int decodes;
    uint8_t *dec = shuffled ? g_filt : g_ref;
    if (zstd) {
        /* exactly one frame (FORMAT.md: a zstd chunk is one frame) */
        size_t r = ZSTD_decompressDCtx(g_dctx, dec, (size_t)bytes, stored, slen);
        decodes = !ZSTD_isError(r) && r == bytes &&
                  ZSTD_findFrameCompressedSize(stored, slen) == slen;
    } else {
        memcpy(dec, stored, slen);
        decodes = 1;
    }
    if (decodes && shuffled) unshuffle(g_ref, g_filt, (size_t)bytes, (size_t)eb);
    uint64_t xst = XXH3_64bits(stored, slen) ^ (uint64_t)bad_stored;
    uint64_t xraw = (decodes ? XXH3_64bits(g_ref, (size_t)bytes) : 0x5eed) ^ (uint64_t)bad_raw;
    int expect_ok = !bad_stored && decodes && !bad_raw;

    /* the data file: the stored bytes, then the optional valid raw chunk */
    uint64_t total = bytes + (tail ? TAIL_BYTES : 0);
    json_t *chunks = json_array();
    json_array_append_new(chunks, chunk_json(0, bytes, 0, slen, zstd, shuffled, xraw, xst));
    uint8_t *file = malloc(slen + TAIL_BYTES + 1);
    FZ_SETUP(file != NULL, "data file");
    memcpy(file, stored, slen);
    if (tail) {
        tail_bytes(file + slen);
        memcpy(g_ref + bytes, file + slen, TAIL_BYTES);
        uint64_t x = XXH3_64bits(file + slen, TAIL_BYTES);
        json_array_append_new(chunks, chunk_json(bytes, TAIL_BYTES, slen, TAIL_BYTES, 0, 0, x, x));
    }
    size_t flen = slen + (tail ? TAIL_BYTES : 0);
    FZ_SETUP(fz_write_file(g_data, file, flen) == 0, g_data);
    free(file);
    write_manifest(chunks, total, flen, eb);

    ckpt_snapshot *s = NULL;
    char why[512] = "";
    int rc = ckpt_snapshot_open(&s, g_snap, why, sizeof why);
    if (zstd && (slen == 0 || slen > ZSTD_compressBound((size_t)bytes))) {
        /* more stored bytes than any frame of `bytes` bytes can take: a layout error */
        FZ_ASSERT(rc == -EBADMSG && why[0], "stored %zu > bound of %llu raw bytes: %d (%s)", slen,
                  (unsigned long long)bytes, rc, why);
        return 0;
    }
    FZ_ASSERT(rc == 0, "open of a valid layout failed: %s", why); /* valid by construction */
    FZ_ASSERT(ckpt_snapshot_set_threads(s, threads) == 0, "set_threads");

    char bad[512] = "";
    rc = ckpt_snapshot_verify(s, bad, sizeof bad, NULL, NULL);
    FZ_ASSERT((rc == 0) == expect_ok, "verify returned %d (%s), the reference decode says %s "
              "(stored checksum %s, frame %s, raw checksum %s)", rc, bad,
              expect_ok ? "good" : "bad", bad_stored ? "wrong" : "right",
              decodes ? "decodes" : "does not decode", bad_raw ? "wrong" : "right");
    if (!g_lax && rc != 0)
        FZ_ASSERT(rc == -EBADMSG && one_line(bad), "verify of a bad chunk: %d (%s), reason '%s'",
                  rc, strerror(-rc), bad);

    /* the whole buffer, then a range of it */
    bad[0] = '\0';
    rc = ckpt_snapshot_read(s, "params", 0, total, g_out, bad, sizeof bad);
    FZ_ASSERT((rc == 0) == expect_ok, "read of the buffer returned %d (%s), expected %s", rc, bad,
              expect_ok ? "success" : "a failure");
    if (rc == 0) FZ_ASSERT(!memcmp(g_out, g_ref, (size_t)total), "read returned other bytes");
    uint64_t off = (uint64_t)(sel & 0xffff) * total / 65536u;
    uint64_t len = 1 + (uint64_t)(sel >> 16) * (total - off - 1) / 65535u;
    rc = ckpt_snapshot_read(s, "params", off, len, g_out, bad, sizeof bad);
    /* a range inside the valid tail chunk succeeds even when the first chunk is bad */
    int range_ok = expect_ok || off >= bytes;
    FZ_ASSERT((rc == 0) == range_ok, "read of [%llu, +%llu) returned %d (%s), expected %s",
              (unsigned long long)off, (unsigned long long)len, rc, bad,
              range_ok ? "success" : "a failure");
    if (rc == 0)
        FZ_ASSERT(!memcmp(g_out, g_ref + off, (size_t)len), "range [%llu, +%llu) differs",
                  (unsigned long long)off, (unsigned long long)len);
    ckpt_snapshot_close(s);
    return 0;
}
