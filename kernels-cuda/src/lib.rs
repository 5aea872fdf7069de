//! anyccl-kernels-cuda: CUDA C++ all-reduce kernels (one-shot, two-shot, NVLS variants), compiled by nvcc at
//! build time and embedded as cubins.
//!
//! **Not implemented yet**: this crate holds no kernels today.
#![forbid(unsafe_code)]
