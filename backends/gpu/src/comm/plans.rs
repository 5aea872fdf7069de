//! Each all-reduce algorithm of a GPU communicator as a registered plan.
//!
//! One type per kernel family implements [`AllReducePlans`]: [`CclPlans`] (the collective library), [`ShotPlans`]
//! (the custom one-shot and two-shot), [`PushPlans`] (the push one-shot and two-shot) and [`QuantPlans`] (the
//! quantized two-shots). [`registered`] is the one table keyed by [`Algorithm`]: it maps every algorithm to its
//! family, with the family's variant (kernel kind, push shape, quantized format) fixed in the entry. The front-end
//! asks the table's [`AllReducePlans::eligible`] once per decision and remembers the [`Plan`] it returns with the
//! decision; [`AllReducePlans::launch`] consumes that plan, so nothing after selection works the algorithm out
//! again, and a failure names the algorithm that ran ([`name_algorithm`]).
//!
//! [`NvlsPlans`] (the NVLS multicast kernels, where the communicator's multicast setup succeeded) is the fifth.
//!
//! The fused all-reduce + residual add + RMSNorm is chosen by form ([`RmsNormForm`]), not by [`Algorithm`]: its
//! family ([`FusedPlans`]) implements [`RmsNormPlans`], the same pair of eligibility and launch over a plan, and
//! [`registered_rmsnorm`] is its entry in this table.

use anyccl_core::comm::{AllReduceArgs, AllReduceCall};
use anyccl_core::fused::{RmsNormArgs, RmsNormCall, RmsNormForm};
use anyccl_core::{Algorithm, Error, ReduceOp, Result};

use super::fused_call::{FusedPlan, FusedPlans};
use super::{custom_blocks, GpuComm};
use crate::device::GpuRuntime;
use crate::kernels::{self, Inputs, Kind};
use crate::push::{self, PushGrid, PushShape};
use crate::quant::{self, Format};
use crate::GpuPlatform;

/// How a GPU communicator runs one all-reduce: the algorithm chosen and what its family decided for the call
/// ([`anyccl_core::CommBackend::Plan`] of [`GpuComm`]). Made only by the registered families' eligibility.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    algorithm: Algorithm,
    step: Step,
}

impl Plan {
    /// The algorithm this plan runs.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
}

/// What one family decided for a call: everything its launch needs beyond the call's buffers and stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The collective library's all-reduce (symmetric kernels where the buffers lie in a registered window).
    Ccl,
    /// The custom one-shot or two-shot kernel, with this many blocks per rank.
    Shot { kind: Kind, blocks: u32 },
    /// A push kernel of this shape on this grid.
    Push { shape: PushShape, grid: PushGrid },
    /// A quantized two-shot of this format, with this many blocks per rank.
    Quant { format: Format, blocks: u32 },
    /// An NVLS multicast kernel (the variant is the plan's algorithm).
    Nvls,
}

/// One kernel family's all-reduce: whether it can run a call, and how it runs the plan it made.
pub(crate) trait AllReducePlans<P: GpuPlatform>: Sync {
    /// Whether `algorithm` (one this family is registered for in [`registered`]) can run `call` on `comm`: the
    /// plan for it, or why not.
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        call: &AllReduceCall,
    ) -> std::result::Result<Plan, String>;

    /// Runs `args` by `plan`.
    ///
    /// # Safety
    /// `plan` was returned by this family's [`AllReducePlans::eligible`] for `args`' call on `comm`, and nothing
    /// that eligibility reads has changed since (the communicator's eligibility epoch is the same), so the sizes
    /// and buffers it checked still hold.
    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()>;

    /// Whether neither this family's eligibility nor its launch reads whether the stream is being captured
    /// ([`anyccl_core::CommBackend::capture_independent`]).
    fn capture_independent(&self) -> bool {
        false
    }
}

/// The one table: every algorithm's family, with its variant. An algorithm not listed (the host's ring, or one
/// added to [`Algorithm`] later) is never eligible here, with the platform's reason.
pub(crate) fn registered<P: GpuPlatform>(algorithm: Algorithm) -> &'static dyn AllReducePlans<P> {
    match algorithm {
        Algorithm::Ccl | Algorithm::CclSymmetric => &CclPlans,
        Algorithm::OneShot => &ShotPlans(Kind::OneShot),
        Algorithm::TwoShot => &ShotPlans(Kind::TwoShot),
        Algorithm::OneShotPush => &PushPlans(PushShape::OneShot),
        Algorithm::TwoShotPush => &PushPlans(PushShape::TwoShot),
        Algorithm::TwoShotFp8 => &QuantPlans(Format::Fp8E4m3),
        Algorithm::TwoShotInt8 => &QuantPlans(Format::Int8),
        Algorithm::NvlsZeroCopy | Algorithm::NvlsWarpPipeline | Algorithm::NvlsBlockPipeline => &NvlsPlans,
        _ => &Unregistered,
    }
}

/// The fused all-reduce + residual add + RMSNorm's family: whether a form can run a call, and how it runs the plan
/// it made ([`AllReducePlans`]' shape, keyed by form).
pub(crate) trait RmsNormPlans<P: GpuPlatform>: Sync {
    /// Whether this family's form can run `call` on `comm`: the plan for it, or why not.
    fn eligible(&self, comm: &GpuComm<P>, call: &RmsNormCall) -> std::result::Result<FusedPlan, String>;

    /// Runs `args` by `plan`; a failure names the form.
    ///
    /// # Safety
    /// `plan` was returned by this family's [`RmsNormPlans::eligible`] for `args`' call on `comm`, and nothing that
    /// eligibility reads has changed since, so the sizes and buffers it checked still hold.
    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &FusedPlan, args: RmsNormArgs<'_, GpuComm<P>>) -> Result<()>;
}

/// The fused forms' entries: every form of [`RmsNormForm::ALL`] is the fused kernels' family with that form fixed
/// in the entry; a form added to [`RmsNormForm`] later is never eligible.
pub(crate) fn registered_rmsnorm<P: GpuPlatform>(form: RmsNormForm) -> &'static dyn RmsNormPlans<P> {
    match form {
        RmsNormForm::FusedOneShot => &FusedPlans(RmsNormForm::FusedOneShot),
        RmsNormForm::FusedTwoShot => &FusedPlans(RmsNormForm::FusedTwoShot),
        RmsNormForm::Unfused => &FusedPlans(RmsNormForm::Unfused),
        RmsNormForm::FusedPush => &FusedPlans(RmsNormForm::FusedPush),
        _ => &UnregisteredForm,
    }
}

/// A fused form no GPU communicator implements: never eligible.
struct UnregisteredForm;

impl<P: GpuPlatform> RmsNormPlans<P> for UnregisteredForm {
    fn eligible(&self, _comm: &GpuComm<P>, _call: &RmsNormCall) -> std::result::Result<FusedPlan, String> {
        Err("not a form the GPU communicators implement".to_owned())
    }

    unsafe fn launch(
        &self,
        _comm: &mut GpuComm<P>,
        _plan: &FusedPlan,
        args: RmsNormArgs<'_, GpuComm<P>>,
    ) -> Result<()> {
        Err(Error::NoEligibleAlgorithm { why: format!("{}: not a form the GPU communicators implement", args.form()) })
    }
}

/// `e`, a failure of running `algorithm`, named by that algorithm: an eligibility refusal from deeper down says
/// `algorithm`, and a vendor call's failure says which all-reduce it was part of.
pub(crate) fn name_algorithm(algorithm: Algorithm, e: Error) -> Error {
    match e {
        Error::AlgorithmNotEligible { why, .. } => Error::AlgorithmNotEligible { algorithm, why },
        Error::Backend { backend, call, code, message } => {
            Error::Backend { backend, call: format!("{algorithm} all-reduce: {call}"), code, message }
        }
        other => other,
    }
}

/// The error of a plan handed to a family that did not make it (the table and the plans disagree: a bug).
fn foreign(plan: &Plan, family: &str) -> Error {
    Error::backend("anyccl", "all-reduce plan", None, format!("a {} plan reached the {family} family", plan.algorithm))
}

/// The collective library's all-reduce: [`Algorithm::Ccl`] and [`Algorithm::CclSymmetric`] (the same call: the
/// library picks its symmetric kernels when the buffers lie in a registered window, which eligibility checks).
pub(crate) struct CclPlans;

impl<P: GpuPlatform> AllReducePlans<P> for CclPlans {
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        call: &AllReduceCall,
    ) -> std::result::Result<Plan, String> {
        let hint = format!("{}::symmetric_buffer", P::COMM_NAME);
        match comm.ccl.eligible(algorithm, call, &comm.caps, &hint) {
            Some(r) => r.map(|()| Plan { algorithm, step: Step::Ccl }),
            None => Err(format!("{algorithm} is not the collective library's")),
        }
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()> {
        if plan.step != Step::Ccl {
            return Err(foreign(plan, "collective library"));
        }
        // NCCL makes the communicator's device current itself before it prepares and launches a collective (what
        // lets one thread drive several GPUs in a group), so the device is bound here only where the library does
        // not ([`GpuPlatform::CCL_BINDS_DEVICE`]).
        comm.bind_for_ccl()?;
        // SAFETY: `args` was made by this backend's `Communicator` after validating it against this rank: both
        // buffers hold `count` elements of this device and do not overlap unless in place; the stream is live
        // (borrowed for the call).
        unsafe { comm.ccl.all_reduce(args) }
    }

    fn capture_independent(&self) -> bool {
        // The library's calls handle capture themselves.
        true
    }
}

/// The custom one-shot ([`Kind::OneShot`]) or two-shot ([`Kind::TwoShot`]) kernel.
pub(crate) struct ShotPlans(Kind);

impl<P: GpuPlatform> AllReducePlans<P> for ShotPlans {
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        call: &AllReduceCall,
    ) -> std::result::Result<Plan, String> {
        let st = comm.custom.as_ref().map_err(Clone::clone)?;
        if call.op != ReduceOp::Sum {
            return Err(format!("the custom kernels implement sum, not {}", call.op));
        }
        if let Some(why) = kernels::ineligible::<P>(call.dtype, call.bytes, comm.ccl.world()) {
            return Err(why);
        }
        if call.bytes > st.capacity {
            return Err(format!(
                "{} bytes exceed the custom kernels' staging buffers ({} bytes; ANYCCL_CUSTOM_MAX_BYTES)",
                call.bytes, st.capacity
            ));
        }
        Ok(Plan { algorithm, step: Step::Shot { kind: self.0, blocks: custom_blocks(call.bytes, st.max_blocks) } })
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()> {
        let Step::Shot { kind, blocks } = plan.step else { return Err(foreign(plan, "one-shot/two-shot")) };
        let Some((io, st, _)) = comm.custom_launch(plan, &args)? else { return Ok(()) };
        // Captured calls read their inputs through a table (switched to the registered inputs once registered),
        // except an in-place one-shot, which would overwrite its input while peers still read it.
        let table = if args.capturing() && !(kind == Kind::OneShot && io.src == io.dst) {
            st.graph.table_for(io.src)
        } else {
            None
        };
        let inputs = match table {
            Some(table) => Inputs::Table { table, own: io.src },
            None => Inputs::Staged { staging: &st.all_staging, own: io.src },
        };
        // SAFETY: every rank's staging/scratch/flags were allocated with `capacity >= bytes` (eligibility, whose
        // answer still holds: the caller's contract) by the setup and are reachable through peer access or IPC;
        // the tables hold staging or registered inputs of every rank; every rank of this communicator makes the
        // same calls in the same order (a collective), with the same block count (a function of `bytes`); ranks
        // run on different GPUs.
        unsafe {
            st.kernels.launch(
                kind,
                args.dtype(),
                inputs,
                &st.all_scratch,
                io.dst,
                &st.all_flags,
                io.rank,
                io.bytes,
                blocks,
                kernels::TWO_SHOT_ROUND_BYTES,
                args.stream(),
            )
        }
    }
}

/// A push kernel ([`PushShape::OneShot`], [`PushShape::TwoShot`]) over the push receive buffers.
pub(crate) struct PushPlans(PushShape);

impl<P: GpuPlatform> AllReducePlans<P> for PushPlans {
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        call: &AllReduceCall,
    ) -> std::result::Result<Plan, String> {
        let st = comm.custom.as_ref().map_err(Clone::clone)?;
        // Both shapes share the push one-shot's receive buffers and limit (ANYCCL_PUSH_MAX_BYTES).
        let push = st.push.as_ref().map_err(|why| format!("the push one-shot is {why}"))?;
        if call.op != ReduceOp::Sum {
            return Err(format!("the push kernels implement sum, not {}", call.op));
        }
        let shape = self.0;
        if shape == PushShape::TwoShot {
            if let Some(why) = push.kernels.missing(PushShape::TwoShot, call.dtype) {
                return Err(why);
            }
        }
        // Graph capture needs nothing more: the kernels read this rank's input directly and keep their
        // buffer-set counter on the device, so a replay runs exactly what an eager call does.
        let world = comm.ccl.world();
        if let Some(why) = push::ineligible::<P>(call.dtype, call.bytes, world, push.capacity) {
            return Err(why);
        }
        let grid =
            PushGrid { blocks: shape.blocks(call.bytes, world), dependent: push.kernels.dependent_launch().is_ok() };
        Ok(Plan { algorithm, step: Step::Push { shape, grid } })
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()> {
        let Step::Push { shape, grid } = plan.step else { return Err(foreign(plan, "push")) };
        let Some((io, st, runtime)) = comm.custom_launch(plan, &args)? else { return Ok(()) };
        let push = st
            .push
            .as_ref()
            .map_err(|why| Error::AlgorithmNotEligible { algorithm: plan.algorithm, why: why.clone() })?;
        // SAFETY: every rank's receive buffer was allocated with PUSH_RECV_BYTES and initialised by the setup, and
        // is reachable through peer access or IPC; `flags` is this rank's live flag array; eligibility checked
        // `bytes` against the agreed limit (≤ the slots' size), and still holds (the caller's contract); every
        // rank of this communicator makes the same calls in the same order (a collective); ranks run on different
        // GPUs. The kernel reads only this rank's input (in place is fine) and keeps its call counter on the
        // device: the same eager and captured.
        unsafe {
            push.kernels.launch(
                shape,
                runtime,
                args.dtype(),
                io.src,
                io.dst,
                &push.all_recv,
                st.flags.device_ptr(),
                io.rank,
                io.bytes,
                push.capacity,
                grid,
                args.stream(),
            )
        }
    }
}

/// A quantized two-shot of one [`Format`].
pub(crate) struct QuantPlans(Format);

impl<P: GpuPlatform> AllReducePlans<P> for QuantPlans {
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        call: &AllReduceCall,
    ) -> std::result::Result<Plan, String> {
        let st = comm.custom.as_ref().map_err(Clone::clone)?;
        if call.op != ReduceOp::Sum {
            return Err(format!("the quantized kernels implement sum, not {}", call.op));
        }
        if let Some(why) = kernels::ineligible::<P>(call.dtype, call.bytes, comm.ccl.world()) {
            return Err(why);
        }
        let format = self.0;
        if let Some(why) = st.quant.missing(format, call.dtype) {
            return Err(why);
        }
        let need = quant::staging_bytes(call.dtype, call.bytes).unwrap_or(usize::MAX);
        if need > st.capacity {
            return Err(format!(
                "{} bytes quantize to {need} bytes, more than the custom kernels' staging buffers ({} bytes; \
                 ANYCCL_CUSTOM_MAX_BYTES)",
                call.bytes, st.capacity
            ));
        }
        Ok(Plan { algorithm, step: Step::Quant { format, blocks: custom_blocks(call.bytes, st.max_blocks) } })
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()> {
        let Step::Quant { format, blocks } = plan.step else { return Err(foreign(plan, "quantized")) };
        let Some((io, st, _)) = comm.custom_launch(plan, &args)? else { return Ok(()) };
        // SAFETY: eligibility checked that the quantized message fits every rank's staging and scratch
        // (`capacity`), reachable through peer access or IPC, and still holds (the caller's contract); `quant`
        // came from `kernels`' module; every rank makes the same calls in the same order with the same block
        // count; ranks run on different GPUs. The kernel reads only this rank's input and the ranks' staging and
        // scratch: the same eager and captured.
        unsafe {
            st.quant.launch(
                &st.kernels,
                format,
                args.dtype(),
                io.src,
                &st.all_staging,
                &st.all_scratch,
                io.dst,
                &st.all_flags,
                io.rank,
                io.bytes,
                blocks,
                args.stream(),
            )
        }
    }
}

/// An algorithm no GPU engine implements (the host's ring): never eligible, with the platform's reason.
pub(crate) struct Unregistered;

impl<P: GpuPlatform> AllReducePlans<P> for Unregistered {
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        _call: &AllReduceCall,
    ) -> std::result::Result<Plan, String> {
        Err(P::other_algorithm(&comm.caps, algorithm))
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, _args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()> {
        Err(Error::AlgorithmNotEligible {
            algorithm: plan.algorithm,
            why: P::other_algorithm(&comm.caps, plan.algorithm),
        })
    }
}

// ---- The NVLS algorithms ----

/// The NVLS multicast all-reduce ([`crate::nvls`]): `nvls-block-pipeline` and `nvls-warp-pipeline` over the
/// multicast-bound staging buffers; `nvls-zero-copy` is refused with its reason. Eligible only where the
/// communicator's multicast setup succeeded, which its gate (capability, `NCCL_NVLS_ENABLE`, `ANYCCL_DISABLE`)
/// allowed.
pub(crate) struct NvlsPlans;

impl<P: GpuPlatform> AllReducePlans<P> for NvlsPlans {
    fn eligible(
        &self,
        comm: &GpuComm<P>,
        algorithm: Algorithm,
        call: &AllReduceCall,
    ) -> std::result::Result<Plan, String> {
        comm.nvls.eligible(algorithm, call, comm.ccl.world())?;
        Ok(Plan { algorithm, step: Step::Nvls })
    }

    unsafe fn launch(&self, comm: &mut GpuComm<P>, plan: &Plan, args: AllReduceArgs<'_, GpuComm<P>>) -> Result<()> {
        if plan.step != Step::Nvls {
            return Err(foreign(plan, "NVLS"));
        }
        comm.runtime.bind()?;
        let (src, dst) = anyccl_ccl::io_ptrs(args.bufs());
        // SAFETY: `args` was validated by this backend's `Communicator` (both buffers hold `bytes` of this device)
        // and the plan's eligibility checked the multicast state, dtype and size; every rank of the multicast
        // object makes the same calls in the same order (a collective), each on its own device.
        unsafe {
            comm.nvls.launch(
                &comm.runtime,
                plan.algorithm,
                args.dtype(),
                src as u64,
                dst as u64,
                args.bytes(),
                comm.ccl.rank(),
                comm.ccl.world(),
                args.stream(),
            )
        }
    }
}
