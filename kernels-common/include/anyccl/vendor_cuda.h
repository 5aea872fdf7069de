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

// Push one-shot (push.h): a 16-byte load that always reaches memory (a peer's store is polled for: ld.volatile,
// relaxed at system scope, never an L1 hit), and the 16-byte store peers poll for (st.volatile, likewise).
__device__ __forceinline__ anyccl_vec16 anyccl_ld_vec_volatile(const anyccl_vec16* p) {
    anyccl_vec16 v;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ void anyccl_st_vec_volatile(anyccl_vec16* p, anyccl_vec16 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Programmatic dependent launch (sm_90+; nothing on older archs, and nothing when the kernel was launched without
// the programmatic-stream-serialization attribute). anyccl_grid_dependency_wait: griddepcontrol.wait, returns
// once the grids this one depends on (the previous kernel of the stream) have completed and their memory is
// visible; nothing the previous kernel writes may be read, and nothing peers read may be written, before it.
// anyccl_launch_dependents: griddepcontrol.launch_dependents, lets the next kernel of the stream start launching
// (it still waits for this grid's completion in its own anyccl_grid_dependency_wait).
__device__ __forceinline__ void anyccl_grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void anyccl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// f32 arithmetic with one rounding each (round to nearest even) that the compiler never contracts into an fma, and
// an explicit fma: the fused all-reduce + RMSNorm (fused.h) computes the same bits in every kernel and on the host.
__device__ __forceinline__ float anyccl_fadd_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float anyccl_fmul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float anyccl_fdiv_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float anyccl_fsqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ float anyccl_fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }

// Lane `lane ^ mask` of the 32 consecutive threads this one belongs to (every one of them calls it).
__device__ __forceinline__ float anyccl_shfl_xor32(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

// Lane `lane ^ mask` within this thread's aligned group of `width` consecutive lanes (a power of two, 2..=32, of
// a one-dimensional block): only the group's lanes need to call it together (the quantized kernels' groups of a
// block may take different branches).
__device__ __forceinline__ float anyccl_shfl_xor_group(float v, int mask, int width) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned group = width >= 32 ? 0xffffffffu : ((1u << width) - 1u) << (lane & ~(unsigned)(width - 1));
    return __shfl_xor_sync(group, v, mask, width);
}

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
