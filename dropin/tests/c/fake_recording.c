/* A fake NCCL for the drop-in's tests: it exports the nccl.h 2.28 functions (and, with -DNCCL_2_32, a few of 2.32)
 * and appends one line per call, with every argument, to the file named by FAKE_RECORD. ncclCommInitRank with
 * nranks -1 (which NCCL refuses) records nothing and hands out the handle `rank` itself: the test programs create,
 * through the drop-in, the communicators with distinctive handles that they then pass. Built by
 * dropin/tests/forwarding.rs with
 *   -DFAKE_VERSION=<code>   what ncclGetVersion answers
 *   -DNO_WINDOWS            leave out ncclCommWindowRegister/Deregister (as RCCL 7.0 does)
 *   -DRCCL                  export ncclAllToAllv too, an RCCL-only symbol (anyccl's loader then says RCCL)
 *   -DNCCL_2_32             export the nccl.h 2.32 functions the checks program calls too (the eight *Config
 *                           collectives, ncclCommSuspend/Resume, ncclCommGrow, ncclCommMemStats, ncclWinGetUserPtr,
 *                           ncclSetEncryption, ncclPutSignal, ncclSignal, ncclWaitSignal, the ncclParam* family)
 *                           and two device API host functions (ncclTeamWorld, ncclTeamRankToWorld), but not
 *                           ncclCommGetUniqueId; ncclAllReduceConfig records the config's fields, the other *Config
 *                           calls its address
 * Results: every call returns ncclSuccess (0) except ncclGroupEnd, which returns ncclInProgress (7), and
 * ncclAllGather with sendcount 13, which returns ncclInvalidArgument (4) and sets the last error. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef void* comm_t;
typedef void* stream_t;

static char last_error[256] = "fake: no error yet";

static void rec(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void rec(const char* fmt, ...) {
    const char* path = getenv("FAKE_RECORD");
    if (!path) return;
    FILE* f = fopen(path, "a");
    if (!f) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}
#define P(x) ((unsigned long)(uintptr_t)(x))

int ncclGetVersion(int* v) { rec("ncclGetVersion"); *v = FAKE_VERSION; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { rec("ncclGetUniqueId"); memset(id->internal, 0x5a, 128); return 0; }
int ncclMemAlloc(void** p, size_t n) { rec("ncclMemAlloc size=%zu", n); *p = (void*)0xa110c; return 0; }
int ncclMemFree(void* p) { rec("ncclMemFree ptr=%lx", P(p)); return 0; }
int ncclCommInitRankConfig(comm_t* c, int n, ncclUniqueId id, int r, void* cfg) {
    rec("ncclCommInitRankConfig nranks=%d id0=%d rank=%d config=%lx", n, id.internal[0], r, P(cfg));
    *c = (void*)0xc0;
    return 0;
}
int ncclCommInitRank(comm_t* c, int n, ncclUniqueId id, int r) {
    if (n == -1) {
        *c = (void*)(uintptr_t)(unsigned)r;
        return 0;
    }
    rec("ncclCommInitRank nranks=%d id0=%d id127=%d rank=%d", n, id.internal[0], id.internal[127], r);
    *c = (void*)0xc1;
    return 0;
}
int ncclCommInitAll(comm_t* c, int n, const int* devs) {
    if (devs && n == 2) rec("ncclCommInitAll ndev=%d devlist=%d,%d", n, devs[0], devs[1]);
    else rec("ncclCommInitAll ndev=%d devlist=%lx", n, P(devs));
    for (int i = 0; i < n; i++) c[i] = (void*)(uintptr_t)(0xd0 + i);
    return 0;
}
int ncclCommFinalize(comm_t c) { rec("ncclCommFinalize comm=%lx", P(c)); return 0; }
int ncclCommGetAsyncError(comm_t c, int* e);
/* NCCL 2.28's destroy asks for the communicator's state through its own exported ncclCommGetAsyncError. Under a
   drop-in that loads this library with the default binding, that call would reach the drop-in's symbol instead,
   which refuses the communicator it has just released; the drop-in binds the library to itself (RTLD_DEEPBIND). */
int ncclCommDestroy(comm_t c) {
    rec("ncclCommDestroy comm=%lx", P(c));
    int e = 0;
    return c ? ncclCommGetAsyncError(c, &e) : 0;
}
int ncclCommAbort(comm_t c) { rec("ncclCommAbort comm=%lx", P(c)); return 0; }
int ncclCommRevoke(comm_t c, int flags) { rec("ncclCommRevoke comm=%lx flags=%d", P(c), flags); return 0; }
int ncclCommSplit(comm_t c, int color, int key, comm_t* out, void* cfg) {
    rec("ncclCommSplit comm=%lx color=%d key=%d config=%lx", P(c), color, key, P(cfg));
    *out = (void*)0xe0;
    return 0;
}
int ncclCommShrink(comm_t c, int* ex, int nex, comm_t* out, void* cfg, int flags) {
    rec("ncclCommShrink comm=%lx exclude=%d,%d count=%d config=%lx flags=%d", P(c), ex[0], ex[1], nex, P(cfg), flags);
    *out = (void*)0xe1;
    return 0;
}
int ncclCommInitRankScalable(comm_t* c, int n, int r, int nid, ncclUniqueId* ids, void* cfg) {
    rec("ncclCommInitRankScalable nranks=%d rank=%d nId=%d id0=%d config=%lx", n, r, nid, ids[0].internal[0], P(cfg));
    *c = (void*)0xc2;
    return 0;
}
const char* ncclGetErrorString(int s) {
    static char buf[16][40];
    int i = s < 0 || s > 15 ? 15 : s;
    snprintf(buf[i], sizeof buf[i], "fake error string %d", s);
    return buf[i];
}
const char* ncclGetLastError(comm_t c) { (void)c; return last_error; }
void ncclResetDebugInit(void) { rec("ncclResetDebugInit"); }
int ncclCommGetAsyncError(comm_t c, int* e) { rec("ncclCommGetAsyncError comm=%lx", P(c)); *e = 6; return 0; }
int ncclCommCount(comm_t c, int* n) { rec("ncclCommCount comm=%lx", P(c)); *n = 8; return 0; }
int ncclCommCuDevice(comm_t c, int* d) { rec("ncclCommCuDevice comm=%lx", P(c)); *d = 3; return 0; }
int ncclCommUserRank(comm_t c, int* r) { rec("ncclCommUserRank comm=%lx", P(c)); *r = 5; return 0; }
int ncclCommRegister(comm_t c, void* b, size_t n, void** h) {
    rec("ncclCommRegister comm=%lx buff=%lx size=%zu", P(c), P(b), n);
    *h = (void*)0x4a;
    return 0;
}
int ncclCommDeregister(comm_t c, void* h) { rec("ncclCommDeregister comm=%lx handle=%lx", P(c), P(h)); return 0; }
#ifndef NO_WINDOWS
int ncclCommWindowRegister(comm_t c, void* b, size_t n, void** w, int flags) {
    rec("ncclCommWindowRegister comm=%lx buff=%lx size=%zu flags=%d", P(c), P(b), n, flags);
    *w = (void*)0x3b;
    return 0;
}
int ncclCommWindowDeregister(comm_t c, void* w) { rec("ncclCommWindowDeregister comm=%lx win=%lx", P(c), P(w)); return 0; }
#endif
int ncclRedOpCreatePreMulSum(int* op, void* scalar, int t, int residence, comm_t c) {
    rec("ncclRedOpCreatePreMulSum scalar=%lx dtype=%d residence=%d comm=%lx", P(scalar), t, residence, P(c));
    *op = 5;
    return 0;
}
int ncclRedOpDestroy(int op, comm_t c) { rec("ncclRedOpDestroy op=%d comm=%lx", op, P(c)); return 0; }
int ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, comm_t c, stream_t st) {
    rec("ncclReduce send=%lx recv=%lx count=%zu dtype=%d op=%d root=%d comm=%lx stream=%lx", P(s), P(r), n, t, op, root,
        P(c), P(st));
    return 0;
}
int ncclBcast(void* b, size_t n, int t, int root, comm_t c, stream_t st) {
    rec("ncclBcast buff=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx", P(b), n, t, root, P(c), P(st));
    return 0;
}
int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, comm_t c, stream_t st) {
    rec("ncclBroadcast send=%lx recv=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx", P(s), P(r), n, t, root, P(c),
        P(st));
    return 0;
}
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, comm_t c, stream_t st) {
    rec("ncclAllReduce send=%lx recv=%lx count=%zu dtype=%d op=%d comm=%lx stream=%lx", P(s), P(r), n, t, op, P(c), P(st));
    return 0;
}
int ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, comm_t c, stream_t st) {
    rec("ncclReduceScatter send=%lx recv=%lx count=%zu dtype=%d op=%d comm=%lx stream=%lx", P(s), P(r), n, t, op, P(c),
        P(st));
    return 0;
}
int ncclAllGather(const void* s, void* r, size_t n, int t, comm_t c, stream_t st) {
    rec("ncclAllGather send=%lx recv=%lx count=%zu dtype=%d comm=%lx stream=%lx", P(s), P(r), n, t, P(c), P(st));
    if (n == 13) {
        snprintf(last_error, sizeof last_error, "fake: ncclAllGather refuses count 13");
        return 4;
    }
    return 0;
}
int ncclAlltoAll(const void* s, void* r, size_t n, int t, comm_t c, stream_t st) {
    rec("ncclAlltoAll send=%lx recv=%lx count=%zu dtype=%d comm=%lx stream=%lx", P(s), P(r), n, t, P(c), P(st));
    return 0;
}
int ncclGather(const void* s, void* r, size_t n, int t, int root, comm_t c, stream_t st) {
    rec("ncclGather send=%lx recv=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx", P(s), P(r), n, t, root, P(c), P(st));
    return 0;
}
int ncclScatter(const void* s, void* r, size_t n, int t, int root, comm_t c, stream_t st) {
    rec("ncclScatter send=%lx recv=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx", P(s), P(r), n, t, root, P(c), P(st));
    return 0;
}
int ncclSend(const void* s, size_t n, int t, int peer, comm_t c, stream_t st) {
    rec("ncclSend send=%lx count=%zu dtype=%d peer=%d comm=%lx stream=%lx", P(s), n, t, peer, P(c), P(st));
    return 0;
}
int ncclRecv(void* r, size_t n, int t, int peer, comm_t c, stream_t st) {
    rec("ncclRecv recv=%lx count=%zu dtype=%d peer=%d comm=%lx stream=%lx", P(r), n, t, peer, P(c), P(st));
    return 0;
}
int ncclGroupStart(void) { rec("ncclGroupStart"); return 0; }
int ncclGroupEnd(void) { rec("ncclGroupEnd"); return 7; }
int ncclGroupSimulateEnd(void* info) { rec("ncclGroupSimulateEnd info=%lx", P(info)); return 0; }
#ifdef RCCL
int ncclAllToAllv(void) { return 0; }
#endif
#ifdef NCCL_2_32
/* ncclCollConfig_t of nccl.h 2.32.3, as the checks program fills it. */
typedef struct {
    size_t size;
    unsigned int magic, version;
    void* ext;
    int minCTAs, maxCTAs, nvlsCTAs, cgaClusterSize;
    const char* algSelection;
    int forceAlgSelection, CTAPolicy;
    unsigned long long userProfilerTag;
    void* launchCompletionEvent;
} collconfig_t;
int ncclAllReduceConfig(const void* s, void* r, size_t n, int t, int op, comm_t c, stream_t st, const void* cfg) {
    const collconfig_t* k = cfg;
    if (!k) {
        rec("ncclAllReduceConfig send=%lx recv=%lx count=%zu dtype=%d op=%d comm=%lx stream=%lx config=null", P(s), P(r),
            n, t, op, P(c), P(st));
        return 0;
    }
    rec("ncclAllReduceConfig send=%lx recv=%lx count=%zu dtype=%d op=%d comm=%lx stream=%lx config=size:%zu,magic:%x,"
        "version:%u,alg:%s,force:%d,tag:%llu",
        P(s), P(r), n, t, op, P(c), P(st), k->size, k->magic, k->version, k->algSelection ? k->algSelection : "(null)",
        k->forceAlgSelection, k->userProfilerTag);
    return 0;
}
int ncclBroadcastConfig(const void* s, void* r, size_t n, int t, int root, comm_t c, stream_t st, const void* cfg) {
    rec("ncclBroadcastConfig send=%lx recv=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx config=%lx", P(s), P(r),
        n, t, root, P(c), P(st), P(cfg));
    return 0;
}
int ncclReduceConfig(const void* s, void* r, size_t n, int t, int op, int root, comm_t c, stream_t st, const void* cfg) {
    rec("ncclReduceConfig send=%lx recv=%lx count=%zu dtype=%d op=%d root=%d comm=%lx stream=%lx config=%lx", P(s),
        P(r), n, t, op, root, P(c), P(st), P(cfg));
    return 0;
}
int ncclAllGatherConfig(const void* s, void* r, size_t n, int t, comm_t c, stream_t st, const void* cfg) {
    rec("ncclAllGatherConfig send=%lx recv=%lx count=%zu dtype=%d comm=%lx stream=%lx config=%lx", P(s), P(r), n, t,
        P(c), P(st), P(cfg));
    return 0;
}
int ncclReduceScatterConfig(const void* s, void* r, size_t n, int t, int op, comm_t c, stream_t st, const void* cfg) {
    rec("ncclReduceScatterConfig send=%lx recv=%lx count=%zu dtype=%d op=%d comm=%lx stream=%lx config=%lx", P(s), P(r),
        n, t, op, P(c), P(st), P(cfg));
    return 0;
}
int ncclAlltoAllConfig(const void* s, void* r, size_t n, int t, comm_t c, stream_t st, const void* cfg) {
    rec("ncclAlltoAllConfig send=%lx recv=%lx count=%zu dtype=%d comm=%lx stream=%lx config=%lx", P(s), P(r), n, t,
        P(c), P(st), P(cfg));
    return 0;
}
int ncclGatherConfig(const void* s, void* r, size_t n, int t, int root, comm_t c, stream_t st, const void* cfg) {
    rec("ncclGatherConfig send=%lx recv=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx config=%lx", P(s), P(r), n,
        t, root, P(c), P(st), P(cfg));
    return 0;
}
int ncclScatterConfig(const void* s, void* r, size_t n, int t, int root, comm_t c, stream_t st, const void* cfg) {
    rec("ncclScatterConfig send=%lx recv=%lx count=%zu dtype=%d root=%d comm=%lx stream=%lx config=%lx", P(s), P(r), n,
        t, root, P(c), P(st), P(cfg));
    return 0;
}
int ncclCommGrow(comm_t c, int n, const ncclUniqueId* id, int r, comm_t* out, void* cfg) {
    rec("ncclCommGrow comm=%lx nranks=%d id0=%d rank=%d config=%lx", P(c), n, id ? id->internal[0] : -1, r, P(cfg));
    *out = (void*)0xe2;
    return 0;
}
int ncclCommMemStats(comm_t c, int stat, uint64_t* v) {
    rec("ncclCommMemStats comm=%lx stat=%d", P(c), stat);
    *v = 1000 + (uint64_t)stat;
    return 0;
}
int ncclWinGetUserPtr(comm_t c, void* w, void** out) {
    rec("ncclWinGetUserPtr comm=%lx win=%lx", P(c), P(w));
    *out = (void*)0x05e4;
    return 0;
}
int ncclSetEncryption(const void* cfg) { rec("ncclSetEncryption config=%lx", P(cfg)); return 0; }
int ncclPutSignal(const void* s, size_t n, int t, int peer, void* w, size_t off, int sig, int ctx, unsigned flags,
                  comm_t c, stream_t st) {
    rec("ncclPutSignal send=%lx count=%zu dtype=%d peer=%d win=%lx offset=%zu sig=%d ctx=%d flags=%u comm=%lx "
        "stream=%lx",
        P(s), n, t, peer, P(w), off, sig, ctx, flags, P(c), P(st));
    return 0;
}
int ncclSignal(int peer, int sig, int ctx, unsigned flags, comm_t c, stream_t st) {
    rec("ncclSignal peer=%d sig=%d ctx=%d flags=%u comm=%lx stream=%lx", peer, sig, ctx, flags, P(c), P(st));
    return 0;
}
typedef struct { int opCnt, peer, sigIdx, ctx; } wait_desc_t;
int ncclWaitSignal(int nd, wait_desc_t* d, comm_t c, stream_t st) {
    rec("ncclWaitSignal n=%d desc1=%d,%d,%d,%d comm=%lx stream=%lx", nd, d[1].opCnt, d[1].peer, d[1].sigIdx, d[1].ctx,
        P(c), P(st));
    return 0;
}
int ncclParamBind(void** out, const char* key) { rec("ncclParamBind key=%s", key); *out = (void*)0x9b; return 0; }
int ncclParamGetI8(void* h, int8_t* out) { rec("ncclParamGetI8 h=%lx", P(h)); *out = -8; return 0; }
int ncclParamGetI16(void* h, int16_t* out) { rec("ncclParamGetI16 h=%lx", P(h)); *out = -16; return 0; }
int ncclParamGetI64(void* h, int64_t* out) { rec("ncclParamGetI64 h=%lx", P(h)); *out = -(1LL << 40); return 0; }
int ncclParamGetU8(void* h, uint8_t* out) { rec("ncclParamGetU8 h=%lx", P(h)); *out = 200; return 0; }
int ncclParamGetU16(void* h, uint16_t* out) { rec("ncclParamGetU16 h=%lx", P(h)); *out = 60000; return 0; }
int ncclParamGetU32(void* h, uint32_t* out) { rec("ncclParamGetU32 h=%lx", P(h)); *out = 4000000000u; return 0; }
int ncclParamGetU64(void* h, uint64_t* out) { rec("ncclParamGetU64 h=%lx", P(h)); *out = 1ULL << 63; return 0; }
int ncclParamGetStr(void* h, const char** out) { rec("ncclParamGetStr h=%lx", P(h)); *out = "fake-str"; return 0; }
int ncclParamGet(void* h, void* out, int max, int* len) {
    rec("ncclParamGet h=%lx max=%d", P(h), max);
    memcpy(out, "raw", max < 3 ? (size_t)max : 3);
    *len = 3;
    return 0;
}
int ncclParamGetParameter(const char* key, const char** value, int* len) {
    rec("ncclParamGetParameter key=%s", key);
    *value = "fake-value";
    *len = 10;
    return 0;
}
int ncclParamGetAllParameterKeys(const char*** table, int* len) {
    static const char* keys[] = {"NCCL_FAKE_A", "NCCL_FAKE_B"};
    rec("ncclParamGetAllParameterKeys");
    *table = keys;
    *len = 2;
    return 0;
}
void ncclParamDumpAll(void) { rec("ncclParamDumpAll"); }
int ncclCommSuspend(comm_t c, int flags) { rec("ncclCommSuspend comm=%lx flags=%d", P(c), flags); return 0; }
int ncclCommResume(comm_t c) { rec("ncclCommResume comm=%lx", P(c)); return 0; }
int ncclParamGetI32(void* h, int* out) { rec("ncclParamGetI32 h=%lx", P(h)); *out = 32; return 0; }
typedef struct { int nRanks, rank, stride; } team_t;
team_t ncclTeamWorld(comm_t c) {
    rec("ncclTeamWorld comm=%lx", P(c));
    team_t t = {8, 3, 1};
    return t;
}
int ncclTeamRankToWorld(comm_t c, team_t t, int rank) {
    rec("ncclTeamRankToWorld comm=%lx team=%d,%d,%d rank=%d", P(c), t.nRanks, t.rank, t.stride, rank);
    return 100 + rank;
}
#endif
/* The profiling aliases forward.c calls (the real library exports every one). */
int pncclAllReduce(const void*, void*, size_t, int, int, comm_t, stream_t) __attribute__((alias("ncclAllReduce")));
int pncclSend(const void*, size_t, int, int, comm_t, stream_t) __attribute__((alias("ncclSend")));
int pncclGroupStart(void) __attribute__((alias("ncclGroupStart")));
