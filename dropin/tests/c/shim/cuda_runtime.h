/* Stand-in for the CUDA runtime header so that the real nccl.h compiles with the system C compiler and no CUDA
 * toolkit: nccl.h uses two CUDA types, cudaStream_t and (2.31 and later, in ncclCollConfig_t) cudaEvent_t, opaque
 * pointers. CUDART_VERSION stays undefined, so nccl.h
 * includes no bfloat16 or fp8 header either. Like the real header, it brings size_t (stddef.h). */
#ifndef ANYCCL_SHIM_CUDA_RUNTIME_H
#define ANYCCL_SHIM_CUDA_RUNTIME_H
#include <stddef.h>
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
