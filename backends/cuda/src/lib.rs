//! anyccl-cuda: the CUDA backend (cargo feature `cuda` of the facade).
//!
//! **Not implemented yet.** It will hold the CUDA driver runtime (through cudarc), the NCCL communicator,
//! symmetric-memory windows, IPC buffers, the multicast object manager and the CUDA all-reduce algorithms.
//! Enabling the `cuda` feature today compiles this empty crate in and `anyccl probe` says the backend is not
//! implemented; nothing pretends to run on a GPU.
#![forbid(unsafe_code)]
