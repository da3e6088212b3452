/* emu_runtime.cpp - the CUDA emulator's runtime API (cuda_runtime_api.h): devices, memory and
 * its registry, streams as worker threads, events, host functions, copies, errors. */
#include "cuda_runtime.h"
#include "emu_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

namespace emu {

#define GUARD 256 /* bytes of guard before and after each device allocation (keeps 256-alignment) */
/* Guard bytes: A5 at even addresses, FF at odd ones, so that an aligned float, bf16 or
 * double read from a guard is a NaN (FFA5FFA5...) that poisons the result it enters. */
static inline unsigned char guard_byte(const unsigned char *p) { return ((uintptr_t)p & 1) ? 0xFF : 0xA5; }
static void guard_fill(unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) p[i] = guard_byte(p + i);
}

struct Stream {
    int device = 0;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> q;
    bool busy = false, closing = false;
};

struct Event {
    int device = 0;
    std::mutex mu;
    std::condition_variable cv;
    uint64_t recorded = 0, completed = 0; /* generations */
};

struct Range {
    size_t bytes;
    int kind;
    int device;
    void *raw; /* what to free: the guarded block of a device allocation */
};

/* Leaked on purpose: worker threads may still run when static destructors would run. */
static std::mutex &g_mu = *new std::mutex;
static std::map<uintptr_t, Range> &g_ranges = *new std::map<uintptr_t, Range>;
static std::map<Stream *, std::shared_ptr<Stream>> &g_streams =
    *new std::map<Stream *, std::shared_ptr<Stream>>;
static std::map<Event *, std::shared_ptr<Event>> &g_events =
    *new std::map<Event *, std::shared_ptr<Event>>;
static std::shared_ptr<Stream> *g_legacy;
static size_t g_used[64]; /* device bytes in use, per device */
static std::atomic<int> g_sticky{0};

static thread_local cudaError_t t_last = cudaSuccess;
static thread_local int t_device = 0;
static thread_local int t_in_host_fn = 0;

static int env_int(const char *name, int dflt, int lo, int hi)
{
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) {
        fprintf(stderr, "cuda-emu: %s=%s is not a number in [%d, %d]; using %d\n", name, v, lo,
                hi, dflt);
        return dflt;
    }
    return (int)x;
}

static int ndevices(void)
{
    static int n = env_int("CUDA_EMU_DEVICES", 1, 0, 64);
    return n;
}

static size_t device_bytes(void)
{
    static size_t b = (size_t)env_int("CUDA_EMU_MEM_GIB", 16, 1, 4096) << 30;
    return b;
}

void say(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda-emu: %s\n", line);
}

void fault(cudaError_t e, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    int expected = 0;
    if (g_sticky.compare_exchange_strong(expected, (int)e))
        fprintf(stderr, "cuda-emu: fault (%s, sticky): %s\n", cudaGetErrorName(e), line);
    else
        fprintf(stderr, "cuda-emu: after the fault: %s\n", line);
    if (getenv("CUDA_EMU_ABORT") && !strcmp(getenv("CUDA_EMU_ABORT"), "1")) abort();
}

int faulted(void) { return g_sticky.load() != 0; }

cudaError_t ret(cudaError_t e)
{
    if (e != cudaSuccess) t_last = e;
    return e;
}

cudaError_t api_enter(const char *call)
{
    if (t_in_host_fn) {
        say("%s called inside a host function (cudaLaunchHostFunc): not permitted", call);
        return ret(cudaErrorNotPermitted);
    }
    int s = g_sticky.load();
    return s ? ret((cudaError_t)s) : cudaSuccess;
}

int current_device(void) { return t_device; }

static void worker(std::shared_ptr<Stream> s)
{
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
        s->cv.wait(lk, [&] { return !s->q.empty() || s->closing; });
        if (s->q.empty()) return; /* destroyed and drained */
        std::function<void()> op = std::move(s->q.front());
        s->q.pop_front();
        s->busy = true;
        lk.unlock();
        op();
        op = nullptr;
        lk.lock();
        s->busy = false;
        s->cv.notify_all();
    }
}

static std::shared_ptr<Stream> stream_new(int device)
{
    auto s = std::make_shared<Stream>();
    s->device = device;
    std::thread(worker, s).detach();
    return s;
}

std::shared_ptr<Stream> stream_get(cudaStream_t h)
{
    std::lock_guard<std::mutex> g(g_mu);
    if (!h) {
        if (!g_legacy) g_legacy = new std::shared_ptr<Stream>(stream_new(0));
        return *g_legacy;
    }
    auto it = g_streams.find((Stream *)h);
    return it == g_streams.end() ? nullptr : it->second;
}

int stream_device(const Stream *s) { return s->device; }

void enqueue(const std::shared_ptr<Stream> &s, std::function<void()> op)
{
    std::lock_guard<std::mutex> g(s->mu);
    s->q.push_back(std::move(op));
    s->cv.notify_all();
}

static bool stream_idle(Stream *s)
{
    std::lock_guard<std::mutex> g(s->mu);
    return s->q.empty() && !s->busy;
}

static void stream_drain(Stream *s)
{
    std::unique_lock<std::mutex> lk(s->mu);
    s->cv.wait(lk, [&] { return s->q.empty() && !s->busy; });
}

/* The implicit synchronisation of cudaFree / cudaFreeHost / cudaHostUnregister: every
 * stream drained. */
static void device_sync(void)
{
    std::vector<std::shared_ptr<Stream>> all;
    {
        std::lock_guard<std::mutex> g(g_mu);
        for (auto &kv : g_streams) all.push_back(kv.second);
        if (g_legacy) all.push_back(*g_legacy);
    }
    for (auto &s : all) stream_drain(s.get());
}

/* Callers hold g_mu. */
static std::map<uintptr_t, Range>::iterator range_at(uintptr_t p)
{
    auto it = g_ranges.upper_bound(p);
    if (it == g_ranges.begin()) return g_ranges.end();
    --it;
    if (p >= it->first + std::max<size_t>(it->second.bytes, 1)) return g_ranges.end();
    return it;
}

int range_kind(const void *p, size_t bytes, int *device, void **base)
{
    std::lock_guard<std::mutex> g(g_mu);
    auto it = range_at((uintptr_t)p);
    if (it == g_ranges.end()) return MEM_NONE;
    if (device) *device = it->second.device;
    if (base) *base = (void *)it->first;
    if ((uintptr_t)p + bytes > it->first + it->second.bytes) return -1;
    return it->second.kind;
}

int guards_ok(const void *p, const char *what)
{
    uintptr_t base;
    size_t bytes;
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = range_at((uintptr_t)p);
        if (it == g_ranges.end() || it->second.kind != MEM_DEVICE) return 0;
        base = it->first;
        bytes = it->second.bytes;
    }
    const unsigned char *lo = (const unsigned char *)base - GUARD,
                        *hi = (const unsigned char *)base + bytes;
    for (size_t i = 0; i < GUARD; i++) {
        const bool blo = lo[i] != guard_byte(lo + i);
        if (blo || hi[i] != guard_byte(hi + i)) {
            fault(cudaErrorIllegalAddress,
                  "%s wrote %s the device allocation %p of %zu bytes (guard byte %zu)", what,
                  blo ? "before" : "past the end of", (void *)base, bytes, i);
            return -1;
        }
    }
    return 0;
}

static const char *kind_name(int k)
{
    switch (k) {
    case MEM_DEVICE: return "device memory";
    case MEM_PINNED: return "pinned host memory";
    case MEM_REGISTERED: return "registered host memory";
    default: return "pageable host memory";
    }
}

} // namespace emu

using namespace emu;

extern "C" {

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
#define N(x)                                                                                       \
    case x: return #x;
        N(cudaSuccess)
        N(cudaErrorInvalidValue)
        N(cudaErrorMemoryAllocation)
        N(cudaErrorInvalidConfiguration)
        N(cudaErrorNoDevice)
        N(cudaErrorInvalidDevice)
        N(cudaErrorInvalidResourceHandle)
        N(cudaErrorNotReady)
        N(cudaErrorIllegalAddress)
        N(cudaErrorHostMemoryAlreadyRegistered)
        N(cudaErrorHostMemoryNotRegistered)
        N(cudaErrorLaunchFailure)
        N(cudaErrorNotPermitted)
        N(cudaErrorUnknown)
#undef N
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorHostMemoryAlreadyRegistered:
        return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotPermitted: return "operation not permitted";
    default: return "unknown error";
    }
}

cudaError_t cudaGetLastError(void)
{
    int s = g_sticky.load();
    if (s) return (cudaError_t)s;
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    int s = g_sticky.load();
    return s ? (cudaError_t)s : t_last;
}

cudaError_t cudaGetDeviceCount(int *count)
{
    if (!count) return ret(cudaErrorInvalidValue);
    *count = ndevices();
    return *count ? cudaSuccess : ret(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device)
{
    cudaError_t e = api_enter("cudaSetDevice");
    if (e) return e;
    if (device < 0 || device >= ndevices()) return ret(cudaErrorInvalidDevice);
    t_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    cudaError_t e = api_enter("cudaGetDevice");
    if (e) return e;
    if (!device) return ret(cudaErrorInvalidValue);
    if (!ndevices()) return ret(cudaErrorNoDevice);
    *device = t_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    cudaError_t e = api_enter("cudaGetDeviceProperties");
    if (e) return e;
    if (!prop) return ret(cudaErrorInvalidValue);
    if (device < 0 || device >= ndevices()) return ret(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "cuda-emu (CPU emulation, tests/cuda_emu)");
    prop->totalGlobalMem = device_bytes();
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 1;
    prop->maxThreadsPerBlock = 1024;
    prop->warpSize = 32;
    prop->sharedMemPerBlock = 48 << 10;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    cudaError_t e = api_enter("cudaDeviceSynchronize");
    if (e) return e;
    device_sync();
    return api_enter("cudaDeviceSynchronize");
}

static cudaError_t dev_alloc(void **p, size_t bytes, const char *call)
{
    cudaError_t e = api_enter(call);
    if (e) return e;
    if (!p) return ret(cudaErrorInvalidValue);
    *p = NULL;
    if (!ndevices()) return ret(cudaErrorNoDevice);
    const int dev = t_device;
    const size_t body = (bytes + 255) & ~(size_t)255;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (bytes > device_bytes() || g_used[dev] + body > device_bytes())
            return ret(cudaErrorMemoryAllocation);
        g_used[dev] += body;
    }
    unsigned char *raw = (unsigned char *)aligned_alloc(256, body + 2 * GUARD);
    if (!raw) {
        std::lock_guard<std::mutex> g(g_mu);
        g_used[dev] -= body;
        return ret(cudaErrorMemoryAllocation);
    }
    guard_fill(raw, GUARD);
    memset(raw + GUARD, 0xFF, bytes); /* not zeroed, as on a GPU: a NaN pattern */
    guard_fill(raw + GUARD + bytes, body - bytes + GUARD);
    std::lock_guard<std::mutex> g(g_mu);
    g_ranges[(uintptr_t)(raw + GUARD)] = Range{bytes, MEM_DEVICE, dev, raw};
    *p = raw + GUARD;
    return cudaSuccess;
}

/* Remove and free the device allocation at p (its base). */
static cudaError_t dev_release(void *p, const char *call)
{
    void *raw;
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_ranges.find((uintptr_t)p);
        if (it == g_ranges.end() || it->second.kind != MEM_DEVICE) {
            say("%s(%p): not the start of a device allocation", call, p);
            return ret(cudaErrorInvalidValue);
        }
        raw = it->second.raw;
        g_used[it->second.device] -= (it->second.bytes + 255) & ~(size_t)255;
        g_ranges.erase(it);
    }
    if (guards_ok(p, call)) return ret(cudaErrorIllegalAddress);
    free(raw);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) { return dev_alloc(p, bytes, "cudaMalloc"); }

cudaError_t cudaFree(void *p)
{
    cudaError_t e = api_enter("cudaFree");
    if (e) return e;
    if (!p) return cudaSuccess;
    device_sync();
    return dev_release(p, "cudaFree");
}

cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s)
{
    cudaError_t e = api_enter("cudaMallocAsync");
    if (e) return e;
    if (!stream_get(s)) return ret(cudaErrorInvalidResourceHandle);
    return dev_alloc(p, bytes, "cudaMallocAsync");
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s)
{
    cudaError_t e = api_enter("cudaFreeAsync");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    if (!p) return cudaSuccess;
    if (range_kind(p, 0, NULL, NULL) != MEM_DEVICE) {
        say("cudaFreeAsync(%p): not a device allocation", p);
        return ret(cudaErrorInvalidValue);
    }
    enqueue(st, [p] { (void)dev_release(p, "cudaFreeAsync"); });
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    cudaError_t e = api_enter("cudaHostAlloc");
    if (e) return e;
    if (!p || (flags & ~0x0fu)) return ret(cudaErrorInvalidValue);
    const size_t body = (std::max<size_t>(bytes, 1) + 4095) & ~(size_t)4095;
    void *m = aligned_alloc(4096, body);
    if (!m) return ret(cudaErrorMemoryAllocation);
    std::lock_guard<std::mutex> g(g_mu);
    g_ranges[(uintptr_t)m] = Range{bytes, MEM_PINNED, t_device, m};
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
    cudaError_t e = api_enter("cudaFreeHost");
    if (e) return e;
    if (!p) return cudaSuccess;
    device_sync();
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_ranges.find((uintptr_t)p);
    if (it == g_ranges.end() || it->second.kind != MEM_PINNED) {
        say("cudaFreeHost(%p): not memory of cudaHostAlloc", p);
        return ret(cudaErrorInvalidValue);
    }
    free(it->second.raw);
    g_ranges.erase(it);
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags)
{
    cudaError_t e = api_enter("cudaHostRegister");
    if (e) return e;
    if (!p || !bytes || (flags & ~0x0fu)) return ret(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(g_mu);
    uintptr_t a = (uintptr_t)p;
    auto it = g_ranges.lower_bound(a);
    bool overlap = (it != g_ranges.end() && it->first < a + bytes) ||
                   range_at(a) != g_ranges.end();
    if (overlap) return ret(cudaErrorHostMemoryAlreadyRegistered);
    g_ranges[a] = Range{bytes, MEM_REGISTERED, t_device, NULL};
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *p)
{
    cudaError_t e = api_enter("cudaHostUnregister");
    if (e) return e;
    device_sync();
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_ranges.find((uintptr_t)p);
    if (it == g_ranges.end() || it->second.kind != MEM_REGISTERED)
        return ret(cudaErrorHostMemoryNotRegistered);
    g_ranges.erase(it);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p)
{
    cudaError_t e = api_enter("cudaPointerGetAttributes");
    if (e) return e;
    if (!a) return ret(cudaErrorInvalidValue);
    int dev = -1;
    int k = range_kind(p, 0, &dev, NULL);
    memset(a, 0, sizeof *a);
    a->device = k > 0 ? dev : -2;
    if (k == MEM_DEVICE) {
        a->type = cudaMemoryTypeDevice;
        a->devicePointer = (void *)p;
    } else if (k == MEM_PINNED || k == MEM_REGISTERED) {
        a->type = cudaMemoryTypeHost;
        a->devicePointer = a->hostPointer = (void *)p;
    } else {
        a->type = cudaMemoryTypeUnregistered;
    }
    return cudaSuccess;
}

/* Check one side of a copy or memset: its kind, or an argument error (printed) when the
 * range runs past its allocation. */
static int side_kind(const void *p, size_t bytes, const char *call, const char *side)
{
    int k = range_kind(p, bytes, NULL, NULL);
    if (k < 0) say("%s: the %s [%p, +%zu) runs past the end of its allocation", call, side, p, bytes);
    return k;
}

static cudaError_t copy_args(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                             const char *call, int *dst_dev, int *src_dev)
{
    if (bytes && (!dst || !src)) return ret(cudaErrorInvalidValue);
    if (!bytes) return cudaSuccess;
    int kd = side_kind(dst, bytes, call, "destination"),
        ks = side_kind(src, bytes, call, "source");
    if (kd < 0 || ks < 0) return ret(cudaErrorInvalidValue);
    bool dd = kd == MEM_DEVICE, sd = ks == MEM_DEVICE;
    bool ok;
    switch (kind) {
    case cudaMemcpyHostToHost: ok = !dd && !sd; break;
    case cudaMemcpyHostToDevice: ok = dd && !sd; break;
    case cudaMemcpyDeviceToHost: ok = !dd && sd; break;
    case cudaMemcpyDeviceToDevice: ok = dd && sd; break;
    case cudaMemcpyDefault: ok = true; break;
    default: return ret(cudaErrorInvalidValue);
    }
    if (!ok) {
        static const char *names[] = {"HostToHost", "HostToDevice", "DeviceToHost",
                                      "DeviceToDevice"};
        say("%s: kind cudaMemcpy%s, but the destination %p is %s and the source %p is %s", call,
            names[kind], dst, kind_name(kd), src, kind_name(ks));
        return ret(cudaErrorInvalidValue);
    }
    *dst_dev = dd;
    *src_dev = sd;
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s)
{
    cudaError_t e = api_enter("cudaMemcpyAsync");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    int dd = 0, sd = 0;
    if ((e = copy_args(dst, src, bytes, kind, "cudaMemcpyAsync", &dd, &sd))) return e;
    if (!bytes) return cudaSuccess;
    enqueue(st, [=] {
        if (faulted()) return;
        /* the ranges may have been freed since (stream-ordered frees): check again */
        if (range_kind(dst, bytes, NULL, NULL) < 0 || range_kind(src, bytes, NULL, NULL) < 0 ||
            (dd && range_kind(dst, bytes, NULL, NULL) != MEM_DEVICE) ||
            (sd && range_kind(src, bytes, NULL, NULL) != MEM_DEVICE)) {
            fault(cudaErrorIllegalAddress, "cudaMemcpyAsync(%p <- %p, %zu bytes): a side is no "
                                           "longer in its allocation when the copy runs",
                  dst, src, bytes);
            return;
        }
        memmove(dst, src, bytes);
        if (dd) guards_ok(dst, "cudaMemcpyAsync");
    });
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, NULL);
    if (e) return e;
    stream_drain(stream_get(NULL).get()); /* the legacy stream; not the non-blocking ones */
    return api_enter("cudaMemcpy");
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s)
{
    cudaError_t e = api_enter("cudaMemsetAsync");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    if (!bytes) return cudaSuccess;
    int k = side_kind(p, bytes, "cudaMemsetAsync", "range");
    if (k != MEM_DEVICE) {
        if (k >= 0) say("cudaMemsetAsync: %p is %s, not device memory", p, kind_name(k));
        return ret(cudaErrorInvalidValue);
    }
    enqueue(st, [=] {
        if (faulted()) return;
        if (range_kind(p, bytes, NULL, NULL) != MEM_DEVICE) {
            fault(cudaErrorIllegalAddress, "cudaMemsetAsync(%p, %zu bytes): freed before it ran",
                  p, bytes);
            return;
        }
        memset(p, value, bytes);
    });
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    cudaError_t e = api_enter("cudaStreamCreateWithFlags");
    if (e) return e;
    if (!s || (flags & ~1u)) return ret(cudaErrorInvalidValue);
    auto st = stream_new(t_device);
    std::lock_guard<std::mutex> g(g_mu);
    g_streams[st.get()] = st;
    *s = (cudaStream_t)st.get();
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    cudaError_t e = api_enter("cudaStreamDestroy");
    if (e) return e;
    std::shared_ptr<Stream> st;
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_streams.find((Stream *)s);
        if (!s || it == g_streams.end()) return ret(cudaErrorInvalidResourceHandle);
        st = it->second;
        g_streams.erase(it);
    }
    /* returns at once; the worker finishes the queued work, then exits */
    std::lock_guard<std::mutex> g(st->mu);
    st->closing = true;
    st->cv.notify_all();
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    cudaError_t e = api_enter("cudaStreamQuery");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    if (!stream_idle(st.get())) return ret(cudaErrorNotReady);
    return api_enter("cudaStreamQuery"); /* a fault in the work just finished */
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    cudaError_t e = api_enter("cudaStreamSynchronize");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    stream_drain(st.get());
    return api_enter("cudaStreamSynchronize");
}

cudaError_t cudaStreamGetDevice(cudaStream_t s, int *device)
{
    cudaError_t e = api_enter("cudaStreamGetDevice");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    if (!device) return ret(cudaErrorInvalidValue);
    *device = s ? st->device : t_device;
    return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user)
{
    cudaError_t e = api_enter("cudaLaunchHostFunc");
    if (e) return e;
    auto st = stream_get(s);
    if (!st) return ret(cudaErrorInvalidResourceHandle);
    if (!fn) return ret(cudaErrorInvalidValue);
    enqueue(st, [=] {
        if (faulted()) return;
        t_in_host_fn = 1;
        fn(user);
        t_in_host_fn = 0;
    });
    return cudaSuccess;
}

static std::shared_ptr<Event> event_get(cudaEvent_t h)
{
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_events.find((Event *)h);
    return it == g_events.end() ? nullptr : it->second;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    cudaError_t r = api_enter("cudaEventCreateWithFlags");
    if (r) return r;
    if (!e || (flags & ~0x0fu)) return ret(cudaErrorInvalidValue);
    auto ev = std::make_shared<Event>();
    ev->device = t_device;
    std::lock_guard<std::mutex> g(g_mu);
    g_events[ev.get()] = ev;
    *e = (cudaEvent_t)ev.get();
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    cudaError_t r = api_enter("cudaEventDestroy");
    if (r) return r;
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_events.find((Event *)e);
    if (it == g_events.end()) return ret(cudaErrorInvalidResourceHandle);
    g_events.erase(it); /* pending records and waits keep their reference */
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    cudaError_t r = api_enter("cudaEventRecord");
    if (r) return r;
    auto ev = event_get(e);
    auto st = stream_get(s);
    if (!ev || !st) return ret(cudaErrorInvalidResourceHandle);
    uint64_t gen;
    {
        std::lock_guard<std::mutex> g(ev->mu);
        gen = ++ev->recorded;
    }
    enqueue(st, [ev, gen] { /* runs after a fault too: waiters must not hang */
        std::lock_guard<std::mutex> g(ev->mu);
        ev->completed = std::max(ev->completed, gen);
        ev->cv.notify_all();
    });
    return cudaSuccess;
}

static std::atomic<int> g_schedule{-1};

void cudaEmuSetSchedule(int schedule)
{
    g_schedule.store(schedule == CUDA_EMU_SCHEDULE_REVERSE ? schedule : CUDA_EMU_SCHEDULE_FORWARD);
}

int cudaEmuGetSchedule(void)
{
    int s = g_schedule.load();
    if (s < 0) {
        const char *v = getenv("CUDA_EMU_SCHEDULE");
        s = v && !strcmp(v, "reverse") ? CUDA_EMU_SCHEDULE_REVERSE : CUDA_EMU_SCHEDULE_FORWARD;
        if (v && *v && strcmp(v, "reverse") && strcmp(v, "forward"))
            say("CUDA_EMU_SCHEDULE=%s: not forward or reverse; forward", v);
        int expect = -1;
        g_schedule.compare_exchange_strong(expect, s);
        s = g_schedule.load();
    }
    return s;
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    cudaError_t r = api_enter("cudaEventQuery");
    if (r) return r;
    auto ev = event_get(e);
    if (!ev) return ret(cudaErrorInvalidResourceHandle);
    std::lock_guard<std::mutex> g(ev->mu);
    return ev->completed >= ev->recorded ? cudaSuccess : ret(cudaErrorNotReady);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    cudaError_t r = api_enter("cudaStreamWaitEvent");
    if (r) return r;
    auto ev = event_get(e);
    auto st = stream_get(s);
    if (!ev || !st) return ret(cudaErrorInvalidResourceHandle);
    if (flags) return ret(cudaErrorInvalidValue);
    uint64_t gen;
    {
        std::lock_guard<std::mutex> g(ev->mu);
        gen = ev->recorded; /* the record most recent at this call */
        if (ev->completed >= gen) return cudaSuccess;
    }
    enqueue(st, [ev, gen] {
        std::unique_lock<std::mutex> lk(ev->mu);
        while (ev->completed < gen && !faulted())
            ev->cv.wait_for(lk, std::chrono::milliseconds(50));
    });
    return cudaSuccess;
}

} /* extern "C" */
