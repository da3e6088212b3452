/* ds_config.h - the trainer's settings from a DeepSpeed-style JSON
 * configuration file.
 *
 * Key names and nesting follow DeepSpeed's configuration reference
 * (https://www.deepspeed.ai/docs/config-json/): "train_batch_size",
 * "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
 * "zero_optimization", "optimizer", "scheduler", "gradient_clipping",
 * "steps_per_print", "fp16", "bf16", "tensorboard" and "checkpoint". Two additions are ours:
 * "seed" at the top level, and our snapshot settings inside "checkpoint". As in
 * Hugging Face's integration, "auto" is accepted for the batch sizes and
 * "gradient_clipping" and means "not set here".
 *
 * The parser only reads: it fills a plain struct in which each setting has a
 * has_ flag, and leaves defaults and command-line precedence to the caller.
 * Keys it does not use are reported (for a warning), never silently dropped;
 * values it uses are checked strictly (type, range, enum), and the first bad
 * one fails the load with a one-line reason.
 *
 * Not checked here: train_batch_size == micro * grad_accum * world size (the
 * world size is not known here), and warmup against total_steps.
 *
 * Thread-safety: train_ds_config_load keeps no state between calls; concurrent
 * calls with distinct output buffers are safe.
 */
#ifndef TRAIN_DS_CONFIG_H
#define TRAIN_DS_CONFIG_H

#include <stddef.h>

/* Every setting has a has_ flag: 1 when the file set it, 0 otherwise (the value
 * is then 0). Steps are optimizer steps; batch sizes are sequences. */
typedef struct train_ds_config {
  /* "train_batch_size": sequences per optimizer step over all ranks; [1, 65536]
   * or "auto" */
  int has_train_batch_size;
  int train_batch_size;
  /* "train_micro_batch_size_per_gpu": sequences per forward/backward on one
     rank; [1, 65536] or "auto" */
  int has_micro_batch;
  int micro_batch;
  /* "gradient_accumulation_steps": micro-batches per optimizer step on one
     rank; [1, 65536] or "auto" */
  int has_grad_accum;
  int grad_accum;
  /* "zero_optimization": {"stage": 0..3}; other zero_optimization keys are
   * reported */
  int has_zero_stage;
  int zero_stage;
  /* "optimizer": {"type": "AdamW" or "Adam" (case-insensitive; "Adam" only with
     "params": {"adam_w_mode": true} or without adam_w_mode, and then means
     AdamW), "params": {"lr", "betas", "eps", "weight_decay"}}. "type" is
     required. */
  int has_lr; /* "params.lr", or "scheduler.params.warmup_max_lr"; (0, 10] */
  float lr;
  int has_betas; /* "params.betas": [beta1, beta2], each in [0, 1) */
  float beta1, beta2;
  int has_eps; /* "params.eps": > 0 (and > 0 as a float) */
  float eps;
  int has_weight_decay; /* "params.weight_decay": decoupled (AdamW); [0, 10] */
  float weight_decay;
  /* "scheduler": {"type": "WarmupCosineLR", "WarmupDecayLR" or "WarmupLR"
     (exact case; required), "params": {...}}. The trainer's schedule is linear
     warm-up then cosine (train_lr_at); the types map onto it as follows:
       WarmupCosineLR: as is; "cos_min_ratio" -> min_lr_ratio.
       WarmupLR: constant after warm-up, so min_lr_ratio is set to 1 (exact).
       WarmupDecayLR: linear decay to 0 in DeepSpeed; here min_lr_ratio is set
     to 0 and the decay is a cosine (approximate; reported in `unknown`).
     DeepSpeed's scheduler defaults (e.g. warmup_num_steps 1000, log warm-up)
     are not applied: what the file does not set stays unset. */
  int has_warmup; /* "params.warmup_num_steps": steps of linear warm-up; >= 0 */
  int warmup;
  int has_total_steps; /* "params.total_num_steps": steps of the schedule; >= 1
                        */
  int total_steps;
  int has_min_lr_ratio; /* "params.cos_min_ratio" (WarmupCosineLR only): final
                           lr / lr; [0, 1] */
  float min_lr_ratio;
  /* "gradient_clipping": maximum global L2 norm of the gradient, 0 = off; [0,
     1e9] or "auto" */
  int has_grad_clip;
  float grad_clip;
  /* "seed" (ours, not DeepSpeed's): seed of initialisation and sample order; >=
   * 0 */
  int has_seed;
  int seed;
  /* "steps_per_print": one log line every N steps; >= 1 */
  int has_log_every;
  int log_every;
  /* "checkpoint": our snapshot settings. DeepSpeed's own checkpoint keys
     ("tag_validation", "load_universal", "use_node_local_storage",
     "parallel_write") are accepted and reported as "(ignored)". */
  int has_ckpt_dir; /* "dir": snapshot folder; non-empty, at most 4095 bytes */
  char ckpt_dir[4096];
  int has_ckpt_every; /* "every": a snapshot every N steps, 0 = none; >= 0 */
  int ckpt_every;
  int has_keep_last; /* "keep_last": keep the newest K snapshots, 0 = all; >= 0
                      */
  int keep_last;
  int has_keep_every; /* "keep_every": also keep steps that are multiples of N,
                         0 = none; >= 0 */
  int keep_every;
  int has_zstd_level; /* "zstd_level": compression level; [-7, 19] */
  int zstd_level;
  int has_compress; /* "compress": true (zstd) or false (raw chunks) -> 1 or 0
                     */
  int compress;
  int has_shuffle; /* "shuffle": byte-shuffle filter before compression;
                      true/false */
  int shuffle;
  int has_snapshot_policy; /* "policy": "wait" -> 0 (CKPT_POLICY_WAIT), "skip"
                              -> 1 (CKPT_POLICY_SKIP) */
  int snapshot_policy;
  /* "bf16": {"enabled": true/false} -> 1/0 (train --dtype bf16/fp32); "auto"
   * or no "enabled" leaves it unset */
  int has_bf16;
  int bf16;
  /* "tensorboard": DeepSpeed's monitor section; events go to the folder
     output_path/job_name (os.path.join's rule, as DeepSpeed's TensorBoardMonitor:
     output_path "" gives job_name in the current folder; an absolute job_name
     stands alone). DeepSpeed's defaults when a key is absent: enabled false,
     output_path "", job_name "DeepSpeedJobName" (the caller applies them). */
  int has_tensorboard_enabled; /* "enabled": true/false -> 1/0 */
  int tensorboard_enabled;
  int has_tensorboard_output_path; /* "output_path": a string of at most 4095
                                      bytes, "" allowed */
  char tensorboard_output_path[4096];
  int has_tensorboard_job_name; /* "job_name": a non-empty string of at most
                                   255 bytes */
  char tensorboard_job_name[256];
} train_ds_config;

/* Nothing set. */
#define TRAIN_DS_CONFIG_INIT                                                   \
  { 0 }

/* Read the JSON configuration file at `path` into *out.
 *
 * path: the file; also the name used in messages. out: zeroed first, then
 * filled; on error it is left zeroed (all has_ = 0). why, why_len: on error,
 * ONE line (NUL-terminated, truncated to why_len) naming the file, the dotted
 * key path and the reason, e.g. cfg.json: optimizer.params.lr: expected a
 * number in (0, 10], got "abc" cfg.json: line 3 column 5: JSON syntax error:
 * ... cfg.json: line 4 column 11: optimizer.params.lr: duplicate key On success
 * it is set to "". why may be NULL (then why_len is ignored). unknown,
 * unknown_len: on success, the keys that were not used, as a ", "-separated
 * list of dotted paths in file order (e.g.
 * "zero_optimization.offload_optimizer, wall_clock_breakdown"); a key whose
 * value is an object is reported once, not its children. Entries may carry a
 * suffix: " (ignored)" for DeepSpeed's checkpoint keys, " (ignored: fp16 is not
 * supported; use bf16)" for "fp16" with "enabled": true (with false or "auto" it
 * is accepted silently; "bf16" sets has_bf16/bf16), and a note on the
 * WarmupDecayLR approximation. ""
 * when every key was used. The list is truncated to unknown_len - 1 bytes,
 * ending in "...", when longer. On error it is set to "". unknown may be NULL
 * (then unknown_len is ignored).
 *
 * Values: integers may be written as JSON reals only when integral (8.0,
 * not 8.5); numbers for float settings are also checked after rounding to float
 * (eps 1e-50 or beta 0.999999999 fail). When both "optimizer.params.lr" and
 * "scheduler.params.warmup_max_lr" are given they must be equal. The top level
 * must be an object; a key given twice in one object is an error.
 *
 * Returns 0 on success. Errors:
 *   -ENOENT  no such file;
 *   -EINVAL  JSON syntax error, duplicate key, top level not an object, wrong
 * type, value out of range, unknown enum value (optimizer/scheduler type,
 * policy), non-integral integer, conflicting lr, missing optimizer/scheduler
 * "type"; -EFBIG   the file is larger than 64 MiB; -ENOMEM  out of memory;
 *   -EISDIR a folder, -ENODEV a device or socket (a pipe, as `--config <(...)`
 *   makes, is read; one nobody writes reads as empty, never blocks);
 *   -ETIMEDOUT a pipe's writer did not finish within 30 s; other -errno from
 *   open/read (-EACCES, -EIO, ...).
 * Never exits, never logs.
 */
int train_ds_config_load(const char *path, train_ds_config *out, char *why,
                         size_t why_len, char *unknown, size_t unknown_len);

#endif /* TRAIN_DS_CONFIG_H */
