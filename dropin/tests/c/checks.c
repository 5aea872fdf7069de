/* The checks test's program: linked to the drop-in over the recording fake (tests/c/fake_recording.c), it passes
 * communicator handles the drop-in did not create (garbage, freed memory, destroyed, aborted) and checks each is
 * refused with ncclInvalidArgument and a text, without reaching the library; that a pointer ncclGetLastError
 * returned stays readable after later failures and after the thread that got it ended; and calls nccl.h 2.32
 * functions and the device API's host functions. Prints one line per answer; dropin/tests/forwarding.rs compares them and the fake's records. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drop_in_decls.h"

#define P(n) ((void*)(uintptr_t)(n))

static ncclComm_t mint(uintptr_t h) {
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclComm_t c = NULL;
    if (ncclCommInitRank(&c, -1, id, (int)h) != 0 || c != P(h)) printf("MINT FAILED for %lx\n", (unsigned long)h);
    return c;
}

static const char* last(void) {
    const char* e = ncclGetLastError(NULL);
    return e ? e : "(null)";
}

static void show(const char* what, int rc) { printf("%s rc=%d last=%s\n", what, rc, last()); }

static void* other_thread(void* arg) {
    int n = 0;
    ncclCommCount(P(0xbad2), &n);
    *(const char**)arg = ncclGetLastError(NULL);
    return NULL;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    int n = -1;
    /* Garbage: a number nobody handed out. */
    show("garbage ncclCommCount", ncclCommCount(P(0xdead0), &n));
    show("garbage ncclAllReduce", ncclAllReduce(P(1), P(2), 3, 7, 0, P(0xdead1), P(5)));
    show("garbage ncclSend", ncclSend(P(1), 3, 7, 0, P(0xdead2), P(5)));
    show("garbage ncclCommDestroy", ncclCommDestroy(P(0xdead3)));
    show("garbage ncclAllReduceConfig", ncclAllReduceConfig(P(1), P(2), 3, 7, 0, P(0xdead4), P(5), NULL));
    /* Freed memory: a real heap address, no longer anything. */
    void* block = malloc(64);
    volatile uintptr_t freed = (uintptr_t)block; /* kept as a number: the compiler rightly refuses a freed pointer */
    free(block);
    int rc = ncclCommUserRank((void*)freed, &n);
    printf("freed ncclCommUserRank rc=%d names_it=%d\n", rc, strstr(last(), "is not a communicator") != NULL);
    printf("garbage ncclGetLastError: %s\n", ncclGetLastError(P(0xdead5)) ? "text" : "(null)");
    /* Destroyed, aborted: created through the drop-in first. */
    ncclComm_t d = mint(0xd00);
    show("live ncclCommCount", ncclCommCount(d, &n));
    show("live ncclCommDestroy", ncclCommDestroy(d));
    show("destroyed ncclCommCount", ncclCommCount(d, &n));
    show("destroyed ncclCommDestroy", ncclCommDestroy(d));
    ncclComm_t a = mint(0xa00);
    show("live ncclCommAbort", ncclCommAbort(a));
    show("aborted ncclAllReduce", ncclAllReduce(P(1), P(2), 3, 7, 0, a, P(5)));
    ncclComm_t f = mint(0xf00);
    show("live ncclCommFinalize", ncclCommFinalize(f));
    show("finalized ncclCommCount", ncclCommCount(f, &n));
    /* Null: the library answers (the fake answers everything with success). */
    show("null ncclCommDestroy", ncclCommDestroy(NULL));

    /* The text's lifetime: the first pointer stays readable after two later failures (it shows the newest text). */
    ncclCommCount(P(0xbad0), &n);
    const char* first = ncclGetLastError(NULL);
    char copy[512];
    snprintf(copy, sizeof copy, "%s", first);
    ncclCommCount(P(0xbad1), &n);
    ncclCommCuDevice(P(0xbad11), &n);
    printf("first pointer again: same=%d text=%s\n", first == ncclGetLastError(NULL), first);
    printf("first text was: %s\n", copy);
    /* A forwarded call gives the library's text back; the drop-in's pointer is still readable. */
    ncclCommCount(mint(0xc00), &n);
    printf("after a forwarded call: %s; first pointer: %s\n", last(), first);
    /* A pointer from a thread that has ended. */
    const char* theirs = NULL;
    pthread_t t;
    pthread_create(&t, NULL, other_thread, &theirs);
    pthread_join(t, NULL);
    printf("ended thread's pointer: %s\n", theirs ? theirs : "(null)");

    /* nccl.h 2.32 functions. */
    ncclComm_t c = mint(0xc32);
    show("ncclCommSuspend", ncclCommSuspend(c, 1));
    show("ncclCommResume", ncclCommResume(c));
    /* ncclAllReduceConfig reads the config (within its size): one that asks for nothing goes the way of
     * ncclAllReduce, anything else is forwarded; whichever way, what reaches the library is the caller's call. */
    ncclCollConfig_t plain = NCCL_COLLCONFIG_INITIALIZER_2_32_3;
    show("ncclAllReduceConfig initializer", ncclAllReduceConfig(P(0x301), P(0x302), 303, 7, 0, c, P(0x5f1), &plain));
    show("ncclAllReduceConfig null", ncclAllReduceConfig(P(0x311), P(0x312), 313, 7, 0, c, P(0x5f2), NULL));
    ncclCollConfig_t named = NCCL_COLLCONFIG_INITIALIZER_2_32_3;
    named.algSelection = "RING_SIMPLE";
    show("ncclAllReduceConfig named", ncclAllReduceConfig(P(0x341), P(0x342), 343, 7, 0, c, P(0x5f5), &named));
    ncclCollConfig_t tagged = NCCL_COLLCONFIG_INITIALIZER_2_32_3;
    tagged.userProfilerTag = 42;
    show("ncclAllReduceConfig tagged", ncclAllReduceConfig(P(0x351), P(0x352), 353, 7, 0, c, P(0x5f6), &tagged));
    ncclCollConfig_t bad = NCCL_COLLCONFIG_INITIALIZER_2_32_3;
    bad.magic = 0;
    show("ncclAllReduceConfig bad magic", ncclAllReduceConfig(P(0x361), P(0x362), 363, 7, 0, c, P(0x5f7), &bad));
    ncclCollConfig_t small = NCCL_COLLCONFIG_INITIALIZER_2_32_3;
    small.size = 16;
    show("ncclAllReduceConfig too small", ncclAllReduceConfig(P(0x371), P(0x372), 373, 7, 0, c, P(0x5f8), &small));
    show("ncclBroadcastConfig", ncclBroadcastConfig(P(0x321), P(0x322), 323, 7, 1, c, P(0x5f3), P(0xcc2)));
    show("pncclBroadcastConfig", pncclBroadcastConfig(P(0x331), P(0x332), 333, 7, 2, c, P(0x5f4), P(0xcc3)));
    n = -1;
    rc = ncclParamGetI32(P(0x9a), &n);
    printf("ncclParamGetI32 rc=%d value=%d\n", rc, n);
    ncclUniqueId id;
    show("ncclCommGetUniqueId", ncclCommGetUniqueId(c, &id));
    /* The other *Config collectives: forwarded with every argument, the config's address untouched. */
    show("ncclReduceConfig", ncclReduceConfig(P(0x401), P(0x402), 403, 2, 2, 1, c, P(0x5a1), P(0xcc4)));
    show("ncclAllGatherConfig", ncclAllGatherConfig(P(0x411), P(0x412), 413, 8, c, P(0x5a2), P(0xcc5)));
    show("ncclReduceScatterConfig", ncclReduceScatterConfig(P(0x421), P(0x422), 423, 6, 3, c, P(0x5a3), P(0xcc6)));
    show("ncclAlltoAllConfig", ncclAlltoAllConfig(P(0x431), P(0x432), 433, 10, c, P(0x5a4), P(0xcc7)));
    show("ncclGatherConfig", ncclGatherConfig(P(0x441), P(0x442), 443, 11, 1, c, P(0x5a5), P(0xcc8)));
    show("ncclScatterConfig", ncclScatterConfig(P(0x451), P(0x452), 453, 0, 2, c, P(0x5a6), P(0xcc9)));
    /* ncclCommGrow: the new communicator is one the drop-in holds, so a later call on it is forwarded. */
    memset(&id, 0x21, sizeof id);
    ncclComm_t grown = NULL;
    rc = ncclCommGrow(c, 12, &id, 9, &grown, P(0xcfa));
    printf("ncclCommGrow rc=%d new=%lx last=%s\n", rc, (unsigned long)(uintptr_t)grown, last());
    show("grown ncclCommCount", ncclCommCount(grown, &n));
    show("ncclSetEncryption", ncclSetEncryption(P(0xe4c)));
    void* user = NULL;
    rc = ncclWinGetUserPtr(c, P(0x3d), &user);
    printf("ncclWinGetUserPtr rc=%d user=%lx\n", rc, (unsigned long)(uintptr_t)user);
    show("ncclPutSignal", ncclPutSignal(P(0x501), 503, 9, 4, P(0x3e), 4096, 2, 1, 5u, c, P(0x5b1)));
    show("ncclSignal", ncclSignal(5, 3, 2, 6u, c, P(0x5b2)));
    ncclWaitSignalDesc_t descs[2] = {{1, 2, 3, 4}, {6, 7, 8, 9}};
    show("ncclWaitSignal", ncclWaitSignal(2, descs, c, P(0x5b3)));
    unsigned long long stat = 0;
    rc = ncclCommMemStats(c, 2, &stat);
    printf("ncclCommMemStats rc=%d value=%llu\n", rc, stat);
    /* The ncclParam* family: each value type, through a handle the library bound. */
    void* h = NULL;
    rc = ncclParamBind(&h, "NCCL_FAKE_KEY");
    printf("ncclParamBind rc=%d handle=%lx\n", rc, (unsigned long)(uintptr_t)h);
    signed char i8 = 0;
    short i16 = 0;
    long long i64 = 0;
    unsigned char u8 = 0;
    unsigned short u16 = 0;
    unsigned int u32 = 0;
    unsigned long long u64 = 0;
    int r8 = ncclParamGetI8(h, &i8), r16 = ncclParamGetI16(P(0x9c), &i16), r64 = ncclParamGetI64(P(0x9d), &i64);
    int ru8 = ncclParamGetU8(P(0x9e), &u8), ru16 = ncclParamGetU16(P(0x9f), &u16);
    int ru32 = ncclParamGetU32(P(0xa0), &u32), ru64 = ncclParamGetU64(P(0xa1), &u64);
    printf("ncclParamGet ints rc=%d,%d,%d,%d,%d,%d,%d values=%d,%d,%lld,%u,%u,%u,%llu\n", r8, r16, r64, ru8, ru16, ru32,
           ru64, i8, i16, i64, u8, u16, u32, u64);
    const char* str = NULL;
    rc = ncclParamGetStr(P(0xa2), &str);
    printf("ncclParamGetStr rc=%d value=%s\n", rc, str ? str : "(null)");
    char raw[8] = {0};
    int len = 0;
    rc = ncclParamGet(P(0xa3), raw, 7, &len);
    printf("ncclParamGet rc=%d value=%s len=%d\n", rc, raw, len);
    const char* value = NULL;
    len = 0;
    rc = ncclParamGetParameter("NCCL_FAKE_PARAM", &value, &len);
    printf("ncclParamGetParameter rc=%d value=%s len=%d\n", rc, value ? value : "(null)", len);
    const char** keys = NULL;
    len = 0;
    rc = ncclParamGetAllParameterKeys(&keys, &len);
    printf("ncclParamGetAllParameterKeys rc=%d len=%d keys=%s,%s\n", rc, len, keys ? keys[0] : "(null)",
           keys ? keys[1] : "(null)");
    ncclParamDumpAll();
    printf("ncclParamDumpAll last=%s\n", last());
    /* The device API's host side: forwarded (a team by value, both ways), a handle checked, a function the library
     * lacks answered with a default and a text. */
    ncclTeam_t team = ncclTeamWorld(c);
    printf("ncclTeamWorld team=%d,%d,%d last=%s\n", team.nRanks, team.rank, team.stride, last());
    team.stride = 2;
    printf("ncclTeamRankToWorld rank=%d last=%s\n", ncclTeamRankToWorld(c, team, 5), last());
    team = pncclTeamWorld(P(0xdead6));
    printf("garbage pncclTeamWorld team=%d,%d,%d last=%s\n", team.nRanks, team.rank, team.stride, last());
    printf("ncclLLA2ACalcSlots slots=%d last=%s\n", ncclLLA2ACalcSlots(1024, 16), last());
    void* out = P(0x77);
    rc = ncclGetPeerDevicePointer(P(0x3c), 0, 1, &out);
    printf("ncclGetPeerDevicePointer rc=%d out=%lx last=%s\n", rc, (unsigned long)(uintptr_t)out, last());
    show("destroyed ncclCommSuspend", (ncclCommDestroy(c), ncclCommSuspend(c, 1)));
    printf("calls=%llu\n", anyccl_nccl_dropin_calls());
    return 0;
}
