/* test_ckpt_plan.c - ckpt module: the re-sharding planner (case C11 of CASES.md).
 *
 * (a) ckpt_plan_reshard against brute force on every pair of small world sizes with random
 *     bounds (empty shards, 1-byte and empty buffers), and its argument checks;
 *     ckpt_even_bounds against its definition;
 * (b) C11: a 70B-scale layout of 5000 tensors planned 64 -> 128 in the planner alone must
 *     cost about what 40000 tensors planned 8 -> 16 cost (the same tensors x (W + W'), so
 *     linear planning gives a ratio near 1; planning that grows with W x W' gives 8). Both
 *     plans are far larger than the caches, so the comparison is not skewed by one of them
 *     fitting in L2 (an 8 -> 16 plan of 5000 tensors does, and is printed for reference);
 * (c) ckpt_snapshot_plan on a snapshot written by ckpt_save, against brute force over its
 *     chunks. */
#include "ckpt.h"
#include "ckpt_plan.h"
#include "t_helpers.h"

#include <stdint.h>

static uint64_t rng_s = 0x243F6A8885A308D3ull;

static uint64_t rnd(void)
{
    rng_s ^= rng_s << 13;
    rng_s ^= rng_s >> 7;
    rng_s ^= rng_s << 17;
    return rng_s;
}

static uint64_t rnd_below(uint64_t n) { return n ? rnd() % n : 0; }

static uint64_t max64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* world+1 random bounds of a buffer of `total` bytes: sorted draws, so equal neighbours
 * (empty shards) are common; sometimes the even partition instead. */
static void random_row(uint64_t total, uint32_t world, uint64_t *row)
{
    if (rnd_below(4) == 0) {
        ckpt_even_bounds(total, 1 + rnd_below(5), world, row);
        return;
    }
    row[0] = 0;
    row[world] = total;
    for (uint32_t i = 1; i < world; i++) {
        uint64_t v = rnd_below(3) == 0 ? row[i - 1] : rnd_below(total + 1);
        uint32_t k = i;
        while (k > 1 && row[k - 1] > v) { /* insertion sort into row[1..i] */
            row[k] = row[k - 1];
            k--;
        }
        row[k] = v;
    }
}

/* Check pieces against brute force over every (old shard, new range) pair: count, order
 * (new_rank, buffer, offset), tiling of each new range, and that each piece is exactly the
 * intersection of its old shard and its new range. Returns the failures found. */
static int check_plan(size_t nb, uint32_t ow, const uint64_t *ob, uint32_t nw, const uint64_t *nbd,
                      const ckpt_plan_piece *p, size_t np)
{
    int bad = 0;
    size_t expect = 0;
    for (size_t b = 0; b < nb; b++)
        for (uint32_t i = 0; i < ow; i++)
            for (uint32_t j = 0; j < nw; j++) {
                const uint64_t *o = ob + b * (ow + 1), *n = nbd + b * (nw + 1);
                if (max64(o[i], n[j]) < min64(o[i + 1], n[j + 1])) expect++;
            }
    if (np != expect) {
        fprintf(stderr, "  %zu pieces, brute force %zu\n", np, expect);
        return 1;
    }
    size_t k = 0;
    for (uint32_t r = 0; r < nw; r++)
        for (size_t b = 0; b < nb; b++) {
            const uint64_t *o = ob + b * (ow + 1), *n = nbd + b * (nw + 1);
            uint64_t pos = n[r];
            for (; k < np && p[k].new_rank == r && p[k].buffer == b; k++) {
                const ckpt_plan_piece *q = &p[k];
                uint32_t i = q->old_rank;
                if (i >= ow || q->bytes == 0 || q->offset != pos ||
                    q->offset != max64(o[i], n[r]) || q->offset + q->bytes != min64(o[i + 1], n[r + 1])) {
                    fprintf(stderr, "  piece %zu (buffer %u new %u old %u [%llu,+%llu)) is wrong\n",
                            k, q->buffer, q->new_rank, q->old_rank, (unsigned long long)q->offset,
                            (unsigned long long)q->bytes);
                    bad++;
                }
                pos = q->offset + q->bytes;
            }
            if (pos != n[r + 1]) {
                fprintf(stderr, "  new rank %u buffer %zu: pieces end at %llu, range at %llu\n", r,
                        b, (unsigned long long)pos, (unsigned long long)n[r + 1]);
                bad++;
            }
        }
    if (k != np) {
        fprintf(stderr, "  pieces out of (new_rank, buffer, offset) order at %zu\n", k);
        bad++;
    }
    return bad;
}

/* ------------------------------------------------------------------ (a) small layouts */

static void test_exhaustive(void)
{
    enum { MAXB = 5, MAXW = 9, TRIALS = 30 };
    uint64_t ob[MAXB * (MAXW + 1)], nbd[MAXB * (MAXW + 1)];
    size_t cases = 0;
    int failed = 0;
    for (uint32_t ow = 1; ow <= MAXW; ow++)
        for (uint32_t nw = 1; nw <= MAXW; nw++)
            for (int t = 0; t < TRIALS; t++) {
                size_t nb = 1 + rnd_below(MAXB);
                for (size_t b = 0; b < nb; b++) {
                    uint64_t total;
                    switch (rnd_below(4)) {
                    case 0: total = rnd_below(2); break; /* empty or 1 byte */
                    case 1: total = rnd_below(12); break;
                    default: total = rnd_below(200); break;
                    }
                    random_row(total, ow, ob + b * (ow + 1));
                    random_row(total, nw, nbd + b * (nw + 1));
                }
                ckpt_plan_piece *p = NULL;
                size_t np = 0;
                int rc = ckpt_plan_reshard(nb, ow, ob, nw, nbd, &p, &np);
                cases++;
                if (rc != 0 || (np > 0) != (p != NULL) || check_plan(nb, ow, ob, nw, nbd, p, np)) {
                    fprintf(stderr, "  case %u -> %u, %zu buffers: rc %d\n", ow, nw, nb, rc);
                    failed++;
                }
                free(p);
            }
    T_CHECK(failed == 0, "%d of %zu small re-shard plans wrong", failed, cases);
    printf("exhaustive: %zu random layouts, W and W' in 1..%d\n", cases, MAXW);
}

static void test_reshard_args(void)
{
    uint64_t o[3] = {0, 5, 10}, n[2] = {0, 10};
    ckpt_plan_piece *p = (ckpt_plan_piece *)1;
    size_t np = 7;
    T_CHECK(ckpt_plan_reshard(1, 2, o, 1, n, &p, &np) == 0 && np == 2, "2 -> 1");
    T_CHECK(p && p[0].old_rank == 0 && p[1].old_rank == 1 && p[1].offset == 5, "2 -> 1 pieces");
    free(p);
    T_CHECK(ckpt_plan_reshard(0, 2, NULL, 1, NULL, &p, &np) == 0 && np == 0 && !p, "no buffers");
    T_CHECK(ckpt_plan_reshard(1, 0, o, 1, n, &p, &np) == -EINVAL && !p && np == 0, "old world 0");
    T_CHECK(ckpt_plan_reshard(1, 2, o, 0, n, &p, &np) == -EINVAL, "new world 0");
    T_CHECK(ckpt_plan_reshard(1, 2, NULL, 1, n, &p, &np) == -EINVAL, "NULL bounds");
    T_CHECK(ckpt_plan_reshard(1, 2, o, 1, n, NULL, &np) == -EINVAL, "NULL out");
    T_CHECK(ckpt_plan_reshard(1, 2, o, 1, n, &p, NULL) == -EINVAL, "NULL npieces");
    uint64_t n_short[2] = {0, 9}, n_start[2] = {1, 10}, o_dec[3] = {0, 11, 10};
    T_CHECK(ckpt_plan_reshard(1, 2, o, 1, n_short, &p, &np) == -EINVAL, "totals differ");
    T_CHECK(ckpt_plan_reshard(1, 2, o, 1, n_start, &p, &np) == -EINVAL, "row not at 0");
    T_CHECK(ckpt_plan_reshard(1, 2, o_dec, 1, n, &p, &np) == -EINVAL && !p && np == 0,
            "decreasing row");
    uint64_t z[3] = {0, 0, 0}, z1[2] = {0, 0};
    T_CHECK(ckpt_plan_reshard(1, 2, z, 1, z1, &p, &np) == 0 && np == 0 && !p, "empty buffer");
}

static void test_even_bounds(void)
{
    static const uint64_t totals[] = {0, 1, 3, 4, 8191, 8192, 8193, 5 * 8192 + 17, 1ull << 40};
    static const uint64_t aligns[] = {0, 1, 4, 7, 8192};
    uint64_t bd[18];
    int bad = 0;
    for (size_t ti = 0; ti < sizeof totals / sizeof *totals; ti++)
        for (size_t ai = 0; ai < sizeof aligns / sizeof *aligns; ai++)
            for (uint32_t w = 1; w <= 17; w++) {
                uint64_t total = totals[ti], a = aligns[ai] ? aligns[ai] : 1;
                ckpt_even_bounds(total, aligns[ai], w, bd);
                uint64_t n = (total + a - 1) / a, pos = 0;
                for (uint32_t r = 0; r < w; r++) { /* the definition, unit by unit count */
                    uint64_t units = n / w + (r < n % w);
                    if (bd[r] != pos) bad++;
                    pos = min64(pos + units * a, total);
                }
                if (bd[w] != total || pos != total) bad++;
            }
    T_CHECK(bad == 0, "%d even bounds differ from the definition", bad);
    /* no overflow next to 2^64 */
    uint64_t top = UINT64_MAX;
    ckpt_even_bounds(top, 8192, 3, bd);
    T_CHECK(bd[0] == 0 && bd[1] <= bd[2] && bd[2] <= bd[3] && bd[3] == top && bd[1] % 8192 == 0 &&
                bd[1] > top / 4,
            "bounds of 2^64-1 bytes: %llu %llu %llu", (unsigned long long)bd[1],
            (unsigned long long)bd[2], (unsigned long long)bd[3]);
    /* more ranks than units: the tail ranks get empty ranges at the end */
    ckpt_even_bounds(3 * 8192 + 1, 8192, 6, bd);
    T_CHECK(bd[1] == 8192 && bd[3] == 3 * 8192 && bd[4] == 3 * 8192 + 1 && bd[6] == 3 * 8192 + 1,
            "more ranks than units");
}

/* ------------------------------------------------------------------ (b) C11 scaling */

enum { NT = 5000, NT_BIG = 40000 };

/* Tensor sizes of a Llama-70B-like model (fp32 bytes): embedding and head (32000 x 8192),
 * attention and MLP matrices (8192 x 8192, 1024 x 8192, 28672 x 8192), norms and biases
 * (8192, 1024), and a few odd small ones (scalars, rotary tables). */
static void llama_layout(uint64_t *bytes, size_t nt)
{
    static const uint64_t mats[][2] = {{8192, 8192}, {1024, 8192}, {1024, 8192}, {8192, 8192},
                                       {28672, 8192}, {28672, 8192}, {8192, 28672}};
    for (size_t t = 0; t < nt; t++) {
        uint64_t u = rnd_below(100), e;
        if (t == 0 || t == nt - 1) e = 32000ull * 8192;
        else if (u < 45) {
            const uint64_t *m = mats[rnd_below(sizeof mats / sizeof *mats)];
            e = m[0] * m[1];
        } else if (u < 70) e = 8192;
        else if (u < 95) e = 1024;
        else e = 1 + rnd_below(4096);
        bytes[t] = 4 * e;
    }
}

static uint64_t *layout_bounds(const uint64_t *bytes, size_t nt, uint32_t world)
{
    uint64_t *bd = malloc(nt * (world + 1) * sizeof *bd);
    T_REQUIRE(bd != NULL, "malloc bounds");
    /* per-tensor sharding by whole elements, as FSDP2 / DCP shard each parameter */
    for (size_t t = 0; t < nt; t++) ckpt_even_bounds(bytes[t], 4, world, bd + t * (world + 1));
    return bd;
}

/* Best CPU time of repeated plans (seconds): at least 9 runs and 0.3 s, so that first touches
 * of fresh memory (a VM backs guest pages lazily) and noisy neighbours drop out of the
 * minimum. Also checks each new rank's bytes. */
/* CPU time of this thread, seconds: other processes on a busy machine stretch wall time,
 * not the CPU time the planner itself uses. */
static double cpu_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double time_plan(const uint64_t *bytes, size_t nt, uint32_t ow, uint32_t nw,
                        size_t *npieces)
{
    uint64_t *ob = layout_bounds(bytes, nt, ow), *nbd = layout_bounds(bytes, nt, nw);
    double best = 1e30, start = t_now_s();
    for (int i = 0; i < 9 || (t_now_s() - start < 0.3 && i < 1000); i++) {
        ckpt_plan_piece *p = NULL;
        size_t np = 0;
        double t0 = cpu_now_s();
        int rc = ckpt_plan_reshard(nt, ow, ob, nw, nbd, &p, &np);
        double dt = cpu_now_s() - t0;
        T_REQUIRE(rc == 0, "plan %u -> %u: %d", ow, nw, rc);
        if (dt < best) best = dt;
        *npieces = np;
        if (i == 0) { /* each new rank plans exactly its ranges: never more, never whole shards */
            int bad = 0;
            size_t k = 0;
            for (uint32_t r = 0; r < nw; r++) {
                uint64_t want = 0, got = 0;
                for (size_t t = 0; t < nt; t++)
                    want += nbd[t * (nw + 1) + r + 1] - nbd[t * (nw + 1) + r];
                for (; k < np && p[k].new_rank == r; k++) {
                    got += p[k].bytes;
                    const uint64_t *o = ob + (size_t)p[k].buffer * (ow + 1);
                    const uint64_t *n = nbd + (size_t)p[k].buffer * (nw + 1);
                    if (p[k].offset < n[r] || p[k].offset + p[k].bytes > n[r + 1] ||
                        p[k].offset < o[p[k].old_rank] ||
                        p[k].offset + p[k].bytes > o[p[k].old_rank + 1])
                        bad++;
                }
                if (got != want) bad++;
            }
            T_CHECK(bad == 0 && k == np, "%u -> %u: %d ranks or pieces plan other bytes than their "
                    "ranges", ow, nw, bad);
        }
        free(p);
    }
    free(ob);
    free(nbd);
    return best;
}

static void test_c11_scaling(void)
{
    uint64_t *bytes = malloc(NT_BIG * sizeof *bytes);
    T_REQUIRE(bytes != NULL, "malloc");
    llama_layout(bytes, NT_BIG); /* the first NT tensors form the 70B-like layout */
    uint64_t total = 0;
    for (size_t t = 0; t < NT; t++) total += bytes[t];
    size_t np_ref = 0, np_small = 0, np_big = 0;
    double ref = time_plan(bytes, NT, 8, 16, &np_ref);
    /* interleaved rounds, best of each: a burst of load elsewhere hits both alike */
    double small = 1e30, big = 1e30;
    for (int round = 0; round < 3; round++) {
        double a = time_plan(bytes, NT_BIG, 8, 16, &np_small);
        double b = time_plan(bytes, NT, 64, 128, &np_big);
        if (a < small) small = a;
        if (b < big) big = b;
    }
    double ratio = big / (small > 1e-9 ? small : 1e-9);
    printf("C11: %d tensors, %.1f G fp32 elements (%.0f GiB per buffer)\n", NT,
           (double)total / 4e9, (double)total / (1u << 30));
    printf("C11: plan %5d tensors 8 -> 16:   %9.3f ms, %zu pieces (fits in cache; reference)\n",
           NT, ref * 1e3, np_ref);
    printf("C11: plan %5d tensors 8 -> 16:   %9.3f ms, %zu pieces\n", NT_BIG, small * 1e3,
           np_small);
    printf("C11: plan %5d tensors 64 -> 128: %9.3f ms, %zu pieces\n", NT, big * 1e3, np_big);
    printf("C11: ratio %.2f (same tensors x (W + W'): linear ~1, product W x W' ~8; limit 4)\n",
           ratio);
    T_CHECK(ratio < 4, "planning time grows like W x W': ratio %.2f", ratio);
    free(bytes);
}

/* ------------------------------------------------------------------ (c) snapshot plans */

/* The chunks ckpt_snapshot_read would read for new rank r, by brute force over all chunks. */
static void brute_reads(const ckpt_snapshot *s, uint64_t align, uint32_t nw, uint32_t r,
                        ckpt_rank_reads *o, int *whole)
{
    memset(o, 0, sizeof *o);
    *whole = 0;
    size_t nf = ckpt_snapshot_nfiles(s);
    int *touched = calloc(nf ? nf : 1, sizeof *touched);
    uint64_t *bd = malloc((nw + 1) * sizeof *bd);
    T_REQUIRE(touched && bd, "malloc");
    for (size_t b = 0; b < ckpt_snapshot_nbuffers(s); b++) {
        ckpt_buffer_info bi;
        T_REQUIRE(ckpt_snapshot_buffer_info(s, b, &bi) == 0, "buffer info");
        ckpt_even_bounds(bi.total_bytes, align, nw, bd);
        uint64_t lo = bd[r], hi = bd[r + 1], raw = 0;
        o->need_bytes += hi - lo;
        for (size_t j = 0; j < bi.nchunks && lo < hi; j++) {
            ckpt_chunk_info k;
            T_REQUIRE(ckpt_snapshot_chunk_info(s, b, j, &k) == 0, "chunk info");
            if (k.offset >= hi || k.offset + k.bytes <= lo) continue;
            raw += k.bytes;
            o->read_stored_bytes += k.stored_bytes;
            o->chunks++;
            if (!touched[k.file]++) o->files++;
        }
        o->read_raw_bytes += raw;
        /* a rank of several that decodes a whole big buffer has not been planned by range */
        if (nw > 1 && bi.nchunks > 4 && raw >= bi.total_bytes) *whole = 1;
        /* at most one partial chunk at each end */
        if (raw > (hi - lo) + 2 * 4096) *whole = 1;
    }
    free(touched);
    free(bd);
}

static void test_snapshot_plan(void)
{
    char *root = t_tmpdir("ckpt-plan");
    enum { NBUF = 4 };
    const uint64_t sizes[NBUF] = {262147 * 4, 262147 * 4, 0, 100}; /* ~1 MiB, not chunk-aligned */
    static const char *names[NBUF] = {"params", "adam_m", "empty", "small"};
    ckpt_buffer b[NBUF];
    unsigned char *mem[NBUF];
    uint64_t total = 0;
    for (int i = 0; i < NBUF; i++) {
        mem[i] = sizes[i] ? malloc(sizes[i]) : NULL;
        T_REQUIRE(!sizes[i] || mem[i], "malloc");
        for (uint64_t j = 0; j < sizes[i]; j++) /* half noise, half zeros: stored < raw */
            mem[i][j] = (unsigned char)((j / 4096) % 2 ? 0 : rnd() >> 56);
        b[i] = (ckpt_buffer){names[i], i < 2 ? "f32" : "u8", i < 2 ? 4 : 1, sizes[i], 0,
                             sizes[i], mem[i]};
        total += sizes[i];
    }
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.chunk_bytes = 4096;
    o.direct_io = 0;
    T_REQUIRE(ckpt_save(&o, 5, "plan-run", "cfg-plan", b, NBUF, "{}", NULL) == 0, "save");
    char name[32];
    ckpt_step_dirname(5, name, sizeof name);
    char *path = t_path_in(root, name);
    ckpt_snapshot *s = NULL;
    char why[256] = "";
    T_REQUIRE(ckpt_snapshot_open(&s, path, why, sizeof why) == 0, "open: %s", why);
    T_CHECK(ckpt_snapshot_nfiles(s) == 1, "one data file");

    static const uint64_t aligns[] = {8192, 4000, 4};
    static const uint32_t worlds[] = {1, 3, 4, 7};
    ckpt_rank_reads rr[8], want;
    for (size_t ai = 0; ai < sizeof aligns / sizeof *aligns; ai++)
        for (size_t wi = 0; wi < sizeof worlds / sizeof *worlds; wi++) {
            uint64_t align = aligns[ai];
            uint32_t nw = worlds[wi];
            T_REQUIRE(ckpt_snapshot_plan(s, align, nw, rr) == 0, "plan");
            uint64_t need = 0;
            for (uint32_t r = 0; r < nw; r++) {
                int whole;
                brute_reads(s, align, nw, r, &want, &whole);
                const ckpt_rank_reads *g = &rr[r];
                need += g->need_bytes;
                T_CHECK(g->need_bytes == want.need_bytes && g->read_raw_bytes == want.read_raw_bytes &&
                            g->read_stored_bytes == want.read_stored_bytes &&
                            g->chunks == want.chunks && g->files == want.files,
                        "align %llu world %u rank %u: plan need %llu raw %llu stored %llu chunks %zu "
                        "files %zu; brute force %llu %llu %llu %zu %zu",
                        (unsigned long long)align, nw, r, (unsigned long long)g->need_bytes,
                        (unsigned long long)g->read_raw_bytes,
                        (unsigned long long)g->read_stored_bytes, g->chunks, g->files,
                        (unsigned long long)want.need_bytes, (unsigned long long)want.read_raw_bytes,
                        (unsigned long long)want.read_stored_bytes, want.chunks, want.files);
                T_CHECK(g->read_raw_bytes >= g->need_bytes, "decodes less than it needs");
                T_CHECK(!whole, "align %llu world %u rank %u decodes whole buffers or more than "
                        "2 chunks beyond its range", (unsigned long long)align, nw, r);
                T_CHECK(g->files == (g->need_bytes > 0), "files %zu", g->files);
                if (nw > 1) T_CHECK(g->read_raw_bytes < total, "rank %u reads everything", r);
            }
            T_CHECK(need == total, "align %llu world %u: need %llu of %llu bytes",
                    (unsigned long long)align, nw, (unsigned long long)need,
                    (unsigned long long)total);
            if (align == 8192 && nw != 7)
                printf("snapshot plan, world %u: rank 0 needs %llu B, decodes %llu B in %zu chunks, "
                       "reads %llu B\n", nw, (unsigned long long)rr[0].need_bytes,
                       (unsigned long long)rr[0].read_raw_bytes, rr[0].chunks,
                       (unsigned long long)rr[0].read_stored_bytes);
        }
    /* the plan agrees with what a restore reads: rank 1 of 3 gets its bytes */
    uint64_t bd[4];
    ckpt_even_bounds(sizes[0], 4000, 3, bd);
    unsigned char *dst = malloc(bd[2] - bd[1]);
    T_REQUIRE(dst != NULL, "malloc");
    T_CHECK(ckpt_snapshot_read(s, "params", bd[1], bd[2] - bd[1], dst, NULL, 0) == 0 &&
                memcmp(dst, mem[0] + bd[1], bd[2] - bd[1]) == 0,
            "read of rank 1's range");
    free(dst);

    T_CHECK(ckpt_snapshot_plan(s, 0, 3, rr) == -EINVAL, "align 0");
    T_CHECK(ckpt_snapshot_plan(s, 8192, 0, rr) == -EINVAL, "world 0");
    T_CHECK(ckpt_snapshot_plan(NULL, 8192, 3, rr) == -EINVAL, "NULL snapshot");
    T_CHECK(ckpt_snapshot_plan(s, 8192, 3, NULL) == -EINVAL, "NULL out");
    ckpt_chunk_info ci;
    T_CHECK(ckpt_snapshot_chunk_info(s, NBUF, 0, &ci) == -EINVAL, "buffer out of range");
    T_CHECK(ckpt_snapshot_chunk_info(s, 2, 0, &ci) == -EINVAL, "chunk of an empty buffer");

    ckpt_snapshot_close(s);
    free(path);
    for (int i = 0; i < NBUF; i++) free(mem[i]);
    t_rmrf(root);
    free(root);
}

int main(void)
{
    test_reshard_args();
    test_even_bounds();
    test_exhaustive();
    test_c11_scaling();
    test_snapshot_plan();
    return t_done("test_ckpt_plan");
}
