//! The fused all-reduce + residual add + RMSNorm on the GPU communicator: [`GpuComm`]'s answers to
//! [`CommBackend::rmsnorm_eligible`](anyccl_core::CommBackend::rmsnorm_eligible) and its
//! [`CommBackend::all_reduce_rmsnorm`](anyccl_core::CommBackend::all_reduce_rmsnorm), over the custom kernels'
//! staging, scratch, flag arrays and graph input tables. The front door is
//! [`anyccl_core::Communicator::all_reduce_rmsnorm`], which validates the call ([`anyccl_core::fused::validate`])
//! and chooses the form before anything here runs.

use anyccl_core::fused::{RmsNormArgs, RmsNormCall, RmsNormForm};
use anyccl_core::Result;

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

impl<P: GpuPlatform> GpuComm<P> {
    /// [`rmsnorm_ineligible`] for this communicator, after its custom and fused kernels being set up at all.
    pub(super) fn fused_eligible(&self, form: RmsNormForm, call: &RmsNormCall) -> std::result::Result<(), String> {
        let st = self.custom.as_ref().map_err(Clone::clone)?;
        if self.fused.is_none() {
            return Err("the fused kernels are not set up".into());
        }
        if let Some(why) = rmsnorm_ineligible(form, call, self.ccl.world(), st.capacity) {
            return Err(why);
        }
        if form == RmsNormForm::FusedPush {
            // The push one-shot's receive buffers, its agreed limit and the kernel itself.
            let p = st.push.as_ref().map_err(|why| format!("the push one-shot is {why}"))?;
            if let Some(why) = fused_push_ineligible(call.dtype, call.tokens, call.hidden, self.ccl.world(), p.capacity)
            {
                return Err(why);
            }
            if let Some(why) = p.kernels.fused_missing(call.dtype) {
                return Err(why);
            }
        }
        Ok(())
    }

    /// Runs a validated call with the form the front-end chose (eligible: [`GpuComm::fused_eligible`]).
    /// `residual` is overwritten with `allreduce(input) + residual` (the same on every rank; it must be the same
    /// on every rank before the call too); capture-safe (nothing is allocated; during capture the input is read
    /// through an input table, as for the custom all-reduce).
    pub(super) fn run_rmsnorm(&mut self, args: RmsNormArgs<'_, Self>) -> Result<()> {
        let (call, form) = (*args.call(), args.form());
        let stream = args.stream();
        let bufs = args.into_bufs();
        let (input, residual, weight, out) = (bufs.input, bufs.residual, bufs.weight, bufs.out);
        let (world, rank) = (self.ccl.world(), self.ccl.rank());
        // The front-end asked eligibility a moment ago; ask again on the state this call uses (cheap), so that
        // nothing below runs on a form these buffers cannot take.
        self.fused_eligible(form, &call).map_err(|why| anyccl_core::Error::NoEligibleAlgorithm { why })?;
        let not_set_up = || anyccl_core::Error::NoEligibleAlgorithm { why: "the custom kernels are off".into() };
        let st = self.custom.as_mut().map_err(|_| not_set_up())?;
        let fk = self.fused.as_ref().ok_or_else(not_set_up)?;
        let (bytes, capturing) = (call.bytes, call.capturing);
        if bytes == 0 {
            // Nothing to do on any rank alike: no launch keeps the barrier epochs in step.
            return Ok(());
        }
        let spec = &call;
        let choice = form;

        self.runtime.bind()?;
        let (src, dst) = (input.device_ptr(), out.device_ptr());
        let args = NormArgs::new(
            residual.device_ptr(),
            weight.device_ptr(),
            dst,
            spec.tokens,
            spec.hidden,
            spec.eps,
            spec.output,
        );
        if choice == RmsNormForm::FusedPush {
            let no_push = |why: &String| anyccl_core::Error::NoEligibleAlgorithm { why: why.clone() };
            let p = st.push.as_ref().map_err(no_push)?;
            let dependent = p.kernels.dependent_launch().is_ok();
            let my_flags = st.all_flags.get(rank).copied().unwrap_or(0);
            // SAFETY: validated by the front-end (every buffer this device's, 16-byte aligned, long enough, out and
            // residual overlapping nothing) and eligible (`fused_eligible` above: the message within the agreed
            // push limit and the receive slots); every rank's receive buffer is live and initialised (set up with
            // the custom kernels, shared by this communicator's push calls only, one protocol); every rank makes the
            // same call; ranks run on different GPUs. A null flag array is refused by the launch.
            return unsafe {
                p.kernels.launch_fused(
                    &self.runtime,
                    spec.dtype,
                    src,
                    &args,
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
        let table = if capturing { st.graph.table_for(src) } else { None };
        let inputs = match table {
            Some(table) => Inputs::Table { table, own: src },
            None => Inputs::Staged { staging: &st.all_staging, own: src },
        };
        let max = st.max_blocks;
        let fused_form = match choice {
            RmsNormForm::FusedOneShot => Some(FusedForm::OneShot),
            RmsNormForm::FusedTwoShot => Some(FusedForm::TwoShot),
            _ => None,
        };
        // SAFETY: validated by the front-end (the `RmsNormArgs` only it makes): every buffer is this device's, 16-byte
        // aligned, long enough, and out/residual overlap nothing; every rank's staging and scratch hold `capacity`
        // bytes (≥ the input, ≥ the two-shot scratch, and the unfused path has no fp8 output: `fused_eligible`
        // above), reachable through peer access or IPC; every rank makes the same call (a collective)
        // with the same block count (a function of the spec, the world and the communicator's block limit); ranks
        // run on different GPUs.
        unsafe {
            match fused_form {
                Some(form) => {
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
                None => {
                    // The custom all-reduce into `out`, then the RMSNorm of `out` in place (each thread reads its
                    // row elements before it writes them).
                    let kind = if bytes <= anyccl_core::selector::FUSED_ONE_SHOT_MAX_BYTES {
                        Kind::OneShot
                    } else {
                        Kind::TwoShot
                    };
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
        Ok(())
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
