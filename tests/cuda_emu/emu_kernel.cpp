/* emu_kernel.cpp - the CUDA emulator's kernel executor: launches (configuration checks,
 * pointer checks), the blocks of a grid one after another, the threads of a block as fibers
 * that switch at __syncthreads and at warp shuffles (cuda_runtime.h says what is emulated).
 *
 * Fibers: each thread of a block runs on a stack of its own (mmap'd, with a guard page), and
 * a scheduler on the worker thread resumes every runnable fiber in thread order until it
 * finishes or waits. A warp whose 32 lanes all wait at a shuffle, or a block whose threads
 * all wait at __syncthreads, is released; if neither can happen and threads remain, the
 * kernel has a barrier that some threads never reach - a fault.
 * Direct mode: a block starts with one fiber that runs its threads one after another. That
 * is the order the fibers would run in, so it changes nothing until a thread reaches a
 * barrier: thread 0 then becomes the first fiber of the block and the others start as fibers
 * of their own; a later thread means that the threads before it finished without reaching
 * the barrier - the fault above. Kernels without barriers so cost a call per thread.
 * Shuffles write to one of two slot arrays by the parity of the lane's shuffle count, so one
 * warp barrier per shuffle suffices (no lane can be two shuffles ahead of another).
 * The switch is a few instructions of x86-64 assembly (callee-saved registers and the stack
 * pointer, System V ABI); other machines use ucontext (slower: a system call per switch).
 */
#include "cuda_runtime.h"
#include "emu_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace emu {

thread_local const uint3 *t_tid;
thread_local uint3 t_block_idx;
thread_local uint3 t_block_dim, t_grid_dim;

#define STACK_BYTES ((size_t)128 << 10)
#define PAGE 4096

enum { F_NEW, F_RUN, F_WAIT_BLOCK, F_WAIT_WARP, F_DONE };

struct Fiber {
#if defined(__x86_64__)
    void *sp;
#else
    ucontext_t uc;
#endif
    uint3 tid;
    unsigned lin;    /* linear thread index in the block */
    int state;
    unsigned shuffles; /* shuffles done: its parity picks the slot array */
    char *stack;     /* the base of its mapping (guard page first) */
};

struct Exec {
#if defined(__x86_64__)
    void *sched_sp = nullptr;
#else
    ucontext_t sched_uc;
#endif
    std::vector<Fiber> f;
    std::vector<uint32_t> slot[2]; /* one shuffle value per thread, by parity */
    std::vector<unsigned> warp_wait; /* lanes of each warp waiting at a shuffle */
    unsigned n = 0, block_wait = 0, done = 0;
    bool direct = false;   /* fiber 0 runs the threads one after another */
    unsigned direct_at = 0; /* the thread it runs */
    std::vector<char *> free_stacks;
    Fiber *cur = nullptr;
    void (*body)(void *) = nullptr;
    void *args = nullptr;
    const char *name = "";
    bool bad = false; /* an unsupported use reported during this block */
    int schedule = CUDA_EMU_SCHEDULE_FORWARD;
    unsigned diverged = 0; /* direct mode: the thread that reached a barrier after others ended */
    ~Exec()
    {
        for (char *s : free_stacks) munmap(s, STACK_BYTES + PAGE);
    }
};

static thread_local Exec *t_ex;

#if defined(__x86_64__)
extern "C" void emu_swap(void **save_sp, void *load_sp);
extern "C" void emu_fiber_entry(void);
/* emu_swap: push the callee-saved registers, save rsp in *save_sp, load load_sp, pop the
 * registers saved there and return into that context. emu_fiber_entry: a new fiber's first
 * return lands here with its Fiber * in r12 and its function in r13. */
asm(R"(
    .text
    .p2align 4
    .globl emu_swap
    .type emu_swap, @function
emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_swap, .-emu_swap
    .globl emu_fiber_entry
    .type emu_fiber_entry, @function
emu_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_fiber_entry, .-emu_fiber_entry
)");
#endif

static void fiber_main(Fiber *f)
{
    Exec *ex = t_ex;
    if (ex->direct) {
        /* f is fiber 0; it runs thread after thread until one waits at a barrier */
        for (unsigned i = 0; i < ex->n && ex->direct; i++) {
            ex->direct_at = i;
            ex->cur = &ex->f[i];
            t_tid = &ex->f[i].tid;
            ex->body(ex->args);
            if (ex->direct) ex->done++;
        }
        if (ex->direct) { /* every thread ran to its end: f, the stack's owner, is done */
            ex->direct = false;
            ex->cur = f;
        } else {
            ex->done++; /* thread k (0, or the first of a warp), a fiber of its own since */
        }
    } else {
        ex->body(ex->args);
        ex->done++;
    }
    f = ex->cur; /* direct mode may have handed this stack to a later thread's fiber */
    f->state = F_DONE;
#if defined(__x86_64__)
    void *dead;
    emu_swap(&dead, ex->sched_sp); /* never resumed */
#else
    setcontext(&ex->sched_uc);
#endif
    abort();
}

#if !defined(__x86_64__)
static void fiber_main_uc(unsigned hi, unsigned lo)
{
    fiber_main((Fiber *)(((uintptr_t)hi << 32) | lo));
}
#endif

static char *stack_get(Exec *ex)
{
    if (!ex->free_stacks.empty()) {
        char *s = ex->free_stacks.back();
        ex->free_stacks.pop_back();
        return s;
    }
    void *m = mmap(NULL, STACK_BYTES + PAGE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        say("no memory for a fiber stack of %zu bytes", STACK_BYTES);
        abort();
    }
    mprotect(m, PAGE, PROT_NONE); /* a stack overflow faults here */
    return (char *)m;
}

static void resume(Exec *ex, Fiber *f)
{
    if (f->state == F_NEW) {
        f->stack = stack_get(ex);
#if defined(__x86_64__)
        char *top = f->stack + PAGE + STACK_BYTES; /* 16-aligned */
        void **sp = (void **)(top - 72); /* after the 6 pops and the ret: rsp = top - 16 */
        sp[0] = sp[1] = nullptr;          /* r15, r14 */
        sp[2] = (void *)fiber_main;       /* r13 */
        sp[3] = (void *)f;                /* r12 */
        sp[4] = sp[5] = nullptr;          /* rbx, rbp */
        sp[6] = (void *)emu_fiber_entry;  /* return address */
        f->sp = sp;
#else
        getcontext(&f->uc);
        f->uc.uc_stack.ss_sp = f->stack + PAGE;
        f->uc.uc_stack.ss_size = STACK_BYTES;
        f->uc.uc_link = NULL;
        makecontext(&f->uc, (void (*)())fiber_main_uc, 2, (unsigned)((uintptr_t)f >> 32),
                    (unsigned)(uintptr_t)f);
#endif
    }
    f->state = F_RUN;
    ex->cur = f;
    t_tid = &f->tid;
#if defined(__x86_64__)
    emu_swap(&ex->sched_sp, f->sp);
#else
    swapcontext(&ex->sched_uc, &f->uc);
#endif
    Fiber *ran = ex->cur; /* f, or the thread that direct mode handed f's stack to */
    if (ran->state == F_DONE && ran->stack) {
        ex->free_stacks.push_back(ran->stack);
        ran->stack = nullptr;
    }
}

static void yield(Exec *ex, Fiber *f, int state)
{
    if (ex->direct) {
        /* The block's first barrier. Threads 0 to k - 1 (k = direct_at) finished without
         * one: legal when k is 0, or when k starts a warp and this is that warp's shuffle;
         * thread k then goes on as a fiber of its own, on the stack it runs on, and the
         * threads after it start as fibers. Otherwise threads ended before a barrier that
         * others wait at: the fault that fiber mode finds too. */
        ex->direct = false;
        const unsigned k = ex->direct_at;
        if (k != 0 && (state != F_WAIT_WARP || k % 32 != 0)) {
            ex->diverged = k;
            f = &ex->f[0]; /* the stack's owner: taken back by the fault path */
            f->state = F_WAIT_BLOCK;
            ex->cur = f;
#if defined(__x86_64__)
            emu_swap(&f->sp, ex->sched_sp);
#else
            swapcontext(&f->uc, &ex->sched_uc);
#endif
            abort(); /* never resumed */
        }
        if (k != 0) {
            ex->f[k].stack = ex->f[0].stack;
            ex->f[0].stack = nullptr; /* thread 0 finished long ago */
            ex->f[0].state = F_DONE;
        }
        for (unsigned i = k + 1; i < ex->n; i++) ex->f[i].state = F_NEW;
        f = &ex->f[k];
    }
    f->state = state;
    if (state == F_WAIT_WARP) ex->warp_wait[f->lin / 32]++;
    else ex->block_wait++;
#if defined(__x86_64__)
    emu_swap(&f->sp, ex->sched_sp);
#else
    swapcontext(&f->uc, &ex->sched_uc);
#endif
}

static Exec *exec_of(const char *what)
{
    Exec *ex = t_ex;
    if (!ex || !ex->cur) {
        say("%s outside a kernel", what);
        abort();
    }
    return ex;
}

void syncthreads()
{
    Exec *ex = exec_of("__syncthreads");
    yield(ex, ex->cur, F_WAIT_BLOCK);
}

uint32_t shfl_xor_u32(unsigned mask, uint32_t v, int lane_mask, int width)
{
    Exec *ex = exec_of("__shfl_xor_sync");
    Fiber *f = ex->cur;
    if (mask != 0xffffffffu || width != 32 || lane_mask < 0 || lane_mask > 31) {
        if (!ex->bad)
            say("kernel %s: __shfl_xor_sync(mask %#x, lane mask %d, width %d): only full-mask "
                "shuffles of width 32 are emulated",
                ex->name, mask, lane_mask, width);
        ex->bad = true;
        return v;
    }
    std::vector<uint32_t> &slot = ex->slot[f->shuffles++ & 1u];
    slot[f->lin] = v;
    yield(ex, f, F_WAIT_WARP); /* every lane has written */
    f = ex->cur;                /* (direct mode may have changed which fiber this is) */
    return slot[(f->lin & ~31u) | ((f->lin & 31u) ^ (unsigned)lane_mask)];
}

/* Release warp w when all its 32 lanes wait at a shuffle; true when it did. */
static bool release_warp(Exec *ex, unsigned w)
{
    if (ex->warp_wait[w] != 32) return false;
    for (unsigned i = w * 32; i < w * 32 + 32; i++) ex->f[i].state = F_RUN;
    ex->warp_wait[w] = 0;
    return true;
}

/* The reverse schedule's depth-first warps: while warp w is complete at a shuffle, release
 * it and run its lanes (in reverse) again, before any other warp runs. */
static void run_warp_ahead(Exec *ex, unsigned w)
{
    while (release_warp(ex, w))
        for (unsigned j = w * 32 + 32; j-- > w * 32;)
            if (ex->f[j].state == F_RUN) resume(ex, &ex->f[j]);
}

/* Run one block; 0, or -1 after a fault. Forward: direct mode, then rounds over the fibers
 * in thread order. Reverse: fibers from the start, rounds in reverse thread order, and a
 * warp released at a shuffle runs on at once (so one warp gets ahead of the others). */
static int run_block(Exec *ex)
{
    const unsigned n = ex->n, nwarps = (n + 31) / 32;
    const bool rev = ex->schedule == CUDA_EMU_SCHEDULE_REVERSE;
    for (unsigned i = 0; i < n; i++) {
        ex->f[i].state = i && !rev ? F_DONE : F_NEW; /* direct mode: fiber 0 runs them all */
        ex->f[i].shuffles = 0;
    }
    for (unsigned w = 0; w < nwarps; w++) ex->warp_wait[w] = 0;
    ex->block_wait = ex->done = ex->diverged = 0;
    ex->direct = !rev;
    for (;;) {
        for (unsigned k = 0; k < n; k++) {
            const unsigned i = rev ? n - 1 - k : k;
            Fiber *f = &ex->f[i];
            if (f->state != F_NEW && f->state != F_RUN) continue;
            resume(ex, f);
            if (ex->diverged) break;
            if (rev && f->state == F_WAIT_WARP) run_warp_ahead(ex, i / 32);
        }
        if (ex->bad) {
            fault(cudaErrorLaunchFailure, "kernel %s: an unsupported operation (above)", ex->name);
            return -1;
        }
        if (ex->done == n) return 0;
        bool released = false;
        if (!ex->diverged) {
            for (unsigned w = 0; w < nwarps; w++) released |= release_warp(ex, w);
            if (!released && ex->block_wait == n) {
                for (unsigned i = 0; i < n; i++) ex->f[i].state = F_RUN;
                ex->block_wait = 0;
                released = true;
            }
        }
        if (!released) {
            unsigned at_shfl = 0;
            for (unsigned w = 0; w < nwarps; w++) at_shfl += ex->warp_wait[w];
            if (ex->diverged)
                fault(cudaErrorLaunchFailure,
                      "kernel %s, block (%u,%u,%u) of %u threads: a barrier some threads never "
                      "reach: threads 0 to %u finished before thread %u reached one",
                      ex->name, t_block_idx.x, t_block_idx.y, t_block_idx.z, n,
                      ex->diverged - 1, ex->diverged);
            else
                fault(cudaErrorLaunchFailure,
                      "kernel %s, block (%u,%u,%u) of %u threads: a barrier some threads never "
                      "reach: %u finished, %u wait at __syncthreads, %u at a full-mask warp "
                      "shuffle (a warp of fewer than 32 threads, or lanes that diverged)",
                      ex->name, t_block_idx.x, t_block_idx.y, t_block_idx.z, n, ex->done,
                      ex->block_wait, at_shfl);
            /* the waiting fibers are abandoned; their stacks are taken back */
            for (unsigned i = 0; i < n; i++)
                if (ex->f[i].stack) {
                    ex->free_stacks.push_back(ex->f[i].stack);
                    ex->f[i].stack = nullptr;
                }
            return -1;
        }
    }
}

int run_grid(const char *name, dim3 grid, dim3 block, void (*body)(void *), void *args,
             int schedule)
{
    static thread_local Exec ex;
    t_ex = &ex;
    const unsigned n = block.x * block.y * block.z;
    ex.n = n;
    ex.f.resize(n);
    ex.slot[0].assign(n, 0);
    ex.slot[1].assign(n, 0);
    ex.warp_wait.assign((n + 31) / 32, 0);
    ex.body = body;
    ex.args = args;
    ex.name = name;
    ex.bad = false;
    ex.schedule = schedule;
    for (unsigned i = 0; i < n; i++) {
        ex.f[i].lin = i;
        ex.f[i].tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        ex.f[i].stack = nullptr;
    }
    t_block_dim = uint3{block.x, block.y, block.z};
    t_grid_dim = uint3{grid.x, grid.y, grid.z};
    int rc = 0;
    const unsigned long long nb = (unsigned long long)grid.x * grid.y * grid.z;
    for (unsigned long long b = 0; b < nb && !rc; b++) {
        const unsigned long long q = schedule == CUDA_EMU_SCHEDULE_REVERSE ? nb - 1 - b : b;
        t_block_idx = uint3{(unsigned)(q % grid.x), (unsigned)(q / grid.x % grid.y),
                            (unsigned)(q / grid.x / grid.y)};
        rc = run_block(&ex);
    }
    ex.cur = nullptr;
    t_tid = nullptr;
    return rc;
}

int launch_check(const char *name, dim3 g, dim3 b, size_t smem, cudaStream_t s)
{
    cudaError_t e = api_enter(name);
    if (e) return 1;
    if (!stream_get(s)) {
        ret(cudaErrorInvalidResourceHandle);
        return 1;
    }
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (!g.x || !g.y || !g.z || !b.x || !b.y || !b.z || threads > 1024 || b.z > 64 ||
        g.x > 2147483647u || g.y > 65535 || g.z > 65535 || smem > (48u << 10)) {
        say("kernel %s: invalid configuration: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of "
            "dynamic shared memory",
            name, g.x, g.y, g.z, b.x, b.y, b.z, smem);
        ret(cudaErrorInvalidConfiguration);
        return 1;
    }
    return 0;
}

void launch_enqueue(const char *name, dim3 grid, dim3 block, cudaStream_t s,
                    std::shared_ptr<void> args, void (*body)(void *), std::vector<const void *> ptrs)
{
    auto st = stream_get(s);
    const int dev = stream_device(st.get());
    const int schedule = cudaEmuGetSchedule(); /* the one in force at the launch */
    enqueue(st, [=] {
        if (faulted()) return;
        for (size_t i = 0; i < ptrs.size(); i++) {
            if (!ptrs[i]) continue;
            int d = -1;
            int k = range_kind(ptrs[i], 0, &d, NULL);
            if (k != MEM_DEVICE || d != dev) {
                fault(cudaErrorIllegalAddress,
                      "kernel %s: pointer argument %zu (%p) is not memory of device %d when the "
                      "kernel starts",
                      name, i + 1, ptrs[i], dev);
                return;
            }
        }
        if (run_grid(name, grid, block, body, args.get(), schedule)) return;
        for (const void *p : ptrs)
            if (p && guards_ok(p, name)) return;
    });
}

} // namespace emu
