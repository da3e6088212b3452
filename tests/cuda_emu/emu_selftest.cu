/* emu_selftest.cu - the CUDA emulator's own test (suite unit of a gpu_emu build): what it
 * must compute, and each mistake it exists to catch, caught. A kernel, compiled by nvcc, would
 * behave the same on a GPU for the passing cases; the faults are the emulator's reports.
 *
 * Faults are sticky (as on a GPU), so each case runs in a child process of its own (forked
 * before any CUDA call: the streams' worker threads do not survive a fork).
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>

static int checks, fails;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        checks++;                                                                                  \
        if (!(cond)) {                                                                             \
            fails++;                                                                               \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                            \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

/* Block-wide sum: warp butterflies, then warp 0 over the warp sums (as kern_cuda.cu). */
__global__ void k_block_sum(const float *x, float *out, int n)
{
    __shared__ float sh[32];
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v += x[blockIdx.x * n + i];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (threadIdx.x == 0) out[blockIdx.x] = t;
    }
}

/* Thread 0 leaves before the barrier the others wait at. */
__global__ void k_early_exit(float *x)
{
    if (threadIdx.x == 0) return;
    __syncthreads();
    x[threadIdx.x] = 1.0f;
}

__global__ void k_fill(float *x, size_t n, float v)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

__global__ void k_shfl(float *x)
{
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}

/* Warp 0 leaves; warp 1 shuffles: legal (the shuffle's warp is whole). */
__global__ void k_warp_exit(float *x)
{
    if (threadIdx.x < 32) return;
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}

/* A block max, then a block sum, sharing sh (kern_cuda.cu's block_max/block_sum); with
 * `racy`, without the barrier before the sum's write to sh, which may still be read for the
 * max: a warp that gets ahead overwrites it. */
__device__ float wsum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ float wmax(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__global__ void k_max_then_sum(const float *x, float *out, int racy)
{
    __shared__ float sh[32];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
    float v = wmax(x[threadIdx.x]);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float mx = wmax(lane < nw ? sh[lane] : -INFINITY);
    float s = wsum(x[threadIdx.x] - mx);
    if (!racy) __syncthreads();
    if (lane == 0) sh[w] = s;
    __syncthreads();
    float t = wsum(lane < nw ? sh[lane] : 0.0f);
    if (threadIdx.x == 0) out[0] = t;
    if (threadIdx.x == 0) out[1] = mx;
}

/* Reads one element past the end of x. */
__global__ void k_read_past(const float *x, float *out, int n)
{
    if (threadIdx.x == 0) out[0] = x[0] + x[n];
}

__global__ void k_2d(int *out)
{
    const int i = (blockIdx.y * gridDim.x + blockIdx.x) * (blockDim.x * blockDim.y) +
                  threadIdx.y * blockDim.x + threadIdx.x;
    out[i] = (int)(threadIdx.x + 10 * threadIdx.y + 100 * blockIdx.x + 1000 * blockIdx.y);
}

static cudaStream_t stream(void)
{
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) abort();
    return s;
}

static float *dev_floats(size_t n)
{
    void *p = NULL;
    if (cudaMalloc(&p, n * sizeof(float)) != cudaSuccess) abort();
    return (float *)p;
}

static int count_maps(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    int n = 0;
    char line[512];
    while (f && fgets(line, sizeof line, f)) n++;
    if (f) fclose(f);
    return n;
}

/* ---- cases that must work */

static void case_compute(void)
{
    cudaStream_t s = stream();
    const int rows = 3, n = 1000;
    float *h = (float *)malloc(sizeof(float) * rows * n), got[3];
    double want[3] = {0, 0, 0};
    for (int i = 0; i < rows * n; i++) want[i / n] += (h[i] = (float)(i % 7) - 3.0f);
    float *x = dev_floats((size_t)rows * n), *o = dev_floats(rows);
    CHECK(cudaMemcpyAsync(x, h, sizeof(float) * rows * n, cudaMemcpyHostToDevice, s) == cudaSuccess, "h2d");
    k_block_sum<<<rows, 256, 0, s>>>(x, o, n);
    CHECK(cudaGetLastError() == cudaSuccess, "launch");
    CHECK(cudaMemcpyAsync(got, o, sizeof got, cudaMemcpyDeviceToHost, s) == cudaSuccess, "d2h");
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
    for (int r = 0; r < rows; r++) CHECK(got[r] == (float)want[r], "row %d: %g vs %g", r, got[r], want[r]);

    int *d2 = NULL, h2[2 * 3 * 4 * 2];
    CHECK(cudaMalloc((void **)&d2, sizeof h2) == cudaSuccess, "malloc");
    k_2d<<<dim3(2, 3), dim3(4, 2), 0, s>>>(d2);
    CHECK(cudaMemcpyAsync(h2, d2, sizeof h2, cudaMemcpyDeviceToHost, s) == cudaSuccess, "d2h");
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
    CHECK(h2[0] == 0 && h2[1] == 1 && h2[4] == 10 && h2[8] == 100 && h2[47] == 2113,
          "2-D indices: %d %d %d %d %d", h2[0], h2[1], h2[4], h2[8], h2[47]);

    float *wx = dev_floats(64), hw[64];
    k_warp_exit<<<1, 64, 0, s>>>(wx);
    CHECK(cudaMemcpyAsync(hw, wx, sizeof hw, cudaMemcpyDeviceToHost, s) == cudaSuccess &&
              cudaStreamSynchronize(s) == cudaSuccess, "a warp leaves, the next one shuffles");
    CHECK(hw[32] == 33.0f && hw[33] == 32.0f && hw[63] == 62.0f, "shuffle after a warp left: %g %g",
          hw[32], hw[33]);

    /* a read one past the end meets the guard: NaN, which poisons the result */
    float one = 1.0f, rp = 0.0f, *px = dev_floats(4), *po = dev_floats(1);
    cudaMemcpyAsync(px, &one, 4, cudaMemcpyHostToDevice, s);
    k_read_past<<<1, 32, 0, s>>>(px, po, 4);
    cudaMemcpyAsync(&rp, po, 4, cudaMemcpyDeviceToHost, s);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && rp != rp, "a read past the end: %g, not NaN", rp);

    /* the reverse schedule: the same results for a correct kernel, other ones for a racy one */
    float hx[128], res[2][2][2];
    for (int i = 0; i < 128; i++) hx[i] = (float)((i * 37) % 11) - 5.0f;
    hx[127] = 100.0f; /* the maximum in the last warp: the one the reverse schedule runs ahead */
    float *dx = dev_floats(128), *dr = dev_floats(2);
    cudaMemcpyAsync(dx, hx, sizeof hx, cudaMemcpyHostToDevice, s);
    for (int racy = 0; racy < 2; racy++)
        for (int sched = 0; sched < 2; sched++) {
            cudaEmuSetSchedule(sched ? CUDA_EMU_SCHEDULE_REVERSE : CUDA_EMU_SCHEDULE_FORWARD);
            k_max_then_sum<<<1, 128, 0, s>>>(dx, dr, racy);
            cudaMemcpyAsync(res[racy][sched], dr, 8, cudaMemcpyDeviceToHost, s);
            CHECK(cudaStreamSynchronize(s) == cudaSuccess, "max then sum");
        }
    cudaEmuSetSchedule(CUDA_EMU_SCHEDULE_FORWARD);
    CHECK(!memcmp(res[0][0], res[0][1], 8), "correct kernel: %g vs %g under the reverse schedule",
          res[0][0][0], res[0][1][0]);
    CHECK(memcmp(res[1][0], res[1][1], 8) != 0, "racy kernel: the reverse schedule shows no difference");

    /* many launches: the fiber stacks are given back (a leak ran out of mappings) */
    const int maps0 = count_maps();
    for (int i = 0; i < 3000; i++) k_fill<<<2, 64, 0, s>>>(wx, 64, 1.0f);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "3000 launches");
    CHECK(count_maps() < maps0 + 50, "%d mappings after 3000 launches, %d before", count_maps(), maps0);

    /* cuBLAS: C (2x2) = A (2x3) B (3x2), column-major, and beta 0 does not read C (NaN) */
    cublasHandle_t hb;
    CHECK(cublasCreate(&hb) == CUBLAS_STATUS_SUCCESS && cublasSetStream(hb, s) == CUBLAS_STATUS_SUCCESS, "cublas");
    float A[6] = {1, 2, 3, 4, 5, 6}, B[6] = {1, 0, 1, 0, 1, 1}, Cg[4], zero = 0;
    float *dA = dev_floats(6), *dB = dev_floats(6), *dC = dev_floats(4); /* dC: 0xFF, NaN */
    cudaMemcpyAsync(dA, A, sizeof A, cudaMemcpyHostToDevice, s);
    cudaMemcpyAsync(dB, B, sizeof B, cudaMemcpyHostToDevice, s);
    CHECK(cublasSgemm(hb, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, dA, 2, dB, 3, &zero, dC, 2) ==
              CUBLAS_STATUS_SUCCESS, "sgemm");
    cudaMemcpyAsync(Cg, dC, sizeof Cg, cudaMemcpyDeviceToHost, s);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
    CHECK(Cg[0] == 6 && Cg[1] == 8 && Cg[2] == 8 && Cg[3] == 10, "gemm %g %g %g %g", Cg[0], Cg[1], Cg[2], Cg[3]);
    CHECK(cublasSgemm(hb, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, dA, 1, dB, 3, &zero, dC, 2) ==
              CUBLAS_STATUS_INVALID_VALUE, "lda below m");
    cublasDestroy(hb);
    CHECK(cudaFree(x) == cudaSuccess && cudaFree(o) == cudaSuccess, "free");
    free(h);
}

static std::atomic<int> gate{0};
static void wait_gate(void *) { while (!gate.load()) usleep(1000); }
static void set_flag(void *p) { *(int *)p = 1; }
static cudaError_t in_fn_err = cudaSuccess;
static void call_api(void *) { int n; in_fn_err = cudaGetDeviceCount(&n) == cudaSuccess ? cudaSetDevice(0) : cudaErrorUnknown; }

static void case_order(void)
{
    cudaStream_t a = stream(), b = stream();
    cudaEvent_t e;
    CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess, "event");
    CHECK(cudaEventQuery(e) == cudaSuccess, "an event never recorded is complete");
    int flag = 0;
    cudaLaunchHostFunc(a, wait_gate, NULL); /* a is held until gate opens */
    cudaEventRecord(e, a);
    cudaStreamWaitEvent(b, e, 0);
    cudaLaunchHostFunc(b, set_flag, &flag);
    usleep(50000);
    CHECK(cudaStreamQuery(a) == cudaErrorNotReady && cudaEventQuery(e) == cudaErrorNotReady &&
              cudaStreamQuery(b) == cudaErrorNotReady, "held streams are not ready");
    CHECK(cudaGetLastError() == cudaErrorNotReady, "not ready stays as the last error (CUDA may)");
    CHECK(cudaGetLastError() == cudaSuccess, "and is cleared by reading it");
    CHECK(flag == 0, "b waited for the event");
    gate = 1;
    CHECK(cudaStreamSynchronize(b) == cudaSuccess && flag == 1, "b ran after a's event");
    cudaLaunchHostFunc(a, call_api, NULL);
    CHECK(cudaStreamSynchronize(a) == cudaSuccess, "sync");
    CHECK(in_fn_err == cudaErrorNotPermitted, "an API call in a host function: %d", in_fn_err);
    cudaEventDestroy(e);
}

static void case_arg_errors(void)
{
    cudaStream_t s = stream();
    float *d = dev_floats(16), h[16] = {0}, *d2 = dev_floats(16);
    CHECK(cudaMemcpyAsync(d, d2, 64, cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue,
          "HostToDevice from device memory");
    CHECK(cudaMemcpyAsync(h, d, 64, cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue,
          "HostToDevice into host memory");
    CHECK(cudaMemcpyAsync(d + 8, h, 64, cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue,
          "a copy running past the allocation");
    CHECK(cudaMemsetAsync(h, 0, 64, s) == cudaErrorInvalidValue, "memset of host memory");
    CHECK(cudaGetLastError() == cudaErrorInvalidValue && cudaGetLastError() == cudaSuccess,
          "argument errors are the last error, not sticky");
    k_fill<<<1, 2048, 0, s>>>(d, 16, 1.0f);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads per block");
    CHECK(cudaMemcpyAsync(h, d, 64, cudaMemcpyDeviceToHost, s) == cudaSuccess &&
              cudaStreamSynchronize(s) == cudaSuccess, "still usable");
    unsigned char *bytes = (unsigned char *)h;
    CHECK(bytes[0] == 0xFF && bytes[63] == 0xFF, "cudaMalloc'd memory is not zeroed (0xFF)");
    CHECK(cudaFree(h) == cudaErrorInvalidValue, "cudaFree of host memory");
    void *pin;
    CHECK(cudaHostAlloc(&pin, 4096, cudaHostAllocPortable) == cudaSuccess, "pinned");
    CHECK(cudaHostRegister(pin, 100, 0) == cudaErrorHostMemoryAlreadyRegistered, "pinned twice");
    CHECK(cudaHostUnregister(h) == cudaErrorHostMemoryNotRegistered, "unregister unregistered");
    cudaPointerAttributes at;
    CHECK(cudaPointerGetAttributes(&at, pin) == cudaSuccess && at.type == cudaMemoryTypeHost, "pinned attrs");
    CHECK(cudaPointerGetAttributes(&at, d + 3) == cudaSuccess && at.type == cudaMemoryTypeDevice && at.device == 0, "device attrs");
    CHECK(cudaPointerGetAttributes(&at, h) == cudaSuccess && at.type == cudaMemoryTypeUnregistered, "pageable attrs");
    CHECK(cudaFreeHost(pin) == cudaSuccess, "free pinned");
}

/* ---- faults: each child must end with the sticky error named */

static void fault_barrier(void)
{
    cudaStream_t s = stream();
    float *d = dev_floats(64);
    k_early_exit<<<1, 64, 0, s>>>(d);
    CHECK(cudaStreamSynchronize(s) == cudaErrorLaunchFailure, "a barrier thread 0 never reaches");
}

static void fault_partial_warp(void)
{
    cudaStream_t s = stream();
    float *d = dev_floats(48);
    k_shfl<<<1, 48, 0, s>>>(d);
    CHECK(cudaStreamSynchronize(s) == cudaErrorLaunchFailure, "full-mask shuffle in a warp of 16");
}

static void fault_out_of_bounds(void)
{
    cudaStream_t s = stream();
    float *d = dev_floats(100);
    k_fill<<<1, 128, 0, s>>>(d, 101, 2.0f); /* one element past the end */
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress, "a write past the end");
    CHECK(cudaMalloc((void **)&d, 4) == cudaErrorIllegalAddress, "sticky: later calls fail");
}

static void fault_host_pointer(void)
{
    cudaStream_t s = stream();
    static float h[64];
    k_fill<<<1, 64, 0, s>>>(h, 64, 2.0f);
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress, "a kernel given host memory");
}

static void fault_use_after_free(void)
{
    cudaStream_t s = stream();
    void *p;
    CHECK(cudaMallocAsync(&p, 256, s) == cudaSuccess, "malloc async");
    CHECK(cudaFreeAsync(p, s) == cudaSuccess, "free async");
    k_fill<<<1, 64, 0, s>>>((float *)p, 64, 2.0f);
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress, "a kernel after the stream-ordered free");
}

static void fault_copy_freed_source(void)
{
    cudaStream_t s = stream(), t = stream();
    void *p;
    static float h[1 << 18];
    CHECK(cudaMallocAsync(&p, sizeof h, t) == cudaSuccess, "malloc async");
    cudaLaunchHostFunc(s, wait_gate, NULL); /* s is held while t frees the source */
    CHECK(cudaMemcpyAsync(h, p, sizeof h, cudaMemcpyDeviceToHost, s) == cudaSuccess, "queued");
    CHECK(cudaFreeAsync(p, t) == cudaSuccess && cudaStreamSynchronize(t) == cudaSuccess, "freed");
    gate = 1;
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress, "a copy from a source freed first");
}

static void fault_gemm_bounds(void)
{
    cudaStream_t s = stream();
    cublasHandle_t hb;
    cublasCreate(&hb);
    cublasSetStream(hb, s);
    float *A = dev_floats(6), *B = dev_floats(6), *C = dev_floats(3), one = 1, zero = 0;
    CHECK(cublasSgemm(hb, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, A, 2, B, 3, &zero, C, 2) ==
              CUBLAS_STATUS_SUCCESS, "queued");
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress, "C of 3 floats for a 2x2 result");
}

static int run_case(const char *name, void (*fn)(void))
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        checks = fails = 0;
        fn();
        printf("%-22s %d checks, %d failed\n", name, checks, fails);
        fflush(stdout);
        _exit(fails ? 1 : 0);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAIL %s: the case's process ended with status %#x\n", name, st);
        return 1;
    }
    return 0;
}

int main(void)
{
    alarm(120); /* every wait in here has a bound */
    int bad = 0;
    bad += run_case("compute", case_compute);
    bad += run_case("order", case_order);
    bad += run_case("argument errors", case_arg_errors);
    bad += run_case("fault: barrier", fault_barrier);
    bad += run_case("fault: partial warp", fault_partial_warp);
    bad += run_case("fault: out of bounds", fault_out_of_bounds);
    bad += run_case("fault: host pointer", fault_host_pointer);
    bad += run_case("fault: use after free", fault_use_after_free);
    bad += run_case("fault: gemm bounds", fault_gemm_bounds);
    bad += run_case("fault: freed source", fault_copy_freed_source);
    printf("emu_selftest: %s\n", bad ? "FAILED" : "all cases passed");
    return bad ? 1 : 0;
}
