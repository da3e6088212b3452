/* test_device.c - the device layer (train/device.h).
 *
 * CPU kind: memory (zeroed, aligned), synchronous copies of every kind, worker streams that
 * really are asynchronous (a host function holds the worker on a gate: the event after a copy
 * stays pending and the destination unchanged until the gate opens), FIFO order, cross-stream
 * waits (worker and compute stream), re-recording moving the mark, bounded waits
 * (-ETIMEDOUT, then success), events never recorded (-EINVAL), sticky errors (an injected
 * failure, an event wait passing its bound, propagation through a waited-for event),
 * registered ranges, destroy with queued work (drained; and abandoned at its timeout), and
 * many threads waiting on one event (run under TSan too). CUDA kind: without a GPU, count and
 * open fail with -ENODEV and a reason naming cudaGetDeviceCount (-ENOTSUP when the build has no
 * CUDA); with a GPU, a short smoke test of the same operations.
 */
#include "config.h"
#include "device.h"
#include "device_internal.h"
#include "t_helpers.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* A host function that holds a worker until the test opens the gate (30 s at most, so that a
 * broken layer fails the test instead of hanging it). Gates are static: an abandoned worker
 * may still be inside one after its test returned. */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open, entered, left;
} gate;

static void gate_init(gate *g)
{
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->open = g->entered = g->left = 0;
}

static void gate_fn(void *arg)
{
    gate *g = arg;
    pthread_mutex_lock(&g->mu);
    g->entered++;
    pthread_cond_broadcast(&g->cv);
    double end = t_now_s() + 30;
    while (!g->open && t_now_s() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
    }
    g->left++;
    pthread_mutex_unlock(&g->mu);
}

static void gate_open(gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static int gate_get(gate *g, const int *field)
{
    pthread_mutex_lock(&g->mu);
    int v = *field;
    pthread_mutex_unlock(&g->mu);
    return v;
}

/* Wait (5 s at most) until a worker is inside the gate. */
static int gate_wait_entered(gate *g)
{
    double end = t_now_s() + 5;
    while (!gate_get(g, &g->entered) && t_now_s() < end)
        t_sleep_s(0.001);
    return gate_get(g, &g->entered);
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(seed * 131u + i * 7u + 1u);
}

static int all_zero(const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static train_device *open_cpu(void)
{
    train_device *d = NULL;
    char why[256];
    int rc = train_device_open(&d, TRAIN_DEVICE_CPU, 0, why, sizeof why);
    T_REQUIRE(rc == 0 && d, "open cpu: %d %s", rc, why);
    return d;
}

static void test_parse(void)
{
    train_device_kind k = TRAIN_DEVICE_CUDA;
    int ord = -1;
    T_CHECK(train_device_parse("cpu", &k, &ord) == 0 && k == TRAIN_DEVICE_CPU && ord == 0, "cpu");
    T_CHECK(train_device_parse("cuda", &k, &ord) == 0 && k == TRAIN_DEVICE_CUDA && ord == 0, "cuda");
    T_CHECK(train_device_parse("cuda:1", &k, &ord) == 0 && k == TRAIN_DEVICE_CUDA && ord == 1,
            "cuda:1");
    T_CHECK(train_device_parse("cuda:12", &k, &ord) == 0 && ord == 12, "cuda:12");
    T_CHECK(train_device_parse("cuda:0", &k, NULL) == 0, "ordinal may be NULL");
    static const char *bad[] = {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:1x", "cuda: 1",
                                "cudax", "cpu:0", "cuda:99999999999", " cuda", "cuda1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        k = TRAIN_DEVICE_CPU;
        ord = 7;
        T_CHECK(train_device_parse(bad[i], &k, &ord) == -EINVAL, "'%s' refused", bad[i]);
        T_CHECK(k == TRAIN_DEVICE_CPU && ord == 7, "'%s' leaves the outputs alone", bad[i]);
    }
    T_CHECK(train_device_parse(NULL, &k, &ord) == -EINVAL, "NULL text");
    T_CHECK(train_device_parse("cpu", NULL, &ord) == -EINVAL, "NULL kind");
}

static void test_cpu_memory_and_sync_copies(void)
{
    T_CHECK(train_device_count(TRAIN_DEVICE_CPU) == 1, "one cpu device");
    train_device *d = NULL;
    char why[256] = "";
    T_CHECK(train_device_open(&d, TRAIN_DEVICE_CPU, 1, why, sizeof why) == -ENODEV && !d &&
                strstr(why, "cpu"),
            "cpu ordinal 1: %s", why);
    T_CHECK(train_device_open(&d, TRAIN_DEVICE_CPU, -1, NULL, 0) == -EINVAL, "ordinal -1");
    T_CHECK(train_device_open(NULL, TRAIN_DEVICE_CPU, 0, NULL, 0) == -EINVAL, "NULL out");
    T_CHECK(train_device_open(&d, (train_device_kind)7, 0, NULL, 0) == -EINVAL, "bad kind");
    d = open_cpu();
    T_CHECK(train_device_kind_of(d) == TRAIN_DEVICE_CPU, "kind");
    T_CHECK(strcmp(train_device_describe(d), "cpu") == 0, "describe: %s", train_device_describe(d));
    T_CHECK(train_device_compute_stream(d) != NULL, "compute stream");
    T_CHECK(train_stream_native(train_device_compute_stream(d)) == NULL, "no native handle");

    static const size_t sizes[] = {1, 3, 255, 4096, 1 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        void *a = NULL, *h = NULL;
        T_REQUIRE(train_device_alloc(d, &a, n) == 0 && a, "alloc %zu", n);
        T_CHECK((uintptr_t)a % 256 == 0, "device memory aligned to 256 (%p)", a);
        T_CHECK(all_zero(a, n), "device memory zeroed (%zu)", n);
        T_REQUIRE(train_host_alloc_pinned(d, &h, n) == 0 && h, "pinned %zu", n);
        T_CHECK((uintptr_t)h % 64 == 0, "pinned memory aligned to 64 (%p)", h);
        T_CHECK(all_zero(h, n), "pinned memory zeroed (%zu)", n);
        memset(a, 0xab, n);
        memset(h, 0xcd, n);
        train_device_free(d, a);
        train_host_free_pinned(d, h);
    }
    void *p = (void *)1;
    T_CHECK(train_device_alloc(d, &p, 0) == -EINVAL && p == (void *)1, "alloc 0");
    T_CHECK(train_host_alloc_pinned(d, &p, 0) == -EINVAL, "pinned 0");
    T_CHECK(train_device_alloc(d, NULL, 8) == -EINVAL, "alloc NULL out");
    train_device_free(d, NULL);
    train_host_free_pinned(d, NULL);

    const size_t n = 10007;
    unsigned char *host = malloc(n), *back = malloc(n);
    void *dev1 = NULL, *dev2 = NULL;
    T_REQUIRE(host && back, "malloc");
    T_REQUIRE(train_device_alloc(d, &dev1, n) == 0 && train_device_alloc(d, &dev2, n) == 0, "alloc");
    fill(host, n, 3);
    T_CHECK(train_device_copy(d, dev1, host, n, TRAIN_COPY_H2D) == 0, "H2D");
    T_CHECK(train_device_copy(d, dev2, dev1, n, TRAIN_COPY_D2D) == 0, "D2D");
    T_CHECK(train_device_copy(d, back, dev2, n, TRAIN_COPY_D2H) == 0, "D2H");
    T_CHECK(memcmp(back, host, n) == 0, "H2D, D2D, D2H round trip");
    memset(back, 0, n);
    T_CHECK(train_device_copy(d, back, host, n, TRAIN_COPY_H2H) == 0 && memcmp(back, host, n) == 0,
            "H2H");
    T_CHECK(train_device_zero(d, dev1, n) == 0 && all_zero(dev1, n), "zero");
    T_CHECK(train_device_zero(d, NULL, 0) == 0, "zero of 0 bytes");
    T_CHECK(train_device_zero(d, NULL, 5) == -EINVAL, "zero NULL");
    T_CHECK(train_device_copy(d, NULL, NULL, 0, TRAIN_COPY_H2D) == 0, "copy of 0 bytes");
    T_CHECK(train_device_copy(d, NULL, host, 5, TRAIN_COPY_H2D) == -EINVAL, "copy to NULL");
    T_CHECK(train_device_copy(d, back, host, 5, (train_copy_kind)9) == -EINVAL, "bad copy kind");
    T_CHECK(train_device_copy(NULL, back, host, 5, TRAIN_COPY_H2H) == -EINVAL, "NULL device");

    /* the compute stream is synchronous: its work is done when the call returns */
    train_stream *cs = train_device_compute_stream(d);
    train_event *e = NULL;
    T_REQUIRE(train_event_create(d, &e) == 0 && e, "event");
    memset(back, 0, n);
    T_CHECK(train_stream_copy_async(cs, back, host, n, TRAIN_COPY_D2H) == 0, "async on compute");
    T_CHECK(memcmp(back, host, n) == 0, "done at once on the compute stream");
    T_CHECK(train_event_record(e, NULL) == 0 && train_event_query(e) == 1,
            "an event on the compute stream is complete at once");
    T_CHECK(train_stream_sync(cs, 0) == 0, "compute stream sync");
    T_CHECK(train_stream_destroy(cs, 1) == -EINVAL, "the compute stream is the device's");
    T_CHECK(train_stream_sync(cs, -1) == -EINVAL && train_stream_sync(cs, NAN) == -EINVAL,
            "bad timeouts");
    train_event_destroy(e);
    train_event_destroy(NULL);
    T_CHECK(train_stream_destroy(NULL, 1) == 0, "destroy NULL");
    train_device_free(d, dev1);
    train_device_free(d, dev2);
    free(host);
    free(back);
    train_device_close(d);
    train_device_close(NULL);
}

static gate g_async;

static void test_async_is_async(void)
{
    train_device *d = open_cpu();
    train_stream *s = NULL;
    train_event *e = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0 && s, "stream");
    T_REQUIRE(train_event_create(d, &e) == 0, "event");
    const size_t n = 1 << 16;
    unsigned char *src = NULL, *dst = NULL;
    T_REQUIRE(train_host_alloc_pinned(d, (void **)&src, n) == 0, "src");
    T_REQUIRE(train_device_alloc(d, (void **)&dst, n) == 0, "dst");
    fill(src, n, 11);

    gate_init(&g_async);
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_async) == 0, "host fn");
    T_CHECK(train_stream_copy_async(s, dst, src, n, TRAIN_COPY_H2D) == 0, "copy queued");
    T_CHECK(train_event_record(e, s) == 0, "record");
    T_CHECK(gate_wait_entered(&g_async), "the worker reached the gate");
    T_CHECK(train_event_query(e) == 0, "event pending behind the gate");
    t_sleep_s(0.05);
    T_CHECK(train_event_query(e) == 0, "still pending 50 ms later");
    T_CHECK(all_zero(dst, n), "destination untouched while the worker is held");
    double t0 = t_now_s();
    T_CHECK(train_event_wait(e, 0.1) == -ETIMEDOUT, "event wait times out");
    T_CHECK(train_stream_sync(s, 0.1) == -ETIMEDOUT, "stream sync times out");
    double waited = t_now_s() - t0;
    T_CHECK(waited >= 0.19 && waited < 5, "the two waits took their bounds (%.3f s)", waited);
    T_CHECK(train_event_wait(e, 0) == -ETIMEDOUT, "a zero timeout only looks");
    gate_open(&g_async);
    T_CHECK(train_event_wait(e, 10) == 0, "complete once the gate opens");
    T_CHECK(train_event_query(e) == 1, "query says complete");
    T_CHECK(memcmp(dst, src, n) == 0, "bytes in place after the event");
    T_CHECK(train_stream_sync(s, 10) == 0, "sync");
    T_CHECK(train_stream_copy_async(s, dst, src, 0, TRAIN_COPY_H2D) == 0, "0 bytes");
    T_CHECK(train_stream_copy_async(s, NULL, src, 8, TRAIN_COPY_H2D) == -EINVAL, "NULL dst");
    T_CHECK(train_stream_copy_async(s, dst, src, 8, (train_copy_kind)-1) == -EINVAL, "bad kind");
    T_CHECK(train_stream_host_fn(s, NULL, NULL) == -EINVAL, "NULL fn");
    T_CHECK(train_stream_destroy(s, 10) == 0, "destroy");
    train_event_destroy(e);
    train_device_free(d, dst);
    train_host_free_pinned(d, src);
    train_device_close(d);
}

typedef struct order_log {
    int seen[2000];
    int count;
} order_log;

typedef struct order_arg {
    order_log *log;
    int id;
} order_arg;

static void order_fn(void *arg)
{
    order_arg *a = arg;
    a->log->seen[a->log->count++] = a->id; /* only the one worker touches it */
}

static void test_fifo(void)
{
    train_device *d = open_cpu();
    train_stream *s = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0, "stream");
    /* a chain of dependent copies: buf[i+1] <- buf[i]; correct only in queue order */
    enum { CHAIN = 300, N = 4096 };
    unsigned char *buf[CHAIN];
    for (int i = 0; i < CHAIN; i++)
        T_REQUIRE(train_device_alloc(d, (void **)&buf[i], N) == 0, "alloc");
    fill(buf[0], N, 5);
    static order_log log;
    static order_arg args[CHAIN];
    log.count = 0;
    for (int i = 0; i + 1 < CHAIN; i++) {
        T_CHECK(train_stream_copy_async(s, buf[i + 1], buf[i], N, TRAIN_COPY_D2D) == 0, "copy %d", i);
        args[i] = (order_arg){&log, i};
        T_CHECK(train_stream_host_fn(s, order_fn, &args[i]) == 0, "fn %d", i);
    }
    T_CHECK(train_stream_sync(s, 30) == 0, "sync");
    T_CHECK(memcmp(buf[CHAIN - 1], buf[0], N) == 0, "the chain carried the bytes to the end");
    T_CHECK(log.count == CHAIN - 1, "every host fn ran (%d)", log.count);
    int in_order = 1;
    for (int i = 0; i < log.count; i++)
        if (log.seen[i] != i) in_order = 0;
    T_CHECK(in_order, "host fns ran in queue order");

    /* many copies into one place: the last one queued wins */
    static unsigned char srcs[64][256];
    unsigned char *one = buf[1];
    for (int i = 0; i < 64; i++) {
        fill(srcs[i], 256, 100 + (unsigned)i);
        T_CHECK(train_stream_copy_async(s, one, srcs[i], 256, TRAIN_COPY_H2D) == 0, "copy");
    }
    T_CHECK(train_stream_sync(s, 30) == 0, "sync");
    T_CHECK(memcmp(one, srcs[63], 256) == 0, "the last copy queued is the last done");
    T_CHECK(train_stream_destroy(s, 10) == 0, "destroy");
    for (int i = 0; i < CHAIN; i++)
        train_device_free(d, buf[i]);
    train_device_close(d);
}

static gate g_cross, g_cross2;

typedef struct opener {
    gate *g;
    double after_s;
} opener;

static void *open_later(void *arg)
{
    opener *o = arg;
    t_sleep_s(o->after_s);
    gate_open(o->g);
    return NULL;
}

static void test_cross_stream(void)
{
    train_device *d = open_cpu();
    train_stream *a = NULL, *b = NULL;
    train_event *ea = NULL, *eb = NULL;
    T_REQUIRE(train_stream_create(d, &a) == 0 && train_stream_create(d, &b) == 0, "streams");
    T_REQUIRE(train_event_create(d, &ea) == 0 && train_event_create(d, &eb) == 0, "events");
    const size_t n = 8192;
    unsigned char *src, *mid, *dst;
    T_REQUIRE(train_host_alloc_pinned(d, (void **)&src, n) == 0, "src");
    T_REQUIRE(train_device_alloc(d, (void **)&mid, n) == 0, "mid");
    T_REQUIRE(train_host_alloc_pinned(d, (void **)&dst, n) == 0, "dst");
    fill(src, n, 21);

    gate_init(&g_cross);
    T_CHECK(train_stream_host_fn(a, gate_fn, &g_cross) == 0, "gate on a");
    T_CHECK(train_stream_copy_async(a, mid, src, n, TRAIN_COPY_H2D) == 0, "a: src -> mid");
    T_CHECK(train_event_record(ea, a) == 0, "record ea");
    T_CHECK(train_stream_wait_event(b, ea) == 0, "b waits for ea");
    T_CHECK(train_stream_copy_async(b, dst, mid, n, TRAIN_COPY_D2H) == 0, "b: mid -> dst");
    T_CHECK(train_event_record(eb, b) == 0, "record eb");
    T_CHECK(gate_wait_entered(&g_cross), "a at the gate");
    t_sleep_s(0.05);
    T_CHECK(train_event_query(eb) == 0, "b held by its wait on a");
    T_CHECK(all_zero(dst, n) && all_zero(mid, n), "nothing copied yet");
    gate_open(&g_cross);
    T_CHECK(train_event_wait(eb, 10) == 0, "eb completes");
    T_CHECK(train_event_query(ea) == 1, "ea before eb");
    T_CHECK(memcmp(dst, src, n) == 0, "b copied what a had put there");

    /* the compute stream's wait blocks the caller until the event completes */
    gate_init(&g_cross2);
    T_CHECK(train_stream_host_fn(a, gate_fn, &g_cross2) == 0, "gate on a");
    T_CHECK(train_event_record(ea, a) == 0, "re-record ea");
    pthread_t th;
    opener o = {&g_cross2, 0.15};
    T_REQUIRE(pthread_create(&th, NULL, open_later, &o) == 0, "thread");
    double t0 = t_now_s();
    T_CHECK(train_stream_wait_event(train_device_compute_stream(d), ea) == 0, "compute waits");
    double waited = t_now_s() - t0;
    T_CHECK(waited >= 0.1, "the compute stream's wait blocked until a got there (%.3f s)", waited);
    T_CHECK(train_event_query(ea) == 1, "ea complete after the compute stream's wait");
    pthread_join(th, NULL);

    T_CHECK(train_stream_destroy(a, 10) == 0 && train_stream_destroy(b, 10) == 0, "destroy");
    train_event_destroy(ea);
    train_event_destroy(eb);
    train_host_free_pinned(d, src);
    train_host_free_pinned(d, dst);
    train_device_free(d, mid);
    train_device_close(d);
}

static gate g_rec1, g_rec2;

static void test_rerecord_and_never_recorded(void)
{
    train_device *d = open_cpu();
    train_stream *s = NULL, *s2 = NULL;
    train_event *e = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0 && train_stream_create(d, &s2) == 0, "streams");
    T_REQUIRE(train_event_create(d, &e) == 0, "event");
    T_CHECK(train_event_query(e) == -EINVAL, "query never recorded");
    T_CHECK(train_event_wait(e, 1) == -EINVAL, "wait never recorded");
    T_CHECK(train_stream_wait_event(s, e) == -EINVAL, "stream wait never recorded");
    T_CHECK(train_stream_wait_event(train_device_compute_stream(d), e) == -EINVAL,
            "compute wait never recorded");

    gate_init(&g_rec1);
    gate_init(&g_rec2);
    T_CHECK(train_event_record(e, s) == 0, "record on an idle stream");
    T_CHECK(train_event_wait(e, 10) == 0, "complete");
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_rec1) == 0, "gate");
    T_CHECK(train_event_record(e, s) == 0, "record again behind the gate");
    T_CHECK(train_event_query(e) == 0, "the mark moved: pending again");
    gate_open(&g_rec1);
    T_CHECK(train_event_wait(e, 10) == 0, "complete at the new mark");
    T_CHECK(train_stream_host_fn(s2, gate_fn, &g_rec2) == 0, "gate on another stream");
    T_CHECK(train_event_record(e, s2) == 0, "record on the other stream");
    T_CHECK(train_event_query(e) == 0, "pending on the other stream");
    gate_open(&g_rec2);
    T_CHECK(train_event_wait(e, 10) == 0 && train_event_query(e) == 1, "complete there too");
    T_CHECK(train_stream_destroy(s, 10) == 0 && train_stream_destroy(s2, 10) == 0, "destroy");
    train_event_destroy(e);
    train_device_close(d);
}

static gate g_err, g_bound;

static void test_sticky_errors(void)
{
    train_device *d = open_cpu();
    train_stream *s = NULL, *w = NULL;
    train_event *e = NULL, *ew = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0 && train_stream_create(d, &w) == 0, "streams");
    T_REQUIRE(train_event_create(d, &e) == 0 && train_event_create(d, &ew) == 0, "events");
    unsigned char src[512], dst[512];
    fill(src, sizeof src, 9);
    memset(dst, 0, sizeof dst);

    gate_init(&g_err);
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_err) == 0, "gate");
    T_CHECK(train_stream_cpu_inject_error(s, -EIO) == 0, "a failure queued");
    T_CHECK(train_stream_copy_async(s, dst, src, sizeof dst, TRAIN_COPY_H2H) == 0,
            "a copy queued after it (the stream has not failed yet)");
    T_CHECK(train_event_record(e, s) == 0, "record");
    T_CHECK(train_stream_wait_event(w, e) == 0, "another stream waits for it");
    T_CHECK(train_event_record(ew, w) == 0, "record on the waiting stream");
    T_CHECK(train_event_query(e) == 0, "pending behind the gate");
    gate_open(&g_err);
    T_CHECK(train_stream_sync(s, 10) == -EIO, "sync returns the failure");
    T_CHECK(train_event_query(e) == -EIO, "the event after it failed");
    T_CHECK(train_event_wait(e, 1) == -EIO, "wait says so too");
    T_CHECK(all_zero(dst, sizeof dst), "the copy after the failure was skipped");
    T_CHECK(train_stream_copy_async(s, dst, src, sizeof dst, TRAIN_COPY_H2H) == -EIO,
            "a failed stream refuses copies");
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_err) == -EIO, "and host fns");
    T_CHECK(train_event_record(e, s) == -EIO && train_event_query(e) == -EIO, "and events");
    T_CHECK(train_stream_sync(w, 10) == -EIO, "the failure went through the wait to w");
    T_CHECK(train_event_wait(ew, 1) == -EIO, "and to w's event");
    T_CHECK(train_stream_cpu_inject_error(train_device_compute_stream(d), -EIO) == -EINVAL,
            "no injection on the compute stream");
    T_CHECK(train_stream_cpu_inject_error(s, 5) == -EINVAL, "a positive error is no error");
    T_CHECK(train_stream_destroy(s, 10) == -EIO, "destroy returns the sticky error");
    T_CHECK(train_stream_destroy(w, 10) == -EIO, "destroy of w too");
    train_event_destroy(e);
    train_event_destroy(ew);

    /* a cross-stream wait that passes its bound fails the waiting stream */
    train_stream *held = NULL, *waiter = NULL;
    train_event *eh = NULL;
    T_REQUIRE(train_device_cpu_set_wait_bound(d, 0.2) == 0, "bound");
    T_CHECK(train_device_cpu_set_wait_bound(d, 0) == -EINVAL, "bound 0");
    T_REQUIRE(train_stream_create(d, &held) == 0 && train_stream_create(d, &waiter) == 0, "streams");
    T_REQUIRE(train_event_create(d, &eh) == 0, "event");
    gate_init(&g_bound);
    T_CHECK(train_stream_host_fn(held, gate_fn, &g_bound) == 0, "gate");
    T_CHECK(train_event_record(eh, held) == 0, "record behind the gate");
    T_CHECK(train_stream_wait_event(waiter, eh) == 0, "wait queued");
    double t0 = t_now_s();
    T_CHECK(train_stream_sync(waiter, 10) == -ETIMEDOUT, "the waiter failed at its bound");
    double took = t_now_s() - t0;
    T_CHECK(took >= 0.15 && took < 5, "after about 0.2 s (%.3f s)", took);
    T_CHECK(train_stream_sync(waiter, 10) == -ETIMEDOUT, "sticky");
    t0 = t_now_s();
    T_CHECK(train_stream_wait_event(train_device_compute_stream(d), eh) == -ETIMEDOUT,
            "the compute stream's wait has the bound too");
    took = t_now_s() - t0;
    T_CHECK(took >= 0.15 && took < 5, "after about 0.2 s (%.3f s)", took);
    T_CHECK(train_device_copy(d, dst, src, 8, TRAIN_COPY_H2H) == -ETIMEDOUT,
            "the failed compute stream fails the synchronous copies");
    gate_open(&g_bound);
    T_CHECK(train_event_wait(eh, 10) == 0, "the held stream itself is fine");
    T_CHECK(train_stream_destroy(held, 10) == 0, "destroy held");
    T_CHECK(train_stream_destroy(waiter, 10) == -ETIMEDOUT, "destroy waiter");
    train_event_destroy(eh);
    train_device_close(d);
}

static void test_register(void)
{
    train_device *d = open_cpu();
    static char area[1 << 16];
    T_CHECK(train_host_register(d, area, sizeof area / 2) == 0, "register");
    T_CHECK(train_host_register(d, area + 100, 10) == -EINVAL, "inside a registered range");
    T_CHECK(train_host_register(d, area, 10) == -EINVAL, "the same start again");
    T_CHECK(train_host_register(d, area + sizeof area / 2 - 1, 10) == -EINVAL, "overlapping end");
    T_CHECK(train_host_register(d, area + sizeof area / 2, sizeof area / 2) == 0,
            "the adjacent range");
    T_CHECK(train_host_register(d, NULL, 10) == -EINVAL, "NULL");
    T_CHECK(train_host_register(d, area, 0) == -EINVAL, "0 bytes");
    T_CHECK(train_host_register(d, (void *)(UINTPTR_MAX - 10), 100) == -EINVAL, "wrapping range");
    static char other[64];
    T_CHECK(train_host_unregister(d, other) == -EINVAL, "unknown pointer");
    T_CHECK(train_host_unregister(d, area + 1) == -EINVAL, "not the start of a range");
    T_CHECK(train_host_unregister(d, NULL) == -EINVAL, "NULL");
    T_CHECK(train_host_unregister(d, area) == 0, "unregister");
    T_CHECK(train_host_unregister(d, area) == -EINVAL, "twice");
    T_CHECK(train_host_register(d, area, 10) == 0, "registrable again");
    T_CHECK(train_host_unregister(d, area) == 0, "unregister");
    /* many ranges (the table grows) */
    static char many[100][64];
    int ok = 1;
    for (int i = 0; i < 100; i++)
        ok &= train_host_register(d, many[i], sizeof many[i]) == 0;
    for (int i = 99; i >= 0; i -= 2)
        ok &= train_host_unregister(d, many[i]) == 0;
    T_CHECK(ok, "100 ranges registered, half unregistered");
    T_CHECK(train_host_unregister(d, many[99]) == -EINVAL, "gone");
    T_CHECK(train_host_unregister(d, many[98]) == 0, "still there");
    train_device_close(d); /* with ranges still registered */
}

static gate g_destroy;
static unsigned char d_src[4096], d_dst[4096];

static void test_destroy_with_queued_work(void)
{
    train_device *d = open_cpu();
    /* queued work is done before destroy returns */
    train_stream *s = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0, "stream");
    enum { N = 1 << 20, K = 64 };
    unsigned char *src = malloc((size_t)N * K), *dst = malloc((size_t)N * K);
    T_REQUIRE(src && dst, "malloc");
    fill(src, (size_t)N * K, 33);
    memset(dst, 0, (size_t)N * K);
    for (int i = 0; i < K; i++)
        T_CHECK(train_stream_copy_async(s, dst + (size_t)i * N, src + (size_t)i * N, N,
                                        TRAIN_COPY_H2D) == 0,
                "copy");
    T_CHECK(train_stream_destroy(s, 30) == 0, "destroy drains");
    T_CHECK(memcmp(dst, src, (size_t)N * K) == 0, "every queued copy done");
    free(src);
    free(dst);

    /* a worker that does not come back: destroy gives up at its timeout and abandons it */
    T_REQUIRE(train_stream_create(d, &s) == 0, "stream");
    gate_init(&g_destroy);
    fill(d_src, sizeof d_src, 44);
    memset(d_dst, 0, sizeof d_dst);
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_destroy) == 0, "gate");
    T_CHECK(train_stream_copy_async(s, d_dst, d_src, sizeof d_dst, TRAIN_COPY_H2H) == 0, "copy");
    T_CHECK(gate_wait_entered(&g_destroy), "at the gate");
    double t0 = t_now_s();
    T_CHECK(train_stream_destroy(s, 0.2) == -ETIMEDOUT, "destroy times out");
    double took = t_now_s() - t0;
    T_CHECK(took >= 0.15 && took < 5, "after its bound (%.3f s)", took);
    gate_open(&g_destroy);
    double end = t_now_s() + 5;
    while (!gate_get(&g_destroy, &g_destroy.left) && t_now_s() < end)
        t_sleep_s(0.001);
    t_sleep_s(0.1); /* the worker frees the stream and exits */
    T_CHECK(all_zero(d_dst, sizeof d_dst), "an abandoned stream skips its remaining copies");
    train_device_close(d);
}

enum { WAITERS = 8 };
static gate g_many;

typedef struct waiter_arg {
    train_event *e;
    const unsigned char *dst, *src;
    size_t n;
    int saw_pending, saw_complete, bytes_ok, wait_rc;
} waiter_arg;

static void *waiter_main(void *arg)
{
    waiter_arg *w = arg;
    for (int i = 0; i < 20; i++) {
        int q = train_event_query(w->e);
        if (q == 0) w->saw_pending = 1;
        if (q == 1) break;
    }
    int rc;
    while ((rc = train_event_wait(w->e, 0.01)) == -ETIMEDOUT)
        w->saw_pending = 1;
    w->wait_rc = rc;
    w->saw_complete = train_event_query(w->e) == 1;
    w->bytes_ok = memcmp(w->dst, w->src, w->n) == 0; /* visible after the wait */
    return NULL;
}

static void test_many_waiters(void)
{
    train_device *d = open_cpu();
    train_stream *s = NULL;
    train_event *e = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0 && train_event_create(d, &e) == 0, "stream, event");
    const size_t n = 1 << 18;
    unsigned char *src, *dst;
    T_REQUIRE(train_host_alloc_pinned(d, (void **)&src, n) == 0, "src");
    T_REQUIRE(train_device_alloc(d, (void **)&dst, n) == 0, "dst");
    fill(src, n, 55);
    gate_init(&g_many);
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_many) == 0, "gate");
    T_CHECK(train_stream_copy_async(s, dst, src, n, TRAIN_COPY_H2D) == 0, "copy");
    T_CHECK(train_event_record(e, s) == 0, "record");
    pthread_t th[WAITERS];
    waiter_arg args[WAITERS];
    for (int i = 0; i < WAITERS; i++) {
        args[i] = (waiter_arg){e, dst, src, n, 0, 0, 0, 1};
        T_REQUIRE(pthread_create(&th[i], NULL, waiter_main, &args[i]) == 0, "thread");
    }
    t_sleep_s(0.1);
    gate_open(&g_many);
    int ok = 1;
    for (int i = 0; i < WAITERS; i++) {
        pthread_join(th[i], NULL);
        ok &= args[i].saw_pending && args[i].saw_complete && args[i].bytes_ok && args[i].wait_rc == 0;
    }
    T_CHECK(ok, "every waiter saw pending, then complete, then the bytes");
    T_CHECK(train_stream_destroy(s, 10) == 0, "destroy");
    train_event_destroy(e);
    train_device_free(d, dst);
    train_host_free_pinned(d, src);
    train_device_close(d);
}

/* One allocation's worth of the real thing, when a GPU is there. */
static gate g_gpu;

static void test_cuda_smoke(int ordinal)
{
    train_device *d = NULL;
    char why[512] = "";
    int rc = train_device_open(&d, TRAIN_DEVICE_CUDA, ordinal, why, sizeof why);
    T_REQUIRE(rc == 0, "open cuda:%d: %d %s", ordinal, rc, why);
    printf("device: %s\n", train_device_describe(d));
    T_CHECK(strncmp(train_device_describe(d), "cuda:", 5) == 0 &&
                strstr(train_device_describe(d), "sm_"),
            "describe: %s", train_device_describe(d));
    const size_t n = 8u << 20;
    unsigned char *h1, *h2, *dv1, *dv2;
    T_REQUIRE(train_host_alloc_pinned(d, (void **)&h1, n) == 0, "pinned");
    T_REQUIRE(train_host_alloc_pinned(d, (void **)&h2, n) == 0, "pinned");
    T_REQUIRE(train_device_alloc(d, (void **)&dv1, n) == 0, "alloc");
    T_REQUIRE(train_device_alloc(d, (void **)&dv2, n) == 0, "alloc");
    T_CHECK(((uintptr_t)dv1 & 255) == 0, "aligned");
    T_CHECK(all_zero(h1, n), "pinned zeroed");
    T_CHECK(train_device_copy(d, h2, dv1, n, TRAIN_COPY_D2H) == 0 && all_zero(h2, n),
            "device memory zeroed");
    fill(h1, n, 77);
    T_CHECK(train_device_copy(d, dv1, h1, n, TRAIN_COPY_H2D) == 0, "H2D");
    T_CHECK(train_device_copy(d, dv2, dv1, n, TRAIN_COPY_D2D) == 0, "D2D");
    T_CHECK(train_device_copy(d, h2, dv2, n, TRAIN_COPY_D2H) == 0 && memcmp(h1, h2, n) == 0,
            "round trip");

    train_stream *s = NULL, *s2 = NULL;
    train_event *e = NULL, *e2 = NULL;
    T_REQUIRE(train_stream_create(d, &s) == 0 && train_stream_create(d, &s2) == 0, "streams");
    T_REQUIRE(train_event_create(d, &e) == 0 && train_event_create(d, &e2) == 0, "events");
    T_CHECK(train_stream_native(s) != NULL, "native handle");
    T_CHECK(train_event_query(e) == -EINVAL, "never recorded");
    memset(h2, 0, n);
    gate_init(&g_gpu);
    T_CHECK(train_stream_host_fn(s, gate_fn, &g_gpu) == 0, "host fn");
    T_CHECK(train_stream_copy_async(s, h2, dv2, n, TRAIN_COPY_D2H) == 0, "async D2H");
    T_CHECK(train_event_record(e, s) == 0, "record");
    T_CHECK(train_stream_wait_event(s2, e) == 0, "s2 waits");
    T_CHECK(train_event_record(e2, s2) == 0, "record e2");
    T_CHECK(gate_wait_entered(&g_gpu), "host fn running");
    T_CHECK(train_event_query(e) == 0 && train_event_query(e2) == 0, "pending behind the host fn");
    T_CHECK(train_event_wait(e2, 0.05) == -ETIMEDOUT, "wait times out");
    T_CHECK(all_zero(h2, n), "not copied yet");
    gate_open(&g_gpu);
    T_CHECK(train_event_wait(e2, 30) == 0 && train_event_query(e) == 1, "complete");
    T_CHECK(memcmp(h1, h2, n) == 0, "async bytes in place");
    static char area[1 << 20];
    T_CHECK(train_host_register(d, area, sizeof area) == 0, "cudaHostRegister");
    T_CHECK(train_stream_copy_async(s, area, dv1, sizeof area, TRAIN_COPY_D2H) == 0 &&
                train_stream_sync(s, 30) == 0 && memcmp(area, h1, sizeof area) == 0,
            "copy into registered memory");
    T_CHECK(train_host_unregister(d, area) == 0, "cudaHostUnregister");
    T_CHECK(train_host_unregister(d, area) == -EINVAL, "twice");
    T_CHECK(train_stream_destroy(s, 30) == 0 && train_stream_destroy(s2, 30) == 0, "destroy");
    train_event_destroy(e);
    train_event_destroy(e2);
    train_device_free(d, dv1);
    train_device_free(d, dv2);
    train_host_free_pinned(d, h1);
    train_host_free_pinned(d, h2);
    train_device_close(d);
}

static void test_cuda(void)
{
    int n = train_device_count(TRAIN_DEVICE_CUDA);
    train_device *d = NULL;
    char why[512] = "";
    int rc = train_device_open(&d, TRAIN_DEVICE_CUDA, 0, why, sizeof why);
    if (!CKPT_HAVE_CUDA) {
        T_CHECK(n == -ENOTSUP, "count without CUDA in the build: %d", n);
        T_CHECK(rc == -ENOTSUP && !d && why[0], "open without CUDA in the build: %d %s", rc, why);
        return;
    }
    if (n > 0) {
        T_CHECK(rc == 0, "open cuda:0 with %d devices: %d %s", n, rc, why);
        train_device_close(d);
        why[0] = '\0';
        T_CHECK(train_device_open(&d, TRAIN_DEVICE_CUDA, n, why, sizeof why) == -ENODEV &&
                    strstr(why, "no such device"),
                "ordinal past the devices: %s", why);
        test_cuda_smoke(0);
        return;
    }
    printf("no GPU: %s\n", why);
    T_CHECK(n == -ENODEV, "count without a GPU: %d", n);
    T_CHECK(rc == -ENODEV && !d, "open without a GPU: %d", rc);
    T_CHECK(strstr(why, "cudaGetDeviceCount") != NULL, "the reason names the call: %s", why);
    T_CHECK(strstr(why, "--device cuda") != NULL, "the reason names the option: %s", why);
    T_CHECK(strchr(why, '\n') == NULL, "one line");
    why[0] = '\0';
    T_CHECK(train_device_open(&d, TRAIN_DEVICE_CUDA, 3, why, sizeof why) == -ENODEV && why[0],
            "cuda:3 too: %s", why);
    T_CHECK(train_device_open(&d, TRAIN_DEVICE_CUDA, 0, NULL, 0) == -ENODEV, "why may be NULL");
}

int main(void)
{
    test_parse();
    test_cpu_memory_and_sync_copies();
    test_async_is_async();
    test_fifo();
    test_cross_stream();
    test_rerecord_and_never_recorded();
    test_sticky_errors();
    test_register();
    test_destroy_with_queued_work();
    test_many_waiters();
    test_cuda();
    return t_done("test_device");
}
