// anyccl quantized two-shot all-reduce, written once for every vendor: the data the ranks exchange is fp8 (e4m3,
// the OCP "fn" format: bias 7, max 448, one NaN code 0x7f) or int8, in blocks of ANYCCL_QUANT_BLOCK elements with one
// f32 scale per block; every sum is accumulated in f32. Include after allreduce.h (barrier, epochs, Vec, pick).
//
// Per block of 32 elements x[0..32) (f32 values of the input type):
//   amax  = max |x[k]|                      (fmaxf: a NaN element is skipped)
//   inv   = amax > 0 ? min(QMAX / amax, FLT_MAX) : 0   (IEEE division; QMAX = 448 for e4m3, 127 for int8)
//   scale = amax / QMAX                     (stored, f32)
//   code  = e4m3: round-to-nearest-even of x*inv, saturated to ±448 (NaN stays NaN)
//           int8: min(max(rint(x*inv), -127), 127)
//   value = float(code) * scale             (dequantized)
// Rank r's chunk is reduced as acc = fmaf(value_r, scale_r, acc) for r = 0..W-1 from acc = 0 (explicit fused
// multiply-adds, in rank order: bitwise the same on every rank and every run), then re-quantized by the same rule.
// anyccl_kernels_common::quant mirrors this exactly on the host (the GPU test compares bitwise), and documents the
// error bound.
//
// Buffers: each rank's peer-visible staging and scratch hold a message of nb = ceil(elements / 32) blocks as
// [nb × 32 code bytes][nb × f32 scales] (anyccl_kernels_common::quant::staging_bytes); the staging holds the rank's
// own quantized input, the scratch the re-quantized sum of the chunk the rank owns.
//
// Phases (one epoch each, the per-block barrier of allreduce.h between them):
//   1. every rank quantizes its whole input into its own staging;
//   2. rank r dequantizes its chunk (blocks [r·cb, (r+1)·cb), cb = ceil(nb / W)) from every rank's staging, sums in
//      rank order, re-quantizes into its own scratch;
//   3. every rank gathers every chunk from its owner's scratch and dequantizes into its output (the input type).
// Each block of 32 elements is handled by a group of 32 / N threads (N elements per 16-byte vector), one vector per
// thread, so a warp reads and writes contiguous memory. A block is handled by the same group in every phase and on
// every rank (chunk offset j goes to group j mod the number of groups), so the writer and every reader of a block
// are the same block index: the per-block barriers order them. A last barrier keeps the next call from overwriting
// staging or scratch a peer still reads.
//
// Vendor layer additions (vendor_cuda.h / vendor_hip.h): anyccl_e4m3x2_encode (two f32 → two e4m3 codes, the first
// in the low byte) and anyccl_e4m3x2_decode (the reverse, exact).

#pragma once

#define ANYCCL_QUANT_BLOCK 32

// e4m3: four values per 32-bit word, element k in byte k.
struct QuantE4m3 {
    static constexpr float QMAX = 448.0f;
    __device__ static uint32_t encode4(const float* v, float inv) {
        const uint32_t lo = anyccl_e4m3x2_encode(v[0] * inv, v[1] * inv);
        const uint32_t hi = anyccl_e4m3x2_encode(v[2] * inv, v[3] * inv);
        return lo | (hi << 16);
    }
    __device__ static void decode4(uint32_t w, float* v) {
        anyccl_e4m3x2_decode((uint16_t)(w & 0xffffu), v);
        anyccl_e4m3x2_decode((uint16_t)(w >> 16), v + 2);
    }
};

// int8: four values per 32-bit word, element k in byte k (two's complement).
struct QuantInt8 {
    static constexpr float QMAX = 127.0f;
    __device__ static uint32_t encode1(float x) {
        // Clamped as a float first (fmaxf turns NaN into -127), so the conversion to int is always in range.
        const float r = fminf(fmaxf(rintf(x), -127.0f), 127.0f);
        return (uint32_t)(uint8_t)(int8_t)(int)r;
    }
    __device__ static uint32_t encode4(const float* v, float inv) {
        return encode1(v[0] * inv) | (encode1(v[1] * inv) << 8) | (encode1(v[2] * inv) << 16) |
               (encode1(v[3] * inv) << 24);
    }
    __device__ static void decode4(uint32_t w, float* v) {
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = (float)(int8_t)(uint8_t)(w >> (8 * k));
    }
};

// A block of 32 elements is handled by a group of G = 32 / N consecutive threads (N elements of the 16-byte vector
// type each: G = 4 for f16/bf16, 8 for f32), aligned within a warp: lane li of the group holds elements
// [li·N, (li+1)·N) of the block, so a warp's loads and stores of inputs, codes and outputs are contiguous. The
// group combines its block's largest magnitude with shuffles (fmaxf is exact and order-free, so the result is the
// one a single thread would get).
template <typename T> struct QuantGroup {
    static constexpr int N = Vec<T>::N;                  // elements per thread
    static constexpr int G = ANYCCL_QUANT_BLOCK / N;     // threads per block
    static constexpr int WORDS = N / 4;                  // 32-bit code words per thread
};

// Where block b's codes and scale are in a buffer holding nb blocks.
__device__ __forceinline__ unsigned char* quant_codes(void* base, size_t b) {
    return reinterpret_cast<unsigned char*>(base) + b * ANYCCL_QUANT_BLOCK;
}
__device__ __forceinline__ float* quant_scales(void* base, size_t nb) {
    return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(base) + nb * ANYCCL_QUANT_BLOCK);
}

// Lane li's code words of block b in `base` (WORDS of them, 4·WORDS-byte aligned).
template <int WORDS>
__device__ __forceinline__ void quant_load_words(void* base, size_t b, int li, uint32_t* w) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(quant_codes(base, b) + li * 4 * WORDS);
    if constexpr (WORDS == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x;
        w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < WORDS; i++) w[i] = p[i];
    }
}

// Quantizes this lane's N values x of block b into `base` (codes and, from lane 0, the scale); every lane of the
// group calls it together.
template <typename Q, int N, int G>
__device__ __forceinline__ void quant_store(const float* x, void* base, size_t nb, size_t b, int li) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < N; k++) amax = fmaxf(amax, fabsf(x[k]));
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) amax = fmaxf(amax, anyccl_shfl_xor_group(amax, o, G));
    // Capped at the largest float: a block whose largest magnitude is below QMAX / FLT_MAX (~1e-36) would get an
    // infinite factor, and 0 · inf is NaN.
    const float inv = amax > 0.0f ? fminf(Q::QMAX / amax, 3.40282347e38f) : 0.0f;
    const float scale = amax / Q::QMAX;
    constexpr int WORDS = N / 4;
    uint32_t w[WORDS];
#pragma unroll
    for (int i = 0; i < WORDS; i++) w[i] = Q::encode4(x + 4 * i, inv);
    uint32_t* dst = reinterpret_cast<uint32_t*>(quant_codes(base, b) + li * N);
    if constexpr (WORDS == 2) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
        for (int i = 0; i < WORDS; i++) dst[i] = w[i];
    }
    if (li == 0) quant_scales(base, nb)[b] = scale;
}

// This lane's part of the sum of block b over every rank's staging (rank order, f32 fused multiply-adds),
// re-quantized into `mine`.
template <typename T, typename Q, int W>
__device__ __forceinline__ void quant_reduce_block(const RankPtrs& stage, void* mine, size_t nb, size_t b, int li) {
    constexpr int N = QuantGroup<T>::N, G = QuantGroup<T>::G, WORDS = QuantGroup<T>::WORDS;
    // Every peer's words and scale first (W·(WORDS+1) registers), so the loads are in flight together.
    uint32_t w[W][WORDS];
    float s[W];
#pragma unroll
    for (int r = 0; r < W; r++) {
        void* base = const_cast<void*>(pick(stage, r));
        quant_load_words<WORDS>(base, b, li, w[r]);
        s[r] = quant_scales(base, nb)[b];
    }
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; k++) acc[k] = 0.0f;
#pragma unroll
    for (int r = 0; r < W; r++) {
#pragma unroll
        for (int i = 0; i < WORDS; i++) {
            float v[4];
            Q::decode4(w[r][i], v);
#pragma unroll
            for (int k = 0; k < 4; k++) acc[4 * i + k] = fmaf(v[k], s[r], acc[4 * i + k]);
        }
    }
    quant_store<Q, N, G>(acc, mine, nb, b, li);
}

// This lane's vector of block b of `owner`'s scratch, dequantized into the output `out` of n_vec vectors (the
// valid part only).
template <typename T, typename Q>
__device__ __forceinline__ void quant_gather_vec(const uint32_t* w, float s, anyccl_vec16* out, size_t n_vec,
                                                 size_t vi) {
    constexpr int N = QuantGroup<T>::N, WORDS = QuantGroup<T>::WORDS;
    float x[N];
#pragma unroll
    for (int i = 0; i < WORDS; i++) Q::decode4(w[i], x + 4 * i);
#pragma unroll
    for (int k = 0; k < N; k++) x[k] = x[k] * s;
    if (vi < n_vec) out[vi] = Vec<T>::store(x);
}

template <typename T, typename Q, int W>
__device__ __forceinline__ void quant_two_shot(const void* in, const RankPtrs& stage, const RankPtrs& scratch,
                                               void* out, const FlagPtrs& flags, int rank, size_t n_vec) {
    constexpr int N = QuantGroup<T>::N, G = QuantGroup<T>::G, WORDS = QuantGroup<T>::WORDS;
    // Inputs loaded at once in phase 1 (U vectors in flight per thread, within the 64-register budget).
    constexpr int U = W < 4 ? W : 4;
    const size_t nb = (n_vec + G - 1) / G;
    const size_t cb = (nb + W - 1) / W;
    const uint32_t e = next_epoch(pick(flags, rank), 3);
    // Group j handles block offset j of every chunk, in every phase and on every rank, so a block's writer and its
    // readers are the same block index and the per-block barriers order them. blockDim.x is a multiple of G.
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t first = tid / G;
    const int li = (int)(threadIdx.x % G);
    const size_t stride = (size_t)gridDim.x * blockDim.x / G;
    const anyccl_vec16* src = reinterpret_cast<const anyccl_vec16*>(in);
    void* my_stage = const_cast<void*>(pick(stage, rank));
    for (size_t j = first; j < cb; j += stride) {
#pragma unroll 1
        for (int q0 = 0; q0 < W; q0 += U) {
            anyccl_vec16 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const size_t vi = ((size_t)(q0 + u) * cb + j) * G + li;
                if (q0 + u < W && vi < n_vec) {
                    v[u] = src[vi];
                } else {
                    // Elements past the end count as 0.
                    unsigned char* z = reinterpret_cast<unsigned char*>(&v[u]);
#pragma unroll
                    for (int k = 0; k < 16; k++) z[k] = 0;
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const size_t b = (size_t)(q0 + u) * cb + j;
                if (q0 + u < W && b < nb) {
                    float x[N];
                    Vec<T>::load(v[u], x);
                    quant_store<Q, N, G>(x, my_stage, nb, b, li);
                }
            }
        }
    }
    barrier(flags, rank, W, e + 1);
    void* mine = const_cast<void*>(pick(scratch, rank));
    for (size_t j = first; j < cb; j += stride) {
        const size_t b = (size_t)rank * cb + j;
        if (b >= nb) break;
        quant_reduce_block<T, Q, W>(stage, mine, nb, b, li);
    }
    barrier(flags, rank, W, e + 2);
    anyccl_vec16* o = reinterpret_cast<anyccl_vec16*>(out);
    for (size_t j = first; j < cb; j += stride) {
        // Every owner's words and scale first, then the stores (the output may alias nothing they read, but the
        // compiler cannot know that).
        uint32_t w[W][WORDS];
        float s[W];
#pragma unroll
        for (int q = 0; q < W; q++) {
            const size_t b = (size_t)q * cb + j;
            if (b < nb) {
                void* base = const_cast<void*>(pick(scratch, q));
                quant_load_words<WORDS>(base, b, li, w[q]);
                s[q] = quant_scales(base, nb)[b];
            }
        }
#pragma unroll
        for (int q = 0; q < W; q++) {
            const size_t b = (size_t)q * cb + j;
            if (b < nb) quant_gather_vec<T, Q>(w[q], s[q], o, n_vec, b * G + li);
        }
    }
    // Nobody may overwrite its staging or scratch (the next call) while a peer still reads them.
    barrier(flags, rank, W, e + 3);
}

// The quantized two-shot kernels of element type T (named NAME) for both formats:
// anyccl_quant_two_shot_{fp8,int8}_NAME(in, stage, scratch, out, flags, rank, world, n_vec). `in` is this rank's
// input (n_vec 16-byte vectors), `out` its output (may be `in`), `stage`/`scratch` every rank's buffers of
// anyccl_kernels_common::quant::staging_bytes each.
#define ANYCCL_QUANT_KERNELS(NAME, T)                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_quant_two_shot_fp8_##NAME(                                \
        const void* in, RankPtrs stage, RankPtrs scratch, void* out, FlagPtrs flags, int rank, int world,            \
        size_t n_vec) {                                                                                              \
        ANYCCL_QUANT_DISPATCH(T, QuantE4m3)                                                                          \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_quant_two_shot_int8_##NAME(                               \
        const void* in, RankPtrs stage, RankPtrs scratch, void* out, FlagPtrs flags, int rank, int world,            \
        size_t n_vec) {                                                                                              \
        ANYCCL_QUANT_DISPATCH(T, QuantInt8)                                                                          \
    }

#define ANYCCL_QUANT_DISPATCH(T, Q)                                                                                  \
    switch (world) {                                                                                                 \
        case 2: quant_two_shot<T, Q, 2>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        case 3: quant_two_shot<T, Q, 3>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        case 4: quant_two_shot<T, Q, 4>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        case 5: quant_two_shot<T, Q, 5>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        case 6: quant_two_shot<T, Q, 6>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        case 7: quant_two_shot<T, Q, 7>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        case 8: quant_two_shot<T, Q, 8>(in, stage, scratch, out, flags, rank, n_vec); break;                         \
        default: break;                                                                                              \
    }
