// anyccl custom all-reduce, written once for every vendor: one-shot and two-shot over peer-mapped buffers (IPC, or
// N buffer sets on one GPU when ranks are emulated), for f32, f16 and bf16 (accumulation in f32). nvcc compiles it
// for sm_80/sm_90/sm_100 (kernels-cuda/cuda/allreduce.cu), hipcc for gfx90a/gfx942 (kernels-hip/hip/allreduce.hip);
// each source includes its vendor header first.
//
// Vendor layer (vendor_cuda.h, vendor_hip.h): ANYCCL_LAUNCH_BOUNDS; the 16-byte vector type anyccl_vec16; the
// element storage types anyccl_f32/anyccl_f16/anyccl_bf16 with Elem<T>::get/put to and from f32;
// anyccl_st_release_sys and anyccl_ld_acquire_sys (release store and acquire load of a 32-bit flag at system
// scope); anyccl_ld_volatile (a load that reaches memory, for the abort word); anyccl_spin_pause (between polls);
// anyccl_min_size (the smaller of two sizes).
//
// Synchronisation: every block of every rank owns a 32-bit epoch counter in its own flag array. A barrier
// increments the block's epoch, stores it (release, system scope) into slot [block][rank] of every peer's flag
// array, then waits (acquire, system scope) until its own slots [block][peer] reach the epoch. 32-bit flags, no
// byte flags, no relaxed-only waits (relaxed start barriers over XGMI have shown torn reads on AMD GPUs). The epoch
// lives in device memory, so graph replays keep counting.
//
// Inputs are 16-byte vectors; callers guarantee byte counts that are multiples of 16 and 16-byte aligned buffers.
//
// Stopping: a barrier whose peer died would wait forever, and a kernel that never ends keeps every later free of
// the process waiting too. Each rank's flag array ends with an abort word that the host sets (from another stream:
// cuStreamWriteValue32, hipStreamWriteValue32) when its wait gives up on a peer; a wait that has spun
// ANYCCL_ABORT_CHECK times without its peer looks at it every ANYCCL_ABORT_CHECK spins, and stops waiting once it
// is set. The kernel then runs to its end on whatever the peers' memory holds: its results are garbage, which the
// caller already knows, and the process keeps a usable GPU.
//
// The layout constants below are mirrored in Rust by anyccl-kernels-common (src/lib.rs), whose test reads them
// from this file.

#pragma once

#define ANYCCL_MAX_RANKS 8
#define ANYCCL_MAX_BLOCKS 128
// A rank's flag array: [ANYCCL_MAX_BLOCKS][ANYCCL_MAX_RANKS] barrier slots, [ANYCCL_MAX_BLOCKS] epoch counters,
// [ANYCCL_MAX_BLOCKS] arrival counters of the multicast barrier (CUDA NVLS kernels), then the abort word, all
// 32-bit words (offsets in words).
#define ANYCCL_EPOCHS (ANYCCL_MAX_BLOCKS * ANYCCL_MAX_RANKS)
#define ANYCCL_MC_ARRIVALS (ANYCCL_EPOCHS + ANYCCL_MAX_BLOCKS)
#define ANYCCL_ABORT_WORD (ANYCCL_MC_ARRIVALS + ANYCCL_MAX_BLOCKS)
#define ANYCCL_ABORT_CHECK 1024

struct RankPtrs {
    const void* p[ANYCCL_MAX_RANKS];
};

struct FlagPtrs {
    // Each rank's flag array (layout above).
    uint32_t* p[ANYCCL_MAX_RANKS];
};

// Entry `i` of a pointer table held in kernel parameters, selected over constant indices instead of indexed with a
// run-time value, which makes the compiler copy the table to local memory. It kept the emulated zero-copy kernel
// free of local memory; the others still use some (cuobjdump -res-usage shows STACK per kernel).
template <typename P>
__device__ __forceinline__ auto pick(const P& table, int i) {
    auto v = table.p[0];
#pragma unroll
    for (int r = 1; r < ANYCCL_MAX_RANKS; r++)
        if (r == i) v = table.p[r];
    return v;
}

// Whether the host has told this rank's kernels to stop waiting (see "Stopping" above).
__device__ __forceinline__ bool aborted(const uint32_t* my_flags) {
    return anyccl_ld_volatile(my_flags + ANYCCL_ABORT_WORD) != 0;
}

// Spins until the 32-bit counter at `addr` reaches `target` (wrapping compare: counters only grow, and a peer may
// already be ahead), or until this rank's abort word is set.
__device__ __forceinline__ void wait_reach(const uint32_t* addr, uint32_t target, const uint32_t* my_flags) {
    for (uint32_t spins = 1; (int32_t)(anyccl_ld_acquire_sys(addr) - target) < 0; spins++) {
        if (spins % ANYCCL_ABORT_CHECK == 0 && aborted(my_flags)) return;
        anyccl_spin_pause();
    }
}

// All threads of the block call it. Returns after every peer's same block reached the same barrier.
__device__ __forceinline__ void barrier(const FlagPtrs& flags, int rank, int world, uint32_t epoch) {
    __syncthreads();
    const int b = blockIdx.x;
    if (threadIdx.x < (unsigned)world) {
        const int peer = threadIdx.x;
        anyccl_st_release_sys(pick(flags, peer) + b * ANYCCL_MAX_RANKS + rank, epoch);
        const uint32_t* my_flags = pick(flags, rank);
        wait_reach(my_flags + b * ANYCCL_MAX_RANKS + peer, epoch, my_flags);
    }
    __syncthreads();
}

// Reserves `steps` barrier epochs for this block of this rank; returns the epoch before the first. `my_flags` is
// this rank's own flag array.
__device__ __forceinline__ uint32_t next_epoch(uint32_t* my_flags, uint32_t steps) {
    __shared__ uint32_t base;
    uint32_t* counter = my_flags + ANYCCL_EPOCHS + blockIdx.x;
    if (threadIdx.x == 0) {
        base = *counter;
        *counter = base + steps;
    }
    __syncthreads();
    return base;
}

// Copies vectors [s, e) from `src` to `dst`: thread `t` of `width` threads takes every width-th vector, four
// loads in flight before their stores.
__device__ __forceinline__ void copy_vecs(anyccl_vec16* __restrict__ dst, const anyccl_vec16* __restrict__ src,
                                          size_t s, size_t e, int t, int width) {
    size_t i = s + t;
    for (; i + 3 * (size_t)width < e; i += 4 * (size_t)width) {
        const anyccl_vec16 a = src[i], b = src[i + width], c = src[i + 2 * width], d = src[i + 3 * width];
        dst[i] = a;
        dst[i + width] = b;
        dst[i + 2 * width] = c;
        dst[i + 3 * width] = d;
    }
    for (; i < e; i += width) dst[i] = src[i];
}

// A 16-byte vector of N elements of storage type T, accumulated in f32.
template <typename T> struct Vec {
    static constexpr int N = 16 / sizeof(T);
    __device__ static void load(const anyccl_vec16& v, float* a) {
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < N; i++) a[i] = Elem<T>::get(e[i]);
    }
    __device__ static void add(const anyccl_vec16& v, float* a) {
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < N; i++) a[i] += Elem<T>::get(e[i]);
    }
    __device__ static anyccl_vec16 store(const float* a) {
        anyccl_vec16 v;
        T* e = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int i = 0; i < N; i++) e[i] = Elem<T>::put(a[i]);
        return v;
    }
};

// Sum of the peers' vector `i`, in rank order 0..W-1 (the same order on every rank: bitwise identical). W is a
// compile-time constant so the peer pointers stay in registers and all W loads are in flight before the adds.
template <typename T, int W>
__device__ __forceinline__ anyccl_vec16 reduce_vec(const RankPtrs& in, size_t i) {
    anyccl_vec16 v[W];
#pragma unroll
    for (int r = 0; r < W; r++) v[r] = reinterpret_cast<const anyccl_vec16*>(in.p[r])[i];
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
// Kernels launched inside a graph for an input first seen during capture take an InputTable in device memory
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
        copy_vecs(reinterpret_cast<anyccl_vec16*>(const_cast<void*>(pick(in, rank))),
                  reinterpret_cast<const anyccl_vec16*>(self_src), 0, n_vec, (int)first, (int)stride);
    barrier(flags, rank, W, e + 1);
    anyccl_vec16* o = reinterpret_cast<anyccl_vec16*>(out);
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
        anyccl_vec16* stage = reinterpret_cast<anyccl_vec16*>(const_cast<void*>(pick(in, rank)));
        for (size_t k = 0; k < rounds; k++) {
            const size_t r0 = k * round_vecs;
            const size_t r1 = anyccl_min_size(n_vec, r0 + round_vecs);
            const size_t chunk = (r1 - r0 + W - 1) / W;
            for (int q = 0; q < W; q++) {
                const size_t qs = r0 + chunk * q;
                copy_vecs(stage, reinterpret_cast<const anyccl_vec16*>(self_src), qs, anyccl_min_size(r1, qs + chunk),
                          (int)first, (int)stride);
            }
        }
    }
    barrier(flags, rank, W, e + 1);
    anyccl_vec16* mine = reinterpret_cast<anyccl_vec16*>(const_cast<void*>(pick(scratch, rank)));
    anyccl_vec16* o = reinterpret_cast<anyccl_vec16*>(out);
    for (size_t k = 0; k < rounds; k++) {
        const size_t r0 = k * round_vecs;
        const size_t r1 = anyccl_min_size(n_vec, r0 + round_vecs);
        const size_t chunk = (r1 - r0 + W - 1) / W;
        const size_t start = r0 + chunk * rank;
        const size_t end = anyccl_min_size(r1, start + chunk);
        for (size_t i = start + first; i < end; i += stride) mine[i] = reduce_vec<T, W>(in, i);
        barrier(flags, rank, W, e + 2 + (uint32_t)k);
        // Gather: offset j of up to four ranks' chunks at once, so four loads are in flight before the stores
        // (all W at once would not fit the 64 registers that keep two blocks per SM).
        for (size_t j = first; j < chunk; j += stride) {
#pragma unroll
            for (int q0 = 0; q0 < W; q0 += 4) {
                anyccl_vec16 v[4];
#pragma unroll
                for (int d = 0; d < 4 && q0 + d < W; d++) {
                    const size_t i = r0 + chunk * (q0 + d) + j;
                    if (i < r1) v[d] = reinterpret_cast<const anyccl_vec16*>(scratch.p[q0 + d])[i];
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

// Calls FN<T, W> with W the run-time `world` (2..=ANYCCL_MAX_RANKS) as a compile-time constant; other worlds do
// nothing (the launcher refuses them).
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

// The one-shot and two-shot kernels of element type T (a storage type of the vendor layer), named by NAME; the
// names and parameters are what the launchers pass, the same on every vendor.
#define ANYCCL_ALLREDUCE_KERNELS(NAME, T)                                                                            \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_one_shot_##NAME(                                          \
        RankPtrs in, const void* self_src, void* out, FlagPtrs flags, int rank, int world, size_t n_vec) {           \
        ANYCCL_DISPATCH(one_shot, T, in, self_src, out, flags, rank, n_vec)                                          \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_one_shot_table_##NAME(                                    \
        const InputTable* table, const void* self_src, void* out, FlagPtrs flags, int rank, int world,               \
        size_t n_vec) {                                                                                              \
        const InputTable t = *table;                                                                                 \
        const void* src = t.registered ? nullptr : self_src;                                                         \
        ANYCCL_DISPATCH(one_shot, T, t.p, src, out, flags, rank, n_vec)                                              \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_two_shot_##NAME(                                          \
        RankPtrs in, const void* self_src, RankPtrs scratch, void* out, size_t round_vecs, FlagPtrs flags, int rank, \
        int world, size_t n_vec) {                                                                                   \
        ANYCCL_DISPATCH(two_shot, T, in, self_src, scratch, out, flags, rank, n_vec, round_vecs)                     \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_two_shot_table_##NAME(                                    \
        const InputTable* table, const void* self_src, RankPtrs scratch, void* out, size_t round_vecs,               \
        FlagPtrs flags, int rank, int world, size_t n_vec) {                                                         \
        const InputTable t = *table;                                                                                 \
        const void* src = t.registered ? nullptr : self_src;                                                         \
        ANYCCL_DISPATCH(two_shot, T, t.p, src, scratch, out, flags, rank, n_vec, round_vecs)                         \
    }
