// anyccl kernels, host side of the vendor layer: everything allreduce.h needs, spelled for a C++ compiler targeting
// the CPU, so the test fakes (testkit's fake CUDA driver and fake HIP runtime) run the very kernel source the GPUs
// run instead of a re-implementation of it. The twins are vendor_cuda.h and vendor_hip.h; all three define the same
// names (see allreduce.h, "Vendor layer").
//
// The execution model comes from a runner that defines the anyccl_host_* functions below (testkit/c/host_kernels.cpp):
// the threads of a block are coroutines of one OS thread, switched at __syncthreads, at the shuffles and at the spin
// pause between two polls of a flag; threadIdx, blockIdx, blockDim and gridDim are the running thread's. Memory a
// peer polls (flags, push slots) is accessed with the C11 atomics the GPU orders it with; `__shared__` variables
// are thread-local statics, private to the block the OS thread runs. Compile with -ffp-contract=off and
// -fno-strict-aliasing (the kernels read vectors as element arrays).

#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static thread_local
#define ANYCCL_LAUNCH_BOUNDS

// Blocks of up to 512 threads, in x only (the launchers' grids).
struct anyccl_dim3 {
    unsigned x, y, z;
};
extern thread_local anyccl_dim3 threadIdx, blockIdx, blockDim, gridDim;

extern "C" {
// Waits until every thread of the block has called it.
void anyccl_host_syncthreads(void);
// Between two polls of a flag: lets the block's other threads, and the peers, run.
void anyccl_host_spin_pause(void);
// `v` of lane `lane ^ mask` within this thread's aligned group of `width` threads (all of them call it).
float anyccl_host_shfl_xor(float v, int mask, int width);
// A relaxed load that reaches memory (the abort word, the push epoch); the runner notes a set abort word.
uint32_t anyccl_host_ld_volatile(const uint32_t* addr);
// A store a peer may be polling for was made (wakes waiting peers).
void anyccl_host_stored(void);
}

#define __syncthreads anyccl_host_syncthreads

// The 16-byte vector every access moves.
struct alignas(16) anyccl_vec16 {
    uint32_t x, y, z, w;
};
struct uint2 {
    uint32_t x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }

// Storage types of the element types (f16 and bf16 accumulate in f32); bf16 is its bits, converted by hand below
// as on HIP.
typedef float anyccl_f32;
typedef _Float16 anyccl_f16;
struct anyccl_bf16 {
    uint16_t bits;
};

inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Release store and acquire load of a 32-bit flag; a volatile load (the runner's, above).
inline void anyccl_st_release_sys(uint32_t* addr, uint32_t v) {
    __atomic_store_n(addr, v, __ATOMIC_RELEASE);
    anyccl_host_stored();
}
inline uint32_t anyccl_ld_acquire_sys(const uint32_t* addr) { return __atomic_load_n(addr, __ATOMIC_ACQUIRE); }
inline uint32_t anyccl_ld_volatile(const uint32_t* addr) { return anyccl_host_ld_volatile(addr); }
inline void anyccl_spin_pause() { anyccl_host_spin_pause(); }

// Push one-shot (push.h): four relaxed 32-bit atomics each way, as on HIP (push.h checks every word on its own).
inline anyccl_vec16 anyccl_ld_vec_volatile(const anyccl_vec16* p) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
    anyccl_vec16 v;
    v.x = __atomic_load_n(w + 0, __ATOMIC_ACQUIRE);
    v.y = __atomic_load_n(w + 1, __ATOMIC_ACQUIRE);
    v.z = __atomic_load_n(w + 2, __ATOMIC_ACQUIRE);
    v.w = __atomic_load_n(w + 3, __ATOMIC_ACQUIRE);
    return v;
}
inline void anyccl_st_vec_volatile(anyccl_vec16* p, anyccl_vec16 v) {
    uint32_t* w = reinterpret_cast<uint32_t*>(p);
    __atomic_store_n(w + 0, v.x, __ATOMIC_RELEASE);
    __atomic_store_n(w + 1, v.y, __ATOMIC_RELEASE);
    __atomic_store_n(w + 2, v.z, __ATOMIC_RELEASE);
    __atomic_store_n(w + 3, v.w, __ATOMIC_RELEASE);
    anyccl_host_stored();
}

// push_end's arrival counter.
inline uint32_t atomicAdd(uint32_t* p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }

// Programmatic dependent launch is CUDA's: kernels run in stream order here.
inline void anyccl_grid_dependency_wait() {}
inline void anyccl_launch_dependents() {}

inline size_t anyccl_min_size(size_t a, size_t b) { return b < a ? b : a; }

inline float anyccl_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t anyccl_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// Conversions between each element type and the f32 accumulator (f16 and bf16 to f32 are exact; back to the element
// type rounds to nearest even).
template <typename T> struct Elem;
template <> struct Elem<float> {
    static float get(float v) { return v; }
    static float put(float f) { return f; }
};
template <> struct Elem<_Float16> {
    static float get(_Float16 v) { return (float)v; }
    static _Float16 put(float f) { return (_Float16)f; }
};
template <> struct Elem<anyccl_bf16> {
    static float get(anyccl_bf16 v) { return anyccl_bf16_to_f32(v.bits); }
    static anyccl_bf16 put(float f) { return anyccl_bf16{anyccl_f32_to_bf16(f)}; }
};

// f32 arithmetic with one rounding each (the build turns fma contraction off) and an explicit fma.
inline float anyccl_fadd_rn(float a, float b) { return a + b; }
inline float anyccl_fmul_rn(float a, float b) { return a * b; }
inline float anyccl_fdiv_rn(float a, float b) { return a / b; }
inline float anyccl_fsqrt_rn(float a) { return sqrtf(a); }
inline float anyccl_fma_rn(float a, float b, float c) { return fmaf(a, b, c); }

inline float anyccl_shfl_xor32(float v, int mask) { return anyccl_host_shfl_xor(v, mask, 32); }
inline float anyccl_shfl_xor_group(float v, int mask, int width) { return anyccl_host_shfl_xor(v, mask, width); }

// fp8 e4m3 (OCP "fn": bias 7, max 448, NaN 0x7f) for the quantized all-reduce (quant.h), converted by hand as on
// HIP. Round to nearest even, saturated to ±448, NaN stays NaN.
inline uint32_t anyccl_e4m3_encode1(float f) {
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
inline float anyccl_e4m3_decode1(uint32_t c) {
    const uint32_t sign = (c & 0x80u) << 24;
    const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7fc00000u);
    const float v = e == 0u ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return __uint_as_float(__float_as_uint(v) | sign);
}
inline uint32_t anyccl_e4m3x2_encode(float a, float b) {
    return anyccl_e4m3_encode1(a) | (anyccl_e4m3_encode1(b) << 8);
}
inline void anyccl_e4m3x2_decode(uint16_t codes, float* v) {
    v[0] = anyccl_e4m3_decode1(codes & 0xffu);
    v[1] = anyccl_e4m3_decode1((uint32_t)codes >> 8);
}
