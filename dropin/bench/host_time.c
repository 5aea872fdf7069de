/* Host time per ncclAllReduce: the real NCCL against the anyccl drop-in, in one process, same buffers, same stream.
 *
 * Usage: host_time REAL_LIBNCCL DROPIN_SO [ITERATIONS]   (ITERATIONS defaults to 1000; 100 warm-up calls each)
 *
 * Both libraries are opened with dlopen(RTLD_NOW | RTLD_LOCAL), so neither's symbols enter the global scope and
 * each name below is looked up in its own library. ANYCCL_NCCL_PATH is set to REAL_LIBNCCL before the drop-in's
 * first call, so the drop-in forwards to the very file this program opened: the dynamic loader loads that library
 * once and both handles name the same copy (one NCCL in the process, two communicators of it). The communicator
 * made through the drop-in is therefore an ordinary NCCL communicator; what differs between the two timed calls is
 * only the path to NCCL's ncclAllReduce: direct, or through the drop-in's export.
 *
 * For each size (512 KiB and 16 MiB of bf16, sum) the calls alternate real / drop-in, the order swapped every
 * iteration; each call is timed from just before it to its return (the enqueue, not the collective: the stream is
 * synchronised after the timer stops). It prints the median, 10th and 90th percentile of each and the difference of
 * the medians. Exit status: 0 after a complete run (whatever the difference: this is a benchmark), 1 on any error.
 *
 * Build (on a machine with the CUDA toolkit and nccl.h):
 *   gcc -O2 -std=gnu11 -o host_time dropin/bench/host_time.c -I$CUDA_HOME/include -I<dir of nccl.h> \
 *       -L$CUDA_HOME/lib64 -lcudart -ldl -Wl,-rpath,$CUDA_HOME/lib64
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_lib.h"

#include <cuda_runtime.h>
#include <nccl.h>

typedef ncclResult_t (*GetUniqueIdFn)(ncclUniqueId*);
typedef ncclResult_t (*InitRankFn)(ncclComm_t*, int, ncclUniqueId, int);
typedef ncclResult_t (*AllReduceFn)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*DestroyFn)(ncclComm_t);
typedef ncclResult_t (*GetVersionFn)(int*);
typedef const char* (*UnderlyingFn)(void);

struct Lib {
    const char* label;
    void* handle;
    GetUniqueIdFn get_unique_id;
    InitRankFn init_rank;
    AllReduceFn all_reduce;
    DestroyFn destroy;
    GetVersionFn get_version;
    ncclComm_t comm;
};

#define CUDA_OK(call)                                                                                   \
    do {                                                                                                \
        cudaError_t e_ = (call);                                                                        \
        if (e_ != cudaSuccess) {                                                                        \
            fprintf(stderr, "error: %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, \
                    __LINE__);                                                                          \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)

static void open_lib(struct Lib* l, const char* path) {
    l->handle = open_local(path);
    l->get_unique_id = (GetUniqueIdFn)sym(l->handle, path, "ncclGetUniqueId");
    l->init_rank = (InitRankFn)sym(l->handle, path, "ncclCommInitRank");
    l->all_reduce = (AllReduceFn)sym(l->handle, path, "ncclAllReduce");
    l->destroy = (DestroyFn)sym(l->handle, path, "ncclCommDestroy");
    l->get_version = (GetVersionFn)sym(l->handle, path, "ncclGetVersion");
}

static void nccl_ok(const struct Lib* l, const char* what, ncclResult_t rc) {
    if (rc != ncclSuccess) {
        fprintf(stderr, "error: %s through %s returned %d\n", what, l->label, (int)rc);
        exit(1);
    }
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* The q-quantile (0..1) of the sorted array v of n values (nearest rank). */
static double quantile(const double* v, int n, double q) {
    int i = (int)(q * (double)(n - 1) + 0.5);
    return v[i];
}

int main(int argc, char** argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s REAL_LIBNCCL DROPIN_SO [ITERATIONS]\n", argv[0]);
        return 1;
    }
    const char* real_path = argv[1];
    const char* dropin_path = argv[2];
    int iters = argc == 4 ? atoi(argv[3]) : 1000;
    if (iters < 10 || iters > 10000000) {
        fprintf(stderr, "error: ITERATIONS must be between 10 and 10000000, not %s\n", argv[3]);
        return 1;
    }
    const int warmup = 100;
    /* The drop-in forwards to the same file (see the top of this file). */
    if (setenv("ANYCCL_NCCL_PATH", real_path, 1) != 0) {
        perror("setenv");
        return 1;
    }

    struct Lib real = {.label = "the real NCCL"}, drop = {.label = "the anyccl drop-in"};
    open_lib(&real, real_path);
    open_lib(&drop, dropin_path);
    if (!dlsym(drop.handle, "anyccl_nccl_dropin_marker")) {
        fprintf(stderr, "error: %s is not the anyccl drop-in (no anyccl_nccl_dropin_marker)\n", dropin_path);
        return 1;
    }
    if (dlsym(real.handle, "anyccl_nccl_dropin_marker")) {
        fprintf(stderr, "error: %s is an anyccl drop-in, not the real NCCL\n", real_path);
        return 1;
    }
    UnderlyingFn underlying = (UnderlyingFn)sym(drop.handle, dropin_path, "anyccl_nccl_dropin_underlying");
    int vr = 0, vd = 0;
    nccl_ok(&real, "ncclGetVersion", real.get_version(&vr));
    nccl_ok(&drop, "ncclGetVersion", drop.get_version(&vd));
    printf("real NCCL: %s (version %d)\n", real_path, vr);
    printf("drop-in:   %s (version %d, forwards to: %s)\n", dropin_path, vd, underlying());
    if (vr != vd) {
        fprintf(stderr, "error: the versions differ: the drop-in does not forward to %s\n", real_path);
        return 1;
    }

    CUDA_OK(cudaSetDevice(0));
    const size_t max_bytes = (size_t)16 << 20;
    void *send = NULL, *recv = NULL;
    CUDA_OK(cudaMalloc(&send, max_bytes));
    CUDA_OK(cudaMalloc(&recv, max_bytes));
    CUDA_OK(cudaMemset(send, 0, max_bytes));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    struct Lib* libs[2] = {&real, &drop};
    for (int k = 0; k < 2; k++) {
        ncclUniqueId id;
        nccl_ok(libs[k], "ncclGetUniqueId", libs[k]->get_unique_id(&id));
        nccl_ok(libs[k], "ncclCommInitRank", libs[k]->init_rank(&libs[k]->comm, 1, id, 0));
    }

    double* t[2];
    for (int k = 0; k < 2; k++) {
        t[k] = malloc(sizeof(double) * (size_t)iters);
        if (!t[k]) {
            fprintf(stderr, "error: out of host memory for %d samples\n", iters);
            return 1;
        }
    }
    const size_t sizes[2] = {(size_t)512 << 10, (size_t)16 << 20};
    printf("%-10s %-22s %10s %10s %10s\n", "bytes", "path", "p10 us", "median us", "p90 us");
    for (int s = 0; s < 2; s++) {
        size_t count = sizes[s] / 2; /* bf16 */
        for (int i = -warmup; i < iters; i++) {
            for (int j = 0; j < 2; j++) {
                int k = (i & 1) ? 1 - j : j; /* who goes first alternates */
                struct Lib* l = libs[k];
                double t0 = now_us();
                ncclResult_t rc = l->all_reduce(send, recv, count, ncclBfloat16, ncclSum, l->comm, stream);
                double t1 = now_us();
                nccl_ok(l, "ncclAllReduce", rc);
                CUDA_OK(cudaStreamSynchronize(stream));
                if (i >= 0) t[k][i] = t1 - t0;
            }
        }
        double med[2];
        for (int k = 0; k < 2; k++) {
            qsort(t[k], (size_t)iters, sizeof(double), cmp_double);
            med[k] = quantile(t[k], iters, 0.5);
            printf("%-10zu %-22s %10.3f %10.3f %10.3f\n", sizes[s], libs[k]->label, quantile(t[k], iters, 0.1),
                   med[k], quantile(t[k], iters, 0.9));
        }
        double diff = med[1] - med[0];
        printf("RESULT bytes=%zu real_median_us=%.3f dropin_median_us=%.3f diff_us=%+.3f %s\n", sizes[s], med[0],
               med[1], diff, diff <= 0.3 ? "within-0.3us" : "ABOVE-0.3us");
    }
    for (int k = 0; k < 2; k++) nccl_ok(libs[k], "ncclCommDestroy", libs[k]->destroy(libs[k]->comm));
    CUDA_OK(cudaStreamDestroy(stream));
    CUDA_OK(cudaFree(send));
    CUDA_OK(cudaFree(recv));
    return 0;
}
