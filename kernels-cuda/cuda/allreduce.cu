// anyccl custom all-reduce kernels: one-shot and two-shot over peer-mapped buffers (IPC, or N buffer sets on one
// GPU when ranks are emulated). One source for every dtype (f32, f16, bf16; accumulation in f32).
//
// Synchronisation: every block of every rank owns a 32-bit epoch counter in its own flag array. A barrier
// increments the block's epoch, stores it (release, system scope) into slot [block][rank] of every peer's flag
// array, then waits (acquire, system scope) until its own slots [block][peer] reach the epoch. 32-bit flags, no
// byte flags, no relaxed-only waits. The epoch lives in device memory, so graph replays keep counting.
//
// Inputs are 16-byte vectors; callers guarantee byte counts that are multiples of 16 and 16-byte aligned buffers.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define ANYCCL_MAX_RANKS 8
#define ANYCCL_MAX_BLOCKS 64

struct RankPtrs {
    const void* p[ANYCCL_MAX_RANKS];
};

struct FlagPtrs {
    // Each rank's flag array: [ANYCCL_MAX_BLOCKS][ANYCCL_MAX_RANKS] slots, then [ANYCCL_MAX_BLOCKS] epoch counters.
    uint32_t* p[ANYCCL_MAX_RANKS];
};

__device__ __forceinline__ void st_release(uint32_t* addr, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* addr) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// All threads of the block call it. Returns after every peer's same block reached the same barrier.
__device__ __forceinline__ void barrier(const FlagPtrs& flags, int rank, int world, uint32_t epoch) {
    __syncthreads();
    const int b = blockIdx.x;
    if (threadIdx.x < world) {
        const int peer = threadIdx.x;
        st_release(flags.p[peer] + b * ANYCCL_MAX_RANKS + rank, epoch);
        const uint32_t* mine = flags.p[rank] + b * ANYCCL_MAX_RANKS + peer;
        // Epochs only grow; a peer may already be one barrier ahead.
        while ((int32_t)(ld_acquire(mine) - epoch) < 0) {
        }
    }
    __syncthreads();
}

__device__ __forceinline__ uint32_t next_epoch(const FlagPtrs& flags, int rank, uint32_t steps) {
    __shared__ uint32_t base;
    uint32_t* counter = flags.p[rank] + ANYCCL_MAX_BLOCKS * ANYCCL_MAX_RANKS + blockIdx.x;
    if (threadIdx.x == 0) {
        base = *counter;
        *counter = base + steps;
    }
    __syncthreads();
    return base;
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

// One shot: every rank reads every peer's whole input. `in.p[r]` is rank r's input as mapped here.
template <typename T, int W>
__device__ void one_shot(const RankPtrs& in, void* out, const FlagPtrs& flags, int rank, size_t n_vec) {
    const uint32_t e = next_epoch(flags, rank, 2);
    barrier(flags, rank, W, e + 1);
    uint4* o = reinterpret_cast<uint4*>(out);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_vec; i += (size_t)gridDim.x * blockDim.x)
        o[i] = reduce_vec<T, W>(in, i);
    // Nobody may overwrite its input (the next call) while a peer still reads it.
    barrier(flags, rank, W, e + 2);
}

// Two shot: rank r reduces chunk r into its scratch (peer-visible), then every rank gathers all chunks.
template <typename T, int W>
__device__ void two_shot(const RankPtrs& in, const RankPtrs& scratch, void* out, const FlagPtrs& flags, int rank,
                         size_t n_vec) {
    const uint32_t e = next_epoch(flags, rank, 3);
    barrier(flags, rank, W, e + 1);
    const size_t chunk = (n_vec + W - 1) / W;
    const size_t start = chunk * rank;
    const size_t end = min(n_vec, start + chunk);
    uint4* mine = reinterpret_cast<uint4*>(const_cast<void*>(scratch.p[rank]));
    for (size_t i = start + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < end; i += (size_t)gridDim.x * blockDim.x)
        mine[i] = reduce_vec<T, W>(in, i);
    barrier(flags, rank, W, e + 2);
    uint4* o = reinterpret_cast<uint4*>(out);
#pragma unroll
    for (int q = 0; q < W; q++) {
        const size_t qs = chunk * q;
        const size_t qe = min(n_vec, qs + chunk);
        const uint4* src = reinterpret_cast<const uint4*>(scratch.p[q]);
        for (size_t i = qs + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < qe; i += (size_t)gridDim.x * blockDim.x)
            o[i] = src[i];
    }
    barrier(flags, rank, W, e + 3);
}

// ---------------------------------------------------------------------------------------------------------------
// NVLS: the switch-channel primitive and the variants written over it.
//
// A channel reduce-loads a 16-byte vector across all ranks and broadcast-stores one to all ranks. Two
// implementations, one interface: MulticastChannel uses the multimem instructions on a multicast address (sm_90+,
// NVLink SHARP); UnicastChannel emulates them with loads and stores through every rank's own pointer, so the
// variants' partitioning, pipelining and barriers run (and are tested) where multicast cannot be used.

struct UnicastChannel {
    RankPtrs p;
};

struct MulticastChannel {
    const void* mc;
};

template <typename T, int W>
__device__ __forceinline__ uint4 ch_reduce(const UnicastChannel& c, size_t i) {
    return reduce_vec<T, W>(c.p, i);
}

template <int W>
__device__ __forceinline__ void ch_store(const UnicastChannel& c, size_t i, uint4 v) {
#pragma unroll
    for (int r = 0; r < W; r++) reinterpret_cast<uint4*>(const_cast<void*>(c.p.p[r]))[i] = v;
}

template <typename T> struct Multimem;
template <> struct Multimem<float> {
    __device__ static uint4 ld_reduce(const void* a) {
        uint4 v;
#if __CUDA_ARCH__ >= 900
        asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
#else
        v = make_uint4(0, 0, 0, 0);
        __trap();
#endif
        return v;
    }
};
template <> struct Multimem<__half> {
    __device__ static uint4 ld_reduce(const void* a) {
        uint4 v;
#if __CUDA_ARCH__ >= 900
        asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f16x2 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
#else
        v = make_uint4(0, 0, 0, 0);
        __trap();
#endif
        return v;
    }
};
template <> struct Multimem<__nv_bfloat16> {
    __device__ static uint4 ld_reduce(const void* a) {
        uint4 v;
#if __CUDA_ARCH__ >= 900
        asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
#else
        v = make_uint4(0, 0, 0, 0);
        __trap();
#endif
        return v;
    }
};

template <typename T, int W>
__device__ __forceinline__ uint4 ch_reduce(const MulticastChannel& c, size_t i) {
    return Multimem<T>::ld_reduce(reinterpret_cast<const uint4*>(c.mc) + i);
}

template <int W>
__device__ __forceinline__ void ch_store(const MulticastChannel& c, size_t i, uint4 v) {
#if __CUDA_ARCH__ >= 900
    uint4* a = reinterpret_cast<uint4*>(const_cast<void*>(c.mc)) + i;
    asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
                 ::"l"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    __trap();
#endif
}

// Zero-copy: the user's input and output buffers themselves are bound to the channel. Rank r reduce-loads its
// 1/W of the message and broadcast-stores the result into every rank's output.
template <typename T, int W, typename Ch>
__device__ void nvls_zero_copy(const Ch& in, const Ch& out, const FlagPtrs& flags, int rank, size_t n_vec) {
    const uint32_t e = next_epoch(flags, rank, 2);
    barrier(flags, rank, W, e + 1);
    const size_t chunk = (n_vec + W - 1) / W;
    const size_t start = chunk * rank;
    const size_t end = min(n_vec, start + chunk);
    for (size_t i = start + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < end; i += (size_t)gridDim.x * blockDim.x)
        ch_store<W>(out, i, ch_reduce<T, W>(in, i));
    barrier(flags, rank, W, e + 2);
}

// Block pipeline: the message moves through channel-bound staging buffers in tiles of one block's worth. Per tile,
// a block copies its rank's input tile into its staging, meets its peers' same block, reduce-loads its rank's
// 1/W of the tile and broadcast-stores it into every rank's output staging, meets them again, and copies its
// output tile out. Blocks work on different tiles independently, so copies and reductions overlap across blocks.
#define ANYCCL_TILE_VECS 4096
template <typename T, int W, typename Ch>
__device__ void nvls_block_pipeline(const void* in, void* out, void* my_stage_in, const void* my_stage_out,
                                    const Ch& stage_in, const Ch& stage_out, const FlagPtrs& flags, int rank,
                                    size_t n_vec) {
    const size_t tiles = (n_vec + ANYCCL_TILE_VECS - 1) / ANYCCL_TILE_VECS;
    const size_t my_tiles = tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    uint32_t e = next_epoch(flags, rank, 2 * (uint32_t)my_tiles + 1);
    for (size_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const size_t ts = t * ANYCCL_TILE_VECS;
        const size_t te = min(n_vec, ts + ANYCCL_TILE_VECS);
        for (size_t i = ts + threadIdx.x; i < te; i += blockDim.x)
            reinterpret_cast<uint4*>(my_stage_in)[i] = reinterpret_cast<const uint4*>(in)[i];
        barrier(flags, rank, W, ++e);
        const size_t part = (te - ts + W - 1) / W;
        const size_t ps = ts + part * rank;
        const size_t pe = min(te, ps + part);
        for (size_t i = ps + threadIdx.x; i < pe; i += blockDim.x) ch_store<W>(stage_out, i, ch_reduce<T, W>(stage_in, i));
        barrier(flags, rank, W, ++e);
        for (size_t i = ts + threadIdx.x; i < te; i += blockDim.x)
            reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(my_stage_out)[i];
    }
    // Every block ends with one more meeting, so no rank starts the next call's copies into a staging tile a
    // slower peer is still reading.
    barrier(flags, rank, W, ++e);
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
    extern "C" __global__ void __launch_bounds__(512) anyccl_one_shot_##NAME(                                     \
        RankPtrs in, void* out, FlagPtrs flags, int rank, int world, size_t n_vec) {                                 \
        ANYCCL_DISPATCH(one_shot, T, in, out, flags, rank, n_vec)                                                    \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512) anyccl_two_shot_##NAME(                                     \
        RankPtrs in, RankPtrs scratch, void* out, FlagPtrs flags, int rank, int world, size_t n_vec) {             \
        ANYCCL_DISPATCH(two_shot, T, in, scratch, out, flags, rank, n_vec)                                           \
    }

ANYCCL_KERNELS(f32, float)
ANYCCL_KERNELS(f16, __half)
ANYCCL_KERNELS(bf16, __nv_bfloat16)

// NVLS kernels: `_emu` over the unicast channel (N pointers), `_mc` over the multicast channel (sm_90+ only).
#define ANYCCL_NVLS_KERNELS(NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(512) anyccl_nvls_zero_copy_emu_##NAME(                           \
        RankPtrs in, RankPtrs out, FlagPtrs flags, int rank, int world, size_t n_vec) {                              \
        UnicastChannel ci{in}, co{out};                                                                              \
        ANYCCL_DISPATCH(nvls_zero_copy, T, ci, co, flags, rank, n_vec)                                               \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512) anyccl_nvls_zero_copy_mc_##NAME(                            \
        const void* in_mc, void* out_mc, FlagPtrs flags, int rank, int world, size_t n_vec) {                        \
        MulticastChannel ci{in_mc}, co{out_mc};                                                                      \
        ANYCCL_DISPATCH(nvls_zero_copy, T, ci, co, flags, rank, n_vec)                                               \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512) anyccl_nvls_block_pipeline_emu_##NAME(                      \
        const void* in, void* out, RankPtrs stage_in, RankPtrs stage_out, FlagPtrs flags, int rank, int world,      \
        size_t n_vec) {                                                                                              \
        UnicastChannel ci{stage_in}, co{stage_out};                                                                  \
        ANYCCL_DISPATCH(nvls_block_pipeline, T, in, out, const_cast<void*>(stage_in.p[rank]), stage_out.p[rank],    \
                        ci, co, flags, rank, n_vec)                                                                  \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(512) anyccl_nvls_block_pipeline_mc_##NAME(                       \
        const void* in, void* out, void* my_stage_in, const void* my_stage_out, const void* stage_in_mc,            \
        void* stage_out_mc, FlagPtrs flags, int rank, int world, size_t n_vec) {                                     \
        MulticastChannel ci{stage_in_mc}, co{stage_out_mc};                                                          \
        ANYCCL_DISPATCH(nvls_block_pipeline, T, in, out, my_stage_in, my_stage_out, ci, co, flags, rank, n_vec)      \
    }

ANYCCL_NVLS_KERNELS(f32, float)
ANYCCL_NVLS_KERNELS(f16, __half)
ANYCCL_NVLS_KERNELS(bf16, __nv_bfloat16)
