/* anyccl's kernels compiled for the host: the kernel source of kernels-common (allreduce.h, fused.h, push.h,
 * quant.h, fused_push.h) over its host vendor layer (vendor_host.h), instantiated as kernels-cuda and kernels-hip
 * instantiate it, and a runner that executes a launch on the CPU. The fake HIP runtime (and the fake CUDA driver
 * over it) calls anyccl_host_launch for every kernel launch it runs, so the tests on the fakes exercise the very
 * arithmetic and flag protocol the GPUs run, and compare it with the independent Rust host references.
 *
 * Execution: the threads of a block are coroutines of the calling OS thread, switched at __syncthreads,
 * at the shuffles and at the pause between two polls of a flag. Blocks run one after another on that thread, which
 * matches every kernel whose block b only waits for block b of its peers; a kernel whose blocks wait for other
 * blocks of a peer (the fused push one-shot: rows are read by block, pushed by grid thread) runs its blocks on one
 * OS thread each. When every running thread of a block polls without progress, the runner sleeps in `run->sleep`
 * (woken by `run->stored` from a peer's store, or by the caller), and after `run->timeout_ms` without progress it
 * gives up: the block's abort word reads as set from then on, so the kernel's own abort path ends it. */

#include "anyccl/vendor_host.h"
#include "anyccl/allreduce.h"
#include "anyccl/fused.h"
#include "anyccl/push.h"
#include "anyccl/quant.h"
#include "anyccl/fused_push.h"

ANYCCL_ALLREDUCE_KERNELS(f32, anyccl_f32)
ANYCCL_ALLREDUCE_KERNELS(f16, anyccl_f16)
ANYCCL_ALLREDUCE_KERNELS(bf16, anyccl_bf16)
ANYCCL_FUSED_KERNELS(f16, anyccl_f16)
ANYCCL_FUSED_KERNELS(bf16, anyccl_bf16)
ANYCCL_PUSH_KERNELS(f32, anyccl_f32)
ANYCCL_PUSH_KERNELS(f16, anyccl_f16)
ANYCCL_PUSH_KERNELS(bf16, anyccl_bf16)
ANYCCL_QUANT_KERNELS(f32, anyccl_f32)
ANYCCL_QUANT_KERNELS(f16, anyccl_f16)
ANYCCL_QUANT_KERNELS(bf16, anyccl_bf16)
ANYCCL_FUSED_PUSH_KERNELS(f16, anyccl_f16)
ANYCCL_FUSED_PUSH_KERNELS(bf16, anyccl_bf16)

#include <pthread.h>
#include <sched.h>
#include <utility>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>

#include "host_kernels.h"

thread_local anyccl_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace {

/* ---- The kernels by name: each called with kernelParams-style arguments (one pointer per parameter) ---- */

template <typename... A, size_t... I>
void call_with(void (*k)(A...), void** p, std::index_sequence<I...>) {
    k(*static_cast<A*>(p[I])...);
}
template <typename... A>
void call(void (*k)(A...), void** p) {
    call_with(k, p, std::index_sequence_for<A...>{});
}

struct Entry {
    const char* name;
    void (*run)(void**);
};
#define E(K) {#K, [](void** p) { call(K, p); }}
#define ALLREDUCE(N)                                                                                                 \
    E(anyccl_one_shot_##N), E(anyccl_one_shot_table_##N), E(anyccl_two_shot_##N), E(anyccl_two_shot_table_##N)
#define FUSED(N)                                                                                                     \
    E(anyccl_fused_one_shot_##N), E(anyccl_fused_one_shot_table_##N), E(anyccl_fused_two_shot_##N),                  \
        E(anyccl_fused_two_shot_table_##N), E(anyccl_rmsnorm_##N), E(anyccl_fused_push_one_shot_##N)
#define PUSH_QUANT(N)                                                                                                \
    E(anyccl_push_one_shot_##N), E(anyccl_push_two_shot_##N), E(anyccl_quant_two_shot_fp8_##N),                      \
        E(anyccl_quant_two_shot_int8_##N)
const Entry entries[] = {ALLREDUCE(f32), ALLREDUCE(f16), ALLREDUCE(bf16), FUSED(f16),     FUSED(bf16),
                         PUSH_QUANT(f32), PUSH_QUANT(f16), PUSH_QUANT(bf16)};

/* ---- Switching between the threads of a block ----
 *
 * x86-64: a hand-written switch of the callee-saved registers, the stack pointer and the floating-point control
 * words (no system call, unlike swapcontext, which saves the signal mask each time). Elsewhere: ucontext. */

#if defined(__x86_64__)
extern "C" void anyccl_host_switch(void** save_sp, void* to_sp);
extern "C" void anyccl_host_trampoline();
asm(R"(
    .text
    .globl anyccl_host_switch
    .type anyccl_host_switch, @function
anyccl_host_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size anyccl_host_switch, .-anyccl_host_switch
    .hidden anyccl_host_switch
    .globl anyccl_host_trampoline
    .type anyccl_host_trampoline, @function
anyccl_host_trampoline:
    callq *%r12
    ud2
    .size anyccl_host_trampoline, .-anyccl_host_trampoline
    .hidden anyccl_host_trampoline
)");
struct Context {
    void* sp;
};
/* A context that runs `fn` on the stack [base, base + size) when first switched to; `fn` never returns. */
void make_context(Context* c, char* base, size_t size, void (*fn)()) {
    uintptr_t top = ((uintptr_t)(base + size)) & ~(uintptr_t)15;
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 16 - 64);
    uint32_t csr[2];
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
    memcpy(&sp[0], csr, 8);                                     /* mxcsr, x87 control word */
    sp[1] = sp[2] = sp[3] = sp[5] = sp[6] = 0;                   /* r15, r14, r13, rbx, rbp */
    sp[4] = (uint64_t)(uintptr_t)fn;                             /* r12: what the trampoline calls */
    sp[7] = (uint64_t)(uintptr_t)anyccl_host_trampoline;         /* where the switch returns to */
    c->sp = sp;
}
void switch_context(Context* from, Context* to) { anyccl_host_switch(&from->sp, to->sp); }
#else
struct Context {
    ucontext_t uc;
    bool made;
};
void make_context(Context* c, char* base, size_t size, void (*fn)()) {
    if (!c->made) {
        getcontext(&c->uc);
        c->made = true;
    }
    c->uc.uc_stack.ss_sp = base;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, fn, 0);
}
void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
#endif

/* ---- Threads of a block as coroutines ---- */

constexpr unsigned MAX_THREADS = 512;
constexpr size_t STACK = 64 * 1024; /* reserved per thread; only the pages a thread touches are backed */

enum State { RUNNING, AT_SYNC, AT_GROUP, DONE };

struct Block {
    anyccl_host_run* run;
    void (*kernel)(void**);
    void** params;
    unsigned n;      /* threads */
    unsigned cur;    /* the running thread */
    unsigned live;   /* threads not done */
    unsigned synced; /* threads waiting in __syncthreads */
    State state[MAX_THREADS];
    unsigned group_arrived[MAX_THREADS]; /* by the group's first lane */
    float exchange[MAX_THREADS];
    /* Polls since the last progress (a thread passing a sync point or ending); >= the running threads: stuck. */
    unsigned idle;
    int waiting; /* counted in run->waiting */
    timespec stuck_since;
    Context sched;
};

/* A thread's stacks and contexts, reused by every block the OS thread runs. */
struct Lanes {
    char* stacks;
    Context ctx[MAX_THREADS];
};
pthread_key_t lanes_key;
pthread_once_t lanes_once = PTHREAD_ONCE_INIT;
void free_lanes(void* p) {
    Lanes* l = static_cast<Lanes*>(p);
    munmap(l->stacks, STACK * MAX_THREADS);
    free(l);
}
Lanes* lanes() {
    pthread_once(&lanes_once, [] { pthread_key_create(&lanes_key, free_lanes); });
    Lanes* l = static_cast<Lanes*>(pthread_getspecific(lanes_key));
    if (l) return l;
    void* s = mmap(nullptr, STACK * MAX_THREADS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (s == MAP_FAILED) return nullptr;
    l = static_cast<Lanes*>(calloc(1, sizeof(Lanes)));
    if (!l) {
        munmap(s, STACK * MAX_THREADS);
        return nullptr;
    }
    l->stacks = static_cast<char*>(s);
    pthread_setspecific(lanes_key, l);
    return l;
}

thread_local Block* current;
/* Counts the stores peers may poll for (every run's): a block about to sleep sleeps only if none came since its
 * last polls began. */
unsigned stores;
thread_local Lanes* current_lanes;

/* Back to the scheduler; returns when this thread is scheduled again. */
void yield() {
    Block* b = current;
    switch_context(&current_lanes->ctx[b->cur], &b->sched);
}

void progress(Block* b) {
    b->idle = 0;
    if (b->waiting) {
        b->waiting = 0;
        b->run->waiting(-1);
    }
}

void lane_main() {
    Block* b = current;
    b->kernel(b->params);
    b->state[b->cur] = DONE;
    b->live--;
    progress(b);
    /* Threads that ended no longer count at __syncthreads. */
    if (b->synced > 0 && b->synced == b->live) {
        for (unsigned t = 0; t < b->n; t++)
            if (b->state[t] == AT_SYNC) b->state[t] = RUNNING;
        b->synced = 0;
    }
    /* Back to the scheduler for good (a thread that is done is never scheduled again). */
    switch_context(&current_lanes->ctx[b->cur], &b->sched);
}

double seconds_since(const timespec& t) {
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t.tv_sec) + (double)(now.tv_nsec - t.tv_nsec) * 1e-9;
}

/* Runs block `bx` of the launch to its end on this OS thread. 0, or -1 when the thread stacks could not be had. */
int run_block(anyccl_host_run* run, void (*kernel)(void**), void** params, unsigned grid, unsigned bx, unsigned n) {
    Lanes* l = lanes();
    if (!l) return -1;
    Block* b = static_cast<Block*>(calloc(1, sizeof(Block)));
    if (!b) return -1;
    b->run = run, b->kernel = kernel, b->params = params, b->n = n, b->live = n;
    current = b;
    current_lanes = l;
    blockIdx = {bx, 0, 0};
    blockDim = {n, 1, 1};
    gridDim = {grid, 1, 1};
    for (unsigned t = 0; t < n; t++) {
        make_context(&l->ctx[t], l->stacks + STACK * t, STACK, lane_main);
    }
    unsigned stuck_passes = 0;
    while (b->live > 0) {
        const unsigned seen = __atomic_load_n(&stores, __ATOMIC_SEQ_CST);
        bool ran = false;
        for (unsigned t = 0; t < n; t++) {
            if (b->state[t] != RUNNING) continue;
            ran = true;
            b->cur = t;
            threadIdx = {t, 0, 0};
            switch_context(&b->sched, &l->ctx[t]);
        }
        if (!ran) break; /* every live thread waits at a sync point no other thread will reach */
        unsigned running = 0;
        for (unsigned t = 0; t < n; t++) running += b->state[t] == RUNNING;
        if (running == 0 || b->idle < running) {
            stuck_passes = 0;
            continue;
        }
        /* Every running thread polled once without progress: the block waits for a peer. */
        if (!b->waiting) {
            b->waiting = 1;
            clock_gettime(CLOCK_MONOTONIC, &b->stuck_since);
            run->waiting(1);
        }
        if (!__atomic_load_n(&run->timed_out, __ATOMIC_RELAXED) &&
            seconds_since(b->stuck_since) * 1000.0 >= (double)run->timeout_ms)
            __atomic_store_n(&run->timed_out, 1, __ATOMIC_RELAXED);
        const bool stopping = __atomic_load_n(&run->timed_out, __ATOMIC_RELAXED) ||
                              (run->abort_word && __atomic_load_n(run->abort_word, __ATOMIC_RELAXED));
        /* Stopping: the polls run on at full speed until the kernel's own abort check ends them. Else the CPU goes to
         * the peers: a yield first (a peer on this machine's few cores is often just behind), then sleeps. */
        if (!stopping) {
            if (++stuck_passes < 32) sched_yield();
            else run->sleep(2, &stores, seen);
        }
        b->idle = 0;
    }
    progress(b);
    current = nullptr;
    free(b);
    return 0;
}

struct Launch {
    anyccl_host_run* run;
    void (*kernel)(void**);
    void** params;
    unsigned grid, bx, n;
    int rc;
};
void* block_thread(void* p) {
    Launch* l = static_cast<Launch*>(p);
    l->rc = run_block(l->run, l->kernel, l->params, l->grid, l->bx, l->n);
    return nullptr;
}

} // namespace

extern "C" {

void anyccl_host_syncthreads(void) {
    Block* b = current;
    progress(b);
    if (++b->synced == b->live) {
        for (unsigned t = 0; t < b->n; t++)
            if (b->state[t] == AT_SYNC) b->state[t] = RUNNING;
        b->synced = 0;
        return;
    }
    b->state[b->cur] = AT_SYNC;
    yield();
}

/* Waits until the `width` threads of the group starting at `first` have all arrived. */
static void group_wait(Block* b, unsigned first, unsigned width) {
    progress(b);
    if (++b->group_arrived[first] == width) {
        for (unsigned t = first; t < first + width; t++)
            if (b->state[t] == AT_GROUP) b->state[t] = RUNNING;
        b->group_arrived[first] = 0;
        return;
    }
    b->state[b->cur] = AT_GROUP;
    yield();
}

float anyccl_host_shfl_xor(float v, int mask, int width) {
    Block* b = current;
    const unsigned t = b->cur, w = (unsigned)width, first = t & ~(w - 1);
    b->exchange[t] = v;
    group_wait(b, first, w);
    const float r = b->exchange[first + ((t - first) ^ (unsigned)mask)];
    /* Nobody overwrites its value (a next shuffle) before the group has read them all. */
    group_wait(b, first, w);
    return r;
}

void anyccl_host_spin_pause(void) {
    Block* b = current;
    b->idle++;
    yield();
}

uint32_t anyccl_host_ld_volatile(const uint32_t* addr) {
    const uint32_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    anyccl_host_run* run = current->run;
    if (addr == run->abort_word) {
        if (__atomic_load_n(&run->timed_out, __ATOMIC_RELAXED)) return 1;
        if (v) __atomic_store_n(&run->aborted, 1, __ATOMIC_RELAXED);
    }
    return v;
}

void anyccl_host_stored(void) {
    __atomic_add_fetch(&stores, 1, __ATOMIC_SEQ_CST);
    current->run->stored();
}

int anyccl_host_launch(const char* name, void** params, unsigned grid, unsigned block, int parallel,
                       struct anyccl_host_run* run) {
    void (*kernel)(void**) = nullptr;
    for (const Entry& e : entries)
        if (strcmp(e.name, name) == 0) kernel = e.run;
    if (!kernel) return -1;
    if (block < 1 || block > MAX_THREADS || grid < 1) return -2;
    if (!parallel || grid == 1) {
        for (unsigned bx = 0; bx < grid; bx++)
            if (run_block(run, kernel, params, grid, bx, block)) return -3;
        return 0;
    }
    Launch* ls = static_cast<Launch*>(calloc(grid, sizeof(Launch)));
    pthread_t* ts = static_cast<pthread_t*>(calloc(grid, sizeof(pthread_t)));
    int rc = ls && ts ? 0 : -3;
    unsigned started = 0;
    for (; started < grid && rc == 0; started++) {
        ls[started] = Launch{run, kernel, params, grid, started, block, 0};
        if (pthread_create(&ts[started], nullptr, block_thread, &ls[started])) {
            rc = -3;
            break;
        }
    }
    for (unsigned bx = 0; bx < started; bx++) {
        pthread_join(ts[bx], nullptr);
        if (ls[bx].rc) rc = -3;
    }
    free(ls);
    free(ts);
    return rc;
}

} // extern "C"
