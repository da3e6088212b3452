/* copy_bench - the baseline of the snapshot stall: one bare device-to-pinned-host copy of
 * the same bytes a snapshot stages, through the device layer (train/device.h).
 *
 * usage: copy_bench [--device cpu|cuda[:N]] MIB [REPEATS]
 * Prints: "copy_bench device=<..> bytes=<n> d2h_ms=<median ms> d2h_gbps=<GB/s> sync_ms=<ms>"
 * (d2h: one train_stream_copy_async on a copy stream into pinned memory, then a wait on an
 * event; sync: train_device_copy into the same pinned memory). Exit 0, 1 on a device error
 * (one line), 2 on bad arguments, 77 when the device kind is not available here. */
#include "device.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const char *devname = "cpu";
    int i = 1;
    if (i + 1 < argc && !strcmp(argv[i], "--device")) {
        devname = argv[i + 1];
        i += 2;
    }
    if (i >= argc) {
        fprintf(stderr, "usage: copy_bench [--device cpu|cuda[:N]] MIB [REPEATS]\n");
        return 2;
    }
    char *end;
    long mib = strtol(argv[i], &end, 10);
    long reps = i + 1 < argc ? strtol(argv[i + 1], NULL, 10) : 5;
    if (*end || mib < 1 || mib > 65536 || reps < 1 || reps > 1000) {
        fprintf(stderr, "copy_bench: MIB must be in [1, 65536], REPEATS in [1, 1000]\n");
        return 2;
    }
    train_device_kind kind;
    int ordinal;
    if (train_device_parse(devname, &kind, &ordinal) < 0) {
        fprintf(stderr, "copy_bench: --device %s: expected cpu, cuda or cuda:N\n", devname);
        return 2;
    }
    char why[256] = "";
    train_device *d = NULL;
    int rc = train_device_open(&d, kind, ordinal, why, sizeof why);
    if (rc < 0) {
        fprintf(stderr, "copy_bench: %s\n", why[0] ? why : strerror(-rc));
        return rc == -ENODEV || rc == -ENOTSUP ? 77 : 1;
    }
    size_t bytes = (size_t)mib << 20;
    void *dev = NULL, *host = NULL;
    train_stream *s = NULL;
    train_event *ev = NULL;
    double *t = calloc((size_t)reps, sizeof *t), *ts = calloc((size_t)reps, sizeof *ts);
    if (!t || !ts || (rc = train_device_alloc(d, &dev, bytes)) < 0 ||
        (rc = train_host_alloc_pinned(d, &host, bytes)) < 0 || (rc = train_stream_create(d, &s)) < 0 ||
        (rc = train_event_create(d, &ev)) < 0) {
        fprintf(stderr, "copy_bench: setting up %ld MiB on %s: %s\n", mib,
                train_device_describe(d), strerror(rc < 0 ? -rc : ENOMEM));
        rc = 1;
        goto out;
    }
    for (long r = 0; r < reps; r++) {
        double t0 = now_s();
        if ((rc = train_stream_copy_async(s, host, dev, bytes, TRAIN_COPY_D2H)) < 0 ||
            (rc = train_event_record(ev, s)) < 0 || (rc = train_event_wait(ev, 120.0)) < 0)
            break;
        t[r] = now_s() - t0;
        t0 = now_s();
        if ((rc = train_device_copy(d, host, dev, bytes, TRAIN_COPY_D2H)) < 0) break;
        ts[r] = now_s() - t0;
    }
    if (rc < 0) {
        fprintf(stderr, "copy_bench: copy of %ld MiB on %s: %s\n", mib, train_device_describe(d),
                strerror(-rc));
        rc = 1;
        goto out;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    qsort(ts, (size_t)reps, sizeof *ts, cmp_double);
    double med = t[reps / 2], meds = ts[reps / 2];
    printf("copy_bench device=%s bytes=%zu d2h_ms=%.2f d2h_gbps=%.2f sync_ms=%.2f\n",
           train_device_describe(d), bytes, med * 1e3, (double)bytes / med / 1e9, meds * 1e3);
    rc = 0;
out:
    train_event_destroy(ev);
    if (s) train_stream_destroy(s, 60.0);
    train_host_free_pinned(d, host);
    train_device_free(d, dev);
    train_device_close(d);
    free(t);
    free(ts);
    return rc;
}
