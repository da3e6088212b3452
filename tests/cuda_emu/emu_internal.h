/* emu_internal.h - what the CUDA emulator's files share (tests/cuda_emu/; not a public
 * header). The streams, the memory registry, the error rules and the kernel executor. */
#ifndef CUDA_EMU_INTERNAL_H
#define CUDA_EMU_INTERNAL_H

#include "cuda_runtime_api.h"

#include <stddef.h>
#include <stdint.h>

#include <functional>
#include <memory>
#include <vector>

struct dim3;

namespace emu {

struct Stream;

/* Kinds of the registry's ranges. */
enum { MEM_NONE = 0, MEM_DEVICE = 1, MEM_PINNED = 2, MEM_REGISTERED = 3 };

/* Set the calling thread's last error to e (unless e is cudaSuccess) and return e. */
cudaError_t ret(cudaError_t e);

/* At the start of every API call: the sticky fault if there is one, cudaErrorNotPermitted
 * inside a host function (CUDA forbids API calls there), else cudaSuccess. */
cudaError_t api_enter(const char *call);

/* Print one "cuda-emu: " line on stderr (argument errors and faults). */
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A fault while an operation runs: sticky (every later call returns e), one line printed.
 * CUDA_EMU_ABORT=1 aborts instead, for a core dump at the faulting operation. */
void fault(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int faulted(void); /* 1 once a fault happened */

/* The stream of a handle (NULL: the legacy default stream), or an empty pointer when the
 * handle is not a live stream. */
std::shared_ptr<Stream> stream_get(cudaStream_t s);
/* Queue op on s; it runs on s's worker thread after everything queued before it. */
void enqueue(const std::shared_ptr<Stream> &s, std::function<void()> op);
int stream_device(const Stream *s);

/* The registry's kind of [p, p + bytes) when that range lies inside one range of the
 * registry, with its device and base; MEM_NONE when p is in none; -1 when p is in one but
 * the range runs past its end. */
int range_kind(const void *p, size_t bytes, int *device, void **base);
/* Check the guards of the device allocation holding p (if any): 0, or -1 after reporting a
 * fault naming `what`. */
int guards_ok(const void *p, const char *what);

int current_device(void);

/* Run grid (on the calling worker thread): body(args) once per thread. 0, or -1 after a
 * fault. Kernel executor, emu_kernel.cpp. */
int run_grid(const char *name, dim3 grid, dim3 block, void (*body)(void *), void *args,
             int schedule);

} // namespace emu

#endif /* CUDA_EMU_INTERNAL_H */
