//! The communicator: the trait a backend implements ([`CommBackend`]) and the front-end every call goes through
//! ([`Communicator`]), which validates arguments, picks the all-reduce algorithm, logs the choice, and only then
//! hands the call to the backend.

use std::sync::Arc;

use crate::algo::{Algorithm, Vendor};
pub use crate::args::{
    AllGatherArgs, AllReduceArgs, BroadcastArgs, P2pArgs, P2pItem, RecvArgs, ReduceArgs, ReduceScatterArgs, SendArgs,
};
pub use crate::bootstrap::Bootstrap;
use crate::caps::{Capabilities, CapabilityReport, Reason};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, InvalidArgument, Result};
use crate::fused::{RmsNormArgs, RmsNormCall, RmsNormForm, RmsNormSelection, RmsNormSpec};
use crate::runtime::{BufferLike, MemoryRuntime};
use crate::selector::{Selection, SelectionQuery, Selector};
use crate::teardown::Teardown;
use crate::validate::{self, CallShape, InOutDesc, P2pDesc};

/// The buffer type of a backend's runtime.
pub type BufOf<B> = <<B as CommBackend>::Runtime as MemoryRuntime>::Buffer;
/// The stream type of a backend's runtime.
pub type StreamOf<B> = <<B as CommBackend>::Runtime as MemoryRuntime>::Stream;

/// Input and output of a collective: one buffer used in place, or two distinct ones.
///
/// Rust's borrow rules make the two forms explicit: an in-place call lends one buffer mutably; an out-of-place call
/// lends the input shared and the output mutably, so they cannot alias.
///
/// Not `#[non_exhaustive]`: a call is in place or not; there is no third form.
pub enum InOut<'a, B: ?Sized> {
    /// One buffer is input and output, in the collective's in-place layout.
    InPlace(&'a mut B),
    /// Distinct input and output buffers.
    Separate {
        /// The input.
        send: &'a B,
        /// The output.
        recv: &'a mut B,
    },
}

impl<B: ?Sized + BufferLike> InOut<'_, B> {
    /// The descriptors the validation front-end checks.
    pub fn desc(&self) -> InOutDesc {
        match self {
            InOut::InPlace(b) => InOutDesc::InPlace(b.desc()),
            InOut::Separate { send, recv } => InOutDesc::Separate { send: send.desc(), recv: recv.desc() },
        }
    }

    /// True for the in-place form.
    pub fn is_in_place(&self) -> bool {
        matches!(self, InOut::InPlace(_))
    }
}

/// One operation of a grouped point-to-point call ([`Communicator::p2p`]): a send of a read-only buffer or a
/// receive into a writable one, `count` elements of `dtype`, to or from `peer`.
///
/// Not `#[non_exhaustive]`: an operation sends or receives; there is no third kind.
pub enum P2pOp<'a, B: ?Sized> {
    /// Send `count` elements of `buf` to `peer`.
    Send {
        /// What is sent.
        buf: &'a B,
        /// Element count.
        count: usize,
        /// Element type.
        dtype: DataType,
        /// The receiving rank.
        peer: usize,
    },
    /// Receive `count` elements from `peer` into `buf`.
    Recv {
        /// Where the message lands.
        buf: &'a mut B,
        /// Element count.
        count: usize,
        /// Element type.
        dtype: DataType,
        /// The sending rank.
        peer: usize,
    },
}

impl<'a, B: ?Sized> P2pOp<'a, B> {
    /// A send of `count` elements of `buf` to `peer`.
    pub fn send(buf: &'a B, count: usize, dtype: DataType, peer: usize) -> Self {
        P2pOp::Send { buf, count, dtype, peer }
    }

    /// A receive of `count` elements from `peer` into `buf`.
    pub fn recv(buf: &'a mut B, count: usize, dtype: DataType, peer: usize) -> Self {
        P2pOp::Recv { buf, count, dtype, peer }
    }

    /// The other rank.
    pub fn peer(&self) -> usize {
        match self {
            P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
        }
    }
}

impl<B: ?Sized + BufferLike> P2pOp<'_, B> {
    /// The descriptor the validation front-end checks.
    pub fn desc(&self) -> P2pDesc {
        match self {
            P2pOp::Send { buf, count, dtype, peer } => {
                P2pDesc { recv: false, buf: buf.desc(), count: *count, dtype: *dtype, peer: *peer }
            }
            P2pOp::Recv { buf, count, dtype, peer } => {
                P2pDesc { recv: true, buf: buf.desc(), count: *count, dtype: *dtype, peer: *peer }
            }
        }
    }
}

/// What an all-reduce call looks like to a backend deciding which algorithms can run it.
///
/// Not `#[non_exhaustive]`: raw-API callers and backends build one with a literal (see `anyccl_core::args`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllReduceCall {
    /// Element count.
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Operator.
    pub op: ReduceOp,
    /// Message size in bytes.
    pub bytes: usize,
    /// Whether the call is in place.
    pub in_place: bool,
    /// Whether the stream is being captured. The front-end asks the runtime on every call whose choice or
    /// algorithm could depend on it; on a repeat of the previous call whose decision cannot
    /// ([`CommBackend::capture_independent`]) it keeps the previous call's answer without asking.
    pub capturing: bool,
    /// The buffers, when known (a dry-run selection has none).
    pub bufs: Option<InOutDesc>,
}

/// What a backend implements for one rank.
///
/// Its collective methods take a validated description ([`AllReduceArgs`] and the others, see [`crate::args`]),
/// which only [`Communicator`] can make, after validating the call against this very backend: the methods are
/// safe, and a backend may rely on the description's buffers holding what it says (to enter `unsafe` for a vendor
/// call) without checking again. The backend still returns errors for what only it can detect (vendor failures,
/// peers that leave, timeouts).
pub trait CommBackend: Send {
    /// The memory runtime the backend's buffers and streams come from.
    type Runtime: MemoryRuntime;

    /// The runtime.
    fn runtime(&self) -> &Self::Runtime;
    /// Short backend name (`"host"`, `"cuda"`, `"rocm"`).
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The vendor, for algorithm selection.
    fn vendor(&self) -> Vendor;
    /// The architecture name, for algorithm selection (`"sm_90"`, `"gfx942"`, `"host"`).
    fn arch(&self) -> &str;
    /// What this backend can do here, and why not where it cannot.
    fn capabilities(&self) -> &CapabilityReport;
    /// The all-reduce algorithms this backend implements, eligible or not.
    fn allreduce_algorithms(&self) -> &[Algorithm];
    /// What a backend's eligibility answer hands to its launch: everything [`CommBackend::all_reduce`] needs to
    /// know about how to run the chosen algorithm on that call (which kernel family, shape, format), so the launch
    /// does not decide it again. The front-end remembers it with the decision and passes it back inside
    /// [`AllReduceArgs::plan`]. `()` for a backend with nothing to hand over.
    type Plan: Clone + Send + Sync + std::fmt::Debug;
    /// Whether `algorithm` can run `call`: its plan ([`CommBackend::Plan`]), or why not.
    fn allreduce_eligible(&self, algorithm: Algorithm, call: &AllReduceCall)
        -> std::result::Result<Self::Plan, String>;
    /// What the backend derives once from a (type, operator) pair it accepts, such as the vendor library's codes
    /// for them. The front-end gets it from [`CommBackend::check_reduction`] and hands it back inside the
    /// validated description of the call ([`AllReduceArgs::reduction`] and the others), so a pair is checked and
    /// mapped once per call. `()` for a backend with nothing to derive.
    type Reduction: Copy + Send + Sync + std::fmt::Debug;

    /// Accepts `op` on `dtype` for this backend, or refuses what it cannot do beyond core's rules (for example
    /// fp8 on an old NCCL). Called by the front-end after core's own check has accepted the pair.
    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<Self::Reduction>;

    /// All-reduce with the algorithm the description carries (chosen and found eligible by the front-end).
    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()>;
    /// All-gather of `count` elements per rank.
    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()>;
    /// Reduce-scatter to `count` elements per rank.
    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()>;
    /// Broadcast from the description's root.
    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()>;
    /// Reduce to the description's root.
    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()>;
    /// Send `count` elements to the description's peer.
    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()>;
    /// Receive `count` elements from the description's peer.
    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()>;
    /// Registers the inputs of collectives captured in graphs since the last call, so that replays read every
    /// rank's input directly (see the CUDA backend). Collective. `bootstrap` is how the ranks reach each other
    /// when they live in different processes; communicators of one process exchange among themselves. The
    /// default: nothing to register.
    fn register_graph_buffers(&mut self, bootstrap: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
        let _ = bootstrap;
        Ok(GraphRegistration::default())
    }
    /// Inputs of captured collectives not registered yet ([`CommBackend::register_graph_buffers`]).
    fn pending_graph_buffers(&self) -> usize {
        0
    }
    /// A number that changes whenever [`CommBackend::check_reduction`] or
    /// [`CommBackend::allreduce_eligible`] could answer differently for the same call (a window registered or
    /// freed, custom kernels turned off). With it, the front-end reuses the decision of an all-reduce identical to
    /// the previous one (same buffers, size, type, operator and capture state) instead of asking again: the
    /// selection is a measurable part of a call's host time. `None`, the default: the answers may change at any
    /// time, so every call asks.
    fn eligibility_epoch(&self) -> Option<u64> {
        None
    }
    /// Whether neither this backend's eligibility answers (for any algorithm) nor running `algorithm` depend on
    /// whether the stream is being captured, so that on a repeat of the previous call (same
    /// [`CommBackend::eligibility_epoch`], no selector rule that looks at capture) the front-end may skip the
    /// capture query and run the remembered decision: the vendor library then handles capture itself. The
    /// default: `false` (the capture state is asked on every call).
    fn capture_independent(&self, algorithm: Algorithm) -> bool {
        let _ = algorithm;
        false
    }
    /// Runs a validated group of sends and receives as one call ([`Communicator::p2p`]): it must complete
    /// whatever the order of the operations on each rank (post every send before waiting for any receive, or let
    /// the library do so: `ncclGroupStart`/`ncclGroupEnd`). The default refuses with [`Error::Unsupported`] naming
    /// the backend.
    fn p2p(&mut self, args: P2pArgs<'_, '_, Self>) -> Result<()> {
        let _ = args;
        Err(not_implemented(self.name(), "grouped point-to-point", "grouped send/receive (CommBackend::p2p)"))
    }
    /// The forms of the fused all-reduce + residual add + RMSNorm this backend implements, eligible or not
    /// ([`Communicator::all_reduce_rmsnorm`]). The default: none (the call is refused with
    /// [`Error::Unsupported`] naming the backend).
    fn rmsnorm_forms(&self) -> &[RmsNormForm] {
        &[]
    }
    /// Whether `form` can run `call` here (`Err` says why not: the fused kernels are off, the two-shot scratch is
    /// too small, fp8 output on a path that cannot make it). Asked only for forms of [`CommBackend::rmsnorm_forms`].
    /// The default: every implemented form is eligible.
    fn rmsnorm_eligible(&self, form: RmsNormForm, call: &RmsNormCall) -> std::result::Result<(), String> {
        let _ = (form, call);
        Ok(())
    }
    /// Runs a validated fused all-reduce + residual add + RMSNorm with the form the description carries (chosen
    /// and found eligible by the front-end; see [`crate::fused`] for the arithmetic every backend matches). The
    /// default refuses with [`Error::Unsupported`] naming the backend.
    fn all_reduce_rmsnorm(&mut self, args: RmsNormArgs<'_, Self>) -> Result<()> {
        let _ = args;
        Err(not_implemented(
            self.name(),
            "fused-rmsnorm",
            "the fused all-reduce + RMSNorm (CommBackend::all_reduce_rmsnorm)",
        ))
    }
    /// A sub-communicator of the ranks that pass the same `color` ([`Communicator::split`]), ordered by `(key,
    /// this rank)`; `None` for a rank that passes no color. Collective over this communicator. The default refuses
    /// with [`Error::Unsupported`] naming the backend.
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Self>>
    where
        Self: Sized,
    {
        let _ = (color, key);
        let capability = Capabilities::COMM_SPLIT.name().unwrap_or("comm-split");
        Err(not_implemented(self.name(), capability, "sub-communicators (CommBackend::split)"))
    }
    /// Wait until every rank has reached the barrier.
    fn barrier(&mut self, stream: &StreamOf<Self>) -> Result<()>;
    /// Waits until the work queued on `stream` has finished, for at most `timeout`. A backend that can watch its
    /// collective library tears its communicator down on a timeout or a library error (a peer that died) and
    /// returns the error instead of hanging; later calls then fail. The default synchronizes without a limit.
    ///
    /// The front-end refuses a capturing stream before calling it ([`Communicator::wait`]). Whatever else fails
    /// here, a backend changes what it can select (its [`CommBackend::eligibility_epoch`] state) only together
    /// with aborting its communicator, after which every call on this rank fails: a local event never leaves this
    /// rank choosing differently from its peers.
    fn wait(&mut self, stream: &StreamOf<Self>, timeout: std::time::Duration) -> Result<()> {
        let _ = timeout;
        self.runtime().synchronize(stream)
    }
    /// Whether the work queued on `stream` has finished, without blocking: `Ok(false)` while it runs. A backend
    /// that can watch its collective library reports a library error (a peer that died) as an error, without
    /// aborting; [`CommBackend::wait`] then sees the same error and aborts. A capturing stream is refused with
    /// [`InvalidArgument::DuringCapture`], changing nothing. The default asks the runtime ([`MemoryRuntime::query`]).
    fn query(&mut self, stream: &StreamOf<Self>) -> Result<bool> {
        self.runtime().query(stream)
    }
    /// Tears this rank down without making the caller wait for the slow part ([`Communicator::close_in_background`]).
    /// The default drops it here and returns a finished [`Teardown`]: right for a backend whose teardown is quick
    /// (the host). Backends over NCCL/RCCL destroy the library's communicator on a thread of its own.
    fn close_in_background(self) -> Teardown
    where
        Self: Sized,
    {
        drop(self);
        Teardown::finished(Ok(()))
    }
}

/// The refusal of a [`CommBackend`] method a backend does not implement.
fn not_implemented(backend: &str, capability: &str, what: &str) -> Error {
    Error::Unsupported {
        capability: capability.to_owned(),
        reason: Reason::Unavailable {
            component: format!("the {backend} backend"),
            detail: format!("it does not implement {what}"),
        },
    }
}

/// What a graph-buffer registration did ([`Communicator::register_graph_buffers`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphRegistration {
    /// Inputs whose tables now point at every rank's input.
    pub registered: usize,
    /// Inputs left copying through staging, with the reason (still correct, one copy slower).
    pub kept_staged: Vec<String>,
}

/// One rank's communicator: the validation and selection front-end over a backend.
///
/// Every collective is validated first ([`crate::validate`]); a bad call returns
/// [`Error::InvalidArgument`] and the backend never sees it. The communicator is the only door to the backend's
/// collectives: it alone makes the validated descriptions they take ([`crate::args`]), and it does not hand the
/// backend out mutably. All-reduce then asks the [`Selector`] which algorithm
/// runs, logs the choice and the rule behind it at `debug` level, and returns it.
///
/// Thread-safety: a `Communicator` is `Send` when its backend is; it is used from one thread at a time (`&mut`).
pub struct Communicator<B: CommBackend> {
    backend: B,
    selector: Arc<Selector>,
    /// The selector's rules that can apply to this communicator (its vendor, arch and world are fixed).
    candidates: Vec<usize>,
    /// Whether one of `candidates` looks at the capture state.
    rules_read_capture: bool,
    /// The last all-reduce's decision, for a backend that says when its eligibility changes.
    memo: Option<Memo<B::Reduction, B::Plan>>,
    /// Deterministic mode ([`Communicator::set_deterministic`]).
    deterministic: bool,
}

/// One remembered all-reduce decision ([`CommBackend::eligibility_epoch`]), with the backend's plan for it.
struct Memo<R, P> {
    call: AllReduceCall,
    epoch: u64,
    reduction: R,
    selection: Selection,
    plan: P,
}

/// What [`Communicator::all_reduce_if`] did with a call.
#[derive(Debug)]
pub enum AllReduceOutcome {
    /// The selected algorithm ran (queued on the stream).
    Ran(Selection),
    /// The caller declined the selected algorithm: nothing ran.
    Declined(Selection),
    /// No algorithm could run the call (the selector's refusal): nothing ran.
    Unselected(Error),
}

/// What the front-end decided for one all-reduce: the backend's reduction, the selection and the backend's plan.
type Decision<B> = (<B as CommBackend>::Reduction, Selection, <B as CommBackend>::Plan);

impl<B: CommBackend> Communicator<B> {
    /// Wraps a backend communicator with `selector`.
    pub fn new(backend: B, selector: Arc<Selector>) -> Self {
        let candidates = selector.candidates(backend.vendor(), backend.arch(), backend.world_size());
        let rules_read_capture = selector.reads_capture(&candidates);
        let deterministic = selector.deterministic();
        Communicator { backend, selector, candidates, rules_read_capture, memo: None, deterministic }
    }

    /// Turns deterministic mode on or off for this communicator (the default is the selector's,
    /// `ANYCCL_DETERMINISTIC`): every all-reduce then sums in rank order 0..W−1 with one-shot or two-shot, whose
    /// results are bitwise identical across runs, across the two and across message sizes; algorithms that cannot
    /// promise it (the vendor library's, NVLS, ring, quantized) are skipped and the selection names them, and a call
    /// no deterministic algorithm can run fails with [`Error::NoEligibleAlgorithm`]. Every rank must use the same
    /// setting (their selections must agree). See [`crate::selector`].
    pub fn set_deterministic(&mut self, on: bool) {
        if self.deterministic != on {
            self.deterministic = on;
            self.memo = None;
        }
    }

    /// Whether deterministic mode is on ([`Communicator::set_deterministic`]).
    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }

    /// What this backend can do here, with reasons for what it cannot.
    pub fn capabilities(&self) -> &CapabilityReport {
        self.backend.capabilities()
    }

    /// The selector in use.
    pub fn selector(&self) -> &Selector {
        &self.selector
    }

    /// The backend, for its own queries and operations that take `&self` (e.g. symmetric buffers). There is no
    /// mutable access: every collective goes through the validating methods of the communicator.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend's memory runtime (allocation, copies, streams).
    pub fn runtime(&self) -> &B::Runtime {
        self.backend.runtime()
    }

    fn shape(&self) -> CallShape {
        CallShape { rank: self.backend.rank(), world: self.backend.world_size(), location: self.runtime().location() }
    }

    /// Core's rules, then the backend's: one check and one mapping per call.
    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<B::Reduction> {
        crate::dtype::check_reduction(dtype, op)?;
        self.backend.check_reduction(dtype, op)
    }

    /// The algorithm an all-reduce of this shape would use now, without running it.
    pub fn select_all_reduce(&self, call: &AllReduceCall) -> Result<Selection> {
        self.plan_all_reduce(call).map(|(selection, _)| selection)
    }

    /// The selection for `call` with the backend's plan for the chosen algorithm: each candidate's eligibility is
    /// asked once, and the plan of the one chosen is kept (the selector returns the last algorithm it found
    /// eligible).
    pub fn plan_all_reduce(&self, call: &AllReduceCall) -> Result<(Selection, B::Plan)> {
        let mut last: Option<(Algorithm, B::Plan)> = None;
        let q = SelectionQuery {
            vendor: self.backend.vendor(),
            arch: self.backend.arch(),
            world: self.backend.world_size(),
            bytes: call.bytes as u64,
            dtype: call.dtype,
            capturing: call.capturing,
        };
        let algos = self.backend.allreduce_algorithms();
        let selection = self.selector.select_among(&self.candidates, &q, self.deterministic, |a| {
            if !algos.contains(&a) {
                return Err(format!("not implemented by the {} backend", self.backend.name()));
            }
            let plan = self.backend.allreduce_eligible(a, call)?;
            last = Some((a, plan));
            Ok(())
        })?;
        match last {
            Some((a, plan)) if a == selection.algorithm => Ok((selection, plan)),
            // The selector only returns an algorithm it found eligible last; asked again should that ever change.
            _ => {
                let plan = self.plan_algorithm(selection.algorithm, call)?;
                Ok((selection, plan))
            }
        }
    }

    /// Whether `algorithm` could run `call` here (`Err` with the reason if not; in deterministic mode an algorithm
    /// that does not sum in rank order is refused).
    pub fn check_algorithm(&self, algorithm: Algorithm, call: &AllReduceCall) -> Result<()> {
        self.plan_algorithm(algorithm, call).map(drop)
    }

    /// [`Self::check_algorithm`], returning the backend's plan for running `algorithm` on `call`.
    pub fn plan_algorithm(&self, algorithm: Algorithm, call: &AllReduceCall) -> Result<B::Plan> {
        if let Some(why) = algorithm.nondeterministic().filter(|_| self.deterministic) {
            return Err(Error::AlgorithmNotEligible {
                algorithm,
                why: format!("not deterministic ({}): {why}", crate::selector::ENV_DETERMINISTIC),
            });
        }
        if !self.backend.allreduce_algorithms().contains(&algorithm) {
            return Err(Error::AlgorithmNotEligible {
                algorithm,
                why: format!("not implemented by the {} backend", self.backend.name()),
            });
        }
        self.backend.allreduce_eligible(algorithm, call).map_err(|why| Error::AlgorithmNotEligible { algorithm, why })
    }

    /// Validates an all-reduce and asks the capture state once.
    fn prepare_all_reduce(
        &self,
        bufs: &InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &StreamOf<B>,
    ) -> Result<AllReduceCall> {
        let mut call = self.validate_all_reduce(bufs, count, dtype, op)?;
        call.capturing = self.runtime().is_capturing(stream)?;
        Ok(call)
    }

    /// Validates an all-reduce; `capturing` is left `false` for the caller to fill in.
    fn validate_all_reduce(
        &self,
        bufs: &InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<AllReduceCall> {
        let desc = bufs.desc();
        // Core's rules on the pair come first inside `validate`.
        let bytes = validate::all_reduce(&self.shape(), &desc, count, dtype, op)?;
        Ok(AllReduceCall { count, dtype, op, bytes, in_place: bufs.is_in_place(), capturing: false, bufs: Some(desc) })
    }

    /// The remembered decision, if `call` repeats the previous call and the backend's eligibility has not changed
    /// since ([`CommBackend::eligibility_epoch`]). `capture` is whether `call.capturing` was asked: if not, the
    /// memo applies only when the decision cannot depend on it, and `call.capturing` becomes the previous answer.
    fn remembered(&self, call: &mut AllReduceCall, epoch: Option<u64>, capture: bool) -> Option<Decision<B>> {
        let m = self.memo.as_ref().filter(|m| Some(m.epoch) == epoch)?;
        if !capture {
            if self.rules_read_capture || !self.backend.capture_independent(m.selection.algorithm) {
                return None;
            }
            call.capturing = m.call.capturing;
        }
        (m.call == *call).then(|| (m.reduction, m.selection.clone(), m.plan.clone()))
    }

    /// The selection and plan for a validated `call` whose reduction the backend accepted, asked afresh and
    /// remembered (with `reduction`) when the backend says when its answers change.
    fn decide_all_reduce(
        &mut self,
        call: &AllReduceCall,
        epoch: Option<u64>,
        reduction: B::Reduction,
    ) -> Result<Decision<B>> {
        let (selection, plan) = self.plan_all_reduce(call)?;
        self.memo =
            epoch.map(|epoch| Memo { call: *call, epoch, reduction, selection: selection.clone(), plan: plan.clone() });
        Ok((reduction, selection, plan))
    }

    /// All-reduce `count` elements with the algorithm the selector picks. Returns the selection.
    ///
    /// A call identical to the previous one (buffers, size, type, operator) reuses its decision while the
    /// backend's eligibility is unchanged; on the CUDA backend a repeated NCCL call does not even ask whether the
    /// stream is being captured (NCCL handles capture itself). Everything else is checked on every call.
    pub fn all_reduce(
        &mut self,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &StreamOf<B>,
    ) -> Result<Selection> {
        match self.all_reduce_if(bufs, count, dtype, op, stream, |_| true)? {
            AllReduceOutcome::Ran(sel) | AllReduceOutcome::Declined(sel) => Ok(sel),
            AllReduceOutcome::Unselected(e) => Err(e),
        }
    }

    /// [`Self::all_reduce`], run only where `accept` takes the selection: the selector is asked once (or its
    /// remembered decision reused), and the backend's plan for the chosen algorithm runs if `accept` says so.
    /// For a caller that hands some algorithms elsewhere (the drop-in `libnccl` forwards what is not its own
    /// kernels' to the library underneath). `Err` is a call that failed (validation, the capture query, the
    /// backend's reduction or the run); a call no algorithm can run is [`AllReduceOutcome::Unselected`].
    pub fn all_reduce_if(
        &mut self,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &StreamOf<B>,
        accept: impl FnOnce(&Selection) -> bool,
    ) -> Result<AllReduceOutcome> {
        let mut call = self.validate_all_reduce(&bufs, count, dtype, op)?;
        let epoch = self.backend.eligibility_epoch();
        let mut capture_asked = false;
        let remembered = match self.remembered(&mut call, epoch, false) {
            Some(d) => Some(d),
            None => {
                call.capturing = self.runtime().is_capturing(stream)?;
                capture_asked = true;
                self.remembered(&mut call, epoch, true)
            }
        };
        let decided = match remembered {
            Some(d) => d,
            None => {
                let reduction = self.backend.check_reduction(call.dtype, call.op)?;
                match self.decide_all_reduce(&call, epoch, reduction) {
                    Ok(d) => d,
                    Err(e) => return Ok(AllReduceOutcome::Unselected(e)),
                }
            }
        };
        let (reduction, sel, plan) = decided;
        let accepted = accept(&sel);
        tracing::debug!(
            rank = self.rank(),
            world = self.world_size(),
            bytes = call.bytes,
            dtype = %dtype,
            op = %op,
            capturing = call.capturing,
            capture_asked,
            algorithm = %sel.algorithm,
            rule = %sel.why,
            accepted,
            "all-reduce"
        );
        if !accepted {
            return Ok(AllReduceOutcome::Declined(sel));
        }
        self.backend.all_reduce(AllReduceArgs::new(bufs, stream, call, reduction, sel.algorithm, plan))?;
        Ok(AllReduceOutcome::Ran(sel))
    }

    /// All-reduce with an explicit algorithm (for benchmarks and tests, and the way to ask for a lossy one:
    /// [`Algorithm::TwoShotFp8`], [`Algorithm::TwoShotInt8`]); an ineligible one is an error, and so is one that is
    /// not deterministic in deterministic mode.
    pub fn all_reduce_with(
        &mut self,
        algorithm: Algorithm,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let call = self.prepare_all_reduce(&bufs, count, dtype, op, stream)?;
        let reduction = self.backend.check_reduction(dtype, op)?;
        let plan = self.plan_algorithm(algorithm, &call)?;
        self.backend.all_reduce(AllReduceArgs::new(bufs, stream, call, reduction, algorithm, plan))
    }

    /// [`Error::Unsupported`] naming the backend if it has no form of the fused all-reduce + RMSNorm.
    fn rmsnorm_implemented(&self) -> Result<()> {
        if self.backend.rmsnorm_forms().is_empty() {
            return Err(not_implemented(
                self.backend.name(),
                "fused-rmsnorm",
                "the fused all-reduce + RMSNorm (CommBackend::all_reduce_rmsnorm)",
            ));
        }
        Ok(())
    }

    /// The form a fused all-reduce + RMSNorm `call` would use now, without running it: the call's `forced` form,
    /// else `ANYCCL_FUSED_RMSNORM`, else the selector's table rules, else the default rule
    /// ([`Selector::select_rmsnorm`]), each asked of the backend ([`CommBackend::rmsnorm_eligible`]).
    pub fn select_rmsnorm(&self, call: &RmsNormCall, forced: Option<RmsNormForm>) -> Result<RmsNormSelection> {
        self.rmsnorm_implemented()?;
        let forms = self.backend.rmsnorm_forms();
        let call = call.with_deterministic(self.deterministic);
        let q = SelectionQuery {
            vendor: self.backend.vendor(),
            arch: self.backend.arch(),
            world: self.backend.world_size(),
            bytes: call.bytes as u64,
            dtype: call.dtype,
            capturing: call.capturing,
        };
        self.selector.select_rmsnorm_among(&self.candidates, &q, &call, forced, |f| {
            if !forms.contains(&f) {
                return Err(format!("not implemented by the {} backend", self.backend.name()));
            }
            self.backend.rmsnorm_eligible(f, &call)
        })
    }

    /// The fused all-reduce + residual add + RMSNorm of `spec.tokens` rows of `spec.hidden` elements:
    ///
    /// ```text
    /// residual ← allreduce(input) + residual
    /// out      ← rmsnorm(residual) × weight     (or e4m3(… / scale) with RmsNormSpec::fp8_output)
    /// ```
    ///
    /// A collective: every rank calls it with the same `spec`, and its `residual` must hold the same values on
    /// every rank (as tensor parallelism keeps it; it does so again afterwards). `input`, `residual` and `out` hold
    /// `tokens × hidden` elements (`out` one byte each with fp8 output), `weight` `hidden`; each is 16-byte
    /// aligned memory of this communicator, and `residual` and `out` overlap no other buffer. Stream-ordered on
    /// `stream`; on GPUs capture-safe (nothing allocated).
    ///
    /// Validated first ([`crate::fused::validate`]): a bad call returns a typed [`Error::InvalidArgument`] naming
    /// the culprit and nothing runs or changes. A backend without the call returns [`Error::Unsupported`]. The
    /// form is then chosen ([`Communicator::select_rmsnorm`]), logged at `debug` level and returned with the
    /// rule behind it. Results are bitwise the same for every form and every run (rank-order sums, see
    /// [`crate::fused`]).
    pub fn all_reduce_rmsnorm(
        &mut self,
        input: &BufOf<B>,
        residual: &mut BufOf<B>,
        weight: &BufOf<B>,
        out: &mut BufOf<B>,
        spec: &RmsNormSpec,
        stream: &StreamOf<B>,
    ) -> Result<RmsNormSelection> {
        self.rmsnorm_implemented()?;
        let location = self.runtime().location();
        let bufs = [input.desc(), residual.desc(), weight.desc(), out.desc()];
        let call = crate::fused::validate(spec, location, bufs)?;
        let call = call.with_capturing(self.runtime().is_capturing(stream)?).with_deterministic(self.deterministic);
        let sel = self.select_rmsnorm(&call, spec.form)?;
        tracing::debug!(
            rank = self.rank(),
            world = self.world_size(),
            bytes = call.bytes,
            dtype = %call.dtype,
            tokens = call.tokens,
            hidden = call.hidden,
            fp8 = !matches!(call.output, crate::fused::RmsNormOutput::Same),
            capturing = call.capturing,
            form = %sel.form,
            rule = %sel.why,
            "all-reduce + rmsnorm"
        );
        self.backend.all_reduce_rmsnorm(RmsNormArgs::new(input, residual, weight, out, stream, call, sel.form))?;
        Ok(sel)
    }

    /// All-gather: every rank contributes `count` elements; the output holds `world × count`.
    pub fn all_gather(
        &mut self,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let bytes = validate::all_gather(&self.shape(), &bufs.desc(), count, dtype)?;
        self.backend.all_gather(AllGatherArgs::new(bufs, stream, count, dtype, bytes))
    }

    /// Reduce-scatter: the input holds `world × count` elements; each rank gets its reduced `count`.
    pub fn reduce_scatter(
        &mut self,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let reduction = self.check_reduction(dtype, op)?;
        let bytes = validate::reduce_scatter(&self.shape(), &bufs.desc(), count, dtype, op)?;
        self.backend.reduce_scatter(ReduceScatterArgs::new(bufs, stream, count, dtype, bytes, op, reduction))
    }

    /// Broadcast `count` elements from `root`.
    pub fn broadcast(
        &mut self,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let bytes = validate::broadcast(&self.shape(), &bufs.desc(), count, dtype, root)?;
        self.backend.broadcast(BroadcastArgs::new(bufs, stream, count, dtype, bytes, root))
    }

    /// Reduce `count` elements to `root` (the output is written on the root only).
    pub fn reduce(
        &mut self,
        bufs: InOut<'_, BufOf<B>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let reduction = self.check_reduction(dtype, op)?;
        let bytes = validate::reduce(&self.shape(), &bufs.desc(), count, dtype, op, root)?;
        self.backend.reduce(ReduceArgs::new(bufs, stream, count, dtype, bytes, op, reduction, root))
    }

    /// Send `count` elements to `peer`.
    pub fn send(
        &mut self,
        buf: &BufOf<B>,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let bytes = validate::point_to_point(&self.shape(), "send", &buf.desc(), count, dtype, peer)?;
        self.backend.send(SendArgs::new(buf, stream, count, dtype, bytes, peer))
    }

    /// Receive `count` elements from `peer`.
    pub fn recv(
        &mut self,
        buf: &mut BufOf<B>,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        let bytes = validate::point_to_point(&self.shape(), "recv", &buf.desc(), count, dtype, peer)?;
        self.backend.recv(RecvArgs::new(buf, stream, count, dtype, bytes, peer))
    }

    /// Sends and receives as one group, the way a pipeline stage sends to the next stage and receives from the
    /// previous one: `ncclGroupStart`, each `ncclSend`/`ncclRecv`, `ncclGroupEnd` on NCCL/RCCL; on the host backend
    /// every send is posted before any receive waits. Two plain blocking calls in that situation deadlock (each
    /// rank waits in its first call for a peer that waits in its own); a group does not, whatever the order of
    /// the operations on each rank. Several operations may name the same peer; they match in order.
    ///
    /// Every operation gets the checks of [`Communicator::send`] and [`Communicator::recv`] (a failure is
    /// [`InvalidArgument::GroupOp`] with its index), and no receive buffer may overlap another receive buffer or a
    /// send buffer ([`InvalidArgument::GroupOverlap`]); nothing is sent then. An empty group does nothing.
    pub fn p2p(&mut self, ops: &mut [P2pOp<'_, BufOf<B>>], stream: &StreamOf<B>) -> Result<()> {
        let descs: Vec<P2pDesc> = ops.iter().map(P2pOp::desc).collect();
        let bytes = validate::p2p_group(&self.shape(), &descs)?;
        if ops.is_empty() {
            return Ok(());
        }
        tracing::trace!(rank = self.rank(), ops = ops.len(), "grouped point-to-point");
        self.backend.p2p(P2pArgs::new(ops, stream, bytes))
    }

    /// Sends `count` elements of `send` to rank `to` and receives `count` elements from rank `from` into `recv`,
    /// as one group ([`Communicator::p2p`]): a ring step or a pipeline stage's exchange.
    #[allow(clippy::too_many_arguments)]
    pub fn send_recv(
        &mut self,
        send: &BufOf<B>,
        to: usize,
        recv: &mut BufOf<B>,
        from: usize,
        count: usize,
        dtype: DataType,
        stream: &StreamOf<B>,
    ) -> Result<()> {
        self.p2p(&mut [P2pOp::send(send, count, dtype, to), P2pOp::recv(recv, count, dtype, from)], stream)
    }

    /// A sub-communicator (`ncclCommSplit`): the ranks that pass the same `color` form a new communicator, ranked
    /// by `(key, rank in this communicator)`; a rank that passes `None` (NCCL's `NCCL_SPLIT_NOCOLOR`) joins none
    /// and gets `Ok(None)`. Collective: every rank of this communicator calls it. The new communicator has its own
    /// rank and world, the same selector, and is independent of this one and of its siblings (either may be
    /// dropped first).
    ///
    /// `color` and `key` must fit NCCL's non-negative `int` (at most `i32::MAX`, else
    /// [`InvalidArgument::OutOfRange`], on every backend, before anything is exchanged). Refused while a capture
    /// that setup would break runs ([`MemoryRuntime::refuse_during_capture`]). A backend without sub-communicators
    /// refuses with [`Error::Unsupported`]; on NCCL/RCCL without `ncclCommSplit` (NCCL < 2.18) the reason names the
    /// missing symbol.
    pub fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Communicator<B>>> {
        let max = i32::MAX as u64;
        if let Some(c) = color.filter(|c| u64::from(*c) > max) {
            return Err(InvalidArgument::OutOfRange { what: "split color", value: c.into(), min: 0, max }.into());
        }
        if u64::from(key) > max {
            return Err(InvalidArgument::OutOfRange { what: "split key", value: key.into(), min: 0, max }.into());
        }
        self.runtime().refuse_during_capture("Communicator::split")?;
        let sub = self.backend.split(color, key)?;
        tracing::debug!(
            rank = self.rank(),
            world = self.world_size(),
            ?color,
            key,
            sub_rank = sub.as_ref().map(CommBackend::rank),
            sub_world = sub.as_ref().map(CommBackend::world_size),
            "split"
        );
        Ok(sub.map(|b| Communicator::new(b, self.selector.clone())))
    }

    /// Registers the inputs of all-reduces captured in graphs since the last call, so that replays read every
    /// rank's input directly instead of copying it through staging (the CUDA backend's custom kernels; other
    /// backends have nothing to register). Collective: every rank calls it after the same captures and before
    /// replaying them, with no graph of this communicator running.
    ///
    /// `bootstrap` is how the ranks of a one-process-per-GPU communicator reach each other (the rendezvous it was
    /// made with, or the engine's own [`Bootstrap`]); communicators of one process exchange among themselves and
    /// take `None`. A bootstrap whose rank or world differs from this communicator's is an
    /// [`Error::InvalidArgument`].
    ///
    /// Refused with [`InvalidArgument::DuringCapture`] while a capture it would break runs on a stream this rank's
    /// runtime knows (registration opens IPC handles and writes tables synchronously); nothing is registered then,
    /// and peers that did call it fail on their exchange's timeout.
    pub fn register_graph_buffers(&mut self, bootstrap: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
        if let Some(b) = &bootstrap {
            check_bootstrap(&**b, self.rank(), self.world_size())?;
        }
        self.runtime().refuse_during_capture("Communicator::register_graph_buffers")?;
        self.backend.register_graph_buffers(bootstrap)
    }

    /// Inputs of captured all-reduces not registered yet ([`Communicator::register_graph_buffers`]).
    pub fn pending_graph_buffers(&self) -> usize {
        self.backend.pending_graph_buffers()
    }

    /// Wait until every rank reaches the barrier.
    pub fn barrier(&mut self, stream: &StreamOf<B>) -> Result<()> {
        self.backend.barrier(stream)
    }

    /// Waits until the work queued on `stream` has finished, for at most `timeout`: on the CUDA and ROCm backends
    /// a peer that died makes this return [`Error::Timeout`] or [`Error::PeerFailure`] (and the communicator is
    /// aborted) instead of hanging, as `stream.synchronize()` would. They return within `timeout` plus 2 s, the
    /// time they give the library's abort before leaving it to finish in the background.
    ///
    /// A stream being captured into a graph is refused with [`InvalidArgument::DuringCapture`] before the backend
    /// is asked anything: the capture stays valid, the communicator is not aborted, and what it selects does not
    /// change (the wait did not fail, it was not made).
    pub fn wait(&mut self, stream: &StreamOf<B>, timeout: std::time::Duration) -> Result<()> {
        crate::capture::refuse_if("Communicator::wait", self.runtime().is_capturing(stream)?)?;
        self.backend.wait(stream, timeout)
    }

    /// Whether the work queued on `stream` has finished, without blocking: `Ok(true)` when it has, `Ok(false)`
    /// while it still runs (the communicator stays usable; ask again, or [`Communicator::wait`]). A stream being
    /// captured is refused with an error, as `wait` refuses it.
    ///
    /// On the CUDA and ROCm backends an error the collective library reports while the work runs (a peer that
    /// died) is returned as [`Error::PeerFailure`] but, unlike `wait`, does not abort the communicator: call
    /// [`Communicator::wait`] next, which sees the same error at once and aborts (so queued kernels stop), or drop
    /// the communicator. The host backend's work is done when its call returns: `query` answers `Ok(true)`.
    pub fn query(&mut self, stream: &StreamOf<B>) -> Result<bool> {
        self.backend.query(stream)
    }

    /// Tears this rank's communicator down and returns at once, leaving the slow part to a thread of its own: on
    /// the CUDA and ROCm backends NCCL's/RCCL's own `ncclCommDestroy` (about 500 ms on an H200 with NCCL 2.28),
    /// after which the rank's device buffers are freed on that thread too. The returned [`Teardown`] says when it
    /// has finished ([`Teardown::is_done`], [`Teardown::wait`], [`Teardown::wait_timeout`]) and with what status.
    /// On the host backend there is nothing slow: the teardown has finished when this returns. Dropping the
    /// communicator instead keeps the old behaviour: the destroy runs before `drop` returns.
    ///
    /// Nothing is leaked if the process exits first: the library stays loaded while the destroy runs (the thread
    /// holds it), and at a normal exit (`main` returning, `std::process::exit`) the process waits up to 10 s for
    /// pending destroys before its exit handlers unload the vendor libraries. After a crash, a kill, or that limit,
    /// the operating system reclaims the device memory and the library's resources with the process.
    /// [`crate::teardown::wait_for_pending`] waits for every pending teardown explicitly.
    ///
    /// Symmetric buffers of this communicator are best dropped before it; one dropped while the destroy runs waits
    /// for it before freeing its memory.
    pub fn close_in_background(self) -> Teardown {
        self.backend.close_in_background()
    }
}

/// Refuses a bootstrap that is not this communicator's group: its rank and world must be `rank` and `world`.
pub fn check_bootstrap(bootstrap: &dyn Bootstrap, rank: usize, world: usize) -> Result<()> {
    let (br, bw) = (bootstrap.rank(), bootstrap.world());
    if (br, bw) != (rank, world) {
        return Err(InvalidArgument::BadWorld(format!(
            "the bootstrap is rank {br} of {bw}, but the communicator is rank {rank} of {world}"
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;
    use crate::caps::Reason;
    use crate::runtime::Location;

    /// Host memory, no streams: just enough runtime for the front-end, with a capture state to set and count.
    #[derive(Default)]
    struct Bytes {
        capturing: AtomicBool,
        asked: AtomicUsize,
    }

    impl MemoryRuntime for Bytes {
        type Buffer = [u8];
        type OwnedBuffer = Vec<u8>;
        type Stream = ();

        fn location(&self) -> Location {
            Location::Host
        }
        fn alloc(&self, bytes: usize) -> Result<Vec<u8>> {
            Ok(vec![0; bytes])
        }
        fn upload(&self, _: &mut [u8], _: &[u8], _: &()) -> Result<()> {
            Ok(())
        }
        fn download(&self, _: &[u8], _: &mut [u8], _: &()) -> Result<()> {
            Ok(())
        }
        fn synchronize(&self, _: &()) -> Result<()> {
            Ok(())
        }
        fn is_capturing(&self, _: &()) -> Result<bool> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            Ok(self.capturing.load(Ordering::Relaxed))
        }
        fn refuse_during_capture(&self, what: &'static str) -> Result<()> {
            crate::capture::refuse_if(what, self.capturing.load(Ordering::Relaxed))
        }
    }

    /// Counts how often the front-end asks it; refuses `one-shot` while `refuse_one_shot` is set.
    struct Counting {
        rt: Bytes,
        caps: CapabilityReport,
        /// What `capture_independent` answers for every algorithm.
        capture_free: bool,
        /// Refuse one-shot while the stream is captured (only honest with `capture_free == false`).
        refuse_one_shot_captured: bool,
        epoch: Option<u64>,
        refuse_one_shot: bool,
        reductions: Cell<usize>,
        eligibility: Cell<usize>,
        ran: Vec<Algorithm>,
        /// Calls that reached the backend's `wait` and `register_graph_buffers`.
        waits: usize,
        registrations: usize,
        /// The world size it reports (rank 0 of it).
        world: usize,
        /// Each grouped point-to-point call that reached it: (kind, peer, bytes) per operation.
        groups: Vec<Vec<(&'static str, usize, usize)>>,
    }

    impl CommBackend for Counting {
        type Reduction = (DataType, ReduceOp);
        type Plan = ();
        type Runtime = Bytes;

        fn runtime(&self) -> &Bytes {
            &self.rt
        }
        fn name(&self) -> &'static str {
            "counting"
        }
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn vendor(&self) -> Vendor {
            Vendor::Host
        }
        fn arch(&self) -> &str {
            "host"
        }
        fn capabilities(&self) -> &CapabilityReport {
            &self.caps
        }
        fn allreduce_algorithms(&self) -> &[Algorithm] {
            &[Algorithm::OneShot, Algorithm::Ring]
        }
        fn allreduce_eligible(&self, algorithm: Algorithm, call: &AllReduceCall) -> std::result::Result<(), String> {
            self.eligibility.set(self.eligibility.get() + 1);
            match algorithm {
                Algorithm::OneShot if self.refuse_one_shot => Err("refused".into()),
                Algorithm::OneShot if self.refuse_one_shot_captured && call.capturing => Err("captured".into()),
                Algorithm::OneShot | Algorithm::Ring => Ok(()),
                _ => Err("not here".into()),
            }
        }
        fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<(DataType, ReduceOp)> {
            self.reductions.set(self.reductions.get() + 1);
            Ok((dtype, op))
        }
        fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
            assert_eq!(args.reduction(), (args.dtype(), args.op()), "the reduction of this very call");
            self.ran.push(args.algorithm());
            Ok(())
        }
        fn all_gather(&mut self, _: AllGatherArgs<'_, Self>) -> Result<()> {
            Ok(())
        }
        fn reduce_scatter(&mut self, _: ReduceScatterArgs<'_, Self>) -> Result<()> {
            Ok(())
        }
        fn broadcast(&mut self, _: BroadcastArgs<'_, Self>) -> Result<()> {
            Ok(())
        }
        fn reduce(&mut self, _: ReduceArgs<'_, Self>) -> Result<()> {
            Ok(())
        }
        fn send(&mut self, _: SendArgs<'_, Self>) -> Result<()> {
            Ok(())
        }
        fn recv(&mut self, _: RecvArgs<'_, Self>) -> Result<()> {
            Ok(())
        }
        fn barrier(&mut self, _: &()) -> Result<()> {
            Ok(())
        }
        fn eligibility_epoch(&self) -> Option<u64> {
            self.epoch
        }
        fn capture_independent(&self, _: Algorithm) -> bool {
            self.capture_free
        }
        fn wait(&mut self, _: &(), _: std::time::Duration) -> Result<()> {
            self.waits += 1;
            Ok(())
        }
        fn register_graph_buffers(&mut self, _: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
            self.registrations += 1;
            Ok(GraphRegistration::default())
        }
        fn p2p(&mut self, mut args: P2pArgs<'_, '_, Self>) -> Result<()> {
            let seen = args
                .items()
                .map(|i| match i {
                    P2pItem::Send(s) => ("send", s.peer(), s.bytes()),
                    P2pItem::Recv(r) => {
                        // The receive buffer is writable through the description.
                        let bytes = r.bytes();
                        let peer = r.peer();
                        r.into_buf()[..bytes].fill(0xab);
                        ("recv", peer, bytes)
                    }
                })
                .collect();
            self.groups.push(seen);
            Ok(())
        }
    }

    fn counting(epoch: Option<u64>) -> Communicator<Counting> {
        // The defaults for the host at world 1: one-shot, two-shot (not implemented here), ring.
        let selector = Selector::default();
        let caps =
            CapabilityReport::all_disabled(|_| Reason::Unavailable { component: "x".into(), detail: "y".into() });
        let backend = Counting {
            rt: Bytes::default(),
            caps,
            capture_free: false,
            refuse_one_shot_captured: false,
            epoch,
            refuse_one_shot: false,
            reductions: Cell::new(0),
            eligibility: Cell::new(0),
            ran: Vec::new(),
            waits: 0,
            registrations: 0,
            world: 1,
            groups: Vec::new(),
        };
        Communicator::new(backend, Arc::new(selector))
    }

    fn sum(c: &mut Communicator<Counting>, buf: &mut [u8], dtype: DataType) -> Algorithm {
        let count = buf.len() / dtype.size_bytes();
        c.all_reduce(InOut::InPlace(buf), count, dtype, ReduceOp::Sum, &()).expect("valid call").algorithm
    }

    /// A backend without the fused call: refused with `Unsupported` naming it and the capability, before the
    /// capture state is asked or anything reaches the backend.
    #[test]
    fn a_backend_without_the_fused_call_is_refused_naming_it() {
        let mut c = counting(None);
        let (input, weight) = (vec![0u8; 64], vec![0u8; 16]);
        let (mut residual, mut out) = (vec![0u8; 64], vec![0u8; 64]);
        let spec = RmsNormSpec::new(DataType::Bf16, 4, 8, 1e-6);
        let e = c.all_reduce_rmsnorm(&input, &mut residual, &weight, &mut out, &spec, &()).expect_err("refused");
        match &e {
            Error::Unsupported { capability, reason } => {
                assert_eq!(capability, "fused-rmsnorm");
                assert!(reason.to_string().contains(c.backend().name()), "{e}");
            }
            other => panic!("not Unsupported: {other}"),
        }
        assert_eq!(c.backend().rt.asked.load(Ordering::Relaxed), 0);
        let call = spec.call().expect("valid");
        assert!(matches!(c.select_rmsnorm(&call, None), Err(Error::Unsupported { .. })));
    }

    #[test]
    fn a_repeated_call_reuses_the_decision_until_the_backend_changes() {
        let mut c = counting(Some(7));
        let mut a = vec![0u8; 64];
        let mut b = vec![0u8; 64];
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        let asked = (c.backend().reductions.get(), c.backend().eligibility.get());
        assert_eq!(asked, (1, 1));
        // The same call again: nothing asked.
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        assert_eq!((c.backend().reductions.get(), c.backend().eligibility.get()), asked);
        // Another buffer, then another type: asked again.
        sum(&mut c, &mut b, DataType::F32);
        assert_eq!((c.backend().reductions.get(), c.backend().eligibility.get()), (2, 2));
        sum(&mut c, &mut b, DataType::I32);
        assert_eq!((c.backend().reductions.get(), c.backend().eligibility.get()), (3, 3));
        // The backend's answer changes, and says so through its epoch: the new answer is used at once.
        c.backend.refuse_one_shot = true;
        c.backend.epoch = Some(8);
        assert_eq!(sum(&mut c, &mut b, DataType::I32), Algorithm::Ring);
        assert_eq!(
            c.backend().ran,
            [Algorithm::OneShot, Algorithm::OneShot, Algorithm::OneShot, Algorithm::OneShot, Algorithm::Ring]
        );
    }

    #[test]
    fn deterministic_mode_is_per_communicator_drops_the_remembered_decision_and_refuses_other_algorithms() {
        let mut c = counting(Some(7));
        let mut a = vec![0u8; 64];
        assert!(!c.deterministic());
        c.backend.refuse_one_shot = true;
        // Without the mode, the ring runs where one-shot cannot; with it, nothing may run: a typed error.
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::Ring);
        c.set_deterministic(true);
        assert!(c.deterministic());
        let err = c
            .all_reduce(InOut::InPlace(&mut a[..]), 16, DataType::F32, ReduceOp::Sum, &())
            .expect_err("no deterministic algorithm");
        assert!(matches!(&err, Error::NoEligibleAlgorithm { why } if why.contains("ANYCCL_DETERMINISTIC")), "{err}");
        // One-shot back: it runs, and an explicit ring is refused for its order.
        c.backend.refuse_one_shot = false;
        c.backend.epoch = Some(8);
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        let err = c
            .all_reduce_with(Algorithm::Ring, InOut::InPlace(&mut a[..]), 16, DataType::F32, ReduceOp::Sum, &())
            .expect_err("ring is not deterministic");
        assert!(matches!(err, Error::AlgorithmNotEligible { algorithm: Algorithm::Ring, .. }), "{err}");
        // Off again: the remembered one-shot decision is not reused blindly, the ring is allowed again.
        c.set_deterministic(false);
        c.all_reduce_with(Algorithm::Ring, InOut::InPlace(&mut a[..]), 16, DataType::F32, ReduceOp::Sum, &())
            .expect("ring allowed");
        assert_eq!(c.backend().ran.last(), Some(&Algorithm::Ring));
    }

    #[test]
    fn a_backend_without_an_epoch_is_asked_every_call() {
        let mut c = counting(None);
        let mut a = vec![0u8; 64];
        for n in 1..=3 {
            sum(&mut c, &mut a, DataType::F32);
            assert_eq!((c.backend().reductions.get(), c.backend().eligibility.get()), (n, n));
        }
        // Its answer may change at any time, and the next call follows it.
        c.backend.refuse_one_shot = true;
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::Ring);
    }

    #[test]
    fn the_capture_state_is_skipped_only_where_the_decision_cannot_depend_on_it() {
        let asked = |c: &Communicator<Counting>| c.backend().rt.asked.load(Ordering::Relaxed);
        let mut a = vec![0u8; 64];
        // A backend whose choice and algorithm ignore capture: a repeated call does not ask.
        let mut c = counting(Some(1));
        c.backend.capture_free = true;
        sum(&mut c, &mut a, DataType::F32);
        sum(&mut c, &mut a, DataType::F32);
        assert_eq!(asked(&c), 1);
        // One whose eligibility reads it: asked every call, and a capture that starts changes the choice at once.
        let mut c = counting(Some(1));
        c.backend.refuse_one_shot_captured = true;
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        c.backend.rt.capturing.store(true, Ordering::Relaxed);
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::Ring);
        c.backend.rt.capturing.store(false, Ordering::Relaxed);
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        assert_eq!(asked(&c), 3);
        // A table rule that looks at capture makes every call ask, whatever the backend says.
        let table = "[[rule]]\nvendor = \"host\"\ncapturing = true\nalgorithms = [\"ring\"]\n";
        let path = std::env::temp_dir().join(format!("anyccl-capture-rule-{}.toml", std::process::id()));
        std::fs::write(&path, table).expect("write the table");
        let selector = Selector::default().with_table_file(&path, "test");
        let _ = std::fs::remove_file(&path);
        let mut c = Communicator::new(counting(Some(1)).backend, Arc::new(selector.expect("a valid table")));
        c.backend.capture_free = true;
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        c.backend.rt.capturing.store(true, Ordering::Relaxed);
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::Ring);
        assert_eq!(asked(&c), 2);
    }

    #[test]
    fn a_wait_during_capture_is_refused_before_the_backend_and_changes_nothing() {
        let mut c = counting(Some(3));
        let mut a = vec![0u8; 64];
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        c.backend.rt.capturing.store(true, Ordering::Relaxed);
        let refused = c.wait(&(), std::time::Duration::from_secs(1)).expect_err("refused during capture");
        assert_eq!(refused, Error::InvalidArgument(InvalidArgument::DuringCapture { what: "Communicator::wait" }));
        assert_eq!(c.backend().waits, 0, "the backend was not asked: it cannot count the wait as failed");
        let reg = c.register_graph_buffers(None).expect_err("registration refused during capture");
        assert!(matches!(reg, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{reg:?}");
        assert_eq!(c.backend().registrations, 0);
        // Nothing the selection reads changed: the same call still takes the same algorithm, from the memo.
        assert_eq!(c.backend().eligibility_epoch(), Some(3));
        let asked = c.backend().eligibility.get();
        c.backend.rt.capturing.store(false, Ordering::Relaxed);
        assert_eq!(sum(&mut c, &mut a, DataType::F32), Algorithm::OneShot);
        assert_eq!(c.backend().eligibility.get(), asked, "the remembered decision still holds");
        c.wait(&(), std::time::Duration::from_secs(1)).expect("after the capture the wait reaches the backend");
        c.register_graph_buffers(None).expect("and so does registration");
        assert_eq!((c.backend().waits, c.backend().registrations), (1, 1));
    }

    #[test]
    fn closing_in_the_background_with_nothing_slow_to_do_has_finished_on_return() {
        let c = counting(None);
        let t = c.close_in_background();
        assert!(t.is_done(), "the default teardown drops the backend before returning");
        assert_eq!(t.wait(), Ok(()));
    }

    /// Each bad operation of a group is refused with its own typed error naming it, and the backend sees nothing;
    /// a valid group reaches it whole, in order, with each operation's size.
    #[test]
    fn a_grouped_point_to_point_call_is_validated_whole_before_the_backend_sees_it() {
        let mut c = counting(None);
        c.backend.world = 4;
        let (a, b, mut r1, mut r2) = (vec![1u8; 64], vec![2u8; 64], vec![0u8; 64], vec![0u8; 64]);
        let f32s = DataType::F32;
        let group_op = |e: Error| match e {
            Error::InvalidArgument(InvalidArgument::GroupOp { index, error }) => (index, *error),
            other => panic!("expected GroupOp, got {other:?}"),
        };
        let e = c.p2p(&mut [P2pOp::send(&a[..], 16, f32s, 1), P2pOp::recv(&mut r1[..], 16, f32s, 0)], &());
        assert_eq!(group_op(e.expect_err("self")), (1, InvalidArgument::SelfPeer { rank: 0 }));
        let e = c.p2p(&mut [P2pOp::send(&a[..], 16, f32s, 4)], &());
        assert_eq!(
            group_op(e.expect_err("out of range")),
            (0, InvalidArgument::RankOutOfRange { what: "peer", rank: 4, world: 4 })
        );
        let e = c.p2p(&mut [P2pOp::send(&a[..], 16, f32s, 1), P2pOp::recv(&mut r1[..], 17, f32s, 2)], &());
        assert!(matches!(
            group_op(e.expect_err("short")),
            (1, InvalidArgument::BufferTooSmall { which: "recv", need: 68, .. })
        ));
        let e = c.p2p(&mut [P2pOp::send(&a[..], usize::MAX, DataType::F64, 1)], &());
        assert!(matches!(group_op(e.expect_err("overflow")), (0, InvalidArgument::CountOverflow { .. })));
        assert!(c.backend().groups.is_empty(), "nothing of a refused group reached the backend");
        assert!(r1.iter().all(|x| *x == 0), "nor was any receive buffer written");
        // Receives into adjacent halves of one buffer do not overlap.
        let (lo, hi) = r2.split_at_mut(32);
        let e = c
            .p2p(&mut [P2pOp::recv(lo, 8, f32s, 1), P2pOp::recv(hi, 8, f32s, 2), P2pOp::send(&b[..], 8, f32s, 3)], &());
        assert_eq!(e, Ok(()));
        assert_eq!(c.backend().groups, vec![vec![("recv", 1, 32), ("recv", 2, 32), ("send", 3, 32)]]);
        c.backend.groups.clear();
        // A valid group: every operation, in order, with its size; the receives are written.
        r1.fill(0);
        let ok = c.send_recv(&a[..], 1, &mut r1[..], 3, 16, f32s, &());
        assert_eq!(ok, Ok(()));
        assert_eq!(c.backend().groups, vec![vec![("send", 1, 64), ("recv", 3, 64)]]);
        assert!(r1.iter().all(|x| *x == 0xab));
        // An empty group does nothing.
        c.p2p(&mut [], &()).expect("empty group");
        assert_eq!(c.backend().groups.len(), 1);
    }

    /// A receive buffer overlapping a send buffer is refused (the checks see through the borrow rules, which
    /// cannot stop two views of one device allocation).
    #[test]
    fn overlapping_receive_buffers_are_refused_with_both_operations_named() {
        use crate::runtime::BufferDesc;
        /// A view of raw host bytes, as a device pool's views would be: nothing stops two of them overlapping.
        struct Raw(BufferDesc);
        impl BufferLike for Raw {
            fn desc(&self) -> BufferDesc {
                self.0
            }
        }
        let raw = |addr: usize| Raw(BufferDesc { addr, len: 64, location: Location::Host });
        let (a, mut b, mut c) = (raw(0x1000), raw(0x2000), raw(0x1020));
        let ops = [
            P2pOp::send(&a, 16, DataType::F32, 1),
            P2pOp::recv(&mut b, 16, DataType::F32, 2),
            P2pOp::recv(&mut c, 16, DataType::F32, 3),
        ];
        let descs: Vec<_> = ops.iter().map(P2pOp::desc).collect();
        let shape = CallShape { rank: 0, world: 4, location: Location::Host };
        let e = validate::p2p_group(&shape, &descs).expect_err("recv over a send");
        assert!(
            matches!(
                e,
                InvalidArgument::GroupOverlap { first: 0, first_kind: "send", second: 2, second_kind: "recv", .. }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("operations 0 (send"), "{e}");
    }

    #[test]
    fn split_checks_its_arguments_and_a_backend_without_it_says_so() {
        let mut c = counting(None);
        let e = c.split(Some(1 << 31), 0).err().expect("color too large");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::OutOfRange { what: "split color", .. })), "{e}");
        let e = c.split(None, u32::MAX).err().expect("key too large");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::OutOfRange { what: "split key", .. })), "{e}");
        let e = c.split(Some(0), 0).err().expect("not implemented");
        assert!(matches!(&e, Error::Unsupported { capability, .. } if capability == "comm-split"), "{e}");
        assert!(e.to_string().contains("the counting backend"), "{e}");
        // During a capture the runtime knows of, refused before the backend is asked (it would allocate).
        c.backend.rt.capturing.store(true, Ordering::Relaxed);
        let e = c.split(Some(0), 0).err().expect("refused during capture");
        assert_eq!(e, Error::InvalidArgument(InvalidArgument::DuringCapture { what: "Communicator::split" }));
    }
}
