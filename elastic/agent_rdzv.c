/* agent_rdzv.c - rendezvous of the agents of several nodes over the elastic store, in rounds
 * with generation numbers (in the spirit of torch's c10d rendezvous), plus heartbeats.
 *
 * Keys (P = "rdzv/<run id>/"; counters are store ADD counters, texts are plain values):
 *   elastic/job         the run id of the job whose agent hosts the store; set by that agent
 *                       (after P config) before it registers. Every other agent waits for it
 *                       (at most max(10 s, heartbeat timeout)) and leaves with exit 2 when it
 *                       names another job: two jobs on one endpoint would fail together when
 *                       the hosting one ends
 *   P config            "nproc=<n> nnodes=<min>:<max>" of the hosting agent; an agent with
 *                       other settings is refused (exit 2) before it registers: the ranks
 *                       would overlap (RANK = node rank x nproc + local rank)
 *   P agents            counter: agents that ever registered; P agent/<i> = "<aid> <host> <pid>"
 *   P hb/<aid>          counter bumped by the agent's watcher thread every min(1, T/3) s
 *                       (T = heartbeat timeout); a value that does not move for T = dead agent
 *   P gen               the newest round some agent joined (a hint for newcomers)
 *   P r/<g>/n           counter: join order of round g (the k-th joiner has number k)
 *   P r/<g>/a/<k>       "<aid> <host> <pid>" of the k-th joiner
 *   P r/<g>/ranks       the node ranks of round g: N space-separated entries, the aid of node
 *                       0, 1, ...; "?<k>" stands for the k-th joiner when the proposer could
 *                       not read its descriptor. Set once (compare-and-set from missing) by
 *                       the first member past the close (assign_ranks); every member reads
 *                       its node rank from the value that won
 *   P r/<g>/closed      N, the nodes of round g; set once (compare-and-set from missing)
 *   P r/<g>/stop        "<kind> <reason>": round g is over; kind F failure (a worker failed, an
 *                       agent died, a hang: counted against --max-restarts by every member),
 *                       S scale-up (an agent waits to join), P a node was preempted; set once
 *   P r/<g>/done        counter: members whose workers all exited 0
 *   P end               "<code> <reason>": the job is over (0 every node of the last round
 *                       finished, 1 failure, 2 usage error of a worker); set once
 *   P bye/<aid>         the agent has read the end and leaves
 *   P mem/<g>/<node>    "host:port" of the memory-tier replica server of node <node> in round
 *                       g (agent_mem.c), set by that node's agent when the round starts
 *
 * Rounds: an agent joins round g (P gen, or the round after its last one) with ADD on
 * r/<g>/n. The round closes when max_nodes joined, or last_call_s after min_nodes had joined
 * (each waiting agent times this itself; the first compare-and-set wins), and only once round
 * g-1 is over (its stop key is set) and each of its members joined round g or went silent
 * (prev_pending: a member's workers may still be taking a final snapshot), so that two
 * rounds never run at once. Node ranks are sticky: a member of round g-1 that joins round g
 * keeps its node rank when it is below N (so a restart after a rank failure puts every rank
 * back on the node whose memory-tier segments hold its own slot); the others take the free
 * ranks in join order. A joiner whose
 * number is above N came late and goes on to round g+1; its presence there (r/<g+1>/n > 0)
 * makes the members of a round with fewer than max_nodes stop it gracefully (kind S). An
 * outsider waiting for round g+1 also watches the heartbeats of round g's members and stops
 * g when one of them is dead (otherwise a round whose agents all died would block it).
 *
 * Members of a running round: each one's watcher thread parks a GET on r/<g>/stop (answered
 * the moment any member sets it), checks the end key and the heartbeats of the other members
 * every tick, and sets r/<g>/stop itself for a dead member or a waiting joiner. A member whose
 * workers fail sets the stop key with the reason (agent.c). When every member is done, the
 * last one sets the end key to 0. The agent that hosts the store leaves last: it waits until
 * every registered agent said bye or has a stale heartbeat (bounded by T + 1 s).
 *
 * A store call that fails (the store host died: connection reset) makes the store "lost": the
 * agent stops its workers and exits 1 (there is no replicated store).
 */
#include "clock.h"
#include "agent_internal.h"

#include "log.h"
#include "store.h"
#include "thread.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define KEY_MAX 256
#define WHY_MAX 512
#define DESC_MAX 160

typedef struct peer {
    char aid[24];
    char desc[DESC_MAX];
    int node;               /* node rank in the watched round, -1 when not a member */
    int64_t value;
    int have;               /* value was read at least once */
    double changed;         /* monotonic time the value last moved (or was first looked at) */
} peer;

struct elastic_rdzv {
    elastic_rdzv_opts o;
    char *host, *token, *run_id;
    char prefix[96];
    char aid[24];
    char desc[DESC_MAX];
    elastic_store_client *c;  /* main thread */
    elastic_store_client *wc; /* watcher thread */
    pthread_t th;
    int th_started;
    int notify[2];
    double tick;

    pthread_mutex_t mu;       /* guards everything below */
    int quit;
    int watch_gen;            /* -1 none */
    int watch_nnodes;         /* 0 = read r/<g>/closed */
    int watch_member;         /* 1 member, 0 outsider waiting for the next round */
    int watch_done;
    unsigned watch_serial;    /* bumped by every change of the above */
    unsigned events;
    int end_code;             /* -1 until the end is seen */
    char end_why[WHY_MAX];
    int lost;                 /* negative errno */

    /* watcher-thread data (read by close after the thread is joined) */
    peer *peers;
    int npeers, cap;

    /* main-thread data of elastic_rdzv_join: the members of the round before the one it
     * joins, until each one joined that round too or went silent (prev_pending) */
    peer *prev;
    unsigned char *prev_done;  /* 1: joined, silent, or this agent */
    int nprev, prev_gen;
};

static void key(const elastic_rdzv *r, char *out, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void key(const elastic_rdzv *r, char *out, const char *fmt, ...)
{
    int n = snprintf(out, KEY_MAX, "%s", r->prefix);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out + n, KEY_MAX - (size_t)n, fmt, ap);
    va_end(ap);
}

static void notify(elastic_rdzv *r)
{
    char b = 1;
    ssize_t w = write(r->notify[1], &b, 1);
    (void)w; /* a full pipe already says "look" */
}

/* Mark the store lost (first error kept) and tell main. */
static void set_lost(elastic_rdzv *r, int rc)
{
    pthread_mutex_lock(&r->mu);
    if (!r->lost) {
        r->lost = rc;
        r->events |= ELASTIC_EV_LOST;
    }
    pthread_mutex_unlock(&r->mu);
    notify(r);
}

static void set_end(elastic_rdzv *r, const char *value)
{
    int code = atoi(value);
    const char *why = strchr(value, ' ');
    pthread_mutex_lock(&r->mu);
    if (r->end_code < 0) {
        r->end_code = code < 0 || code > 2 ? 1 : code;
        snprintf(r->end_why, sizeof r->end_why, "%s", why ? why + 1 : "");
        r->events |= ELASTIC_EV_END;
    }
    pthread_mutex_unlock(&r->mu);
    notify(r);
}

/* 1 = present (value in *out, malloc'ed, NUL-terminated), 0 = missing, <0 = store error. */
static int get_opt(elastic_store_client *c, const char *k, char **out, double wait_s)
{
    void *v = NULL;
    size_t len = 0;
    int rc = elastic_store_get(c, k, &v, &len, wait_s);
    if (rc == -ETIMEDOUT) return 0;
    if (rc < 0) return rc;
    if (out)
        *out = v;
    else
        free(v);
    return 1;
}

/* Parse "<aid> <rest>" into aid and desc. */
static void parse_desc(const char *v, char *aid, size_t alen, char *desc, size_t dlen)
{
    const char *sp = strchr(v, ' ');
    size_t n = sp ? (size_t)(sp - v) : strlen(v);
    if (n >= alen) n = alen - 1;
    memcpy(aid, v, n);
    aid[n] = '\0';
    snprintf(desc, dlen, "%s", sp ? sp + 1 : v);
}

/* The descriptor of the k-th joiner of round g (r/<g>/a/<k>), waiting at most wait_s for it:
 * 1 with aid and desc, 0 when missing (aid "?<k>", desc "(never registered)": a joiner that
 * died between its ADD and its SET looks silent), <0 a store error. */
static int read_joiner(const elastic_rdzv *r, elastic_store_client *c, int g, int64_t k,
                       double wait_s, char aid[24], char desc[DESC_MAX])
{
    char key_[KEY_MAX], *v = NULL;
    key(r, key_, "r/%d/a/%" PRId64, g, k);
    int rc = get_opt(c, key_, &v, wait_s);
    if (rc == 1) {
        parse_desc(v, aid, 24, desc, DESC_MAX);
        free(v);
    } else if (rc == 0) {
        snprintf(aid, 24, "?%" PRId64, k);
        snprintf(desc, DESC_MAX, "(never registered)");
    }
    return rc;
}

/* Make room in the peer table for `more` new entries, so that the peer_find calls that follow
 * (at most `more` new aids) do not move it: callers keep the pointers peer_find returns. */
static int peers_reserve(elastic_rdzv *r, int more)
{
    if (more < 0 || r->npeers > INT_MAX / 2 - more) return -ENOMEM;
    if (r->npeers + more <= r->cap) return 0;
    int cap = r->cap ? r->cap : 16;
    while (cap < r->npeers + more) cap *= 2;
    peer *p = realloc(r->peers, (size_t)cap * sizeof *p);
    if (!p) return -ENOMEM;
    r->peers = p;
    r->cap = cap;
    return 0;
}

/* The entry of aid, added when missing. The table moves when it grows: a caller that keeps
 * the returned pointers across calls reserves room first (peers_reserve). NULL: no memory. */
static peer *peer_find(elastic_rdzv *r, const char *aid, const char *desc)
{
    for (int i = 0; i < r->npeers; i++)
        if (!strcmp(r->peers[i].aid, aid)) return &r->peers[i];
    if (r->npeers == r->cap && peers_reserve(r, 1) < 0) return NULL;
    peer *p = &r->peers[r->npeers++];
    memset(p, 0, sizeof *p);
    snprintf(p->aid, sizeof p->aid, "%s", aid);
    snprintf(p->desc, sizeof p->desc, "%s", desc);
    p->node = -1;
    p->changed = clock_now_s();
    return p;
}

/* Read hb/<aid>; returns 1 when the heartbeat is stale (no move for the timeout), 0 when
 * alive, <0 store error. */
static int peer_stale(elastic_rdzv *r, elastic_store_client *c, peer *p, double *silent)
{
    char k[KEY_MAX], *v = NULL;
    key(r, k, "hb/%s", p->aid);
    int rc = get_opt(c, k, &v, 0);
    if (rc < 0) return rc;
    double t = clock_now_s();
    if (rc == 1) {
        int64_t val = strtoll(v, NULL, 10);
        free(v);
        if (!p->have || val != p->value) {
            p->have = 1;
            p->value = val;
            p->changed = t;
        }
    }
    *silent = t - p->changed;
    return *silent > r->o.heartbeat_timeout_s;
}

/* ------------------------------------------------------------------ watcher thread */

typedef struct watch_state {
    int gen, nnodes, member, done;
    unsigned serial;
} watch_state;

/* Split the value of r/<g>/ranks into n entries (pointers into v, which is modified).
 * Returns 0, or -EBADMSG when it does not hold exactly n non-empty entries. */
static int split_ranks(char *v, int n, char **ent)
{
    int i = 0;
    for (char *save = NULL, *t = strtok_r(v, " ", &save); t; t = strtok_r(NULL, " ", &save)) {
        if (i == n) return -EBADMSG;
        ent[i++] = t;
    }
    return i == n ? 0 : -EBADMSG;
}

/* Load the members of round ws->gen into the peer table, indexed by node rank (r/<g>/ranks;
 * join order while that key is missing, which only an outsider can meet). Returns the number
 * of members, 0 when the round is not closed, <0 store error. A member whose descriptor
 * cannot be read within a tick is entered as "?" and will look dead. */
static int load_members(elastic_rdzv *r, const watch_state *ws, peer ***out)
{
    char k[KEY_MAX], *v = NULL;
    int n = ws->nnodes;
    if (n <= 0) {
        key(r, k, "r/%d/closed", ws->gen);
        int rc = get_opt(r->wc, k, &v, 0);
        if (rc <= 0) return rc;
        n = atoi(v);
        free(v);
        v = NULL;
        if (n <= 0) return 0;
    }
    peer **joined = calloc((size_t)n, sizeof *joined);
    peer **m = calloc((size_t)n, sizeof *m);
    char **ent = calloc((size_t)n, sizeof *ent);
    int rc = 0;
    /* the pointers into the peer table must survive the peer_find calls below */
    if (!joined || !m || !ent || peers_reserve(r, n) < 0) {
        rc = -ENOMEM;
        goto out;
    }
    for (int i = 0; i < r->npeers; i++) r->peers[i].node = -1;
    for (int i = 0; i < n; i++) {
        char aid[24], desc[DESC_MAX];
        /* short: our own heartbeat waits */
        if ((rc = read_joiner(r, r->wc, ws->gen, i + 1, r->tick, aid, desc)) < 0) goto out;
        if (!(joined[i] = peer_find(r, aid, desc))) {
            rc = -ENOMEM;
            goto out;
        }
    }
    key(r, k, "r/%d/ranks", ws->gen);
    if ((rc = get_opt(r->wc, k, &v, ws->member ? r->tick : 0)) < 0) goto out;
    /* by node rank; join order when the value is missing (an outsider, before the members
     * set it) or does not match the joiners as read here (an outsider that read a joiner's
     * descriptor as missing a moment before it was set): then only the node numbers in this
     * watcher's messages can be off, the heartbeats checked are the same */
    int permuted = rc == 1 && split_ranks(v, n, ent) == 0;
    for (int i = 0; i < n && permuted; i++) {
        int j = -1;
        if (ent[i][0] == '?') {
            j = atoi(ent[i] + 1) - 1;
        } else {
            for (int q = 0; q < n && j < 0; q++)
                if (!strcmp(joined[q]->aid, ent[i])) j = q;
        }
        int taken = 0;
        for (int q = 0; q < i && j >= 0 && j < n; q++) taken |= m[q] == joined[j];
        if (j < 0 || j >= n || taken) permuted = 0;
        else m[i] = joined[j];
    }
    if (!permuted) {
        if (rc == 1) LOG_D(EA_TAG, "round %d: the node ranks do not match the joiners read: "
                           "join order for this watcher's messages", ws->gen);
        memcpy(m, joined, (size_t)n * sizeof *m);
    }
    for (int i = 0; i < n; i++) m[i]->node = i;
    *out = m;
    m = NULL;
    rc = n;
out:
    free(v);
    free(joined);
    free(ent);
    free(m);
    return rc;
}

static void *watcher(void *arg)
{
    elastic_rdzv *r = arg;
    char hbkey[KEY_MAX], endkey[KEY_MAX], k[KEY_MAX];
    key(r, hbkey, "hb/%s", r->aid);
    key(r, endkey, "end");
    watch_state ws = {-1, 0, 0, 0, ~0u};
    peer **members = NULL;
    int nmembers = 0;
    int stop_seen = 0, end_seen = 0;
    int rc = 0;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        int quit = r->quit;
        watch_state now = {r->watch_gen, r->watch_nnodes, r->watch_member, r->watch_done,
                           r->watch_serial};
        pthread_mutex_unlock(&r->mu);
        if (quit) break;
        if ((rc = elastic_store_add(r->wc, hbkey, 1, NULL)) < 0) break;
        if (now.serial != ws.serial) {
            ws = now;
            free(members);
            members = NULL;
            nmembers = 0;
            stop_seen = 0;
        }
        if (ws.gen >= 0 && !members && !stop_seen) {
            if ((rc = load_members(r, &ws, &members)) < 0) break;
            nmembers = rc;
            rc = 0;
        }
        /* park on the key most likely to change: the round's stop, or the end */
        int watching = ws.gen >= 0 && !stop_seen;
        char stopkey[KEY_MAX];
        key(r, stopkey, "r/%d/stop", ws.gen);
        const char *park = watching && !ws.done ? stopkey : endkey;
        char *v = NULL;
        if (end_seen && !watching) {
            /* nothing to wait for: just keep the heartbeat */
            struct timespec ts = {0, (long)(r->tick * 1e9)};
            nanosleep(&ts, NULL);
            continue;
        }
        int got = get_opt(r->wc, park, &v, r->tick);
        if (got < 0) {
            rc = got;
            break;
        }
        int stop_now = 0, end_now = 0;
        if (got == 1 && park == endkey) end_now = 1;
        if (got == 1 && park == stopkey) stop_now = 1;
        free(v);
        v = NULL;
        /* the other key, without waiting */
        if (!end_seen && !end_now && park != endkey) {
            if ((got = get_opt(r->wc, endkey, NULL, 0)) < 0) {
                rc = got;
                break;
            }
            end_now = got;
        }
        if (watching && !stop_now && park != stopkey) {
            if ((got = get_opt(r->wc, stopkey, NULL, 0)) < 0) {
                rc = got;
                break;
            }
            stop_now = got;
        }
        if (end_now && !end_seen) {
            if ((got = get_opt(r->wc, endkey, &v, 0)) < 0) {
                rc = got;
                break;
            }
            if (got) set_end(r, v);
            free(v);
            v = NULL;
            end_seen = 1;
        }
        if (stop_now) {
            stop_seen = 1;
            pthread_mutex_lock(&r->mu);
            if (r->watch_serial == ws.serial) r->events |= ELASTIC_EV_STOP;
            pthread_mutex_unlock(&r->mu);
            notify(r);
            continue;
        }
        if (!watching) continue;
        /* heartbeats of the other members */
        for (int i = 0; i < nmembers && rc == 0; i++) {
            if (!ws.member || strcmp(members[i]->aid, r->aid) != 0) {
                double silent = 0;
                int st = peer_stale(r, r->wc, members[i], &silent);
                if (st < 0) {
                    rc = st;
                    break;
                }
                if (st == 0) continue;
                char why[WHY_MAX];
                snprintf(why, sizeof why, "F node %d (%s) of round %d missed its heartbeats for "
                         "%.1f s", i, members[i]->desc, ws.gen, silent);
                LOG_W(EA_TAG, "%s", why + 2);
                rc = elastic_store_compare_set(r->wc, stopkey, NULL, 0, why, strlen(why), NULL,
                                               NULL);
                if (rc == 0) break; /* the parked GET reports it next */
            }
        }
        if (rc < 0) break;
        /* an agent waiting for the next round: scale up when there is room */
        if (ws.member && !ws.done && nmembers > 0 && nmembers < r->o.max_nodes) {
            key(r, k, "r/%d/n", ws.gen + 1);
            if ((got = get_opt(r->wc, k, &v, 0)) < 0) {
                rc = got;
                break;
            }
            long waiting = got ? strtol(v, NULL, 10) : 0;
            free(v);
            v = NULL;
            if (waiting > 0) {
                char why[WHY_MAX];
                snprintf(why, sizeof why, "S scale-up: %ld agent(s) wait to join; round %d has "
                         "%d of at most %d nodes", waiting, ws.gen, nmembers, r->o.max_nodes);
                if ((rc = elastic_store_compare_set(r->wc, stopkey, NULL, 0, why, strlen(why),
                                                    NULL, NULL)) < 0)
                    break;
            }
        }
    }
    free(members);
    if (rc < 0) {
        pthread_mutex_lock(&r->mu);
        int quit = r->quit;
        pthread_mutex_unlock(&r->mu);
        if (!quit) set_lost(r, rc);
    }
    return NULL;
}

/* ------------------------------------------------------------------ main-thread API */

static int connect_store(elastic_rdzv *r, elastic_store_client **out, double total_s)
{
    double t0 = clock_now_s();
    for (;;) {
        int rc = elastic_store_connect(out, r->host, r->o.port, r->token,
                                       r->o.heartbeat_timeout_s);
        if (rc != -ETIMEDOUT || clock_now_s() - t0 >= total_s) return rc;
        if (r->o.interrupted && r->o.interrupted(r->o.arg)) return -EINTR;
        LOG_I(EA_TAG, "waiting for the rendezvous store at %s:%d", r->host, r->o.port);
    }
}

/* "4" or "2:4", as --nnodes is written. */
static void nnodes_text(char *buf, size_t len, int lo, int hi)
{
    if (lo == hi)
        snprintf(buf, len, "%d", lo);
    else
        snprintf(buf, len, "%d:%d", lo, hi);
}

/* The hosting agent records the job; the others check it (see the top: elastic/job, P config).
 * Returns 0, -EBUSY another job, -EINVAL other settings (both logged), other store errors. */
static int check_job(elastic_rdzv *r)
{
    static const char job_key[] = "elastic/job";
    char k[KEY_MAX], mine[64];
    int ml = snprintf(mine, sizeof mine, "nproc=%d nnodes=%d:%d", r->o.nproc_per_node,
                      r->o.min_nodes, r->o.max_nodes);
    void *v = NULL;
    size_t len = 0;
    int rc;
    key(r, k, "config");
    if (r->o.hosting) {
        /* compare-and-set from missing: the first record stands (nobody else writes these) */
        if ((rc = elastic_store_compare_set(r->c, k, NULL, 0, mine, (size_t)ml, NULL, NULL)) < 0 ||
            (rc = elastic_store_compare_set(r->c, job_key, NULL, 0, r->run_id, strlen(r->run_id),
                                            NULL, NULL)) < 0)
            return rc;
        return 0;
    }
    double wait = r->o.heartbeat_timeout_s > 10 ? r->o.heartbeat_timeout_s : 10;
    rc = elastic_store_get(r->c, job_key, &v, &len, wait);
    if (rc == -ETIMEDOUT) {
        LOG_E(EA_TAG, "the store at %s:%d serves no elastic job (no job id recorded within "
              "%g s); give this job its own --rdzv-endpoint", r->host, r->o.port, wait);
        return -EBUSY;
    }
    if (rc < 0) return rc;
    if (strcmp(v, r->run_id) != 0) {
        LOG_E(EA_TAG, "the store at %s:%d serves job %.64s; give this job its own "
              "--rdzv-endpoint (this is --rdzv-id %s)", r->host, r->o.port, (const char *)v,
              r->run_id);
        free(v);
        return -EBUSY;
    }
    free(v);
    v = NULL;
    if ((rc = elastic_store_get(r->c, k, &v, &len, 0)) < 0) return rc;
    int nproc = -1, lo = -1, hi = -1;
    sscanf(v, "nproc=%d nnodes=%d:%d", &nproc, &lo, &hi);
    free(v);
    if (nproc == r->o.nproc_per_node && lo == r->o.min_nodes && hi == r->o.max_nodes) return 0;
    char diff[256], here[32], job[32];
    size_t off = 0;
    nnodes_text(here, sizeof here, r->o.min_nodes, r->o.max_nodes);
    nnodes_text(job, sizeof job, lo, hi);
    if (nproc != r->o.nproc_per_node)
        off += (size_t)snprintf(diff + off, sizeof diff - off, "--nproc-per-node %d here, %d "
                                "in the job", r->o.nproc_per_node, nproc);
    if ((lo != r->o.min_nodes || hi != r->o.max_nodes) && off < sizeof diff)
        snprintf(diff + off, sizeof diff - off, "%s--nnodes %s here, %s in the job",
                 off ? "; " : "", here, job);
    LOG_E(EA_TAG, "refusing to join job %s at %s:%d: %s (every agent of a job needs the same "
          "--nnodes and --nproc-per-node as the agent hosting the store)", r->run_id, r->host,
          r->o.port, diff);
    return -EINVAL;
}

int elastic_rdzv_open(elastic_rdzv **out, const elastic_rdzv_opts *o)
{
    elastic_rdzv *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    int rc = 0;
    r->o = *o;
    r->notify[0] = r->notify[1] = -1;
    r->watch_gen = -1;
    r->end_code = -1;
    pthread_mutex_init(&r->mu, NULL);
    r->host = strdup(o->host);
    r->token = o->token ? strdup(o->token) : NULL;
    r->run_id = strdup(o->run_id);
    if (!r->host || !r->run_id || (o->token && !r->token)) {
        rc = -ENOMEM;
        goto fail;
    }
    r->tick = o->heartbeat_timeout_s / 3 < 1.0 ? o->heartbeat_timeout_s / 3 : 1.0;
    snprintf(r->prefix, sizeof r->prefix, "rdzv/%s/", o->run_id);
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
        id = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
    snprintf(r->aid, sizeof r->aid, "%016" PRIx64, id);
    char hn[64] = "?";
    gethostname(hn, sizeof hn - 1);
    hn[sizeof hn - 1] = '\0';
    snprintf(r->desc, sizeof r->desc, "%s %.63s:%d", r->aid, hn, (int)getpid());
    if (pipe2(r->notify, O_NONBLOCK | O_CLOEXEC) != 0) {
        rc = -errno;
        goto fail;
    }
    if ((rc = connect_store(r, &r->c, o->join_timeout_s)) == -EINTR) goto fail;
    if (rc < 0 || (rc = connect_store(r, &r->wc, o->heartbeat_timeout_s)) < 0) {
        if (rc == -EACCES)
            LOG_E(EA_TAG, "the rendezvous store at %s:%d refused this agent's token: "
                  "ELASTIC_STORE_TOKEN differs from the one of the agent hosting the store%s",
                  r->host, o->port, r->token ? "" : " (unset here)");
        else
            LOG_E(EA_TAG, "cannot reach the rendezvous store at %s:%d: %s", r->host, o->port,
                  strerror(-rc));
        goto fail;
    }
    char k[KEY_MAX];
    int64_t idx = 0;
    if ((rc = check_job(r)) == -EBUSY || rc == -EINVAL) goto fail; /* logged; not registered */
    if (rc < 0) goto store_fail;
    key(r, k, "agents");
    if ((rc = elastic_store_add(r->c, k, 1, &idx)) < 0) goto store_fail;
    key(r, k, "agent/%" PRId64, idx);
    if ((rc = elastic_store_set(r->c, k, r->desc, strlen(r->desc))) < 0) goto store_fail;
    key(r, k, "hb/%s", r->aid);
    if ((rc = elastic_store_add(r->c, k, 1, NULL)) < 0) goto store_fail;
    if ((rc = common_thread_start(&r->th, watcher, r)) < 0) {
        LOG_E(EA_TAG, "cannot start the heartbeat thread: %s", strerror(-rc));
        goto fail;
    }
    r->th_started = 1;
    LOG_I(EA_TAG, "agent %s registered with the rendezvous store at %s:%d (run id %s)", r->desc,
          r->host, o->port, o->run_id);
    *out = r;
    return 0;
store_fail:
    LOG_E(EA_TAG, "rendezvous store at %s:%d: %s", r->host, o->port, strerror(-rc));
fail:
    r->lost = rc; /* no goodbye */
    elastic_rdzv_close(r);
    return rc;
}

int elastic_rdzv_notify_fd(const elastic_rdzv *r) { return r->notify[0]; }

unsigned elastic_rdzv_events(elastic_rdzv *r)
{
    char buf[64];
    while (read(r->notify[0], buf, sizeof buf) > 0) {
    }
    pthread_mutex_lock(&r->mu);
    unsigned ev = r->events;
    r->events = 0;
    pthread_mutex_unlock(&r->mu);
    return ev;
}

int elastic_rdzv_lost(const elastic_rdzv *r)
{
    pthread_mutex_lock((pthread_mutex_t *)&r->mu);
    int l = r->lost;
    pthread_mutex_unlock((pthread_mutex_t *)&r->mu);
    return l;
}

int elastic_rdzv_end_code(elastic_rdzv *r, char *why, size_t why_len)
{
    pthread_mutex_lock(&r->mu);
    int code = r->end_code;
    if (why && why_len) snprintf(why, why_len, "%s", r->end_why);
    pthread_mutex_unlock(&r->mu);
    return code;
}

static void set_watch(elastic_rdzv *r, int gen, int nnodes, int member, int done)
{
    pthread_mutex_lock(&r->mu);
    r->watch_gen = gen;
    r->watch_nnodes = nnodes;
    r->watch_member = member;
    r->watch_done = done;
    r->watch_serial++;
    r->events &= ~ELASTIC_EV_STOP;
    pthread_mutex_unlock(&r->mu);
}

void elastic_rdzv_watch(elastic_rdzv *r, const elastic_round *rd, int done)
{
    set_watch(r, rd->gen, rd->nnodes, 1, done);
}

void elastic_rdzv_unwatch(elastic_rdzv *r) { set_watch(r, -1, 0, 0, 0); }

/* A store error in the main thread: the store is lost. */
static int main_lost(elastic_rdzv *r, int rc)
{
    if (rc < 0 && rc != -ENOMEM && rc != -EINVAL && rc != -EMSGSIZE) set_lost(r, rc);
    return rc;
}

int elastic_rdzv_set(elastic_rdzv *r, const char *name, const char *value)
{
    char k[KEY_MAX];
    key(r, k, "%s", name);
    int rc = elastic_store_set(r->c, k, value, strlen(value));
    return rc < 0 ? main_lost(r, rc) : 0;
}

int elastic_rdzv_get(elastic_rdzv *r, const char *name, char **value)
{
    char k[KEY_MAX];
    key(r, k, "%s", name);
    int rc = get_opt(r->c, k, value, 0);
    return rc < 0 ? main_lost(r, rc) : rc;
}

int elastic_rdzv_local_addr(const elastic_rdzv *r, char *host, size_t host_len)
{
    return elastic_store_local_addr(r->c, host, host_len);
}

/* Round g-1 is over (its stop key is set), but its members may still be stopping: workers
 * that finish their step, take a final snapshot and drain uploads hold the snapshot folder
 * and their node's memory segments for up to --preempt-grace. Round g must not start
 * without them (a newcomer alone would close it after --last-call and meet their lock).
 * Returns how many members of g-1 other than this agent neither joined round g (r/<g>/a/N)
 * nor went silent (heartbeat stale for the timeout: dead, or gone); 0 when round g-1 never
 * closed; <0 a store error. Main thread only (r->prev). */
static int prev_pending(elastic_rdzv *r, int g)
{
    char k[KEY_MAX], *v = NULL;
    int rc;
    if (r->prev_gen != g) {
        free(r->prev);
        free(r->prev_done);
        r->prev = NULL;
        r->prev_done = NULL;
        r->nprev = 0;
        r->prev_gen = g;
        key(r, k, "r/%d/closed", g - 1);
        if ((rc = get_opt(r->c, k, &v, 0)) <= 0) return rc;
        int n = atoi(v);
        free(v);
        v = NULL;
        if (n <= 0) return 0;
        r->prev = calloc((size_t)n, sizeof *r->prev);
        r->prev_done = calloc((size_t)n, 1);
        if (!r->prev || !r->prev_done) return -ENOMEM;
        for (int i = 0; i < n; i++) {
            peer *p = &r->prev[r->nprev++];
            /* a "?" entry never registered: silent */
            if ((rc = read_joiner(r, r->c, g - 1, i + 1, 0, p->aid, p->desc)) < 0) return rc;
            p->node = -1;
            p->changed = clock_now_s();
            r->prev_done[i] = !strcmp(p->aid, r->aid) || p->aid[0] == '?';
        }
    }
    int pending = 0;
    int64_t count = 0;
    key(r, k, "r/%d/n", g);
    if ((rc = elastic_store_add(r->c, k, 0, &count)) < 0) return rc;
    for (int i = 0; i < r->nprev; i++) {
        peer *p = &r->prev[i];
        if (r->prev_done[i]) continue;
        for (int64_t j = 1; j <= count && !r->prev_done[i]; j++) {
            char aid[24], desc[DESC_MAX];
            if ((rc = read_joiner(r, r->c, g, j, 0, aid, desc)) < 0) return rc;
            if (rc == 1 && !strcmp(aid, p->aid)) r->prev_done[i] = 1;
        }
        double silent = 0;
        if (!r->prev_done[i]) {
            if ((rc = peer_stale(r, r->c, p, &silent)) < 0) return rc;
            r->prev_done[i] = rc == 1;
        }
        pending += !r->prev_done[i];
    }
    return pending;
}

/* The node rank of this agent (join number me) in round g, which closed with n nodes (see
 * r/<g>/ranks at the top). Proposes an assignment - the members of round g-1 keep their node
 * rank when it is below n, the others fill the free ranks in join order - and sets it when
 * no member did yet; the value that won decides. Returns 0 with *node_rank, <0 a store error
 * or -EBADMSG (a malformed value). Main thread only. */
static int assign_ranks(elastic_rdzv *r, int g, int n, int64_t me, int *node_rank)
{
    char k[KEY_MAX], *v = NULL, *pv = NULL;
    char (*aid)[24] = calloc((size_t)n, sizeof *aid);
    int *slot = malloc((size_t)n * sizeof *slot);
    char **ent = calloc((size_t)n, sizeof *ent);
    unsigned char *placed = calloc((size_t)n, 1);
    char *prop = malloc((size_t)n * 25 + 1);
    int rc = 0, np = 0;
    char **pent = NULL;
    void *won = NULL;
    size_t wlen = 0;
    if (!aid || !slot || !ent || !placed || !prop) {
        rc = -ENOMEM;
        goto out;
    }
    key(r, k, "r/%d/ranks", g);
    if ((rc = get_opt(r->c, k, &v, 0)) < 0) goto out;
    if (rc == 0) {
        for (int i = 0; i < n; i++) {
            char desc[DESC_MAX];
            /* a joiner sets its descriptor right after its ADD: wait a little for it */
            if ((rc = read_joiner(r, r->c, g, i + 1, 1.0, aid[i], desc)) < 0) goto out;
        }
        /* the node ranks of round g-1 (none: no stickiness, not an error) */
        key(r, k, "r/%d/ranks", g - 1);
        if (g > 0 && (rc = get_opt(r->c, k, &pv, 0)) < 0) goto out;
        if (g > 0 && rc == 1) {
            np = 1;
            for (const char *c = pv; *c; c++) np += *c == ' ';
            if (!(pent = calloc((size_t)np, sizeof *pent))) {
                rc = -ENOMEM;
                goto out;
            }
            if (split_ranks(pv, np, pent) < 0) np = 0;
        }
        for (int i = 0; i < n; i++) slot[i] = -1;
        for (int j = 0; j < n; j++) {
            if (aid[j][0] == '?') continue;
            for (int p = 0; p < np && p < n; p++)
                if (slot[p] < 0 && !strcmp(pent[p], aid[j])) {
                    slot[p] = j;
                    placed[j] = 1;
                    break;
                }
        }
        for (int j = 0, p = 0; j < n; j++) {
            if (placed[j]) continue;
            while (slot[p] >= 0) p++;
            slot[p] = j;
        }
        size_t len = 0;
        for (int p = 0; p < n; p++) {
            len += (size_t)snprintf(prop + len, 26, "%s%s", p ? " " : "", aid[slot[p]]);
        }
        key(r, k, "r/%d/ranks", g);
        if ((rc = elastic_store_compare_set(r->c, k, NULL, 0, prop, len, &won, &wlen)) < 0)
            goto out;
        v = won;
        won = NULL;
    }
    if ((rc = split_ranks(v, n, ent)) < 0) goto out;
    char mine[24];
    snprintf(mine, sizeof mine, "?%" PRId64, me);
    rc = -EBADMSG;
    for (int p = 0; p < n; p++)
        if (!strcmp(ent[p], r->aid) || !strcmp(ent[p], mine)) {
            *node_rank = p;
            rc = 0;
            break;
        }
out:
    free(v);
    free(pv);
    free(won);
    free(pent);
    free(aid);
    free(slot);
    free(ent);
    free(placed);
    free(prop);
    return rc;
}

int elastic_rdzv_join(elastic_rdzv *r, int from_gen, elastic_round *out,
                      int (*interrupted)(void *), void *arg)
{
    char k[KEY_MAX], *v = NULL;
    double t0 = clock_now_s();
    int g = from_gen, rc;
    key(r, k, "gen");
    if ((rc = get_opt(r->c, k, &v, 0)) < 0) return main_lost(r, rc);
    if (rc == 1) {
        int hint = atoi(v);
        if (hint > g) g = hint;
        free(v);
        v = NULL;
    }
    for (;;) {
        int64_t me = 0;
        key(r, k, "r/%d/n", g);
        if ((rc = elastic_store_add(r->c, k, 1, &me)) < 0) return main_lost(r, rc);
        key(r, k, "r/%d/a/%" PRId64, g, me);
        if ((rc = elastic_store_set(r->c, k, r->desc, strlen(r->desc))) < 0)
            return main_lost(r, rc);
        char gs[16];
        int gl = snprintf(gs, sizeof gs, "%d", g);
        key(r, k, "gen");
        if ((rc = elastic_store_set(r->c, k, gs, (size_t)gl)) < 0) return main_lost(r, rc);
        LOG_D(EA_TAG, "joined round %d as number %" PRId64, g, me);
        double t_min = -1;
        int watching_prev = 0, waiting_members = 0, n = 0;
        char closed[KEY_MAX];
        key(r, closed, "r/%d/closed", g);
        for (;;) {
            if (interrupted && interrupted(arg)) {
                elastic_rdzv_unwatch(r);
                return -EINTR;
            }
            if ((rc = elastic_rdzv_lost(r)) < 0) return rc;
            if (elastic_rdzv_end_code(r, NULL, 0) >= 0) {
                elastic_rdzv_unwatch(r);
                return -ECANCELED;
            }
            if ((rc = get_opt(r->c, closed, &v, 0.1)) < 0) return main_lost(r, rc);
            if (rc == 1) {
                n = atoi(v);
                free(v);
                v = NULL;
                break;
            }
            if (clock_now_s() - t0 > r->o.join_timeout_s) {
                elastic_rdzv_unwatch(r);
                return -ETIMEDOUT;
            }
            /* round g may close only once round g-1 is over */
            int prev_over = 1;
            if (g > 0) {
                key(r, k, "r/%d/stop", g - 1);
                if ((rc = get_opt(r->c, k, NULL, 0)) < 0) return main_lost(r, rc);
                if (rc == 0) {
                    key(r, k, "r/%d/closed", g - 1);
                    if ((rc = get_opt(r->c, k, NULL, 0)) < 0) return main_lost(r, rc);
                    prev_over = rc == 0;
                }
            }
            if (!prev_over) {
                if (!watching_prev) {
                    LOG_I(EA_TAG, "round %d is running: waiting for it to end (this agent joins "
                          "round %d as number %" PRId64 ")", g - 1, g, me);
                    set_watch(r, g - 1, 0, 0, 0);
                    watching_prev = 1;
                }
                t_min = -1;
                continue;
            }
            /* ... and once its members finished stopping (joined this round, or went silent) */
            if (g > 0) {
                int pend = prev_pending(r, g);
                if (pend < 0) return main_lost(r, pend);
                if (pend > 0) {
                    if (!waiting_members) {
                        LOG_I(EA_TAG, "round %d: waiting for %d agent(s) of round %d to finish "
                              "stopping (they join this round, or are dead after %.0f s of silence)",
                              g, pend, g - 1, r->o.heartbeat_timeout_s);
                        waiting_members = 1;
                    }
                    t_min = -1;
                    continue;
                }
            }
            int64_t count = 0;
            key(r, k, "r/%d/n", g);
            if ((rc = elastic_store_add(r->c, k, 0, &count)) < 0) return main_lost(r, rc);
            int64_t close_at = 0;
            if (count >= r->o.max_nodes) {
                close_at = r->o.max_nodes;
            } else if (count >= r->o.min_nodes) {
                if (t_min < 0) t_min = clock_now_s();
                if (clock_now_s() - t_min >= r->o.last_call_s) close_at = count;
            }
            if (close_at > 0) {
                char ns[24];
                int nl = snprintf(ns, sizeof ns, "%" PRId64, close_at);
                rc = elastic_store_compare_set(r->c, closed, NULL, 0, ns, (size_t)nl, NULL, NULL);
                if (rc < 0) return main_lost(r, rc);
            }
        }
        if (watching_prev) elastic_rdzv_unwatch(r);
        if (me <= n) {
            int node = 0;
            if ((rc = assign_ranks(r, g, n, me, &node)) < 0) {
                if (rc == -EBADMSG)
                    LOG_E(EA_TAG, "round %d: the node ranks in the store (key %sr/%d/ranks) are "
                          "malformed or do not name this agent (%s, joined as number %" PRId64
                          "): another program writes this job's keys?", g, r->prefix, g, r->aid, me);
                if (rc == -EBADMSG || rc == -ENOMEM) return rc;
                return main_lost(r, rc);
            }
            out->gen = g;
            out->node_rank = node;
            out->nnodes = n;
            return 0;
        }
        LOG_I(EA_TAG, "round %d closed with %d nodes before this agent (number %" PRId64 "): "
              "waiting for round %d", g, n, me, g + 1);
        g++;
    }
}

int elastic_rdzv_stop_round(elastic_rdzv *r, int gen, char kind, const char *why,
                            char *winner_kind, char *why_out, size_t why_len)
{
    char k[KEY_MAX], val[WHY_MAX];
    void *cur = NULL;
    size_t len = 0;
    int rc;
    key(r, k, "r/%d/stop", gen);
    if (kind) {
        int n = snprintf(val, sizeof val, "%c %s", kind, why ? why : "");
        if (n >= (int)sizeof val) n = (int)sizeof val - 1;
        rc = elastic_store_compare_set(r->c, k, NULL, 0, val, (size_t)n, &cur, &len);
    } else {
        rc = elastic_store_get(r->c, k, &cur, &len, 0);
        if (rc == -ETIMEDOUT) {
            if (winner_kind) *winner_kind = 0;
            if (why_out && why_len) why_out[0] = '\0';
            return 0;
        }
    }
    if (rc < 0) return main_lost(r, rc);
    const char *s = cur;
    if (winner_kind) *winner_kind = len ? s[0] : 0;
    if (why_out && why_len) snprintf(why_out, why_len, "%s", len > 2 ? s + 2 : "");
    free(cur);
    return 0;
}

int elastic_rdzv_end(elastic_rdzv *r, int code, const char *why)
{
    char k[KEY_MAX], val[WHY_MAX];
    void *cur = NULL;
    size_t len = 0;
    key(r, k, "end");
    int n = snprintf(val, sizeof val, "%d %s", code, why ? why : "");
    if (n >= (int)sizeof val) n = (int)sizeof val - 1;
    int rc = elastic_store_compare_set(r->c, k, NULL, 0, val, (size_t)n, &cur, &len);
    if (rc < 0) return main_lost(r, rc);
    set_end(r, cur);
    free(cur);
    return 0;
}

int elastic_rdzv_finish(elastic_rdzv *r, const elastic_round *rd)
{
    char k[KEY_MAX];
    int64_t done = 0;
    key(r, k, "r/%d/done", rd->gen);
    int rc = elastic_store_add(r->c, k, 1, &done);
    if (rc < 0) return main_lost(r, rc);
    set_watch(r, rd->gen, rd->nnodes, 1, 1);
    if (done >= rd->nnodes) {
        char why[128];
        snprintf(why, sizeof why, "every worker of the %d node(s) of round %d exited 0",
                 rd->nnodes, rd->gen);
        return elastic_rdzv_end(r, 0, why);
    }
    return 0;
}

int elastic_rdzv_wait_end(elastic_rdzv *r, double timeout_s)
{
    char k[KEY_MAX], *v = NULL;
    key(r, k, "end");
    int rc = get_opt(r->c, k, &v, timeout_s);
    if (rc < 0) return main_lost(r, rc);
    if (rc == 1) set_end(r, v);
    free(v);
    return rc;
}

/* The hosting agent waits until every other registered agent said bye or looks dead. */
static void wait_for_others(elastic_rdzv *r)
{
    char k[KEY_MAX], *v = NULL;
    int64_t n = 0;
    key(r, k, "agents");
    if (elastic_store_add(r->c, k, 0, &n) < 0 || n <= 1) return;
    peer **pend = calloc((size_t)n, sizeof *pend);
    if (!pend || n > INT_MAX / 4 || peers_reserve(r, (int)n) < 0) { /* pend keeps pointers */
        free(pend);
        return;
    }
    int np = 0;
    for (int64_t i = 1; i <= n; i++) {
        key(r, k, "agent/%" PRId64, i);
        if (get_opt(r->c, k, &v, 0) != 1) continue;
        char aid[24], desc[DESC_MAX];
        parse_desc(v, aid, sizeof aid, desc, sizeof desc);
        free(v);
        v = NULL;
        if (!strcmp(aid, r->aid)) continue;
        peer *p = peer_find(r, aid, desc);
        if (p) pend[np++] = p;
    }
    double deadline = clock_now_s() + r->o.heartbeat_timeout_s + 1.0;
    while (np > 0 && clock_now_s() < deadline) {
        for (int i = 0; i < np; i++) {
            key(r, k, "bye/%s", pend[i]->aid);
            double silent = 0;
            int bye = get_opt(r->c, k, NULL, 0);
            int stale = bye == 1 ? 1 : peer_stale(r, r->c, pend[i], &silent);
            if (bye < 0 || stale < 0) {
                np = 0;
                break;
            }
            if (bye == 1 || stale == 1) pend[i--] = pend[--np];
        }
        if (np > 0) {
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    if (np > 0)
        LOG_W(EA_TAG, "leaving with %d agent(s) that did not say goodbye (first: %s)", np,
              pend[0]->desc);
    free(pend);
}

void elastic_rdzv_close(elastic_rdzv *r)
{
    if (!r) return;
    if (r->th_started) {
        pthread_mutex_lock(&r->mu);
        r->quit = 1;
        pthread_mutex_unlock(&r->mu);
        elastic_store_interrupt(r->wc);
        pthread_join(r->th, NULL);
    }
    if (r->c && !r->lost) {
        char k[KEY_MAX];
        key(r, k, "bye/%s", r->aid);
        if (elastic_store_set(r->c, k, "1", 1) == 0 && r->o.hosting) wait_for_others(r);
    }
    elastic_store_close(r->c);
    elastic_store_close(r->wc);
    if (r->notify[0] >= 0) close(r->notify[0]);
    if (r->notify[1] >= 0) close(r->notify[1]);
    pthread_mutex_destroy(&r->mu);
    free(r->peers);
    free(r->prev);
    free(r->prev_done);
    free(r->host);
    free(r->token);
    free(r->run_id);
    free(r);
}
