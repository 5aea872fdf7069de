/* A fake CUDA driver (libcuda.so.1) for tests: the CUDA driver API entry points anyccl-cuda and cudarc call,
 * each a thin facade over the fake HIP runtime of fake_hip.c, which tests/support/fake_cuda.rs compiles in front
 * of this file as one translation unit. So the fake driver shares everything with the fake HIP runtime: "device"
 * memory is host memory, streams run work on worker threads or capture it into graphs, the capture rules and
 * their violations, IPC handles (threads of one process), and the emulation of anyccl's all-reduce kernels,
 * which it runs from the sm_90 cubin (an ELF of e_machine 190, EM_CUDA, whose FUNC symbols name the kernels).
 * Every cu* call is counted by its exported name (the HIP call it maps onto is counted too).
 *
 * Contexts are the primary contexts of the devices (one per device; current per thread, as hipSetDevice is).
 * Devices: FAKECUDA_DEVICES (default 4), compute capability 9.0 (FAKECUDA_CC_MAJOR changes the major),
 * FAKECUDA_SMS multiprocessors (default 132),
 * no multicast. The VMM calls (cuMem*) and multicast are not emulated: cuMemCreate and friends answer
 * CUDA_ERROR_NOT_SUPPORTED, and cuMulticast* is not exported at all (anyccl must never call it on the machines it
 * is tested on). CUDA's result codes equal HIP's for every code the fake HIP returns except 98
 * (hipErrorInvalidDeviceFunction), which becomes CUDA_ERROR_INVALID_VALUE. */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;

#define CU_STREAM_LEGACY ((void*)1)
#define CU_STREAM_PER_THREAD ((void*)2)

/* A stream handle as the fake HIP knows it: the legacy and per-thread default streams are its null stream. */
static void* hs(void* s) { return s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD ? NULL : s; }
static CUresult cu(hipError_t e) { return e == 98 ? 1 : e; }

static int cu_device_count(void) {
    const char* e = getenv("FAKECUDA_DEVICES");
    int n = e ? atoi(e) : 4;
    int hip = device_count();
    return n < 0 ? 0 : n > hip ? hip : n;
}
static int cu_device_ok(CUdevice d) { return d >= 0 && d < cu_device_count(); }
/* Every device's compute capability major: FAKECUDA_CC_MAJOR, default 9 (minor 0). */
static int cu_cc_major(void) {
    const char* e = getenv("FAKECUDA_CC_MAJOR");
    return e ? atoi(e) : 9;
}

/* ---- Initialisation, devices, contexts ---- */
CUresult cuInit(unsigned flags) {
    count_call("cuInit");
    return flags ? 1 : 0;
}
CUresult cuDriverGetVersion(int* v) {
    count_call("cuDriverGetVersion");
    if (!v) return 1;
    *v = 12080;
    return 0;
}
CUresult cuDeviceGetCount(int* n) {
    count_call("cuDeviceGetCount");
    if (!n) return 1;
    *n = cu_device_count();
    return 0;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    count_call("cuDeviceGet");
    if (!d) return 1;
    if (!cu_device_ok(ordinal)) return 101;
    *d = ordinal;
    return 0;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    count_call("cuDeviceGetName");
    if (!name || len <= 0) return 1;
    if (!cu_device_ok(d)) return 101;
    snprintf(name, (size_t)len, "Fake NVIDIA H200 %d", d);
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    count_call("cuDeviceTotalMem_v2");
    if (!bytes) return 1;
    if (!cu_device_ok(d)) return 101;
    *bytes = FAKE_TOTAL_MEMORY;
    return 0;
}
/* Compute capability 9.0 (so the sm_90 cubin is chosen), FAKECUDA_SMS multiprocessors (132, an H100/H200),
 * stream memory operations and unified addressing; every other attribute reads 0 (multicast among them). */
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    count_call("cuDeviceGetAttribute");
    if (!v) return 1;
    if (!cu_device_ok(d)) return 101;
    const char* sms = getenv("FAKECUDA_SMS");
    switch (attr) {
        case 75: *v = cu_cc_major(); break;          /* COMPUTE_CAPABILITY_MAJOR (FAKECUDA_CC_MAJOR, 9) */
        case 76: *v = 0; break;                       /* COMPUTE_CAPABILITY_MINOR */
        case 16: *v = sms ? atoi(sms) : 132; break;   /* MULTIPROCESSOR_COUNT */
        case 41: case 92: *v = 1; break;              /* UNIFIED_ADDRESSING, CAN_USE_STREAM_MEM_OPS */
        default: *v = 0;
    }
    return 0;
}
CUresult cuDeviceCanAccessPeer(int* ok, CUdevice a, CUdevice b) {
    count_call("cuDeviceCanAccessPeer");
    if (!ok) return 1;
    if (!cu_device_ok(a) || !cu_device_ok(b)) return 101;
    return cu(hipDeviceCanAccessPeer(ok, a, b));
}

/* The primary context of each device: its address is the CUcontext. */
struct cu_context {
    int device;
    int retained;
};
static struct cu_context contexts[K_MAX_RANKS * 2];
static __thread struct cu_context* current_context;
#define N_CONTEXTS ((int)(sizeof contexts / sizeof contexts[0]))
static struct cu_context* context_of(void* c) {
    for (int i = 0; i < N_CONTEXTS; i++)
        if (c == &contexts[i]) return &contexts[i];
    return NULL;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice d) {
    count_call("cuDevicePrimaryCtxRetain");
    if (!ctx) return 1;
    if (!cu_device_ok(d) || d >= N_CONTEXTS) return 101;
    pthread_mutex_lock(&mu);
    contexts[d].device = d;
    contexts[d].retained++;
    pthread_mutex_unlock(&mu);
    *ctx = &contexts[d];
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    count_call("cuDevicePrimaryCtxRelease_v2");
    if (!cu_device_ok(d) || d >= N_CONTEXTS) return 101;
    pthread_mutex_lock(&mu);
    int ok = contexts[d].retained > 0;
    if (ok) contexts[d].retained--;
    pthread_mutex_unlock(&mu);
    if (!ok) fakehip_add_violation("cuDevicePrimaryCtxRelease_v2", "released more often than retained");
    return ok ? 0 : 201;
}
CUresult cuCtxSetCurrent(void* ctx) {
    count_call("cuCtxSetCurrent");
    if (!ctx) {
        current_context = NULL;
        return 0;
    }
    struct cu_context* c = context_of(ctx);
    if (!c || c->retained == 0) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    current_context = c;
    return cu(hipSetDevice(c->device));
}
CUresult cuCtxGetCurrent(void** ctx) {
    count_call("cuCtxGetCurrent");
    if (!ctx) return 1;
    *ctx = current_context;
    return 0;
}
CUresult cuCtxGetDevice(CUdevice* d) {
    count_call("cuCtxGetDevice");
    if (!d) return 1;
    if (!current_context) return 201;
    *d = current_context->device;
    return 0;
}
/* Waits for every stream of the current device, as hipFree does. */
CUresult cuCtxSynchronize(void) {
    count_call("cuCtxSynchronize");
    if (!current_context) return 201;
    drain(NULL, current_context->device);
    return 0;
}
/* Peer access as the driver grants it: from the current context to another device's (CUDA_ERROR_INVALID_DEVICE
 * for its own, CUDA_ERROR_INVALID_CONTEXT without a current context), once
 * (CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED after that); potentially unsafe during capture, as in HIP. */
static int peer_enabled[N_CONTEXTS][N_CONTEXTS];
CUresult cuCtxEnablePeerAccess(void* peer, unsigned flags) {
    struct cu_context* p = context_of(peer);
    if (flags) return 1;
    if (!p || !current_context) return 201;
    if (p == current_context) return 101;
    CUresult e = cu(hipDeviceEnablePeerAccess(p->device, 0));
    count_call("cuCtxEnablePeerAccess");
    if (e) return e;
    pthread_mutex_lock(&mu);
    int* on = &peer_enabled[current_context->device][p->device];
    int again = *on;
    *on = 1;
    pthread_mutex_unlock(&mu);
    return again ? 704 : 0;
}

/* ---- Memory ---- */
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    count_call("cuMemAlloc_v2");
    if (!p) return 1;
    if (n == 0) return 1; /* CUDA refuses zero bytes */
    void* q = NULL;
    CUresult e = cu(hipMalloc(&q, n));
    *p = (CUdeviceptr)(uintptr_t)q;
    return e;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    count_call("cuMemFree_v2");
    return cu(hipFree((void*)(uintptr_t)p));
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    count_call("cuMemGetInfo_v2");
    if (!free_bytes || !total) return 1;
    return cu(hipMemGetInfo(free_bytes, total));
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
    count_call("cuMemGetAddressRange_v2");
    void* b = NULL;
    size_t s = 0;
    CUresult e = cu(hipMemGetAddressRange(&b, &s, (void*)(uintptr_t)p));
    if (e) return e;
    if (base) *base = (CUdeviceptr)(uintptr_t)b;
    if (size) *size = s;
    return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    count_call("cuMemcpyHtoDAsync_v2");
    return cu(hipMemcpyAsync((void*)(uintptr_t)dst, src, n, 1, hs(s)));
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    count_call("cuMemcpyDtoHAsync_v2");
    return cu(hipMemcpyAsync(dst, (const void*)(uintptr_t)src, n, 2, hs(s)));
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    count_call("cuMemcpyDtoDAsync_v2");
    return cu(hipMemcpyAsync((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n, 3, hs(s)));
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    count_call("cuMemcpyHtoD_v2");
    return cu(hipMemcpy((void*)(uintptr_t)dst, src, n, 1));
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    count_call("cuMemcpyDtoH_v2");
    return cu(hipMemcpy(dst, (const void*)(uintptr_t)src, n, 2));
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    count_call("cuMemcpyDtoD_v2");
    return cu(hipMemcpy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n, 3));
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
    count_call("cuMemsetD8Async");
    return cu(hipMemsetAsync((void*)(uintptr_t)dst, v, n, hs(s)));
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    count_call("cuMemsetD8_v2");
    return cu(hipMemsetAsync((void*)(uintptr_t)dst, v, n, NULL));
}
/* CU_POINTER_ATTRIBUTE_*: what anyccl asks of cuMemAlloc memory. BUFFER_ID (7) is the allocation's serial id
 * (a new one after a free, even at a reused address), IS_LEGACY_CUDA_IPC_CAPABLE (10) is 1, MEMORY_TYPE (2) is
 * CU_MEMORYTYPE_DEVICE, DEVICE_POINTER (3) the pointer, RANGE_START_ADDR (11) / RANGE_SIZE (12) the allocation;
 * an address in no live allocation is CUDA_ERROR_INVALID_VALUE, other attributes CUDA_ERROR_NOT_SUPPORTED. */
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
    count_call("cuPointerGetAttribute");
    if (!data) return 1;
    pthread_mutex_lock(&mu);
    const struct alloc* a = NULL;
    for (int i = 0; i < n_allocs && !a; i++)
        if (p >= allocs[i].base && p - allocs[i].base < allocs[i].size) a = &allocs[i];
    uint64_t id = a ? a->id : 0, base = a ? a->base : 0, size = a ? a->size : 0;
    pthread_mutex_unlock(&mu);
    if (!a) return 1;
    switch (attr) {
        case 7: memcpy(data, &id, 8); return 0;
        case 10: *(int*)data = 1; return 0;
        case 2: *(unsigned*)data = 2; return 0;
        case 3: memcpy(data, &p, 8); return 0;
        case 11: memcpy(data, &base, 8); return 0;
        case 12: memcpy(data, &size, 8); return 0;
        default: return 801;
    }
}

/* ---- Streams and capture ---- */
/* Blocking streams (created with CU_STREAM_DEFAULT): a capture on one makes the legacy stream of its device
 * answer CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, as the driver does. */
static void* blocking_streams[MAX_STREAMS];
static void note_blocking(void* s, int add) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (add && !blocking_streams[i]) { blocking_streams[i] = s; break; }
        if (!add && blocking_streams[i] == s) blocking_streams[i] = NULL;
    }
    pthread_mutex_unlock(&mu);
}
CUresult cuStreamCreate(void** s, unsigned flags) {
    count_call("cuStreamCreate");
    if (!s || flags > 1) return 1;
    CUresult e = cu(hipStreamCreateWithFlags(s, flags));
    if (!e && flags == 0) note_blocking(*s, 1);
    return e;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned flags, int priority) {
    (void)priority;
    return cuStreamCreate(s, flags);
}
CUresult cuStreamDestroy_v2(void* s) {
    count_call("cuStreamDestroy_v2");
    if (!hs(s)) return 400;
    note_blocking(s, 0);
    return cu(hipStreamDestroy(s));
}
CUresult cuStreamSynchronize(void* s) {
    count_call("cuStreamSynchronize");
    return cu(hipStreamSynchronize(hs(s)));
}
CUresult cuStreamQuery(void* s) {
    count_call("cuStreamQuery");
    return cu(hipStreamQuery(hs(s)));
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    count_call("cuStreamIsCapturing");
    if (!status) return 1;
    if (!hs(s)) {
        /* The legacy stream: implicitly synchronised with every blocking stream of the current device. */
        int implicit = 0;
        pthread_mutex_lock(&mu);
        for (int i = 0; i < MAX_STREAMS; i++) {
            const struct stream* b = blocking_streams[i];
            implicit |= b != NULL && b->capturing && b->device == current_device;
        }
        pthread_mutex_unlock(&mu);
        *status = 0;
        return implicit ? 906 : 0;
    }
    unsigned long long id = 0;
    return cu(hipStreamGetCaptureInfo(s, status, &id));
}
CUresult cuStreamGetCaptureInfo_v2(void* s, int* status, unsigned long long* id, void** graph, const void** deps,
                                   size_t* n_deps) {
    count_call("cuStreamGetCaptureInfo_v2");
    if (!status) return 1;
    if (graph) *graph = NULL;
    if (deps) *deps = NULL;
    if (n_deps) *n_deps = 0;
    if (!hs(s)) {
        *status = 0;
        return 0;
    }
    return cu(hipStreamGetCaptureInfo(s, status, id));
}
CUresult cuStreamGetCaptureInfo(void* s, int* status, unsigned long long* id) {
    return cuStreamGetCaptureInfo_v2(s, status, id, NULL, NULL, NULL);
}
/* CUDA 12.3's form, with edge data (none here). */
CUresult cuStreamGetCaptureInfo_v3(void* s, int* status, unsigned long long* id, void** graph, const void** deps,
                                   const void** edges, size_t* n_deps) {
    if (edges) *edges = NULL;
    return cuStreamGetCaptureInfo_v2(s, status, id, graph, deps, n_deps);
}
CUresult cuStreamBeginCapture_v2(void* s, int mode) {
    count_call("cuStreamBeginCapture_v2");
    if (!hs(s)) return 906; /* the legacy stream cannot capture */
    if (mode < 0 || mode > 2) return 1;
    return cu(hipStreamBeginCapture(s, mode));
}
CUresult cuStreamEndCapture(void* s, void** graph) {
    count_call("cuStreamEndCapture");
    if (!graph) return 1;
    if (!hs(s)) return 903;
    return cu(hipStreamEndCapture(s, graph));
}
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
    count_call("cuThreadExchangeStreamCaptureMode");
    return cu(hipThreadExchangeStreamCaptureMode(mode));
}
CUresult cuStreamWriteValue32_v2(void* s, CUdeviceptr addr, unsigned value, unsigned flags) {
    count_call("cuStreamWriteValue32_v2");
    return cu(hipStreamWriteValue32(hs(s), (void*)(uintptr_t)addr, value, flags));
}
CUresult cuStreamWriteValue32(void* s, CUdeviceptr addr, unsigned value, unsigned flags) {
    return cuStreamWriteValue32_v2(s, addr, value, flags);
}

/* ---- Graphs ---- */
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long flags) {
    count_call("cuGraphInstantiateWithFlags");
    if (!exec) return 1;
    if (flags) return 801;
    return cu(hipGraphInstantiate(exec, graph, NULL, NULL, 0));
}
CUresult cuGraphInstantiate_v2(void** exec, void* graph, void** err_node, char* log, size_t log_size) {
    count_call("cuGraphInstantiate_v2");
    if (!exec) return 1;
    return cu(hipGraphInstantiate(exec, graph, err_node, log, log_size));
}
CUresult cuGraphLaunch(void* exec, void* s) {
    count_call("cuGraphLaunch");
    return cu(hipGraphLaunch(exec, hs(s)));
}
CUresult cuGraphExecDestroy(void* exec) {
    count_call("cuGraphExecDestroy");
    return cu(hipGraphExecDestroy(exec));
}
CUresult cuGraphDestroy(void* g) {
    count_call("cuGraphDestroy");
    return cu(hipGraphDestroy(g));
}

/* ---- Events ---- */
CUresult cuEventCreate(void** e, unsigned flags) {
    count_call("cuEventCreate");
    (void)flags;
    if (!e) return 1;
    return cu(hipEventCreate(e));
}
CUresult cuEventRecord(void* e, void* s) {
    count_call("cuEventRecord");
    if (!e) return 400;
    return cu(hipEventRecord(e, hs(s)));
}
CUresult cuEventSynchronize(void* e) {
    count_call("cuEventSynchronize");
    if (!e) return 400;
    return cu(hipEventSynchronize(e));
}
CUresult cuEventQuery(void* e) {
    count_call("cuEventQuery");
    if (!e) return 400;
    pthread_mutex_lock(&amu);
    int pending = ((struct event*)e)->pending > 0;
    pthread_mutex_unlock(&amu);
    return pending ? 600 : 0;
}
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    count_call("cuEventElapsedTime");
    if (!ms || !a || !b) return 1;
    return cu(hipEventElapsedTime(ms, a, b));
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }
CUresult cuEventDestroy_v2(void* e) {
    count_call("cuEventDestroy_v2");
    if (!e) return 400;
    return cu(hipEventDestroy(e));
}
/* Stream order after an event: on a capturing stream the captured work is already in order (one stream per
 * graph here); otherwise the host waits for the event before later work is enqueued, which orders no less. */
CUresult cuStreamWaitEvent(void* s, void* e, unsigned flags) {
    count_call("cuStreamWaitEvent");
    (void)flags;
    if (!e) return 400;
    if (hs(s) && ((struct stream*)s)->capturing) return 0;
    event_wait(e);
    return 0;
}

/* ---- Modules and launches ---- */
/* A cubin: a 64-bit ELF for EM_CUDA (190). Copied with its e_machine set to AMDGPU's, the fake HIP runtime's
 * hipModuleLoadData loads it (checks, copy, FUNC symbol lookup by name). Anything else (PTX text, a fatbin, an
 * AMDGPU code object) is CUDA_ERROR_INVALID_IMAGE. */
CUresult cuModuleLoadData(void** m, const void* image) {
    count_call("cuModuleLoadData");
    const unsigned char* b = image;
    if (!m || !b) return 1;
    if (memcmp(b, "\x7f" "ELF", 4) != 0 || b[4] != 2 || b[18] != 190 || b[19] != 0) return 200;
    size_t size = elf_size(b);
    if (size == 0) return 200;
    unsigned char* copy = malloc(size);
    if (!copy) return 2;
    memcpy(copy, b, size);
    copy[18] = 0xe0;
    CUresult e = cu(hipModuleLoadData(m, copy));
    free(copy);
    return e;
}
CUresult cuModuleUnload(void* m) {
    count_call("cuModuleUnload");
    return cu(hipModuleUnload(m));
}
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
    count_call("cuModuleGetFunction");
    return cu(hipModuleGetFunction(f, m, name));
}
/* Occupancy: FAKECUDA_BLOCKS_PER_SM (default 2) blocks of up to 1024 threads per multiprocessor. */
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void* f, int block, size_t shared) {
    count_call("cuOccupancyMaxActiveBlocksPerMultiprocessor");
    (void)shared;
    if (!n || !f) return 1;
    if (block <= 0 || block > 1024) return 1;
    const char* e = getenv("FAKECUDA_BLOCKS_PER_SM");
    *n = e ? atoi(e) : 2;
    return 0;
}
/* cuLaunchKernel: hipModuleLaunchKernel, with `extra`'s CU_LAUNCH_PARAM_END (0) turned into HIP's (3). */
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* s, void** params, void** extra) {
    count_call("cuLaunchKernel");
    void* hip_extra[16];
    void** ex = NULL;
    if (extra) {
        int i = 0;
        for (; i + 1 < 16 && extra[i] != NULL; i += 2) hip_extra[i] = extra[i], hip_extra[i + 1] = extra[i + 1];
        if (i + 1 >= 16) return 1;
        hip_extra[i] = (void*)3;
        ex = hip_extra;
    }
    return cu(hipModuleLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, hs(s), params, ex));
}

/* cuLaunchKernelEx: CUlaunchConfig's grid, block, shared bytes, stream and attributes. The only attribute the fake
 * takes is CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6), and only on compute capability 9.0 or newer
 * (CUDA_ERROR_NOT_SUPPORTED otherwise); IGNORE (0) is skipped, any other is CUDA_ERROR_INVALID_VALUE. The launch
 * is then cuLaunchKernel's, recorded with `pdl` set when the attribute allowed it. */
typedef struct {
    unsigned grid[3], block[3], shared;
    void* stream;
    struct cu_launch_attribute {
        int id;
        int pad;
        union {
            int allowed;
            char bytes[64];
        } value;
    }* attrs;
    unsigned n_attrs;
} CUlaunchConfig;
CUresult cuLaunchKernelEx(const CUlaunchConfig* c, void* f, void** params, void** extra) {
    count_call("cuLaunchKernelEx");
    if (!c || (c->n_attrs && !c->attrs)) return 1;
    int pdl = 0;
    for (unsigned i = 0; i < c->n_attrs; i++) {
        if (c->attrs[i].id == 0) continue;
        if (c->attrs[i].id != 6) return 1;
        if (cu_cc_major() < 9) return 801;
        pdl = c->attrs[i].value.allowed != 0;
    }
    launch_pdl = pdl;
    CUresult e = cuLaunchKernel(f, c->grid[0], c->grid[1], c->grid[2], c->block[0], c->block[1], c->block[2],
                                c->shared, c->stream, params, extra);
    launch_pdl = 0;
    return e;
}

/* ---- IPC (legacy handles) ---- */
typedef struct {
    char reserved[64];
} CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
    count_call("cuIpcGetMemHandle");
    if (!h) return 1;
    return cu(hipIpcGetMemHandle(h, (void*)(uintptr_t)p));
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* p, CUipcMemHandle h, unsigned flags) {
    count_call("cuIpcOpenMemHandle_v2");
    if (!p) return 1;
    if (flags != 1) return 1; /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS is the only flag */
    hipIpcMemHandle_t hh;
    memcpy(hh.reserved, h.reserved, 64);
    void* q = NULL;
    CUresult e = cu(hipIpcOpenMemHandle(&q, hh, 0));
    if (!e) *p = (CUdeviceptr)(uintptr_t)q;
    return e;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    count_call("cuIpcCloseMemHandle");
    return cu(hipIpcCloseMemHandle((void*)(uintptr_t)p));
}

/* ---- VMM: not emulated ---- */
#define NOT_SUPPORTED(name)         \
    CUresult name(void) {           \
        count_call(#name);          \
        return 801;                 \
    }
NOT_SUPPORTED(cuMemCreate)
NOT_SUPPORTED(cuMemRelease)
NOT_SUPPORTED(cuMemMap)
NOT_SUPPORTED(cuMemUnmap)
NOT_SUPPORTED(cuMemSetAccess)
NOT_SUPPORTED(cuMemAddressReserve)
NOT_SUPPORTED(cuMemAddressFree)
NOT_SUPPORTED(cuMemGetAllocationGranularity)
NOT_SUPPORTED(cuMemExportToShareableHandle)
NOT_SUPPORTED(cuMemImportFromShareableHandle)

/* ---- Errors ---- */
static const char* cu_error_name(CUresult e) {
    switch (e) {
        case 0: return "CUDA_SUCCESS";
        case 1: return "CUDA_ERROR_INVALID_VALUE";
        case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
        case 3: return "CUDA_ERROR_NOT_INITIALIZED";
        case 100: return "CUDA_ERROR_NO_DEVICE";
        case 101: return "CUDA_ERROR_INVALID_DEVICE";
        case 200: return "CUDA_ERROR_INVALID_IMAGE";
        case 201: return "CUDA_ERROR_INVALID_CONTEXT";
        case 400: return "CUDA_ERROR_INVALID_HANDLE";
        case 401: return "CUDA_ERROR_ILLEGAL_STATE";
        case 500: return "CUDA_ERROR_NOT_FOUND";
        case 600: return "CUDA_ERROR_NOT_READY";
        case 704: return "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED";
        case 801: return "CUDA_ERROR_NOT_SUPPORTED";
        case 900: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
        case 901: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
        case 903: return "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED";
        case 906: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
        default: return NULL;
    }
}
CUresult cuGetErrorName(CUresult e, const char** s) {
    if (!s) return 1;
    *s = cu_error_name(e);
    return *s ? 0 : 1;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
    if (!s) return 1;
    const char* n = cu_error_name(e);
    *s = n ? n + (e == 0 ? 0 : 11) : NULL; /* the name without CUDA_ERROR_, as text (the fake has no prose) */
    return *s ? 0 : 1;
}
/* Test interface beside fakehip_*: the number of retained primary contexts (all released when every user dropped). */
int fakecuda_contexts_retained(void) {
    int n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < N_CONTEXTS; i++) n += contexts[i].retained;
    pthread_mutex_unlock(&mu);
    return n;
}
