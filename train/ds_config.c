/* ds_config.c - DeepSpeed-style JSON configuration (see ds_config.h). */
#include "ds_config.h"

#include "clock.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* A config file is a few KiB; the cap only stops us from reading a device or a
 * huge file. */
#define MAX_FILE_BYTES (64u << 20)
#define KEY_MAX 512

typedef struct ctx {
  const char *file;
  char *why;
  size_t why_len;
  int want_unknown;
  char *unk; /* malloc'ed list of unused keys */
  size_t unk_len, unk_cap;
  int has_opt_lr, has_sched_lr;
  double opt_lr, sched_lr; /* as written, to compare them exactly */
} ctx;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int
fail(ctx *c, const char *key, const char *fmt, ...) {
  if (!c->why || !c->why_len)
    return -EINVAL;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (key && *key)
    snprintf(c->why, c->why_len, "%s: %s: %s", c->file, key, msg);
  else
    snprintf(c->why, c->why_len, "%s: %s", c->file, msg);
  return -EINVAL;
}

/* The value as JSON text, shortened, for "got ..." in messages. */
static void describe(const json_t *v, char *buf, size_t n) {
  char *s =
      json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT | JSON_REAL_PRECISION(10));
  if (!s) {
    snprintf(buf, n, "%s",
             json_is_object(v)  ? "an object"
             : json_is_array(v) ? "an array"
                                : "?");
    return;
  }
  if (strlen(s) > 40)
    snprintf(buf, n, "%.37s...", s);
  else
    snprintf(buf, n, "%s", s);
  free(s);
}

/* dst = prefix.key (or key), truncated to n - 1 bytes. */
static void join(char *dst, size_t n, const char *prefix, const char *key) {
  size_t used = 0;
  const char *parts[3] = {prefix && *prefix ? prefix : "",
                          prefix && *prefix ? "." : "", key};
  for (int i = 0; i < 3; i++) {
    size_t l = strlen(parts[i]);
    if (l > n - 1 - used)
      l = n - 1 - used;
    memcpy(dst + used, parts[i], l);
    used += l;
  }
  dst[used] = 0;
}

/* Append "key suffix" to the list of unused keys. */
static int note(ctx *c, const char *key, const char *suffix) {
  if (!c->want_unknown)
    return 0;
  size_t add = strlen(key) + (suffix ? strlen(suffix) : 0) + 2 /* ", " */ + 1;
  if (c->unk_len + add > c->unk_cap) {
    size_t cap = c->unk_cap ? c->unk_cap * 2 : 256;
    while (cap < c->unk_len + add)
      cap *= 2;
    char *p = realloc(c->unk, cap);
    if (!p)
      return -ENOMEM;
    c->unk = p;
    c->unk_cap = cap;
  }
  c->unk_len +=
      (size_t)sprintf(c->unk + c->unk_len, "%s%s%s", c->unk_len ? ", " : "",
                      key, suffix ? suffix : "");
  return 0;
}

static int is_auto(const json_t *v) {
  return json_is_string(v) && strcmp(json_string_value(v), "auto") == 0;
}

/* An integer in [lo, hi] (a JSON integer, or a JSON real with an integral
 * value); "auto" when allow_auto leaves *has at 0. */
static int get_int(ctx *c, const char *key, const json_t *v, long long lo,
                   long long hi, int allow_auto, int *has, int *out) {
  if (allow_auto && is_auto(v)) {
    *has = 0;
    *out = 0;
    return 0;
  }
  int ok = 0;
  long long x = 0;
  if (json_is_integer(v)) {
    x = (long long)json_integer_value(v);
    ok = x >= lo && x <= hi;
  } else if (json_is_real(v)) {
    double d = json_real_value(v);
    ok = d >= (double)lo && d <= (double)hi && d == floor(d);
    if (ok)
      x = (long long)d;
  }
  if (!ok) {
    char got[64], range[64];
    describe(v, got, sizeof got);
    if (hi == INT_MAX)
      snprintf(range, sizeof range, ">= %lld", lo);
    else
      snprintf(range, sizeof range, "in [%lld, %lld]", lo, hi);
    return fail(c, key, "expected an integer %s%s, got %s", range,
                allow_auto ? " or \"auto\"" : "", got);
  }
  *has = 1;
  *out = (int)x;
  return 0;
}

typedef struct range {
  double lo, hi; /* hi = INFINITY: no upper bound */
  int lo_open, hi_open;
} range;

static int in_range(double x, range r) {
  if (r.lo_open ? !(x > r.lo) : !(x >= r.lo))
    return 0;
  if (r.hi_open ? !(x < r.hi) : !(x <= r.hi))
    return 0;
  return 1;
}

/* A number in r, also after rounding to float; "auto" when allow_auto leaves
 * *has at 0. raw (may be NULL) gets the value as written. */
static int get_num(ctx *c, const char *key, const json_t *v, range r,
                   int allow_auto, int *has, float *out, double *raw) {
  if (allow_auto && is_auto(v)) {
    *has = 0;
    *out = 0;
    return 0;
  }
  if (json_is_number(v)) {
    double d = json_number_value(v);
    float f = (float)d;
    if (isfinite(d) && in_range(d, r) && isfinite(f) &&
        in_range((double)f, r)) {
      *has = 1;
      *out = f;
      if (raw)
        *raw = d;
      return 0;
    }
  }
  char got[64], want[96];
  describe(v, got, sizeof got);
  if (isinf(r.hi))
    snprintf(want, sizeof want, "%s %g", r.lo_open ? ">" : ">=", r.lo);
  else
    snprintf(want, sizeof want, "in %c%g, %g%c", r.lo_open ? '(' : '[', r.lo,
             r.hi, r.hi_open ? ')' : ']');
  return fail(c, key, "expected a number %s%s, got %s", want,
              allow_auto ? " or \"auto\"" : "", got);
}

static int get_bool(ctx *c, const char *key, const json_t *v, int *has,
                    int *out) {
  if (!json_is_boolean(v)) {
    char got[64];
    describe(v, got, sizeof got);
    return fail(c, key, "expected true or false, got %s", got);
  }
  *has = 1;
  *out = json_is_true(v);
  return 0;
}

static int want_object(ctx *c, const char *key, const json_t *v) {
  if (json_is_object(v))
    return 0;
  char got[64];
  describe(v, got, sizeof got);
  return fail(c, key, "expected an object, got %s", got);
}

static const range LR = {0, 10, 1, 0};

static int parse_zero(ctx *c, const char *prefix, const json_t *obj,
                      train_ds_config *o) {
  const char *k;
  json_t *v;
  char key[KEY_MAX];
  json_object_foreach((json_t *)obj, k, v) {
    int rc = 0;
    join(key, sizeof key, prefix, k);
    if (!strcmp(k, "stage"))
      rc = get_int(c, key, v, 0, 3, 0, &o->has_zero_stage, &o->zero_stage);
    else
      rc = note(c, key, NULL);
    if (rc)
      return rc;
  }
  return 0;
}

enum { SCHED_COSINE, SCHED_DECAY, SCHED_CONST };

/* A handler of one member of a section's "params" object: path is its dotted
 * key path. */
typedef int (*param_fn)(ctx *c, const char *path, const char *name,
                        const json_t *v, void *arg);

/* The members of a {"type": ..., "params": {...}} section (optimizer,
 * scheduler): "type" was read by the caller, any other member but "params" is
 * noted as unused, and every member of "params" goes to fn. Returns 0 or the
 * first error. */
static int each_param(ctx *c, const char *prefix, const json_t *obj,
                      param_fn fn, void *arg) {
  char key[KEY_MAX];
  const char *k;
  json_t *v;
  json_object_foreach((json_t *)obj, k, v) {
    int rc = 0;
    join(key, sizeof key, prefix, k);
    if (!strcmp(k, "type"))
      continue;
    if (strcmp(k, "params")) {
      if ((rc = note(c, key, NULL)))
        return rc;
      continue;
    }
    if ((rc = want_object(c, key, v)))
      return rc;
    char path[KEY_MAX];
    const char *name;
    json_t *pv;
    json_object_foreach(v, name, pv) {
      join(path, sizeof path, key, name);
      if ((rc = fn(c, path, name, pv, arg)))
        return rc;
    }
  }
  return 0;
}

typedef struct opt_arg {
  train_ds_config *o;
  int adam; /* "Adam" (AdamW unless adam_w_mode is false) rather than "AdamW" */
} opt_arg;

/* One member of the optimizer's "params". */
static int optimizer_param(ctx *c, const char *path, const char *name,
                           const json_t *v, void *arg) {
  const opt_arg *a = arg;
  train_ds_config *o = a->o;
  const int adam = a->adam;
  int rc = 0;
  if (!strcmp(name, "lr")) {
    rc = get_num(c, path, v, LR, 1, &o->has_lr, &o->lr, &c->opt_lr);
    c->has_opt_lr = o->has_lr;
  } else if (!strcmp(name, "betas")) {
    const range br = {0, 1, 0, 1};
    int h1 = 0, h2 = 0;
    if (is_auto(v)) {
      o->has_betas = 0; /* both from the flags or the defaults */
    } else if (!json_is_array(v) || json_array_size(v) != 2) {
      char got[64];
      describe(v, got, sizeof got);
      rc = fail(c, path, "expected [beta1, beta2], got %s", got);
    } else {
      char ekey[KEY_MAX + 8];
      snprintf(ekey, sizeof ekey, "%s[0]", path);
      rc = get_num(c, ekey, json_array_get(v, 0), br, 1, &h1, &o->beta1, NULL);
      if (!rc) {
        snprintf(ekey, sizeof ekey, "%s[1]", path);
        rc =
            get_num(c, ekey, json_array_get(v, 1), br, 1, &h2, &o->beta2, NULL);
      }
      if (!rc && h1 != h2)
        rc = fail(c, path, "give both betas, or \"auto\" for both");
      o->has_betas = h1 && h2;
    }
  } else if (!strcmp(name, "eps")) {
    const range er = {0, INFINITY, 1, 0};
    rc = get_num(c, path, v, er, 1, &o->has_eps, &o->eps, NULL);
  } else if (!strcmp(name, "weight_decay")) {
    const range wr = {0, 10, 0, 0};
    rc = get_num(c, path, v, wr, 1, &o->has_weight_decay, &o->weight_decay,
                 NULL);
  } else if (!strcmp(name, "adam_w_mode")) {
    /* DeepSpeed: "Adam" means AdamW unless adam_w_mode is false; "AdamW" is
       always AdamW. */
    int has = 0, w = 1;
    rc = get_bool(c, path, v, &has, &w);
    if (!rc && adam && !w)
      rc = fail(c, path,
                "Adam with L2 regularization (adam_w_mode false) is not "
                "supported; "
                "only AdamW");
  } else {
    rc = note(c, path, NULL);
  }
  return rc;
}

typedef struct sched_arg {
  train_ds_config *o;
  int kind; /* SCHED_* */
} sched_arg;

/* One member of the scheduler's "params". */
static int scheduler_param(ctx *c, const char *path, const char *name,
                           const json_t *v, void *arg) {
  const sched_arg *a = arg;
  train_ds_config *o = a->o;
  const int kind = a->kind;
  int rc = 0;
  if (!strcmp(name, "warmup_num_steps")) {
    rc = get_int(c, path, v, 0, INT_MAX, 1, &o->has_warmup, &o->warmup);
  } else if (!strcmp(name, "total_num_steps")) {
    rc = get_int(c, path, v, 1, INT_MAX, 1, &o->has_total_steps,
                 &o->total_steps);
  } else if (!strcmp(name, "cos_min_ratio") && kind == SCHED_COSINE) {
    const range mr = {0, 1, 0, 0};
    rc = get_num(c, path, v, mr, 1, &o->has_min_lr_ratio, &o->min_lr_ratio,
                 NULL);
  } else if (!strcmp(name, "warmup_max_lr")) {
    float f;
    rc = get_num(c, path, v, LR, 1, &c->has_sched_lr, &f, &c->sched_lr);
  } else {
    rc = note(c, path, NULL);
  }
  return rc;
}

static int parse_optimizer(ctx *c, const char *prefix, const json_t *obj,
                           train_ds_config *o) {
  char key[KEY_MAX];
  join(key, sizeof key, prefix, "type");
  const json_t *type = json_object_get(obj, "type");
  if (!type)
    return fail(c, key, "missing (expected \"AdamW\" or \"Adam\")");
  int adam = 0;
  if (json_is_string(type) && !strcasecmp(json_string_value(type), "adam"))
    adam = 1;
  else if (!json_is_string(type) ||
           strcasecmp(json_string_value(type), "adamw")) {
    char got[64];
    describe(type, got, sizeof got);
    return fail(
        c, key,
        "expected \"AdamW\" or \"Adam\" (the only optimizer here), got %s",
        got);
  }

  const opt_arg a = {o, adam};
  return each_param(c, prefix, obj, optimizer_param, (void *)&a);
}

static int parse_scheduler(ctx *c, const char *prefix, const json_t *obj,
                           train_ds_config *o) {
  static const char *const names[] = {"WarmupCosineLR", "WarmupDecayLR",
                                      "WarmupLR"};
  char key[KEY_MAX];
  join(key, sizeof key, prefix, "type");
  const json_t *type = json_object_get(obj, "type");
  if (!type)
    return fail(c, key,
                "missing (expected \"WarmupCosineLR\", \"WarmupDecayLR\" or "
                "\"WarmupLR\")");
  int kind = -1;
  for (int i = 0; i < 3 && json_is_string(type); i++)
    if (!strcmp(json_string_value(type), names[i]))
      kind = i;
  if (kind < 0) {
    char got[64];
    describe(type, got, sizeof got);
    return fail(c, key,
                "expected \"WarmupCosineLR\", \"WarmupDecayLR\" or "
                "\"WarmupLR\", got %s",
                got);
  }
  int rc;
  if (kind == SCHED_CONST) {
    o->has_min_lr_ratio = 1; /* constant after warm-up = a cosine to lr * 1 */
    o->min_lr_ratio = 1.0f;
  } else if (kind == SCHED_DECAY) {
    o->has_min_lr_ratio = 1;
    o->min_lr_ratio = 0.0f;
    if ((rc = note(
             c, key,
             " (WarmupDecayLR approximated: cosine, not linear, decay to 0)")))
      return rc;
  }

  const sched_arg a = {o, kind};
  return each_param(c, prefix, obj, scheduler_param, (void *)&a);
}

static int parse_checkpoint(ctx *c, const char *prefix, const json_t *obj,
                            train_ds_config *o) {
  static const char *const deepspeed_keys[] = {
      "tag_validation", "load_universal", "use_node_local_storage",
      "parallel_write"};
  const char *k;
  json_t *v;
  char key[KEY_MAX];
  json_object_foreach((json_t *)obj, k, v) {
    int rc = 0;
    join(key, sizeof key, prefix, k);
    if (!strcmp(k, "dir")) {
      size_t n = json_is_string(v) ? json_string_length(v) : 0;
      if (n == 0 || n >= sizeof o->ckpt_dir ||
          strlen(json_string_value(v)) != n) {
        char got[64];
        describe(v, got, sizeof got);
        rc = fail(c, key,
                  "expected a non-empty string of at most %zu bytes, got %s",
                  sizeof o->ckpt_dir - 1, got);
      } else {
        memcpy(o->ckpt_dir, json_string_value(v), n + 1);
        o->has_ckpt_dir = 1;
      }
    } else if (!strcmp(k, "every")) {
      rc =
          get_int(c, key, v, 0, INT_MAX, 0, &o->has_ckpt_every, &o->ckpt_every);
    } else if (!strcmp(k, "keep_last")) {
      rc = get_int(c, key, v, 0, INT_MAX, 0, &o->has_keep_last, &o->keep_last);
    } else if (!strcmp(k, "keep_every")) {
      rc =
          get_int(c, key, v, 0, INT_MAX, 0, &o->has_keep_every, &o->keep_every);
    } else if (!strcmp(k, "zstd_level")) {
      rc = get_int(c, key, v, -7, 19, 0, &o->has_zstd_level, &o->zstd_level);
    } else if (!strcmp(k, "compress")) {
      rc = get_bool(c, key, v, &o->has_compress, &o->compress);
    } else if (!strcmp(k, "shuffle")) {
      rc = get_bool(c, key, v, &o->has_shuffle, &o->shuffle);
    } else if (!strcmp(k, "policy")) {
      const char *s = json_is_string(v) ? json_string_value(v) : NULL;
      if (s && !strcmp(s, "wait")) {
        o->has_snapshot_policy = 1;
        o->snapshot_policy = 0;
      } else if (s && !strcmp(s, "skip")) {
        o->has_snapshot_policy = 1;
        o->snapshot_policy = 1;
      } else {
        char got[64];
        describe(v, got, sizeof got);
        rc = fail(c, key, "expected \"wait\" or \"skip\", got %s", got);
      }
    } else {
      int ds = 0;
      for (size_t i = 0; i < sizeof deepspeed_keys / sizeof *deepspeed_keys;
           i++)
        if (!strcmp(k, deepspeed_keys[i]))
          ds = 1;
      rc = note(c, key, ds ? " (ignored)" : NULL);
    }
    if (rc)
      return rc;
  }
  return 0;
}

/* A string value into dst (cap bytes with the NUL): at most cap - 1 bytes, no NUL inside,
 * empty only when allow_empty. */
static int get_string(ctx *c, const char *key, const json_t *v, int allow_empty,
                      char *dst, size_t cap, int *has) {
  size_t n = json_is_string(v) ? json_string_length(v) : 0;
  if (!json_is_string(v) || (n == 0 && !allow_empty) || n >= cap ||
      strlen(json_string_value(v)) != n) {
    char got[64];
    describe(v, got, sizeof got);
    return fail(c, key, "expected a %sstring of at most %zu bytes, got %s",
                allow_empty ? "" : "non-empty ", cap - 1, got);
  }
  memcpy(dst, json_string_value(v), n + 1);
  *has = 1;
  return 0;
}

/* "tensorboard": DeepSpeed's TensorBoard monitor. */
static int parse_tensorboard(ctx *c, const char *prefix, const json_t *obj,
                             train_ds_config *o) {
  const char *k;
  json_t *v;
  char key[KEY_MAX];
  json_object_foreach((json_t *)obj, k, v) {
    int rc = 0;
    join(key, sizeof key, prefix, k);
    if (!strcmp(k, "enabled"))
      rc = get_bool(c, key, v, &o->has_tensorboard_enabled,
                    &o->tensorboard_enabled);
    else if (!strcmp(k, "output_path"))
      rc = get_string(c, key, v, 1, o->tensorboard_output_path,
                      sizeof o->tensorboard_output_path,
                      &o->has_tensorboard_output_path);
    else if (!strcmp(k, "job_name"))
      rc = get_string(c, key, v, 0, o->tensorboard_job_name,
                      sizeof o->tensorboard_job_name,
                      &o->has_tensorboard_job_name);
    else
      rc = note(c, key, NULL);
    if (rc)
      return rc;
  }
  return 0;
}

/* "fp16" / "bf16". bf16 "enabled": true / false sets o->bf16 (train --dtype bf16 / fp32);
 * fp16 is not supported: "enabled": true is reported and ignored (the run is fp32). "auto"
 * means not set here. */
static int parse_precision(ctx *c, const char *key, const json_t *obj, train_ds_config *o) {
  const json_t *en = json_object_get(obj, "enabled");
  int is_bf16 = !strcmp(key, "bf16");
  if (!en || is_auto(en))
    return 0;
  if (json_is_boolean(en) && is_bf16) {
    o->has_bf16 = 1;
    o->bf16 = json_is_true(en);
    return 0;
  }
  if (json_is_false(en))
    return 0;
  if (json_is_true(en))
    return note(c, key, " (ignored: fp16 is not supported; use bf16)");
  char ekey[KEY_MAX], got[64];
  join(ekey, sizeof ekey, key, "enabled");
  describe(en, got, sizeof got);
  return fail(c, ekey, "expected true, false or \"auto\", got %s", got);
}

static int parse_top(ctx *c, const json_t *root, train_ds_config *o) {
  const range clip = {0, 1e9, 0, 0};
  const char *k;
  json_t *v;
  json_object_foreach((json_t *)root, k, v) {
    int rc = 0;
    if (!strcmp(k, "train_batch_size")) {
      rc = get_int(c, k, v, 1, 65536, 1, &o->has_train_batch_size,
                   &o->train_batch_size);
    } else if (!strcmp(k, "train_micro_batch_size_per_gpu")) {
      rc = get_int(c, k, v, 1, 65536, 1, &o->has_micro_batch, &o->micro_batch);
    } else if (!strcmp(k, "gradient_accumulation_steps")) {
      rc = get_int(c, k, v, 1, 65536, 1, &o->has_grad_accum, &o->grad_accum);
    } else if (!strcmp(k, "gradient_clipping")) {
      rc = get_num(c, k, v, clip, 1, &o->has_grad_clip, &o->grad_clip, NULL);
    } else if (!strcmp(k, "seed")) {
      rc = get_int(c, k, v, 0, INT_MAX, 0, &o->has_seed, &o->seed);
    } else if (!strcmp(k, "steps_per_print")) {
      rc = get_int(c, k, v, 1, INT_MAX, 0, &o->has_log_every, &o->log_every);
    } else if (!strcmp(k, "zero_optimization")) {
      rc = want_object(c, k, v);
      if (!rc)
        rc = parse_zero(c, k, v, o);
    } else if (!strcmp(k, "optimizer")) {
      rc = want_object(c, k, v);
      if (!rc)
        rc = parse_optimizer(c, k, v, o);
    } else if (!strcmp(k, "scheduler")) {
      rc = want_object(c, k, v);
      if (!rc)
        rc = parse_scheduler(c, k, v, o);
    } else if (!strcmp(k, "checkpoint")) {
      rc = want_object(c, k, v);
      if (!rc)
        rc = parse_checkpoint(c, k, v, o);
    } else if (!strcmp(k, "tensorboard")) {
      rc = want_object(c, k, v);
      if (!rc)
        rc = parse_tensorboard(c, k, v, o);
    } else if (!strcmp(k, "fp16") || !strcmp(k, "bf16")) {
      rc = want_object(c, k, v);
      if (!rc)
        rc = parse_precision(c, k, v, o);
    } else {
      rc = note(c, k, NULL);
    }
    if (rc)
      return rc;
  }
  if (c->has_sched_lr) {
    if (c->has_opt_lr && c->sched_lr != c->opt_lr)
      return fail(c, "scheduler.params.warmup_max_lr",
                  "%.10g differs from optimizer.params.lr %.10g (give one, or "
                  "the same)",
                  c->sched_lr, c->opt_lr);
    o->has_lr = 1;
    o->lr = (float)c->sched_lr;
  }
  return 0;
}

/* Dotted path (a.b[2].c) of the key being read at byte `pos` of a JSON text
 * that is valid up to there: used to name the key that jansson rejects as a
 * duplicate. */
static void path_at(const char *text, size_t len, size_t pos, char *out,
                    size_t n) {
  enum { DEPTH = 64 };
  struct {
    int obj, want_key;
    size_t kbeg, klen;
    long idx;
  } st[DEPTH];
  int depth = 0, deeper = 0, in_str = 0, esc = 0;
  size_t sbeg = 0;
  if (pos > len)
    pos = len;
  for (size_t i = 0; i < pos; i++) {
    char ch = text[i];
    if (in_str) {
      if (esc)
        esc = 0;
      else if (ch == '\\')
        esc = 1;
      else if (ch == '"') {
        in_str = 0;
        if (!deeper && depth > 0 && st[depth - 1].obj &&
            st[depth - 1].want_key) {
          st[depth - 1].kbeg = sbeg;
          st[depth - 1].klen = i - sbeg;
          st[depth - 1].want_key = 0;
        }
      }
      continue;
    }
    switch (ch) {
    case '"':
      in_str = 1;
      sbeg = i + 1;
      break;
    case '{':
    case '[':
      if (depth == DEPTH) {
        deeper++;
        break;
      }
      st[depth].obj = ch == '{';
      st[depth].want_key = ch == '{';
      st[depth].klen = 0;
      st[depth].kbeg = 0;
      st[depth].idx = 0;
      depth++;
      break;
    case '}':
    case ']':
      if (deeper)
        deeper--;
      else if (depth)
        depth--;
      break;
    case ',':
      if (deeper || !depth)
        break;
      if (st[depth - 1].obj)
        st[depth - 1].want_key = 1;
      else
        st[depth - 1].idx++;
      break;
    default:
      break;
    }
  }
  size_t used = 0;
  out[0] = 0;
  for (int d = 0; d < depth && used + 1 < n; d++) {
    int w;
    if (st[d].obj)
      w = snprintf(out + used, n - used, "%s%.*s", used ? "." : "",
                   (int)st[d].klen, text + st[d].kbeg);
    else
      w = snprintf(out + used, n - used, "[%ld]", st[d].idx);
    if (w < 0)
      break;
    used += (size_t)w < n - used ? (size_t)w : n - used - 1;
  }
  if (deeper && used + 4 < n)
    snprintf(out + used, n - used, "...");
}

/* Longest wait for a pipe's writer (`--config <(...)`), seconds. */
#define PIPE_READ_TIMEOUT_S 30

/* A regular file, or a pipe (process substitution) read with a deadline: opened
 * non-blocking, so a FIFO nobody writes never hangs the program (it reads as
 * empty), and a writer that never finishes fails with -ETIMEDOUT. */
static int read_all(const char *path, char **out, size_t *len) {
  *out = NULL;
  *len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return -errno;
  int rc = 0;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    rc = -errno;
    close(fd);
    return rc;
  }
  const int pipe = S_ISFIFO(st.st_mode);
  if (S_ISDIR(st.st_mode) || (!pipe && !S_ISREG(st.st_mode))) {
    close(fd);
    return S_ISDIR(st.st_mode) ? -EISDIR : -ENODEV;
  }
  const double deadline = clock_now_s() + PIPE_READ_TIMEOUT_S;
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  if (!buf) {
    rc = -ENOMEM;
    goto out;
  }
  for (;;) {
    if (n == cap) {
      if (cap >= MAX_FILE_BYTES) {
        rc = -EFBIG;
        goto out;
      }
      char *p = realloc(buf, cap * 2);
      if (!p) {
        rc = -ENOMEM;
        goto out;
      }
      buf = p;
      cap *= 2;
    }
    ssize_t r = read(fd, buf + n, cap - n);
    if (r < 0 && pipe && errno == EAGAIN) {
      double left = deadline - clock_now_s();
      if (left <= 0) {
        rc = -ETIMEDOUT;
        goto out;
      }
      struct pollfd pfd = {fd, POLLIN, 0};
      poll(&pfd, 1, (int)(left * 1000) + 1);
      continue;
    }
    if (r < 0) {
      if (errno == EINTR)
        continue;
      rc = -errno;
      goto out;
    }
    if (r == 0)
      break;
    n += (size_t)r;
  }
out:
  close(fd);
  if (rc) {
    free(buf);
    return rc;
  }
  *out = buf;
  *len = n;
  return 0;
}

int train_ds_config_load(const char *path, train_ds_config *out, char *why,
                         size_t why_len, char *unknown, size_t unknown_len) {
  ctx c = {0};
  c.file = path ? path : "(null)";
  c.why = why;
  c.why_len = why ? why_len : 0;
  c.want_unknown = unknown && unknown_len;
  if (c.why_len)
    why[0] = 0;
  if (c.want_unknown)
    unknown[0] = 0;
  if (!out)
    return fail(&c, NULL, "no output struct");
  memset(out, 0, sizeof *out);
  if (!path)
    return fail(&c, NULL, "no path");

  char *text = NULL;
  size_t len = 0;
  json_t *root = NULL;
  int rc = read_all(path, &text, &len);
  if (rc) {
    if (c.why_len)
      snprintf(why, why_len, "%s: cannot read: %s", path,
               rc == -ENODEV ? "not a regular file or a pipe (a device or a socket)"
                             : strerror(-rc));
    goto out;
  }

  json_error_t err;
  /* a UTF-8 byte-order mark (editors on Windows write one) is not JSON: skip it
   */
  size_t bom = len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
  root = json_loadb(text + bom, len - bom, JSON_REJECT_DUPLICATES, &err);
  if (!root) {
    if (json_error_code(&err) == json_error_out_of_memory) {
      rc = -ENOMEM;
      if (c.why_len)
        snprintf(why, why_len, "%s: out of memory parsing JSON", path);
    } else if (json_error_code(&err) == json_error_duplicate_key) {
      char key[KEY_MAX];
      path_at(text + bom, len - bom,
              err.position > 0 ? (size_t)err.position : 0, key, sizeof key);
      rc = -EINVAL;
      if (c.why_len)
        snprintf(why, why_len, "%s: line %d column %d: %s: duplicate key", path,
                 err.line, err.column, key[0] ? key : "?");
    } else {
      rc = -EINVAL;
      if (c.why_len)
        snprintf(why, why_len, "%s: line %d column %d: JSON syntax error: %s",
                 path, err.line, err.column, err.text);
    }
    goto out;
  }
  if (!json_is_object(root)) {
    rc =
        fail(&c, NULL, "expected a JSON object at the top level, got an array");
    goto out;
  }
  rc = parse_top(&c, root, out);

out:
  if (rc) {
    memset(out, 0, sizeof *out);
  } else if (c.want_unknown && c.unk_len) {
    if (c.unk_len < unknown_len) {
      memcpy(unknown, c.unk, c.unk_len + 1);
    } else {
      size_t keep = unknown_len > 4 ? unknown_len - 4 : 0;
      memcpy(unknown, c.unk, keep);
      snprintf(unknown + keep, unknown_len - keep, "...");
    }
  }
  free(c.unk);
  json_decref(root);
  free(text);
  return rc;
}
