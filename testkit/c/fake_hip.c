/* A fake HIP runtime for tests: host memory stands in for device memory, streams run their work at once, and
 * stream capture records that work into graphs that replay it. It enforces the capture rules of HIP (the same as
 * CUDA's): while a stream captures in global mode anywhere, or in any mode on the calling thread, "potentially
 * unsafe" calls (allocation, free, synchronous copies, IPC get/open/close, peer enabling, module load/unload) fail
 * with hipErrorStreamCaptureUnsupported (900), invalidate the capture, and are recorded as violations;
 * synchronising a capturing stream or an event recorded in one is a violation too. Kernel launches and
 * hipStreamWriteValue32 are stream work, legal during capture. It runs anyccl's kernels (the one-shot and
 * two-shot all-reduce, the push one-shot and two-shot, the fused all-reduce + RMSNorm forms and the separate RMSNorm
 * kernel, the fused push one-shot, the quantized two-shots: kernel_kinds below) from their own source, compiled for
 * the host (host_kernels.cpp over kernels-common's vendor_host.h), ranks being threads of this process (see
 * "anyccl's kernels" below), records every launch, and refuses (with a violation) launches the real kernels could
 * not run. Tests read the records through the fakehip_* functions (fake_hip.rs wraps them). Every call is counted
 * by name. Nothing here is thread-safe beyond the mutexes around the records. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "host_kernels.h"

typedef int hipError_t;
#define MAX_STREAMS 256
#define MAX_RECORDS 256

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char violations[MAX_RECORDS][200];
static int n_violations;
static struct { char name[64]; int n; } calls[MAX_RECORDS];
static int n_call_names;

static void count_call(const char* name) {
    pthread_mutex_lock(&mu);
    int i;
    for (i = 0; i < n_call_names; i++)
        if (strcmp(calls[i].name, name) == 0) break;
    if (i == n_call_names && n_call_names < MAX_RECORDS) {
        snprintf(calls[i].name, sizeof calls[i].name, "%s", name);
        calls[i].n = 0; /* the slot may hold a count from before the last reset */
        n_call_names++;
    }
    if (i < MAX_RECORDS) calls[i].n++;
    pthread_mutex_unlock(&mu);
}

void fakehip_add_violation(const char* call, const char* why) {
    pthread_mutex_lock(&mu);
    if (n_violations < MAX_RECORDS) snprintf(violations[n_violations++], 200, "%s: %s", call, why);
    pthread_mutex_unlock(&mu);
}
int fakehip_violation_count(void) { return n_violations; }
const char* fakehip_violation(int i) { return i >= 0 && i < n_violations ? violations[i] : ""; }
int fakehip_call_count(const char* name) {
    for (int i = 0; i < n_call_names; i++)
        if (strcmp(calls[i].name, name) == 0) return calls[i].n;
    return 0;
}
/* Live allocations (hipMemGetAddressRange, IPC handles, the kernels' bounds checks), each with a serial id so a
 * handle of freed memory is refused even when a later allocation reuses the address; tests can make the next
 * hipMalloc "succeed" with a null pointer or make the reported ranges shorter than the allocations, as a broken
 * runtime might. */
struct alloc {
    uintptr_t base;
    size_t size;  /* rounded up to pages, as hipMemGetAddressRange reports it */
    size_t asked; /* what hipMalloc was asked for: the kernels' bounds */
    uint64_t id;
};
static struct alloc* allocs;
static int n_allocs, cap_allocs;
static uint64_t next_alloc_id = 1;
static int next_malloc_null;
static size_t range_shrink;
void fakehip_next_malloc_null(void) { next_malloc_null = 1; }
void fakehip_set_range_shrink(size_t bytes) { range_shrink = bytes; }
static void reset_launches(void);
void fakehip_reset(void) {
    pthread_mutex_lock(&mu);
    n_violations = 0;
    n_call_names = 0;
    next_malloc_null = 0;
    range_shrink = 0;
    reset_launches();
    pthread_mutex_unlock(&mu);
}
/* The live allocation holding [p, p + n) within the bytes hipMalloc was asked for, or NULL. Called locked. */
static const struct alloc* alloc_holding(uintptr_t p, size_t n) {
    for (int i = 0; i < n_allocs; i++)
        if (p >= allocs[i].base && p - allocs[i].base < allocs[i].asked && n <= allocs[i].asked - (p - allocs[i].base))
            return &allocs[i];
    return NULL;
}

typedef void (*work_fn)(void* arg);
struct node {
    work_fn fn;
    void* arg;
    size_t arg_size;
    int async; /* may wait for other ranks: runs on the stream's worker thread (the kernels) */
    struct node* next;
};
/* Work runs on the calling thread at once, as before, except for work that may wait for other ranks (the
 * kernels): that runs on the stream's own worker thread, as a kernel runs on a GPU while the host goes
 * on, and whatever is enqueued on the stream after it waits in the stream's queue behind it. While the queue is
 * not empty, hipStreamQuery answers hipErrorNotReady, hipStreamSynchronize, hipEventSynchronize and
 * hipStreamDestroy wait, and hipFree and hipModuleUnload wait for every stream of the calling thread's current
 * device (as HIP's free waits for the device; other devices, i.e. other ranks, go on). The null stream runs
 * everything on the calling thread. */
struct stream {
    int device;
    int capturing;
    int mode; /* 0 global, 1 thread-local, 2 relaxed */
    int invalidated;
    pthread_t owner;
    struct node *head, *tail;
    /* The queue of work behind asynchronous work, under amu. */
    struct node *qhead, *qtail;
    int running;      /* the worker runs a work now */
    int sync_running; /* a work runs on an enqueuing thread now */
    int stop, has_worker;
    pthread_t worker;
};
struct graph {
    struct node* head;
};

static struct stream* streams[MAX_STREAMS];
static int global_captures;
static __thread int thread_captures;
static __thread int current_device;
/* The calling thread's capture interaction mode (hipThreadExchangeStreamCaptureMode): 0 global (the default),
 * 1 thread-local, 2 relaxed. */
static __thread int thread_mode;

static int device_count(void) {
    const char* e = getenv("FAKEHIP_DEVICES");
    return e ? atoi(e) : 8;
}

static void invalidate_captures(void) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] && streams[i]->capturing) streams[i]->invalidated = 1;
}

/* A potentially unsafe call, refused as HIP (and CUDA) refuse it: in the thread's default global mode while a
 * global-mode capture runs anywhere or this thread captures; in thread-local mode only while this thread captures;
 * never in relaxed mode. */
static hipError_t unsafe_call(const char* name) {
    count_call(name);
    int blocked = thread_mode == 2   ? 0
                  : thread_mode == 1 ? thread_captures > 0
                                     : global_captures > 0 || thread_captures > 0;
    if (blocked) {
        fakehip_add_violation(name, "potentially unsafe call during stream capture");
        invalidate_captures();
        return 900;
    }
    return 0;
}

static struct node* copy_node(const struct node* n) {
    struct node* c = calloc(1, sizeof *c);
    c->fn = n->fn;
    c->async = n->async;
    c->arg_size = n->arg_size;
    c->arg = malloc(n->arg_size ? n->arg_size : 1);
    memcpy(c->arg, n->arg, n->arg_size);
    return c;
}

static pthread_mutex_t amu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t acv = PTHREAD_COND_INITIALIZER;
static int stream_pending(const struct stream* st) {
    return st->qhead != NULL || st->running || st->sync_running;
}
static void* stream_worker(void* arg) {
    struct stream* st = arg;
    pthread_mutex_lock(&amu);
    for (;;) {
        while (!st->stop && (st->qhead == NULL || st->sync_running)) pthread_cond_wait(&acv, &amu);
        if (st->qhead == NULL) break; /* stopping, and nothing left */
        struct node* n = st->qhead;
        st->qhead = n->next;
        if (!st->qhead) st->qtail = NULL;
        st->running = 1;
        pthread_mutex_unlock(&amu);
        n->fn(n->arg);
        free(n->arg);
        free(n);
        pthread_mutex_lock(&amu);
        st->running = 0;
        pthread_cond_broadcast(&acv);
    }
    pthread_mutex_unlock(&amu);
    return NULL;
}
/* Waits until `st`'s queue is empty (when `st` is NULL: that of every stream of `device`). */
static void drain(const struct stream* st, int device) {
    pthread_mutex_lock(&amu);
    for (;;) {
        int pending = 0;
        if (st) {
            pending = stream_pending(st);
        } else {
            for (int i = 0; i < MAX_STREAMS && !pending; i++)
                pending = streams[i] && streams[i]->device == device &&
                          (streams[i]->qhead != NULL || streams[i]->running);
        }
        if (!pending) break;
        pthread_cond_wait(&acv, &amu);
    }
    pthread_mutex_unlock(&amu);
}

/* Runs `n` in stream order on a stream that is not capturing: now on this thread, or on the stream's worker when
 * it may wait for other ranks or work is queued there already. */
static int run_or_queue(struct stream* st, const struct node* n) {
    pthread_mutex_lock(&amu);
    if (n->async || stream_pending(st)) {
        struct node* c = copy_node(n);
        if (st->qtail) st->qtail->next = c; else st->qhead = c;
        st->qtail = c;
        int start = !st->has_worker;
        st->has_worker = 1;
        pthread_cond_broadcast(&acv);
        pthread_mutex_unlock(&amu);
        if (start && pthread_create(&st->worker, NULL, stream_worker, st) != 0) {
            fakehip_add_violation("fake HIP", "could not start a stream's worker thread");
            pthread_mutex_lock(&amu);
            st->has_worker = 0;
            pthread_mutex_unlock(&amu);
            return 2;
        }
        return 0;
    }
    st->sync_running++;
    pthread_mutex_unlock(&amu);
    n->fn(n->arg);
    pthread_mutex_lock(&amu);
    st->sync_running--;
    pthread_cond_broadcast(&acv);
    pthread_mutex_unlock(&amu);
    return 0;
}

/* Runs `fn(arg)` in stream order: now, or recorded into the stream's capture. `arg` is copied. Used by the fake
 * RCCL for its "kernels". */
static int enqueue(void* s, work_fn fn, const void* arg, size_t size, int async) {
    struct stream* st = s;
    struct node n = {fn, (void*)arg, size, async, NULL};
    if (st && st->capturing) {
        struct node* c = copy_node(&n);
        if (st->tail) st->tail->next = c; else st->head = c;
        st->tail = c;
        return 0;
    }
    if (!st && (global_captures > 0 || thread_captures > 0)) {
        fakehip_add_violation("enqueue on the null stream", "the legacy stream cannot be used during capture");
        invalidate_captures();
        return 900;
    }
    if (st) return run_or_queue(st, &n);
    fn((void*)arg);
    return 0;
}
int fakehip_enqueue(void* s, work_fn fn, const void* arg, size_t size) { return enqueue(s, fn, arg, size, 0); }

int fakehip_is_capturing(void* s) { return s && ((struct stream*)s)->capturing; }
int fakehip_any_capture(void) { return global_captures > 0 || thread_captures > 0; }

hipError_t hipGetDeviceCount(int* n) {
    count_call("hipGetDeviceCount");
    *n = device_count();
    return *n > 0 ? 0 : 100;
}
hipError_t hipSetDevice(int d) {
    count_call("hipSetDevice");
    if (d < 0 || d >= device_count()) return 101;
    current_device = d;
    return 0;
}
hipError_t hipGetDevice(int* d) {
    count_call("hipGetDevice");
    *d = current_device;
    return 0;
}
/* hipDeviceGetAttribute: the compute-unit count (hipDeviceAttributeMultiprocessorCount, 63): FAKEHIP_CUS or 104
 * (an MI210); other attributes are not known to the fake (hipErrorInvalidValue). */
hipError_t hipDeviceGetAttribute(int* value, int attr, int d) {
    count_call("hipDeviceGetAttribute");
    if (d < 0 || d >= device_count()) return 101;
    if (!value || attr != 63) return 1;
    const char* e = getenv("FAKEHIP_CUS");
    *value = e ? atoi(e) : 104;
    return 0;
}
hipError_t hipDeviceGetName(char* name, int len, int d) {
    count_call("hipDeviceGetName");
    snprintf(name, len, "Fake AMD Instinct %d", d);
    return 0;
}
/* Writes the name at offset 0 and gcnArchName further in, as the real struct does (offsets differ per HIP). */
hipError_t hipGetDeviceProperties(void* p, int d) {
    count_call("hipGetDeviceProperties");
    if (d < 0 || d >= device_count()) return 101;
    char* b = p;
    snprintf(b, 256, "Fake AMD Instinct %d", d);
    const char* arch = getenv("FAKEHIP_ARCH");
    snprintf(b + 1160, 256, "%s", arch ? arch : "gfx90a:sramecc+:xnack-");
    return 0;
}
hipError_t hipRuntimeGetVersion(int* v) {
    count_call("hipRuntimeGetVersion");
    *v = 70051831;
    return 0;
}
const char* hipGetErrorString(hipError_t e) {
    switch (e) {
        case 0: return "hipSuccess";
        case 1: return "hipErrorInvalidValue";
        case 2: return "hipErrorOutOfMemory";
        case 100: return "hipErrorNoDevice";
        case 101: return "hipErrorInvalidDevice";
        case 200: return "hipErrorInvalidImage";
        case 400: return "hipErrorInvalidHandle";
        case 401: return "hipErrorIllegalState";
        case 500: return "hipErrorNotFound";
        case 900: return "hipErrorStreamCaptureUnsupported";
        case 901: return "hipErrorStreamCaptureInvalidated";
        case 903: return "hipErrorStreamCaptureUnmatched";
        case 98: return "hipErrorInvalidDeviceFunction";
        default: return "hipErrorUnknown";
    }
}
hipError_t hipMalloc(void** p, size_t n) {
    hipError_t e = unsafe_call("hipMalloc");
    if (e) return e;
    pthread_mutex_lock(&mu);
    int null_now = next_malloc_null;
    next_malloc_null = 0;
    pthread_mutex_unlock(&mu);
    if (null_now) {
        *p = NULL;
        return 0;
    }
    if (n > SIZE_MAX - 4095) return 2;
    size_t size = (n + 4095) / 4096 * 4096;
    *p = aligned_alloc(4096, size);
    if (!*p) return 2;
    pthread_mutex_lock(&mu);
    if (n_allocs == cap_allocs) {
        int cap = cap_allocs ? 2 * cap_allocs : 256;
        struct alloc* grown = realloc(allocs, (size_t)cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&mu);
            free(*p);
            *p = NULL;
            return 2;
        }
        allocs = grown;
        cap_allocs = cap;
    }
    allocs[n_allocs++] = (struct alloc){(uintptr_t)*p, size, n, next_alloc_id++};
    pthread_mutex_unlock(&mu);
    return 0;
}
hipError_t hipFree(void* p) {
    hipError_t e = unsafe_call("hipFree");
    if (e) return e;
    if (!p) return 0;
    drain(NULL, current_device); /* hipFree waits for the device (the calling thread's) */
    int found = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_allocs; i++)
        if (allocs[i].base == (uintptr_t)p) {
            allocs[i] = allocs[--n_allocs];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&mu);
    if (!found) {
        fakehip_add_violation("hipFree", "not a live allocation of hipMalloc (freed twice, or never allocated)");
        return 1;
    }
    free(p);
    return 0;
}
/* A 64 GiB device whose free memory shrinks by what is allocated now. */
#define FAKE_TOTAL_MEMORY ((size_t)64 << 30)
hipError_t hipMemGetInfo(size_t* free_bytes, size_t* total) {
    count_call("hipMemGetInfo");
    size_t used = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_allocs; i++) used += allocs[i].size;
    pthread_mutex_unlock(&mu);
    *total = FAKE_TOTAL_MEMORY;
    *free_bytes = used < FAKE_TOTAL_MEMORY ? FAKE_TOTAL_MEMORY - used : 0;
    return 0;
}
hipError_t hipMemGetAddressRange(void** base, size_t* size, void* ptr) {
    count_call("hipMemGetAddressRange");
    hipError_t e = 1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_allocs; i++)
        if ((uintptr_t)ptr >= allocs[i].base && (uintptr_t)ptr < allocs[i].base + allocs[i].size) {
            *base = (void*)allocs[i].base;
            *size = allocs[i].size > range_shrink ? allocs[i].size - range_shrink : 0;
            e = 0;
            break;
        }
    pthread_mutex_unlock(&mu);
    return e;
}

struct copy_args {
    void* dst;
    const void* src;
    size_t n;
};
static void do_copy(void* a) {
    struct copy_args* c = a;
    memmove(c->dst, c->src, c->n);
}
/* Test hook (fakehip_fail_copies): the next `count` hipMemcpyAsync calls of exactly `bytes` bytes on a stream of
 * device `device` fail with hipErrorInvalidValue, as a copy on a failing device would. */
static int fail_copy_device = -1, fail_copy_count;
static size_t fail_copy_bytes;
void fakehip_fail_copies(int device, size_t bytes, int count) {
    pthread_mutex_lock(&amu);
    fail_copy_device = device;
    fail_copy_bytes = bytes;
    fail_copy_count = count;
    pthread_mutex_unlock(&amu);
}
hipError_t hipMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* s) {
    count_call("hipMemcpyAsync");
    (void)kind;
    if (s) {
        pthread_mutex_lock(&amu);
        int fail = fail_copy_count > 0 && ((struct stream*)s)->device == fail_copy_device && n == fail_copy_bytes;
        if (fail) fail_copy_count--;
        pthread_mutex_unlock(&amu);
        if (fail) return 1;
    }
    struct copy_args c = {dst, src, n};
    return fakehip_enqueue(s, do_copy, &c, sizeof c);
}
hipError_t hipMemcpy(void* dst, const void* src, size_t n, int kind) {
    hipError_t e = unsafe_call("hipMemcpy");
    if (e) return e;
    (void)kind;
    memmove(dst, src, n);
    return 0;
}
struct set_args {
    void* dst;
    int v;
    size_t n;
};
static void do_set(void* a) {
    struct set_args* c = a;
    memset(c->dst, c->v, c->n);
}
hipError_t hipMemsetAsync(void* dst, int v, size_t n, void* s) {
    count_call("hipMemsetAsync");
    struct set_args c = {dst, v, n};
    return fakehip_enqueue(s, do_set, &c, sizeof c);
}

hipError_t hipStreamCreateWithFlags(void** s, unsigned flags) {
    count_call("hipStreamCreateWithFlags");
    (void)flags;
    struct stream* st = calloc(1, sizeof *st);
    st->device = current_device;
    pthread_mutex_lock(&mu);
    pthread_mutex_lock(&amu);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i]) {
            streams[i] = st;
            break;
        }
    pthread_mutex_unlock(&amu);
    pthread_mutex_unlock(&mu);
    *s = st;
    return 0;
}
/* Waits for the stream's work first, as HIP does. */
hipError_t hipStreamDestroy(void* s) {
    count_call("hipStreamDestroy");
    struct stream* st = s;
    if (!st) return 400;
    drain(st, 0);
    pthread_mutex_lock(&amu);
    st->stop = 1;
    int joined = st->has_worker;
    pthread_cond_broadcast(&acv);
    pthread_mutex_unlock(&amu);
    if (joined) pthread_join(st->worker, NULL);
    pthread_mutex_lock(&mu);
    pthread_mutex_lock(&amu);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] == s) streams[i] = NULL;
    pthread_mutex_unlock(&amu);
    pthread_mutex_unlock(&mu);
    free(s);
    return 0;
}
/* Streams the tests mark busy: hipStreamQuery answers hipErrorNotReady for them (work that never finishes). */
static void* busy_streams[MAX_STREAMS];
void fakehip_set_busy(void* s, int busy) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (busy && busy_streams[i] == NULL) { busy_streams[i] = s; break; }
        if (!busy && busy_streams[i] == s) busy_streams[i] = NULL;
    }
    pthread_mutex_unlock(&mu);
}
hipError_t hipStreamQuery(void* s) {
    count_call("hipStreamQuery");
    struct stream* st = s;
    if (st && st->capturing) {
        fakehip_add_violation("hipStreamQuery", "querying a capturing stream");
        st->invalidated = 1;
        return 900;
    }
    int busy = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_STREAMS; i++) busy |= s != NULL && busy_streams[i] == s;
    pthread_mutex_unlock(&mu);
    if (st) {
        pthread_mutex_lock(&amu);
        busy |= stream_pending(st);
        pthread_mutex_unlock(&amu);
    }
    return busy ? 600 : 0;
}
hipError_t hipStreamSynchronize(void* s) {
    count_call("hipStreamSynchronize");
    struct stream* st = s;
    if (st && st->capturing) {
        fakehip_add_violation("hipStreamSynchronize", "synchronising a capturing stream");
        st->invalidated = 1;
        return 900;
    }
    if (st) drain(st, 0);
    return 0;
}
hipError_t hipStreamGetCaptureInfo(void* s, int* status, unsigned long long* id) {
    count_call("hipStreamGetCaptureInfo");
    struct stream* st = s;
    *status = st && st->capturing ? (st->invalidated ? 2 : 1) : 0;
    if (id) *id = (unsigned long long)(uintptr_t)s;
    return 0;
}
hipError_t hipThreadExchangeStreamCaptureMode(int* mode) {
    count_call("hipThreadExchangeStreamCaptureMode");
    if (!mode || *mode < 0 || *mode > 2) return 1;
    int previous = thread_mode;
    thread_mode = *mode;
    *mode = previous;
    return 0;
}
hipError_t hipStreamBeginCapture(void* s, int mode) {
    count_call("hipStreamBeginCapture");
    struct stream* st = s;
    if (!st || st->capturing) return 401;
    st->capturing = 1;
    st->mode = mode;
    st->invalidated = 0;
    st->owner = pthread_self();
    st->head = st->tail = NULL;
    if (mode == 0) global_captures++;
    if (mode != 2) thread_captures++;
    return 0;
}
static void free_graph(struct graph* g) {
    for (struct node* n = g->head; n;) {
        struct node* next = n->next;
        free(n->arg);
        free(n);
        n = next;
    }
    free(g);
}
hipError_t hipStreamEndCapture(void* s, void** graph) {
    count_call("hipStreamEndCapture");
    struct stream* st = s;
    if (!st || !st->capturing) return 903;
    st->capturing = 0;
    if (st->mode == 0) global_captures--;
    if (st->mode != 2) thread_captures--;
    struct graph* g = calloc(1, sizeof *g);
    g->head = st->head;
    st->head = st->tail = NULL;
    if (st->invalidated) {
        *graph = NULL;
        free_graph(g);
        return 901;
    }
    *graph = g;
    return 0;
}
static struct graph* copy_graph(const struct graph* g) {
    struct graph* c = calloc(1, sizeof *c);
    struct node** tail = &c->head;
    for (const struct node* n = g->head; n; n = n->next) {
        *tail = copy_node(n);
        tail = &(*tail)->next;
    }
    return c;
}
hipError_t hipGraphInstantiate(void** exec, void* graph, void* err_node, char* log, size_t log_size) {
    count_call("hipGraphInstantiate");
    (void)err_node, (void)log, (void)log_size;
    if (!graph) return 400;
    *exec = copy_graph(graph);
    return 0;
}
hipError_t hipGraphLaunch(void* exec, void* s) {
    count_call("hipGraphLaunch");
    if (!exec) return 400;
    for (struct node* n = ((struct graph*)exec)->head; n; n = n->next) {
        hipError_t e = enqueue(s, n->fn, n->arg, n->arg_size, n->async);
        if (e) return e;
    }
    return 0;
}
hipError_t hipGraphExecDestroy(void* exec) {
    count_call("hipGraphExecDestroy");
    if (exec) free_graph(exec);
    return 0;
}
hipError_t hipGraphDestroy(void* g) {
    count_call("hipGraphDestroy");
    if (g) free_graph(g);
    return 0;
}

/* IPC in one process: the handle names an allocation (its base, its serial id, the exporting process). Opening
 * maps the whole allocation and returns its base, as HIP does; a handle of memory freed since (even if a later
 * allocation took its address) or one made by another process (the fake cannot map across processes) fails
 * with hipErrorInvalidHandle (400). Closing a pointer that no open returned fails with hipErrorInvalidValue. */
struct ipc_handle {
    char magic[8];
    uint64_t base;
    uint64_t id;
    int32_t pid;
};
static struct opened {
    uintptr_t base;
    uint64_t id;
}* opened;
static int n_opened, cap_opened;

hipError_t hipIpcGetMemHandle(void* handle, void* p) {
    hipError_t e = unsafe_call("hipIpcGetMemHandle");
    if (e) return e;
    pthread_mutex_lock(&mu);
    const struct alloc* a = alloc_holding((uintptr_t)p, 1);
    struct ipc_handle h = {"FAKEHIP", a ? a->base : 0, a ? a->id : 0, (int32_t)getpid()};
    pthread_mutex_unlock(&mu);
    if (!a) {
        fakehip_add_violation("hipIpcGetMemHandle", "the pointer is in no live allocation of hipMalloc");
        return 1;
    }
    memset(handle, 0, 64);
    memcpy(handle, &h, sizeof h);
    return 0;
}
/* hipIpcMemHandle_t is passed by value (64 bytes, in memory on x86-64), not as a pointer. */
typedef struct {
    char reserved[64];
} hipIpcMemHandle_t;
hipError_t hipIpcOpenMemHandle(void** p, hipIpcMemHandle_t handle, unsigned flags) {
    hipError_t e = unsafe_call("hipIpcOpenMemHandle");
    if (e) return e;
    (void)flags;
    struct ipc_handle h;
    memcpy(&h, handle.reserved, sizeof h);
    if (memcmp(h.magic, "FAKEHIP", 8) != 0) return 400;
    if (h.pid != (int32_t)getpid()) return 400;
    pthread_mutex_lock(&mu);
    int live = 0;
    for (int i = 0; i < n_allocs; i++) live |= allocs[i].base == h.base && allocs[i].id == h.id;
    if (live && n_opened == cap_opened) {
        int cap = cap_opened ? 2 * cap_opened : 64;
        struct opened* grown = realloc(opened, (size_t)cap * sizeof *grown);
        if (grown) opened = grown, cap_opened = cap;
    }
    int ok = live && n_opened < cap_opened;
    if (ok) opened[n_opened++] = (struct opened){h.base, h.id};
    pthread_mutex_unlock(&mu);
    if (!live) return 400;
    if (!ok) return 2;
    *p = (void*)h.base;
    return 0;
}
hipError_t hipIpcCloseMemHandle(void* p) {
    hipError_t e = unsafe_call("hipIpcCloseMemHandle");
    if (e) return e;
    int found = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_opened && !found; i++)
        if (opened[i].base == (uintptr_t)p) {
            opened[i] = opened[--n_opened];
            found = 1;
        }
    pthread_mutex_unlock(&mu);
    if (!found) {
        fakehip_add_violation("hipIpcCloseMemHandle", "the pointer was not returned by hipIpcOpenMemHandle");
        return 1;
    }
    return 0;
}
/* Mappings opened and not closed yet (tests check that a communicator closes what it opened). */
int fakehip_ipc_open_count(void) { return n_opened; }
hipError_t hipDeviceCanAccessPeer(int* ok, int a, int b) {
    count_call("hipDeviceCanAccessPeer");
    *ok = a != b;
    return 0;
}
hipError_t hipDeviceEnablePeerAccess(int peer, unsigned flags) {
    (void)peer, (void)flags;
    return unsafe_call("hipDeviceEnablePeerAccess");
}

/* Modules: a code object is accepted when it is a 64-bit AMDGPU ELF (e_machine 224); it is copied, as HIP
 * copies it. hipModuleGetFunction finds FUNC symbols of its symbol tables by name (hipErrorNotFound, 500,
 * otherwise) and copies the name. A function of an unloaded module cannot be launched. */
struct module {
    unsigned char* image;
    size_t size;
    int loaded;
};
struct function {
    struct module* module;
    char name[128];
};
static uint64_t rd(const unsigned char* b, size_t off, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | b[off + (size_t)i];
    return v;
}
/* The bytes an ELF image spans, from its headers (0 when the headers do not fit the 1 GiB the fake accepts). */
static size_t elf_size(const unsigned char* b) {
    const uint64_t limit = (uint64_t)1 << 30;
    uint64_t shoff = rd(b, 0x28, 8), shentsize = rd(b, 0x3a, 2), shnum = rd(b, 0x3c, 2);
    uint64_t phoff = rd(b, 0x20, 8), phentsize = rd(b, 0x36, 2), phnum = rd(b, 0x38, 2);
    if (shoff > limit || phoff > limit || (shentsize < 64 && shnum > 0)) return 0;
    uint64_t end = 64;
    if (shoff + shentsize * shnum > end) end = shoff + shentsize * shnum;
    if (phoff + phentsize * phnum > end) end = phoff + phentsize * phnum;
    for (uint64_t i = 0; i < shnum; i++) {
        const unsigned char* sh = b + shoff + i * shentsize;
        uint64_t type = rd(sh, 4, 4), off = rd(sh, 0x18, 8), size = rd(sh, 0x20, 8);
        if (type == 8) continue; /* NOBITS */
        if (off > limit || size > limit) return 0;
        if (off + size > end) end = off + size;
    }
    return end > limit ? 0 : (size_t)end;
}
/* Whether the image defines a FUNC symbol `name` in .symtab or .dynsym. */
static int elf_has_function(const unsigned char* b, size_t size, const char* name) {
    uint64_t shoff = rd(b, 0x28, 8), shentsize = rd(b, 0x3a, 2), shnum = rd(b, 0x3c, 2);
    for (uint64_t i = 0; i < shnum; i++) {
        const unsigned char* sh = b + shoff + i * shentsize;
        uint64_t type = rd(sh, 4, 4), off = rd(sh, 0x18, 8), bytes = rd(sh, 0x20, 8), link = rd(sh, 0x28, 4);
        if ((type != 2 && type != 11) || link >= shnum) continue;
        const unsigned char* str = b + shoff + link * shentsize;
        uint64_t str_off = rd(str, 0x18, 8), str_size = rd(str, 0x20, 8);
        for (uint64_t s = off; s + 24 <= off + bytes && s + 24 <= size; s += 24) {
            uint64_t name_off = rd(b, s, 4);
            if ((b[s + 4] & 0xf) != 2 || name_off >= str_size) continue;
            const char* sym = (const char*)b + str_off + name_off;
            if (strnlen(sym, str_size - name_off) < str_size - name_off && strcmp(sym, name) == 0) return 1;
        }
    }
    return 0;
}
hipError_t hipModuleLoadData(void** m, const void* image) {
    hipError_t e = unsafe_call("hipModuleLoadData");
    if (e) return e;
    const unsigned char* b = image;
    if (!m || !b) return 1;
    if (memcmp(b, "\x7f" "ELF", 4) != 0 || b[4] != 2 || b[18] != 0xe0) return 200;
    size_t size = elf_size(b);
    if (size == 0) return 200;
    struct module* mod = calloc(1, sizeof *mod);
    mod->image = malloc(size);
    if (!mod->image) {
        free(mod);
        return 2;
    }
    memcpy(mod->image, b, size);
    mod->size = size;
    mod->loaded = 1;
    *m = mod;
    return 0;
}
/* The module's image is freed; the struct stays (functions of it still point to it, and refuse to launch). */
hipError_t hipModuleUnload(void* m) {
    hipError_t e = unsafe_call("hipModuleUnload");
    if (e) return e;
    struct module* mod = m;
    if (!mod || !mod->loaded) return 400;
    drain(NULL, current_device); /* its kernels may still run */
    mod->loaded = 0;
    free(mod->image);
    mod->image = NULL;
    return 0;
}
hipError_t hipModuleGetFunction(void** f, void* m, const char* name) {
    count_call("hipModuleGetFunction");
    struct module* mod = m;
    if (!f || !name) return 1;
    if (!mod || !mod->loaded) return 400;
    if (strlen(name) >= sizeof((struct function*)0)->name || !elf_has_function(mod->image, mod->size, name))
        return 500;
    struct function* fn = calloc(1, sizeof *fn);
    fn->module = mod;
    snprintf(fn->name, sizeof fn->name, "%s", name);
    *f = fn;
    return 0;
}

/* ---- anyccl's kernels (kernels-common/include/anyccl), run from their own source ----
 *
 * Every hipModuleLaunchKernel is recorded (the last MAX_LAUNCHES; fakehip_launch_total counts all). A launch of a
 * kernel of kernel_kinds is checked (grid, block, rank, world, sizes, every pointer in a live hipMalloc allocation
 * large enough and 16-byte aligned) and enqueued as stream work (captured into a graph during capture, run again by
 * each replay) that runs the kernel itself: the kernel source of kernels-common compiled for the host
 * (host_kernels.cpp), its threads coroutines of the stream's worker thread, its flags in "device" memory. Ranks are
 * threads of this process, each running its own launch, so the barriers meet the peers' launches of the same step
 * exactly as on a GPU (epochs not zeroed, steps or grids that differ between ranks wait as a GPU would). The
 * arithmetic is the kernels' own, so tests compare their results with the independent host references of
 * anyccl-core and anyccl-kernels-common. A block that waits FAKEHIP_KERNEL_TIMEOUT_MS (20 s by default) without
 * progress gives up: its abort word reads as set from then on, and the run is recorded as timed out, with a
 * violation, instead of hanging. A kernel that reads its abort word set stops waiting and runs to its end as on a
 * GPU (its results are garbage); the run counts as aborted. A one-shot writing `out` over an input its peers read,
 * or a two-shot writing it over a scratch buffer, is a race on a GPU and recorded as a violation. */
#define K_MAX_RANKS 8
#define K_MAX_BLOCKS 128
#define K_MAX_THREADS 512
#define K_EPOCHS (K_MAX_BLOCKS * K_MAX_RANKS)
#define K_ABORT_WORD (K_EPOCHS + 2 * K_MAX_BLOCKS)
#define K_FLAG_BYTES (K_ABORT_WORD * 4 + 16)
#define K_TABLE_BYTES (K_MAX_RANKS * 8 + 8)
#define MAX_LAUNCHES 4096

/* One launch, as fakehip_launch copies it out (mirrored by `RawLaunch` in fake_hip.rs). */
struct fakehip_launch {
    uint64_t seq;           /* 1, 2, ... since the last reset */
    char name[64];          /* the function's name (truncated) */
    uint32_t grid[3], block[3];
    uint32_t shared_bytes;
    int32_t capturing;      /* the stream was capturing: the work runs at each replay */
    uint64_t stream;
    int32_t status;         /* what hipModuleLaunchKernel returned */
    int32_t kernel;         /* 0: not a kernel the fake runs (or not decoded), else its kind (K_ONE_SHOT...) */
    int32_t table_kernel;   /* 1: a _table kernel (inputs through `table`) */
    int32_t dtype;          /* 0 f32, 1 f16, 2 bf16; -1 when not an all-reduce kernel */
    int32_t rank, world;
    uint64_t table, self_src, out, round_vecs, n_vec;
    uint64_t in[8], scratch[8], flags[8];
    uint32_t runs;          /* times the work started (eager: once; captured: once per replay) */
    uint32_t completed;     /* runs that met every barrier and wrote `out` */
    uint32_t aborted;       /* runs that stopped on the abort word */
    uint32_t timed_out;     /* runs that gave up waiting for a peer */
    uint32_t failed;        /* runs refused when they started (a buffer freed since the launch, a bad table) */
    int32_t last_registered; /* the input table's `registered` word at the last run; -1: no table read */
    uint64_t recv[8];       /* push one-shot (kernel 3): every rank's receive buffer */
    uint64_t my_flags;      /* push one-shot: this rank's flag array (its abort word) */
    int32_t pdl;            /* launched with programmatic dependent launch (cuLaunchKernelEx's attribute) */
    int32_t out_fp8;        /* the fused kinds and the RMSNorm kernel (4-7): NormArgs, as decoded */
    uint32_t hidden_vec;
    float eps, scale;
    uint64_t residual, weight, tokens;
    int32_t quant;          /* quantized two-shot (kernel 8): 1 fp8 e4m3, 2 int8 */
    int32_t reserved;
};
static struct fakehip_launch launches[MAX_LAUNCHES];
static uint64_t n_launches;
static void reset_launches(void) { n_launches = 0; }
uint64_t fakehip_launch_total(void) { return n_launches; }
int fakehip_launch_count(void) { return n_launches < MAX_LAUNCHES ? (int)n_launches : MAX_LAUNCHES; }
/* Copies launch `i` (0: the oldest held) into `out`, whose size must be sizeof(struct fakehip_launch); 0 on
 * success, 1 when `i` is out of range, 2 when the size differs (the Rust mirror is stale). */
int fakehip_launch(int i, struct fakehip_launch* out, size_t size) {
    if (size != sizeof *out) return 2;
    pthread_mutex_lock(&mu);
    int held = fakehip_launch_count();
    int r = 1;
    if (i >= 0 && i < held) {
        uint64_t seq = n_launches - (uint64_t)held + (uint64_t)i + 1;
        *out = launches[(seq - 1) % MAX_LAUNCHES];
        r = 0;
    }
    pthread_mutex_unlock(&mu);
    return r;
}
/* The record of launch `seq` if still held. Called locked. */
static struct fakehip_launch* launch_rec(uint64_t seq) {
    struct fakehip_launch* l = &launches[(seq - 1) % MAX_LAUNCHES];
    return seq >= 1 && l->seq == seq ? l : NULL;
}

static pthread_mutex_t kmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t kcv = PTHREAD_COND_INITIALIZER;
static int kernels_waiting;
static int kernel_timeout_ms = -1;
/* Kernel runs waiting at a barrier now (tests wait for it before setting an abort word). */
int fakehip_kernels_waiting(void) {
    pthread_mutex_lock(&kmu);
    int n = kernels_waiting;
    pthread_mutex_unlock(&kmu);
    return n;
}
/* How long a kernel waits for its peers before it records "timed out" (ms; < 0: FAKEHIP_KERNEL_TIMEOUT_MS or
 * 20 s). */
void fakehip_set_kernel_timeout_ms(int ms) {
    pthread_mutex_lock(&kmu);
    kernel_timeout_ms = ms;
    pthread_mutex_unlock(&kmu);
}
static void wake_kernels(void) {
    pthread_mutex_lock(&kmu);
    pthread_cond_broadcast(&kcv);
    pthread_mutex_unlock(&kmu);
}

/* The kernels the fake runs, by kind (fakehip_launch.kernel). */
enum {
    K_ONE_SHOT = 1,   /* anyccl_one_shot[_table]_{f32,f16,bf16} (allreduce.h) */
    K_TWO_SHOT = 2,   /* anyccl_two_shot[_table]_{f32,f16,bf16} */
    K_PUSH = 3,       /* anyccl_push_one_shot_{f32,f16,bf16} (push.h) */
    K_FUSED_ONE = 4,  /* anyccl_fused_one_shot[_table]_{f16,bf16} (fused.h) */
    K_FUSED_TWO = 5,  /* anyccl_fused_two_shot[_table]_{f16,bf16} */
    K_RMSNORM = 6,    /* anyccl_rmsnorm_{f16,bf16}: the unfused form's second kernel */
    K_FUSED_PUSH = 7, /* anyccl_fused_push_one_shot_{f16,bf16} (fused_push.h) */
    K_QUANT = 8,      /* anyccl_quant_two_shot_{fp8,int8}_{f32,f16,bf16} (quant.h) */
    K_PUSH_TWO = 9,   /* anyccl_push_two_shot_{f32,f16,bf16} (push.h) */
};
/* The fused kernels' NormArgs (fused.h; by value in their parameters). */
struct norm_args {
    uint64_t residual, weight, out;
    float eps, scale;
    int32_t out_fp8;
    uint32_t hidden_vec;
    uint64_t tokens;
};
_Static_assert(sizeof(struct norm_args) == 48, "fused.h's NormArgs is 48 bytes");
/* push.h's receive buffers: two sets of K_MAX_RANKS slots, then the control words. */
#define K_PUSH_SLOT (256 * 1024)
#define K_PUSH_CTRL (2 * K_MAX_RANKS * K_PUSH_SLOT)
#define K_PUSH_RECV (K_PUSH_CTRL + 16)
#define K_NORM_THREADS 512
#define K_MAX_HIDDEN 16384
#define K_QUANT_BLOCK 32

struct kwork {
    uint64_t seq;
    char name[64];
    int kind, table_kernel, dtype, rank, world;
    int quant; /* K_QUANT: 1 fp8 e4m3, 2 int8 */
    unsigned blocks, threads;
    uint64_t table, self_src, out, round_vecs, n_vec;
    uint64_t in[8], scratch[8], flags[8];
    uint64_t recv[8];
    struct norm_args norm; /* the fused kinds and K_RMSNORM */
    /* Bytes a run touches (size_launch): the message (each input, staging and push slot), `out`, and each
     * rank's scratch (the two-shot kinds) or staging and scratch (K_QUANT). */
    uint64_t bytes, out_bytes, scratch_bytes;
};

static void launch_note(const struct kwork* w, const char* why) {
    char msg[200];
    snprintf(msg, sizeof msg, "rank %d of %d: %s", w->rank, w->world, why);
    fakehip_add_violation(w->name, msg);
}
static void launch_count(uint64_t seq, uint32_t* (*field)(struct fakehip_launch*)) {
    pthread_mutex_lock(&mu);
    struct fakehip_launch* l = launch_rec(seq);
    if (l) (*field(l))++;
    pthread_mutex_unlock(&mu);
}
static uint32_t* f_runs(struct fakehip_launch* l) { return &l->runs; }
static uint32_t* f_completed(struct fakehip_launch* l) { return &l->completed; }
static uint32_t* f_aborted(struct fakehip_launch* l) { return &l->aborted; }
static uint32_t* f_timed_out(struct fakehip_launch* l) { return &l->timed_out; }
static uint32_t* f_failed(struct fakehip_launch* l) { return &l->failed; }

static uint32_t* flag_word(uint64_t flags, size_t word) { return (uint32_t*)(uintptr_t)flags + word; }
/* Whether [a, a + an) and [b, b + bn) overlap. */
static int overlaps(uint64_t a, uint64_t an, uint64_t b, uint64_t bn) { return a < b + bn && b < a + an; }

/* ---- Decoding and checking a launch ---- */

/* Parameters in order: which field. P_SELF is the kernel's own-input pointer (self_src, or `in` where it is one
 * pointer); P_IN every rank's input or staging (RankPtrs; K_QUANT's `stage`). */
enum { P_IN, P_TABLE, P_SELF, P_SCRATCH, P_OUT, P_ROUND, P_FLAGS, P_RANK, P_WORLD, P_NVEC, P_RECV, P_MY_FLAGS, P_ARGS };
/* allreduce_params, push.h's PUSH_PARAMS, fused_params, FUSED_PUSH_PARAMS and QUANT_PARAMS of kernels-common. */
static const int one_shot_params[] = {P_IN, P_SELF, P_OUT, P_FLAGS, P_RANK, P_WORLD, P_NVEC, -1};
static const int two_shot_params[] = {P_IN, P_SELF, P_SCRATCH, P_OUT, P_ROUND, P_FLAGS, P_RANK, P_WORLD, P_NVEC, -1};
static const int push_params[] = {P_SELF, P_OUT, P_RECV, P_MY_FLAGS, P_RANK, P_WORLD, P_NVEC, -1};
static const int fused_one_params[] = {P_IN, P_SELF, P_ARGS, P_FLAGS, P_RANK, P_WORLD, -1};
static const int fused_two_params[] = {P_IN, P_SELF, P_SCRATCH, P_ARGS, P_FLAGS, P_RANK, P_WORLD, -1};
static const int rmsnorm_params[] = {P_SELF, P_ARGS, -1};
static const int fused_push_params[] = {P_SELF, P_ARGS, P_RECV, P_MY_FLAGS, P_RANK, P_WORLD, -1};
static const int quant_params[] = {P_SELF, P_IN, P_SCRATCH, P_OUT, P_FLAGS, P_RANK, P_WORLD, P_NVEC, -1};

/* Every kernel name the fake runs: prefix, then `table_` where `tables`, then f32 (where `f32`), f16 or bf16. */
static const struct kernel_kind {
    const char* prefix;
    int kind, quant, tables, f32;
    const int* params;
} kernel_kinds[] = {
    {"anyccl_one_shot_", K_ONE_SHOT, 0, 1, 1, one_shot_params},
    {"anyccl_two_shot_", K_TWO_SHOT, 0, 1, 1, two_shot_params},
    {"anyccl_push_one_shot_", K_PUSH, 0, 0, 1, push_params},
    {"anyccl_push_two_shot_", K_PUSH_TWO, 0, 0, 1, push_params},
    {"anyccl_fused_one_shot_", K_FUSED_ONE, 0, 1, 0, fused_one_params},
    {"anyccl_fused_two_shot_", K_FUSED_TWO, 0, 1, 0, fused_two_params},
    {"anyccl_rmsnorm_", K_RMSNORM, 0, 0, 0, rmsnorm_params},
    {"anyccl_fused_push_one_shot_", K_FUSED_PUSH, 0, 0, 0, fused_push_params},
    {"anyccl_quant_two_shot_fp8_", K_QUANT, 1, 0, 1, quant_params},
    {"anyccl_quant_two_shot_int8_", K_QUANT, 2, 0, 1, quant_params},
};
static const struct kernel_kind* kind_of(int kind, int quant) {
    for (size_t i = 0; i < sizeof kernel_kinds / sizeof kernel_kinds[0]; i++)
        if (kernel_kinds[i].kind == kind && kernel_kinds[i].quant == quant) return &kernel_kinds[i];
    return NULL;
}
static int is_fused(int kind) {
    return kind == K_FUSED_ONE || kind == K_FUSED_TWO || kind == K_RMSNORM || kind == K_FUSED_PUSH;
}
static int is_push(int kind) { return kind == K_PUSH || kind == K_FUSED_PUSH || kind == K_PUSH_TWO; }
/* Kinds whose every rank's input is read through `in` (direct, staged, or a table). */
static int reads_peers(int kind) {
    return kind == K_ONE_SHOT || kind == K_TWO_SHOT || kind == K_FUSED_ONE || kind == K_FUSED_TWO;
}
/* Fills kind, quant, table_kernel and dtype from a kernel name; 0 when the fake cannot run it. */
static int parse_kernel(const char* name, struct kwork* w) {
    for (size_t i = 0; i < sizeof kernel_kinds / sizeof kernel_kinds[0]; i++) {
        const struct kernel_kind* k = &kernel_kinds[i];
        size_t n = strlen(k->prefix);
        if (strncmp(name, k->prefix, n) != 0) continue;
        const char* rest = name + n;
        w->table_kernel = k->tables && strncmp(rest, "table_", 6) == 0;
        if (w->table_kernel) rest += 6;
        if (strcmp(rest, "f32") == 0 && k->f32) w->dtype = 0;
        else if (strcmp(rest, "f16") == 0) w->dtype = 1;
        else if (strcmp(rest, "bf16") == 0) w->dtype = 2;
        else return 0;
        w->kind = k->kind;
        w->quant = k->quant;
        return 1;
    }
    return 0;
}

static size_t param_bytes(int p) {
    switch (p) {
        case P_IN: case P_SCRATCH: case P_FLAGS: case P_RECV: return 64;
        case P_RANK: case P_WORLD: return 4;
        case P_ARGS: return sizeof(struct norm_args);
        default: return 8;
    }
}
static void store_param(struct kwork* w, int p, const void* v) {
    switch (p) {
        case P_IN: memcpy(w->in, v, 64); break;
        case P_TABLE: memcpy(&w->table, v, 8); break;
        case P_SELF: memcpy(&w->self_src, v, 8); break;
        case P_SCRATCH: memcpy(w->scratch, v, 64); break;
        case P_OUT: memcpy(&w->out, v, 8); break;
        case P_ROUND: memcpy(&w->round_vecs, v, 8); break;
        case P_FLAGS: memcpy(w->flags, v, 64); break;
        case P_RANK: memcpy(&w->rank, v, 4); break;
        case P_WORLD: memcpy(&w->world, v, 4); break;
        case P_NVEC: memcpy(&w->n_vec, v, 8); break;
        case P_RECV: memcpy(w->recv, v, 64); break;
        /* Kept as flags[0] until the rank is known (decode_params moves it to flags[rank]). */
        case P_MY_FLAGS: memcpy(&w->flags[0], v, 8); break;
        case P_ARGS: memcpy(&w->norm, v, sizeof w->norm); break;
    }
}

/* Decodes the parameters from kernelParams (one pointer per parameter) or from `extra` (a parameter buffer laid
 * out as kernels-common's parameter tables say). Returns 0 or 1 with `why` filled. */
static hipError_t decode_params(struct kwork* w, void** params, void** extra, char* why, size_t n) {
    const int* order = kind_of(w->kind, w->quant)->params;
    if ((params == NULL) == (extra == NULL))
        return snprintf(why, n, "exactly one of kernelParams and extra must be given"), 1;
    const unsigned char* buf = NULL;
    size_t buf_size = 0;
    if (extra) {
        const void* size_p = NULL;
        int i = 0;
        for (; i < 16 && extra[i] != (void*)3; i += 2) {
            if (extra[i] == (void*)1) buf = extra[i + 1];
            else if (extra[i] == (void*)2) size_p = extra[i + 1];
            else return snprintf(why, n, "extra[%d] is not a HIP_LAUNCH_PARAM_* key", i), 1;
        }
        if (i >= 16 || !buf || !size_p) return snprintf(why, n, "extra lacks a buffer, its size or the end"), 1;
        memcpy(&buf_size, size_p, sizeof buf_size);
    }
    size_t off = 0;
    for (int i = 0; order[i] >= 0; i++) {
        int p = order[i] == P_IN && w->table_kernel ? P_TABLE : order[i];
        size_t bytes = param_bytes(p);
        size_t align = bytes < 8 ? bytes : 8;
        off = (off + align - 1) / align * align;
        const void* v;
        if (params) {
            v = params[i];
            if (!v) return snprintf(why, n, "kernelParams[%d] is null", i), 1;
        } else {
            if (off + bytes > buf_size)
                return snprintf(why, n, "the parameter buffer of %zu bytes ends before parameter %d", buf_size, i),
                       1;
            v = buf + off;
        }
        store_param(w, p, v);
        off += bytes;
    }
    if (extra && off != buf_size)
        return snprintf(why, n, "the parameter buffer has %zu bytes, the kernel's parameters %zu", buf_size, off), 1;
    if (is_push(w->kind) && w->rank >= 0 && w->rank < K_MAX_RANKS && w->rank != 0) {
        w->flags[w->rank] = w->flags[0];
        w->flags[0] = 0;
    }
    return 0;
}

/* The message's vectors and the bytes a run touches, from the decoded parameters; 0, or 1 with `why` filled. */
static hipError_t size_launch(struct kwork* w, char* why, size_t n) {
    if (is_fused(w->kind)) {
        const struct norm_args* a = &w->norm;
        if (a->hidden_vec == 0 || a->hidden_vec > K_MAX_HIDDEN / 8)
            return snprintf(why, n, "hidden_vec %u (1..=%d: hidden a multiple of 8 up to %d)", a->hidden_vec,
                            K_MAX_HIDDEN / 8, K_MAX_HIDDEN),
                   1;
        if (a->tokens == 0 || a->tokens > ((uint64_t)1 << 40) / a->hidden_vec)
            return snprintf(why, n, "tokens %llu (1..=2^40 vectors in all)", (unsigned long long)a->tokens), 1;
        w->n_vec = a->tokens * a->hidden_vec;
        w->out = a->out;
        w->out_bytes = w->n_vec * (a->out_fp8 ? 8 : 16);
    } else {
        w->out_bytes = w->n_vec * 16;
    }
    if (w->n_vec == 0 || w->n_vec > ((uint64_t)1 << 40))
        return snprintf(why, n, "n_vec %llu (1..=2^40)", (unsigned long long)w->n_vec), 1;
    w->bytes = w->n_vec * 16;
    if (w->kind == K_TWO_SHOT) w->scratch_bytes = w->bytes;
    if (w->kind == K_FUSED_TWO) w->scratch_bytes = w->bytes + w->out_bytes;
    if (w->kind == K_QUANT) {
        /* quant::staging_bytes: ceil(elements / 32) blocks of 32 code bytes and a 4-byte scale. */
        uint64_t per_block = K_QUANT_BLOCK / (w->dtype == 0 ? 4 : 8);
        w->scratch_bytes = (w->n_vec + per_block - 1) / per_block * (K_QUANT_BLOCK + 4);
    }
    if (is_push(w->kind) && w->bytes > K_PUSH_SLOT)
        return snprintf(why, n, "%llu bytes exceed a push slot", (unsigned long long)w->bytes), 1;
    return 0;
}

/* A buffer a run touches: what (and which rank's, or -1), where, how many bytes; null allowed or not. */
struct need {
    const char* what;
    int index;
    uint64_t p, bytes;
    int may_be_null;
};
/* Every buffer a run of `w` touches: `in` is every rank's input (NULL for a _table kernel whose table is not read
 * yet: the table is listed instead), `src` the own input to stage (self_src). Returns the count. */
static int needed_buffers(const struct kwork* w, const uint64_t* in, uint64_t src, struct need* need) {
    int k = 0;
    const int barriers = reads_peers(w->kind) || w->kind == K_QUANT;
    for (int r = 0; r < w->world && w->kind != K_RMSNORM; r++) {
        if (barriers) need[k++] = (struct need){"flags", r, w->flags[r], K_FLAG_BYTES, 0};
        if (reads_peers(w->kind) && in) need[k++] = (struct need){"in", r, in[r], w->bytes, 0};
        if (w->kind == K_QUANT) need[k++] = (struct need){"stage", r, w->in[r], w->scratch_bytes, 0};
        if (w->scratch_bytes) need[k++] = (struct need){"scratch", r, w->scratch[r], w->scratch_bytes, 0};
        if (is_push(w->kind)) need[k++] = (struct need){"recv", r, w->recv[r], K_PUSH_RECV, 0};
    }
    if (is_push(w->kind)) need[k++] = (struct need){"my_flags", -1, w->flags[w->rank], K_FLAG_BYTES, 0};
    if (w->table_kernel && !in) need[k++] = (struct need){"table", -1, w->table, K_TABLE_BYTES, 0};
    need[k++] = (struct need){"out", -1, w->out, w->out_bytes, 0};
    need[k++] = (struct need){reads_peers(w->kind) ? "self_src" : "in", -1, src, w->bytes, reads_peers(w->kind)};
    if (is_fused(w->kind)) {
        need[k++] = (struct need){"residual", -1, w->norm.residual, w->bytes, 0};
        need[k++] = (struct need){"weight", -1, w->norm.weight, (uint64_t)w->norm.hidden_vec * 16, 0};
    }
    return k;
}
#define K_MAX_NEEDS (5 * K_MAX_RANKS + 6)
/* Whether every buffer of `need` is non-null (unless it may be), 16-byte aligned and inside a live allocation
 * holding its bytes; 1 with `why` filled when not (`freed`: worded for a run, after the launch was accepted). */
static int bad_buffer(const struct need* need, int k, int freed, char* why, size_t n) {
    char at[24] = "";
    for (int i = 0; i < k; i++) {
        const struct need* b = &need[i];
        if (b->index >= 0) snprintf(at, sizeof at, "[%d]", b->index);
        else at[0] = 0;
        if (!b->p) {
            if (b->may_be_null) continue;
            return snprintf(why, n, "%s%s is null", b->what, at), 1;
        }
        if (b->p % 16 != 0)
            return snprintf(why, n, "%s%s %#llx is not 16-byte aligned", b->what, at, (unsigned long long)b->p), 1;
        pthread_mutex_lock(&mu);
        int live = alloc_holding(b->p, b->bytes) != NULL;
        pthread_mutex_unlock(&mu);
        if (!live)
            return snprintf(why, n,
                            freed ? "%s%s %#llx: no live allocation of %llu bytes (freed?)"
                                  : "%s%s %#llx: no live hipMalloc allocation holds %llu bytes there",
                            b->what, at, (unsigned long long)b->p, (unsigned long long)b->bytes),
                   1;
    }
    return 0;
}

/* Checks a decoded launch; returns 0 or the error code, with `why` filled. */
static hipError_t check_launch(struct kwork* w, const unsigned* grid, const unsigned* block, char* why, size_t n) {
    /* The separate RMSNorm kernel has no flags: any grid; the others' flag arrays hold K_MAX_BLOCKS blocks. */
    const unsigned max_grid = w->kind == K_RMSNORM ? 0x7fffffffu : K_MAX_BLOCKS;
    if (grid[0] < 1 || grid[0] > max_grid || grid[1] != 1 || grid[2] != 1)
        return snprintf(why, n, "grid %ux%ux%u (1..=%u blocks in x only)", grid[0], grid[1], grid[2], max_grid), 1;
    if (block[0] < 1 || block[0] > K_MAX_THREADS || block[1] != 1 || block[2] != 1)
        return snprintf(why, n, "block %ux%ux%u (1..=%d threads in x only)", block[0], block[1], block[2],
                        K_MAX_THREADS),
               1;
    /* The order of the fused kernels' sum of squares is that of 512 threads; quant.h's groups of 32 / N threads
     * must not straddle blocks. */
    if (is_fused(w->kind) && block[0] != K_NORM_THREADS)
        return snprintf(why, n, "block of %u threads (the fused kernels need exactly %d)", block[0], K_NORM_THREADS),
               1;
    if (w->kind == K_QUANT && block[0] % (K_QUANT_BLOCK / (w->dtype == 0 ? 4 : 8)) != 0)
        return snprintf(why, n, "block of %u threads (not whole groups of a quantization block)", block[0]), 1;
    if (w->kind != K_RMSNORM) {
        if (w->world < 2 || w->world > K_MAX_RANKS) return snprintf(why, n, "world %d (2..=8)", w->world), 1;
        if (w->rank < 0 || w->rank >= w->world) return snprintf(why, n, "rank %d of world %d", w->rank, w->world), 1;
    }
    hipError_t e = size_launch(w, why, n);
    if (e) return e;
    struct need need[K_MAX_NEEDS];
    int k = needed_buffers(w, w->table_kernel ? NULL : w->in, w->self_src, need);
    return bad_buffer(need, k, 0, why, n);
}

/* Whether every buffer the run touches is live and large enough; reads the input table into `in`/`src` first.
 * Records why not. */
static int run_buffers_ok(const struct kwork* w, uint64_t* in, uint64_t* src, int* registered) {
    char why[160] = "";
    memcpy(in, w->in, 64);
    *src = w->self_src;
    if (w->table_kernel) {
        pthread_mutex_lock(&mu);
        if (!alloc_holding(w->table, K_TABLE_BYTES)) {
            snprintf(why, sizeof why, "the input table %#llx is in no live allocation (freed?)",
                     (unsigned long long)w->table);
        } else {
            memcpy(in, (const void*)(uintptr_t)w->table, 64);
            uint64_t reg;
            memcpy(&reg, (const char*)(uintptr_t)w->table + 64, 8);
            *registered = reg != 0;
            if (reg) *src = 0;
        }
        pthread_mutex_unlock(&mu);
    }
    struct need need[K_MAX_NEEDS];
    if (!why[0]) bad_buffer(need, needed_buffers(w, in, *src, need), 1, why, sizeof why);
    if (why[0]) {
        launch_note(w, why);
        return 0;
    }
    /* Writes over what a peer reads (a race on a GPU): one-shot outputs over an input, two-shot outputs over a
     * scratch buffer. */
    const uint64_t norm_res = is_fused(w->kind) ? w->norm.residual : 0;
    for (int r = 0; r < w->world && reads_peers(w->kind); r++) {
        const int two = w->kind == K_TWO_SHOT || w->kind == K_FUSED_TWO;
        const uint64_t read = two ? w->scratch[r] : in[r], read_bytes = two ? w->scratch_bytes : w->bytes;
        const char* name = two ? "scratch" : "in";
        const int out_over = overlaps(w->out, w->out_bytes, read, read_bytes);
        if (out_over || (norm_res && overlaps(norm_res, w->bytes, read, read_bytes))) {
            char msg[160];
            snprintf(msg, sizeof msg, "%s writes %s over %s[%d], which every rank reads%s",
                     two ? "two-shot" : "one-shot", out_over ? "out" : "residual", name, r,
                     two ? "" : " (a race on a GPU)");
            launch_note(w, msg);
        }
    }
    return 1;
}

/* ---- Running a launch: the kernel source itself, compiled for the host (host_kernels.cpp) ---- */

static int kernel_sleepers;
/* The host runner's waits (struct anyccl_host_run): a block with no progress sleeps until a peer's store or a host
 * write wakes it (or 2 ms pass: abort words and flags may be written by host copies that wake nobody). It counts
 * itself a sleeper before it looks at the store count, and a storer counts before it looks for sleepers, so a
 * store is never missed for the whole 2 ms. */
static void kernel_sleep(int ms, const unsigned* stores, unsigned seen) {
    pthread_mutex_lock(&kmu);
    __atomic_add_fetch(&kernel_sleepers, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(stores, __ATOMIC_SEQ_CST) == seen) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += (long)ms * 1000000L;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&kcv, &kmu, &until);
    }
    __atomic_sub_fetch(&kernel_sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&kmu);
}
static void kernel_waiting(int delta) {
    pthread_mutex_lock(&kmu);
    kernels_waiting += delta;
    pthread_mutex_unlock(&kmu);
}
static void kernel_stored(void) {
    if (__atomic_load_n(&kernel_sleepers, __ATOMIC_SEQ_CST)) wake_kernels();
}
/* The address of parameter `p` of a decoded launch (the kernel reads it by value, as from kernelParams). */
static void* param_at(struct kwork* w, int p) {
    switch (p) {
        case P_IN: return w->in;
        case P_TABLE: return &w->table;
        case P_SELF: return &w->self_src;
        case P_SCRATCH: return w->scratch;
        case P_OUT: return &w->out;
        case P_ROUND: return &w->round_vecs;
        case P_FLAGS: return w->flags;
        case P_RANK: return &w->rank;
        case P_WORLD: return &w->world;
        case P_NVEC: return &w->n_vec;
        case P_RECV: return w->recv;
        case P_MY_FLAGS: return &w->flags[w->rank];
        default: return &w->norm;
    }
}

static void kernel_run(void* arg) {
    const struct kwork* w = arg;
    launch_count(w->seq, f_runs);
    uint64_t in[8] = {0}, src = 0;
    int registered = -1;
    if (!run_buffers_ok(w, in, &src, &registered)) {
        launch_count(w->seq, f_failed);
        return;
    }
    pthread_mutex_lock(&mu);
    struct fakehip_launch* l = launch_rec(w->seq);
    if (l) l->last_registered = registered;
    pthread_mutex_unlock(&mu);
    /* The kernel's parameters, as decoded (a copy: graph replays run the same work again). */
    struct kwork k = *w;
    const int* order = kind_of(k.kind, k.quant)->params;
    void* params[16];
    for (int i = 0; order[i] >= 0; i++)
        params[i] = param_at(&k, order[i] == P_IN && k.table_kernel ? P_TABLE : order[i]);
    pthread_mutex_lock(&kmu);
    int timeout = kernel_timeout_ms;
    pthread_mutex_unlock(&kmu);
    if (timeout < 0) {
        const char* env = getenv("FAKEHIP_KERNEL_TIMEOUT_MS");
        timeout = env ? atoi(env) : 20000;
    }
    struct anyccl_host_run run = {
        .abort_word = k.kind == K_RMSNORM ? NULL : flag_word(k.flags[k.rank], K_ABORT_WORD),
        .timeout_ms = timeout,
        .sleep = kernel_sleep,
        .waiting = kernel_waiting,
        .stored = kernel_stored,
    };
    /* The fused push one-shot's blocks read rows that other blocks of the peers push: its blocks run at once. */
    if (anyccl_host_launch(k.name, params, k.blocks, k.threads, k.kind == K_FUSED_PUSH, &run) != 0) {
        launch_note(w, "the host build of the kernel could not run it");
        launch_count(w->seq, f_failed);
        return;
    }
    const int stopped = run.timed_out ? 2 : run.aborted ? 1 : 0;
    if (stopped == 2)
        launch_note(w, is_push(w->kind) ? "timed out waiting for a peer's push"
                                        : "timed out waiting for the other ranks at a barrier");
    launch_count(w->seq, stopped == 0 ? f_completed : stopped == 1 ? f_aborted : f_timed_out);
}


/* Set by cuLaunchKernelEx (fake_cuda.c) for the launch it makes on this thread: programmatic dependent launch. */
static __thread int launch_pdl;

/* Test hook (fakehip_fail_launches): the next `count` launches of a function whose name starts with `prefix`
 * fail with hipErrorLaunchFailure (719) before anything is checked, recorded or run, as a launch on a failing
 * device would. A count of 0 turns it off. */
static char fail_launch_prefix[64];
static int fail_launch_count;
void fakehip_fail_launches(const char* prefix, int count) {
    pthread_mutex_lock(&mu);
    snprintf(fail_launch_prefix, sizeof fail_launch_prefix, "%s", prefix ? prefix : "");
    fail_launch_count = count;
    pthread_mutex_unlock(&mu);
}
hipError_t hipModuleLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shared, void* s, void** params, void** extra) {
    count_call("hipModuleLaunchKernel");
    struct function* fn = f;
    if (fn) {
        pthread_mutex_lock(&mu);
        int fail = fail_launch_count > 0 && strncmp(fn->name, fail_launch_prefix, strlen(fail_launch_prefix)) == 0;
        if (fail) fail_launch_count--;
        pthread_mutex_unlock(&mu);
        if (fail) return 719;
    }
    struct kwork w;
    memset(&w, 0, sizeof w);
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    char why[200] = "";
    hipError_t e = 0;
    int known = 0;
    if (!fn) {
        e = 400, snprintf(why, sizeof why, "null function");
    } else {
        snprintf(w.name, sizeof w.name, "%s", fn->name);
        if (!fn->module->loaded) {
            e = 400, snprintf(why, sizeof why, "its module was unloaded");
        } else if (!parse_kernel(fn->name, &w)) {
            e = 98, snprintf(why, sizeof why, "not an all-reduce kernel the fake can run");
        } else {
            known = 1;
            e = decode_params(&w, params, extra, why, sizeof why);
            if (!e) e = check_launch(&w, grid, block, why, sizeof why);
        }
    }
    pthread_mutex_lock(&mu);
    w.seq = ++n_launches;
    struct fakehip_launch* l = &launches[(w.seq - 1) % MAX_LAUNCHES];
    memset(l, 0, sizeof *l);
    l->seq = w.seq;
    snprintf(l->name, sizeof l->name, "%s", fn ? fn->name : "(null)");
    memcpy(l->grid, grid, sizeof grid);
    memcpy(l->block, block, sizeof block);
    l->shared_bytes = shared;
    l->capturing = fakehip_is_capturing(s);
    l->stream = (uint64_t)(uintptr_t)s;
    l->kernel = known ? w.kind : 0;
    l->table_kernel = known ? w.table_kernel : 0;
    l->dtype = known ? w.dtype : -1;
    l->rank = w.rank, l->world = w.world;
    l->table = w.table, l->self_src = w.self_src, l->out = w.out, l->round_vecs = w.round_vecs, l->n_vec = w.n_vec;
    memcpy(l->in, w.in, 64), memcpy(l->scratch, w.scratch, 64), memcpy(l->flags, w.flags, 64);
    l->last_registered = -1;
    memcpy(l->recv, w.recv, 64);
    l->my_flags = is_push(w.kind) && w.rank >= 0 && w.rank < K_MAX_RANKS ? w.flags[w.rank] : 0;
    l->pdl = launch_pdl;
    launch_pdl = 0;
    l->out_fp8 = w.norm.out_fp8, l->hidden_vec = w.norm.hidden_vec, l->eps = w.norm.eps, l->scale = w.norm.scale;
    l->residual = w.norm.residual, l->weight = w.norm.weight, l->tokens = w.norm.tokens;
    l->quant = w.quant;
    l->status = e;
    pthread_mutex_unlock(&mu);
    if (e) {
        fakehip_add_violation(fn ? fn->name : "hipModuleLaunchKernel", why);
        return e;
    }
    w.blocks = gx;
    w.threads = bx;
    e = enqueue(s, kernel_run, &w, sizeof w, 1);
    if (e) {
        pthread_mutex_lock(&mu);
        l = launch_rec(w.seq);
        if (l) l->status = e;
        pthread_mutex_unlock(&mu);
    }
    return e;
}

/* hipStreamWriteValue32: a stream-ordered 4-byte store (legal during capture, like a memset), which also wakes
 * kernels waiting for their peers (the abort word). */
struct write32_args {
    uint32_t* ptr;
    uint32_t value;
};
static void do_write32(void* a) {
    struct write32_args* c = a;
    __atomic_store_n(c->ptr, c->value, __ATOMIC_RELEASE);
    wake_kernels();
}
hipError_t hipStreamWriteValue32(void* s, void* ptr, uint32_t value, unsigned flags) {
    count_call("hipStreamWriteValue32");
    (void)flags;
    if (!ptr || (uintptr_t)ptr % 4 != 0) return 1;
    struct write32_args c = {ptr, value};
    return fakehip_enqueue(s, do_write32, &c, sizeof c);
}

/* An event recorded behind queued work completes when the stream's worker reaches it. */
struct event {
    int recorded_in_capture;
    int pending; /* markers not reached yet, under amu */
};
hipError_t hipEventCreate(void** e) {
    count_call("hipEventCreate");
    *e = calloc(1, sizeof(struct event));
    return 0;
}
static void event_reached(void* a) {
    struct event* ev = *(struct event**)a;
    pthread_mutex_lock(&amu);
    ev->pending--;
    pthread_cond_broadcast(&acv);
    pthread_mutex_unlock(&amu);
}
static void event_wait(struct event* ev) {
    pthread_mutex_lock(&amu);
    while (ev->pending > 0) pthread_cond_wait(&acv, &amu);
    pthread_mutex_unlock(&amu);
}
hipError_t hipEventRecord(void* e, void* s) {
    count_call("hipEventRecord");
    struct event* ev = e;
    struct stream* st = s;
    ev->recorded_in_capture = fakehip_is_capturing(s);
    if (st && !st->capturing) {
        pthread_mutex_lock(&amu);
        int behind = stream_pending(st);
        if (behind) ev->pending++;
        pthread_mutex_unlock(&amu);
        if (behind) {
            struct node n = {event_reached, &ev, sizeof ev, 0, NULL};
            return run_or_queue(st, &n);
        }
    }
    return 0;
}
hipError_t hipEventSynchronize(void* e) {
    count_call("hipEventSynchronize");
    if (((struct event*)e)->recorded_in_capture && fakehip_any_capture()) {
        fakehip_add_violation("hipEventSynchronize", "waiting for an event recorded in a capture");
        invalidate_captures();
        return 900;
    }
    event_wait(e);
    return 0;
}
hipError_t hipEventElapsedTime(float* ms, void* a, void* b) {
    count_call("hipEventElapsedTime");
    (void)a, (void)b;
    *ms = 0.001f;
    return 0;
}
hipError_t hipEventDestroy(void* e) {
    count_call("hipEventDestroy");
    if (e) event_wait(e); /* its marker still points to it */
    free(e);
    return 0;
}
