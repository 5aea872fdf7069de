// anyccl kernels, CUDA side of the vendor layer: everything allreduce.h needs that CUDA and HIP spell differently.
// The HIP twin is vendor_hip.h; both define the same names (see allreduce.h, "Vendor layer").

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// Occupancy every kernel is built for: 512 threads, two blocks per SM (so at most 64 registers per thread; the
// emulated ranks and the communicator size their grids for it).
#define ANYCCL_LAUNCH_BOUNDS __launch_bounds__(512, 2)

// The 16-byte vector every access moves.
typedef uint4 anyccl_vec16;

// Storage types of the element types (f16 and bf16 accumulate in f32).
typedef float anyccl_f32;
typedef __half anyccl_f16;
typedef __nv_bfloat16 anyccl_bf16;

// A store with release semantics at system scope (STG.E.STRONG.SYS after the fence it implies).
__device__ __forceinline__ void anyccl_st_release_sys(uint32_t* addr, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

// A load with acquire semantics at system scope (LDG.E.STRONG.SYS).
__device__ __forceinline__ uint32_t anyccl_ld_acquire_sys(const uint32_t* addr) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// A load that always reaches memory and orders nothing (the abort word, set by the host).
__device__ __forceinline__ uint32_t anyccl_ld_volatile(const uint32_t* addr) {
    return *reinterpret_cast<const volatile uint32_t*>(addr);
}

// Between two polls of a flag: nothing on NVIDIA (the spin is an acquire load from another GPU's memory, slow
// enough on its own).
__device__ __forceinline__ void anyccl_spin_pause() {}

// The smaller of two sizes (CUDA's min, which compiles to a 64-bit min instruction).
__device__ __forceinline__ size_t anyccl_min_size(size_t a, size_t b) { return min(a, b); }

// Conversions between each element type and the f32 accumulator, one element at a time (f16 and bf16 to f32 are
// exact; back to the element type rounds to nearest even).
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

// fp8 e4m3 (OCP "fn": bias 7, max 448, NaN 0x7f) for the quantized all-reduce (quant.h): two f32 to two codes
// (round to nearest even, saturated to ±448, NaN stays NaN; `a` in the low byte), and two codes back to f32 (exact).
// sm_89+ converts in hardware (cvt.rn.satfinite.e4m3x2.f32, cvt.rn.f16x2.e4m3x2); older archs get cuda_fp8.h's
// software conversion, which rounds the same way.
__device__ __forceinline__ uint32_t anyccl_e4m3x2_encode(float a, float b) {
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ void anyccl_e4m3x2_decode(uint16_t codes, float* v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)codes, __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    v[0] = f.x;
    v[1] = f.y;
}
