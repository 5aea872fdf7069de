/* The real-NCCL test's program: compiled against the real nccl.h (from the PyPI wheel) and linked to the
 * drop-in, run with the real libnccl.so.2 underneath (ANYCCL_NCCL_PATH). It opens that same library directly too
 * and checks that the drop-in answers as it does. Prints what it saw; exits 1 on the first mismatch.
 * Usage: real_nccl <path of the real libnccl.so.2> */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nccl.h>

const char* anyccl_nccl_dropin_underlying(void);
/* Every nccl.h function by address (generated from the header by the test): linking fails if one is missing. */
extern const int anyccl_test_function_count;
/* Every device API host function (nccl_device/host.h, which needs CUDA's headers) by address, likewise. */
extern const int anyccl_test_device_function_count;
/* The device API host functions called below, declared here with the types nccl_device/host.h gives them. */
ncclResult_t ncclCommQueryProperties(ncclComm_t comm, void* props);
ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void** outPtr);
ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void** outPtr);
int ncclLLA2ACalcSlots(int maxElts, int maxEltSize);

static int failed = 0;
#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            printf("MISMATCH: " __VA_ARGS__);              \
            printf("\n");                                  \
            failed = 1;                                    \
        }                                                  \
    } while (0)

static const char* str(const char* s) { return s ? s : "(null)"; }

int main(int argc, char** argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 2) return 2;
    void* real = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!real) {
        printf("cannot open %s: %s\n", argv[1], dlerror());
        return 1;
    }
    ncclResult_t (*real_version)(int*) = (ncclResult_t(*)(int*))dlsym(real, "ncclGetVersion");
    const char* (*real_error_string)(ncclResult_t) = (const char* (*)(ncclResult_t))dlsym(real, "ncclGetErrorString");
    const char* (*real_last_error)(ncclComm_t) = (const char* (*)(ncclComm_t))dlsym(real, "ncclGetLastError");
    if (!real_version || !real_error_string || !real_last_error) {
        printf("the real library lacks ncclGetVersion/ncclGetErrorString/ncclGetLastError\n");
        return 1;
    }
    printf("functions linked: %d\n", anyccl_test_function_count);
    printf("device functions linked: %d\n", anyccl_test_device_function_count);
    printf("underlying: %s\n", anyccl_nccl_dropin_underlying());

    int v = -1, rv = -2;
    ncclResult_t rc = ncclGetVersion(&v);
    real_version(&rv);
    printf("ncclGetVersion rc=%d version=%d real=%d header=%d\n", rc, v, rv, NCCL_VERSION_CODE);
    CHECK(rc == ncclSuccess && v == rv, "version %d (rc %d) through the drop-in, %d from the library", v, rc, rv);

    for (int code = -1; code <= ncclNumResults + 1; code++) {
        const char* mine = ncclGetErrorString((ncclResult_t)code);
        const char* theirs = real_error_string((ncclResult_t)code);
        printf("ncclGetErrorString(%d): %s\n", code, str(mine));
        CHECK(mine == theirs || (mine && theirs && strcmp(mine, theirs) == 0), "error string %d: \"%s\" vs \"%s\"",
              code, str(mine), str(theirs));
    }

    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    rc = ncclGetUniqueId(&id);
    int nonzero = 0;
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) nonzero |= id.internal[i] != 0;
    printf("ncclGetUniqueId rc=%d nonzero=%d\n", rc, nonzero);
    const char* e = ncclGetLastError(NULL);
    printf("last after ncclGetUniqueId: %s\n", str(e));

    ncclComm_t comm = NULL;
    rc = ncclCommInitRank(&comm, 1, id, 0);
    const char* mine = ncclGetLastError(NULL);
    const char* theirs = real_last_error(NULL);
    printf("ncclCommInitRank rc=%d comm_is_null=%d\n", rc, comm == NULL);
    printf("last after ncclCommInitRank: %s\n", str(mine));
    CHECK(mine == theirs || (mine && theirs && strcmp(mine, theirs) == 0), "last error \"%s\" vs \"%s\"", str(mine),
          str(theirs));

    /* A function this library may lack: the drop-in answers it, or forwards it and answers as the library does. */
    ncclWindow_t win = NULL;
    rc = ncclCommWindowRegister(NULL, NULL, 0, &win, NCCL_WIN_DEFAULT);
    mine = ncclGetLastError(NULL);
    printf("ncclCommWindowRegister rc=%d exported=%d\n", rc, dlsym(real, "ncclCommWindowRegister") != NULL);
    printf("last after ncclCommWindowRegister: %s\n", str(mine));
    if (dlsym(real, "ncclCommWindowRegister")) {
        ncclResult_t (*real_register)(ncclComm_t, void*, size_t, ncclWindow_t*, int) =
            (ncclResult_t(*)(ncclComm_t, void*, size_t, ncclWindow_t*, int))dlsym(real, "ncclCommWindowRegister");
        ncclResult_t rrc = real_register(NULL, NULL, 0, &win, NCCL_WIN_DEFAULT);
        theirs = real_last_error(NULL);
        CHECK(rc == rrc, "ncclCommWindowRegister rc %d vs %d", rc, rrc);
        CHECK(mine && theirs && strcmp(mine, theirs) == 0, "last error \"%s\" vs \"%s\"", str(mine), str(theirs));
    } else {
        CHECK(rc == ncclInvalidUsage, "ncclCommWindowRegister rc %d where the library lacks it", rc);
    }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 32, 0)
    /* nccl.h 2.32 calls that have a defined answer without a GPU (a null communicator, the parameter registry):
     * through the drop-in and from the library directly, the same code and last-error text; where the library
     * lacks the function, ncclInvalidUsage from the drop-in. */
    {
        ncclCollConfig_t cfg = NCCL_COLLCONFIG_INITIALIZER;
        uint64_t stat = 0;
        ncclUniqueId gid;
        const char* value = NULL;
        int value_len = -1;
        ncclParamHandle_t param = NULL;
        int32_t param_value = -1;
#define SAME(name, types, ...)                                                                                   \
    do {                                                                                                         \
        char mine_text[1024], theirs_text[1024];                                                                 \
        ncclResult_t mine_rc = name(__VA_ARGS__);                                                                \
        snprintf(mine_text, sizeof mine_text, "%s", str(ncclGetLastError(NULL)));                                \
        void* sym = dlsym(real, #name);                                                                          \
        printf(#name " rc=%d exported=%d\n", mine_rc, sym != NULL);                                              \
        printf("last after " #name ": %s\n", mine_text);                                                         \
        if (sym) {                                                                                               \
            ncclResult_t theirs_rc = ((ncclResult_t(*) types)sym)(__VA_ARGS__);                                  \
            snprintf(theirs_text, sizeof theirs_text, "%s", str(real_last_error(NULL)));                         \
            CHECK(mine_rc == theirs_rc, #name " rc %d vs %d", mine_rc, theirs_rc);                               \
            CHECK(strcmp(mine_text, theirs_text) == 0, #name " last error \"%s\" vs \"%s\"", mine_text,        \
                  theirs_text);                                                                                  \
        } else {                                                                                                 \
            CHECK(mine_rc == ncclInvalidUsage, #name " rc %d where the library lacks it", mine_rc);              \
        }                                                                                                        \
    } while (0)
        SAME(ncclCommSuspend, (ncclComm_t, int), NULL, NCCL_SUSPEND_MEM);
        SAME(ncclCommResume, (ncclComm_t), NULL);
        SAME(ncclCommMemStats, (ncclComm_t, ncclCommMemStat_t, uint64_t*), NULL, ncclStatGpuMemTotal, &stat);
        SAME(ncclCommGetUniqueId, (ncclComm_t, ncclUniqueId*), NULL, &gid);
        SAME(ncclAllReduceConfig,
             (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t,
              const ncclCollConfig_t*),
             NULL, NULL, 1, ncclFloat32, ncclSum, NULL, NULL, &cfg);
        /* The drop-in reads an ncclAllReduceConfig config: a null one, one naming an algorithm and a malformed one
         * (which it leaves to the library to refuse) get the library's own answers too. */
        ncclCollConfig_t named = NCCL_COLLCONFIG_INITIALIZER, bad = NCCL_COLLCONFIG_INITIALIZER;
        named.algSelection = "RING_SIMPLE";
        bad.magic = 0;
        SAME(ncclAllReduceConfig,
             (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t,
              const ncclCollConfig_t*),
             NULL, NULL, 1, ncclFloat32, ncclSum, NULL, NULL, NULL);
        SAME(ncclAllReduceConfig,
             (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t,
              const ncclCollConfig_t*),
             NULL, NULL, 1, ncclFloat32, ncclSum, NULL, NULL, &named);
        SAME(ncclAllReduceConfig,
             (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t,
              const ncclCollConfig_t*),
             NULL, NULL, 1, ncclFloat32, ncclSum, NULL, NULL, &bad);
        SAME(ncclBroadcastConfig,
             (const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t*),
             NULL, NULL, 1, ncclFloat32, 0, NULL, NULL, &cfg);
        SAME(ncclAlltoAllConfig,
             (const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t*),
             NULL, NULL, 1, ncclFloat32, NULL, NULL, NULL);
        SAME(ncclParamGetParameter, (const char*, const char**, int*), "NCCL_PROTO", &value, &value_len);
        SAME(ncclParamBind, (ncclParamHandle_t*, const char*), &param, "NCCL_NTHREADS");
        if (param) SAME(ncclParamGetI32, (ncclParamHandle_t, int32_t*), param, &param_value);
        printf("2.32 calls compared\n");
        /* The device API's host side: the calls that have an answer without a GPU (a null communicator or window,
         * a pure computation). */
        {
            char props[4096];
            void* out = NULL;
            memset(props, 0, sizeof props);
            SAME(ncclCommQueryProperties, (ncclComm_t, void*), NULL, props);
            SAME(ncclGetPeerDevicePointer, (ncclWindow_t, size_t, int, void**), NULL, 0, 1, &out);
            SAME(ncclGetLsaDevicePointer, (ncclWindow_t, size_t, int, void**), NULL, 0, 0, &out);
            int slots = ncclLLA2ACalcSlots(1024, 16);
            void* sym = dlsym(real, "ncclLLA2ACalcSlots");
            printf("ncclLLA2ACalcSlots value=%d exported=%d\n", slots, sym != NULL);
            if (sym) {
                int theirs = ((int (*)(int, int))sym)(1024, 16);
                CHECK(slots == theirs, "ncclLLA2ACalcSlots %d vs %d", slots, theirs);
            } else {
                CHECK(slots == -1, "ncclLLA2ACalcSlots %d where the library lacks it", slots);
            }
            printf("device API host calls compared\n");
        }
#undef SAME
    }
#endif
    printf("%s\n", failed ? "FAILED" : "ALL CHECKS PASSED");
    return failed;
}
