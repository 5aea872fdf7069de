//! [`GpuComm::all_reduce_rmsnorm`]: the fused all-reduce + residual add + RMSNorm as a validated communicator
//! call, over the custom kernels' staging, scratch, flag arrays and graph input tables.

use anyccl_core::{DataType, Error, InvalidArgument, Location, Result};
use anyccl_kernels_common as common;

use super::super::fused::{self as fused, FusedChoice, FusedForm, FusedOutput, NormArgs};
use super::super::kernels::{self, Inputs, Kind};
use super::super::{BufferOf, GpuPlatform, StreamOf};
use super::{custom_blocks, GpuComm};
use crate::device::GpuRuntime;
use crate::CclStream;

/// What one [`GpuComm::all_reduce_rmsnorm`] call computes: `tokens` rows of `hidden` elements of `dtype`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RmsNormSpec {
    /// f16 or bf16 (the input, residual, weight and, unless fp8, output type).
    pub dtype: DataType,
    /// Rows.
    pub tokens: usize,
    /// Elements per row: a multiple of 8, 8..=16384.
    pub hidden: usize,
    /// Added to the mean square (finite, ≥ 0).
    pub eps: f32,
    /// Output type.
    pub output: FusedOutput,
    /// Forces fused one-shot, fused two-shot or unfused; `None`: `ANYCCL_FUSED_RMSNORM` if set, else the default
    /// rule ([`fused::choose`]).
    pub choice: Option<FusedChoice>,
}

impl RmsNormSpec {
    /// `tokens` × `hidden` of `dtype` with `eps`, output in `dtype`, the choice left to the rules.
    pub fn new(dtype: DataType, tokens: usize, hidden: usize, eps: f32) -> Self {
        RmsNormSpec { dtype, tokens, hidden, eps, output: FusedOutput::Same, choice: None }
    }

    /// The same with fp8 e4m3 output `e4m3(y / scale)`.
    pub fn fp8_output(mut self, scale: f32) -> Self {
        self.output = FusedOutput::Fp8E4M3 { scale };
        self
    }

    /// The same, carried out by `choice`.
    pub fn with_choice(mut self, choice: FusedChoice) -> Self {
        self.choice = Some(choice);
        self
    }
}

/// One buffer as [`validate`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct BufInfo {
    /// Its role (`"input"`, `"residual"`, `"weight"`, `"out"`).
    pub which: &'static str,
    /// Device address.
    pub addr: u64,
    /// Bytes.
    pub len: usize,
    /// Its device.
    pub ordinal: u32,
}

fn bad(what: &str, message: String) -> Error {
    Error::Config { source_name: format!("all_reduce_rmsnorm: {what}"), line: None, message }
}

/// Checks one call before anything is launched: element type, `hidden` (a multiple of 8, 8..=16384), `eps` and
/// the fp8 scale, the sizes (checked arithmetic), every buffer's length, 16-byte alignment and device, and that
/// `out` and `residual` overlap nothing else. Returns the input's bytes.
pub fn validate(spec: &RmsNormSpec, ordinal: u32, bufs: [BufInfo; 4]) -> Result<usize> {
    let dtype = spec.dtype;
    if !matches!(dtype, DataType::F16 | DataType::Bf16) {
        return Err(InvalidArgument::UnsupportedDataType {
            dtype,
            backend: "gpu".into(),
            why: "the fused all-reduce + RMSNorm takes f16 and bf16".into(),
        }
        .into());
    }
    if spec.hidden < 8 || spec.hidden > common::MAX_HIDDEN {
        return Err(InvalidArgument::OutOfRange {
            what: "all_reduce_rmsnorm hidden",
            value: spec.hidden as u64,
            min: 8,
            max: common::MAX_HIDDEN as u64,
        }
        .into());
    }
    if !spec.hidden.is_multiple_of(8) {
        return Err(bad("hidden", format!("{} is not a multiple of 8 (rows are whole 16-byte vectors)", spec.hidden)));
    }
    if !(spec.eps.is_finite() && spec.eps >= 0.0) {
        return Err(bad("eps", format!("{} must be finite and not negative", spec.eps)));
    }
    if let FusedOutput::Fp8E4M3 { scale } = spec.output {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(bad("fp8 scale", format!("{scale} must be finite and positive")));
        }
        if spec.choice == Some(FusedChoice::Unfused) {
            return Err(bad("choice", "fp8 output is produced by the fused kernels only".into()));
        }
    }
    let count = spec.tokens.checked_mul(spec.hidden);
    let overflow = || InvalidArgument::CountOverflow { count: spec.tokens, dtype, world: spec.hidden };
    let bytes = count.and_then(|n| n.checked_mul(dtype.size_bytes())).ok_or_else(overflow)?;
    let out_bytes = count.and_then(|n| n.checked_mul(spec.output.element_bytes(dtype))).ok_or_else(overflow)?;
    let need = [bytes, bytes, spec.hidden * dtype.size_bytes(), out_bytes];
    for (b, need) in bufs.iter().zip(need) {
        if b.len < need {
            let count = if b.which == "weight" { spec.hidden } else { count.unwrap_or(0) };
            return Err(InvalidArgument::BufferTooSmall { which: b.which, have: b.len, need, count, dtype }.into());
        }
        if b.addr % 16 != 0 {
            return Err(InvalidArgument::Misaligned { which: b.which, addr: b.addr as usize, align: 16, dtype }.into());
        }
        if b.ordinal != ordinal {
            return Err(InvalidArgument::WrongDevice {
                which: b.which,
                found: Location::Device { ordinal: b.ordinal },
                expected: Location::Device { ordinal },
            }
            .into());
        }
    }
    // out and residual are written: neither may overlap another buffer (the weight and input may be shared).
    let span = |b: &BufInfo, n: usize| (b.addr, b.addr.saturating_add(n as u64));
    let used = [span(&bufs[0], bytes), span(&bufs[1], bytes), span(&bufs[2], need[2]), span(&bufs[3], out_bytes)];
    for w in [1usize, 3] {
        for o in 0..4 {
            let (a, b) = (used[w], used[o]);
            if o != w && a.0 < b.1 && b.0 < a.1 {
                return Err(InvalidArgument::Overlap {
                    send_addr: b.0 as usize,
                    send_len: (b.1 - b.0) as usize,
                    recv_addr: a.0 as usize,
                    recv_len: (a.1 - a.0) as usize,
                    layout: "input, residual, weight and out must not overlap",
                }
                .into());
            }
        }
    }
    Ok(bytes)
}

/// `ANYCCL_FUSED_RMSNORM`: `one-shot`, `two-shot`, `unfused` or `auto` (the default rule); `None` for auto or
/// unset.
pub fn choice_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<FusedChoice>> {
    let Some(v) = env("ANYCCL_FUSED_RMSNORM") else { return Ok(None) };
    match v.trim() {
        "" | "auto" => Ok(None),
        "one-shot" => Ok(Some(FusedChoice::Fused(FusedForm::OneShot))),
        "two-shot" => Ok(Some(FusedChoice::Fused(FusedForm::TwoShot))),
        "unfused" => Ok(Some(FusedChoice::Unfused)),
        other => Err(Error::Config {
            source_name: "ANYCCL_FUSED_RMSNORM".into(),
            line: None,
            message: format!("'{other}': expected one-shot, two-shot, unfused or auto"),
        }),
    }
}

/// The choice a call makes: the caller's, else the environment's, else the default rule; a form that the staging
/// and scratch capacity (`capacity` bytes each) cannot hold falls back to one that fits, or to an error.
pub fn resolve(spec: &RmsNormSpec, world: usize, capacity: usize, env: Option<FusedChoice>) -> Result<FusedChoice> {
    let mut choice = spec.choice.or(env).unwrap_or_else(|| fused::choose(spec.dtype, spec.tokens, spec.hidden, world));
    let bytes = spec.tokens.saturating_mul(spec.hidden).saturating_mul(spec.dtype.size_bytes());
    if bytes > capacity {
        return Err(Error::AlgorithmNotEligible {
            algorithm: anyccl_core::Algorithm::OneShot,
            why: format!(
                "all_reduce_rmsnorm of {bytes} bytes exceeds the custom kernels' staging of {capacity} bytes \
                 (ANYCCL_CUSTOM_MAX_BYTES)"
            ),
        });
    }
    let scratch =
        fused::two_shot_scratch_bytes(spec.dtype, spec.tokens, spec.hidden, spec.output).unwrap_or(usize::MAX);
    if choice == FusedChoice::Fused(FusedForm::TwoShot) && scratch > capacity {
        choice = FusedChoice::Fused(FusedForm::OneShot);
    }
    if choice == FusedChoice::Unfused && spec.output != FusedOutput::Same {
        choice = FusedChoice::Fused(FusedForm::OneShot);
    }
    Ok(choice)
}

impl<P: GpuPlatform> GpuComm<P> {
    /// The fused all-reduce + residual add + RMSNorm of `spec.tokens` rows: `out = rmsnorm(allreduce(input) +
    /// residual) * weight`, with `residual` overwritten by `allreduce(input) + residual` (the same on every rank;
    /// it must be the same on every rank before the call too, as tensor parallelism keeps it). A collective: every
    /// rank calls it with the same `spec`. Stream-ordered on `stream`; capture-safe (nothing is allocated; during
    /// capture the input is read through an input table, as for the custom all-reduce). Validated first
    /// ([`validate`]): nothing is launched on bad input. Returns what carried it out (fused one-shot, fused
    /// two-shot, or the custom all-reduce followed by the separate RMSNorm kernel).
    pub fn all_reduce_rmsnorm(
        &mut self,
        input: &BufferOf<P>,
        residual: &mut BufferOf<P>,
        weight: &BufferOf<P>,
        out: &mut BufferOf<P>,
        spec: &RmsNormSpec,
        stream: &StreamOf<P>,
    ) -> Result<FusedChoice> {
        let ordinal = self.runtime.ordinal();
        let info = |which: &'static str, b: &BufferOf<P>| BufInfo {
            which,
            addr: b.device_ptr(),
            len: b.len(),
            ordinal: b.ordinal(),
        };
        let bufs = [info("input", input), info("residual", residual), info("weight", weight), info("out", out)];
        let bytes = validate(spec, ordinal, bufs)?;
        let world = self.ccl.world();
        let rank = self.ccl.rank();
        if let Some(why) = fused::fused_ineligible(spec.dtype, spec.hidden, world) {
            return Err(Error::AlgorithmNotEligible { algorithm: anyccl_core::Algorithm::OneShot, why });
        }
        let env = choice_from_env(&crate::caps::process_env)?;
        let capturing = stream.is_capturing()?;
        let not_eligible =
            |why: String| Error::AlgorithmNotEligible { algorithm: anyccl_core::Algorithm::OneShot, why };
        let st = self.custom.as_mut().map_err(|why| not_eligible(why.clone()))?;
        let fk = self.fused.as_ref().ok_or_else(|| not_eligible("the fused kernels are not set up".into()))?;
        let choice = resolve(spec, world, st.capacity, env)?;
        if bytes == 0 {
            // Nothing to do on any rank alike: no launch keeps the barrier epochs in step.
            return Ok(choice);
        }
        self.runtime.bind()?;
        let (src, dst) = (input.device_ptr(), out.device_ptr());
        let table = if capturing { st.graph.table_for(src) } else { None };
        let inputs = match table {
            Some(table) => Inputs::Table { table, own: src },
            None => Inputs::Staged { staging: &st.all_staging, own: src },
        };
        let args = NormArgs::new(
            residual.device_ptr(),
            weight.device_ptr(),
            dst,
            spec.tokens,
            spec.hidden,
            spec.eps,
            spec.output,
        );
        let max = st.max_blocks;
        // SAFETY: validated above: every buffer is this device's, 16-byte aligned, long enough, and out/residual
        // overlap nothing; every rank's staging and scratch hold `capacity` bytes (≥ the input, ≥ the two-shot
        // scratch: `resolve`), reachable through peer access or IPC; every rank makes the same call (a collective)
        // with the same block count (a function of the spec, the world and the communicator's block limit); ranks
        // run on different GPUs.
        unsafe {
            match choice {
                FusedChoice::Fused(form) => {
                    let rows = if form == FusedForm::TwoShot { spec.tokens.div_ceil(world) } else { spec.tokens };
                    let blocks = rows.clamp(1, max) as u32;
                    fk.launch_fused(
                        form,
                        spec.dtype,
                        inputs,
                        &st.all_scratch,
                        &args,
                        &st.all_flags,
                        rank,
                        blocks,
                        stream,
                    )
                }
                _ => {
                    // The custom all-reduce into `out`, then the RMSNorm of `out` in place (each thread reads its
                    // row elements before it writes them).
                    let kind = if bytes <= fused::FUSED_ONE_SHOT_MAX_BYTES { Kind::OneShot } else { Kind::TwoShot };
                    st.kernels.launch(
                        kind,
                        spec.dtype,
                        inputs,
                        &st.all_scratch,
                        dst,
                        &st.all_flags,
                        rank,
                        bytes,
                        custom_blocks(bytes, max),
                        kernels::TWO_SHOT_ROUND_BYTES,
                        stream,
                    )?;
                    let blocks = spec.tokens.clamp(1, 4 * fk.multiprocessors().max(1)) as u32;
                    fk.launch_rmsnorm(spec.dtype, dst, &args, blocks, stream)
                }
            }
        }?;
        Ok(choice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bufs(tokens: usize, hidden: usize, esz: usize) -> [BufInfo; 4] {
        let n = tokens * hidden * esz;
        let gap = (n as u64).next_multiple_of(256) + 256;
        [
            BufInfo { which: "input", addr: 1 << 20, len: n, ordinal: 0 },
            BufInfo { which: "residual", addr: (1 << 20) + gap, len: n, ordinal: 0 },
            BufInfo { which: "weight", addr: (1 << 20) + 2 * gap, len: hidden * esz, ordinal: 0 },
            BufInfo { which: "out", addr: (1 << 20) + 3 * gap, len: n, ordinal: 0 },
        ]
    }

    #[test]
    fn a_valid_call_passes_and_returns_the_input_bytes() {
        let spec = RmsNormSpec::new(DataType::Bf16, 64, 8192, 1e-6);
        assert_eq!(validate(&spec, 0, bufs(64, 8192, 2)).expect("valid"), 64 * 8192 * 2);
        // fp8 output needs half the output bytes.
        let mut b = bufs(3, 16384, 2);
        b[3].len = 3 * 16384;
        assert!(validate(&RmsNormSpec::new(DataType::F16, 3, 16384, 0.0).fp8_output(0.5), 0, b).is_ok());
        assert!(validate(&RmsNormSpec::new(DataType::F16, 0, 8, 1e-5), 0, bufs(0, 8, 2)).is_ok());
    }

    #[test]
    fn bad_calls_get_typed_errors_naming_the_culprit() {
        let ok = bufs(4, 1024, 2);
        let base = RmsNormSpec::new(DataType::Bf16, 4, 1024, 1e-6);
        let err = |spec: RmsNormSpec, b: [BufInfo; 4]| validate(&spec, 0, b).expect_err("refused").to_string();
        assert!(err(RmsNormSpec { dtype: DataType::F32, ..base }, bufs(4, 1024, 4)).contains("f32"));
        assert!(err(RmsNormSpec { hidden: 16392, ..base }, bufs(4, 16392, 2)).contains("hidden"));
        assert!(err(RmsNormSpec { hidden: 0, ..base }, bufs(4, 0, 2)).contains("hidden"));
        assert!(err(RmsNormSpec { hidden: 1020, ..base }, bufs(4, 1020, 2)).contains("multiple of 8"));
        assert!(err(RmsNormSpec { eps: f32::NAN, ..base }, ok).contains("eps"));
        assert!(err(RmsNormSpec { eps: -1.0, ..base }, ok).contains("eps"));
        assert!(err(base.fp8_output(0.0), ok).contains("scale"));
        assert!(err(base.fp8_output(f32::INFINITY), ok).contains("scale"));
        assert!(err(base.fp8_output(1.0).with_choice(FusedChoice::Unfused), ok).contains("fused kernels only"));
        assert!(err(RmsNormSpec { tokens: usize::MAX, ..base }, ok).contains("overflows"));
        for (i, which) in ["input", "residual", "weight", "out"].into_iter().enumerate() {
            let mut b = ok;
            b[i].len -= 2;
            assert!(err(base, b).contains(which), "{which} short");
            let mut b = ok;
            b[i].addr += 8;
            let m = err(base, b);
            assert!(m.contains(which) && m.contains("aligned"), "{which} misaligned: {m}");
            let mut b = ok;
            b[i].ordinal = 1;
            assert!(err(base, b).contains(which), "{which} on another device");
        }
        // out over the input, the residual over the weight, out over the residual: refused.
        for (w, o) in [(3usize, 0usize), (1, 2), (3, 1)] {
            let mut b = ok;
            b[w].addr = b[o].addr;
            assert!(err(base, b).contains("overlap"), "{w} over {o}");
        }
        // The input and the weight are only read: the same memory for both is fine.
        let mut b = ok;
        b[2].addr = b[0].addr;
        assert!(validate(&base, 0, b).is_ok());
    }

    #[test]
    fn the_environment_and_the_capacity_steer_the_choice() {
        let env = |v: &'static str| move |k: &str| (k == "ANYCCL_FUSED_RMSNORM").then(|| v.to_string());
        assert_eq!(choice_from_env(&env("two-shot")).expect("ok"), Some(FusedChoice::Fused(FusedForm::TwoShot)));
        assert_eq!(choice_from_env(&env("one-shot")).expect("ok"), Some(FusedChoice::Fused(FusedForm::OneShot)));
        assert_eq!(choice_from_env(&env("unfused")).expect("ok"), Some(FusedChoice::Unfused));
        assert_eq!(choice_from_env(&env("auto")).expect("ok"), None);
        assert_eq!(choice_from_env(&|_: &str| None).expect("ok"), None);
        assert!(choice_from_env(&env("fast")).expect_err("bad").to_string().contains("ANYCCL_FUSED_RMSNORM"));

        let spec = RmsNormSpec::new(DataType::Bf16, 512, 8192, 1e-6);
        let cap = 8 << 20;
        // Two-shot's scratch (16 MiB here) does not fit 8 MiB: one-shot, whether chosen by the rule or forced.
        assert_eq!(resolve(&spec, 8, cap, None).expect("ok"), FusedChoice::Fused(FusedForm::OneShot));
        assert_eq!(
            resolve(&spec, 8, cap, Some(FusedChoice::Fused(FusedForm::TwoShot))).expect("ok"),
            FusedChoice::Fused(FusedForm::OneShot)
        );
        assert_eq!(resolve(&spec, 8, 16 << 20, None).expect("ok"), FusedChoice::Fused(FusedForm::TwoShot));
        // The caller's choice beats the environment's.
        let forced = spec.with_choice(FusedChoice::Unfused);
        assert_eq!(
            resolve(&forced, 8, cap, Some(FusedChoice::Fused(FusedForm::OneShot))).expect("ok"),
            FusedChoice::Unfused
        );
        // Larger than staging: refused.
        assert!(resolve(&RmsNormSpec::new(DataType::Bf16, 1024, 8192, 1e-6), 8, cap, None).is_err());
        assert_eq!(
            resolve(&RmsNormSpec::new(DataType::Bf16, 1, 8192, 1e-6), 8, cap, None).expect("ok"),
            FusedChoice::Fused(FusedForm::OneShot)
        );
    }
}
