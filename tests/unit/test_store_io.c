/* test_store_io.c - storage module: writer/reader round trips, errors, file helpers and
 * fault injection (CKPT_FAULT_STORE, exercised in forked children because the variable is
 * read once per process). Runs in $TMPDIR (O_DIRECT path) and in /dev/shm when present. */
#include "storage.h"
#include "t_helpers.h"

#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define MiB (1u << 20)

/* T_REQUIRE evaluates its condition twice: calls with side effects go through this, which
 * evaluates `expr` once and requires it to be 0. */
#define REQUIRE_OK(expr, what)                                                                 \
    do {                                                                                       \
        int req_rc_ = (expr);                                                                  \
        T_REQUIRE(req_rc_ == 0, "%s: %d", what, req_rc_);                                      \
    } while (0)

/* Byte at file offset i of the test pattern `seed`: not periodic at any power of two. */
static unsigned char pat(uint64_t i, unsigned seed)
{
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 29;
    return (unsigned char)(x ^ (x >> 17));
}

static void fill_pat(unsigned char *p, uint64_t off, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) p[i] = pat(off + i, seed);
}

static char *path_in(const char *dir, const char *name)
{
    char *p = malloc(4096);
    T_REQUIRE(p, "malloc");
    snprintf(p, 4096, "%s/%s", dir, name);
    return p;
}

/* Read a whole file with plain read(2); returns its size or -1. */
static long long slurp(const char *path, unsigned char **out)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st)) {
        close(fd);
        return -1;
    }
    unsigned char *buf = malloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (buf && got < (size_t)st.st_size) {
        ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    *out = buf;
    return buf && got == (size_t)st.st_size ? (long long)got : -1;
}

static int file_matches(const char *path, uint64_t size, unsigned seed)
{
    unsigned char *buf = NULL;
    long long n = slurp(path, &buf);
    int ok = n >= 0 && (uint64_t)n == size;
    for (uint64_t i = 0; ok && i < size; i++) ok = buf[i] == pat(i, seed);
    free(buf);
    return ok;
}

/* Irregular append sizes, cycled. */
static const size_t append_sizes[] = {1, 7, 4095, 4097, 65539, 1, 4096, 1048581, 333, 12288,
                                      2 * MiB + 17, 0, 100003};

/* Write `size` pattern bytes through a writer with irregular appends; 0 on success. */
static int write_pattern(const char *path, uint64_t size, const store_writer_opts *o,
                         unsigned seed)
{
    store_writer *w = NULL;
    int rc = store_writer_open(&w, path, o);
    T_CHECK(rc == 0, "open %s: %d", path, rc);
    if (rc) return rc;
    size_t maxa = 3 * MiB;
    unsigned char *chunk = malloc(maxa);
    T_REQUIRE(chunk, "malloc");
    uint64_t off = 0;
    size_t k = (size_t)seed;
    while (off < size && !rc) {
        size_t n = append_sizes[k++ % (sizeof append_sizes / sizeof *append_sizes)];
        if (n > size - off) n = (size_t)(size - off);
        fill_pat(chunk, off, n, seed);
        rc = store_writer_append(w, chunk, n);
        off += n;
        if (!rc) T_CHECK(store_writer_offset(w) == off, "offset %llu != %llu",
                         (unsigned long long)store_writer_offset(w), (unsigned long long)off);
    }
    free(chunk);
    T_CHECK(rc == 0, "append to %s: %d", path, rc);
    int rc2 = store_writer_close(w, 1);
    T_CHECK(rc2 == 0, "close %s: %d", path, rc2);
    return rc ? rc : rc2;
}

static void test_round_trips(const char *dir)
{
    static const uint64_t sizes[] = {0,       1,           4095,        4096,
                                     4097,    MiB - 1,     MiB,         MiB + 1,
                                     8193,    10 * MiB + 123};
    static const store_writer_opts opts[] = {
        {4096, 1, 1, NULL}, {4096, 8, 1, NULL}, {1u << 20, 8, 1, NULL}, {65536, 3, 1, NULL},
        {8192, 2, 0, NULL}};
    unsigned seed = 1;
    for (size_t oi = 0; oi < sizeof opts / sizeof *opts; oi++) {
        for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++, seed++) {
            char name[64];
            snprintf(name, sizeof name, "rt-%zu-%zu.bin", oi, si);
            char *p = path_in(dir, name);
            if (write_pattern(p, sizes[si], &opts[oi], seed) == 0)
                T_CHECK(file_matches(p, sizes[si], seed),
                        "%s: size or bytes differ (size %llu, buffer %zu, qd %u, direct %d)",
                        p, (unsigned long long)sizes[si], opts[oi].buffer_bytes,
                        opts[oi].queue_depth, opts[oi].direct);
            unlink(p);
            free(p);
        }
    }
    /* NULL options = defaults. */
    char *p = path_in(dir, "defaults.bin");
    store_writer *w = NULL;
    REQUIRE_OK(store_writer_open(&w, p, NULL), "open with NULL opts");
    unsigned char b[5000];
    fill_pat(b, 0, sizeof b, 99);
    T_CHECK(store_writer_append(w, b, sizeof b) == 0, "append");
    T_CHECK(store_writer_append(w, NULL, 0) == 0, "empty append");
    T_CHECK(store_writer_close(w, 0) == 0, "close without fsync");
    T_CHECK(file_matches(p, sizeof b, 99), "defaults file");
    unlink(p);
    free(p);
}

static void test_writer_errors(const char *dir)
{
    char *p = path_in(dir, "excl.bin");
    REQUIRE_OK(store_write_file_durable(p, "keep", 4), "seed file");
    store_writer *w = (store_writer *)&w;
    int rc = store_writer_open(&w, p, NULL);
    T_CHECK(rc == -EEXIST, "O_EXCL refusal: %d", rc);
    T_CHECK(w == NULL, "*out cleared on error");
    char *buf = NULL;
    size_t len = 0;
    T_CHECK(store_read_file(p, 100, 0, &buf, &len) == 0 && len == 4 && !memcmp(buf, "keep", 4),
            "existing file untouched");
    free(buf);
    unlink(p);

    static char misaligned_mem[2 * 4096 + 1];
    store_writer_opts bad[] = {{1000, 8, 1, NULL},  {0, 8, 1, NULL},    {4096, 0, 1, NULL},
                               {4096, 65, 1, NULL}, {6000, 1, 1, NULL}, {(64u << 20) + 4096, 1, 1, NULL},
                               {4096, 1, 1, misaligned_mem + ((uintptr_t)misaligned_mem % 4096 ? 0 : 1)}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        rc = store_writer_open(&w, p, &bad[i]);
        T_CHECK(rc == -EINVAL, "bad opts %zu: %d", i, rc);
        T_CHECK(access(p, F_OK) != 0, "no file left by bad opts %zu", i);
    }
    T_CHECK(store_writer_open(NULL, p, NULL) == -EINVAL, "NULL out");
    T_CHECK(store_writer_append(NULL, "x", 1) == -EINVAL, "NULL writer append");
    T_CHECK(store_writer_close(NULL, 1) == -EINVAL, "NULL writer close");
    T_CHECK(store_writer_offset(NULL) == 0, "NULL writer offset");
    store_writer_abort(NULL);
    char *missing = path_in(dir, "no/such/dir/f.bin");
    T_CHECK(store_writer_open(&w, missing, NULL) == -ENOENT, "missing folder");
    free(missing);

    /* Abort: with writes in flight and with a buffered tail; the file disappears. */
    store_writer_opts o = {4096, 8, 1, NULL};
    REQUIRE_OK(store_writer_open(&w, p, &o), "open for abort");
    unsigned char *big = malloc(MiB + 5);
    T_REQUIRE(big, "malloc");
    fill_pat(big, 0, MiB + 5, 3);
    T_CHECK(store_writer_append(w, big, MiB + 5) == 0, "append before abort");
    store_writer_abort(w);
    T_CHECK(access(p, F_OK) != 0 && errno == ENOENT, "abort unlinks");
    REQUIRE_OK(store_writer_open(&w, p, NULL), "reopen after abort");
    store_writer_abort(w);
    T_CHECK(access(p, F_OK) != 0, "abort of an empty writer unlinks");
    free(big);
    free(p);
}

static void test_reader(const char *dir)
{
    const uint64_t size = 3 * MiB + 4321;
    char *p = path_in(dir, "reader.bin");
    store_writer_opts o = {65536, 4, 1, NULL};
    REQUIRE_OK(write_pattern(p, size, &o, 7), "write reader file");
    unsigned char *ref = malloc(size);
    T_REQUIRE(ref, "malloc");
    fill_pat(ref, 0, size, 7);

    static const unsigned qds[] = {0, 1, 3, 64};
    for (size_t qi = 0; qi < sizeof qds / sizeof *qds; qi++) {
        store_reader *r = NULL;
        uint64_t got_size = 0;
        int rc = store_reader_open(&r, p, qds[qi], 0, &got_size);
        T_REQUIRE(rc == 0, "reader open qd %u: %d", qds[qi], rc);
        T_CHECK(got_size == size, "size %llu", (unsigned long long)got_size);

        /* Fixed awkward ranges, each into a deliberately misaligned destination. */
        const struct {
            uint64_t off;
            size_t len;
        } fx[] = {{0, 1},           {size - 1, 1},        {0, (size_t)size},
                  {1, 4095},        {4095, 2},            {4096, 4096},
                  {12345, 2 * MiB}, {size - 5000, 5000},  {MiB - 3, 7},
                  {0, 0},           {size, 0},            {8192, MiB + 4096}};
        size_t nfx = sizeof fx / sizeof *fx;
        for (int mis = 0; mis < 2; mis++) {
            store_read_req reqs[16];
            unsigned char *bufs[16];
            for (size_t i = 0; i < nfx; i++) {
                /* mis = 0: page-aligned dst (aligned ranges read straight); 1: dst + 3 */
                void *b = NULL;
                REQUIRE_OK(posix_memalign(&b, 4096, fx[i].len + 4096), "memalign");
                bufs[i] = b;
                memset(bufs[i], 0xEE, fx[i].len + 4096);
                reqs[i] = (store_read_req){fx[i].off, fx[i].len, bufs[i] + (mis ? 3 : 0)};
            }
            rc = store_reader_read(r, reqs, nfx);
            T_CHECK(rc == 0, "fixed ranges qd %u mis %d: %d", qds[qi], mis, rc);
            for (size_t i = 0; i < nfx; i++) {
                unsigned char *d = reqs[i].dst;
                T_CHECK(!memcmp(d, ref + fx[i].off, fx[i].len),
                        "range %zu (%llu+%zu) qd %u mis %d", i,
                        (unsigned long long)fx[i].off, fx[i].len, qds[qi], mis);
                T_CHECK(d[fx[i].len] == 0xEE, "range %zu wrote past its end", i);
                if (mis) T_CHECK(bufs[i][0] == 0xEE, "range %zu wrote before its start", i);
                free(bufs[i]);
            }
        }

        /* Many random ranges in one call. */
        enum { NR = 300 };
        store_read_req reqs[NR];
        unsigned long long s = 88172645463325252ull + qi;
        for (int i = 0; i < NR; i++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            uint64_t off = s % size;
            size_t len = (size_t)((s >> 20) % (i % 10 == 0 ? 3 * MiB : 20000));
            if (off + len > size) len = (size_t)(size - off);
            reqs[i] = (store_read_req){off, len, malloc(len + 1)};
            T_REQUIRE(reqs[i].dst, "malloc");
        }
        rc = store_reader_read(r, reqs, NR);
        T_CHECK(rc == 0, "random ranges: %d", rc);
        int bad = 0;
        for (int i = 0; i < NR; i++) {
            if (memcmp(reqs[i].dst, ref + reqs[i].offset, reqs[i].len)) bad++;
            free(reqs[i].dst);
        }
        T_CHECK(bad == 0, "%d of %d random ranges differ (qd %u)", bad, NR, qds[qi]);

        /* Past the end: -EBADMSG, and the handle stays usable. */
        unsigned char tmp[8192];
        const struct {
            uint64_t off;
            size_t len;
        } eof[] = {{size - 1, 2}, {size, 1}, {size + 100000, 10}, {size - 4000, 8192}};
        for (size_t i = 0; i < sizeof eof / sizeof *eof; i++) {
            store_read_req q = {eof[i].off, eof[i].len, tmp};
            rc = store_reader_read(r, &q, 1);
            T_CHECK(rc == -EBADMSG, "past EOF %zu: %d", i, rc);
        }
        store_read_req mixed[2] = {{0, 100, tmp}, {size - 10, 20, tmp + 100}};
        T_CHECK(store_reader_read(r, mixed, 2) == -EBADMSG, "good + past-EOF range");
        store_read_req last = {size - 1, 1, tmp};
        T_CHECK(store_reader_read(r, &last, 1) == 0 && tmp[0] == ref[size - 1],
                "usable after -EBADMSG");

        store_read_req nul = {0, 10, NULL};
        T_CHECK(store_reader_read(r, &nul, 1) == -EINVAL, "NULL dst");
        store_read_req ovf = {UINT64_MAX - 2, 10, tmp};
        T_CHECK(store_reader_read(r, &ovf, 1) == -EINVAL, "offset overflow");
        T_CHECK(store_reader_read(r, NULL, 0) == 0, "no requests");
        store_reader_close(r);
    }
    store_reader *r = NULL;
    T_CHECK(store_reader_open(&r, p, 65, 0, NULL) == -EINVAL, "qd 65");
    char *missing = path_in(dir, "missing.bin");
    T_CHECK(store_reader_open(&r, missing, 0, 0, NULL) == -ENOENT, "missing file");
    free(missing);
    store_reader_close(NULL);

    /* Empty file. */
    char *e = path_in(dir, "empty.bin");
    REQUIRE_OK(write_pattern(e, 0, &o, 1), "empty file");
    uint64_t esz = 1;
    REQUIRE_OK(store_reader_open(&r, e, 2, 0, &esz), "open empty");
    T_CHECK(esz == 0, "empty size");
    unsigned char c;
    store_read_req q = {0, 1, &c};
    T_CHECK(store_reader_read(r, &q, 1) == -EBADMSG, "read of empty file");
    store_reader_close(r);
    unlink(e);
    free(e);
    free(ref);
    unlink(p);
    free(p);
}

static void test_file_helpers(const char *dir)
{
    char *a = path_in(dir, "a.json"), *b = path_in(dir, "b.json");
    const char *msg = "{\"step\": 1200}";
    T_CHECK(store_write_file_durable(a, msg, strlen(msg)) == 0, "write durable");
    T_CHECK(store_write_file_durable(a, msg, 3) == -EEXIST, "write durable: exists");
    char *buf = NULL;
    size_t len = 0;
    T_CHECK(store_read_file(a, 1000, 0, &buf, &len) == 0 && len == strlen(msg) &&
                !strcmp(buf, msg),
            "read back");
    free(buf);
    buf = (char *)1;
    T_CHECK(store_read_file(a, 5, 0, &buf, &len) == -EFBIG && buf == NULL, "max_bytes");
    T_CHECK(store_read_file(a, strlen(msg), 0, &buf, NULL) == 0, "max_bytes == size");
    free(buf);
    T_CHECK(store_read_file(b, 1000, 0, &buf, &len) == -ENOENT, "missing");
    T_CHECK(store_rename_durable(a, b) == 0, "rename");
    T_CHECK(access(a, F_OK) != 0 && access(b, F_OK) == 0, "renamed");
    T_CHECK(store_rename_durable(a, b) == -ENOENT, "rename of missing");

    char *z = path_in(dir, "zero");
    T_CHECK(store_write_file_durable(z, NULL, 0) == 0, "empty durable file");
    T_CHECK(store_read_file(z, 0, 0, &buf, &len) == 0 && len == 0 && buf && buf[0] == 0,
            "empty read");
    free(buf);

    /* Tree: nested folders, files, a symlink to a file outside that must survive. */
    char *t = path_in(dir, "tree"), *keep = path_in(dir, "keep.txt");
    REQUIRE_OK(store_write_file_durable(keep, "k", 1), "keep file");
    char sub[4200];
    REQUIRE_OK(mkdir(t, 0755), "mkdir");
    snprintf(sub, sizeof sub, "%s/x", t);
    REQUIRE_OK(mkdir(sub, 0755), "mkdir");
    snprintf(sub, sizeof sub, "%s/x/y", t);
    REQUIRE_OK(mkdir(sub, 0755), "mkdir");
    snprintf(sub, sizeof sub, "%s/x/y/f.bin", t);
    REQUIRE_OK(store_write_file_durable(sub, "abc", 3), "file");
    snprintf(sub, sizeof sub, "%s/g.bin", t);
    REQUIRE_OK(store_write_file_durable(sub, "abc", 3), "file");
    snprintf(sub, sizeof sub, "%s/x/link", t);
    REQUIRE_OK(symlink(keep, sub), "symlink");
    snprintf(sub, sizeof sub, "%s/x/dirlink", t);
    REQUIRE_OK(symlink(dir, sub), "symlink");

    /* Rename a folder durably too. */
    char *t2 = path_in(dir, "tree2");
    T_CHECK(store_rename_durable(t, t2) == 0, "rename folder");
    T_CHECK(store_fsync_dir(dir) == 0, "fsync dir");
    T_CHECK(store_fsync_dir(t) == -ENOENT, "fsync missing dir");
    T_CHECK(store_remove_tree(t2) == 0, "remove tree");
    T_CHECK(access(t2, F_OK) != 0, "tree gone");
    T_CHECK(access(keep, F_OK) == 0 && access(b, F_OK) == 0, "symlink targets survive");
    T_CHECK(store_remove_tree(t2) == 0, "missing tree is not an error");
    T_CHECK(store_remove_tree(keep) == 0 && access(keep, F_OK) != 0, "remove a file");
    T_CHECK(store_remove_tree("") == -EINVAL, "empty path");

    unlink(b);
    unlink(z);
    free(a);
    free(b);
    free(z);
    free(t);
    free(t2);
    free(keep);
}

/* Child: with CKPT_FAULT_STORE=spec, write 3 buffers of 4096 bytes (qd 1) and a second file;
 * returns the exit code describing what happened (0 = as expected). */
static int fault_child(const char *dir, const char *spec, int want_err, int fail_at)
{
    setenv("CKPT_FAULT_STORE", spec, 1);
    setenv("CKPT_LOG_LEVEL", "error", 1);
    char *p = path_in(dir, "fault.bin");
    store_writer_opts o = {4096, 1, 1, NULL};
    store_writer *w = NULL;
    if (store_writer_open(&w, p, &o)) return 10;
    unsigned char b[4096];
    memset(b, 1, sizeof b);
    for (int i = 1; i <= 3; i++) {
        /* With qd 1 the append that fills buffer i submits write i and waits for it. */
        int rc = store_writer_append(w, b, sizeof b);
        if (i < fail_at && rc != 0) return 20 + i;
        if (i >= fail_at && rc != want_err) return 30 + i;
    }
    if (store_writer_append(w, b, 1) != want_err) return 40; /* sticky */
    if (store_writer_close(w, 1) != want_err) return 41;
    if (unlink(p)) return 42;
    /* The count is per process: the next writer is not hit again. */
    if (store_writer_open(&w, p, &o)) return 50;
    if (store_writer_append(w, b, sizeof b) || store_writer_append(w, b, 10)) return 51;
    if (store_writer_close(w, 0)) return 52;
    unlink(p);
    free(p);
    return 0;
}

/* Child: a file size limit makes a write short, then fail with EFBIG. */
static int fsize_child(const char *dir, int direct)
{
    setenv("CKPT_LOG_LEVEL", "error", 1);
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {10000, 10000};
    if (setrlimit(RLIMIT_FSIZE, &rl)) return 77;
    char *p = path_in(dir, "fsize.bin");
    store_writer_opts o = {4096, 2, direct, NULL};
    store_writer *w = NULL;
    if (store_writer_open(&w, p, &o)) return 10;
    unsigned char b[3 * 4096];
    memset(b, 2, sizeof b);
    int rc = store_writer_append(w, b, sizeof b);
    int rc2 = store_writer_close(w, 0);
    if (rc == 0) rc = rc2;
    if (rc != -EFBIG && rc != -EINVAL) return 20; /* O_DIRECT may refuse the unaligned rest */
    if (rc2 != rc) return 21;
    struct stat st;
    if (!direct && (stat(p, &st) || st.st_size != 10000)) return 22; /* short part landed */
    unlink(p);
    free(p);
    return 0;
}

static int run_child(int (*fn)(const char *, const char *, int, int), const char *dir,
                     const char *spec, int want, int at)
{
    fflush(NULL);
    pid_t pid = fork();
    T_REQUIRE(pid >= 0, "fork");
    if (pid == 0) _exit(fn(dir, spec, want, at));
    int st = 0;
    pid_t wp = waitpid(pid, &st, 0);
    T_REQUIRE(wp == pid, "waitpid");
    char *p = path_in(dir, "fault.bin"), *q = path_in(dir, "fsize.bin");
    unlink(p); /* left behind when the child stopped early */
    unlink(q);
    free(p);
    free(q);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

static int fsize_adapter(const char *dir, const char *spec, int direct, int unused)
{
    (void)spec;
    (void)unused;
    return fsize_child(dir, direct);
}

static void test_faults(const char *dir)
{
    int rc = run_child(fault_child, dir, "enospc:2", -ENOSPC, 2);
    T_CHECK(rc == 0, "enospc:2 child exit %d", rc);
    rc = run_child(fault_child, dir, "eio:1", -EIO, 1);
    T_CHECK(rc == 0, "eio:1 child exit %d", rc);
    rc = run_child(fault_child, dir, "eio:3", -EIO, 3);
    T_CHECK(rc == 0, "eio:3 child exit %d", rc);
    rc = run_child(fault_child, dir, "bogus", 0, 99);
    T_CHECK(rc == 0, "malformed spec ignored: child exit %d", rc);
    for (int direct = 0; direct < 2; direct++) {
        rc = run_child(fsize_adapter, dir, NULL, direct, 0);
        T_CHECK(rc == 0 || rc == 77, "short write (direct %d): child exit %d", direct, rc);
    }
}

/* Only regular files are opened for reading: a FIFO must not hang the reader (it would wait
 * for a writer forever), a directory or a device is refused, and with STORE_NOFOLLOW so is a
 * symbolic link. An alarm turns a hang into a failure. */
static void test_file_types(const char *dir)
{
    char *fifo = path_in(dir, "fifo"), *sub = path_in(dir, "sub"), *reg = path_in(dir, "reg");
    char *link = path_in(dir, "link");
    REQUIRE_OK(mkfifo(fifo, 0644), "mkfifo");
    REQUIRE_OK(mkdir(sub, 0755), "mkdir");
    REQUIRE_OK(store_write_file_durable(reg, "data", 4), "regular file");
    REQUIRE_OK(symlink(reg, link), "symlink");
    alarm(20);
    char *buf = NULL;
    store_reader *r = NULL;
    T_CHECK(store_read_file(fifo, 100, 0, &buf, NULL) == -ENODEV && !buf, "read_file FIFO");
    T_CHECK(store_reader_open(&r, fifo, 0, 0, NULL) == -ENODEV && !r, "reader FIFO");
    T_CHECK(store_read_file(sub, 100, 0, &buf, NULL) == -EISDIR, "read_file directory");
    T_CHECK(store_reader_open(&r, sub, 0, 0, NULL) == -EISDIR, "reader directory");
    T_CHECK(store_read_file("/dev/null", 100, 0, &buf, NULL) == -ENODEV, "read_file device");
    T_CHECK(store_read_file(link, 100, STORE_NOFOLLOW, &buf, NULL) == -ELOOP, "nofollow link");
    T_CHECK(store_reader_open(&r, link, 0, STORE_NOFOLLOW, NULL) == -ELOOP, "reader nofollow");
    size_t len = 0;
    T_CHECK(store_read_file(link, 100, 0, &buf, &len) == 0 && len == 4, "link followed");
    free(buf);
    uint64_t size = 0;
    T_CHECK(store_reader_open(&r, link, 0, 0, &size) == 0 && size == 4, "reader follows link");
    store_reader_close(r);
    r = NULL;
    T_CHECK(store_reader_open(&r, reg, 0, 7, NULL) == -EINVAL, "unknown flags");
    int fd = store_open_regular(reg, STORE_NOFOLLOW, 0, NULL);
    T_CHECK(fd >= 0 && !(fcntl(fd, F_GETFL) & O_NONBLOCK), "blocking descriptor");
    if (fd >= 0) close(fd);
    alarm(0);
    unlink(fifo);
    unlink(link);
    unlink(reg);
    rmdir(sub);
    free(fifo);
    free(sub);
    free(reg);
    free(link);
}

/* One canonical text for a folder whether or not it exists yet (ranks compare it while rank 0
 * may be creating it): links of the existing prefix resolved, the rest folded. */
static void test_canonical_path(const char *dir)
{
    char real[4096], out[4096], want[4200], in[4200];
    T_REQUIRE(realpath(dir, real) != NULL, "realpath");
    T_CHECK(store_canonical_path(dir, out, sizeof out) == 0 && !strcmp(out, real), "existing: %s", out);
    static const struct { const char *in, *tail; } cases[] = {
        {"/new/sub", "/new/sub"}, {"/new/../x", "/x"}, {"//a/./b/", "/a/b"},
        {"/a/b/../../c", "/c"}, {"/.", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(in, sizeof in, "%s%s", dir, cases[i].in);
        snprintf(want, sizeof want, "%s%s", real, cases[i].tail);
        T_CHECK(store_canonical_path(in, out, sizeof out) == 0 && !strcmp(out, want),
                "%s: %s, want %s", in, out, want);
    }
    char *link = path_in(dir, "link");
    REQUIRE_OK(symlink(real, link), "symlink");
    snprintf(in, sizeof in, "%s/new", link);
    snprintf(want, sizeof want, "%s/new", real);
    T_CHECK(store_canonical_path(in, out, sizeof out) == 0 && !strcmp(out, want), "via link: %s", out);
    char cwd[4096];
    T_REQUIRE(getcwd(cwd, sizeof cwd) != NULL, "getcwd");
    REQUIRE_OK(chdir(dir), "chdir");
    snprintf(want, sizeof want, "%s/rel/x", real);
    T_CHECK(store_canonical_path("rel/x", out, sizeof out) == 0 && !strcmp(out, want), "relative: %s", out);
    T_CHECK(store_canonical_path("./rel/./x", out, sizeof out) == 0 && !strcmp(out, want), "./: %s", out);
    REQUIRE_OK(chdir(cwd), "chdir back");
    T_CHECK(store_canonical_path("/", out, sizeof out) == 0 && !strcmp(out, "/"), "root: %s", out);
    T_CHECK(store_canonical_path("", out, sizeof out) == -EINVAL, "empty");
    T_CHECK(store_canonical_path(dir, out, 4) == -ENAMETOOLONG, "short buffer");
    unlink(link);
    free(link);
}

/* store_writer_append_ref: bytes written from the caller's memory, mixed with copied
 * appends, from memory aligned like the file (written in place) and not (copied), with and
 * without a preallocation larger than the file; the file must equal the pattern. */
static void test_append_ref(const char *dir)
{
    static const size_t sizes[] = {5, 4 * MiB + 4096, 70000, 4091, 9 * MiB + 13, 1, 65536,
                                   200003, 3 * MiB};
    static const store_writer_opts opts[] = {
        {4096, 1, 1, NULL}, {1u << 20, 8, 1, NULL}, {65536, 3, 1, NULL}, {8192, 2, 0, NULL}};
    const size_t total = 20 * MiB;
    unsigned char *mem = NULL;
    T_REQUIRE(posix_memalign((void **)&mem, 4096, total + 4096) == 0, "posix_memalign");
    unsigned seed = 900;
    for (size_t oi = 0; oi < sizeof opts / sizeof *opts; oi++)
        for (int shift = 0; shift <= 16; shift += 16)     /* aligned like the file, or not */
            for (int reserve = 0; reserve <= 1; reserve++, seed++) {
                unsigned char *src = mem + shift; /* src[i] is the byte at file offset i */
                fill_pat(src, 0, total, seed);
                char name[64];
                snprintf(name, sizeof name, "ref-%zu-%d-%d.bin", oi, shift, reserve);
                char *p = path_in(dir, name);
                store_writer *w = NULL;
                int rc = store_writer_open(&w, p, &opts[oi]);
                T_CHECK(rc == 0, "open %s: %d", p, rc);
                if (rc == 0 && reserve) rc = store_writer_reserve(w, total + 12345);
                uint64_t off = 0;
                for (size_t k = 0; rc == 0 && off < total; k++) {
                    size_t n = sizes[k % (sizeof sizes / sizeof *sizes)];
                    if (n > total - off) n = (size_t)(total - off);
                    rc = k % 3 == 2 ? store_writer_append(w, src + off, n)
                                    : store_writer_append_ref(w, src + off, n);
                    off += n;
                    if (rc == 0)
                        T_CHECK(store_writer_offset(w) == off, "offset %llu != %llu",
                                (unsigned long long)store_writer_offset(w), (unsigned long long)off);
                }
                T_CHECK(rc == 0, "append to %s: %d", p, rc);
                int rc2 = w ? store_writer_close(w, 1) : -1;
                T_CHECK(rc2 == 0, "close %s: %d", p, rc2);
                if (rc == 0 && rc2 == 0)
                    T_CHECK(file_matches(p, total, seed),
                            "%s: size or bytes differ (buffer %zu, qd %u, direct %d, shift %d, "
                            "reserve %d)", p, opts[oi].buffer_bytes, opts[oi].queue_depth,
                            opts[oi].direct, shift, reserve);
                unlink(p);
                free(p);
            }
    T_CHECK(store_writer_append_ref(NULL, "x", 1) == -EINVAL, "NULL writer append_ref");
    T_CHECK(store_writer_reserve(NULL, 1) == -EINVAL, "NULL writer reserve");
    free(mem);
}

/* store_reader_submit / store_reader_wait: two readers of one file with batches in flight at
 * once (more pieces than the queue depth, aligned and not), one batch at a time per reader,
 * a past-the-end range reported by wait, and a close with a batch still in flight. */
static void test_reader_async(const char *dir)
{
    const uint64_t size = 5 * MiB + 777;
    char *p = path_in(dir, "reader-async.bin");
    store_writer_opts o = {65536, 4, 1, NULL};
    REQUIRE_OK(write_pattern(p, size, &o, 11), "write reader file");
    unsigned char *ref = malloc(size), *a = NULL, *b = NULL;
    T_REQUIRE(ref, "malloc");
    fill_pat(ref, 0, size, 11);
    REQUIRE_OK(posix_memalign((void **)&a, 4096, size + 4096), "memalign");
    REQUIRE_OK(posix_memalign((void **)&b, 4096, size + 4096), "memalign");
    store_reader *r1 = NULL, *r2 = NULL;
    REQUIRE_OK(store_reader_open(&r1, p, 2, 0, NULL), "open r1");
    REQUIRE_OK(store_reader_open(&r2, p, 3, 0, NULL), "open r2");
    T_CHECK(store_reader_wait(r1) == -EINVAL, "wait without a batch");
    store_read_req q1[4], q2[3];
    for (int i = 0; i < 4; i++) /* aligned pieces, then the short tail */
        q1[i] = (store_read_req){(uint64_t)i * (MiB + 4096), i < 3 ? MiB + 4096 : (size_t)(size - 3 * (MiB + 4096)),
                                 a + (size_t)i * (MiB + 4096)};
    q2[0] = (store_read_req){5, 3 * MiB, b + 7};           /* misaligned: bounce pieces */
    q2[1] = (store_read_req){3 * MiB + 5, 0, NULL};
    q2[2] = (store_read_req){3 * MiB + 5, (size_t)(size - 3 * MiB - 5), b + 7 + 3 * MiB};
    T_CHECK(store_reader_submit(r1, q1, 4) == 0, "submit r1");
    T_CHECK(store_reader_submit(r1, q1, 4) == -EINVAL, "second batch on a busy reader");
    T_CHECK(store_reader_submit(r2, q2, 3) == 0, "submit r2");
    T_CHECK(store_reader_wait(r2) == 0, "wait r2");
    T_CHECK(store_reader_wait(r1) == 0, "wait r1");
    T_CHECK(!memcmp(a, ref, size), "r1 bytes");
    T_CHECK(!memcmp(b + 7, ref + 5, size - 5), "r2 bytes");
    store_read_req past = {size - 10, 20, b};
    T_CHECK(store_reader_submit(r1, &past, 1) == 0, "submit past the end");
    T_CHECK(store_reader_wait(r1) == -EBADMSG, "past the end: -EBADMSG at wait");
    T_CHECK(store_reader_read(r1, q1, 4) == 0, "read after a failed batch");
    T_CHECK(store_reader_submit(r2, q2, 3) == 0, "submit before close");
    store_reader_close(r2); /* waits for the batch */
    store_reader_close(r1);
    T_CHECK(store_reader_submit(NULL, q1, 1) == -EINVAL && store_reader_wait(NULL) == -EINVAL,
            "NULL reader");
    free(a);
    free(b);
    free(ref);
    unlink(p);
    free(p);
}

static void run_all(const char *dir)
{
    printf("storage tests in %s\n", dir);
    test_round_trips(dir);
    test_append_ref(dir);
    test_writer_errors(dir);
    test_reader(dir);
    test_reader_async(dir);
    test_file_helpers(dir);
    test_file_types(dir);
    test_canonical_path(dir);
}

int main(void)
{
    char *dir = t_tmpdir("store-io");
    char shm[] = "/dev/shm/t-store-io-XXXXXX";
    struct stat st;
    int have_shm = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) &&
                   access("/dev/shm", W_OK) == 0 && mkdtemp(shm) != NULL;

    /* First, while this process has not written through the storage module yet: a forked
     * child inherits the parsed CKPT_FAULT_STORE state, so the children must be forked
     * before the parent's first write parses it. */
    test_faults(dir);
    if (have_shm) test_faults(shm);

    run_all(dir);
    t_rmrf(dir);
    free(dir);
    if (have_shm) { /* tmpfs: buffered, or O_DIRECT where the kernel supports it there */
        run_all(shm);
        t_rmrf(shm);
    }
    return t_done("test_store_io");
}
