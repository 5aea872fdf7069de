/* A fake RCCL whose collectives compute on host memory (the fake HIP runtime's "device" memory), for tests. It
 * is built per release by testkit/src/fake_ccl.rs (build_computing), which defines FAKE_VERSION and one HAVE_<symbol> per
 * optional symbol the release exports, and links it against the fake HIP runtime, as the real RCCL links
 * libamdhip64.
 *
 * Ranks of one communicator live in one process (ncclCommInitAll, or ncclCommInitRank with a shared id). Every
 * collective is a stream-ordered "kernel" handed to the fake HIP runtime, so it runs at once or is captured into
 * a graph and runs at replay. When it runs, a rank posts its part; the rank that completes a step (the n-th
 * collective executed on every rank) computes it for all, and the others wait for it, as a device waits for
 * its peers; so ranks are driven from one thread each, as with the real library. A send is posted and returns
 * (each ordered pair of ranks has a queue, so a rank may post several sends before its peer receives); the
 * matching receive copies and returns, and receives match sends in order. Calls between ncclGroupStart and
 * ncclGroupEnd (per thread, nestable) are deferred to the outermost ncclGroupEnd, which posts the group's sends
 * first and then its other calls in order, as NCCL runs a group as one: a rank whose group is [recv, send] does
 * not deadlock. A call refused inside a group makes ncclGroupEnd discard the group and return that error; an
 * ncclGroupEnd without a matching ncclGroupStart is refused and recorded as a violation. ncclCommSplit (for
 * releases that export it) is collective over the parent: ranks with the same color form a new communicator,
 * ranked by (key, parent rank); color -1 (NCCL_SPLIT_NOCOLOR) gets NULL. A rank that waits more than 20 s records a violation ("timed out")
 * instead of hanging the test. Window and buffer registration are not allowed during
 * capture (RCCL's registration allocates when cuMem is off); such calls are recorded as capture violations. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef int ncclResult_t;

int fakehip_enqueue(void* stream, void (*fn)(void*), const void* arg, size_t size);
int fakehip_any_capture(void);
void fakehip_add_violation(const char* call, const char* why);
int hipMalloc(void** p, size_t n);
int hipFree(void* p);
int hipGetDevice(int* d);

#define MAX_RANKS 16
#define SLOTS 64
/* Sends (and receives) one ordered pair of ranks may have pending at once. */
#define P2P_DEPTH 16
/* Calls one group may hold. */
#define MAX_GROUP 256

enum kind { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, SEND, RECV };
struct op {
    int kind;
    const void* send;
    void* recv;
    size_t count;
    int dtype, redop, root, peer;
    /* A send's copy of its data, taken when it runs on its stream: the send is then complete, as a real one is
     * once its data has left, and the caller may reuse or free its buffer before the peer receives. */
    void* staged;
};
struct clique {
    int n;
    uint64_t key;
    int joined;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct {
        int arrived;
        uint64_t generation;
        struct op ops[MAX_RANKS];
    } slot[SLOTS];
    uint64_t next_step[MAX_RANKS];
    /* point to point: a queue of pending sends and one of pending receives per ordered pair [src][dst] */
    struct {
        struct op send[P2P_DEPTH], recv[P2P_DEPTH];
        uint64_t send_head, send_tail, recv_head, recv_tail;
    } pq[MAX_RANKS][MAX_RANKS];
    /* ncclCommSplit: one round at a time */
    struct {
        int arrived;
        uint64_t generation;
        int color[MAX_RANKS], key[MAX_RANKS];
        void* out[MAX_RANKS];
    } split;
};
struct comm {
    struct clique* c;
    int rank;
    int device; /* ncclCommCuDevice: the device current at ncclCommInitRank, as NCCL's */
};

static pthread_mutex_t cliques_mu = PTHREAD_MUTEX_INITIALIZER;
static struct clique* cliques[64];
static uint64_t next_id = 1;

static struct clique* clique_for(uint64_t key, int n) {
    pthread_mutex_lock(&cliques_mu);
    struct clique* found = NULL;
    for (int i = 0; i < 64; i++)
        if (cliques[i] && cliques[i]->key == key && cliques[i]->joined < cliques[i]->n) found = cliques[i];
    if (!found) {
        found = calloc(1, sizeof *found);
        found->n = n;
        found->key = key;
        pthread_mutex_init(&found->mu, NULL);
        pthread_cond_init(&found->cv, NULL);
        for (int i = 0; i < 64; i++)
            if (!cliques[i]) {
                cliques[i] = found;
                break;
            }
    }
    found->joined++;
    pthread_mutex_unlock(&cliques_mu);
    return found;
}

static size_t dsize(int t) {
    switch (t) {
        case 0: case 1: case 10: case 11: return 1;
        case 2: case 3: case 7: return 4;
        case 4: case 5: case 8: return 8;
        case 6: case 9: return 2;
        default: return 0;
    }
}

static double bf16_get(const void* p, size_t i) {
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void bf16_set(void* p, size_t i, double v) {
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        ((uint16_t*)p)[i] = (uint16_t)((u >> 16) | 0x40);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
}

/* Element i of every input reduced into out[i]. Floating types accumulate in double; integers in 64-bit
 * unsigned arithmetic (wrapping, like the devices), compared as their own type for max/min. */
static void reduce_elem(int t, int op, int n, const void** in, size_t i, void* out, size_t oi) {
#define INT_CASE(T)                                                                                             \
    {                                                                                                           \
        T acc = ((const T*)in[0])[i];                                                                           \
        for (int r = 1; r < n; r++) {                                                                           \
            T v = ((const T*)in[r])[i];                                                                         \
            if (op == 0) acc = (T)((uint64_t)acc + (uint64_t)v);                                                \
            else if (op == 1) acc = (T)((uint64_t)acc * (uint64_t)v);                                           \
            else if (op == 2) acc = v > acc ? v : acc;                                                          \
            else if (op == 3) acc = v < acc ? v : acc;                                                          \
        }                                                                                                       \
        ((T*)out)[oi] = acc;                                                                                    \
        return;                                                                                                 \
    }
    switch (t) {
        case 0: INT_CASE(int8_t)
        case 1: INT_CASE(uint8_t)
        case 2: INT_CASE(int32_t)
        case 3: INT_CASE(uint32_t)
        case 4: INT_CASE(int64_t)
        case 5: INT_CASE(uint64_t)
        default: break;
    }
    double vals[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        switch (t) {
            case 6: vals[r] = (double)((const _Float16*)in[r])[i]; break;
            case 7: vals[r] = ((const float*)in[r])[i]; break;
            case 8: vals[r] = ((const double*)in[r])[i]; break;
            case 9: vals[r] = bf16_get(in[r], i); break;
        }
    }
    double acc = vals[0];
    for (int r = 1; r < n; r++) {
        if (op == 0 || op == 4) acc += vals[r];
        else if (op == 1) acc *= vals[r];
        else if (op == 2) acc = vals[r] > acc ? vals[r] : acc;
        else if (op == 3) acc = vals[r] < acc ? vals[r] : acc;
    }
    if (op == 4) acc /= n;
    switch (t) {
        case 6: ((_Float16*)out)[oi] = (_Float16)acc; break;
        case 7: ((float*)out)[oi] = (float)acc; break;
        case 8: ((double*)out)[oi] = acc; break;
        case 9: bf16_set(out, oi, acc); break;
    }
}

static void compute(struct clique* c, struct op* ops) {
    int n = c->n;
    struct op* o0 = &ops[0];
    size_t es = dsize(o0->dtype), count = o0->count;
    const void* in[MAX_RANKS];
    switch (o0->kind) {
        case ALL_REDUCE: {
            /* Inputs may alias outputs (in place): reduce into a scratch first. */
            void* tmp = malloc(count * es + 1);
            for (int r = 0; r < n; r++) in[r] = ops[r].send;
            for (size_t i = 0; i < count; i++) reduce_elem(o0->dtype, o0->redop, n, in, i, tmp, i);
            for (int r = 0; r < n; r++) memcpy(ops[r].recv, tmp, count * es);
            free(tmp);
            break;
        }
        case REDUCE: {
            int root = o0->root;
            void* tmp = malloc(count * es + 1);
            for (int r = 0; r < n; r++) in[r] = ops[r].send;
            for (size_t i = 0; i < count; i++) reduce_elem(o0->dtype, o0->redop, n, in, i, tmp, i);
            memcpy(ops[root].recv, tmp, count * es);
            free(tmp);
            break;
        }
        case ALL_GATHER: {
            void* tmp = malloc(n * count * es + 1);
            for (int r = 0; r < n; r++) memcpy((char*)tmp + r * count * es, ops[r].send, count * es);
            for (int r = 0; r < n; r++) memcpy(ops[r].recv, tmp, n * count * es);
            free(tmp);
            break;
        }
        case REDUCE_SCATTER: {
            void* tmp = malloc(n * count * es + 1);
            for (int r = 0; r < n; r++) in[r] = ops[r].send;
            for (size_t i = 0; i < n * count; i++) reduce_elem(o0->dtype, o0->redop, n, in, i, tmp, i);
            for (int r = 0; r < n; r++) memcpy(ops[r].recv, (char*)tmp + r * count * es, count * es);
            free(tmp);
            break;
        }
        case BROADCAST: {
            int root = o0->root;
            void* tmp = malloc(count * es + 1);
            memcpy(tmp, ops[root].send, count * es);
            for (int r = 0; r < n; r++) memcpy(ops[r].recv, tmp, count * es);
            free(tmp);
            break;
        }
    }
}

struct posted {
    struct comm* comm;
    struct op op;
};

#include <errno.h>
#include <time.h>

/* Waits on the clique's condition until `done()` holds; records a violation after 20 s. Called locked. */
static int wait_until(struct clique* c, int (*done)(struct clique*, const void*), const void* arg, const char* what) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 20;
    while (!done(c, arg)) {
        if (pthread_cond_timedwait(&c->cv, &c->mu, &deadline) == ETIMEDOUT) {
            fakehip_add_violation(what, "fake RCCL: timed out waiting for the other ranks");
            return 0;
        }
    }
    return 1;
}

struct gen_wait {
    int k;
    uint64_t gen;
};
static int step_done(struct clique* c, const void* a) {
    const struct gen_wait* w = a;
    return c->slot[w->k].generation != w->gen;
}
struct ticket {
    int s, d;
    uint64_t n;
};
static int recv_done(struct clique* c, const void* a) {
    const struct ticket* t = a;
    return c->pq[t->s][t->d].recv_head > t->n;
}

/* Matches the pending sends from s to d with the pending receives, in order. Called locked. */
static void try_match(struct clique* c, int s, int d) {
    int matched = 0;
    while (c->pq[s][d].send_head < c->pq[s][d].send_tail && c->pq[s][d].recv_head < c->pq[s][d].recv_tail) {
        struct op* snd = &c->pq[s][d].send[c->pq[s][d].send_head % P2P_DEPTH];
        struct op* rcv = &c->pq[s][d].recv[c->pq[s][d].recv_head % P2P_DEPTH];
        size_t sb = snd->count * dsize(snd->dtype), rb = rcv->count * dsize(rcv->dtype);
        if (sb != rb) fakehip_add_violation("ncclRecv", "fake RCCL: the matching send has another size");
        memcpy(rcv->recv, snd->staged, sb < rb ? sb : rb);
        free(snd->staged);
        c->pq[s][d].send_head++;
        c->pq[s][d].recv_head++;
        matched = 1;
    }
    if (matched) pthread_cond_broadcast(&c->cv);
}

static void post(void* arg) {
    struct posted* p = arg;
    struct clique* c = p->comm->c;
    int rank = p->comm->rank;
    pthread_mutex_lock(&c->mu);
    if (p->op.kind == SEND) {
        int peer = p->op.peer;
        if (c->pq[rank][peer].send_tail - c->pq[rank][peer].send_head == P2P_DEPTH) {
            fakehip_add_violation("ncclSend", "fake RCCL: too many sends pending to one peer");
        } else {
            struct op o = p->op;
            size_t bytes = o.count * dsize(o.dtype);
            o.staged = malloc(bytes + 1);
            memcpy(o.staged, o.send, bytes);
            c->pq[rank][peer].send[c->pq[rank][peer].send_tail++ % P2P_DEPTH] = o;
            try_match(c, rank, peer);
        }
    } else if (p->op.kind == RECV) {
        int peer = p->op.peer;
        if (c->pq[peer][rank].recv_tail - c->pq[peer][rank].recv_head == P2P_DEPTH) {
            fakehip_add_violation("ncclRecv", "fake RCCL: too many receives pending from one peer");
        } else {
            struct ticket t = {peer, rank, c->pq[peer][rank].recv_tail};
            c->pq[peer][rank].recv[c->pq[peer][rank].recv_tail++ % P2P_DEPTH] = p->op;
            try_match(c, peer, rank);
            wait_until(c, recv_done, &t, "ncclRecv");
        }
    } else {
        uint64_t step = c->next_step[rank]++;
        int k = (int)(step % SLOTS);
        c->slot[k].ops[rank] = p->op;
        if (++c->slot[k].arrived == c->n) {
            compute(c, c->slot[k].ops);
            c->slot[k].arrived = 0;
            c->slot[k].generation++;
            pthread_cond_broadcast(&c->cv);
        } else {
            struct gen_wait w = {k, c->slot[k].generation};
            wait_until(c, step_done, &w, "collective");
        }
    }
    pthread_mutex_unlock(&c->mu);
}

/* This thread's open group: its depth, the calls deferred to its end, and the first error refused inside it. */
struct deferred {
    void* stream;
    struct posted p;
};
static __thread int group_depth = 0;
static __thread int group_len = 0;
static __thread int group_error = 0;
static __thread struct deferred group_calls[MAX_GROUP];

/* The test's view of this thread's group depth (0: no group open). */
int fakerccl_group_depth(void) { return group_depth; }

static ncclResult_t submit(void* comm, int kind, const void* send, void* recv, size_t count, int dtype, int redop,
                           int root, int peer, void* stream) {
    struct comm* cm = comm;
    ncclResult_t refused = 0;
    if (!cm) refused = 4;
    else if (dsize(dtype) == 0 || dtype >= 10) refused = 4; /* fp8 is not computed by the fake */
    else if (redop < 0 || redop > 4) refused = 4;
    else if ((kind == SEND || kind == RECV) && (peer < 0 || peer >= cm->c->n || peer == cm->rank)) refused = 4;
    struct posted p = {cm, {kind, send, recv, count, dtype, redop, root, peer}};
    if (group_depth > 0) {
        if (!refused && group_len == MAX_GROUP) {
            fakehip_add_violation("ncclGroupStart", "fake RCCL: too many calls in one group");
            refused = 5;
        }
        if (refused) {
            if (!group_error) group_error = refused;
            return refused;
        }
        group_calls[group_len].stream = stream;
        group_calls[group_len].p = p;
        group_len++;
        return 0;
    }
    if (refused) return refused;
    return fakehip_enqueue(stream, post, &p, sizeof p) ? 1 : 0;
}

ncclResult_t ncclGroupStart(void) {
    group_depth++;
    return 0;
}

ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) {
        fakehip_add_violation("ncclGroupEnd", "fake RCCL: ncclGroupEnd without ncclGroupStart");
        return 5; /* ncclInvalidUsage */
    }
    if (--group_depth > 0) return 0;
    int n = group_len, err = group_error;
    group_len = 0;
    group_error = 0;
    if (err) return err; /* the group is discarded, as NCCL does after a call in it failed */
    ncclResult_t st = 0;
    /* Sends first, then everything else in order: every send is posted before any receive waits. */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            int is_send = group_calls[i].p.op.kind == SEND;
            if (is_send != (pass == 0)) continue;
            if (fakehip_enqueue(group_calls[i].stream, post, &group_calls[i].p, sizeof group_calls[i].p) && !st) st = 1;
        }
    return st;
}

ncclResult_t ncclGetVersion(int* v) { *v = FAKE_VERSION; return 0; }
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    memset(id->internal, 0, 128);
    id->internal[0] = 1;
    pthread_mutex_lock(&cliques_mu);
    uint64_t k = next_id++;
    pthread_mutex_unlock(&cliques_mu);
    memcpy(id->internal + 8, &k, 8);
    return 0;
}
ncclResult_t ncclCommInitRank(void** out, int n, ncclUniqueId id, int rank) {
    if (id.internal[0] != 1 || n < 1 || n > MAX_RANKS || rank < 0 || rank >= n) return 4;
    uint64_t key;
    memcpy(&key, id.internal + 8, 8);
    struct comm* c = calloc(1, sizeof *c);
    c->c = clique_for(key, n);
    c->rank = rank;
    if (hipGetDevice(&c->device) != 0) c->device = 0;
    *out = c;
    return 0;
}
ncclResult_t ncclCommInitAll(void** out, int n, const int* devs) {
    if (n < 1 || n > MAX_RANKS) return 4;
    pthread_mutex_lock(&cliques_mu);
    uint64_t key = next_id++ | (1ull << 63);
    pthread_mutex_unlock(&cliques_mu);
    for (int r = 0; r < n; r++) {
        struct comm* c = calloc(1, sizeof *c);
        c->c = clique_for(key, n);
        c->rank = r;
        c->device = devs ? devs[r] : r;
        out[r] = c;
    }
    return 0;
}
ncclResult_t ncclCommGetAsyncError(void* c, int* e);
/* As NCCL 2.28's does, destroy asks for the communicator's state through its own exported ncclCommGetAsyncError: a
   call that reaches a drop-in's same-named symbol unless the drop-in loads this library with its own binding first. */
ncclResult_t ncclCommDestroy(void* c) {
    int e = 0;
    ncclResult_t r = c ? ncclCommGetAsyncError(c, &e) : 0;
    if (r != 0) return r;
    free(c);
    return 0;
}
ncclResult_t ncclCommCount(void* c, int* n) { *n = ((struct comm*)c)->c->n; return 0; }
ncclResult_t ncclCommUserRank(void* c, int* r) { *r = ((struct comm*)c)->rank; return 0; }
ncclResult_t ncclCommCuDevice(void* c, int* d) {
    if (!c || !d) return 4;
    *d = ((struct comm*)c)->device;
    return 0;
}
/* An asynchronous error the tests inject (0: healthy), and the communicators aborted so far. */
static int async_error = 0;
static int aborted = 0;
void fakerccl_set_async_error(int e) { async_error = e; }
int fakerccl_aborted(void) { return aborted; }
ncclResult_t ncclCommGetAsyncError(void* c, int* e) { (void)c; *e = async_error; return 0; }
ncclResult_t ncclCommAbort(void* c) { free(c); aborted++; return 0; }
const char* ncclGetErrorString(int s) { return s == 4 ? "invalid argument (fake RCCL)" : s == 1 ? "unhandled cuda error (fake RCCL)" : "error (fake RCCL)"; }
const char* ncclGetLastError(void* c) { (void)c; return ""; }
ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* c, void* st) {
    return submit(c, ALL_REDUCE, s, r, n, t, op, 0, 0, st);
}
ncclResult_t ncclAllGather(const void* s, void* r, size_t n, int t, void* c, void* st) {
    return submit(c, ALL_GATHER, s, r, n, t, 0, 0, 0, st);
}
ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, void* c, void* st) {
    return submit(c, REDUCE_SCATTER, s, r, n, t, op, 0, 0, st);
}
ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* c, void* st) {
    return submit(c, BROADCAST, s, r, n, t, 0, root, 0, st);
}
ncclResult_t ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, void* c, void* st) {
    return submit(c, REDUCE, s, r, n, t, op, root, 0, st);
}
ncclResult_t ncclSend(const void* s, size_t n, int t, int peer, void* c, void* st) {
    return submit(c, SEND, s, NULL, n, t, 0, 0, peer, st);
}
ncclResult_t ncclRecv(void* r, size_t n, int t, int peer, void* c, void* st) {
    return submit(c, RECV, NULL, r, n, t, 0, 0, peer, st);
}

/* The per-call config of NCCL 2.31 (HAVE_ncclAllReduceConfig and its siblings, for releases from 2.31 on): the config
 * (ncclCollConfig_t) asks for an algorithm, CTAs or a profiler tag, none of which changes the result, so each runs
 * as its plain form. */
#ifdef HAVE_ncclAllReduceConfig
ncclResult_t ncclAllReduceConfig(const void* s, void* r, size_t n, int t, int op, void* c, void* st, const void* cfg) {
    (void)cfg;
    return submit(c, ALL_REDUCE, s, r, n, t, op, 0, 0, st);
}
#endif
#ifdef HAVE_ncclAllGatherConfig
ncclResult_t ncclAllGatherConfig(const void* s, void* r, size_t n, int t, void* c, void* st, const void* cfg) {
    (void)cfg;
    return submit(c, ALL_GATHER, s, r, n, t, 0, 0, 0, st);
}
#endif
#ifdef HAVE_ncclReduceScatterConfig
ncclResult_t ncclReduceScatterConfig(const void* s, void* r, size_t n, int t, int op, void* c, void* st,
                                     const void* cfg) {
    (void)cfg;
    return submit(c, REDUCE_SCATTER, s, r, n, t, op, 0, 0, st);
}
#endif
#ifdef HAVE_ncclBroadcastConfig
ncclResult_t ncclBroadcastConfig(const void* s, void* r, size_t n, int t, int root, void* c, void* st,
                                 const void* cfg) {
    (void)cfg;
    return submit(c, BROADCAST, s, r, n, t, 0, root, 0, st);
}
#endif
#ifdef HAVE_ncclReduceConfig
ncclResult_t ncclReduceConfig(const void* s, void* r, size_t n, int t, int op, int root, void* c, void* st,
                              const void* cfg) {
    (void)cfg;
    return submit(c, REDUCE, s, r, n, t, op, root, 0, st);
}
#endif

#ifdef HAVE_ncclMemAlloc
/* RCCL without cuMem falls back to hipMalloc, which capture rejects: the fake HIP records that. */
ncclResult_t ncclMemAlloc(void** p, size_t n) { return hipMalloc(p, n) ? 1 : 0; }
ncclResult_t ncclMemFree(void* p) { return hipFree(p) ? 1 : 0; }
#endif

static ncclResult_t registration(const char* call) {
    if (fakehip_any_capture()) {
        fakehip_add_violation(call, "registration during stream capture");
        return 1;
    }
    return 0;
}
#ifdef HAVE_ncclCommRegister
ncclResult_t ncclCommRegister(void* c, void* p, size_t n, void** h) {
    (void)c, (void)n;
    *h = p;
    return registration("ncclCommRegister");
}
ncclResult_t ncclCommDeregister(void* c, void* h) { (void)c, (void)h; return registration("ncclCommDeregister"); }
#endif
#ifdef HAVE_ncclCommWindowRegister
ncclResult_t ncclCommWindowRegister(void* c, void* p, size_t n, void** w, int flags) {
    (void)c, (void)n, (void)flags;
    *w = p;
    return registration("ncclCommWindowRegister");
}
ncclResult_t ncclCommWindowDeregister(void* c, void* w) { (void)c, (void)w; return registration("ncclCommWindowDeregister"); }
#endif

/* ncclCommSplit: collective over the parent. The last rank to arrive makes one new clique per color and hands each
 * member its communicator, ranked by (key, parent rank); the others wait for it. */
static int split_done(struct clique* c, const void* a) { return c->split.generation != *(const uint64_t*)a; }
static ncclResult_t fake_comm_split(void* comm, int color, int key, void** out, void* config) {
    struct comm* cm = comm;
    (void)config;
    if (!cm || !out || color < -1 || key < 0) return 4;
    if (group_depth > 0) fakehip_add_violation("ncclCommSplit", "fake RCCL: ncclCommSplit inside a group");
    struct clique* c = cm->c;
    pthread_mutex_lock(&c->mu);
    c->split.color[cm->rank] = color;
    c->split.key[cm->rank] = key;
    uint64_t gen = c->split.generation;
    if (++c->split.arrived == c->n) {
        for (int r = 0; r < c->n; r++) c->split.out[r] = NULL;
        for (int r = 0; r < c->n; r++) {
            int col = c->split.color[r];
            if (col < 0 || c->split.out[r]) continue;
            /* Members of this color in (key, parent rank) order: a selection sort over at most MAX_RANKS. */
            int members[MAX_RANKS], m = 0;
            for (int q = 0; q < c->n; q++)
                if (c->split.color[q] == col) members[m++] = q;
            for (int i = 0; i < m; i++)
                for (int j = i + 1; j < m; j++)
                    if (c->split.key[members[j]] < c->split.key[members[i]] ||
                        (c->split.key[members[j]] == c->split.key[members[i]] && members[j] < members[i])) {
                        int t = members[i];
                        members[i] = members[j];
                        members[j] = t;
                    }
            struct clique* nc = calloc(1, sizeof *nc);
            nc->n = m;
            nc->joined = m;
            pthread_mutex_init(&nc->mu, NULL);
            pthread_cond_init(&nc->cv, NULL);
            for (int i = 0; i < m; i++) {
                struct comm* sub = calloc(1, sizeof *sub);
                sub->c = nc;
                sub->rank = i;
                c->split.out[members[i]] = sub;
            }
        }
        c->split.arrived = 0;
        c->split.generation++;
        pthread_cond_broadcast(&c->cv);
    } else if (!wait_until(c, split_done, &gen, "ncclCommSplit")) {
        pthread_mutex_unlock(&c->mu);
        return 1;
    }
    *out = c->split.out[cm->rank];
    if (*out) ((struct comm*)*out)->device = cm->device;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

#ifdef HAVE_ncclCommSplit
ncclResult_t ncclCommSplit(void* c, int color, int key, void** out, void* config) {
    return fake_comm_split(c, color, key, out, config);
}
#endif
