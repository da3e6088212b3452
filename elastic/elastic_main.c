/* elastic_main.c - the `elastic` launcher: parse the command line, run the agent (agent.h).
 * Exit status: 0 success, 1 failure, 2 usage error or a worker's usage error, 143 preempted. */
#include "agent.h"

#include "log.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char usage_text[] =
    "usage: elastic [options] -- COMMAND [ARGS...]\n"
    "Start COMMAND --nproc-per-node times on this node, watch the processes and restart the\n"
    "whole group when one fails, hangs or a node comes or goes (the role of torchrun).\n"
    "\n"
    "  --nproc-per-node N      workers on this node (required), 1..4096\n"
    "  --nnodes N | MIN:MAX    nodes in the job (default 1); MAX > 1 means several agents that\n"
    "                          rendezvous through the store at --rdzv-endpoint\n"
    "  --max-restarts K        restarts after failures before giving up (default 3); counted\n"
    "                          per agent; scale-ups and preemptions of other nodes do not count\n"
    "  --rdzv-endpoint H:P     store endpoint. One node: where the agent hosts its store\n"
    "                          (default 127.0.0.1 and a free port; a busy port is replaced by a\n"
    "                          free one). Several nodes (required): the first agent that can\n"
    "                          bind it hosts the store, the others connect to it; [v6addr]:P\n"
    "  --rdzv-id ID            job id, the same on every node (required with several nodes):\n"
    "                          1-64 characters of [A-Za-z0-9_.-]; workers get ELASTIC_RUN_ID.\n"
    "                          One endpoint serves one job, and every agent of it needs the\n"
    "                          --nnodes and --nproc-per-node of the agent hosting the store:\n"
    "                          others are refused (exit 2)\n"
    "  --monitor-interval S    monitor tick, seconds (default 0.1); worker exits are seen at once\n"
    "  --hang-timeout S        restart the group when a worker wrote no progress line for S\n"
    "                          seconds, counted from its start (default 0 = off)\n"
    "  --stop-grace S          after a failure: SIGTERM to every worker group, SIGKILL after S\n"
    "                          seconds (default 10)\n"
    "  --preempt-grace S       on SIGTERM/SIGINT to the agent or a graceful stop (scale-up):\n"
    "                          time for workers to finish the step and snapshot (default 60)\n"
    "  --heartbeat-timeout S   several nodes: an agent silent this long is dead (default 5)\n"
    "  --last-call S           several nodes: a round closes S seconds after MIN nodes joined,\n"
    "                          at once when MAX did (default 2)\n"
    "  --join-timeout S        several nodes: give up when no round forms within S seconds\n"
    "                          (default 600)\n"
    "  --metrics-port P        serve Prometheus metrics on http://ADDR:P/metrics (text format\n"
    "                          0.0.4): steps, loss, throughput, step time, restarts, ranks up,\n"
    "                          snapshot commits, failures, stalls, persists, restores, goodput.\n"
    "                          Default 0 = off; a port that cannot be bound exits 1\n"
    "  --metrics-addr A        the address for --metrics-port (default 127.0.0.1: this machine\n"
    "                          only; 0.0.0.0 or :: for every interface)\n"
    "  --mem-dir DIR           the memory tier's segment folder (default /dev/shm): workers\n"
    "                          get CKPT_MEM_PATH=DIR/ckptmem-<job>-<random>; stale segments of\n"
    "                          this job's dead agents are removed at start, this agent's at end;\n"
    "                          its real path must be at most 3989 bytes\n"
    "  --mem-replica-mbps N    several nodes: send each memory snapshot to the next node at\n"
    "                          most N MB/s (default 1000; 0 = no replica)\n"
    "  --mem-clean             no job: remove the segments of dead agents (SIGKILLed: their\n"
    "                          lease is not held) of every job of this user in --mem-dir, one\n"
    "                          line per prefix removed; live agents' files stay. Exit 0, 1 on\n"
    "                          an error\n"
    "  -h, --help              this text\n";

/* the rest of --help (two strings: C99 compilers need only take 4095 bytes in one) */
static const char usage_more[] =
    "\n"
    "Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,\n"
    "MASTER_ADDR, MASTER_PORT (the store), ELASTIC_STORE_HOSTED=1, ELASTIC_STORE_TOKEN,\n"
    "ELASTIC_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT (the round number: new in every\n"
    "round), ELASTIC_RUN_ID, and ELASTIC_HEARTBEAT_FD (write one line, e.g. \"step 12\", per\n"
    "unit of progress: the hang watchdog's input). Each worker runs in its own process group,\n"
    "which dies with the agent (a guardian process kills the groups if the agent is killed);\n"
    "its output lines are prefixed \"[rank R] \".\n"
    "Several nodes: GROUP_RANK (the node rank) is sticky: an agent keeps the node rank it had\n"
    "in the round before whenever the new round still has it, so that each rank restores its\n"
    "own memory snapshot on its own node; newcomers and the survivors of a shrink take the\n"
    "free ranks in join order.\n"
    "At exit (whatever the cause) the agent logs a goodput report: wall time, productive step\n"
    "time, recomputed steps, time lost to restarts, snapshot stall, and goodput = productive /\n"
    "wall (docs/OPERATIONS.md, \"Metrics\").\n"
    "Memory tier: workers also get CKPT_MEM_PATH (a path prefix in --mem-dir); after a failed\n"
    "round and on preemption, when a worker made a segment there, COMMAND runs once more with\n"
    "CKPT_MEM_FLUSH=1 (no RANK etc.) to write the newest memory snapshot to disk (output\n"
    "\"[flush] \"; at most max(60, 6 x --stop-grace) s).\n"
    "A restart runs COMMAND again from the start: give train `--resume auto` (with --ckpt-dir)\n"
    "so that it continues from the newest snapshot, re-sharded to the new world size.\n"
    "Store token: one node, a random secret per job; several nodes, ELASTIC_STORE_TOKEN of the\n"
    "agents' environment (the same on all), no token when unset. Never logged.\n"
    "\n"
    "Exit status: 0 every worker of the final round exited 0 (on every node); 1 failure\n"
    "(restart budget spent, store host gone, no round formed, ...); 2 usage error, or a worker\n"
    "exited 2 (configuration error: never retried); 143 SIGTERM/SIGINT to the agent (workers\n"
    "got SIGTERM and --preempt-grace to take a final snapshot).\n";

static int bad(const char *flag, const char *val, const char *what)
{
    fprintf(stderr, "elastic: %s: '%s' is not %s (see --help)\n", flag, val, what);
    return -1;
}

static int parse_int(const char *flag, const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        char what[64];
        snprintf(what, sizeof what, "an integer in [%ld, %ld]", lo, hi);
        return bad(flag, s, what);
    }
    *out = (int)v;
    return 0;
}

static int parse_secs(const char *flag, const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        char what[80];
        snprintf(what, sizeof what, "a number of seconds in [%g, %g]", lo, hi);
        return bad(flag, s, what);
    }
    *out = v;
    return 0;
}

static int parse_nnodes(const char *s, elastic_agent_opts *o)
{
    const char *colon = strchr(s, ':');
    if (!colon) {
        if (parse_int("--nnodes", s, 1, 4096, &o->max_nodes) < 0) return -1;
        o->min_nodes = o->max_nodes;
        return 0;
    }
    char lo[32];
    size_t n = (size_t)(colon - s);
    if (n == 0 || n >= sizeof lo) return bad("--nnodes", s, "N or MIN:MAX");
    memcpy(lo, s, n);
    lo[n] = '\0';
    if (parse_int("--nnodes", lo, 1, 4096, &o->min_nodes) < 0 ||
        parse_int("--nnodes", colon + 1, 1, 4096, &o->max_nodes) < 0)
        return -1;
    if (o->min_nodes > o->max_nodes) return bad("--nnodes", s, "MIN:MAX with MIN <= MAX");
    return 0;
}

/* HOST:PORT or [V6ADDR]:PORT; host points into a static copy. */
static int parse_endpoint(const char *s, elastic_agent_opts *o)
{
    static char host[256];
    const char *colon;
    size_t hl;
    const char *h = s;
    if (s[0] == '[') {
        const char *rb = strchr(s, ']');
        if (!rb || rb[1] != ':') return bad("--rdzv-endpoint", s, "HOST:PORT or [ADDR]:PORT");
        h = s + 1;
        hl = (size_t)(rb - h);
        colon = rb + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon || strchr(s, ':') != colon) return bad("--rdzv-endpoint", s, "HOST:PORT");
        hl = (size_t)(colon - s);
    }
    if (hl == 0 || hl >= sizeof host) return bad("--rdzv-endpoint", s, "HOST:PORT");
    memcpy(host, h, hl);
    host[hl] = '\0';
    if (parse_int("--rdzv-endpoint port", colon + 1, 0, 65535, &o->rdzv_port) < 0) return -1;
    o->rdzv_host = host;
    return 0;
}

int main(int argc, char **argv)
{
    enum {
        O_NNODES = 256, O_NPROC, O_MAXR, O_EP, O_ID, O_MON, O_HANG, O_PREEMPT, O_STOP, O_HB,
        O_LAST, O_JOIN, O_MPORT, O_MADDR, O_MEMDIR, O_MEMMBPS, O_MEMCLEAN
    };
    static const struct option lo[] = {
        {"nnodes", required_argument, 0, O_NNODES},
        {"nproc-per-node", required_argument, 0, O_NPROC},
        {"max-restarts", required_argument, 0, O_MAXR},
        {"rdzv-endpoint", required_argument, 0, O_EP},
        {"rdzv-id", required_argument, 0, O_ID},
        {"monitor-interval", required_argument, 0, O_MON},
        {"hang-timeout", required_argument, 0, O_HANG},
        {"preempt-grace", required_argument, 0, O_PREEMPT},
        {"stop-grace", required_argument, 0, O_STOP},
        {"heartbeat-timeout", required_argument, 0, O_HB},
        {"last-call", required_argument, 0, O_LAST},
        {"join-timeout", required_argument, 0, O_JOIN},
        {"metrics-port", required_argument, 0, O_MPORT},
        {"metrics-addr", required_argument, 0, O_MADDR},
        {"mem-dir", required_argument, 0, O_MEMDIR},
        {"mem-replica-mbps", required_argument, 0, O_MEMMBPS},
        {"mem-clean", no_argument, 0, O_MEMCLEAN},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    elastic_agent_opts o = ELASTIC_AGENT_OPTS_INIT;
    int have_nproc = 0, c, rc = 0, mem_clean = 0;
    opterr = 0;
    /* '+': stop at the first non-option, the worker's command; ':': report missing values */
    while (rc == 0 && (c = getopt_long(argc, argv, "+:h", lo, NULL)) != -1) {
        switch (c) {
        case O_NNODES: rc = parse_nnodes(optarg, &o); break;
        case O_NPROC:
            rc = parse_int("--nproc-per-node", optarg, 1, 4096, &o.nproc_per_node);
            have_nproc = 1;
            break;
        case O_MAXR: rc = parse_int("--max-restarts", optarg, 0, 1000000, &o.max_restarts); break;
        case O_EP: rc = parse_endpoint(optarg, &o); break;
        case O_ID:
            o.rdzv_id = optarg;
            break;
        case O_MON: rc = parse_secs("--monitor-interval", optarg, 0.001, 60, &o.monitor_interval_s); break;
        case O_HANG: rc = parse_secs("--hang-timeout", optarg, 0, 1e6, &o.hang_timeout_s); break;
        case O_PREEMPT: rc = parse_secs("--preempt-grace", optarg, 0, 86400, &o.preempt_grace_s); break;
        case O_STOP: rc = parse_secs("--stop-grace", optarg, 0, 86400, &o.stop_grace_s); break;
        case O_HB: rc = parse_secs("--heartbeat-timeout", optarg, 0.1, 3600, &o.heartbeat_timeout_s); break;
        case O_LAST: rc = parse_secs("--last-call", optarg, 0, 3600, &o.last_call_s); break;
        case O_JOIN: rc = parse_secs("--join-timeout", optarg, 1, 86400, &o.join_timeout_s); break;
        case O_MPORT: rc = parse_int("--metrics-port", optarg, 0, 65535, &o.metrics_port); break;
        case O_MADDR:
            if (!*optarg) rc = bad("--metrics-addr", optarg, "an address or host name");
            o.metrics_addr = optarg;
            break;
        case O_MEMDIR:
            if (!*optarg) rc = bad("--mem-dir", optarg, "a folder");
            o.mem_dir = optarg;
            break;
        case O_MEMMBPS:
            rc = parse_int("--mem-replica-mbps", optarg, 0, 1000000, &o.mem_replica_mbps);
            break;
        case O_MEMCLEAN: mem_clean = 1; break;
        case 'h':
            fputs(usage_text, stdout);
            fputs(usage_more, stdout);
            return 0;
        case ':':
            fprintf(stderr, "elastic: %s needs a value (see --help)\n", argv[optind - 1]);
            return 2;
        default:
            if (optopt)
                fprintf(stderr, "elastic: unknown option '-%c' (see --help)\n", optopt);
            else
                fprintf(stderr, "elastic: unknown option '%s' (see --help)\n", argv[optind - 1]);
            return 2;
        }
    }
    if (rc < 0) return 2;
    if (mem_clean) {
        if (optind < argc) {
            fprintf(stderr, "elastic: --mem-clean runs no command (see --help)\n");
            return 2;
        }
        return elastic_mem_clean(o.mem_dir) < 0 ? 1 : 0;
    }
    if (optind >= argc) {
        fprintf(stderr, "elastic: no worker command: elastic [options] -- COMMAND [ARGS...] "
                "(see --help)\n");
        return 2;
    }
    if (!have_nproc) {
        fprintf(stderr, "elastic: --nproc-per-node N is required (see --help)\n");
        return 2;
    }
    if (o.rdzv_id) {
        size_t n = strlen(o.rdzv_id);
        int okid = n >= 1 && n <= 64;
        for (size_t i = 0; okid && i < n; i++) {
            char ch = o.rdzv_id[i];
            okid = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                   (ch >= '0' && ch <= '9') || ch == '_' || ch == '.' || ch == '-';
        }
        if (!okid) {
            bad("--rdzv-id", o.rdzv_id, "1-64 characters of [A-Za-z0-9_.-]");
            return 2;
        }
    }
    if (o.max_nodes > 1 && (!o.rdzv_host || o.rdzv_port == 0)) {
        fprintf(stderr, "elastic: --nnodes %d:%d needs --rdzv-endpoint HOST:PORT with a port "
                "(see --help)\n", o.min_nodes, o.max_nodes);
        return 2;
    }
    if (o.max_nodes > 1 && !o.rdzv_id) {
        fprintf(stderr, "elastic: --nnodes %d:%d needs --rdzv-id ID, the same on every node "
                "(see --help)\n", o.min_nodes, o.max_nodes);
        return 2;
    }
    return elastic_agent_run(&o, argv + optind);
}
