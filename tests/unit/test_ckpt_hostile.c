/* test_ckpt_hostile.c - the snapshot reader against its environment and hostile folders
 * (issue 9, DESIGN I7):
 *   - transient errors are not corruption: EMFILE at open, list and read, and an injected EIO
 *     on a chunk read, come back as themselves, never as -EBADMSG, and listing calls the
 *     snapshot "unreadable", not "corrupt";
 *   - only regular files are read: a FIFO as manifest or data file never blocks, a folder, a
 *     link or a name the format does not define ("..") is corruption;
 *   - the folder lock never follows a link and never blocks on a FIFO;
 *   - the cost of opening a manifest is bounded: the format's limits (chunks, world size,
 *     trainer record), stored sizes bounded by the raw size, and duplicate checks that grow
 *     n log n, not n^2 (200 000 buffers once took 98 s);
 *   - the checksum member is exactly 16 lowercase hex digits and the last thing in the file;
 *   - a snapshot that retention renames away while it is listed is left out, not "corrupt".
 * An alarm turns any hang into a failure. */
#include "ckpt.h"
#include "ckpt_internal.h"
#include "t_helpers.h"
#include "t_manifest.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <xxhash.h>
#include <zstd.h>

/* ------------------------------------------------------------------ helpers */

enum { NB = 3, BUF_BYTES = 3 * 4096 + 100 };

static unsigned char g_mem[NB][BUF_BYTES];

/* n bytes that zstd cannot shrink (xorshift64 from seed). */
static void fill_random(unsigned char *p, size_t n, uint64_t seed)
{
    for (size_t j = 0; j < n; j++) {
        seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
        p[j] = (unsigned char)(seed >> 56);
    }
}

/* Three f32 buffers of a few chunks each (chunk 4096), saved as `step` under root: params
 * compresses (zstd chunks), adam_m and adam_v are random (stored raw, codec "none"). */
static int save_small(const char *root, uint64_t step)
{
    static const char *names[NB] = {"params", "adam_m", "adam_v"};
    ckpt_buffer b[NB];
    for (int j = 0; j < BUF_BYTES; j++) g_mem[0][j] = (unsigned char)(j % 64 < 48 ? 0 : j);
    fill_random(g_mem[1], BUF_BYTES, 0x9E3779B97F4A7C15ull);
    fill_random(g_mem[2], BUF_BYTES, 0x2545F4914F6CDD1Dull);
    for (int i = 0; i < NB; i++) b[i] = (ckpt_buffer){names[i], "f32", 4, BUF_BYTES, 0, BUF_BYTES, g_mem[i]};
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.chunk_bytes = 4096;
    return ckpt_save(&o, step, "run-h", "cfg-h", b, NB, "{\"step\": 1}", NULL);
}

static char *snap_path(const char *root, uint64_t step)
{
    char name[32];
    ckpt_step_dirname(step, name, sizeof name);
    return t_path_in(root, name);
}

static int open_rc(const char *path, char *why, size_t len)
{
    ckpt_snapshot *s = (ckpt_snapshot *)1;
    if (why && len) why[0] = '\0';
    int rc = ckpt_snapshot_open(&s, path, why, len);
    if (rc == 0) ckpt_snapshot_close(s);
    else if (s != NULL) return -12345; /* *out must be NULL on failure */
    return rc;
}

/* Status of the entry of `name` in a listing of root; -1 when not listed. */
static int list_status(const char *root, const char *name, int *error)
{
    ckpt_entry *e = NULL;
    size_t n = 0;
    if (ckpt_list(root, &e, &n) < 0) return -2;
    int st = -1;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(e[i].name, name)) {
            st = e[i].status;
            if (error) *error = e[i].error;
        }
    free(e);
    return st;
}

/* Set the soft limit of open files so that exactly `more` more can be opened: descriptors
 * are numbered from the lowest free one, and a number at or past the limit is EMFILE. */
static void limit_fds(int more, struct rlimit *saved)
{
    T_REQUIRE(getrlimit(RLIMIT_NOFILE, saved) == 0, "getrlimit");
    int lowest = dup(0);
    T_REQUIRE(lowest >= 0, "dup");
    close(lowest);
    struct rlimit rl = *saved;
    rl.rlim_cur = (rlim_t)(lowest + more);
    T_REQUIRE(setrlimit(RLIMIT_NOFILE, &rl) == 0, "setrlimit");
}

/* ------------------------------------------------------------------ transient is not corrupt */

static void transient_emfile(const char *base)
{
    char *root = t_path_in(base, "emfile");
    T_REQUIRE(save_small(root, 5) == 0, "save");
    char *sp = snap_path(root, 5);
    char why[512];
    struct rlimit saved;

    /* no descriptor left for manifest.json */
    limit_fds(0, &saved);
    int rc = open_rc(sp, why, sizeof why);
    setrlimit(RLIMIT_NOFILE, &saved);
    T_CHECK(rc == -EMFILE, "open with no free descriptor: %d (%s), want -EMFILE", rc, why);

    /* the listing opens the folder (one descriptor), then cannot read the manifest */
    limit_fds(1, &saved);
    int err = 0;
    int st = list_status(root, "step-000000005", &err);
    setrlimit(RLIMIT_NOFILE, &saved);
    T_CHECK(st == CKPT_STATUS_UNREADABLE && err == -EMFILE,
            "listing with no descriptor for the manifest: status %d (%s) error %d, want unreadable",
            st, st >= 0 ? ckpt_status_name(st) : "?", err);
    T_CHECK(!strcmp(ckpt_status_name(CKPT_STATUS_UNREADABLE), "unreadable"), "status name");

    /* open fine, then no descriptor for the data file or its ring when reading */
    ckpt_snapshot *s = NULL;
    T_REQUIRE(ckpt_snapshot_open(&s, sp, why, sizeof why) == 0, "open: %s", why);
    unsigned char buf[64];
    limit_fds(0, &saved);
    rc = ckpt_snapshot_read(s, "params", 0, sizeof buf, buf, why, sizeof why);
    int vrc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL);
    setrlimit(RLIMIT_NOFILE, &saved);
    T_CHECK(rc == -EMFILE, "read with no free descriptor: %d (%s), want -EMFILE", rc, why);
    T_CHECK(vrc == -EMFILE, "verify with no free descriptor: %d, want -EMFILE", vrc);
    /* and everything works again once descriptors are back: nothing was marked bad */
    T_CHECK(ckpt_snapshot_read(s, "params", 0, sizeof buf, buf, why, sizeof why) == 0 &&
                !memcmp(buf, g_mem[0], sizeof buf),
            "read after the limit was lifted: %s", why);
    T_CHECK(ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL) == 0, "verify after: %s", why);
    ckpt_snapshot_close(s);
    T_CHECK(list_status(root, "step-000000005", NULL) == CKPT_STATUS_COMMITTED, "committed again");
    free(sp);
    t_rmrf(root);
    free(root);
}

/* A device read error (CKPT_FAULT_STORE=eio-read:N, read once per process: a forked child,
 * before this process does any I/O) is -EIO from read and verify, never -EBADMSG. */
static int eio_child(const char *base)
{
    char *root = t_path_in(base, "eio");
    if (save_small(root, 6) != 0) return 10;
    char *sp = snap_path(root, 6);
    ckpt_snapshot *s = NULL;
    char why[512] = "";
    if (ckpt_snapshot_open(&s, sp, why, sizeof why) != 0) return 11;
    ckpt_snapshot_set_threads(s, 1);
    unsigned char buf[64];
    int rc = ckpt_snapshot_read(s, "params", 0, sizeof buf, buf, why, sizeof why); /* read 1 */
    if (rc != -EIO) {
        fprintf(stderr, "read with an injected EIO: %d (%s), want -EIO\n", rc, why);
        return 12;
    }
    rc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL); /* reads 2.. : no fault */
    if (rc != 0) {
        fprintf(stderr, "verify after the EIO: %d (%s)\n", rc, why);
        return 13;
    }
    ckpt_snapshot_close(s);
    return 0;
}

static void transient_eio(const char *base)
{
    pid_t pid = fork();
    T_REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        setenv("CKPT_FAULT_STORE", "eio-read:1", 1);
        _exit(eio_child(base));
    }
    int st = 0;
    T_REQUIRE(waitpid(pid, &st, 0) == pid, "waitpid");
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "EIO child: status %d", st);
}

/* ------------------------------------------------------------------ file types and names */

static long long make_synthetic(const char *dir, uint64_t step, size_t nbuf, size_t nchunk,
                                const char *dup);

/* A folder (or "..") as the data file, with the manifest's size set to the folder's own
 * st_size so that every size check passes: the old reader opened the snapshot and failed each
 * read with EISDIR, which a resume took for an error of the environment (exit 1 on every
 * run) instead of a corrupt snapshot. */
static void folder_sized_data_file(const char *base)
{
    char why[512], from[96], to[96];
    char *snap = t_path_in(base, "step-000000030");
    T_REQUIRE(make_synthetic(snap, 30, 1, 1, NULL) > 0, "synthetic snapshot");
    T_CHECK(open_rc(snap, why, sizeof why) == 0, "the synthetic snapshot opens: %s", why);
    char *dp = t_path_in(snap, "rank-00000.bin");
    unlink(dp);
    T_REQUIRE(mkdir(dp, 0755) == 0, "a folder as the data file");
    struct stat st;
    T_REQUIRE(stat(dp, &st) == 0 && st.st_size >= 16, "folder size %lld", (long long)st.st_size);
    snprintf(from, sizeof from, "{\"bytes\":16,\"name\":\"rank-00000.bin\"");
    snprintf(to, sizeof to, "{\"bytes\":%lld,\"name\":\"rank-00000.bin\"", (long long)st.st_size);
    T_REQUIRE(rewrite_manifest(snap, from, to) == 0, "size of the folder");
    int rc = open_rc(snap, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "not a regular file"), "folder as data file: %d (%s)",
            rc, why);
    rmdir(dp);
    /* ".." names the folder above the snapshot: sized the same way */
    long long folder_size = (long long)st.st_size;
    T_REQUIRE(stat(base, &st) == 0, "stat base");
    T_REQUIRE(rewrite_manifest(snap, "\"name\":\"rank-00000.bin\"", "\"name\":\"..\"") == 0 &&
                  rewrite_manifest(snap, "\"file\":\"rank-00000.bin\"", "\"file\":\"..\"") == 0,
              "name ..");
    snprintf(from, sizeof from, "{\"bytes\":%lld,\"name\":\"..\"", folder_size);
    snprintf(to, sizeof to, "{\"bytes\":%lld,\"name\":\"..\"", (long long)st.st_size);
    T_REQUIRE(rewrite_manifest(snap, from, to) == 0, "size of ..");
    rc = open_rc(snap, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "file entry 0"), "'..' as data file: %d (%s)", rc, why);
    free(dp);
    t_rmrf(snap);
    free(snap);
}

static void file_types(const char *base)
{
    char *root = t_path_in(base, "types");
    char why[512];
    T_REQUIRE(save_small(root, 10) == 0, "save 10");
    char *sp = snap_path(root, 10);
    char *mp = t_path_in(sp, CKPT_MANIFEST_NAME), *dp = t_path_in(sp, "rank-00000.bin");
    char *keep_m = t_path_in(base, "manifest.keep"), *keep_d = t_path_in(base, "data.keep");
    T_REQUIRE(rename(mp, keep_m) == 0 && rename(dp, keep_d) == 0, "move aside");

    /* manifest.json as a FIFO: no writer will ever come, so an open that waits hangs */
    T_REQUIRE(mkfifo(mp, 0644) == 0, "mkfifo");
    T_REQUIRE(link(keep_d, dp) == 0, "data back");
    int rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "regular"), "FIFO manifest: %d (%s)", rc, why);
    T_CHECK(list_status(root, "step-000000010", NULL) == CKPT_STATUS_CORRUPT, "FIFO manifest listed");
    unlink(mp);

    /* manifest.json as a link to a valid manifest */
    T_REQUIRE(symlink(keep_m, mp) == 0, "symlink manifest");
    rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG, "linked manifest: %d (%s)", rc, why);
    unlink(mp);
    /* manifest.json as a folder */
    T_REQUIRE(mkdir(mp, 0755) == 0, "mkdir manifest");
    rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG, "manifest folder: %d (%s)", rc, why);
    rmdir(mp);
    T_REQUIRE(link(keep_m, mp) == 0, "manifest back");
    T_CHECK(open_rc(sp, why, sizeof why) == 0, "restored snapshot opens: %s", why);

    /* the data file as a FIFO, a folder, a link */
    unlink(dp);
    T_REQUIRE(mkfifo(dp, 0644) == 0, "mkfifo data");
    rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "rank-00000.bin"), "FIFO data file: %d (%s)", rc, why);
    unlink(dp);
    T_REQUIRE(mkdir(dp, 0755) == 0, "mkdir data");
    rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG, "data file folder: %d (%s)", rc, why);
    rmdir(dp);
    T_REQUIRE(symlink(keep_d, dp) == 0, "symlink data");
    rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG, "linked data file: %d (%s)", rc, why);
    /* ... also when it became a link after the open (the read opens without following) */
    unlink(dp);
    T_REQUIRE(link(keep_d, dp) == 0, "data back");
    ckpt_snapshot *s = NULL;
    T_REQUIRE(ckpt_snapshot_open(&s, sp, why, sizeof why) == 0, "open: %s", why);
    unlink(dp);
    T_REQUIRE(mkfifo(dp, 0644) == 0, "mkfifo data after open");
    unsigned char buf[16];
    rc = ckpt_snapshot_read(s, "params", 0, sizeof buf, buf, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "rank-00000.bin"), "FIFO after open: %d (%s)", rc, why);
    ckpt_snapshot_close(s);
    unlink(dp);
    T_REQUIRE(link(keep_d, dp) == 0, "data back");

    /* data file names the format does not define, resealed so that the checksum passes */
    static const struct {
        const char *what, *from, *to;
    } names[] = {
        {"'..' as a data file", "\"name\":\"rank-00000.bin\"", "\"name\":\"..\""},
        {"'.' as a data file", "\"name\":\"rank-00000.bin\"", "\"name\":\".\""},
        {"a name of another rank", "\"name\":\"rank-00000.bin\"", "\"name\":\"rank-00001.bin\""},
        {"manifest.json as a data file", "\"name\":\"rank-00000.bin\"", "\"name\":\"manifest.json\""},
        {"a shard of another rank", "\"rank\":0}],\"total_bytes\"", "\"rank\":1}],\"total_bytes\""},
    };
    unsigned char *orig = NULL;
    long long on = t_slurp(mp, &orig);
    T_REQUIRE(on > 0, "read manifest");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
        T_REQUIRE(rewrite_manifest(sp, names[i].from, names[i].to) == 0, "rewrite %s", names[i].what);
        rc = open_rc(sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG, "%s: %d (%s)", names[i].what, rc, why);
    }
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    T_CHECK(open_rc(sp, why, sizeof why) == 0, "restored again: %s", why);
    free(orig);

    /* a regular file under a snapshot's name */
    char *fake = t_path_in(root, "step-000000011");
    T_REQUIRE(t_spit(fake, "x", 1) == 0, "fake snapshot file");
    rc = open_rc(fake, why, sizeof why);
    T_CHECK(rc == -EBADMSG, "a file as snapshot folder: %d (%s)", rc, why);
    T_CHECK(list_status(root, "step-000000011", NULL) == CKPT_STATUS_CORRUPT, "listed corrupt");
    char *none = t_path_in(root, "step-000000012");
    T_CHECK(open_rc(none, why, sizeof why) == -ENOENT, "a missing folder is -ENOENT");
    free(none);
    free(fake);
    free(keep_m);
    free(keep_d);
    free(mp);
    free(dp);
    free(sp);
    t_rmrf(root);
    free(root);
}

/* The folder lock never writes through a link and never waits on a FIFO. */
static void lock_types(const char *base)
{
    char *root = t_path_in(base, "lock");
    T_REQUIRE(mkdir(root, 0755) == 0, "mkdir");
    char *lk = t_path_in(root, ".lock"), *victim = t_path_in(base, "victim.txt");
    T_REQUIRE(t_spit(victim, "precious\n", 9) == 0, "victim");
    T_REQUIRE(symlink(victim, lk) == 0, "symlink .lock");
    ckpt_dir_lock *l = NULL;
    int rc = ckpt_dir_lock_acquire(root, &l, NULL);
    T_CHECK(rc == -ELOOP && l == NULL, ".lock as a link: %d, want -ELOOP", rc);
    unsigned char *text = NULL;
    T_CHECK(t_slurp(victim, &text) == 9 && !memcmp(text, "precious\n", 9), "link target untouched");
    free(text);
    unlink(lk);
    T_REQUIRE(mkfifo(lk, 0644) == 0, "mkfifo .lock");
    rc = ckpt_dir_lock_acquire(root, &l, NULL);
    T_CHECK(rc == -ENODEV && l == NULL, ".lock as a FIFO: %d, want -ENODEV", rc);
    unlink(lk);
    T_REQUIRE(mkdir(lk, 0755) == 0, "mkdir .lock");
    rc = ckpt_dir_lock_acquire(root, &l, NULL);
    T_CHECK(rc == -EISDIR && l == NULL, ".lock as a folder: %d, want -EISDIR", rc);
    rmdir(lk);
    rc = ckpt_dir_lock_acquire(root, &l, NULL);
    T_CHECK(rc == 0 && l != NULL, "a plain lock: %d", rc);
    ckpt_dir_lock_release(l);
    free(lk);
    free(victim);
    t_rmrf(root);
    free(root);
}

/* ------------------------------------------------------------------ manifest checks */

static void manifest_checks(const char *base)
{
    char *root = t_path_in(base, "checks");
    char why[512];
    T_REQUIRE(save_small(root, 20) == 0, "save 20");
    char *sp = snap_path(root, 20), *mp = t_path_in(sp, CKPT_MANIFEST_NAME);
    char *dp = t_path_in(sp, "rank-00000.bin");
    unsigned char *orig = NULL;
    long long on = t_slurp(mp, &orig);
    T_REQUIRE(on > 40, "read manifest");
    unsigned char *buf = malloc((size_t)on + 64);
    T_REQUIRE(buf != NULL, "malloc");

    /* the checksum member: exactly 16 lowercase hex digits, then '"}' and a newline, last */
    const size_t tail = strlen(CKPT_MANIFEST_SUM_KEY) + 16 + 3;
    T_REQUIRE(!memcmp(orig + on - tail, CKPT_MANIFEST_SUM_KEY, strlen(CKPT_MANIFEST_SUM_KEY)),
              "writer's manifest ends with the checksum member");
    for (int kind = 0; kind < 5; kind++) {
        size_t len = (size_t)on, hex = (size_t)on - 19;
        memcpy(buf, orig, (size_t)on);
        const char *what = "";
        switch (kind) {
        case 0: /* a 17th digit: the old reader parsed the first 16 and accepted */
            what = "17 hex digits";
            memmove(buf + hex + 17, buf + hex + 16, 3);
            buf[hex + 16] = '0';
            len++;
            break;
        case 1:
            what = "a member after the checksum";
            memcpy(buf + hex + 16, "\",\"x\":1}\n", 9);
            len = hex + 16 + 9;
            break;
        case 2:
            what = "upper-case hex digits";
            for (size_t i = hex; i < hex + 16; i++)
                if (buf[i] >= 'a' && buf[i] <= 'f') buf[i] = (unsigned char)(buf[i] - 32);
            break;
        case 3:
            what = "a second newline at the end";
            buf[len++] = '\n';
            break;
        case 4:
            what = "a NUL byte in the body";
            buf[5] = 0;
            break;
        }
        T_REQUIRE(t_spit(mp, buf, len) == 0, "write");
        int rc = open_rc(sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG, "manifest with %s: %d (%s)", what, rc, why);
    }
    /* the final newline may be missing (JSON tools drop it); nothing else may change */
    T_REQUIRE(t_spit(mp, orig, (size_t)on - 1) == 0, "no newline");
    T_CHECK(open_rc(sp, why, sizeof why) == 0, "without the final newline: %s", why);
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    T_CHECK(open_rc(sp, why, sizeof why) == 0, "restored: %s", why);

    /* sizes that no chunk can have, resealed */
    struct stat st;
    T_REQUIRE(stat(dp, &st) == 0, "stat data");
    char from[64], to[96];
    static const struct {
        const char *what, *from, *to;
    } bad[] = {
        {"duplicate buffer names", "\"name\":\"adam_v\"", "\"name\":\"adam_m\""},
        {"dtype with an escape sequence", "\"dtype\":\"f32\"", "\"dtype\":\"\\u001b[2J\""},
        {"world_size over the limit", "\"world_size\":1", "\"world_size\":65537"},
        {"total_bytes not a multiple of elem_bytes", "\"total_bytes\":12388}",
         "\"total_bytes\":12387}"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
        int rw = rewrite_manifest(sp, bad[i].from, bad[i].to);
        T_REQUIRE(rw == 0, "rewrite for %s", bad[i].what);
        int rc = open_rc(sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG, "%s: %d (%s)", bad[i].what, rc, why);
    }

    /* a raw chunk that claims the shuffle filter (the writer stores raw chunks unfiltered) */
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    {
        const char *raw = strstr((const char *)orig, "\"codec\":\"none\",");
        const char *flt = raw ? strstr(raw, "\"filter\":\"none\"") : NULL;
        T_REQUIRE(raw && flt, "a raw chunk in the sample");
        size_t n = (size_t)(flt - raw) + strlen("\"filter\":\"none\"");
        char *f = strndup(raw, n), *t = malloc(n + 8);
        T_REQUIRE(f && t, "malloc");
        snprintf(t, n + 8, "%.*s\"filter\":\"shuffle\"", (int)(flt - raw), raw);
        T_REQUIRE(rewrite_manifest(sp, f, t) == 0, "rewrite raw + shuffle");
        int rc = open_rc(sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG, "a raw chunk with the shuffle filter: %d (%s)", rc, why);
        free(f);
        free(t);
    }

    /* stored_bytes of 4 GiB in a sparse 4 GiB data file: the old reader accepted it and
     * verify allocated 4.2 GB; stored bytes are bounded by ZSTD_compressBound(raw) now */
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    unsigned char *m = orig;
    const char *sb = strstr((const char *)m, "\"stored_bytes\":");
    T_REQUIRE(sb != NULL, "a stored_bytes member");
    long long first_sb = atoll(sb + 15);
    long long file_bytes = (long long)st.st_size;
    long long big = (4ll << 30);
    snprintf(from, sizeof from, "\"stored_bytes\":%lld,", first_sb);
    snprintf(to, sizeof to, "\"stored_bytes\":%lld,", big);
    T_REQUIRE(rewrite_manifest(sp, from, to) == 0, "rewrite stored_bytes");
    snprintf(from, sizeof from, "\"bytes\":%lld,\"name\":\"rank-00000.bin\"", file_bytes);
    snprintf(to, sizeof to, "\"bytes\":%lld,\"name\":\"rank-00000.bin\"", big + file_bytes);
    T_REQUIRE(rewrite_manifest(sp, from, to) == 0, "rewrite file bytes");
    T_REQUIRE(truncate(dp, big + file_bytes) == 0, "sparse data file");
    int rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "stored bytes"), "4 GiB stored bytes: %d (%s)", rc, why);
    T_REQUIRE(truncate(dp, file_bytes) == 0, "data file back");

    /* a trainer record over the limit (resealed; the limit is on the compact form) */
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    size_t blen = CKPT_MAX_TRAINER_BYTES + 16;
    char *pad = malloc(blen + 64);
    T_REQUIRE(pad != NULL, "malloc");
    int k = snprintf(pad, 64, "\"trainer\":{\"pad\":\"");
    memset(pad + k, 'x', blen);
    snprintf(pad + k + blen, 64, "\",");
    T_REQUIRE(rewrite_manifest(sp, "\"trainer\":{", pad) == 0, "rewrite trainer");
    free(pad);
    rc = open_rc(sp, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "trainer record"), "huge trainer record: %d (%s)", rc, why);

    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    T_CHECK(open_rc(sp, why, sizeof why) == 0, "the original opens: %s", why);
    free(buf);
    free(orig);
    free(mp);
    free(dp);
    free(sp);
    t_rmrf(root);
    free(root);
}

/* ------------------------------------------------------------------ the chunk decoder */

/* verify checks every chunk also when the last buffers are empty: the last short batch was
 * flushed only at "the last chunk of the last buffer", so with an empty buffer last the
 * chunks after the last full batch went unchecked (found by tests/fuzz/fuzz_manifest). */
static void verify_with_empty_last_buffer(const char *base)
{
    char *root = t_path_in(base, "emptylast");
    static unsigned char mem[3][BUF_BYTES];
    for (int i = 0; i < 3; i++) fill_random(mem[i], BUF_BYTES, 0x243F6A8885A308D3ull + (uint64_t)i);
    ckpt_buffer b[4] = {{"params", "f32", 4, BUF_BYTES, 0, BUF_BYTES, mem[0]},
                        {"adam_m", "f32", 4, BUF_BYTES, 0, BUF_BYTES, mem[1]},
                        {"adam_v", "f32", 4, BUF_BYTES, 0, BUF_BYTES, mem[2]},
                        {"empty", "u8", 1, 0, 0, 0, NULL}};
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.chunk_bytes = 4096;
    T_REQUIRE(ckpt_save(&o, 1, "r", "c", b, 4, "{}", NULL) == 0, "save");
    char *sp = snap_path(root, 1), *dp = t_path_in(sp, "rank-00000.bin");
    struct stat st;
    T_REQUIRE(stat(dp, &st) == 0, "stat");
    /* the last byte of the file: the last chunk of adam_v, past the first batch of 8 */
    int fd = open(dp, O_RDWR);
    unsigned char c;
    T_REQUIRE(fd >= 0 && pread(fd, &c, 1, st.st_size - 1) == 1, "read");
    c ^= 0x20;
    T_REQUIRE(pwrite(fd, &c, 1, st.st_size - 1) == 1, "flip");
    close(fd);
    ckpt_snapshot *s = NULL;
    char why[512];
    T_REQUIRE(ckpt_snapshot_open(&s, sp, why, sizeof why) == 0, "open: %s", why);
    T_REQUIRE(ckpt_snapshot_nbuffers(s) == 4, "4 buffers");
    for (unsigned t = 1; t <= 3; t++) {
        ckpt_snapshot_set_threads(s, t);
        why[0] = '\0';
        int rc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL);
        T_CHECK(rc == -EBADMSG && strstr(why, "adam_v"), "%u threads: verify %d (%s)", t, rc, why);
    }
    ckpt_snapshot_close(s);
    free(dp);
    free(sp);
    t_rmrf(root);
    free(root);
}

/* A snapshot of one u8 buffer stored as one zstd chunk of the given stored bytes (which must
 * decode to raw), with correct checksums and sizes. */
static int make_zstd_snapshot(const char *dir, const void *stored, size_t sn, const void *raw,
                              size_t rn)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return -1;
    char hs[17], hr[17], *text = NULL;
    ckpt_hex64(XXH3_64bits(stored, sn), hs);
    ckpt_hex64(XXH3_64bits(raw, rn), hr);
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return -1;
    fprintf(f, "{\"buffers\":[{\"dtype\":\"u8\",\"elem_bytes\":1,\"name\":\"b\",\"shards\":[{\"bytes\":%zu,"
            "\"chunks\":[{\"bytes\":%zu,\"codec\":\"zstd\",\"file_offset\":0,\"filter\":\"none\","
            "\"offset\":0,\"stored_bytes\":%zu,\"xxh3_raw\":\"%s\",\"xxh3_stored\":\"%s\"}],"
            "\"file\":\"rank-00000.bin\",\"offset\":0,\"rank\":0}],\"total_bytes\":%zu}],"
            "\"chunk_bytes\":4096,\"config_hash\":\"c\",\"created_unix\":0,\"files\":[{\"bytes\":%zu,"
            "\"name\":\"rank-00000.bin\",\"rank\":0}],\"format\":\"ckptsys.snapshot\","
            "\"format_version\":1,\"run_id\":\"r\",\"step\":1,\"trainer\":{},\"world_size\":1",
            rn, rn, sn, hr, hs, rn, sn);
    if (fclose(f) != 0) return -1;
    char hex[17];
    ckpt_hex64(XXH3_64bits(text, len), hex);
    char *mp = t_path_in(dir, CKPT_MANIFEST_NAME), *dp = t_path_in(dir, "rank-00000.bin");
    size_t mlen = len + strlen(CKPT_MANIFEST_SUM_KEY) + 19;
    char *m = malloc(mlen + 1);
    int ok = m != NULL;
    if (ok) {
        snprintf(m, mlen + 1, "%s%s%s\"}\n", text, CKPT_MANIFEST_SUM_KEY, hex);
        ok = t_spit(mp, m, mlen) == 0 && t_spit(dp, stored, sn) == 0;
    }
    free(m);
    free(text);
    free(mp);
    free(dp);
    return ok ? 0 : -1;
}

/* A chunk is exactly one zstd frame: zstd also decodes concatenated frames and skips
 * skippable ones, so bytes outside the one frame went unchecked by the format's rule. */
static void one_frame_per_chunk(const char *base)
{
    unsigned char raw[64];
    for (int i = 0; i < 64; i++) raw[i] = (unsigned char)(i * 37);
    unsigned char two[512], one[256];
    size_t a = ZSTD_compress(two, 256, raw, 32, 1);
    size_t b = ZSTD_compress(two + a, 256, raw + 32, 32, 1);
    size_t c = ZSTD_compress(one, sizeof one, raw, 64, 1);
    T_REQUIRE(!ZSTD_isError(a) && !ZSTD_isError(b) && !ZSTD_isError(c), "compress");
    char why[512];
    char *d1 = t_path_in(base, "frames1"), *d2 = t_path_in(base, "frames2"),
         *d3 = t_path_in(base, "frames3");
    T_REQUIRE(make_zstd_snapshot(d1, one, c, raw, 64) == 0, "one frame");
    ckpt_snapshot *s = NULL;
    T_REQUIRE(ckpt_snapshot_open(&s, d1, why, sizeof why) == 0, "open: %s", why);
    T_CHECK(ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL) == 0, "one frame verifies: %s", why);
    ckpt_snapshot_close(s);
    /* two frames that decode to the 64 bytes together */
    T_REQUIRE(make_zstd_snapshot(d2, two, a + b, raw, 64) == 0, "two frames");
    T_REQUIRE(ckpt_snapshot_open(&s, d2, why, sizeof why) == 0, "open: %s", why);
    int rc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL);
    T_CHECK(rc == -EBADMSG && strstr(why, "one zstd frame"), "two frames: %d (%s)", rc, why);
    ckpt_snapshot_close(s);
    /* a frame, then a skippable frame (magic 0x184D2A50, 4 bytes of content) */
    unsigned char sk[512];
    memcpy(sk, one, c);
    static const unsigned char skippable[12] = {0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 1, 2, 3, 4};
    memcpy(sk + c, skippable, sizeof skippable);
    T_REQUIRE(make_zstd_snapshot(d3, sk, c + sizeof skippable, raw, 64) == 0, "skippable");
    T_REQUIRE(ckpt_snapshot_open(&s, d3, why, sizeof why) == 0, "open: %s", why);
    rc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL);
    T_CHECK(rc == -EBADMSG && strstr(why, "one zstd frame"), "a skippable frame after: %d (%s)",
            rc, why);
    ckpt_snapshot_close(s);
    t_rmrf(d1);
    t_rmrf(d2);
    t_rmrf(d3);
    free(d1);
    free(d2);
    free(d3);
}

/* ------------------------------------------------------------------ found by a review */

/* Out of memory while parsing a manifest says nothing about its bytes: -ENOMEM, and the
 * listing calls the snapshot unreadable (a resume had set a valid one aside). In a child with
 * a bounded address space; a sanitizer's shadow memory cannot live under such a bound, so
 * this runs in the plain build. */
static void oom_is_not_corrupt(const char *base)
{
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    (void)base;
#else
    char *root = t_path_in(base, "oom"), *snap = t_path_in(root, "step-000000001");
    T_REQUIRE(mkdir(root, 0755) == 0, "mkdir");
    T_REQUIRE(make_synthetic(snap, 1, 1, 1, NULL) > 0, "synthetic");
    /* 6 million values (under the limit): the parser needs a few hundred MB for them */
    size_t n = 6000000;
    char *pad = malloc(2 * n + 32);
    T_REQUIRE(pad != NULL, "malloc");
    memcpy(pad, "\"pad\":[", 7);
    for (size_t i = 0; i < n; i++) memcpy(pad + 7 + 2 * i, "0,", 2);
    memcpy(pad + 7 + 2 * n - 1, "],\"trainer\":{", 14);
    T_REQUIRE(rewrite_manifest(snap, "\"trainer\":{", pad) == 0, "pad");
    free(pad);
    char why[512];
    /* first the bounded child: memory this process freed would count for it */
    pid_t pid = fork();
    T_REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        struct rlimit rl = {(rlim_t)60 << 20, (rlim_t)60 << 20};
        FILE *f = fopen("/proc/self/statm", "r");
        unsigned long pages = 0;
        if (f && fscanf(f, "%lu", &pages) == 1) rl.rlim_cur = rl.rlim_max =
            (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)60 << 20);
        if (f) fclose(f);
        if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(20);
        int rc = open_rc(snap, why, sizeof why);
        if (rc != -ENOMEM) {
            fprintf(stderr, "open under a memory bound: %d (%s), want -ENOMEM\n", rc, why);
            _exit(21);
        }
        int err = 0, st = list_status(root, "step-000000001", &err);
        if (st != CKPT_STATUS_UNREADABLE || err != -ENOMEM) {
            fprintf(stderr, "listed under a memory bound: status %d error %d\n", st, err);
            _exit(22);
        }
        _exit(0);
    }
    int st = 0;
    T_REQUIRE(waitpid(pid, &st, 0) == pid, "waitpid");
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "out of memory is not corrupt: child %d", st);
    T_CHECK(open_rc(snap, why, sizeof why) == 0, "the snapshot opens with memory: %s", why);
    t_rmrf(root);
    free(snap);
    free(root);
#endif
}

/* A snapshot folder renamed away while it is read (retention, a set-aside) is missing, not
 * corrupt: verify during a run with --keep-last 1 called removed snapshots corrupt. */
static void removed_while_read(const char *base)
{
    char *root = t_path_in(base, "removed");
    T_REQUIRE(save_small(root, 3) == 0, "save");
    char *sp = snap_path(root, 3), *gone = t_path_in(root, ".tmp-step-000000003-retired");
    ckpt_snapshot *s = NULL;
    char why[512];
    T_REQUIRE(ckpt_snapshot_open(&s, sp, why, sizeof why) == 0, "open: %s", why);
    T_REQUIRE(rename(sp, gone) == 0, "retire");
    int rc = ckpt_snapshot_verify(s, why, sizeof why, NULL, NULL);
    T_CHECK(rc == -ENOENT && strstr(why, "removed while it was read"), "verify: %d (%s)", rc, why);
    ckpt_snapshot_close(s);
    free(gone);
    free(sp);
    t_rmrf(root);
    free(root);
}

/* The folder's name is checked against the manifest's step also when the path ends in '/'
 * or "/.": a copy of step 15 under the name step-000000020 verified "OK ... step 15". */
static void trailing_slash_names_the_folder(const char *base)
{
    char *root = t_path_in(base, "slash");
    T_REQUIRE(save_small(root, 15) == 0, "save");
    char *src = snap_path(root, 15), *dst = snap_path(root, 20), p[4200], why[512];
    T_REQUIRE(rename(src, dst) == 0, "rename");
    static const char *tails[] = {"", "/", "//", "/.", "/./", "/../step-000000020"};
    for (size_t i = 0; i < sizeof tails / sizeof tails[0]; i++) {
        snprintf(p, sizeof p, "%s%s", dst, tails[i]);
        int rc = open_rc(p, why, sizeof why);
        T_CHECK(rc == -EBADMSG && strstr(why, "manifest says step 15"), "'%s': %d (%s)", tails[i],
                rc, why);
    }
    free(src);
    free(dst);
    t_rmrf(root);
    free(root);
}

/* Layouts FORMAT.md rules out: W ranks have W data files; a shard lies inside its buffer. */
static void files_and_shards(const char *base)
{
    char *root = t_path_in(base, "fs");
    T_REQUIRE(save_small(root, 4) == 0, "save");
    char *sp = snap_path(root, 4), *mp = t_path_in(sp, CKPT_MANIFEST_NAME), why[512];
    unsigned char *orig = NULL;
    long long on = t_slurp(mp, &orig);
    T_REQUIRE(on > 0, "read");
    static const struct {
        const char *what, *from, *to;
    } bad[] = {
        {"world size 2 with one data file", "\"world_size\":1", "\"world_size\":2"},
        {"an empty shard past the buffer's end", "{\"dtype\":\"f32\",\"elem_bytes\":4,\"name\":\"params\",\"shards\":[",
         "{\"dtype\":\"f32\",\"elem_bytes\":4,\"name\":\"params\",\"shards\":[{\"bytes\":0,\"chunks\":[],"
         "\"file\":\"rank-00000.bin\",\"offset\":1000000000000000,\"rank\":0},"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
        T_REQUIRE(rewrite_manifest(sp, bad[i].from, bad[i].to) == 0, "rewrite %s", bad[i].what);
        int rc = open_rc(sp, why, sizeof why);
        T_CHECK(rc == -EBADMSG, "%s: %d (%s)", bad[i].what, rc, why);
    }
    T_REQUIRE(t_spit(mp, orig, (size_t)on) == 0, "restore");
    T_CHECK(open_rc(sp, why, sizeof why) == 0, "restored: %s", why);
    free(orig);
    free(mp);
    free(sp);
    t_rmrf(root);
    free(root);
}

/* A hard-linked .lock would have the other name's file overwritten with the pid; a folder of
 * snapshots inside a snapshot would write into a committed snapshot. */
static void lock_links_and_snapshot_folders(const char *base)
{
    char *root = t_path_in(base, "lock2");
    T_REQUIRE(save_small(root, 5) == 0, "save");
    char *lk = t_path_in(root, ".lock"), *victim = t_path_in(base, "victim2.txt");
    T_REQUIRE(t_spit(victim, "precious\n", 9) == 0 && link(victim, lk) == 0, "hard link");
    ckpt_dir_lock *l = NULL;
    T_CHECK(ckpt_dir_lock_acquire(root, &l, NULL) == -EMLINK && !l, "hard-linked .lock");
    unsigned char *text = NULL;
    T_CHECK(t_slurp(victim, &text) == 9 && !memcmp(text, "precious\n", 9), "other name untouched");
    free(text);
    unlink(lk);
    char *sp = snap_path(root, 5), p[4200];
    static const char *inside[] = {"", "/", "/sub"};
    for (size_t i = 0; i < sizeof inside / sizeof inside[0]; i++) {
        snprintf(p, sizeof p, "%s%s", sp, inside[i]);
        T_CHECK(ckpt_dir_lock_acquire(p, &l, NULL) == -EINVAL && !l, "lock in '%s'", p);
    }
    snprintf(p, sizeof p, "%s/.tmp-step-000000009-x-1", root);
    T_CHECK(ckpt_dir_lock_acquire(p, &l, NULL) == -EINVAL && !l, "lock in a temp folder");
    struct stat st;
    T_CHECK(stat(p, &st) != 0, "the temp folder was not created");
    char *lk5 = t_path_in(sp, ".lock");
    T_CHECK(!t_exists(lk5), "nothing written into the snapshot");
    T_CHECK(ckpt_dir_lock_acquire(root, &l, NULL) == 0, "the snapshot root itself");
    ckpt_dir_lock_release(l);
    free(lk5);
    free(sp);
    free(lk);
    free(victim);
    t_rmrf(root);
    free(root);
}

/* ------------------------------------------------------------------ limits and scaling */

/* Write a snapshot folder by hand: nbuf buffers (names b<i>, or all `dup` when not NULL for
 * the last one) of nchunk raw chunks of 16 zero bytes each, in one data file, with a correct
 * checksum. Returns the manifest's size, or -1. */
static long long make_synthetic(const char *dir, uint64_t step, size_t nbuf, size_t nchunk,
                                const char *dup)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return -1;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return -1;
    static const unsigned char zero[16];
    char hz[17];
    ckpt_hex64(XXH3_64bits(zero, 16), hz);
    uint64_t data = (uint64_t)nbuf * nchunk * 16;
    fprintf(f, "{\"buffers\":[");
    uint64_t foff = 0;
    for (size_t b = 0; b < nbuf; b++) {
        char name[32];
        if (dup && b + 1 == nbuf) snprintf(name, sizeof name, "%s", dup);
        else snprintf(name, sizeof name, "b%07zu", b);
        fprintf(f, "%s{\"dtype\":\"u8\",\"elem_bytes\":1,\"name\":\"%s\",\"shards\":[{\"bytes\":%zu,"
                "\"chunks\":[", b ? "," : "", name, nchunk * 16);
        for (size_t c = 0; c < nchunk; c++, foff += 16)
            fprintf(f, "%s{\"bytes\":16,\"codec\":\"none\",\"file_offset\":%llu,\"filter\":\"none\","
                    "\"offset\":%zu,\"stored_bytes\":16,\"xxh3_raw\":\"%s\",\"xxh3_stored\":\"%s\"}",
                    c ? "," : "", (unsigned long long)foff, c * 16, hz, hz);
        fprintf(f, "],\"file\":\"rank-00000.bin\",\"offset\":0,\"rank\":0}],\"total_bytes\":%zu}",
                nchunk * 16);
    }
    fprintf(f, "],\"chunk_bytes\":4096,\"config_hash\":\"c\",\"created_unix\":0,\"files\":[{\"bytes\":%llu,"
            "\"name\":\"rank-00000.bin\",\"rank\":0}],\"format\":\"ckptsys.snapshot\","
            "\"format_version\":1,\"run_id\":\"r\",\"step\":%llu,\"trainer\":{},\"world_size\":1",
            (unsigned long long)data, (unsigned long long)step);
    if (fclose(f) != 0) return -1;
    char hex[17];
    ckpt_hex64(XXH3_64bits(text, len), hex);
    char *mp = t_path_in(dir, CKPT_MANIFEST_NAME), *dp = t_path_in(dir, "rank-00000.bin");
    FILE *m = fopen(mp, "wb");
    int ok = m && fwrite(text, 1, len, m) == len &&
             fprintf(m, "%s%s\"}\n", CKPT_MANIFEST_SUM_KEY, hex) > 0;
    ok = (m && fclose(m) == 0) && ok;
    ok = ok && t_spit(dp, "", 0) == 0 && truncate(dp, (off_t)data) == 0;
    long long total = ok ? (long long)(len + strlen(CKPT_MANIFEST_SUM_KEY) + 19) : -1;
    free(text);
    free(mp);
    free(dp);
    return total;
}

static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds of one ckpt_snapshot_open of dir (the best of `reps`), and its result. */
static double time_open(const char *dir, int reps, int *rc_out)
{
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        char why[512];
        double t0 = thread_cpu_s();
        *rc_out = open_rc(dir, why, sizeof why);
        double t = thread_cpu_s() - t0;
        if (t < best) best = t;
    }
    return best;
}

static void limits_and_scaling(const char *base)
{
    char why[512];
    /* exactly CKPT_MAX_CHUNKS chunks open; one more is over the format's limit */
    char *at = t_path_in(base, "step-000000001"), *over = t_path_in(base, "step-000000002");
    long long msz = make_synthetic(at, 1, 2, CKPT_MAX_CHUNKS / 2, NULL);
    T_REQUIRE(msz > 0, "synthetic manifest at the chunk limit");
    T_REQUIRE(make_synthetic(over, 2, 2, CKPT_MAX_CHUNKS / 2 + 1, NULL) > 0, "over the limit");
    T_CHECK(msz <= (long long)CKPT_MAX_MANIFEST_BYTES,
            "the chunk limit fits in the manifest limit (%lld bytes)", msz);
    int rc = open_rc(at, why, sizeof why);
    T_CHECK(rc == 0, "%u chunks: %d (%s)", (unsigned)CKPT_MAX_CHUNKS, rc, why);
    rc = open_rc(over, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "chunks"), "%u chunks: %d (%s)",
            (unsigned)CKPT_MAX_CHUNKS + 2, rc, why);
    printf("a manifest of %u chunks has %.1f MiB\n", (unsigned)CKPT_MAX_CHUNKS,
           (double)msz / 1048576.0);
    t_rmrf(at);
    t_rmrf(over);
    free(at);
    free(over);

    /* duplicate names among many buffers are found, and the check is n log n: 4x the
     * buffers cost about 4x (a pairwise check costs 16x; 200 000 buffers took 98 s) */
    char *dupd = t_path_in(base, "step-000000003");
    T_REQUIRE(make_synthetic(dupd, 3, 20000, 1, "b0000007") > 0, "duplicate names");
    rc = open_rc(dupd, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "b0000007"), "20000 buffers, one name twice: %d (%s)", rc,
            why);
    t_rmrf(dupd);
    free(dupd);
    char *small = t_path_in(base, "step-000000004"), *large = t_path_in(base, "step-000000005");
    T_REQUIRE(make_synthetic(small, 4, CKPT_MAX_BUFFERS / 4, 1, NULL) > 0, "small");
    T_REQUIRE(make_synthetic(large, 5, CKPT_MAX_BUFFERS, 1, NULL) > 0, "large");
    int rs = 0, rl = 0;
    double ts = time_open(small, 3, &rs), tl = time_open(large, 3, &rl);
    T_CHECK(rs == 0 && rl == 0, "synthetic manifests open: %d %d", rs, rl);
    printf("open of %u buffers: %.3f s CPU, of %u: %.3f s (ratio %.2f; n^2 would be 16)\n",
           (unsigned)CKPT_MAX_BUFFERS / 4, ts, (unsigned)CKPT_MAX_BUFFERS, tl, tl / ts);
    T_CHECK(tl < 8.0 * ts + 0.05, "4x the buffers cost %.2fx the time: not n log n", tl / ts);
    char *more = t_path_in(base, "step-000000006");
    T_REQUIRE(make_synthetic(more, 6, CKPT_MAX_BUFFERS + 1, 1, NULL) > 0, "over");
    rc = open_rc(more, why, sizeof why);
    T_CHECK(rc == -EBADMSG && strstr(why, "buffers"), "%u buffers: %d (%s)",
            (unsigned)CKPT_MAX_BUFFERS + 1, rc, why);
    t_rmrf(small);
    t_rmrf(large);
    t_rmrf(more);
    free(small);
    free(large);
    free(more);
}

/* The writer never writes what readers refuse: too many chunks is refused before any byte is
 * read (the buffer is mapped but never touched), and ckpt_fit_chunk_bytes finds the chunk
 * size that fits. */
static void writer_limits(const char *base)
{
    char *root = t_path_in(base, "wlimits");
    const uint64_t total = (uint64_t)CKPT_MAX_CHUNKS * 4096 + 4096; /* 1 GiB + 4 KiB */
    void *mem = mmap(NULL, (size_t)total, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    T_REQUIRE(mem != MAP_FAILED, "mmap");
    ckpt_buffer b = {"params", "u8", 1, total, 0, total, mem};
    ckpt_save_opts o = CKPT_SAVE_OPTS_INIT;
    o.dir = root;
    o.chunk_bytes = 4096;
    T_CHECK(ckpt_snapshot_max_chunks(&b, 1, 4096, 1) == CKPT_MAX_CHUNKS + 1, "chunk count");
    T_CHECK(ckpt_snapshot_max_chunks(&b, 1, 4096, 3) == CKPT_MAX_CHUNKS + 3, "shard boundaries");
    int rc = ckpt_save(&o, 1, "r", "c", &b, 1, "{}", NULL);
    T_CHECK(rc == -EINVAL, "save of %u chunks: %d, want -EINVAL", (unsigned)CKPT_MAX_CHUNKS + 1, rc);
    T_CHECK(ckpt_fit_chunk_bytes(4096, &b, 1, 1) == 8192, "fit: %llu",
            (unsigned long long)ckpt_fit_chunk_bytes(4096, &b, 1, 1));
    T_CHECK(ckpt_fit_chunk_bytes(4u << 20, &b, 1, 1) == 4u << 20, "fit keeps a size that fits");
    T_CHECK(ckpt_fit_chunk_bytes(4095, &b, 1, 1) == 0, "fit: bad chunk size");
    ckpt_buffer huge = {"params", "u8", 1, 1ull << 62, 0, 1ull << 62, mem};
    T_CHECK(ckpt_fit_chunk_bytes(4u << 20, &huge, 1, 1) == 0, "fit: nothing fits 4 EiB");
    /* a trainer record over the limit is refused too */
    ckpt_buffer one = {"params", "u8", 1, 4096, 0, 4096, mem};
    size_t tl = CKPT_MAX_TRAINER_BYTES + 100;
    char *tr = malloc(tl + 16);
    T_REQUIRE(tr != NULL, "malloc");
    int k = snprintf(tr, 16, "{\"p\":\"");
    memset(tr + k, 'y', tl);
    snprintf(tr + k + tl, 16, "\"}");
    rc = ckpt_save(&o, 2, "r", "c", &one, 1, tr, NULL);
    T_CHECK(rc == -EINVAL, "save with a huge trainer record: %d", rc);
    free(tr);
    T_CHECK(ckpt_save(&o, 3, "r", "c", &one, 1, "{}", NULL) == 0, "a normal save still works");
    munmap(mem, (size_t)total);
    t_rmrf(root);
    free(root);
}

/* ------------------------------------------------------------------ listing during retention */

typedef struct churn {
    const char *root, *pool, *gone;
    int first, last; /* steps [first, last] wait in the pool */
    atomic_int done;
    atomic_long lists; /* listings the other thread finished */
} churn;

/* Commit and retire snapshots as a run with keep-last does, each name once: pool/step-k ->
 * root/step-k (a commit), a moment later root/.tmp-step-k-retired (retention's rename), then
 * out of the folder (its deletion). */
static void *churn_main(void *arg)
{
    churn *c = arg;
    char a[4200], b[4200], t[4200], g[4200], name[32];
    for (int i = c->first; i <= c->last; i++) {
        ckpt_step_dirname((uint64_t)i, name, sizeof name);
        snprintf(a, sizeof a, "%s/%s", c->pool, name);
        snprintf(b, sizeof b, "%s/%s", c->root, name);
        snprintf(t, sizeof t, "%s/.tmp-%s-retired", c->root, name);
        snprintf(g, sizeof g, "%s/%s", c->gone, name);
        if (rename(a, b)) break;
        t_sleep_s(200e-6);
        if (i % 10 == 0) {
            /* now and then stay until two listings ended (at most 0.2 s): on a slow machine
             * (a sanitizer, a loaded CI) a listing takes longer than the 200 us above, and the
             * check that a committed entry was seen in passing would fail by timing alone */
            long l0 = atomic_load(&c->lists);
            for (int w = 0; w < 1000 && atomic_load(&c->lists) < l0 + 2; w++) t_sleep_s(200e-6);
        }
        if (rename(b, t) || rename(t, g)) break;
    }
    atomic_store(&c->done, 1);
    return NULL;
}

static void list_during_retention(const char *base)
{
    char *root = t_path_in(base, "churn"), *pool = t_path_in(base, "pool");
    char *gone = t_path_in(base, "gone");
    T_REQUIRE(mkdir(root, 0755) == 0 && mkdir(gone, 0755) == 0, "mkdir");
    churn c = {root, pool, gone, 10, 409, 0, 0};
    T_REQUIRE(save_small(root, 1) == 0, "a snapshot that stays");
    for (int i = c.first; i <= c.last; i++) T_REQUIRE(save_small(pool, (uint64_t)i) == 0, "save %d", i);
    pthread_t tid;
    T_REQUIRE(pthread_create(&tid, NULL, churn_main, &c) == 0, "thread");
    long lists = 0, seen = 0, corrupt = 0;
    char first_bad[700] = "";
    while (!atomic_load(&c.done)) {
        ckpt_entry *e = NULL;
        size_t n = 0;
        if (ckpt_list(root, &e, &n) < 0) break;
        for (size_t i = 0; i < n; i++) {
            if (e[i].status == CKPT_STATUS_COMMITTED && e[i].step >= 10) seen++;
            if (e[i].status == CKPT_STATUS_CORRUPT || e[i].status == CKPT_STATUS_UNREADABLE) {
                if (!corrupt++) snprintf(first_bad, sizeof first_bad, "%s: %s", e[i].name, e[i].reason);
            }
        }
        free(e);
        lists++;
        atomic_store(&c.lists, lists);
    }
    pthread_join(tid, NULL);
    printf("listing during retention: %ld lists over %d commits and removals, %ld committed "
           "entries seen in passing, %ld called corrupt\n", lists, c.last - c.first + 1, seen,
           corrupt);
    T_CHECK(lists > 10 && seen > 0, "the race was exercised");
    T_CHECK(corrupt == 0, "%ld entries called corrupt while being renamed, first %s", corrupt,
            first_bad);
    t_rmrf(root);
    t_rmrf(pool);
    t_rmrf(gone);
    free(root);
    free(pool);
    free(gone);
}

int main(void)
{
    char *base = t_tmpdir("ckpt-hostile");
    alarm(240); /* a hang (a FIFO waited on) is a failure, not a stuck test */
    transient_eio(base); /* first: forks before this process reads its fault settings */
    transient_emfile(base);
    file_types(base);
    folder_sized_data_file(base);
    lock_types(base);
    manifest_checks(base);
    verify_with_empty_last_buffer(base);
    one_frame_per_chunk(base);
    oom_is_not_corrupt(base);
    removed_while_read(base);
    trailing_slash_names_the_folder(base);
    files_and_shards(base);
    lock_links_and_snapshot_folders(base);
    writer_limits(base);
    limits_and_scaling(base);
    list_during_retention(base);
    t_rmrf(base);
    free(base);
    return t_done("test_ckpt_hostile");
}
