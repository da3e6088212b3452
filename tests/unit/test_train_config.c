/* test_train_config.c - train_ds_config_load: a realistic DeepSpeed config,
 * "auto", the scheduler mappings, and one case per kind of error (with the key
 * path in the message). */
#include "ds_config.h"
#include "t_helpers.h"

#include <errno.h>
#include <string.h>

static char *dir;

/* Write text to dir/name; the path (malloc'ed). */
static char *put(const char *name, const char *text) {
  char *p = t_path_in(dir, name);
  T_REQUIRE(t_spit(p, text, strlen(text)) == 0, "write %s", p);
  return p;
}

static const char full_json[] =
    "{\n"
    "  \"train_batch_size\": 64,\n"
    "  \"train_micro_batch_size_per_gpu\": 8,\n"
    "  \"gradient_accumulation_steps\": 4.0,\n"
    "  \"steps_per_print\": 10,\n"
    "  \"seed\": 1234,\n"
    "  \"gradient_clipping\": 0.5,\n"
    "  \"wall_clock_breakdown\": false,\n"
    "  \"zero_optimization\": {\n"
    "    \"stage\": 2,\n"
    "    \"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true},\n"
    "    \"overlap_comm\": true,\n"
    "    \"contiguous_gradients\": true,\n"
    "    \"reduce_bucket_size\": 5e8\n"
    "  },\n"
    "  \"optimizer\": {\n"
    "    \"type\": \"adamw\",\n"
    "    \"params\": {\"lr\": 3e-4, \"betas\": [0.9, 0.95], \"eps\": 1e-8,\n"
    "               \"weight_decay\": 0.1, \"torch_adam\": true}\n"
    "  },\n"
    "  \"scheduler\": {\n"
    "    \"type\": \"WarmupCosineLR\",\n"
    "    \"params\": {\"warmup_num_steps\": 100, \"total_num_steps\": 2000,\n"
    "               \"cos_min_ratio\": 0.05, \"warmup_min_ratio\": 0, "
    "\"warmup_type\": \"linear\"}\n"
    "  },\n"
    "  \"fp16\": {\"enabled\": false, \"loss_scale\": 0},\n"
    "  \"bf16\": {\"enabled\": true},\n"
    "  \"checkpoint\": {\n"
    "    \"dir\": \"/tmp/run1/ckpt\", \"every\": 50, \"keep_last\": 3, "
    "\"keep_every\": 500,\n"
    "    \"zstd_level\": -3, \"compress\": true, \"shuffle\": false, "
    "\"policy\": \"skip\",\n"
    "    \"tag_validation\": \"Warn\", \"load_universal\": false, \"async\": "
    "1\n"
    "  }\n"
    "}\n";

static const char full_unknown[] =
    "wall_clock_breakdown, zero_optimization.offload_optimizer, "
    "zero_optimization.overlap_comm, "
    "zero_optimization.contiguous_gradients, "
    "zero_optimization.reduce_bucket_size, "
    "optimizer.params.torch_adam, scheduler.params.warmup_min_ratio, "
    "scheduler.params.warmup_type, "
    "checkpoint.tag_validation (ignored), checkpoint.load_universal (ignored), "
    "checkpoint.async";

static void test_full(void) {
  char *p = put("full.json", full_json);
  train_ds_config c;
  char why[512] = "x", unk[1024] = "x";
  int rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_REQUIRE(rc == 0, "rc %d why %s", rc, why);
  T_CHECK(why[0] == 0, "why '%s'", why);
  T_CHECK(!strcmp(unk, full_unknown), "unknown:\n got  '%s'\n want '%s'", unk,
          full_unknown);
  T_CHECK(c.has_train_batch_size && c.train_batch_size == 64, "%d",
          c.train_batch_size);
  T_CHECK(c.has_micro_batch && c.micro_batch == 8, "%d", c.micro_batch);
  T_CHECK(c.has_grad_accum && c.grad_accum == 4, "%d", c.grad_accum);
  T_CHECK(c.has_log_every && c.log_every == 10, "%d", c.log_every);
  T_CHECK(c.has_seed && c.seed == 1234, "%d", c.seed);
  T_CHECK(c.has_grad_clip && c.grad_clip == 0.5f, "%g", c.grad_clip);
  T_CHECK(c.has_zero_stage && c.zero_stage == 2, "%d", c.zero_stage);
  T_CHECK(c.has_bf16 && c.bf16 == 1, "bf16 %d %d", c.has_bf16, c.bf16);
  T_CHECK(c.has_lr && c.lr == 3e-4f, "%g", c.lr);
  T_CHECK(c.has_betas && c.beta1 == 0.9f && c.beta2 == 0.95f, "%g %g", c.beta1,
          c.beta2);
  T_CHECK(c.has_eps && c.eps == 1e-8f, "%g", c.eps);
  T_CHECK(c.has_weight_decay && c.weight_decay == 0.1f, "%g", c.weight_decay);
  T_CHECK(c.has_warmup && c.warmup == 100, "%d", c.warmup);
  T_CHECK(c.has_total_steps && c.total_steps == 2000, "%d", c.total_steps);
  T_CHECK(c.has_min_lr_ratio && c.min_lr_ratio == 0.05f, "%g", c.min_lr_ratio);
  T_CHECK(c.has_ckpt_dir && !strcmp(c.ckpt_dir, "/tmp/run1/ckpt"), "'%s'",
          c.ckpt_dir);
  T_CHECK(c.has_ckpt_every && c.ckpt_every == 50, "%d", c.ckpt_every);
  T_CHECK(c.has_keep_last && c.keep_last == 3, "%d", c.keep_last);
  T_CHECK(c.has_keep_every && c.keep_every == 500, "%d", c.keep_every);
  T_CHECK(c.has_zstd_level && c.zstd_level == -3, "%d", c.zstd_level);
  T_CHECK(c.has_compress && c.compress == 1, "%d", c.compress);
  T_CHECK(c.has_shuffle && c.shuffle == 0, "%d", c.shuffle);
  T_CHECK(c.has_snapshot_policy && c.snapshot_policy == 1, "%d",
          c.snapshot_policy);

  /* why and unknown may be NULL. */
  rc = train_ds_config_load(p, &c, NULL, 0, NULL, 0);
  T_CHECK(rc == 0 && c.micro_batch == 8, "rc %d", rc);

  /* A short unknown buffer: truncated, ending in "...". */
  char small[24];
  rc = train_ds_config_load(p, &c, why, sizeof why, small, sizeof small);
  T_CHECK(rc == 0, "rc %d", rc);
  T_CHECK(strlen(small) == sizeof small - 1 &&
              !strcmp(small + sizeof small - 4, "...") &&
              !strncmp(small, full_unknown, sizeof small - 4),
          "'%s'", small);
  free(p);
}

static void test_empty_and_auto(void) {
  char why[512], unk[512];
  train_ds_config c, zero;
  memset(&zero, 0, sizeof zero);
  char *p = put("empty.json", "{}");
  memset(&c, 0x5a, sizeof c);
  int rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0, "rc %d %s", rc, why);
  T_CHECK(!memcmp(&c, &zero, sizeof c), "{} must leave every field 0");
  T_CHECK(unk[0] == 0 && why[0] == 0, "'%s' '%s'", unk, why);
  free(p);

  p = put(
      "auto.json",
      "{\"train_batch_size\": \"auto\", \"train_micro_batch_size_per_gpu\": "
      "\"auto\", \"gradient_accumulation_steps\": \"auto\", "
      "\"gradient_clipping\": \"auto\", \"seed\": 0, "
      "\"fp16\": {\"enabled\": \"auto\"}, \"bf16\": {\"enabled\": false}}");
  memset(&c, 0x5a, sizeof c);
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0, "rc %d %s", rc, why);
  T_CHECK(!c.has_train_batch_size && !c.has_micro_batch && !c.has_grad_accum &&
              !c.has_grad_clip,
          "auto must leave has_ 0");
  T_CHECK(c.has_seed && c.seed == 0, "%d %d", c.has_seed, c.seed);
  T_CHECK(unk[0] == 0, "'%s'", unk);
  free(p);

  /* "auto" in optimizer.params and scheduler.params, as Hugging Face's DeepSpeed
   * configs write them: the flags or the defaults supply the values (issue 9) */
  p = put("auto_opt.json",
          "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\", "
          "\"betas\": \"auto\", \"eps\": \"auto\", \"weight_decay\": \"auto\"}}, "
          "\"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": "
          "{\"warmup_num_steps\": \"auto\", \"total_num_steps\": \"auto\", "
          "\"warmup_max_lr\": \"auto\", \"cos_min_ratio\": \"auto\"}}}");
  memset(&c, 0x5a, sizeof c);
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0, "auto optimizer/scheduler params: rc %d %s", rc, why);
  T_CHECK(!c.has_lr && !c.has_betas && !c.has_eps && !c.has_weight_decay &&
              !c.has_warmup && !c.has_total_steps && !c.has_min_lr_ratio,
          "auto must leave has_ 0");
  free(p);
  p = put("auto_beta.json",
          "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": "
          "[\"auto\", 0.95]}}}");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == -EINVAL && strstr(why, "optimizer.params.betas"), "one beta auto: %d %s", rc, why);
  free(p);
  p = put("auto_betas2.json",
          "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": "
          "[\"auto\", \"auto\"], \"lr\": 0.001}}}");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0 && !c.has_betas && c.has_lr, "both betas auto: %d %s", rc, why);
  free(p);
}

static void test_scheduler_and_optimizer(void) {
  char why[512], unk[512];
  train_ds_config c;
  /* warmup_max_lr alone gives lr; WarmupLR is constant after warm-up (ratio 1).
   */
  char *p =
      put("wlr.json", "{\"scheduler\": {\"type\": \"WarmupLR\", \"params\": "
                      "{\"warmup_max_lr\": 0.002, \"warmup_num_steps\": 0, "
                      "\"cos_min_ratio\": 0.5}}}");
  int rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0, "rc %d %s", rc, why);
  T_CHECK(c.has_lr && c.lr == 0.002f, "%d %g", c.has_lr, c.lr);
  T_CHECK(c.has_warmup && c.warmup == 0, "%d", c.warmup);
  T_CHECK(c.has_min_lr_ratio && c.min_lr_ratio == 1.0f, "%g", c.min_lr_ratio);
  T_CHECK(!strcmp(unk, "scheduler.params.cos_min_ratio"), "'%s'", unk);
  free(p);

  /* Equal lr in both places is fine; WarmupDecayLR is reported as approximated.
   */
  p = put(
      "wd.json",
      "{\"optimizer\": {\"type\": \"ADAM\", \"params\": {\"lr\": 1e-3, "
      "\"adam_w_mode\": true}}, \"scheduler\": {\"type\": \"WarmupDecayLR\", "
      "\"params\": {\"warmup_max_lr\": 0.001, \"total_num_steps\": 10}}}");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0, "rc %d %s", rc, why);
  T_CHECK(c.has_lr && c.lr == 1e-3f, "%g", c.lr);
  T_CHECK(c.has_total_steps && c.total_steps == 10, "%d", c.total_steps);
  T_CHECK(c.has_min_lr_ratio && c.min_lr_ratio == 0.0f, "%g", c.min_lr_ratio);
  T_CHECK(!strncmp(unk, "scheduler.type (WarmupDecayLR approximated", 42),
          "'%s'", unk);
  free(p);

  /* "Adam" without adam_w_mode means AdamW. */
  p = put("adam.json",
          "{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"eps\": 1e-6}}}");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0 && c.has_eps && c.eps == 1e-6f && !c.has_lr, "rc %d %s", rc,
          why);
  free(p);
}

typedef struct bad {
  const char *json;
  int rc;
  const char *want; /* expected text of why after "<path>: " (prefix match) */
} bad;

static const bad bads[] = {
    /* syntax */
    {"{\n  \"seed\": 1,\n  \"x\" 2\n}", -EINVAL, "line 3 column "},
    {"{\"seed\": 1,}", -EINVAL, "line 1 column "},
    {"", -EINVAL, "line "},
    {"[1, 2]", -EINVAL, "expected a JSON object at the top level"},
    /* duplicates, with their path */
    {"{\n \"optimizer\": {\"type\": \"AdamW\",\n  \"params\": {\"lr\": 1e-3,\n "
     "  \"lr\": 2e-3}}}",
     -EINVAL, "line 4 column "},
    {"{\"seed\": 1, \"seed\": 2}", -EINVAL, "line 1 column "},
    /* wrong type */
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"abc\"}}}",
     -EINVAL, "optimizer.params.lr: expected a number in (0, 10] or \"auto\", got \"abc\""},
    {"{\"zero_optimization\": 2}", -EINVAL,
     "zero_optimization: expected an object, got 2"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": [1]}}", -EINVAL,
     "optimizer.params: expected an object"},
    {"{\"checkpoint\": {\"compress\": 1}}", -EINVAL,
     "checkpoint.compress: expected true or false, got 1"},
    {"{\"checkpoint\": {\"dir\": 7}}", -EINVAL,
     "checkpoint.dir: expected a non-empty string"},
    {"{\"checkpoint\": {\"dir\": \"\"}}", -EINVAL,
     "checkpoint.dir: expected a non-empty string"},
    {"{\"seed\": \"auto\"}", -EINVAL,
     "seed: expected an integer >= 0, got \"auto\""},
    {"{\"train_batch_size\": \"8\"}", -EINVAL,
     "train_batch_size: expected an integer in [1, 65536] or \"auto\", got "
     "\"8\""},
    {"{\"fp16\": {\"enabled\": \"yes\"}}", -EINVAL,
     "fp16.enabled: expected true, false or"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": 0.9}}}",
     -EINVAL, "optimizer.params.betas: expected [beta1, beta2], got 0.9"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": [0.9, "
     "0.95, 0.99]}}}",
     -EINVAL, "optimizer.params.betas: expected [beta1, beta2]"},
    /* out of range */
    {"{\"train_batch_size\": 0}", -EINVAL,
     "train_batch_size: expected an integer in [1, 65536] or \"auto\", got 0"},
    {"{\"train_micro_batch_size_per_gpu\": 65537}", -EINVAL,
     "train_micro_batch_size_per_gpu: expected an integer in [1, 65536]"},
    {"{\"seed\": -1}", -EINVAL, "seed: expected an integer >= 0, got -1"},
    {"{\"seed\": 99999999999}", -EINVAL, "seed: expected an integer >= 0"},
    {"{\"seed\": 1e30}", -EINVAL, "seed: expected an integer >= 0"},
    {"{\"steps_per_print\": 0}", -EINVAL,
     "steps_per_print: expected an integer >= 1"},
    {"{\"gradient_clipping\": -1}", -EINVAL,
     "gradient_clipping: expected a number in [0, 1e+09] or \"auto\", got -1"},
    {"{\"zero_optimization\": {\"stage\": 4}}", -EINVAL,
     "zero_optimization.stage: expected an integer in [0, 3], got 4"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0}}}", -EINVAL,
     "optimizer.params.lr: expected a number in (0, 10] or \"auto\", got 0"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 11}}}",
     -EINVAL, "optimizer.params.lr: expected a number in (0, 10]"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": [0.9, "
     "1.0]}}}",
     -EINVAL,
     "optimizer.params.betas[1]: expected a number in [0, 1) or \"auto\", got 1.0"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": "
     "[0.9999999999, 0.9]}}}",
     -EINVAL,
     "optimizer.params.betas[0]: expected a number in [0, 1)"}, /* 1.0f as float
                                                                 */
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"eps\": 0}}}",
     -EINVAL, "optimizer.params.eps: expected a number > 0 or \"auto\", got 0"},
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"eps\": 1e-50}}}",
     -EINVAL, "optimizer.params.eps: expected a number > 0"}, /* 0 as a float */
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"weight_decay\": "
     "-0.1}}}",
     -EINVAL, "optimizer.params.weight_decay: expected a number in [0, 10]"},
    {"{\"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": "
     "{\"cos_min_ratio\": 1.5}}}",
     -EINVAL,
     "scheduler.params.cos_min_ratio: expected a number in [0, 1] or \"auto\", got 1.5"},
    {"{\"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": "
     "{\"total_num_steps\": 0}}}",
     -EINVAL,
     "scheduler.params.total_num_steps: expected an integer >= 1 or \"auto\", got 0"},
    {"{\"scheduler\": {\"type\": \"WarmupLR\", \"params\": "
     "{\"warmup_num_steps\": -5}}}",
     -EINVAL,
     "scheduler.params.warmup_num_steps: expected an integer >= 0 or \"auto\", got -5"},
    {"{\"checkpoint\": {\"zstd_level\": 20}}", -EINVAL,
     "checkpoint.zstd_level: expected an integer in [-7, 19], got 20"},
    {"{\"checkpoint\": {\"keep_last\": -1}}", -EINVAL,
     "checkpoint.keep_last: expected an integer >= 0"},
    /* bad enum */
    {"{\"optimizer\": {\"type\": \"Lamb\"}}", -EINVAL,
     "optimizer.type: expected \"AdamW\" or \"Adam\""},
    {"{\"optimizer\": {\"params\": {\"lr\": 1e-3}}}", -EINVAL,
     "optimizer.type: missing"},
    {"{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"adam_w_mode\": "
     "false}}}",
     -EINVAL, "optimizer.params.adam_w_mode: Adam with L2 regularization"},
    {"{\"scheduler\": {\"type\": \"OneCycle\"}}", -EINVAL,
     "scheduler.type: expected \"WarmupCosineLR\", \"WarmupDecayLR\" or "
     "\"WarmupLR\", got "
     "\"OneCycle\""},
    {"{\"scheduler\": {\"type\": \"warmupcosinelr\"}}", -EINVAL,
     "scheduler.type: expected"},
    {"{\"checkpoint\": {\"policy\": \"later\"}}", -EINVAL,
     "checkpoint.policy: expected \"wait\" or \"skip\", got \"later\""},
    /* non-integral integers */
    {"{\"gradient_accumulation_steps\": 8.5}", -EINVAL,
     "gradient_accumulation_steps: expected an integer in [1, 65536] or "
     "\"auto\", got 8.5"},
    {"{\"checkpoint\": {\"every\": 0.5}}", -EINVAL,
     "checkpoint.every: expected an integer >= 0, got 0.5"},
    /* conflicting lr (in either order) */
    {"{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}, "
     "\"scheduler\": {\"type\": "
     "\"WarmupCosineLR\", \"params\": {\"warmup_max_lr\": 1e-3}}}",
     -EINVAL,
     "scheduler.params.warmup_max_lr: 0.001 differs from optimizer.params.lr "
     "0.0003"},
    {"{\"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": "
     "{\"warmup_max_lr\": 1e-3}}, "
     "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}}",
     -EINVAL, "scheduler.params.warmup_max_lr: 0.001 differs"},
    /* the tensorboard section */
    {"{\"tensorboard\": true}", -EINVAL, "tensorboard: expected an object, got true"},
    {"{\"tensorboard\": {\"enabled\": 1}}", -EINVAL,
     "tensorboard.enabled: expected true or false, got 1"},
    {"{\"tensorboard\": {\"job_name\": \"\"}}", -EINVAL,
     "tensorboard.job_name: expected a non-empty string of at most 255 bytes, got \"\""},
    {"{\"tensorboard\": {\"output_path\": 3}}", -EINVAL,
     "tensorboard.output_path: expected a string of at most 4095 bytes, got 3"},
};

/* The key named by the duplicate-key messages (checked apart: the column is
 * jansson's). */
static void test_duplicate_paths(void) {
  char why[512];
  train_ds_config c;
  char *p = put("dup.json", bads[4].json);
  int rc = train_ds_config_load(p, &c, why, sizeof why, NULL, 0);
  T_CHECK(rc == -EINVAL && strstr(why, ": optimizer.params.lr: duplicate key"),
          "%d '%s'", rc, why);
  free(p);
  p = put("dup2.json", "{\"seed\": 1, \"seed\": 2}");
  rc = train_ds_config_load(p, &c, why, sizeof why, NULL, 0);
  T_CHECK(rc == -EINVAL && strstr(why, "line 1 column ") &&
              strstr(why, ": seed: duplicate key"),
          "%d '%s'", rc, why);
  free(p);
  /* Inside an array of objects (an unknown section): the index is in the path.
   */
  p = put("dup3.json", "{\"x\": [{\"a\": 1}, {\"b\": 1, \"b\": 2}]}");
  rc = train_ds_config_load(p, &c, why, sizeof why, NULL, 0);
  T_CHECK(rc == -EINVAL && strstr(why, ": x[1].b: duplicate key"), "%d '%s'",
          rc, why);
  free(p);
  p = put("syn.json", bads[0].json);
  rc = train_ds_config_load(p, &c, why, sizeof why, NULL, 0);
  T_CHECK(rc == -EINVAL && strstr(why, "line 3 column ") &&
              strstr(why, "JSON syntax error: "),
          "%d '%s'", rc, why);
  free(p);
}

static void test_errors(void) {
  char why[512], unk[512];
  train_ds_config c;
  for (size_t i = 0; i < sizeof bads / sizeof *bads; i++) {
    char name[32];
    snprintf(name, sizeof name, "bad%zu.json", i);
    char *p = put(name, bads[i].json);
    memset(&c, 0x5a, sizeof c);
    strcpy(unk, "x");
    int rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
    T_CHECK(rc == bads[i].rc, "case %zu (%s): rc %d want %d (%s)", i,
            bads[i].json, rc, bads[i].rc, why);
    size_t pl = strlen(p);
    T_CHECK(!strncmp(why, p, pl) && !strncmp(why + pl, ": ", 2) &&
                !strncmp(why + pl + 2, bads[i].want, strlen(bads[i].want)),
            "case %zu:\n got  '%s'\n want '%s: %s...'", i, why, p,
            bads[i].want);
    T_CHECK(!strchr(why, '\n'), "case %zu: why must be one line: '%s'", i, why);
    T_CHECK(unk[0] == 0, "case %zu: unknown '%s' on error", i, unk);
    train_ds_config zero;
    memset(&zero, 0, sizeof zero);
    T_CHECK(!memcmp(&c, &zero, sizeof c),
            "case %zu: out must be zeroed on error", i);
    free(p);
  }

  /* Values read before the bad one are not left behind. */
  char *p = put("partial.json", "{\"seed\": 5, \"train_batch_size\": 0}");
  int rc = train_ds_config_load(p, &c, why, sizeof why, NULL, 0);
  T_CHECK(rc == -EINVAL && !c.has_seed && c.seed == 0, "rc %d has_seed %d", rc,
          c.has_seed);
  free(p);

  /* Missing file and a folder. */
  p = t_path_in(dir, "missing.json");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == -ENOENT, "rc %d", rc);
  T_CHECK(!strncmp(why, p, strlen(p)) && strstr(why, "No such file"), "'%s'",
          why);
  free(p);
  rc = train_ds_config_load(dir, &c, why, sizeof why, NULL, 0);
  T_CHECK(rc == -EISDIR, "rc %d (%s)", rc, why);

  /* A tiny why buffer is still NUL-terminated. */
  p = put("tiny.json", "{\"seed\": -1}");
  char tiny[8];
  rc = train_ds_config_load(p, &c, tiny, sizeof tiny, NULL, 0);
  T_CHECK(rc == -EINVAL && strlen(tiny) == sizeof tiny - 1, "rc %d '%s'", rc,
          tiny);
  rc = train_ds_config_load(p, &c, NULL, 0, NULL, 0);
  T_CHECK(rc == -EINVAL, "rc %d", rc);
  free(p);
}

/* A UTF-8 byte-order mark before the JSON is skipped; a duplicate key after it is still
 * named by its path. */
static void test_byte_order_mark(void) {
  char why[512], unk[512];
  train_ds_config c;
  char *p = put("bom.json", "\xef\xbb\xbf{\"seed\": 3, \"steps_per_print\": 5}");
  int rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0 && c.has_seed && c.seed == 3 && c.log_every == 5, "bom: rc %d %s", rc, why);
  free(p);
  p = put("bomdup.json", "\xef\xbb\xbf{\"optimizer\": {\"params\": {\"lr\": 1, \"lr\": 2}}}");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == -EINVAL && strstr(why, "optimizer.params.lr: duplicate key"), "bom dup: %d %s",
          rc, why);
  free(p);
}

/* DeepSpeed's "tensorboard" monitor section: the three keys, "" for output_path,
 * other keys reported. */
static void test_tensorboard(void) {
  char why[512], unk[512];
  train_ds_config c;
  char *p = put("tb.json", "{\"tensorboard\": {\"enabled\": true, \"output_path\": "
                           "\"output/ds_logs/\", \"job_name\": \"train_bert\", "
                           "\"flush_secs\": 5}}");
  int rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0, "rc %d %s", rc, why);
  T_CHECK(c.has_tensorboard_enabled && c.tensorboard_enabled &&
              c.has_tensorboard_output_path &&
              !strcmp(c.tensorboard_output_path, "output/ds_logs/") &&
              c.has_tensorboard_job_name &&
              !strcmp(c.tensorboard_job_name, "train_bert"),
          "tensorboard section: %d %d '%s' '%s'", c.has_tensorboard_enabled,
          c.tensorboard_enabled, c.tensorboard_output_path,
          c.tensorboard_job_name);
  T_CHECK(!strcmp(unk, "tensorboard.flush_secs"), "unknown '%s'", unk);
  free(p);
  p = put("tb2.json", "{\"tensorboard\": {\"enabled\": false, "
                      "\"output_path\": \"\"}}");
  rc = train_ds_config_load(p, &c, why, sizeof why, unk, sizeof unk);
  T_CHECK(rc == 0 && c.has_tensorboard_enabled && !c.tensorboard_enabled &&
              c.has_tensorboard_output_path && !c.tensorboard_output_path[0] &&
              !c.has_tensorboard_job_name && unk[0] == 0,
          "disabled, empty output_path: rc %d %s '%s'", rc, why, unk);
  free(p);
}

int main(void) {
  dir = t_tmpdir("train-config");
  test_full();
  test_empty_and_auto();
  test_scheduler_and_optimizer();
  test_duplicate_paths();
  test_errors();
  test_byte_order_mark();
  test_tensorboard();
  t_rmrf(dir);
  free(dir);
  return t_done("test_train_config");
}
