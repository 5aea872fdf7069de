//! The CUDA communicator: the generic GPU communicator ([`anyccl_gpu::GpuComm`]) on the CUDA platform
//! ([`crate::platform::Cuda`]): NCCL collectives through the loader's table, algorithm eligibility, symmetric
//! windows, and the custom one-shot / two-shot kernels over peer access or legacy IPC handles.

pub use anyccl_gpu::comm::{DEFAULT_CUSTOM_MAX_BLOCKS, DEFAULT_CUSTOM_MAX_BYTES};

pub use crate::platform::ALGORITHMS;

/// One rank of a CUDA communicator: `CudaComm::init_all(lib, &ordinals, caps)` (one process, peer access),
/// `CudaComm::init_rank(lib, ordinal, world, rank, &id, caps)` then `enable_custom_ipc(bootstrap)` (one process per
/// GPU, [`crate::bootstrap`]), `symmetric_buffer`, `ccl()`.
pub type CudaComm = anyccl_gpu::GpuComm<crate::platform::Cuda>;

/// Device memory from `ncclMemAlloc`, registered as a symmetric window on its communicator
/// ([`CudaComm::symmetric_buffer`]).
pub type SymmetricBuffer = anyccl_gpu::comm::SymmetricBuffer<crate::platform::Cuda>;
