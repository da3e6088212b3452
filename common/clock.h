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

/* *ts = now + seconds (>= 0) on `clock`, normalized: the absolute deadline of a
 * pthread_cond_timedwait (CLOCK_MONOTONIC for a condition variable made with
 * pthread_condattr_setclock(CLOCK_MONOTONIC), CLOCK_REALTIME for one with default attributes). */
static inline void clock_deadline_in(clockid_t clock, struct timespec *ts, double seconds)
{
    clock_gettime(clock, ts);
    time_t whole = (time_t)seconds;
    ts->tv_sec += whole;
    ts->tv_nsec += (long)((seconds - (double)whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

#endif /* COMMON_CLOCK_H */
