/* model.h - GPT-2 style decoder over flat fp32 buffers, on a kernel table (kern_ops.h) and a
 * device (device.h): the CPU backend (fp32, or bf16 GEMM operands) or CUDA.
 *
 * Parameters live in one flat, padded fp32 buffer described by a tensor table (name, shape,
 * offset in elements). Gradients and Adam moments use the same layout. Tensors are laid out
 * layer by layer (wte, wpe, then h.<l>.* for each layer, then ln_f.*), each starting at a
 * multiple of 16 elements; the total is padded to a multiple of TRAIN_BLOCK elements so that
 * fixed reduction blocks and whole-block shards tile the buffer (DESIGN section 4). Padding
 * stays zero. Names follow Hugging Face's GPT-2 (with nn.Linear (out, in) weight layout).
 *
 * Thread-safety: a model is used by one thread at a time.
 */
#ifndef TRAIN_MODEL_H
#define TRAIN_MODEL_H

#include "device.h"
#include "kern_ops.h"

#include <stddef.h>
#include <stdint.h>

/* Elements per reduction block of the flat space (grad norm, digests, shards). */
#define TRAIN_BLOCK 2048

typedef struct train_model_config {
    int vocab;   /* vocabulary size V; [2, 65536]; 256 for byte-level data */
    int seq_len; /* context length T (max positions); [1, 8192] */
    int n_layer; /* [1, 256] */
    int n_embd;  /* C; [n_head, 65536], divisible by n_head */
    int n_head;  /* NH; [1, 256] */
} train_model_config;

/* Check ranges; on error write a one-line reason into why (may be NULL). -EINVAL if bad. */
int train_model_config_check(const train_model_config *c, char *why, size_t why_len);

enum { TRAIN_MAX_DIMS = 4 };

typedef struct train_tensor {
    char name[48];
    int ndim;
    int64_t shape[TRAIN_MAX_DIMS];
    size_t offset; /* first element in the flat buffer */
    size_t numel;
    int decay;     /* 1: AdamW weight decay applies (matrices and embeddings); 0: gains, biases */
} train_tensor;

typedef struct train_model train_model;

/* Create a model for micro-batches of up to `micro_batch` sequences of config->seq_len tokens:
 * computes the tensor table, allocates parameters, gradients and activations (owned by the
 * model). Parameters are not initialised (see train_model_init_params).
 * Errors: -EINVAL bad config or micro_batch < 1, -ENOMEM. */
int train_model_create(train_model **out, const train_model_config *config, int micro_batch);

/* The same on a device and a kernel table: parameters, gradients, activations, attention
 * scratch and the token copies are memory of dev (train_device_alloc; NULL = host memory from
 * calloc, what train_model_create uses), and forward/backward call ops (NULL = the CPU fp32
 * table, kern_cpu_vec.h's kern_cpu_ops_fp32). dev and ops are not owned and must outlive the
 * model. train_model_create(out, c, b) is train_model_create_on(out, c, b, NULL, NULL).
 * On a device whose memory is not host memory (CUDA), train_model_params/grads return device
 * pointers, forward copies inputs/targets host-to-device and the losses device-to-host (the
 * mean is summed on the host in the same order), and train_model_init_params initialises in
 * host memory and copies. Errors: as train_model_create, and -EINVAL for a table with bf16 = 1
 * whose *_bf16 entries are not all filled in. */
int train_model_create_on(train_model **out, const train_model_config *config, int micro_batch,
                          train_device *dev, const kern_ops *ops);

/* The device and table given at creation (dev NULL for train_model_create; ops never NULL). */
train_device *train_model_device(const train_model *m);
const kern_ops *train_model_ops(const train_model *m);

/* First failed host<->device copy of forward or init (negative errno), 0 when none; forward
 * returns NaN once it is set. Kernel failures are the table's ops->status. */
int train_model_copy_status(const train_model *m);

/* Frees everything; accepts NULL. */
void train_model_free(train_model *m);

/* Bytes of device memory (host memory on the CPU) the model allocated, by purpose. */
typedef struct train_model_mem {
    size_t params;     /* fp32 parameters and the gradient buffer (2 x num_params x 4) */
    size_t working;    /* bf16 working parameters (num_params x 2; 0 in fp32) */
    size_t acts;       /* forward activations, fp32 and bf16 parts, for micro_batch sequences */
    size_t act_grads;  /* the activations' gradients (always fp32) */
    size_t other;      /* attention scratch, token copies */
} train_model_mem;

/* Fill *out with the model's allocations (the sizes asked for at creation). Thread-safe
 * (reads fields fixed at creation). */
void train_model_memory(const train_model *m, train_model_mem *out);

/* Tensor table and flat sizes. */
const train_tensor *train_model_tensors(const train_model *m, size_t *n);
size_t train_model_num_params(const train_model *m);  /* padded flat size, elements */
size_t train_model_num_real(const train_model *m);    /* sum of tensor sizes, elements */
float *train_model_params(train_model *m);           /* (num_params) memory of the device */
float *train_model_grads(train_model *m);            /* (num_params) gradient of one micro-batch */
const train_model_config *train_model_get_config(const train_model *m);

/* GPT-2 initialisation, counter-based so that it depends only on (seed, tensor, element):
 * weights ~ N(0, 0.02), residual projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02/sqrt(2L)),
 * biases 0, LayerNorm gains 1. Padding is zeroed. */
void train_model_init_params(train_model *m, uint64_t seed);

/* The same initialisation written into a host buffer dst of num_params floats (the model's
 * own buffers are not touched). */
void train_model_init_params_into(const train_model *m, uint64_t seed, float *dst);

/* Forward pass over one micro-batch. inputs, targets (B,T) token ids in [0, V); B <= the
 * micro_batch given at creation. Returns the mean cross-entropy over the B*T positions
 * (nats); keeps the activations for train_model_backward. targets may be NULL (no loss,
 * returns 0). */
double train_model_forward(train_model *m, const int32_t *inputs, const int32_t *targets, int B);

/* Backward pass of the last forward (which must have had targets): zeroes the gradient
 * buffer, then writes d(loss_scale * sum of per-position losses)/d(params) into it.
 * loss_scale is usually 1 / (positions in the global batch). */
void train_model_backward(train_model *m, float loss_scale);

/* ZeRO-3 (DESIGN section 3): a hook that forward and backward call before they use a layer
 * group's parameters, so that a caller holding only a shard of the parameters can gather the
 * group's range [lo, hi) (elements of the flat space) into the parameter buffer. Groups, in
 * forward order: wte + wpe, each block h.<l>, ln_f (with the padding up to num_params); the
 * ranges tile [0, num_params). Backward calls it for ln_f, wte + wpe (the tied output head),
 * then the blocks from the last to the first. The hook returns 0 or a negative errno; the
 * first error is kept (train_model_hook_status), no later hook is called, and forward returns
 * NaN. fn NULL removes the hook. Setting it clears the status. */
typedef int (*train_param_hook)(void *ctx, size_t lo, size_t hi);
void train_model_set_param_hook(train_model *m, train_param_hook fn, void *ctx);
/* The first error of the hook since it was set, or 0. */
int train_model_hook_status(const train_model *m);

#endif /* TRAIN_MODEL_H */
