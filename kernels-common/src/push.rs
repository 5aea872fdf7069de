//! The push-mode one-shot all-reduce of `include/anyccl/push.h`: its kernels, parameters and receive-buffer layout.
//!
//! Every rank writes its input into slot `[set][its rank]` of every peer's receive buffer, then reduces the slots of
//! its own receive buffer in rank order (the bits of the barrier one-shot's result). Completion is flag-free: every
//! 32-bit word of a receive buffer holds [`PUSH_SENTINEL`] until a peer's value lands there, and the reader writes
//! the sentinel back after use. Calls alternate between [`PUSH_SETS`] buffer sets by a call counter in the buffer's
//! control words. Messages up to [`PUSH_MAX_BYTES`].

use crate::{Param, DTYPES, MAX_RANKS, VECTOR_BYTES};

/// Largest message the receive buffers are sized for, in bytes (`ANYCCL_PUSH_MAX_BYTES`): 256 KiB.
pub const PUSH_MAX_BYTES: usize = 256 << 10;
/// Buffer sets the calls alternate between (`ANYCCL_PUSH_SETS`).
pub const PUSH_SETS: usize = 2;
/// Byte offset of the control words in a receive buffer (`ANYCCL_PUSH_CTRL`): after `PUSH_SETS` sets of
/// `MAX_RANKS` slots of `PUSH_MAX_BYTES`.
pub const PUSH_CTRL_OFFSET: usize = PUSH_SETS * MAX_RANKS * PUSH_MAX_BYTES;
/// Bytes of the control words (`ANYCCL_PUSH_CTRL_WORDS` words of 32 bits: the call counter, the arrival counter,
/// padding).
pub const PUSH_CTRL_BYTES: usize = 16;
/// Bytes of one rank's receive buffer: the sets, then the control words. Before first use, fill
/// `..PUSH_CTRL_OFFSET` with the sentinel (every byte `0xFF`) and zero the control words.
pub const PUSH_RECV_BYTES: usize = PUSH_CTRL_OFFSET + PUSH_CTRL_BYTES;
/// The value of every 32-bit word of a receive slot that holds no data (`ANYCCL_PUSH_SENTINEL`): a NaN in every
/// element type, so finite inputs never have it.
pub const PUSH_SENTINEL: u32 = 0xFFFF_FFFF;
/// What an input word equal to [`PUSH_SENTINEL`] is pushed as (`ANYCCL_PUSH_CANONICAL`): another NaN in every
/// element type (an f32 NaN, two f16 NaNs, two bf16 NaNs).
pub const PUSH_CANONICAL: u32 = 0x7FFF_7FFF;

const _: () = assert!(PUSH_RECV_BYTES.is_multiple_of(VECTOR_BYTES) && PUSH_MAX_BYTES.is_multiple_of(VECTOR_BYTES));

/// The push one-shot kernels, one per name of [`DTYPES`], the same on every vendor.
pub const PUSH_KERNELS: [&str; 3] =
    ["anyccl_push_one_shot_f32", "anyccl_push_one_shot_f16", "anyccl_push_one_shot_bf16"];

/// The push two-shot kernels (scatter, reduce, gather over the same receive buffers: `push.h`), one per name of
/// [`DTYPES`], with the push one-shot's parameters ([`PUSH_PARAMS`]).
pub const PUSH_TWO_SHOT_KERNELS: [&str; 3] =
    ["anyccl_push_two_shot_f32", "anyccl_push_two_shot_f16", "anyccl_push_two_shot_bf16"];

/// Vector offset, within a slot, of the push two-shot's second half (the reduced chunks; `ANYCCL_PUSH_HALF_VECS`).
/// A chunk, `ceil(n_vec / world)` vectors, fits half a slot for every world of 2 or more.
pub const PUSH_HALF_VECS: usize = PUSH_MAX_BYTES / VECTOR_BYTES / 2;

/// The parameters of every push kernel, in order: this rank's input and output, every rank's receive buffer (8
/// pointers by value), this rank's flag array (its abort word), rank, world, vector count.
pub const PUSH_PARAMS: [Param; 7] = [
    ("in", 0, 8),
    ("out", 8, 8),
    ("recv", 16, 64),
    ("my_flags", 80, 8),
    ("rank", 88, 4),
    ("world", 92, 4),
    ("n_vec", 96, 8),
];

/// The push kernel of element type `dtype` (a name of [`DTYPES`]).
pub fn push_kernel(dtype: &str) -> Option<&'static str> {
    DTYPES.iter().position(|d| *d == dtype).map(|i| PUSH_KERNELS[i])
}

/// The push one-shot's source, `include/anyccl/push.h`.
pub const PUSH_HEADER: &str = include_str!("../include/anyccl/push.h");

/// The 32-bit word the kernel pushes for input word `word`: the word itself, except [`PUSH_SENTINEL`], which is
/// pushed as [`PUSH_CANONICAL`] (the host-side model of the kernel's write side, for tests and references).
pub fn push_word(word: u32) -> u32 {
    if word == PUSH_SENTINEL {
        PUSH_CANONICAL
    } else {
        word
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer `#define NAME …` evaluates to in push.h (or allreduce.h for names it takes from there).
    fn define(name: &str) -> u64 {
        let line = [PUSH_HEADER, crate::HEADERS[0].1]
            .iter()
            .flat_map(|s| s.lines())
            .find_map(|l| l.strip_prefix("#define ").and_then(|r| r.strip_prefix(name)).filter(|r| r.starts_with(' ')))
            .unwrap_or_else(|| panic!("no #define {name}"));
        eval(line.trim())
    }

    fn eval(expr: &str) -> u64 {
        let e = expr.trim();
        if let Some(inner) = e.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
            return eval(inner);
        }
        if let Some((a, b)) = e.split_once(" * ") {
            return eval(a) * eval(b);
        }
        if let Some(hex) = e.strip_prefix("0x").and_then(|h| h.strip_suffix('u')) {
            return u64::from_str_radix(hex, 16).expect("hex literal");
        }
        e.parse().unwrap_or_else(|_| define(e))
    }

    #[test]
    fn layout_constants_are_the_headers() {
        assert_eq!(define("ANYCCL_PUSH_MAX_BYTES"), PUSH_MAX_BYTES as u64);
        assert_eq!(define("ANYCCL_PUSH_SLOT_VECS") * VECTOR_BYTES as u64, PUSH_MAX_BYTES as u64);
        assert_eq!(define("ANYCCL_PUSH_SETS"), PUSH_SETS as u64);
        assert_eq!(define("ANYCCL_PUSH_CTRL"), PUSH_CTRL_OFFSET as u64);
        assert_eq!(define("ANYCCL_PUSH_CTRL_WORDS") * 4, PUSH_CTRL_BYTES as u64);
        assert_eq!(define("ANYCCL_PUSH_SENTINEL"), u64::from(PUSH_SENTINEL));
        assert_eq!(define("ANYCCL_PUSH_CANONICAL"), u64::from(PUSH_CANONICAL));
        assert_eq!(define("ANYCCL_PUSH_HALF_VECS"), PUSH_HALF_VECS as u64);
        // 4 MiB per rank: two sets of eight 256 KiB slots, and the control words.
        assert_eq!(PUSH_RECV_BYTES, (4 << 20) + 16);
    }

    fn f16_nan(h: u16) -> bool {
        h & 0x7C00 == 0x7C00 && h & 0x03FF != 0
    }

    fn bf16_nan(h: u16) -> bool {
        h & 0x7F80 == 0x7F80 && h & 0x007F != 0
    }

    #[test]
    fn the_sentinel_and_its_replacement_are_nans_of_every_element_type() {
        for w in [PUSH_SENTINEL, PUSH_CANONICAL] {
            assert!(f32::from_bits(w).is_nan(), "{w:#x} as f32");
            for half in [w as u16, (w >> 16) as u16] {
                assert!(f16_nan(half), "{half:#x} as f16");
                assert!(bf16_nan(half), "{half:#x} as bf16");
            }
        }
        assert_ne!(PUSH_CANONICAL, PUSH_SENTINEL);
        assert_eq!(push_word(PUSH_SENTINEL), PUSH_CANONICAL);
        // Every other word is pushed as it is, -0.0 and the usual NaNs included.
        for w in [0, 0x8000_0000, 0x7FC0_0000, 0xFFC0_0000, 0x7FFF_FFFF, 0xFFFF_FFFE, PUSH_CANONICAL] {
            assert_eq!(push_word(w), w);
        }
        // No finite value of any element type has the sentinel's bits (f16/bf16: the pair 0xFFFF, 0xFFFF).
        assert!(!f32::from_bits(PUSH_SENTINEL).is_finite());
        assert!(f16_nan(0xFFFF) && bf16_nan(0xFFFF) && !f16_nan(0x7C00) && !bf16_nan(0xFF80));
    }

    #[test]
    fn kernel_names_and_parameters_are_the_headers() {
        assert!(PUSH_HEADER.contains("anyccl_push_one_shot_##NAME("));
        for (d, k) in DTYPES.iter().zip(PUSH_KERNELS) {
            assert_eq!(k, format!("anyccl_push_one_shot_{d}"));
            assert_eq!(push_kernel(d), Some(k));
        }
        assert_eq!(push_kernel("f64"), None);
        assert!(PUSH_HEADER.contains("anyccl_push_two_shot_##NAME("));
        for (d, k) in DTYPES.iter().zip(PUSH_TWO_SHOT_KERNELS) {
            assert_eq!(k, format!("anyccl_push_two_shot_{d}"));
        }
        // Both kernels take PUSH_PARAMS, in that order.
        for kernel in ["anyccl_push_one_shot_##NAME(", "anyccl_push_two_shot_##NAME("] {
            let start = PUSH_HEADER.find(kernel).expect("kernel");
            let sig = &PUSH_HEADER[start..start + PUSH_HEADER[start..].find(')').expect("signature end")];
            let mut at = 0;
            let mut end = 0usize;
            for (name, offset, size) in PUSH_PARAMS {
                assert_eq!(offset, end.next_multiple_of(size.min(8)), "{name} at {offset}");
                end = offset + size;
                let pos = sig[at..].find(&format!(" {name},")).or_else(|| sig[at..].find(&format!(" {name}")));
                at += pos.unwrap_or_else(|| panic!("{kernel} parameter {name} not in order: {sig}")) + name.len();
            }
        }
        // A chunk of the largest message fits half a slot at every world of 2 or more.
        assert!((PUSH_MAX_BYTES / VECTOR_BYTES).div_ceil(2) <= PUSH_HALF_VECS);
        assert_eq!(PUSH_PARAMS[2].2, MAX_RANKS * 8, "recv is RankPtrs by value");
    }

    #[test]
    fn vendor_headers_define_what_push_h_uses() {
        for name in [
            "anyccl_ld_vec_volatile(",
            "anyccl_st_vec_volatile(",
            "anyccl_grid_dependency_wait(",
            "anyccl_launch_dependents(",
        ] {
            assert!(PUSH_HEADER.contains(name), "push.h does not use {name}");
            for (path, text) in &crate::HEADERS[1..3] {
                assert!(text.contains(name), "{path} does not define {name}");
            }
        }
        // The CUDA twin really waits (griddepcontrol, sm_90+); the HIP twin is a no-op.
        assert!(crate::HEADERS[1].1.contains("griddepcontrol.wait;"));
        assert!(crate::HEADERS[1].1.contains("griddepcontrol.launch_dependents;"));
        assert!(crate::HEADERS[2].1.contains("void anyccl_grid_dependency_wait() {}"));
    }
}
