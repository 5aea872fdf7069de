//! Test support of the anyccl workspace, shared by the test targets of every crate as a dev-dependency (never
//! published):
//!
//! - [`fake_ccl`], [`fake_hip`], [`fake_cuda`] (feature `fakes`): fake NCCL/RCCL libraries with the symbol set of
//!   one release, the fake HIP runtime and the fake CUDA driver built over it, compiled from the C sources in
//!   `testkit/c` with the system `cc` when a test first asks for them (a missing compiler fails the test with its
//!   reason), and the fake runtime's test interface ([`fake_hip::FakeHip`]: calls, violations, launch records);
//! - [`launcher`]: a stand-in for `torchrun` that starts the calling test binary once per rank;
//! - [`hostile_child`] (feature `hostile`): planted folders and libraries for the hostile library-search tests;
//! - [`fused_case`] (feature `fused`): inputs of the fused all-reduce + RMSNorm and the host reference's outputs;
//! - [`gpu_suite`] (feature `gpu`): the GPU-communicator cases written once for every `GpuPlatform`, run on the
//!   fake CUDA driver and the fake HIP runtime.
#![allow(missing_docs, clippy::unwrap_used)]

#[cfg(feature = "fakes")]
pub mod fake_ccl;
#[cfg(feature = "fakes")]
pub mod fake_cuda;
#[cfg(feature = "fakes")]
pub mod fake_hip;
#[cfg(feature = "fused")]
pub mod fused_case;
#[cfg(feature = "gpu")]
pub mod gpu_suite;
#[cfg(feature = "hostile")]
pub mod hostile_child;
pub mod launcher;

/// The folder the fakes are compiled into and the hostile cases plant into: `anyccl-testkit` beside the build
/// profile's `build` folder (`target/debug/anyccl-testkit`), short enough for the Unix socket paths the hostile
/// cases bind (108 bytes). `OUT_DIR` is `<target>/<profile>/build/anyccl-testkit-<hash>/out`.
pub fn scratch_dir() -> std::path::PathBuf {
    let out = std::path::Path::new(env!("OUT_DIR"));
    out.ancestors().nth(3).unwrap_or(out).join("anyccl-testkit")
}
