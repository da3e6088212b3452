/* train_opts.c - the train program's command line and --config (see train_internal.h). */
#include "ckpt.h"
#include "ds_config.h"
#include "log.h"
#include "model.h"
#include "storage.h"
#include "train_internal.h"
#include "ckpt_s3.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TAG "train"

static const char usage_text[] =
    "usage: train --data GLOB [options]\n"
    "\n"
    "Trains a GPT-2 style decoder on llm.c token shards (CPU or CUDA backend), with snapshots.\n"
    "\n"
    "Data and model:\n"
    "  --data GLOB           training shards (llm.c layout), required\n"
    "  --val-data GLOB       validation shards (default: none, no val_loss)\n"
    "  --vocab N             vocabulary size (default 256: byte-level)\n"
    "  --n-layer N           transformer blocks (default 4)\n"
    "  --n-embd N            embedding width (default 128)\n"
    "  --n-head N            attention heads (default 4)\n"
    "  --seq-len N           tokens per sequence (default 128)\n"
    "Batch and schedule:\n"
    "  --micro-batch N       sequences per micro-batch (default 8)\n"
    "  --grad-accum N        micro-batches per rank per optimizer step (default 1)\n"
    "  --global-batch B      sequences per optimizer step over all ranks (DeepSpeed's\n"
    "                        train_batch_size); gradient accumulation per rank is derived as\n"
    "                        B / (micro-batch x world size), so B stays fixed when the world size\n"
    "                        changes. Without it and without --grad-accum, a resume keeps the\n"
    "                        snapshot's B\n"
    "  --zero-stage N        ZeRO sharding: 0 none (all-reduce, every rank holds everything),\n"
    "                        1 optimizer state, 2 + reduce-scattered gradients (default), 3 +\n"
    "                        parameters, gathered layer by layer for forward and backward\n"
    "  --config FILE         DeepSpeed-style JSON (train_batch_size, train_micro_batch_size_per_gpu,\n"
    "                        gradient_accumulation_steps, zero_optimization.stage, optimizer,\n"
    "                        scheduler, gradient_clipping, checkpoint{dir,every,keep_last,...},\n"
    "                        tensorboard{enabled,output_path,job_name});\n"
    "                        command-line flags override it; unknown keys are listed in a warning\n"
    "  --steps N             optimizer steps to reach (default 100)\n"
    "  --lr X                peak learning rate (default 1e-3)\n"
    "  --min-lr-ratio X      final lr / peak lr after the cosine (default 0.1)\n"
    "  --warmup N            linear warm-up steps (default 0)\n"
    "  --weight-decay X      AdamW decoupled weight decay (default 0.1)\n"
    "  --grad-clip X         global gradient-norm clip, 0 = off (default 1.0)\n"
    "  --seed N              seed of initialisation and sample order (default 1337)\n"
    "  --eval-every N        validation loss every N steps, 0 = only at the end (default 0)\n"
    "  --val-samples N       validation sequences per evaluation (default 64)\n"
    "  --log-every N         one log line every N steps (default 1)\n"
    "  --tensorboard-dir DIR rank 0 writes TensorBoard event files (scalars train/loss,\n"
    "                        train/val_loss, train/lr, train/grad_norm, train/tokens_per_second,\n"
    "                        train/step_seconds, ckpt/stall_seconds, ckpt/persist_seconds,\n"
    "                        ckpt/persist_mib_per_second, ckpt/compression_ratio,\n"
    "                        ckpt/restore_seconds, elastic/restarts) into DIR, created when\n"
    "                        missing; a resumed run continues the curves (`tensorboard --logdir\n"
    "                        DIR`). Overrides the config's \"tensorboard\" section (DeepSpeed's:\n"
    "                        enabled, output_path, job_name: events in output_path/job_name).\n"
    "                        A write error is logged once and training goes on without events\n"
    ;
static const char usage_text_dev[] =
    "Backend:\n"
    "  --device D            cpu (default), cuda (GPU number LOCAL_RANK, default 0) or cuda:N.\n"
    "                        Without a usable GPU, or in a build without CUDA: one line, exit 2\n"
    "  --dtype T             fp32 (default) or bf16 (the config's bf16.enabled: true): bf16\n"
    "                        working parameters and GEMM-input activations (GEMM operands\n"
    "                        rounded to bf16), products summed in fp32; master weights, Adam\n"
    "                        moments, gradients and snapshots stay fp32 (on the CPU an emulation,\n"
    "                        deterministic, for tests). A snapshot of either dtype restores into a\n"
    "                        run of either (a warning when they differ: the run then does not\n"
    "                        match an uninterrupted one); the trainer record names the dtype\n"
    "  --reduce M            gradient reduction across ranks: tree (default; deterministic, the\n"
    "                        same bits at every world size) or ring (NCCL's ring collectives:\n"
    "                        faster, not bit-stable across world sizes; CUDA only, on the CPU\n"
    "                        tree is used and logged)\n"
    "\n"
    ;
static const char usage_text2[] =
    "Snapshots:\n"
    "  --ckpt-dir DIR        snapshot folder (made if missing, locked by this run; its\n"
    "                        absolute path at most 3584 bytes)\n"
    "  --ckpt-every N        snapshot every N steps, and at the last step (default 0: none);\n"
    "                        taken asynchronously: the copies run beside the next step's\n"
    "                        forward and backward; only its optimizer update waits for them\n"
    "  --resume MODE         none (default), auto (newest verified snapshot in --ckpt-dir,\n"
    "                        fresh start when there is none), or a snapshot folder PATH\n"
    "  --allow-fresh-start   with --resume auto: start from step 0 when --ckpt-dir holds\n"
    "                        snapshots but none can be restored (all corrupt: they are set\n"
    "                        aside); without it such a run exits 2 listing each and why\n"
    "  --run-id ID           lineage id recorded in snapshots (default: random, kept on resume);\n"
    "                        given, --resume auto skips snapshots of other run ids\n"
    "  --keep-last K         keep the newest K snapshots of this run, 0 = all (default 0)\n"
    "  --keep-every N        also keep snapshots whose step is a multiple of N (default 0)\n"
    "  --snapshot-policy P   when a snapshot is due while the previous one still persists:\n"
    "                        wait (default) or skip (counted and logged)\n"
    "  --snapshot-threads N  compression threads of the background persist (default 2)\n"
    "  --snapshot-overlap    no effect, kept so that old command lines work (logged): the\n"
    "                        copies are asynchronous and the persist follows them chunk by\n"
    "                        chunk anyway\n"
    "  --zstd-level N        compression level (default 1)\n"
    "  --no-compress         store chunks raw\n"
    "  --no-shuffle          no byte-shuffle filter before compression (by default the bytes\n"
    "                        of each float are grouped: about 1.2x instead of 1.09x on Adam\n"
    "                        state)\n"
    "  --chunk-mib N         raw MiB per chunk (default 4)\n"
    "  --no-direct-io        buffered writes instead of O_DIRECT\n"
    ;
static const char usage_text_s3[] =
    "Off-site backup on S3 (docs/OPERATIONS.md, \"Off-site backup on S3\"):\n"
    "  --s3 s3://BUCKET/PREFIX  upload every committed snapshot in the background, and let\n"
    "                        --resume auto restore from the bucket (the newest complete snapshot\n"
    "                        across --ckpt-dir and S3). Settings and keys from the AWS variables\n"
    "                        (AWS_ENDPOINT_URL[_S3], AWS_REGION, AWS_ACCESS_KEY_ID, ...) or the\n"
    "                        shared credentials file (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE),\n"
    "                        re-read when it changes. Never a secret on the command line\n"
    "  --s3-signature V      v4 (default: AWS, R2, B2, Ceph, MinIO) or v2 (libs3; old servers)\n"
    "  --s3-keep-last K      keep the newest K complete snapshots on S3, 0 = all (default 0)\n"
    "  --s3-part-mib N       data files larger than N MiB become several objects (default 256)\n"
    "  --s3-backlog N        snapshots waiting for upload at most; a new one then drops the\n"
    "                        oldest waiting (counted, logged), never the newest (default 2)\n"
    "  --s3-timeout S        per request attempt, seconds (default 60; retried with backoff)\n"
    "  --s3-attempts N       attempts per request, the first included (default 6)\n"
    "  --s3-snapshot-timeout S  bound of one snapshot's upload, seconds (default 1800)\n"
    "  --s3-lag-warn S       warn when the oldest snapshot not yet on S3 is older (default 1800)\n"
    "  --s3-drain-timeout S  at the end, wait this long for uploads in progress (default 600)\n"
    ;
static const char usage_text_mem[] =
    "Memory tier (under elastic, which sets CKPT_MEM_PATH; docs/OPERATIONS.md, \"Memory tier\"):\n"
    "  --mem-snapshot-every N  copy the state into this rank's shared-memory segment every N\n"
    "                        steps (it outlives the process: a restart restores from it in\n"
    "                        milliseconds); 0 = off. Default 1 (every step) when the memory\n"
    "                        budget allows it, else off with a warning. Disk snapshots\n"
    "                        (--ckpt-every) are then persisted from that copy. Without\n"
    "                        CKPT_MEM_PATH (train not under elastic) there is no memory tier\n"
    "  --mem-budget BYTES    shared memory this node may use (suffixes K, M, G, T in either\n"
    "                        case: powers of 1024), checked at start against 2 slots x the state shard of each\n"
    "                        local rank (x 2 on several nodes: the peer's replicas live here\n"
    "                        too); too small: exit 2. Default: half the free space of the\n"
    "                        segment folder's file system (too small: the tier is off). Sync\n"
    "                        mode takes a third slot per rank when the budget holds it\n"
    "                        (else one warning)\n"
    "  --mem-snapshot-mode M  sync: the copy into the segment, its checksums and its commit\n"
    "                        happen before the next step starts (the newest step finished is\n"
    "                        in memory); async: the copy runs on the snapshot copy stream\n"
    "                        while the next step computes, and the slot is committed at that\n"
    "                        step's optimizer update (a smaller stall; a crash before it loses\n"
    "                        that slot: the memory tier is then up to one step older).\n"
    "                        Default: async on --device cuda, sync on the CPU\n"
    ;
static const char usage_text3[] =
    "Ranks (one process per rank; launched by elastic, torchrun-style or by hand):\n"
    "  --comm-timeout S      deadline of each collective, seconds (default 60); a dead rank is\n"
    "                        noticed at once, a stopped one at this deadline\n"
    "  --join-timeout S      how long the ranks wait for each other at start, seconds\n"
    "                        (default 120); a rank whose store host gave up fails at once\n"
    "  --sample-log FILE     append \"<sample number> <sample index>\" for every sample of every\n"
    "                        finished step (diagnostics: proves no sample repeats or is skipped)\n"
    "  -h, --help            this text\n"
    "\n"
    "SIGTERM/SIGINT: finish the step, take a final snapshot (with --ckpt-every), exit 128+sig.\n"
    "At the end it prints: final step=<n> loss=<x> val_loss=<y> params_digest=<xxh3-128 hex>\n"
    "(val_loss=nan without --val-data).\n"
    "Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun's; or Slurm's\n"
    "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID with MASTER_ADDR/MASTER_PORT, default port 29500);\n"
    "rank 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT unless ELASTIC_STORE_HOSTED=1\n"
    "(the launcher hosts it); ELASTIC_STORE_TOKEN (store secret, never logged);\n"
    "ELASTIC_RESTART_COUNT (generation); CKPT_MEM_PATH (the memory tier's segment prefix, set by\n"
    "elastic); CKPT_MEM_FLUSH=1 (flush mode: write the newest memory snapshot into --ckpt-dir\n"
    "when it is newer than the newest there, then exit); OPENBLAS_NUM_THREADS/OPENBLAS_CORETYPE\n"
    "(pin them for bit-identical runs); CKPT_LOG_LEVEL=error|warn|info|debug.\n"
    "Exit status: 0 success, 1 runtime failure, 2 usage or configuration error (including an\n"
    "unusable or locked --ckpt-dir, or later snapshots there than the step this run starts from).\n";

static int parse_int(const char *flag, const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "train: %s: '%s' is not an integer in [%ld, %ld]\n", flag, s, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_float(const char *flag, const char *s, double lo, double hi, float *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || end == s || !(v >= lo && v <= hi)) {
        fprintf(stderr, "train: %s: '%s' is not a number in [%g, %g]\n", flag, s, lo, hi);
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* A byte count: digits with an optional suffix K, M, G or T in either case (powers of 1024;
 * "KiB", "MB", "k" are accepted alike), at least 1, nothing before or after (no blanks: strtoull
 * would skip leading ones, so they are refused here like trailing ones). Returns 0, or -1
 * after printing one line. */
static int parse_bytes(const char *flag, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned shift = 0;
    if (end != s && *end) {
        const char *u = "KMGT", *k = strchr(u, *end >= 'a' ? *end - 32 : *end);
        if (k && *k) {
            shift = 10u * (unsigned)(k - u + 1);
            end++;
            if (*end == 'i') end++;
            if (*end == 'B') end++;
        }
    }
    if (errno || *end || end == s || s[0] < '0' || s[0] > '9' || v == 0 ||
        (shift && v > (UINT64_MAX >> shift))) {
        fprintf(stderr, "train: %s: '%s' is not a byte count of at least 1 (digits with an "
                "optional K, M, G or T suffix, either case; no blanks)\n", flag, s);
        return -1;
    }
    *out = (uint64_t)v << shift;
    return 0;
}

int train_parse_args(int argc, char **argv, options *o)
{
    enum {
        O_DATA = 256, O_VAL, O_VOCAB, O_NLAYER, O_NEMBD, O_NHEAD, O_SEQ, O_MB, O_GA, O_STEPS,
        O_LR, O_MINLR, O_WARM, O_WD, O_CLIP, O_SEED, O_EVAL, O_VALS, O_LOG, O_CKDIR, O_CKEVERY,
        O_RESUME, O_RUNID, O_ZLEVEL, O_SHUFFLE, O_NOSHUFFLE, O_CHUNK, O_NODIRECT, O_NOCOMP, O_SNTHREADS,
        O_POLICY, O_KEEPLAST, O_KEEPEVERY, O_OVERLAP, O_GB, O_ZERO, O_CONFIG, O_CTIMEOUT, O_SLOG,
        O_JTIMEOUT, O_FRESH, O_TBDIR, O_S3, O_S3SIG, O_S3KEEP, O_S3PART, O_S3BACKLOG, O_S3TIMEOUT,
        O_S3SNAPTIMEOUT, O_S3LAG, O_S3DRAIN, O_S3ATTEMPTS, O_MEMEVERY, O_MEMBUDGET, O_MEMMODE, O_DEVICE,
        O_DTYPE, O_REDUCE
    };
    static const struct option lo[] = {
        {"data", required_argument, 0, O_DATA}, {"val-data", required_argument, 0, O_VAL},
        {"vocab", required_argument, 0, O_VOCAB}, {"n-layer", required_argument, 0, O_NLAYER},
        {"n-embd", required_argument, 0, O_NEMBD}, {"n-head", required_argument, 0, O_NHEAD},
        {"seq-len", required_argument, 0, O_SEQ}, {"micro-batch", required_argument, 0, O_MB},
        {"grad-accum", required_argument, 0, O_GA}, {"steps", required_argument, 0, O_STEPS},
        {"lr", required_argument, 0, O_LR}, {"min-lr-ratio", required_argument, 0, O_MINLR},
        {"warmup", required_argument, 0, O_WARM}, {"weight-decay", required_argument, 0, O_WD},
        {"grad-clip", required_argument, 0, O_CLIP}, {"seed", required_argument, 0, O_SEED},
        {"eval-every", required_argument, 0, O_EVAL}, {"val-samples", required_argument, 0, O_VALS},
        {"log-every", required_argument, 0, O_LOG}, {"ckpt-dir", required_argument, 0, O_CKDIR},
        {"ckpt-every", required_argument, 0, O_CKEVERY}, {"resume", required_argument, 0, O_RESUME},
        {"run-id", required_argument, 0, O_RUNID}, {"zstd-level", required_argument, 0, O_ZLEVEL},
        {"shuffle", no_argument, 0, O_SHUFFLE}, {"no-shuffle", no_argument, 0, O_NOSHUFFLE},
        {"chunk-mib", required_argument, 0, O_CHUNK},
        {"no-direct-io", no_argument, 0, O_NODIRECT}, {"no-compress", no_argument, 0, O_NOCOMP},
        {"snapshot-threads", required_argument, 0, O_SNTHREADS},
        {"snapshot-policy", required_argument, 0, O_POLICY},
        {"keep-last", required_argument, 0, O_KEEPLAST},
        {"keep-every", required_argument, 0, O_KEEPEVERY},
        {"snapshot-overlap", no_argument, 0, O_OVERLAP}, {"help", no_argument, 0, 'h'},
        {"global-batch", required_argument, 0, O_GB}, {"zero-stage", required_argument, 0, O_ZERO},
        {"config", required_argument, 0, O_CONFIG}, {"comm-timeout", required_argument, 0, O_CTIMEOUT},
        {"sample-log", required_argument, 0, O_SLOG},
        {"join-timeout", required_argument, 0, O_JTIMEOUT},
        {"allow-fresh-start", no_argument, 0, O_FRESH},
        {"tensorboard-dir", required_argument, 0, O_TBDIR},
        {"s3", required_argument, 0, O_S3}, {"s3-signature", required_argument, 0, O_S3SIG},
        {"s3-keep-last", required_argument, 0, O_S3KEEP}, {"s3-part-mib", required_argument, 0, O_S3PART},
        {"s3-backlog", required_argument, 0, O_S3BACKLOG}, {"s3-timeout", required_argument, 0, O_S3TIMEOUT},
        {"s3-snapshot-timeout", required_argument, 0, O_S3SNAPTIMEOUT},
        {"s3-lag-warn", required_argument, 0, O_S3LAG}, {"s3-drain-timeout", required_argument, 0, O_S3DRAIN},
        {"s3-attempts", required_argument, 0, O_S3ATTEMPTS},
        {"mem-snapshot-every", required_argument, 0, O_MEMEVERY},
        {"mem-budget", required_argument, 0, O_MEMBUDGET},
        {"mem-snapshot-mode", required_argument, 0, O_MEMMODE},
        {"device", required_argument, 0, O_DEVICE}, {"dtype", required_argument, 0, O_DTYPE},
        {"reduce", required_argument, 0, O_REDUCE},
        {0, 0, 0, 0}};
    int c, v = 0, chunk_mib = 4;
    const char *s3_flag = NULL; /* an --s3-* option given, for the check that --s3 is */
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_DATA: o->data = optarg; break;
        case O_VAL: o->val_data = optarg; break;
        case O_VOCAB: bad = parse_int("--vocab", optarg, 2, 65536, &o->model.vocab); break;
        case O_NLAYER: bad = parse_int("--n-layer", optarg, 1, 256, &o->model.n_layer); break;
        case O_NEMBD: bad = parse_int("--n-embd", optarg, 1, 65536, &o->model.n_embd); break;
        case O_NHEAD: bad = parse_int("--n-head", optarg, 1, 256, &o->model.n_head); break;
        case O_SEQ: bad = parse_int("--seq-len", optarg, 1, 8192, &o->model.seq_len); break;
        case O_MB: bad = parse_int("--micro-batch", optarg, 1, 65536, &o->micro_batch); break;
        case O_GA:
            bad = parse_int("--grad-accum", optarg, 1, 65536, &o->grad_accum);
            o->grad_accum_set = o->cli_ga = 1;
            if (!o->cli_gb) o->global_batch = 0; /* overrides the config's train_batch_size */
            o->cfg_ga = 0;
            break;
        case O_GB:
            bad = parse_int("--global-batch", optarg, 1, 1 << 24, &o->global_batch);
            o->cli_gb = 1;
            if (!o->cli_ga) o->grad_accum_set = 0;
            o->cfg_ga = 0;
            break;
        case O_ZERO: bad = parse_int("--zero-stage", optarg, 0, 3, &o->zero_stage); break;
        case O_CONFIG: break; /* read before the flags (train_read_config) */
        case O_DEVICE: {
            train_device_kind kind;
            int ord;
            if (train_device_parse(optarg, &kind, &ord) < 0) {
                fprintf(stderr, "train: --device: '%s' is not cpu, cuda or cuda:N\n", optarg);
                bad = 1;
            }
            o->device = optarg;
            break;
        }
        case O_DTYPE:
            if (!strcmp(optarg, "fp32")) o->bf16 = 0;
            else if (!strcmp(optarg, "bf16")) o->bf16 = 1;
            else {
                fprintf(stderr, "train: --dtype: '%s' is not fp32 or bf16\n", optarg);
                bad = 1;
            }
            break;
        case O_REDUCE:
            if (!strcmp(optarg, "tree")) o->reduce_ring = 0;
            else if (!strcmp(optarg, "ring")) o->reduce_ring = 1;
            else {
                fprintf(stderr, "train: --reduce: '%s' is not tree or ring\n", optarg);
                bad = 1;
            }
            break;
        case O_SLOG: o->sample_log = optarg; break;
        case O_JTIMEOUT: {
            float t = 0;
            bad = parse_float("--join-timeout", optarg, 1, 86400, &t);
            o->join_timeout = t;
            break;
        }
        case O_CTIMEOUT: {
            float t = 0;
            bad = parse_float("--comm-timeout", optarg, 0.1, 86400, &t);
            o->comm_timeout = t;
            break;
        }
        case O_STEPS: bad = parse_int("--steps", optarg, 1, INT_MAX, &o->steps); break;
        case O_LR: bad = parse_float("--lr", optarg, 1e-12, 10, &o->adam.lr); break;
        case O_MINLR: bad = parse_float("--min-lr-ratio", optarg, 0, 1, &o->adam.min_lr_ratio); break;
        case O_WARM: bad = parse_int("--warmup", optarg, 0, INT_MAX, &o->adam.warmup); break;
        case O_WD: bad = parse_float("--weight-decay", optarg, 0, 10, &o->adam.weight_decay); break;
        case O_CLIP: bad = parse_float("--grad-clip", optarg, 0, 1e9, &o->adam.grad_clip); break;
        case O_SEED:
            bad = parse_int("--seed", optarg, 0, INT_MAX, &v);
            o->seed = (uint64_t)v;
            break;
        case O_EVAL: bad = parse_int("--eval-every", optarg, 0, INT_MAX, &o->eval_every); break;
        case O_VALS: bad = parse_int("--val-samples", optarg, 1, 1 << 20, &o->val_samples); break;
        case O_LOG: bad = parse_int("--log-every", optarg, 1, INT_MAX, &o->log_every); break;
        case O_CKDIR: o->ckpt_dir = optarg; break;
        case O_CKEVERY: bad = parse_int("--ckpt-every", optarg, 0, INT_MAX, &o->ckpt_every); break;
        case O_RESUME: o->resume = optarg; break;
        case O_RUNID: o->run_id = optarg; break;
        case O_FRESH: o->allow_fresh_start = 1; break;
        case O_TBDIR:
            if (!*optarg) {
                fprintf(stderr, "train: --tensorboard-dir: an empty folder name\n");
                bad = 1;
            }
            o->tensorboard_dir = optarg;
            break;
        case O_ZLEVEL: bad = parse_int("--zstd-level", optarg, -7, 19, &o->zstd_level); break;
        case O_SHUFFLE: o->filter = CKPT_FILTER_SHUFFLE; break; /* the default; kept for scripts */
        case O_NOSHUFFLE: o->filter = CKPT_FILTER_NONE; break;
        case O_CHUNK: bad = parse_int("--chunk-mib", optarg, 1, 1024, &chunk_mib); break;
        case O_NODIRECT: o->direct_io = 0; break;
        case O_NOCOMP: o->compress = 0; break;
        case O_SNTHREADS: bad = parse_int("--snapshot-threads", optarg, 1, 64, &o->snapshot_threads); break;
        case O_POLICY:
            if (!strcmp(optarg, "wait")) o->policy = CKPT_POLICY_WAIT;
            else if (!strcmp(optarg, "skip")) o->policy = CKPT_POLICY_SKIP;
            else {
                fprintf(stderr, "train: --snapshot-policy: '%s' is not wait or skip\n", optarg);
                bad = 1;
            }
            break;
        case O_KEEPLAST:
            bad = parse_int("--keep-last", optarg, 0, INT_MAX, &v);
            o->keep_last = (unsigned)v;
            break;
        case O_KEEPEVERY: bad = parse_int("--keep-every", optarg, 0, INT_MAX, &o->keep_every); break;
        case O_OVERLAP:
            o->overlap = 1;
            LOG_W("train", "--snapshot-overlap has no effect: snapshot copies are asynchronous "
                  "and the persist follows them chunk by chunk anyway");
            break;
        case O_S3: o->s3 = optarg; break;
        case O_S3SIG: s3_flag = "--s3-signature";
            if (!strcmp(optarg, "v4")) o->s3_signature = 4;
            else if (!strcmp(optarg, "v2")) o->s3_signature = 2;
            else {
                fprintf(stderr, "train: --s3-signature: '%s' is not v4 or v2\n", optarg);
                bad = 1;
            }
            break;
        case O_S3KEEP:
            s3_flag = "--s3-keep-last";
            bad = parse_int("--s3-keep-last", optarg, 0, INT_MAX, &v);
            o->s3_keep_last = (unsigned)v;
            break;
        case O_S3PART:
            s3_flag = "--s3-part-mib";
            bad = parse_int("--s3-part-mib", optarg, 1, 4096, &v);
            o->s3_part_bytes = (uint64_t)v << 20;
            break;
        case O_S3ATTEMPTS:
            s3_flag = "--s3-attempts";
            bad = parse_int("--s3-attempts", optarg, 1, 100, &v);
            o->s3_attempts = (unsigned)v;
            break;
        case O_S3BACKLOG:
            s3_flag = "--s3-backlog";
            bad = parse_int("--s3-backlog", optarg, 1, 64, &v);
            o->s3_backlog = (unsigned)v;
            break;
        case O_S3TIMEOUT: case O_S3SNAPTIMEOUT: case O_S3LAG: case O_S3DRAIN: {
            float t = 0;
            const char *flag = c == O_S3TIMEOUT ? "--s3-timeout" : c == O_S3SNAPTIMEOUT ?
                               "--s3-snapshot-timeout" : c == O_S3LAG ? "--s3-lag-warn" :
                               "--s3-drain-timeout";
            s3_flag = flag;
            bad = parse_float(flag, optarg, c == O_S3DRAIN ? 0 : 0.1, 1e7, &t);
            if (c == O_S3TIMEOUT) o->s3_timeout = t;
            else if (c == O_S3SNAPTIMEOUT) o->s3_snapshot_timeout = t;
            else if (c == O_S3LAG) o->s3_lag_warn = t;
            else o->s3_drain_timeout = t;
            break;
        }
        case O_MEMEVERY:
            bad = parse_int("--mem-snapshot-every", optarg, 0, INT_MAX, &o->mem_every);
            break;
        case O_MEMBUDGET: bad = parse_bytes("--mem-budget", optarg, &o->mem_budget); break;
        case O_MEMMODE:
            if (!strcmp(optarg, "sync")) o->mem_async = 0;
            else if (!strcmp(optarg, "async")) o->mem_async = 1;
            else {
                fprintf(stderr, "train: --mem-snapshot-mode: '%s' is not sync or async\n", optarg);
                bad = 1;
            }
            break;
        case 'h':
            fputs(usage_text, stdout);
            fputs(usage_text_dev, stdout);
            fputs(usage_text2, stdout);
            fputs(usage_text_s3, stdout);
            fputs(usage_text_mem, stdout);
            fputs(usage_text3, stdout);
            exit(0);
        default: bad = 1; fputs("train: see --help\n", stderr); break;
        }
        if (bad) return -1;
    }
    if (optind < argc) {
        fprintf(stderr, "train: unexpected argument '%s' (see --help)\n", argv[optind]);
        return -1;
    }
    o->chunk_bytes = (uint64_t)chunk_mib << 20;
    char why[160];
    if (!o->data) {
        fprintf(stderr, "train: --data GLOB is required (see --help)\n");
        return -1;
    }
    if (train_model_config_check(&o->model, why, sizeof why) < 0) {
        fprintf(stderr, "train: bad model configuration: %s\n", why);
        return -1;
    }
    if (o->resume && strcmp(o->resume, "auto") == 0 && !o->ckpt_dir) {
        fprintf(stderr, "train: --resume auto needs --ckpt-dir\n");
        return -1;
    }
    if (o->ckpt_every > 0 && !o->ckpt_dir) {
        fprintf(stderr, "train: --ckpt-every needs --ckpt-dir\n");
        return -1;
    }
    if (!o->s3 && s3_flag) {
        fprintf(stderr, "train: %s needs --s3 s3://BUCKET/PREFIX\n", s3_flag);
        return -1;
    }
    if (o->s3) {
        char bucket[64], prefix[1024], w[200];
        if (objstore_parse_url(o->s3, bucket, sizeof bucket, prefix, sizeof prefix, w, sizeof w) < 0) {
            fprintf(stderr, "train: --s3 %s: %s\n", o->s3, w);
            return -1;
        }
        if (!o->ckpt_dir) {
            fprintf(stderr, "train: --s3 needs --ckpt-dir (snapshots are uploaded once committed "
                    "there, and restored through it)\n");
            return -1;
        }
    }
    if (o->cli_gb && o->cli_ga) {
        fprintf(stderr, "train: give --global-batch or --grad-accum, not both (the global batch "
                "fixes the accumulation per rank)\n");
        return -1;
    }
    if (o->run_id && !(strlen(o->run_id) >= 1 && strlen(o->run_id) <= 63 &&
                       strspn(o->run_id, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789_.-") == strlen(o->run_id))) {
        fprintf(stderr, "train: --run-id must be 1-63 characters of [A-Za-z0-9_.-]\n");
        return -1;
    }
    /* every rank works with one absolute form of the folders: rank 0 sends the snapshot it
     * chose as a path, which another rank started in another folder must find too */
    static char ckpt_abs[CKPT_PATH_MAX], resume_abs[CKPT_PATH_MAX];
    int rc;
    if (o->ckpt_dir && (rc = store_canonical_path(o->ckpt_dir, ckpt_abs, sizeof ckpt_abs)) < 0) {
        fprintf(stderr, "train: --ckpt-dir %s: %s\n", o->ckpt_dir, strerror(-rc));
        return -1;
    }
    if (o->ckpt_dir) o->ckpt_dir = ckpt_abs;
    /* room for the names below it (temp folders with the run id, shard files): a longer
     * folder would fail only when the engine starts, as if the environment had failed */
    if (o->ckpt_dir && strlen(o->ckpt_dir) > CKPT_DIR_MAX) {
        fprintf(stderr, "train: --ckpt-dir: the folder's absolute path is %zu bytes, more than "
                "the %d a snapshot folder may have\n", strlen(o->ckpt_dir), CKPT_DIR_MAX);
        return -1;
    }
    if (o->resume && strcmp(o->resume, "auto") != 0 && strcmp(o->resume, "none") != 0 &&
        !ckpt_is_s3_url(o->resume) && store_canonical_path(o->resume, resume_abs, sizeof resume_abs) == 0)
        o->resume = resume_abs; /* an error is reported by the resume, naming the path */
    o->adam.total_steps = o->steps;
    return 0;
}

/* Read --config FILE (before the flags, which override it). Returns 0 or -1 (printed). */
int train_read_config(int argc, char **argv, options *o, train_ds_config *dc)
{
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "--config") && i + 1 < argc) path = argv[++i];
        else if (!strncmp(argv[i], "--config=", 9)) path = argv[i] + 9;
    }
    if (!path) return 0;
    o->config = path;
    char why[600], unknown[1024];
    int rc = train_ds_config_load(path, dc, why, sizeof why, unknown, sizeof unknown);
    if (rc < 0) {
        fprintf(stderr, "train: --config %s\n", why[0] ? why : strerror(-rc));
        return -1;
    }
    if (unknown[0]) LOG_W(TAG, "--config %s: keys not used: %s", path, unknown);
    if (dc->has_train_batch_size) {
        o->global_batch = dc->train_batch_size;
        if (dc->has_grad_accum) o->cfg_ga = dc->grad_accum;
    } else if (dc->has_grad_accum) {
        o->grad_accum = dc->grad_accum;
        o->grad_accum_set = 1;
    }
    if (dc->has_micro_batch) o->micro_batch = dc->micro_batch;
    if (dc->has_zero_stage) o->zero_stage = dc->zero_stage;
    if (dc->has_lr) o->adam.lr = dc->lr;
    if (dc->has_betas) {
        o->adam.beta1 = dc->beta1;
        o->adam.beta2 = dc->beta2;
    }
    if (dc->has_eps) o->adam.eps = dc->eps;
    if (dc->has_weight_decay) o->adam.weight_decay = dc->weight_decay;
    if (dc->has_warmup) o->adam.warmup = dc->warmup;
    if (dc->has_total_steps) o->steps = dc->total_steps;
    if (dc->has_min_lr_ratio) o->adam.min_lr_ratio = dc->min_lr_ratio;
    if (dc->has_grad_clip) o->adam.grad_clip = dc->grad_clip;
    if (dc->has_seed) o->seed = (uint64_t)dc->seed;
    if (dc->has_bf16) o->bf16 = dc->bf16;
    if (dc->has_log_every) o->log_every = dc->log_every;
    if (dc->has_ckpt_dir) o->ckpt_dir = dc->ckpt_dir;
    if (dc->has_ckpt_every) o->ckpt_every = dc->ckpt_every;
    if (dc->has_keep_last) o->keep_last = (unsigned)dc->keep_last;
    if (dc->has_keep_every) o->keep_every = dc->keep_every;
    if (dc->has_zstd_level) o->zstd_level = dc->zstd_level;
    if (dc->has_compress) o->compress = dc->compress;
    if (dc->has_shuffle) o->filter = dc->shuffle ? CKPT_FILTER_SHUFFLE : CKPT_FILTER_NONE;
    if (dc->has_snapshot_policy) o->policy = dc->snapshot_policy;
    if (dc->has_tensorboard_enabled && dc->tensorboard_enabled) {
        /* output_path/job_name as DeepSpeed's TensorBoardMonitor joins them (os.path.join) */
        static char tb_dir[sizeof dc->tensorboard_output_path + sizeof dc->tensorboard_job_name + 1];
        const char *base = dc->has_tensorboard_output_path ? dc->tensorboard_output_path : "";
        const char *job = dc->has_tensorboard_job_name ? dc->tensorboard_job_name : "DeepSpeedJobName";
        size_t bl = strlen(base);
        if (job[0] == '/' || bl == 0) snprintf(tb_dir, sizeof tb_dir, "%s", job);
        else snprintf(tb_dir, sizeof tb_dir, "%s%s%s", base, base[bl - 1] == '/' ? "" : "/", job);
        o->tensorboard_dir = tb_dir;
    }
    return 0;
}
