/* train_internal.h - what the files of the train program share (not part of any public API).
 *
 *   train_opts.c      the command line and --config into `options`
 *   train_step.c      the collectives over the state, the optimizer step, validation
 *   train_snapshot.c  digests, the trainer record, the snapshot engine
 *   train_mem.c       the memory tier: budget, own segment, memory snapshots, flush mode
 *   train_resume.c    fresh start or resume (rank 0 decides, the others follow)
 *   train_startup.c   ranks, store and communicator; each rank's own start-up; the ranks'
 *                     agreement on it; shard ranges
 *   train_main.c      main(): the loop, signals, the launcher heartbeat
 *
 * Exit statuses returned by the functions below that say so: 0 success, 1 runtime failure,
 * 2 usage or configuration error (DESIGN I8). Nothing here is thread-safe: every function runs
 * on the main thread of its rank, and those marked "collective" must be called by every rank
 * in the same order. */
#ifndef TRAIN_INTERNAL_H
#define TRAIN_INTERNAL_H

#include "ckpt.h"
#include "comm.h"
#include "data.h"
#include "dcomm.h"
#include "device.h"
#include "kern_ops.h"
#include "ds_config.h"
#include "model.h"
#include "optim.h"
#include "prefetch.h"
#include "report.h"
#include "store.h"
#include "vote.h"
#include "ckpt_s3.h"
#include "shmseg.h"
#include "ckpt_mem.h"

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

/* The run's settings, from --config and the flags (train_opts.c). The strings point into
 * argv or into the static train_ds_config given to train_read_config: never freed. */
typedef struct options {
    const char *data, *val_data, *ckpt_dir, *resume, *run_id, *config, *sample_log;
    const char *tensorboard_dir; /* rank 0 writes TensorBoard events here; NULL = none */
    int allow_fresh_start; /* --allow-fresh-start: --resume auto may start from step 0 when
                              every snapshot in --ckpt-dir is corrupt */
    train_model_config model;
    int micro_batch, grad_accum, steps, eval_every, ckpt_every, val_samples, log_every;
    int grad_accum_set;   /* --grad-accum (or the config's gradient_accumulation_steps) given */
    int global_batch;     /* --global-batch B, 0 = not given */
    int cli_ga, cli_gb;   /* given on the command line (they override the config) */
    int cfg_ga;           /* the config's gradient_accumulation_steps when it also gave
                             train_batch_size: checked against B once W is known; 0 = none */
    int zero_stage;       /* 0..3 */
    double comm_timeout;  /* seconds, each collective */
    double join_timeout;  /* seconds, to join the group at start */
    uint64_t seed;
    train_adamw_config adam;
    int zstd_level, filter, direct_io, compress, snapshot_threads, policy, overlap;
    unsigned keep_last;
    int keep_every;
    uint64_t chunk_bytes;
    /* --s3 (train_s3.c): NULL = no S3 tier */
    const char *s3;
    int s3_signature;         /* 4 or 2 */
    unsigned s3_keep_last, s3_backlog, s3_attempts;
    uint64_t s3_part_bytes;
    double s3_timeout, s3_snapshot_timeout, s3_lag_warn, s3_drain_timeout;
    /* the memory tier (train_mem.c) */
    int mem_every;            /* --mem-snapshot-every N: a memory snapshot every N steps; 0 off;
                                 -1 (not given) = 1 when the budget allows, else off */
    uint64_t mem_budget;      /* --mem-budget, bytes per node; 0 (not given) = half the free
                                 space of the segment folder's file system */
    int mem_async;            /* --mem-snapshot-mode: 1 async, 0 sync, -1 (not given) = async
                                 on a device other than the CPU */
    /* the backend (train_device.c) */
    const char *device;       /* --device: NULL = "cpu"; "cuda" (ordinal LOCAL_RANK), "cuda:N" */
    int bf16;                 /* --dtype bf16 (or the config's bf16.enabled): 1; fp32: 0 */
    int reduce_ring;          /* --reduce ring: 1; tree (default): 0 */
} options;

/* One shard's checksums, computed on the copy stream by a host callback after its copy into
 * a memory slot (train_mem_begin): ckpt_mem_sum_buffer(bufs, 3, index, chunk_bytes, sums);
 * rc is -EINPROGRESS until the callback ran, then its result. */
typedef struct train_mem_sum_job {
    const ckpt_buffer *bufs;
    size_t index;
    uint64_t chunk_bytes;
    uint64_t *sums;
    int rc;
} train_mem_sum_job;

/* The state of one rank. main() (train_main.c) owns it: it allocates the buffers, and frees
 * them and closes the handles at its `out:` path; the other files fill in and use the fields
 * their functions name. */
typedef struct state {
    options *o;
    train_model *model;
    train_dataset *train, *val;
    /* ranks (DESIGN section 3): rank r owns the elements [lo, hi) of the flat space, whole
     * TRAIN_BLOCK blocks, the first nb % W ranks one block more */
    int rank, world;
    train_comm *comm;
    elastic_store_server *server; /* rank 0 hosts the store when no launcher does */
    train_vote *vote;
    ckpt_group group;
    char job_tag[40];
    size_t np, nb, lo, hi;
    size_t olo, ohi;         /* what the optimizer updates here: [lo, hi), all at stage 0 */
    size_t *shard_bytes;     /* (W) params bytes per rank */
    size_t *shard_el;        /* (W) elements per rank */
    size_t *block_bytes;     /* (W) bytes of block sums (doubles) per rank */
    /* the backend (train_device.c): the device, its kernel table and collectives. Buffers
     * marked (dev) are device memory; on the CPU device that is host memory. */
    train_device *dev;
    kern_ops ops;            /* the kernel table of dev (kern_cpu_ops_init / kern_cuda_ops_init) */
    int ops_ready;           /* ops was filled in (to be freed) */
    train_dcomm *dcomm;      /* gradient reduction and parameter all-gathers over dev memory */
    struct train_stager *stager; /* the snapshot copies from dev memory into the engine's
                                 staging area, on their own copy stream (stage.h); NULL
                                 without an engine */
    int stage_pending;       /* a snapshot's copies may still be running and its trainer
                                record waits for its digests: the next optimizer update (or
                                the next wait for the engine) completes it first
                                (train_wait_stage_copies); the same on every rank */
    int restore_staged;      /* CKPT_RESTORE_STAGED=1: restore through the stager also on the
                                CPU device (train_resume.c read_ranges) */
    size_t restore_slice;    /* bytes per staged restore slice (CKPT_RESTORE_SLICE_BYTES) */
    int restore_slice_warned; /* rank 0 said the slices are smaller than the chunks */
    int state_on_device;     /* the resume restored the state into the device memory (and
                                copied it to the host view): main skips train_state_to_device;
                                0 after a fresh start, whose state is in the host view */
    int stage_staged;        /* the engine took that snapshot (it waits for the record) */
    double stage_t0;         /* when the copies were queued (for the log line of the wait) */
    double stage_wait_s;     /* seconds train_wait_stage_copies took (the wait and the
                                digests), summed since the training loop last zeroed it: what
                                the loop takes off a step's seconds in its report (the wait is
                                reported as a stall, snapshot_wait) */
    struct train_digester *digester; /* the digest thread (train_digest.c); NULL until used */
    int stage_digest;        /* the pending snapshot's digests run on it */
    void *stage_rec;         /* (json_t *) its trainer record, digests still to be filled */
    float *dm, *dv;          /* (dev, ohi - olo) Adam moments */
    float *m, *v;            /* host view of dm, dv: the same pointers on the CPU device, pinned
                                mirrors on CUDA (train_state_to_host / train_state_to_device) */
    float *params_host;      /* host view of the params (np): train_model_params on the CPU
                                device, a pinned mirror on CUDA */
    float *gsum;             /* (dev, np) this rank's tree sum of its micro-batch gradients */
    float *gshard;           /* (dev, hi - lo) reduce-scattered gradient (stages 2, 3) */
    double *dblocks;         /* (dev, (ohi - olo) / TRAIN_BLOCK) block sums of squares */
    double *blocks;          /* (nb) squared norms of gradient blocks (host) */
    double *xchg;            /* (W x (A + 1)) per-micro-batch losses and stop flags */
    double *losses;          /* (M = A x W) the step's micro-batch losses in order */
    size_t *counts;          /* (W) scratch for the counts of one collective */
    train_tree *tree;
    int32_t *inputs, *targets;   /* (b x T) for validation */
    int32_t *step_inputs, *step_targets; /* (A x b x T) this rank's samples of the step */
    uint64_t *step_samples;  /* (A x b) sample indices of the step, for --sample-log */
    train_prefetch *prefetch; /* reads the next steps' samples ahead on its own thread */
    int grad_accum;          /* micro-batches per rank per step (A) */
    int global_batch;        /* sequences per step over all ranks (B = A x b x W) */
    int64_t step;             /* completed optimizer steps */
    uint64_t samples;         /* samples consumed */
    ckpt_engine *engine;
    ckpt_dir_lock *lock;
    char run_id[64];
    char config_hash[17];
    double last_loss, last_val;
    uint64_t skipped;
    int sample_fd;
    uint64_t moments_digest[2]; /* block digests of adam_m, adam_v for the next record */
    char recorded_moments[2][17]; /* the loaded record's, "" when it has none (older) */
    train_report *report;     /* progress events for the launcher (report.h) */
    uint64_t persists_reported; /* finished persists already reported */
    /* the S3 tier (train_s3.c) */
    objstore *s3_read;        /* restore and listing */
    objstore *s3_up;          /* the uploader's own */
    ckpt_uploader *uploader;
    train_vote *s3_vote;      /* the uploader's confirmations (W > 1) */
    ckpt_group s3_group;
    char s3_restored[CKPT_PATH_MAX]; /* the s3:// snapshot restored from, "" when none */
    int64_t s3_newest;        /* rank 0: newest committed step the resume saw on S3; -1 none */
    int s3_down;              /* the start-up check could not reach the bucket (transient) */
    ckpt_entry *s3_list;      /* rank 0: the S3 listing of the resume (NULL: not listed) */
    size_t s3_nlist;
    /* the memory tier (train_mem.c) */
    const char *mem_path;     /* CKPT_MEM_PATH (a path prefix), NULL = no memory tier */
    int mem_every;            /* memory snapshot every N steps, agreed by every rank; 0 off */
    uint64_t mem_chunk;       /* chunk bytes of the slots' checksums (= the disk snapshots') */
    uint64_t mem_slot_bytes;  /* capacity of each slot of the own segment */
    int mem_nslots;           /* slots of the own segment (train_mem_plan: 3 in sync mode when
                                 the budget allows, else 2) */
    char mem_own[CKPT_PATH_MAX]; /* the own segment: $CKPT_MEM_PATH.own-$LOCAL_RANK */
    shmseg *mem_seg;          /* the own segment; NULL when off or not creatable here */
    char mem_tag[40];         /* tag of this launch's memory snapshots */
    int mem_persist_slot;     /* the slot a disk persist in flight reads, -1 none */
    int mem_async;            /* memory snapshots are asynchronous (--mem-snapshot-mode; agreed
                                 by every rank): copied on the stager's copy stream into a
                                 slot begun at the stage (ckpt_mem_begin) and committed by
                                 train_wait_stage_copies (ckpt_mem_commit) */
    int mem_pinned;           /* the own segment's slots are registered as pinned memory */
    int stage_mem_slot;       /* the slot the pending stage copies into, -1 none */
    ckpt_buffer stage_mem_bufs[3]; /* where its shards go in that slot (ckpt_mem_begin) */
    train_mem_sum_job stage_mem_jobs[3]; /* their checksums, computed on the copy stream */
    uint64_t *mem_sums;       /* those checksums (ckpt_mem_sum_count entries), NULL before
                                 the first asynchronous memory snapshot */
    double stage_mem_stall;   /* the seconds its stage took (queueing), for its report */
    int mem_failing;          /* the last memory snapshot failed (logged once) */
    uint64_t mem_count, mem_failed;
    double mem_stall_sum, mem_stall_max;
    int mem_restored;         /* rank 0: the resume came from memory */
    struct train_memremote *mem_remote; /* the other nodes' memory slots (train_memremote.c);
                                 NULL until a resume needs them */
} state;

/* ------------------------------------------------------------------ train_opts.c */

/* Read --config FILE from argv, if given, into *o (and *dc, which must stay alive while *o is
 * used: o's strings may point into it). Call before train_parse_args, whose flags override
 * it. Returns 0, or -1 after printing one line (exit 2). */
int train_read_config(int argc, char **argv, options *o, train_ds_config *dc);

/* Parse the flags into *o (holding the defaults and the config) and check the combination.
 * --help prints the usage and exits 0. Returns 0, or -1 after printing one line (exit 2). */
int train_parse_args(int argc, char **argv, options *o);

/* ------------------------------------------------------------------ train_step.c */

/* Log one line for a failed collective: the rank, the step, what (a short description) and
 * the reason of rc (a negative errno). */
void train_comm_failed(const state *s, const char *what, int rc);

/* All-gather of one record of len bytes per rank. all: (W x len) bytes, this rank's record at
 * all + rank x len; on return every rank's, in rank order. Uses s->counts. Collective.
 * Returns 0 or the collective's negative errno (not logged here). */
int train_gather_records(state *s, void *all, size_t len);

/* All-gather of every rank's params shard [lo, hi) into the full buffer; nothing at W = 1 or
 * ZeRO stage 0. Collective. Returns 0 or the collective's negative errno (logged). */
int train_gather_params(state *s);

/* The model's ZeRO-3 parameter hook (model.h): gathers the elements [lo, hi) of the flat
 * space from the ranks that own them. ctx: the state. Also called with [0, np) to gather
 * everything. Collective. Returns 0 or the collective's negative errno (logged). */
int train_gather_range_hook(void *ctx, size_t lo, size_t hi);

/* Validation loss over the first o->val_samples samples of s->val, with the same bits at
 * every world size. Collective. Returns the mean loss, NaN without validation data or on a
 * failure (logged). */
double train_eval_val(state *s);

/* One optimizer step (DESIGN section 3). On success s->step and s->samples advance and
 * *loss_out (mean loss of the step's micro-batches), *norm_out (global gradient norm before
 * clipping), *lr_out (learning rate used) are set; *stop_any is set when some rank received
 * SIGTERM/SIGINT before this step's exchange. Collective. Returns 0, or a negative errno
 * (logged): a data, gradient-accumulator or collective failure, the run cannot go on. */
int train_step(state *s, double *loss_out, double *norm_out, float *lr_out, int *stop_any);

/* ------------------------------------------------------------------ train_snapshot.c */

/* XXH3-128 of the n floats at p as 32 lowercase hex digits (out: 33 bytes with the NUL). */
void train_digest_hex(const float *p, size_t n, char out[33]);

/* The digests of adam_m and adam_v over the whole flat space, independent of the sharding
 * (each rank adds its part of [lo, hi)); out[0] adam_m, out[1] adam_v. Collective when W > 1.
 * Returns 0, -ENOMEM, or the collective's negative errno (logged). */
int train_moments_digest(state *s, uint64_t out[2]);
/* train_moments_digest in two parts: this rank's parts of the two digests over its shard
 * [lo, hi) of m and v (which hold [olo, ...)), local and thread-safe; and their sum over the
 * ranks (collective when W > 1; 0 or the collective's error). */
void train_moments_digest_local(const float *m, const float *v, size_t lo, size_t hi, size_t olo,
                                uint64_t out[2]);
int train_moments_digest_sum(state *s, const uint64_t mine[2], uint64_t out[2]);

/* The same digests as train_moments_digest over whole buffers m and v of np elements (np a
 * multiple of TRAIN_BLOCK, as s->np is), in one process: what the ranks' parts sum to. */
void train_moments_digest_whole(const float *m, const float *v, size_t np, uint64_t out[2]);

/* The config hash recorded in snapshots (model shape, seed, global batch) as 16 hex digits
 * (out: 17 bytes). */
void train_make_config_hash(const state *s, char out[17]);

/* The shortest decimal that reads back as the same float f. */
double train_f2d(float f);

/* Create s->stager (the snapshot copy stream on s->dev) unless there is one. Returns 0 or
 * train_stager_create's negative errno (logged). */
int train_make_stager(state *s);

/* Create s->engine for o->ckpt_dir from the options (and s->stager first). Returns 0 or
 * ckpt_engine_create's or train_make_stager's negative errno (logged). */
int train_make_engine(state *s);

/* An error exit's end of a pending stage that will not be waited for: frees its trainer
 * record (after the engine and the stager are gone). */
void train_stage_discard(state *s);

/* Complete the snapshot staged from the device (if one is pending), before the optimizer
 * update overwrites params, adam_m and adam_v, and before any wait for the engine: wait for
 * its copies (bounded by --comm-timeout x 10, at least 600 s), compute the digests of its
 * trainer record from the host view (the state is still the snapshot's: no update ran since),
 * and hand the record to the engine (ckpt_engine_set_trainer). Collective when W > 1 (the
 * moments digest); every rank has the same pending snapshot. Logs how long the update waited
 * for the copies when it did; reports the wait and the digests' time (snapshot_wait, report.h)
 * and adds it to s->stage_wait_s. Returns 0, or the copy stream's or the collective's negative
 * errno (logged; the record is then withdrawn: nothing is committed). */
int train_wait_stage_copies(state *s);

/* Wait for the persist in flight, at most timeout_s seconds; in a group, watch for dead
 * peers meanwhile. Returns ckpt_engine_wait's result (0, -EINPROGRESS when still running at
 * the deadline, the persist's error), or -ECONNRESET (a peer died: the vote channel is
 * aborted, the persist will not commit; logged). */
int train_wait_engine(state *s, double timeout_s);

/* Report every persist that finished since the last call (train_report_snapshot_done);
 * cheap, call after each step. No-op without an engine. */
void train_poll_persists(state *s);

/* The snapshot of the current step taken through the stager (train_snapshot.c): disk != 0
 * stages it for the engine (policy as ckpt_engine_stage_device), and with s->mem_async a
 * memory snapshot too: a slot of the own segment is begun, the shards are copied into it on
 * the copy stream (the engine's copies, when it takes the disk snapshot, so one copy feeds
 * both and the persist reads the slot), and train_wait_stage_copies commits it once the
 * record's digests are known. Every rank marks the snapshot pending (the digests are a
 * collective). Collective. Returns 0 (also when a stage failed: logged and reported), or a
 * collective's negative errno (fatal). */
int train_stage_snapshot(state *s, int disk);

/* What a snapshot of the current step holds, for the engine and the memory tier: at ZeRO-3
 * the parameters are gathered (the record's digest), the moments digest is computed, bufs
 * gets this rank's shards of params, adam_m, adam_v (pointing into the live state) and *text
 * the trainer record as compact JSON (free() it). Collective. Returns 0, -ENOMEM, or a
 * collective's negative errno (fatal). */
int train_snapshot_prepare(state *s, ckpt_buffer bufs[3], char **text);

/* Stage a snapshot of the current step (params, adam_m, adam_v shards and the trainer
 * record); the engine persists it in the background. With the memory tier, the state is
 * copied into a slot of the own segment (a memory snapshot) and persisted from there. last: the final snapshot of the run,
 * never skipped. Collective. Returns 0 (also when the stage failed or the policy skipped it:
 * logged), or a negative errno when a collective failed or memory ran out (fatal). */
int train_take_snapshot(state *s, int last);

/* ------------------------------------------------------------------ train_mem.c */

/* Decide whether the memory tier is on (CKPT_MEM_PATH set, --mem-snapshot-every not 0, the
 * budget fits on every rank): sets s->mem_path, s->mem_every, s->mem_chunk and
 * s->mem_slot_bytes. Needs train_plan_shards and the model. Call before the resume. An
 * explicit --mem-budget too small is an input error (one line naming the need and the budget);
 * the default budget too small turns the tier off with a warning. Collective. Returns the exit
 * status: 0, 1 (a collective failed) or 2. */
int train_mem_plan(state *s);

/* After the resume: create (or re-use, same layout) this rank's own segment
 * $CKPT_MEM_PATH.own-$LOCAL_RANK. A failure is logged and leaves s->mem_seg NULL: this rank
 * then takes no memory snapshots (but still joins their collectives). Local. Returns 0 or
 * shmseg_create's negative errno. */
int train_mem_open(state *s);

/* Log the figures of the memory snapshots (rank 0) and unmap the own segment (the file stays:
 * the agent removes it at the end of the job). Accepts a state without the tier. */
void train_mem_close(state *s);

/* Write a memory snapshot of bufs (from train_snapshot_prepare) and trainer_json into the own
 * segment, never into the slot a persist in flight reads; t0: when the snapshot began
 * (clock_now_s), for the stall reported. staged (3 entries, may be NULL) gets the buffers in
 * the slot, for ckpt_engine_persist_staged; *slot_out the slot written (-1 on failure). A
 * failure is logged (once until it recovers) and reported. Local. Returns 0, -ENODEV (no
 * segment on this rank), or ckpt_mem_write's negative errno. */
int train_mem_write(state *s, const ckpt_buffer bufs[3], const char *trainer_json, double t0,
                    ckpt_buffer staged[3], int *slot_out);

/* Begin an asynchronous memory snapshot of this rank's shards dbufs (device memory, as
 * train_stage_snapshot stages them): ckpt_mem_begin on the own segment (its older slot: no
 * persist reads a slot in this mode) into s->stage_mem_bufs, then on the stager's copy stream
 * (after the work queued on it so far) each shard's copy into the slot and a host callback
 * that computes its checksums into s->mem_sums (s->stage_mem_jobs), off the training thread.
 * The caller waits for the copy stream before train_mem_commit. A failure is accounted as
 * train_mem_write's. Local. Returns the slot, or -ENODEV (no segment on this rank),
 * -ENOMEM, or ckpt_mem_begin's or the copy stream's negative errno. */
int train_mem_begin(state *s, const ckpt_buffer dbufs[3]);

/* Commit the slot begun by train_mem_begin once its copies are done (rc 0) with
 * trainer_json and the checksums from the copy stream (hashed here if one of those failed),
 * or account its failure (rc < 0: the copies or the digests failed; the slot stays writing,
 * never used). stall: the seconds reported as the memory snapshot's stall, the commit's own
 * added. Logged and reported as train_mem_write. Local. Returns 0 or the negative errno of
 * the snapshot (rc, or ckpt_mem_commit's). */
int train_mem_commit(state *s, int slot, const char *trainer_json, int rc, double stall);

/* A memory snapshot of the current step (not a disk one: see train_take_snapshot). Call on
 * every rank at the steps where s->step % s->mem_every == 0. Collective. Returns 0 (also when
 * the copy failed: logged), or a collective's negative errno (fatal). */
int train_mem_take(state *s);

/* Flush mode (CKPT_MEM_FLUSH=1, run by the agent after a failure or on preemption): write the
 * newest memory snapshot complete on this node into o->ckpt_dir when it is newer than the
 * newest committed one there (ckpt_mem_flush). One log line. Returns the exit status: 0
 * flushed or nothing to do, 1 failed, 2 no CKPT_MEM_PATH. */
int train_mem_flush_main(const options *o);

/* ------------------------------------------------------------------ train_memremote.c */

/* The other nodes' memory slots, read through their agents (elastic/mem_client.h) during
 * --resume auto: under elastic with several nodes (GROUP_WORLD_SIZE > 1), the addresses of
 * the agents of the other nodes of this round come from the store (rdzv/<ELASTIC_RUN_ID>/mem/
 * <ELASTIC_RESTART_COUNT>/<node>, waited for up to 1 s each: the agents publish them before
 * they start their workers; MASTER_ADDR:MASTER_PORT with
 * ELASTIC_STORE_TOKEN, which is also the agents' token). Built at the first need, freed by
 * train_memremote_close. A peer that cannot be reached is one warning and is left out. */
typedef struct train_memremote train_memremote;

/* Rank 0: ckpt_mem_list of mem_path; when a PARTIAL entry of step >= newest (of --run-id's
 * run when given) is listed, the peer agents are asked as well (ckpt_mem_list_ex) and that
 * listing replaces this node's. Returns 0 (*out, *n as ckpt_mem_list's) or its -errno. */
int train_memremote_list(state *s, const char *mem_path, int64_t newest, ckpt_mem_entry **out, size_t *n);

/* Every rank: open memory snapshot id from this node's segments ($CKPT_MEM_PATH), or, when
 * some rank's slot is not here (-ENOENT), with the peer agents' slots for those ranks
 * (ckpt_mem_snapshot_open_ex); logs one line per peer read from: "... from memory (peer agent
 * host:port)". Returns ckpt_mem_snapshot_open_ex's result; -ENOENT with why set when there is
 * no peer to ask. */
int train_memremote_open(state *s, ckpt_snapshot **out, const char *id, char *why, size_t why_len);

/* After the reads of a handle from train_memremote_open: one line per peer with the bytes read
 * from it and the rate. No-op for other handles. */
void train_memremote_done(state *s, const ckpt_snapshot *snap);

/* Close the peer clients; accepts a state without them. */
void train_memremote_close(state *s);

/* ------------------------------------------------------------------ train_s3.c */

/* With --s3: open the store handles from the environment and check the bucket can be listed
 * (bad credentials, no such bucket: exit 2 before the first step; an outage only warns: the
 * uploads retry). Returns the exit status 0, 1 or 2 (logged). */
int train_s3_open(state *s);

/* The store settings the options give (signature, request timeout, o->s3 as URL). */
void train_s3_store_opts(const options *o, objstore_opts *so);

/* With --s3 at W > 1: the uploader's confirmation channel (train_dist_init). */
int train_s3_vote_create(state *s, const char *host, int port, const char *token,
                         const char *gen);

/* With --s3: start the uploader (after the resume: the run id is known), and make the
 * snapshot engine hand it every commit (train_make_engine reads s->uploader). 0 or -errno. */
int train_s3_start(state *s);

/* At the end: wait up to --s3-drain-timeout for uploads, log the figures, stop the uploader,
 * close the handles. Safe without --s3. */
void train_s3_finish(state *s, int drain);

/* The engine's on_commit hook: queue the snapshot for upload. */
void train_s3_on_commit(void *ctx, uint64_t step);

/* ------------------------------------------------------------------ train_resume.c */

/* What a trainer record says, as train_record_check found it (pointers into the record). */
typedef struct train_record {
    int64_t step, samples, global_batch, saved_world;
    const char *params_digest;               /* 32 hex digits over the whole params */
    const char *adam_m_digest, *adam_v_digest; /* 16 hex digits each; NULL in older records */
} train_record;

struct json_t;

/* The checks a restore makes of a snapshot's trainer record against this job before it
 * reads a byte (load_part), shared with the flush (train_mem.c), which must not commit what a
 * restore would reject: the record's fields are there and well formed, its step and Adam
 * step equal the snapshot's step, the model config equals o->model, the data hash equals
 * data_hash (16 hex digits of train_dataset_hash), the seed equals o->seed, the global batch
 * is valid and samples_consumed = step x it, params/adam_m/adam_v are f32 buffers of np
 * elements. The digests themselves need the bytes: the caller compares them. tr: the parsed
 * record (NULL counts as malformed). *rec gets the fields on success. Returns 0, -EBADMSG
 * (malformed or inconsistent: corrupt or forged) or -EINVAL (another model, data or seed:
 * not this job's), with one line in why. Thread-safe. */
int train_record_check(const options *o, const char *data_hash, size_t np, const ckpt_snapshot *snap,
                       const struct json_t *tr, train_record *rec, char *why, size_t why_len);

/* Fresh start or resume as o->resume says: rank 0 chooses the snapshot (--resume PATH, or for
 * auto the newest usable one: with CKPT_MEM_PATH first the memory snapshots of this node at
 * least as new as the newest on disk and S3, where any failure only moves on to the next
 * candidate, then --ckpt-dir and S3, setting corrupt ones aside), every rank loads its
 * ranges and checks them, and the ranks agree on the outcome. Sets the parameters, moments,
 * step, samples, run id, global batch and accumulation per rank. Needs the model and the
 * buffers of main and train_plan_shards. Collective. Returns the exit status: 0, 1 (runtime
 * failure), 2 (configuration error: an incompatible or newer snapshot, a bad batch split,
 * later snapshots in --ckpt-dir). */
int train_resume(state *s);

/* ------------------------------------------------------------------ train_startup.c */

/* The exit status for an error found in an input before the first step (DESIGN I8): 1 when
 * rc is transient or environmental (-EMFILE, -ENFILE, -ENOMEM, -EIO, -ETIMEDOUT, -EAGAIN,
 * -EINTR, -EBUSY, -ECONNRESET, -ENOSPC: a retry may succeed), else 2 (the input is wrong:
 * missing, malformed, corrupt, refused, not permitted; the agent never retries it). */
int train_input_status(int rc);


/* Join the group: ranks from the environment (torchrun's or Slurm's), rank 0 hosts the store
 * unless the launcher does, the communicator, the job tag and the snapshot vote channel.
 * Allocates s->counts. Returns the exit status: 0, 1 or 2 (logged). */
int train_dist_init(state *s);

/* This rank's own start-up: open the data, and on rank 0 take --ckpt-dir's lock. Returns the
 * exit status: 0, 1 or 2 (logged, naming the rank). */
int train_startup_local(state *s);

/* Every rank's start-up status (local, from train_startup_local) and settings, exchanged
 * once. Collective. Returns 0 when every rank started with rank 0's settings, else the same
 * exit status on every rank (the largest failed rank's, or 2 for different settings). */
int train_startup_agree(state *s, int local);

/* Shard ranges of the flat space: np, nb, lo, hi, olo, ohi and the per-rank arrays
 * shard_bytes, shard_el, block_bytes (allocated here, freed by main). Needs s->model.
 * Returns 0 or -ENOMEM. */
int train_plan_shards(state *s);

/* ------------------------------------------------------------------ train_device.c */

/* Open the device of --device (cuda: ordinal LOCAL_RANK; cuda:N: N) and its kernel table of
 * --dtype into s->dev and s->ops; log the device, dtype and reduce mode (rank 0). A missing or
 * unusable GPU, or a build without CUDA: one line on stderr, exit status 2. Local. Returns the
 * exit status 0, 1 (out of memory) or 2. */
int train_device_setup(state *s);

/* After train_plan_shards and the model: the device buffers of the state (dm, dv, gsum,
 * gshard, dblocks; zeroed), the host views m, v, params_host (aliases on the CPU device,
 * pinned mirrors on CUDA) and the device collectives s->dcomm (over s->comm; --reduce).
 * Collective (dcomm create). Returns 0, or a negative errno (logged). */
int train_state_alloc(state *s);

/* Rank 0: log the device, dtype, kernels and reduce mode in one line (and that --reduce ring
 * falls back to the tree on the CPU). Called with the model line, after the resume. */
void train_backend_log(const state *s);

/* Free the buffers and collectives of train_state_alloc (before the model goes) /
 * the kernel table and the device of train_device_setup (after the model). Both accept a state
 * without them. */
void train_state_free(state *s);
void train_device_teardown(state *s);

/* The sync points between the device state and its host view (piece D replaces the snapshot
 * path's use with asynchronous staging). On the CPU device both are no-ops (the views are the
 * device memory). CUDA: to_host copies the params (np), adam_m and adam_v (ohi - olo) D2H into
 * params_host, m, v, after the work queued on the compute stream; to_device the other way.
 * Call to_host before host users read the state (digests, the trainer record, snapshots, the
 * memory tier, the final digest), to_device after a resume or a fresh start wrote the host
 * view. Return 0 or the copy's negative errno (logged). Local. */
int train_state_to_host(state *s);
/* train_state_to_host queued on stream st (asynchronous: complete once st's work is done);
 * nothing on the CPU device. 0 or the device layer's negative errno (logged). */
int train_state_to_host_async(state *s, train_stream *st);
int train_state_to_device(state *s);

/* CKPT_RESTORE_STAGED and CKPT_RESTORE_SLICE_BYTES into s->restore_staged and
 * s->restore_slice (train_resume.c; docs/OPERATIONS.md, environment), in train_startup_local.
 * A bad value: one line on stderr, -EINVAL. Local. */
int train_restore_env(state *s);

/* ------------------------------------------------------------------ train_digest.c */

/* The record's digests of a staged snapshot on a helper thread, overlapped with the next
 * step (see train_digest.c). Training thread only. */
typedef struct train_digester train_digester;
/* Whether the host view stays unchanged until the next optimizer update (not on the CPU
 * device at ZeRO-3 with W > 1, where the layer all-gathers write into it). */
int train_digest_usable(const state *s);
/* Hash the host view (params_host over np; m, v over [lo, hi)) on the digest thread once the
 * work queued on st so far is done (a host function on st). The host view must stay unchanged
 * until train_digest_finish or train_digest_cancel returns. Errors: -EOPNOTSUPP (not
 * usable), -EBUSY (a job not finished, or the host function of a dropped one not run yet),
 * -ENOMEM, -EAGAIN (no thread), the host function's errors (the job is then dropped). */
int train_digest_start(state *s, train_stream *st);
/* Wait (at most timeout_s) for the job: params_hex gets the params digest (32 hex digits),
 * mine this rank's moments parts, *hash_s (may be NULL) the seconds hashed. Errors: -EINVAL
 * (no job), -ETIMEDOUT (the job stays, and train_digest_start refuses another). */
int train_digest_finish(state *s, double timeout_s, char params_hex[33], uint64_t mine[2],
                        double *hash_s);
/* Drop the job (its copies failed): waits (at most timeout_s) for hashing already running.
 * 0 or -ETIMEDOUT. */
int train_digest_cancel(state *s, double timeout_s);
/* Join the thread and free it (after the stager is destroyed). Accepts a state without. */
void train_digest_stop(state *s);

/* ------------------------------------------------------------------ train_main.c */

/* The SIGTERM/SIGINT received (the signal number), 0 = none: set by main's handler, read by
 * train_step for this rank's stop flag. */
extern volatile sig_atomic_t train_stop_signal;
/* Every SIGTERM/SIGINT received (the first one also sets train_stop_signal): a second one ends
 * the wait for the last uploads. */
extern volatile sig_atomic_t train_stop_count;

/* 64 random bits (/dev/urandom, mixed with the time and pid should it fail): run ids and
 * probe file names. Thread-safe. */
uint64_t train_random_u64(void);

#endif
