//! Launch glue for the custom all-reduce kernels of `anyccl-kernels-cuda`, written once for both vendors in
//! [`anyccl_gpu::kernels`] and used here on the CUDA platform: one-shot and two-shot (inputs read directly,
//! through staging the kernel copies into, or through an input table in device memory), and the unicast
//! emulations of the NVLS zero-copy, warp-pipeline and block-pipeline variants.

use anyccl_core::{DataType, Result};

pub use anyccl_gpu::kernels::{input_table, Inputs, Kind, INPUT_TABLE_BYTES, THREADS, TWO_SHOT_ROUND_BYTES};

use crate::platform::Cuda;
use crate::runtime::{CudaStream, DeviceBuffer};

/// The kernels loaded for one device (`CustomKernels::load(&runtime)`).
pub type CustomKernels = anyccl_gpu::CustomKernels<Cuda>;

/// Why the custom kernels cannot run `dtype` × `bytes` for `world` ranks, if they cannot.
pub fn ineligible(dtype: DataType, bytes: usize, world: usize) -> Option<String> {
    anyccl_gpu::kernels::ineligible::<Cuda>(dtype, bytes, world)
}

/// Why the custom kernels cannot serve a communicator of `world` ranks at all, if they cannot.
pub fn unavailable(world: usize) -> Option<String> {
    anyccl_gpu::kernels::unavailable::<Cuda>(world)
}

/// Tells every custom kernel of the rank whose flag array is `flags` to stop waiting for its peers: sets the abort
/// word ([`anyccl_kernels_cuda::ABORT_WORD_OFFSET`]) with `cuStreamWriteValue32` on `stream`, which must not be the
/// stream the kernels are stuck on, and waits for that write (at most `limit`). Kernels launched after it stop at
/// their first barrier that waits long, so the rank's custom kernels are finished with for good: use it once a wait
/// has given up on a peer. Not during capture.
pub fn stop_waiting(flags: &DeviceBuffer, stream: &CudaStream, limit: std::time::Duration) -> Result<()> {
    let runtime = crate::CudaRuntime::from_context(stream.context().clone());
    anyccl_gpu::stop_waiting::<Cuda>(&runtime, flags, stream, limit)
}

#[cfg(test)]
mod tests {
    use anyccl_gpu::kernels::kernel_name;

    use super::*;

    /// Every name looked up at load is a symbol of every all-reduce cubin built (the NVLS emulations' too).
    #[test]
    fn every_kernel_name_is_a_symbol_of_the_cubins() {
        let mut names = Vec::new();
        for kind in Kind::ALL {
            for table in [false, true] {
                for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
                    names.extend(kernel_name(kind, dtype, table));
                }
            }
        }
        // One-shot and two-shot with and without a table, the three NVLS emulations without: 7 per type.
        assert_eq!(names.len(), 7 * 3);
        let required = std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_some();
        if let Some(why) = anyccl_kernels_cuda::NOT_BUILT {
            assert!(!required, "kernels missing in a run that requires them: {why}");
            eprintln!("NOT CHECKED against the cubins: {why} (CI builds them)");
            return;
        }
        let cubins: Vec<_> = anyccl_kernels_cuda::CUBINS.iter().filter(|(src, _, _)| *src == "allreduce").collect();
        assert!(!cubins.is_empty());
        for (_, arch, bytes) in cubins {
            for name in &names {
                let sym = format!("{name}\0");
                assert!(bytes.windows(sym.len()).any(|w| w == sym.as_bytes()), "{arch}: no symbol {name}");
            }
        }
    }
}
