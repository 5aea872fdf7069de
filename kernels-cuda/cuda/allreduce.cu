// anyccl custom all-reduce kernels for NVIDIA GPUs. The one-shot and two-shot all-reduce, with the barrier, epoch
// and abort-word scheme, are written once for every vendor in kernels-common/include/anyccl/allreduce.h (hipcc
// builds the same algorithm for AMD GPUs); this file instantiates them over the CUDA vendor layer and adds the
// CUDA-only NVLS kernels (multimem on multicast addresses, and their unicast emulation), which build on the shared
// barrier, epoch counters, vectors and reductions.

#include "anyccl/vendor_cuda.h"
#include "anyccl/allreduce.h"

ANYCCL_ALLREDUCE_KERNELS(f32, anyccl_f32)
ANYCCL_ALLREDUCE_KERNELS(f16, anyccl_f16)
ANYCCL_ALLREDUCE_KERNELS(bf16, anyccl_bf16)

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
//     barrier of allreduce.h, so the variants' partitioning, pipelining and barriers run (and are tested) where
//     multicast cannot be used.
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
__device__ __forceinline__ void nvls_block_pipeline(const void* in, void* out, void* my_stage_in,
                                                    const void* my_stage_out, const Ch& ch, int rank, size_t n_vec) {
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
__device__ __forceinline__ void nvls_warp_pipeline(const void* in, void* out, void* my_stage_in,
                                                   const void* my_stage_out, const Ch& ch, int rank, size_t n_vec) {
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

// NVLS kernels: `_emu` over the unicast channel (every rank's pointers and flag arrays), `_mc` over the multicast
// channel (sm_90+ only; multicast addresses of the bound buffers and of the flag arrays). Every kernel ends with
// (FlagPtrs flags, int rank, int world, size_t n_vec); the `_mc` kernels use only `flags.p[rank]` of it.
#define ANYCCL_NVLS_STAGED(VARIANT, NAME, T)                                                                         \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_nvls_##VARIANT##_emu_##NAME(                              \
        const void* in, void* out, RankPtrs stage_in, RankPtrs stage_out, FlagPtrs flags, int rank, int world,       \
        size_t n_vec) {                                                                                              \
        UnicastChannel ch{stage_in, stage_out, flags, rank};                                                         \
        ANYCCL_DISPATCH(nvls_##VARIANT, T, in, out, const_cast<void*>(pick(stage_in, rank)), pick(stage_out, rank),  \
                        ch, rank, n_vec)                                                                             \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_nvls_##VARIANT##_mc_##NAME(                               \
        const void* in, void* out, void* my_stage_in, const void* my_stage_out, const void* stage_in_mc,             \
        void* stage_out_mc, uint32_t* flags_mc, FlagPtrs flags, int rank, int world, size_t n_vec) {                 \
        MulticastChannel ch{stage_in_mc, stage_out_mc, flags_mc, pick(flags, rank)};                                 \
        ANYCCL_DISPATCH(nvls_##VARIANT, T, in, out, my_stage_in, my_stage_out, ch, rank, n_vec)                      \
    }

#define ANYCCL_NVLS_KERNELS(NAME, T)                                                                                 \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_nvls_zero_copy_emu_##NAME(                                \
        RankPtrs in, RankPtrs out, FlagPtrs flags, int rank, int world, size_t n_vec) {                              \
        UnicastChannel ch{in, out, flags, rank};                                                                     \
        ANYCCL_DISPATCH(nvls_zero_copy, T, ch, rank, n_vec)                                                          \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_nvls_zero_copy_mc_##NAME(                                 \
        const void* in_mc, void* out_mc, uint32_t* flags_mc, FlagPtrs flags, int rank, int world, size_t n_vec) {    \
        MulticastChannel ch{in_mc, out_mc, flags_mc, pick(flags, rank)};                                             \
        ANYCCL_DISPATCH(nvls_zero_copy, T, ch, rank, n_vec)                                                          \
    }                                                                                                                \
    ANYCCL_NVLS_STAGED(block_pipeline, NAME, T)                                                                      \
    ANYCCL_NVLS_STAGED(warp_pipeline, NAME, T)

ANYCCL_NVLS_KERNELS(f32, anyccl_f32)
ANYCCL_NVLS_KERNELS(f16, anyccl_f16)
ANYCCL_NVLS_KERNELS(bf16, anyccl_bf16)

// Fused all-reduce + residual add + RMSNorm (one-shot, two-shot) and the separate RMSNorm kernel: fused.h.
#include "anyccl/fused.h"
ANYCCL_FUSED_KERNELS(f16, anyccl_f16)
ANYCCL_FUSED_KERNELS(bf16, anyccl_bf16)

// Push-mode one-shot (Lamport sentinels, programmatic dependent launch on sm_90+), shared with HIP.
#include "anyccl/push.h"
ANYCCL_PUSH_KERNELS(f32, anyccl_f32)
ANYCCL_PUSH_KERNELS(f16, anyccl_f16)
ANYCCL_PUSH_KERNELS(bf16, anyccl_bf16)

// Quantized two-shot (fp8 e4m3 / int8 exchanged data with per-block scales), written once for every vendor.
#include "anyccl/quant.h"
ANYCCL_QUANT_KERNELS(f32, anyccl_f32)
ANYCCL_QUANT_KERNELS(f16, anyccl_f16)
ANYCCL_QUANT_KERNELS(bf16, anyccl_bf16)

// Fused push one-shot (the push exchange, then add + RMSNorm in the same kernel), written once for every vendor.
#include "anyccl/fused_push.h"
ANYCCL_FUSED_PUSH_KERNELS(f16, anyccl_f16)
ANYCCL_FUSED_PUSH_KERNELS(bf16, anyccl_bf16)
