/* nccl.h of the CUDA emulator (tests/cuda_emu/): the NCCL calls of train/dcomm_nccl.c, for
 * ranks that are processes on this machine (up to 64), through shared memory in /dev/shm
 * (emu_nccl.cpp says how). Every operation runs on its stream in queue order; sends and
 * receives match by peer and order as in NCCL; sums are in rank order (deterministic, not
 * NCCL's ring order). A peer process that is gone ends a waiting operation with
 * ncclRemoteError (ncclCommGetAsyncError); ncclCommAbort ends it too. Non-blocking
 * communicators (config.blocking = 0) return ncclInProgress from the init and report the
 * rendezvous through ncclCommGetAsyncError. Reductions: ncclSum of ncclFloat only.
 * Groups: over one communicator and stream, at most one send to each peer; a group in which a
 * call failed runs none of its calls (ncclGroupEnd returns that error).
 */
#ifndef CUDA_EMU_NCCL_H
#define CUDA_EMU_NCCL_H

#include "cuda_runtime_api.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 0
#define NCCL_VERSION_CODE 22800
#define NCCL_UNIQUE_ID_BYTES 128

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7
} ncclResult_t;

typedef enum { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclFloat32 = 7 } ncclDataType_t;
#define ncclFloat ncclFloat32
typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3 } ncclRedOp_t;

typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef struct ncclComm *ncclComm_t;

typedef struct {
    size_t size;
    unsigned magic;
    unsigned version;
    int blocking;
    int cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare;
} ncclConfig_t;

#define NCCL_CONFIG_UNDEF_INT (-2147483647 - 1)
#define NCCL_CONFIG_INITIALIZER                                                                 \
    {                                                                                           \
        sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT,             \
            NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NULL,          \
            NCCL_CONFIG_UNDEF_INT                                                               \
    }

ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
const char *ncclGetErrorString(ncclResult_t r);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer,
                      ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* CUDA_EMU_NCCL_H */
