/* A fake CUDA driver (libcuda.so.1) for tests: the CUDA driver API entry points anyccl-cuda and cudarc call,
 * each a thin facade over the fake HIP runtime of fake_hip.c, which testkit/src/fake_cuda.rs compiles in front
 * of this file as one translation unit. So the fake driver shares everything with the fake HIP runtime: "device"
 * memory is host memory, streams run work on worker threads or capture it into graphs, the capture rules and
 * their violations, IPC handles (threads of one process), and the emulation of anyccl's all-reduce kernels,
 * which it runs from the sm_90 cubin (an ELF of e_machine 190, EM_CUDA, whose FUNC symbols name the kernels).
 * Every cu* call is counted by its exported name (the HIP call it maps onto is counted too).
 *
 * Contexts are the primary contexts of the devices (one per device; current per thread, as hipSetDevice is).
 * Devices: FAKECUDA_DEVICES (default 4), compute capability 9.0 (FAKECUDA_CC_MAJOR changes the major),
 * FAKECUDA_SMS multiprocessors (default 132),
 * no multicast by default: the VMM calls (cuMem*) and cuMulticast* answer CUDA_ERROR_NOT_SUPPORTED unless a test
 * sets FAKECUDA_MULTICAST=1, which turns the multicast emulation on (see "VMM and multicast" below; anyccl must
 * never call the real cuMulticastCreate on the machines it is tested on). CUDA's result codes equal HIP's for every code the fake HIP returns except 98
 * (hipErrorInvalidDeviceFunction), which becomes CUDA_ERROR_INVALID_VALUE. */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;

#define CU_STREAM_LEGACY ((void*)1)
#define CU_STREAM_PER_THREAD ((void*)2)

static int mc_enabled(void);
static CUresult mc_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, void* s, void** params, void** extra);

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
 * stream memory operations, unified addressing and a PCI bus per device; every other attribute reads 0 (multicast
 * among them, unless FAKECUDA_MULTICAST=1). */
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
        case 132: *v = mc_enabled(); break;           /* MULTICAST_SUPPORTED (FAKECUDA_MULTICAST=1) */
        case 33: *v = 0x18 + d; break;                /* PCI_BUS_ID: a bus of its own per device */
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
    const struct function* fn = f;
    if (fn && strncmp(fn->name, "anyccl_nvls_", 12) == 0 && strstr(fn->name, "_mc_"))
        return mc_launch(fn->name, gx, gy, gz, bx, by, bz, s, params, extra);
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

/* ---- VMM and multicast: only where a test asks (FAKECUDA_MULTICAST=1) ----
 * Without FAKECUDA_MULTICAST=1 (the default) every cuMem* VMM call and every cuMulticast* call answers
 * CUDA_ERROR_NOT_SUPPORTED (801), counted, and the devices report no multicast (attribute 132 reads 0).
 *
 * With it, the devices report multicast, and:
 * - cuMemCreate makes a memfd of the size (a multiple of the 2 MiB granularity) with a host mapping of its own;
 *   cuMemAddressReserve reserves real address space (PROT_NONE); cuMemMap of a physical handle maps the memfd
 *   there (so the unicast address aliases the allocation); cuMemMap of a multicast handle must use offset 0 and
 *   leaves the range inaccessible: only the emulated multimem kernels reach it, through the bindings;
 * - cuMulticastCreate makes an object whose state (size, devices added, bindings) lives in a memfd of its own, so
 *   that processes share it; cuMemExportToShareableHandle gives a new descriptor of it (a real fd: peers in the
 *   process use dup, other processes receive it over a Unix socket), cuMemImportFromShareableHandle finds the
 *   object by the descriptor's inode, or, in a process that has not seen it yet, maps the shared state from the
 *   descriptor; an object lives in a process while a handle, a mapping or a descriptor there refers to it;
 * - a binding records the binding process and its allocation's memfd; a kernel in another process reaches that
 *   memory through /proc/<pid>/fd/<fd> (mapped once, MAP_SHARED), so ranks as processes reduce real data;
 * - cuMulticastBindMem needs every device added first (in every process), a physical allocation of an added
 *   device, and aligned, non-overlapping ranges; cuMulticastUnbind unbinds this process's memory only; releasing
 *   an allocation still bound or a handle still mapped is a violation;
 * - the kernels anyccl_nvls_{zero_copy,block_pipeline,warp_pipeline}_mc_{f32,f16,bf16} run emulated on the
 *   stream: multimem.ld_reduce sums the element over every device bound at that offset (in device order, in f32),
 *   multimem.st stores into every one, and multimem.red on the flag arrays' multicast address adds to every
 *   device's arrival counter (the kernels' barrier), with the abort word and FAKEHIP_KERNEL_TIMEOUT_MS honoured.
 * Every call is logged in order ("call kind#id ...") for fakecuda_mc_log; fakecuda_mc_fail makes one call fail. */
#include <dirent.h>
#include <sched.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#define MC_G ((size_t)2 << 20)
#define MC_MAX 64
#define MC_BIND_MAX 32
static int mc_enabled(void) {
    const char* e = getenv("FAKECUDA_MULTICAST");
    return e && strcmp(e, "1") == 0;
}
struct vmm_phys {
    int live, fd, device, handles, maps, binds;
    size_t size;
    unsigned char* backing;
    ino_t ino;
};
/* A binding, in the object's shared state: the binding process and its allocation's memfd there. */
struct mc_binding {
    int live, device, pid, fd;
    size_t offset, size, mem_offset;
    unsigned gen;
};
#define MC_SHARED_MAGIC 0x666b636d63737431ull
/* The state of a multicast object that every process using it shares (the object's memfd, mapped MAP_SHARED). */
struct mc_shared {
    uint64_t magic;
    int lock, num_devices, added;
    unsigned devices, gen;
    size_t size;
    struct mc_binding b[MC_BIND_MAX];
};
/* Another process's allocation as this process mapped it (through /proc/<pid>/fd/<fd>). */
struct mc_remote {
    int pid, fd;
    unsigned gen;
    unsigned char* base;
    size_t len;
};
struct mc_obj {
    int live, fd, handles, maps;
    ino_t ino;
    struct mc_shared* sh;
    int local_phys[MC_BIND_MAX]; /* this process's allocation of binding k (where the binding's pid is ours) */
    struct mc_remote remote[MC_BIND_MAX];
};
struct vmm_handle {
    int live, kind, obj; /* kind 1: physical, 2: multicast */
};
struct vmm_range {
    int live, kind, obj; /* kind 0: a reservation; 1 / 2: a mapping of a physical / multicast handle */
    uint64_t va;
    size_t size;
    void* region; /* reservations: the mmap'd region */
    size_t region_size;
};
static struct vmm_phys phys[MC_MAX];
static void sh_lock(struct mc_shared* sh) {
    while (__atomic_exchange_n(&sh->lock, 1, __ATOMIC_ACQUIRE)) sched_yield();
}
static void sh_unlock(struct mc_shared* sh) { __atomic_store_n(&sh->lock, 0, __ATOMIC_RELEASE); }
static struct mc_obj mcs[MC_MAX];
static struct vmm_handle handles[MC_MAX * 4];
static struct vmm_range ranges[MC_MAX * 4];
static pthread_mutex_t vmu = PTHREAD_MUTEX_INITIALIZER;
static char mc_log_buf[1 << 16];
static size_t mc_log_len;
static void mc_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void mc_log(const char* fmt, ...) {
    char line[200];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (mc_log_len + (size_t)n < sizeof mc_log_buf) {
        memcpy(mc_log_buf + mc_log_len, line, (size_t)n);
        mc_log_len += (size_t)n;
    }
}
#define H_BASE 0x1000ull
static struct vmm_handle* handle_of(unsigned long long h) {
    if (h < H_BASE || h - H_BASE >= sizeof handles / sizeof handles[0]) return NULL;
    struct vmm_handle* x = &handles[h - H_BASE];
    return x->live ? x : NULL;
}
static unsigned long long new_handle(int kind, int obj) {
    for (size_t i = 0; i < sizeof handles / sizeof handles[0]; i++)
        if (!handles[i].live) {
            handles[i] = (struct vmm_handle){1, kind, obj};
            return H_BASE + i;
        }
    return 0;
}
static int mc_memfd(const char* name, size_t size, ino_t* ino) {
    int fd = (int)syscall(SYS_memfd_create, name, 0);
    if (fd < 0) return -1;
    struct stat st;
    if ((size && ftruncate(fd, (off_t)size) != 0) || fstat(fd, &st) != 0) {
        close(fd);
        return -1;
    }
    *ino = st.st_ino;
    return fd;
}
/* Open descriptors of this process (other than `except`) on the inode `ino`. */
static int fds_on(ino_t ino, int except) {
    int n = 0;
    DIR* d = opendir("/proc/self/fd");
    if (!d) return 0;
    const struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        struct stat st;
        if (e->d_name[0] == '.' || fd == except || fd == dirfd(d)) continue;
        if (fstat(fd, &st) == 0 && st.st_ino == ino && S_ISREG(st.st_mode)) n++;
    }
    closedir(d);
    return n;
}
/* Frees objects nothing refers to any more (under vmu). */
static void mc_collect(void) {
    for (int i = 0; i < MC_MAX; i++) {
        struct mc_obj* o = &mcs[i];
        if (o->live && o->handles == 0 && o->maps == 0 && fds_on(o->ino, o->fd) == 0) {
            sh_lock(o->sh);
            for (int k = 0; k < MC_BIND_MAX; k++)
                if (o->sh->b[k].live && o->sh->b[k].pid == getpid())
                    fakehip_add_violation("multicast", "an object freed with memory still bound");
            sh_unlock(o->sh);
            for (int k = 0; k < MC_BIND_MAX; k++)
                if (o->remote[k].base) munmap(o->remote[k].base, o->remote[k].len);
            munmap(o->sh, sizeof *o->sh);
            close(o->fd);
            o->live = 0;
            mc_log("free mc#%d", i);
        }
        struct vmm_phys* p = &phys[i];
        if (p->live && p->handles == 0 && p->maps == 0) {
            if (p->binds) fakehip_add_violation("cuMemRelease", "an allocation freed while bound to a multicast object");
            munmap(p->backing, p->size);
            close(p->fd);
            p->live = 0;
            mc_log("free mem#%d", i);
        }
    }
}

/* Test interface: the `nth` call of `name` from now on fails with CUDA_ERROR_OUT_OF_MEMORY (nth 0: none). */
static char mc_fail_name[64];
static int mc_fail_nth, mc_fail_seen;
void fakecuda_mc_fail(const char* name, int nth) {
    pthread_mutex_lock(&vmu);
    snprintf(mc_fail_name, sizeof mc_fail_name, "%s", name ? name : "");
    mc_fail_nth = nth;
    mc_fail_seen = 0;
    pthread_mutex_unlock(&vmu);
}
static int mc_should_fail(const char* name) {
    pthread_mutex_lock(&vmu);
    int fail = mc_fail_nth > 0 && strcmp(name, mc_fail_name) == 0 && ++mc_fail_seen == mc_fail_nth;
    if (fail) mc_log("fail %s", name);
    pthread_mutex_unlock(&vmu);
    return fail;
}

CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
    count_call("cuMemGetAllocationGranularity");
    if (!mc_enabled()) return 801;
    if (!g || !prop || option < 0 || option > 1) return 1;
    *g = MC_G;
    return 0;
}
CUresult cuMulticastGetGranularity(size_t* g, const void* prop, int option) {
    count_call("cuMulticastGetGranularity");
    if (!mc_enabled()) return 801;
    if (!g || !prop || option < 0 || option > 1) return 1;
    *g = MC_G;
    return 0;
}
/* CUmemAllocationProp: type at 0, requested handle types at 4, location (type, id) at 8 and 12. */
CUresult cuMemCreate(unsigned long long* h, size_t size, const void* prop, unsigned long long flags) {
    count_call("cuMemCreate");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMemCreate")) return 2;
    if (!h || !prop || flags || size == 0 || size % MC_G) return 1;
    int type, loc_type, device;
    memcpy(&type, prop, 4);
    memcpy(&loc_type, (const char*)prop + 8, 4);
    memcpy(&device, (const char*)prop + 12, 4);
    if (type != 1 || loc_type != 1 || !cu_device_ok(device)) return 1;
    pthread_mutex_lock(&vmu);
    int i = 0;
    while (i < MC_MAX && phys[i].live) i++;
    CUresult e = 2;
    if (i < MC_MAX) {
        struct vmm_phys* p = &phys[i];
        ino_t ino;
        int fd = mc_memfd("fakecuda-mem", size, &ino);
        void* b = fd < 0 ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (b != MAP_FAILED) {
            *p = (struct vmm_phys){1, fd, device, 1, 0, 0, size, b, ino};
            *h = new_handle(1, i);
            mc_log("cuMemCreate mem#%d dev=%d size=%zu", i, device, size);
            e = 0;
        } else if (fd >= 0) {
            close(fd);
        }
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
/* CUmulticastObjectProp: numDevices at 0, size at 8, handleTypes at 16, flags at 24. */
CUresult cuMulticastCreate(unsigned long long* h, const void* prop) {
    count_call("cuMulticastCreate");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMulticastCreate")) return 2;
    if (!h || !prop) return 1;
    unsigned n;
    size_t size;
    unsigned long long types;
    memcpy(&n, prop, 4);
    memcpy(&size, (const char*)prop + 8, 8);
    memcpy(&types, (const char*)prop + 16, 8);
    if (n == 0 || n > 8 || size == 0 || size % MC_G || !(types & 1)) return 1;
    pthread_mutex_lock(&vmu);
    int i = 0;
    while (i < MC_MAX && mcs[i].live) i++;
    CUresult e = 2;
    ino_t ino;
    int fd = i < MC_MAX ? mc_memfd("fakecuda-mc", sizeof(struct mc_shared), &ino) : -1;
    struct mc_shared* sh =
        fd < 0 ? MAP_FAILED : mmap(NULL, sizeof(struct mc_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (sh == MAP_FAILED && fd >= 0) close(fd);
    if (sh != MAP_FAILED) {
        memset(&mcs[i], 0, sizeof mcs[i]);
        mcs[i].live = 1, mcs[i].fd = fd, mcs[i].ino = ino, mcs[i].sh = sh;
        sh->num_devices = (int)n, sh->size = size;
        __atomic_store_n(&sh->magic, MC_SHARED_MAGIC, __ATOMIC_RELEASE);
        mcs[i].handles = 1;
        *h = new_handle(2, i);
        mc_log("cuMulticastCreate mc#%d devices=%u size=%zu", i, n, size);
        e = 0;
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
CUresult cuMemExportToShareableHandle(void* out, unsigned long long h, int type, unsigned long long flags) {
    count_call("cuMemExportToShareableHandle");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMemExportToShareableHandle")) return 2;
    if (!out || flags || type != 1) return 1;
    pthread_mutex_lock(&vmu);
    struct vmm_handle* x = handle_of(h);
    int src = !x ? -1 : x->kind == 2 ? mcs[x->obj].fd : phys[x->obj].fd;
    int fd = src < 0 ? -1 : fcntl(src, F_DUPFD_CLOEXEC, 3);
    if (fd >= 0) mc_log("cuMemExportToShareableHandle %s#%d", x->kind == 2 ? "mc" : "mem", x->obj);
    pthread_mutex_unlock(&vmu);
    if (fd < 0) return x ? 2 : 400;
    memcpy(out, &fd, sizeof fd);
    return 0;
}
CUresult cuMemImportFromShareableHandle(unsigned long long* h, void* os_handle, int type) {
    count_call("cuMemImportFromShareableHandle");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMemImportFromShareableHandle")) return 2;
    if (!h || type != 1) return 1;
    int fd = (int)(intptr_t)os_handle;
    struct stat st;
    if (fstat(fd, &st) != 0) return 1;
    pthread_mutex_lock(&vmu);
    CUresult e = 1;
    for (int i = 0; i < MC_MAX && e; i++) {
        if (mcs[i].live && mcs[i].ino == st.st_ino) {
            mcs[i].handles++;
            *h = new_handle(2, i);
            mc_log("cuMemImportFromShareableHandle mc#%d", i);
            e = 0;
        } else if (phys[i].live && phys[i].ino == st.st_ino) {
            phys[i].handles++;
            *h = new_handle(1, i);
            mc_log("cuMemImportFromShareableHandle mem#%d", i);
            e = 0;
        }
    }
    if (e && S_ISREG(st.st_mode) && (size_t)st.st_size == sizeof(struct mc_shared)) {
        /* An object another process made: map its shared state from a descriptor of this process's own. */
        int i = 0;
        while (i < MC_MAX && mcs[i].live) i++;
        int own = i < MC_MAX ? fcntl(fd, F_DUPFD_CLOEXEC, 3) : -1;
        struct mc_shared* sh =
            own < 0 ? MAP_FAILED : mmap(NULL, sizeof(struct mc_shared), PROT_READ | PROT_WRITE, MAP_SHARED, own, 0);
        if (sh != MAP_FAILED && __atomic_load_n(&sh->magic, __ATOMIC_ACQUIRE) == MC_SHARED_MAGIC) {
            memset(&mcs[i], 0, sizeof mcs[i]);
            mcs[i].live = 1, mcs[i].fd = own, mcs[i].ino = st.st_ino, mcs[i].sh = sh, mcs[i].handles = 1;
            *h = new_handle(2, i);
            mc_log("cuMemImportFromShareableHandle mc#%d", i);
            e = 0;
        } else {
            if (sh != MAP_FAILED) munmap(sh, sizeof(struct mc_shared));
            if (own >= 0) close(own);
        }
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
CUresult cuMemRelease(unsigned long long h) {
    count_call("cuMemRelease");
    if (!mc_enabled()) return 801;
    pthread_mutex_lock(&vmu);
    struct vmm_handle* x = handle_of(h);
    if (!x) {
        pthread_mutex_unlock(&vmu);
        return 400;
    }
    if (x->kind == 2) mcs[x->obj].handles--;
    else phys[x->obj].handles--;
    mc_log("cuMemRelease %s#%d", x->kind == 2 ? "mc" : "mem", x->obj);
    x->live = 0;
    mc_collect();
    pthread_mutex_unlock(&vmu);
    return 0;
}
CUresult cuMulticastAddDevice(unsigned long long h, CUdevice d) {
    count_call("cuMulticastAddDevice");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMulticastAddDevice")) return 2;
    pthread_mutex_lock(&vmu);
    struct vmm_handle* x = handle_of(h);
    CUresult e = 0;
    if (!x || x->kind != 2) e = 400;
    else if (!cu_device_ok(d)) e = 101;
    else {
        struct mc_shared* o = mcs[x->obj].sh;
        sh_lock(o);
        if ((o->devices >> d & 1) || o->added >= o->num_devices) e = 1;
        else {
            o->devices |= 1u << d;
            o->added++;
            mc_log("cuMulticastAddDevice mc#%d dev=%d", x->obj, d);
        }
        sh_unlock(o);
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
CUresult cuMulticastBindMem(unsigned long long mc, size_t mc_off, unsigned long long mem, size_t mem_off, size_t size,
                            unsigned long long flags) {
    count_call("cuMulticastBindMem");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMulticastBindMem")) return 2;
    pthread_mutex_lock(&vmu);
    struct vmm_handle* x = handle_of(mc);
    struct vmm_handle* m = handle_of(mem);
    CUresult e = 0;
    if (!x || x->kind != 2 || !m || m->kind != 1 || flags) e = 1;
    else {
        struct mc_obj* obj = &mcs[x->obj];
        struct mc_shared* o = obj->sh;
        struct vmm_phys* p = &phys[m->obj];
        int aligned = mc_off % MC_G == 0 && mem_off % MC_G == 0 && size % MC_G == 0 && size > 0;
        sh_lock(o);
        if (o->added != o->num_devices) {
            /* The driver would block here until every device is added; the fake calls it a mistake. */
            fakehip_add_violation("cuMulticastBindMem", "memory bound before every device was added");
            e = 1;
        } else if (!(o->devices >> p->device & 1) || !aligned || mc_off + size > o->size || mem_off + size > p->size) {
            e = 1;
        } else {
            int free_slot = -1;
            for (int k = 0; k < MC_BIND_MAX; k++) {
                const struct mc_binding* b = &o->b[k];
                if (!b->live) {
                    if (free_slot < 0) free_slot = k;
                } else if (b->device == p->device && b->offset < mc_off + size && mc_off < b->offset + b->size) {
                    e = 1;
                }
            }
            if (!e && free_slot < 0) e = 2;
            if (!e) {
                o->b[free_slot] =
                    (struct mc_binding){1, p->device, getpid(), p->fd, mc_off, size, mem_off, ++o->gen};
                obj->local_phys[free_slot] = m->obj;
                p->binds++;
                mc_log("cuMulticastBindMem mc#%d dev=%d off=%zu size=%zu mem#%d", x->obj, p->device, mc_off, size,
                       m->obj);
            }
        }
        sh_unlock(o);
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
CUresult cuMulticastUnbind(unsigned long long mc, CUdevice d, size_t mc_off, size_t size) {
    count_call("cuMulticastUnbind");
    if (!mc_enabled()) return 801;
    pthread_mutex_lock(&vmu);
    struct vmm_handle* x = handle_of(mc);
    CUresult e = 1;
    if (x && x->kind == 2) {
        struct mc_obj* o = &mcs[x->obj];
        sh_lock(o->sh);
        for (int k = 0; k < MC_BIND_MAX && e; k++) {
            struct mc_binding* b = &o->sh->b[k];
            if (b->live && b->pid == getpid() && b->device == d && b->offset == mc_off && b->size == size) {
                b->live = 0;
                phys[o->local_phys[k]].binds--;
                mc_log("cuMulticastUnbind mc#%d dev=%d off=%zu", x->obj, d, mc_off);
                e = 0;
            }
        }
        sh_unlock(o->sh);
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
static struct vmm_range* range_at(int kind, uint64_t va) {
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (ranges[i].live && ranges[i].kind == kind && ranges[i].va == va) return &ranges[i];
    return NULL;
}
static struct vmm_range* new_range(void) {
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (!ranges[i].live) return &ranges[i];
    return NULL;
}
/* The reservation holding [va, va + size), if any. */
static struct vmm_range* reservation_of(uint64_t va, size_t size) {
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        struct vmm_range* r = &ranges[i];
        if (r->live && r->kind == 0 && va >= r->va && va + size <= r->va + r->size) return r;
    }
    return NULL;
}
CUresult cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    count_call("cuMemAddressReserve");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMemAddressReserve")) return 2;
    if (!p || size == 0 || size % MC_G || flags || addr) return 1;
    if (align == 0) align = MC_G;
    if (align & (align - 1)) return 1;
    size_t region = size + align;
    void* b = mmap(NULL, region, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (b == MAP_FAILED) return 2;
    pthread_mutex_lock(&vmu);
    struct vmm_range* r = new_range();
    if (r) {
        uint64_t va = ((uint64_t)(uintptr_t)b + align - 1) / align * align;
        *r = (struct vmm_range){1, 0, -1, va, size, b, region};
        *p = va;
        mc_log("cuMemAddressReserve size=%zu", size);
    }
    pthread_mutex_unlock(&vmu);
    if (!r) munmap(b, region);
    return r ? 0 : 2;
}
CUresult cuMemAddressFree(CUdeviceptr va, size_t size) {
    count_call("cuMemAddressFree");
    if (!mc_enabled()) return 801;
    pthread_mutex_lock(&vmu);
    struct vmm_range* r = range_at(0, va);
    CUresult e = 1;
    if (r && r->size == size) {
        for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
            if (ranges[i].live && ranges[i].kind && ranges[i].va >= va && ranges[i].va < va + size)
                fakehip_add_violation("cuMemAddressFree", "a range freed while still mapped");
        munmap(r->region, r->region_size);
        r->live = 0;
        mc_log("cuMemAddressFree size=%zu", size);
        e = 0;
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, unsigned long long h, unsigned long long flags) {
    count_call("cuMemMap");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMemMap")) return 2;
    pthread_mutex_lock(&vmu);
    struct vmm_handle* x = handle_of(h);
    CUresult e = 0;
    struct vmm_range* r = NULL;
    if (!x || flags || size == 0 || size % MC_G || !reservation_of(va, size) || range_at(1, va) || range_at(2, va)) {
        e = 1;
    } else if (x->kind == 2) {
        /* A multicast handle is mapped from offset 0 only. */
        if (offset != 0 || size > mcs[x->obj].sh->size) e = 1;
    } else if (offset % MC_G || offset + size > phys[x->obj].size) {
        e = 1;
    } else if (mmap((void*)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, phys[x->obj].fd,
                    (off_t)offset) == MAP_FAILED) {
        e = 2;
    }
    if (!e && (r = new_range()) == NULL) e = 2;
    if (!e) {
        *r = (struct vmm_range){1, x->kind, x->obj, va, size, NULL, 0};
        if (x->kind == 2) mcs[x->obj].maps++;
        else phys[x->obj].maps++;
        mc_log("cuMemMap %s#%d size=%zu offset=%zu", x->kind == 2 ? "mc" : "mem", x->obj, size, offset);
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    count_call("cuMemUnmap");
    if (!mc_enabled()) return 801;
    pthread_mutex_lock(&vmu);
    struct vmm_range* r = range_at(1, va);
    if (!r) r = range_at(2, va);
    CUresult e = 1;
    if (r && r->size == size) {
        if (r->kind == 1) {
            mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
                 0);
            phys[r->obj].maps--;
        } else {
            mcs[r->obj].maps--;
        }
        mc_log("cuMemUnmap %s#%d", r->kind == 2 ? "mc" : "mem", r->obj);
        r->live = 0;
        mc_collect();
        e = 0;
    }
    pthread_mutex_unlock(&vmu);
    return e;
}
/* CUmemAccessDesc: location (type, id), flags (3: read-write). */
CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const void* desc, size_t count) {
    count_call("cuMemSetAccess");
    if (!mc_enabled()) return 801;
    if (mc_should_fail("cuMemSetAccess")) return 2;
    if (!desc || count != 1) return 1;
    int loc_type, device, flags;
    memcpy(&loc_type, desc, 4);
    memcpy(&device, (const char*)desc + 4, 4);
    memcpy(&flags, (const char*)desc + 8, 4);
    pthread_mutex_lock(&vmu);
    struct vmm_range* r = range_at(1, va);
    if (!r) r = range_at(2, va);
    CUresult e = r && r->size == size && loc_type == 1 && cu_device_ok(device) && flags == 3 ? 0 : 1;
    if (!e) mc_log("cuMemSetAccess %s#%d dev=%d", r->kind == 2 ? "mc" : "mem", r->obj, device);
    pthread_mutex_unlock(&vmu);
    return e;
}

/* The host addresses a multicast address reaches: for each device bound at `addr` (in device order) the
 * allocation's bytes there, holding `bytes` bytes. The count, or -1 when `addr` is in no multicast mapping or a
 * binding does not hold the bytes. Under vmu. */
/* The host bytes of binding `k` of `o` (this process's allocation, or another process's mapped here once); NULL
 * when they cannot be reached. Under vmu and the object's shared lock. */
static unsigned char* mc_binding_bytes(struct mc_obj* o, int k) {
    const struct mc_binding* b = &o->sh->b[k];
    if (b->pid == getpid()) return phys[o->local_phys[k]].backing;
    struct mc_remote* r = &o->remote[k];
    if (r->base && r->pid == b->pid && r->fd == b->fd && r->gen == b->gen) return r->base;
    if (r->base) munmap(r->base, r->len);
    memset(r, 0, sizeof *r);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", b->pid, b->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0) return NULL;
    void* base = fstat(fd, &st) != 0 || st.st_size <= 0
                     ? MAP_FAILED
                     : mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return NULL;
    *r = (struct mc_remote){b->pid, b->fd, b->gen, base, (size_t)st.st_size};
    return r->base;
}
static int mc_resolve(uint64_t addr, size_t bytes, unsigned char** out) {
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        const struct vmm_range* r = &ranges[i];
        if (!r->live || r->kind != 2 || addr < r->va || addr + bytes > r->va + r->size) continue;
        struct mc_obj* o = &mcs[r->obj];
        size_t off = (size_t)(addr - r->va);
        int n = 0;
        sh_lock(o->sh);
        for (int d = 0; d < 32 && n >= 0; d++)
            for (int k = 0; k < MC_BIND_MAX && n >= 0; k++) {
                const struct mc_binding* b = &o->sh->b[k];
                if (!b->live || b->device != d || off < b->offset || off + bytes > b->offset + b->size) continue;
                unsigned char* base = mc_binding_bytes(o, k);
                if (n == 8 || !base) n = -1;
                else out[n++] = base + b->mem_offset + (off - b->offset);
            }
        sh_unlock(o->sh);
        return n;
    }
    return -1;
}
/* The unicast range [addr, addr + bytes) lies in a mapping of a physical allocation. Under vmu. */
static int mc_unicast_ok(uint64_t addr, size_t bytes) {
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        const struct vmm_range* r = &ranges[i];
        if (r->live && r->kind == 1 && addr >= r->va && addr + bytes <= r->va + r->size) return 1;
    }
    return 0;
}

/* The multicast kernels' element access (they are CUDA-only PTX, emulated here): f32 from and to each element
 * type (f16 and bf16 round to nearest even). */
static float k_get(int dtype, const void* p, size_t i) {
    if (dtype == 0) return ((const float*)p)[i];
    if (dtype == 1) return (float)((const _Float16*)p)[i];
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void k_put(int dtype, void* p, size_t i, float f) {
    if (dtype == 0) {
        ((float*)p)[i] = f;
    } else if (dtype == 1) {
        ((_Float16*)p)[i] = (_Float16)f;
    } else {
        /* Nearest even, NaN stays a quiet NaN (vendor_hip.h's anyccl_f32_to_bf16). */
        uint32_t u;
        memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t*)p)[i] = (uint16_t)((u >> 16) | 0x40);
            return;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
    }
}
static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }
#define MC_ARRIVALS (K_EPOCHS + K_MAX_BLOCKS)
struct mc_work {
    char name[64];
    int variant, dtype, rank, world, n_in, n_out, n_flags;
    uint64_t in, out, my_in, my_out, n_vec;
    uint32_t* my_flags;
    unsigned char *in_at[8], *out_at[8], *flags_at[8];
};
/* One multicast barrier: add 1 to every device's arrival counter, then wait until this rank's reaches
 * `target` × world (wrapping). 0: met; 1: aborted; 2: timed out. */
static int mc_barrier(const struct mc_work* w, uint32_t target) {
    for (int d = 0; d < w->n_flags; d++) __atomic_fetch_add((uint32_t*)w->flags_at[d] + MC_ARRIVALS, 1, __ATOMIC_ACQ_REL);
    wake_kernels();
    const char* env = getenv("FAKEHIP_KERNEL_TIMEOUT_MS");
    int timeout = env ? atoi(env) : 20000;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout / 1000;
    deadline.tv_nsec += (long)(timeout % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    const uint32_t want = target * (uint32_t)w->world;
    int result = 0;
    pthread_mutex_lock(&kmu);
    kernels_waiting++;
    while ((int32_t)(__atomic_load_n(w->my_flags + MC_ARRIVALS, __ATOMIC_ACQUIRE) - want) < 0) {
        if (__atomic_load_n(w->my_flags + K_ABORT_WORD, __ATOMIC_ACQUIRE)) {
            result = 1;
            break;
        }
        struct timespec now, until;
        clock_gettime(CLOCK_REALTIME, &now);
        if (now.tv_sec > deadline.tv_sec || (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec)) {
            result = 2;
            break;
        }
        until = now;
        until.tv_nsec += 2000000L;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&kcv, &kmu, &until);
    }
    kernels_waiting--;
    pthread_mutex_unlock(&kmu);
    return result;
}
/* multimem.ld_reduce of vectors [v0, v1) from every device's `in_at`, multimem.st into every device's `out_at`. */
static void mc_reduce(const struct mc_work* w, size_t v0, size_t v1) {
    const size_t per = w->dtype == 0 ? 4 : 8;
    for (size_t e = v0 * per; e < v1 * per; e++) {
        float sum = 0.0f;
        for (int d = 0; d < w->n_in; d++) sum += k_get(w->dtype, w->in_at[d], e);
        for (int d = 0; d < w->n_out; d++) k_put(w->dtype, w->out_at[d], e, sum);
    }
}
static void mc_run(void* arg) {
    const struct mc_work* w = arg;
    const size_t bytes = w->n_vec * 16;
    const uint32_t steps = w->variant == 0 ? 2 : 3;
    uint32_t* epoch = w->my_flags + K_EPOCHS;
    const uint32_t e = *epoch;
    *epoch = e + steps;
    int stopped = 0;
    if (w->variant) memcpy((void*)(uintptr_t)w->my_in, (const void*)(uintptr_t)w->in, bytes);
    stopped = mc_barrier(w, e + 1);
    const size_t chunk = (w->n_vec + (size_t)w->world - 1) / (size_t)w->world;
    const size_t v0 = min_size(w->n_vec, chunk * (size_t)w->rank), v1 = min_size(w->n_vec, v0 + chunk);
    if (!stopped) mc_reduce(w, v0, v1);
    int s2 = mc_barrier(w, e + 2);
    if (!stopped) stopped = s2;
    if (w->variant) {
        if (!stopped) memcpy((void*)(uintptr_t)w->out, (const void*)(uintptr_t)w->my_out, bytes);
        int s3 = mc_barrier(w, e + 3);
        if (!stopped) stopped = s3;
    }
    pthread_mutex_lock(&vmu);
    mc_log("run %s rank=%d %s", w->name, w->rank, stopped == 0 ? "completed" : stopped == 1 ? "aborted" : "timed out");
    pthread_mutex_unlock(&vmu);
}
/* Launches an `_mc` NVLS kernel: decodes and checks its parameters (kernelParams only), resolves its multicast
 * addresses, and runs it on the stream. */
static CUresult mc_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, void* s, void** params, void** extra) {
    struct mc_work w;
    memset(&w, 0, sizeof w);
    snprintf(w.name, sizeof w.name, "%s", name);
    const char* rest = name + strlen("anyccl_nvls_");
    if (strncmp(rest, "zero_copy_mc_", 13) == 0) w.variant = 0, rest += 13;
    else if (strncmp(rest, "block_pipeline_mc_", 18) == 0) w.variant = 1, rest += 18;
    else if (strncmp(rest, "warp_pipeline_mc_", 17) == 0) w.variant = 2, rest += 17;
    else return 1;
    w.dtype = strcmp(rest, "f32") == 0 ? 0 : strcmp(rest, "f16") == 0 ? 1 : strcmp(rest, "bf16") == 0 ? 2 : -1;
    if (w.dtype < 0 || !params || extra) return 1;
    if (gx < 1 || gx > K_MAX_BLOCKS || gy != 1 || gz != 1 || bx < 1 || bx > K_MAX_THREADS || by != 1 || bz != 1)
        return 1;
    /* zero-copy: (in_mc, out_mc, flags_mc, FlagPtrs, rank, world, n_vec); staged: (in, out, my_stage_in,
     * my_stage_out, stage_in_mc, stage_out_mc, flags_mc, FlagPtrs, rank, world, n_vec). */
    int k = 0;
    uint64_t in_mc, out_mc, flags_mc, flag_ptrs[8];
    if (w.variant) {
        memcpy(&w.in, params[k++], 8);
        memcpy(&w.out, params[k++], 8);
        memcpy(&w.my_in, params[k++], 8);
        memcpy(&w.my_out, params[k++], 8);
    }
    memcpy(&in_mc, params[k++], 8);
    memcpy(&out_mc, params[k++], 8);
    memcpy(&flags_mc, params[k++], 8);
    memcpy(flag_ptrs, params[k++], 64);
    memcpy(&w.rank, params[k++], 4);
    memcpy(&w.world, params[k++], 4);
    memcpy(&w.n_vec, params[k++], 8);
    if (w.world < 2 || w.world > K_MAX_RANKS || w.rank < 0 || w.rank >= w.world || w.n_vec == 0 ||
        w.n_vec > ((uint64_t)1 << 36))
        return 1;
    const size_t bytes = w.n_vec * 16;
    w.my_flags = (uint32_t*)(uintptr_t)flag_ptrs[w.rank];
    pthread_mutex_lock(&vmu);
    w.n_in = mc_resolve(in_mc, bytes, w.in_at);
    w.n_out = mc_resolve(out_mc, bytes, w.out_at);
    w.n_flags = mc_resolve(flags_mc, K_FLAG_BYTES, w.flags_at);
    int ok = w.n_in == w.world && w.n_out == w.world && w.n_flags == w.world && w.my_flags &&
             mc_unicast_ok(flag_ptrs[w.rank], K_FLAG_BYTES);
    if (ok && w.variant)
        ok = w.in && w.out && mc_unicast_ok(w.my_in, bytes) && mc_unicast_ok(w.my_out, bytes);
    mc_log("launch %s rank=%d world=%d n_vec=%llu grid=%u %s", name, w.rank, w.world, (unsigned long long)w.n_vec, gx,
           ok ? "accepted" : "refused");
    pthread_mutex_unlock(&vmu);
    if (!ok) return 1;
    return cu(fakehip_enqueue(hs(s), mc_run, &w, sizeof w));
}

/* Test interface: the multicast call log (every entry a line), and its reset. */
size_t fakecuda_mc_log(char* buf, size_t n) {
    pthread_mutex_lock(&vmu);
    size_t len = mc_log_len < n ? mc_log_len : n;
    if (buf) memcpy(buf, mc_log_buf, len);
    pthread_mutex_unlock(&vmu);
    return len;
}
void fakecuda_mc_log_reset(void) {
    pthread_mutex_lock(&vmu);
    mc_log_len = 0;
    pthread_mutex_unlock(&vmu);
}
/* Test interface: what is alive now (after freeing what nothing refers to): multicast objects, handles,
 * allocations, bindings, reservations and mappings, in that order. */
void fakecuda_mc_live(int* out) {
    pthread_mutex_lock(&vmu);
    mc_collect();
    memset(out, 0, 6 * sizeof(int));
    for (int i = 0; i < MC_MAX; i++) {
        out[0] += mcs[i].live;
        out[2] += phys[i].live;
        for (int k = 0; k < MC_BIND_MAX; k++)
            out[3] += mcs[i].live && mcs[i].sh->b[k].live && mcs[i].sh->b[k].pid == getpid();
    }
    for (size_t i = 0; i < sizeof handles / sizeof handles[0]; i++) out[1] += handles[i].live;
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        out[4] += ranges[i].live && ranges[i].kind == 0;
        out[5] += ranges[i].live && ranges[i].kind != 0;
    }
    pthread_mutex_unlock(&vmu);
}

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
