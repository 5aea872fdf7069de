//! N ranks emulated on one GPU: N buffer sets and N streams, for testing and measuring the custom kernels where
//! only one GPU is available. Peers' "mapped" buffers are simply the other sets' device pointers.

use std::sync::Arc;

use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_kernels_cuda::FLAG_BYTES;

use anyccl_cuda::custom::{input_table, CustomKernels, Inputs, Kind, INPUT_TABLE_BYTES};
use anyccl_cuda::graph::Graph;
use anyccl_cuda::runtime::{CudaRuntime, CudaStream, DeviceBuffer};

/// Where the emulated ranks' one-shot and two-shot kernels read the inputs (the [`Inputs`] the communicator
/// uses, all testable on one GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InputMode {
    /// The inputs themselves (registered buffers).
    Direct,
    /// Staging buffers (`stage_out`), which each rank's kernel first copies its input into.
    Staged,
    /// Per-rank input tables in device memory ([`EmulatedRanks::set_tables`] says what they hold).
    Table,
}

/// N emulated ranks of `bytes`-byte all-reduces on one device.
#[non_exhaustive]
pub struct EmulatedRanks {
    /// The device runtime.
    pub runtime: CudaRuntime,
    /// The kernels.
    pub kernels: CustomKernels,
    /// One stream per rank.
    pub streams: Vec<CudaStream>,
    /// Inputs, by rank.
    pub inputs: Vec<DeviceBuffer>,
    /// Outputs, by rank.
    pub outputs: Vec<DeviceBuffer>,
    /// Two-shot scratch, by rank.
    pub scratch: Vec<DeviceBuffer>,
    /// Flag arrays, by rank (zeroed at creation).
    pub flags: Vec<DeviceBuffer>,
    /// Output staging of the NVLS warp and block pipelines, by rank (their input staging is `scratch`).
    pub stage_out: Vec<DeviceBuffer>,
    /// Message size.
    pub bytes: usize,
    /// Blocks per rank.
    pub blocks: u32,
    /// Two-shot's round size in bytes (0: the whole message in one round).
    pub two_shot_round: usize,
    /// Where one-shot and two-shot read the inputs.
    pub input_mode: InputMode,
    /// Input tables, by rank ([`InputMode::Table`]); they start as staging tables (unregistered).
    pub tables: Vec<DeviceBuffer>,
}

impl EmulatedRanks {
    /// Allocates everything for `world` ranks on device `ordinal`; flag arrays zeroed.
    pub fn new(ordinal: i32, world: usize, bytes: usize, blocks: u32) -> Result<Self> {
        let runtime = CudaRuntime::new(ordinal)?;
        let kernels = CustomKernels::load(&runtime)?;
        let s0 = runtime.stream()?;
        let alloc = |n: usize| -> Result<Vec<DeviceBuffer>> { (0..world).map(|_| runtime.alloc(n)).collect() };
        let inputs = alloc(bytes)?;
        let outputs = alloc(bytes)?;
        let scratch = alloc(bytes)?;
        let stage_out = alloc(bytes)?;
        let mut flags = alloc(FLAG_BYTES)?;
        for f in &mut flags {
            runtime.upload(f, &vec![0u8; FLAG_BYTES], &s0)?;
        }
        let streams = (0..world).map(|_| runtime.stream()).collect::<Result<Vec<_>>>()?;
        let tables = alloc(INPUT_TABLE_BYTES)?;
        let mut g = EmulatedRanks {
            runtime,
            kernels,
            streams,
            inputs,
            outputs,
            scratch,
            flags,
            stage_out,
            bytes,
            blocks,
            two_shot_round: anyccl_cuda::custom::TWO_SHOT_ROUND_BYTES,
            input_mode: InputMode::Direct,
            tables,
        };
        g.set_tables(false)?;
        Ok(g)
    }

    /// Writes every rank's input table: the inputs themselves (`registered`), or the staging buffers. Not
    /// during capture; a graph captured in [`InputMode::Table`] reads the tables at every replay.
    pub fn set_tables(&mut self, registered: bool) -> Result<()> {
        let ptrs = if registered { Self::ptrs(&self.inputs) } else { Self::ptrs(&self.stage_out) };
        let t = input_table(&ptrs, registered);
        let s = &self.streams[0];
        for b in &mut self.tables {
            self.runtime.upload(b, &t, s)?;
        }
        Ok(())
    }

    fn ptrs(v: &[DeviceBuffer]) -> Vec<u64> {
        v.iter().map(DeviceBuffer::device_ptr).collect()
    }

    /// Launches every rank's kernel on its own stream (concurrently); does not wait.
    pub fn launch(&self, kind: Kind, dtype: DataType) -> Result<()> {
        self.streams.iter().enumerate().try_for_each(|(rank, s)| self.launch_rank(kind, dtype, rank, s))
    }

    /// Refuses a launch whose ranks' blocks could not all be resident at once: their barriers would wait forever.
    fn check_resident(&self, kind: Kind, dtype: DataType) -> Result<()> {
        let fit = self.kernels.resident_blocks(kind, dtype)?;
        let need = self.streams.len() * self.blocks as usize;
        if need > fit {
            return Err(anyccl_core::Error::backend(
                "cuda",
                "emulated ranks",
                None,
                format!(
                    "{} ranks × {} blocks of {kind:?} need {need} resident blocks, the device holds {fit}: the \
                     barriers would deadlock (use fewer blocks or ranks)",
                    self.streams.len(),
                    self.blocks
                ),
            ));
        }
        Ok(())
    }

    /// Launches rank `rank`'s kernel alone on `s`; does not wait. Its barriers wait for the other ranks' launches
    /// (what [`Self::launch`] does for every rank), or, when they never come, until
    /// [`anyccl_cuda::custom::stop_waiting`] is given the rank's flag array.
    pub fn launch_rank(&self, kind: Kind, dtype: DataType, rank: usize, s: &CudaStream) -> Result<()> {
        if rank == 0 {
            self.check_resident(kind, dtype)?;
        }
        let (ins, sc, fl) = (Self::ptrs(&self.inputs), Self::ptrs(&self.scratch), Self::ptrs(&self.flags));
        let out = self.outputs[rank].device_ptr();
        let staged = Self::ptrs(&self.stage_out);
        // SAFETY: every buffer was allocated in `new` with the sizes the kernels need (cuMemAlloc is 256-byte
        // aligned); the caller's `blocks` keeps all ranks' blocks co-resident.
        unsafe {
            match kind {
                Kind::OneShot | Kind::TwoShot => self.kernels.launch(
                    kind,
                    dtype,
                    match self.input_mode {
                        InputMode::Direct => Inputs::Direct(&ins),
                        InputMode::Staged => Inputs::Staged { staging: &staged, own: self.inputs[rank].device_ptr() },
                        InputMode::Table => {
                            Inputs::Table { table: self.tables[rank].device_ptr(), own: self.inputs[rank].device_ptr() }
                        }
                    },
                    &sc,
                    out,
                    &fl,
                    rank,
                    self.bytes,
                    self.blocks,
                    self.two_shot_round,
                    s,
                ),
                Kind::NvlsZeroCopyEmulated => {
                    let outs = Self::ptrs(&self.outputs);
                    self.kernels.launch_nvls_emulated(
                        kind,
                        dtype,
                        &ins,
                        &outs,
                        0,
                        0,
                        &fl,
                        rank,
                        self.bytes,
                        self.blocks,
                        s,
                    )
                }
                Kind::NvlsBlockPipelineEmulated | Kind::NvlsWarpPipelineEmulated => {
                    let so = Self::ptrs(&self.stage_out);
                    let input = self.inputs[rank].device_ptr();
                    self.kernels.launch_nvls_emulated(
                        kind,
                        dtype,
                        &sc,
                        &so,
                        input,
                        out,
                        &fl,
                        rank,
                        self.bytes,
                        self.blocks,
                        s,
                    )
                }
                other => Err(anyccl_core::Error::backend(
                    "cuda",
                    "emulated ranks",
                    None,
                    format!("{other:?} has no emulated launch"),
                )),
            }
        }
    }

    /// Waits for every rank's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.streams.iter().try_for_each(CudaStream::synchronize)
    }

    /// Captures each rank's launch (`calls` back-to-back) into one graph per rank.
    pub fn capture(&self, kind: Kind, dtype: DataType, calls: usize) -> Result<Vec<Graph>> {
        let ctx: &Arc<_> = self.runtime.context();
        self.streams
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                Graph::capture(ctx, s, |s| (0..calls).try_for_each(|_| self.launch_rank(kind, dtype, rank, s)))
            })
            .collect()
    }
}

/// Seconds per call of `graphs` (one per rank, each holding `calls` back-to-back calls, replayed on the rank's
/// stream in `streams`), the way the emulated-rank benches time every kernel: per round, every rank's graph starts
/// after an event on a timing stream, which then waits for every rank; `warmup` untimed rounds, then `rounds` timed
/// with device events; the median round divided by `calls`.
pub fn time_graphs(
    runtime: &CudaRuntime,
    streams: &[CudaStream],
    graphs: &[Graph],
    calls: usize,
    warmup: usize,
    rounds: usize,
) -> Result<f64> {
    use anyccl_cuda::graph::Event;
    let timer = runtime.stream()?;
    let ctx = runtime.context();
    let (start, end) = (Event::new(ctx)?, Event::new(ctx)?);
    let done: Vec<Event> = streams.iter().map(|_| Event::new(ctx)).collect::<Result<_>>()?;
    let mut times = Vec::with_capacity(rounds);
    for round in 0..warmup + rounds {
        start.record(&timer)?;
        for ((graph, stream), d) in graphs.iter().zip(streams).zip(&done) {
            start.wait_on(stream)?;
            graph.launch(stream)?;
            d.record(stream)?;
        }
        for d in &done {
            d.wait_on(&timer)?;
        }
        end.record(&timer)?;
        timer.synchronize()?;
        if round >= warmup {
            times.push(f64::from(start.elapsed_ms(&end)?) * 1e-3 / calls.max(1) as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times.get(times.len() / 2).copied().unwrap_or(f64::NAN))
}
