//! anyccl-kernels-hip: the HIP all-reduce kernels (one-shot, two-shot), compiled by hipcc at build time (see
//! `build.rs`) and embedded as AMDGPU code objects for gfx90a and gfx942 where the hipcc knows them.
//!
//! Kernels (`hip/allreduce.hip`, [`KERNELS`]): the one-shot and two-shot all-reduce of the source shared with the
//! CUDA kernels (`anyccl-kernels-common`): `anyccl_{one_shot,two_shot}[_table]_{f32,f16,bf16}`, with the same
//! parameters, flag layout ([`FLAG_BYTES`], with the abort word at [`ABORT_WORD_OFFSET`]), input tables, two-shot
//! rounds and limits as the CUDA kernels; and the quantized two-shot ([`QUANT_KERNELS`]). [`NOT_BUILT`] says why a build has no kernels; [`SKIPPED_TARGETS`] which
//! targets this hipcc could not build, and why.
#![forbid(unsafe_code)]

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

pub use anyccl_kernels_common::{ABORT_WORD_OFFSET, FLAG_BYTES, MAX_BLOCKS, MAX_RANKS, VECTOR_BYTES};

/// The all-reduce kernels of the shared source every code object holds, with the names and parameters of the CUDA
/// kernels.
pub const KERNELS: [&str; 12] = anyccl_kernels_common::ALLREDUCE_KERNELS;

/// The fused all-reduce + residual add + RMSNorm kernels and the separate RMSNorm kernel every code object also
/// holds (`anyccl-kernels-common`'s `fused.h`, the same names and parameters as the CUDA kernels).
pub const FUSED_KERNELS: [&str; 10] = anyccl_kernels_common::FUSED_KERNELS;

/// The push-mode one-shot kernels every code object also holds (`anyccl-kernels-common`'s `push.h`, the same names
/// and parameters as on CUDA; programmatic dependent launch is a no-op here).
pub const PUSH_KERNELS: [&str; 3] = anyccl_kernels_common::push::PUSH_KERNELS;

/// The push two-shot kernels every code object also holds (`push.h`, the push one-shot's parameters).
pub const PUSH_TWO_SHOT_KERNELS: [&str; 3] = anyccl_kernels_common::push::PUSH_TWO_SHOT_KERNELS;

/// The fused push one-shot kernels every code object also holds (`anyccl-kernels-common`'s `fused_push.h`, the same
/// names and parameters as on CUDA).
pub const FUSED_PUSH_KERNELS: [&str; 2] = anyccl_kernels_common::fused_push::FUSED_PUSH_KERNELS;

/// The quantized two-shot kernels of the shared source (`quant.h`) every code object also holds, with the names and
/// parameters ([`anyccl_kernels_common::QUANT_PARAMS`]) of the CUDA kernels.
pub const QUANT_KERNELS: [&str; 6] = anyccl_kernels_common::QUANT_KERNELS;

/// The code object of `source` for GPU target `arch` (`"gfx90a"`, `"gfx942"`; feature suffixes such as
/// `":sramecc+:xnack-"` are ignored). AMDGPU code objects run only on the exact target they were built for.
pub fn code_object_for(source: &str, arch: &str) -> Option<&'static [u8]> {
    let base = arch.split(':').next().unwrap_or(arch);
    CODE_OBJECTS.iter().find(|(s, a, _)| *s == source && *a == base).map(|(_, _, b)| *b)
}

/// Why `arch` has no code object in this build, or `None` when it has one.
pub fn why_not(arch: &str) -> Option<String> {
    let base = arch.split(':').next().unwrap_or(arch);
    if code_object_for("allreduce", base).is_some() {
        return None;
    }
    if let Some(why) = NOT_BUILT {
        return Some(format!("HIP kernels not compiled in: {why}"));
    }
    match SKIPPED_TARGETS.iter().find(|(a, _)| *a == base) {
        Some((_, why)) => Some(format!("HIP kernels not built for {base}: {why}")),
        None => Some(format!("HIP kernels are not built for {base} (built: {})", built_targets().join(", "))),
    }
}

/// The targets this build embeds code objects for.
pub fn built_targets() -> Vec<&'static str> {
    CODE_OBJECTS.iter().map(|(_, a, _)| *a).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_built_or_say_why() {
        match NOT_BUILT {
            Some(why) => {
                assert!(CODE_OBJECTS.is_empty());
                assert!(why.contains("hipcc"), "{why}");
                assert!(why_not("gfx90a").is_some_and(|w| w.starts_with("HIP kernels not compiled in")));
                // CI installs hipcc; a build there without kernels is a failure, not a skip.
                assert!(std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_none(), "kernels required but not built: {why}");
            }
            None => {
                let co = code_object_for("allreduce", "gfx90a:sramecc+:xnack-").expect("a gfx90a code object");
                assert_eq!(&co[..4], b"\x7fELF", "raw AMDGPU ELF, not an offload bundle");
                assert_eq!(co[18], 0xe0, "e_machine is EM_AMDGPU (224)");
                assert!(why_not("gfx90a").is_none());
                assert!(why_not("gfx1100").is_some());
                for (arch, why) in SKIPPED_TARGETS {
                    assert!(!why.is_empty(), "{arch} skipped without a reason");
                }
            }
        }
    }
}
