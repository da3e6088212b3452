/* emu_nccl.cpp - the CUDA emulator's NCCL for one rank (nccl.h says what and how). */
#include "nccl.h"
#include "emu_internal.h"

#include <stdio.h>
#include <string.h>
#include <sys/random.h>

#include <mutex>
#include <vector>

struct ncclComm {
    int nranks = 1, rank = 0, device = 0;
    int pending_init = 0; /* non-blocking: one ncclInProgress from ncclCommGetAsyncError */
    char last[256] = "";
};

using namespace emu;

namespace {

thread_local int t_group = 0;
struct P2p {
    bool send;
    void *buf;
    size_t bytes;
    ncclComm_t comm;
    cudaStream_t s;
};
thread_local std::vector<P2p> t_p2p;

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

ncclResult_t check(ncclComm_t c, const void *p, size_t bytes, cudaStream_t s, const char *call)
{
    if (!c) return ncclInvalidArgument;
    if (faulted()) return ncclUnhandledCudaError;
    if (!stream_get(s)) {
        snprintf(c->last, sizeof c->last, "%s: not a live stream", call);
        return ncclInvalidArgument;
    }
    if (bytes && range_kind(p, bytes, NULL, NULL) != MEM_DEVICE) {
        snprintf(c->last, sizeof c->last, "%s: [%p, +%zu) is not inside one device allocation",
                 call, p, bytes);
        say("%s", c->last);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

ncclResult_t copy(ncclComm_t c, const void *src, void *dst, size_t bytes, cudaStream_t s,
                  const char *call)
{
    ncclResult_t r = check(c, src, bytes, s, call);
    if (r == ncclSuccess) r = check(c, dst, bytes, s, call);
    if (r != ncclSuccess || !bytes || src == dst) return r;
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s) == cudaSuccess
               ? ncclSuccess
               : ncclUnhandledCudaError;
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
    (void)id;
    if (!comm) return ncclInvalidArgument;
    *comm = NULL;
    if (nranks != 1 || rank != 0) {
        say("ncclCommInitRankConfig(nranks %d, rank %d): the emulator has one rank only", nranks,
            rank);
        return ncclInvalidUsage;
    }
    if (faulted()) return ncclUnhandledCudaError;
    ncclComm_t c = new ncclComm;
    c->device = current_device();
    *comm = c;
    if (config && config->blocking == 0) {
        c->pending_init = 1;
        return ncclInProgress;
    }
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async)
{
    if (!comm || !async) return ncclInvalidArgument;
    if (comm->pending_init) {
        comm->pending_init = 0;
        *async = ncclInProgress;
    } else {
        *async = faulted() ? ncclUnhandledCudaError : ncclSuccess;
    }
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm ? ncclSuccess : ncclInvalidArgument; }

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm) return ncclInvalidArgument;
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart(void)
{
    t_group++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (t_group == 0) return ncclInvalidUsage;
    if (--t_group) return ncclSuccess;
    /* one rank: each send to self pairs with the next receive from self, in order */
    std::vector<P2p> ops;
    ops.swap(t_p2p);
    std::vector<P2p> sends, recvs;
    for (auto &o : ops) (o.send ? sends : recvs).push_back(o);
    if (sends.size() != recvs.size()) return ncclInvalidUsage;
    for (size_t i = 0; i < sends.size(); i++) {
        if (sends[i].bytes != recvs[i].bytes) return ncclInvalidUsage;
        ncclResult_t r = copy(recvs[i].comm, sends[i].buf, recvs[i].buf, sends[i].bytes,
                              recvs[i].s, "ncclRecv");
        if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s)
{
    (void)op;
    return copy(comm, send, recv, count * tsize(t), s, "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s)
{
    (void)op;
    return copy(comm, send, recv, count * tsize(t), s, "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s)
{
    return copy(comm, send, recv, count * tsize(t), s, "ncclAllGather");
}

static ncclResult_t p2p(bool send, void *buf, size_t count, ncclDataType_t t, int peer,
                        ncclComm_t comm, cudaStream_t s, const char *call)
{
    if (!comm) return ncclInvalidArgument;
    if (peer != 0) {
        snprintf(comm->last, sizeof comm->last, "%s: peer %d of a one-rank communicator", call,
                 peer);
        return ncclInvalidArgument;
    }
    ncclResult_t r = check(comm, buf, count * tsize(t), s, call);
    if (r != ncclSuccess) return r;
    P2p o{send, buf, count * tsize(t), comm, s};
    if (t_group) {
        t_p2p.push_back(o);
        return ncclSuccess;
    }
    return ncclInvalidUsage; /* a lone send or receive to self never completes */
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
