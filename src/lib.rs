//! anyccl: one API for GPU collectives on NVIDIA and AMD, with runtime capability probing.
//!
//! This facade re-exports the vendor-neutral core ([`core`]) and the backends compiled in: the host backend
//! ([`host`], feature `host`, on by default), CUDA (feature `cuda`: NCCL, custom kernels; feature `multicast` adds
//! NVLS, see below) and ROCm (feature `rocm`: HIP runtime and RCCL, loaded at run time), and the machine-level
//! capability report
//! ([`report::MachineReport`]). [`dynamic`] chooses the backend at run time: one type-erased communicator
//! ([`AnyCommunicator`]) for code written once for every backend. The `anyccl` command (`probe`, `bench`, `tune`)
//! lives in the `anyccl-cli` crate; this library has no command-line dependencies.
//!
//! # Features
//!
//! - `host` (default): the host backend.
//! - `cuda`: the CUDA backend. `cudarc` adds cudarc's slices and streams as the currency; `cudarc-dynamic-loading`
//!   chooses cudarc's linking and CUDA version for a binary that does not choose them itself.
//! - `multicast` (implies `cuda`, off by default): NVLS, the NVLink SHARP multicast all-reduce plans
//!   (nvls-block-pipeline, nvls-warp-pipeline) and the multicast object manager (`cuda::multicast`,
//!   `cuda::nvls`), for ranks as threads of one process and for one process per GPU. It has been tested against
//!   fake drivers only. Compiled in, it still runs only where every device reports multicast on a CUDA 12.1 or
//!   newer driver, `NCCL_NVLS_ENABLE` is not `0` and `ANYCCL_DISABLE` does not name `multicast`; when any of
//!   these says no, or the feature is off, the capability report says why and no multicast driver call is made.
//! - `rocm`: the ROCm backend.
//!
//! ```
//! use anyccl::core::{DataType, InOut, ReduceOp};
//! use anyccl::host::{communicators, HostBuffer, HostOptions, HostStream};
//!
//! // Two ranks on two threads; each all-reduces its buffer in place.
//! let comms = communicators(2, HostOptions::default()).unwrap();
//! std::thread::scope(|s| {
//!     for mut comm in comms {
//!         s.spawn(move || {
//!             let mut buf = HostBuffer::from_elems(&[anyccl::half::bf16::from_f32(1.5); 8]);
//!             let chosen = comm
//!                 .all_reduce(InOut::InPlace(buf.as_bytes_mut()), 8, DataType::Bf16, ReduceOp::Sum, &HostStream)
//!                 .unwrap();
//!             assert_eq!(buf.to_vec::<anyccl::half::bf16>()[0].to_f32(), 3.0);
//!             println!("rank {} used {} because {}", comm.rank(), chosen.algorithm, chosen.why);
//!         });
//!     }
//! });
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

/// The NCCL/RCCL loader and capability report (`communicators_single_process` and friends take its library), with
/// the GPU engine's device layer and communicator ([`anyccl_gpu`]) under the names they have always had here.
pub mod ccl {
    pub use anyccl_ccl::*;
    /// The GPU engine ([`anyccl_gpu`]): the communicator of both vendors over a per-vendor platform.
    pub use anyccl_gpu as gpu;
    pub use anyccl_gpu::{
        ccl_bootstrap, device, CaptureQueries, CclBootstrap, GpuAllocation, GpuBuffer, GpuRuntime, GpuView, GpuViewMut,
    };
}
/// The vendor-neutral core every backend shares: the [`Communicator`] front door and its validation, data types
/// and operators, errors, the capability model ([`CapabilityReport`]), the algorithm [`Selector`] and the fused
/// all-reduce + RMSNorm. The `anyccl-core` crate; its most used items are also re-exported at this crate's root.
#[doc(inline)]
pub use anyccl_core as core;
pub use anyccl_core::{
    Algorithm, Capabilities, CapabilityReport, Communicator, DataType, Error, InOut, ReduceOp, Result, RmsNormForm,
    RmsNormOutput, RmsNormSelection, RmsNormSpec, Selector,
};
/// The CUDA backend (feature `cuda`): NCCL and the CUDA driver loaded at run time, anyccl's custom all-reduce
/// kernels, graph capture, one process per GPU, and the cudarc interop (feature `cudarc`). The `anyccl-cuda`
/// crate.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
#[doc(inline)]
pub use anyccl_cuda as cuda;
/// The host backend (feature `host`, on by default): ranks as threads over host memory ([`host::communicators`]),
/// or one process per rank over shared memory ([`host::from_env`], [`host::communicator_over`]); no GPU needed.
/// Its calls take [`&host::HostStream`](type@host::HostStream) where the GPU backends take a stream. The
/// `anyccl-host` crate.
#[cfg(feature = "host")]
#[cfg_attr(docsrs, doc(cfg(feature = "host")))]
#[doc(inline)]
pub use anyccl_host as host;
/// The ROCm backend (feature `rocm`): the HIP runtime and RCCL loaded at run time, and anyccl's kernels built by
/// hipcc. The `anyccl-rocm` crate.
#[cfg(feature = "rocm")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocm")))]
#[doc(inline)]
pub use anyccl_rocm as rocm;
/// The fp8 element types ([`float8::F8E4M3`], [`float8::F8E5M2`]) the typed APIs take.
pub use float8;
/// The 16-bit float element types ([`half::f16`], [`half::bf16`]) the typed APIs take.
pub use half;

#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
pub mod dynamic;
pub mod report;

#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
pub use dynamic::{AnyBuffer, AnyCommunicator, AnyEvent, AnyGraph, AnyStream, BackendChoice, BackendKind, DynComm};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust guide's examples (`docs/rust.md`), compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
pub struct RustGuideDoctests;

/// The kernel document's examples (`docs/kernels.md`), compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/kernels.md")]
pub struct KernelsDoctests;

/// The command's document's examples (`docs/cli.md`), compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/cli.md")]
pub struct CliDoctests;
