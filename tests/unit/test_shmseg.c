/* The shared-memory segment of two or three slots (common/shmseg.h): layout, alternation,
 * with a slot avoided (three slots), a writer
 * SIGKILLed between begin and commit keeps the other slot as the newest complete one, torn
 * copies detected, re-create with another slot size clears, 0600, links and non-regular
 * files and bad headers refused.
 */
#include "shmseg.h"
#include "t_helpers.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

static int uniform(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

static void write_slot(shmseg *seg, int avoid, unsigned char v, uint64_t bytes, uint64_t step, int *slot)
{
    T_REQUIRE(shmseg_begin(seg, avoid, slot) == 0, "begin");
    memset(shmseg_payload(seg, *slot), v, bytes);
    T_REQUIRE(shmseg_commit(seg, *slot, bytes, step) == 0, "commit");
}

static void test_layout_alternation(const char *dir)
{
    char *p = t_path_in(dir, "seg-a");
    const uint64_t sb = 8192;
    mode_t old = umask(0);
    shmseg *s;
    T_REQUIRE(shmseg_create(p, 2, sb, &s) == 0, "create");
    umask(old);
    struct stat st;
    T_REQUIRE(stat(p, &st) == 0, "stat");
    T_CHECK((st.st_mode & 0777) == 0600, "mode %o", (unsigned)(st.st_mode & 0777));
    T_CHECK((uint64_t)st.st_size == 4096 + 2 * (4096 + sb), "size %lld", (long long)st.st_size);
    T_CHECK(shmseg_file_bytes(2, sb) == (uint64_t)st.st_size, "file_bytes");
    T_CHECK(shmseg_file_bytes(2, 4095) == 0 && shmseg_file_bytes(2, 0) == 0, "bad sizes");
    T_CHECK(shmseg_slot_bytes(s) == sb, "slot_bytes");
    unsigned char *p0 = shmseg_payload(s, 0), *p1 = shmseg_payload(s, 1);
    T_CHECK(((uintptr_t)p0 % 4096) == 0 && ((uintptr_t)p1 % 4096) == 0, "aligned");
    T_CHECK(p1 - p0 == (ptrdiff_t)(4096 + sb), "slot stride %td", p1 - p0);
    T_CHECK(shmseg_payload(s, 2) == NULL && shmseg_payload(s, -1) == NULL, "payload range");

    /* the header bytes on the file as FORMAT.md says */
    unsigned char *f;
    long long n = t_slurp(p, &f);
    T_REQUIRE(n > 0, "slurp");
    T_CHECK(memcmp(f, "CKPTSEG1", 8) == 0, "magic");
    uint32_t v32;
    uint64_t v64;
    memcpy(&v32, f + 8, 4);
    T_CHECK(v32 == 1, "version");
    memcpy(&v32, f + 12, 4);
    T_CHECK(v32 == 4096, "header_bytes");
    memcpy(&v64, f + 16, 8);
    T_CHECK(v64 == sb, "slot_bytes field");
    memcpy(&v32, f + 24, 4);
    T_CHECK(v32 == 2, "nslots");
    free(f);

    int i;
    T_CHECK(shmseg_newest(s, &i) == -ENOENT, "empty segment has no newest");
    shmseg_info in;
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.state == SHMSEG_EMPTY && in.seq == 0, "empty slot");
    T_CHECK(shmseg_commit(s, 0, 10, 1) == -EINVAL, "commit without begin");

    int a, b, c;
    write_slot(s, -1, 0x11, 5000, 7, &a);
    T_CHECK(a == 0, "first write into slot 0 (got %d)", a);
    T_CHECK(shmseg_newest(s, &i) == 0 && i == 0, "newest 0");
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.state == SHMSEG_COMPLETE && in.seq == 1 && in.step == 7 &&
                in.payload_bytes == 5000,
            "info after commit: state %u seq %llu", in.state, (unsigned long long)in.seq);
    T_CHECK(shmseg_head_ok(s, 0, &in), "head hash");
    write_slot(s, -1, 0x22, 6000, 8, &b);
    T_CHECK(b == 1, "second write into slot 1");
    T_CHECK(shmseg_newest(s, &i) == 0 && i == 1, "newest 1");
    write_slot(s, -1, 0x33, 100, 9, &c);
    T_CHECK(c == 0, "third write alternates back to slot 0");
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.seq == 3 && in.step == 9, "seq 3");
    T_CHECK(shmseg_commit(s, 0, sb + 1, 1) == -EINVAL, "payload larger than the slot");

    /* avoid: the persist in flight reads slot 1 -> slot 0 even though... and again slot 0 */
    int d;
    write_slot(s, 1, 0x44, 100, 10, &d);
    T_CHECK(d == 0, "avoid 1 writes 0");
    write_slot(s, 1, 0x55, 100, 11, &d);
    T_CHECK(d == 0, "avoid 1 writes 0 again (0 is the newest)");
    shmseg_info i1;
    T_CHECK(shmseg_slot_info(s, 1, &i1) == 0 && i1.state == SHMSEG_COMPLETE && i1.step == 8, "slot 1 kept");
    T_CHECK(uniform(shmseg_payload(s, 1), 6000, 0x22), "slot 1 bytes kept");
    T_CHECK(shmseg_begin(s, 2, &d) == -EINVAL, "avoid out of range");

    /* a flipped byte in the payload head is seen by head_ok */
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && shmseg_head_ok(s, 0, &in), "head ok");
    ((unsigned char *)shmseg_payload(s, 0))[50] ^= 1;
    T_CHECK(!shmseg_head_ok(s, 0, &in), "flipped byte in the head");
    ((unsigned char *)shmseg_payload(s, 0))[50] ^= 1;

    /* read-only open sees the same, cannot write */
    shmseg *r;
    T_REQUIRE(shmseg_open(p, 0, &r) == 0, "open ro");
    T_CHECK(!shmseg_writable(r) && shmseg_slot_bytes(r) == sb, "ro handle");
    T_CHECK(shmseg_newest(r, &i) == 0 && i == 0, "ro newest");
    T_CHECK(shmseg_begin(r, -1, &i) == -EBADF, "ro begin");
    int pf = shmseg_prefault(r, 0, 100);
    T_CHECK(pf == 0 || pf == -EOPNOTSUPP, "prefault ro: %d", pf);
    pf = shmseg_prefault(s, 1, 0);
    T_CHECK(pf == 0 || pf == -EOPNOTSUPP, "prefault rw: %d", pf);
    T_CHECK(shmseg_prefault(r, 2, 0) == -EINVAL, "prefault slot out of range");
    T_CHECK(uniform(shmseg_payload(s, 1), 6000, 0x22), "prefault changes no byte");
    unsigned char buf[100];
    uint64_t seq = 0;
    T_CHECK(shmseg_copy_out(r, 0, buf, 0, 100, &seq) == 0 && uniform(buf, 100, 0x55) && seq == 5,
            "copy_out seq %llu", (unsigned long long)seq);
    T_CHECK(shmseg_copy_out(r, 0, buf, 1, 100, &seq) == -EINVAL, "copy beyond payload_bytes");
    /* a commit between two pieces of one copy: the second piece says torn */
    uint64_t seq1 = 0;
    T_CHECK(shmseg_copy_out(r, 0, buf, 0, 50, &seq1) == 0, "first piece");
    write_slot(s, 1, 0x66, 100, 12, &d);
    T_CHECK(shmseg_copy_out(r, 0, buf, 50, 50, &seq1) == -EAGAIN, "second piece after a commit: torn");
    /* a slot being written is not copied */
    T_REQUIRE(shmseg_begin(s, 1, &d) == 0 && d == 0, "begin");
    seq = 0;
    T_CHECK(shmseg_copy_out(r, 0, buf, 0, 10, &seq) == -ENOENT, "writing slot refused");
    T_CHECK(shmseg_newest(r, &i) == 0 && i == 1, "the other slot is the newest while 0 is written");
    T_CHECK(shmseg_commit(s, 0, 100, 13) == 0, "commit");
    shmseg_close(r);

    /* re-create with the same slot size keeps the slots */
    shmseg_close(s);
    T_REQUIRE(shmseg_create(p, 2, sb, &s) == 0, "re-create same");
    T_CHECK(shmseg_newest(s, &i) == 0 && i == 0, "kept newest");
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.step == 13 && in.seq == 7, "kept info seq %llu",
            (unsigned long long)in.seq);
    /* an old mapping of the file, then re-create with another slot size: cleared, and the
     * old mapping sees empty slots instead of faulting */
    T_REQUIRE(shmseg_open(p, 0, &r) == 0, "open ro");
    shmseg_close(s);
    T_REQUIRE(shmseg_create(p, 2, 3 * 4096, &s) == 0, "re-create other size");
    T_CHECK(shmseg_newest(s, &i) == -ENOENT, "cleared");
    T_CHECK(shmseg_slot_bytes(s) == 3 * 4096, "new size");
    T_REQUIRE(stat(p, &st) == 0, "stat");
    T_CHECK((uint64_t)st.st_size == shmseg_file_bytes(2, 3 * 4096) && (st.st_mode & 0777) == 0600, "new file");
    T_CHECK(shmseg_newest(r, &i) == -ENOENT, "the old mapping sees no complete slot");
    shmseg_close(r);
    shmseg_close(s);
    free(p);
}

/* A child opens the segment at p (nslots, slot_bytes), begins a write with `avoid`, fills
 * `fill` bytes of the slot with 0xEE and is SIGKILLed there, before its commit. Returns the
 * slot it was writing, or -1. */
static int killed_mid_write(const char *p, int nslots, uint64_t slot_bytes, int avoid, size_t fill)
{
    int pfd[2];
    T_REQUIRE(pipe(pfd) == 0, "pipe");
    pid_t pid = fork();
    T_REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        shmseg *c;
        int i;
        if (shmseg_create(p, nslots, slot_bytes, &c) != 0 || shmseg_begin(c, avoid, &i) != 0) _exit(3);
        memset(shmseg_payload(c, i), 0xEE, fill);
        char x = (char)('0' + i);
        if (write(pfd[1], &x, 1) != 1) _exit(4);
        for (;;) pause();
    }
    close(pfd[1]);
    char x = 0;
    T_REQUIRE(read(pfd[0], &x, 1) == 1, "child reached the middle of its write");
    close(pfd[0]);
    kill(pid, SIGKILL);
    int wst;
    waitpid(pid, &wst, 0);
    T_CHECK(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL, "child killed");
    return x >= '0' && x <= '2' ? x - '0' : -1;
}

/* Three slots (sync mode's own segment): layout, and with a slot avoided (a disk persist
 * reads it) the writes alternate between the other two, so the newest complete payload
 * survives a crash in the middle of the next one; a torn slot is taken first; a two-slot file
 * re-created with three is rebuilt, and the other way round. */
static void test_three_slots(const char *dir)
{
    char *p = t_path_in(dir, "seg-3");
    const uint64_t sb = 8192;
    shmseg *s;
    T_REQUIRE(shmseg_create(p, 3, sb, &s) == 0, "create 3");
    struct stat st;
    T_REQUIRE(stat(p, &st) == 0, "stat");
    T_CHECK((uint64_t)st.st_size == 4096 + 3 * (4096 + sb) && shmseg_file_bytes(3, sb) == (uint64_t)st.st_size,
            "size %lld", (long long)st.st_size);
    T_CHECK(shmseg_nslots(s) == 3, "nslots %d", shmseg_nslots(s));
    unsigned char *p0 = shmseg_payload(s, 0), *p2 = shmseg_payload(s, 2);
    T_CHECK(p2 && p2 - p0 == (ptrdiff_t)(2 * (4096 + sb)) && shmseg_payload(s, 3) == NULL, "payload 2, none 3");
    unsigned char *f;
    long long n = t_slurp(p, &f);
    uint32_t v32 = 0;
    if (n > 28) memcpy(&v32, f + 24, 4);
    T_CHECK(v32 == 3, "nslots field %u", v32);
    free(f);

    /* no avoid: round robin 0, 1, 2, 0 (the oldest each time) */
    int a[4];
    for (int k = 0; k < 4; k++) write_slot(s, -1, (unsigned char)(0x10 + k), 100, (uint64_t)(20 + k), &a[k]);
    T_CHECK(a[0] == 0 && a[1] == 1 && a[2] == 2 && a[3] == 0, "round robin %d %d %d %d", a[0], a[1], a[2], a[3]);
    /* a persist reads slot 1 (step 21): the writes alternate between 0 and 2, never 1, and
     * never the newest complete */
    int w[5], prev_newest;
    T_REQUIRE(shmseg_newest(s, &prev_newest) == 0 && prev_newest == 0, "newest 0");
    for (int k = 0; k < 5; k++) {
        write_slot(s, 1, (unsigned char)(0x40 + k), 100, (uint64_t)(30 + k), &w[k]);
        T_CHECK(w[k] != 1 && w[k] != prev_newest, "write %d took slot %d (avoid 1, newest %d)", k, w[k], prev_newest);
        prev_newest = w[k];
    }
    T_CHECK(w[0] == 2 && w[1] == 0 && w[2] == 2 && w[3] == 0 && w[4] == 2, "alternation %d %d %d %d %d", w[0], w[1],
            w[2], w[3], w[4]);
    shmseg_info in;
    T_CHECK(shmseg_slot_info(s, 1, &in) == 0 && in.state == SHMSEG_COMPLETE && in.step == 21 &&
                uniform(shmseg_payload(s, 1), 100, 0x11),
            "the avoided slot kept step 21");
    T_CHECK(shmseg_begin(s, 3, &w[0]) == -EINVAL && shmseg_begin(s, -2, &w[0]) == -EINVAL, "avoid out of range");
    shmseg_close(s);

    /* a child begins the next write (avoid 1) and is killed in the middle: the newest (slot
     * 2, step 34) and the avoided (slot 1, step 21) are both still complete */
    int x = killed_mid_write(p, 3, sb, 1, 50);
    T_CHECK(x == 0, "the child wrote slot 0 (got %d)", x);
    T_REQUIRE(shmseg_create(p, 3, sb, &s) == 0, "re-create same 3: kept");
    int nw;
    T_CHECK(shmseg_newest(s, &nw) == 0 && nw == 2, "newest still slot 2 (%d)", nw);
    T_CHECK(shmseg_slot_info(s, 2, &in) == 0 && in.state == SHMSEG_COMPLETE && in.step == 34 &&
                uniform(shmseg_payload(s, 2), 100, 0x44),
            "slot 2 step 34 intact");
    T_CHECK(shmseg_slot_info(s, 1, &in) == 0 && in.state == SHMSEG_COMPLETE && in.step == 21, "slot 1 step 21");
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.state == SHMSEG_WRITING, "slot 0 left writing");
    /* the torn slot goes first, with or without avoid */
    int t;
    write_slot(s, -1, 0x77, 100, 35, &t);
    T_CHECK(t == 0, "no avoid: the torn slot 0 first (got %d)", t);
    T_REQUIRE(shmseg_begin(s, -1, &t) == 0 && t == 1, "begin 1 (the oldest)"); /* tear slot 1 */
    shmseg_close(s);
    T_REQUIRE(shmseg_create(p, 3, sb, &s) == 0, "re-create");
    write_slot(s, 2, 0x78, 100, 36, &t);
    T_CHECK(t == 1, "avoid 2: the torn slot 1 (got %d)", t);

    /* an older two-slot file at the path: rebuilt with three, its slots gone */
    shmseg_close(s);
    char *q = t_path_in(dir, "seg-2to3");
    T_REQUIRE(shmseg_create(q, 2, sb, &s) == 0, "create 2");
    write_slot(s, -1, 0x21, 100, 5, &t);
    shmseg_close(s);
    T_REQUIRE(shmseg_create(q, 3, sb, &s) == 0, "re-create with 3");
    T_CHECK(shmseg_nslots(s) == 3 && shmseg_newest(s, &t) == -ENOENT, "3 slots, empty");
    T_CHECK(stat(q, &st) == 0 && (uint64_t)st.st_size == shmseg_file_bytes(3, sb), "size of 3");
    write_slot(s, -1, 0x22, 100, 6, &t);
    shmseg_close(s);
    shmseg *r;
    T_REQUIRE(shmseg_open(q, 0, &r) == 0, "open the 3-slot file");
    T_CHECK(shmseg_nslots(r) == 3 && shmseg_newest(r, &t) == 0 && t == 0, "reader sees 3 slots");
    shmseg_close(r);
    T_REQUIRE(shmseg_create(q, 2, sb, &s) == 0, "and back to 2");
    T_CHECK(shmseg_nslots(s) == 2 && shmseg_newest(s, &t) == -ENOENT, "2 slots, empty");
    shmseg_close(s);
    free(q);
    free(p);
}

/* A child writes half a slot and is SIGKILLed before commit. */
static void test_crash_mid_write(const char *dir)
{
    char *p = t_path_in(dir, "seg-crash");
    shmseg *s;
    int a, b;
    T_REQUIRE(shmseg_create(p, 2, 65536, &s) == 0, "create");
    write_slot(s, -1, 0xA1, 65536, 100, &a);
    write_slot(s, -1, 0xA2, 65536, 101, &b);
    shmseg_close(s);
    int x = killed_mid_write(p, 2, 65536, -1, 30000);
    T_CHECK(x == 0, "the child wrote slot 0 (the older), got %d", x);

    T_REQUIRE(shmseg_open(p, 1, &s) == 0, "open after crash");
    int n;
    T_CHECK(shmseg_newest(s, &n) == 0 && n == 1, "newest is the other slot");
    shmseg_info in;
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.state == SHMSEG_WRITING, "slot 0 left writing");
    T_CHECK(shmseg_slot_info(s, 1, &in) == 0 && in.state == SHMSEG_COMPLETE && in.step == 101, "slot 1 step 101");
    T_CHECK(shmseg_head_ok(s, 1, &in) && uniform(shmseg_payload(s, 1), 65536, 0xA2), "slot 1 bytes intact");
    uint64_t seq = 0;
    unsigned char buf[16];
    T_CHECK(shmseg_copy_out(s, 0, buf, 0, 16, &seq) == -ENOENT, "the writing slot is never copied");
    int w;
    T_CHECK(shmseg_begin(s, -1, &w) == 0 && w == 0, "the next write takes the abandoned slot");
    T_CHECK(shmseg_commit(s, 0, 10, 102) == 0, "commit");
    T_CHECK(shmseg_newest(s, &n) == 0 && n == 0, "newest 0 after the retry");
    T_CHECK(shmseg_slot_info(s, 0, &in) == 0 && in.seq == 3, "seq continues");
    shmseg_close(s);
    free(p);
}

struct churn {
    shmseg *seg;
    atomic_int stop;
    uint64_t commits;
};

/* Rewrites slot 0 over and over (avoid 1), each time with one byte value. */
static void *churn_main(void *arg)
{
    struct churn *c = arg;
    unsigned char v = 1;
    while (!atomic_load(&c->stop)) {
        int i;
        if (shmseg_begin(c->seg, 1, &i) != 0) break;
        memset(shmseg_payload(c->seg, i), v, shmseg_slot_bytes(c->seg));
        if (shmseg_commit(c->seg, i, shmseg_slot_bytes(c->seg), v) != 0) break;
        c->commits++;
        v = (unsigned char)(v == 255 ? 1 : v + 1);
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void test_torn_copy(const char *dir)
{
    char *p = t_path_in(dir, "seg-torn");
    const uint64_t sb = 1 << 20;
    struct churn c = {0};
    T_REQUIRE(shmseg_create(p, 2, sb, &c.seg) == 0, "create");
    int i;
    write_slot(c.seg, -1, 0, sb, 0, &i);
    shmseg *r;
    T_REQUIRE(shmseg_open(p, 0, &r) == 0, "open");
    unsigned char *buf = malloc(sb);
    T_REQUIRE(buf, "malloc");
    pthread_t th;
    T_REQUIRE(pthread_create(&th, NULL, churn_main, &c) == 0, "thread");
    long ok = 0, torn = 0, busy = 0, bad = 0;
    double t0 = t_now_s();
    while (t_now_s() - t0 < 10 && (ok < 20 || torn < 3)) {
        uint64_t seq = 0;
        int rc = shmseg_copy_out(r, 0, buf, 0, sb, &seq);
        if (rc == 0) {
            ok++;
            if (!uniform(buf, sb, buf[0])) bad++;
        } else if (rc == -EAGAIN) {
            torn++;
        } else if (rc == -ENOENT) {
            busy++;
        } else {
            bad++;
        }
    }
    atomic_store(&c.stop, 1);
    pthread_join(th, NULL);
    printf("torn copy: %ld whole, %ld torn, %ld writing, %llu commits\n", ok, torn, busy,
           (unsigned long long)c.commits);
    T_CHECK(bad == 0, "%ld copies reported whole were mixed", bad);
    T_CHECK(ok > 0, "some copies whole");
    T_CHECK(torn > 0, "some copies torn and detected");
    free(buf);
    shmseg_close(r);
    shmseg_close(c.seg);
    free(p);
}

static void test_refusals(const char *dir)
{
    shmseg *s = NULL;
    char *target = t_path_in(dir, "target");
    char *link = t_path_in(dir, "link");
    T_REQUIRE(symlink(target, link) == 0, "symlink");
    T_CHECK(shmseg_create(link, 2, 4096, &s) == -EPERM && s == NULL, "create through a symlink refused");
    T_CHECK(!t_exists(target), "the link's target was not created");
    T_CHECK(shmseg_open(link, 0, &s) == -EPERM, "open of a dangling symlink refused");
    /* a link to a real segment: still refused */
    T_REQUIRE(shmseg_create(target, 2, 4096, &s) == 0, "create target");
    shmseg_close(s);
    T_CHECK(shmseg_open(link, 0, &s) == -EPERM, "open through a symlink refused");
    T_CHECK(shmseg_create(link, 2, 4096, &s) == -EPERM, "create through a symlink to a segment refused");

    char *sub = t_path_in(dir, "subdir");
    T_REQUIRE(mkdir(sub, 0700) == 0, "mkdir");
    T_CHECK(shmseg_create(sub, 2, 4096, &s) == -EPERM, "directory refused");
    char *fifo = t_path_in(dir, "fifo");
    T_REQUIRE(mkfifo(fifo, 0600) == 0, "mkfifo");
    T_CHECK(shmseg_create(fifo, 2, 4096, &s) == -EPERM, "fifo refused");
    T_CHECK(shmseg_open(fifo, 1, &s) == -EPERM, "fifo open refused");

    char *none = t_path_in(dir, "none");
    T_CHECK(shmseg_open(none, 0, &s) == -ENOENT, "missing");
    T_CHECK(shmseg_create(none, 2, 1000, &s) == -EINVAL, "slot size not a page multiple");
    T_CHECK(!t_exists(none), "nothing created for a bad size");

    /* an existing file with a wider mode is made 0600 */
    char *wide = t_path_in(dir, "wide");
    T_REQUIRE(t_spit(wide, "", 0) == 0 && chmod(wide, 0644) == 0, "wide file");
    T_REQUIRE(shmseg_create(wide, 2, 4096, &s) == 0, "create over a 0644 file");
    shmseg_close(s);
    struct stat st;
    T_CHECK(stat(wide, &st) == 0 && (st.st_mode & 0777) == 0600, "chmod 0600");

    /* headers: garbage, wrong size, newer version */
    char *junk = t_path_in(dir, "junk");
    unsigned char page[8192];
    memset(page, 'x', sizeof page);
    T_REQUIRE(t_spit(junk, page, sizeof page) == 0, "junk");
    T_CHECK(shmseg_open(junk, 0, &s) == -EBADMSG, "garbage refused");
    unsigned char *f;
    long long n = t_slurp(target, &f);
    T_REQUIRE(n > 0, "slurp");
    T_REQUIRE(t_spit(junk, f, (size_t)n - 4096) == 0, "short copy");
    T_CHECK(shmseg_open(junk, 0, &s) == -EBADMSG, "wrong size refused");
    f[8] = 2;
    T_REQUIRE(t_spit(junk, f, (size_t)n) == 0, "v2 copy");
    T_CHECK(shmseg_open(junk, 0, &s) == -EPROTONOSUPPORT, "newer version refused");
    f[8] = 1;
    f[24] = 3; /* a valid nslots, but the file is the size of two */
    T_REQUIRE(t_spit(junk, f, (size_t)n) == 0, "nslots 3");
    T_CHECK(shmseg_open(junk, 0, &s) == -EBADMSG, "nslots 3 with the size of 2 refused");
    f[24] = 1;
    T_REQUIRE(t_spit(junk, f, (size_t)n) == 0, "nslots 1");
    T_CHECK(shmseg_open(junk, 0, &s) == -EBADMSG, "nslots 1 refused");
    f[24] = 4;
    T_REQUIRE(t_spit(junk, f, (size_t)n) == 0, "nslots 4");
    T_CHECK(shmseg_open(junk, 0, &s) == -EBADMSG, "nslots 4 refused");
    free(f);
    T_CHECK(shmseg_create(none, 1, 4096, &s) == -EINVAL && shmseg_create(none, 4, 4096, &s) == -EINVAL &&
                !t_exists(none),
            "create with 1 or 4 slots refused, nothing created");
    T_CHECK(shmseg_file_bytes(1, 4096) == 0 && shmseg_file_bytes(4, 4096) == 0 && shmseg_nslots(NULL) == 0,
            "file_bytes of 1 or 4 slots");
    /* re-create over garbage builds a fresh layout */
    T_CHECK(shmseg_create(junk, 2, 4096, &s) == 0, "create over garbage");
    int i;
    T_CHECK(s && shmseg_newest(s, &i) == -ENOENT, "fresh");
    shmseg_close(s);

    if (geteuid() == 0) {
        char *other = t_path_in(dir, "other-uid");
        T_REQUIRE(shmseg_create(other, 2, 4096, &s) == 0, "create");
        shmseg_close(s);
        T_REQUIRE(chown(other, 65534, 65534) == 0, "chown");
        T_CHECK(shmseg_open(other, 0, &s) == -EPERM, "another uid's segment refused (open)");
        T_CHECK(shmseg_create(other, 2, 4096, &s) == -EPERM, "another uid's segment refused (create)");
        free(other);
    } else {
        printf("other-uid check skipped (not root)\n");
    }
    free(target);
    free(link);
    free(sub);
    free(fifo);
    free(none);
    free(wide);
    free(junk);
}

/* One writer per segment: shmseg_create holds an exclusive flock until shmseg_close. */
static void test_one_writer(const char *dir)
{
    char *p = t_path_in(dir, "seg-lock");
    shmseg *s, *s2 = (shmseg *)1, *r;
    int a;
    T_REQUIRE(shmseg_create(p, 2, 8192, &s) == 0, "create");
    write_slot(s, -1, 0x33, 100, 5, &a);
    T_CHECK(shmseg_create(p, 2, 8192, &s2) == -EBUSY && s2 == NULL, "a second writer (same process) refused");
    T_CHECK(shmseg_create(p, 2, 4096, &s2) == -EBUSY, "a second writer with another layout refused");
    T_CHECK(shmseg_slot_bytes(s) == 8192 && shmseg_newest(s, &a) == 0 && a == 0, "nothing changed by them");
    pid_t pid = fork();
    T_REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        shmseg *c;
        _exit(shmseg_create(p, 2, 8192, &c) == -EBUSY ? 0 : 1);
    }
    int wst;
    waitpid(pid, &wst, 0);
    T_CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "a second writer (another process) refused");
    T_REQUIRE(shmseg_open(p, 0, &r) == 0, "a reader takes no lock");
    shmseg_close(s);
    T_REQUIRE(shmseg_create(p, 2, 8192, &s) == 0, "create again after close");
    T_CHECK(shmseg_newest(s, &a) == 0 && a == 0, "kept slots");
    shmseg_close(s);
    shmseg_close(r);
    free(p);
}

static void test_names(void)
{
    char b[64];
    T_CHECK(shmseg_own_path(b, sizeof b, "/dev/shm/ckptmem-a-b", 3) == 0 && !strcmp(b, "/dev/shm/ckptmem-a-b.own-3"),
            "own name %s", b);
    T_CHECK(shmseg_rep_path(b, sizeof b, "/dev/shm/ckptmem-a-b", 0x12ab, 0) == 0 &&
                !strcmp(b, "/dev/shm/ckptmem-a-b.rep-00000000000012ab-0"),
            "rep name %s", b);
    T_CHECK(shmseg_own_path(b, 10, "/dev/shm/ckptmem-a-b", 3) == -ENAMETOOLONG, "too long");
    T_CHECK(shmseg_rep_path(NULL, 10, "x", 1, 1) == -EINVAL, "NULL");
}

int main(void)
{
    test_names();
    char *dir = t_tmpdir("shmseg");
    test_layout_alternation(dir);
    test_crash_mid_write(dir);
    test_three_slots(dir);
    test_torn_copy(dir);
    test_refusals(dir);
    test_one_writer(dir);
    t_rmrf(dir);
    free(dir);
    return t_done("test_shmseg");
}
