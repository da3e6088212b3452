/* emu_nccl.cpp - the CUDA emulator's NCCL (nccl.h says what and how).
 *
 * The ranks are processes on this machine. A communicator is a shared-memory header,
 * /dev/shm/cuda-emu-nccl-<id> (<id>: the unique id's first 8 bytes in hex), with each rank's
 * pid and counters, and one data region per rank, <header>-r<rank>, grown as needed. Every
 * operation runs on the stream's worker thread, in the order the rank queued it:
 *   collective k: write the input into the own region, post k, wait until every rank posted
 *     k, compute the output from the regions (sums in rank order), mark k consumed, wait
 *     until every rank consumed k (the regions may then be written again);
 *   group of sends and receives: write every send into the own region with a directory (per
 *     peer: offset, bytes, the pair's message number), post; each receive waits for the
 *     peer's post of that message number and copies it; then wait until every peer consumed
 *     this rank's messages. Sends and receives match by peer and order, as in NCCL.
 * Waits poll every 50 us. A peer whose process is gone (no such pid, or a zombie) makes the
 * waiting operation end with ncclRemoteError, reported by ncclCommGetAsyncError, as NCCL
 * reports a peer that closed its connections; ncclCommAbort ends a waiting operation. The
 * files of a communicator are removed by the destroy or abort of its last rank alive (with
 * the regions of ranks that were killed); a job killed whole leaves them in /dev/shm.
 */
#include "nccl.h"
#include "emu_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define MAXR 64

using namespace emu;

namespace {

struct Dir {
    uint64_t off, bytes, msg; /* a send to this peer: where in the region, its number */
};

struct RankHdr {
    std::atomic<int> pid;
    std::atomic<int> out; /* it left (destroy, abort) or stopped on an error: waits end */
    std::atomic<uint64_t> coll_posted, coll_consumed;
    std::atomic<uint64_t> sent[MAXR];     /* messages to each peer posted */
    std::atomic<uint64_t> received[MAXR]; /* messages to each peer consumed (the peer writes) */
    Dir dir[MAXR];                        /* this rank's posted group: per destination */
};

struct Hdr {
    std::atomic<int> nranks, joined, left;
    RankHdr r[MAXR];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "process-shared atomics");

} // namespace

struct ncclComm {
    int nranks = 1, rank = 0, device = 0;
    char base[96] = "";
    Hdr *h = nullptr;
    int fd = -1;                    /* this rank's region */
    size_t cap = 0;                 /* its size */
    uint64_t coll = 0;              /* collectives queued */
    uint64_t to[MAXR] = {0}, from[MAXR] = {0}; /* messages queued to / expected from each peer */
    std::atomic<int> aborted{0};
    std::atomic<int> async{ncclSuccess};
    int init_done = 0;
    char last[256] = "";
};

namespace {

thread_local int t_group = 0;
thread_local ncclResult_t t_group_err = ncclSuccess; /* a call of the open group failed */
struct P2p {
    bool send;
    void *buf;
    size_t bytes;
    int peer;
    ncclComm_t comm;
    cudaStream_t s;
};
thread_local std::vector<P2p> t_p2p;

/* Communicators, kept alive by the operations queued on them (an abort may free the handle's
 * reference while one waits). */
std::vector<std::shared_ptr<ncclComm>> &comms()
{
    static auto *v = new std::vector<std::shared_ptr<ncclComm>>;
    return *v;
}
std::mutex &comms_mu()
{
    static auto *m = new std::mutex;
    return *m;
}
std::shared_ptr<ncclComm> ref(ncclComm_t c)
{
    std::lock_guard<std::mutex> g(comms_mu());
    for (auto &p : comms())
        if (p.get() == c) return p;
    return nullptr;
}

size_t tsize(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclInt32:
    case ncclFloat32: return 4;
    }
    return 0;
}

void nap(void)
{
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
}

/* Keep the communicator's first error and tell the peers that this rank stopped, so that
 * their waits end (as a closed connection does in NCCL) instead of running to a timeout. */
void fail(ncclComm *c, ncclResult_t r)
{
    int expect = ncclSuccess;
    c->async.compare_exchange_strong(expect, (int)r);
    if (c->h) c->h->r[c->rank].out.store(1);
}

/* The process is gone: no such pid, or a zombie (killed, not yet reaped by its parent). */
bool gone(int pid)
{
    if (kill(pid, 0) < 0 && errno == ESRCH) return true;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return false;
    buf[n] = 0;
    const char *e = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return e && (e[2] == 'Z' || e[2] == 'X');
}

/* Wait until ready() or the communicator ends: 0, or the NCCL error (also kept async). */
template <typename F> ncclResult_t wait_for(ncclComm *c, F ready, const char *what)
{
    for (unsigned k = 0;; k++) {
        if (ready()) return ncclSuccess;
        if (c->aborted.load()) return ncclInvalidUsage;
        for (int p = 0; p < c->nranks; p++) {
            int pid = c->h->r[p].pid.load();
            const bool out = c->h->r[p].out.load();
            if (p != c->rank && (out || (k % 256 == 255 && pid > 0 && gone(pid)))) {
                    if (ready()) return ncclSuccess; /* its last stores came before `out` */
                    snprintf(c->last, sizeof c->last, "%s: rank %d (pid %d) %s", what, p, pid,
                             out ? "left the communicator" : "is gone");
                    say("NCCL: %s", c->last);
                    fail(c, ncclRemoteError);
                    return ncclRemoteError;
            }
        }
        nap();
    }
}

/* The own region, at least bytes long. */
void *region(ncclComm *c, size_t bytes)
{
    if (bytes > c->cap) {
        /* allocated, not sparse: a full /dev/shm is this error, not a SIGBUS in a copy */
        int e = posix_fallocate(c->fd, 0, (off_t)bytes);
        if (e) {
            snprintf(c->last, sizeof c->last, "growing %s-r%d to %zu bytes: %s", c->base,
                     c->rank, bytes, strerror(e));
            say("NCCL: %s", c->last);
            return nullptr;
        }
        c->cap = bytes;
    }
    return mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd, 0);
}

/* Rank p's region, mapped read-only (at least bytes long, as p posted it). */
const void *peer_region(ncclComm *c, int p, size_t bytes)
{
    char name[128];
    snprintf(name, sizeof name, "%s-r%d", c->base, p);
    int fd = open(name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < bytes) { /* counts differ between ranks */
        snprintf(c->last, sizeof c->last, "rank %d posted fewer bytes than %zu", p, bytes);
        say("NCCL: %s", c->last);
        close(fd);
        return nullptr;
    }
    void *m = mmap(NULL, bytes ? bytes : 1, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    return m == MAP_FAILED ? nullptr : m;
}

ncclResult_t check(ncclComm_t c, const void *p, size_t bytes, cudaStream_t s, const char *call)
{
    if (!c || !ref(c)) return ncclInvalidArgument;
    if (faulted()) return ncclUnhandledCudaError;
    if (!c->init_done) {
        snprintf(c->last, sizeof c->last, "%s: the communicator is still initialising", call);
        return ncclInvalidUsage;
    }
    if (!stream_get(s)) {
        snprintf(c->last, sizeof c->last, "%s: not a live stream", call);
        return ncclInvalidArgument;
    }
    int dev = -1;
    if (bytes && (range_kind(p, bytes, &dev, NULL) != MEM_DEVICE || dev != c->device)) {
        snprintf(c->last, sizeof c->last,
                 "%s: [%p, +%zu) is not inside one allocation of device %d", call, p, bytes,
                 c->device);
        say("%s", c->last);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

enum { C_ALLREDUCE, C_REDUCESCATTER, C_ALLGATHER };

/* A collective on every rank's `in` of in_bytes; see the file's comment. */
ncclResult_t collective(ncclComm_t comm, int kind, const void *in, void *out, size_t count,
                        ncclDataType_t t, cudaStream_t s, const char *call)
{
    const size_t es = tsize(t);
    const size_t in_bytes = count * es * (kind == C_REDUCESCATTER ? comm->nranks : 1);
    const size_t out_bytes = count * es * (kind == C_ALLGATHER ? comm->nranks : 1);
    if (!es) return ncclInvalidArgument;
    if (kind != C_ALLGATHER && t != ncclFloat32) {
        snprintf(comm->last, sizeof comm->last, "%s: only float sums are emulated", call);
        return ncclInvalidArgument;
    }
    ncclResult_t r = check(comm, in, in_bytes, s, call);
    if (r == ncclSuccess) r = check(comm, out, out_bytes, s, call);
    if (r != ncclSuccess) return r;
    auto c = ref(comm);
    const uint64_t k = ++c->coll;
    enqueue(stream_get(s), [c, kind, in, out, count, es, in_bytes, call, k] {
        if (faulted() || c->aborted.load() || c->async.load() != ncclSuccess) return;
        const int W = c->nranks, me = c->rank;
        RankHdr *mine = &c->h->r[me];
        void *reg = region(c.get(), in_bytes);
        if (reg == MAP_FAILED || !reg) {
            fail(c.get(), ncclSystemError);
            return;
        }
        memcpy(reg, in, in_bytes);
        munmap(reg, in_bytes ? in_bytes : 1);
        mine->coll_posted.store(k);
        auto all = [&](std::atomic<uint64_t> RankHdr::*f) {
            for (int p = 0; p < W; p++)
                if ((c->h->r[p].*f).load() < k) return false;
            return true;
        };
        if (wait_for(c.get(), [&] { return all(&RankHdr::coll_posted); }, call)) return;
        std::vector<const void *> regs(W);
        for (int p = 0; p < W; p++)
            if (!(regs[p] = peer_region(c.get(), p, in_bytes))) {
                fail(c.get(), ncclSystemError);
                return;
            }
        if (kind == C_ALLGATHER) {
            for (int p = 0; p < W; p++) memcpy((char *)out + (size_t)p * count * es, regs[p], count * es);
        } else {
            const size_t from = kind == C_REDUCESCATTER ? (size_t)me * count : 0;
            float *o = (float *)out;
            for (size_t i = 0; i < count; i++) {
                float acc = ((const float *)regs[0])[from + i];
                for (int p = 1; p < W; p++) acc += ((const float *)regs[p])[from + i];
                o[i] = acc;
            }
        }
        for (int p = 0; p < W; p++) munmap((void *)regs[p], in_bytes ? in_bytes : 1);
        guards_ok(out, call);
        mine->coll_consumed.store(k);
        wait_for(c.get(), [&] { return all(&RankHdr::coll_consumed); }, call);
    });
    return ncclSuccess;
}

/* The group's sends and receives, queued as one operation per stream. */
ncclResult_t run_group(std::vector<P2p> &ops)
{
    if (ops.empty()) return ncclSuccess;
    ncclComm_t comm = ops[0].comm;
    cudaStream_t s = ops[0].s;
    for (auto &o : ops)
        if (o.comm != comm || o.s != s) {
            say("ncclGroupEnd: a group over several communicators or streams is not emulated");
            return ncclInvalidUsage;
        }
    auto c = ref(comm);
    if (!c) return ncclInvalidArgument;
    struct Msg {
        int peer;
        void *buf;
        size_t bytes;
        uint64_t msg;
        size_t off;
    };
    std::vector<Msg> sends, recvs;
    size_t total = 0;
    for (auto &o : ops) {
        if (o.send) {
            sends.push_back(Msg{o.peer, o.buf, o.bytes, ++c->to[o.peer], total});
            total += (o.bytes + 63) & ~(size_t)63;
        } else {
            recvs.push_back(Msg{o.peer, o.buf, o.bytes, ++c->from[o.peer], 0});
        }
    }
    enqueue(stream_get(s), [c, sends, recvs, total] {
        if (faulted() || c->aborted.load() || c->async.load() != ncclSuccess) return;
        RankHdr *mine = &c->h->r[c->rank];
        if (!sends.empty()) {
            void *reg = region(c.get(), total);
            if (reg == MAP_FAILED || !reg) {
                fail(c.get(), ncclSystemError);
                return;
            }
            for (auto &m : sends) {
                memcpy((char *)reg + m.off, m.buf, m.bytes);
                mine->dir[m.peer] = Dir{m.off, m.bytes, m.msg};
            }
            munmap(reg, total ? total : 1);
            for (auto &m : sends) mine->sent[m.peer].store(m.msg); /* after the directory */
        }
        for (auto &m : recvs) {
            RankHdr *src = &c->h->r[m.peer];
            if (wait_for(c.get(), [&] { return src->sent[c->rank].load() >= m.msg; }, "ncclRecv"))
                return;
            const Dir d = src->dir[c->rank];
            if (d.msg != m.msg || d.bytes != m.bytes) {
                snprintf(c->last, sizeof c->last,
                         "ncclRecv from rank %d: %zu bytes expected, message %llu of %llu bytes "
                         "sent", m.peer, m.bytes, (unsigned long long)d.msg,
                         (unsigned long long)d.bytes);
                say("NCCL: %s", c->last);
                fail(c.get(), ncclInvalidUsage);
                return;
            }
            const char *reg = (const char *)peer_region(c.get(), m.peer, d.off + d.bytes);
            if (!reg) {
                fail(c.get(), ncclSystemError);
                return;
            }
            memcpy(m.buf, reg + d.off, m.bytes);
            munmap((void *)reg, d.off + d.bytes ? d.off + d.bytes : 1);
            guards_ok(m.buf, "ncclRecv");
            src->received[c->rank].store(m.msg);
        }
        for (auto &m : sends) { /* the region may be written again once every peer read it */
            if (wait_for(c.get(), [&] { return mine->received[m.peer].load() >= m.msg; },
                         "ncclSend"))
                return;
        }
    });
    return ncclSuccess;
}

void leave(ncclComm *c)
{
    if (!c->h) return;
    c->h->r[c->rank].out.store(1);
    char name[128];
    snprintf(name, sizeof name, "%s-r%d", c->base, c->rank);
    unlink(name);
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    /* the last to leave removes the header; ranks whose process is gone (killed) never
     * leave: their regions go with it */
    int left = c->h->left.fetch_add(1) + 1, dead = 0;
    for (int p = 0; p < c->nranks; p++) {
        int pid = c->h->r[p].pid.load();
        if (p != c->rank && pid > 0 && gone(pid)) dead++;
    }
    if (left + dead >= c->nranks) {
        for (int p = 0; p < c->nranks; p++) {
            int pid = c->h->r[p].pid.load();
            snprintf(name, sizeof name, "%s-r%d", c->base, p);
            if (p != c->rank && pid > 0 && gone(pid)) unlink(name);
        }
        unlink(c->base);
    }
    munmap(c->h, sizeof(Hdr));
    c->h = nullptr;
}

ncclResult_t drop(ncclComm_t comm, bool abort)
{
    std::shared_ptr<ncclComm> c;
    {
        std::lock_guard<std::mutex> g(comms_mu());
        for (size_t i = 0; i < comms().size(); i++)
            if (comms()[i].get() == comm) {
                c = comms()[i];
                comms().erase(comms().begin() + (long)i);
                break;
            }
    }
    if (!c) return ncclInvalidArgument;
    if (abort) c->aborted.store(1); /* a waiting operation sees it within 50 us */
    /* leave (unmap; the last rank alive removes the files) once no queued operation holds
     * the communicator - at once after a finalize, within a second after an abort, else
     * later on a thread of its own (a wait that does not poll: an operation not started) */
    for (int i = 0; i < 20000 && c.use_count() > 1; i++) nap();
    if (c.use_count() == 1) {
        leave(c.get());
        return ncclSuccess;
    }
    struct Leaver {
        static void run(std::shared_ptr<ncclComm> c)
        {
            while (c.use_count() > 1) nap();
            leave(c.get());
        }
    };
    std::thread(Leaver::run, std::move(c)).detach();
    return ncclSuccess;
}

} // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *version)
{
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id) return ncclInvalidArgument;
    if (getrandom(id->internal, sizeof id->internal, 0) != (ssize_t)sizeof id->internal)
        return ncclSystemError;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

const char *ncclGetLastError(ncclComm_t comm) { return comm ? comm->last : ""; }

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config)
{
    if (!comm) return ncclInvalidArgument;
    *comm = NULL;
    if (nranks < 1 || nranks > MAXR || rank < 0 || rank >= nranks) {
        say("ncclCommInitRankConfig(nranks %d, rank %d): 1 to %d ranks emulated", nranks, rank, MAXR);
        return ncclInvalidArgument;
    }
    if (faulted()) return ncclUnhandledCudaError;
    auto c = std::make_shared<ncclComm>();
    c->nranks = nranks;
    c->rank = rank;
    c->device = current_device();
    const unsigned char *u = (const unsigned char *)id.internal;
    snprintf(c->base, sizeof c->base, "/dev/shm/cuda-emu-nccl-%02x%02x%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7]);
    int hfd = open(c->base, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (hfd < 0 || ftruncate(hfd, sizeof(Hdr)) < 0) {
        say("NCCL: %s: %s", c->base, strerror(errno));
        if (hfd >= 0) close(hfd);
        return ncclSystemError;
    }
    void *m = mmap(NULL, sizeof(Hdr), PROT_READ | PROT_WRITE, MAP_SHARED, hfd, 0);
    close(hfd);
    if (m == MAP_FAILED) return ncclSystemError;
    c->h = (Hdr *)m; /* a new file is zeros: every counter starts at 0 */
    int expect = 0;
    if (!c->h->nranks.compare_exchange_strong(expect, nranks) && expect != nranks) {
        say("ncclCommInitRankConfig: rank %d says %d ranks, another rank said %d", rank, nranks,
            expect);
        munmap(m, sizeof(Hdr));
        return ncclInvalidUsage;
    }
    int zero = 0;
    if (!c->h->r[rank].pid.compare_exchange_strong(zero, (int)getpid())) {
        say("ncclCommInitRankConfig: rank %d joined twice (pid %d, then %d)", rank, zero,
            (int)getpid());
        munmap(m, sizeof(Hdr));
        return ncclInvalidUsage;
    }
    char name[128]; /* the region: truncated only once this rank's slot is ours */
    snprintf(name, sizeof name, "%s-r%d", c->base, rank);
    c->fd = open(name, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (c->fd < 0) {
        c->h->r[rank].out.store(1);
        munmap(m, sizeof(Hdr));
        return ncclSystemError;
    }
    c->h->joined.fetch_add(1);
    {
        std::lock_guard<std::mutex> g(comms_mu());
        comms().push_back(c);
    }
    *comm = c.get();
    const bool blocking = !config || config->blocking != 0;
    if (blocking) {
        while (c->h->joined.load() < nranks) nap();
        c->init_done = 1;
        return ncclSuccess;
    }
    return ncclInProgress; /* ncclCommGetAsyncError reports the rendezvous */
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async)
{
    if (!comm || !async || !ref(comm)) return ncclInvalidArgument;
    if (!comm->init_done) {
        if (comm->h->joined.load() < comm->nranks) {
            for (int p = 0; p < comm->nranks; p++) { /* a rank that joined and went away */
                int pid = comm->h->r[p].pid.load();
                if (p != comm->rank && pid > 0 && (comm->h->r[p].out.load() || gone(pid))) {
                    snprintf(comm->last, sizeof comm->last, "init: rank %d (pid %d) is gone", p, pid);
                    *async = ncclRemoteError;
                    return ncclSuccess;
                }
            }
            *async = ncclInProgress;
            return ncclSuccess;
        }
        comm->init_done = 1;
    }
    ncclResult_t a = (ncclResult_t)comm->async.load();
    *async = a != ncclSuccess ? a : faulted() ? ncclUnhandledCudaError : ncclSuccess;
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm && ref(comm) ? ncclSuccess : ncclInvalidArgument; }

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return drop(comm, false); }

ncclResult_t ncclCommAbort(ncclComm_t comm) { return comm ? drop(comm, true) : ncclSuccess; }

ncclResult_t ncclGroupStart(void)
{
    t_group++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (t_group == 0) return ncclInvalidUsage;
    if (--t_group) return ncclSuccess;
    std::vector<P2p> ops;
    ops.swap(t_p2p);
    ncclResult_t e = t_group_err;
    t_group_err = ncclSuccess;
    return e != ncclSuccess ? e : run_group(ops); /* a group with a failed call: none run */
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s)
{
    if (op != ncclSum) return ncclInvalidArgument;
    return collective(comm, C_ALLREDUCE, send, recv, count, t, s, "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s)
{
    if (op != ncclSum) return ncclInvalidArgument;
    return collective(comm, C_REDUCESCATTER, send, recv, count, t, s, "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s)
{
    return collective(comm, C_ALLGATHER, send, recv, count, t, s, "ncclAllGather");
}

static ncclResult_t p2p(bool send, void *buf, size_t count, ncclDataType_t t, int peer,
                        ncclComm_t comm, cudaStream_t s, const char *call)
{
    if (!comm) return ncclInvalidArgument;
    if (peer < 0 || peer >= comm->nranks) {
        snprintf(comm->last, sizeof comm->last, "%s: peer %d of %d ranks", call, peer,
                 comm->nranks);
        return ncclInvalidArgument;
    }
    ncclResult_t r = check(comm, buf, count * tsize(t), s, call);
    if (r != ncclSuccess) {
        if (t_group && t_group_err == ncclSuccess) t_group_err = r;
        return r;
    }
    for (auto &o : t_p2p)
        if (o.send == send && o.peer == peer && send) {
            snprintf(comm->last, sizeof comm->last, "%s: two sends to rank %d in one group are "
                     "not emulated", call, peer);
            if (t_group && t_group_err == ncclSuccess) t_group_err = ncclInvalidUsage;
            return ncclInvalidUsage;
        }
    t_p2p.push_back(P2p{send, buf, count * tsize(t), peer, comm, s});
    if (t_group) return ncclSuccess;
    std::vector<P2p> ops; /* outside a group: a group of one */
    ops.swap(t_p2p);
    return run_group(ops);
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer,
                      ncclComm_t comm, cudaStream_t s)
{
    return p2p(true, (void *)send, count, t, peer, comm, s, "ncclSend");
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s)
{
    return p2p(false, recv, count, t, peer, comm, s, "ncclRecv");
}

} /* extern "C" */
