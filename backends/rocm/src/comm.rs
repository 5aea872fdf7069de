//! The ROCm communicator: the generic GPU communicator ([`anyccl_gpu::GpuComm`]) on the HIP platform
//! ([`crate::platform::Hip`]): RCCL collectives through the shared CCL rank, symmetric windows where RCCL has them
//! and cuMem is on, and the HIP one-shot / two-shot kernels over peer access (one process) or HIP IPC handles
//! (one process per GPU), with graph buffers and the abort word, under the HIP capture rules.

pub use anyccl_gpu::comm::{DEFAULT_CUSTOM_MAX_BLOCKS, DEFAULT_CUSTOM_MAX_BYTES};

pub use crate::platform::ALGORITHMS;

/// One rank of a ROCm communicator: `RocmComm::init_all(lib, &devices, caps)` (one process, peer access),
/// `RocmComm::init_rank(lib, device, world, rank, &id, caps)` then `enable_custom_ipc(bootstrap)` (one process per
/// GPU, [`crate::bootstrap`]), `symmetric_buffer`, `ccl()`.
pub type RocmComm = anyccl_gpu::GpuComm<crate::platform::Hip>;

/// Device memory from `ncclMemAlloc`, registered as a symmetric window ([`RocmComm::symmetric_buffer`]).
pub type SymmetricBuffer = anyccl_gpu::comm::SymmetricBuffer<crate::platform::Hip>;
