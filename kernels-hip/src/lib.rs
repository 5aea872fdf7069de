//! anyccl-kernels-hip: HIP all-reduce kernels (one-shot, two-shot), compiled by hipcc at build time and embedded
//! as code objects.
//!
//! **Not implemented yet**: this crate holds no kernels today.
#![forbid(unsafe_code)]
