/* cuda_runtime.h of the CUDA emulator (tests/cuda_emu/): the runtime API
 * (cuda_runtime_api.h) and, for C++, the kernel language of the .cu files of kernels/cuda, so that
 * those files compile with g++ and their kernels run on the CPU.
 *
 * How a kernel runs: tests/cuda_emu/translate.py rewrites each launch `k<<<grid, block, smem,
 * stream>>>(args)` as `::emu::launcher("k", grid, block, smem, stream).run(k, args)`. The
 * launch checks its configuration as a GPU does (cudaErrorInvalidConfiguration), copies the
 * arguments, and queues the grid on the stream's worker thread. There the blocks run one after
 * another, and the threads of a block in order, each to its end or to its first barrier: from
 * there on as fibers (each with its own stack) that switch only at __syncthreads and warp
 * shuffles - so a barrier that some threads never reach, or a full-mask shuffle in a warp whose
 * lanes diverged, is detected and reported, not silently passed.
 * __shared__ variables are per worker thread (one block runs at a time on it).
 *
 * Orders: threads run in one of two legal orders (cudaEmuSetSchedule, cuda_runtime_api.h):
 * forward, or blocks and threads reversed with one warp run ahead of the others at each
 * shuffle. kernel_check runs each op once in each: a race between warps over shared memory
 * or an order-dependent accumulation across blocks then differs in bits or in value.
 * Not emulated: the GPU's memory model beyond those two orders (threads never interleave
 * between barriers, so a lost update of a read-modify-write race cannot happen here), float
 * intrinsics' accuracy (expf is glibc's), nvcc's exact choice of which a * b + c to fuse
 * into an FMA (g++'s -ffp-contract=fast choice stands in for it), shared memory's garbage at a block's start (a block sees the previous
 * block's values), timing. Only full-mask __shfl_xor_sync.
 */
#ifndef CUDA_EMU_RUNTIME_H
#define CUDA_EMU_RUNTIME_H

#include "cuda_runtime_api.h"

#ifdef __cplusplus
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

/* Kernels and device functions have internal linkage (as without -rdc). */
#define __global__ static
#define __device__ static
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ static thread_local
#define __launch_bounds__(...)

namespace emu {
extern thread_local const uint3 *t_tid; /* the running fiber's threadIdx */
extern thread_local uint3 t_block_idx;
extern thread_local uint3 t_block_dim, t_grid_dim; /* uint3: no TLS constructor */
void syncthreads();
uint32_t shfl_xor_u32(unsigned mask, uint32_t v, int lane_mask, int width);

/* Checks the configuration (sets the thread's last error and returns nonzero when it is
 * invalid), then queues the grid. body runs once per thread; ptrs are the pointer arguments,
 * each checked to lie in live device memory when the grid starts. */
int launch_check(const char *name, dim3 grid, dim3 block, size_t smem, cudaStream_t s);
void launch_enqueue(const char *name, dim3 grid, dim3 block, cudaStream_t s,
                    std::shared_ptr<void> args, void (*body)(void *args),
                    std::vector<const void *> ptrs);

template <typename T> void push_ptr(std::vector<const void *> &v, const T &x)
{
    if constexpr (std::is_pointer_v<T>) v.push_back((const void *)x);
}

struct launcher {
    const char *name;
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
    launcher(const char *n, dim3 g, dim3 b, size_t sm = 0, cudaStream_t s = 0)
        : name(n), grid(g), block(b), smem(sm), stream(s)
    {
    }
    template <typename... P, typename... A> void run(void (*k)(P...), A &&...a)
    {
        if (launch_check(name, grid, block, smem, stream)) return;
        struct pack {
            void (*k)(P...);
            std::tuple<std::decay_t<P>...> t; /* copied at the launch, as CUDA does */
        };
        auto p = std::make_shared<pack>(
            pack{k, std::tuple<std::decay_t<P>...>(static_cast<std::decay_t<P>>(std::forward<A>(a))...)});
        std::vector<const void *> ptrs;
        std::apply([&](const auto &...x) { (push_ptr(ptrs, x), ...); }, p->t);
        launch_enqueue(
            name, grid, block, stream, p,
            [](void *v) {
                pack *q = (pack *)v;
                std::apply(q->k, q->t); /* by value: each thread its own copies */
            },
            std::move(ptrs));
    }
};
} // namespace emu

#define EMU_STR_(x) #x
#define threadIdx (*::emu::t_tid)
#define blockIdx (::emu::t_block_idx)
#define blockDim (::emu::t_block_dim)
#define gridDim (::emu::t_grid_dim)
static const int warpSize = 32;

static inline void __syncthreads(void) { ::emu::syncthreads(); }

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32)
{
    static_assert(sizeof(T) == 4, "cuda-emu: 32-bit shuffles only");
    uint32_t u;
    memcpy(&u, &v, 4);
    u = ::emu::shfl_xor_u32(mask, u, lane_mask, width);
    memcpy(&v, &u, 4);
    return v;
}

/* IEEE round-to-nearest operations that are never contracted into an FMA (as nvcc's): the
 * empty asm statements hide the operands' and the result's origins from the optimizer, so
 * that -ffp-contract=fast (the emulated kernels' nvcc-like default) cannot fuse them. */
#define EMU_OPAQUE(x) __asm__("" : "+x"(x))
static inline float __fadd_rn(float a, float b) { EMU_OPAQUE(a); EMU_OPAQUE(b); float r = a + b; EMU_OPAQUE(r); return r; }
static inline float __fsub_rn(float a, float b) { EMU_OPAQUE(a); EMU_OPAQUE(b); float r = a - b; EMU_OPAQUE(r); return r; }
static inline float __fmul_rn(float a, float b) { EMU_OPAQUE(a); EMU_OPAQUE(b); float r = a * b; EMU_OPAQUE(r); return r; }
static inline float __fdiv_rn(float a, float b) { EMU_OPAQUE(a); EMU_OPAQUE(b); float r = a / b; EMU_OPAQUE(r); return r; }
static inline float __fsqrt_rn(float a) { EMU_OPAQUE(a); float r = sqrtf(a); EMU_OPAQUE(r); return r; }
static inline double __dadd_rn(double a, double b) { EMU_OPAQUE(a); EMU_OPAQUE(b); double r = a + b; EMU_OPAQUE(r); return r; }
static inline double __dmul_rn(double a, double b) { EMU_OPAQUE(a); EMU_OPAQUE(b); double r = a * b; EMU_OPAQUE(r); return r; }
static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif /* __cplusplus */

#endif /* CUDA_EMU_RUNTIME_H */
