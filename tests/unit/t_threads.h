/* t_threads.h - for the C tests that run ranks (ckpt engines) on threads of one process
 * (test_ckpt_group.c, test_ckpt_stage_device.c). Include it once per test program: under
 * ThreadSanitizer it defines the program's __tsan_default_suppressions.
 *
 * ThreadSanitizer: liburing (2.3 here) maps and unmaps its rings with raw system calls that
 * TSan does not intercept. When one rank's writer unmaps its ring and another rank's thread
 * gets a new ring at the same address, TSan takes the new ring's SQE/CQE accesses for a race
 * with the old ring's (a two-thread program that only creates and drops its own rings shows
 * the same). Location suppressions do not match those mappings, so the two functions that
 * touch ring memory are exempted; a writer is private to one persist, and a real race on its
 * state would also show in store_writer_append/close.
 *
 * t_deadline_in gives the absolute deadline of a pthread_cond_timedwait.
 */
#ifndef T_THREADS_H
#define T_THREADS_H

#include <time.h>

#if defined(__SANITIZE_THREAD__)
#define T_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define T_TSAN 1
#endif
#endif
#ifdef T_TSAN
const char *__tsan_default_suppressions(void);
const char *__tsan_default_suppressions(void)
{
    return "race:w_queue\nrace:w_complete\n";
}
#endif

/* *ts = now + s seconds (s >= 0) on clock: CLOCK_REALTIME for a condition variable with the
 * default attributes, the clock given to pthread_condattr_setclock otherwise. */
static inline void t_deadline_in(clockid_t clock, struct timespec *ts, double s)
{
    clock_gettime(clock, ts);
    double whole = (double)(time_t)s;
    ts->tv_sec += (time_t)s;
    ts->tv_nsec += (long)((s - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

#endif /* T_THREADS_H */
