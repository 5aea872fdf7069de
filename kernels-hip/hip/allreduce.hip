// anyccl custom all-reduce kernels for AMD GPUs: the one-shot and two-shot all-reduce written once for every vendor
// in kernels-common/include/anyccl/allreduce.h (the algorithm, barrier, epochs, input tables, abort word and
// two-shot rounds the CUDA kernels run on NVIDIA GPUs), instantiated over the HIP vendor layer: scoped atomics
// (on gfx90a a system-scope release is `buffer_wbl2` + store, an acquire is load + `buffer_invl2`, which the
// code-object test checks in every kernel), s_sleep between polls, a plain 16-byte vector struct, and bf16
// converted by hand.

#include "anyccl/vendor_hip.h"
#include "anyccl/allreduce.h"

ANYCCL_ALLREDUCE_KERNELS(f32, anyccl_f32)
ANYCCL_ALLREDUCE_KERNELS(f16, anyccl_f16)
ANYCCL_ALLREDUCE_KERNELS(bf16, anyccl_bf16)

// Fused all-reduce + residual add + RMSNorm (one-shot, two-shot) and the separate RMSNorm kernel: fused.h.
#include "anyccl/fused.h"
ANYCCL_FUSED_KERNELS(f16, anyccl_f16)
ANYCCL_FUSED_KERNELS(bf16, anyccl_bf16)

// Push-mode one-shot (Lamport sentinels; programmatic dependent launch is a no-op on HIP), shared with CUDA.
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
