/* Host time per call without a GPU: the real NCCL against the anyccl drop-in, in one process, on the calls that
 * answer without a device (the same answer from both, checked).
 *
 * Usage: host_time_cpu REAL_LIBNCCL DROPIN_SO [ROUNDS] [BATCH]   (defaults: 301 rounds of 2000 calls)
 *
 * Both libraries are opened with dlopen(RTLD_NOW | RTLD_LOCAL), so each name below is looked up in its own library.
 * ANYCCL_NCCL_PATH is set to REAL_LIBNCCL before the drop-in's first call, so the drop-in forwards to the very file
 * this program opened (the dynamic loader loads it once): what differs between the two timed paths is only the way
 * to NCCL's function, direct or through the drop-in's export.
 *
 * The calls: ncclGetVersion; ncclGetErrorString(ncclInvalidArgument); ncclCommCount, ncclAllReduce and
 * ncclAllReduceConfig with a null communicator (NCCL refuses it with ncclInvalidArgument after its argument
 * checks; the drop-in forwards a null handle, so both paths reach NCCL's check); ncclGetLastError(NULL). For each,
 * a round times BATCH calls through one path and then BATCH through the other (the order swapped every round), and
 * divides; the program prints the median, 10th and 90th percentile per call of each path over the rounds, the
 * difference of the medians and their ratio. Exit status: 0 after a complete run (whatever the difference: this is a
 * benchmark), 1 on any error or when the two paths answer differently.
 *
 * Build: cc -O2 -std=gnu11 -o host_time_cpu dropin/bench/host_time_cpu.c -ldl   (no CUDA headers needed);
 * dropin/bench/host_time_cpu.sh builds the drop-in and this program and runs it.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_lib.h"

typedef int (*GetVersionFn)(int*);
typedef const char* (*ErrorStringFn)(int);
typedef int (*CommCountFn)(void*, int*);
typedef int (*AllReduceFn)(const void*, void*, size_t, int, int, void*, void*);
typedef int (*AllReduceConfigFn)(const void*, void*, size_t, int, int, void*, void*, const void*);
typedef const char* (*LastErrorFn)(void*);

struct Lib {
    void* handle;
    GetVersionFn get_version;
    ErrorStringFn error_string;
    CommCountFn comm_count;
    AllReduceFn all_reduce;
    AllReduceConfigFn all_reduce_config;
    LastErrorFn last_error;
};

static void open_lib(struct Lib* l, const char* path) {
    l->handle = open_local(path);
    l->get_version = (GetVersionFn)sym(l->handle, path, "ncclGetVersion");
    l->error_string = (ErrorStringFn)sym(l->handle, path, "ncclGetErrorString");
    l->comm_count = (CommCountFn)sym(l->handle, path, "ncclCommCount");
    l->all_reduce = (AllReduceFn)sym(l->handle, path, "ncclAllReduce");
    l->all_reduce_config = (AllReduceConfigFn)sym(l->handle, path, "ncclAllReduceConfig");
    l->last_error = (LastErrorFn)sym(l->handle, path, "ncclGetLastError");
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* One call of kind `k` through `l`; returns its result code (or a hash of the text for the string calls). */
static long call(const struct Lib* l, int k) {
    static int sink;
    static char send[64], recv[64];
    switch (k) {
        case 0: {
            int v = 0;
            int rc = l->get_version(&v);
            return rc * 1000000L + v;
        }
        case 1:
            return (long)strlen(l->error_string(4));
        case 2:
            return l->comm_count(NULL, &sink);
        case 3:
            return l->all_reduce(send, recv, 16, 7, 0, NULL, NULL);
        case 4:
            return l->all_reduce_config(send, recv, 16, 7, 0, NULL, NULL, NULL);
        default:
            return (long)strlen(l->last_error(NULL));
    }
}

static const char* NAMES[] = {"ncclGetVersion",
                              "ncclGetErrorString(4)",
                              "ncclCommCount(NULL comm)",
                              "ncclAllReduce(NULL comm)",
                              "ncclAllReduceConfig(NULL comm)",
                              "ncclGetLastError(NULL)"};
#define KINDS 6

static int cmp(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

static double pct(double* v, int n, double p) {
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

static double timed(const struct Lib* l, int k, int batch) {
    double t0 = now_ns();
    long acc = 0;
    for (int i = 0; i < batch; i++) acc += call(l, k);
    double t1 = now_ns();
    if (acc == 0x7fffffffffffL) printf(" ");
    return (t1 - t0) / batch;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s REAL_LIBNCCL DROPIN_SO [ROUNDS] [BATCH]\n", argv[0]);
        return 1;
    }
    int rounds = argc > 3 ? atoi(argv[3]) : 301;
    int batch = argc > 4 ? atoi(argv[4]) : 2000;
    if (rounds < 1 || batch < 1) {
        fprintf(stderr, "error: ROUNDS and BATCH must be positive\n");
        return 1;
    }
    setenv("ANYCCL_NCCL_PATH", argv[1], 1);
    struct Lib real, drop;
    open_lib(&real, argv[1]);
    open_lib(&drop, argv[2]);
    const char* (*underlying)(void) = (const char* (*)(void))sym(drop.handle, argv[2], "anyccl_nccl_dropin_underlying");
    printf("real: %s\ndrop-in: %s, forwarding to %s\n", argv[1], argv[2], underlying());
    for (int k = 0; k < KINDS; k++) {
        long a = call(&real, k), b = call(&drop, k);
        if (a != b) {
            fprintf(stderr, "error: %s answers %ld directly and %ld through the drop-in\n", NAMES[k], a, b);
            return 1;
        }
    }
    printf("%d rounds of %d calls per path; ns per call\n", rounds, batch);
    printf("%-32s %9s %9s %9s   %9s %9s %9s   %8s %6s\n", "call", "real p50", "p10", "p90", "drop p50", "p10", "p90",
           "diff", "ratio");
    double* r = malloc(sizeof(double) * rounds);
    double* d = malloc(sizeof(double) * rounds);
    if (!r || !d) return 1;
    for (int k = 0; k < KINDS; k++) {
        timed(&real, k, batch);
        timed(&drop, k, batch);
        for (int i = 0; i < rounds; i++) {
            if (i % 2 == 0) {
                r[i] = timed(&real, k, batch);
                d[i] = timed(&drop, k, batch);
            } else {
                d[i] = timed(&drop, k, batch);
                r[i] = timed(&real, k, batch);
            }
        }
        qsort(r, rounds, sizeof(double), cmp);
        qsort(d, rounds, sizeof(double), cmp);
        double rm = pct(r, rounds, 0.5), dm = pct(d, rounds, 0.5);
        printf("%-32s %9.1f %9.1f %9.1f   %9.1f %9.1f %9.1f   %+8.1f %6.2f\n", NAMES[k], rm, pct(r, rounds, 0.1),
               pct(r, rounds, 0.9), dm, pct(d, rounds, 0.1), pct(d, rounds, 0.9), dm - rm, rm > 0 ? dm / rm : 0.0);
    }
    free(r);
    free(d);
    return 0;
}
