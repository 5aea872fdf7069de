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
// A block of the message is handled by the same thread index in every phase and on every rank (chunk offset j goes
// to thread j mod stride), so the writer and every reader of a block are the same block index: the per-block
// barriers order them. A last barrier keeps the next call from overwriting staging or scratch a peer still reads.
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

// Where block b's codes and scale are in a buffer holding nb blocks.
__device__ __forceinline__ anyccl_vec16* quant_codes(void* base, size_t b) {
    return reinterpret_cast<anyccl_vec16*>(reinterpret_cast<unsigned char*>(base) + b * ANYCCL_QUANT_BLOCK);
}
__device__ __forceinline__ float* quant_scales(void* base, size_t nb) {
    return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(base) + nb * ANYCCL_QUANT_BLOCK);
}

// Quantizes the 32 values x into block b of `base` (codes and scale).
template <typename Q>
__device__ __forceinline__ void quant_store(const float* x, void* base, size_t nb, size_t b) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < ANYCCL_QUANT_BLOCK; k++) amax = fmaxf(amax, fabsf(x[k]));
    // Capped at the largest float: a block whose largest magnitude is below QMAX / FLT_MAX (~1e-36) would get an
    // infinite factor, and 0 · inf is NaN.
    const float inv = amax > 0.0f ? fminf(Q::QMAX / amax, 3.40282347e38f) : 0.0f;
    const float scale = amax / Q::QMAX;
    anyccl_vec16 c[2];
    uint32_t* w = reinterpret_cast<uint32_t*>(c);
#pragma unroll
    for (int i = 0; i < ANYCCL_QUANT_BLOCK / 4; i++) w[i] = Q::encode4(x + 4 * i, inv);
    anyccl_vec16* dst = quant_codes(base, b);
    dst[0] = c[0];
    dst[1] = c[1];
    quant_scales(base, nb)[b] = scale;
}

// Block b of the message from the input `src` of n_vec vectors (elements past the end count as 0), quantized into
// `stage`.
template <typename T, typename Q>
__device__ __forceinline__ void quant_input_block(const anyccl_vec16* src, size_t n_vec, void* stage, size_t nb,
                                                  size_t b) {
    constexpr int N = Vec<T>::N;
    constexpr int G = ANYCCL_QUANT_BLOCK / N;
    const size_t v0 = b * G;
    float x[ANYCCL_QUANT_BLOCK];
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (v0 + g < n_vec) {
            Vec<T>::load(src[v0 + g], x + g * N);
        } else {
#pragma unroll
            for (int k = 0; k < N; k++) x[g * N + k] = 0.0f;
        }
    }
    quant_store<Q>(x, stage, nb, b);
}

// Block b of the sum of every rank's staging (rank order, f32 fused multiply-adds), re-quantized into `mine`.
template <typename Q, int W>
__device__ __forceinline__ void quant_reduce_block(const RankPtrs& stage, void* mine, size_t nb, size_t b) {
    float acc[ANYCCL_QUANT_BLOCK];
#pragma unroll
    for (int k = 0; k < ANYCCL_QUANT_BLOCK; k++) acc[k] = 0.0f;
    // One peer at a time: 32 accumulators and one peer's codes fit the 64 registers of two blocks per SM (all W
    // peers' loads hoisted spilled to local memory).
#pragma unroll 1
    for (int r = 0; r < W; r++) {
        void* base = const_cast<void*>(pick(stage, r));
        const anyccl_vec16* codes = quant_codes(base, b);
        const anyccl_vec16 c0 = codes[0], c1 = codes[1];
        const float s = quant_scales(base, nb)[b];
        const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&c0);
        const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&c1);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float v[4];
            Q::decode4(i < 4 ? w0[i] : w1[i - 4], v);
#pragma unroll
            for (int k = 0; k < 4; k++) acc[4 * i + k] = fmaf(v[k], s, acc[4 * i + k]);
        }
    }
    quant_store<Q>(acc, mine, nb, b);
}

// Block b of `owner`'s scratch, dequantized into the output `out` of n_vec vectors (the valid part only).
template <typename T, typename Q>
__device__ __forceinline__ void quant_gather_block(const void* owner, anyccl_vec16* out, size_t n_vec, size_t nb,
                                                   size_t b) {
    constexpr int N = Vec<T>::N;
    constexpr int G = ANYCCL_QUANT_BLOCK / N;
    void* base = const_cast<void*>(owner);
    const anyccl_vec16* codes = quant_codes(base, b);
    const anyccl_vec16 c0 = codes[0], c1 = codes[1];
    const float s = quant_scales(base, nb)[b];
    const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&c0);
    const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&c1);
    const size_t v0 = b * G;
#pragma unroll
    for (int g = 0; g < G; g++) {
        float x[N];
#pragma unroll
        for (int i = 0; i < N / 4; i++) {
            const int word = (g * N) / 4 + i;
            Q::decode4(word < 4 ? w0[word] : w1[word - 4], x + 4 * i);
        }
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = x[k] * s;
        if (v0 + g < n_vec) out[v0 + g] = Vec<T>::store(x);
    }
}

template <typename T, typename Q, int W>
__device__ __forceinline__ void quant_two_shot(const void* in, const RankPtrs& stage, const RankPtrs& scratch,
                                               void* out, const FlagPtrs& flags, int rank, size_t n_vec) {
    constexpr int G = ANYCCL_QUANT_BLOCK / Vec<T>::N;
    const size_t nb = (n_vec + G - 1) / G;
    const size_t cb = (nb + W - 1) / W;
    const uint32_t e = next_epoch(pick(flags, rank), 3);
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const anyccl_vec16* src = reinterpret_cast<const anyccl_vec16*>(in);
    void* my_stage = const_cast<void*>(pick(stage, rank));
    for (size_t j = first; j < cb; j += stride) {
#pragma unroll 1
        for (int q = 0; q < W; q++) {
            const size_t b = (size_t)q * cb + j;
            if (b < nb) quant_input_block<T, Q>(src, n_vec, my_stage, nb, b);
        }
    }
    barrier(flags, rank, W, e + 1);
    void* mine = const_cast<void*>(pick(scratch, rank));
    for (size_t j = first; j < cb; j += stride) {
        const size_t b = (size_t)rank * cb + j;
        if (b >= nb) break;
        quant_reduce_block<Q, W>(stage, mine, nb, b);
    }
    barrier(flags, rank, W, e + 2);
    anyccl_vec16* o = reinterpret_cast<anyccl_vec16*>(out);
    for (size_t j = first; j < cb; j += stride) {
#pragma unroll 1
        for (int q = 0; q < W; q++) {
            const size_t b = (size_t)q * cb + j;
            if (b < nb) quant_gather_block<T, Q>(pick(scratch, q), o, n_vec, nb, b);
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
