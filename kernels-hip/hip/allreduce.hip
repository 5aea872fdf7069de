// anyccl custom all-reduce kernels for AMD GPUs: one-shot and two-shot over peer-mapped buffers (HIP IPC, or
// every device's buffers in one process with peer access). The same algorithms and synchronisation as the CUDA
// kernels (kernels-cuda/cuda/allreduce.cu), written with HIP's scoped atomics.
//
// Synchronisation: every block of every rank owns a 32-bit epoch counter in its own flag array. A barrier
// increments the epoch, stores it with release semantics at system scope into slot [block][rank] of every peer's
// flag array, then waits with acquire loads at system scope until its own slots [block][peer] reach the epoch.
// 32-bit flags only; no relaxed-only waits (relaxed start barriers over XGMI have shown torn reads on AMD GPUs).
// On gfx90a the release store compiles to `buffer_wbl2` + store and the acquire load to a load + `buffer_invl2`,
// which the code-object test checks.
//
// Inputs are 16-byte vectors; callers guarantee byte counts that are multiples of 16 and 16-byte aligned buffers.
// f16 and bf16 accumulate in f32.

#include <hip/hip_runtime.h>
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

struct alignas(16) V4 {
    uint32_t x, y, z, w;
};

__device__ __forceinline__ void st_release(uint32_t* addr, uint32_t v) {
    __hip_atomic_store(addr, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}

__device__ __forceinline__ uint32_t ld_acquire(uint32_t* addr) {
    return __hip_atomic_load(addr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}

// All threads of the block call it. Returns after every peer's same block reached the same barrier.
__device__ __forceinline__ void barrier(const FlagPtrs& flags, int rank, int world, uint32_t epoch) {
    __syncthreads();
    const int b = blockIdx.x;
    if ((int)threadIdx.x < world) {
        const int peer = threadIdx.x;
        st_release(flags.p[peer] + b * ANYCCL_MAX_RANKS + rank, epoch);
        uint32_t* mine = flags.p[rank] + b * ANYCCL_MAX_RANKS + peer;
        // Epochs only grow; a peer may already be one barrier ahead.
        while ((int32_t)(ld_acquire(mine) - epoch) < 0) {
            __builtin_amdgcn_s_sleep(1);
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

// Element conversions. bf16 is converted by hand (round to nearest even), which needs no bf16 header and so
// builds with every hipcc.
__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

struct F32 {};
struct F16 {};
struct BF16 {};

// Each element type: how it is stored, and its conversions to and from the f32 accumulator.
template <typename T> struct Elem;
template <> struct Elem<F32> {
    using S = float;
    __device__ static float get(S v) { return v; }
    __device__ static S put(float f) { return f; }
};
template <> struct Elem<F16> {
    using S = _Float16;
    __device__ static float get(S v) { return (float)v; }
    __device__ static S put(float f) { return (S)f; }
};
template <> struct Elem<BF16> {
    using S = uint16_t;
    __device__ static float get(S v) { return bf16_to_f32(v); }
    __device__ static S put(float f) { return f32_to_bf16(f); }
};

// A 16-byte vector of N elements, accumulated in f32.
template <typename T> struct Vec {
    using S = typename Elem<T>::S;
    static constexpr int N = 16 / sizeof(S);
    __device__ static void load(const V4& v, float* a) {
        const S* e = reinterpret_cast<const S*>(&v);
        for (int i = 0; i < N; i++) a[i] = Elem<T>::get(e[i]);
    }
    __device__ static void add(const V4& v, float* a) {
        const S* e = reinterpret_cast<const S*>(&v);
        for (int i = 0; i < N; i++) a[i] += Elem<T>::get(e[i]);
    }
    __device__ static V4 store(const float* a) {
        V4 v;
        S* e = reinterpret_cast<S*>(&v);
        for (int i = 0; i < N; i++) e[i] = Elem<T>::put(a[i]);
        return v;
    }
};

// Sum of the peers' vector `i`, in rank order 0..W-1 (the same order on every rank: bitwise identical).
template <typename T, int W>
__device__ __forceinline__ V4 reduce_vec(const RankPtrs& in, size_t i) {
    V4 v[W];
#pragma unroll
    for (int r = 0; r < W; r++) v[r] = reinterpret_cast<const V4*>(in.p[r])[i];
    float acc[Vec<T>::N];
    Vec<T>::load(v[0], acc);
#pragma unroll
    for (int r = 1; r < W; r++) Vec<T>::add(v[r], acc);
    return Vec<T>::store(acc);
}

// One shot: every rank reads every peer's whole input.
template <typename T, int W>
__device__ void one_shot(const RankPtrs& in, void* out, const FlagPtrs& flags, int rank, size_t n_vec) {
    const uint32_t e = next_epoch(flags, rank, 2);
    barrier(flags, rank, W, e + 1);
    V4* o = reinterpret_cast<V4*>(out);
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
    const size_t end = start + chunk < n_vec ? start + chunk : n_vec;
    V4* mine = reinterpret_cast<V4*>(const_cast<void*>(scratch.p[rank]));
    for (size_t i = start + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < end; i += (size_t)gridDim.x * blockDim.x)
        mine[i] = reduce_vec<T, W>(in, i);
    barrier(flags, rank, W, e + 2);
    V4* o = reinterpret_cast<V4*>(out);
#pragma unroll
    for (int q = 0; q < W; q++) {
        const size_t qs = chunk * q;
        const size_t qe = qs + chunk < n_vec ? qs + chunk : n_vec;
        const V4* src = reinterpret_cast<const V4*>(scratch.p[q]);
        for (size_t i = qs + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < qe; i += (size_t)gridDim.x * blockDim.x)
            o[i] = src[i];
    }
    barrier(flags, rank, W, e + 3);
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

ANYCCL_KERNELS(f32, F32)
ANYCCL_KERNELS(f16, F16)
ANYCCL_KERNELS(bf16, BF16)
