//! anyccl-kernels-cuda: CUDA C++ all-reduce kernels, compiled by nvcc at build time (see `build.rs`) and embedded
//! as cubins for sm_80 and sm_90 (sm_100 where the nvcc supports it).
//!
//! Kernels (`cuda/allreduce.cu`, one source for every dtype and for real and emulated ranks): the one-shot and
//! two-shot all-reduce of the source shared with the HIP kernels (`anyccl-kernels-common`, whose
//! [`ALLREDUCE_KERNELS`](anyccl_kernels_common::ALLREDUCE_KERNELS) lists them, and whose flag layout is re-exported
//! here: [`FLAG_BYTES`], [`ABORT_WORD_OFFSET`]); the CUDA-only NVLS variants
//! `anyccl_nvls_{zero_copy,warp_pipeline,block_pipeline}_{emu,mc}_{dtype}`, written once over a switch-channel
//! primitive (reduce-load, broadcast-store, signal/wait) with two implementations: `mc` uses
//! `multimem.ld_reduce`/`multimem.st`/`multimem.red` on multicast addresses (sm_90+), `emu` emulates them with
//! unicast loads and stores through every rank's pointer and per-peer flags.
//! [`NOT_BUILT`] says why a build has no kernels (no nvcc at build time).
#![forbid(unsafe_code)]

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The fused push one-shot's kernels and parameters (`fused_push.h`, built into the same cubins).
pub use anyccl_kernels_common::fused_push;
/// The push-mode one-shot's kernels, parameters and receive-buffer layout (`push.h`, built into the same cubins).
pub use anyccl_kernels_common::push;
pub use anyccl_kernels_common::{ABORT_WORD_OFFSET, FLAG_BYTES, MAX_BLOCKS, MAX_RANKS, VECTOR_BYTES};

/// The cubin of `source` best suited to compute capability `major.minor`: the highest embedded arch not above
/// it (machine code for sm_90 runs on sm_90 only; sm_80 code runs on sm_8x).
pub fn cubin_for(source: &str, major: i32, minor: i32) -> Option<&'static [u8]> {
    let cc = major * 10 + minor;
    CUBINS
        .iter()
        .filter(|(s, _, _)| *s == source)
        .filter_map(|(_, arch, bytes)| {
            arch.strip_prefix("sm_").and_then(|a| a.parse::<i32>().ok()).map(|a| (a, *bytes))
        })
        .filter(|(a, _)| *a <= cc && (*a / 10 == cc / 10 || *a == 80 && cc / 10 == 8))
        .max_by_key(|(a, _)| *a)
        .map(|(_, b)| b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_built_or_say_why() {
        match NOT_BUILT {
            Some(why) => {
                assert!(CUBINS.is_empty());
                assert!(why.contains("nvcc"), "{why}");
                // CI installs nvcc; a build there without kernels is a failure, not a skip.
                assert!(std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_none(), "kernels required but not built: {why}");
            }
            None => {
                for arch in ["sm_80", "sm_90"] {
                    let c = CUBINS.iter().find(|(s, a, _)| *s == "allreduce" && *a == arch);
                    let (_, _, bytes) = c.unwrap_or_else(|| panic!("no {arch} cubin"));
                    assert_eq!(&bytes[..4], b"\x7fELF", "{arch}: cubins are ELF machine code, not PTX");
                }
                assert!(cubin_for("allreduce", 9, 0).is_some());
                assert!(cubin_for("allreduce", 8, 6).is_some());
                assert!(cubin_for("allreduce", 7, 5).is_none());
            }
        }
    }
}
