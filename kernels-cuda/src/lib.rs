//! anyccl-kernels-cuda: CUDA C++ all-reduce kernels, compiled by nvcc at build time (see `build.rs`) and embedded
//! as cubins for sm_80 and sm_90 (sm_100 where the nvcc supports it).
//!
//! Kernels (`cuda/allreduce.cu`, one source for every dtype and for real and emulated ranks):
//! `anyccl_one_shot_{f32,f16,bf16}` and `anyccl_two_shot_{f32,f16,bf16}`; the NVLS variants
//! `anyccl_nvls_{zero_copy,warp_pipeline,block_pipeline}_{emu,mc}_{dtype}`, written once over a switch-channel
//! primitive (reduce-load, broadcast-store, signal/wait) with two implementations: `mc` uses
//! `multimem.ld_reduce`/`multimem.st`/`multimem.red` on multicast addresses (sm_90+), `emu` emulates them with
//! unicast loads and stores through every rank's pointer and per-peer flags.
//! [`NOT_BUILT`] says why a build has no kernels (no nvcc at build time).
#![forbid(unsafe_code)]

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// Most ranks one launch handles.
pub const MAX_RANKS: usize = 8;
/// Most blocks per launch (the flag arrays are sized for it).
pub const MAX_BLOCKS: usize = 128;
/// Bytes of one rank's flag array: `MAX_BLOCKS × MAX_RANKS` barrier slots, then `MAX_BLOCKS` epoch counters, then
/// `MAX_BLOCKS` arrival counters of the multicast barrier, then the abort word ([`ABORT_WORD_OFFSET`]) and padding
/// to 16 bytes, 32 bits each. Zero it once before first use.
pub const FLAG_BYTES: usize = ABORT_WORD_OFFSET + 16;
/// Byte offset of the abort word in a rank's flag array. Non-zero tells that rank's kernels to stop waiting for
/// peers: a barrier that has spun 1024 times without its peer checks it every 1024 spins, and the kernel then runs
/// to its end with garbage results. Set it (from a stream other than the stuck one) when a wait gave up on a dead
/// peer, so the kernel ends and the GPU's memory can be freed.
pub const ABORT_WORD_OFFSET: usize = (MAX_BLOCKS * MAX_RANKS + 2 * MAX_BLOCKS) * 4;
/// Bytes every vector access moves; message sizes must be multiples of it.
pub const VECTOR_BYTES: usize = 16;

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
