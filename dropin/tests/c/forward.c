/* The forwarding test's program: linked to the drop-in, it calls every nccl.h 2.28 function once with distinctive
 * arguments and prints each result; dropin/tests/forwarding.rs compares the output and what the fake underneath
 * recorded. The communicators it passes are first created through the drop-in (the fake's ncclCommInitRank with
 * nranks -1 hands out the handle asked for, and records nothing), since the drop-in refuses handles it did not
 * create. With no library underneath (ncclGetVersion fails) it prints the drop-in's own answers and stops. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "drop_in_decls.h"

#define P(n) ((void*)(uintptr_t)(n))

/* A communicator with the handle h, created through the drop-in. */
static ncclComm_t C(uintptr_t h) {
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclComm_t c = NULL;
    int rc = ncclCommInitRank(&c, -1, id, (int)h);
    if (rc != 0 || c != P(h)) printf("MINT FAILED for %lx: rc=%d\n", (unsigned long)h, rc);
    return c;
}

static void last(const char* after) {
    const char* e = ncclGetLastError(NULL);
    printf("last after %s: %s\n", after, e ? e : "(null)");
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!anyccl_nccl_dropin_underlying) {
        printf("underlying: (no drop-in loaded)\n");
        return 1;
    }
    printf("underlying: %s\n", anyccl_nccl_dropin_underlying());
    printf("calls at start: %llu\n", anyccl_nccl_dropin_calls());
    int v = -1;
    int rc = ncclGetVersion(&v);
    printf("ncclGetVersion rc=%d version=%d\n", rc, v);
    if (rc != 0) {
        last("ncclGetVersion");
        printf("ncclGetErrorString(2): %s\n", ncclGetErrorString(2));
        printf("ncclAllReduce rc=%d\n", ncclAllReduce(P(1), P(2), 3, 7, 0, P(4), P(5)));
        ncclResetDebugInit();
        last("ncclResetDebugInit");
        printf("calls at end: %llu\n", anyccl_nccl_dropin_calls());
        return 0;
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    rc = ncclGetUniqueId(&id);
    printf("ncclGetUniqueId rc=%d id0=%d\n", rc, id.internal[0]);
    void* mem = NULL;
    rc = ncclMemAlloc(&mem, 4096);
    printf("ncclMemAlloc rc=%d ptr=%p\n", rc, mem);
    printf("ncclMemFree rc=%d\n", ncclMemFree(P(0x2001)));
    ncclComm_t comm = NULL;
    id.internal[127] = 9;
    rc = ncclCommInitRankConfig(&comm, 4, id, 1, P(0xcf6));
    printf("ncclCommInitRankConfig rc=%d comm=%p\n", rc, comm);
    rc = ncclCommInitRank(&comm, 4, id, 2);
    printf("ncclCommInitRank rc=%d comm=%p\n", rc, comm);
    ncclComm_t comms[2] = {0, 0};
    int devs[2] = {0, 1};
    rc = ncclCommInitAll(comms, 2, devs);
    printf("ncclCommInitAll rc=%d comms=%p,%p\n", rc, comms[0], comms[1]);
    printf("ncclCommFinalize rc=%d\n", ncclCommFinalize(C(0xc10)));
    printf("ncclCommDestroy rc=%d\n", ncclCommDestroy(C(0xc11)));
    printf("ncclCommAbort rc=%d\n", ncclCommAbort(C(0xc12)));
    printf("ncclCommRevoke rc=%d\n", ncclCommRevoke(C(0xc13), 0));
    ncclComm_t split = NULL;
    rc = ncclCommSplit(C(0xc14), 3, 7, &split, P(0xcf7));
    printf("ncclCommSplit rc=%d new=%p\n", rc, split);
    int exclude[2] = {6, 7};
    rc = ncclCommShrink(C(0xc15), exclude, 2, &split, P(0xcf8), 1);
    printf("ncclCommShrink rc=%d new=%p\n", rc, split);
    rc = ncclCommInitRankScalable(&comm, 8, 3, 1, &id, P(0xcf9));
    printf("ncclCommInitRankScalable rc=%d comm=%p\n", rc, comm);
    ncclResetDebugInit();
    int n = -1;
    rc = ncclCommGetAsyncError(C(0xc16), &n);
    printf("ncclCommGetAsyncError rc=%d err=%d\n", rc, n);
    rc = ncclCommCount(C(0xc17), &n);
    printf("ncclCommCount rc=%d count=%d\n", rc, n);
    rc = ncclCommCuDevice(C(0xc18), &n);
    printf("ncclCommCuDevice rc=%d device=%d\n", rc, n);
    rc = ncclCommUserRank(C(0xc19), &n);
    printf("ncclCommUserRank rc=%d rank=%d\n", rc, n);
    void* handle = NULL;
    rc = ncclCommRegister(C(0xc1a), P(0xb0f), 65536, &handle);
    printf("ncclCommRegister rc=%d handle=%p\n", rc, handle);
    printf("ncclCommDeregister rc=%d\n", ncclCommDeregister(C(0xc1b), P(0x4a)));
    int op = -1;
    rc = ncclRedOpCreatePreMulSum(&op, P(0x5ca), 9, 1, C(0xc1c));
    printf("ncclRedOpCreatePreMulSum rc=%d op=%d\n", rc, op);
    printf("ncclRedOpDestroy rc=%d\n", ncclRedOpDestroy(5, C(0xc1d)));
    printf("ncclGroupStart rc=%d\n", ncclGroupStart());
    printf("ncclReduce rc=%d\n", ncclReduce(P(0x101), P(0x102), 103, 2, 2, 1, C(0xc1e), P(0x5e1)));
    printf("ncclBcast rc=%d\n", ncclBcast(P(0x111), 113, 3, 2, C(0xc1f), P(0x5e2)));
    printf("ncclBroadcast rc=%d\n", ncclBroadcast(P(0x121), P(0x122), 123, 4, 3, C(0xc20), P(0x5e3)));
    printf("ncclAllReduce rc=%d\n", ncclAllReduce(P(0x131), P(0x132), 133, 9, 0, C(0xc21), P(0x5e4)));
    printf("pncclAllReduce rc=%d\n", pncclAllReduce(P(0x135), P(0x136), 137, 7, 4, C(0xc21), P(0x5e4)));
    printf("ncclReduceScatter rc=%d\n", ncclReduceScatter(P(0x141), P(0x142), 143, 6, 3, C(0xc22), P(0x5e5)));
    printf("ncclAllGather rc=%d\n", ncclAllGather(P(0x151), P(0x152), 153, 8, C(0xc23), P(0x5e6)));
    printf("ncclAlltoAll rc=%d\n", ncclAlltoAll(P(0x161), P(0x162), 163, 10, C(0xc24), P(0x5e7)));
    printf("ncclGather rc=%d\n", ncclGather(P(0x171), P(0x172), 173, 11, 1, C(0xc25), P(0x5e8)));
    printf("ncclScatter rc=%d\n", ncclScatter(P(0x181), P(0x182), 183, 0, 2, C(0xc26), P(0x5e9)));
    printf("ncclSend rc=%d\n", ncclSend(P(0x191), 193, 1, 3, C(0xc27), P(0x5ea)));
    printf("pncclSend rc=%d\n", pncclSend(P(0x195), 197, 1, 2, C(0xc27), P(0x5ea)));
    printf("ncclRecv rc=%d\n", ncclRecv(P(0x1a2), 419, 5, 3, C(0xc28), P(0x5eb)));
    printf("ncclGroupEnd rc=%d\n", ncclGroupEnd());
    printf("pncclGroupStart rc=%d\n", pncclGroupStart());
    printf("ncclGroupSimulateEnd rc=%d\n", ncclGroupSimulateEnd(P(0x51)));
    printf("ncclAllGather rc=%d\n", ncclAllGather(P(0x1b1), P(0x1b2), 13, 7, C(0xc29), P(0x5ec)));
    last("ncclAllGather");
    void* win = NULL;
    rc = ncclCommWindowRegister(C(0xc2a), P(0x1000), 8192, &win, 1);
    printf("ncclCommWindowRegister rc=%d win=%p\n", rc, win);
    last("ncclCommWindowRegister");
    printf("ncclGetErrorString(4): %s\n", ncclGetErrorString(4));
    last("ncclGetErrorString");
    printf("ncclCommWindowDeregister rc=%d\n", ncclCommWindowDeregister(C(0xc2b), P(0x3b)));
    rc = ncclCommCount(C(0xc2c), &n);
    printf("ncclCommCount rc=%d count=%d\n", rc, n);
    last("ncclCommCount");
    printf("calls at end: %llu\n", anyccl_nccl_dropin_calls());
    return 0;
}
