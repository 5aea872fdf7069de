//! `anyccl bench`: all-reduce latency per message size and algorithm, the selector's choice, and the best.
//!
//! Method (host backend): one thread per rank; for each size and algorithm, `warmup` untimed calls, then `iters`
//! timed ones. Each timed call starts after a barrier and ends when every rank has finished (a second barrier), as
//! measured on rank 0; the median is reported. `algbw = bytes / time`; `busbw = algbw × 2(n−1)/n` (nccl-tests).

use std::sync::Arc;

use serde::Serialize;

use anyccl::core::units::format_bytes;
use anyccl::core::{Algorithm, DataType, Error, ReduceOp, Result, Selector};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Number of ranks.
    pub world: usize,
    /// Element type.
    pub dtype: DataType,
    /// Operator.
    pub op: ReduceOp,
    /// Message sizes in bytes.
    pub sizes: Vec<u64>,
    /// Algorithms to measure (`None`: every one the backend implements).
    pub algorithms: Option<Vec<Algorithm>>,
    /// Timed calls per cell.
    pub iters: usize,
    /// Untimed calls before them.
    pub warmup: usize,
    /// The selector `auto` uses.
    pub selector: Arc<Selector>,
}

/// The most message sizes one sweep takes (`--sizes`).
pub const MAX_SIZES: usize = 64;
/// The most timed calls per cell (`--iters`).
pub const MAX_ITERS: u32 = 10_000;
/// The most untimed warm-up calls per cell (`--warmup`).
pub const MAX_WARMUP: u32 = 10_000;
/// The host backend's largest message (`--sizes`): 1 GiB.
pub const HOST_MAX_MESSAGE_BYTES: u64 = 1 << 30;
/// The host backend's largest world × message: 2 GiB. Each rank thread holds about four copies of its message
/// (input, buffer, two staging halves), so this bounds a host sweep to about 8 GiB of memory.
pub const HOST_MAX_WORLD_BYTES: u64 = 2 << 30;
/// A GPU backend's largest message: 64 GiB (each rank also keeps a host copy of its input).
pub const GPU_MAX_MESSAGE_BYTES: u64 = 64 << 30;

/// The limits a backend puts on a sweep (see [`BenchConfig::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest message in bytes.
    pub max_message: u64,
    /// Largest world × message in bytes, where memory grows with both.
    pub max_world_bytes: Option<u64>,
}

impl Limits {
    /// The host backend's: [`HOST_MAX_MESSAGE_BYTES`], [`HOST_MAX_WORLD_BYTES`].
    pub const HOST: Limits =
        Limits { max_message: HOST_MAX_MESSAGE_BYTES, max_world_bytes: Some(HOST_MAX_WORLD_BYTES) };
    /// A GPU backend's: [`GPU_MAX_MESSAGE_BYTES`] (device memory is checked by the allocator).
    pub const GPU: Limits = Limits { max_message: GPU_MAX_MESSAGE_BYTES, max_world_bytes: None };
}

/// An error about one flag's value (the flag is the error's source).
fn flag_error(flag: &str, message: String) -> Error {
    Error::Config { source_name: flag.to_owned(), line: None, message }
}

impl BenchConfig {
    /// Checks every number a user gave against `limits`, before anything is allocated: the number of sizes, each
    /// size (positive, a multiple of the element size, at most `max_message`, and world × size at most
    /// `max_world_bytes`), the world size and the call counts. Errors name the flag (`--sizes`, `--iters`, …).
    pub fn check(&self, limits: Limits) -> Result<()> {
        if self.world == 0 {
            return Err(flag_error("--world", "a communicator needs at least one rank".into()));
        }
        if self.sizes.is_empty() || self.sizes.len() > MAX_SIZES {
            return Err(flag_error(
                "--sizes",
                format!("{} sizes given; a sweep takes 1 to {MAX_SIZES}", self.sizes.len()),
            ));
        }
        let esz = self.dtype.size_bytes() as u64;
        for &b in &self.sizes {
            if b == 0 || b % esz != 0 {
                return Err(flag_error(
                    "--sizes",
                    format!(
                        "{} is not a positive multiple of the {} element size ({esz} B)",
                        format_bytes(b),
                        self.dtype
                    ),
                ));
            }
            if b > limits.max_message {
                return Err(flag_error(
                    "--sizes",
                    format!(
                        "{} is above this backend's largest message, {}",
                        format_bytes(b),
                        format_bytes(limits.max_message)
                    ),
                ));
            }
            if let Some(cap) = limits.max_world_bytes {
                let total = (self.world as u64).checked_mul(b);
                if total.is_none_or(|t| t > cap) {
                    return Err(flag_error(
                        "--sizes",
                        format!(
                            "{} on each of {} ranks is above this backend's limit of {} for world × message \
                             (about four copies per rank live in host memory)",
                            format_bytes(b),
                            self.world,
                            format_bytes(cap)
                        ),
                    ));
                }
            }
        }
        if self.iters == 0 || self.iters > MAX_ITERS as usize {
            return Err(flag_error("--iters", format!("{} timed calls; 1 to {MAX_ITERS} are allowed", self.iters)));
        }
        if self.warmup > MAX_WARMUP as usize {
            return Err(flag_error(
                "--warmup",
                format!("{} warm-up calls; 0 to {MAX_WARMUP} are allowed", self.warmup),
            ));
        }
        Ok(())
    }
}

/// The default host sweep: 4 KiB to 16 MiB in steps of 4×.
pub fn default_host_sizes() -> Vec<u64> {
    (0..7).map(|i| 4096u64 << (2 * i)).collect()
}

/// The default GPU sweep: bf16 tensors of shape (N, 8192) as engines report them, N = 32 … 4096.
pub fn default_gpu_sizes() -> Vec<u64> {
    [32u64, 64, 96, 128, 192, 256, 512, 1024, 2048, 3062, 4096].iter().map(|n| n * 8192 * 2).collect()
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Median latency in microseconds.
    pub median_us: f64,
    /// Fastest call in microseconds.
    pub min_us: f64,
    /// Algorithm bandwidth, GB/s (10⁹ bytes per second).
    pub algbw_gbps: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbps: f64,
}

/// One message size.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Message size in bytes.
    pub bytes: u64,
    /// Elements per rank.
    pub count: usize,
    /// One cell per measured algorithm, in column order.
    pub cells: Vec<Cell>,
    /// The selector's choice, measured through the normal (auto) path.
    pub auto: Cell,
    /// Why the selector chose it.
    pub auto_rule: String,
    /// The fastest measured algorithm.
    pub best: Algorithm,
    /// Baseline median over the best's median.
    pub best_speedup_vs_baseline: Option<f64>,
    /// GPU eager mode: median host time of one all-reduce call through anyccl, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_us_per_call: Option<f64>,
    /// GPU eager mode: median host time of one raw `ncclAllReduce` call on the same buffers, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_ccl_host_us_per_call: Option<f64>,
}

/// An algorithm that was asked for but cannot run here.
#[derive(Debug, Clone, Serialize)]
pub struct Ineligible {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Why.
    pub reason: String,
}

/// A whole sweep.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Backend name.
    pub backend: String,
    /// Number of ranks.
    pub world: usize,
    /// Element type.
    pub dtype: DataType,
    /// Operator.
    pub op: ReduceOp,
    /// Timed calls per cell.
    pub iters: usize,
    /// Untimed calls per cell.
    pub warmup: usize,
    /// The vendor-library baseline the speedup is measured against (`ring` on the host).
    pub baseline: Algorithm,
    /// Measured algorithms, in column order.
    pub algorithms: Vec<Algorithm>,
    /// Algorithms asked for that cannot run.
    pub ineligible: Vec<Ineligible>,
    /// One row per size.
    pub rows: Vec<Row>,
    /// How it was measured.
    pub method: String,
}

/// Median of samples (sorts them); NaN when there are none.
#[cfg(any(feature = "host", feature = "cuda"))]
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A cell from latency samples in µs.
#[cfg(any(feature = "host", feature = "cuda"))]
pub(crate) fn cell(algorithm: Algorithm, samples: &mut [f64], bytes: u64, world: usize) -> Cell {
    let med = median(samples);
    let min = samples.first().copied().unwrap_or(f64::NAN);
    let algbw = bytes as f64 / (med * 1e-6) / 1e9;
    let factor = if world > 1 { 2.0 * (world - 1) as f64 / world as f64 } else { 0.0 };
    Cell { algorithm, median_us: med, min_us: min, algbw_gbps: algbw, busbw_gbps: algbw * factor }
}

/// One row from the samples of every measured algorithm (in `algorithms` order) and of `auto`: the cells, the best
/// (finite) one, and its speedup over `baseline` where measured.
#[cfg(any(feature = "host", feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn make_row(
    cfg: &BenchConfig,
    bytes: u64,
    algorithms: &[Algorithm],
    per_algo: Vec<Vec<f64>>,
    (mut auto_samples, auto_algo, auto_rule): (Vec<f64>, Algorithm, String),
    baseline: Algorithm,
    host: Option<(f64, f64)>,
) -> Row {
    let cells: Vec<Cell> =
        algorithms.iter().zip(per_algo).map(|(&a, mut s)| cell(a, &mut s, bytes, cfg.world)).collect();
    let auto = cell(auto_algo, &mut auto_samples, bytes, cfg.world);
    let best = cells
        .iter()
        .filter(|c| c.median_us.is_finite())
        .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
        .map(|c| (c.algorithm, c.median_us))
        .unwrap_or((auto.algorithm, auto.median_us));
    let base = cells.iter().find(|c| c.algorithm == baseline).map(|c| c.median_us);
    Row {
        bytes,
        count: (bytes / cfg.dtype.size_bytes() as u64) as usize,
        cells,
        auto,
        auto_rule,
        best: best.0,
        best_speedup_vs_baseline: base.map(|b| b / best.1),
        host_us_per_call: host.map(|h| h.0),
        raw_ccl_host_us_per_call: host.map(|h| h.1),
    }
}

/// Runs `rank` on one thread per communicator; the first error wins, otherwise rank 0's result is returned.
#[cfg(any(feature = "host", feature = "cuda"))]
pub(crate) fn on_ranks<C: Send, T: Send>(
    comms: Vec<C>,
    rank: impl Fn(C) -> anyccl::core::Result<T> + Sync,
) -> anyccl::core::Result<T> {
    let results: Vec<anyccl::core::Result<T>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| rank(c))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::PeerFailure("a benchmark rank thread panicked".into()))))
            .collect()
    });
    // The root cause wins: a rank that failed on its own (out of memory, a bad argument) rather than a peer that
    // only saw it leave.
    let mut first = None;
    let mut peer_failure = None;
    for r in results {
        match r {
            Ok(v) => {
                first.get_or_insert(v);
            }
            Err(e @ Error::PeerFailure(_)) => {
                peer_failure.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(e) = peer_failure {
        return Err(e);
    }
    first.ok_or_else(|| Error::PeerFailure("no rank 0 results".into()))
}

/// Progress reporting hook: called with (cells done, cells total).
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);

/// Runs the sweep on the host backend.
#[cfg(feature = "host")]
pub fn run_host(cfg: &BenchConfig, progress: Progress<'_>) -> Result<BenchReport> {
    use std::time::Instant;

    use anyccl::core::{Communicator, InOut};
    use anyccl::host::{communicators, HostBuffer, HostComm, HostOptions, ALGORITHMS};

    cfg.check(Limits::HOST)?;
    let esz = cfg.dtype.size_bytes() as u64;
    let requested = cfg.algorithms.clone().unwrap_or_else(|| ALGORITHMS.to_vec());
    let (algorithms, ineligible): (Vec<_>, Vec<_>) = requested.into_iter().partition(|a| ALGORITHMS.contains(a));
    let ineligible: Vec<Ineligible> = ineligible
        .into_iter()
        .map(|a| Ineligible { algorithm: a, reason: "not implemented by the host backend".into() })
        .collect();

    let comms = communicators(cfg.world, HostOptions { selector: cfg.selector.clone(), ..HostOptions::default() })?;
    let total = (cfg.sizes.len() * (algorithms.len() + 1)) as u64;

    type RankOut = Result<Vec<(Vec<Vec<f64>>, Vec<f64>, (Algorithm, String))>>;
    let run_rank = |mut c: Communicator<HostComm>| -> RankOut {
        let rank = c.rank();
        let mut out = Vec::new();
        let mut done = 0u64;
        for &bytes in &cfg.sizes {
            // Checked against HOST_MAX_MESSAGE_BYTES above, so it fits a usize; the buffers are reserved fallibly.
            let len = usize::try_from(bytes)
                .map_err(|_| flag_error("--sizes", format!("{} does not fit this machine", format_bytes(bytes))))?;
            let count = len / esz as usize;
            // Non-trivial inputs (zeros can hide wrong indexing and run faster than real data).
            let mut seed: Vec<u8> = Vec::new();
            seed.try_reserve_exact(len)
                .map_err(|_| Error::OutOfMemory { what: "the bench's input copy".into(), bytes })?;
            seed.extend((0..len).map(|i| ((i * 7 + rank * 13) % 61) as u8 & 0x3f));
            let mut buf = HostBuffer::try_zeroed(len)?;
            let mut per_algo = Vec::new();
            let mut time =
                |c: &mut Communicator<HostComm>, algo: Option<Algorithm>| -> Result<(Vec<f64>, (Algorithm, String))> {
                    let mut samples = Vec::new();
                    samples.try_reserve_exact(cfg.iters).map_err(|_| Error::OutOfMemory {
                        what: "the timing samples".into(),
                        bytes: (cfg.iters as u64).saturating_mul(8),
                    })?;
                    let mut why = (Algorithm::Ring, String::new());
                    for i in 0..cfg.warmup + cfg.iters {
                        buf.as_bytes_mut().copy_from_slice(&seed);
                        c.barrier(&())?;
                        let t0 = Instant::now();
                        let bufs = InOut::InPlace(buf.as_bytes_mut());
                        match algo {
                            Some(a) => c.all_reduce_with(a, bufs, count, cfg.dtype, cfg.op, &())?,
                            None => {
                                let sel = c.all_reduce(bufs, count, cfg.dtype, cfg.op, &())?;
                                why = (sel.algorithm, sel.why.to_string());
                            }
                        }
                        c.barrier(&())?;
                        if i >= cfg.warmup {
                            samples.push(t0.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                    Ok((samples, why))
                };
            for &a in &algorithms {
                per_algo.push(time(&mut c, Some(a))?.0);
                done += 1;
                if rank == 0 {
                    progress(done, total);
                }
            }
            let (auto, why) = time(&mut c, None)?;
            done += 1;
            if rank == 0 {
                progress(done, total);
            }
            out.push((per_algo, auto, why));
        }
        Ok(out)
    };

    let rank0 = on_ranks(comms, run_rank)?;
    let baseline = Algorithm::Ring;
    let rows = cfg
        .sizes
        .iter()
        .zip(rank0)
        .map(|(&bytes, (per_algo, auto, chosen))| {
            make_row(cfg, bytes, &algorithms, per_algo, (auto, chosen.0, chosen.1), baseline, None)
        })
        .collect();
    Ok(BenchReport {
        backend: "host".into(),
        world: cfg.world,
        dtype: cfg.dtype,
        op: cfg.op,
        iters: cfg.iters,
        warmup: cfg.warmup,
        baseline,
        algorithms,
        ineligible,
        rows,
        method: "host threads; per call: barrier, all-reduce, barrier, timed on rank 0; median of the timed calls"
            .into(),
    })
}

fn fmt_us(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else if us >= 100.0 {
        format!("{us:.0} us")
    } else {
        format!("{us:.1} us")
    }
}

/// The human-readable table.
pub fn render_table(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "anyccl bench: all-reduce, backend {}, world {}, {} {}, median of {} calls after {} warm-up",
        r.backend, r.world, r.dtype, r.op, r.iters, r.warmup
    );
    // busbw is 0 at world 1 (nothing crosses a link); show algbw there.
    let bw = if r.world > 1 { "bus bandwidth" } else { "algorithm bandwidth (world 1: busbw is 0)" };
    let _ = writeln!(s, "cells: median latency / {bw} in GB/s; best: fastest, with its speedup over {}", r.baseline);
    let w = 22;
    let _ = write!(s, "\n{:>10} {:>9}", "size", "count");
    for a in &r.algorithms {
        let _ = write!(s, " {:>w$}", a.name());
    }
    let host = r.rows.iter().any(|row| row.host_us_per_call.is_some());
    if host {
        let _ = write!(s, " {:>20}", "host us/call (raw)");
    }
    let _ = writeln!(s, " {:>w$}  best", "auto");
    for row in &r.rows {
        let _ = write!(s, "{:>10} {:>9}", format_bytes(row.bytes), row.count);
        for c in &row.cells {
            let bw = if r.world > 1 { c.busbw_gbps } else { c.algbw_gbps };
            if c.median_us.is_nan() {
                let _ = write!(s, " {:>w$}", "- (size not eligible)");
            } else {
                let _ = write!(s, " {:>w$}", format!("{} / {bw:.2}", fmt_us(c.median_us)));
            }
        }
        if host {
            let h = match (row.host_us_per_call, row.raw_ccl_host_us_per_call) {
                (Some(a), Some(b)) => format!("{a:.2} ({b:.2})"),
                _ => "-".into(),
            };
            let _ = write!(s, " {h:>20}");
        }
        let _ = write!(s, " {:>w$}", format!("{} {}", row.auto.algorithm, fmt_us(row.auto.median_us)));
        match row.best_speedup_vs_baseline {
            Some(x) => {
                let _ = writeln!(s, "  {} ({x:.2}x)", row.best);
            }
            None => {
                let _ = writeln!(s, "  {}", row.best);
            }
        }
    }
    for (i, ie) in r.ineligible.iter().enumerate() {
        let _ = writeln!(s, "\n[{}] {} not measured: {}", i + 1, ie.algorithm, ie.reason);
    }
    let _ = writeln!(s, "\nmethod: {}", r.method);
    s
}

/// CSV: one line per (size, algorithm), `auto` included.
pub fn render_csv(r: &BenchReport) -> String {
    let mut s = String::from(
        "backend,world,dtype,op,bytes,count,algorithm,median_us,min_us,algbw_gbps,busbw_gbps,is_auto,is_best\n",
    );
    for row in &r.rows {
        let line = |c: &Cell, auto: bool| {
            format!(
                "{},{},{},{},{},{},{},{:.3},{:.3},{:.4},{:.4},{},{}\n",
                r.backend,
                r.world,
                r.dtype,
                r.op,
                row.bytes,
                row.count,
                c.algorithm,
                c.median_us,
                c.min_us,
                c.algbw_gbps,
                c.busbw_gbps,
                auto,
                !auto && c.algorithm == row.best
            )
        };
        for c in &row.cells {
            s.push_str(&line(c, false));
        }
        s.push_str(&line(&row.auto, true));
    }
    s
}

/// A quick, small default for the host tests.
#[cfg(all(test, feature = "host"))]
pub fn smoke_config(selector: Arc<Selector>) -> BenchConfig {
    BenchConfig {
        world: 2,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        sizes: vec![4096, 65536],
        algorithms: None,
        iters: 3,
        warmup: 1,
        selector,
    }
}

/// How long a sweep must run before a progress bar appears (host sweeps).
#[cfg(feature = "host")]
pub const PROGRESS_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;
    use anyccl::core::Error;

    #[test]
    fn host_sweep_measures_every_algorithm_and_auto() {
        let cfg = smoke_config(Arc::new(Selector::defaults()));
        let r = run_host(&cfg, &|_, _| {}).expect("bench runs");
        assert_eq!(r.rows.len(), 2);
        for row in &r.rows {
            assert_eq!(row.cells.len(), 3);
            for c in &row.cells {
                assert!(c.median_us > 0.0 && c.median_us.is_finite());
                assert!(c.busbw_gbps > 0.0);
            }
            assert!(row.cells.iter().any(|c| c.algorithm == row.best));
            assert!(row.best_speedup_vs_baseline.is_some_and(|x| x >= 1.0));
        }
        let table = render_table(&r);
        assert!(table.contains("one-shot") && table.contains("ring") && table.contains("auto"), "{table}");
        let csv = render_csv(&r);
        assert_eq!(csv.lines().count(), 1 + 2 * 4);
    }

    #[test]
    fn bad_sizes_and_unknown_algorithms_are_reported() {
        let mut cfg = smoke_config(Arc::new(Selector::defaults()));
        cfg.sizes = vec![6];
        assert!(matches!(run_host(&cfg, &|_, _| {}), Err(Error::Config { .. })));
        cfg.sizes = vec![4096];
        cfg.algorithms = Some(vec![Algorithm::OneShot, Algorithm::NvlsZeroCopy]);
        let r = run_host(&cfg, &|_, _| {}).expect("runs what it can");
        assert_eq!(r.algorithms, vec![Algorithm::OneShot]);
        assert_eq!(r.ineligible.len(), 1);
        assert!(render_table(&r).contains("nvls-zero-copy not measured"));
    }

    /// Every number a user gives is bounded before anything is allocated, and the error names the flag.
    #[test]
    fn limits_name_the_flag() {
        let base = smoke_config(Arc::new(Selector::defaults()));
        let flag_of = |cfg: &BenchConfig, limits: Limits| match cfg.check(limits) {
            Err(Error::Config { source_name, message, .. }) => Some((source_name, message)),
            Ok(()) => None,
            Err(e) => panic!("{e:?}"),
        };
        assert_eq!(flag_of(&base, Limits::HOST), None);
        type Change = Box<dyn Fn(&mut BenchConfig)>;
        let cases: Vec<(Change, &str, &str)> = vec![
            (Box::new(|c| c.sizes = vec![u64::MAX - 3]), "--sizes", "largest message"),
            (Box::new(|c| c.sizes = vec![100 << 30]), "--sizes", "1 GiB"),
            (Box::new(|c| c.sizes = vec![0]), "--sizes", "positive multiple"),
            (Box::new(|c| c.sizes = vec![]), "--sizes", "1 to 64"),
            (Box::new(|c| c.sizes = vec![4096; MAX_SIZES + 1]), "--sizes", "65 sizes"),
            (Box::new(|c| (c.world, c.sizes) = (8, vec![1 << 30])), "--sizes", "world × message"),
            (Box::new(|c| (c.world, c.sizes) = (usize::MAX, vec![1 << 30])), "--sizes", "world × message"),
            (Box::new(|c| c.world = 0), "--world", "at least one"),
            (Box::new(|c| c.iters = 0), "--iters", "1 to 10000"),
            (Box::new(|c| c.iters = u32::MAX as usize), "--iters", "1 to 10000"),
            (Box::new(|c| c.warmup = u32::MAX as usize), "--warmup", "0 to 10000"),
        ];
        for (change, flag, needle) in cases {
            let mut cfg = base.clone();
            change(&mut cfg);
            let (source, message) = flag_of(&cfg, Limits::HOST).expect("refused");
            assert_eq!(source, flag);
            assert!(message.contains(needle), "{flag}: {message}");
            // The library entry point refuses it too, without allocating.
            assert!(run_host(&cfg, &|_, _| {}).is_err());
        }
        let mut gpu = base.clone();
        gpu.sizes = vec![8 << 30];
        assert_eq!(flag_of(&gpu, Limits::GPU), None, "GPUs take messages the host bench refuses");
        assert!(flag_of(&gpu, Limits::HOST).is_some());
    }
}
