/* clock.h - the monotonic clock in seconds: for deadlines, timeouts and durations (never wall
 * time, which can jump). Thread-safe; header only. */
#ifndef COMMON_CLOCK_H
#define COMMON_CLOCK_H

#include <time.h>

/* Seconds on CLOCK_MONOTONIC (an arbitrary origin: only differences mean anything). */
static inline double clock_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* COMMON_CLOCK_H */
