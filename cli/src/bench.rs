//! `anyccl bench`: all-reduce latency per message size, algorithm and placement (out of place, in place), the
//! selector's choice, the best, and a correctness check of every cell (`#wrong`), as nccl-tests reports them.
//!
//! Method (host backend): one thread per rank (or, with `--per-rank`, one process per rank started by torchrun or
//! srun); for each size, placement and algorithm, `warmup` untimed calls, then `iters` timed ones. Each timed call
//! starts after a barrier and ends when every rank has finished (a second barrier), measured on every rank. A cell
//! reports rank 0's median (threads) or the average of the ranks' medians (processes, as nccl-tests averages over
//! ranks), and the spread of the ranks' medians. `algbw = bytes / time`; `busbw = algbw × 2(n−1)/n` (nccl-tests).
//! After the timed calls, one more call per cell is checked against [`crate::check::Reference`].

use std::sync::Arc;

use serde::Serialize;

use anyccl::core::units::format_bytes;
use anyccl::core::{Algorithm, DataType, Error, ReduceOp, Result, Selector};

/// The version of the JSON and CSV formats: 2 added `schema`, in-place columns, `wrong`, the rank spread, the
/// library and the ranks (output without a `schema` field is version 1).
pub const SCHEMA: u32 = 2;

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
    /// The flag the sizes came from, for errors (`--sizes`, `-b/-e/-f`).
    pub sizes_flag: &'static str,
    /// Algorithms to measure (`None`: every one the backend implements).
    pub algorithms: Option<Vec<Algorithm>>,
    /// Quantized algorithms to measure besides (`--quantize`); their results are checked against the exact sum
    /// within the format's error bound instead of exactly.
    pub quantized: Vec<Algorithm>,
    /// Timed calls per cell.
    pub iters: usize,
    /// Untimed calls before them.
    pub warmup: usize,
    /// Whether to measure in place too (out of place is always measured).
    pub in_place: bool,
    /// The selector `auto` uses.
    pub selector: Arc<Selector>,
    /// Host: bind each rank to a processor of its own (`--bind`; see [`crate::bind::bind_rank`]).
    pub bind: bool,
}

/// The most message sizes one sweep takes (`--sizes`, `-b/-e/-f`).
pub const MAX_SIZES: usize = 64;
/// The most timed calls per cell (`--iters`).
pub const MAX_ITERS: u32 = 10_000;
/// The most untimed warm-up calls per cell (`--warmup`).
pub const MAX_WARMUP: u32 = 10_000;
/// The host backend's largest message (`--sizes`): 1 GiB.
pub const HOST_MAX_MESSAGE_BYTES: u64 = 1 << 30;
/// The host backend's largest world × message: 2 GiB. Each rank holds about five copies of its message (input,
/// output, in-place buffer, staging), so this bounds a host sweep to about 10 GiB of memory.
pub const HOST_MAX_WORLD_BYTES: u64 = 2 << 30;
/// A GPU backend's largest message: 64 GiB (each rank also keeps two host copies, its input and its download).
// The GPU items below serve the cuda and rocm backends only.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub const GPU_MAX_MESSAGE_BYTES: u64 = 64 << 30;
/// The largest `-f/--stepfactor`.
pub const MAX_STEP_FACTOR: u64 = 1024;

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
    #[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
    pub const GPU: Limits = Limits { max_message: GPU_MAX_MESSAGE_BYTES, max_world_bytes: None };
}

/// An error about one flag's value (the flag is the error's source).
pub(crate) fn flag_error(flag: &str, message: String) -> Error {
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
        if self.world > crate::check::MAX_WORLD {
            return Err(flag_error(
                "--world",
                format!("{} ranks; the bench checks results for at most {}", self.world, crate::check::MAX_WORLD),
            ));
        }
        let flag = self.sizes_flag;
        if self.sizes.is_empty() || self.sizes.len() > MAX_SIZES {
            return Err(flag_error(flag, format!("{} sizes given; a sweep takes 1 to {MAX_SIZES}", self.sizes.len())));
        }
        let esz = self.dtype.size_bytes() as u64;
        for &b in &self.sizes {
            if b == 0 || b % esz != 0 {
                return Err(flag_error(
                    flag,
                    format!(
                        "{} is not a positive multiple of the {} element size ({esz} B)",
                        format_bytes(b),
                        self.dtype
                    ),
                ));
            }
            if b > limits.max_message {
                return Err(flag_error(
                    flag,
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
                        flag,
                        format!(
                            "{} on each of {} ranks is above this backend's limit of {} for world × message \
                             (about five copies per rank live in host memory)",
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
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub fn default_gpu_sizes() -> Vec<u64> {
    [32u64, 64, 96, 128, 192, 256, 512, 1024, 2048, 3062, 4096].iter().map(|n| n * 8192 * 2).collect()
}

/// The flags of a geometric sweep, for errors.
pub const STEP_FLAGS: &str = "-b/-e/-f";

/// The sizes of nccl-tests' `-b MIN -e MAX -f FACTOR`: `min`, `min × factor`, … up to and including `max`.
/// Refuses `min` of 0 or above `max`, a factor outside `2..=`[`MAX_STEP_FACTOR`], and more than [`MAX_SIZES`]
/// sizes; the arithmetic is checked (a step past 2⁶⁴ ends the sweep).
pub fn geometric_sizes(min: u64, max: u64, factor: u64) -> Result<Vec<u64>> {
    if min == 0 {
        return Err(flag_error("-b/--minbytes", "the smallest size must be at least 1 byte".into()));
    }
    if min > max {
        return Err(flag_error(
            STEP_FLAGS,
            format!("-b/--minbytes ({}) is above -e/--maxbytes ({})", format_bytes(min), format_bytes(max)),
        ));
    }
    if !(2..=MAX_STEP_FACTOR).contains(&factor) {
        return Err(flag_error("-f/--stepfactor", format!("{factor}; a factor of 2 to {MAX_STEP_FACTOR} is allowed")));
    }
    let mut sizes = Vec::new();
    let mut s = Some(min);
    while let Some(b) = s.filter(|&b| b <= max) {
        if sizes.len() == MAX_SIZES {
            return Err(flag_error(
                STEP_FLAGS,
                format!(
                    "{} to {} in steps of {factor}× is more than {MAX_SIZES} sizes",
                    format_bytes(min),
                    format_bytes(max)
                ),
            ));
        }
        sizes.push(b);
        s = b.checked_mul(factor);
    }
    Ok(sizes)
}

/// The spread of the ranks' medians of one cell.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Spread {
    /// The fastest rank's median, µs.
    pub min_us: f64,
    /// The average of the ranks' medians, µs.
    pub avg_us: f64,
    /// The slowest rank's median, µs.
    pub max_us: f64,
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Latency in microseconds: rank 0's median (ranks as threads) or the average of the ranks' medians
    /// (`--per-rank`); NaN when the cell did not run.
    pub median_us: f64,
    /// Fastest call in microseconds (rank 0's; `--per-rank`: of any rank).
    pub min_us: f64,
    /// Algorithm bandwidth, GB/s (10⁹ bytes per second).
    pub algbw_gbps: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbps: f64,
    /// Elements that differed from the reference, summed over the ranks (`None`: the cell did not run).
    pub wrong: Option<u64>,
    /// The spread of the ranks' medians (more than one rank).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank_spread: Option<Spread>,
}

/// The cells of one placement (out of place or in place) at one size.
#[derive(Debug, Clone, Serialize)]
pub struct Placement {
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
}

/// One message size.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Message size in bytes.
    pub bytes: u64,
    /// Elements per rank.
    pub count: usize,
    /// Out of place (separate send and receive buffers); its fields sit in the row itself.
    #[serde(flatten)]
    pub out_of_place: Placement,
    /// In place (one buffer), where measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_place: Option<Placement>,
    /// Wrong elements over every cell of the row.
    pub wrong: u64,
    /// GPU eager mode: median host time of one all-reduce call through anyccl, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_us_per_call: Option<f64>,
    /// GPU eager mode: median host time of one raw `ncclAllReduce` call on the same buffers, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_ccl_host_us_per_call: Option<f64>,
}

impl Row {
    /// The placements measured, out of place first.
    pub fn placements(&self) -> impl Iterator<Item = (&'static str, &Placement)> {
        std::iter::once(("out", &self.out_of_place)).chain(self.in_place.as_ref().map(|p| ("in", p)))
    }
}

/// An algorithm that was asked for but cannot run here.
#[derive(Debug, Clone, Serialize)]
pub struct Ineligible {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Why.
    pub reason: String,
}

/// How the ranks were started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Launch {
    /// One process, one thread per rank.
    Threads,
    /// One process per rank (`--per-rank`, under torchrun or srun).
    Processes,
}

/// Where one rank ran.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank.
    pub rank: usize,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// The device (`GPU 0: NVIDIA H200 (sm_90)`, `host`).
    pub device: String,
}

/// A whole sweep.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The format's version ([`SCHEMA`]).
    pub schema: u32,
    /// Backend name.
    pub backend: String,
    /// How the ranks were started.
    pub launch: Launch,
    /// The vendor collective library and its version (`NCCL 2.28.3`; none on the host).
    pub library: Option<String>,
    /// Where each rank ran.
    pub ranks: Vec<RankInfo>,
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
    /// Wrong elements over the whole sweep (non-zero: the command exits with an error).
    pub wrong: u64,
    /// How results were checked.
    pub check: String,
    /// How it was measured.
    pub method: String,
}

impl BenchReport {
    /// The cells with wrong results: (size, placement, algorithm or `auto`, wrong elements).
    pub fn wrong_cells(&self) -> Vec<(u64, &'static str, String, u64)> {
        let mut v = Vec::new();
        for row in &self.rows {
            for (place, p) in row.placements() {
                for c in &p.cells {
                    if let Some(w) = c.wrong.filter(|&w| w > 0) {
                        v.push((row.bytes, place, c.algorithm.name().to_owned(), w));
                    }
                }
                if let Some(w) = p.auto.wrong.filter(|&w| w > 0) {
                    v.push((row.bytes, place, format!("auto ({})", p.auto.algorithm), w));
                }
            }
        }
        v
    }
}

/// Median of samples (sorts them); NaN when there are none.
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

/// A cell of `algorithm` with latency `median_us` (and fastest call `min_us`) for `bytes` at `world` ranks.
pub(crate) fn cell(algorithm: Algorithm, median_us: f64, min_us: f64, bytes: u64, world: usize) -> Cell {
    let algbw = bytes as f64 / (median_us * 1e-6) / 1e9;
    let factor = if world > 1 { 2.0 * (world - 1) as f64 / world as f64 } else { 0.0 };
    Cell {
        algorithm,
        median_us,
        min_us,
        algbw_gbps: algbw,
        busbw_gbps: algbw * factor,
        wrong: Some(0),
        rank_spread: None,
    }
}

/// What one rank measured in one cell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RankCell {
    /// Median latency, µs (NaN: not run).
    pub median_us: f64,
    /// Fastest call, µs.
    pub min_us: f64,
    /// Wrong elements of this rank's output (`None`: not run).
    pub wrong: Option<u64>,
}

impl RankCell {
    /// A cell that did not run (the algorithm cannot take this size).
    pub const EMPTY: RankCell = RankCell { median_us: f64::NAN, min_us: f64::NAN, wrong: None };

    /// A cell from its timing samples (sorted here) and its check.
    pub fn from_samples(samples: &mut [f64], wrong: u64) -> RankCell {
        let median_us = median(samples);
        RankCell { median_us, min_us: samples.first().copied().unwrap_or(f64::NAN), wrong: Some(wrong) }
    }
}

/// Bytes of one encoded [`RankCell`].
pub(crate) const RANK_CELL_BYTES: usize = 24;

/// Encodes cells for the exchange between rank processes (three little-endian f64 each; NaN for none).
pub(crate) fn encode_cells(cells: &[RankCell]) -> Vec<u8> {
    let mut out = Vec::with_capacity(cells.len() * RANK_CELL_BYTES);
    for c in cells {
        let wrong = c.wrong.map_or(f64::NAN, |w| w as f64);
        for x in [c.median_us, c.min_us, wrong] {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

/// Decodes rank `rank`'s cells, which must be `expected` of them with sane values.
pub(crate) fn decode_cells(rank: usize, bytes: &[u8], expected: usize) -> Result<Vec<RankCell>> {
    if bytes.len() != expected.saturating_mul(RANK_CELL_BYTES) {
        return Err(Error::PeerFailure(format!(
            "rank {rank} reported {} bytes of results; {expected} cells take {}",
            bytes.len(),
            expected.saturating_mul(RANK_CELL_BYTES)
        )));
    }
    let f = |c: &[u8]| {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        f64::from_le_bytes(b)
    };
    bytes
        .chunks_exact(RANK_CELL_BYTES)
        .map(|c| {
            let (median_us, min_us, wrong) = (f(&c[..8]), f(&c[8..16]), f(&c[16..]));
            let wrong = if wrong.is_nan() {
                None
            } else if wrong >= 0.0 && wrong.fract() == 0.0 && wrong < 2f64.powi(53) {
                Some(wrong as u64)
            } else {
                return Err(Error::PeerFailure(format!("rank {rank} reported {wrong} wrong elements")));
            };
            Ok(RankCell { median_us, min_us, wrong })
        })
        .collect()
}

/// One rank's whole sweep.
#[derive(Debug, Clone)]
pub(crate) struct RankSweep {
    /// Per size: per placement (out of place, then in place if measured): one cell per algorithm, then `auto`.
    pub cells: Vec<RankCell>,
    /// Per size and placement: the algorithm `auto` chose and why.
    pub autos: Vec<(Algorithm, String)>,
    /// Per size: eager host time per call through anyccl and raw, µs.
    pub host: Vec<Option<(f64, f64)>>,
}

/// Which number heads a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Headline {
    /// Rank 0's median (ranks as threads of one process).
    Rank0,
    /// The average of the ranks' medians (one process per rank, as nccl-tests).
    Average,
}

/// The cells per size of `cfg` measuring `algorithms`.
pub(crate) fn cells_per_size(cfg: &BenchConfig, algorithms: &[Algorithm]) -> usize {
    (algorithms.len() + 1) * if cfg.in_place { 2 } else { 1 }
}

fn merge_cell(algorithm: Algorithm, per_rank: &[RankCell], bytes: u64, world: usize, headline: Headline) -> Cell {
    let medians: Vec<f64> = per_rank.iter().map(|c| c.median_us).filter(|m| m.is_finite()).collect();
    let avg = if medians.is_empty() { f64::NAN } else { medians.iter().sum::<f64>() / medians.len() as f64 };
    let (median, min) = match headline {
        Headline::Rank0 => per_rank.first().map_or((f64::NAN, f64::NAN), |c| (c.median_us, c.min_us)),
        Headline::Average => {
            (avg, per_rank.iter().map(|c| c.min_us).filter(|m| m.is_finite()).fold(f64::NAN, f64::min))
        }
    };
    let mut c = cell(algorithm, median, min, bytes, world);
    c.wrong = per_rank.iter().filter_map(|c| c.wrong).reduce(u64::saturating_add);
    if per_rank.len() > 1 && !medians.is_empty() {
        c.rank_spread = Some(Spread {
            min_us: medians.iter().copied().fold(f64::INFINITY, f64::min),
            avg_us: avg,
            max_us: medians.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        });
    }
    c
}

/// The rows of a sweep from every rank's cells (`all[rank]`) and rank 0's selections and host times.
pub(crate) fn assemble(
    cfg: &BenchConfig,
    algorithms: &[Algorithm],
    baseline: Algorithm,
    all: &[Vec<RankCell>],
    rank0: &RankSweep,
    headline: Headline,
) -> Result<Vec<Row>> {
    let per_size = cells_per_size(cfg, algorithms);
    let places = if cfg.in_place { 2 } else { 1 };
    let total = cfg.sizes.len() * per_size;
    if let Some((r, c)) = all.iter().enumerate().find(|(_, c)| c.len() != total) {
        return Err(Error::PeerFailure(format!("rank {r} measured {} cells; the sweep has {total}", c.len())));
    }
    if all.is_empty() || rank0.autos.len() != cfg.sizes.len() * places || rank0.host.len() != cfg.sizes.len() {
        return Err(Error::PeerFailure("the sweep's results are incomplete".into()));
    }
    let mut rows = Vec::with_capacity(cfg.sizes.len());
    for (s, &bytes) in cfg.sizes.iter().enumerate() {
        let mut placed = Vec::with_capacity(places);
        for p in 0..places {
            let base = s * per_size + p * (algorithms.len() + 1);
            let column = |k: usize| all.iter().map(|cells| cells[base + k]).collect::<Vec<_>>();
            let cells: Vec<Cell> = algorithms
                .iter()
                .enumerate()
                .map(|(k, &a)| merge_cell(a, &column(k), bytes, cfg.world, headline))
                .collect();
            let (auto_algo, auto_rule) = rank0.autos[s * places + p].clone();
            let auto = merge_cell(auto_algo, &column(algorithms.len()), bytes, cfg.world, headline);
            let best = cells
                .iter()
                .filter(|c| c.median_us.is_finite())
                .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
                .map(|c| (c.algorithm, c.median_us))
                .unwrap_or((auto.algorithm, auto.median_us));
            let base_us = cells.iter().find(|c| c.algorithm == baseline).map(|c| c.median_us);
            placed.push(Placement {
                cells,
                auto,
                auto_rule,
                best: best.0,
                best_speedup_vs_baseline: base_us.map(|b| b / best.1).filter(|x| x.is_finite()),
            });
        }
        let mut placed = placed.into_iter();
        let (Some(out_of_place), in_place) = (placed.next(), placed.next()) else {
            return Err(Error::PeerFailure("the sweep measured no placement".into()));
        };
        let wrong = std::iter::once(&out_of_place)
            .chain(in_place.as_ref())
            .flat_map(|p| p.cells.iter().chain(std::iter::once(&p.auto)))
            .filter_map(|c| c.wrong)
            .fold(0u64, u64::saturating_add);
        let host = rank0.host[s];
        rows.push(Row {
            bytes,
            count: (bytes / cfg.dtype.size_bytes() as u64) as usize,
            out_of_place,
            in_place,
            wrong,
            host_us_per_call: host.map(|h| h.0),
            raw_ccl_host_us_per_call: host.map(|h| h.1),
        });
    }
    Ok(rows)
}

/// Runs `rank` on one thread per communicator; the first error wins (a rank's own failure before a peer's report
/// of it), otherwise every rank's result, in rank order.
#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
pub(crate) fn on_ranks<C: Send, T: Send>(
    comms: Vec<C>,
    rank: impl Fn(C) -> anyccl::core::Result<T> + Sync,
) -> anyccl::core::Result<Vec<T>> {
    let results: Vec<anyccl::core::Result<T>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| rank(c))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::PeerFailure("a benchmark rank thread panicked".into()))))
            .collect()
    });
    // The root cause wins: a rank that failed on its own (out of memory, a bad argument) rather than a peer that
    // only saw it leave.
    let mut all = Vec::with_capacity(results.len());
    let mut peer_failure = None;
    for r in results {
        match r {
            Ok(v) => all.push(v),
            Err(e @ Error::PeerFailure(_)) => {
                peer_failure.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(e) = peer_failure {
        return Err(e);
    }
    if all.is_empty() {
        return Err(Error::PeerFailure("no rank ran".into()));
    }
    Ok(all)
}

/// Progress reporting hook: called with (cells done, cells total).
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);

#[cfg(all(test, feature = "host"))]
pub(crate) use crate::bench_any::{CellId, Tamper};

/// This machine's host name (`?` when it cannot be read).
pub(crate) fn host_name() -> String {
    #[cfg(unix)]
    {
        nix::unistd::gethostname().map_or_else(|_| "?".to_owned(), |h| h.to_string_lossy().into_owned())
    }
    #[cfg(not(unix))]
    {
        "?".to_owned()
    }
}

/// The line exchanged about each rank: host, pid, device.
pub(crate) fn encode_rank_info(host: &str, device: &str) -> Vec<u8> {
    format!("{host}\t{}\t{device}", std::process::id()).into_bytes()
}

/// Decodes the rank lines of [`encode_rank_info`] (each at most 4 KiB; anything malformed is an error).
pub(crate) fn decode_rank_info(all: &[Vec<u8>]) -> Result<Vec<RankInfo>> {
    all.iter()
        .enumerate()
        .map(|(rank, b)| {
            let bad = || Error::PeerFailure(format!("rank {rank} sent a malformed description of itself"));
            if b.len() > 4096 {
                return Err(bad());
            }
            let s = std::str::from_utf8(b).map_err(|_| bad())?;
            let mut parts = s.splitn(3, '\t');
            let (Some(host), Some(pid), Some(device)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad());
            };
            Ok(RankInfo {
                rank,
                host: anyccl::core::text::sanitize_with_limit(host, 256),
                pid: pid.parse().map_err(|_| bad())?,
                device: anyccl::core::text::sanitize_with_limit(device, 256),
            })
        })
        .collect()
}

/// What every rank must agree on before a sweep across processes (ranks started with different flags would
/// otherwise call different collectives and wait on each other).
pub(crate) fn fingerprint(cfg: &BenchConfig, algorithms: &[Algorithm], mode: &str) -> Vec<u8> {
    format!(
        "{} {} {:?} {:?} {} {} {} {mode}",
        cfg.dtype, cfg.op, cfg.sizes, algorithms, cfg.iters, cfg.warmup, cfg.in_place
    )
    .into_bytes()
}

/// Checks that every rank's [`fingerprint`] (`all[rank]`) is rank 0's.
pub(crate) fn check_agreement(all: &[Vec<u8>]) -> Result<()> {
    let Some(first) = all.first() else { return Ok(()) };
    match all.iter().position(|f| f != first) {
        None => Ok(()),
        Some(r) => Err(Error::Config {
            source_name: "--per-rank".into(),
            line: None,
            message: format!(
                "rank {r} was started with other settings than rank 0 ({} vs {}); start every rank with the same \
                 flags",
                anyccl::core::text::sanitize_with_limit(&String::from_utf8_lossy(&all[r]), 300),
                anyccl::core::text::sanitize_with_limit(&String::from_utf8_lossy(first), 300)
            ),
        }),
    }
}

/// Runs the sweep on the host backend, one thread per rank (the tests' entry point; the command goes through
/// [`crate::bench_any::run`] for every backend but cuda).
#[cfg(all(test, feature = "host"))]
pub fn run_host(cfg: &BenchConfig, progress: Progress<'_>) -> Result<BenchReport> {
    run_host_with(cfg, progress, None)
}

/// [`run_host`] with a test's [`Tamper`] hook: the driver of every backend ([`crate::bench_any`]) on the host.
#[cfg(all(test, feature = "host"))]
pub(crate) fn run_host_with(cfg: &BenchConfig, progress: Progress<'_>, tamper: Tamper<'_>) -> Result<BenchReport> {
    use crate::bench_any::{run, Timing};
    Ok(run(anyccl::dynamic::BackendKind::Host, cfg, Timing::Barriers, progress, tamper)?.report)
}

/// The report of a finished sweep.
#[allow(clippy::too_many_arguments)]
pub(crate) fn report(
    cfg: &BenchConfig,
    backend: &str,
    launch: Launch,
    library: Option<String>,
    ranks: Vec<RankInfo>,
    baseline: Algorithm,
    algorithms: Vec<Algorithm>,
    ineligible: Vec<Ineligible>,
    rows: Vec<Row>,
    check: String,
    method: String,
) -> BenchReport {
    let wrong = rows.iter().map(|r| r.wrong).fold(0u64, u64::saturating_add);
    BenchReport {
        schema: SCHEMA,
        backend: backend.into(),
        launch,
        library,
        ranks,
        world: cfg.world,
        dtype: cfg.dtype,
        op: cfg.op,
        iters: cfg.iters,
        warmup: cfg.warmup,
        baseline,
        algorithms,
        ineligible,
        rows,
        wrong,
        check,
        method,
    }
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

/// The text of one cell of the table.
fn cell_text(c: &Cell, world: usize, spread: bool) -> String {
    if c.median_us.is_nan() {
        return "- (size not eligible)".into();
    }
    let bw = if world > 1 { c.busbw_gbps } else { c.algbw_gbps };
    let mut s = fmt_us(c.median_us);
    if let (true, Some(r)) = (spread, c.rank_spread) {
        s += &format!(" [{}-{}]", fmt_us(r.min_us).trim_end_matches(" us"), fmt_us(r.max_us));
    }
    s += &format!(" / {bw:.2}");
    if c.wrong.is_some_and(|w| w > 0) {
        s.push_str(" !");
    }
    s
}

/// The human-readable table.
pub fn render_table(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "anyccl bench: all-reduce, backend {}, world {}, {} {}, median of {} calls after {} warm-up (schema {})",
        r.backend, r.world, r.dtype, r.op, r.iters, r.warmup, r.schema
    );
    let launch = match r.launch {
        Launch::Threads => "one process, a thread per rank",
        Launch::Processes => "one process per rank",
    };
    let _ = writeln!(s, "library: {}; {launch}", r.library.as_deref().unwrap_or("none (host memory)"));
    for k in &r.ranks {
        let _ = writeln!(s, "#  rank {:>3}  pid {:>7}  on {:<16} device {}", k.rank, k.pid, k.host, k.device);
    }
    // busbw is 0 at world 1 (nothing crosses a link); show algbw there.
    let bw = if r.world > 1 { "bus bandwidth" } else { "algorithm bandwidth (world 1: busbw is 0)" };
    let spread = r.launch == Launch::Processes;
    let latency =
        if spread { "average of the ranks' median latencies [fastest-slowest rank]" } else { "median latency" };
    let _ = writeln!(s, "cells: {latency} / {bw} in GB/s; best: fastest, with its speedup over {}", r.baseline);
    let _ = writeln!(
        s,
        "#wrong: elements of the ranks' outputs that differ from the reference, per row (a cell marked ! is wrong)"
    );
    let mut texts: Vec<String> = r.algorithms.iter().map(|a| a.name().to_owned()).collect();
    for row in &r.rows {
        for (_, p) in row.placements() {
            texts.extend(p.cells.iter().map(|c| cell_text(c, r.world, spread)));
            texts.push(format!("{} {}", p.auto.algorithm, cell_text(&p.auto, r.world, spread)));
        }
    }
    let w = texts.iter().map(|t| t.chars().count()).max().unwrap_or(0).max(22);
    let _ = write!(s, "\n{:>10} {:>9} {:>5}", "size", "count", "place");
    for a in &r.algorithms {
        let _ = write!(s, "  {:>w$}", a.name());
    }
    let host = r.rows.iter().any(|row| row.host_us_per_call.is_some());
    if host {
        let _ = write!(s, " {:>20}", "host us/call (raw)");
    }
    let _ = writeln!(s, "  {:>w$} {:>7}  best", "auto", "#wrong");
    for row in &r.rows {
        for (i, (place, p)) in row.placements().enumerate() {
            if i == 0 {
                let _ = write!(s, "{:>10} {:>9} {place:>5}", format_bytes(row.bytes), row.count);
            } else {
                let _ = write!(s, "{:>10} {:>9} {place:>5}", "", "");
            }
            for c in &p.cells {
                let _ = write!(s, "  {:>w$}", cell_text(c, r.world, spread));
            }
            if host {
                let h = match (i, row.host_us_per_call, row.raw_ccl_host_us_per_call) {
                    (0, Some(a), Some(b)) => format!("{a:.2} ({b:.2})"),
                    _ => "-".into(),
                };
                let _ = write!(s, " {h:>20}");
            }
            let auto = format!("{} {}", p.auto.algorithm, cell_text(&p.auto, r.world, spread));
            let wrong: u64 = p.cells.iter().chain([&p.auto]).filter_map(|c| c.wrong).fold(0, u64::saturating_add);
            let _ = write!(s, "  {auto:>w$} {wrong:>7}");
            match p.best_speedup_vs_baseline {
                Some(x) => {
                    let _ = writeln!(s, "  {} ({x:.2}x)", p.best);
                }
                None => {
                    let _ = writeln!(s, "  {}", p.best);
                }
            }
        }
    }
    for (i, ie) in r.ineligible.iter().enumerate() {
        let _ = writeln!(s, "\n[{}] {} not measured: {}", i + 1, ie.algorithm, ie.reason);
    }
    let _ = writeln!(s, "\ncheck: {}", r.check);
    if r.wrong > 0 {
        let _ = writeln!(s, "WRONG RESULTS: {} elements in total", r.wrong);
    }
    let _ = writeln!(s, "method: {}", r.method);
    s
}

/// The CSV header (the columns of schema 1 first, in their order; `schema` last).
pub const CSV_HEADER: &str = "backend,world,dtype,op,bytes,count,algorithm,median_us,min_us,algbw_gbps,busbw_gbps,\
                              is_auto,is_best,in_place,wrong,rank_min_us,rank_avg_us,rank_max_us,schema\n";

/// CSV: one line per (size, placement, algorithm), `auto` included.
pub fn render_csv(r: &BenchReport) -> String {
    let mut s = String::from(CSV_HEADER);
    let opt = |x: Option<f64>| x.map_or(String::new(), |v| format!("{v:.3}"));
    for row in &r.rows {
        for (place, p) in row.placements() {
            let line = |c: &Cell, auto: bool| {
                format!(
                    "{},{},{},{},{},{},{},{:.3},{:.3},{:.4},{:.4},{},{},{},{},{},{},{},{}\n",
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
                    !auto && c.algorithm == p.best,
                    place == "in",
                    c.wrong.map_or(String::new(), |w| w.to_string()),
                    opt(c.rank_spread.map(|x| x.min_us)),
                    opt(c.rank_spread.map(|x| x.avg_us)),
                    opt(c.rank_spread.map(|x| x.max_us)),
                    r.schema,
                )
            };
            for c in &p.cells {
                s.push_str(&line(c, false));
            }
            s.push_str(&line(&p.auto, true));
        }
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
        sizes_flag: "--sizes",
        algorithms: None,
        quantized: Vec::new(),
        iters: 3,
        warmup: 1,
        in_place: true,
        selector,
        bind: false,
    }
}

/// How long a sweep must run before a progress bar appears.
pub const PROGRESS_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;
    use anyccl::core::Error;
    use proptest::prelude::*;

    #[test]
    fn host_sweep_measures_and_checks_every_algorithm_and_auto_in_both_placements() {
        let cfg = smoke_config(Arc::new(Selector::defaults()));
        let r = run_host(&cfg, &|_, _| {}).expect("bench runs");
        assert_eq!((r.schema, r.launch, r.wrong), (SCHEMA, Launch::Threads, 0));
        assert_eq!(r.rows.len(), 2);
        assert_eq!(r.ranks.len(), 2);
        for row in &r.rows {
            assert_eq!(row.wrong, 0);
            let places: Vec<_> = row.placements().map(|(p, _)| p).collect();
            assert_eq!(places, ["out", "in"]);
            for (_, p) in row.placements() {
                assert_eq!(p.cells.len(), 3);
                for c in p.cells.iter().chain([&p.auto]) {
                    assert!(c.median_us > 0.0 && c.median_us.is_finite());
                    assert!(c.busbw_gbps > 0.0);
                    assert_eq!(c.wrong, Some(0), "checked and right");
                    let spread = c.rank_spread.expect("two ranks have a spread");
                    assert!(spread.min_us <= spread.avg_us && spread.avg_us <= spread.max_us);
                }
                assert!(p.cells.iter().any(|c| c.algorithm == p.best));
                assert!(p.best_speedup_vs_baseline.is_some_and(|x| x >= 1.0));
            }
        }
        let table = render_table(&r);
        for needle in ["one-shot", "ring", "auto", "#wrong", "place", " out ", " in ", "schema 2", "#  rank   1"] {
            assert!(table.contains(needle), "{needle:?} missing:\n{table}");
        }
        let csv = render_csv(&r);
        assert_eq!(csv.lines().count(), 1 + 2 * 2 * 4);
        assert!(csv.lines().skip(1).all(|l| l.ends_with(",2") && l.split(',').count() == 19), "{csv}");
    }

    /// A wrong element in one rank's output is counted in its cell, its row and the report, and only there.
    #[test]
    fn a_tampered_output_is_counted_where_it_happened() {
        let mut cfg = smoke_config(Arc::new(Selector::defaults()));
        cfg.world = 3;
        let target = CellId { rank: 1, bytes: 65536, algorithm: Some(Algorithm::TwoShot), in_place: true };
        let tamper = |id: CellId, out: &mut [u8]| {
            if id == target {
                out[4 * 100..4 * 103].fill(0x7F);
            }
        };
        let r = run_host_with(&cfg, &|_, _| {}, Some(&tamper)).expect("runs");
        assert_eq!(r.wrong, 3);
        assert_eq!(r.rows[0].wrong, 0);
        assert_eq!(r.rows[1].wrong, 3);
        assert_eq!(r.wrong_cells(), vec![(65536, "in", "two-shot".to_owned(), 3)]);
        let table = render_table(&r);
        assert!(table.contains(" !") && table.contains("WRONG RESULTS: 3"), "{table}");
        let csv = render_csv(&r);
        assert_eq!(csv.lines().filter(|l| l.contains(",two-shot,") && l.contains(",true,3,")).count(), 1, "{csv}");
    }

    #[test]
    fn bad_sizes_and_unknown_algorithms_are_reported() {
        let mut cfg = smoke_config(Arc::new(Selector::defaults()));
        cfg.sizes = vec![6];
        assert!(matches!(run_host(&cfg, &|_, _| {}), Err(Error::Config { .. })));
        cfg.sizes = vec![4096];
        cfg.algorithms = Some(vec![Algorithm::OneShot, Algorithm::NvlsZeroCopy]);
        cfg.in_place = false;
        let r = run_host(&cfg, &|_, _| {}).expect("runs what it can");
        assert_eq!(r.algorithms, vec![Algorithm::OneShot]);
        assert_eq!(r.ineligible.len(), 1);
        assert!(r.rows[0].in_place.is_none());
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
            (Box::new(|c| (c.sizes, c.sizes_flag) = (vec![6], STEP_FLAGS)), STEP_FLAGS, "positive multiple"),
            (Box::new(|c| (c.world, c.sizes) = (8, vec![1 << 30])), "--sizes", "world × message"),
            (Box::new(|c| (c.world, c.sizes) = (usize::MAX, vec![1 << 30])), "--world", "at most 1024"),
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

    /// Cells cross between processes intact, and a peer's nonsense is refused with its rank named.
    #[test]
    fn rank_cells_round_trip_and_bad_ones_are_refused() {
        let cells = [
            RankCell { median_us: 12.5, min_us: 11.0, wrong: Some(0) },
            RankCell::EMPTY,
            RankCell { median_us: 1e6, min_us: 3.0, wrong: Some(1 << 40) },
        ];
        let bytes = encode_cells(&cells);
        let back = decode_cells(2, &bytes, 3).expect("decodes");
        assert_eq!(back[0], cells[0]);
        assert!(back[1].median_us.is_nan() && back[1].wrong.is_none());
        assert_eq!(back[2], cells[2]);
        let e = decode_cells(2, &bytes[..30], 3).expect_err("short");
        assert!(e.to_string().contains("rank 2"), "{e}");
        let mut bad = bytes.clone();
        bad[16..24].copy_from_slice(&(-1.5f64).to_le_bytes());
        assert!(decode_cells(1, &bad, 3).expect_err("negative").to_string().contains("-1.5 wrong"));
        let info = decode_rank_info(&[encode_rank_info("node-a", "GPU 3: NVIDIA H200 (sm_90)")]).expect("info");
        assert_eq!((info[0].host.as_str(), info[0].pid), ("node-a", std::process::id()));
        assert!(decode_rank_info(&[b"no tabs".to_vec()]).is_err());
        assert!(check_agreement(&[b"a".to_vec(), b"a".to_vec()]).is_ok());
        let e = check_agreement(&[b"a".to_vec(), b"a".to_vec(), b"b".to_vec()]).expect_err("differs");
        assert!(e.to_string().contains("rank 2 was started with other settings"), "{e}");
    }

    /// The per-rank spread and average: the headline is rank 0's median, or the average over ranks.
    #[test]
    fn cells_merge_over_ranks() {
        let ranks = [
            RankCell { median_us: 10.0, min_us: 9.0, wrong: Some(0) },
            RankCell { median_us: 30.0, min_us: 5.0, wrong: Some(2) },
        ];
        let c = merge_cell(Algorithm::Ring, &ranks, 1 << 20, 2, Headline::Rank0);
        assert_eq!((c.median_us, c.min_us, c.wrong), (10.0, 9.0, Some(2)));
        assert_eq!(c.rank_spread, Some(Spread { min_us: 10.0, avg_us: 20.0, max_us: 30.0 }));
        let c = merge_cell(Algorithm::Ring, &ranks, 1 << 20, 2, Headline::Average);
        assert_eq!((c.median_us, c.min_us), (20.0, 5.0));
        let empty = merge_cell(Algorithm::Ring, &[RankCell::EMPTY, RankCell::EMPTY], 1, 2, Headline::Average);
        assert!(empty.median_us.is_nan() && empty.wrong.is_none() && empty.rank_spread.is_none());
    }

    proptest! {
        /// `-b MIN -e MAX -f F`: starts at MIN, multiplies by F, never passes MAX, and stops only where the next
        /// step would (or would overflow); anything it refuses is a typed error naming a flag.
        #[test]
        fn geometric_sweeps(min in 1u64..(1 << 40), span in 0u32..70, factor in 0u64..1100) {
            let max = min.saturating_mul(1u64.checked_shl(span.min(63)).unwrap_or(u64::MAX));
            match geometric_sizes(min, max, factor) {
                Ok(s) => {
                    prop_assert!((2..=MAX_STEP_FACTOR).contains(&factor));
                    prop_assert_eq!(s[0], min);
                    prop_assert!(s.len() <= MAX_SIZES);
                    prop_assert!(s.windows(2).all(|w| w[1] == w[0] * factor));
                    let last = *s.last().expect("non-empty");
                    prop_assert!(last <= max);
                    prop_assert!(last.checked_mul(factor).is_none_or(|n| n > max));
                }
                Err(Error::Config { source_name, .. }) => {
                    prop_assert!(source_name.starts_with('-'), "{}", source_name);
                    let count = (0..=64u32).take_while(|&k| factor.checked_pow(k).and_then(|p| min.checked_mul(p)).is_some_and(|b| b <= max)).count();
                    prop_assert!(!(2..=MAX_STEP_FACTOR).contains(&factor) || count > MAX_SIZES);
                }
                Err(e) => prop_assert!(false, "{:?}", e),
            }
        }
    }

    #[test]
    fn geometric_sweeps_as_nccl_tests_writes_them() {
        assert_eq!(geometric_sizes(8, 128, 2).expect("ok"), vec![8, 16, 32, 64, 128]);
        assert_eq!(geometric_sizes(1 << 20, 1 << 20, 2).expect("one size"), vec![1 << 20]);
        assert_eq!(geometric_sizes(3, 100, 4).expect("ok"), vec![3, 12, 48]);
        assert_eq!(geometric_sizes(1, u64::MAX, 2).expect("64 sizes").len(), 64);
        assert!(geometric_sizes(1, u64::MAX, 2).expect("ok").last() == Some(&(1 << 63)));
        assert!(geometric_sizes(0, 8, 2).is_err());
        assert!(geometric_sizes(16, 8, 2).expect_err("inverted").to_string().contains("above -e/--maxbytes"));
        assert!(geometric_sizes(8, 16, 1).expect_err("factor 1").to_string().contains("-f/--stepfactor"));
    }
}
