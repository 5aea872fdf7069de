//! anyccl-lab: measurement and test support that is not part of the product (not published).
//!
//! - [`emulated`]: N ranks emulated on one GPU (N buffer sets on N streams of one device), for the custom kernels'
//!   GPU tests and benchmarks; [`emulated_fused`]: the same for the fused all-reduce + residual add + RMSNorm and
//!   its unfused baseline; [`emulated_quant`] adds the quantized two-shot; [`push`]: the push one-shot and
//!   two-shot on emulated ranks.
//! - the tool binaries (`src/bin`): `anyccl-cuda-emulated-bench`, `anyccl-cuda-fused-bench`,
//!   `anyccl-cuda-push-bench`, `anyccl-cuda-quant-bench` (kernel benchmarks on emulated ranks) and
//!   `anyccl-cuda-ipc-check` (inter-process device memory, the conformance suite one process per rank, and
//!   peer-failure checks).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod emulated;
pub mod emulated_fused;
pub mod emulated_quant;
pub mod push;
