//! Inputs of custom all-reduces captured in CUDA graphs ("graph buffers"): the generic tables and registration of
//! [`anyccl_gpu::graph_inputs`] on the CUDA platform (legacy IPC handles between processes, plain pointers
//! within one; inputs known by pointer and `CU_POINTER_ATTRIBUTE_BUFFER_ID`).

pub use anyccl_gpu::graph_inputs::{GraphRegistration, Transport, MAX_GRAPH_INPUTS};

/// One rank's graph-input tables and registrations.
pub type GraphInputs = anyccl_gpu::GraphInputs<crate::platform::Cuda>;
