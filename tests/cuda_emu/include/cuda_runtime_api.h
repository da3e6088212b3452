/* cuda_runtime_api.h of the CUDA emulator (tests/cuda_emu/): the subset of the CUDA runtime
 * API that train/device_cuda.c, train/dcomm_nccl.c, kernels/cuda/ and tests/gpu/ call, run on
 * the CPU so that the CUDA build of the product is exercised without a GPU (meson option
 * gpu_emu; docs/CUDA.md "The CUDA emulator").
 *
 * Semantics follow the CUDA Runtime API reference (CUDA 13.0), with these choices:
 * - Device memory is host memory from the emulator's allocator, filled with 0xFF bytes (a NaN
 *   pattern) at cudaMalloc, fenced by 256-byte guards (NaN as float, bf16 and double, so that
 *   a read past the end poisons its result) checked after every operation that wrote it. It
 *   is only "device memory" by the emulator's registry: copies, memsets, kernels and cuBLAS
 *   calls refuse pointers outside a live allocation of the right kind, when queued and again
 *   when they run (a stream-ordered free on another stream may have come first).
 * - Each stream is a worker thread running its operations in order; events, cross-stream
 *   waits and host functions behave as on a GPU, so ordering mistakes show as races.
 * - Errors: argument errors return at once and set the calling thread's last error; a fault
 *   while an operation runs (a pointer outside its allocation, a guard overwritten, a
 *   __syncthreads some threads never reach) is sticky, as an illegal address is on a GPU:
 *   every later call returns it. Each fault prints one "cuda-emu:" line on stderr.
 * - CUDA_EMU_DEVICES (default 1) devices of CUDA_EMU_MEM_GIB (default 16) GiB each, sm_90.
 *
 * Thread-safety: as CUDA (any thread may call; the current device is per thread).
 */
#ifndef CUDA_EMU_RUNTIME_API_H
#define CUDA_EMU_RUNTIME_API_H

#include <stddef.h>

#define CUDA_EMU 1
#define CUDART_VERSION 13000

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotPermitted = 800,
    cudaErrorUnknown = 999
} cudaError_t;

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *userData);

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3
};

struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
};

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem; /* bytes */
    int major, minor;
    int multiProcessorCount;
    int maxThreadsPerBlock;
    int warpSize;
    size_t sharedMemPerBlock; /* bytes */
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01
#define cudaHostRegisterDefault 0x00
#define cudaHostRegisterPortable 0x01

const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceSynchronize(void);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p);

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamGetDevice(cudaStream_t s, int *device);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user);

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);

/* The emulator's own (not CUDA): the order in which later launches run their threads.
 * FORWARD (the default): blocks and threads in index order. REVERSE: blocks and threads in
 * reverse, and a warp released at a shuffle runs on before the other warps - a different,
 * equally legal order, so a kernel whose result depends on the order (a race, an unordered
 * accumulation) gives other bits or values under it. CUDA_EMU_SCHEDULE=reverse in the
 * environment sets it at start. Thread-safe; takes effect at the next launch. */
#define CUDA_EMU_SCHEDULE_FORWARD 0
#define CUDA_EMU_SCHEDULE_REVERSE 1
void cudaEmuSetSchedule(int schedule);
int cudaEmuGetSchedule(void);

#ifdef __cplusplus
}
#endif

#endif /* CUDA_EMU_RUNTIME_API_H */
