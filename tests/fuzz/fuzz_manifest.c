/* fuzz_manifest.c - libFuzzer harness: the manifest parser, the layout checks and the reader
 * behind them (ckpt_snapshot_open, the accessors, verify, read, ckpt_list).
 *
 * Input: the bytes of a snapshot folder's manifest.json. The harness reseals it first, so
 * that the checksum (docs/FORMAT.md, "Manifest checksum") passes and the fuzzer reaches the
 * JSON parser and the layout checks instead of stopping at a checksum mismatch:
 *   - when the input holds `,"manifest_xxh3":"` followed by at least 16 bytes, those 16
 *     bytes become the XXH3-64 of everything before the last such occurrence (what
 *     tests/tools/reseal_manifest does); whatever follows them is kept, so that inputs with
 *     17 digits or members after the checksum reach the reader as they are;
 *   - otherwise, when it ends with '}' (and white space), the member is appended the way the
 *     writer does (the final '}' dropped, the member, '"}' and a newline);
 *   - otherwise it is left alone (the "no checksum member" path).
 *
 * The snapshot folder lives in a private temp folder made once per process, with data files
 * whose bytes never change (LLVMFuzzerInitialize writes them, see make_template); each input
 * only replaces manifest.json. Layout of the private folder:
 *   snap/                    the folder opened (its name is no step name, so that any
 *                            step is accepted): manifest.json, rank-00000.bin,
 *                            rank-00001.bin, rank-00002.bin (empty)
 *   step-000000001 -> snap   what ckpt_list sees as a committed snapshot of step 1
 *   .tmp-step-000000002-fz/  an interrupted save, for the listing
 *   step-000000003.corrupt-1700000000/  a set-aside folder, for the listing
 *
 * Besides crashes and sanitizer reports, these are findings (the harness aborts):
 *   - a failed open without a one-line reason, or with an error ckpt.h does not document;
 *   - an open snapshot whose figures disagree (buffer totals vs. ckpt_snapshot_sizes, stored
 *     bytes), whose trainer record is not a JSON object, or whose verify succeeds while a
 *     read of the same chunks fails;
 *   - ckpt_list judging step-000000001 differently from ckpt_snapshot_open;
 *   - an accepted manifest whose file does not end as FORMAT.md says (16 hex digits, '"}'):
 *     bytes after the checksum are not covered by it, so accepting them lets a corrupt
 *     manifest pass (I1).
 * FUZZ_LAX=1 in the environment turns the checks on documented behaviour (error codes,
 * reasons, the file's tail) off, to explore past a known finding; the consistency checks
 * and the sanitizers stay.
 *
 * FUZZ_TRACE=1 prints the result of each call (open, verify, reads), for triage.
 *
 * FUZZ_MANIFEST_TEMPLATE=<file> writes the manifest that matches the data files (the valid
 * seed of tests/fuzz/corpus/fuzz_manifest/) to <file> at start-up.
 */
#include "ckpt.h"
#include "fz_util.h"
#include "log.h"

#include <jansson.h>
#include <xxhash.h>

/* docs/FORMAT.md, "Manifest checksum" (spelled out here, not taken from ckpt_internal.h, so
 * that a reader drifting from the spec is caught) */
static const char SUM_KEY[] = ",\"manifest_xxh3\":\"";
#define SUM_KEY_LEN (sizeof SUM_KEY - 1)

static char g_root[4096];     /* the private folder */
static char g_snap[4200];     /* g_root/snap */
static char g_manifest[4300]; /* g_snap/manifest.json */
static int g_lax;
static int g_trace; /* FUZZ_TRACE=1: one line per call, for triage */

/* ------------------------------------------------------------------ the fixed data files */

/* One zstd frame (RFC 8878) of a single block, built by hand so that the data files do not
 * depend on the zstd version: Frame_Header_Descriptor 0xA0 (single segment, 4-byte
 * Frame_Content_Size, no checksum, no dictionary), then one last block, raw (type 0) or RLE
 * (type 1, the byte src[0] repeated n times). n <= 128 KiB. Returns the frame's size. */
static size_t zframe(uint8_t *dst, const uint8_t *src, size_t n, int rle)
{
    static const uint8_t magic[4] = {0x28, 0xB5, 0x2F, 0xFD};
    memcpy(dst, magic, 4);
    dst[4] = 0xA0;
    fz_put_u32(dst + 5, (uint32_t)n);
    uint32_t bh = 1u | (rle ? 1u : 0u) << 1 | (uint32_t)n << 3;
    dst[9] = (uint8_t)bh;
    dst[10] = (uint8_t)(bh >> 8);
    dst[11] = (uint8_t)(bh >> 16);
    if (rle) {
        dst[12] = src[0];
        return 13;
    }
    memcpy(dst + 12, src, n);
    return 12 + n;
}

/* The shuffle filter of docs/FORMAT.md: byte plane k of every element, k = 0..e-1, then the
 * trailing n % e bytes. */
static void shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t e)
{
    size_t c = n / e, o = 0;
    for (size_t k = 0; k < e; k++)
        for (size_t i = 0; i < c; i++) dst[o++] = src[i * e + k];
    memcpy(dst + o, src + c * e, n - c * e);
}

typedef struct tchunk {
    const char *buf;   /* buffer name */
    int file;          /* 0 or 1: rank-0000<file>.bin */
    uint64_t offset;   /* raw offset in the buffer */
    size_t bytes;      /* raw bytes */
    int codec_zstd, shuffled, rle;
    uint8_t seed;      /* raw content: a pattern from this seed (rle: the repeated byte) */
} tchunk;

/* Two f32 buffers over two ranks' files and an empty u8 buffer: every codec, filter and
 * frame kind the reader knows, chunks smaller than chunk_bytes, a shard split over files. */
static const tchunk TCHUNKS[] = {
    {"params", 0, 0, 4096, 1, 0, 1, 0x00},    /* zeros, one RLE block */
    {"params", 0, 4096, 4096, 0, 0, 0, 0x11}, /* stored raw (codec none) */
    {"params", 0, 8192, 1000, 1, 1, 0, 0x22}, /* shuffled, raw block, a partial tail */
    {"adam_m", 0, 0, 2048, 0, 0, 0, 0x33},    /* rank 0's shard, stored raw */
    {"adam_m", 1, 2048, 4096, 1, 1, 0, 0x44}, /* rank 1's shard: shuffled */
    {"adam_m", 1, 6144, 2048, 1, 0, 1, 0x3f}, /* RLE of 0x3f */
};
#define NTCHUNKS (sizeof TCHUNKS / sizeof TCHUNKS[0])

static void raw_bytes(const tchunk *t, uint8_t *out)
{
    for (size_t i = 0; i < t->bytes; i++)
        out[i] = t->rle ? t->seed : (uint8_t)(t->seed + i * 131u + (i >> 7));
}

static void hex64(uint64_t v, char out[17]) { snprintf(out, 17, "%016llx", (unsigned long long)v); }

static json_t *shard_json(int rank, const char *file, uint64_t off, uint64_t bytes, json_t *chunks)
{
    return json_pack("{s:i, s:s, s:I, s:I, s:o}", "rank", rank, "file", file, "offset",
                     (json_int_t)off, "bytes", (json_int_t)bytes, "chunks", chunks);
}

/* Write the data files into g_snap and return the manifest (compact, sorted keys, sealed:
 * what the writer would produce) in malloc'ed memory. */
static char *make_template(void)
{
    static uint8_t file[2][16384];
    size_t flen[2] = {0, 0};
    /* chunk lists: params' one shard, adam_m's shards of rank 0 and rank 1 */
    json_t *c_params = json_array(), *c_m[2] = {json_array(), json_array()};
    for (size_t i = 0; i < NTCHUNKS; i++) {
        const tchunk *t = &TCHUNKS[i];
        uint8_t raw[4096], filt[4096];
        raw_bytes(t, raw);
        const uint8_t *src = raw;
        if (t->shuffled) {
            shuffle(filt, raw, t->bytes, 4);
            src = filt;
        }
        uint8_t *dst = file[t->file] + flen[t->file];
        size_t stored = t->codec_zstd ? zframe(dst, src, t->bytes, t->rle) : t->bytes;
        if (!t->codec_zstd) memcpy(dst, src, t->bytes);
        char hraw[17], hst[17];
        hex64(XXH3_64bits(raw, t->bytes), hraw);
        hex64(XXH3_64bits(dst, stored), hst);
        json_t *jc = json_pack("{s:I, s:I, s:I, s:I, s:s, s:s, s:s, s:s}", "offset",
                               (json_int_t)t->offset, "bytes", (json_int_t)t->bytes,
                               "file_offset", (json_int_t)flen[t->file], "stored_bytes",
                               (json_int_t)stored, "codec", t->codec_zstd ? "zstd" : "none",
                               "filter", t->shuffled ? "shuffle" : "none", "xxh3_raw", hraw,
                               "xxh3_stored", hst);
        json_array_append_new(strcmp(t->buf, "params") ? c_m[t->file] : c_params, jc);
        flen[t->file] += stored;
    }
    static const char *names[3] = {"rank-00000.bin", "rank-00001.bin", "rank-00002.bin"};
    for (int f = 0; f < 3; f++) {
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", g_snap, names[f]);
        FZ_SETUP(fz_write_file(p, f < 2 ? file[f] : NULL, f < 2 ? flen[f] : 0) == 0, p);
    }
    json_t *files = json_pack("[{s:s, s:i, s:I}, {s:s, s:i, s:I}]", "name", names[0], "rank", 0,
                              "bytes", (json_int_t)flen[0], "name", names[1], "rank", 1, "bytes",
                              (json_int_t)flen[1]);
    /* the empty buffer sits in the middle: at the end it would trip a known reader bug on
     * every input (corpus/fuzz_manifest/fixed-verify-skips-chunks-after-empty-last-buffer.json) */
    json_t *buffers = json_pack(
        "[{s:s, s:s, s:i, s:I, s:[o]}, {s:s, s:s, s:i, s:I, s:[]}, {s:s, s:s, s:i, s:I, s:[o, o]}]",
        "name", "params", "dtype", "f32", "elem_bytes", 4, "total_bytes", (json_int_t)9192,
        "shards", shard_json(0, names[0], 0, 9192, c_params),
        "name", "flags", "dtype", "u8", "elem_bytes", 1, "total_bytes", (json_int_t)0, "shards",
        "name", "adam_m", "dtype", "f32", "elem_bytes", 4, "total_bytes", (json_int_t)8192,
        "shards", shard_json(0, names[0], 0, 2048, c_m[0]),
        shard_json(1, names[1], 2048, 6144, c_m[1]));
    /* the record train writes (FORMAT.md "The trainer record"); opaque to the reader */
    json_t *trainer = json_loads(
        "{\"step\":1,\"model\":{\"vocab\":256,\"seq_len\":16,\"n_layer\":1,\"n_embd\":16,"
        "\"n_head\":2},\"tensor_buffer\":\"params\",\"tensors\":[{\"name\":\"wte.weight\","
        "\"shape\":[128,16],\"offset\":0,\"decay\":true},{\"name\":\"ln_f.weight\",\"shape\":[16],"
        "\"offset\":2048,\"decay\":false}],\"num_params\":2298,\"optimizer\":{\"type\":\"adamw\","
        "\"lr\":0.0003,\"min_lr_ratio\":0.1,\"warmup\":10,\"total_steps\":100,\"beta1\":0.9,"
        "\"beta2\":0.95,\"eps\":1e-08,\"weight_decay\":0.1,\"grad_clip\":1.0,\"t\":1},\"batch\":"
        "{\"micro_batch\":2,\"grad_accum\":2,\"world_size\":2,\"global_batch\":8,\"zero_stage\":1},"
        "\"data\":{\"samples_consumed\":8,\"epoch\":0,\"offset_in_epoch\":8,\"seed\":1234,"
        "\"num_samples\":1000,\"data_hash\":\"0123456789abcdef\",\"files\":[\"train_000000.bin\"]},"
        "\"params_digest\":\"00112233445566778899aabbccddeeff\",\"moments_digest\":{\"adam_m\":"
        "\"0123456789abcdef\",\"adam_v\":\"fedcba9876543210\"},\"loss\":5.25}",
        0, NULL);
    json_t *body = json_pack("{s:s, s:i, s:I, s:I, s:i, s:s, s:s, s:I, s:o, s:o, s:o}", "format",
                             "ckptsys.snapshot", "format_version", 1, "step", (json_int_t)1,
                             "created_unix", (json_int_t)1700000000, "world_size", 2, "run_id",
                             "fuzz-run", "config_hash", "0123456789abcdef", "chunk_bytes",
                             (json_int_t)4096, "files", files, "buffers", buffers, "trainer",
                             trainer);
    errno = EINVAL;
    FZ_SETUP(body != NULL, "template manifest");
    char *text = json_dumps(body, JSON_COMPACT | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    json_decref(body);
    FZ_SETUP(text != NULL, "template manifest");
    size_t n = strlen(text) - 1; /* without the final '}' */
    char *out = malloc(n + SUM_KEY_LEN + 16 + 4);
    FZ_SETUP(out != NULL, "template manifest");
    memcpy(out, text, n);
    memcpy(out + n, SUM_KEY, SUM_KEY_LEN);
    hex64(XXH3_64bits(text, n), out + n + SUM_KEY_LEN);
    memcpy(out + n + SUM_KEY_LEN + 16, "\"}\n", 4);
    free(text);
    return out;
}

/* ------------------------------------------------------------------ set-up */

static void cleanup(void)
{
    if (g_root[0]) fz_rmrf(g_root);
}

static void snapshot_check_or_die(const char *what);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    log_set_level(LOG_ERROR);
    const char *lax = getenv("FUZZ_LAX");
    g_lax = lax && *lax && strcmp(lax, "0") != 0;
    g_trace = getenv("FUZZ_TRACE") != NULL;
    fz_mkdtemp(g_root, sizeof g_root, "fuzz-manifest");
    atexit(cleanup);
    snprintf(g_snap, sizeof g_snap, "%s/snap", g_root);
    snprintf(g_manifest, sizeof g_manifest, "%s/manifest.json", g_snap);
    FZ_SETUP(mkdir(g_snap, 0755) == 0, g_snap);
    char p[4400];
    snprintf(p, sizeof p, "%s/step-000000001", g_root);
    FZ_SETUP(symlink("snap", p) == 0, p);
    snprintf(p, sizeof p, "%s/.tmp-step-000000002-fz", g_root);
    FZ_SETUP(mkdir(p, 0755) == 0, p);
    snprintf(p, sizeof p, "%s/step-000000003.corrupt-1700000000", g_root);
    FZ_SETUP(mkdir(p, 0755) == 0, p);

    char *tmpl = make_template();
    const char *dump = getenv("FUZZ_MANIFEST_TEMPLATE");
    if (dump && *dump) FZ_SETUP(fz_write_file(dump, tmpl, strlen(tmpl)) == 0, dump);
    /* the harness itself must be right: the template opens and verifies */
    FZ_SETUP(fz_write_file(g_manifest, tmpl, strlen(tmpl)) == 0, g_manifest);
    free(tmpl);
    snapshot_check_or_die("template");
    return 0;
}

static void snapshot_check_or_die(const char *what)
{
    ckpt_snapshot *s = NULL;
    char why[512] = "";
    int rc = ckpt_snapshot_open(&s, g_snap, why, sizeof why);
    if (rc == 0) rc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL);
    ckpt_snapshot_close(s);
    if (rc != 0) {
        fprintf(stderr, "fuzz harness set-up failed: the %s snapshot does not verify: %s (%s)\n",
                what, why, strerror(-rc));
        abort();
    }
}

/* ------------------------------------------------------------------ one input */

/* The manifest file for an input (see the top of this file); *len gets its size. */
static uint8_t *reseal(const uint8_t *d, size_t n, size_t *len)
{
    uint8_t *m = malloc(n + SUM_KEY_LEN + 16 + 4);
    FZ_SETUP(m != NULL, "reseal");
    memcpy(m, d, n);
    const uint8_t *last = NULL;
    for (size_t i = 0; i + SUM_KEY_LEN <= n; i++)
        if (!memcmp(d + i, SUM_KEY, SUM_KEY_LEN)) last = d + i;
    char hex[17];
    if (last && (size_t)(last - d) + SUM_KEY_LEN + 16 <= n) {
        size_t pre = (size_t)(last - d);
        hex64(XXH3_64bits(d, pre), hex);
        memcpy(m + pre + SUM_KEY_LEN, hex, 16);
        *len = n;
        return m;
    }
    size_t end = n;
    while (end > 0 && (d[end - 1] == ' ' || d[end - 1] == '\n' || d[end - 1] == '\r' ||
                       d[end - 1] == '\t'))
        end--;
    if (end > 0 && d[end - 1] == '}') {
        size_t pre = end - 1;
        hex64(XXH3_64bits(d, pre), hex);
        memcpy(m + pre, SUM_KEY, SUM_KEY_LEN);
        memcpy(m + pre + SUM_KEY_LEN, hex, 16);
        memcpy(m + pre + SUM_KEY_LEN + 16, "\"}\n", 3);
        *len = pre + SUM_KEY_LEN + 16 + 3;
        return m;
    }
    *len = n;
    return m;
}

/* FORMAT.md: after the last `,"manifest_xxh3":"` come 16 lowercase hex digits, '"}' and a
 * newline. White space is tolerated here (it means nothing); anything else is content that
 * no checksum covers. */
static int tail_is_checksum_only(const uint8_t *m, size_t n)
{
    const uint8_t *last = NULL;
    for (size_t i = 0; i + SUM_KEY_LEN <= n; i++)
        if (!memcmp(m + i, SUM_KEY, SUM_KEY_LEN)) last = m + i;
    if (!last) return 0;
    size_t i = (size_t)(last - m) + SUM_KEY_LEN;
    for (size_t k = 0; k < 16; k++, i++)
        if (i >= n || !((m[i] >= '0' && m[i] <= '9') || (m[i] >= 'a' && m[i] <= 'f'))) return 0;
    if (i >= n || m[i++] != '"') return 0;
    while (i < n && strchr(" \t\r\n", m[i])) i++;
    if (i >= n || m[i++] != '}') return 0;
    while (i < n && strchr(" \t\r\n", m[i])) i++;
    return i == n;
}

static int one_line(const char *s) { return s[0] != '\0' && strchr(s, '\n') == NULL; }

typedef struct progress {
    uint64_t done, total, calls;
} progress;

static int on_progress(void *ctx, uint64_t done, uint64_t total)
{
    progress *p = ctx;
    FZ_ASSERT(done >= p->done && done <= total, "verify progress %llu after %llu of %llu",
              (unsigned long long)done, (unsigned long long)p->done, (unsigned long long)total);
    FZ_ASSERT(p->calls == 0 || total == p->total, "verify total changed");
    p->done = done;
    p->total = total;
    p->calls++;
    return 0;
}

/* Exercise an open snapshot; returns the result of verify. */
static int use_snapshot(ckpt_snapshot *s, uint64_t h)
{
    FZ_ASSERT(ckpt_snapshot_world_size(s) >= 1, "world_size 0 accepted");
    FZ_ASSERT(ckpt_snapshot_run_id(s) && ckpt_snapshot_config_hash(s), "no run_id/config_hash");
    FZ_ASSERT(!strcmp(ckpt_snapshot_path(s), g_snap), "path %s", ckpt_snapshot_path(s));
    (void)ckpt_snapshot_step(s);
    (void)ckpt_snapshot_created(s);
    const char *tj = ckpt_snapshot_trainer_json(s);
    json_t *t = tj ? json_loads(tj, 0, NULL) : NULL;
    FZ_ASSERT(json_is_object(t), "trainer record is not a JSON object: %.80s", tj ? tj : "(null)");
    json_decref(t);

    size_t nb = ckpt_snapshot_nbuffers(s);
    uint64_t raw = 0, stored = 0, sum_total = 0, sum_stored = 0;
    ckpt_snapshot_sizes(s, &raw, &stored);
    for (size_t i = 0; i < nb; i++) {
        ckpt_buffer_info bi;
        FZ_ASSERT(ckpt_snapshot_buffer_info(s, i, &bi) == 0, "buffer_info(%zu) of %zu", i, nb);
        FZ_ASSERT(ckpt_snapshot_buffer_bytes(s, bi.name) == (int64_t)bi.total_bytes,
                  "buffer_bytes(%s) != total_bytes", bi.name);
        sum_total += bi.total_bytes;
        sum_stored += bi.stored_bytes;
    }
    ckpt_buffer_info bi;
    FZ_ASSERT(ckpt_snapshot_buffer_info(s, nb, &bi) == -EINVAL, "buffer_info past the end");
    FZ_ASSERT(ckpt_snapshot_buffer_bytes(s, "no such buffer!") == -ENOENT, "unknown buffer found");
    /* chunks cover each buffer exactly, so the sums agree */
    FZ_ASSERT(sum_total == raw && sum_stored == stored,
              "buffers total %llu/%llu bytes, chunks %llu/%llu", (unsigned long long)sum_total,
              (unsigned long long)sum_stored, (unsigned long long)raw, (unsigned long long)stored);

    FZ_ASSERT(ckpt_snapshot_set_threads(s, 1 + (unsigned)(h & 1)) == 0, "set_threads");
    char bad[512] = "";
    progress pr = {0, 0, 0};
    int vrc = ckpt_snapshot_verify(s, bad, sizeof bad, on_progress, &pr);
    if (g_trace) fprintf(stderr, "verify: %d %s\n", vrc, bad);
    if (!g_lax) {
        FZ_ASSERT(vrc == 0 || vrc == -EBADMSG || vrc == -EIO || vrc == -ENOMEM,
                  "verify: undocumented error %d (%s): %s", vrc, strerror(-vrc), bad);
        FZ_ASSERT(vrc != -EBADMSG || one_line(bad), "verify: -EBADMSG without a reason");
    }
    if (vrc == 0) FZ_ASSERT(pr.done == raw, "verify passed over %llu of %llu bytes",
                            (unsigned long long)pr.done, (unsigned long long)raw);

    /* a range of up to four buffers, placed by the input's hash */
    for (size_t i = 0; i < nb && i < 4; i++) {
        FZ_ASSERT(ckpt_snapshot_buffer_info(s, i, &bi) == 0, "buffer_info");
        uint64_t hi = XXH3_64bits_withSeed(&h, sizeof h, i);
        uint64_t off = bi.total_bytes ? hi % bi.total_bytes : 0;
        uint64_t len = bi.total_bytes - off;
        uint64_t cap = 1 + ((hi >> 40) & 0xffff); /* at most 64 KiB: ranges, not whole buffers */
        if (len > cap) len = cap;
        uint8_t *dst = malloc(len ? len : 1);
        FZ_SETUP(dst != NULL, "read buffer");
        bad[0] = '\0';
        int rc = ckpt_snapshot_read(s, bi.name, off, len, dst, bad, sizeof bad);
        free(dst);
        if (g_trace)
            fprintf(stderr, "read %s [%llu, +%llu): %d %s\n", bi.name, (unsigned long long)off,
                    (unsigned long long)len, rc, bad);
        if (!g_lax) {
            FZ_ASSERT(rc == 0 || rc == -EBADMSG || rc == -EIO || rc == -ENOMEM,
                      "read %s [%llu, +%llu): undocumented error %d (%s): %s", bi.name,
                      (unsigned long long)off, (unsigned long long)len, rc, strerror(-rc), bad);
        }
        /* verify read every chunk and found them good: a read of some cannot fail */
        FZ_ASSERT(vrc != 0 || rc == 0, "verify passed but read %s [%llu, +%llu) failed: %s",
                  bi.name, (unsigned long long)off, (unsigned long long)len, bad);
        uint8_t one;
        FZ_ASSERT(ckpt_snapshot_read(s, bi.name, bi.total_bytes, 1, &one, NULL, 0) == -EINVAL,
                  "read past the end of %s accepted", bi.name);
    }
    return vrc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t mlen;
    uint8_t *m = reseal(data, size, &mlen);
    FZ_SETUP(fz_write_file(g_manifest, m, mlen) == 0, g_manifest);
    uint64_t h = XXH3_64bits(data, size);

    ckpt_snapshot *s = NULL;
    char why[512] = "";
    int orc = ckpt_snapshot_open(&s, g_snap, why, sizeof why);
    if (g_trace) fprintf(stderr, "open: %d %s\n", orc, why);
    uint64_t step = 0;
    if (orc == 0) {
        if (!g_lax)
            FZ_ASSERT(tail_is_checksum_only(m, mlen),
                      "manifest accepted with bytes after its checksum that no checksum covers");
        step = ckpt_snapshot_step(s);
        use_snapshot(s, h);
        ckpt_snapshot_close(s);
    } else {
        FZ_ASSERT(s == NULL, "failed open left a handle");
        if (!g_lax) {
            FZ_ASSERT(orc == -EBADMSG || orc == -EPROTONOSUPPORT || orc == -ENOMEM,
                      "open: undocumented error %d (%s): %s", orc, strerror(-orc), why);
            FZ_ASSERT(one_line(why), "open failed (%d) without a one-line reason: '%s'", orc, why);
        }
    }

    /* the listing opens step-000000001 (the same folder): it must judge it the same way */
    ckpt_entry *e = NULL;
    size_t n = 0;
    int lrc = ckpt_list(g_root, &e, &n);
    FZ_ASSERT(lrc == 0 && n == 3, "ckpt_list: %d, %zu entries", lrc, n);
    FZ_ASSERT(e[0].step == 1 && e[1].step == 2 && e[2].step == 3, "listing out of order");
    int want = orc == 0 ? (step == 1 ? CKPT_STATUS_COMMITTED : CKPT_STATUS_CORRUPT)
                        : (orc == -EPROTONOSUPPORT ? CKPT_STATUS_NEWER : CKPT_STATUS_CORRUPT);
    FZ_ASSERT(e[0].status == want, "listing says %s, open said %d (step %llu): %s",
              ckpt_status_name(e[0].status), orc, (unsigned long long)step, e[0].reason);
    FZ_ASSERT(e[1].status == CKPT_STATUS_INCOMPLETE && e[2].status == CKPT_STATUS_SET_ASIDE,
              "temp or set-aside folder misjudged");
    free(e);
    free(m);
    return 0;
}
