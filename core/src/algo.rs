//! The all-reduce algorithm family and the vendors anyccl knows.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// An all-reduce algorithm. Which ones a backend offers, and when each is eligible, the backend says; which one
/// runs, the [`crate::Selector`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Algorithm {
    /// The vendor collective library's own all-reduce (NCCL or RCCL).
    Ccl,
    /// The vendor library's all-reduce on symmetric-memory windows (`ncclCommWindowRegister`).
    CclSymmetric,
    /// One step: every rank reads every peer's whole input and reduces it (custom IPC kernel; host threads).
    OneShot,
    /// Two steps: reduce-scatter then all-gather, each rank reducing its own 1/N (custom IPC kernel; host).
    TwoShot,
    /// Ring reduce-scatter then ring all-gather between neighbours (host backend; the host's baseline).
    Ring,
    /// NVLS multicast, reducing straight from the user buffers (`multimem.ld_reduce`).
    NvlsZeroCopy,
    /// NVLS multicast through staging buffers, pipelined per warp.
    NvlsWarpPipeline,
    /// NVLS multicast through staging buffers, pipelined per block.
    NvlsBlockPipeline,
    /// One step in push mode: every rank writes its input into every peer's receive buffer and reduces its own,
    /// with flag-free completion (sentinel values) and no barrier round; for small messages (custom kernel).
    OneShotPush,
    /// Two hops in push mode over the push one-shot's receive buffers: chunk q of every rank's input goes to rank
    /// q, which sums it in rank order and writes the sum into every peer's receive buffer; for mid-size messages on
    /// many ranks, where the push one-shot's W − 1 copies cost more than the second hop (custom kernel). Offered
    /// when named or by a table rule; the default rules do not pick it yet.
    TwoShotPush,
    /// Two-shot exchanging fp8 (e4m3) codes with one f32 scale per 32 elements, summed in f32 (custom kernels).
    /// Lossy: runs only when named (an explicit algorithm, `ANYCCL_ALLREDUCE_ALGO`, a table rule), never chosen by
    /// the defaults or the fallback.
    TwoShotFp8,
    /// Two-shot exchanging int8 codes with one f32 scale per 32 elements, summed in f32 (custom kernels). Lossy,
    /// like [`Algorithm::TwoShotFp8`].
    TwoShotInt8,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 12] = [
        Algorithm::Ccl,
        Algorithm::CclSymmetric,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::Ring,
        Algorithm::NvlsZeroCopy,
        Algorithm::NvlsWarpPipeline,
        Algorithm::NvlsBlockPipeline,
        Algorithm::OneShotPush,
        Algorithm::TwoShotPush,
        Algorithm::TwoShotFp8,
        Algorithm::TwoShotInt8,
    ];

    /// The stable kebab-case name used in `ANYCCL_ALLREDUCE_ALGO`, table files and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ccl => "ccl",
            Algorithm::CclSymmetric => "ccl-symmetric",
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
            Algorithm::Ring => "ring",
            Algorithm::NvlsZeroCopy => "nvls-zero-copy",
            Algorithm::NvlsWarpPipeline => "nvls-warp-pipeline",
            Algorithm::NvlsBlockPipeline => "nvls-block-pipeline",
            Algorithm::OneShotPush => "one-shot-push",
            Algorithm::TwoShotPush => "two-shot-push",
            Algorithm::TwoShotFp8 => "two-shot-fp8",
            Algorithm::TwoShotInt8 => "two-shot-int8",
        }
    }

    /// Whether the result is not the sum of the inputs rounded once (the quantized algorithms): such an
    /// algorithm runs only when the caller names it, never by default or as a fallback.
    pub const fn is_lossy(self) -> bool {
        matches!(self, Algorithm::TwoShotFp8 | Algorithm::TwoShotInt8)
    }

    /// Why `self` cannot run in deterministic mode, or `None` when it can. Deterministic algorithms sum every
    /// element in rank order 0, 1, …, W−1 (in f32 for f16 and bf16, from rank 0's value) and round once, whatever
    /// the message size: one-shot and two-shot (in one round or several) give bitwise the same result, run after
    /// run. The rule for any new kernel that wants to count as deterministic (the fused all-reduce + RMSNorm
    /// included) is the same.
    pub const fn nondeterministic(self) -> Option<&'static str> {
        match self {
            // The push one-shot and two-shot sum in the same order with the same adds as the one-shot (bitwise
            // equal on the H200's emulated ranks).
            Algorithm::OneShot | Algorithm::TwoShot | Algorithm::OneShotPush | Algorithm::TwoShotPush => None,
            Algorithm::Ccl | Algorithm::CclSymmetric => {
                Some("the vendor library's reduction order depends on its algorithm, protocol and channels")
            }
            Algorithm::Ring => Some("the ring sums each chunk starting at a different rank"),
            Algorithm::NvlsZeroCopy | Algorithm::NvlsWarpPipeline | Algorithm::NvlsBlockPipeline => {
                Some("the switch's reduction order is unspecified")
            }
            Algorithm::TwoShotFp8 | Algorithm::TwoShotInt8 => {
                Some("quantized: the result is not the exact rank-order sum of the other algorithms")
            }
        }
    }

    /// The comma-separated list of all names, for error messages.
    pub fn all_names() -> String {
        Algorithm::ALL.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        Algorithm::ALL.into_iter().find(|a| a.name() == norm).ok_or_else(|| Error::Parse {
            what: "all-reduce algorithm",
            input: s.to_owned(),
            expected: Algorithm::all_names(),
        })
    }
}

/// Who made the accelerator a backend drives (the host backend is its own vendor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Vendor {
    /// Host memory, threads as ranks.
    Host,
    /// NVIDIA (CUDA, NCCL).
    Nvidia,
    /// AMD (HIP, RCCL).
    Amd,
}

impl Vendor {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Vendor::Host => "host",
            Vendor::Nvidia => "nvidia",
            Vendor::Amd => "amd",
        }
    }
}

impl fmt::Display for Vendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Vendor {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "host" | "cpu" => Ok(Vendor::Host),
            "nvidia" | "cuda" => Ok(Vendor::Nvidia),
            "amd" | "rocm" | "hip" => Ok(Vendor::Amd),
            _ => Err(Error::Parse { what: "vendor", input: s.to_owned(), expected: "host, nvidia, amd".to_owned() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().ok(), Some(a));
        }
        assert_eq!("ONE_SHOT".parse::<Algorithm>().ok(), Some(Algorithm::OneShot));
        assert_eq!("one_shot_push".parse::<Algorithm>().ok(), Some(Algorithm::OneShotPush));
        assert_eq!("Two-Shot-Push".parse::<Algorithm>().ok(), Some(Algorithm::TwoShotPush));
        let err = "three-shot".parse::<Algorithm>().expect_err("unknown");
        assert!(err.to_string().contains("nvls-block-pipeline"), "{err}");
        assert!(err.to_string().contains("two-shot-fp8"), "{err}");
    }

    #[test]
    fn only_the_rank_order_kernels_are_deterministic_and_only_quantized_ones_lossy() {
        for a in Algorithm::ALL {
            let det = a.nondeterministic().is_none();
            let rank_order =
                matches!(a, Algorithm::OneShot | Algorithm::TwoShot | Algorithm::OneShotPush | Algorithm::TwoShotPush);
            assert_eq!(det, rank_order, "{a}");
            assert_eq!(a.is_lossy(), matches!(a, Algorithm::TwoShotFp8 | Algorithm::TwoShotInt8), "{a}");
            assert!(!(det && a.is_lossy()), "{a}");
        }
    }
}
