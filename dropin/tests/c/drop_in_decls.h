/* The drop-in's entry points as the forwarding test calls them, declared here (not from nccl.h, which the offline
 * tests do not have): C enums are int, handles are opaque pointers. The real-NCCL test compiles against the
 * wheel's nccl.h instead. */
#include <stddef.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef void* ncclComm_t;
typedef void* cudaStream_t;

int ncclGetVersion(int*);
int ncclGetUniqueId(ncclUniqueId*);
int ncclMemAlloc(void**, size_t);
int ncclMemFree(void*);
int ncclCommInitRankConfig(ncclComm_t*, int, ncclUniqueId, int, void*);
int ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int);
int ncclCommInitAll(ncclComm_t*, int, const int*);
int ncclCommFinalize(ncclComm_t);
int ncclCommDestroy(ncclComm_t);
int ncclCommAbort(ncclComm_t);
int ncclCommRevoke(ncclComm_t, int);
int ncclCommSplit(ncclComm_t, int, int, ncclComm_t*, void*);
int ncclCommShrink(ncclComm_t, int*, int, ncclComm_t*, void*, int);
int ncclCommInitRankScalable(ncclComm_t*, int, int, int, ncclUniqueId*, void*);
const char* ncclGetErrorString(int);
const char* ncclGetLastError(ncclComm_t);
void ncclResetDebugInit(void);
int ncclCommGetAsyncError(ncclComm_t, int*);
int ncclCommCount(ncclComm_t, int*);
int ncclCommCuDevice(ncclComm_t, int*);
int ncclCommUserRank(ncclComm_t, int*);
int ncclCommRegister(ncclComm_t, void*, size_t, void**);
int ncclCommDeregister(ncclComm_t, void*);
int ncclCommWindowRegister(ncclComm_t, void*, size_t, void**, int);
int ncclCommWindowDeregister(ncclComm_t, void*);
int ncclRedOpCreatePreMulSum(int*, void*, int, int, ncclComm_t);
int ncclRedOpDestroy(int, ncclComm_t);
int ncclReduce(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t);
int ncclBcast(void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclBroadcast(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclAllReduce(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
int pncclAllReduce(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclReduceScatter(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclAllGather(const void*, void*, size_t, int, ncclComm_t, cudaStream_t);
int ncclAlltoAll(const void*, void*, size_t, int, ncclComm_t, cudaStream_t);
int ncclGather(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclScatter(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclSend(const void*, size_t, int, int, ncclComm_t, cudaStream_t);
int pncclSend(const void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclRecv(void*, size_t, int, int, ncclComm_t, cudaStream_t);
int ncclGroupStart(void);
int pncclGroupStart(void);
int ncclGroupEnd(void);
int ncclGroupSimulateEnd(void*);
/* Weak: a program linked to the real library and run with the drop-in in LD_PRELOAD gets it from the drop-in. */
const char* anyccl_nccl_dropin_underlying(void) __attribute__((weak));
unsigned long long anyccl_nccl_dropin_calls(void) __attribute__((weak));
/* nccl.h 2.32 functions the checks program calls. */
int ncclAllReduceConfig(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t, const void*);
int ncclBroadcastConfig(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t, const void*);
int pncclBroadcastConfig(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t, const void*);
int ncclCommSuspend(ncclComm_t, int);
int ncclCommResume(ncclComm_t);
int ncclParamGetI32(void*, int*);
int ncclCommGetUniqueId(ncclComm_t, ncclUniqueId*);
int ncclReduceConfig(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t, const void*);
int ncclAllGatherConfig(const void*, void*, size_t, int, ncclComm_t, cudaStream_t, const void*);
int ncclReduceScatterConfig(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t, const void*);
int ncclAlltoAllConfig(const void*, void*, size_t, int, ncclComm_t, cudaStream_t, const void*);
int ncclGatherConfig(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t, const void*);
int ncclScatterConfig(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t, const void*);
int ncclCommGrow(ncclComm_t, int, const ncclUniqueId*, int, ncclComm_t*, void*);
int ncclSetEncryption(const void*);
int ncclWinGetUserPtr(ncclComm_t, void*, void**);
int ncclPutSignal(const void*, size_t, int, int, void*, size_t, int, int, unsigned int, ncclComm_t, cudaStream_t);
int ncclSignal(int, int, int, unsigned int, ncclComm_t, cudaStream_t);
typedef struct { int opCnt, peer, sigIdx, ctx; } ncclWaitSignalDesc_t;
int ncclWaitSignal(int, ncclWaitSignalDesc_t*, ncclComm_t, cudaStream_t);
int ncclCommMemStats(ncclComm_t, int, unsigned long long*);
int ncclParamBind(void**, const char*);
int ncclParamGetI8(void*, signed char*);
int ncclParamGetI16(void*, short*);
int ncclParamGetI64(void*, long long*);
int ncclParamGetU8(void*, unsigned char*);
int ncclParamGetU16(void*, unsigned short*);
int ncclParamGetU32(void*, unsigned int*);
int ncclParamGetU64(void*, unsigned long long*);
int ncclParamGetStr(void*, const char**);
int ncclParamGet(void*, void*, int, int*);
int ncclParamGetParameter(const char*, const char**, int*);
int ncclParamGetAllParameterKeys(const char***, int*);
void ncclParamDumpAll(void);
/* ncclCollConfig_t of nccl.h 2.32.3 (ncclCollConfig_v23200), field for field, and its initializer. */
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    void* ext;
    int minCTAs, maxCTAs, nvlsCTAs, cgaClusterSize;
    const char* algSelection;
    int forceAlgSelection;
    int CTAPolicy;
    unsigned long long userProfilerTag;
    void* launchCompletionEvent;
} ncclCollConfig_t;
#define NCCL_COLLCONFIG_INITIALIZER_2_32_3 \
    {sizeof(ncclCollConfig_t), 0xcafebeef, 23203, NULL, -2147483647 - 1, -2147483647 - 1, -2147483647 - 1, \
     -2147483647 - 1, NULL, 1, -2147483647 - 1, 0, NULL}
/* The device API's host side (nccl_device/host.h). */
typedef struct { int nRanks, rank, stride; } ncclTeam_t;
ncclTeam_t ncclTeamWorld(ncclComm_t);
ncclTeam_t pncclTeamWorld(ncclComm_t);
int ncclTeamRankToWorld(ncclComm_t, ncclTeam_t, int);
int ncclLLA2ACalcSlots(int, int);
int ncclGetPeerDevicePointer(void*, size_t, int, void**);
