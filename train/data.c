/* Token shards, sample order and the prepare step. */
#include "data.h"

#include "log.h"
#include "rng.h"
#include "storage.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define TAG "data"

typedef struct shard {
    char *path;
    int fd;
    uint64_t ntokens;
    uint64_t nsamples;
    uint64_t first_sample; /* global number of the shard's first sample */
} shard;

struct train_dataset {
    shard *shards;
    size_t nshards;
    int seq_len;
    uint64_t nsamples, ntokens, hash;
    /* cached permutation of one epoch */
    uint32_t *perm;
    int64_t perm_epoch;
    uint64_t perm_seed;
};


/* Open a shard, check its header and size, stream every token once (range check against
 * vocab, hash). Tokens are read with pread when sampled, not mapped: a file truncated or
 * rewritten under a running job then gives an error, not a SIGBUS. */
static int open_shard(shard *s, int seq_len, int vocab, XXH3_state_t *hs, char *why, size_t why_len)
{
    /* a FIFO or a folder matched by the glob is refused at once, never waited on */
    struct stat st;
    int fd = store_open_regular(s->path, 0, 0, &st);
    if (fd == -ENODEV || fd == -EISDIR) {
        log_why(why, why_len, "%s: not a regular file", s->path);
        return -EBADMSG;
    }
    if (fd < 0) {
        log_why(why, why_len, "%s: cannot open: %s", s->path, strerror(-fd));
        return fd;
    }
    s->fd = fd;
    const size_t hdr = TRAIN_SHARD_HEADER_INTS * sizeof(int32_t);
    if ((size_t)st.st_size < hdr) {
        log_why(why, why_len, "%s: %lld bytes, shorter than the %zu-byte header", s->path,
            (long long)st.st_size, hdr);
        return -EBADMSG;
    }
    int32_t h[3];
    if (pread(fd, h, sizeof h, 0) != (ssize_t)sizeof h) { /* little-endian hosts only */
        log_why(why, why_len, "%s: cannot read the header", s->path);
        return -EIO;
    }
    if (h[0] != TRAIN_SHARD_MAGIC) {
        log_why(why, why_len, "%s: bad magic %d (expected %d): not an llm.c token shard", s->path, h[0],
            TRAIN_SHARD_MAGIC);
        return -EBADMSG;
    }
    if (h[1] != TRAIN_SHARD_VERSION) {
        log_why(why, why_len, "%s: shard version %d not supported (only %d: uint16 tokens)", s->path,
            h[1], TRAIN_SHARD_VERSION);
        return -EBADMSG;
    }
    if (h[2] < 0) {
        log_why(why, why_len, "%s: header says %d tokens, a negative count", s->path, h[2]);
        return -EBADMSG;
    }
    if ((uint64_t)st.st_size != hdr + 2ull * (uint64_t)h[2]) {
        log_why(why, why_len, "%s: header says %d tokens (%llu bytes) but the file has %lld bytes",
            s->path, h[2], (unsigned long long)(hdr + 2ull * (uint64_t)h[2]), (long long)st.st_size);
        return -EBADMSG;
    }
    s->ntokens = (uint64_t)h[2];
    uint16_t *buf = malloc(1u << 20);
    if (!buf) return -ENOMEM;
    int rc = 0;
    for (uint64_t done = 0; done < s->ntokens && rc == 0;) {
        size_t n = (size_t)(s->ntokens - done < (1u << 19) ? s->ntokens - done : (1u << 19));
        ssize_t got = pread(fd, buf, n * 2, (off_t)(hdr + done * 2));
        if (got != (ssize_t)(n * 2)) {
            log_why(why, why_len, "%s: short read at token %llu", s->path, (unsigned long long)done);
            rc = -EIO;
            break;
        }
        for (size_t i = 0; i < n; i++)
            if (buf[i] >= vocab) {
                log_why(why, why_len, "%s: token %u at position %llu is outside the vocabulary (%d)",
                    s->path, buf[i], (unsigned long long)(done + i), vocab);
                rc = -EBADMSG;
                break;
            }
        XXH3_64bits_update(hs, buf, n * 2);
        done += n;
    }
    free(buf);
    if (rc < 0) return rc;
    s->nsamples = s->ntokens > 0 ? (s->ntokens - 1) / (uint64_t)seq_len : 0;
    if (s->nsamples == 0) {
        log_why(why, why_len, "%s: %llu tokens, too few for one sample of %d+1 tokens", s->path,
            (unsigned long long)s->ntokens, seq_len);
        return -EBADMSG;
    }
    return 0;
}

int train_dataset_open(train_dataset **out, const char *glob_pattern, int seq_len, int vocab,
                       char *why, size_t why_len)
{
    *out = NULL;
    if (!glob_pattern || seq_len < 1 || vocab < 2 || vocab > 65536) return -EINVAL;
    glob_t g;
    int grc = glob(glob_pattern, 0, NULL, &g);
    if (grc == GLOB_NOMATCH || (grc == 0 && g.gl_pathc == 0)) {
        log_why(why, why_len, "%s: no file matches", glob_pattern);
        globfree(&g);
        return -ENOENT;
    }
    if (grc != 0) {
        log_why(why, why_len, "%s: cannot expand the pattern", glob_pattern);
        globfree(&g);
        return -EINVAL;
    }
    int rc = -ENOMEM;
    train_dataset *d = calloc(1, sizeof *d);
    if (!d) goto fail;
    d->seq_len = seq_len;
    d->perm_epoch = -1;
    d->shards = calloc(g.gl_pathc, sizeof *d->shards);
    if (!d->shards) goto fail;
    XXH3_state_t *hs = XXH3_createState();
    if (!hs) goto fail;
    XXH3_64bits_reset(hs);
    for (size_t i = 0; i < g.gl_pathc; i++) {
        shard *s = &d->shards[d->nshards++];
        s->fd = -1;
        s->path = strdup(g.gl_pathv[i]);
        if (!s->path) {
            rc = -ENOMEM;
            break;
        }
        if ((rc = open_shard(s, seq_len, vocab, hs, why, why_len)) < 0) break;
        s->first_sample = d->nsamples;
        d->nsamples += s->nsamples;
        d->ntokens += s->ntokens;
    }
    d->hash = XXH3_64bits_digest(hs);
    XXH3_freeState(hs);
    if (rc < 0) goto fail;
    if (d->nsamples > UINT32_MAX) {
        log_why(why, why_len, "%s: more than 2^32 samples", glob_pattern);
        rc = -EINVAL;
        goto fail;
    }
    globfree(&g);
    *out = d;
    return 0;
fail:
    globfree(&g);
    train_dataset_close(d);
    return rc;
}

void train_dataset_close(train_dataset *d)
{
    if (!d) return;
    for (size_t i = 0; i < d->nshards; i++) {
        if (d->shards[i].fd >= 0) close(d->shards[i].fd);
        free(d->shards[i].path);
    }
    free(d->shards);
    free(d->perm);
    free(d);
}

uint64_t train_dataset_num_samples(const train_dataset *d) { return d->nsamples; }
uint64_t train_dataset_num_tokens(const train_dataset *d) { return d->ntokens; }
size_t train_dataset_num_files(const train_dataset *d) { return d->nshards; }
uint64_t train_dataset_hash(const train_dataset *d) { return d->hash; }

int train_dataset_sample(const train_dataset *d, uint64_t index, int32_t *inputs, int32_t *targets,
                         char *why, size_t why_len)
{
    if (index >= d->nsamples) return -EINVAL;
    size_t lo = 0, hi = d->nshards;
    while (hi - lo > 1) { /* last shard whose first sample <= index */
        size_t mid = (lo + hi) / 2;
        if (d->shards[mid].first_sample <= index) lo = mid;
        else hi = mid;
    }
    const shard *s = &d->shards[lo];
    const int T = d->seq_len;
    uint16_t buf[1024];
    uint16_t *t = (size_t)T + 1 <= sizeof buf / sizeof buf[0] ? buf : malloc(((size_t)T + 1) * 2);
    if (!t) return -ENOMEM;
    off_t off = (off_t)(TRAIN_SHARD_HEADER_INTS * sizeof(int32_t) +
                        (index - s->first_sample) * (uint64_t)T * 2);
    ssize_t got = pread(s->fd, t, ((size_t)T + 1) * 2, off);
    int rc = 0;
    if (got != (ssize_t)(((size_t)T + 1) * 2)) {
        log_why(why, why_len, "%s: %s reading sample %llu: the file changed while training",
            s->path, got < 0 ? strerror(errno) : "short read", (unsigned long long)index);
        rc = -EIO;
    } else {
        for (int i = 0; i < T; i++) {
            inputs[i] = t[i];
            targets[i] = t[i + 1];
        }
    }
    if (t != buf) free(t);
    return rc;
}

int64_t train_dataset_order(train_dataset *d, uint64_t seed, uint64_t k)
{
    uint64_t n = d->nsamples;
    int64_t epoch = (int64_t)(k / n);
    if (!d->perm || d->perm_epoch != epoch || d->perm_seed != seed) {
        if (!d->perm) {
            d->perm = malloc(n * sizeof *d->perm);
            if (!d->perm) return -ENOMEM;
        }
        for (uint64_t i = 0; i < n; i++) d->perm[i] = (uint32_t)i;
        /* Fisher-Yates; modulo bias is below 2^-32 for n < 2^32 and irrelevant here */
        for (uint64_t i = n - 1; i > 0; i--) {
            uint64_t j = train_rng_u64(seed, 0x5a4d1e00ull + (uint64_t)epoch, i) % (i + 1);
            uint32_t tmp = d->perm[i];
            d->perm[i] = d->perm[j];
            d->perm[j] = tmp;
        }
        d->perm_epoch = epoch;
        d->perm_seed = seed;
    }
    return (int64_t)d->perm[k % n];
}

/* ------------------------------------------------------------------ prepare */

static int is_punct_token(const char *w, size_t n)
{
    if (n == 1 && strchr(".,;:?!)]}", w[0])) return 1;
    if (n >= 1 && w[0] == '\'' ) return 1; /* 's, 't, '' closing quote */
    return 0;
}

size_t train_brown_to_text(char *buf, size_t len)
{
    size_t out = 0, i = 0;
    int line_has_words = 0, no_space_next = 0;
    while (i < len) {
        if (buf[i] == '\n') {
            if (line_has_words) buf[out++] = '\n';
            line_has_words = 0;
            no_space_next = 0;
            i++;
            continue;
        }
        if (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\r') {
            i++;
            continue;
        }
        size_t start = i;
        while (i < len && buf[i] != ' ' && buf[i] != '\t' && buf[i] != '\n' && buf[i] != '\r') i++;
        size_t end = i, slash = end;
        for (size_t k = start; k < end; k++)
            if (buf[k] == '/') slash = k;
        size_t wn = slash - start;
        if (wn == 0) continue;
        const char *w = buf + start;
        int open_quote = wn == 2 && w[0] == '`' && w[1] == '`';
        int close_quote = wn == 2 && w[0] == '\'' && w[1] == '\'';
        int punct = close_quote || is_punct_token(w, wn);
        if (line_has_words && !punct && !no_space_next) buf[out++] = ' ';
        if (open_quote || close_quote) {
            buf[out++] = '"';
        } else {
            memmove(buf + out, w, wn); /* out <= start: never overtakes the input */
            out += wn;
        }
        no_space_next = open_quote || (wn == 1 && strchr("([{", w[0]));
        line_has_words = 1;
    }
    return out;
}

typedef struct shard_writer {
    const char *dir;
    const char *kind; /* "train" or "val" */
    int index;
    uint16_t *buf;
    size_t n, cap;
    uint64_t total;
} shard_writer;

#define SHARD_MAX_TOKENS 100000000u

static int flush_shard(shard_writer *w, char *why, size_t why_len)
{
    if (w->n == 0) return 0;
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%s_%06d.bin", w->dir, w->kind, w->index);
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    size_t hdr = TRAIN_SHARD_HEADER_INTS * sizeof(int32_t);
    size_t bytes = hdr + w->n * sizeof(uint16_t);
    char *data = calloc(1, bytes);
    if (!data) return -ENOMEM;
    int32_t h[3] = {TRAIN_SHARD_MAGIC, TRAIN_SHARD_VERSION, (int32_t)w->n};
    memcpy(data, h, sizeof h);
    memcpy(data + hdr, w->buf, w->n * sizeof(uint16_t));
    unlink(tmp);
    int rc = store_write_file_durable(tmp, data, bytes);
    free(data);
    if (rc == 0) rc = store_rename_durable(tmp, path);
    if (rc < 0) {
        unlink(tmp);
        log_why(why, why_len, "%s: cannot write: %s", path, strerror(-rc));
        return rc;
    }
    LOG_I(TAG, "wrote %s (%zu tokens)", path, w->n);
    w->total += w->n;
    w->n = 0;
    w->index++;
    return 0;
}

static int put_bytes(shard_writer *w, const char *p, size_t n, char *why, size_t why_len)
{
    for (size_t i = 0; i < n; i++) {
        if (w->n == w->cap) {
            size_t cap = w->cap ? w->cap * 2 : 1u << 20;
            if (cap > SHARD_MAX_TOKENS) cap = SHARD_MAX_TOKENS;
            uint16_t *nb = realloc(w->buf, cap * sizeof *nb);
            if (!nb) return -ENOMEM;
            w->buf = nb;
            w->cap = cap;
        }
        w->buf[w->n++] = (uint8_t)p[i];
        if (w->n == SHARD_MAX_TOKENS) {
            int rc = flush_shard(w, why, why_len);
            if (rc < 0) return rc;
        }
    }
    return 0;
}

static int is_val_file(size_t i, double f)
{
    return (long long)((double)(i + 1) * f) > (long long)((double)i * f);
}

int train_prepare(const char *out_dir, const char *const *files, size_t nfiles,
                  double val_fraction, int format, uint64_t *train_tokens, uint64_t *val_tokens,
                  char *why, size_t why_len)
{
    if (!out_dir || !files || nfiles == 0) {
        log_why(why, why_len, "no input files");
        return -EINVAL;
    }
    if (!(val_fraction >= 0.0 && val_fraction <= 0.5)) {
        log_why(why, why_len, "validation fraction %g is outside [0, 0.5]", val_fraction);
        return -EINVAL;
    }
    char tmp[4096];
    if (strlen(out_dir) >= sizeof tmp) {
        log_why(why, why_len, "output folder name too long");
        return -EINVAL;
    }
    snprintf(tmp, sizeof tmp, "%s", out_dir);
    for (char *p = tmp + 1;; p++) { /* like mkdir -p */
        char c = *p;
        if (c != '/' && c != '\0') continue;
        *p = '\0';
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            log_why(why, why_len, "%s: cannot create: %s", tmp, strerror(e));
            return -e;
        }
        *p = c;
        if (c == '\0') break;
    }
    shard_writer tw = {out_dir, "train", 0, NULL, 0, 0, 0};
    shard_writer vw = {out_dir, "val", 0, NULL, 0, 0, 0};
    int rc = 0;
    for (size_t i = 0; i < nfiles && rc == 0; i++) {
        char *text = NULL;
        size_t len = 0;
        rc = store_read_file(files[i], (size_t)1 << 31, 0, &text, &len);
        if (rc < 0) {
            log_why(why, why_len, "%s: cannot read: %s", files[i], strerror(-rc));
            break;
        }
        if (format == TRAIN_TEXT_BROWN) len = train_brown_to_text(text, len);
        if (len == 0) {
            LOG_W(TAG, "%s: empty after conversion, skipped", files[i]);
            free(text);
            continue;
        }
        if (nfiles == 1) {
            size_t nval = (size_t)((double)len * val_fraction);
            rc = put_bytes(&tw, text, len - nval, why, why_len);
            if (rc == 0) rc = put_bytes(&vw, text + (len - nval), nval, why, why_len);
        } else {
            shard_writer *w = is_val_file(i, val_fraction) ? &vw : &tw;
            if (w->n > 0 || w->total > 0) rc = put_bytes(w, "\n\n", 2, why, why_len);
            if (rc == 0) rc = put_bytes(w, text, len, why, why_len);
        }
        free(text);
    }
    if (rc == 0 && tw.n + tw.total == 0) {
        log_why(why, why_len, "no training text: the inputs are empty");
        rc = -EINVAL;
    }
    if (rc == 0 && val_fraction > 0 && vw.n + vw.total == 0) {
        log_why(why, why_len, "the validation split is empty: use more text or a larger --val-fraction");
        rc = -EINVAL;
    }
    if (rc == 0) rc = flush_shard(&tw, why, why_len);
    if (rc == 0) rc = flush_shard(&vw, why, why_len);
    /* shards of an earlier, larger prepare into the same folder would be picked up by the
     * same glob: remove the numbers past the ones just written */
    for (int k = 0; rc == 0 && k < 2; k++) {
        shard_writer *w = k ? &vw : &tw;
        for (int i = w->index;; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s_%06d.bin", out_dir, w->kind, i);
            if (unlink(path) != 0) break;
            LOG_I(TAG, "removed stale shard %s from an earlier prepare", path);
        }
    }
    if (rc == 0) {
        if (train_tokens) *train_tokens = tw.total;
        if (val_tokens) *val_tokens = vw.total;
    }
    free(tw.buf);
    free(vw.buf);
    return rc;
}
