/* train: GPT-2 style decoder on the CPU backend with crash-safe snapshots and --resume.
 * Exit status: 0 success, 1 runtime failure, 2 usage or configuration error. */
#include "ckpt.h"
#include "config.h"
#include "data.h"
#include "log.h"
#include "model.h"
#include "optim.h"

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
    const char *data, *val_data, *ckpt_dir, *resume, *run_id;
    train_model_config model;
    int micro_batch, grad_accum, steps, eval_every, ckpt_every, val_samples, log_every;
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
    "  --grad-accum N        micro-batches per optimizer step (default 1)\n"
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
    "  -h, --help            this text\n"
    "\n"
    "SIGTERM/SIGINT: finish the step, take a final snapshot (with --ckpt-every), exit 128+sig.\n"
    "At the end it prints: final step=<n> loss=<x> val_loss=<y> params_digest=<xxh3-128 hex>\n"
    "(val_loss=nan without --val-data).\n"
    "Environment: OPENBLAS_NUM_THREADS/OPENBLAS_CORETYPE (pin them for bit-identical runs),\n"
    "CKPT_LOG_LEVEL=error|warn|info|debug.\n"
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
        O_POLICY, O_KEEPLAST, O_KEEPEVERY, O_OVERLAP
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
        case O_GA: bad = parse_int("--grad-accum", optarg, 1, 65536, &o->grad_accum); break;
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
        case 'h': fputs(usage_text, stdout); exit(0);
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
    if (o->run_id && !(strlen(o->run_id) >= 1 && strlen(o->run_id) <= 63 &&
                       strspn(o->run_id, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789_.-") == strlen(o->run_id))) {
        fprintf(stderr, "train: --run-id must be 1-63 characters of [A-Za-z0-9_.-]\n");
        return -1;
    }
    o->adam.total_steps = o->steps;
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
    float *m, *v, *gsum;
    double *blocks;
    train_tree *tree;
    int32_t *inputs, *targets;
    int64_t step;             /* completed optimizer steps */
    uint64_t samples;         /* samples consumed */
    ckpt_engine *engine;
    ckpt_dir_lock *lock;
    char run_id[64];
    char config_hash[17];
    double last_loss, last_val;
} state;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void digest_hex(const float *p, size_t n, char out[33])
{
    XXH128_hash_t h = XXH3_128bits(p, n * sizeof(float));
    snprintf(out, 33, "%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
}

static void make_config_hash(const options *o, char out[17])
{
    char buf[512];
    int n = snprintf(buf, sizeof buf,
                     "vocab=%d;seq_len=%d;n_layer=%d;n_embd=%d;n_head=%d;seed=%" PRIu64
                     ";global_batch=%d",
                     o->model.vocab, o->model.seq_len, o->model.n_layer, o->model.n_embd,
                     o->model.n_head, o->seed, o->micro_batch * o->grad_accum);
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

/* Validation loss: the first val_samples samples in file order, micro_batch at a time. */
static double eval_val(state *s)
{
    if (!s->val) return NAN;
    const int T = s->o->model.seq_len, b = s->o->micro_batch;
    uint64_t total = (uint64_t)s->o->val_samples;
    if (total > train_dataset_num_samples(s->val)) total = train_dataset_num_samples(s->val);
    double sum = 0.0;
    for (uint64_t i = 0; i < total; i += (uint64_t)b) {
        int n = (int)(total - i < (uint64_t)b ? total - i : (uint64_t)b);
        for (int k = 0; k < n; k++) {
            char why[512];
            if (train_dataset_sample(s->val, i + (uint64_t)k, s->inputs + (size_t)k * T,
                                     s->targets + (size_t)k * T, why, sizeof why) < 0) {
                LOG_E(TAG, "validation data: %s", why);
                return NAN;
            }
        }
        sum += train_model_forward(s->model, s->inputs, s->targets, n) * n;
    }
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
    char digest[33], dhash[17];
    digest_hex(train_model_params(s->model), train_model_num_params(s->model), digest);
    snprintf(dhash, sizeof dhash, "%016" PRIx64, train_dataset_hash(s->train));
    uint64_t n = train_dataset_num_samples(s->train);
    return json_pack(
        "{s:I, s:{s:i, s:i, s:i, s:i, s:i}, s:s, s:o, s:i, "
        "s:{s:s, s:f, s:f, s:i, s:i, s:f, s:f, s:f, s:f, s:f, s:I}, "
        "s:{s:i, s:i, s:i, s:i}, s:{s:I, s:I, s:I, s:I, s:I, s:s, s:i}, s:s, s:f}",
        "step", (json_int_t)s->step, "model", "vocab", o->model.vocab, "seq_len", o->model.seq_len,
        "n_layer", o->model.n_layer, "n_embd", o->model.n_embd, "n_head", o->model.n_head,
        "tensor_buffer", "params", "tensors", tensors, "num_params",
        (int)train_model_num_params(s->model), "optimizer", "type", "adamw", "lr", f2d(o->adam.lr),
        "min_lr_ratio", f2d(o->adam.min_lr_ratio), "warmup", o->adam.warmup, "total_steps",
        o->adam.total_steps, "beta1", f2d(o->adam.beta1), "beta2", f2d(o->adam.beta2), "eps",
        f2d(o->adam.eps), "weight_decay", f2d(o->adam.weight_decay), "grad_clip",
        f2d(o->adam.grad_clip), "t", (json_int_t)s->step, "batch", "micro_batch", o->micro_batch,
        "grad_accum", o->grad_accum, "world_size", 1, "global_batch", o->micro_batch * o->grad_accum,
        "data", "samples_consumed", (json_int_t)s->samples, "epoch", (json_int_t)(s->samples / n),
        "offset_in_epoch", (json_int_t)(s->samples % n), "seed", (json_int_t)o->seed, "num_samples",
        (json_int_t)n, "data_hash", dhash, "files", (int)train_dataset_num_files(s->train),
        "params_digest", digest, "loss", s->last_loss);
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

/* Stage a snapshot of the current state; the engine persists it in the background. */
static int take_snapshot(state *s)
{
    size_t np = train_model_num_params(s->model), bytes = np * sizeof(float);
    ckpt_buffer bufs[3] = {
        {"params", "f32", 4, bytes, 0, bytes, train_model_params(s->model)},
        {"adam_m", "f32", 4, bytes, 0, bytes, s->m},
        {"adam_v", "f32", 4, bytes, 0, bytes, s->v},
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
        return rc;
    }
    if (rc == 0)
        LOG_I(TAG, "snapshot step %" PRId64 " staged: stall %.1f ms for %.2f MiB; rss %.1f MiB",
              s->step, stall * 1e3, 3.0 * (double)bytes / 1048576.0, (double)rss_kib() / 1024.0);
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
    eo.keep_last = o->keep_last;
    eo.keep_every = (uint64_t)o->keep_every;
    eo.reserve_bytes = 3 * train_model_num_params(s->model) * sizeof(float);
    eo.overlap = o->overlap;
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

/* Load one snapshot. Returns 0, -EBADMSG (corrupt: try an older one), or -EINVAL
 * (incompatible: refuse), other -errno. why gets one line. */
static int load_snapshot(state *s, const char *path, char *why, size_t why_len)
{
    ckpt_snapshot *snap;
    int rc = ckpt_snapshot_open(&snap, path, why, why_len);
    if (rc < 0) return rc == -EPROTONOSUPPORT ? -EINVAL : rc;
    json_error_t jerr;
    json_t *tr = json_loads(ckpt_snapshot_trainer_json(snap), 0, &jerr);
    json_t *data = json_object_get(tr, "data");
    size_t np = train_model_num_params(s->model), bytes = np * sizeof(float);
    char diff[400];
    json_t *opt = json_object_get(tr, "optimizer");
    json_t *jstep = json_object_get(tr, "step"), *jsamples = json_object_get(data, "samples_consumed");
    json_t *jt = json_object_get(opt, "t");
    int64_t step = json_is_integer(jstep) ? json_integer_value(jstep) : -1;
    int64_t samples = json_is_integer(jsamples) ? json_integer_value(jsamples) : -1;
    int64_t t = json_is_integer(jt) ? json_integer_value(jt) : -1;
    const char *dh = json_string_value(json_object_get(data, "data_hash"));
    const char *digest = json_string_value(json_object_get(tr, "params_digest"));
    int64_t gb = json_integer_value(json_object_get(json_object_get(tr, "batch"), "global_batch"));
    int64_t seed = json_integer_value(json_object_get(data, "seed"));
    char mydh[17], got_digest[33];
    snprintf(mydh, sizeof mydh, "%016" PRIx64, train_dataset_hash(s->train));
    int dtypes_ok = 1;
    for (size_t i = 0; i < ckpt_snapshot_nbuffers(snap); i++) {
        ckpt_buffer_info bi;
        ckpt_snapshot_buffer_info(snap, i, &bi);
        if ((!strcmp(bi.name, "params") || !strcmp(bi.name, "adam_m") || !strcmp(bi.name, "adam_v")) &&
            (strcmp(bi.dtype, "f32") != 0 || bi.elem_bytes != 4))
            dtypes_ok = 0;
    }
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
    } else if (gb != s->o->micro_batch * s->o->grad_accum || seed != (int64_t)s->o->seed) {
        snprintf(why, why_len, "global batch or seed differs (snapshot %lld sequences, seed %lld; "
                 "now %d, %" PRIu64 ")", (long long)gb, (long long)seed,
                 s->o->micro_batch * s->o->grad_accum, s->o->seed);
        rc = -EINVAL;
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
    } else if ((rc = ckpt_snapshot_read(snap, "params", 0, bytes, train_model_params(s->model), why,
                                        why_len)) == 0 &&
               (rc = ckpt_snapshot_read(snap, "adam_m", 0, bytes, s->m, why, why_len)) == 0 &&
               (rc = ckpt_snapshot_read(snap, "adam_v", 0, bytes, s->v, why, why_len)) == 0) {
        digest_hex(train_model_params(s->model), np, got_digest);
        if (strcmp(got_digest, digest) != 0) {
            snprintf(why, why_len, "params digest %s differs from the recorded %s", got_digest, digest);
            rc = -EBADMSG;
        } else {
            warn_changed_hparams(tr, s->o);
            s->step = step;
            s->samples = (uint64_t)samples;
            snprintf(s->run_id, sizeof s->run_id, "%s", ckpt_snapshot_run_id(snap));
            json_t *loss = json_object_get(tr, "loss");
            s->last_loss = json_is_number(loss) ? json_number_value(loss) : NAN;
        }
    }
    json_decref(tr);
    ckpt_snapshot_close(snap);
    return rc;
}

static void fresh_start(state *s)
{
    size_t np = train_model_num_params(s->model);
    train_model_init_params(s->model, s->o->seed);
    memset(s->m, 0, np * sizeof(float));
    memset(s->v, 0, np * sizeof(float));
    s->step = 0;
    s->samples = 0;
    if (s->o->run_id) snprintf(s->run_id, sizeof s->run_id, "%s", s->o->run_id);
    else make_run_id(s->run_id);
}

/* Snapshot names already in the folder after the step we start from would collide with the
 * ones this run is about to save (and a later --resume auto would continue the other run).
 * Returns 0, or 2 with one line naming the newest one. */
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

/* Returns 0 (resumed or fresh), 1 runtime failure, 2 configuration error. */
static int resume(state *s)
{
    const options *o = s->o;
    char why[512];
    fresh_start(s);
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
        int rc = load_snapshot(s, o->resume, why, sizeof why);
        if (rc < 0) {
            LOG_E(TAG, "cannot resume from %s: %s", o->resume, why);
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
            rc = load_snapshot(s, path, why, sizeof why);
            if (rc == 0) {
                LOG_I(TAG, "resumed from %s at step %" PRId64 " (run %s)", path, s->step, s->run_id);
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
            fresh_start(s); /* the failed load may have overwritten part of the state */
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

/* ------------------------------------------------------------------ training */

static int train_step(state *s, double *loss_out, double *norm_out, float *lr_out)
{
    const options *o = s->o;
    const int T = o->model.seq_len, b = o->micro_batch, M = o->grad_accum;
    const size_t np = train_model_num_params(s->model);
    const float loss_scale = 1.0f / (float)((double)M * b * T);
    double *losses = malloc((size_t)M * sizeof(double));
    if (!losses) return -ENOMEM;
    train_tree_reset(s->tree);
    for (int j = 0; j < M; j++) {
        for (int k = 0; k < b; k++) {
            uint64_t kth = s->samples + (uint64_t)j * (uint64_t)b + (uint64_t)k;
            int64_t idx = train_dataset_order(s->train, o->seed, kth);
            if (idx < 0) {
                free(losses);
                return (int)idx;
            }
            char why[512];
            int sr = train_dataset_sample(s->train, (uint64_t)idx, s->inputs + (size_t)k * T,
                                          s->targets + (size_t)k * T, why, sizeof why);
            if (sr < 0) {
                LOG_E(TAG, "training data: %s", why);
                free(losses);
                return sr;
            }
        }
        losses[j] = train_model_forward(s->model, s->inputs, s->targets, b);
        train_model_backward(s->model, loss_scale);
        int pr = train_tree_push(s->tree, train_model_grads(s->model));
        if (pr < 0) {
            free(losses);
            return pr;
        }
    }
    train_tree_result(s->tree, s->gsum);
    double loss = train_tree_sum(losses, (size_t)M) / M;
    free(losses);
    train_block_sumsq(s->gsum, 0, np, s->blocks);
    double norm = sqrt(train_tree_sum(s->blocks, np / TRAIN_BLOCK));
    if (o->adam.grad_clip > 0 && norm > o->adam.grad_clip)
        train_scale(s->gsum, 0, np, (float)(o->adam.grad_clip / norm));
    float lr = train_lr_at(&o->adam, s->step);
    size_t nt;
    const train_tensor *tt = train_model_tensors(s->model, &nt);
    train_adamw_update(&o->adam, tt, nt, train_model_params(s->model), s->m, s->v, s->gsum, 0, np,
                       s->step + 1, lr);
    s->step++;
    s->samples += (uint64_t)M * (uint64_t)b;
    *loss_out = loss;
    *norm_out = norm;
    *lr_out = lr;
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
    if (parse_args(argc, argv, &o) < 0) return 2;
    openblas_set_num_threads(1);

    state s = {.o = &o, .last_loss = NAN, .last_val = NAN};
    char why[512] = "";
    int rc, status = 1;
    rc = train_dataset_open(&s.train, o.data, o.model.seq_len, o.model.vocab, why, sizeof why);
    if (rc < 0) {
        fprintf(stderr, "train: training data: %s\n", why);
        return rc == -ENOENT || rc == -EINVAL ? 2 : 1;
    }
    if (o.val_data) {
        rc = train_dataset_open(&s.val, o.val_data, o.model.seq_len, o.model.vocab, why, sizeof why);
        if (rc < 0) {
            fprintf(stderr, "train: validation data: %s\n", why);
            train_dataset_close(s.train);
            return rc == -ENOENT || rc == -EINVAL ? 2 : 1;
        }
    }
    make_config_hash(&o, s.config_hash);
    if (o.ckpt_dir) {
        struct stat st;
        int existed = stat(o.ckpt_dir, &st) == 0;
        long holder = 0;
        rc = ckpt_dir_lock_acquire(o.ckpt_dir, &s.lock, &holder);
        if (rc == -EBUSY) {
            fprintf(stderr, "train: snapshot folder %s is in use by another run (pid %ld); two runs "
                    "must not share a --ckpt-dir\n", o.ckpt_dir, holder);
            status = 2;
            goto out;
        }
        if (rc < 0) {
            fprintf(stderr, "train: cannot use %s as the snapshot folder: %s\n", o.ckpt_dir,
                    strerror(-rc));
            status = 2;
            goto out;
        }
        if (!existed && o.resume && !strcmp(o.resume, "auto"))
            LOG_W(TAG, "snapshot folder %s did not exist (created it): nothing to resume", o.ckpt_dir);
    }
    size_t T = (size_t)o.model.seq_len, b = (size_t)o.micro_batch;
    if ((rc = train_model_create(&s.model, &o.model, o.micro_batch)) < 0) {
        fprintf(stderr, "train: cannot create the model: %s\n", strerror(-rc));
        goto out;
    }
    size_t np = train_model_num_params(s.model);
    s.m = calloc(np, sizeof(float));
    s.v = calloc(np, sizeof(float));
    s.gsum = calloc(np, sizeof(float));
    s.blocks = calloc(np / TRAIN_BLOCK, sizeof(double));
    s.inputs = calloc(b * T, sizeof(int32_t));
    s.targets = calloc(b * T, sizeof(int32_t));
    if (!s.m || !s.v || !s.gsum || !s.blocks || !s.inputs || !s.targets ||
        train_tree_create(&s.tree, np, o.grad_accum) < 0) {
        fprintf(stderr, "train: out of memory for %zu parameters\n", np);
        goto out;
    }
    LOG_I(TAG, "model: %d layers, %d embd, %d heads, seq %d, vocab %d: %zu parameters (%zu padded); "
          "batch %d x %d sequences; data %llu tokens in %zu files (%llu samples)",
          o.model.n_layer, o.model.n_embd, o.model.n_head, o.model.seq_len, o.model.vocab,
          train_model_num_real(s.model), np, o.micro_batch, o.grad_accum,
          (unsigned long long)train_dataset_num_tokens(s.train), train_dataset_num_files(s.train),
          (unsigned long long)train_dataset_num_samples(s.train));
    int r = resume(&s);
    if (r != 0) {
        status = r;
        goto out;
    }
    if (o.ckpt_every > 0 && (r = check_no_later_snapshots(&s)) != 0) {
        status = r;
        goto out;
    }
    if (o.ckpt_every > 0 && make_engine(&s) < 0) goto out;
    install_stop_handlers();
    if (s.step >= o.steps)
        LOG_I(TAG, "already at step %" PRId64 " of %d: nothing to train", s.step, o.steps);
    int stopped_by = 0;
    while (s.step < o.steps) {
        double t0 = now_s(), loss = 0, norm = 0;
        float lr = 0;
        if ((rc = train_step(&s, &loss, &norm, &lr)) < 0) {
            LOG_E(TAG, "step %" PRId64 " failed: %s", s.step + 1, strerror(-rc));
            goto out;
        }
        double dt = now_s() - t0;
        s.last_loss = loss;
        if (!isfinite(loss)) {
            LOG_E(TAG, "step %" PRId64 ": loss is %f; stopping", s.step, loss);
            goto out;
        }
        if (s.step % o.log_every == 0 || s.step == o.steps)
            LOG_I(TAG, "step %" PRId64 "/%d loss %.4f lr %.3e grad_norm %.4f %.0f ms %.0f tok/s", s.step,
                  o.steps, loss, (double)lr, norm, dt * 1e3,
                  (double)(b * T * (size_t)o.grad_accum) / dt);
        if (o.eval_every > 0 && s.step % o.eval_every == 0 && s.val) {
            s.last_val = eval_val(&s);
            LOG_I(TAG, "step %" PRId64 " val_loss %.4f", s.step, s.last_val);
        }
        stopped_by = g_stop_signal;
        if (stopped_by)
            LOG_W(TAG, "received %s: stopping after step %" PRId64 "%s", strsignal(stopped_by), s.step,
                  s.engine ? " with a final snapshot" : "");
        int last = s.step == o.steps || stopped_by;
        if (o.ckpt_every > 0 && (s.step % o.ckpt_every == 0 || last)) {
            /* the last step's snapshot is never skipped: let the one in flight finish first */
            if (last) ckpt_engine_wait(s.engine, 3600.0);
            if (take_snapshot(&s) < 0) goto out;
        }
        if (stopped_by) break;
    }
    if (s.val && !(o.eval_every > 0 && s.step % o.eval_every == 0 && !isnan(s.last_val)))
        s.last_val = eval_val(&s);
    int final_status = stopped_by ? 128 + stopped_by : 0;
    if (s.engine) {
        /* the last snapshot must be durable before we report success */
        rc = ckpt_engine_wait(s.engine, 3600.0);
        ckpt_persist_stats ps;
        if (ckpt_engine_last(s.engine, &ps) == 0 && ps.step == (uint64_t)s.step && ps.result < 0) {
            LOG_E(TAG, "the snapshot of the last step %" PRId64 " failed: %s", s.step,
                  strerror(-ps.result));
            final_status = 1;
        }
        if (rc == -ETIMEDOUT) {
            LOG_E(TAG, "the snapshot of step %" PRId64 " did not finish within an hour", s.step);
            final_status = 1;
        }
        if (ckpt_engine_skipped(s.engine))
            LOG_W(TAG, "%llu snapshots were skipped (policy skip)",
                  (unsigned long long)ckpt_engine_skipped(s.engine));
    }
    char digest[33];
    digest_hex(train_model_params(s.model), np, digest);
    printf("final step=%" PRId64 " loss=%.6f val_loss=%.6f params_digest=%s\n", s.step, s.last_loss,
           s.last_val, digest);
    fflush(stdout);
    status = final_status;
out:
    ckpt_engine_destroy(s.engine);
    ckpt_dir_lock_release(s.lock);
    train_tree_free(s.tree);
    free(s.m);
    free(s.v);
    free(s.gsum);
    free(s.blocks);
    free(s.inputs);
    free(s.targets);
    train_model_free(s.model);
    train_dataset_close(s.train);
    train_dataset_close(s.val);
    return status;
}
