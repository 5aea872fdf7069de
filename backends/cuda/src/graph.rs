//! CUDA graphs and events, for capture-and-replay and for timing (the benchmark's method).

use std::sync::Arc;

use anyccl_core::{CaptureMode, Result};
use cudarc::driver::{result, sys};

use crate::driver::cu_err;
use crate::runtime::{CudaStream, DeviceContext};

/// A captured and instantiated CUDA graph.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<DeviceContext>,
}

// SAFETY: graph handles may be launched and destroyed from any thread.
unsafe impl Send for Graph {}

impl Graph {
    /// Captures what `body` enqueues on `stream` and instantiates it. If `body` fails, the capture is ended and
    /// discarded and the error returned.
    ///
    /// Thread-local capture mode: other threads of the process (other ranks driving other GPUs) may keep making
    /// calls that global mode forbids while one thread captures. In global mode a second rank's thread invalidated
    /// the capture at world 2 on an H200 pair. [`Graph::capture_with`] chooses the mode.
    pub fn capture(
        ctx: &Arc<DeviceContext>,
        stream: &CudaStream,
        body: impl FnOnce(&CudaStream) -> Result<()>,
    ) -> Result<Self> {
        Self::capture_with(ctx, stream, CaptureMode::ThreadLocal, body)
    }

    /// [`Graph::capture`] in capture mode `mode`: [`CaptureMode::Global`] as engines such as PyTorch capture
    /// (then no other thread of the process may allocate or synchronize while `body` runs, or the capture is
    /// invalidated and this returns the driver's error), or [`CaptureMode::Relaxed`].
    pub fn capture_with(
        ctx: &Arc<DeviceContext>,
        stream: &CudaStream,
        mode: CaptureMode,
        body: impl FnOnce(&CudaStream) -> Result<()>,
    ) -> Result<Self> {
        ctx.bind()?;
        // The mode and this thread go on record before the capture begins, so that another thread's check never
        // sees this stream capturing without them (it would count the capture as global and refuse a call the
        // driver allows); calls elsewhere are then refused exactly where the driver would refuse them
        // (anyccl_core::capture). A failed begin drops the record at once.
        let began = crate::runtime::known_streams().began_capture(stream.key(), mode);
        // SAFETY: live stream, not already capturing (the driver reports an error otherwise).
        unsafe { result::stream::begin_capture(stream.raw(), cu_capture_mode(mode)) }
            .map_err(|e| cu_err("cuStreamBeginCapture", e))?;
        let r = body(stream);
        // SAFETY: ends the capture begun above, whatever `body` did.
        let graph = unsafe { result::stream::end_capture(stream.raw()) };
        drop(began);
        r?;
        let graph = graph.map_err(|e| cu_err("cuStreamEndCapture", e))?;
        // SAFETY: a graph just captured.
        let exec = match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: destroy the graph we own.
                let _ = unsafe { result::graph::destroy(graph) };
                return Err(cu_err("cuGraphInstantiate", e));
            }
        };
        Ok(Graph { graph, exec, ctx: ctx.clone() })
    }

    /// Launches the graph on `stream`.
    pub fn launch(&self, stream: &CudaStream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: instantiated graph, live stream.
        unsafe { result::graph::launch(self.exec, stream.raw()) }.map_err(|e| cu_err("cuGraphLaunch", e))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: created in `capture`, destroyed once.
        unsafe {
            if let Err(e) = result::graph::exec_destroy(self.exec) {
                tracing::warn!(error = %cu_err("cuGraphExecDestroy", e), "destroying a graph failed");
            }
            if let Err(e) = result::graph::destroy(self.graph) {
                tracing::warn!(error = %cu_err("cuGraphDestroy", e), "destroying a graph failed");
            }
        }
    }
}

/// The driver's value of `mode`.
pub(crate) fn cu_capture_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

/// A CUDA event with timing enabled.
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<DeviceContext>,
}

// SAFETY: events may be recorded and queried from any thread.
unsafe impl Send for Event {}

impl Event {
    /// A new timing event.
    pub fn new(ctx: &Arc<DeviceContext>) -> Result<Self> {
        ctx.bind()?;
        let raw =
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cu_err("cuEventCreate", e))?;
        Ok(Event { raw, ctx: ctx.clone() })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.raw, stream.raw()) }.map_err(|e| cu_err("cuEventRecord", e))
    }

    /// Makes `stream` wait until this event (as last recorded) completes.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { result::stream::wait_event(stream.raw(), self.raw, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| cu_err("cuStreamWaitEvent", e))
    }

    /// Milliseconds from `self` to `end` (both recorded and completed).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        // SAFETY: both events live and recorded.
        unsafe { result::event::elapsed(self.raw, end.raw) }.map_err(|e| cu_err("cuEventElapsedTime", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: created in `new`, destroyed once.
        if let Err(e) = unsafe { result::event::destroy(self.raw) } {
            tracing::warn!(error = %cu_err("cuEventDestroy", e), "destroying an event failed");
        }
    }
}
