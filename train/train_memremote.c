/* train_memremote.c - the memory tier's remote reads (issue 13): during --resume auto, the
 * memory slots of the other nodes, read through their agents (elastic/mem_client.h), as
 * remotes of ckpt_mem_list_ex / ckpt_mem_snapshot_open_ex (ckpt/ckpt_mem.h). See
 * train_internal.h, "train_memremote.c".
 *
 * Why through the agents and not a collective between the ranks: the slots a restore needs are
 * those of the ranks that died (a node lost, or a new world size whose shards straddle the old
 * ones); their bytes live in the agents' segment folders, not in any live rank's memory, and
 * each agent already serves its folder (the replica server) with the job token.
 */
#include "ckpt_mem.h"
#include "clock.h"
#include "log.h"
#include "mem_client.h"
#include "store.h"
#include "train_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TAG "train"
#define STORE_CONNECT_S 5.0 /* to reach the store */
/* For a peer agent's address in the store. Short on purpose: every agent publishes its address
 * before it starts its workers (agent.c, mem_round), and the resume runs after every rank of the
 * round joined the group, so a missing key means that agent has no replica server
 * (--mem-replica-mbps 0): a long wait would only delay every restart of such a job. */
#define STORE_WAIT_S 1.0
#define PEER_TIMEOUT_S 10.0 /* each socket wait of a query without progress */

/* What a read needs of a listed slot. */
typedef struct slot_key {
    uint32_t kind, local, slot;
    uint64_t agent;
    uint64_t seq;
} slot_key;

typedef struct peer {
    elastic_mem_client *c;
    char name[160];       /* "peer agent host:port" */
    pthread_mutex_t mu;   /* guards keys */
    slot_key *keys;       /* every slot any listing returned; ref = index (append-only, so a
                             handle's refs stay valid across later listings) */
    size_t nkeys;
    uint64_t bytes;       /* read since the last train_memremote_done (atomic) */
    uint64_t ns;
} peer;

struct train_memremote {
    peer *peers;
    size_t npeers;
    ckpt_mem_remote *remotes;
};

static int peer_list(void *ctx, ckpt_mem_remote_slot **out, size_t *n)
{
    peer *p = ctx;
    *out = NULL;
    *n = 0;
    elastic_mem_slot *v = NULL;
    size_t cnt = 0;
    int rc = elastic_mem_client_list(p->c, &v, &cnt);
    if (rc < 0) return rc;
    ckpt_mem_remote_slot *o = cnt ? calloc(cnt, sizeof *o) : NULL;
    pthread_mutex_lock(&p->mu);
    slot_key *k = cnt ? realloc(p->keys, (p->nkeys + cnt) * sizeof *k) : p->keys;
    if (k) p->keys = k;
    if (cnt && (!o || !k)) {
        pthread_mutex_unlock(&p->mu);
        free(o);
        free(v);
        return -ENOMEM;
    }
    for (size_t i = 0; i < cnt; i++) {
        const elastic_mem_slot *e = &v[i];
        p->keys[p->nkeys] = (slot_key){e->kind, e->local, e->slot, e->agent, e->seq};
        o[i].ref = p->nkeys++;
        o[i].payload_bytes = e->payload_bytes;
        memcpy(o[i].head, e->head, sizeof o[i].head);
        if (e->kind == ELASTIC_MEM_REP)
            snprintf(o[i].where, sizeof o[i].where, "%s rep-%016" PRIx64 "-%u slot %u", p->name, e->agent,
                     e->local, e->slot);
        else
            snprintf(o[i].where, sizeof o[i].where, "%s own-%u slot %u", p->name, e->local, e->slot);
    }
    pthread_mutex_unlock(&p->mu);
    free(v);
    *out = o;
    *n = cnt;
    return 0;
}

static int peer_read(void *ctx, uint64_t ref, uint64_t off, uint64_t len, void *dst)
{
    peer *p = ctx;
    pthread_mutex_lock(&p->mu);
    int have = ref < p->nkeys;
    slot_key k = have ? p->keys[ref] : (slot_key){0, 0, 0, 0, 0};
    pthread_mutex_unlock(&p->mu);
    if (!have) return -EINVAL;
    elastic_mem_slot w = {.kind = k.kind, .local = k.local, .slot = k.slot, .agent = k.agent, .seq = k.seq};
    double t0 = clock_now_s();
    int rc = elastic_mem_client_get(p->c, &w, off, dst, len);
    if (rc == 0) {
        __atomic_add_fetch(&p->bytes, len, __ATOMIC_RELAXED);
        __atomic_add_fetch(&p->ns, (uint64_t)((clock_now_s() - t0) * 1e9), __ATOMIC_RELAXED);
    }
    return rc;
}

static int env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    return *end || x < 0 || x > 1 << 20 ? dflt : (int)x;
}

/* The remotes of every other node of this round: their agents' addresses from the store. */
static int build(state *s)
{
    if (s->mem_remote) return 0;
    int nnodes = env_int("GROUP_WORLD_SIZE", 1), me = env_int("GROUP_RANK", -1);
    int gen = env_int("ELASTIC_RESTART_COUNT", -1), port = env_int("MASTER_PORT", -1);
    const char *run = getenv("ELASTIC_RUN_ID"), *host = getenv("MASTER_ADDR");
    const char *token = getenv("ELASTIC_STORE_TOKEN");
    if (nnodes <= 1 || me < 0 || gen < 0 || port <= 0 || !run || !host) return -ENOENT; /* one node */
    train_memremote *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    r->peers = calloc((size_t)nnodes, sizeof *r->peers);
    r->remotes = calloc((size_t)nnodes, sizeof *r->remotes);
    elastic_store_client *c = NULL;
    int rc = !r->peers || !r->remotes ? -ENOMEM : elastic_store_connect(&c, host, port, token, STORE_CONNECT_S);
    if (rc < 0) {
        LOG_W(TAG, "memory tier: cannot reach the store at %s:%d for the peer agents' addresses: %s", host,
              port, strerror(-rc));
    }
    for (int n = 0; rc == 0 && n < nnodes; n++) {
        if (n == me) continue;
        char key[256];
        snprintf(key, sizeof key, "rdzv/%s/mem/%d/%d", run, gen, n);
        void *val = NULL;
        size_t len = 0;
        int g = elastic_store_get(c, key, &val, &len, STORE_WAIT_S);
        if (g < 0) {
            LOG_W(TAG, "memory tier: no address of node %d's agent in the store (%s): its memory is not "
                  "read", n, strerror(-g));
            continue;
        }
        peer *p = &r->peers[r->npeers];
        int oc = elastic_mem_client_open(&p->c, val, token, PEER_TIMEOUT_S);
        if (oc < 0) {
            LOG_W(TAG, "memory tier: node %d's agent address '%.100s' is unusable: %s", n, (char *)val,
                  strerror(-oc));
            free(val);
            continue;
        }
        snprintf(p->name, sizeof p->name, "peer agent %s", (char *)val);
        free(val);
        pthread_mutex_init(&p->mu, NULL);
        r->remotes[r->npeers] = (ckpt_mem_remote){p->name, p, peer_list, peer_read};
        r->npeers++;
    }
    elastic_store_close(c);
    if (rc < 0) {
        free(r->peers);
        free(r->remotes);
        free(r);
        return rc;
    }
    s->mem_remote = r;
    LOG_D(TAG, "memory tier: %zu peer agent(s) to read memory slots from", r->npeers);
    return 0;
}

int train_memremote_list(state *s, const char *mem_path, int64_t newest, ckpt_mem_entry **out, size_t *n)
{
    int rc = ckpt_mem_list(mem_path, out, n);
    if (rc < 0) return rc;
    const char *need = NULL;
    for (size_t i = 0; i < *n && !need; i++)
        if ((*out)[i].status == CKPT_MEM_PARTIAL && (int64_t)(*out)[i].step >= newest &&
            (!s->o->run_id || !strcmp((*out)[i].run_id, s->o->run_id)))
            need = (*out)[i].id;
    if (!need) return 0;
    char id[CKPT_MEM_ID_MAX];
    snprintf(id, sizeof id, "%s", need);
    if (build(s) < 0 || !s->mem_remote->npeers) return 0;
    LOG_I(TAG, "memory snapshot %s lacks some ranks' slots on this node: asking %zu peer agent(s)", id,
          s->mem_remote->npeers);
    ckpt_mem_entry *e = NULL;
    size_t m = 0;
    if ((rc = ckpt_mem_list_ex(mem_path, s->mem_remote->remotes, s->mem_remote->npeers, &e, &m)) < 0) {
        LOG_W(TAG, "memory tier: listing with the peer agents failed: %s; this node's listing is used",
              strerror(-rc));
        return 0;
    }
    free(*out);
    *out = e;
    *n = m;
    return 0;
}

int train_memremote_open(state *s, ckpt_snapshot **out, const char *id, char *why, size_t why_len)
{
    const char *path = getenv(CKPT_MEM_PATH_ENV);
    int rc = path ? ckpt_mem_snapshot_open(out, path, id, why, why_len) : -ENOENT;
    if (rc != -ENOENT) return rc;
    char local_why[600];
    snprintf(local_why, sizeof local_why, "%s", path ? why : "no memory tier on this node");
    int b = build(s);
    if (b == -ENOENT || (b == 0 && !s->mem_remote->npeers)) {
        snprintf(why, why_len, "%s", local_why);
        return -ENOENT; /* one node: nothing else to ask */
    }
    if (b < 0) {
        snprintf(why, why_len, "%s; the peer agents cannot be asked: %s", local_why, strerror(-b));
        return -ENOENT;
    }
    train_memremote *r = s->mem_remote;
    for (size_t i = 0; i < r->npeers; i++) {
        __atomic_store_n(&r->peers[i].bytes, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&r->peers[i].ns, 0, __ATOMIC_RELAXED);
    }
    if ((rc = ckpt_mem_snapshot_open_ex(out, path, id, r->remotes, r->npeers, why, why_len)) < 0) return rc;
    uint32_t W = ckpt_snapshot_world_size(*out);
    for (size_t i = 0; i < r->npeers; i++) {
        char ranks[200] = "";
        size_t k = 0, cnt = 0;
        for (uint32_t q = 0; q < W; q++) {
            const char *nm = ckpt_mem_snapshot_remote_name(*out, q);
            if (!nm || strcmp(nm, r->peers[i].name) != 0) continue;
            if (k < sizeof ranks - 12) k += (size_t)snprintf(ranks + k, sizeof ranks - k, "%s%u", cnt ? "," : "", q);
            cnt++;
        }
        if (cnt)
            LOG_I(TAG, "memory snapshot %s: the slot%s of saved rank%s %s from memory (%s)", id,
                  cnt == 1 ? "" : "s", cnt == 1 ? "" : "s", ranks, r->peers[i].name);
    }
    return 0;
}

void train_memremote_done(state *s, const ckpt_snapshot *snap)
{
    if (!s->mem_remote || !ckpt_snapshot_is_mem(snap) || ckpt_mem_snapshot_remotes(snap) <= 0) return;
    train_memremote *r = s->mem_remote;
    for (size_t i = 0; i < r->npeers; i++) {
        uint64_t b = __atomic_exchange_n(&r->peers[i].bytes, 0, __ATOMIC_RELAXED);
        uint64_t ns = __atomic_exchange_n(&r->peers[i].ns, 0, __ATOMIC_RELAXED);
        if (!b) continue;
        LOG_I(TAG, "read %.1f MiB of memory slots from memory (%s): %.1f ms in the reads, %.0f MB/s per "
              "reading thread", (double)b / 1048576.0, r->peers[i].name, (double)ns / 1e6,
              ns ? (double)b / ((double)ns / 1e9) / 1e6 : 0.0);
    }
}

void train_memremote_close(state *s)
{
    train_memremote *r = s->mem_remote;
    if (!r) return;
    for (size_t i = 0; i < r->npeers; i++) {
        elastic_mem_client_close(r->peers[i].c);
        free(r->peers[i].keys);
        pthread_mutex_destroy(&r->peers[i].mu);
    }
    free(r->peers);
    free(r->remotes);
    free(r);
    s->mem_remote = NULL;
}
