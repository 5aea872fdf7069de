//! The fused all-reduce + residual add + RMSNorm on the GPU communicator: [`GpuComm`]'s answers to
//! [`CommBackend::rmsnorm_eligible`](anyccl_core::CommBackend::rmsnorm_eligible) and its
//! [`CommBackend::all_reduce_rmsnorm`](anyccl_core::CommBackend::all_reduce_rmsnorm), over the custom kernels'
//! staging, scratch, flag arrays and graph input tables. The front door is
//! [`anyccl_core::Communicator::all_reduce_rmsnorm`], which validates the call ([`anyccl_core::fused::validate`])
//! and chooses the form before anything here runs.
//!
//! The forms are a registered plan family ([`FusedPlans`], found by form in the plan table,
//! [`super::plans::registered_rmsnorm`]), as the all-reduce's kernel families are: its eligibility decides once
//! everything a launch needs ([`FusedPlan`]: kernel shape, grid, the unfused path's all-reduce kind, dependent
//! launch), its launch runs that plan without working the form out again, and a failure names the form.

use anyccl_core::fused::{RmsNormArgs, RmsNormCall, RmsNormForm};
use anyccl_core::{Error, Result};

use super::plans::{registered_rmsnorm, RmsNormPlans};
use super::{custom_blocks, GpuComm};
use crate::device::GpuRuntime;
use crate::fused::{self as fused, FusedForm, NormArgs};
use crate::kernels::{self, Inputs, Kind};
use crate::push::{fused_push_ineligible, PUSH_MAX_BYTES};
use crate::GpuPlatform;

/// Why `form` cannot run `call` on `world` ranks whose custom kernels have `capacity` bytes of staging and
/// scratch (each), or `None`: the fused kernels' type, row and world bounds; the staging (the input is staged, or
/// read through an input table, up to `capacity`); two-shot's scratch (new residual and output rows); and the
/// unfused path's all-reduce into `out`, which cannot hold the sum when `out` is e4m3 bytes.
pub fn rmsnorm_ineligible(form: RmsNormForm, call: &RmsNormCall, world: usize, capacity: usize) -> Option<String> {
    if let Some(why) = fused::fused_ineligible(call.dtype, call.hidden, world) {
        return Some(why);
    }
    if !matches!(call.output, fused::FusedOutput::Same | fused::FusedOutput::Fp8E4M3 { .. }) {
        return Some(format!("the fused kernels cannot make output {:?}", call.output));
    }
    if call.bytes > capacity {
        return Some(format!(
            "{} bytes of input exceed the custom kernels' staging of {capacity} bytes (ANYCCL_CUSTOM_MAX_BYTES)",
            call.bytes
        ));
    }
    match form {
        RmsNormForm::FusedOneShot => None,
        RmsNormForm::FusedTwoShot => {
            let scratch = fused::two_shot_scratch_bytes(call.dtype, call.tokens, call.hidden, call.output);
            match scratch {
                Some(s) if s <= capacity => None,
                _ => Some(format!(
                    "two-shot's scratch (new residual and output rows, {} bytes) exceeds the custom kernels' {capacity} \
                     bytes (ANYCCL_CUSTOM_MAX_BYTES)",
                    scratch.map_or_else(|| "more than usize::MAX".to_owned(), |s| s.to_string())
                )),
            }
        }
        RmsNormForm::FusedPush => {
            crate::push::fused_push_ineligible(call.dtype, call.tokens, call.hidden, world, PUSH_MAX_BYTES)
        }
        RmsNormForm::Unfused if call.output != fused::FusedOutput::Same => Some(
            "the unfused path all-reduces into `out`, which holds e4m3 bytes with fp8 output; fp8 output is made by \
             the fused kernels only"
                .to_owned(),
        ),
        _ => None,
    }
}

/// What the fused family decided for a call: the form, and everything its launch needs beyond the call's buffers
/// and stream. Made only by [`FusedPlans`]' eligibility.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FusedPlan {
    form: RmsNormForm,
    step: FusedStep,
}

/// The kernels one fused plan launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FusedStep {
    /// The fused one-shot or two-shot kernel, with this many blocks per rank.
    Shot { shape: FusedForm, blocks: u32 },
    /// The fused push one-shot (with programmatic dependent launch where the kernels have it).
    Push { dependent: bool },
    /// The custom all-reduce of this kind into `out` on `blocks` blocks, then the RMSNorm kernel on `norm_blocks`.
    Unfused { kind: Kind, blocks: u32, norm_blocks: u32 },
}

/// The fused all-reduce + residual add + RMSNorm of one [`RmsNormForm`] (the unfused baseline included: the custom
/// all-reduce, then the separate RMSNorm kernel).
pub(crate) struct FusedPlans(pub(crate) RmsNormForm);

/// `e`, a failure of running `form`, named by that form: a vendor call's failure says which fused call it was part
/// of, a refusal which form refused.
fn name_form(form: RmsNormForm, e: Error) -> Error {
    match e {
        Error::Backend { backend, call, code, message } => {
            Error::Backend { backend, call: format!("{form} all-reduce + rmsnorm: {call}"), code, message }
        }
        Error::NoEligibleAlgorithm { why } => Error::NoEligibleAlgorithm { why: format!("{form}: {why}") },
        other => other,
    }
}

impl<P: GpuPlatform> RmsNormPlans<P> for FusedPlans {
    fn eligible(&self, comm: &GpuComm<P>, call: &RmsNormCall) -> std::result::Result<FusedPlan, String> {
        let form = self.0;
        let st = comm.custom.as_ref().map_err(Clone::clone)?;
        let fk = comm.fused.as_ref().ok_or_else(|| "the fused kernels are not set up".to_owned())?;
        let world = comm.ccl.world();
        if let Some(why) = rmsnorm_ineligible(form, call, world, st.capacity) {
            return Err(why);
        }
        let max = st.max_blocks;
        let step = match form {
            RmsNormForm::FusedPush => {
                // The push one-shot's receive buffers, its agreed limit and the kernel itself.
                let p = st.push.as_ref().map_err(|why| format!("the push one-shot is {why}"))?;
                if let Some(why) = fused_push_ineligible(call.dtype, call.tokens, call.hidden, world, p.capacity) {
                    return Err(why);
                }
                if let Some(why) = p.kernels.fused_missing(call.dtype) {
                    return Err(why);
                }
                FusedStep::Push { dependent: p.kernels.dependent_launch().is_ok() }
            }
            RmsNormForm::FusedOneShot => {
                FusedStep::Shot { shape: FusedForm::OneShot, blocks: call.tokens.clamp(1, max) as u32 }
            }
            RmsNormForm::FusedTwoShot => {
                let rows = call.tokens.div_ceil(world);
                FusedStep::Shot { shape: FusedForm::TwoShot, blocks: rows.clamp(1, max) as u32 }
            }
            RmsNormForm::Unfused => {
                let kind = if call.bytes <= anyccl_core::selector::FUSED_ONE_SHOT_MAX_BYTES {
                    Kind::OneShot
                } else {
                    Kind::TwoShot
                };
                let norm_blocks = call.tokens.clamp(1, 4 * fk.multiprocessors().max(1)) as u32;
                FusedStep::Unfused { kind, blocks: custom_blocks(call.bytes, max), norm_blocks }
            }
            other => return Err(format!("{other} is not a form the GPU communicators implement")),
        };
        Ok(FusedPlan { form, step })
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &FusedPlan, args: RmsNormArgs<'_, GpuComm<P>>) -> Result<()> {
        let form = plan.form;
        if form != self.0 || form != args.form() {
            return Err(Error::backend(
                "anyccl",
                "all-reduce + rmsnorm plan",
                None,
                format!("a {form} plan reached the {} family for a {} call", self.0, args.form()),
            ));
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { run_plan(comm, plan, args) }.map_err(|e| name_form(form, e))
    }
}

/// Runs `args` by `plan` ([`FusedPlans::launch`]).
///
/// # Safety
/// As [`RmsNormPlans::launch`]: `plan` was made by [`FusedPlans`]' eligibility for `args`' call on `comm`, and
/// nothing it read has changed since.
unsafe fn run_plan<P: GpuPlatform>(
    comm: &mut GpuComm<P>,
    plan: &FusedPlan,
    args: RmsNormArgs<'_, GpuComm<P>>,
) -> Result<()> {
    let call = *args.call();
    let stream = args.stream();
    let bufs = args.into_bufs();
    let (input, residual, weight, out) = (bufs.input, bufs.residual, bufs.weight, bufs.out);
    if call.bytes == 0 {
        // Nothing to do on any rank alike: no launch keeps the barrier epochs in step.
        return Ok(());
    }
    let rank = comm.ccl.rank();
    let not_set_up = || Error::NoEligibleAlgorithm { why: "the custom kernels are off".into() };
    let st = comm.custom.as_mut().map_err(|_| not_set_up())?;
    let fk = comm.fused.as_ref().ok_or_else(not_set_up)?;
    comm.runtime.bind()?;
    let (src, dst) = (input.device_ptr(), out.device_ptr());
    let norm =
        NormArgs::new(residual.device_ptr(), weight.device_ptr(), dst, call.tokens, call.hidden, call.eps, call.output);
    if let FusedStep::Push { dependent } = plan.step {
        let p = st.push.as_ref().map_err(|why| Error::NoEligibleAlgorithm { why: why.clone() })?;
        let my_flags = st.all_flags.get(rank).copied().unwrap_or(0);
        // SAFETY: validated by the front-end (every buffer this device's, 16-byte aligned, long enough, out and
        // residual overlapping nothing) and eligible (the plan: the message within the agreed push limit and the
        // receive slots, still so by the caller's contract); every rank's receive buffer is live and initialised
        // (set up with the custom kernels, shared by this communicator's push calls only, one protocol); every rank
        // makes the same call; ranks run on different GPUs. A null flag array is refused by the launch.
        return unsafe {
            p.kernels.launch_fused(
                &comm.runtime,
                call.dtype,
                src,
                &norm,
                &p.all_recv,
                my_flags,
                rank,
                p.capacity,
                dependent,
                stream,
            )
        };
    }
    // The push form reads its own input directly (eager and captured alike); the others read every rank's input
    // through staging or, during capture, a graph-input table (a slot is made for the input here).
    let table = if call.capturing { st.graph.table_for(src) } else { None };
    let inputs = match table {
        Some(table) => Inputs::Table { table, own: src },
        None => Inputs::Staged { staging: &st.all_staging, own: src },
    };
    // SAFETY: validated by the front-end (the `RmsNormArgs` only it makes): every buffer is this device's, 16-byte
    // aligned, long enough, and out/residual overlap nothing; every rank's staging and scratch hold `capacity` bytes
    // (≥ the input, ≥ the two-shot scratch, and the unfused path has no fp8 output: the plan's eligibility, still so
    // by the caller's contract), reachable through peer access or IPC; every rank makes the same call (a collective)
    // with the same block counts (functions of the call, the world and the communicator's block limit, which every
    // rank agreed on); ranks run on different GPUs.
    unsafe {
        match plan.step {
            FusedStep::Shot { shape, blocks } => {
                fk.launch_fused(shape, call.dtype, inputs, &st.all_scratch, &norm, &st.all_flags, rank, blocks, stream)
            }
            FusedStep::Unfused { kind, blocks, norm_blocks } => {
                // The custom all-reduce into `out`, then the RMSNorm of `out` in place (each thread reads its row
                // elements before it writes them).
                st.kernels.launch(
                    kind,
                    call.dtype,
                    inputs,
                    &st.all_scratch,
                    dst,
                    &st.all_flags,
                    rank,
                    call.bytes,
                    blocks,
                    kernels::TWO_SHOT_ROUND_BYTES,
                    stream,
                )?;
                fk.launch_rmsnorm(call.dtype, dst, &norm, norm_blocks, stream)
            }
            FusedStep::Push { .. } => Ok(()), // launched above
        }
    }
}

impl<P: GpuPlatform> GpuComm<P> {
    /// Whether `form` can run `call` on this communicator: its registered family's eligibility
    /// ([`FusedPlans`]), the plan dropped.
    pub(super) fn fused_eligible(&self, form: RmsNormForm, call: &RmsNormCall) -> std::result::Result<(), String> {
        registered_rmsnorm::<P>(form).eligible(self, call).map(|_| ())
    }

    /// Runs a validated call with the form the front-end chose, by the plan its family makes for the state this
    /// call uses (the front-end asked the same family a moment ago; [`anyccl_core::CommBackend`] carries no fused
    /// plan to the run). `residual` is overwritten with `allreduce(input) + residual` (the same on every rank; it
    /// must be the same on every rank before the call too); capture-safe (nothing is allocated; during capture the
    /// input is read through an input table, as for the custom all-reduce).
    pub(super) fn run_rmsnorm(&mut self, args: RmsNormArgs<'_, Self>) -> Result<()> {
        let form = args.form();
        let family = registered_rmsnorm::<P>(form);
        let plan = family.eligible(self, args.call()).map_err(|why| Error::NoEligibleAlgorithm { why })?;
        // SAFETY: `plan` was made by this family for this call on this communicator just now, with nothing between.
        unsafe { family.launch(self, &plan, args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyccl_core::fused::RmsNormSpec;
    use anyccl_core::DataType;

    fn call(tokens: usize, hidden: usize) -> RmsNormCall {
        RmsNormSpec::new(DataType::Bf16, tokens, hidden, 1e-6).call().expect("valid")
    }

    /// The capacity fallbacks are eligibility answers with their reason: two-shot's scratch too big, fp8 output
    /// on the unfused path, the input beyond staging, and the kernels' own bounds.
    #[test]
    fn eligibility_says_why_each_form_cannot_run() {
        use RmsNormForm::*;
        let cap = 8 << 20;
        // 512 rows of 8192 bf16: 8 MiB input fits; two-shot's 16 MiB scratch does not.
        let c = call(512, 8192);
        assert_eq!(rmsnorm_ineligible(FusedOneShot, &c, 8, cap), None);
        assert_eq!(rmsnorm_ineligible(Unfused, &c, 8, cap), None);
        let why = rmsnorm_ineligible(FusedTwoShot, &c, 8, cap).expect("scratch too small");
        assert!(why.contains("scratch") && why.contains("ANYCCL_CUSTOM_MAX_BYTES"), "{why}");
        assert_eq!(rmsnorm_ineligible(FusedTwoShot, &c, 8, 16 << 20), None);
        // fp8 output: never unfused; two-shot's scratch is smaller (1 byte per output element).
        let f = RmsNormSpec::new(DataType::Bf16, 256, 8192, 1e-6).fp8_output(0.5).call().expect("valid");
        assert!(rmsnorm_ineligible(Unfused, &f, 8, cap).expect("refused").contains("fp8"));
        assert_eq!(rmsnorm_ineligible(FusedTwoShot, &f, 8, cap), None);
        // Beyond staging: every form refused.
        let big = call(1024, 8192);
        for form in RmsNormForm::ALL {
            assert!(rmsnorm_ineligible(form, &big, 8, cap).expect("refused").contains("staging"), "{form}");
        }
        // The kernels' world bounds.
        for w in [1, 9] {
            assert!(rmsnorm_ineligible(FusedOneShot, &call(1, 8), w, cap).expect("refused").contains("world"));
        }
    }
}
