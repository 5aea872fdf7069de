// anyccl kernels, HIP side of the vendor layer: everything allreduce.h needs that CUDA and HIP spell differently.
// The CUDA twin is vendor_cuda.h; both define the same names (see allreduce.h, "Vendor layer").

#pragma once

#include <hip/hip_runtime.h>
#include <stdint.h>

// Occupancy every kernel is built for: blocks of up to 512 threads.
#define ANYCCL_LAUNCH_BOUNDS __launch_bounds__(512)

// The 16-byte vector every access moves (a plain struct: HIP's uint4 is a template wrapper).
struct alignas(16) anyccl_vec16 {
    uint32_t x, y, z, w;
};

// Storage types of the element types (f16 and bf16 accumulate in f32). bf16 is its bits, converted by hand below,
// which needs no bf16 header and so builds with every hipcc.
typedef float anyccl_f32;
typedef _Float16 anyccl_f16;
struct anyccl_bf16 {
    uint16_t bits;
};

// A store with release semantics at system scope: on gfx90a, `buffer_wbl2` (write L2 back) then the store, which
// the code-object test checks in every kernel.
__device__ __forceinline__ void anyccl_st_release_sys(uint32_t* addr, uint32_t v) {
    __hip_atomic_store(addr, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}

// A load with acquire semantics at system scope: on gfx90a, the load then `buffer_invl2` (invalidate L2).
__device__ __forceinline__ uint32_t anyccl_ld_acquire_sys(const uint32_t* addr) {
    return __hip_atomic_load(const_cast<uint32_t*>(addr), __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}

// A load that always reaches memory and orders nothing (the abort word, set by the host): a relaxed atomic at
// system scope, so it bypasses the caches a plain volatile load could hit.
__device__ __forceinline__ uint32_t anyccl_ld_volatile(const uint32_t* addr) {
    return __hip_atomic_load(const_cast<uint32_t*>(addr), __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}

// Between two polls of a flag: sleep about 64 clocks, so the poll leaves the memory system to the peers (spinning
// without it over XGMI slows the peer being waited for).
__device__ __forceinline__ void anyccl_spin_pause() { __builtin_amdgcn_s_sleep(1); }

// Push one-shot (push.h): a 16-byte load that always reaches memory (a peer's store is polled for) and the
// 16-byte store peers poll for, as four relaxed 32-bit atomics at system scope each (they bypass the caches a
// plain access could hit or linger in; push.h checks every 32-bit word on its own, so the four need not be one
// access).
__device__ __forceinline__ anyccl_vec16 anyccl_ld_vec_volatile(const anyccl_vec16* p) {
    uint32_t* w = const_cast<uint32_t*>(reinterpret_cast<const uint32_t*>(p));
    anyccl_vec16 v;
    v.x = __hip_atomic_load(w + 0, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    v.y = __hip_atomic_load(w + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    v.z = __hip_atomic_load(w + 2, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    v.w = __hip_atomic_load(w + 3, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    return v;
}
__device__ __forceinline__ void anyccl_st_vec_volatile(anyccl_vec16* p, anyccl_vec16 v) {
    uint32_t* w = reinterpret_cast<uint32_t*>(p);
    __hip_atomic_store(w + 0, v.x, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    __hip_atomic_store(w + 1, v.y, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    __hip_atomic_store(w + 2, v.z, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
    __hip_atomic_store(w + 3, v.w, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}

// Programmatic dependent launch is CUDA's (sm_90+): HIP launches in plain stream order, so both are no-ops.
__device__ __forceinline__ void anyccl_grid_dependency_wait() {}
__device__ __forceinline__ void anyccl_launch_dependents() {}

// The smaller of two sizes.
__device__ __forceinline__ size_t anyccl_min_size(size_t a, size_t b) { return b < a ? b : a; }

__device__ __forceinline__ float anyccl_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

// Round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ uint16_t anyccl_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// Conversions between each element type and the f32 accumulator, one element at a time (f16 and bf16 to f32 are
// exact; back to the element type rounds to nearest even).
template <typename T> struct Elem;
template <> struct Elem<float> {
    __device__ static float get(float v) { return v; }
    __device__ static float put(float f) { return f; }
};
template <> struct Elem<_Float16> {
    __device__ static float get(_Float16 v) { return (float)v; }
    __device__ static _Float16 put(float f) { return (_Float16)f; }
};
template <> struct Elem<anyccl_bf16> {
    __device__ static float get(anyccl_bf16 v) { return anyccl_bf16_to_f32(v.bits); }
    __device__ static anyccl_bf16 put(float f) { return anyccl_bf16{anyccl_f32_to_bf16(f)}; }
};

// f32 arithmetic with one rounding each (round to nearest even) that the compiler never contracts into an fma, and
// an explicit fma: the fused all-reduce + RMSNorm (fused.h) computes the same bits in every kernel and on the host.
// HIP's division and square root are correctly rounded by default (clang's -fhip-fp32-correctly-rounded-divide-sqrt).
__device__ __forceinline__ float anyccl_fadd_rn(float a, float b) {
#pragma clang fp contract(off)
    return a + b;
}
__device__ __forceinline__ float anyccl_fmul_rn(float a, float b) {
#pragma clang fp contract(off)
    return a * b;
}
__device__ __forceinline__ float anyccl_fdiv_rn(float a, float b) { return a / b; }
__device__ __forceinline__ float anyccl_fsqrt_rn(float a) { return sqrtf(a); }
__device__ __forceinline__ float anyccl_fma_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// Lane `lane ^ mask` of the 32 consecutive threads this one belongs to (half a 64-wide wavefront).
__device__ __forceinline__ float anyccl_shfl_xor32(float v, int mask) { return __shfl_xor(v, mask, 32); }

// Lane `lane ^ mask` within this thread's aligned group of `width` consecutive lanes (a power of two, 2..=32): only
// the group's lanes need to be active (they read only each other).
__device__ __forceinline__ float anyccl_shfl_xor_group(float v, int mask, int width) { return __shfl_xor(v, mask, width); }

// fp8 e4m3 (OCP "fn": bias 7, max 448, NaN 0x7f) for the quantized all-reduce (quant.h), converted by hand: AMD's
// hardware fp8 on gfx942 is the "fnuz" variant (another bias, no negative zero), so the exchanged format stays the
// one the CUDA kernels and the host model use. Round to nearest even, saturated to ±448, NaN stays NaN.
__device__ __forceinline__ uint32_t anyccl_e4m3_encode1(float f) {
    const uint32_t u = __float_as_uint(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
    if (a >= 0x43e00000u) return sign | 0x7eu; // >= 448, and infinity: the largest finite code
    if (a >= 0x3c800000u) {                    // >= 2^-6: a normal e4m3 number
        uint32_t r = a - 0x3c000000u;          // exponent bias 127 -> 7
        r += 0x7ffffu + ((r >> 20) & 1u);      // round the 20 dropped mantissa bits to nearest even
        return sign | (r >> 20);
    }
    // Subnormal: a multiple of 2^-9 (rintf rounds to nearest even; 8 is the smallest normal, 2^-6).
    return sign | (uint32_t)(int)rintf(__uint_as_float(a) * 512.0f);
}
__device__ __forceinline__ float anyccl_e4m3_decode1(uint32_t c) {
    const uint32_t sign = (c & 0x80u) << 24;
    const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7fc00000u);
    const float v = e == 0u ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return __uint_as_float(__float_as_uint(v) | sign);
}
__device__ __forceinline__ uint32_t anyccl_e4m3x2_encode(float a, float b) {
    return anyccl_e4m3_encode1(a) | (anyccl_e4m3_encode1(b) << 8);
}
__device__ __forceinline__ void anyccl_e4m3x2_decode(uint16_t codes, float* v) {
    v[0] = anyccl_e4m3_decode1(codes & 0xffu);
    v[1] = anyccl_e4m3_decode1((uint32_t)codes >> 8);
}
