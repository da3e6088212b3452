/* train_startup.c - start-up of the train program's ranks: the group, each rank's own start-up,
 * the ranks' agreement on it, shard ranges (see train_internal.h). */
#include "ckpt.h"
#include "clock.h"
#include "comm.h"
#include "data.h"
#include "log.h"
#include "model.h"
#include "store.h"
#include "storage.h"
#include "train_internal.h"
#include "vote.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TAG "train"

/* ------------------------------------------------------------------ ranks */

/* Slurm's variables stand in for torchrun's when those are absent (srun without torchrun). */
static void env_from_slurm(void)
{
    const char *pid = getenv("SLURM_PROCID"), *nt = getenv("SLURM_NTASKS");
    if (getenv("RANK") || !pid || !nt) return;
    setenv("RANK", pid, 1);
    setenv("WORLD_SIZE", nt, 1);
    const char *lid = getenv("SLURM_LOCALID");
    if (lid) setenv("LOCAL_RANK", lid, 1);
    if (!getenv("MASTER_PORT")) setenv("MASTER_PORT", "29500", 1);
    if (!getenv("MASTER_ADDR")) {
        const char *nn = getenv("SLURM_NNODES");
        const char *launch = getenv("SLURM_LAUNCH_NODE_IPADDR");
        if (nn && !strcmp(nn, "1")) setenv("MASTER_ADDR", "127.0.0.1", 1);
        else if (launch) setenv("MASTER_ADDR", launch, 1);
    }
}

int train_input_status(int rc)
{
    switch (rc) {
    case -EMFILE: case -ENFILE: case -ENOMEM: case -EIO: case -ETIMEDOUT: case -EAGAIN:
    case -EINTR: case -EBUSY: case -ECONNRESET: case -ENOSPC:
        return 1;
    default:
        return 2;
    }
}

/* This rank's own start-up: open the data, and on rank 0 take the snapshot folder's lock.
 * Returns 0, or the exit status (the reason is printed here, naming the rank). */
int train_startup_local(state *s)
{
    const options *o = s->o;
    char why[512] = "";
    /* CKPT_RESTORE_* (train_resume.c): a bad value is a configuration error, told to the
     * other ranks by the agreement like the rest below */
    if (train_restore_env(s) < 0) return 2; /* one line */
    /* the device first: a missing GPU is a configuration error (one line, exit 2) */
    int rc = train_device_setup(s);
    if (rc != 0) return rc;
    rc = train_dataset_open(&s->train, o->data, o->model.seq_len, o->model.vocab, why,
                                sizeof why);
    /* bad data is a configuration error: a restart reads the same files (DESIGN I8) */
    if (rc < 0) {
        LOG_E(TAG, "training data: %s", why);
        return train_input_status(rc);
    }
    if (o->val_data) {
        rc = train_dataset_open(&s->val, o->val_data, o->model.seq_len, o->model.vocab, why,
                                sizeof why);
        if (rc < 0) {
            LOG_E(TAG, "validation data: %s", why);
            return train_input_status(rc);
        }
    }
    if (o->ckpt_dir && s->rank == 0) {
        struct stat st;
        int existed = stat(o->ckpt_dir, &st) == 0;
        long holder = 0;
        char howner[80] = "";
        /* the launcher's job id names this job in the lock: a rank of an earlier round of the
         * same job that still holds it (stopping slowly, or on a node cut off from the store
         * that has not noticed yet) is waited for, within half the collective deadline (the
         * other ranks wait for rank 0 at the start-up agreement), then exit 1, a restart; only
         * another run's lock is a configuration error */
        const char *job = getenv("ELASTIC_RUN_ID");
        if (job && (!*job || strlen(job) > 64 || strspn(job, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghij"
                                                            "klmnopqrstuvwxyz0123456789_.-") != strlen(job)))
            job = NULL;
        rc = ckpt_dir_lock_acquire_owned(o->ckpt_dir, job, &s->lock, &holder, howner, sizeof howner);
        if (rc == -EBUSY && job && !strcmp(howner, job)) {
            double wait_s = o->comm_timeout / 2, t0 = clock_now_s();
            LOG_W(TAG, "snapshot folder %s is still locked by pid %ld of an earlier round of this "
                  "job (%s): waiting up to %.0f s for it to exit", o->ckpt_dir, holder, job, wait_s);
            while (rc == -EBUSY && !strcmp(howner, job) && clock_now_s() - t0 < wait_s) {
                struct timespec ts = {0, 100 * 1000000L};
                nanosleep(&ts, NULL);
                rc = ckpt_dir_lock_acquire_owned(o->ckpt_dir, job, &s->lock, &holder, howner,
                                                 sizeof howner);
            }
            if (rc == 0) {
                LOG_I(TAG, "snapshot folder %s: the earlier round's lock was released after %.1f s",
                      o->ckpt_dir, clock_now_s() - t0);
            } else if (rc == -EBUSY && !strcmp(howner, job)) {
                LOG_E(TAG, "snapshot folder %s is still locked by pid %ld of an earlier round of this "
                      "job (%s) after %.0f s; exiting 1 so that the launcher tries again", o->ckpt_dir,
                      holder, job, wait_s);
                return 1;
            }
        }
        if (rc == -EBUSY) {
            LOG_E(TAG, "snapshot folder %s is in use by another run (pid %ld); two runs must not "
                  "share a --ckpt-dir", o->ckpt_dir, holder);
            return 2;
        }
        if (rc == -EINVAL) {
            LOG_E(TAG, "cannot use %s as the snapshot folder: it is a snapshot folder itself (it "
                  "holds a manifest.json or is named like one); give the folder that holds the "
                  "snapshots", o->ckpt_dir);
            return 2;
        }
        if (rc == -EMLINK) {
            LOG_E(TAG, "cannot use %s as the snapshot folder: its .lock has other hard links, "
                  "whose file would receive this run's pid; remove it (nothing was written)",
                  o->ckpt_dir);
            return 2;
        }
        if (rc == -ELOOP || rc == -EISDIR || rc == -ENODEV) {
            LOG_E(TAG, "cannot use %s as the snapshot folder: its .lock is %s, not a regular "
                  "file; remove it (nothing else was touched)", o->ckpt_dir,
                  rc == -ELOOP ? "a symbolic link" : rc == -EISDIR ? "a folder"
                                                                : "a FIFO, socket or device");
            return 2;
        }
        if (rc < 0) {
            LOG_E(TAG, "cannot use %s as the snapshot folder: %s", o->ckpt_dir, strerror(-rc));
            return train_input_status(rc); /* EACCES, EROFS, ENOTDIR: 2; EMFILE: 1 */
        }
        if (!existed && o->resume && !strcmp(o->resume, "auto"))
            LOG_W(TAG, "snapshot folder %s did not exist (created it): nothing to resume",
                  o->ckpt_dir);
    }
    if (o->s3) return train_s3_open(s);
    return 0;
}

/* The device kind of --device (cpu or cuda): ranks of one job may use different GPU numbers
 * (cuda:$LOCAL_RANK), never different kinds (their collectives would not match up). */
static const char *device_kind_text(const options *o)
{
    train_device_kind kind = TRAIN_DEVICE_CPU;
    int ordinal = 0;
    if (o->device && train_device_parse(o->device, &kind, &ordinal) < 0) return o->device;
    return kind == TRAIN_DEVICE_CUDA ? "cuda" : "cpu";
}

/* The settings every rank must share, as "key=value;" text (a rank started with another
 * learning rate, seed, data, batch, snapshot folder, ... would train something else and save
 * shards that do not fit together; a rank with another dtype or device kind computes other
 * gradients or runs other collectives). */
static void settings_text(const state *s, char *buf, size_t len)
{
    const options *o = s->o;
    /* one canonical form on every rank, whether or not rank 0 created the folder yet */
    char dir[CKPT_PATH_MAX] = "-";
    if (o->ckpt_dir && store_canonical_path(o->ckpt_dir, dir, sizeof dir) < 0)
        snprintf(dir, sizeof dir, "%s", o->ckpt_dir);
    snprintf(buf, len,
             "data=%016" PRIx64 ";val-data=%016" PRIx64 ";vocab=%d;seq-len=%d;n-layer=%d;"
             "n-embd=%d;n-head=%d;micro-batch=%d;grad-accum=%d%s;global-batch=%d;zero-stage=%d;"
             "steps=%d;lr=%.9g;min-lr-ratio=%.9g;warmup=%d;weight-decay=%.9g;grad-clip=%.9g;"
             "beta1=%.9g;beta2=%.9g;eps=%.9g;seed=%" PRIu64 ";eval-every=%d;val-samples=%d;"
             "ckpt-every=%d;resume=%s;run-id=%s;keep-last=%u;keep-every=%d;compress=%d;"
             "zstd-level=%d;shuffle=%d;chunk=%" PRIu64 ";policy=%d;comm-timeout=%g;s3=%.1000s;"
             "s3-part=%" PRIu64 ";s3-signature=%d;s3-keep-last=%u;mem-every=%d;mem-budget=%" PRIu64
             ";mem-mode=%s;dtype=%s;device=%s;reduce=%s;ckpt-dir=%.3000s;",
             s->train ? train_dataset_hash(s->train) : 0, s->val ? train_dataset_hash(s->val) : 0,
             o->model.vocab, o->model.seq_len, o->model.n_layer, o->model.n_embd, o->model.n_head,
             o->micro_batch, o->grad_accum, o->grad_accum_set ? "(given)" : "", o->global_batch,
             o->zero_stage, o->steps, train_f2d(o->adam.lr), train_f2d(o->adam.min_lr_ratio),
             o->adam.warmup, train_f2d(o->adam.weight_decay), train_f2d(o->adam.grad_clip),
             train_f2d(o->adam.beta1), train_f2d(o->adam.beta2), train_f2d(o->adam.eps), o->seed,
             o->eval_every, o->val_samples, o->ckpt_every, o->resume ? o->resume : "none",
             o->run_id ? o->run_id : "-", o->keep_last, o->keep_every, o->compress, o->zstd_level,
             o->filter, o->chunk_bytes, o->policy, o->comm_timeout, o->s3 ? o->s3 : "-",
             o->s3_part_bytes, o->s3_signature, o->s3_keep_last, o->mem_every, o->mem_budget,
             o->mem_async < 0 ? "default" : o->mem_async ? "async" : "sync", o->bf16 ? "bf16" : "fp32", device_kind_text(o), o->reduce_ring ? "ring" : "tree", dir);
}

/* The first setting in which a and b differ, as "key (a vs b)". */
static void first_difference(const char *a, const char *b, int rank_b, char *out, size_t len)
{
    snprintf(out, len, "?");
    while (*a && *b) {
        const char *ea = strchr(a, ';'), *eb = strchr(b, ';');
        if (!ea || !eb) break;
        size_t la = (size_t)(ea - a), lb = (size_t)(eb - b);
        if (la != lb || memcmp(a, b, la) != 0) {
            const char *eq = memchr(a, '=', la);
            int kl = eq ? (int)(eq - a) : (int)la;
            const char *vb = memchr(b, '=', lb);
            snprintf(out, len, "%.*s (rank 0: %.*s, rank %d: %.*s)", kl, a,
                     eq ? (int)(ea - eq - 1) : 0, eq ? eq + 1 : "", rank_b,
                     vb ? (int)(eb - vb - 1) : 0, vb ? vb + 1 : "");
            return;
        }
        a = ea + 1;
        b = eb + 1;
    }
}

/* Rank 0: remove the probe files a killed rank 0 left (it holds the folder's lock: no other
 * run uses them), then write DIR/.probe-<token> holding the token. */
static int write_probe(const char *dir, char token[40])
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)))
            if (!strncmp(de->d_name, ".probe-", 7)) unlinkat(dirfd(d), de->d_name, 0);
        closedir(d);
    }
    snprintf(token, 40, ".probe-%016" PRIx64, train_random_u64());
    char path[CKPT_PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", dir, token) >= (int)sizeof path) return -ENAMETOOLONG;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    size_t n = strlen(token);
    int rc = write(fd, token, n) == (ssize_t)n ? 0 : -EIO;
    if (close(fd) != 0 && rc == 0) rc = -errno;
    if (rc < 0) unlink(path);
    return rc;
}

/* A rank != 0: 0 when DIR/token holds the token; waits up to 2 s for it to appear (a network
 * file system may show a new file to other clients late). */
static int read_probe(const char *dir, const char *token)
{
    char path[CKPT_PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", dir, token) >= (int)sizeof path) return -ENAMETOOLONG;
    int rc = -ENOENT;
    for (int tries = 0; tries < 20; tries++) {
        if (tries) {
            struct timespec ts = {0, 100 * 1000000L};
            nanosleep(&ts, NULL);
        }
        int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            rc = -errno;
            if (rc != -ENOENT && rc != -ENOTDIR) return rc;
            continue;
        }
        char buf[40] = "";
        ssize_t got = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (got == (ssize_t)strlen(token) && !memcmp(buf, token, (size_t)got)) return 0;
        rc = -ESTALE; /* another file of that name: not the folder rank 0 wrote to */
    }
    return rc;
}

/* Every rank must see the snapshot folder rank 0 writes to: the commit protocol has rank 0
 * read the other ranks' part records there and write the manifest (docs/FORMAT.md), so
 * node-local folders under one path would fail every snapshot. Rank 0 writes a probe file
 * with a random name, every rank reads it back, rank 0 removes it (collective, two
 * exchanges). Returns 0; 2 when a rank does not see it (a configuration error: a restart
 * finds the same, DESIGN I8) or rank 0 cannot write it for a lasting reason; 1 when an
 * exchange failed or rank 0's write failed transiently. */
static int check_shared_folder(state *s)
{
    const char *dir = s->o->ckpt_dir;
    typedef struct { int32_t err; char token[40]; } rec;
    rec *all = calloc((size_t)s->world, sizeof *all);
    if (!all) return 1;
    if (s->rank == 0) all[0].err = write_probe(dir, all[0].token);
    int rc = train_gather_records(s, all, sizeof *all);
    if (rc == 0 && s->rank != 0) {
        all[0].token[sizeof all[0].token - 1] = '\0';
        all[s->rank].err = all[0].err ? 0 : read_probe(dir, all[0].token);
        rc = train_gather_records(s, all, sizeof *all);
    } else if (rc == 0) {
        rc = train_gather_records(s, all, sizeof *all);
    }
    if (s->rank == 0 && all[0].err == 0) {
        char path[CKPT_PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, all[0].token) < (int)sizeof path) unlink(path);
    }
    int status = 0;
    if (rc < 0) {
        train_comm_failed(s, "check that every rank sees the snapshot folder", rc);
        status = 1;
    } else if (all[0].err) {
        if (s->rank == 0)
            LOG_E(TAG, "cannot write a probe file into the snapshot folder %s: %s", dir,
                  strerror(-all[0].err));
        status = train_input_status(all[0].err);
    } else {
        char who[256] = "";
        size_t off = 0;
        for (int r = 1; r < s->world; r++) {
            if (!all[r].err) continue;
            status = 2;
            if (off < sizeof who)
                off += (size_t)snprintf(who + off, sizeof who - off, "%s%d", off ? ", " : "", r);
            if (r == s->rank)
                LOG_E(TAG, "the snapshot folder %s here is not the one rank 0 writes to: its probe "
                      "file %s is %s on this rank; every rank must see one shared --ckpt-dir (a "
                      "shared file system: a sharded snapshot cannot be committed in node-local "
                      "folders)", dir, all[0].token,
                      all[r].err == -ESTALE ? "another file" : strerror(-all[r].err));
        }
        if (status && s->rank == 0)
            LOG_E(TAG, "rank(s) %s do not see the snapshot folder %s that rank 0 writes to; every "
                  "rank must see one shared --ckpt-dir", who, dir);
    }
    free(all);
    return status;
}

/* Every rank's start-up status and settings, exchanged once (collective): returns 0 when all
 * ranks started and share rank 0's settings, else the exit status for every rank (the
 * largest status of a rank that failed, or 2 for different settings), each rank naming its
 * own problem in one line. */
int train_startup_agree(state *s, int local)
{
    if (s->world == 1) return local;
    enum { TEXT = 6000 };
    typedef struct { int32_t status; char text[TEXT]; } msg;
    msg *all = calloc((size_t)s->world, sizeof *all);
    if (!all) return 1;
    all[s->rank].status = local;
    if (local == 0) settings_text(s, all[s->rank].text, TEXT);
    int rc = train_gather_records(s, all, sizeof(msg)), status = 0;
    if (rc < 0) {
        train_comm_failed(s, "exchange of start-up settings", rc);
        status = local ? local : 1;
    }
    for (int r = 0; r < s->world && rc == 0; r++)
        if (all[r].status > status) status = all[r].status;
    if (rc == 0 && status != 0 && local == 0 && s->rank == 0) {
        char who[256] = "";
        size_t off = 0;
        for (int r = 0; r < s->world && off < sizeof who; r++)
            if (all[r].status)
                off += (size_t)snprintf(who + off, sizeof who - off, "%s%d", off ? ", " : "", r);
        LOG_E(TAG, "rank(s) %s could not start (see their lines); stopping every rank", who);
    }
    if (rc == 0 && status == 0) {
        int bad = 0;
        for (int r = 1; r < s->world; r++) {
            all[r].text[TEXT - 1] = all[0].text[TEXT - 1] = '\0';
            if (strcmp(all[r].text, all[0].text) != 0) {
                bad++;
                if (r == s->rank || (s->rank == 0 && bad == 1)) {
                    char diff[600];
                    first_difference(all[0].text, all[r].text, r, diff, sizeof diff);
                    LOG_E(TAG, "rank %d was started with other settings than rank 0: %s; every "
                          "rank must get the same flags, config and data", r, diff);
                }
            }
        }
        if (bad) status = 2;
    }
    free(all);
    if (status == 0 && s->o->ckpt_dir) status = check_shared_folder(s);
    return status;
}

/* Ranks, store, communicator, shard ranges. Returns 0, 1 or 2 (exit status). */
int train_dist_init(state *s)
{
    const options *o = s->o;
    env_from_slurm();
    train_comm_opts co = TRAIN_COMM_OPTS_INIT;
    if (train_comm_opts_from_env(&co) < 0) return 2;
    s->rank = co.rank;
    s->world = co.world_size;
    s->counts = calloc((size_t)s->world, sizeof(size_t));
    if (!s->counts) return 1;
    if (s->world > 1) log_set_rank(s->rank);
    const char *token = getenv("ELASTIC_STORE_TOKEN");
    const char *gen = getenv("ELASTIC_RESTART_COUNT");
    const char *hosted = getenv("ELASTIC_STORE_HOSTED");
    char prefix[96];
    snprintf(prefix, sizeof prefix, "g%s/comm", gen && *gen ? gen : "0");
    co.store_token = token;
    co.prefix = prefix;
    co.timeout_s = o->comm_timeout;
    co.connect_timeout_s = o->join_timeout;
    int rc;
    if (s->world > 1 && s->rank == 0 && !(hosted && !strcmp(hosted, "1"))) {
        elastic_store_server_opts so = ELASTIC_STORE_SERVER_OPTS_INIT;
        so.host = co.store_host;
        so.port = co.store_port;
        so.token = token;
        if ((rc = elastic_store_server_start(&s->server, &so)) < 0) {
            LOG_E(TAG, "rank 0 cannot host the rendezvous store at %s:%d (MASTER_ADDR:MASTER_PORT): "
                  "%s", co.store_host, co.store_port, strerror(-rc));
            /* an address that is not this host's, or a privileged port: the launch's
             * configuration (exit 2, no restart helps); a port in use, a resolver that did
             * not answer: a runtime failure (exit 1) */
            return rc == -EADDRNOTAVAIL || rc == -EACCES || rc == -EINVAL ? 2 : 1;
        }
    }
    if ((rc = train_comm_init(&s->comm, &co)) < 0) {
        LOG_E(TAG, "rank %d of %d could not join the group through %s:%d: %s", s->rank, s->world,
              co.store_host ? co.store_host : "-", co.store_port, strerror(-rc));
        return 1;
    }
    if (s->world > 1) {
        /* a tag unique to this launch names the shared temp folders and the vote keys */
        if (s->rank == 0) {
            uint64_t r = 0;
            int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                if (read(fd, &r, sizeof r) != (ssize_t)sizeof r) r = 0;
                close(fd);
            }
            r ^= (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
            snprintf(s->job_tag, sizeof s->job_tag, "j%016" PRIx64, r);
        }
        if ((rc = train_comm_broadcast(s->comm, s->job_tag, sizeof s->job_tag, 0)) < 0) {
            train_comm_failed(s, "broadcast of the job tag", rc);
            return 1;
        }
        s->job_tag[sizeof s->job_tag - 1] = '\0';
        char vprefix[160];
        snprintf(vprefix, sizeof vprefix, "g%s/snap/%s", gen && *gen ? gen : "0", s->job_tag);
        if (o->ckpt_every > 0 &&
            (rc = train_vote_create(&s->vote, &s->group, co.store_host, co.store_port, token, 60.0,
                                    vprefix, s->job_tag, s->rank, s->world, 600.0)) < 0) {
            LOG_E(TAG, "rank %d cannot open the snapshot vote channel: %s", s->rank, strerror(-rc));
            return 1;
        }
        if (o->ckpt_every > 0 && o->s3 &&
            (rc = train_s3_vote_create(s, co.store_host, co.store_port, token, gen)) < 0)
            return 1;
        /* every rank holds its store connections now: rank 0 may stop the store (exit)
         * without leaving anyone connecting to a gone server */
        if ((rc = train_comm_barrier(s->comm)) < 0) {
            train_comm_failed(s, "start-up barrier", rc);
            return 1;
        }
    }
    return 0;
}

/* Shard ranges: whole blocks, the first nb % W ranks one block more. */
int train_plan_shards(state *s)
{
    const int W = s->world;
    s->np = train_model_num_params(s->model);
    s->nb = s->np / TRAIN_BLOCK;
    s->shard_bytes = calloc((size_t)W, sizeof(size_t));
    s->shard_el = calloc((size_t)W, sizeof(size_t));
    s->block_bytes = calloc((size_t)W, sizeof(size_t));
    if (!s->shard_bytes || !s->shard_el || !s->block_bytes) return -ENOMEM;
    size_t base = s->nb / (size_t)W, extra = s->nb % (size_t)W, start = 0;
    for (int r = 0; r < W; r++) {
        size_t nblk = base + ((size_t)r < extra ? 1 : 0);
        if (r == s->rank) {
            s->lo = start * TRAIN_BLOCK;
            s->hi = (start + nblk) * TRAIN_BLOCK;
        }
        s->shard_el[r] = nblk * TRAIN_BLOCK;
        s->shard_bytes[r] = nblk * TRAIN_BLOCK * sizeof(float);
        s->block_bytes[r] = nblk * sizeof(double);
        start += nblk;
    }
    if (s->o->zero_stage == 0) {
        s->olo = 0;
        s->ohi = s->np;
    } else {
        s->olo = s->lo;
        s->ohi = s->hi;
    }
    return 0;
}
