/* A fake HIP runtime for tests: host memory stands in for device memory, streams run their work at once, and
 * stream capture records that work into graphs that replay it. It enforces the capture rules of HIP (the same as
 * CUDA's): while a stream captures in global mode anywhere, or in any mode on the calling thread, "potentially
 * unsafe" calls (allocation, free, synchronous copies, IPC opens, module loads) fail with
 * hipErrorStreamCaptureUnsupported (900), invalidate the capture, and are recorded as violations; synchronising a
 * capturing stream or an event recorded in one is a violation too. Tests read the record through the fakehip_*
 * functions. Every call is counted by name. Nothing here is thread-safe beyond one mutex around the records. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
/* Live allocations, for hipMemGetAddressRange; tests can make the next hipMalloc "succeed" with a null pointer
 * or make the reported ranges shorter than the allocations, as a broken runtime might. */
#define MAX_ALLOCS 4096
static struct { uintptr_t base; size_t size; } allocs[MAX_ALLOCS];
static int n_allocs;
static int next_malloc_null;
static size_t range_shrink;
void fakehip_next_malloc_null(void) { next_malloc_null = 1; }
void fakehip_set_range_shrink(size_t bytes) { range_shrink = bytes; }
void fakehip_reset(void) {
    pthread_mutex_lock(&mu);
    n_violations = 0;
    n_call_names = 0;
    next_malloc_null = 0;
    range_shrink = 0;
    pthread_mutex_unlock(&mu);
}

typedef void (*work_fn)(void* arg);
struct node {
    work_fn fn;
    void* arg;
    size_t arg_size;
    struct node* next;
};
struct stream {
    int device;
    int capturing;
    int mode; /* 0 global, 1 thread-local, 2 relaxed */
    int invalidated;
    pthread_t owner;
    struct node *head, *tail;
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
    c->arg_size = n->arg_size;
    c->arg = malloc(n->arg_size ? n->arg_size : 1);
    memcpy(c->arg, n->arg, n->arg_size);
    return c;
}

/* Runs `fn(arg)` in stream order: now, or recorded into the stream's capture. `arg` is copied. Used by the fake
 * RCCL for its "kernels". */
int fakehip_enqueue(void* s, work_fn fn, const void* arg, size_t size) {
    struct stream* st = s;
    struct node n = {fn, (void*)arg, size, NULL};
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
    fn((void*)arg);
    return 0;
}

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
    if (n_allocs < MAX_ALLOCS) {
        allocs[n_allocs].base = (uintptr_t)*p;
        allocs[n_allocs].size = size;
        n_allocs++;
    }
    pthread_mutex_unlock(&mu);
    return 0;
}
hipError_t hipFree(void* p) {
    hipError_t e = unsafe_call("hipFree");
    if (e) return e;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_allocs; i++)
        if (allocs[i].base == (uintptr_t)p) {
            allocs[i] = allocs[--n_allocs];
            break;
        }
    pthread_mutex_unlock(&mu);
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
hipError_t hipMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* s) {
    count_call("hipMemcpyAsync");
    (void)kind;
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
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i]) {
            streams[i] = st;
            break;
        }
    pthread_mutex_unlock(&mu);
    *s = st;
    return 0;
}
hipError_t hipStreamDestroy(void* s) {
    count_call("hipStreamDestroy");
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] == s) streams[i] = NULL;
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
        hipError_t e = fakehip_enqueue(s, n->fn, n->arg, n->arg_size);
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

/* IPC in one process: the handle carries the address. */
hipError_t hipIpcGetMemHandle(void* handle, void* p) {
    hipError_t e = unsafe_call("hipIpcGetMemHandle");
    if (e) return e;
    memset(handle, 0, 64);
    memcpy(handle, "FAKEHIP", 7);
    memcpy((char*)handle + 8, &p, sizeof p);
    return 0;
}
hipError_t hipIpcOpenMemHandle(void** p, char handle[64], unsigned flags) {
    hipError_t e = unsafe_call("hipIpcOpenMemHandle");
    if (e) return e;
    (void)flags;
    if (memcmp(handle, "FAKEHIP", 7) != 0) return 400;
    memcpy(p, handle + 8, sizeof *p);
    return 0;
}
hipError_t hipIpcCloseMemHandle(void* p) {
    (void)p;
    return unsafe_call("hipIpcCloseMemHandle");
}
hipError_t hipDeviceCanAccessPeer(int* ok, int a, int b) {
    count_call("hipDeviceCanAccessPeer");
    *ok = a != b;
    return 0;
}
hipError_t hipDeviceEnablePeerAccess(int peer, unsigned flags) {
    (void)peer, (void)flags;
    return unsafe_call("hipDeviceEnablePeerAccess");
}

/* Modules: a code object is accepted when it is AMDGPU ELF (e_machine 224); kernels are found by name, but the
 * fake cannot run GPU code, so a launch fails with hipErrorInvalidDeviceFunction. */
struct module {
    const unsigned char* image;
};
hipError_t hipModuleLoadData(void** m, const void* image) {
    hipError_t e = unsafe_call("hipModuleLoadData");
    if (e) return e;
    const unsigned char* b = image;
    if (memcmp(b, "\x7f" "ELF", 4) != 0 || b[18] != 0xe0) return 200;
    struct module* mod = calloc(1, sizeof *mod);
    mod->image = b;
    *m = mod;
    return 0;
}
hipError_t hipModuleUnload(void* m) {
    hipError_t e = unsafe_call("hipModuleUnload");
    if (e) return e;
    free(m);
    return 0;
}
hipError_t hipModuleGetFunction(void** f, void* m, const char* name) {
    count_call("hipModuleGetFunction");
    (void)m;
    *f = (void*)name;
    return 0;
}
hipError_t hipModuleLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shared, void* s, void** params, void** extra) {
    count_call("hipModuleLaunchKernel");
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)s, (void)params,
        (void)extra;
    return 98;
}

struct event {
    int recorded_in_capture;
};
hipError_t hipEventCreate(void** e) {
    count_call("hipEventCreate");
    *e = calloc(1, sizeof(struct event));
    return 0;
}
hipError_t hipEventRecord(void* e, void* s) {
    count_call("hipEventRecord");
    ((struct event*)e)->recorded_in_capture = fakehip_is_capturing(s);
    return 0;
}
hipError_t hipEventSynchronize(void* e) {
    count_call("hipEventSynchronize");
    if (((struct event*)e)->recorded_in_capture && fakehip_any_capture()) {
        fakehip_add_violation("hipEventSynchronize", "waiting for an event recorded in a capture");
        invalidate_captures();
        return 900;
    }
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
    free(e);
    return 0;
}
