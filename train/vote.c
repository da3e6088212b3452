/* Two-phase-commit votes of sharded snapshots over the elastic store (vote.h). */
#include "clock.h"
#include "vote.h"

#include "log.h"
#include "store.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TAG "vote"

struct train_vote {
    elastic_store_client *c;
    char prefix[208];
    char tag[64];
    int rank, world;
};

static int put(train_vote *v, const char *key, int result)
{
    char val[24];
    int n = snprintf(val, sizeof val, "%d", result);
    return elastic_store_set(v->c, key, val, (size_t)n);
}

/* Read a result key, waiting up to timeout_s, into *result. Returns 0, or the error of the
 * store (-ETIMEDOUT: the key did not appear; -EBADMSG: not a result). */
static int get_value(train_vote *v, const char *key, double timeout_s, int *result)
{
    void *val = NULL;
    size_t len = 0;
    int rc = elastic_store_get(v->c, key, &val, &len, timeout_s < 0 ? 0 : timeout_s);
    if (rc < 0) return rc;
    char buf[24];
    long r = 0;
    if (len == 0 || len >= sizeof buf) rc = -EBADMSG;
    else {
        memcpy(buf, val, len);
        buf[len] = '\0';
        char *end;
        errno = 0;
        r = strtol(buf, &end, 10);
        if (errno || *end || r > 0 || r < -4095) rc = -EBADMSG;
    }
    free(val);
    if (rc == 0) *result = (int)r;
    return rc;
}

/* The result stored at key (0 or negative), or the store's error reading it. */
static int get_result(train_vote *v, const char *key, double timeout_s)
{
    int result = 0;
    int rc = get_value(v, key, timeout_s, &result);
    return rc < 0 ? rc : result;
}

static int vote_cb(void *ctx, uint64_t step, int result)
{
    train_vote *v = ctx;
    char key[300];
    snprintf(key, sizeof key, "%s/%" PRIu64 "/vote/%d", v->prefix, step, v->rank);
    return put(v, key, result);
}

static int collect_cb(void *ctx, uint64_t step, double timeout_s)
{
    train_vote *v = ctx;
    double deadline = clock_now_s() + timeout_s;
    for (int r = 1; r < v->world; r++) {
        char key[300];
        snprintf(key, sizeof key, "%s/%" PRIu64 "/vote/%d", v->prefix, step, r);
        int rc = get_result(v, key, deadline - clock_now_s());
        if (rc == -ETIMEDOUT) {
            LOG_E(TAG, "step %" PRIu64 ": rank %d did not report its shard within %.0f s", step, r,
                  timeout_s);
            return rc;
        }
        if (rc == -ECONNRESET || rc == -EPIPE) {
            LOG_E(TAG, "step %" PRIu64 ": lost the store while waiting for rank %d's vote (the "
                  "group is being torn down)", step, r);
            return rc;
        }
        if (rc < 0) {
            LOG_E(TAG, "step %" PRIu64 ": rank %d failed to save its shard: %s", step, r,
                  strerror(-rc));
            return rc;
        }
    }
    return 0;
}

static int decide_cb(void *ctx, uint64_t step, int result)
{
    train_vote *v = ctx;
    char key[300];
    snprintf(key, sizeof key, "%s/%" PRIu64 "/decision", v->prefix, step);
    return put(v, key, result);
}

static int outcome_cb(void *ctx, uint64_t step, double timeout_s, int *decision)
{
    train_vote *v = ctx;
    char key[300];
    snprintf(key, sizeof key, "%s/%" PRIu64 "/decision", v->prefix, step);
    int result = 0;
    int rc = get_value(v, key, timeout_s, &result);
    if (rc == 0) *decision = result;
    return rc;
}

int train_vote_create(train_vote **out, ckpt_group *group, const char *host, int port,
                      const char *token, double connect_timeout_s, const char *prefix,
                      const char *tag, int rank, int world_size, double timeout_s)
{
    if (!out || !group || !host || !prefix || !tag) return -EINVAL;
    *out = NULL;
    size_t pl = strlen(prefix), tl = strlen(tag);
    if (pl < 1 || pl > 200 || tl < 1 || tl > 63 || world_size < 1 || rank < 0 ||
        rank >= world_size || !(timeout_s > 0))
        return -EINVAL;
    train_vote *v = calloc(1, sizeof *v);
    if (!v) return -ENOMEM;
    int rc = elastic_store_connect(&v->c, host, port, token, connect_timeout_s);
    if (rc < 0) {
        free(v);
        return rc;
    }
    memcpy(v->prefix, prefix, pl + 1);
    memcpy(v->tag, tag, tl + 1);
    v->rank = rank;
    v->world = world_size;
    *group = (ckpt_group){(uint32_t)rank, (uint32_t)world_size, v->tag, v, vote_cb, collect_cb,
                          decide_cb, outcome_cb, timeout_s};
    *out = v;
    return 0;
}

void train_vote_free(train_vote *v)
{
    if (!v) return;
    elastic_store_close(v->c);
    free(v);
}

void train_vote_abort(train_vote *v)
{
    if (v) elastic_store_interrupt(v->c);
}
