/* tier_bench - one snapshot restored from every tier, for bench/tier_bench.sh (which makes the
 * snapshot with s3_bench, uploads it to an RGW and prints the table). A benchmark, not a
 * test: it checks only what the reader's checksums check.
 *
 *   tier_bench mem --from SNAP --prefix P [--replica-prefix Q] [--reps R]
 *       reads each rank's shards of the disk snapshot SNAP (a step folder saved by W ranks)
 *       into memory, then, per rank r, writes its memory snapshot into the segment
 *       "P.own-<r>" with ckpt_mem_write (the trainer's stage: copy fused with the chunk
 *       checksums) R times, and times a plain memcpy of the same bytes beside it (the floor);
 *       with --replica-prefix, copies each committed slot into "Q.rep-0000000000000001-<r>" the way the
 *       agent stores a replica it received (shmseg_create/begin, shmseg_copy_out, commit):
 *       under the prefix Q the snapshot then exists only as a peer's replica. Prints the
 *       snapshot's id ("mem:...") and the times.
 *   tier_bench restore --from SRC [--world W] [--threads T]
 *       W threads, each a new rank: ckpt_snapshot_open_any(SRC) - a step folder, an s3:// URL
 *       (store settings from the AWS variables) or a "mem:..." id (the segments under
 *       CKPT_MEM_PATH) - then ckpt_snapshot_read of its 1/W of every buffer into memory
 *       faulted beforehand (every chunk checked by the reader); wall time from the first open
 *       to the last byte.
 *   tier_bench peer --from SNAP --dir DIR [--world W] [--threads T]
 *       the remote read of issue 13: an agent's memory server (elastic_mem, as elastic runs it)
 *       over a segment folder DIR on loopback, SNAP's ranks written into its own segments as
 *       `mem` does, then `restore` of the "mem:..." id twice: from the segments directly
 *       (own_restore_*) and with every rank's slot read through the server
 *       (elastic/mem_client.h as a ckpt_mem remote; peer_restore_*), each chunk checked.
 * Each prints "key value" lines on stdout (seconds, bytes). Exit status: 0 done, 1 failure,
 * 2 usage error.
 */
#include "ckpt.h"
#include "ckpt_mem.h"
#include "ckpt_s3.h"
#include "clock.h"
#include "objstore.h"
#include "shmseg.h"
#include "agent_internal.h"
#include "mem_client.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define MAXW 8
#define MAXB 16

static const char usage_text[] =
    "usage: tier_bench mem --from SNAP --prefix P [--replica-prefix Q] [--reps R]\n"
    "       tier_bench restore --from SRC [--world W] [--threads T]\n"
    "  mem      memory snapshots of SNAP's ranks in P.own-<r> (and replicas in Q.rep-<16 hex>-<r>)\n"
    "       tier_bench peer --from SNAP --dir DIR [--world W] [--threads T]\n"
    "  restore  W (default 2, at most 8) ranks read their 1/W of every buffer of SRC (a step\n"
    "           folder, s3://BUCKET/PREFIX/step-N, or mem:... with CKPT_MEM_PATH set)\n"
    "  peer     SNAP's memory snapshot restored from own segments and through an agent's\n"
    "           memory server on loopback (DIR: a folder for the segments, e.g. in /dev/shm)\n"
    "Prints key value lines.\n";

static double cpu_s(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           1e-6 * (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

/* Rank r's share of a buffer of `total` bytes in a world of w: whole 4-byte elements,
 * the first ones one more (any split works: the reader re-shards). */
static void share(uint64_t total, uint32_t w, uint32_t r, uint64_t *off, uint64_t *len)
{
    uint64_t n = total / 4, base = n / w, rem = n % w;
    uint64_t first = r * base + (r < rem ? r : rem);
    *off = first * 4;
    *len = (base + (r < rem)) * 4;
}

/* The peer of `tier_bench peer`: an agent's memory server read through its client. */
typedef struct bench_peer {
    elastic_mem_client *c;
    pthread_mutex_t mu;
    elastic_mem_slot *keys; /* every slot listed; ref = index */
    size_t nkeys;
} bench_peer;

static const ckpt_mem_remote *g_remote; /* set: open "mem:..." ids through it alone */
static const char *g_key = "";          /* prefix of restore's output keys */

static int peer_list(void *ctx, ckpt_mem_remote_slot **out, size_t *n)
{
    bench_peer *p = ctx;
    elastic_mem_slot *v = NULL;
    size_t cnt = 0;
    *out = NULL;
    *n = 0;
    int rc = elastic_mem_client_list(p->c, &v, &cnt);
    if (rc < 0 || !cnt) {
        free(v);
        return rc;
    }
    ckpt_mem_remote_slot *o = calloc(cnt, sizeof *o);
    pthread_mutex_lock(&p->mu);
    elastic_mem_slot *k = realloc(p->keys, (p->nkeys + cnt) * sizeof *k);
    if (k) p->keys = k;
    if (o && k) {
        for (size_t i = 0; i < cnt; i++) {
            p->keys[p->nkeys] = v[i];
            o[i].ref = p->nkeys++;
            o[i].payload_bytes = v[i].payload_bytes;
            memcpy(o[i].head, v[i].head, sizeof o[i].head);
            snprintf(o[i].where, sizeof o[i].where, "peer agent %s slot %u of local %u",
                     elastic_mem_client_addr(p->c), v[i].slot, v[i].local);
        }
    }
    pthread_mutex_unlock(&p->mu);
    free(v);
    if (!o || !k) {
        free(o);
        return -ENOMEM;
    }
    *out = o;
    *n = cnt;
    return 0;
}

static int peer_read(void *ctx, uint64_t ref, uint64_t off, uint64_t len, void *dst)
{
    bench_peer *p = ctx;
    pthread_mutex_lock(&p->mu);
    elastic_mem_slot w = {0};
    int have = ref < p->nkeys;
    if (have) {
        w.kind = p->keys[ref].kind;
        w.agent = p->keys[ref].agent;
        w.local = p->keys[ref].local;
        w.slot = p->keys[ref].slot;
        w.seq = p->keys[ref].seq;
    }
    pthread_mutex_unlock(&p->mu);
    return have ? elastic_mem_client_get(p->c, &w, off, dst, len) : -EINVAL;
}

static int open_src(ckpt_snapshot **s, const char *src, char *why, size_t len)
{
    if (g_remote && ckpt_mem_is_id(src)) return ckpt_mem_snapshot_open_ex(s, NULL, src, g_remote, 1, why, len);
    objstore_opts so = OBJSTORE_OPTS_INIT;
    return ckpt_snapshot_open_any(s, src, &so, why, len);
}

/* ------------------------------------------------------------------ mem */

static int cmd_mem(const char *from, const char *prefix, const char *rprefix, unsigned reps)
{
    ckpt_snapshot *s = NULL;
    char why[512] = "";
    int rc = ckpt_snapshot_open(&s, from, why, sizeof why);
    if (rc < 0) {
        fprintf(stderr, "tier_bench mem: %s: %s\n", from, why[0] ? why : strerror(-rc));
        return rc;
    }
    uint32_t world = ckpt_snapshot_world_size(s);
    size_t nb = ckpt_snapshot_nbuffers(s);
    if (world > MAXW || nb > MAXB) {
        fprintf(stderr, "tier_bench mem: %s: %u ranks, %zu buffers: more than this bench takes\n",
                from, world, nb);
        ckpt_snapshot_close(s);
        return -EINVAL;
    }
    ckpt_buffer_info bi[MAXB];
    for (size_t i = 0; i < nb; i++) ckpt_snapshot_buffer_info(s, i, &bi[i]);
    const char *tr = ckpt_snapshot_trainer_json(s);
    uint64_t total_bytes = 0;
    double best_write = 0, best_copy = 0, worst_write = 0, replica_s = 0;
    char id[CKPT_MEM_ID_MAX] = "";
    for (uint32_t r = 0; r < world && rc == 0; r++) {
        ckpt_buffer b[MAXB];
        uint8_t *mem[MAXB] = {0};
        uint8_t *copy[MAXB] = {0};
        uint64_t shard = 0;
        for (size_t i = 0; i < nb && rc == 0; i++) {
            uint64_t off, len;
            share(bi[i].total_bytes, world, r, &off, &len);
            mem[i] = malloc(len ? len : 1);
            copy[i] = malloc(len ? len : 1);
            if (!mem[i] || !copy[i]) {
                rc = -ENOMEM;
                break;
            }
            memset(copy[i], 0xa5, len); /* faulted, as the trainer's memory is */
            rc = ckpt_snapshot_read(s, bi[i].name, off, len, mem[i], why, sizeof why);
            b[i] = (ckpt_buffer){bi[i].name, bi[i].dtype, bi[i].elem_bytes, bi[i].total_bytes, off,
                                 len, mem[i]};
            shard += len;
        }
        char path[4200];
        snprintf(path, sizeof path, "%s.own-%u", prefix, r);
        uint64_t need = ckpt_mem_need(b, nb, strlen(tr) + 4096, 4u << 20);
        shmseg *seg = NULL;
        if (rc == 0 && (rc = shmseg_create(path, 2, need, &seg)) < 0)
            snprintf(why, sizeof why, "cannot create %.300s: %s", path, strerror(-rc));
        for (unsigned k = 0; k < reps && rc == 0; k++) {
            double t0 = clock_now_s();
            rc = ckpt_mem_write(seg, -1, ckpt_snapshot_step(s), ckpt_snapshot_run_id(s),
                                ckpt_snapshot_config_hash(s), "tierbench", world, r, b, nb, tr,
                                4u << 20, NULL, NULL);
            double t = clock_now_s() - t0;
            if (rc < 0) snprintf(why, sizeof why, "ckpt_mem_write rank %u: %s", r, strerror(-rc));
            if (k == 0 || t < best_write) best_write = t;
            if (t > worst_write) worst_write = t;
            t0 = clock_now_s();
            for (size_t i = 0; i < nb; i++) memcpy(copy[i], mem[i], (size_t)b[i].bytes);
            t = clock_now_s() - t0;
            if (k == 0 || t < best_copy) best_copy = t;
        }
        /* per-rank figures add up: the ranks of one node stage at the same time on their own
         * cores in a real job; here they run one after the other */
        printf("mem_write_rank%u_s %.6f\nmemcpy_rank%u_s %.6f\n", r, best_write, r, best_copy);
        total_bytes += shard;
        if (rc == 0 && rprefix) { /* the replica, as the agent's receiver stores it */
            int slot = -1, rslot = -1;
            shmseg *rep = NULL;
            shmseg_info info;
            char rpath[4200];
            shmseg_rep_path(rpath, sizeof rpath, rprefix, 1, r); /* as from agent id 1 */
            double t0 = clock_now_s();
            uint64_t seq = 0;
            if ((rc = shmseg_newest(seg, &slot)) == 0 && (rc = shmseg_slot_info(seg, slot, &info)) == 0 &&
                (rc = shmseg_create(rpath, 2, shmseg_slot_bytes(seg), &rep)) == 0 &&
                (rc = shmseg_begin(rep, -1, &rslot)) == 0 &&
                (rc = shmseg_copy_out(seg, slot, shmseg_payload(rep, rslot), 0, info.payload_bytes,
                                      &seq)) == 0)
                rc = shmseg_commit(rep, rslot, info.payload_bytes, info.step);
            replica_s += clock_now_s() - t0;
            if (rc < 0) snprintf(why, sizeof why, "replica %.300s: %s", rpath, strerror(-rc));
            shmseg_close(rep);
        }
        shmseg_close(seg);
        for (size_t i = 0; i < nb; i++) {
            free(mem[i]);
            free(copy[i]);
        }
    }
    if (rc == 0) {
        ckpt_mem_entry *e = NULL;
        size_t n = 0;
        rc = ckpt_mem_list(prefix, &e, &n);
        for (size_t i = 0; rc == 0 && i < n; i++)
            if (e[i].status == CKPT_MEM_COMPLETE && e[i].step == ckpt_snapshot_step(s)) {
                snprintf(id, sizeof id, "%s", e[i].id);
                break;
            }
        free(e);
        if (rc == 0 && !id[0]) {
            snprintf(why, sizeof why, "the memory snapshot written is not listed complete");
            rc = -ENOENT;
        }
    }
    ckpt_snapshot_close(s);
    if (rc < 0) {
        fprintf(stderr, "tier_bench mem: %s\n", why[0] ? why : strerror(-rc));
        return rc;
    }
    printf("mem_id %s\nmem_world %u\nmem_bytes %" PRIu64 "\nmem_replica_copy_s %.6f\n", id, world,
           total_bytes, replica_s);
    return 0;
}

/* ------------------------------------------------------------------ restore */

typedef struct rs_rank {
    uint32_t rank, world;
    const char *src;
    unsigned threads;
    uint8_t *mem;
    uint64_t mem_bytes, bytes;
    char why[512];
    int rc;
    double t0, t_open, t_end;
} rs_rank;

static void *restore_rank(void *arg)
{
    rs_rank *j = arg;
    ckpt_snapshot *s = NULL;
    j->rc = open_src(&s, j->src, j->why, sizeof j->why);
    j->t_open = clock_now_s() - j->t0;
    if (j->rc == 0 && j->threads) j->rc = ckpt_snapshot_set_threads(s, j->threads);
    uint64_t at = 0;
    for (size_t i = 0; j->rc == 0 && i < ckpt_snapshot_nbuffers(s); i++) {
        ckpt_buffer_info bi;
        ckpt_snapshot_buffer_info(s, i, &bi);
        uint64_t off, len;
        share(bi.total_bytes, j->world, j->rank, &off, &len);
        if (at + len > j->mem_bytes) {
            j->rc = -EOVERFLOW;
            break;
        }
        j->rc = ckpt_snapshot_read(s, bi.name, off, len, j->mem + at, j->why, sizeof j->why);
        at += len;
    }
    j->bytes = at;
    j->t_end = clock_now_s() - j->t0;
    ckpt_snapshot_close(s);
    return NULL;
}

static int cmd_restore(const char *src, uint32_t world, unsigned threads)
{
    ckpt_snapshot *s = NULL;
    char why[512] = "";
    int rc = open_src(&s, src, why, sizeof why); /* sizes first, not timed */
    if (rc < 0) {
        fprintf(stderr, "tier_bench restore: %s: %s\n", src, why[0] ? why : strerror(-rc));
        return rc;
    }
    uint64_t raw = 0, stored = 0;
    ckpt_snapshot_sizes(s, &raw, &stored);
    size_t nb = ckpt_snapshot_nbuffers(s);
    ckpt_snapshot_close(s);
    rs_rank jobs[MAXW];
    pthread_t th[MAXW];
    for (uint32_t r = 0; r < world; r++) {
        uint64_t per = raw / world + 4 * nb + 4096;
        jobs[r] = (rs_rank){r, world, src, threads, malloc((size_t)per), per, 0, "", 0, 0, 0, 0};
        if (!jobs[r].mem) return -ENOMEM;
        memset(jobs[r].mem, 0xa5, (size_t)per);
    }
    double c0 = cpu_s(), t0 = clock_now_s();
    uint32_t started = 0;
    for (uint32_t r = 0; r < world; r++) {
        jobs[r].t0 = t0;
        if (pthread_create(&th[r], NULL, restore_rank, &jobs[r]) != 0) break;
        started++;
    }
    for (uint32_t r = 0; r < started; r++) pthread_join(th[r], NULL);
    double t = clock_now_s() - t0, cpu = cpu_s() - c0;
    uint64_t bytes = 0;
    rc = started == world ? 0 : -EAGAIN;
    for (uint32_t r = 0; r < world; r++) {
        if (r < started && jobs[r].rc < 0) {
            fprintf(stderr, "tier_bench restore: rank %u of %u: %s\n", r, world,
                    jobs[r].why[0] ? jobs[r].why : strerror(-jobs[r].rc));
            if (rc == 0) rc = jobs[r].rc;
        }
        bytes += jobs[r].bytes;
        free(jobs[r].mem);
    }
    if (rc == 0 && bytes != raw) {
        fprintf(stderr, "tier_bench restore: read %" PRIu64 " bytes of %" PRIu64 "\n", bytes, raw);
        rc = -EIO;
    }
    if (rc == 0)
        printf("%srestore_s %.6f\n%srestore_cpu_s %.3f\n%srestore_raw_bytes %" PRIu64
               "\n%srestore_stored_bytes %" PRIu64 "\n", g_key, t, g_key, cpu, g_key, raw, g_key, stored);
    return rc;
}

/* ------------------------------------------------------------------ peer */

static int cmd_peer(const char *from, const char *dir, uint32_t world, unsigned threads)
{
    elastic_mem *m = NULL;
    char addr[96];
    int rc = elastic_mem_open(&m, dir, "tier-bench", (int)world);
    if (rc < 0) return rc;
    if ((rc = elastic_mem_replica_start(m, "127.0.0.1", "tier-bench-token", 1000, NULL, addr, sizeof addr)) < 0) {
        elastic_mem_close(m);
        return rc;
    }
    const char *prefix = elastic_mem_path(m);
    ckpt_mem_entry *e = NULL;
    size_t n = 0;
    char id[CKPT_MEM_ID_MAX] = "";
    if ((rc = cmd_mem(from, prefix, NULL, 1)) == 0 && (rc = ckpt_mem_list(prefix, &e, &n)) == 0) {
        for (size_t i = 0; i < n && !id[0]; i++)
            if (e[i].status == CKPT_MEM_COMPLETE) snprintf(id, sizeof id, "%s", e[i].id);
        if (!id[0]) rc = -ENOENT;
    }
    free(e);
    bench_peer p = {NULL, PTHREAD_MUTEX_INITIALIZER, NULL, 0};
    if (rc == 0) rc = elastic_mem_client_open(&p.c, addr, "tier-bench-token", 10.0);
    if (rc == 0) {
        setenv(CKPT_MEM_PATH_ENV, prefix, 1);
        g_key = "own_";
        rc = cmd_restore(id, world, threads);
    }
    ckpt_mem_remote rm = {"peer agent", &p, peer_list, peer_read};
    if (rc == 0) {
        g_remote = &rm;
        g_key = "peer_";
        rc = cmd_restore(id, world, threads);
        g_remote = NULL;
    }
    if (rc == 0) printf("peer_addr %s\n", addr);
    else fprintf(stderr, "tier_bench peer: %s\n", strerror(-rc));
    elastic_mem_client_close(p.c);
    free(p.keys);
    elastic_mem_close(m);
    return rc;
}

/* ------------------------------------------------------------------ main */

static int parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || !end || *end || s[0] == '-' || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(usage_text, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1], *from = NULL, *prefix = NULL, *rprefix = NULL, *dir = NULL;
    uint64_t world = 2, threads = 0, reps = 3;
    static const struct option lo[] = {
        {"from", 1, 0, 'f'}, {"prefix", 1, 0, 'p'}, {"replica-prefix", 1, 0, 'q'},
        {"dir", 1, 0, 'd'}, {"world", 1, 0, 'w'}, {"threads", 1, 0, 't'}, {"reps", 1, 0, 'r'},
        {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c, bad = 0;
    optind = 2;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'f': from = optarg; break;
        case 'p': prefix = optarg; break;
        case 'q': rprefix = optarg; break;
        case 'd': dir = optarg; break;
        case 'w': bad |= parse_u64(optarg, 1, MAXW, &world); break;
        case 't': bad |= parse_u64(optarg, 1, 64, &threads); break;
        case 'r': bad |= parse_u64(optarg, 1, 100, &reps); break;
        case 'h': fputs(usage_text, stdout); return 0;
        default: bad = 1;
        }
    }
    if (optind < argc) bad = 1;
    int rc;
    if (!bad && !strcmp(cmd, "mem") && from && prefix) rc = cmd_mem(from, prefix, rprefix, (unsigned)reps);
    else if (!bad && !strcmp(cmd, "restore") && from)
        rc = cmd_restore(from, (uint32_t)world, (unsigned)threads);
    else if (!bad && !strcmp(cmd, "peer") && from && dir)
        rc = cmd_peer(from, dir, (uint32_t)world, (unsigned)threads);
    else {
        fputs(usage_text, stderr);
        return 2;
    }
    return rc < 0 ? 1 : 0;
}
