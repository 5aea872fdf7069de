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
    show("ncclAllReduceConfig", ncclAllReduceConfig(P(0x301), P(0x302), 303, 7, 0, c, P(0x5f1), P(0xcc1)));
    show("ncclAllReduceConfig null", ncclAllReduceConfig(P(0x311), P(0x312), 313, 7, 0, c, P(0x5f2), NULL));
    show("ncclBroadcastConfig", ncclBroadcastConfig(P(0x321), P(0x322), 323, 7, 1, c, P(0x5f3), P(0xcc2)));
    show("pncclBroadcastConfig", pncclBroadcastConfig(P(0x331), P(0x332), 333, 7, 2, c, P(0x5f4), P(0xcc3)));
    n = -1;
    rc = ncclParamGetI32(P(0x9a), &n);
    printf("ncclParamGetI32 rc=%d value=%d\n", rc, n);
    ncclUniqueId id;
    show("ncclCommGetUniqueId", ncclCommGetUniqueId(c, &id));
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
    return 0;
}
