#include "thread.h"

void common_signals_block_async(sigset_t *old)
{
    sigset_t all;
    sigfillset(&all);
    static const int synchronous[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS};
    for (size_t i = 0; i < sizeof synchronous / sizeof synchronous[0]; i++)
        sigdelset(&all, synchronous[i]);
    pthread_sigmask(SIG_BLOCK, &all, old);
}

int common_thread_start(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    sigset_t old;
    common_signals_block_async(&old); /* the new thread inherits the mask */
    int rc = pthread_create(thread, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return -rc;
}
