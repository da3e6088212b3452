/* agent.h - the elastic agent (the role torchrun's agent plays): start the worker processes of
 * one node, watch them, and when anything fails stop the whole group and start it again,
 * possibly with another world size; rendezvous with the agents of other nodes through the
 * elastic store (store.h). The program `elastic` (elastic_main.c) is a thin CLI around
 * elastic_agent_run.
 *
 * Workers: nproc_per_node processes of the user's command, each in its own process group
 * (setpgid) with a parent-death signal (SIGKILL when the agent dies), stdin from /dev/null,
 * stdout/stderr relayed line by line with a "[rank <r>] " prefix (stdout to the agent's
 * stdout, stderr to its stderr). Environment of each worker, on top of the agent's own:
 *   RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (node rank), GROUP_WORLD_SIZE
 *   (nodes of the round), MASTER_ADDR, MASTER_PORT (the store), ELASTIC_STORE_HOSTED=1,
 *   ELASTIC_STORE_TOKEN (the store's secret; never logged), ELASTIC_RESTART_COUNT and
 *   TORCHELASTIC_RESTART_COUNT (the round number, unique per round of a job: 0, 1, 2, ...;
 *   on one node it equals the number of restarts so far), ELASTIC_RUN_ID and
 *   TORCHELASTIC_RUN_ID (the rendezvous id), TORCHELASTIC_MAX_RESTARTS, and
 *   ELASTIC_HEARTBEAT_FD (the write end of a pipe: a worker writes one line, e.g. "step 12\n",
 *   after each unit of progress; every line counts for the hang watchdog).
 *
 * Restart semantics: a restart starts every worker of the node again from its command line;
 * continuing where the job stopped is the worker's business (train: `--resume auto`).
 *
 * Orphans: a worker dies with the agent (parent-death signal) but its own children would not
 * (they are reparented to init). So at start the agent forks a guardian ("elastic-guard" in
 * ps): its own process group (not a worker's, not the terminal's), SIGINT, SIGTERM, SIGHUP,
 * SIGQUIT and the job-control signals blocked, no fd open but its pipe from the agent and
 * /dev/null on 0..2 (so a reader of the agent's output sees EOF with the agent). Each worker
 * lists its process group with the guardian ("+<pgid>") between fork and exec, before any of
 * the user's code runs; the agent unlists it ("-<pgid>") once every process of the group is
 * gone, and writes "exit" before it returns. When the pipe reaches EOF without "exit" (the
 * agent died: SIGKILL, a crash, the OOM killer), the guardian sends SIGCONT and SIGKILL to
 * every group still listed and exits, within milliseconds of the agent. One guardian per agent
 * rather than a supervisor per worker: one extra process per node instead of one per rank,
 * and the workers stay the agent's children (exit statuses, reaping and stops unchanged).
 * Limits: a process that left its worker's group (setsid, setpgid) is not reached; a guardian
 * that was killed itself is warned about (when the next group ends) and the agent runs on
 * without one; groups the agent gave up on (still there 10 s after SIGKILL) stay listed, and
 * are not killed at a normal exit.
 *
 * Single node (max_nodes == 1): the agent hosts the store on rdzv_host:rdzv_port (default
 * 127.0.0.1, a free port) with a random token; a busy explicit port is replaced by a free one
 * (logged, not a restart). Several nodes (max_nodes > 1): every agent tries to bind the
 * endpoint; the one that succeeds hosts the store, the others (EADDRINUSE/EADDRNOTAVAIL)
 * connect to it; the token is ELASTIC_STORE_TOKEN of the agent's environment (the same on
 * every node), none when unset. The hosting agent records its rdzv_id and settings in the
 * store; an agent whose rdzv_id differs (one endpoint serves one job), or whose nproc_per_node,
 * min_nodes or max_nodes differ from the host's (nodes of different sizes are not supported),
 * is refused before it registers: one line naming the difference, ELASTIC_EXIT_USAGE. The
 * rendezvous protocol is described in agent_rdzv.c.
 *
 * Metrics and goodput (metrics.h): the agent parses every progress line of its workers
 * (train/report.h's line protocol) into metrics that live as long as the agent, serves them on
 * /metrics when metrics_port is set (one libmicrohttpd thread, signals blocked), and at exit,
 * whatever the cause (success, budget spent, a usage error of a worker, preemption, a lost
 * store), logs a goodput report block ("goodput: ..." lines): wall time, productive step time,
 * recomputed steps, time lost to restarts, snapshot stall, other, and their ratio. Each agent
 * reports its own node, from its first local rank's lines; the one hosting rank 0 also has the
 * loss, throughput and restores. Not printed when the agent stopped at its option checks.
 *
 * Signals: SIGTERM or SIGINT to the agent is a preemption notice: SIGTERM to every worker
 * group, up to preempt_grace_s for them to exit (train takes a final snapshot), SIGKILL for
 * the rest, exit status ELASTIC_EXIT_PREEMPTED. A second SIGTERM/SIGINT during that wait
 * sends SIGKILL at once. Each rank that ended otherwise than by exit 0 or 143 (128 + SIGTERM)
 * gets a WARN line: its final snapshot may be missing.
 *
 * Memory tier (issue 13; the design of the whole tier is docs/FORMAT.md "Memory tier" and
 * common/shmseg.h): the agent keeps the workers' memory snapshots in files of a segment folder
 * (mem_dir, default /dev/shm) that outlive a worker, sends them to a peer node, has them
 * flushed to disk after a failure, and removes them at the end of the job.
 *  - Names: at start the agent picks prefix = "ckptmem-<jobhash16>-<rand16>", jobhash16 the
 *    16 hex digits of XXH3-64 over the uid (u32 little-endian) followed by the bytes of the
 *    rdzv id ("none" on one node without --rdzv-id), rand16 from getrandom. Files, all
 *    0600 and created O_EXCL|O_NOFOLLOW (the segments by common/shmseg.c): <prefix>.lease
 *    (flock LOCK_EX held for the agent's life; its text "pid=<pid> run=<id>" is for people),
 *    <prefix>.own-<L> (written by the worker of local rank L, never by the agent),
 *    <prefix>.rep-<A>-<L> (the replica of local slot L of the node whose agent's id is A,
 *    written by this agent; A = that agent's rand16, which stays for its life, unlike its
 *    node rank: a survivor re-sending under a dead node's old rank writes its own file).
 *  - Stale clean-up at start: every other prefix of the same job hash in the folder whose
 *    lease nobody holds (flock LOCK_EX|LOCK_NB succeeds: its agent is dead), or that has no
 *    lease left (a removal cut short), loses all its files of this uid, the lease last; one
 *    INFO line with the count and the bytes. Other job hashes are never touched.
 *  - Workers get CKPT_MEM_PATH=<folder>/<prefix> (absolute). An inherited CKPT_MEM_PATH or
 *    CKPT_MEM_FLUSH is never passed on; with the tier off, workers get neither.
 *  - Flush: after a round that failed on this node (a worker exited non-zero or by a signal,
 *    or hung), on preemption (also between rounds), and before any other exit with status 1
 *    (restart budget spent after another node's failure, a lost store, the job ended by
 *    another node's failure) - each time only when workers ran since the last flush and did
 *    not all succeed, and some <prefix>.own-* exists (so the workers are train: nothing else
 *    makes them) - the agent runs the worker
 *    command once more (same argv, its process group and guardian listing) with the agent's
 *    environment plus CKPT_MEM_FLUSH=1, CKPT_MEM_PATH, ELASTIC_RESTART_COUNT, ELASTIC_RUN_ID,
 *    TORCHELASTIC_RUN_ID and ELASTIC_HEARTBEAT_FD - no RANK, LOCAL_RANK, WORLD_SIZE, GROUP_*,
 *    MASTER_* or store token. Output is relayed with the prefix "[flush] ". It gets
 *    max(60, 6 x stop_grace_s) seconds, then SIGKILL; the result is one log line ("flush
 *    finished: exited with status 0", "flush failed: ...", "flush timed out ..."). A SIGTERM
 *    during a flush after a failure lets it finish and then exits as preempted (no second
 *    flush); a signal during the flush of a preemption kills it at once. Then the agent goes
 *    on as without a flush (restart, give up, exit).
 *  - Peer replica (several nodes, mem_replica_mbps > 0): a server thread listens on the local
 *    address of the agent's store connection, port 0, and the agent publishes "host:port" under
 *    the store key rdzv/<id>/mem/<gen>/<node_rank> each round; the main thread looks up the
 *    next node's ((node_rank + 1) % nnodes) and hands it to a sender thread, which looks at the
 *    own segments every 0.1 s and sends each newly completed slot (a seq the peer does not
 *    have; all again to a new peer) at most mem_replica_mbps MB/s, with the job token (the
 *    store's; a job without a token accepts any sender, as its store does). The
 *    receiver keeps it in <its prefix>.rep-<sender's rand16>-<L> through shmseg (begin, the bytes,
 *    commit): a transfer cut short, or a slot that changed at the source meanwhile, commits
 *    nothing. The protocol is in agent_mem.c. A peer that cannot be reached or refuses is
 *    logged once per round. Metrics: ckpt_mem_replica_bytes_total, ckpt_mem_replica_step.
 *    A slot that changes faster than it can be sent (two memory snapshots during one transfer)
 *    is never replicated: one warning after 8 such transfers in a row.
 *  - Remote reads: the same server (same socket, same token check) answers the workers of
 *    other nodes (elastic/mem_client.h; wire format in mem_wire.h): LIST gives every complete
 *    slot of this node's own and replica segments with the payload's first 4096 bytes, GET a
 *    byte range of one slot copied out at the listed seq (a slot rewritten since: STALE), so
 *    that a restore reads a rank's slot that is only here. The server treats payloads as
 *    bytes. Each connection is served by a thread of its own (at most 64 at once; more are
 *    closed at once, logged at most once per 10 s) and must complete its handshake (magic,
 *    version, token, fixed header) within 5 s of the accept, progress or not, so silent or
 *    trickling connections without the token delay neither transfers nor queries. Queries
 *    are answered one at a time, replica transfers one at a time by a thread of their own (a
 *    restore's reads never wait behind a transfer); after the handshake each socket wait has
 *    10 s without progress. A peer that takes a transfer's connection and does not answer
 *    within 10 s is logged as such ("took the connection but did not answer"), once a round.
 *  - Removal: at the end of the job (success, failure, preemption; after the flush) every
 *    <prefix>.* file is unlinked, the lease last. An agent killed with SIGKILL leaves them
 *    to the next agent of the same job, or to `elastic --mem-clean` (elastic_mem_clean).
 *
 * Thread-safety: elastic_agent_run is meant to be the one thing a process does: it blocks
 * SIGCHLD/SIGTERM/SIGINT (and leaves them blocked on return, so that a late signal cannot turn
 * the exit status into a signal death), ignores SIGPIPE and makes the process a child
 * subreaper. Call it from the main thread, once, before any other thread exists.
 */
#ifndef ELASTIC_AGENT_H
#define ELASTIC_AGENT_H

/* Exit statuses of elastic_agent_run (and of the program). */
enum elastic_exit {
    ELASTIC_EXIT_OK = 0,         /* every worker of the final round exited 0 (on every node) */
    ELASTIC_EXIT_FAILED = 1,     /* restart budget spent, store lost, cannot start, ... */
    ELASTIC_EXIT_USAGE = 2,      /* a worker exited 2 (usage/config error, never retried) or
                                    the agent's own configuration is unusable (bad options,
                                    an endpoint host that does not resolve, refused by the
                                    job: other settings, or the store serves another job) */
    ELASTIC_EXIT_PREEMPTED = 143 /* SIGTERM/SIGINT to the agent; workers were stopped */
};

typedef struct elastic_agent_opts {
    int min_nodes;              /* nodes needed to start a round, [1, max_nodes]; default 1 */
    int max_nodes;              /* nodes that close a round at once, [1, 4096]; default 1;
                                   > 1 selects the multi-node rendezvous */
    int nproc_per_node;         /* workers on this node, [1, 4096]; default 1 */
    int max_restarts;           /* restarts after failures before giving up, [0, 1e6]; default 3.
                                   Counted per agent: every round that this agent took part in
                                   and that ended by a failure (a worker exiting non-zero or by
                                   a signal, a hang, a dead node). Scale-ups and preemptions of
                                   other nodes are not counted */
    const char *rdzv_host;      /* store endpoint host; NULL = "127.0.0.1" (single node only;
                                   required for several nodes); must resolve at start */
    int rdzv_port;              /* store endpoint port, [0, 65535]; 0 = a free port (single node
                                   only) */
    const char *rdzv_id;        /* job id: key namespace in the store, ELASTIC_RUN_ID; 1..64
                                   chars of [A-Za-z0-9_.-]; NULL = "none" (single node only) */
    double monitor_interval_s;  /* tick of the monitor loop (waitpid, watchdog), seconds,
                                   [0.001, 60]; default 0.1. Worker exits are noticed at once
                                   (SIGCHLD) whatever the tick */
    double hang_timeout_s;      /* a worker that wrote no progress line for this long (counted
                                   from its start) is hung: the group is stopped and restarted
                                   (a counted restart); seconds, [0, 1e6]; 0 (default) = off */
    double preempt_grace_s;     /* after forwarding SIGTERM on preemption or a graceful stop
                                   (scale-up), time for workers to exit before SIGKILL; seconds,
                                   [0, 86400]; default 60 */
    double stop_grace_s;        /* the same after a failure; seconds, [0, 86400]; default 10 */
    double heartbeat_timeout_s; /* several nodes: an agent whose store heartbeat did not move
                                   for this long is dead; also the deadline of each store call;
                                   seconds, [0.1, 3600]; default 5 */
    double last_call_s;         /* several nodes: a round closes this long after min_nodes
                                   joined (at once when max_nodes joined); seconds, [0, 3600];
                                   default 2 */
    double join_timeout_s;      /* several nodes: give up (exit 1) when no round could be
                                   formed within this long, and the time to wait for the store
                                   host at start; seconds, [1, 86400]; default 600 */
    int metrics_port;           /* serve /metrics (Prometheus text format 0.0.4, see metrics.h)
                                   on this TCP port, [0, 65535]; 0 (default) = no server. A port
                                   that cannot be bound fails the start (exit 1, one line) */
    const char *metrics_addr;   /* the address to serve it on; NULL = "127.0.0.1" (this machine
                                   only); "0.0.0.0" or "::" for every interface; must resolve */
    const char *mem_dir;        /* the memory tier's segment folder (see "Memory tier"); NULL =
                                   "/dev/shm", and the tier is then off (a warning) when that
                                   folder is unusable; a given folder that is unusable fails the
                                   start (ELASTIC_EXIT_USAGE, one line): missing, not writable,
                                   or a real path over 3989 bytes (the workers' prefix, folder +
                                   "/" + 41, must stay under 4032 bytes, ckpt_mem_prefix_ok's
                                   rule) */
    int mem_replica_mbps;       /* cap of the peer replica sender, MB/s (10^6 bytes/s),
                                   [0, 1000000]; default 1000; 0 = no replica */
} elastic_agent_opts;

#define ELASTIC_AGENT_OPTS_INIT                                                                \
    {1, 1, 1, 3, NULL, 0, NULL, 0.1, 0.0, 60.0, 10.0, 5.0, 2.0, 600.0, 0, NULL, NULL, 1000}

/* Run the job: rendezvous, start argv (argv[0] searched in PATH when it has no '/'; argv is
 * NULL-terminated, argv[0] non-empty) nproc_per_node times per round, watch, restart, until the
 * job succeeds or fails. Logs through common/log.h with the tag "elastic"; worker output is
 * relayed as described at the top. Never exits the process; returns its exit status.
 * Forks the guardian (see "Orphans") and reaps it before returning.
 * Returns: an enum elastic_exit value (0, 1, 2 or 143). Bad options or argv, or an rdzv_host
 * that does not resolve, give ELASTIC_EXIT_USAGE with one logged line; nothing is started
 * then. Before any store or worker: a --metrics-addr that does not resolve gives
 * ELASTIC_EXIT_USAGE, a metrics port that cannot be bound (busy, no permission)
 * ELASTIC_EXIT_FAILED, each with one logged line. */
int elastic_agent_run(const elastic_agent_opts *o, char *const argv[]);

/* The operator's clean-up of a segment folder (`elastic --mem-clean`), for after an agent was
 * SIGKILLed (its files stay until an agent of the same uid and rdzv id starts there again):
 * in dir (NULL = "/dev/shm"), every prefix "ckptmem-<hash16>-<rand16>" of any job whose lease
 * nobody holds (its agent is dead), or that has no lease, loses its files of this uid, the
 * lease last; one line per removed prefix on stdout ("removed DIR/<prefix>: N file(s), B
 * bytes"). Live agents' prefixes (lease held) and other uids' files are left alone. Errors go
 * to stderr in one line. Not thread-safe against itself on the same folder (two cleaners
 * remove the same files: the second reports fewer).
 * Returns 0, or a negative errno: the folder cannot be opened or listed, a file cannot be
 * removed (the others still are), -ENOMEM. */
int elastic_mem_clean(const char *dir);

#endif /* ELASTIC_AGENT_H */
