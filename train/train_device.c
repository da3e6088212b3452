/* train_device.c - the train program's backend: the device of --device, the kernel table of
 * --dtype, the device buffers of the rank state and their host views, the device collectives
 * of --reduce, and the sync points between device state and host view (see
 * train_internal.h). */
#include "dcomm.h"
#include "device.h"
#include "kern_cuda.h"
#include "kern_ops.h"
#include "log.h"
#include "model.h"
#include "train_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TAG "train"

static int is_cpu(const state *s) { return train_device_kind_of(s->dev) == TRAIN_DEVICE_CPU; }

int train_device_setup(state *s)
{
    const options *o = s->o;
    const char *text = o->device ? o->device : "cpu";
    train_device_kind kind;
    int ordinal = 0;
    if (train_device_parse(text, &kind, &ordinal) < 0) {
        fprintf(stderr, "train: --device: '%s' is not cpu, cuda or cuda:N\n", text);
        return 2;
    }
    if (kind == TRAIN_DEVICE_CUDA && !strcmp(text, "cuda")) {
        /* one GPU per local rank, as torchrun's convention */
        const char *lr = getenv("LOCAL_RANK");
        char *end;
        long v = lr && *lr ? strtol(lr, &end, 10) : 0;
        if (lr && *lr && (*end || v < 0 || v > 4095)) {
            fprintf(stderr, "train: --device cuda: LOCAL_RANK '%.40s' is not a GPU number\n", lr);
            return 2;
        }
        ordinal = (int)v;
    }
    char why[512] = "";
    int rc = train_device_open(&s->dev, kind, ordinal, why, sizeof why);
    if (rc < 0) {
        if (rc == -ENOTSUP && !why[0])
            snprintf(why, sizeof why, "--device %s: this build has no CUDA (nvcc was not found "
                     "when it was configured)", text);
        else if (!why[0])
            snprintf(why, sizeof why, "--device %s: %s", text, strerror(-rc));
        fprintf(stderr, "train: %s\n", why);
        return rc == -ENOMEM ? 1 : 2;
    }
    if (kind == TRAIN_DEVICE_CPU) {
        rc = kern_cpu_ops_init(&s->ops, o->bf16);
    } else {
        void *stream = train_stream_native(train_device_compute_stream(s->dev));
        rc = kern_cuda_ops_init(&s->ops, stream, o->bf16);
    }
    if (rc < 0) {
        fprintf(stderr, "train: --device %s: cannot set up the %s kernels: %s\n", text,
                kind == TRAIN_DEVICE_CPU ? "CPU" : "CUDA", strerror(-rc));
        return rc == -ENOMEM || rc == -EIO ? 1 : 2;
    }
    s->ops_ready = 1;
    return 0;
}

/* Device memory of `bytes` (zeroed) into *p; -ENOMEM logged by the caller. */
static int dalloc(state *s, void *p, size_t bytes)
{
    void *q = NULL;
    int rc = train_device_alloc(s->dev, &q, bytes ? bytes : 1);
    *(void **)p = q;
    return rc;
}

static int halloc(state *s, void *p, size_t bytes)
{
    void *q = NULL;
    int rc = train_host_alloc_pinned(s->dev, &q, bytes ? bytes : 1);
    *(void **)p = q;
    return rc;
}

int train_state_alloc(state *s)
{
    const options *o = s->o;
    const size_t no = s->ohi - s->olo;
    int rc = 0;
    if ((rc = dalloc(s, &s->dm, (no + 1) * sizeof(float))) < 0 ||
        (rc = dalloc(s, &s->dv, (no + 1) * sizeof(float))) < 0 ||
        (rc = dalloc(s, &s->gsum, s->np * sizeof(float))) < 0 ||
        (o->zero_stage >= 2 && (rc = dalloc(s, &s->gshard, (s->hi - s->lo + 1) * sizeof(float))) < 0) ||
        (rc = dalloc(s, &s->dblocks, (no / TRAIN_BLOCK + 1) * sizeof(double))) < 0) {
        LOG_E(TAG, "out of %s memory for %zu parameters", is_cpu(s) ? "host" : "device", s->np);
        return rc;
    }
    if (is_cpu(s)) {
        s->m = s->dm;
        s->v = s->dv;
        s->params_host = train_model_params(s->model);
    } else if ((rc = halloc(s, &s->m, (no + 1) * sizeof(float))) < 0 ||
               (rc = halloc(s, &s->v, (no + 1) * sizeof(float))) < 0 ||
               (rc = halloc(s, &s->params_host, s->np * sizeof(float))) < 0) {
        LOG_E(TAG, "out of pinned host memory for the host copy of %zu parameters", s->np);
        return rc;
    }
    train_dcomm_mode mode = o->reduce_ring && !is_cpu(s) ? TRAIN_DCOMM_RING : TRAIN_DCOMM_TREE;
    if ((rc = train_dcomm_create(&s->dcomm, s->comm, s->dev, &s->ops, NULL, mode,
                                 o->comm_timeout)) < 0) {
        LOG_E(TAG, "rank %d cannot set up the device collectives: %s", s->rank, strerror(-rc));
        return rc;
    }
    return 0;
}

void train_backend_log(const state *s)
{
    const options *o = s->o;
    if (s->rank != 0 || !s->dev) return;
    int ring = o->reduce_ring && !is_cpu(s);
    if (o->reduce_ring && !ring)
        LOG_I(TAG, "--reduce ring needs NCCL (--device cuda): the CPU backend reduces with the "
              "deterministic tree");
    LOG_I(TAG, "backend: device %s, dtype %s, kernels %s, reduce %s (collectives: %s)",
          train_device_describe(s->dev), o->bf16 ? "bf16 (fp32 master state)" : "fp32",
          s->ops.name, ring ? "ring" : "tree", s->dcomm ? train_dcomm_describe(s->dcomm) : "-");
}

void train_state_free(state *s)
{
    train_dcomm_free(s->dcomm);
    s->dcomm = NULL;
    if (!s->dev) return;
    if (!is_cpu(s)) {
        train_host_free_pinned(s->dev, s->m);
        train_host_free_pinned(s->dev, s->v);
        train_host_free_pinned(s->dev, s->params_host);
    }
    s->m = s->v = s->params_host = NULL;
    train_device_free(s->dev, s->dm);
    train_device_free(s->dev, s->dv);
    train_device_free(s->dev, s->gsum);
    train_device_free(s->dev, s->gshard);
    train_device_free(s->dev, s->dblocks);
    s->dm = s->dv = s->gsum = s->gshard = NULL;
    s->dblocks = NULL;
}

/* Free the table and the device last (after the model, which uses both). */
void train_device_teardown(state *s)
{
    if (s->ops_ready) {
        if (s->dev && train_device_kind_of(s->dev) != TRAIN_DEVICE_CPU) kern_cuda_ops_free(&s->ops);
        else kern_cpu_ops_free(&s->ops);
        s->ops_ready = 0;
    }
    train_device_close(s->dev);
    s->dev = NULL;
}

/* One copy of the state between device and host view. */
static int sync_state(state *s, train_copy_kind kind)
{
    if (!s->dev || is_cpu(s)) return 0;
    const size_t no = s->ohi - s->olo;
    float *dp = train_model_params(s->model);
    struct {
        float *d, *h;
        size_t n;
        const char *name;
    } part[3] = {{dp, s->params_host, s->np, "params"},
                 {s->dm, s->m, no, "adam_m"},
                 {s->dv, s->v, no, "adam_v"}};
    for (int i = 0; i < 3; i++) {
        int rc = kind == TRAIN_COPY_D2H
                     ? train_device_copy(s->dev, part[i].h, part[i].d, part[i].n * sizeof(float), kind)
                     : train_device_copy(s->dev, part[i].d, part[i].h, part[i].n * sizeof(float), kind);
        if (rc < 0) {
            LOG_E(TAG, "rank %d, step %" PRId64 ": copy of %s %s failed: %s", s->rank, s->step,
                  part[i].name, kind == TRAIN_COPY_D2H ? "to the host" : "to the device",
                  strerror(-rc));
            return rc;
        }
    }
    return 0;
}

int train_state_to_host(state *s) { return sync_state(s, TRAIN_COPY_D2H); }

int train_state_to_host_async(state *s, train_stream *st)
{
    if (!s->dev || is_cpu(s)) return 0;
    const size_t no = s->ohi - s->olo;
    int rc = train_stream_copy_async(st, s->params_host, train_model_params(s->model),
                                     s->np * sizeof(float), TRAIN_COPY_D2H);
    if (rc == 0) rc = train_stream_copy_async(st, s->m, s->dm, no * sizeof(float), TRAIN_COPY_D2H);
    if (rc == 0) rc = train_stream_copy_async(st, s->v, s->dv, no * sizeof(float), TRAIN_COPY_D2H);
    if (rc < 0)
        LOG_E(TAG, "rank %d, step %" PRId64 ": queueing the copy of the state to the host failed: %s",
              s->rank, s->step, strerror(-rc));
    return rc;
}
int train_state_to_device(state *s) { return sync_state(s, TRAIN_COPY_H2D); }
