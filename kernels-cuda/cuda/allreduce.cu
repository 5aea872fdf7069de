// anyccl custom all-reduce kernels: one-shot and two-shot over peer-mapped buffers (IPC, or N buffer sets on one
// GPU when ranks are emulated). One source for every dtype (f32, f16, bf16; accumulation in f32).
//
// Synchronisation: every block of every rank owns a 32-bit epoch counter in its own flag array. A barrier
// increments the block's epoch, stores it (release, system scope) into slot [block][rank] of every peer's flag
// array, then waits (acquire, system scope) until its own slots [block][peer] reach the epoch. 32-bit flags, no
// byte flags, no relaxed-only waits. The epoch lives in device memory, so graph replays keep counting.
//
// Inputs are 16-byte vectors; callers guarantee byte counts that are multiples of 16 and 16-byte aligned buffers.
//
// Stopping: a barrier whose peer died would wait forever, and a kernel that never ends keeps every later
// cuMemFree of the process waiting too. Each rank's flag array ends with an abort word that the host sets (from
// another stream, cuStreamWriteValue32) when its wait gives up on a peer; a wait that has spun ANYCCL_ABORT_CHECK
// times without its peer looks at it every ANYCCL_ABORT_CHECK spins, and stops waiting once it is set. The kernel
// then runs to its end on whatever the peers' memory holds: its results are garbage, which the caller already
// knows, and the process keeps a usable GPU.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define ANYCCL_MAX_RANKS 8
#define ANYCCL_MAX_BLOCKS 128
// A rank's flag array: [ANYCCL_MAX_BLOCKS][ANYCCL_MAX_RANKS] barrier slots, [ANYCCL_MAX_BLOCKS] epoch counters,
// [ANYCCL_MAX_BLOCKS] arrival counters of the multicast barrier, then the abort word (FLAG_BYTES in lib.rs).
#define ANYCCL_MC_ARRIVALS (ANYCCL_MAX_BLOCKS * ANYCCL_MAX_RANKS + ANYCCL_MAX_BLOCKS)
#define ANYCCL_ABORT_WORD (ANYCCL_MC_ARRIVALS + ANYCCL_MAX_BLOCKS)
#define ANYCCL_ABORT_CHECK 1024

struct RankPtrs {
    const void* p[ANYCCL_MAX_RANKS];
};

struct FlagPtrs {
    // Each rank's flag array: [ANYCCL_MAX_BLOCKS][ANYCCL_MAX_RANKS] slots, then [ANYCCL_MAX_BLOCKS] epoch counters.
    uint32_t* p[ANYCCL_MAX_RANKS];
};

// Entry `i` of a pointer table held in kernel parameters, selected over constant indices instead of indexed with a
// run-time value, which makes the compiler copy the table to local memory. It kept the emulated zero-copy kernel
// free of local memory; the others still use some (cuobjdump -res-usage shows STACK per kernel).
template <typename P>
__device__ __forceinline__ auto pick(const P& table, int i) -> decltype(table.p[0]) {
    auto v = table.p[0];
#pragma unroll
    for (int r = 1; r < ANYCCL_MAX_RANKS; r++)
        if (r == i) v = table.p[r];
    return v;
}

__device__ __forceinline__ void st_release(uint32_t* addr, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* addr) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// Whether the host has told this rank's kernels to stop waiting (see "Stopping" above).
__device__ __forceinline__ bool aborted(const uint32_t* my_flags) {
    return *reinterpret_cast<const volatile uint32_t*>(my_flags + ANYCCL_ABORT_WORD) != 0;
}

// Spins until the 32-bit counter at `addr` reaches `target` (wrapping compare: counters only grow, and a peer may
// already be ahead), or until this rank's abort word is set.
__device__ __forceinline__ void wait_reach(const uint32_t* addr, uint32_t target, const uint32_t* my_flags) {
    for (uint32_t spins = 1; (int32_t)(ld_acquire(addr) - target) < 0; spins++) {
        if (spins % ANYCCL_ABORT_CHECK == 0 && aborted(my_flags)) return;
    }
}

// All threads of the block call it. Returns after every peer's same block reached the same barrier.
__device__ __forceinline__ void barrier(const FlagPtrs& flags, int rank, int world, uint32_t epoch) {
    __syncthreads();
    const int b = blockIdx.x;
    if (threadIdx.x < world) {
        const int peer = threadIdx.x;
        st_release(pick(flags, peer) + b * ANYCCL_MAX_RANKS + rank, epoch);
        const uint32_t* my_flags = pick(flags, rank);
        wait_reach(my_flags + b * ANYCCL_MAX_RANKS + peer, epoch, my_flags);
    }
    __syncthreads();
}

// Reserves `steps` barrier epochs for this block of this rank; returns the epoch before the first. `my_flags` is
// this rank's own flag array.
__device__ __forceinline__ uint32_t next_epoch(uint32_t* my_flags, uint32_t steps) {
    __shared__ uint32_t base;
    uint32_t* counter = my_flags + ANYCCL_MAX_BLOCKS * ANYCCL_MAX_RANKS + blockIdx.x;
    if (threadIdx.x == 0) {
        base = *counter;
        *counter = base + steps;
    }
    __syncthreads();
    return base;
}

// Copies vectors [s, e) from `src` to `dst`: thread `t` of `width` threads takes every width-th vector, four
// loads in flight before their stores.
__device__ __forceinline__ void copy_vecs(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t s, size_t e,
                                          int t, int width) {
    size_t i = s + t;
    for (; i + 3 * (size_t)width < e; i += 4 * (size_t)width) {
        const uint4 a = src[i], b = src[i + width], c = src[i + 2 * width], d = src[i + 3 * width];
        dst[i] = a;
        dst[i + width] = b;
        dst[i + 2 * width] = c;
        dst[i + 3 * width] = d;
    }
    for (; i < e; i += width) dst[i] = src[i];
}

// Each element type: its conversions to and from the f32 accumulator, one element at a time (f16 and bf16 to f32
// are exact; back to the element type rounds to nearest even, as the paired intrinsics do).
template <typename T> struct Elem;
template <> struct Elem<float> {
    __device__ static float get(float v) { return v; }
    __device__ static float put(float f) { return f; }
};
template <> struct Elem<__half> {
    __device__ static float get(__half v) { return __half2float(v); }
    __device__ static __half put(float f) { return __float2half_rn(f); }
};
template <> struct Elem<__nv_bfloat16> {
    __device__ static float get(__nv_bfloat16 v) { return __bfloat162float(v); }
    __device__ static __nv_bfloat16 put(float f) { return __float2bfloat16_rn(f); }
};

// A 16-byte vector of N elements, accumulated in f32.
template <typename T> struct Vec {
    static constexpr int N = 16 / sizeof(T);
    __device__ static void load(const uint4& v, float* a) {
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < N; i++) a[i] = Elem<T>::get(e[i]);
    }
    __device__ static void add(const uint4& v, float* a) {
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < N; i++) a[i] += Elem<T>::get(e[i]);
    }
    __device__ static uint4 store(const float* a) {
        uint4 v;
        T* e = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int i = 0; i < N; i++) e[i] = Elem<T>::put(a[i]);
        return v;
    }
};

// Sum of the peers' vector `i`, in rank order 0..W-1 (the same order on every rank: bitwise identical). W is a
// compile-time constant so the peer pointers stay in registers and all W loads are in flight before the adds.
template <typename T, int W>
__device__ __forceinline__ uint4 reduce_vec(const RankPtrs& in, size_t i) {
    uint4 v[W];
#pragma unroll
    for (int r = 0; r < W; r++) v[r] = reinterpret_cast<const uint4*>(in.p[r])[i];
    float acc[Vec<T>::N];
    Vec<T>::load(v[0], acc);
#pragma unroll
    for (int r = 1; r < W; r++) Vec<T>::add(v[r], acc);
    return Vec<T>::store(acc);
}

// Where a kernel reads the ranks' inputs: `in.p[r]` is rank r's peer-visible input as mapped here: the user's
// buffers themselves when they are registered, else every rank's staging buffer. With staging, `self_src` is this
// rank's own input, which the kernel first copies into its staging (the same blocks copy the elements the peers'
// same blocks will read, so the block's barrier orders the copy before those reads); null otherwise.
//
// Kernels launched inside a CUDA graph for an input first seen during capture take an InputTable in device memory
// instead: made with the staging pointers and `registered` 0, it is rewritten once the graph's inputs have been
// registered (after capture, before or between replays), and later replays read the user's buffers directly.
struct InputTable {
    RankPtrs p;
    uint64_t registered;
};

// One shot: every rank reads every peer's whole input.
template <typename T, int W>
__device__ __forceinline__ void one_shot(const RankPtrs& in, const void* self_src, void* out, const FlagPtrs& flags,
                                         int rank, size_t n_vec) {
    const uint32_t e = next_epoch(pick(flags, rank), 2);
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (self_src != nullptr)
        copy_vecs(reinterpret_cast<uint4*>(const_cast<void*>(pick(in, rank))),
                  reinterpret_cast<const uint4*>(self_src), 0, n_vec, (int)first, (int)stride);
    barrier(flags, rank, W, e + 1);
    uint4* o = reinterpret_cast<uint4*>(out);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_vec; i += (size_t)gridDim.x * blockDim.x)
        o[i] = reduce_vec<T, W>(in, i);
    // Nobody may overwrite its input (the next call) while a peer still reads it.
    barrier(flags, rank, W, e + 2);
}

// Two shot: rank r reduces chunk r into its scratch (peer-visible), then every rank gathers all chunks. The
// message is processed in rounds of `round_vecs` vectors (0: one round): per round, reduce, meet, gather. The
// scratch written in a round is read back by the peers while it is still in the owner's L2, instead of after the
// whole message went through. The writer and every reader of a scratch element are the same block index (the same
// offset pattern inside each rank's chunk), so per-block barriers suffice; scratch is indexed by absolute position,
// so a round's reductions never overwrite what a slower peer still gathers from an earlier round.
template <typename T, int W>
__device__ __forceinline__ void two_shot(const RankPtrs& in, const void* self_src, const RankPtrs& scratch, void* out,
                                         const FlagPtrs& flags, int rank, size_t n_vec, size_t round_vecs) {
    if (round_vecs == 0 || round_vecs > n_vec) round_vecs = n_vec > 0 ? n_vec : 1;
    const size_t rounds = (n_vec + round_vecs - 1) / round_vecs;
    const uint32_t e = next_epoch(pick(flags, rank), 2 + (uint32_t)rounds);
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (self_src != nullptr) {
        // Into staging, in the pattern the reductions below read it: chunk q of each round, from block-offset.
        uint4* stage = reinterpret_cast<uint4*>(const_cast<void*>(pick(in, rank)));
        for (size_t k = 0; k < rounds; k++) {
            const size_t r0 = k * round_vecs;
            const size_t r1 = min(n_vec, r0 + round_vecs);
            const size_t chunk = (r1 - r0 + W - 1) / W;
            for (int q = 0; q < W; q++) {
                const size_t qs = r0 + chunk * q;
                copy_vecs(stage, reinterpret_cast<const uint4*>(self_src), qs, min(r1, qs + chunk), (int)first,
                          (int)stride);
            }
        }
    }
    barrier(flags, rank, W, e + 1);
    uint4* mine = reinterpret_cast<uint4*>(const_cast<void*>(pick(scratch, rank)));
    uint4* o = reinterpret_cast<uint4*>(out);
    for (size_t k = 0; k < rounds; k++) {
        const size_t r0 = k * round_vecs;
        const size_t r1 = min(n_vec, r0 + round_vecs);
        const size_t chunk = (r1 - r0 + W - 1) / W;
        const size_t start = r0 + chunk * rank;
        const size_t end = min(r1, start + chunk);
        for (size_t i = start + first; i < end; i += stride) mine[i] = reduce_vec<T, W>(in, i);
        barrier(flags, rank, W, e + 2 + (uint32_t)k);
        // Gather: offset j of up to four ranks' chunks at once, so four loads are in flight before the stores
        // (all W at once would not fit the 64 registers that keep two blocks per SM).
        for (size_t j = first; j < chunk; j += stride) {
#pragma unroll
            for (int q0 = 0; q0 < W; q0 += 4) {
                uint4 v[4];
#pragma unroll
                for (int d = 0; d < 4 && q0 + d < W; d++) {
                    const size_t i = r0 + chunk * (q0 + d) + j;
                    if (i < r1) v[d] = reinterpret_cast<const uint4*>(scratch.p[q0 + d])[i];
                }
#pragma unroll
                for (int d = 0; d < 4 && q0 + d < W; d++) {
                    const size_t i = r0 + chunk * (q0 + d) + j;
                    if (i < r1) o[i] = v[d];
                }
            }
        }
    }
    // Nobody may overwrite its input or scratch (the next call) while a peer still reads them.
    barrier(flags, rank, W, e + 2 + (uint32_t)rounds);
}

// ---------------------------------------------------------------------------------------------------------------
// NVLS: the switch-channel primitive and the variants written over it.
//
// A channel binds two buffers of every rank: `in` (reduce-load reads it across all ranks) and `out`
// (broadcast-store writes one vector to all ranks), plus a signal/wait barrier among the ranks' same blocks. Two
// implementations, one interface:
//   MulticastChannel: multimem.ld_reduce / multimem.st on multicast addresses (sm_90+, NVLink SHARP); its barrier
//     adds 1 to every rank's arrival counter with one multimem.red (release) and waits (acquire) until its own
//     counter has W arrivals per epoch.
//   UnicastChannel: emulates them with loads and stores through every rank's own pointer, and the per-peer flag
//     barrier above, so the variants' partitioning, pipelining and barriers run (and are tested) where multicast
//     cannot be used.
// Every channel also exposes this rank's own flag array, whose epoch counters order the barriers.

struct UnicastChannel {
    RankPtrs in;
    RankPtrs out;
    FlagPtrs flags;
    int rank;
};

struct MulticastChannel {
    const void* in;
    void* out;
    // The multicast address of the ranks' flag arrays, and this rank's own flag array (unicast).
    uint32_t* flags_mc;
    uint32_t* my_flags;
};

template <typename T, int W>
__device__ __forceinline__ uint4 ch_reduce(const UnicastChannel& c, size_t i) {
    return reduce_vec<T, W>(c.in, i);
}

template <int W>
__device__ __forceinline__ void ch_store(const UnicastChannel& c, size_t i, uint4 v) {
#pragma unroll
    for (int r = 0; r < W; r++) reinterpret_cast<uint4*>(const_cast<void*>(c.out.p[r]))[i] = v;
}

template <int W>
__device__ __forceinline__ void ch_barrier(const UnicastChannel& c, uint32_t epoch) {
    barrier(c.flags, c.rank, W, epoch);
}

__device__ __forceinline__ uint32_t* ch_my_flags(const UnicastChannel& c) { return pick(c.flags, c.rank); }

// multimem.ld_reduce of one 16-byte vector per element type; TYPE is the instruction's type suffix (f16 and bf16
// accumulate in f32, like the other kernels).
template <typename T> struct Multimem;
#if __CUDA_ARCH__ >= 900
#define ANYCCL_LD_REDUCE(T, TYPE)                                                                                    \
    template <> struct Multimem<T> {                                                                                 \
        __device__ static uint4 ld_reduce(const void* a) {                                                           \
            uint4 v;                                                                                                 \
            asm volatile("multimem.ld_reduce.relaxed.sys.global.add." TYPE " {%0,%1,%2,%3}, [%4];"                   \
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");                          \
            return v;                                                                                                \
        }                                                                                                            \
    };
#else
#define ANYCCL_LD_REDUCE(T, TYPE)                                                                                    \
    template <> struct Multimem<T> {                                                                                 \
        __device__ static uint4 ld_reduce(const void*) {                                                             \
            __trap();                                                                                                \
            return make_uint4(0, 0, 0, 0);                                                                           \
        }                                                                                                            \
    };
#endif
ANYCCL_LD_REDUCE(float, "v4.f32")
ANYCCL_LD_REDUCE(__half, "acc::f32.v4.f16x2")
ANYCCL_LD_REDUCE(__nv_bfloat16, "acc::f32.v4.bf16x2")

template <typename T, int W>
__device__ __forceinline__ uint4 ch_reduce(const MulticastChannel& c, size_t i) {
    return Multimem<T>::ld_reduce(reinterpret_cast<const uint4*>(c.in) + i);
}

template <int W>
__device__ __forceinline__ void ch_store(const MulticastChannel& c, size_t i, uint4 v) {
#if __CUDA_ARCH__ >= 900
    uint4* a = reinterpret_cast<uint4*>(c.out) + i;
    asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
                 ::"l"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    __trap();
#endif
}

template <int W>
__device__ __forceinline__ void ch_barrier(const MulticastChannel& c, uint32_t epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
#if __CUDA_ARCH__ >= 900
        uint32_t* arrivals = c.flags_mc + ANYCCL_MC_ARRIVALS + blockIdx.x;
        asm volatile("multimem.red.release.sys.global.add.u32 [%0], 1;" ::"l"(arrivals) : "memory");
        // Every rank adds 1 per epoch, so epoch e is complete at e × W arrivals (wrapping like the epochs).
        wait_reach(c.my_flags + ANYCCL_MC_ARRIVALS + blockIdx.x, epoch * (uint32_t)W, c.my_flags);
#else
        __trap();
#endif
    }
    __syncthreads();
}

__device__ __forceinline__ uint32_t* ch_my_flags(const MulticastChannel& c) { return c.my_flags; }

// Zero-copy: the user's input and output buffers themselves are bound to the channel. Rank r reduce-loads its
// 1/W of the message and broadcast-stores the result into every rank's output.
template <typename T, int W, typename Ch>
__device__ __forceinline__ void nvls_zero_copy(const Ch& ch, int rank, size_t n_vec) {
    const uint32_t e = next_epoch(ch_my_flags(ch), 2);
    ch_barrier<W>(ch, e + 1);
    const size_t chunk = (n_vec + W - 1) / W;
    const size_t start = chunk * rank;
    const size_t end = min(n_vec, start + chunk);
    for (size_t i = start + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < end; i += (size_t)gridDim.x * blockDim.x)
        ch_store<W>(ch, i, ch_reduce<T, W>(ch, i));
    ch_barrier<W>(ch, e + 2);
}

// The staged variants move the message through channel-bound staging buffers (`ch.in`: staging-in, `ch.out`:
// staging-out, each at least the message) in tiles; tile t belongs to block t mod gridDim.x on every rank, and
// within a tile rank r reduce-loads and broadcast-stores part r of W. Staging is indexed by absolute position.

// How many of `tiles` tiles this block owns (tile t belongs to block t mod gridDim.x).
__device__ __forceinline__ size_t block_tiles(size_t tiles) {
    return tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
}

// Block pipeline: a block runs its tiles one after another, all its threads on each phase: copy its rank's input
// tile into staging-in, meet the peers' same block, reduce-load part r and broadcast-store it into every rank's
// staging-out, meet again, copy the output tile out. Blocks work on different tiles independently, so copies and
// reductions overlap across blocks.
#define ANYCCL_TILE_VECS 4096
template <typename T, int W, typename Ch>
__device__ __forceinline__ void nvls_block_pipeline(const void* in, void* out, void* my_stage_in, const void* my_stage_out,
                                    const Ch& ch, int rank, size_t n_vec) {
    const size_t tiles = (n_vec + ANYCCL_TILE_VECS - 1) / ANYCCL_TILE_VECS;
    const size_t my_tiles = block_tiles(tiles);
    uint32_t e = next_epoch(ch_my_flags(ch), 2 * (uint32_t)my_tiles + 1);
    for (size_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const size_t ts = t * ANYCCL_TILE_VECS;
        const size_t te = min(n_vec, ts + ANYCCL_TILE_VECS);
        copy_vecs(reinterpret_cast<uint4*>(my_stage_in), reinterpret_cast<const uint4*>(in), ts, te, threadIdx.x,
                  blockDim.x);
        ch_barrier<W>(ch, ++e);
        const size_t part = (te - ts + W - 1) / W;
        const size_t ps = ts + part * rank;
        const size_t pe = min(te, ps + part);
        for (size_t i = ps + threadIdx.x; i < pe; i += blockDim.x) ch_store<W>(ch, i, ch_reduce<T, W>(ch, i));
        ch_barrier<W>(ch, ++e);
        copy_vecs(reinterpret_cast<uint4*>(out), reinterpret_cast<const uint4*>(my_stage_out), ts, te, threadIdx.x,
                  blockDim.x);
    }
    // Every block ends with one more meeting, so no rank starts the next call's copies into a staging tile a
    // slower peer is still reading.
    ch_barrier<W>(ch, ++e);
}

// Warp pipeline: the warps of a block split into three groups that work on consecutive tiles at once. At step s,
// the copy-in warps stage the block's tile s, the reduce warps reduce-load and broadcast-store part r of tile s-1,
// and the copy-out warps copy tile s-2 out of staging-out; then the block meets its peers' same block once. That
// one meeting says both "tile s is staged on every rank" (so step s+1 may reduce it) and "tile s-1 is broadcast to
// every rank" (so step s+1 may copy it out). A block with k tiles runs k + 2 steps and meets k + 1 times: the last
// step only copies out, and the next call touches peers' memory only after its own first meeting, which a peer
// reaches only after it has finished this call.
#define ANYCCL_WP_TILE_VECS 8192
#define ANYCCL_WP_COPY_IN_WARPS 4
#define ANYCCL_WP_REDUCE_WARPS 8
template <typename T, int W, typename Ch>
__device__ __forceinline__ void nvls_warp_pipeline(const void* in, void* out, void* my_stage_in, const void* my_stage_out,
                                   const Ch& ch, int rank, size_t n_vec) {
    const size_t tiles = (n_vec + ANYCCL_WP_TILE_VECS - 1) / ANYCCL_WP_TILE_VECS;
    const size_t my_tiles = block_tiles(tiles);
    uint32_t e = next_epoch(ch_my_flags(ch), (uint32_t)my_tiles + 1);
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    // Group of this warp: 0 copies in, 1 reduces, 2 copies out; `lane0` and `width` place the thread in its group.
    const int reduce_first = ANYCCL_WP_COPY_IN_WARPS;
    const int out_first = ANYCCL_WP_COPY_IN_WARPS + ANYCCL_WP_REDUCE_WARPS;
    const int group = warp < reduce_first ? 0 : (warp < out_first ? 1 : 2);
    const int lane0 = group == 0 ? 0 : (group == 1 ? reduce_first : out_first) * 32;
    const int width = (group == 0 ? reduce_first : (group == 1 ? ANYCCL_WP_REDUCE_WARPS : warps - out_first)) * 32;
    const int t_in_group = threadIdx.x - lane0;
    for (size_t s = 0; s < my_tiles + 2; s++) {
        // The tile this thread's group works on at step s (group g lags g steps behind copy-in).
        if (s >= (size_t)group && s - group < my_tiles && width > 0) {
            const size_t t = blockIdx.x + (s - group) * gridDim.x;
            const size_t ts = t * ANYCCL_WP_TILE_VECS;
            const size_t te = min(n_vec, ts + ANYCCL_WP_TILE_VECS);
            if (group == 0) {
                copy_vecs(reinterpret_cast<uint4*>(my_stage_in), reinterpret_cast<const uint4*>(in), ts, te,
                          t_in_group, width);
            } else if (group == 1) {
                const size_t part = (te - ts + W - 1) / W;
                const size_t ps = ts + part * rank;
                const size_t pe = min(te, ps + part);
                for (size_t i = ps + t_in_group; i < pe; i += width) ch_store<W>(ch, i, ch_reduce<T, W>(ch, i));
            } else {
                copy_vecs(reinterpret_cast<uint4*>(out), reinterpret_cast<const uint4*>(my_stage_out), ts, te,
                          t_in_group, width);
            }
        }
        if (s <= my_tiles) ch_barrier<W>(ch, ++e);
    }
}

#define ANYCCL_DISPATCH(FN, T, ...)                                                                                  \
    switch (world) {                                                                                                 \
        case 2: FN<T, 2>(__VA_ARGS__); break;                                                                        \
        case 3: FN<T, 3>(__VA_ARGS__); break;                                                                        \
        case 4: FN<T, 4>(__VA_ARGS__); break;                                                                        \
        case 5: FN<T, 5>(__VA_ARGS__); break;                                                                        \
        case 6: FN<T, 6>(__VA_ARGS__); break;                                                                        \
        case 7: FN<T, 7>(__VA_ARGS__); break;                                                                        \
        case 8: FN<T, 8>(__VA_ARGS__); break;                                                                        \
        default: break;                                                                                              \
    }

#define ANYCCL_KERNELS(NAME, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_one_shot_##NAME(                                     \
        RankPtrs in, const void* self_src, void* out, FlagPtrs flags, int rank, int world, size_t n_vec) {          \
        ANYCCL_DISPATCH(one_shot, T, in, self_src, out, flags, rank, n_vec)                                          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_one_shot_table_##NAME(                               \
        const InputTable* table, const void* self_src, void* out, FlagPtrs flags, int rank, int world,              \
        size_t n_vec) {                                                                                              \
        const InputTable t = *table;                                                                                 \
        const void* src = t.registered ? nullptr : self_src;                                                         \
        ANYCCL_DISPATCH(one_shot, T, t.p, src, out, flags, rank, n_vec)                                              \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_two_shot_##NAME(                                     \
        RankPtrs in, const void* self_src, RankPtrs scratch, void* out, size_t round_vecs, FlagPtrs flags, int rank, \
        int world, size_t n_vec) {                                                                                   \
        ANYCCL_DISPATCH(two_shot, T, in, self_src, scratch, out, flags, rank, n_vec, round_vecs)                     \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_two_shot_table_##NAME(                               \
        const InputTable* table, const void* self_src, RankPtrs scratch, void* out, size_t round_vecs,              \
        FlagPtrs flags, int rank, int world, size_t n_vec) {                                                         \
        const InputTable t = *table;                                                                                 \
        const void* src = t.registered ? nullptr : self_src;                                                         \
        ANYCCL_DISPATCH(two_shot, T, t.p, src, scratch, out, flags, rank, n_vec, round_vecs)                         \
    }

ANYCCL_KERNELS(f32, float)
ANYCCL_KERNELS(f16, __half)
ANYCCL_KERNELS(bf16, __nv_bfloat16)

// NVLS kernels: `_emu` over the unicast channel (every rank's pointers and flag arrays), `_mc` over the multicast
// channel (sm_90+ only; multicast addresses of the bound buffers and of the flag arrays). Every kernel ends with
// (FlagPtrs flags, int rank, int world, size_t n_vec); the `_mc` kernels use only `flags.p[rank]` of it.
#define ANYCCL_NVLS_STAGED(VARIANT, NAME, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_nvls_##VARIANT##_emu_##NAME(                         \
        const void* in, void* out, RankPtrs stage_in, RankPtrs stage_out, FlagPtrs flags, int rank, int world,      \
        size_t n_vec) {                                                                                              \
        UnicastChannel ch{stage_in, stage_out, flags, rank};                                                         \
        ANYCCL_DISPATCH(nvls_##VARIANT, T, in, out, const_cast<void*>(pick(stage_in, rank)), pick(stage_out, rank), ch,     \
                        rank, n_vec)                                                                                 \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_nvls_##VARIANT##_mc_##NAME(                          \
        const void* in, void* out, void* my_stage_in, const void* my_stage_out, const void* stage_in_mc,            \
        void* stage_out_mc, uint32_t* flags_mc, FlagPtrs flags, int rank, int world, size_t n_vec) {                \
        MulticastChannel ch{stage_in_mc, stage_out_mc, flags_mc, pick(flags, rank)};                                     \
        ANYCCL_DISPATCH(nvls_##VARIANT, T, in, out, my_stage_in, my_stage_out, ch, rank, n_vec)                      \
    }

#define ANYCCL_NVLS_KERNELS(NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_nvls_zero_copy_emu_##NAME(                           \
        RankPtrs in, RankPtrs out, FlagPtrs flags, int rank, int world, size_t n_vec) {                              \
        UnicastChannel ch{in, out, flags, rank};                                                                     \
        ANYCCL_DISPATCH(nvls_zero_copy, T, ch, rank, n_vec)                                                          \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512, 2) anyccl_nvls_zero_copy_mc_##NAME(                            \
        const void* in_mc, void* out_mc, uint32_t* flags_mc, FlagPtrs flags, int rank, int world, size_t n_vec) {   \
        MulticastChannel ch{in_mc, out_mc, flags_mc, pick(flags, rank)};                                                 \
        ANYCCL_DISPATCH(nvls_zero_copy, T, ch, rank, n_vec)                                                          \
    }                                                                                                                \
    ANYCCL_NVLS_STAGED(block_pipeline, NAME, T)                                                                      \
    ANYCCL_NVLS_STAGED(warp_pipeline, NAME, T)

ANYCCL_NVLS_KERNELS(f32, float)
ANYCCL_NVLS_KERNELS(f16, __half)
ANYCCL_NVLS_KERNELS(bf16, __nv_bfloat16)
