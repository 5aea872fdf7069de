// anyccl fused all-reduce + residual add + RMSNorm, written once for every vendor over allreduce.h (include it
// after allreduce.h):
//
//     s        = allreduce(x)                      (sum in rank order 0..W-1 in f32, rounded to T: reduce_vec)
//     r        = T(f32(s) + f32(residual))         written back into `residual` (in place)
//     ss       = sum of f32(r)^2 over the row      (fixed order, below)
//     inv      = 1 / sqrt(ss / hidden + eps)       (f32, correctly rounded divide and square root)
//     out      = T((f32(r) * inv) * f32(weight))   (two f32 multiplies, each rounded; never fused)
//   or, fp8 output (NormArgs::out_fp8 != 0):
//     out      = e4m3(((f32(r) * inv) * f32(weight)) / scale)   (f32 divide, then round to nearest even to e4m3,
//                saturating to ±448 (finite), NaN stays NaN (0x7f | sign), |v| <= 2^-10 becomes ±0)
//
// for T = f16 or bf16, rows of `hidden` elements (a multiple of 8: one 16-byte vector per 8 elements, up to
// ANYCCL_MAX_HIDDEN). Every kernel here runs that math through one function, norm_row, so the fused kernels and the
// separate RMSNorm kernel (the unfused baseline: all-reduce kernel, then anyccl_rmsnorm_*) produce the same bits.
//
// Order of the sum of squares (bitwise reproducible, and mirrored by the host reference): blocks have exactly
// ANYCCL_NORM_THREADS threads; thread t takes the row's vectors t, t + 512, t + 1024, ... in that order and
// accumulates its elements 0..7 of each with fma(r, r, acc) from +0; then every 32 consecutive threads are added
// pairwise (lane i += lane i + 16, then + 8, + 4, + 2, + 1), and the 16 warp sums likewise (+ 8, + 4, + 2, + 1).
//
// Forms (each rank launches the same kernel with the same grid; block b handles rows b, b + gridDim.x, ...):
// - one-shot: every rank reads whole rows from every peer, reduces them, adds its residual and normalises: every
//   rank computes every row. Barriers: inputs staged, then done (2 epochs).
// - two-shot: rows are split into W chunks of ceil(tokens / W) rows; rank r reduces and normalises chunk r, writes
//   the new residual rows and the output rows into its peer-visible scratch (and its own buffers), then every rank
//   gathers the other chunks from their owners' scratch (3 epochs). The residual used for a row is its owner's:
//   the residual must be the same on every rank (tensor parallelism keeps it replicated).
// Inputs come directly (RankPtrs), through staging (`self_src` non-null: copied by the same blocks that later read
// those rows everywhere), or through an InputTable, as for the plain one-shot and two-shot.
//
// Two-shot scratch layout, per rank: [0, tokens × hidden × sizeof(T)) new residual rows, then the output rows
// (tokens × hidden × sizeof(T), or × 1 for fp8): at most twice the message.

#pragma once

#define ANYCCL_NORM_THREADS 512
#define ANYCCL_MAX_HIDDEN 16384

// What the add + RMSNorm part needs (by value in every kernel's parameters; mirrored in Rust, 48 bytes).
struct NormArgs {
    // [tokens][hidden] of T: read, and overwritten with the new residual.
    void* residual;
    // [hidden] of T.
    const void* weight;
    // [tokens][hidden] of T, or of e4m3 bytes when out_fp8.
    void* out;
    float eps;
    // fp8 output only: out = e4m3(y / scale).
    float scale;
    int out_fp8;
    // Vectors (8 elements) per row: hidden / 8.
    uint32_t hidden_vec;
    uint64_t tokens;
};

// f32 to fp8 e4m3 (OCP "fn": no infinities), round to nearest even, saturating to the largest finite value (±448),
// NaN to 0x7f | sign: the conversion of CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3), written out in
// integer operations so every vendor computes the same bits.
__device__ __forceinline__ uint32_t anyccl_f32_to_e4m3(float f) {
    const uint32_t u = __float_as_uint(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    uint32_t res;
    if (a <= 0x3a800000u) {  // <= 2^-10 (half the smallest subnormal): zero
        res = 0;
    } else if (a > 0x7f800000u) {  // NaN
        res = 0x7f;
    } else if (a > 0x43e80000u) {  // > 464 (448 + half an ulp): saturate
        res = 0x7e;
    } else if (a >= 0x3c800000u) {  // >= 2^-6: normal
        const uint32_t exp = (a >> 23) - 127 + 7;
        const uint32_t man = (a >> 20) & 7u;
        res = (exp << 3) | man;
        const uint32_t rest = a & 0xfffffu;
        if (rest > 0x80000u || (rest == 0x80000u && (man & 1u))) res += 1;
    } else {  // subnormal: unbiased exponent -10..-7
        const int exp = (int)(a >> 23) - 127 + 7;  // -3..0
        const uint32_t shift = (uint32_t)(1 - exp);  // 1..4
        const uint32_t man = ((a >> 20) & 7u) | 8u;
        res = man >> shift;
        const uint32_t half = 0x80000u << shift;
        const uint32_t rest = (a | 0x800000u) & ((0x80000u << (shift + 1)) - 1);
        if (rest > half || (rest == half && (res & 1u))) res += 1;
    }
    return res | sign;
}

// The sum of every thread's `v` (blocks of ANYCCL_NORM_THREADS threads), in the fixed order described at the top,
// returned to every thread.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp_sums[ANYCCL_NORM_THREADS / 32];
    __shared__ float total;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = anyccl_fadd_rn(v, anyccl_shfl_xor32(v, o));
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float w = warp_sums[threadIdx.x % (ANYCCL_NORM_THREADS / 32)];
#pragma unroll
        for (int o = ANYCCL_NORM_THREADS / 64; o > 0; o >>= 1) w = anyccl_fadd_rn(w, anyccl_shfl_xor32(w, o));
        if (threadIdx.x == 0) total = w;
    }
    __syncthreads();
    const float t = total;
    // No thread may overwrite warp_sums/total (the next row) before every thread has read `total`.
    __syncthreads();
    return t;
}

// The add + RMSNorm of one row, by the whole block. `load(j)` gives the row's all-reduced vector j (T, already
// rounded); `res` is the row's residual; the new residual goes to `res_out` (may be `res`) and, if non-null,
// `res_out2`; the output row to `out` and, if non-null, `out2` (vectors of T, or 8 bytes of e4m3 per vector).
template <typename T, typename Load>
__device__ __forceinline__ void norm_row(const Load& load, const anyccl_vec16* res, anyccl_vec16* res_out,
                                         anyccl_vec16* res_out2, void* out, void* out2, const NormArgs& a) {
    constexpr int N = Vec<T>::N;
    static_assert(N == 8, "the fused kernels are for 16-bit element types");
    const uint32_t hv = a.hidden_vec;
    float ss = 0.0f;
    for (uint32_t j = threadIdx.x; j < hv; j += ANYCCL_NORM_THREADS) {
        const anyccl_vec16 s = load(j);
        const anyccl_vec16 rv = res[j];
        float x[N], r[N];
        Vec<T>::load(s, x);
        Vec<T>::load(rv, r);
#pragma unroll
        for (int i = 0; i < N; i++) x[i] = anyccl_fadd_rn(x[i], r[i]);
        const anyccl_vec16 nr = Vec<T>::store(x);
        res_out[j] = nr;
        if (res_out2 != nullptr) res_out2[j] = nr;
        Vec<T>::load(nr, x);
#pragma unroll
        for (int i = 0; i < N; i++) ss = anyccl_fma_rn(x[i], x[i], ss);
    }
    const float total = block_sum(ss);
    const float mean = anyccl_fdiv_rn(total, (float)(hv * N));
    const float inv = anyccl_fdiv_rn(1.0f, anyccl_fsqrt_rn(anyccl_fadd_rn(mean, a.eps)));
    const anyccl_vec16* w = reinterpret_cast<const anyccl_vec16*>(a.weight);
    for (uint32_t j = threadIdx.x; j < hv; j += ANYCCL_NORM_THREADS) {
        // This thread wrote res_out[j] above.
        const anyccl_vec16 rv = res_out[j];
        const anyccl_vec16 wv = w[j];
        float x[N], g[N];
        Vec<T>::load(rv, x);
        Vec<T>::load(wv, g);
#pragma unroll
        for (int i = 0; i < N; i++) x[i] = anyccl_fmul_rn(anyccl_fmul_rn(x[i], inv), g[i]);
        if (a.out_fp8) {
            uint32_t lo = 0, hi = 0;
#pragma unroll
            for (int i = 0; i < 4; i++) lo |= anyccl_f32_to_e4m3(anyccl_fdiv_rn(x[i], a.scale)) << (8 * i);
#pragma unroll
            for (int i = 0; i < 4; i++) hi |= anyccl_f32_to_e4m3(anyccl_fdiv_rn(x[i + 4], a.scale)) << (8 * i);
            const uint64_t q = (uint64_t)lo | ((uint64_t)hi << 32);
            reinterpret_cast<uint64_t*>(out)[j] = q;
            if (out2 != nullptr) reinterpret_cast<uint64_t*>(out2)[j] = q;
        } else {
            const anyccl_vec16 o = Vec<T>::store(x);
            reinterpret_cast<anyccl_vec16*>(out)[j] = o;
            if (out2 != nullptr) reinterpret_cast<anyccl_vec16*>(out2)[j] = o;
        }
    }
}

// Bytes of one output row.
__device__ __forceinline__ size_t out_row_bytes(const NormArgs& a) {
    return (size_t)a.hidden_vec * (a.out_fp8 ? 8 : 16);
}

__device__ __forceinline__ anyccl_vec16* vec_at(void* base, size_t vec) {
    return reinterpret_cast<anyccl_vec16*>(base) + vec;
}

__device__ __forceinline__ void* byte_at(void* base, size_t bytes) {
    return reinterpret_cast<char*>(base) + bytes;
}

// Copies whole rows [first row of this block, ...) of [s, e) rows, `hv` vectors each, from `src` into staging.
__device__ __forceinline__ void stage_rows(void* stage, const void* src, size_t s, size_t e, size_t hv) {
    for (size_t row = s + blockIdx.x; row < e; row += gridDim.x)
        copy_vecs(reinterpret_cast<anyccl_vec16*>(stage), reinterpret_cast<const anyccl_vec16*>(src), row * hv,
                  row * hv + hv, threadIdx.x, blockDim.x);
}

// Fused one-shot (see the top of the file).
template <typename T, int W>
__device__ __forceinline__ void fused_one_shot(const RankPtrs& in, const void* self_src, const NormArgs& a,
                                               const FlagPtrs& flags, int rank) {
    const uint32_t e = next_epoch(pick(flags, rank), 2);
    const size_t hv = a.hidden_vec;
    if (self_src != nullptr) stage_rows(const_cast<void*>(pick(in, rank)), self_src, 0, a.tokens, hv);
    barrier(flags, rank, W, e + 1);
    for (size_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
        anyccl_vec16* res = vec_at(a.residual, row * hv);
        norm_row<T>([&](uint32_t j) { return reduce_vec<T, W>(in, row * hv + j); }, res, res, nullptr,
                    byte_at(a.out, row * out_row_bytes(a)), nullptr, a);
    }
    // Nobody may overwrite its input (the next call) while a peer still reads it.
    barrier(flags, rank, W, e + 2);
}

// Fused two-shot (see the top of the file).
template <typename T, int W>
__device__ __forceinline__ void fused_two_shot(const RankPtrs& in, const void* self_src, const RankPtrs& scratch,
                                               const NormArgs& a, const FlagPtrs& flags, int rank) {
    const uint32_t e = next_epoch(pick(flags, rank), 3);
    const size_t hv = a.hidden_vec;
    const size_t tokens = a.tokens;
    const size_t chunk = (tokens + W - 1) / W;
    const size_t orb = out_row_bytes(a);
    // Offset of the output rows in scratch (after the residual rows).
    const size_t out_off = tokens * hv * 16;
    if (self_src != nullptr) {
        // Each chunk's rows by the block that reduces them on the chunk's owner.
        for (int q = 0; q < W; q++)
            stage_rows(const_cast<void*>(pick(in, rank)), self_src, chunk * q,
                       anyccl_min_size(tokens, chunk * q + chunk), hv);
    }
    barrier(flags, rank, W, e + 1);
    void* mine = const_cast<void*>(pick(scratch, rank));
    const size_t start = chunk * rank;
    const size_t end = anyccl_min_size(tokens, start + chunk);
    for (size_t row = start + blockIdx.x; row < end; row += gridDim.x) {
        anyccl_vec16* res = vec_at(a.residual, row * hv);
        norm_row<T>([&](uint32_t j) { return reduce_vec<T, W>(in, row * hv + j); }, res, vec_at(mine, row * hv), res,
                    byte_at(mine, out_off + row * orb), byte_at(a.out, row * orb), a);
    }
    barrier(flags, rank, W, e + 2);
    // Gather the other chunks: row by row, from the owner's scratch, by the block that wrote it there.
    for (int q = 0; q < W; q++) {
        if (q == rank) continue;
        void* theirs = const_cast<void*>(pick(scratch, q));
        const size_t qe = anyccl_min_size(tokens, chunk * q + chunk);
        for (size_t row = chunk * q + blockIdx.x; row < qe; row += gridDim.x) {
            copy_vecs(reinterpret_cast<anyccl_vec16*>(a.residual), reinterpret_cast<const anyccl_vec16*>(theirs),
                      row * hv, row * hv + hv, threadIdx.x, blockDim.x);
            if (a.out_fp8) {
                const uint64_t* src = reinterpret_cast<const uint64_t*>(byte_at(theirs, out_off + row * orb));
                uint64_t* dst = reinterpret_cast<uint64_t*>(byte_at(a.out, row * orb));
                for (size_t j = threadIdx.x; j < hv; j += blockDim.x) dst[j] = src[j];
            } else {
                copy_vecs(reinterpret_cast<anyccl_vec16*>(a.out),
                          reinterpret_cast<const anyccl_vec16*>(byte_at(theirs, out_off)), row * hv, row * hv + hv,
                          threadIdx.x, blockDim.x);
            }
        }
    }
    // Nobody may overwrite its input or scratch (the next call) while a peer still reads them.
    barrier(flags, rank, W, e + 3);
}

// The unfused baseline's second kernel: the same add + RMSNorm of every row of `in` (an all-reduce's output).
template <typename T>
__device__ __forceinline__ void rmsnorm_rows(const void* in, const NormArgs& a) {
    const size_t hv = a.hidden_vec;
    for (size_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
        const anyccl_vec16* src = reinterpret_cast<const anyccl_vec16*>(in) + row * hv;
        anyccl_vec16* res = vec_at(a.residual, row * hv);
        norm_row<T>([&](uint32_t j) { return src[j]; }, res, res, nullptr, byte_at(a.out, row * out_row_bytes(a)),
                    nullptr, a);
    }
}

// The fused kernels of element type T (f16 or bf16), named by NAME, and the separate RMSNorm kernel. Launch with
// ANYCCL_NORM_THREADS threads per block (the order of the sum of squares depends on it).
#define ANYCCL_FUSED_KERNELS(NAME, T)                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_fused_one_shot_##NAME(                                    \
        RankPtrs in, const void* self_src, NormArgs args, FlagPtrs flags, int rank, int world) {                     \
        ANYCCL_DISPATCH(fused_one_shot, T, in, self_src, args, flags, rank)                                          \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_fused_one_shot_table_##NAME(                              \
        const InputTable* table, const void* self_src, NormArgs args, FlagPtrs flags, int rank, int world) {         \
        const InputTable t = *table;                                                                                 \
        const void* src = t.registered ? nullptr : self_src;                                                         \
        ANYCCL_DISPATCH(fused_one_shot, T, t.p, src, args, flags, rank)                                              \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_fused_two_shot_##NAME(                                    \
        RankPtrs in, const void* self_src, RankPtrs scratch, NormArgs args, FlagPtrs flags, int rank, int world) {   \
        ANYCCL_DISPATCH(fused_two_shot, T, in, self_src, scratch, args, flags, rank)                                 \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_fused_two_shot_table_##NAME(                              \
        const InputTable* table, const void* self_src, RankPtrs scratch, NormArgs args, FlagPtrs flags, int rank,    \
        int world) {                                                                                                 \
        const InputTable t = *table;                                                                                 \
        const void* src = t.registered ? nullptr : self_src;                                                         \
        ANYCCL_DISPATCH(fused_two_shot, T, t.p, src, scratch, args, flags, rank)                                     \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_rmsnorm_##NAME(const void* in, NormArgs args) {           \
        rmsnorm_rows<T>(in, args);                                                                                   \
    }
