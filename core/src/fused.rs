//! The fused all-reduce + residual add + RMSNorm, described once for every backend.
//!
//! ```text
//! residual ← allreduce(input) + residual          (written back; the same on every rank)
//! out      ← rmsnorm(residual) × weight            (or e4m3(out / scale) with fp8 output)
//! ```
//!
//! for f16 or bf16 rows of `hidden` elements (a multiple of 8, at most [`MAX_HIDDEN`]), in f32 arithmetic: the
//! all-reduce sums in rank order 0..W−1 and rounds once to the element type, the residual add rounds once more,
//! and the row's mean square is summed in the fixed order of the GPU kernels ([`norm_row`]: [`NORM_THREADS`]
//! partial sums, then two halving trees). Every form ([`RmsNormForm`]) of every backend computes these bits, so the
//! call is deterministic (bitwise identical across runs, forms and sizes) whatever deterministic mode says.
//!
//! What lives here: the call's description ([`RmsNormSpec`], [`RmsNormOutput`]), the forms ([`RmsNormForm`],
//! with the names `ANYCCL_FUSED_RMSNORM`, table files and the CLI use), the checks every backend gets
//! ([`validate`]), the validated description only the [`crate::Communicator`] makes ([`RmsNormArgs`]), what a
//! call returns ([`RmsNormSelection`]) and the host arithmetic ([`norm_row`]). The call itself is
//! [`crate::Communicator::all_reduce_rmsnorm`]; the choice of form is [`crate::Selector::select_rmsnorm`].
//!
//! A validated description cannot be made outside this crate:
//!
//! ```compile_fail,E0624
//! use anyccl_core::comm::{BufOf, CommBackend, StreamOf};
//! use anyccl_core::fused::{RmsNormArgs, RmsNormCall, RmsNormForm};
//!
//! fn forge<'a, B: CommBackend>(
//!     i: &'a BufOf<B>, r: &'a mut BufOf<B>, w: &'a BufOf<B>, o: &'a mut BufOf<B>, s: &'a StreamOf<B>,
//!     call: RmsNormCall,
//! ) -> RmsNormArgs<'a, B> {
//!     RmsNormArgs::new(i, r, w, o, s, call, RmsNormForm::FusedOneShot)
//! }
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::Serialize;

use crate::comm::{BufOf, CommBackend, StreamOf};
use crate::dtype::DataType;
use crate::error::{Error, InvalidArgument};
use crate::runtime::{BufferDesc, Location};

/// The largest row (`hidden`, elements) the call takes: the GPU kernels' bound (`ANYCCL_MAX_HIDDEN` in
/// `anyccl-kernels-common`, which asserts it equals this).
pub const MAX_HIDDEN: usize = 16384;
/// Threads per block of the GPU kernels: the order of a row's sum of squares depends on it, and [`norm_row`]
/// follows it (`anyccl-kernels-common`'s `NORM_THREADS` is asserted equal).
pub const NORM_THREADS: usize = 512;
/// Row elements are handled in vectors of this many (16 bytes of f16/bf16): `hidden` is a multiple of it.
pub const VECTOR: usize = 8;
/// Every buffer of the call is aligned to this many bytes (the kernels load 16-byte vectors).
pub const ALIGN: usize = 16;
/// The environment variable that forces one form for every call that does not force its own
/// (`fused-one-shot`, `fused-two-shot`, `unfused`, or `auto`; `one-shot` and `two-shot` are accepted too).
pub const ENV_FUSED_RMSNORM: &str = "ANYCCL_FUSED_RMSNORM";

/// How a backend carries out the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum RmsNormForm {
    /// One step: every rank reduces every row from every peer, then adds its residual and normalises.
    FusedOneShot,
    /// Each rank reduces and normalises 1/N of the rows, then every rank gathers the output and new residual.
    FusedTwoShot,
    /// The all-reduce, then a separate RMSNorm pass (the baseline the fused forms are measured against).
    Unfused,
    /// Push-mode one step (GPU communicators with the push one-shot set up): every rank writes its rows into
    /// every peer's receive buffer (completion by sentinel values, no barrier round), then reduces, adds and
    /// normalises every row, in one kernel. The fused one-shot's bits; small messages only (the push receive
    /// slots, 256 KiB).
    FusedPush,
}

impl RmsNormForm {
    /// Every form.
    pub const ALL: [RmsNormForm; 4] =
        [RmsNormForm::FusedOneShot, RmsNormForm::FusedTwoShot, RmsNormForm::Unfused, RmsNormForm::FusedPush];

    /// The stable name used in `ANYCCL_FUSED_RMSNORM`, table files (`fused_rmsnorm = [...]`) and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            RmsNormForm::FusedOneShot => "fused-one-shot",
            RmsNormForm::FusedTwoShot => "fused-two-shot",
            RmsNormForm::Unfused => "unfused",
            RmsNormForm::FusedPush => "fused-push",
        }
    }

    /// Whether one kernel does the whole call.
    pub const fn is_fused(self) -> bool {
        !matches!(self, RmsNormForm::Unfused)
    }

    /// Every name, comma-separated (for messages).
    pub fn all_names() -> String {
        RmsNormForm::ALL.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for RmsNormForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RmsNormForm {
    type Err = Error;

    /// A form's name, any case; `one-shot`, `two-shot` and `push` name the fused forms.
    fn from_str(s: &str) -> Result<Self, Error> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "fused-one-shot" | "one-shot" => Ok(RmsNormForm::FusedOneShot),
            "fused-two-shot" | "two-shot" => Ok(RmsNormForm::FusedTwoShot),
            "unfused" => Ok(RmsNormForm::Unfused),
            "fused-push" | "push" => Ok(RmsNormForm::FusedPush),
            _ => Err(Error::Config {
                source_name: "fused all-reduce + RMSNorm form".to_owned(),
                line: None,
                message: format!("unknown form '{}' (expected one of {})", s.trim(), RmsNormForm::all_names()),
            }),
        }
    }
}

/// The output type of the call.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub enum RmsNormOutput {
    /// The input's element type (f16 or bf16).
    Same,
    /// fp8 e4m3 bytes, `e4m3(y / scale)` (round to nearest even, saturating to ±448, NaN kept); `scale` is finite
    /// and positive.
    Fp8E4M3 {
        /// Divides the normalised value before the conversion.
        scale: f32,
    },
}

impl RmsNormOutput {
    /// Bytes of one output element for inputs of `dtype`.
    pub fn element_bytes(self, dtype: DataType) -> usize {
        match self {
            RmsNormOutput::Same => dtype.size_bytes(),
            RmsNormOutput::Fp8E4M3 { .. } => 1,
        }
    }
}

/// What one [`crate::Communicator::all_reduce_rmsnorm`] call computes: `tokens` rows of `hidden` elements of
/// `dtype`. Every rank passes the same spec.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RmsNormSpec {
    /// f16 or bf16: the input, residual, weight and (unless fp8) output type.
    pub dtype: DataType,
    /// Rows (0 is a valid call that does nothing).
    pub tokens: usize,
    /// Elements per row: a multiple of 8 in 8..=[`MAX_HIDDEN`].
    pub hidden: usize,
    /// Added to the mean square: finite and not negative.
    pub eps: f32,
    /// Output type.
    pub output: RmsNormOutput,
    /// Forces one form; `None`: `ANYCCL_FUSED_RMSNORM`, then the selector's table rules, then the default rule
    /// ([`crate::Selector::select_rmsnorm`]).
    pub form: Option<RmsNormForm>,
}

impl RmsNormSpec {
    /// `tokens` × `hidden` of `dtype` with `eps`, output in `dtype`, the form left to the selector.
    pub fn new(dtype: DataType, tokens: usize, hidden: usize, eps: f32) -> Self {
        RmsNormSpec { dtype, tokens, hidden, eps, output: RmsNormOutput::Same, form: None }
    }

    /// The same with fp8 e4m3 output `e4m3(y / scale)`.
    pub fn fp8_output(mut self, scale: f32) -> Self {
        self.output = RmsNormOutput::Fp8E4M3 { scale };
        self
    }

    /// The same, carried out by `form` (an error if the backend cannot run it for this call).
    pub fn with_form(mut self, form: RmsNormForm) -> Self {
        self.form = Some(form);
        self
    }

    /// Checks the spec alone (type, `hidden`, `eps`, scale, sizes without overflow) and describes the call.
    pub fn call(&self) -> Result<RmsNormCall, InvalidArgument> {
        let dtype = self.dtype;
        if !matches!(dtype, DataType::F16 | DataType::Bf16) {
            return Err(InvalidArgument::UnsupportedDataType {
                dtype,
                backend: "any".into(),
                why: "the fused all-reduce + RMSNorm takes f16 and bf16 (RmsNormSpec::dtype)".into(),
            });
        }
        if self.hidden < VECTOR || self.hidden > MAX_HIDDEN {
            return Err(InvalidArgument::OutOfRange {
                what: "RmsNormSpec::hidden",
                value: self.hidden as u64,
                min: VECTOR as u64,
                max: MAX_HIDDEN as u64,
            });
        }
        if !self.hidden.is_multiple_of(VECTOR) {
            return Err(InvalidArgument::InvalidValue {
                what: "RmsNormSpec::hidden",
                value: self.hidden.to_string(),
                expected: "a multiple of 8 (rows are whole 16-byte vectors)",
            });
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(InvalidArgument::InvalidValue {
                what: "RmsNormSpec::eps",
                value: self.eps.to_string(),
                expected: "finite and not negative",
            });
        }
        if let RmsNormOutput::Fp8E4M3 { scale } = self.output {
            if !(scale.is_finite() && scale > 0.0) {
                return Err(InvalidArgument::InvalidValue {
                    what: "RmsNormSpec fp8 scale",
                    value: scale.to_string(),
                    expected: "finite and positive",
                });
            }
        }
        let count = self.tokens.checked_mul(self.hidden);
        let overflow = || InvalidArgument::CountOverflow { count: self.tokens, dtype, world: self.hidden };
        let bytes = count.and_then(|n| n.checked_mul(dtype.size_bytes())).ok_or_else(overflow)?;
        let out_bytes = count.and_then(|n| n.checked_mul(self.output.element_bytes(dtype))).ok_or_else(overflow)?;
        Ok(RmsNormCall {
            dtype,
            tokens: self.tokens,
            hidden: self.hidden,
            eps: self.eps,
            output: self.output,
            bytes,
            out_bytes,
            capturing: false,
            deterministic: false,
        })
    }
}

/// A checked call as backends and the selector see it ([`RmsNormSpec::call`], [`validate`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RmsNormCall {
    /// f16 or bf16.
    pub dtype: DataType,
    /// Rows.
    pub tokens: usize,
    /// Elements per row (a multiple of 8 in 8..=[`MAX_HIDDEN`]).
    pub hidden: usize,
    /// Added to the mean square.
    pub eps: f32,
    /// Output type.
    pub output: RmsNormOutput,
    /// Bytes of the input and of the residual (`tokens × hidden` elements, without overflow).
    pub bytes: usize,
    /// Bytes of the output.
    pub out_bytes: usize,
    /// Whether the stream is being captured into a graph (asked once by the front-end).
    pub capturing: bool,
    /// Whether the communicator is in deterministic mode: a backend refuses a form that would not sum in rank
    /// order (none of today's backends has one).
    pub deterministic: bool,
}

impl RmsNormCall {
    /// The same call inside (or outside) graph capture.
    pub fn with_capturing(mut self, capturing: bool) -> Self {
        self.capturing = capturing;
        self
    }

    /// The same call in (or out of) deterministic mode.
    pub fn with_deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Bytes of the weight (`hidden` elements).
    pub fn weight_bytes(&self) -> usize {
        // hidden ≤ MAX_HIDDEN and the element is 2 bytes: no overflow.
        self.hidden * self.dtype.size_bytes()
    }
}

/// The roles of the four buffers, in [`validate`]'s order.
pub const BUFFER_ROLES: [&str; 4] = ["input", "residual", "weight", "out"];

/// Checks one call before anything runs: the spec ([`RmsNormSpec::call`]), then every buffer (`bufs` in
/// [`BUFFER_ROLES`] order): where it lives (`location`, the communicator's), 16-byte alignment ([`ALIGN`]), its
/// length, and that `out` and `residual` (the two written) overlap no other buffer (the input and the weight may
/// share memory). Each error is typed and names the culprit.
pub fn validate(spec: &RmsNormSpec, location: Location, bufs: [BufferDesc; 4]) -> Result<RmsNormCall, InvalidArgument> {
    let call = spec.call()?;
    let count = call.tokens.saturating_mul(call.hidden);
    let need = [call.bytes, call.bytes, call.weight_bytes(), call.out_bytes];
    for ((which, b), need) in BUFFER_ROLES.into_iter().zip(&bufs).zip(need) {
        if b.location != location {
            return Err(InvalidArgument::WrongDevice { which, found: b.location, expected: location });
        }
        if !b.addr.is_multiple_of(ALIGN) {
            return Err(InvalidArgument::Misaligned { which, addr: b.addr, align: ALIGN, dtype: call.dtype });
        }
        if b.len < need {
            let count = if which == "weight" { call.hidden } else { count };
            return Err(InvalidArgument::BufferTooSmall { which, have: b.len, need, count, dtype: call.dtype });
        }
    }
    // Only the bytes the call touches matter.
    let used: Vec<BufferDesc> = bufs.iter().zip(need).map(|(b, n)| BufferDesc { len: n, ..*b }).collect();
    for w in [1usize, 3] {
        for o in (0..4).filter(|o| *o != w) {
            if used[w].overlaps(&used[o]) {
                return Err(InvalidArgument::Overlap {
                    send_addr: used[o].addr,
                    send_len: used[o].len,
                    recv_addr: used[w].addr,
                    recv_len: used[w].len,
                    layout: overlap_message(w, o),
                });
            }
        }
    }
    Ok(call)
}

/// What [`validate`] says when the written buffer `w` overlaps buffer `o` ([`BUFFER_ROLES`] indices).
fn overlap_message(w: usize, o: usize) -> &'static str {
    match (w, o) {
        (1, 0) => "all_reduce_rmsnorm: the residual (written) overlaps the input; it may overlap no other buffer",
        (1, 2) => "all_reduce_rmsnorm: the residual (written) overlaps the weight; it may overlap no other buffer",
        (1, _) => "all_reduce_rmsnorm: the residual (written) overlaps out; neither may overlap another buffer",
        (_, 0) => "all_reduce_rmsnorm: out (written) overlaps the input; it may overlap no other buffer",
        (_, 2) => "all_reduce_rmsnorm: out (written) overlaps the weight; it may overlap no other buffer",
        _ => "all_reduce_rmsnorm: out (written) overlaps the residual; neither may overlap another buffer",
    }
}

/// `ANYCCL_FUSED_RMSNORM`'s form (`None`: unset, empty or `auto`), read through `env`; a bad value is an error
/// naming the variable.
pub fn form_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<RmsNormForm>, Error> {
    let Some(v) = env(ENV_FUSED_RMSNORM) else { return Ok(None) };
    let t = v.trim();
    if t.is_empty() || t.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    t.parse::<RmsNormForm>().map(Some).map_err(|_| Error::Config {
        source_name: ENV_FUSED_RMSNORM.to_owned(),
        line: None,
        message: format!("'{t}': expected auto or one of {}", RmsNormForm::all_names()),
    })
}

/// What carried out a call: the form, and the rule (or override) that chose it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RmsNormSelection {
    /// The form that ran.
    pub form: RmsNormForm,
    /// Why: the caller's or the environment's override, a table rule, or the default rule.
    pub why: Arc<str>,
}

impl RmsNormSelection {
    /// `form`, chosen for `why`.
    pub fn new(form: RmsNormForm, why: impl Into<Arc<str>>) -> Self {
        RmsNormSelection { form, why: why.into() }
    }
}

/// The four buffers of a call.
pub struct RmsNormBufs<'a, Buf: ?Sized> {
    /// `[tokens][hidden]` elements: this rank's contribution to the all-reduce (read only).
    pub input: &'a Buf,
    /// `[tokens][hidden]` elements: read, then overwritten with `allreduce(input) + residual`.
    pub residual: &'a mut Buf,
    /// `[hidden]` elements (read only).
    pub weight: &'a Buf,
    /// `[tokens][hidden]` output elements (of the element type, or e4m3 bytes).
    pub out: &'a mut Buf,
}

/// A validated call: the buffers (checked against this backend's location, alignment, lengths and overlaps by
/// [`validate`]), the stream, the call and the form the selector chose (eligible on this backend). Only
/// [`crate::Communicator::all_reduce_rmsnorm`] makes one.
pub struct RmsNormArgs<'a, B: CommBackend + ?Sized> {
    bufs: RmsNormBufs<'a, BufOf<B>>,
    stream: &'a StreamOf<B>,
    call: RmsNormCall,
    form: RmsNormForm,
}

impl<'a, B: CommBackend + ?Sized> RmsNormArgs<'a, B> {
    /// Made by the `Communicator` once the call is validated and `form` found eligible.
    pub(crate) fn new(
        input: &'a BufOf<B>,
        residual: &'a mut BufOf<B>,
        weight: &'a BufOf<B>,
        out: &'a mut BufOf<B>,
        stream: &'a StreamOf<B>,
        call: RmsNormCall,
        form: RmsNormForm,
    ) -> Self {
        RmsNormArgs { bufs: RmsNormBufs { input, residual, weight, out }, stream, call, form }
    }

    /// The buffers.
    pub fn bufs(&self) -> &RmsNormBufs<'a, BufOf<B>> {
        &self.bufs
    }

    /// The buffers, consuming the description.
    pub fn into_bufs(self) -> RmsNormBufs<'a, BufOf<B>> {
        self.bufs
    }

    /// The stream the call is ordered on.
    pub fn stream(&self) -> &'a StreamOf<B> {
        self.stream
    }

    /// The call.
    pub fn call(&self) -> &RmsNormCall {
        &self.call
    }

    /// The form chosen (eligible for this call on this backend).
    pub fn form(&self) -> RmsNormForm {
        self.form
    }
}

/// f32 of an f16 or bf16 element's bits (exact).
pub fn to_f32(dtype: DataType, bits: u16) -> f32 {
    match dtype {
        DataType::F16 => half::f16::from_bits(bits).to_f32(),
        _ => half::bf16::from_bits(bits).to_f32(),
    }
}

/// An f16 or bf16 element's bits of `v`, rounded to nearest even.
pub fn from_f32(dtype: DataType, v: f32) -> u16 {
    match dtype {
        DataType::F16 => half::f16::from_f32(v).to_bits(),
        _ => half::bf16::from_f32(v).to_bits(),
    }
}

/// The sum of squares of `row` (f32 values of the rounded new residual) in the GPU kernels' order: thread `t` of
/// [`NORM_THREADS`] accumulates vectors `t, t + NORM_THREADS, …` element by element with a fused multiply-add from
/// +0; then each warp of 32 partial sums is added as a halving tree, and the warp sums likewise.
fn sum_of_squares(row: &[f32]) -> f32 {
    let vectors = row.len() / VECTOR;
    let mut part = [0f32; NORM_THREADS];
    for (t, p) in part.iter_mut().enumerate() {
        let mut acc = 0f32;
        for j in (t..vectors).step_by(NORM_THREADS) {
            for x in &row[j * VECTOR..(j + 1) * VECTOR] {
                acc = x.mul_add(*x, acc);
            }
        }
        *p = acc;
    }
    fn tree(v: &mut [f32]) -> f32 {
        let mut o = v.len() / 2;
        while o > 0 {
            for i in 0..o {
                v[i] += v[i + o];
            }
            o /= 2;
        }
        v[0]
    }
    let mut warps = [0f32; NORM_THREADS / 32];
    for (w, chunk) in warps.iter_mut().zip(part.chunks_mut(32)) {
        *w = tree(chunk);
    }
    tree(&mut warps)
}

/// The residual add and RMSNorm of one row of `call` (its type, `eps` and output), with the GPU kernels'
/// arithmetic (bit for bit): `reduced` is the all-reduce's row (element bits, rounded once), `residual` is
/// overwritten with `reduced + residual` (rounded), and `out` receives `rmsnorm(residual) × weight` as
/// native-endian element bits (`hidden × 2` bytes, as the buffers hold elements) or e4m3 bytes (`hidden` bytes). `scratch` holds `hidden` f32
/// values. Every slice has the row's length (`hidden`, a multiple of 8); the caller checks that.
pub fn norm_row(
    call: &RmsNormCall,
    reduced: &[u16],
    residual: &mut [u16],
    weight: &[u16],
    out: &mut [u8],
    scratch: &mut [f32],
) {
    let (dtype, eps, output) = (call.dtype, call.eps, call.output);
    let hidden = reduced.len();
    for ((r, s), f) in residual.iter_mut().zip(reduced).zip(scratch.iter_mut()) {
        *r = from_f32(dtype, to_f32(dtype, *s) + to_f32(dtype, *r));
        *f = to_f32(dtype, *r);
    }
    let mean = sum_of_squares(&scratch[..hidden]) / hidden as f32;
    let inv = 1.0f32 / (mean + eps).sqrt();
    let ys = scratch.iter().zip(weight).map(|(r, w)| r * inv * to_f32(dtype, *w));
    match output {
        RmsNormOutput::Same => {
            for (o, y) in out.chunks_exact_mut(2).zip(ys) {
                o.copy_from_slice(&from_f32(dtype, y).to_ne_bytes());
            }
        }
        RmsNormOutput::Fp8E4M3 { scale } => {
            for (o, y) in out.iter_mut().zip(ys) {
                *o = float8::F8E4M3::from_f32(y / scale).to_bits();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOC: Location = Location::Device { ordinal: 0 };

    fn bufs(tokens: usize, hidden: usize, esz: usize) -> [BufferDesc; 4] {
        let n = tokens * hidden * esz;
        let gap = n.next_multiple_of(256) + 256;
        let at = |i: usize, len: usize| BufferDesc { addr: (1 << 20) + i * gap, len, location: LOC };
        [at(0, n), at(1, n), at(2, hidden * esz), at(3, n)]
    }

    #[test]
    fn a_valid_call_passes_and_describes_its_sizes() {
        let spec = RmsNormSpec::new(DataType::Bf16, 64, 8192, 1e-6);
        let call = validate(&spec, LOC, bufs(64, 8192, 2)).expect("valid");
        assert_eq!((call.bytes, call.out_bytes, call.weight_bytes()), (64 * 8192 * 2, 64 * 8192 * 2, 8192 * 2));
        let mut b = bufs(3, 16384, 2);
        b[3].len = 3 * 16384;
        let call = validate(&RmsNormSpec::new(DataType::F16, 3, 16384, 0.0).fp8_output(0.5), LOC, b).expect("fp8");
        assert_eq!(call.out_bytes, 3 * 16384);
        assert!(validate(&RmsNormSpec::new(DataType::F16, 0, 8, 1e-5), LOC, bufs(0, 8, 2)).is_ok());
        // The input and the weight are only read: the same memory for both is fine.
        let mut b = bufs(4, 1024, 2);
        b[2].addr = b[0].addr;
        assert!(validate(&RmsNormSpec::new(DataType::Bf16, 4, 1024, 1e-6), LOC, b).is_ok());
    }

    #[test]
    fn bad_calls_get_typed_errors_naming_the_culprit() {
        use InvalidArgument as I;
        let ok = bufs(4, 1024, 2);
        let base = RmsNormSpec::new(DataType::Bf16, 4, 1024, 1e-6);
        let err = |spec: RmsNormSpec, b: [BufferDesc; 4]| validate(&spec, LOC, b).expect_err("refused");
        assert!(matches!(err(RmsNormSpec { dtype: DataType::F32, ..base }, ok), I::UnsupportedDataType { .. }));
        for h in [0, 4, 16392, usize::MAX] {
            let e = err(RmsNormSpec { hidden: h, ..base }, ok);
            assert!(matches!(e, I::OutOfRange { what: "RmsNormSpec::hidden", .. }), "{h}: {e}");
        }
        let e = err(RmsNormSpec { hidden: 1020, ..base }, ok);
        assert!(matches!(e, I::InvalidValue { what: "RmsNormSpec::hidden", .. }) && e.to_string().contains("8"));
        for eps in [f32::NAN, -1.0, f32::INFINITY] {
            assert!(matches!(err(RmsNormSpec { eps, ..base }, ok), I::InvalidValue { what: "RmsNormSpec::eps", .. }));
        }
        for scale in [0.0, -1.0, f32::INFINITY, f32::NAN] {
            let e = err(base.fp8_output(scale), ok);
            assert!(matches!(e, I::InvalidValue { .. }) && e.to_string().contains("scale"), "{e}");
        }
        assert!(matches!(err(RmsNormSpec { tokens: usize::MAX, ..base }, ok), I::CountOverflow { .. }));
        for (i, which) in BUFFER_ROLES.into_iter().enumerate() {
            let mut b = ok;
            b[i].len -= 2;
            assert!(matches!(err(base, b), I::BufferTooSmall { which: w, .. } if w == which), "{which} short");
            let mut b = ok;
            b[i].addr += 8;
            assert!(matches!(err(base, b), I::Misaligned { which: w, align: 16, .. } if w == which), "{which}");
            let mut b = ok;
            b[i].location = Location::Device { ordinal: 1 };
            assert!(matches!(err(base, b), I::WrongDevice { which: w, .. } if w == which), "{which} elsewhere");
            let mut b = ok;
            b[i].location = Location::Host;
            assert!(matches!(err(base, b), I::WrongDevice { .. }), "{which} on the host");
        }
        // out over the input, the residual over the weight, out over the residual, a partial overlap: refused.
        for (w, o, shift) in [(3usize, 0usize, 0usize), (1, 2, 0), (3, 1, 0), (1, 0, 16)] {
            let mut b = ok;
            b[w].addr = b[o].addr + shift;
            let e = err(base, b);
            assert!(matches!(e, I::Overlap { .. }), "{w} over {o}: {e}");
            let names = [["input", "residual", "weight", "out"][w], ["input", "residual", "weight", "out"][o]];
            assert!(names.iter().all(|n| e.to_string().contains(n)), "{names:?}: {e}");
        }
    }

    #[test]
    fn form_names_round_trip_and_the_environment_parses() {
        for f in RmsNormForm::ALL {
            assert_eq!(f.name().parse::<RmsNormForm>().expect("round trip"), f);
            assert_eq!(f.to_string(), f.name());
        }
        assert_eq!("one-shot".parse::<RmsNormForm>().expect("alias"), RmsNormForm::FusedOneShot);
        assert_eq!(" Two-Shot ".parse::<RmsNormForm>().expect("alias"), RmsNormForm::FusedTwoShot);
        assert!("fast".parse::<RmsNormForm>().expect_err("bad").to_string().contains("fused-one-shot"));
        let env = |v: &'static str| move |k: &str| (k == ENV_FUSED_RMSNORM).then(|| v.to_string());
        assert_eq!(form_from_env(&env("two-shot")).expect("ok"), Some(RmsNormForm::FusedTwoShot));
        assert_eq!(form_from_env(&env("unfused")).expect("ok"), Some(RmsNormForm::Unfused));
        assert_eq!(form_from_env(&env("auto")).expect("ok"), None);
        assert_eq!(form_from_env(&env("")).expect("ok"), None);
        assert_eq!(form_from_env(&|_: &str| None).expect("ok"), None);
        let e = form_from_env(&env("fast")).expect_err("bad");
        assert!(matches!(&e, Error::Config { source_name, .. } if source_name == ENV_FUSED_RMSNORM), "{e}");
    }

    /// The row arithmetic against f64 on the same rounded values: the residual is the rounded sum, the output
    /// the normalised row within f32 rounding, and fp8 output the e4m3 of `y / scale`.
    #[test]
    fn norm_row_is_rmsnorm_of_the_sum_plus_residual() {
        for dtype in [DataType::F16, DataType::Bf16] {
            for hidden in [8usize, 4104, 16384] {
                let mut s = 7u64 + hidden as u64;
                let mut next = || {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    from_f32(dtype, ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32)
                };
                let reduced: Vec<u16> = (0..hidden).map(|_| next()).collect();
                let res0: Vec<u16> = (0..hidden).map(|_| next()).collect();
                let weight: Vec<u16> = (0..hidden).map(|_| next()).collect();
                let mut res = res0.clone();
                let mut out = vec![0u8; hidden * 2];
                let mut scratch = vec![0f32; hidden];
                let call = RmsNormSpec::new(dtype, 1, hidden, 1e-5).call().expect("valid");
                norm_row(&call, &reduced, &mut res, &weight, &mut out, &mut scratch);
                let f = |b: u16| f64::from(to_f32(dtype, b));
                let ms = res.iter().map(|r| f(*r) * f(*r)).sum::<f64>() / hidden as f64;
                let inv = 1.0 / (ms + 1e-5).sqrt();
                for i in 0..hidden {
                    assert_eq!(res[i], from_f32(dtype, (f(reduced[i]) + f(res0[i])) as f32), "{dtype} res {i}");
                    let want = f(res[i]) * inv * f(weight[i]);
                    let got = f(u16::from_ne_bytes([out[2 * i], out[2 * i + 1]]));
                    assert!((got - want).abs() <= 1e-2 * (want.abs() + 1e-3), "{dtype} {hidden} out {i}: {got} {want}");
                }
                let mut res8 = res0.clone();
                let mut out8 = vec![0u8; hidden];
                let fp8 = RmsNormSpec::new(dtype, 1, hidden, 1e-5).fp8_output(0.25).call().expect("valid");
                norm_row(&fp8, &reduced, &mut res8, &weight, &mut out8, &mut scratch);
                assert_eq!(res8, res);
                for i in 0..hidden {
                    let y = f(u16::from_ne_bytes([out[2 * i], out[2 * i + 1]])) / 0.25;
                    let got = f64::from(float8::F8E4M3::from_bits(out8[i]).to_f32());
                    assert!(
                        (got - y.clamp(-448.0, 448.0)).abs() <= 0.07 * y.abs() + 1e-2,
                        "{dtype} fp8 {i}: {got} {y}"
                    );
                }
            }
        }
    }
}
