/* thread.h - threads that never take the process's signals.
 *
 * A signal sent to the process (SIGTERM from a scheduler, SIGINT from Ctrl-C, SIGCHLD) goes to
 * any one thread that does not block it; Linux picks another thread when the first already has
 * one pending, so two signals sent in a row may run their handlers at once on two threads, and
 * "the first stop request decides" could not hold. Every thread the libraries start therefore
 * blocks the asynchronous signals, and the handlers run on the program's main thread only,
 * one at a time.
 */
#ifndef COMMON_THREAD_H
#define COMMON_THREAD_H

#include <pthread.h>
#include <signal.h>

/* pthread_create(thread, NULL, fn, arg) with every asynchronous signal blocked in the new
 * thread (all but SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT and SIGSYS, which a thread
 * raises itself); the caller's mask is left as it was. Thread-safe.
 * Returns 0, or the negative errno of pthread_create (-EAGAIN, ...). */
int common_thread_start(pthread_t *thread, void *(*fn)(void *), void *arg);

/* Block every asynchronous signal (the set common_thread_start blocks) in the calling thread;
 * old (may be NULL) gets the previous mask, to be restored with pthread_sigmask(SIG_SETMASK).
 * For libraries that start threads of their own (libmicrohttpd's MHD_start_daemon): call this
 * around the call that creates them, so that they inherit the mask. Thread-safe. */
void common_signals_block_async(sigset_t *old);

#endif /* COMMON_THREAD_H */
