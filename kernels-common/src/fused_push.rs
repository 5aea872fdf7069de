//! The fused push one-shot of `include/anyccl/fused_push.h`: the push one-shot's exchange (receive buffers,
//! Lamport sentinels, no barrier round; [`crate::push`]) and the residual add + RMSNorm of the fused kernels
//! (`fused.h`) in one kernel. Its results are bit for bit the fused one-shot's; its messages (tokens × hidden ×
//! element size) are at most [`crate::push::PUSH_MAX_BYTES`], and it shares the push one-shot's receive buffers.

use crate::{Param, NORM_ARGS_BYTES};

/// The fused push kernels, for f16 and bf16 (the types of [`crate::FUSED_DTYPES`], in that order).
pub const FUSED_PUSH_KERNELS: [&str; 2] = ["anyccl_fused_push_one_shot_f16", "anyccl_fused_push_one_shot_bf16"];

/// The parameters of every fused push kernel, in order: this rank's input rows, the add + RMSNorm arguments (48
/// bytes by value), every rank's receive buffer (8 pointers by value), this rank's flag array (its abort word),
/// rank, world.
pub const FUSED_PUSH_PARAMS: [Param; 6] = [
    ("in", 0, 8),
    ("args", 8, NORM_ARGS_BYTES),
    ("recv", 56, 64),
    ("my_flags", 120, 8),
    ("rank", 128, 4),
    ("world", 132, 4),
];

/// The kernel's source, `include/anyccl/fused_push.h`.
pub const FUSED_PUSH_HEADER: &str = include_str!("../include/anyccl/fused_push.h");

/// The fused push kernel of element type `dtype` (`"f16"` or `"bf16"`).
pub fn fused_push_kernel(dtype: &str) -> Option<&'static str> {
    crate::FUSED_DTYPES.iter().position(|d| *d == dtype).map(|i| FUSED_PUSH_KERNELS[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_parameters_are_the_header() {
        let h = FUSED_PUSH_HEADER;
        assert!(h.contains("anyccl_fused_push_one_shot_##NAME("), "fused_push.h stamps no kernel");
        for (dt, k) in crate::FUSED_DTYPES.iter().zip(FUSED_PUSH_KERNELS) {
            assert_eq!(k, format!("anyccl_fused_push_one_shot_{dt}"));
            assert_eq!(fused_push_kernel(dt), Some(k));
        }
        assert_eq!(fused_push_kernel("f32"), None);
        // Offsets follow the C layout (each parameter at its size's alignment, at most 8).
        let mut end = 0usize;
        for (name, offset, size) in FUSED_PUSH_PARAMS {
            assert_eq!(offset, end.next_multiple_of(size.min(8)), "{name} at {offset}");
            end = offset + size;
        }
        // ... and the signature's order and names.
        let start = h.find("anyccl_fused_push_one_shot_##NAME(").expect("signature");
        let sig = &h[start..start + h[start..].find(')').expect("end of signature")];
        let mut at = 0;
        for (name, _, _) in FUSED_PUSH_PARAMS {
            let pos = sig[at..].find(&format!(" {name},")).or_else(|| sig[at..].find(&format!(" {name}")));
            at += pos.unwrap_or_else(|| panic!("{name} missing or out of order in {sig}")) + 1;
        }
        // It is the push protocol's and the fused kernels' code, not a copy: it uses their functions, and does not
        // start a push call (PDL wait, epoch, control words) on its own.
        for used in ["push_begin(", "push_out<W>(", "push_reduce_vec<T, W>(", "push_end(", "norm_row<T>("] {
            assert!(h.contains(used), "fused_push.h does not use {used}");
        }
        for copied in ["push_epoch(", "anyccl_grid_dependency_wait(", "ANYCCL_PUSH_CTRL"] {
            assert!(!h.contains(copied), "fused_push.h repeats push_begin's {copied}");
        }
    }
}
