//! anyccl-rocm: the ROCm backend (cargo feature `rocm` of the facade).
//!
//! **Not implemented yet.** It will hold the HIP runtime loaded at run time, the RCCL communicator with RCCL's
//! quirks, and the HIP all-reduce algorithms. Enabling the `rocm` feature today compiles this empty crate in and
//! `anyccl probe` says the backend is not implemented.
#![forbid(unsafe_code)]
