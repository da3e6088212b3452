/* train: GPT-2 style decoder on the CPU backend with crash-safe snapshots and --resume.
 * Exit status: 0 success, 1 runtime failure, 2 usage or configuration error. */
#include "clock.h"
#include "ckpt.h"
#include "comm.h"
#include "config.h"
#include "data.h"
#include "ds_config.h"
#include "log.h"
#include "model.h"
#include "optim.h"
#include "prefetch.h"
#include "store.h"
#include "vote.h"

#include <cblas.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define TAG "train"

/* OpenBLAS's own call (cblas.h of libopenblas); pins GEMMs to one thread per process. */
void openblas_set_num_threads(int num_threads);

typedef struct options {
    const char *data, *val_data, *ckpt_dir, *resume, *run_id, *config, *sample_log;
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
} options;

static const char usage_text[] =
    "usage: train --data GLOB [options]\n"
    "\n"
    "Trains a GPT-2 style decoder on llm.c token shards (CPU backend), with snapshots.\n"
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
    "                        scheduler, gradient_clipping, checkpoint{dir,every,keep_last,...});\n"
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
    ;
static const char usage_text2[] =
    "Snapshots:\n"
    "  --ckpt-dir DIR        snapshot folder\n"
    "  --ckpt-every N        snapshot every N steps, and at the last step (default 0: none);\n"
    "                        taken asynchronously: training waits only for a copy\n"
    "  --resume MODE         none (default), auto (newest verified snapshot in --ckpt-dir,\n"
    "                        fresh start when there is none), or a snapshot folder PATH\n"
    "  --run-id ID           lineage id recorded in snapshots (default: random, kept on resume);\n"
    "                        given, --resume auto skips snapshots of other run ids\n"
    "  --keep-last K         keep the newest K snapshots of this run, 0 = all (default 0)\n"
    "  --keep-every N        also keep snapshots whose step is a multiple of N (default 0)\n"
    "  --snapshot-policy P   when a snapshot is due while the previous one still persists:\n"
    "                        wait (default) or skip (counted and logged)\n"
    "  --snapshot-threads N  compression threads of the background persist (default 2)\n"
    "  --snapshot-overlap    start persisting while the state is still being copied: durable\n"
    "                        sooner, but the copy that training waits for takes longer\n"
    "  --zstd-level N        compression level (default 1)\n"
    "  --no-compress         store chunks raw\n"
    "  --no-shuffle          no byte-shuffle filter before compression (by default the bytes\n"
    "                        of each float are grouped: about 1.2x instead of 1.09x on Adam\n"
    "                        state)\n"
    "  --chunk-mib N         raw MiB per chunk (default 4)\n"
    "  --no-direct-io        buffered writes instead of O_DIRECT\n"
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
    "ELASTIC_RESTART_COUNT (generation); OPENBLAS_NUM_THREADS/OPENBLAS_CORETYPE (pin them for\n"
    "bit-identical runs); CKPT_LOG_LEVEL=error|warn|info|debug.\n"
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

static int parse_args(int argc, char **argv, options *o)
{
    enum {
        O_DATA = 256, O_VAL, O_VOCAB, O_NLAYER, O_NEMBD, O_NHEAD, O_SEQ, O_MB, O_GA, O_STEPS,
        O_LR, O_MINLR, O_WARM, O_WD, O_CLIP, O_SEED, O_EVAL, O_VALS, O_LOG, O_CKDIR, O_CKEVERY,
        O_RESUME, O_RUNID, O_ZLEVEL, O_SHUFFLE, O_NOSHUFFLE, O_CHUNK, O_NODIRECT, O_NOCOMP, O_SNTHREADS,
        O_POLICY, O_KEEPLAST, O_KEEPEVERY, O_OVERLAP, O_GB, O_ZERO, O_CONFIG, O_CTIMEOUT, O_SLOG,
        O_JTIMEOUT
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
        {0, 0, 0, 0}};
    int c, v, chunk_mib = 4;
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
        case O_CONFIG: break; /* read before the flags (read_config) */
        case O_SLOG: o->sample_log = optarg; break;
        case O_JTIMEOUT: {
            float t;
            bad = parse_float("--join-timeout", optarg, 1, 86400, &t);
            o->join_timeout = t;
            break;
        }
        case O_CTIMEOUT: {
            float t;
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
        case O_OVERLAP: o->overlap = 1; break;
        case 'h':
            fputs(usage_text, stdout);
            fputs(usage_text2, stdout);
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
    o->adam.total_steps = o->steps;
    return 0;
}

/* Read --config FILE (before the flags, which override it). Returns 0 or -1 (printed). */
static int read_config(int argc, char **argv, options *o, train_ds_config *dc)
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
    if (dc->has_log_every) o->log_every = dc->log_every;
    if (dc->has_ckpt_dir) o->ckpt_dir = dc->ckpt_dir;
    if (dc->has_ckpt_every) o->ckpt_every = dc->ckpt_every;
    if (dc->has_keep_last) o->keep_last = (unsigned)dc->keep_last;
    if (dc->has_keep_every) o->keep_every = dc->keep_every;
    if (dc->has_zstd_level) o->zstd_level = dc->zstd_level;
    if (dc->has_compress) o->compress = dc->compress;
    if (dc->has_shuffle) o->filter = dc->shuffle ? CKPT_FILTER_SHUFFLE : CKPT_FILTER_NONE;
    if (dc->has_snapshot_policy) o->policy = dc->snapshot_policy;
    return 0;
}

/* ------------------------------------------------------------------ signals */

/* SIGTERM/SIGINT (a scheduler's preemption notice, Ctrl-C): finish the step in progress, take
 * a final snapshot, print the final line and exit 128 + signal. */
static volatile sig_atomic_t g_stop_signal;

static void on_stop_signal(int sig) { g_stop_signal = sig; }

static void install_stop_handlers(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

/* ------------------------------------------------------------------ state */

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
    float *m, *v;            /* (ohi - olo) Adam moments */
    float *gsum;             /* (np) this rank's tree sum of its micro-batch gradients */
    float *gshard;           /* (hi - lo) reduce-scattered gradient (stages 2, 3) */
    double *blocks;          /* (nb) squared norms of gradient blocks */
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
} state;

static void digest_hex(const float *p, size_t n, char out[33])
{
    XXH128_hash_t h = XXH3_128bits(p, n * sizeof(float));
    snprintf(out, 33, "%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
}

static void comm_failed(const state *s, const char *what, int rc);

/* All-gather of one record of len bytes per rank: the caller has put its own record at
 * all + rank x len; on return all holds every rank's, in rank order (W x len bytes).
 * Uses s->counts. Returns 0 or the collective's error (not logged here). */
static int gather_records(state *s, void *all, size_t len)
{
    for (int r = 0; r < s->world; r++) s->counts[r] = len;
    return train_comm_all_gather(s->comm, (char *)all + (size_t)s->rank * len, all, s->counts);
}

/* Digest of x[lo, hi) (whole TRAIN_BLOCK blocks; x points at element lo) that does not depend
 * on how the flat space is split over ranks: the sum, mod 2^64, of XXH3-64 of each block
 * seeded with the block's index. Ranks add their parts (block_digest_sum); the total is that
 * of the whole buffer. Used for the Adam moments, which no other digest covers as a whole: a
 * shard restored at the wrong offset passes every chunk checksum but not this. */
static uint64_t block_digest(const float *x, size_t lo, size_t hi)
{
    uint64_t sum = 0;
    for (size_t b = lo; b < hi; b += TRAIN_BLOCK)
        sum += XXH3_64bits_withSeed(x + (b - lo), TRAIN_BLOCK * sizeof(float), b / TRAIN_BLOCK);
    return sum;
}

/* This rank's parts of the digests of adam_m and adam_v over its shard [lo, hi), summed over
 * all ranks (collective when W > 1). Returns 0 or the collective's error. */
static int moments_digest(state *s, uint64_t out[2])
{
    uint64_t mine[2] = {block_digest(s->m + (s->lo - s->olo), s->lo, s->hi),
                        block_digest(s->v + (s->lo - s->olo), s->lo, s->hi)};
    if (s->world == 1) {
        out[0] = mine[0];
        out[1] = mine[1];
        return 0;
    }
    uint64_t *all = calloc((size_t)s->world * 2, sizeof(uint64_t));
    if (!all) return -ENOMEM;
    memcpy(all + 2 * (size_t)s->rank, mine, sizeof mine);
    int rc = gather_records(s, all, sizeof mine);
    if (rc < 0) comm_failed(s, "all-gather of the moments digest", rc);
    out[0] = out[1] = 0;
    for (int r = 0; r < s->world && rc == 0; r++) {
        out[0] += all[2 * (size_t)r];
        out[1] += all[2 * (size_t)r + 1];
    }
    free(all);
    return rc;
}

static void make_config_hash(const state *s, char out[17])
{
    const options *o = s->o;
    char buf[512];
    int n = snprintf(buf, sizeof buf,
                     "vocab=%d;seq_len=%d;n_layer=%d;n_embd=%d;n_head=%d;seed=%" PRIu64
                     ";global_batch=%d",
                     o->model.vocab, o->model.seq_len, o->model.n_layer, o->model.n_embd,
                     o->model.n_head, o->seed, s->global_batch);
    uint64_t h = XXH3_64bits(buf, (size_t)n);
    snprintf(out, 17, "%016" PRIx64, h);
}

static void make_run_id(char out[64])
{
    uint64_t r = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &r, sizeof r) != (ssize_t)sizeof r) r = 0;
        close(fd);
    }
    r ^= (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    snprintf(out, 64, "run-%016" PRIx64, r);
}

/* A collective failed: one line naming the rank, the step and the reason. */
static void comm_failed(const state *s, const char *what, int rc)
{
    LOG_E(TAG, "rank %d, step %" PRId64 ": %s failed: %s%s", s->rank, s->step + 1, what,
          strerror(-rc),
          rc == -ECONNRESET || rc == -EPIPE ? " (a rank died or left the group)"
          : rc == -ETIMEDOUT ? " (a rank stopped answering; see --comm-timeout)" : "");
}

/* All-gather of every rank's params shard into the full buffer (stages 1-3). */
static int gather_params(state *s)
{
    if (s->world == 1 || s->o->zero_stage == 0) return 0;
    float *p = train_model_params(s->model);
    int rc = train_comm_all_gather(s->comm, p + s->lo, p, s->shard_bytes);
    if (rc < 0) comm_failed(s, "all-gather of parameters", rc);
    return rc;
}

/* ZeRO-3 hook of the model: before layer group [lo, hi) (elements) is used in forward or
 * backward, gather it from the ranks that own its pieces. */
static int gather_range_hook(void *ctx, size_t lo, size_t hi)
{
    state *s = ctx;
    size_t before = 0;
    float *p = train_model_params(s->model);
    for (int r = 0; r < s->world; r++) {
        size_t a = before, b = before + s->shard_el[r];
        size_t x = a > lo ? a : lo, y = b < hi ? b : hi;
        s->counts[r] = y > x ? (y - x) * sizeof(float) : 0;
        before = b;
    }
    size_t mine = s->lo > lo ? s->lo : lo;
    int rc = train_comm_all_gather(s->comm, p + mine, p + lo, s->counts);
    if (rc < 0) comm_failed(s, "layer all-gather (ZeRO-3)", rc);
    return rc;
}

/* Validation loss: the first val_samples samples in file order, in chunks of micro_batch;
 * the chunks are split over the ranks in contiguous runs and their sums added in chunk order,
 * so the result has the same bits at every world size. NaN on failure. */
static double eval_val(state *s)
{
    if (!s->val) return NAN;
    const int T = s->o->model.seq_len, b = s->o->micro_batch;
    uint64_t total = (uint64_t)s->o->val_samples;
    if (total > train_dataset_num_samples(s->val)) total = train_dataset_num_samples(s->val);
    size_t nchunks = (size_t)((total + (uint64_t)b - 1) / (uint64_t)b);
    double *sums = calloc(nchunks ? nchunks : 1, sizeof(double));
    if (!sums) return NAN;
    size_t c0 = nchunks * (size_t)s->rank / (size_t)s->world;
    size_t c1 = nchunks * (size_t)(s->rank + 1) / (size_t)s->world;
    int failed = 0;
    /* ZeRO-3: gather every parameter once, and detach the per-layer hook meanwhile: the ranks
     * evaluate different numbers of chunks, so per-layer gathers (collectives) would not
     * match up */
    int zero3 = s->o->zero_stage == 3 && s->world > 1;
    if (zero3) {
        if (gather_range_hook(s, 0, s->np) < 0) failed = 1;
        train_model_set_param_hook(s->model, NULL, NULL);
    }
    for (size_t c = c0; c < c1 && !failed; c++) {
        uint64_t i = (uint64_t)c * (uint64_t)b;
        int n = (int)(total - i < (uint64_t)b ? total - i : (uint64_t)b);
        for (int k = 0; k < n; k++) {
            char why[512];
            if (train_dataset_sample(s->val, i + (uint64_t)k, s->inputs + (size_t)k * T,
                                     s->targets + (size_t)k * T, why, sizeof why) < 0) {
                LOG_E(TAG, "validation data: %s", why);
                sums[c] = NAN;
                break;
            }
        }
        if (!isnan(sums[c])) sums[c] = train_model_forward(s->model, s->inputs, s->targets, n) * n;
    }
    if (zero3) train_model_set_param_hook(s->model, gather_range_hook, s);
    double sum = NAN;
    if (!failed) {
        for (int r = 0; r < s->world; r++)
            s->counts[r] = (nchunks * (size_t)(r + 1) / (size_t)s->world -
                            nchunks * (size_t)r / (size_t)s->world) * sizeof(double);
        int rc = s->world > 1 ? train_comm_all_gather(s->comm, sums + c0, sums, s->counts) : 0;
        if (rc < 0) comm_failed(s, "all-gather of validation losses", rc);
        else {
            sum = 0.0;
            for (size_t c = 0; c < nchunks; c++) sum += sums[c];
        }
    }
    free(sums);
    return sum / (double)total;
}

/* ------------------------------------------------------------------ snapshots */

/* The shortest decimal that reads back as the same float: 0.9f is recorded as 0.9, not as
 * 0.8999999761581421. */
static double f2d(float f)
{
    char buf[32] = "0";
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if ((float)strtod(buf, NULL) == f) break;
    }
    return strtod(buf, NULL);
}

static json_t *trainer_record(state *s)
{
    const options *o = s->o;
    size_t nt;
    const train_tensor *t = train_model_tensors(s->model, &nt);
    json_t *tensors = json_array();
    for (size_t i = 0; i < nt; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < t[i].ndim; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
        json_array_append_new(tensors, json_pack("{s:s, s:o, s:I, s:b}", "name", t[i].name, "shape",
                                                 shape, "offset", (json_int_t)t[i].offset, "decay",
                                                 t[i].decay));
    }
    char digest[33], dhash[17], mdig[17], vdig[17];
    digest_hex(train_model_params(s->model), train_model_num_params(s->model), digest);
    snprintf(mdig, sizeof mdig, "%016" PRIx64, s->moments_digest[0]);
    snprintf(vdig, sizeof vdig, "%016" PRIx64, s->moments_digest[1]);
    snprintf(dhash, sizeof dhash, "%016" PRIx64, train_dataset_hash(s->train));
    uint64_t n = train_dataset_num_samples(s->train);
    return json_pack(
        "{s:I, s:{s:i, s:i, s:i, s:i, s:i}, s:s, s:o, s:i, "
        "s:{s:s, s:f, s:f, s:i, s:i, s:f, s:f, s:f, s:f, s:f, s:I}, "
        "s:{s:i, s:i, s:i, s:i, s:i}, s:{s:I, s:I, s:I, s:I, s:I, s:s, s:i}, s:s, s:f, "
        "s:{s:s, s:s}}",
        "step", (json_int_t)s->step, "model", "vocab", o->model.vocab, "seq_len", o->model.seq_len,
        "n_layer", o->model.n_layer, "n_embd", o->model.n_embd, "n_head", o->model.n_head,
        "tensor_buffer", "params", "tensors", tensors, "num_params",
        (int)train_model_num_params(s->model), "optimizer", "type", "adamw", "lr", f2d(o->adam.lr),
        "min_lr_ratio", f2d(o->adam.min_lr_ratio), "warmup", o->adam.warmup, "total_steps",
        o->adam.total_steps, "beta1", f2d(o->adam.beta1), "beta2", f2d(o->adam.beta2), "eps",
        f2d(o->adam.eps), "weight_decay", f2d(o->adam.weight_decay), "grad_clip",
        f2d(o->adam.grad_clip), "t", (json_int_t)s->step, "batch", "micro_batch", o->micro_batch,
        "grad_accum", s->grad_accum, "world_size", s->world, "global_batch", s->global_batch,
        "zero_stage", o->zero_stage,
        "data", "samples_consumed", (json_int_t)s->samples, "epoch", (json_int_t)(s->samples / n),
        "offset_in_epoch", (json_int_t)(s->samples % n), "seed", (json_int_t)o->seed, "num_samples",
        (json_int_t)n, "data_hash", dhash, "files", (int)train_dataset_num_files(s->train),
        "params_digest", digest, "loss", s->last_loss, "moments_digest", "adam_m", mdig, "adam_v",
        vdig);
}

/* Resident memory of this process in KiB (VmRSS), or -1. */
static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) {
            kib = strtol(line + 6, NULL, 10);
            break;
        }
    fclose(f);
    return kib;
}

/* Wait for the persist in flight (at most timeout_s). In a group, check every half second
 * that no peer died meanwhile: a dead rank means no commit decision will ever come, so the
 * vote channel is shut (the persist fails at once) and -ECONNRESET returned. */
static int wait_engine(state *s, double timeout_s)
{
    double end = clock_now_s() + timeout_s;
    for (;;) {
        double left = end - clock_now_s();
        if (s->world == 1) return ckpt_engine_wait(s->engine, left > 0 ? left : 0);
        int rc = ckpt_engine_wait(s->engine, left < 0.5 ? (left > 0 ? left : 0) : 0.5);
        if (rc != -EINPROGRESS || left <= 0.5) return rc;
        if ((rc = train_comm_probe(s->comm)) < 0) {
            LOG_E(TAG, "rank %d, step %" PRId64 ": a rank died while a snapshot persisted; it will "
                  "not be committed", s->rank, s->step);
            train_vote_abort(s->vote);
            return rc;
        }
    }
}

/* Stage a snapshot of the current state; the engine persists it in the background. Every
 * rank stages its shard [lo, hi) of params, adam_m and adam_v (the same layout at every ZeRO
 * stage), so that a restore at any world size is range arithmetic. Collective: the ranks first
 * agree whether a persist is still running anywhere, so that all of them skip or wait alike.
 * Returns 0, or a negative errno (a failed collective is fatal; a failed stage is logged). */
static int take_snapshot(state *s, int last)
{
    if (s->world > 1) {
        uint8_t *busy = calloc((size_t)s->world, 1);
        if (!busy) return -ENOMEM;
        busy[s->rank] = (uint8_t)(ckpt_engine_busy(s->engine) > 0);
        int rc = gather_records(s, busy, 1);
        int any = 0;
        for (int r = 0; r < s->world; r++) any |= busy[r];
        free(busy);
        if (rc < 0) {
            comm_failed(s, "snapshot agreement", rc);
            return rc;
        }
        if (any && s->o->policy == CKPT_POLICY_SKIP && !last) {
            s->skipped++;
            if (s->rank == 0)
                LOG_W(TAG, "snapshot of step %" PRId64 " skipped: the previous one still persists on "
                      "some rank (policy skip)", s->step);
            return 0;
        }
        if (any && (rc = wait_engine(s, 3600.0)) == -ECONNRESET) return rc;
    }
    if (s->o->zero_stage == 3 && s->world > 1) {
        int rc = gather_range_hook(s, 0, s->np); /* the record's params digest */
        if (rc < 0) return rc;
    }
    int dr = moments_digest(s, s->moments_digest);
    if (dr < 0) return dr;
    size_t bytes = s->np * sizeof(float), off = s->lo * sizeof(float);
    size_t sb = (s->hi - s->lo) * sizeof(float);
    ckpt_buffer bufs[3] = {
        {"params", "f32", 4, bytes, off, sb, train_model_params(s->model) + s->lo},
        {"adam_m", "f32", 4, bytes, off, sb, s->m + (s->lo - s->olo)},
        {"adam_v", "f32", 4, bytes, off, sb, s->v + (s->lo - s->olo)},
    };
    json_t *rec = trainer_record(s);
    char *text = rec ? json_dumps(rec, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(rec);
    if (!text) return -ENOMEM;
    double stall = 0;
    int rc = ckpt_engine_stage(s->engine, (uint64_t)s->step, s->run_id, s->config_hash, bufs, 3,
                               text, &stall);
    free(text);
    if (rc < 0) {
        LOG_E(TAG, "snapshot of step %" PRId64 " to %s not taken: %s", s->step, s->o->ckpt_dir,
              strerror(-rc));
        return 0;
    }
    if (rc == 0)
        LOG_I(TAG, "snapshot step %" PRId64 " staged: stall %.1f ms for %.2f MiB; rss %.1f MiB",
              s->step, stall * 1e3, 3.0 * (double)sb / 1048576.0, (double)rss_kib() / 1024.0);
    return 0;
}

static int make_engine(state *s)
{
    const options *o = s->o;
    ckpt_engine_opts eo = CKPT_ENGINE_OPTS_INIT;
    eo.save.dir = o->ckpt_dir;
    eo.save.zstd_level = o->zstd_level;
    eo.save.filter = o->filter;
    eo.save.direct_io = o->direct_io;
    eo.save.chunk_bytes = o->chunk_bytes;
    eo.compress = o->compress;
    eo.threads = (unsigned)o->snapshot_threads;
    eo.policy = o->policy;
    eo.keep_last = s->rank == 0 ? o->keep_last : 0; /* only rank 0 applies retention */
    eo.keep_every = s->rank == 0 ? (uint64_t)o->keep_every : 0;
    eo.reserve_bytes = 3 * (s->hi - s->lo) * sizeof(float);
    eo.overlap = o->overlap;
    eo.group = s->world > 1 ? &s->group : NULL;
    int rc = ckpt_engine_create(&s->engine, &eo);
    if (rc < 0) LOG_E(TAG, "cannot start the snapshot engine for %s: %s", o->ckpt_dir, strerror(-rc));
    return rc;
}

/* Compare the snapshot's model config with ours; list the differing fields in diff. */
static int same_model(const json_t *model, const train_model_config *c, char *diff, size_t len)
{
    struct { const char *k; int v; } f[] = {{"vocab", c->vocab}, {"seq_len", c->seq_len},
                                            {"n_layer", c->n_layer}, {"n_embd", c->n_embd},
                                            {"n_head", c->n_head}};
    size_t off = 0;
    diff[0] = '\0';
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        json_t *x = json_object_get(model, f[i].k);
        long long sv = json_is_integer(x) ? (long long)json_integer_value(x) : -1;
        if (sv != f[i].v && off < len)
            off += (size_t)snprintf(diff + off, len - off, "%s%s (snapshot %lld, now %d)",
                                    off ? ", " : "", f[i].k, sv, f[i].v);
    }
    return diff[0] == '\0';
}

/* Log one warning listing the optimizer and schedule settings that differ from the
 * snapshot's: allowed, but the run no longer reproduces an uninterrupted one. */
static void warn_changed_hparams(const json_t *tr, const options *o)
{
    const json_t *opt = json_object_get(tr, "optimizer");
    struct { const char *k; double now; } f[] = {
        {"lr", o->adam.lr}, {"min_lr_ratio", o->adam.min_lr_ratio}, {"warmup", o->adam.warmup},
        {"total_steps", o->adam.total_steps}, {"beta1", o->adam.beta1}, {"beta2", o->adam.beta2},
        {"eps", o->adam.eps}, {"weight_decay", o->adam.weight_decay},
        {"grad_clip", o->adam.grad_clip}};
    char msg[512];
    size_t off = 0;
    msg[0] = '\0';
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        json_t *x = json_object_get(opt, f[i].k);
        if (!json_is_number(x)) continue;
        double was = json_number_value(x);
        if ((float)was != (float)f[i].now && off < sizeof msg)
            off += (size_t)snprintf(msg + off, sizeof msg - off, "%s%s %g -> %g", off ? ", " : "",
                                    f[i].k, was, f[i].now);
    }
    if (msg[0])
        LOG_W(TAG, "optimizer settings differ from the snapshot's (%s): the run will not match an "
              "uninterrupted one", msg);
}

/* The global batch this run wants, or 0 when it follows the snapshot's (neither
 * --global-batch nor --grad-accum given). */
static int wanted_global_batch(const state *s)
{
    const options *o = s->o;
    if (o->global_batch) return o->global_batch;
    if (o->grad_accum_set) return o->micro_batch * o->grad_accum * s->world;
    return 0;
}

/* Set B and the accumulation per rank A = B / (b x W). Returns 0, or -EINVAL with why. */
static int set_global_batch(state *s, int B, char *why, size_t why_len)
{
    const int b = s->o->micro_batch, W = s->world;
    if (B % (b * W) != 0) {
        snprintf(why, why_len, "a global batch of %d sequences does not split into %d rank%s x "
                 "micro-batches of %d; choose a --global-batch that is a multiple of %d, or "
                 "another --micro-batch", B, W, W == 1 ? "" : "s", b, b * W);
        return -EINVAL;
    }
    if (s->o->cfg_ga && B != b * s->o->cfg_ga * W) {
        snprintf(why, why_len, "--config: train_batch_size %d != micro-batch %d x "
                 "gradient_accumulation_steps %d x world size %d", B, b, s->o->cfg_ga, W);
        return -EINVAL;
    }
    s->global_batch = B;
    s->grad_accum = B / (b * W);
    return 0;
}

/* Load this rank's part of one snapshot: params [lo, hi) (all at ZeRO stage 0), Adam moments
 * [olo, ohi). Local: no collective. Returns 0, -EBADMSG (corrupt: try an older one), -EINVAL
 * (incompatible: refuse), other -errno. why gets one line. */
static int load_part(state *s, const char *path, char *why, size_t why_len)
{
    ckpt_snapshot *snap;
    int rc = ckpt_snapshot_open(&snap, path, why, why_len);
    if (rc < 0) return rc == -EPROTONOSUPPORT ? -EINVAL : rc;
    json_error_t jerr;
    json_t *tr = json_loads(ckpt_snapshot_trainer_json(snap), 0, &jerr);
    json_t *data = json_object_get(tr, "data");
    size_t bytes = s->np * sizeof(float);
    char diff[400];
    json_t *opt = json_object_get(tr, "optimizer");
    json_t *jstep = json_object_get(tr, "step"), *jsamples = json_object_get(data, "samples_consumed");
    json_t *jt = json_object_get(opt, "t");
    int64_t step = json_is_integer(jstep) ? json_integer_value(jstep) : -1;
    int64_t samples = json_is_integer(jsamples) ? json_integer_value(jsamples) : -1;
    int64_t t = json_is_integer(jt) ? json_integer_value(jt) : -1;
    const char *dh = json_string_value(json_object_get(data, "data_hash"));
    const char *digest = json_string_value(json_object_get(tr, "params_digest"));
    json_t *jbatch = json_object_get(tr, "batch");
    int64_t gb = json_integer_value(json_object_get(jbatch, "global_batch"));
    int64_t saved_world = json_integer_value(json_object_get(jbatch, "world_size"));
    int64_t seed = json_integer_value(json_object_get(data, "seed"));
    char mydh[17];
    snprintf(mydh, sizeof mydh, "%016" PRIx64, train_dataset_hash(s->train));
    int dtypes_ok = 1;
    for (size_t i = 0; i < ckpt_snapshot_nbuffers(snap); i++) {
        ckpt_buffer_info bi;
        ckpt_snapshot_buffer_info(snap, i, &bi);
        if ((!strcmp(bi.name, "params") || !strcmp(bi.name, "adam_m") || !strcmp(bi.name, "adam_v")) &&
            (strcmp(bi.dtype, "f32") != 0 || bi.elem_bytes != 4))
            dtypes_ok = 0;
    }
    int want = wanted_global_batch(s);
    size_t plo = s->o->zero_stage == 0 ? 0 : s->lo, phi = s->o->zero_stage == 0 ? s->np : s->hi;
    float *params = train_model_params(s->model);
    if (!json_is_object(tr) || !json_is_object(data) || !json_is_object(opt) || !dh || !digest) {
        snprintf(why, why_len, "trainer record lacks its data position, optimizer or params_digest");
        rc = -EBADMSG;
    } else if (step != (int64_t)ckpt_snapshot_step(snap) || t != step) {
        snprintf(why, why_len, "trainer record is inconsistent: step %lld and Adam step %lld in a "
                 "snapshot of step %llu", (long long)step, (long long)t,
                 (unsigned long long)ckpt_snapshot_step(snap));
        rc = -EBADMSG;
    } else if (!same_model(json_object_get(tr, "model"), &s->o->model, diff, sizeof diff)) {
        snprintf(why, why_len, "model configuration differs: %s", diff);
        rc = -EINVAL;
    } else if (strcmp(dh, mydh) != 0) {
        snprintf(why, why_len, "training data differs from the snapshot's (data hash %s, now %s)",
                 dh, mydh);
        rc = -EINVAL;
    } else if (seed != (int64_t)s->o->seed) {
        snprintf(why, why_len, "seed differs (snapshot %lld, now %" PRIu64 ")", (long long)seed,
                 s->o->seed);
        rc = -EINVAL;
    } else if (gb < 1 || gb > (1 << 24)) {
        snprintf(why, why_len, "trainer record has no valid global batch");
        rc = -EBADMSG;
    } else if (want && gb != want) {
        snprintf(why, why_len, "global batch differs: the snapshot used %lld sequences per step "
                 "(world size %lld), this run %d; pass --global-batch %lld (or no batch flag) to "
                 "keep it", (long long)gb, (long long)saved_world, want, (long long)gb);
        rc = -EINVAL;
    } else if ((rc = set_global_batch(s, (int)gb, why, why_len)) < 0) {
        /* why is set */
    } else if (samples != step * gb) {
        snprintf(why, why_len, "trainer record is inconsistent: %lld samples consumed after %lld "
                 "steps of %lld", (long long)samples, (long long)step, (long long)gb);
        rc = -EBADMSG;
    } else if (ckpt_snapshot_buffer_bytes(snap, "params") != (int64_t)bytes ||
               ckpt_snapshot_buffer_bytes(snap, "adam_m") != (int64_t)bytes ||
               ckpt_snapshot_buffer_bytes(snap, "adam_v") != (int64_t)bytes) {
        snprintf(why, why_len, "state buffers have the wrong size for this model");
        rc = -EINVAL;
    } else if (!dtypes_ok) {
        snprintf(why, why_len, "state buffers are not f32");
        rc = -EBADMSG;
    } else if ((rc = ckpt_snapshot_read(snap, "params", plo * 4, (phi - plo) * 4, params + plo, why,
                                        why_len)) == 0 &&
               (rc = ckpt_snapshot_read(snap, "adam_m", s->olo * 4, (s->ohi - s->olo) * 4, s->m, why,
                                        why_len)) == 0 &&
               (rc = ckpt_snapshot_read(snap, "adam_v", s->olo * 4, (s->ohi - s->olo) * 4, s->v, why,
                                        why_len)) == 0) {
        if (s->rank == 0) warn_changed_hparams(tr, s->o);
        s->step = step;
        s->samples = (uint64_t)samples;
        snprintf(s->run_id, sizeof s->run_id, "%s", ckpt_snapshot_run_id(snap));
        json_t *loss = json_object_get(tr, "loss");
        s->last_loss = json_is_number(loss) ? json_number_value(loss) : NAN;
        json_t *md = json_object_get(tr, "moments_digest");
        const char *dm = json_string_value(json_object_get(md, "adam_m"));
        const char *dv = json_string_value(json_object_get(md, "adam_v"));
        snprintf(s->recorded_moments[0], 17, "%s", dm && strlen(dm) == 16 ? dm : "");
        snprintf(s->recorded_moments[1], 17, "%s", dv && strlen(dv) == 16 ? dv : "");
        int64_t saved_mb = json_integer_value(json_object_get(jbatch, "micro_batch"));
        if (saved_mb > 0 && saved_mb != s->o->micro_batch && s->rank == 0)
            LOG_W(TAG, "micro-batch differs from the snapshot's (%lld, now %d): the global batch "
                  "stays %lld, but the results agree with an uninterrupted run only to rounding",
                  (long long)saved_mb, s->o->micro_batch, (long long)gb);
        if (saved_world != s->world && s->rank == 0)
            LOG_I(TAG, "re-sharding: the snapshot was saved by %lld rank%s, this run has %d; each "
                  "rank reads only its ranges", (long long)saved_world, saved_world == 1 ? "" : "s",
                  s->world);
    }
    char *digest_copy = rc == 0 ? strdup(digest) : NULL;
    json_decref(tr);
    ckpt_snapshot_close(snap);
    if (rc == 0) {
        if (!digest_copy) return -ENOMEM;
        snprintf(why, why_len, "%s", digest_copy); /* handed to the caller for the check */
        free(digest_copy);
    }
    return rc;
}

/* The worst of the ranks' results: -EINVAL (refuse) before any other error before -EBADMSG
 * (corrupt) before 0. Collective; a failed collective returns its error with *comm_err set. */
static int agree(state *s, int rc, int *comm_err)
{
    *comm_err = 0;
    if (s->world == 1) return rc;
    int32_t *all = calloc((size_t)s->world, sizeof(int32_t));
    if (!all) {
        *comm_err = 1;
        return -ENOMEM;
    }
    all[s->rank] = rc;
    int cr = gather_records(s, all, sizeof(int32_t));
    int worst = 0;
    for (int r = 0; r < s->world && cr == 0; r++) {
        int x = all[r];
        if (x == -EINVAL) worst = -EINVAL;
        else if (x < 0 && x != -EBADMSG && worst != -EINVAL) worst = x;
        else if (x == -EBADMSG && worst == 0) worst = x;
    }
    free(all);
    if (cr < 0) {
        comm_failed(s, "agreement on the snapshot", cr);
        *comm_err = 1;
        return cr;
    }
    return worst;
}

/* Load one snapshot on every rank (collective): each rank reads only its ranges, the ranks
 * agree on the outcome, the parameters are all-gathered and their digest checked against the
 * record. Returns 0, -EBADMSG, -EINVAL, other -errno; *comm_err when a collective failed. */
static int load_snapshot(state *s, const char *path, char *why, size_t why_len, int *comm_err)
{
    char digest[600] = "";
    int rc = load_part(s, path, why, why_len);
    if (rc == 0) snprintf(digest, sizeof digest, "%s", why);
    else if (rc == -EBADMSG || rc == -EINVAL || rc == -ENOENT)
        LOG_W(TAG, "rank %d: %s: %s", s->rank, path, why);
    if (rc == -ENOENT) rc = -EBADMSG; /* no manifest: not a snapshot */
    rc = agree(s, rc, comm_err);
    if (*comm_err) return rc;
    if (rc < 0) {
        if (why[0] == '\0' || !strcmp(why, digest))
            snprintf(why, why_len, "another rank found it %s", rc == -EINVAL ? "incompatible" : "unreadable");
        return rc;
    }
    if (gather_params(s) < 0) {
        *comm_err = 1;
        return -EIO;
    }
    char got[33];
    digest_hex(train_model_params(s->model), s->np, got);
    if (strcmp(got, digest) != 0) {
        snprintf(why, why_len, "params digest %s differs from the recorded %s", got, digest);
        return -EBADMSG;
    }
    uint64_t md[2];
    if (moments_digest(s, md) < 0) {
        *comm_err = 1;
        return -EIO;
    }
    for (int k = 0; k < 2; k++) {
        const char *want = s->recorded_moments[k];
        char have[17];
        snprintf(have, sizeof have, "%016" PRIx64, md[k]);
        if (want[0] && strcmp(want, have) != 0) {
            snprintf(why, why_len, "%s digest %s differs from the recorded %s (a shard restored at "
                     "the wrong place?)", k ? "adam_v" : "adam_m", have, want);
            return -EBADMSG;
        }
    }
    why[0] = '\0';
    return 0;
}

static void fresh_start(state *s)
{
    train_model_init_params(s->model, s->o->seed);
    memset(s->m, 0, (s->ohi - s->olo) * sizeof(float));
    memset(s->v, 0, (s->ohi - s->olo) * sizeof(float));
    s->step = 0;
    s->samples = 0;
    if (s->o->run_id) snprintf(s->run_id, sizeof s->run_id, "%s", s->o->run_id);
    else make_run_id(s->run_id);
}

/* Snapshot names already in the folder after the step we start from would collide with the
 * ones this run is about to save (and a later --resume auto would continue the other run).
 * Returns 0, or 2 with one line naming the newest one. Rank 0 only. */
static int check_no_later_snapshots(state *s)
{
    ckpt_entry *e;
    size_t n;
    if (ckpt_list(s->o->ckpt_dir, &e, &n) < 0) return 0; /* unreadable: the first save reports it */
    int rc = 0;
    for (size_t i = n; i-- > 0;) {
        if (e[i].status == CKPT_STATUS_INCOMPLETE || e[i].status == CKPT_STATUS_SET_ASIDE) continue;
        if (e[i].step <= (uint64_t)s->step) break;
        LOG_E(TAG, "refusing to start at step %" PRId64 ": %s already holds %s (run %s, %s), whose "
              "steps this run would save again; continue that run with --resume auto, or use "
              "another --ckpt-dir", s->step, s->o->ckpt_dir, e[i].name,
              e[i].run_id[0] ? e[i].run_id : "?", ckpt_status_name(e[i].status));
        rc = 2;
        break;
    }
    free(e);
    return rc;
}

/* Rank 0 tells the others what to do next during the resume. */
enum { CMD_TRY = 0, CMD_DONE = 1 };
typedef struct resume_msg {
    int32_t cmd;
    int32_t status;          /* CMD_DONE: 0 go on, else the exit status */
    int32_t global_batch;    /* CMD_DONE: B of a fresh start */
    char run_id[64];         /* CMD_DONE: the run id */
    char path[CKPT_PATH_MAX];/* CMD_TRY */
} resume_msg;

/* Rank 0: try one snapshot on every rank. Returns the agreed result; *fatal set when a
 * collective failed. */
static int try_snapshot(state *s, const char *path, char *why, size_t why_len, int *fatal)
{
    if (s->world > 1) {
        resume_msg m = {.cmd = CMD_TRY};
        snprintf(m.path, sizeof m.path, "%s", path);
        int rc = train_comm_broadcast(s->comm, &m, sizeof m, 0);
        if (rc < 0) {
            comm_failed(s, "broadcast of the resume plan", rc);
            *fatal = 1;
            return rc;
        }
    }
    return load_snapshot(s, path, why, why_len, fatal);
}

/* Rank 0's side of the resume: returns 0 (resumed or fresh), 1 runtime failure, 2
 * configuration error; the others follow (follow_resume). */
static int resume_rank0(state *s)
{
    const options *o = s->o;
    char why[600];
    int fatal = 0;
    if (!o->resume || !strcmp(o->resume, "none")) {
        LOG_I(TAG, "fresh start (run %s)", s->run_id);
        return 0;
    }
    if (strcmp(o->resume, "auto") != 0) {
        struct stat st;
        char mpath[CKPT_PATH_MAX + 16];
        if (stat(o->resume, &st) != 0 || !S_ISDIR(st.st_mode)) {
            LOG_E(TAG, "--resume %s: no such snapshot folder", o->resume);
            return 2;
        }
        snprintf(mpath, sizeof mpath, "%s/manifest.json", o->resume);
        ckpt_entry *inner;
        size_t ninner = 0;
        if (stat(mpath, &st) != 0 && ckpt_list(o->resume, &inner, &ninner) == 0) {
            free(inner);
            if (ninner > 0) {
                LOG_E(TAG, "--resume %s: this holds snapshots, it is not one; use --ckpt-dir %s "
                      "--resume auto, or name one of its step-* folders", o->resume, o->resume);
                return 2;
            }
        }
        int rc = try_snapshot(s, o->resume, why, sizeof why, &fatal);
        if (rc < 0) {
            if (!fatal) LOG_E(TAG, "cannot resume from %s: %s", o->resume, why);
            return rc == -EINVAL ? 2 : 1;
        }
        LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s)", o->resume, s->step, s->run_id);
        return 0;
    }
    int removed = ckpt_remove_temp(o->ckpt_dir);
    if (removed < 0) LOG_W(TAG, "could not clean temp folders in %s: %s", o->ckpt_dir, strerror(-removed));
    ckpt_entry *e;
    size_t n;
    int rc = ckpt_list(o->ckpt_dir, &e, &n);
    if (rc < 0) {
        LOG_E(TAG, "cannot list snapshots in %s: %s", o->ckpt_dir, strerror(-rc));
        return 1;
    }
    int result = -1;
    for (size_t i = n; i-- > 0;) {
        char path[CKPT_PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", o->ckpt_dir, e[i].name);
        if (e[i].status == CKPT_STATUS_INCOMPLETE || e[i].status == CKPT_STATUS_SET_ASIDE) {
            LOG_D(TAG, "ignoring %s: %s", path, ckpt_status_name(e[i].status));
            continue;
        }
        if (e[i].status == CKPT_STATUS_NEWER) {
            LOG_E(TAG, "refusing to resume: %s was written by a newer version (%s); upgrade, or "
                  "pass --resume PATH to choose an older snapshot", path, e[i].reason);
            result = 2;
            break;
        }
        if (e[i].status == CKPT_STATUS_COMMITTED && o->run_id && strcmp(e[i].run_id, o->run_id) != 0) {
            LOG_W(TAG, "skipping %s: it belongs to run %s, another lineage (this run is %s)", path,
                  e[i].run_id, o->run_id);
            continue;
        }
        if (e[i].status == CKPT_STATUS_COMMITTED) {
            double t0 = clock_now_s();
            rc = try_snapshot(s, path, why, sizeof why, &fatal);
            double load_s = clock_now_s() - t0;
            if (fatal) {
                result = 1;
                break;
            }
            if (rc == 0) {
                LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s): loaded and checked in "
                      "%.0f ms", path, s->step, s->run_id, load_s * 1e3);
                result = 0;
                break;
            }
            if (rc == -EINVAL) {
                LOG_E(TAG, "refusing to resume from %s: %s", path, why);
                result = 2;
                break;
            }
            if (rc != -EBADMSG) {
                LOG_E(TAG, "cannot read %s: %s", path, why[0] ? why : strerror(-rc));
                result = 1;
                break;
            }
            LOG_W(TAG, "skipping corrupt snapshot %s: %s", path, why);
        } else {
            LOG_W(TAG, "skipping %s: corrupt (%s)", path, e[i].reason);
        }
        /* keep the bad bytes for inspection, under a name that frees the step for a new save */
        char aside[96];
        int ar = ckpt_set_aside(o->ckpt_dir, e[i].name, aside, sizeof aside);
        if (ar == 0) LOG_W(TAG, "set %s aside as %s/%s", path, o->ckpt_dir, aside);
        else LOG_W(TAG, "could not set %s aside: %s", path, strerror(-ar));
    }
    free(e);
    if (result < 0) {
        LOG_I(TAG, "no usable snapshot in %s: fresh start (run %s)", o->ckpt_dir, s->run_id);
        result = 0;
    }
    return result;
}

/* Every rank: the resume decided by rank 0 (collective). Returns 0, 1 or 2 (exit status). */
static int resume(state *s)
{
    char why[600];
    fresh_start(s);
    resume_msg m;
    int status;
    if (s->rank == 0) {
        status = resume_rank0(s);
        if (status == 0 && s->step == 0) {
            /* fresh: a failed load may have overwritten part of the state */
            char keep[64];
            snprintf(keep, sizeof keep, "%s", s->run_id);
            fresh_start(s);
            snprintf(s->run_id, sizeof s->run_id, "%s", keep);
        }
        if (status == 0 && s->step == 0 && set_global_batch(s, wanted_global_batch(s) ?
                                                               wanted_global_batch(s) :
                                                               s->o->micro_batch * s->o->grad_accum * s->world,
                                                           why, sizeof why) < 0) {
            LOG_E(TAG, "%s", why);
            status = 2;
        }
        if (status == 0 && s->o->ckpt_every > 0) status = check_no_later_snapshots(s);
        memset(&m, 0, sizeof m);
        m.cmd = CMD_DONE;
        m.status = status;
        m.global_batch = s->global_batch;
        snprintf(m.run_id, sizeof m.run_id, "%s", s->run_id);
        if (s->world > 1) {
            int rc = train_comm_broadcast(s->comm, &m, sizeof m, 0);
            if (rc < 0 && status == 0) {
                comm_failed(s, "broadcast of the resume outcome", rc);
                status = 1;
            }
        }
        return status;
    }
    for (;;) {
        int rc = train_comm_broadcast(s->comm, &m, sizeof m, 0);
        if (rc < 0) {
            comm_failed(s, "waiting for rank 0's resume plan", rc);
            return 1;
        }
        m.path[sizeof m.path - 1] = '\0';
        m.run_id[sizeof m.run_id - 1] = '\0';
        if (m.cmd == CMD_DONE) break;
        int fatal = 0;
        load_snapshot(s, m.path, why, sizeof why, &fatal);
        if (fatal) return 1;
    }
    if (m.status != 0) return m.status;
    if (s->step == 0) {
        fresh_start(s);
        if (set_global_batch(s, m.global_batch, why, sizeof why) < 0) {
            LOG_E(TAG, "%s", why);
            return 2;
        }
    }
    snprintf(s->run_id, sizeof s->run_id, "%s", m.run_id);
    return 0;
}

/* ------------------------------------------------------------------ training */

/* One optimizer step (DESIGN section 3): forward/backward over this rank's micro-batches
 * [rank x A, (rank + 1) x A) of the step's M = A x W -> reduce gradients (all-reduce at
 * stages 0-1, reduce-scatter at 2-3) -> global norm over fixed blocks -> clip -> AdamW on the
 * owned range -> all-gather of parameters (stages 1-2; stage 3 gathers layer by layer in the
 * next forward). *stop_any: some rank received SIGTERM/SIGINT before this step's exchange. */
static int train_step(state *s, double *loss_out, double *norm_out, float *lr_out, int *stop_any)
{
    const options *o = s->o;
    const int T = o->model.seq_len, b = o->micro_batch, A = s->grad_accum, W = s->world;
    const int M = A * W;
    const size_t np = s->np;
    const float loss_scale = 1.0f / (float)((double)M * b * T);
    double *mine = s->xchg + (size_t)s->rank * (size_t)(A + 1);
    int rc;
    train_tree_reset(s->tree);
    /* this rank's samples: numbers [samples + rank*A*b, +A*b) of the global order, read ahead
     * by the prefetch thread */
    char why[512];
    uint64_t first = s->samples + (uint64_t)s->rank * (uint64_t)A * (uint64_t)b;
    rc = train_prefetch_get(s->prefetch, first, s->step_inputs, s->step_targets, s->step_samples,
                            300.0, why, sizeof why);
    if (rc < 0) {
        LOG_E(TAG, "training data for step %" PRId64 ": %s", s->step + 1,
              rc == -ETIMEDOUT ? "the prefetch thread did not deliver within 300 s" : why);
        return rc;
    }
    for (int jl = 0; jl < A; jl++) {
        size_t at = (size_t)jl * (size_t)b * (size_t)T;
        mine[jl] = train_model_forward(s->model, s->step_inputs + at, s->step_targets + at, b);
        train_model_backward(s->model, loss_scale);
        if ((rc = train_model_hook_status(s->model)) < 0) return rc; /* logged by the hook */
        if ((rc = train_tree_push(s->tree, train_model_grads(s->model))) < 0) {
            LOG_E(TAG, "step %" PRId64 ": gradient accumulator full", s->step + 1);
            return rc;
        }
    }
    train_tree_result(s->tree, s->gsum);
    /* losses of all M micro-batches and the ranks' stop flags, in one exchange */
    mine[A] = g_stop_signal ? 1.0 : 0.0;
    if (W > 1) {
        if ((rc = gather_records(s, s->xchg, (size_t)(A + 1) * sizeof(double))) < 0) {
            comm_failed(s, "all-gather of losses", rc);
            return rc;
        }
    }
    *stop_any = 0;
    for (int r = 0; r < W; r++) {
        memcpy(s->losses + (size_t)r * A, s->xchg + (size_t)r * (A + 1),
               (size_t)A * sizeof(double));
        if (s->xchg[(size_t)r * (A + 1) + A] != 0.0) *stop_any = 1;
    }
    double loss = train_tree_sum(s->losses, (size_t)M) / M;
    /* gradients: the sum over ranks of their subtrees, in the fixed rank tree */
    float *grad; /* the gradient of [olo, ohi) */
    if (o->zero_stage <= 1) {
        if (W > 1 && (rc = train_comm_all_reduce_f32(s->comm, s->gsum, np)) < 0) {
            comm_failed(s, "all-reduce of gradients", rc);
            return rc;
        }
        grad = s->gsum + s->olo;
    } else {
        if (W > 1) {
            if ((rc = train_comm_reduce_scatter_f32(s->comm, s->gsum, s->gshard, s->shard_el)) < 0) {
                comm_failed(s, "reduce-scatter of gradients", rc);
                return rc;
            }
        } else {
            memcpy(s->gshard, s->gsum, np * sizeof(float));
        }
        grad = s->gshard;
    }
    /* global norm over fixed blocks, whatever the sharding */
    train_block_sumsq_shard(s->gsum == grad ? s->gsum : grad, s->ohi - s->olo,
                            s->blocks + s->olo / TRAIN_BLOCK);
    if (W > 1 && o->zero_stage > 0) {
        double *mineb = s->blocks + s->lo / TRAIN_BLOCK;
        if ((rc = train_comm_all_gather(s->comm, mineb, s->blocks, s->block_bytes)) < 0) {
            comm_failed(s, "all-gather of gradient norms", rc);
            return rc;
        }
    }
    double norm = sqrt(train_tree_sum(s->blocks, s->nb));
    if (o->adam.grad_clip > 0 && norm > o->adam.grad_clip)
        train_scale(grad, 0, s->ohi - s->olo, (float)(o->adam.grad_clip / norm));
    float lr = train_lr_at(&o->adam, s->step);
    size_t nt;
    const train_tensor *tt = train_model_tensors(s->model, &nt);
    train_adamw_update_shard(&o->adam, tt, nt, train_model_params(s->model) + s->olo, s->m, s->v,
                             grad, s->olo, s->ohi, s->step + 1, lr);
    if (o->zero_stage != 3 && (rc = gather_params(s)) < 0) return rc;
    if (s->sample_fd >= 0) {
        size_t n = (size_t)A * (size_t)b, cap = n * 44 + 1, off = 0;
        char *buf = malloc(cap);
        if (buf) {
            for (size_t i = 0; i < n; i++)
                off += (size_t)snprintf(buf + off, cap - off, "%" PRIu64 " %" PRIu64 "\n",
                                        s->samples + (uint64_t)s->rank * n + i, s->step_samples[i]);
            if (write(s->sample_fd, buf, off) != (ssize_t)off)
                LOG_W(TAG, "--sample-log: short write");
            free(buf);
        }
    }
    s->step++;
    s->samples += (uint64_t)s->global_batch;
    *loss_out = loss;
    *norm_out = norm;
    *lr_out = lr;
    return 0;
}

/* ------------------------------------------------------------------ launcher heartbeat */

/* ELASTIC_HEARTBEAT_FD: the write end of a pipe from the elastic agent; -1 when absent. The
 * fd is made non-blocking: a full pipe or a gone agent never stalls training. */
static int heartbeat_open(void)
{
    const char *v = getenv("ELASTIC_HEARTBEAT_FD");
    if (!v || !*v) return -1;
    char *end;
    errno = 0;
    long fd = strtol(v, &end, 10);
    if (errno || *end || fd < 0 || fd > 65535 || fcntl((int)fd, F_GETFD) < 0) {
        LOG_W(TAG, "ignoring ELASTIC_HEARTBEAT_FD=%s: not an open file descriptor", v);
        return -1;
    }
    int fl = fcntl((int)fd, F_GETFL);
    if (fl >= 0) fcntl((int)fd, F_SETFL, fl | O_NONBLOCK);
    fcntl((int)fd, F_SETFD, FD_CLOEXEC);
    return (int)fd;
}

/* One progress line after each step; errors (EAGAIN, EPIPE) are ignored. */
static void heartbeat(int fd, int64_t step)
{
    if (fd < 0) return;
    char line[40];
    int n = snprintf(line, sizeof line, "step %" PRId64 "\n", step);
    if (write(fd, line, (size_t)n) < 0) { /* the agent notices silence, not our errors */ }
}

/* ------------------------------------------------------------------ ranks */

/* Slurm's variables stand in for torchrun's when those are absent (srun without torchrun). */
static void env_from_slurm(void)
{
    const char *pid = getenv("SLURM_PROCID"), *nt = getenv("SLURM_NTASKS");
    if (getenv("RANK") || !pid || !nt) return;
    setenv("RANK", pid, 1);
    setenv("WORLD_SIZE", nt, 1);
    const char *lid = getenv("SLURM_LOCALID");
    if (lid) setenv("LOCAL_RANK", lid, 1);
    if (!getenv("MASTER_PORT")) setenv("MASTER_PORT", "29500", 1);
    if (!getenv("MASTER_ADDR")) {
        const char *nn = getenv("SLURM_NNODES");
        const char *launch = getenv("SLURM_LAUNCH_NODE_IPADDR");
        if (nn && !strcmp(nn, "1")) setenv("MASTER_ADDR", "127.0.0.1", 1);
        else if (launch) setenv("MASTER_ADDR", launch, 1);
    }
}

/* This rank's own start-up: open the data, and on rank 0 take the snapshot folder's lock.
 * Returns 0, or the exit status (the reason is printed here, naming the rank). */
static int startup_local(state *s)
{
    const options *o = s->o;
    char why[512] = "";
    int rc = train_dataset_open(&s->train, o->data, o->model.seq_len, o->model.vocab, why,
                                sizeof why);
    if (rc < 0) {
        LOG_E(TAG, "training data: %s", why);
        return rc == -ENOENT || rc == -EINVAL ? 2 : 1;
    }
    if (o->val_data) {
        rc = train_dataset_open(&s->val, o->val_data, o->model.seq_len, o->model.vocab, why,
                                sizeof why);
        if (rc < 0) {
            LOG_E(TAG, "validation data: %s", why);
            return rc == -ENOENT || rc == -EINVAL ? 2 : 1;
        }
    }
    if (o->ckpt_dir && s->rank == 0) {
        struct stat st;
        int existed = stat(o->ckpt_dir, &st) == 0;
        long holder = 0;
        rc = ckpt_dir_lock_acquire(o->ckpt_dir, &s->lock, &holder);
        if (rc == -EBUSY) {
            LOG_E(TAG, "snapshot folder %s is in use by another run (pid %ld); two runs must not "
                  "share a --ckpt-dir", o->ckpt_dir, holder);
            return 2;
        }
        if (rc < 0) {
            LOG_E(TAG, "cannot use %s as the snapshot folder: %s", o->ckpt_dir, strerror(-rc));
            return 2;
        }
        if (!existed && o->resume && !strcmp(o->resume, "auto"))
            LOG_W(TAG, "snapshot folder %s did not exist (created it): nothing to resume",
                  o->ckpt_dir);
    }
    return 0;
}

/* The settings every rank must share, as "key=value;" text (a rank started with another
 * learning rate, seed, data, batch, snapshot folder, ... would train something else and save
 * shards that do not fit together). */
static void settings_text(const state *s, char *buf, size_t len)
{
    const options *o = s->o;
    char dir[CKPT_PATH_MAX] = "-";
    if (o->ckpt_dir && !realpath(o->ckpt_dir, dir)) snprintf(dir, sizeof dir, "%s", o->ckpt_dir);
    snprintf(buf, len,
             "data=%016" PRIx64 ";val-data=%016" PRIx64 ";vocab=%d;seq-len=%d;n-layer=%d;"
             "n-embd=%d;n-head=%d;micro-batch=%d;grad-accum=%d%s;global-batch=%d;zero-stage=%d;"
             "steps=%d;lr=%.9g;min-lr-ratio=%.9g;warmup=%d;weight-decay=%.9g;grad-clip=%.9g;"
             "beta1=%.9g;beta2=%.9g;eps=%.9g;seed=%" PRIu64 ";eval-every=%d;val-samples=%d;"
             "ckpt-every=%d;resume=%s;run-id=%s;keep-last=%u;keep-every=%d;compress=%d;"
             "zstd-level=%d;shuffle=%d;chunk=%" PRIu64 ";policy=%d;comm-timeout=%g;ckpt-dir=%.3000s;",
             s->train ? train_dataset_hash(s->train) : 0, s->val ? train_dataset_hash(s->val) : 0,
             o->model.vocab, o->model.seq_len, o->model.n_layer, o->model.n_embd, o->model.n_head,
             o->micro_batch, o->grad_accum, o->grad_accum_set ? "(given)" : "", o->global_batch,
             o->zero_stage, o->steps, f2d(o->adam.lr), f2d(o->adam.min_lr_ratio),
             o->adam.warmup, f2d(o->adam.weight_decay), f2d(o->adam.grad_clip),
             f2d(o->adam.beta1), f2d(o->adam.beta2), f2d(o->adam.eps), o->seed,
             o->eval_every, o->val_samples, o->ckpt_every, o->resume ? o->resume : "none",
             o->run_id ? o->run_id : "-", o->keep_last, o->keep_every, o->compress, o->zstd_level,
             o->filter, o->chunk_bytes, o->policy, o->comm_timeout, dir);
}

/* The first setting in which a and b differ, as "key (a vs b)". */
static void first_difference(const char *a, const char *b, char *out, size_t len)
{
    snprintf(out, len, "?");
    while (*a && *b) {
        const char *ea = strchr(a, ';'), *eb = strchr(b, ';');
        if (!ea || !eb) break;
        size_t la = (size_t)(ea - a), lb = (size_t)(eb - b);
        if (la != lb || memcmp(a, b, la) != 0) {
            const char *eq = memchr(a, '=', la);
            int kl = eq ? (int)(eq - a) : (int)la;
            const char *vb = memchr(b, '=', lb);
            snprintf(out, len, "%.*s (rank 0: %.*s, this rank: %.*s)", kl, a,
                     eq ? (int)(ea - eq - 1) : 0, eq ? eq + 1 : "",
                     vb ? (int)(eb - vb - 1) : 0, vb ? vb + 1 : "");
            return;
        }
        a = ea + 1;
        b = eb + 1;
    }
}

/* Every rank's start-up status and settings, exchanged once (collective): returns 0 when all
 * ranks started and share rank 0's settings, else the exit status for every rank (the
 * largest status of a rank that failed, or 2 for different settings), each rank naming its
 * own problem in one line. */
static int startup_agree(state *s, int local)
{
    if (s->world == 1) return local;
    enum { TEXT = 4000 };
    typedef struct { int32_t status; char text[TEXT]; } msg;
    msg *all = calloc((size_t)s->world, sizeof *all);
    if (!all) return 1;
    all[s->rank].status = local;
    if (local == 0) settings_text(s, all[s->rank].text, TEXT);
    int rc = gather_records(s, all, sizeof(msg)), status = 0;
    if (rc < 0) {
        comm_failed(s, "exchange of start-up settings", rc);
        status = local ? local : 1;
    }
    for (int r = 0; r < s->world && rc == 0; r++)
        if (all[r].status > status) status = all[r].status;
    if (rc == 0 && status != 0 && local == 0 && s->rank == 0) {
        char who[256] = "";
        size_t off = 0;
        for (int r = 0; r < s->world && off < sizeof who; r++)
            if (all[r].status)
                off += (size_t)snprintf(who + off, sizeof who - off, "%s%d", off ? ", " : "", r);
        LOG_E(TAG, "rank(s) %s could not start (see their lines); stopping every rank", who);
    }
    if (rc == 0 && status == 0) {
        int bad = 0;
        for (int r = 1; r < s->world; r++) {
            all[r].text[TEXT - 1] = all[0].text[TEXT - 1] = '\0';
            if (strcmp(all[r].text, all[0].text) != 0) {
                bad++;
                if (r == s->rank || (s->rank == 0 && bad == 1)) {
                    char diff[600];
                    first_difference(all[0].text, all[r].text, diff, sizeof diff);
                    LOG_E(TAG, "rank %d was started with other settings than rank 0: %s; every "
                          "rank must get the same flags, config and data", r, diff);
                }
            }
        }
        if (bad) status = 2;
    }
    free(all);
    return status;
}

/* Ranks, store, communicator, shard ranges. Returns 0, 1 or 2 (exit status). */
static int dist_init(state *s)
{
    const options *o = s->o;
    env_from_slurm();
    train_comm_opts co = TRAIN_COMM_OPTS_INIT;
    if (train_comm_opts_from_env(&co) < 0) return 2;
    s->rank = co.rank;
    s->world = co.world_size;
    s->counts = calloc((size_t)s->world, sizeof(size_t));
    if (!s->counts) return 1;
    if (s->world > 1) log_set_rank(s->rank);
    const char *token = getenv("ELASTIC_STORE_TOKEN");
    const char *gen = getenv("ELASTIC_RESTART_COUNT");
    const char *hosted = getenv("ELASTIC_STORE_HOSTED");
    char prefix[96];
    snprintf(prefix, sizeof prefix, "g%s/comm", gen && *gen ? gen : "0");
    co.store_token = token;
    co.prefix = prefix;
    co.timeout_s = o->comm_timeout;
    co.connect_timeout_s = o->join_timeout;
    int rc;
    if (s->world > 1 && s->rank == 0 && !(hosted && !strcmp(hosted, "1"))) {
        elastic_store_server_opts so = ELASTIC_STORE_SERVER_OPTS_INIT;
        so.host = co.store_host;
        so.port = co.store_port;
        so.token = token;
        if ((rc = elastic_store_server_start(&s->server, &so)) < 0) {
            LOG_E(TAG, "rank 0 cannot host the rendezvous store at %s:%d (MASTER_ADDR:MASTER_PORT): "
                  "%s", co.store_host, co.store_port, strerror(-rc));
            return 1;
        }
    }
    if ((rc = train_comm_init(&s->comm, &co)) < 0) {
        LOG_E(TAG, "rank %d of %d could not join the group through %s:%d: %s", s->rank, s->world,
              co.store_host ? co.store_host : "-", co.store_port, strerror(-rc));
        return 1;
    }
    if (s->world > 1) {
        /* a tag unique to this launch names the shared temp folders and the vote keys */
        if (s->rank == 0) {
            uint64_t r = 0;
            int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                if (read(fd, &r, sizeof r) != (ssize_t)sizeof r) r = 0;
                close(fd);
            }
            r ^= (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
            snprintf(s->job_tag, sizeof s->job_tag, "j%016" PRIx64, r);
        }
        if ((rc = train_comm_broadcast(s->comm, s->job_tag, sizeof s->job_tag, 0)) < 0) {
            comm_failed(s, "broadcast of the job tag", rc);
            return 1;
        }
        s->job_tag[sizeof s->job_tag - 1] = '\0';
        char vprefix[160];
        snprintf(vprefix, sizeof vprefix, "g%s/snap/%s", gen && *gen ? gen : "0", s->job_tag);
        if (o->ckpt_every > 0 &&
            (rc = train_vote_create(&s->vote, &s->group, co.store_host, co.store_port, token, 60.0,
                                    vprefix, s->job_tag, s->rank, s->world, 600.0)) < 0) {
            LOG_E(TAG, "rank %d cannot open the snapshot vote channel: %s", s->rank, strerror(-rc));
            return 1;
        }
        /* every rank holds its store connections now: rank 0 may stop the store (exit)
         * without leaving anyone connecting to a gone server */
        if ((rc = train_comm_barrier(s->comm)) < 0) {
            comm_failed(s, "start-up barrier", rc);
            return 1;
        }
    }
    return 0;
}

/* Shard ranges: whole blocks, the first nb % W ranks one block more. */
static int plan_shards(state *s)
{
    const int W = s->world;
    s->np = train_model_num_params(s->model);
    s->nb = s->np / TRAIN_BLOCK;
    s->shard_bytes = calloc((size_t)W, sizeof(size_t));
    s->shard_el = calloc((size_t)W, sizeof(size_t));
    s->block_bytes = calloc((size_t)W, sizeof(size_t));
    if (!s->shard_bytes || !s->shard_el || !s->block_bytes) return -ENOMEM;
    size_t base = s->nb / (size_t)W, extra = s->nb % (size_t)W, start = 0;
    for (int r = 0; r < W; r++) {
        size_t nblk = base + ((size_t)r < extra ? 1 : 0);
        if (r == s->rank) {
            s->lo = start * TRAIN_BLOCK;
            s->hi = (start + nblk) * TRAIN_BLOCK;
        }
        s->shard_el[r] = nblk * TRAIN_BLOCK;
        s->shard_bytes[r] = nblk * TRAIN_BLOCK * sizeof(float);
        s->block_bytes[r] = nblk * sizeof(double);
        start += nblk;
    }
    if (s->o->zero_stage == 0) {
        s->olo = 0;
        s->ohi = s->np;
    } else {
        s->olo = s->lo;
        s->ohi = s->hi;
    }
    return 0;
}

int main(int argc, char **argv)
{
    options o = {0};
    o.model = (train_model_config){256, 128, 4, 128, 4};
    o.micro_batch = 8;
    o.grad_accum = 1;
    o.steps = 100;
    o.val_samples = 64;
    o.log_every = 1;
    o.seed = 1337;
    o.adam = (train_adamw_config)TRAIN_ADAMW_CONFIG_INIT;
    o.zstd_level = 1;
    o.direct_io = 1;
    o.compress = 1;
    o.filter = CKPT_FILTER_SHUFFLE;
    o.snapshot_threads = 2;
    o.policy = CKPT_POLICY_WAIT;
    o.zero_stage = 2;
    o.comm_timeout = 60.0;
    o.join_timeout = 120.0;
    static train_ds_config dc;
    signal(SIGPIPE, SIG_IGN); /* a gone launcher pipe is an EPIPE, not a death */
    if (read_config(argc, argv, &o, &dc) < 0) return 2;
    if (parse_args(argc, argv, &o) < 0) return 2;
    openblas_set_num_threads(1);

    state s = {.o = &o, .last_loss = NAN, .last_val = NAN, .sample_fd = -1, .world = 1};
    int rc, status = 1;
    /* join the group first, so that a rank that cannot start tells the others at once
     * (startup_agree) instead of leaving them waiting for it */
    if ((status = dist_init(&s)) != 0) goto out;
    status = startup_agree(&s, startup_local(&s));
    if (status != 0) goto out;
    status = 1;
    size_t T = (size_t)o.model.seq_len, b = (size_t)o.micro_batch;
    if ((rc = train_model_create(&s.model, &o.model, o.micro_batch)) < 0) {
        fprintf(stderr, "train: cannot create the model: %s\n", strerror(-rc));
        goto out;
    }
    if (plan_shards(&s) < 0) goto out;
    s.m = calloc(s.ohi - s.olo + 1, sizeof(float));
    s.v = calloc(s.ohi - s.olo + 1, sizeof(float));
    s.gsum = calloc(s.np, sizeof(float));
    s.gshard = o.zero_stage >= 2 ? calloc(s.hi - s.lo + 1, sizeof(float)) : NULL;
    s.blocks = calloc(s.nb, sizeof(double));
    s.inputs = calloc(b * T, sizeof(int32_t));
    s.targets = calloc(b * T, sizeof(int32_t));
    if (!s.m || !s.v || !s.gsum || (o.zero_stage >= 2 && !s.gshard) || !s.blocks || !s.inputs ||
        !s.targets) {
        fprintf(stderr, "train: out of memory for %zu parameters\n", s.np);
        goto out;
    }
    if (o.zero_stage == 3 && s.world > 1) train_model_set_param_hook(s.model, gather_range_hook, &s);
    int r = resume(&s);
    if (r != 0) {
        status = r;
        goto out;
    }
    make_config_hash(&s, s.config_hash);
    s.xchg = calloc((size_t)s.world * (size_t)(s.grad_accum + 1), sizeof(double));
    s.losses = calloc((size_t)s.world * (size_t)s.grad_accum, sizeof(double));
    s.step_samples = calloc((size_t)s.grad_accum * b, sizeof(uint64_t));
    s.step_inputs = calloc((size_t)s.grad_accum * b * T, sizeof(int32_t));
    s.step_targets = calloc((size_t)s.grad_accum * b * T, sizeof(int32_t));
    if (!s.xchg || !s.losses || !s.step_samples || !s.step_inputs || !s.step_targets ||
        train_tree_create(&s.tree, s.np, s.grad_accum) < 0) {
        fprintf(stderr, "train: out of memory for %zu parameters\n", s.np);
        goto out;
    }
    if ((rc = train_prefetch_create(&s.prefetch, s.train, o.seed, o.model.seq_len,
                                    s.grad_accum * o.micro_batch, (uint64_t)s.global_batch, 2)) < 0) {
        fprintf(stderr, "train: cannot start the data prefetch thread: %s\n", strerror(-rc));
        goto out;
    }
    if (s.rank == 0)
        LOG_I(TAG, "model: %d layers, %d embd, %d heads, seq %d, vocab %d: %zu parameters (%zu "
              "padded); world size %d, ZeRO stage %d, global batch %d = %d ranks x %d micro-batches "
              "x %d sequences; data %llu tokens in %zu files (%llu samples)",
              o.model.n_layer, o.model.n_embd, o.model.n_head, o.model.seq_len, o.model.vocab,
              train_model_num_real(s.model), s.np, s.world, o.zero_stage, s.global_batch, s.world,
              s.grad_accum, o.micro_batch,
              (unsigned long long)train_dataset_num_tokens(s.train), train_dataset_num_files(s.train),
              (unsigned long long)train_dataset_num_samples(s.train));
    if (o.sample_log) {
        s.sample_fd = open(o.sample_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (s.sample_fd < 0) {
            LOG_E(TAG, "--sample-log %s: %s", o.sample_log, strerror(errno));
            status = 2;
            goto out;
        }
    }
    if (o.ckpt_every > 0 && make_engine(&s) < 0) goto out;
    install_stop_handlers();
    int heartbeat_fd = heartbeat_open();
    if (s.step >= o.steps && s.rank == 0)
        LOG_I(TAG, "already at step %" PRId64 " of %d: nothing to train", s.step, o.steps);
    int stopped_by = 0;
    while (s.step < o.steps) {
        double t0 = clock_now_s(), loss = 0, norm = 0;
        float lr = 0;
        int stop_any = 0;
        if ((rc = train_step(&s, &loss, &norm, &lr, &stop_any)) < 0) {
            goto out; /* train_step logged the reason */
        }
        double dt = clock_now_s() - t0;
        heartbeat(heartbeat_fd, s.step);
        s.last_loss = loss;
        if (!isfinite(loss)) {
            LOG_E(TAG, "step %" PRId64 ": loss is %f; stopping", s.step, loss);
            goto out;
        }
        if (s.rank == 0 && (s.step % o.log_every == 0 || s.step == o.steps))
            LOG_I(TAG, "step %" PRId64 "/%d loss %.4f lr %.3e grad_norm %.4f %.0f ms %.0f tok/s", s.step,
                  o.steps, loss, (double)lr, norm, dt * 1e3,
                  (double)(b * T * (size_t)s.global_batch / b) / dt);
        if (o.eval_every > 0 && s.step % o.eval_every == 0 && s.val) {
            s.last_val = eval_val(&s);
            if (s.rank == 0) LOG_I(TAG, "step %" PRId64 " val_loss %.4f", s.step, s.last_val);
        }
        if (stop_any) stopped_by = g_stop_signal ? g_stop_signal : SIGTERM;
        if (stop_any && s.rank == 0)
            LOG_W(TAG, "stop requested (%s): stopping after step %" PRId64 "%s",
                  g_stop_signal ? strsignal(g_stop_signal) : "on another rank", s.step,
                  s.engine ? " with a final snapshot" : "");
        int last = s.step == o.steps || stopped_by;
        if (o.ckpt_every > 0 && (s.step % o.ckpt_every == 0 || last)) {
            /* the last step's snapshot is never skipped: let the one in flight finish first */
            if (last && wait_engine(&s, 3600.0) == -ECONNRESET) goto out;
            if (take_snapshot(&s, last) < 0) goto out;
        }
        if (stopped_by) break;
    }
    if (s.val && !(o.eval_every > 0 && s.step % o.eval_every == 0 && !isnan(s.last_val)))
        s.last_val = eval_val(&s);
    int final_status = stopped_by ? 128 + stopped_by : 0;
    if (s.engine) {
        /* the last snapshot must be durable before we report success */
        rc = wait_engine(&s, 3600.0);
        if (rc == -ECONNRESET) goto out;
        ckpt_persist_stats ps;
        if (ckpt_engine_last(s.engine, &ps) == 0 && ps.step == (uint64_t)s.step && ps.result < 0) {
            LOG_E(TAG, "the snapshot of the last step %" PRId64 " failed: %s", s.step,
                  strerror(-ps.result));
            final_status = 1;
        }
        if (rc == -EINPROGRESS) {
            LOG_E(TAG, "the snapshot of step %" PRId64 " did not finish within an hour", s.step);
            final_status = 1;
        }
        uint64_t skipped = ckpt_engine_skipped(s.engine) + s.skipped;
        if (skipped && s.rank == 0)
            LOG_W(TAG, "%llu snapshots were skipped (policy skip)", (unsigned long long)skipped);
    }
    if (o.zero_stage == 3 && s.world > 1 && gather_range_hook(&s, 0, s.np) < 0) goto out;
    /* rank 0 keeps the store up until every rank is done with it */
    if (s.world > 1 && (rc = train_comm_barrier(s.comm)) < 0) {
        comm_failed(&s, "final barrier", rc);
        goto out;
    }
    if (s.rank == 0) {
        char digest[33];
        digest_hex(train_model_params(s.model), s.np, digest);
        printf("final step=%" PRId64 " loss=%.6f val_loss=%.6f params_digest=%s\n", s.step,
               s.last_loss, s.last_val, digest);
        fflush(stdout);
    }
    status = final_status;
out:
    if (status != 0 && status != 128 + SIGTERM && status != 128 + SIGINT)
        train_vote_abort(s.vote); /* no decision will come: unblock our persist */
    ckpt_engine_destroy(s.engine);
    train_vote_free(s.vote);
    ckpt_dir_lock_release(s.lock);
    train_comm_free(s.comm);
    elastic_store_server_stop(s.server);
    if (s.sample_fd >= 0) close(s.sample_fd);
    train_prefetch_free(s.prefetch);
    free(s.step_inputs);
    free(s.step_targets);
    train_tree_free(s.tree);
    free(s.m);
    free(s.v);
    free(s.gsum);
    free(s.gshard);
    free(s.blocks);
    free(s.xchg);
    free(s.losses);
    free(s.counts);
    free(s.step_samples);
    free(s.shard_bytes);
    free(s.shard_el);
    free(s.block_bytes);
    free(s.inputs);
    free(s.targets);
    train_model_free(s.model);
    train_dataset_close(s.train);
    train_dataset_close(s.val);
    return status;
}
