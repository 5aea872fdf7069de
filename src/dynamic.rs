//! A communicator whose backend is chosen at run time: [`AnyCommunicator`] (a boxed [`DynComm`]) over the host,
//! CUDA and ROCm communicators, with device memory as an opaque owned [`AnyBuffer`], streams as [`AnyStream`] and
//! captured graphs as [`AnyGraph`]. [`communicators`] makes one process's ranks on the backend asked for (or the
//! best present), [`from_env`] one rank of a job started by torchrun or srun; both say why each backend passed over
//! was not chosen.
//!
//! The typed API ([`crate::Communicator`]`<B>`) stays the fast path: every method here is one virtual call and a
//! check that the buffers and stream belong to this backend in front of the typed call, which then validates and
//! selects as always. Code written once for every backend (the `anyccl bench` and `tune` commands, an engine that
//! does not want a type parameter per vendor) uses this; a hot loop that knows its backend may downcast
//! ([`DynComm::as_any`]) and use the typed communicator.
//!
//! ```
//! # #[cfg(feature = "host")] {
//! use std::sync::Arc;
//! use anyccl::dynamic::{communicators, BackendChoice};
//! use anyccl::{DataType, InOut, ReduceOp, Selector};
//!
//! let chosen = communicators(BackendChoice::Host, 2, Arc::new(Selector::defaults())).unwrap();
//! std::thread::scope(|s| {
//!     for mut comm in chosen.comms {
//!         s.spawn(move || {
//!             let stream = comm.stream().unwrap();
//!             let mut buf = comm.alloc(16).unwrap();
//!             comm.upload(&mut buf, &2.0f32.to_le_bytes().repeat(4), &stream).unwrap();
//!             comm.all_reduce(InOut::InPlace(&mut buf), 4, DataType::F32, ReduceOp::Sum, &stream).unwrap();
//!             let mut out = [0u8; 16];
//!             comm.download(&buf, &mut out, &stream).unwrap();
//!             assert_eq!(f32::from_le_bytes([out[0], out[1], out[2], out[3]]), 4.0);
//!         });
//!     }
//! });
//! # }
//! ```

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use anyccl_core::comm::{AllReduceCall, BufOf, StreamOf};
use anyccl_core::fused::{RmsNormCall, RmsNormForm, RmsNormSelection, RmsNormSpec};
use anyccl_core::runtime::{BufferLike, Location};
use anyccl_core::{
    Algorithm, Bootstrap, Capabilities, CapabilityReport, CommBackend, Communicator, DataType, Error,
    GraphRegistration, InOut, InvalidArgument, MemoryRuntime, P2pOp, Reason, ReduceOp, Result, Selection, Selector,
    Teardown, Vendor,
};

/// A backend a communicator can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Ranks over host memory (threads, or processes over shared memory).
    Host,
    /// NVIDIA GPUs: the CUDA driver and NCCL.
    Cuda,
    /// AMD GPUs: the HIP runtime and RCCL.
    Rocm,
}

impl BackendKind {
    /// Every backend, in the order [`BackendChoice::Best`] tries them last to first (host is the fallback).
    pub const ALL: [BackendKind; 3] = [BackendKind::Host, BackendKind::Cuda, BackendKind::Rocm];

    /// `host`, `cuda`, `rocm`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
            BackendKind::Rocm => "rocm",
        }
    }

    /// Whether this build contains the backend (its cargo feature).
    pub fn compiled_in(self) -> bool {
        match self {
            BackendKind::Host => cfg!(feature = "host"),
            BackendKind::Cuda => cfg!(feature = "cuda"),
            BackendKind::Rocm => cfg!(feature = "rocm"),
        }
    }

    /// The capability `ANYCCL_DISABLE` names to turn the backend off.
    pub fn capability(self) -> Capabilities {
        match self {
            BackendKind::Host => Capabilities::HOST_BACKEND,
            BackendKind::Cuda => Capabilities::CUDA_RUNTIME,
            BackendKind::Rocm => Capabilities::HIP_RUNTIME,
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which backend [`communicators`] and [`from_env`] use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendChoice {
    /// The best backend present: cuda, then rocm, then host.
    #[default]
    Best,
    /// The host backend, or an error saying why it cannot run.
    Host,
    /// The CUDA backend, or an error saying why it cannot run.
    Cuda,
    /// The ROCm backend, or an error saying why it cannot run.
    Rocm,
}

impl BackendChoice {
    /// The backends tried, in order.
    fn order(self) -> Vec<BackendKind> {
        match self {
            BackendChoice::Best => vec![BackendKind::Cuda, BackendKind::Rocm, BackendKind::Host],
            BackendChoice::Host => vec![BackendKind::Host],
            BackendChoice::Cuda => vec![BackendKind::Cuda],
            BackendChoice::Rocm => vec![BackendKind::Rocm],
        }
    }
}

impl From<BackendKind> for BackendChoice {
    fn from(k: BackendKind) -> Self {
        match k {
            BackendKind::Host => BackendChoice::Host,
            BackendKind::Cuda => BackendChoice::Cuda,
            BackendKind::Rocm => BackendChoice::Rocm,
        }
    }
}

impl std::str::FromStr for BackendChoice {
    type Err = Error;

    /// `best` (or `auto`), `host`, `cuda`, `rocm`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "best" | "auto" => Ok(BackendChoice::Best),
            "host" => Ok(BackendChoice::Host),
            "cuda" => Ok(BackendChoice::Cuda),
            "rocm" => Ok(BackendChoice::Rocm),
            _ => Err(Error::Parse {
                what: "backend",
                input: anyccl_core::text::sanitize_with_limit(s, 64),
                expected: "best, host, cuda or rocm".into(),
            }),
        }
    }
}

/// Device (or host) memory of one backend, owned: what [`DynComm::alloc`] and [`DynComm::symmetric_buffer`]
/// return. Collectives take it through [`InOut`]; a buffer of another backend is refused with
/// [`InvalidArgument::WrongDevice`].
pub struct AnyBuffer {
    inner: BufInner,
}

enum BufInner {
    #[cfg(feature = "host")]
    Host(anyccl_host::HostBuffer),
    #[cfg(feature = "cuda")]
    Cuda(anyccl_cuda::DeviceBuffer),
    #[cfg(feature = "cuda")]
    CudaSymmetric(anyccl_cuda::SymmetricBuffer),
    #[cfg(feature = "rocm")]
    Rocm(anyccl_rocm::HipBuffer),
    #[cfg(feature = "rocm")]
    RocmSymmetric(anyccl_rocm::SymmetricBuffer),
}

impl AnyBuffer {
    /// The backend the memory belongs to.
    pub fn backend(&self) -> BackendKind {
        match &self.inner {
            #[cfg(feature = "host")]
            BufInner::Host(_) => BackendKind::Host,
            #[cfg(feature = "cuda")]
            BufInner::Cuda(_) | BufInner::CudaSymmetric(_) => BackendKind::Cuda,
            #[cfg(feature = "rocm")]
            BufInner::Rocm(_) | BufInner::RocmSymmetric(_) => BackendKind::Rocm,
        }
    }

    /// Where the memory is, its address and length.
    pub fn desc(&self) -> anyccl_core::runtime::BufferDesc {
        match &self.inner {
            #[cfg(feature = "host")]
            BufInner::Host(b) => b.as_bytes().desc(),
            #[cfg(feature = "cuda")]
            BufInner::Cuda(b) => b.desc(),
            #[cfg(feature = "cuda")]
            BufInner::CudaSymmetric(b) => b.buffer().desc(),
            #[cfg(feature = "rocm")]
            BufInner::Rocm(b) => b.desc(),
            #[cfg(feature = "rocm")]
            BufInner::RocmSymmetric(b) => b.buffer().desc(),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.desc().len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it is a registered symmetric window ([`DynComm::symmetric_buffer`]).
    pub fn is_symmetric(&self) -> bool {
        match &self.inner {
            #[cfg(feature = "cuda")]
            BufInner::CudaSymmetric(_) => true,
            #[cfg(feature = "rocm")]
            BufInner::RocmSymmetric(_) => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The CUDA backend's buffer (plain or in a window), if it is one: for code that times the typed path.
    #[cfg(feature = "cuda")]
    pub fn as_cuda(&self) -> Option<&anyccl_cuda::DeviceBuffer> {
        <anyccl_cuda::CudaComm as Erased>::buf(self)
    }

    /// [`AnyBuffer::as_cuda`], mutably.
    #[cfg(feature = "cuda")]
    pub fn as_cuda_mut(&mut self) -> Option<&mut anyccl_cuda::DeviceBuffer> {
        <anyccl_cuda::CudaComm as Erased>::buf_mut(self)
    }

    /// The host backend's buffer, if it is one.
    #[cfg(feature = "host")]
    pub fn as_host(&self) -> Option<&anyccl_host::HostBuffer> {
        match &self.inner {
            BufInner::Host(b) => Some(b),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

impl fmt::Debug for AnyBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.desc();
        f.debug_struct("AnyBuffer")
            .field("backend", &self.backend())
            .field("location", &d.location)
            .field("len", &d.len)
            .field("symmetric", &self.is_symmetric())
            .finish()
    }
}

/// A stream of one backend ([`DynComm::stream`]); the host backend's is a placeholder (its calls finish on return).
pub struct AnyStream {
    inner: StreamInner,
}

enum StreamInner {
    #[cfg(feature = "host")]
    Host,
    #[cfg(feature = "cuda")]
    Cuda(anyccl_cuda::CudaStream),
    #[cfg(feature = "rocm")]
    Rocm(anyccl_rocm::HipStream),
}

impl AnyStream {
    /// The backend the stream belongs to.
    pub fn backend(&self) -> BackendKind {
        match &self.inner {
            #[cfg(feature = "host")]
            StreamInner::Host => BackendKind::Host,
            #[cfg(feature = "cuda")]
            StreamInner::Cuda(_) => BackendKind::Cuda,
            #[cfg(feature = "rocm")]
            StreamInner::Rocm(_) => BackendKind::Rocm,
        }
    }
}

impl AnyStream {
    /// The CUDA stream, if it is one: for code that times the typed path.
    #[cfg(feature = "cuda")]
    pub fn as_cuda(&self) -> Option<&anyccl_cuda::CudaStream> {
        <anyccl_cuda::CudaComm as Erased>::stream_of(self)
    }
}

/// A device timing event ([`DynComm::event`]): recorded on a stream, then the time between two is read.
pub struct AnyEvent {
    inner: EventInner,
}

enum EventInner {
    #[cfg(feature = "cuda")]
    Cuda(anyccl_cuda::graph::Event),
    #[cfg(feature = "rocm")]
    Rocm(anyccl_rocm::HipEvent),
    /// Keeps the enum inhabited in builds without a backend that has events (never constructed there).
    #[allow(dead_code)]
    None(std::convert::Infallible),
}

impl AnyEvent {
    /// The backend that made the event.
    fn backend(&self) -> BackendKind {
        match &self.inner {
            #[cfg(feature = "cuda")]
            EventInner::Cuda(_) => BackendKind::Cuda,
            #[cfg(feature = "rocm")]
            EventInner::Rocm(_) => BackendKind::Rocm,
            EventInner::None(never) => match *never {},
        }
    }

    /// Records the event on `stream` (of the backend that made it). On ROCm, refused while the stream captures.
    pub fn record(&self, stream: &AnyStream) -> Result<()> {
        match (&self.inner, &stream.inner) {
            #[cfg(feature = "cuda")]
            (EventInner::Cuda(e), StreamInner::Cuda(s)) => e.record(s),
            #[cfg(feature = "rocm")]
            (EventInner::Rocm(e), StreamInner::Rocm(s)) => e.record(s),
            (EventInner::None(never), _) => match *never {},
            #[allow(unreachable_patterns)]
            _ => Err(wrong_backend("stream", stream.backend(), self.backend())),
        }
    }

    /// Milliseconds from this event to `end` (of the same backend), both recorded and completed.
    pub fn elapsed_ms(&self, end: &AnyEvent) -> Result<f32> {
        match (&self.inner, &end.inner) {
            #[cfg(feature = "cuda")]
            (EventInner::Cuda(a), EventInner::Cuda(b)) => a.elapsed_ms(b),
            #[cfg(feature = "rocm")]
            (EventInner::Rocm(a), EventInner::Rocm(b)) => a.elapsed_ms(b),
            (EventInner::None(never), _) => match *never {},
            #[allow(unreachable_patterns)]
            (_, EventInner::None(never)) => match *never {},
            #[allow(unreachable_patterns)]
            _ => Err(wrong_backend("end event", end.backend(), self.backend())),
        }
    }
}

impl fmt::Debug for AnyEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AnyEvent")
    }
}

impl fmt::Debug for AnyStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyStream").field("backend", &self.backend()).finish()
    }
}

/// A captured, instantiated graph ([`DynComm::capture`]), replayed with [`AnyGraph::launch`].
pub struct AnyGraph {
    inner: GraphInner,
}

enum GraphInner {
    #[cfg(feature = "cuda")]
    Cuda(anyccl_cuda::graph::Graph),
    #[cfg(feature = "rocm")]
    Rocm(anyccl_rocm::HipGraph),
    /// Keeps the enum inhabited in builds without a GPU backend (never constructed there).
    #[allow(dead_code)]
    None(std::convert::Infallible),
}

impl AnyGraph {
    /// Replays the graph on `stream` (a stream of the backend that captured it).
    pub fn launch(&self, stream: &AnyStream) -> Result<()> {
        match (&self.inner, &stream.inner) {
            #[cfg(feature = "cuda")]
            (GraphInner::Cuda(g), StreamInner::Cuda(s)) => g.launch(s),
            #[cfg(feature = "rocm")]
            (GraphInner::Rocm(g), StreamInner::Rocm(s)) => g.launch(s),
            (GraphInner::None(never), _) => match *never {},
            #[allow(unreachable_patterns)]
            _ => Err(Error::Unsupported {
                capability: "graph-capture".into(),
                reason: Reason::NotApplicable {
                    detail: format!("a graph cannot be launched on a {} stream", stream.backend()),
                },
            }),
        }
    }
}

impl fmt::Debug for AnyGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AnyGraph")
    }
}

/// The body of a capture: enqueues on the capturing stream through the communicator it is given.
pub type CaptureBody<'a> = dyn FnMut(&mut dyn DynComm, &AnyStream) -> Result<()> + 'a;

/// One rank's communicator, whatever its backend: the object-safe face of [`Communicator`]. Every collective is
/// the typed communicator's, after a check that the buffers and the stream belong to this backend.
pub trait DynComm: Send {
    /// The backend.
    fn backend(&self) -> BackendKind;
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The vendor, as the selector sees it.
    fn vendor(&self) -> Vendor;
    /// The architecture (`sm_90`, `gfx942`, `host`).
    fn arch(&self) -> &str;
    /// What the backend can do here, with the reasons for what it cannot.
    fn capabilities(&self) -> &CapabilityReport;
    /// The selector in use.
    fn selector(&self) -> &Selector;
    /// The all-reduce algorithms the backend implements, eligible or not.
    fn allreduce_algorithms(&self) -> Vec<Algorithm>;
    /// The vendor collective library and its file (`RCCL 2.26.6 (/opt/rocm/lib/librccl.so.1)`); `None` on the host.
    fn library(&self) -> Option<String>;
    /// The device this rank drives (`GPU 0 (gfx942)`, `host`).
    fn device(&self) -> String;
    /// Where this rank's buffers live.
    fn location(&self) -> Location;
    /// Turns deterministic mode on or off ([`Communicator::set_deterministic`]; every rank the same).
    fn set_deterministic(&mut self, on: bool);
    /// Whether deterministic mode is on.
    fn deterministic(&self) -> bool;

    /// Allocates `bytes` of this rank's memory (refused during a capture on the GPU backends).
    fn alloc(&self, bytes: usize) -> Result<AnyBuffer>;
    /// A symmetric buffer of `bytes` (registered window) where the backend has them; collective. The error gives
    /// the reason where windows are off.
    fn symmetric_buffer(&self, bytes: usize, stream: &AnyStream) -> Result<AnyBuffer>;
    /// A new stream of this rank's device.
    fn stream(&self) -> Result<AnyStream>;
    /// Copies `src` into the start of `dst`, ordered on `stream`.
    fn upload(&self, dst: &mut AnyBuffer, src: &[u8], stream: &AnyStream) -> Result<()>;
    /// Copies the start of `src` into `dst`, ordered on `stream`; the data is in `dst` on return.
    fn download(&self, src: &AnyBuffer, dst: &mut [u8], stream: &AnyStream) -> Result<()>;
    /// Waits for the work queued on `stream`, without a limit.
    fn synchronize(&self, stream: &AnyStream) -> Result<()>;
    /// Whether `stream` is being captured.
    fn is_capturing(&self, stream: &AnyStream) -> Result<bool>;
    /// A device timing event, where the backend offers them (CUDA, ROCm); elsewhere [`Error::Unsupported`] naming
    /// `device-timing-events` (time on the host up to [`DynComm::synchronize`] instead).
    fn event(&self) -> Result<AnyEvent>;

    /// The algorithm an all-reduce of this shape would use now, without running it.
    fn select_all_reduce(&self, call: &AllReduceCall) -> Result<Selection>;
    /// Whether `algorithm` could run `call` here ([`Error::AlgorithmNotEligible`] with the reason if not).
    fn check_algorithm(&self, algorithm: Algorithm, call: &AllReduceCall) -> Result<()>;
    /// All-reduce with the algorithm the selector picks; returns the selection.
    fn all_reduce(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &AnyStream,
    ) -> Result<Selection>;
    /// All-reduce with an explicit algorithm; an ineligible one is an error.
    fn all_reduce_with(
        &mut self,
        algorithm: Algorithm,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &AnyStream,
    ) -> Result<()>;
    /// The form a fused all-reduce + RMSNorm `call` would use now ([`Communicator::select_rmsnorm`]).
    fn select_rmsnorm(&self, call: &RmsNormCall, forced: Option<RmsNormForm>) -> Result<RmsNormSelection>;
    /// The fused all-reduce + residual add + RMSNorm ([`Communicator::all_reduce_rmsnorm`]): `residual ←
    /// allreduce(input) + residual`, `out ← rmsnorm(residual) × weight` (or fp8), validated and with its form
    /// chosen as there; every buffer must be of this backend. Returns the form and the rule that chose it.
    fn all_reduce_rmsnorm(
        &mut self,
        input: &AnyBuffer,
        residual: &mut AnyBuffer,
        weight: &AnyBuffer,
        out: &mut AnyBuffer,
        spec: &RmsNormSpec,
        stream: &AnyStream,
    ) -> Result<RmsNormSelection>;
    /// All-gather of `count` elements per rank.
    fn all_gather(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        stream: &AnyStream,
    ) -> Result<()>;
    /// Reduce-scatter to `count` elements per rank.
    fn reduce_scatter(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &AnyStream,
    ) -> Result<()>;
    /// Broadcast `count` elements from `root`.
    fn broadcast(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &AnyStream,
    ) -> Result<()>;
    /// Reduce `count` elements to `root`.
    fn reduce(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: &AnyStream,
    ) -> Result<()>;
    /// Send `count` elements to `peer`.
    fn send(&mut self, buf: &AnyBuffer, count: usize, dtype: DataType, peer: usize, stream: &AnyStream) -> Result<()>;
    /// Receive `count` elements from `peer`.
    fn recv(
        &mut self,
        buf: &mut AnyBuffer,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &AnyStream,
    ) -> Result<()>;
    /// Sends and receives as one group ([`Communicator::p2p`]): a pipeline stage's exchange or a ring step, in any
    /// order of operations on each rank. Every buffer must be of this backend.
    fn p2p(&mut self, ops: &mut [P2pOp<'_, AnyBuffer>], stream: &AnyStream) -> Result<()>;
    /// Splits this communicator by `color` (`None`: this rank joins none), ordering ranks by `key`
    /// ([`Communicator::split`]). Collective over this communicator.
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<AnyCommunicator>>;
    /// Waits until every rank reaches the barrier.
    fn barrier(&mut self, stream: &AnyStream) -> Result<()>;
    /// Waits for the work on `stream` for at most `timeout` ([`Communicator::wait`]).
    fn wait(&mut self, stream: &AnyStream, timeout: Duration) -> Result<()>;
    /// Whether the work on `stream` has finished, without blocking ([`Communicator::query`]).
    fn query(&mut self, stream: &AnyStream) -> Result<bool>;
    /// Registers the inputs of captured collectives ([`Communicator::register_graph_buffers`]).
    fn register_graph_buffers(&mut self, bootstrap: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration>;
    /// Inputs of captured collectives not registered yet.
    fn pending_graph_buffers(&self) -> usize;
    /// Captures what `body` enqueues on `stream` into a graph (thread-local capture mode), where the backend has
    /// graphs; the host backend refuses with [`Error::Unsupported`] naming `graph-capture`.
    fn capture(&mut self, stream: &AnyStream, body: &mut CaptureBody<'_>) -> Result<AnyGraph>;
    /// Tears the rank down in the background ([`Communicator::close_in_background`]).
    fn close_in_background(self: Box<Self>) -> Teardown;
    /// The typed communicator, to downcast (`Communicator<CudaComm>`, `Communicator<HostComm>`, …).
    fn as_any(&self) -> &dyn Any;
    /// The typed communicator, mutably.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// One rank's communicator on the backend chosen at run time.
pub type AnyCommunicator = Box<dyn DynComm>;

/// What each backend adds to the typed communicator to be used through [`DynComm`].
trait Erased: CommBackend + Sized + 'static {
    const KIND: BackendKind;
    fn buf(b: &AnyBuffer) -> Option<&BufOf<Self>>;
    fn buf_mut(b: &mut AnyBuffer) -> Option<&mut BufOf<Self>>;
    fn stream_of(s: &AnyStream) -> Option<&StreamOf<Self>>;
    fn wrap(b: <Self::Runtime as MemoryRuntime>::OwnedBuffer) -> AnyBuffer;
    fn new_stream(c: &Communicator<Self>) -> Result<AnyStream>;
    fn library(c: &Communicator<Self>) -> Option<String>;
    fn device(c: &Communicator<Self>) -> String;
    fn symmetric(c: &Communicator<Self>, bytes: usize, stream: &AnyStream) -> Result<AnyBuffer>;
    fn capture(c: &mut Communicator<Self>, stream: &AnyStream, body: &mut CaptureBody<'_>) -> Result<AnyGraph>;
    fn event(c: &Communicator<Self>) -> Result<AnyEvent> {
        let _ = c;
        Err(Error::Unsupported {
            capability: "device-timing-events".into(),
            reason: Reason::NotApplicable {
                detail: format!("the {} backend offers no device timing events in this release", Self::KIND),
            },
        })
    }
}

fn wrong_backend(which: &'static str, found: BackendKind, expected: BackendKind) -> Error {
    InvalidArgument::WrongBackend { which, found: found.name(), expected: expected.name() }.into()
}

#[cfg(feature = "host")]
fn no_windows(backend: BackendKind) -> Error {
    Error::Unsupported {
        capability: "symmetric-windows".into(),
        reason: Reason::NotApplicable { detail: format!("the {backend} backend has no symmetric windows") },
    }
}

#[cfg(feature = "host")]
fn no_graphs(backend: BackendKind) -> Error {
    Error::Unsupported {
        capability: "graph-capture".into(),
        reason: Reason::NotApplicable { detail: format!("the {backend} backend has no streams to capture") },
    }
}

fn any_buf<'b, B: Erased>(which: &'static str, b: &'b AnyBuffer) -> Result<&'b BufOf<B>> {
    B::buf(b).ok_or_else(|| wrong_backend(which, b.backend(), B::KIND))
}

fn any_buf_mut<'b, B: Erased>(which: &'static str, b: &'b mut AnyBuffer) -> Result<&'b mut BufOf<B>> {
    let found = b.backend();
    B::buf_mut(b).ok_or_else(|| wrong_backend(which, found, B::KIND))
}

fn any_stream<B: Erased>(s: &AnyStream) -> Result<&StreamOf<B>> {
    B::stream_of(s).ok_or_else(|| wrong_backend("stream", s.backend(), B::KIND))
}

fn any_io<B: Erased>(bufs: InOut<'_, AnyBuffer>) -> Result<InOut<'_, BufOf<B>>> {
    Ok(match bufs {
        InOut::InPlace(b) => InOut::InPlace(any_buf_mut::<B>("buffer", b)?),
        InOut::Separate { send, recv } => {
            InOut::Separate { send: any_buf::<B>("send buffer", send)?, recv: any_buf_mut::<B>("recv buffer", recv)? }
        }
    })
}

impl<B: Erased> DynComm for Communicator<B> {
    fn backend(&self) -> BackendKind {
        B::KIND
    }
    fn rank(&self) -> usize {
        Communicator::rank(self)
    }
    fn world_size(&self) -> usize {
        Communicator::world_size(self)
    }
    fn vendor(&self) -> Vendor {
        Communicator::backend(self).vendor()
    }
    fn arch(&self) -> &str {
        Communicator::backend(self).arch()
    }
    fn capabilities(&self) -> &CapabilityReport {
        Communicator::capabilities(self)
    }
    fn selector(&self) -> &Selector {
        Communicator::selector(self)
    }
    fn allreduce_algorithms(&self) -> Vec<Algorithm> {
        Communicator::backend(self).allreduce_algorithms().to_vec()
    }
    fn library(&self) -> Option<String> {
        B::library(self)
    }
    fn device(&self) -> String {
        B::device(self)
    }
    fn location(&self) -> Location {
        self.runtime().location()
    }
    fn set_deterministic(&mut self, on: bool) {
        Communicator::set_deterministic(self, on)
    }
    fn deterministic(&self) -> bool {
        Communicator::deterministic(self)
    }
    fn alloc(&self, bytes: usize) -> Result<AnyBuffer> {
        self.runtime().alloc(bytes).map(B::wrap)
    }
    fn symmetric_buffer(&self, bytes: usize, stream: &AnyStream) -> Result<AnyBuffer> {
        B::symmetric(self, bytes, stream)
    }
    fn stream(&self) -> Result<AnyStream> {
        B::new_stream(self)
    }
    fn upload(&self, dst: &mut AnyBuffer, src: &[u8], stream: &AnyStream) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        self.runtime().upload(any_buf_mut::<B>("upload's destination", dst)?, src, s)
    }
    fn download(&self, src: &AnyBuffer, dst: &mut [u8], stream: &AnyStream) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        self.runtime().download(any_buf::<B>("download's source", src)?, dst, s)
    }
    fn synchronize(&self, stream: &AnyStream) -> Result<()> {
        self.runtime().synchronize(any_stream::<B>(stream)?)
    }
    fn is_capturing(&self, stream: &AnyStream) -> Result<bool> {
        self.runtime().is_capturing(any_stream::<B>(stream)?)
    }
    fn event(&self) -> Result<AnyEvent> {
        B::event(self)
    }
    fn select_all_reduce(&self, call: &AllReduceCall) -> Result<Selection> {
        Communicator::select_all_reduce(self, call)
    }
    fn check_algorithm(&self, algorithm: Algorithm, call: &AllReduceCall) -> Result<()> {
        Communicator::check_algorithm(self, algorithm, call)
    }
    fn all_reduce(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &AnyStream,
    ) -> Result<Selection> {
        let s = any_stream::<B>(stream)?;
        let io = any_io::<B>(bufs)?;
        Communicator::all_reduce(self, io, count, dtype, op, s)
    }
    fn all_reduce_with(
        &mut self,
        algorithm: Algorithm,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &AnyStream,
    ) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let io = any_io::<B>(bufs)?;
        Communicator::all_reduce_with(self, algorithm, io, count, dtype, op, s)
    }
    fn select_rmsnorm(&self, call: &RmsNormCall, forced: Option<RmsNormForm>) -> Result<RmsNormSelection> {
        Communicator::select_rmsnorm(self, call, forced)
    }
    fn all_reduce_rmsnorm(
        &mut self,
        input: &AnyBuffer,
        residual: &mut AnyBuffer,
        weight: &AnyBuffer,
        out: &mut AnyBuffer,
        spec: &RmsNormSpec,
        stream: &AnyStream,
    ) -> Result<RmsNormSelection> {
        let s = any_stream::<B>(stream)?;
        let (i, w) = (any_buf::<B>("input", input)?, any_buf::<B>("weight", weight)?);
        let (r, o) = (any_buf_mut::<B>("residual", residual)?, any_buf_mut::<B>("out", out)?);
        Communicator::all_reduce_rmsnorm(self, i, r, w, o, spec, s)
    }
    fn all_gather(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        stream: &AnyStream,
    ) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let io = any_io::<B>(bufs)?;
        Communicator::all_gather(self, io, count, dtype, s)
    }
    fn reduce_scatter(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &AnyStream,
    ) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let io = any_io::<B>(bufs)?;
        Communicator::reduce_scatter(self, io, count, dtype, op, s)
    }
    fn broadcast(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &AnyStream,
    ) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let io = any_io::<B>(bufs)?;
        Communicator::broadcast(self, io, count, dtype, root, s)
    }
    fn reduce(
        &mut self,
        bufs: InOut<'_, AnyBuffer>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: &AnyStream,
    ) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let io = any_io::<B>(bufs)?;
        Communicator::reduce(self, io, count, dtype, op, root, s)
    }
    fn send(&mut self, buf: &AnyBuffer, count: usize, dtype: DataType, peer: usize, stream: &AnyStream) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let b = any_buf::<B>("send buffer", buf)?;
        Communicator::send(self, b, count, dtype, peer, s)
    }
    fn recv(
        &mut self,
        buf: &mut AnyBuffer,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &AnyStream,
    ) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let b = any_buf_mut::<B>("recv buffer", buf)?;
        Communicator::recv(self, b, count, dtype, peer, s)
    }
    fn p2p(&mut self, ops: &mut [P2pOp<'_, AnyBuffer>], stream: &AnyStream) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        let mut typed = Vec::new();
        typed.try_reserve_exact(ops.len()).map_err(|_| Error::OutOfMemory {
            what: "the operations of a grouped point-to-point call".into(),
            bytes: (ops.len() * std::mem::size_of::<P2pOp<'_, BufOf<B>>>()) as u64,
        })?;
        for op in ops.iter_mut() {
            typed.push(match op {
                P2pOp::Send { buf, count, dtype, peer } => {
                    P2pOp::send(any_buf::<B>("send buffer", buf)?, *count, *dtype, *peer)
                }
                P2pOp::Recv { buf, count, dtype, peer } => {
                    P2pOp::recv(any_buf_mut::<B>("recv buffer", buf)?, *count, *dtype, *peer)
                }
            });
        }
        Communicator::p2p(self, &mut typed, s)
    }
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<AnyCommunicator>> {
        Ok(Communicator::split(self, color, key)?.map(|c| Box::new(c) as AnyCommunicator))
    }
    fn barrier(&mut self, stream: &AnyStream) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        Communicator::barrier(self, s)
    }
    fn wait(&mut self, stream: &AnyStream, timeout: Duration) -> Result<()> {
        let s = any_stream::<B>(stream)?;
        Communicator::wait(self, s, timeout)
    }
    fn query(&mut self, stream: &AnyStream) -> Result<bool> {
        let s = any_stream::<B>(stream)?;
        Communicator::query(self, s)
    }
    fn register_graph_buffers(&mut self, bootstrap: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
        Communicator::register_graph_buffers(self, bootstrap)
    }
    fn pending_graph_buffers(&self) -> usize {
        Communicator::pending_graph_buffers(self)
    }
    fn capture(&mut self, stream: &AnyStream, body: &mut CaptureBody<'_>) -> Result<AnyGraph> {
        B::capture(self, stream, body)
    }
    fn close_in_background(self: Box<Self>) -> Teardown {
        Communicator::close_in_background(*self)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(feature = "host")]
mod host_impl {
    use super::*;
    use anyccl_host::{HostBuffer, HostComm, ProcessComm};

    fn host_buf(b: &AnyBuffer) -> Option<&[u8]> {
        match &b.inner {
            BufInner::Host(h) => Some(h.as_bytes()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    fn host_buf_mut(b: &mut AnyBuffer) -> Option<&mut [u8]> {
        match &mut b.inner {
            BufInner::Host(h) => Some(h.as_bytes_mut()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    fn host_stream(s: &AnyStream) -> Option<&()> {
        match s.inner {
            StreamInner::Host => Some(&()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    macro_rules! erased_host {
        ($t:ty, $device:expr) => {
            impl Erased for $t {
                const KIND: BackendKind = BackendKind::Host;
                fn buf(b: &AnyBuffer) -> Option<&[u8]> {
                    host_buf(b)
                }
                fn buf_mut(b: &mut AnyBuffer) -> Option<&mut [u8]> {
                    host_buf_mut(b)
                }
                fn stream_of(s: &AnyStream) -> Option<&()> {
                    host_stream(s)
                }
                fn wrap(b: HostBuffer) -> AnyBuffer {
                    AnyBuffer { inner: BufInner::Host(b) }
                }
                fn new_stream(_: &Communicator<Self>) -> Result<AnyStream> {
                    Ok(AnyStream { inner: StreamInner::Host })
                }
                fn library(_: &Communicator<Self>) -> Option<String> {
                    None
                }
                fn device(c: &Communicator<Self>) -> String {
                    ($device)(c.rank())
                }
                fn symmetric(_: &Communicator<Self>, _: usize, _: &AnyStream) -> Result<AnyBuffer> {
                    Err(no_windows(BackendKind::Host))
                }
                fn capture(_: &mut Communicator<Self>, _: &AnyStream, _: &mut CaptureBody<'_>) -> Result<AnyGraph> {
                    Err(no_graphs(BackendKind::Host))
                }
            }
        };
    }

    erased_host!(HostComm, |rank: usize| format!("host thread {rank}"));
    erased_host!(ProcessComm, |_rank: usize| "host".to_owned());
}

/// The part of `Erased` that is the same for both GPU backends (they are one generic communicator): buffers, plain
/// and symmetric, streams, the library's description and symmetric buffers, each in the backend's own variant;
/// `$rest` adds what differs (the device's description, capture, events).
#[cfg(any(feature = "cuda", feature = "rocm"))]
macro_rules! erased_gpu {
    ($comm:ty, $kind:ident, $buf:ty, $stream:ty, $sym:ident, { $($rest:item)* }) => {
        impl Erased for $comm {
            const KIND: BackendKind = BackendKind::$kind;
            fn buf(b: &AnyBuffer) -> Option<&$buf> {
                match &b.inner {
                    BufInner::$kind(d) => Some(d),
                    BufInner::$sym(s) => Some(s.buffer()),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
            fn buf_mut(b: &mut AnyBuffer) -> Option<&mut $buf> {
                match &mut b.inner {
                    BufInner::$kind(d) => Some(d),
                    BufInner::$sym(s) => Some(s.buffer_mut()),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
            fn stream_of(s: &AnyStream) -> Option<&$stream> {
                match &s.inner {
                    StreamInner::$kind(s) => Some(s),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
            fn wrap(b: $buf) -> AnyBuffer {
                AnyBuffer { inner: BufInner::$kind(b) }
            }
            fn new_stream(c: &Communicator<Self>) -> Result<AnyStream> {
                Ok(AnyStream { inner: StreamInner::$kind(c.runtime().stream()?) })
            }
            fn library(c: &Communicator<Self>) -> Option<String> {
                let lib = c.backend().ccl().library();
                Some(format!("{} ({})", lib.describe(), lib.path().display()))
            }
            fn symmetric(c: &Communicator<Self>, bytes: usize, stream: &AnyStream) -> Result<AnyBuffer> {
                let s = any_stream::<Self>(stream)?;
                Ok(AnyBuffer { inner: BufInner::$sym(c.backend().symmetric_buffer(bytes, s)?) })
            }
            $($rest)*
        }
    };
}

#[cfg(feature = "cuda")]
mod cuda_impl {
    use super::*;
    use anyccl_cuda::graph::Graph;
    use anyccl_cuda::{CudaComm, CudaStream, DeviceBuffer};

    erased_gpu!(CudaComm, Cuda, DeviceBuffer, CudaStream, CudaSymmetric, {
        fn device(c: &Communicator<Self>) -> String {
            let ordinal = c.runtime().context().ordinal();
            match anyccl_cuda::available().ok().and_then(|i| i.devices.iter().find(|d| d.ordinal == ordinal)) {
                Some(d) => format!("GPU {ordinal}: {} ({}, {} GiB)", d.name, d.arch(), d.total_memory >> 30),
                None => format!("GPU {ordinal}"),
            }
        }
        fn capture(c: &mut Communicator<Self>, stream: &AnyStream, body: &mut CaptureBody<'_>) -> Result<AnyGraph> {
            let s = any_stream::<Self>(stream)?;
            let ctx = c.runtime().context().clone();
            // The body enqueues on `stream`, the very stream being captured (Graph::capture hands it back).
            let g = Graph::capture(&ctx, s, |_| body(c, stream))?;
            Ok(AnyGraph { inner: GraphInner::Cuda(g) })
        }
        fn event(c: &Communicator<Self>) -> Result<AnyEvent> {
            Ok(AnyEvent { inner: EventInner::Cuda(anyccl_cuda::graph::Event::new(c.runtime().context())?) })
        }
    });
}

#[cfg(feature = "rocm")]
mod rocm_impl {
    use super::*;
    use anyccl_rocm::{HipBuffer, HipGraph, HipStream, RocmComm};

    erased_gpu!(RocmComm, Rocm, HipBuffer, HipStream, RocmSymmetric, {
        fn device(c: &Communicator<Self>) -> String {
            format!("GPU {} ({})", c.runtime().device().ordinal(), c.backend().arch())
        }
        fn capture(c: &mut Communicator<Self>, stream: &AnyStream, body: &mut CaptureBody<'_>) -> Result<AnyGraph> {
            let s = any_stream::<Self>(stream)?;
            // The body enqueues on `stream`, the very stream being captured (HipGraph::capture hands it back).
            let g = HipGraph::capture(s, |_| body(c, stream))?;
            Ok(AnyGraph { inner: GraphInner::Rocm(g) })
        }
        fn event(c: &Communicator<Self>) -> Result<AnyEvent> {
            Ok(AnyEvent { inner: EventInner::Rocm(anyccl_rocm::HipEvent::new(c.runtime().device())?) })
        }
    });
}

/// A backend that was not chosen, and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PassedOver {
    /// The backend.
    pub backend: BackendKind,
    /// Why it was not used.
    pub why: String,
}

/// One process's ranks on the backend [`communicators`] chose.
#[non_exhaustive]
pub struct Chosen {
    /// The backend used.
    pub backend: BackendKind,
    /// One communicator per rank, index = rank.
    pub comms: Vec<AnyCommunicator>,
    /// The backends tried before it, each with the reason it was not used.
    pub passed_over: Vec<PassedOver>,
}

impl fmt::Debug for Chosen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chosen")
            .field("backend", &self.backend)
            .field("world", &self.comms.len())
            .field("passed_over", &self.passed_over)
            .finish()
    }
}

/// The capabilities `ANYCCL_DISABLE` turns off (an invalid value is a [`Error::Config`] naming the variable).
pub use anyccl_core::caps::disabled_by_env;

/// Why `kind` cannot run `world` ranks in this process, or `None` when it can (as far as can be told without
/// making the communicators). `disabled` is what `ANYCCL_DISABLE` turned off.
pub fn unavailable(kind: BackendKind, world: usize, disabled: Capabilities) -> Option<String> {
    if !kind.compiled_in() {
        return Some(format!("not compiled into this build (cargo feature `{kind}`)"));
    }
    if disabled.contains(kind.capability()) {
        let name = kind.capability().name().unwrap_or("the backend");
        return Some(format!("turned off by ANYCCL_DISABLE ({name})"));
    }
    if kind == BackendKind::Host {
        return None;
    }
    match device_count(kind) {
        Err(why) => Some(why),
        Ok(0) => Some("no GPU".into()),
        Ok(n) if n < world => {
            Some(format!("{world} ranks asked for, but one process drives one rank per GPU and there are {n}"))
        }
        Ok(_) => None,
    }
}

/// The GPUs `kind` sees in this process, or why it sees none (the host backend: 1, the host itself).
pub fn device_count(kind: BackendKind) -> std::result::Result<usize, String> {
    match kind {
        BackendKind::Host => Ok(1),
        BackendKind::Cuda => cuda_devices(),
        BackendKind::Rocm => rocm_devices(),
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> std::result::Result<usize, String> {
    anyccl_cuda::available().map(|i| i.devices.len()).map_err(|r| r.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> std::result::Result<usize, String> {
    Err("not compiled into this build".into())
}

/// The HIP runtime, loaded once per process.
#[cfg(feature = "rocm")]
pub(crate) fn hip_runtime() -> &'static std::result::Result<Arc<anyccl_rocm::HipLibrary>, anyccl_rocm::HipLoadError> {
    // The ROCm backend's own, so the communicators of one process per GPU (`anyccl_rocm::multi_process`) and of one
    // process (`communicators`) share one runtime and one registry of streams for the capture rules.
    anyccl_rocm::multi_process::hip_library()
}

#[cfg(feature = "rocm")]
fn rocm_devices() -> std::result::Result<usize, String> {
    match hip_runtime() {
        Err(e) => Err(e.to_string()),
        Ok(lib) => anyccl_rocm::runtime::device_count(lib)
            .map_err(|e| format!("{} at {}: {e}", lib.describe(), lib.path().display())),
    }
}

#[cfg(not(feature = "rocm"))]
fn rocm_devices() -> std::result::Result<usize, String> {
    Err("not compiled into this build".into())
}

/// The error when no backend of `choice` can run: every reason.
fn none_chosen(choice: BackendChoice, passed_over: &[PassedOver]) -> Error {
    let why = passed_over.iter().map(|p| format!("{}: {}", p.backend, p.why)).collect::<Vec<_>>().join("; ");
    let capability = match choice.order().as_slice() {
        [only] => only.capability().name().unwrap_or("backend").to_owned(),
        _ => "backend".to_owned(),
    };
    Error::Unsupported { capability, reason: Reason::Unavailable { component: "anyccl".into(), detail: why } }
}

/// `world` ranks of this process (one thread each) on the backend `choice` names, or the best present (cuda,
/// then rocm, then host), each wrapped in the validating front-end with `selector`. A backend that is not compiled
/// in, turned off by `ANYCCL_DISABLE`, without a runtime or library, with too few GPUs, or whose communicators
/// cannot be made is passed over with the reason ([`Chosen::passed_over`]); when none can run, the error lists
/// every reason.
pub fn communicators(choice: BackendChoice, world: usize, selector: Arc<Selector>) -> Result<Chosen> {
    if world == 0 {
        return Err(InvalidArgument::BadWorld("a communicator needs at least one rank".into()).into());
    }
    let disabled = disabled_by_env()?;
    let mut passed_over = Vec::new();
    for kind in choice.order() {
        if let Some(why) = unavailable(kind, world, disabled) {
            passed_over.push(PassedOver { backend: kind, why });
            continue;
        }
        match make(kind, world, &selector) {
            Ok(comms) => return Ok(Chosen { backend: kind, comms, passed_over }),
            // Asked for by name: its own error is the clearest.
            Err(e) if choice != BackendChoice::Best => return Err(e),
            Err(e) => passed_over.push(PassedOver { backend: kind, why: e.to_string() }),
        }
    }
    Err(none_chosen(choice, &passed_over))
}

fn boxed<B: Erased>(v: Vec<Communicator<B>>) -> Vec<AnyCommunicator> {
    v.into_iter().map(|c| Box::new(c) as AnyCommunicator).collect()
}

#[allow(unused_variables)]
fn make(kind: BackendKind, world: usize, selector: &Arc<Selector>) -> Result<Vec<AnyCommunicator>> {
    match kind {
        #[cfg(feature = "host")]
        BackendKind::Host => {
            let options = anyccl_host::HostOptions { selector: selector.clone(), ..Default::default() };
            Ok(boxed(anyccl_host::communicators(world, options)?))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let lib = anyccl_cuda::multi_process::load_nccl()?;
            let ordinals: Vec<i32> = (0..world as i32).collect();
            Ok(boxed(anyccl_cuda::communicators_single_process(lib, &ordinals, selector.clone())?))
        }
        #[cfg(feature = "rocm")]
        BackendKind::Rocm => {
            let hip = hip_runtime().as_ref().map_err(|e| Error::Unsupported {
                capability: "hip-runtime".into(),
                reason: Reason::Unavailable { component: "HIP runtime".into(), detail: e.to_string() },
            })?;
            let rccl = anyccl_ccl::load(anyccl_ccl::CclVendor::Rccl).map_err(|e| Error::Unsupported {
                capability: "ccl".into(),
                reason: Reason::Unavailable { component: "RCCL".into(), detail: e.to_string() },
            })?;
            let ordinals: Vec<i32> = (0..world as i32).collect();
            Ok(boxed(anyccl_rocm::communicators_single_process(hip.clone(), rccl, &ordinals, selector.clone())?))
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::Unsupported {
            capability: other.capability().name().unwrap_or("backend").into(),
            reason: Reason::NotCompiledIn {
                what: format!("the {other} backend"),
                detail: format!("cargo feature `{other}`"),
            },
        }),
    }
}

/// One rank of a job whose processes were started by torchrun or srun ([`from_env`]).
#[non_exhaustive]
pub struct Joined {
    /// This rank's communicator.
    pub comm: AnyCommunicator,
    /// How the ranks reach each other outside the communicator (the rendezvous), where the backend keeps one:
    /// [`DynComm::register_graph_buffers`] takes it on the CUDA and ROCm backends.
    pub bootstrap: Option<Box<dyn Bootstrap>>,
    /// The backends passed over, with the reason.
    pub passed_over: Vec<PassedOver>,
}

/// This process as one rank of a job started by torchrun or srun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT`; see the backends' `from_env`), on the backend `choice` names or the best present:
/// cuda or rocm (one GPU per process, `LOCAL_RANK`), then host (shared memory).
pub fn from_env(choice: BackendChoice, selector: Arc<Selector>) -> Result<Joined> {
    let disabled = disabled_by_env()?;
    let mut passed_over = Vec::new();
    for kind in choice.order() {
        // One rank per process: any device count of at least one will do.
        let why = unavailable(kind, 1, disabled);
        if let Some(why) = why {
            passed_over.push(PassedOver { backend: kind, why });
            continue;
        }
        match join(kind, &selector) {
            Ok((comm, bootstrap)) => return Ok(Joined { comm, bootstrap, passed_over }),
            Err(e) => return Err(e),
        }
    }
    Err(none_chosen(choice, &passed_over))
}

#[allow(unused_variables)]
fn join(kind: BackendKind, selector: &Arc<Selector>) -> Result<(AnyCommunicator, Option<Box<dyn Bootstrap>>)> {
    match kind {
        #[cfg(feature = "host")]
        BackendKind::Host => {
            let options = anyccl_host::HostOptions { selector: selector.clone(), ..Default::default() };
            Ok((Box::new(anyccl_host::from_env(options)?), None))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let (c, rdv) = anyccl_cuda::multi_process::communicator_from_env(selector.clone())?;
            Ok((Box::new(c), Some(Box::new(rdv))))
        }
        #[cfg(feature = "rocm")]
        BackendKind::Rocm => {
            let (c, rdv) = anyccl_rocm::multi_process::communicator_from_env(selector.clone())?;
            Ok((Box::new(c), Some(Box::new(rdv))))
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::Unsupported {
            capability: other.capability().name().unwrap_or("backend").into(),
            reason: Reason::NotApplicable { detail: format!("the {other} backend cannot join a job of processes") },
        }),
    }
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// One rank's sum, max and auto's algorithm.
    type Outcome = (Vec<u8>, Vec<u8>, Algorithm);

    #[test]
    fn host_ranks_through_the_erased_face_reduce_gather_and_refuse_what_is_not_theirs() {
        let chosen = communicators(BackendChoice::Host, 3, Arc::new(Selector::defaults())).expect("host ranks");
        assert_eq!((chosen.backend, chosen.comms.len()), (BackendKind::Host, 3));
        assert!(chosen.passed_over.is_empty());
        let out: Vec<Result<Outcome>> = std::thread::scope(|s| {
            let hs: Vec<_> = chosen
                .comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || -> Result<Outcome> {
                        let rank = c.rank();
                        assert_eq!((c.backend(), c.world_size(), c.library()), (BackendKind::Host, 3, None));
                        assert_eq!(c.device(), format!("host thread {rank}"));
                        let st = c.stream()?;
                        let mut a = c.alloc(64)?;
                        c.upload(&mut a, &f32s(&[rank as f32 + 1.0; 16]), &st)?;
                        // Only the first 8 elements: a count smaller than the buffer is fine.
                        let mut b = c.alloc(64)?;
                        c.all_reduce_with(
                            Algorithm::Ring,
                            InOut::Separate { send: &a, recv: &mut b },
                            8,
                            DataType::F32,
                            ReduceOp::Sum,
                            &st,
                        )?;
                        let sel = c.all_reduce(InOut::InPlace(&mut a), 16, DataType::F32, ReduceOp::Max, &st)?;
                        let mut got = vec![0u8; 64];
                        c.download(&b, &mut got, &st)?;
                        let mut gathered = c.alloc(12)?;
                        let mine = c.alloc(4)?;
                        c.all_gather(InOut::Separate { send: &mine, recv: &mut gathered }, 1, DataType::F32, &st)?;
                        let mut max = vec![0u8; 64];
                        c.download(&a, &mut max, &st)?;
                        assert_eq!(&max[..4], 3.0f32.to_le_bytes());
                        // Graphs and windows are not the host's: typed errors naming the capability.
                        let g = c.capture(&st, &mut |_, _| Ok(())).expect_err("no graphs");
                        assert!(matches!(&g, Error::Unsupported { capability, .. } if capability == "graph-capture"));
                        assert!(c.symmetric_buffer(64, &st).is_err());
                        // The typed communicator is still there for the fast path.
                        assert!(c.as_any().downcast_ref::<Communicator<anyccl_host::HostComm>>().is_some());
                        c.barrier(&st)?;
                        Ok((got, max, sel.algorithm))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for r in out {
            let (sum, _, algo) = r.expect("rank ran");
            assert_eq!(&sum[..32], &f32s(&[6.0; 8])[..], "1 + 2 + 3 in the first 8 elements");
            assert_eq!(&sum[32..], &[0u8; 32][..], "the rest untouched");
            assert!(matches!(algo, Algorithm::OneShot | Algorithm::TwoShot | Algorithm::Ring));
        }
    }

    /// The fused all-reduce + RMSNorm through the erased face on host ranks: each form bit-exact against a
    /// reference made here (rank-order sum, then core's row arithmetic), the new residual written back, a bad call
    /// refused with the culprit named.
    #[test]
    fn host_ranks_through_the_erased_face_run_the_fused_all_reduce_rmsnorm() {
        use anyccl_core::fused::{from_f32, norm_row, to_f32};
        let (world, tokens, hidden, dtype) = (2usize, 3usize, 1024usize, DataType::Bf16);
        let n = tokens * hidden;
        let val = |seed: usize, i: usize| from_f32(dtype, ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0);
        let inputs: Vec<Vec<u16>> = (0..world).map(|r| (0..n).map(|i| val(r + 1, i)).collect()).collect();
        let residual: Vec<u16> = (0..n).map(|i| val(9, i)).collect();
        let weight: Vec<u16> = (0..hidden).map(|i| val(11, i)).collect();
        let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|b| b.to_ne_bytes()).collect() };
        let spec = RmsNormSpec::new(dtype, tokens, hidden, 1e-6);
        let call = spec.call().expect("valid");
        let (mut want_res, mut want_out, mut scratch) = (residual.clone(), vec![0u8; n * 2], vec![0f32; hidden]);
        for t in 0..tokens {
            let row = t * hidden..(t + 1) * hidden;
            let red: Vec<u16> = row
                .clone()
                .map(|i| from_f32(dtype, to_f32(dtype, inputs[0][i]) + to_f32(dtype, inputs[1][i])))
                .collect();
            norm_row(
                &call,
                &red,
                &mut want_res[row.clone()],
                &weight,
                &mut want_out[row.start * 2..row.end * 2],
                &mut scratch,
            );
        }
        let chosen = communicators(BackendChoice::Host, world, Arc::new(Selector::defaults())).expect("host ranks");
        // Per rank, per run: the selection, the output and the new residual.
        type Run = (RmsNormSelection, Vec<u8>, Vec<u8>);
        let got: Vec<Vec<Run>> = std::thread::scope(|s| {
            let hs: Vec<_> = chosen
                .comms
                .into_iter()
                .map(|mut c| {
                    let (inputs, residual, weight) = (&inputs, &residual, &weight);
                    s.spawn(move || {
                        let st = c.stream().expect("stream");
                        let mut input = c.alloc(n * 2).expect("alloc");
                        c.upload(&mut input, &bytes(&inputs[c.rank()]), &st).expect("upload");
                        let mut w = c.alloc(hidden * 2).expect("alloc");
                        c.upload(&mut w, &bytes(weight), &st).expect("upload");
                        let mut runs = Vec::new();
                        for form in [
                            None,
                            Some(RmsNormForm::FusedOneShot),
                            Some(RmsNormForm::FusedTwoShot),
                            Some(RmsNormForm::Unfused),
                        ] {
                            let mut res = c.alloc(n * 2).expect("alloc");
                            c.upload(&mut res, &bytes(residual), &st).expect("upload");
                            let mut out = c.alloc(n * 2).expect("alloc");
                            let spec = match form {
                                Some(f) => spec.with_form(f),
                                None => spec,
                            };
                            let sel = c.all_reduce_rmsnorm(&input, &mut res, &w, &mut out, &spec, &st).expect("fused");
                            let (mut o, mut r) = (vec![0u8; n * 2], vec![0u8; n * 2]);
                            c.download(&out, &mut o, &st).expect("download");
                            c.download(&res, &mut r, &st).expect("download");
                            runs.push((sel, o, r));
                        }
                        // A short output: refused before any exchange, naming `out`.
                        let mut short = c.alloc(n * 2 - 2).expect("alloc");
                        let mut res = c.alloc(n * 2).expect("alloc");
                        let e = c.all_reduce_rmsnorm(&input, &mut res, &w, &mut short, &spec, &st).expect_err("short");
                        assert!(
                            matches!(&e, Error::InvalidArgument(InvalidArgument::BufferTooSmall { which: "out", .. })),
                            "{e}"
                        );
                        let sel = c.select_rmsnorm(&call, None).expect("selection");
                        assert_eq!(sel, runs[0].0, "the dry-run selection is the call's");
                        runs
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for (rank, runs) in got.iter().enumerate() {
            assert_eq!(runs[0].0.form, RmsNormForm::FusedOneShot, "6 KiB: the default rule's one-shot");
            for (i, (sel, out, res)) in runs.iter().enumerate() {
                assert!(out == &want_out, "rank {rank} run {i} ({}): output differs from the reference", sel.form);
                assert!(res == &bytes(&want_res), "rank {rank} run {i}: new residual differs");
            }
            assert_eq!(runs[3].0.form, RmsNormForm::Unfused);
        }
    }

    /// One rank's outcome of the group-and-split test: what it received, and its sub-communicator's rank, world and
    /// sum (`None`: it joined none).
    type GroupSplitOutcome = (Vec<u8>, Option<(usize, usize, Vec<u8>)>);

    /// Through the erased face: a grouped ring at world 4 (receive listed first on odd ranks), then a split into
    /// even and odd ranks whose all-reduces sum only their members, with rank 3 joining none.
    #[test]
    fn host_ranks_through_the_erased_face_exchange_in_a_group_and_split() {
        let chosen = communicators(BackendChoice::Host, 4, Arc::new(Selector::defaults())).expect("host ranks");
        let out: Vec<Result<GroupSplitOutcome>> = std::thread::scope(|s| {
            let hs: Vec<_> = chosen
                .comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || -> Result<GroupSplitOutcome> {
                        let (rank, world) = (c.rank(), c.world_size());
                        let st = c.stream()?;
                        let mut send = c.alloc(16)?;
                        c.upload(&mut send, &f32s(&[rank as f32; 4]), &st)?;
                        let mut recv = c.alloc(16)?;
                        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                        let mut ops = if rank % 2 == 1 {
                            vec![
                                P2pOp::recv(&mut recv, 4, DataType::F32, prev),
                                P2pOp::send(&send, 4, DataType::F32, next),
                            ]
                        } else {
                            vec![
                                P2pOp::send(&send, 4, DataType::F32, next),
                                P2pOp::recv(&mut recv, 4, DataType::F32, prev),
                            ]
                        };
                        c.p2p(&mut ops, &st)?;
                        drop(ops);
                        let mut got = vec![0u8; 16];
                        c.download(&recv, &mut got, &st)?;
                        let color = (rank != 3).then_some((rank % 2) as u32);
                        let sub = c.split(color, 0)?;
                        let sub = match sub {
                            None => None,
                            Some(mut sub) => {
                                let sst = sub.stream()?;
                                let mut b = sub.alloc(16)?;
                                sub.upload(&mut b, &f32s(&[rank as f32 + 1.0; 4]), &sst)?;
                                sub.all_reduce(InOut::InPlace(&mut b), 4, DataType::F32, ReduceOp::Sum, &sst)?;
                                let mut summed = vec![0u8; 16];
                                sub.download(&b, &mut summed, &sst)?;
                                Some((sub.rank(), sub.world_size(), summed))
                            }
                        };
                        Ok((got, sub))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (got, sub) = r.expect("rank");
            assert_eq!(got, f32s(&[((rank + 3) % 4) as f32; 4]), "rank {rank} received from its predecessor");
            match rank {
                // Evens: ranks 0 and 2 (values 1 and 3); odds: rank 1 alone (rank 3 joined none).
                0 | 2 => assert_eq!(sub, Some((rank / 2, 2, f32s(&[4.0; 4]))), "rank {rank}"),
                1 => assert_eq!(sub, Some((0, 1, f32s(&[2.0; 4]))), "rank {rank}"),
                _ => assert_eq!(sub, None, "rank {rank} joined no sub-communicator"),
            }
        }
    }

    #[test]
    fn a_buffer_too_small_is_refused_by_the_typed_front_end_behind_it() {
        let mut chosen = communicators(BackendChoice::Host, 1, Arc::new(Selector::defaults())).expect("one rank");
        let c = &mut chosen.comms[0];
        let st = c.stream().expect("stream");
        let mut small = c.alloc(8).expect("alloc");
        let e = c.all_reduce(InOut::InPlace(&mut small), 4, DataType::F32, ReduceOp::Sum, &st).expect_err("small");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BufferTooSmall { .. })), "{e:?}");
    }

    #[test]
    fn backends_that_cannot_run_are_passed_over_with_the_reason() {
        // Not compiled in (this test build has the host backend; a GPU backend may or may not be there).
        for kind in [BackendKind::Cuda, BackendKind::Rocm] {
            if !kind.compiled_in() {
                let why = unavailable(kind, 1, Capabilities::empty()).expect("not compiled in");
                assert!(why.contains("not compiled into this build"), "{why}");
                let e =
                    communicators(BackendChoice::from(kind), 1, Arc::new(Selector::defaults())).expect_err("refused");
                assert!(e.to_string().contains("not compiled into this build"), "{e}");
            }
        }
        let why = unavailable(BackendKind::Host, 2, Capabilities::HOST_BACKEND).expect("turned off");
        assert_eq!(why, "turned off by ANYCCL_DISABLE (host-backend)");
        assert_eq!(unavailable(BackendKind::Host, 2, Capabilities::empty()), None);
        assert!(communicators(BackendChoice::Best, 0, Arc::new(Selector::defaults())).is_err());
        assert_eq!("rocm".parse::<BackendChoice>(), Ok(BackendChoice::Rocm));
        assert_eq!(" Best ".parse::<BackendChoice>(), Ok(BackendChoice::Best));
        assert!(matches!("metal".parse::<BackendChoice>(), Err(Error::Parse { what: "backend", .. })));
    }

    #[test]
    fn best_falls_back_to_the_host_and_says_why_the_gpus_were_not_used() {
        let chosen = communicators(BackendChoice::Best, 2, Arc::new(Selector::defaults())).expect("some backend");
        // On a machine without GPUs (CI) the host runs and both GPU backends say why they did not.
        if chosen.backend == BackendKind::Host {
            let names: Vec<BackendKind> = chosen.passed_over.iter().map(|p| p.backend).collect();
            assert_eq!(names, [BackendKind::Cuda, BackendKind::Rocm]);
            assert!(chosen.passed_over.iter().all(|p| !p.why.is_empty()));
        }
        assert_eq!(chosen.comms.len(), 2);
    }
}
