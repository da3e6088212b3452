/* train: GPT-2 style decoder on the CPU or CUDA backend (--device, --dtype) with crash-safe
 * snapshots and --resume.
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
#include "stage.h"
#include "train_internal.h"
#include "vote.h"

#include <cblas.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TAG "train"

/* OpenBLAS's own call (cblas.h of libopenblas); pins GEMMs to one thread per process. */
void openblas_set_num_threads(int num_threads);

/* ------------------------------------------------------------------ signals */

/* SIGTERM/SIGINT (a scheduler's preemption notice, Ctrl-C): finish the step in progress, take
 * a final snapshot, print the final line and exit 128 + signal. */
volatile sig_atomic_t train_stop_signal;
volatile sig_atomic_t train_stop_count; /* stop signals received, all of them */

/* The first stop request decides (a SIGINT after a SIGTERM does not turn exit 143 into
 * 130); the handlers block each other, so the test and the store cannot interleave.
 * sigpending and sigismember are async-signal-safe (POSIX). */
static void on_stop_signal(int sig)
{
    train_stop_count++;
    if (train_stop_signal) return;
    /* SIGTERM and SIGINT pending together (sent in a row before this process ran) are
     * delivered lowest number first, SIGINT, whatever the order they were sent in: the
     * preemption notice, SIGTERM, counts then */
    sigset_t pending;
    if (sig == SIGINT && sigpending(&pending) == 0 && sigismember(&pending, SIGTERM)) sig = SIGTERM;
    train_stop_signal = sig;
}

static void install_stop_handlers(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
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
    o.s3_signature = OBJSTORE_SIG_V4;
    o.s3_part_bytes = CKPT_S3_PART_BYTES_DEFAULT;
    o.s3_backlog = 2;
    o.s3_attempts = 6;
    o.s3_timeout = 60.0;
    o.s3_snapshot_timeout = 1800.0;
    o.s3_lag_warn = 1800.0;
    o.s3_drain_timeout = 600.0;
    o.mem_every = -1;
    o.mem_async = -1;
    static train_ds_config dc;
    signal(SIGPIPE, SIG_IGN); /* a gone launcher pipe is an EPIPE, not a death */
    if (train_read_config(argc, argv, &o, &dc) < 0) return 2;
    if (train_parse_args(argc, argv, &o) < 0) return 2;
    /* the agent runs the worker command once more after a failure or on preemption, with
     * CKPT_MEM_FLUSH=1: persist the newest memory snapshot, nothing else (train_mem.c) */
    const char *flush = getenv("CKPT_MEM_FLUSH");
    if (flush && *flush && strcmp(flush, "0") != 0 && strcmp(flush, "1") != 0) {
        /* a typo (=2, =yes) must not start a full training run in the agent's flush slot */
        fprintf(stderr, "train: CKPT_MEM_FLUSH='%.40s' is not 0 or 1 (1 = flush mode, unset, empty "
                "or 0 = train)\n", flush);
        return 2;
    }
    if (flush && !strcmp(flush, "1")) return train_mem_flush_main(&o);
    openblas_set_num_threads(1);

    state s = {.o = &o, .last_loss = NAN, .last_val = NAN, .sample_fd = -1, .world = 1,
               .s3_newest = -1};
    int rc, status = 1;
    /* join the group first, so that a rank that cannot start tells the others at once
     * (train_startup_agree) instead of leaving them waiting for it */
    if ((status = train_dist_init(&s)) != 0) goto out;
    if (train_report_open(&s.report, s.rank) < 0) goto out;
    status = train_startup_agree(&s, train_startup_local(&s));
    if (status != 0) goto out;
    status = 1;
    size_t T = (size_t)o.model.seq_len, b = (size_t)o.micro_batch;
    if ((rc = train_model_create_on(&s.model, &o.model, o.micro_batch, s.dev, &s.ops)) < 0) {
        fprintf(stderr, "train: cannot create the model: %s\n", strerror(-rc));
        goto out;
    }
    if (train_plan_shards(&s) < 0) goto out;
    if (train_state_alloc(&s) < 0) goto out; /* logged */
    /* pinned (the D2H copy of the block norms lands here): see train_host_alloc_pinned */
    if (train_host_alloc_pinned(s.dev, (void **)&s.blocks, s.nb * sizeof(double)) < 0)
        s.blocks = NULL;
    s.inputs = calloc(b * T, sizeof(int32_t));
    s.targets = calloc(b * T, sizeof(int32_t));
    if (!s.blocks || !s.inputs || !s.targets) {
        fprintf(stderr, "train: out of memory for %zu parameters\n", s.np);
        goto out;
    }
    if (o.zero_stage == 3 && s.world > 1) train_model_set_param_hook(s.model, train_gather_range_hook, &s);
    if ((status = train_mem_plan(&s)) != 0) goto out;
    status = 1;
    double t_resume = clock_now_s();
    int r = train_resume(&s);
    if (r != 0) {
        status = r;
        goto out;
    }
    /* a fresh start's state is in the host view; a resumed one is on the device already */
    if (!s.state_on_device && train_state_to_device(&s) < 0) goto out; /* logged */
    if (s.rank == 0) {
        double restore_s = clock_now_s() - t_resume;
        if (o.tensorboard_dir) train_report_tensorboard(s.report, o.tensorboard_dir); /* logged */
        train_report_restore(s.report, s.step, restore_s,
                             s.step == 0 ? "none" : s.mem_restored ? "memory" :
                             s.s3_restored[0] ? "s3" : "disk");
    }
    (void)train_mem_open(&s); /* after the resume, which may read the segment (logged) */
    const int64_t start_step = s.step;
    train_make_config_hash(&s, s.config_hash);
    s.xchg = calloc((size_t)s.world * (size_t)(s.grad_accum + 1), sizeof(double));
    s.losses = calloc((size_t)s.world * (size_t)s.grad_accum, sizeof(double));
    s.step_samples = calloc((size_t)s.grad_accum * b, sizeof(uint64_t));
    s.step_inputs = calloc((size_t)s.grad_accum * b * T, sizeof(int32_t));
    s.step_targets = calloc((size_t)s.grad_accum * b * T, sizeof(int32_t));
    if (!s.xchg || !s.losses || !s.step_samples || !s.step_inputs || !s.step_targets ||
        train_tree_create_on(&s.tree, s.np, s.grad_accum, s.dev, &s.ops) < 0) {
        fprintf(stderr, "train: out of memory for %zu parameters\n", s.np);
        goto out;
    }
    if ((rc = train_prefetch_create(&s.prefetch, s.train, o.seed, o.model.seq_len,
                                    s.grad_accum * o.micro_batch, (uint64_t)s.global_batch, 2)) < 0) {
        fprintf(stderr, "train: cannot start the data prefetch thread: %s\n", strerror(-rc));
        goto out;
    }
    train_backend_log(&s);
    if (s.rank == 0)
        LOG_I(TAG, "model: %d layers, %d embd, %d heads, seq %d, vocab %d: %zu parameters (%zu "
              "padded); world size %d, ZeRO stage %d, global batch %d = %d ranks x %d micro-batches "
              "x %d sequences; data %llu tokens in %zu files (%llu samples)",
              o.model.n_layer, o.model.n_embd, o.model.n_head, o.model.seq_len, o.model.vocab,
              train_model_num_real(s.model), s.np, s.world, o.zero_stage, s.global_batch, s.world,
              s.grad_accum, o.micro_batch,
              (unsigned long long)train_dataset_num_tokens(s.train), train_dataset_num_files(s.train),
              (unsigned long long)train_dataset_num_samples(s.train));
    if (s.rank == 0) {
        train_model_mem mm;
        train_model_memory(s.model, &mm);
        const double mib = 1048576.0;
        LOG_I(TAG, "model memory on %s: parameters + gradients %.1f MiB, bf16 working parameters "
              "%.1f MiB, activations %.1f MiB (micro-batch %d) + their gradients %.1f MiB, "
              "scratch %.1f MiB", train_device_describe(s.dev), mm.params / mib, mm.working / mib,
              mm.acts / mib, o.micro_batch, mm.act_grads / mib, mm.other / mib);
    }
    if (o.sample_log) {
        /* a log file: a FIFO would block the open (no reader) or the training (a slow one) */
        s.sample_fd = open(o.sample_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK,
                           0644);
        struct stat st;
        int e = s.sample_fd < 0 ? errno : fstat(s.sample_fd, &st) != 0 ? errno
                                        : !S_ISREG(st.st_mode) ? ENODEV : 0;
        if (e == 0 && fcntl(s.sample_fd, F_SETFL, O_APPEND) != 0) e = errno;
        if (e) {
            LOG_E(TAG, "--sample-log %s: %s", o.sample_log,
                  e == ENODEV || e == ENXIO ? "not a regular file" : strerror(e));
            status = 2;
            goto out;
        }
    }
    if (o.s3 && train_s3_start(&s) < 0) goto out;
    if (o.ckpt_every > 0 && train_make_engine(&s) < 0) goto out;
    /* asynchronous memory snapshots without disk ones need the copy stream too */
    if (s.mem_every > 0 && s.mem_async && train_make_stager(&s) < 0) goto out;
    install_stop_handlers();
    if (s.step >= o.steps && s.rank == 0)
        LOG_I(TAG, "already at step %" PRId64 " of %d: nothing to train", s.step, o.steps);
    int stopped_by = 0;
    while (s.step < o.steps) {
        double t0 = clock_now_s(), loss = 0, norm = 0;
        float lr = 0;
        int stop_any = 0;
        s.stage_wait_s = 0;
        if ((rc = train_step(&s, &loss, &norm, &lr, &stop_any)) < 0) {
            goto out; /* train_step logged the reason */
        }
        double dt = clock_now_s() - t0;
        double tps = (double)(b * T * (size_t)s.global_batch / b) / dt;
        /* the report's step time leaves out the snapshot's wait, reported as a stall
         * (snapshot_wait) so that goodput counts it once; the log line shows the wall time */
        double dt_r = dt - s.stage_wait_s > 0 ? dt - s.stage_wait_s : 0;
        double tps_r = dt_r > 0 ? (double)(b * T * (size_t)s.global_batch / b) / dt_r : tps;
        if (s.rank == 0)
            train_report_step(s.report, s.step, dt_r, loss, (double)lr, norm, tps_r, s.samples);
        else train_report_step(s.report, s.step, dt_r, NAN, NAN, NAN, NAN, 0);
        if (s.engine) train_poll_persists(&s);
        s.last_loss = loss;
        if (!isfinite(loss)) {
            LOG_E(TAG, "step %" PRId64 ": loss is %f; stopping", s.step, loss);
            goto out;
        }
        if (s.rank == 0 && (s.step % o.log_every == 0 || s.step == o.steps))
            LOG_I(TAG, "step %" PRId64 "/%d loss %.4f lr %.3e grad_norm %.4f %.0f ms %.0f tok/s", s.step,
                  o.steps, loss, (double)lr, norm, dt * 1e3, tps);
        if (o.eval_every > 0 && s.step % o.eval_every == 0 && s.val) {
            s.last_val = train_eval_val(&s);
            if (s.rank == 0) {
                LOG_I(TAG, "step %" PRId64 " val_loss %.4f", s.step, s.last_val);
                train_report_val(s.report, s.step, s.last_val);
            }
        }
        if (stop_any) stopped_by = train_stop_signal ? train_stop_signal : SIGTERM;
        if (stop_any && s.rank == 0)
            LOG_W(TAG, "stop requested (%s): stopping after step %" PRId64 "%s",
                  train_stop_signal ? strsignal(train_stop_signal) : "on another rank", s.step,
                  s.engine ? " with a final snapshot" : "");
        int last = s.step == o.steps || stopped_by;
        if (o.ckpt_every > 0 && (s.step % o.ckpt_every == 0 || last)) {
            /* the last step's snapshot is never skipped: let the one in flight finish first */
            if (last && train_wait_engine(&s, 3600.0) == -ECONNRESET) goto out;
            if (train_take_snapshot(&s, last) < 0) goto out; /* with the memory snapshot */
        } else if (s.mem_every > 0 && s.step % s.mem_every == 0 && train_mem_take(&s) < 0) {
            goto out;
        }
        if (stopped_by) break;
    }
    if (s.val && !(o.eval_every > 0 && s.step % o.eval_every == 0 && !isnan(s.last_val))) {
        s.last_val = train_eval_val(&s);
        /* a run that trained nothing reports nothing: the val_loss of its step is the
         * earlier run's (a second value at one step would show twice in TensorBoard) */
        if (s.rank == 0 && s.step > start_step) train_report_val(s.report, s.step, s.last_val);
    }
    /* the last asynchronous memory snapshot is committed before the end (with an engine,
     * its wait below does it) */
    if (!s.engine && train_wait_stage_copies(&s) < 0) goto out;
    int final_status = stopped_by ? 128 + stopped_by : 0;
    if (s.engine) {
        /* the last snapshot must be durable before we report success */
        rc = train_wait_engine(&s, 3600.0);
        if (rc == -ECONNRESET) goto out;
        train_poll_persists(&s);
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
    /* the last snapshot goes to S3 before the end (bounded by --s3-drain-timeout); every rank
     * has voted when this returns, so rank 0's store is no longer needed for it */
    if (s.uploader) train_s3_finish(&s, 1);
    if (o.zero_stage == 3 && s.world > 1 && train_gather_range_hook(&s, 0, s.np) < 0) goto out;
    /* rank 0 keeps the store up until every rank is done with it */
    if (s.world > 1 && (rc = train_comm_barrier(s.comm)) < 0) {
        train_comm_failed(&s, "final barrier", rc);
        goto out;
    }
    if (train_state_to_host(&s) < 0) goto out; /* logged */
    if (s.rank == 0) {
        char digest[33];
        train_digest_hex(s.params_host, s.np, digest);
        printf("final step=%" PRId64 " loss=%.6f val_loss=%.6f params_digest=%s\n", s.step,
               s.last_loss, s.last_val, digest);
        fflush(stdout);
    }
    status = final_status;
out:
    if (status != 0 && status != 128 + SIGTERM && status != 128 + SIGINT)
        train_vote_abort(s.vote); /* no decision will come: unblock our persist */
    ckpt_engine_destroy(s.engine); /* before the segment goes: a persist may read a slot */
    train_stager_destroy(s.stager); /* after the engine, which unpins its staging through it */
    train_digest_stop(&s); /* after the stager: no host function of its stream can come */
    train_stage_discard(&s); /* a pending stage's record, on an error exit */
    train_mem_close(&s);
    train_s3_finish(&s, 0);
    train_report_close(s.report);
    train_vote_free(s.vote);
    ckpt_dir_lock_release(s.lock);
    train_tree_free(s.tree);
    s.tree = NULL;
    train_state_free(&s); /* the device buffers and collectives, before the comm */
    train_comm_free(s.comm);
    elastic_store_server_stop(s.server);
    if (s.sample_fd >= 0) close(s.sample_fd);
    train_prefetch_free(s.prefetch);
    free(s.step_inputs);
    free(s.step_targets);
    if (s.blocks) train_host_free_pinned(s.dev, s.blocks);
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
    train_device_teardown(&s); /* the kernel table and the device, after the model */
    train_dataset_close(s.train);
    train_dataset_close(s.val);
    return status;
}
