//! anyccl-ccl: the runtime loader for the `nccl.h` ABI, shared by NCCL and RCCL.
//!
//! **Not implemented yet** (tracked as the loader issue). It will find the installed library, resolve every
//! symbol once at load time (required ones as plain function pointers, optional ones as `Option`), decode the
//! version, tell NCCL from RCCL, and derive the capability report with reasons. Nothing here loads anything today.
#![forbid(unsafe_code)]
