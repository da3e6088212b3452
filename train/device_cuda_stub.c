/* The CUDA kind when the build has no CUDA (no nvcc at configure time): every entry point
 * says so. Only count and open are ever called: no CUDA device can be opened. */
#include "device_internal.h"
#include "log.h"

#include <errno.h>

static int stub_count(void) { return -ENOTSUP; }

static int stub_open(train_device **out, int ordinal, char *why, size_t why_len)
{
    (void)out, (void)ordinal;
    log_why(why, why_len, "--device cuda: this build has no CUDA (nvcc was not found when it was "
                          "configured; see meson option cuda)");
    return -ENOTSUP;
}

const train_device_ops train_device_cuda_ops = {
    .kind = TRAIN_DEVICE_CUDA,
    .count = stub_count,
    .open = stub_open,
};
