/* train_step.c - the train program's collectives over the rank state, the optimizer step and
 * validation (see train_internal.h). */
#include "comm.h"
#include "data.h"
#include "log.h"
#include "model.h"
#include "optim.h"
#include "prefetch.h"
#include "train_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TAG "train"

/* A collective failed: one line naming the rank, the step and the reason. */
void train_comm_failed(const state *s, const char *what, int rc)
{
    LOG_E(TAG, "rank %d, step %" PRId64 ": %s failed: %s%s", s->rank, s->step + 1, what,
          strerror(-rc),
          rc == -ECONNRESET || rc == -EPIPE ? " (a rank died or left the group)"
          : rc == -ETIMEDOUT ? " (a rank stopped answering; see --comm-timeout)" : "");
}

/* All-gather of one record of len bytes per rank: the caller has put its own record at
 * all + rank x len; on return all holds every rank's, in rank order (W x len bytes).
 * Uses s->counts. Returns 0 or the collective's error (not logged here). */
int train_gather_records(state *s, void *all, size_t len)
{
    for (int r = 0; r < s->world; r++) s->counts[r] = len;
    return train_comm_all_gather(s->comm, (char *)all + (size_t)s->rank * len, all, s->counts);
}

/* All-gather of every rank's params shard into the full buffer (stages 1-3), over device
 * memory (dcomm). */
int train_gather_params(state *s)
{
    if (s->world == 1 || s->o->zero_stage == 0) return 0;
    float *p = train_model_params(s->model);
    int rc = train_dcomm_all_gather(s->dcomm, p + s->lo, p, s->shard_bytes);
    if (rc < 0) train_comm_failed(s, "all-gather of parameters", rc);
    return rc;
}

/* ZeRO-3 hook of the model: before layer group [lo, hi) (elements) is used in forward or
 * backward, gather it from the ranks that own its pieces. */
int train_gather_range_hook(void *ctx, size_t lo, size_t hi)
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
    int rc = train_dcomm_all_gather(s->dcomm, p + mine, p + lo, s->counts);
    if (rc < 0) train_comm_failed(s, "layer all-gather (ZeRO-3)", rc);
    return rc;
}

/* Validation loss: the first val_samples samples in file order, in chunks of micro_batch;
 * the chunks are split over the ranks in contiguous runs and their sums added in chunk order,
 * so the result has the same bits at every world size. NaN on failure. */
double train_eval_val(state *s)
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
        if (train_gather_range_hook(s, 0, s->np) < 0) failed = 1;
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
    if (zero3) train_model_set_param_hook(s->model, train_gather_range_hook, s);
    double sum = NAN;
    if (!failed) {
        for (int r = 0; r < s->world; r++)
            s->counts[r] = (nchunks * (size_t)(r + 1) / (size_t)s->world -
                            nchunks * (size_t)r / (size_t)s->world) * sizeof(double);
        int rc = s->world > 1 ? train_comm_all_gather(s->comm, sums + c0, sums, s->counts) : 0;
        if (rc < 0) train_comm_failed(s, "all-gather of validation losses", rc);
        else {
            sum = 0.0;
            for (size_t c = 0; c < nchunks; c++) sum += sums[c];
        }
    }
    free(sums);
    return sum / (double)total;
}

/* ------------------------------------------------------------------ training */

/* One optimizer step (DESIGN section 3): forward/backward over this rank's micro-batches
 * [rank x A, (rank + 1) x A) of the step's M = A x W -> reduce gradients (all-reduce at
 * stages 0-1, reduce-scatter at 2-3) -> global norm over fixed blocks -> clip -> AdamW on the
 * owned range -> all-gather of parameters (stages 1-2; stage 3 gathers layer by layer in the
 * next forward). *stop_any: some rank received SIGTERM/SIGINT before this step's exchange. */
int train_step(state *s, double *loss_out, double *norm_out, float *lr_out, int *stop_any)
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
    const kern_ops *K = &s->ops;
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
    if ((rc = train_model_copy_status(s->model)) < 0) {
        LOG_E(TAG, "rank %d, step %" PRId64 ": a copy between host and device failed: %s", s->rank,
              s->step + 1, strerror(-rc));
        return rc;
    }
    /* losses of all M micro-batches and the ranks' stop flags, in one exchange */
    mine[A] = train_stop_signal ? 1.0 : 0.0;
    if (W > 1) {
        if ((rc = train_gather_records(s, s->xchg, (size_t)(A + 1) * sizeof(double))) < 0) {
            train_comm_failed(s, "all-gather of losses", rc);
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
    /* gradients: the sum over ranks of their subtrees, in the fixed rank tree (device
     * collectives; --reduce ring on NCCL: NCCL's order) */
    float *grad; /* the gradient of [olo, ohi) (device memory) */
    if (o->zero_stage <= 1) {
        if (W > 1 && (rc = train_dcomm_all_reduce_f32(s->dcomm, s->gsum, np)) < 0) {
            train_comm_failed(s, "all-reduce of gradients", rc);
            return rc;
        }
        grad = s->gsum + s->olo;
    } else {
        if (W > 1) {
            if ((rc = train_dcomm_reduce_scatter_f32(s->dcomm, s->gsum, s->gshard, s->shard_el)) < 0) {
                train_comm_failed(s, "reduce-scatter of gradients", rc);
                return rc;
            }
        } else {
            K->copy(K->ctx, s->gshard, s->gsum, np);
        }
        grad = s->gshard;
    }
    /* global norm over fixed blocks, whatever the sharding: the block sums on the device,
     * copied to the host, gathered and summed there in the fixed tree */
    const size_t no = s->ohi - s->olo;
    K->block_sumsq(K->ctx, grad, no, s->dblocks);
    if ((rc = train_device_copy(s->dev, s->blocks + s->olo / TRAIN_BLOCK, s->dblocks,
                                no / TRAIN_BLOCK * sizeof(double), TRAIN_COPY_D2H)) < 0) {
        LOG_E(TAG, "rank %d, step %" PRId64 ": copy of the gradient norms to the host failed: %s",
              s->rank, s->step + 1, strerror(-rc));
        return rc;
    }
    if (W > 1 && o->zero_stage > 0) {
        double *mineb = s->blocks + s->lo / TRAIN_BLOCK;
        if ((rc = train_comm_all_gather(s->comm, mineb, s->blocks, s->block_bytes)) < 0) {
            train_comm_failed(s, "all-gather of gradient norms", rc);
            return rc;
        }
    }
    double norm = sqrt(train_tree_sum(s->blocks, s->nb));
    if (o->adam.grad_clip > 0 && norm > o->adam.grad_clip)
        K->scale(K->ctx, grad, no, (float)(o->adam.grad_clip / norm));
    float lr = train_lr_at(&o->adam, s->step);
    size_t nt;
    const train_tensor *tt = train_model_tensors(s->model, &nt);
    /* the update overwrites what the last snapshot's copies may still be reading */
    if ((rc = train_wait_stage_copies(s)) < 0) return rc;
    train_adamw_update_ops(K, &o->adam, tt, nt, train_model_params(s->model) + s->olo, s->dm, s->dv,
                           grad, s->olo, s->ohi, s->step + 1, lr);
    /* the kernels' first failure (CUDA launch, cuBLAS, bf16 scratch), once per step */
    if ((rc = K->status(K->ctx)) < 0) {
        LOG_E(TAG, "rank %d, step %" PRId64 ": the %s kernels failed: %s", s->rank, s->step + 1,
              K->name, strerror(-rc));
        return rc;
    }
    if (o->zero_stage != 3 && (rc = train_gather_params(s)) < 0) return rc;
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
