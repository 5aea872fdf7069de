//! The `anyccl` command: `probe`, `bench` and `tune`, built on the `anyccl` library.

// Built with no backend, `bench` and `tune` only refuse (no backend to measure), so the
// measuring code is compiled but unused.
#![cfg_attr(not(any(feature = "host", feature = "cuda", feature = "rocm")), allow(dead_code))]

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyccl::core::units::parse_bytes;
use anyccl::{Algorithm, DataType, Error, ReduceOp, Selector};
use clap::{Parser, Subcommand, ValueEnum};

mod bench;
#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
mod bench_any;
#[cfg(feature = "cuda")]
mod bench_cuda;
#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
mod bench_fused;
#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
mod bind;
mod check;
mod dropin;
mod output;
mod plot;
mod probe;
mod tune;

/// One API for GPU collectives: probe what this machine offers, benchmark all-reduce.
#[derive(Parser, Debug)]
#[command(name = "anyccl", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the backends compiled in, the GPU and vendor libraries found, every capability with its reason, and the
    /// drop-in libnccl (libanyccl_nccl.so beside the binary, or ANYCCL_DROPIN_PATH) with what it forwards to.
    Probe {
        /// Print the report as JSON (schema documented in src/report.rs).
        #[arg(long)]
        json: bool,
        /// A selector table file (TOML) to load before the defaults (overrides ANYCCL_TUNE_FILE).
        #[arg(long, value_name = "FILE")]
        table: Option<PathBuf>,
    },
    /// Measure all-reduce latency and bandwidth per size and algorithm.
    Bench(BenchArgs),
    /// Measure every eligible algorithm, write a selector table (TOML) picking the fastest per size, and check it.
    Tune {
        /// Where to write the table (use it with ANYCCL_TUNE_FILE or --table).
        #[arg(long, value_name = "FILE", default_value = "anyccl-tune.toml")]
        out: PathBuf,
        #[command(flatten)]
        bench: BenchArgs,
    },
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Host,
    Cuda,
    Rocm,
}

/// A fused call `anyccl bench --fused` measures.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum FusedArg {
    /// The all-reduce + residual add + RMSNorm (`Communicator::all_reduce_rmsnorm`).
    Rmsnorm,
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Backend to run on. Default: the first of cuda and rocm that this build has and this machine can run (an
    /// NVIDIA or AMD GPU with its collective library, not turned off by ANYCCL_DISABLE), else host.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// Number of ranks, 1 to 64. Default: host: the number of CPU cores, at least 2 and at most 8; cuda, rocm:
    /// every GPU of this machine; --per-rank: the launcher's WORLD_SIZE (given, it must match).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    world: Option<u16>,
    /// Element type (f32, bf16, f16, fp8e4m3, i32, …).
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: DataType,
    /// Reduction operator.
    #[arg(long, default_value = "sum", value_parser = parse_op)]
    op: ReduceOp,
    /// Message sizes, comma-separated (4KiB,1MiB,…), at most 64. Host backend: each at most 1 GiB, and world ×
    /// size at most 2 GiB. Default: host: 4 KiB to 16 MiB in steps of 4× (7 sizes); cuda, rocm: bf16 tensors of shape
    /// (N, 8192) for N = 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 3062, 4096 (512 KiB to 64 MiB, 11 sizes).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, conflicts_with_all = ["minbytes", "maxbytes", "stepfactor"])]
    sizes: Option<Vec<u64>>,
    /// A geometric sweep instead of --sizes, as nccl-tests' -b: the smallest size (needs -e).
    #[arg(short = 'b', long, value_name = "SIZE", value_parser = parse_size, requires = "maxbytes")]
    minbytes: Option<u64>,
    /// The largest size of the sweep, included when a step lands on it (nccl-tests' -e; needs -b).
    #[arg(short = 'e', long, value_name = "SIZE", value_parser = parse_size, requires = "minbytes")]
    maxbytes: Option<u64>,
    /// The factor from one size of the sweep to the next, 2 to 1024 (nccl-tests' -f; needs -b and -e). Default: 2.
    #[arg(short = 'f', long, value_name = "FACTOR", requires = "minbytes",
          value_parser = clap::value_parser!(u64).range(2..=crate::bench::MAX_STEP_FACTOR))]
    stepfactor: Option<u64>,
    /// Algorithms to measure, comma-separated. Default: every one the backend implements: host: one-shot,
    /// two-shot, ring (--per-rank: one-shot, two-shot); cuda: ccl, ccl-symmetric, one-shot, two-shot, nvls-zero-copy,
    /// nvls-warp-pipeline, nvls-block-pipeline, one-shot-push, two-shot-push; rocm: ccl, ccl-symmetric, one-shot, two-shot (those the machine
    /// cannot run are listed with the reason).
    #[arg(long, value_delimiter = ',', value_parser = parse_algo)]
    algos: Option<Vec<Algorithm>>,
    /// Also measure the quantized two-shot: fp8 (e4m3) and/or int8, comma-separated (the algorithms
    /// two-shot-fp8, two-shot-int8; custom GPU kernels, sum of f32/f16/bf16). Lossy: their results are checked
    /// against the exact sum within the format's error bound (fp8 ≈ 0.13, int8 ≈ 0.008 of the sum of the ranks'
    /// largest magnitudes), not exactly.
    #[arg(long, value_delimiter = ',', value_parser = parse_quantize)]
    quantize: Option<Vec<Algorithm>>,
    /// Timed calls per cell, 1 to 10000 (the median is reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::bench::MAX_ITERS)))]
    iters: u32,
    /// Untimed warm-up calls per cell, 0 to 10000 (on GPUs with --graph, at least 1 eager call and 1 replay).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(..=i64::from(crate::bench::MAX_WARMUP)))]
    warmup: u32,
    /// A selector table file (TOML) to load before the defaults (overrides ANYCCL_TUNE_FILE).
    #[arg(long, value_name = "FILE")]
    table: Option<PathBuf>,
    /// Print JSON instead of the table (schema in the `schema` field).
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV instead of the table (the `schema` column last).
    #[arg(long)]
    csv: bool,
    /// Also draw latency and bandwidth against size (out of place), one line per algorithm, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// GPU timing: one graph of 10 back-to-back calls per replay (the default on GPUs: CUDA events on cuda, host
    /// time up to a stream synchronisation on rocm; the host backend times each call between two barriers).
    #[arg(long, conflicts_with = "eager")]
    graph: bool,
    /// GPU timing: each eager call on its own (cuda: also the host time per call, anyccl vs raw NCCL).
    #[arg(long)]
    eager: bool,
    /// One process per rank, started by torchrun or srun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    /// MASTER_PORT; ANYCCL_RENDEZVOUS_KEY off loopback): every process measures its rank, rank 0 prints the
    /// report with each cell's spread over the ranks (min/avg/max), and every rank exits non-zero if any result
    /// is wrong. cuda: one GPU per process (LOCAL_RANK); host: the ranks share memory (one-shot and two-shot);
    /// rocm: not yet (one process drives every GPU).
    #[arg(long)]
    per_rank: bool,
    /// host: bind each rank to a processor of its own, as mpirun binds its ranks to cores by default: rank r (its
    /// thread, or with --per-rank its process) to the r-th processor this process may run on. No binding where
    /// the ranks outnumber those processors (oversubscribed), nor on other backends.
    #[arg(long)]
    bind: bool,
    /// Measure a fused call instead of the all-reduce: `rmsnorm` (all-reduce + residual add + RMSNorm, f16 or bf16)
    /// in each form (fused one-shot, fused two-shot, and unfused: the all-reduce then a separate RMSNorm), for
    /// each of --tokens rows of --hidden elements, with the fused/unfused ratio and the #wrong check (bit for bit).
    #[arg(long, value_enum, conflicts_with_all = ["per_rank", "algos", "quantize", "sizes", "minbytes", "plot", "csv", "graph"])]
    fused: Option<FusedArg>,
    /// --fused: elements per row, a multiple of 8 from 8 to 16384.
    #[arg(long, default_value_t = 8192, requires = "fused")]
    hidden: usize,
    /// --fused: rows per call, comma-separated, at most 64 counts (each call at most 1 GiB per rank).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,512", requires = "fused")]
    tokens: Vec<usize>,
}

/// The sizes the flags give (`--sizes` or `-b/-e/-f`) and the flag to name in errors, or `None` for the
/// backend's default.
fn sizes_of(args: &BenchArgs) -> Result<Option<(Vec<u64>, &'static str)>, CliError> {
    if let Some(s) = &args.sizes {
        return Ok(Some((s.clone(), "--sizes")));
    }
    match (args.minbytes, args.maxbytes) {
        (Some(min), Some(max)) => {
            let sizes = crate::bench::geometric_sizes(min, max, args.stepfactor.unwrap_or(2))?;
            Ok(Some((sizes, crate::bench::STEP_FLAGS)))
        }
        _ => Ok(None),
    }
}

/// The sweep `args` describe on `world` ranks, with `default_sizes` when no sizes were given.
fn config(
    args: &BenchArgs,
    world: usize,
    default_sizes: fn() -> Vec<u64>,
    selector: Arc<Selector>,
    in_place: bool,
) -> Result<crate::bench::BenchConfig, CliError> {
    let (sizes, sizes_flag) = sizes_of(args)?.unwrap_or_else(|| (default_sizes(), "--sizes"));
    Ok(crate::bench::BenchConfig {
        world,
        dtype: args.dtype,
        op: args.op,
        sizes,
        sizes_flag,
        algorithms: args.algos.clone(),
        quantized: args.quantize.clone().unwrap_or_default(),
        iters: args.iters as usize,
        warmup: args.warmup as usize,
        in_place,
        selector,
        bind: args.bind,
    })
}

fn default_world() -> u16 {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8) as u16)
}

fn parse_dtype(s: &str) -> Result<DataType, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_op(s: &str) -> Result<ReduceOp, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

fn parse_algo(s: &str) -> Result<Algorithm, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

/// `--quantize`: a format name, as its quantized algorithm.
fn parse_quantize(s: &str) -> Result<Algorithm, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "fp8" | "e4m3" | "fp8-e4m3" => Ok(Algorithm::TwoShotFp8),
        "int8" => Ok(Algorithm::TwoShotInt8),
        _ => Err(format!("{s:?} is not a quantization format (fp8, int8)")),
    }
}

/// An error for the user: one line, and a hint where one helps.
struct CliError {
    message: String,
    hint: Option<String>,
}

impl From<Error> for CliError {
    fn from(e: Error) -> Self {
        let hint = match &e {
            // A flag's value out of range: the flag is the error's source.
            Error::Config { source_name, .. } if source_name.starts_with("--") => {
                Some(format!("`anyccl bench --help` lists {source_name} and its limits"))
            }
            _ => e.hint(),
        };
        CliError { hint, message: e.to_string() }
    }
}

impl CliError {
    /// The error with `hint` instead of the library's.
    fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

/// `s` on one short line: control characters escaped (messages quote paths and values from the user, and a file
/// name may hold a newline) and any word longer than [`MAX_WORD`] characters cut in the middle (a 10 000-digit
/// `--sizes` value is not repeated in full).
fn one_line(s: &str) -> String {
    // Escaping is core's (control, bidirectional-override and separator characters); the line cap comes below.
    anyccl::core::text::sanitize_with_limit(s, usize::MAX)
        .split(' ')
        .map(|w| {
            let n = w.chars().count();
            if n <= MAX_WORD {
                w.to_owned()
            } else {
                let head: String = w.chars().take(MAX_WORD / 2).collect();
                let tail: String = w.chars().skip(n - MAX_WORD / 2).collect();
                format!("{head}…{tail}")
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .take(MAX_LINE)
        .collect()
}

/// The longest word [`one_line`] prints whole.
const MAX_WORD: usize = 200;
/// The longest line [`one_line`] prints (in characters).
const MAX_LINE: usize = 2000;

/// The selector from the environment (`ANYCCL_ALLREDUCE_ALGO`, `ANYCCL_TUNE_FILE`) and `--table`; a table file's
/// error gets the hint for how that file was named.
fn selector(table: Option<&PathBuf>) -> Result<Selector, CliError> {
    let s = Selector::from_env().map_err(|e| {
        let from_table_file = matches!(&e, Error::Config { source_name, .. }
            if source_name != anyccl::core::selector::ENV_FORCE_ALGO);
        let e = CliError::from(e);
        if from_table_file {
            e.with_hint("fix the table file named by ANYCCL_TUNE_FILE (docs/configuration.md), or unset the variable")
        } else {
            e
        }
    })?;
    Ok(match table {
        Some(p) => s.with_table_file(p, "--table").map_err(|e| {
            CliError::from(e).with_hint("fix the table file given to --table (docs/configuration.md), or drop --table")
        })?,
        None => s,
    })
}

/// The capabilities `ANYCCL_DISABLE` turns off (`anyccl::core::caps::disabled_by_env`). `probe` reports an invalid
/// value as a warning; `bench` and `tune` refuse it, since they would otherwise run what the user meant to switch off.
fn disabled_by_env() -> Result<anyccl::Capabilities, CliError> {
    Ok(anyccl::core::caps::disabled_by_env()?)
}

/// Refuses a backend whose capability `ANYCCL_DISABLE` names.
fn refuse_if_disabled(disabled: anyccl::Capabilities, cap: anyccl::Capabilities) -> Result<(), CliError> {
    if !disabled.contains(cap) {
        return Ok(());
    }
    let name = cap.name().unwrap_or("backend");
    Err(CliError {
        message: format!("{name} is turned off by ANYCCL_DISABLE, so there is nothing to run on"),
        hint: Some(format!("remove {name} from ANYCCL_DISABLE (or unset it); `anyccl probe` shows what is on")),
    })
}

/// Checks before a sweep that `path` can be written (so a bad path fails at once, not after the sweep).
fn check_output(path: &std::path::Path, flag: &str, what: &str) -> Result<(), CliError> {
    crate::output::check_writable(path, flag, what)
        .map_err(|e| CliError::from(e).with_hint(format!("give {flag} a writable path to a regular file")))
}

fn probe(json: bool, table: Option<&PathBuf>) -> Result<(), CliError> {
    let report = anyccl::report::MachineReport::probe(&selector(table)?);
    // The drop-in libnccl, if one is in a place `dropin` looks at (after the report: it may load the same NCCL).
    let dropin = dropin::probe();
    let out = if json {
        let json_error = |e: serde_json::Error| CliError { message: e.to_string(), hint: None };
        let mut v = serde_json::to_value(&report).map_err(json_error)?;
        // One key beside the library's report (whose schema lives in the facade): the drop-in is the command's.
        if let Some(o) = v.as_object_mut() {
            o.insert("dropin".to_owned(), dropin.to_json());
        }
        serde_json::to_string_pretty(&v).map_err(json_error)? + "\n"
    } else {
        probe::render_text(&report) + &dropin.render_text()
    };
    print_out(&out)
}

fn print_out(s: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
        // A closed pipe (`anyccl probe | head`) is not an error worth reporting.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError { message: format!("cannot write to stdout: {e}"), hint: None })
        }
        _ => Ok(()),
    }
}

/// The backend a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Host,
    Cuda,
    Rocm,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
            Backend::Rocm => "rocm",
        }
    }

    fn capability(self) -> anyccl::Capabilities {
        match self {
            Backend::Host => anyccl::Capabilities::HOST_BACKEND,
            Backend::Cuda => anyccl::Capabilities::CUDA_RUNTIME,
            Backend::Rocm => anyccl::Capabilities::HIP_RUNTIME,
        }
    }

    /// The vendor a tuned table's rules name for this backend.
    fn vendor(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "nvidia",
            Backend::Rocm => "amd",
        }
    }

    #[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
    fn kind(self) -> anyccl::dynamic::BackendKind {
        use anyccl::dynamic::BackendKind;
        match self {
            Backend::Host => BackendKind::Host,
            Backend::Cuda => BackendKind::Cuda,
            Backend::Rocm => BackendKind::Rocm,
        }
    }

    /// Why this backend cannot run here (the library's chooser's reasons), or `None`.
    fn unavailable(self, disabled: anyccl::Capabilities) -> Option<String> {
        #[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
        {
            anyccl::dynamic::unavailable(self.kind(), 1, disabled)
        }
        #[cfg(not(any(feature = "host", feature = "cuda", feature = "rocm")))]
        {
            let _ = disabled;
            Some(format!("not compiled into this build (cargo feature `{}`)", self.name()))
        }
    }
}

/// The backend `args` asks for, or the best available: cuda, then rocm, each where compiled in, present and not
/// turned off by `ANYCCL_DISABLE`, else host. Refuses what cannot run, with the reason.
fn choose_backend(args: &BenchArgs, disabled: anyccl::Capabilities) -> Result<Backend, CliError> {
    let order: &[Backend] = match args.backend {
        Some(BackendArg::Host) => &[Backend::Host],
        Some(BackendArg::Cuda) => &[Backend::Cuda],
        Some(BackendArg::Rocm) => &[Backend::Rocm],
        None => &[Backend::Cuda, Backend::Rocm, Backend::Host],
    };
    let mut passed_over = Vec::new();
    for &b in order {
        match b.unavailable(disabled) {
            None => return Ok(b),
            Some(why) => passed_over.push((b, why)),
        }
    }
    // The last one tried is the one asked for, or the host fallback: its reason decides the message.
    let Some(&(last, _)) = passed_over.last() else {
        return Err(CliError { message: "no backend to run on".into(), hint: None });
    };
    refuse_if_disabled(disabled, last.capability())?;
    if !compiled_in(last) {
        return Err(CliError {
            message: format!("the {} backend is not compiled into this build", last.name()),
            hint: Some(format!("rebuild with `--features {}`, or use `--backend host`", last.name())),
        });
    }
    let why: Vec<String> = passed_over.iter().map(|(b, w)| format!("{}: {w}", b.name())).collect();
    Err(CliError {
        message: match args.backend {
            Some(_) => format!("the {} backend is unavailable: {}", last.name(), passed_over[0].1),
            None => format!("no backend can run here ({})", why.join("; ")),
        },
        hint: Some("run `anyccl probe` for details, or use `--backend host`".into()),
    })
}

fn compiled_in(b: Backend) -> bool {
    match b {
        Backend::Host => cfg!(feature = "host"),
        Backend::Cuda => cfg!(feature = "cuda"),
        Backend::Rocm => cfg!(feature = "rocm"),
    }
}

/// A sweep's outcome for the command: printed (on rank 0), and an error when any result was wrong.
struct Finished {
    report: crate::bench::BenchReport,
    /// Whether this process prints (every process of a threads run; rank 0 of a `--per-rank` job).
    prints: bool,
    /// Rank 0's architecture, for the tuned table's rules (`host`, `gfx942`, `sm_90`).
    arch: String,
}

/// Runs the sweep `args` describe (with `in_place` columns or not) on `backend`.
#[cfg_attr(not(any(feature = "host", feature = "cuda", feature = "rocm")), allow(unused_variables))]
fn sweep(
    args: &BenchArgs,
    backend: Backend,
    selector: Selector,
    in_place: bool,
    world: Option<usize>,
) -> Result<Finished, CliError> {
    let selector = Arc::new(selector);
    match backend {
        #[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
        Backend::Host | Backend::Cuda | Backend::Rocm => {
            use crate::bench_any::Timing;
            let kind = backend.kind();
            let (timing, default_sizes): (Timing, fn() -> Vec<u64>) = match backend {
                Backend::Host => (Timing::Barriers, crate::bench::default_host_sizes),
                _ if args.eager => (Timing::Eager, crate::bench::default_gpu_sizes),
                _ => (Timing::Graph, crate::bench::default_gpu_sizes),
            };
            if args.per_rank {
                let joined = anyccl::dynamic::from_env(kind.into(), selector.clone()).map_err(per_rank_error)?;
                let (c, boot) = (joined.comm, joined.bootstrap);
                let arch = c.arch().to_owned();
                let (rank, cfg) = per_rank_config(args, c.rank(), c.world_size(), default_sizes, selector, in_place)?;
                let report = with_progress(rank == 0, |p| crate::bench_any::run_processes(c, boot, &cfg, timing, p))?;
                return Ok(Finished { report, prints: rank == 0, arch });
            }
            let default_world = match backend {
                Backend::Host => usize::from(default_world()),
                // Every GPU (the chooser has checked there is at least one).
                _ => anyccl::dynamic::device_count(kind).unwrap_or(1).max(1),
            };
            let world = world.unwrap_or_else(|| args.world.map_or(default_world, usize::from));
            let cfg = config(args, world, default_sizes, selector, in_place)?;
            cfg.check(crate::bench_any::limits(kind))?;
            let m = with_progress(true, |p| crate::bench_any::run(kind, &cfg, timing, p, None))?;
            Ok(Finished { report: m.report, prints: true, arch: m.arch })
        }
        #[allow(unreachable_patterns)]
        other => Err(CliError {
            message: format!("the {} backend is not compiled into this build", other.name()),
            hint: Some(format!("rebuild with `--features {}`, or use `--backend host`", other.name())),
        }),
    }
}

/// A `--per-rank` rank's configuration: the world is the launcher's (a `--world` must match it).
fn per_rank_config(
    args: &BenchArgs,
    rank: usize,
    world: usize,
    default_sizes: fn() -> Vec<u64>,
    selector: Arc<Selector>,
    in_place: bool,
) -> Result<(usize, crate::bench::BenchConfig), CliError> {
    if let Some(w) = args.world.filter(|&w| usize::from(w) != world) {
        return Err(CliError {
            message: format!("--world {w} differs from the launcher's WORLD_SIZE ({world})"),
            hint: Some("with --per-rank the launcher sets the world; drop --world or make them agree".into()),
        });
    }
    Ok((rank, config(args, world, default_sizes, selector, in_place)?))
}

/// An error joining a `--per-rank` job, with the hint for how such jobs start.
fn per_rank_error(e: Error) -> CliError {
    let launcher = matches!(&e, Error::Config { source_name, .. } if source_name.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
    let e = CliError::from(e);
    if launcher {
        e.with_hint(
            "--per-rank runs one process per rank under a launcher: `torchrun --nproc-per-node N anyccl bench \
             --per-rank` (or srun), which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
        )
    } else {
        e
    }
}

/// Fails when any result of `report` was wrong, naming the first cells and how many.
fn verdict(report: &crate::bench::BenchReport) -> Result<(), CliError> {
    if report.wrong == 0 {
        return Ok(());
    }
    let cells = report.wrong_cells();
    let first: Vec<String> = cells
        .iter()
        .take(3)
        .map(|(bytes, place, algo, n)| {
            format!("{} {place} of place, {algo}: {n}", anyccl::core::units::format_bytes(*bytes))
        })
        .collect();
    let more = if cells.len() > 3 { format!(" and {} more", cells.len() - 3) } else { String::new() };
    Err(CliError {
        message: format!(
            "{} elements of the results were wrong, in {} cells ({}{more})",
            report.wrong,
            cells.len(),
            first.join("; ")
        ),
        hint: Some(
            "a wrong all-reduce is a bug in anyccl or the vendor library; `--json` gives every cell's count".into(),
        ),
    })
}

fn bench(mut args: BenchArgs) -> Result<(), CliError> {
    dedup_algos(&mut args);
    let disabled = disabled_by_env()?;
    if let Some(p) = &args.plot {
        crate::plot::check_path(p)?;
        check_output(p, "--plot", "the plot")?;
    }
    // A bad -b/-e/-f fails before anything is set up.
    sizes_of(&args)?;
    let backend = choose_backend(&args, disabled)?;
    let sel = selector(args.table.as_ref())?;
    if args.fused.is_some() {
        return bench_fused(&args, backend, sel);
    }
    let done = sweep(&args, backend, sel, true, None)?;
    if done.prints {
        if backend == Backend::Host && args.backend.is_none() && !(args.json || args.csv) {
            eprintln!("no GPU backend is available in this build; ran on the host backend (`anyccl probe` says why)");
        }
        if let Some(p) = &args.plot {
            crate::plot::plot(&done.report, p)?;
        }
        print_report(&done.report, args.json, args.csv)?;
    }
    verdict(&done.report)
}

/// The measurement `bench` and `tune --fused rmsnorm` make: each form per token count on `backend`, with the
/// selector `selector` builds. Measures `--world` ranks (default: the host's default world, or every device of
/// `backend`) of the type, row size, token counts and call counts of `args`; bad sizes fail before anything is set
/// up, the selector included.
#[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
fn measure_fused(
    args: &BenchArgs,
    backend: Backend,
    selector: impl FnOnce() -> Result<Selector, CliError>,
) -> Result<crate::bench_fused::FusedReport, CliError> {
    let world = match (args.world, backend) {
        (Some(w), _) => usize::from(w),
        (None, Backend::Host) => usize::from(default_world()),
        (None, _) => anyccl::dynamic::device_count(backend.kind()).unwrap_or(1).max(1),
    };
    let cfg = crate::bench_fused::FusedConfig {
        world,
        dtype: args.dtype,
        hidden: args.hidden,
        tokens: args.tokens.clone(),
        iters: args.iters as usize,
        warmup: args.warmup as usize,
    };
    cfg.calls()?;
    Ok(crate::bench_fused::run(backend.kind(), &cfg, Arc::new(selector()?))?)
}

/// `anyccl bench --fused rmsnorm`: each form per token count, the table (or JSON), non-zero when a result is wrong.
fn bench_fused(args: &BenchArgs, backend: Backend, selector: Selector) -> Result<(), CliError> {
    #[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
    {
        let report = measure_fused(args, backend, || Ok(selector))?;
        let out = if args.json {
            serde_json::to_string_pretty(&report).map_err(|e| CliError { message: e.to_string(), hint: None })? + "\n"
        } else {
            crate::bench_fused::render_table(&report)
        };
        print_out(&out)?;
        if report.wrong > 0 {
            return Err(CliError {
                message: format!("{} elements of the fused all-reduce + RMSNorm results were wrong", report.wrong),
                hint: Some("the #wrong column shows the cells; rerun with --json for every cell".into()),
            });
        }
        Ok(())
    }
    #[cfg(not(any(feature = "host", feature = "cuda", feature = "rocm")))]
    {
        let _ = (args, selector);
        Err(CliError {
            message: format!("the {} backend is not compiled into this build", backend.name()),
            hint: Some("rebuild with `--features host`".into()),
        })
    }
}

/// `anyccl tune --fused rmsnorm`: measures each form per token count ([`bench_fused`]) and writes one
/// `fused_rmsnorm` rule per token count, fastest form first; the table is read back before it is written.
fn tune_fused(out: &std::path::Path, args: &BenchArgs) -> Result<(), CliError> {
    #[cfg(any(feature = "host", feature = "cuda", feature = "rocm"))]
    {
        let disabled = disabled_by_env()?;
        let backend = choose_backend(args, disabled)?;
        check_output(out, "--out", "the tuned table")?;
        let report = measure_fused(args, backend, || selector(args.table.as_ref()))?;
        print_out(&crate::bench_fused::render_table(&report))?;
        if report.wrong > 0 {
            return Err(CliError {
                message: format!("{} elements of the fused results were wrong; no table written", report.wrong),
                hint: None,
            });
        }
        let text = crate::bench_fused::table_text(&report, backend.vendor())?;
        crate::tune::write_table(out, &text)
            .map_err(|e| CliError::from(e).with_hint("give --out a writable path to a regular file"))?;
        println!("wrote {} ({} token counts, world {})", out.display(), report.rows.len(), report.world);
        print!("{text}");
        Ok(())
    }
    #[cfg(not(any(feature = "host", feature = "cuda", feature = "rocm")))]
    {
        let _ = (out, args);
        Err(CliError { message: "no backend is compiled into this build".into(), hint: None })
    }
}

/// Each algorithm once, in the order first given (`--algos ring,ring` measures ring once).
fn dedup_algos(args: &mut BenchArgs) {
    if let Some(a) = &mut args.algos {
        let mut seen = Vec::new();
        a.retain(|x| {
            let new = !seen.contains(x);
            seen.push(*x);
            new
        });
    }
}

fn print_report(report: &crate::bench::BenchReport, json: bool, csv: bool) -> Result<(), CliError> {
    print_out(&render(report, json, csv)?)
}

fn render(report: &crate::bench::BenchReport, json: bool, csv: bool) -> Result<String, CliError> {
    let out = if json {
        serde_json::to_string_pretty(report).map_err(|e| CliError { message: e.to_string(), hint: None })? + "\n"
    } else if csv {
        crate::bench::render_csv(report)
    } else {
        crate::bench::render_table(report)
    };
    Ok(out)
}

/// Runs the sweep twice: once to pick the winners, once with the written table to check `auto`. Exits non-zero
/// when a result is wrong or the check fails (the table stays written).
fn tune(out: &std::path::Path, mut args: BenchArgs) -> Result<(), CliError> {
    dedup_algos(&mut args);
    if args.fused.is_some() {
        return tune_fused(out, &args);
    }
    if args.per_rank {
        return Err(CliError {
            message: "tune does not take --per-rank (it measures one process's ranks)".into(),
            hint: Some("run `anyccl tune` without --per-rank, or `anyccl bench --per-rank` to measure".into()),
        });
    }
    let disabled = disabled_by_env()?;
    sizes_of(&args)?;
    let backend = choose_backend(&args, disabled)?;
    #[cfg(feature = "host")]
    if backend == Backend::Host {
        crate::tune::check_measurable(args.algos.as_deref(), &anyccl::host::ALGORITHMS, "host")?;
    }
    check_output(out, "--out", "the tuned table")?;
    let base = selector(args.table.as_ref())?;
    let first = sweep(&args, backend, base.clone(), false, None)?;
    let arch = first.arch;
    let first = first.report;
    verdict(&first)?;
    // Each rule falls back to the vendor library's all-reduce (ring on the host, which has none).
    let fallback = if backend == Backend::Host { anyccl::Algorithm::Ring } else { anyccl::Algorithm::Ccl };
    let text = crate::tune::table_text(&first, backend.vendor(), &arch, fallback)?;
    crate::tune::write_table(out, &text)
        .map_err(|e| CliError::from(e).with_hint("give --out a writable path to a regular file"))?;
    println!(
        "wrote {} ({} sizes measured on the {} backend, world {})",
        out.display(),
        first.rows.len(),
        first.backend,
        first.world
    );
    print!("{text}");
    let tuned = base
        .with_table_file(out, "anyccl tune")
        .map_err(|e| CliError::from(e).with_hint("the table just written could not be read back; run tune again"))?;
    let second = sweep(&args, backend, tuned, false, Some(first.world))?.report;
    verdict(&second)?;
    println!(
        "\ncheck: auto with the tuned table against the best algorithm of the same run (tolerance {:.0}%)",
        crate::tune::TOLERANCE * 100.0
    );
    let rows = crate::tune::check(&second, &out.display().to_string());
    for r in &rows {
        let verdict = match (r.followed_table, r.fast) {
            (true, true) => "ok",
            (true, false) => "SLOWER",
            (false, _) => "NOT THE TUNED TABLE'S CHOICE",
        };
        println!(
            "  {:>10}  auto {:<14} {:>9.1} us   best {:<14} {:>9.1} us   {verdict}",
            anyccl::core::units::format_bytes(r.bytes),
            r.auto.name(),
            r.auto_us,
            r.best.name(),
            r.best_us,
        );
    }
    let slow = rows.iter().filter(|r| !r.ok).count();
    println!("check: {} of {} sizes within {:.0}%", rows.len() - slow, rows.len(), crate::tune::TOLERANCE * 100.0);
    match crate::tune::failure(&rows) {
        None => Ok(()),
        Some(why) => Err(CliError {
            message: why,
            hint: Some(format!(
                "the table is written ({}); run tune again with more --iters on a quieter machine, and unset \
                 ANYCCL_ALLREDUCE_ALGO, which overrides every table",
                out.display()
            )),
        }),
    }
}

/// Runs `run` with a progress bar on stderr when `show` (rank 0), stderr is a terminal, and the sweep takes longer
/// than [`crate::bench::PROGRESS_AFTER`].
fn with_progress<T>(
    show: bool,
    run: impl FnOnce(crate::bench::Progress<'_>) -> anyccl::Result<T>,
) -> Result<T, CliError> {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    use std::sync::Mutex;
    let start = std::time::Instant::now();
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
    if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} cells {eta}") {
        bar.set_style(style);
    }
    let shown = Mutex::new(false);
    let tty = show && std::io::stderr().is_terminal();
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
        let mut s = shown.lock().unwrap_or_else(|e| e.into_inner());
        if tty && !*s && start.elapsed() >= crate::bench::PROGRESS_AFTER && done < total {
            bar.set_draw_target(ProgressDrawTarget::stderr());
            *s = true;
        }
    };
    let r = run(&progress);
    bar.finish_and_clear();
    Ok(r?)
}

/// clap's error on one line: its first paragraph (a first line ending in `:` continues with the arguments it
/// names, as in "the following required arguments were not provided: --maxbytes <SIZE>").
fn clap_summary(rendered: &str) -> String {
    let first: Vec<&str> = rendered.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
    let text = if first.first().is_some_and(|l| l.ends_with(':')) {
        first.join(" ")
    } else {
        first.first().map_or_else(String::new, |l| (*l).to_owned())
    };
    let text = text.strip_prefix("error: ").unwrap_or(&text).to_owned();
    if text.is_empty() {
        "invalid arguments".into()
    } else {
        text
    }
}

/// Logging to stderr, filtered by `ANYCCL_LOG` (default `warn`). An invalid value is not fatal: one warning
/// naming the variable and the parse error, then the default.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    const VAR: &str = "ANYCCL_LOG";
    const DEFAULT: &str = "warn";
    let filter = match std::env::var(VAR) {
        Ok(v) if !v.trim().is_empty() => match EnvFilter::builder().parse(&v) {
            Ok(f) => f,
            Err(e) => {
                let shown: String = v.chars().take(80).collect();
                let more = if shown.len() < v.len() { "…" } else { "" };
                eprintln!(
                    "warning: {VAR}={} is not a valid log filter ({}); logging at the default level, {DEFAULT}",
                    one_line(&format!("{shown:?}{more}")),
                    one_line(&e.to_string())
                );
                EnvFilter::new(DEFAULT)
            }
        },
        Ok(_) | Err(std::env::VarError::NotPresent) => EnvFilter::new(DEFAULT),
        Err(std::env::VarError::NotUnicode(_)) => {
            eprintln!("warning: {VAR} is not a valid log filter (not UTF-8); logging at the default level, {DEFAULT}");
            EnvFilter::new(DEFAULT)
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    init_logging();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(2);
            }
            // One clear line instead of clap's multi-line block, then a hint.
            let rendered = e.render().to_string();
            eprintln!("error: {}", one_line(&clap_summary(&rendered)));
            eprintln!("hint: run `anyccl --help` (or `anyccl <command> --help`) for the accepted flags");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Probe { json, table } => probe(json, table.as_ref()),
        Command::Bench(args) => bench(args),
        Command::Tune { out, bench } => tune(&out, bench),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e.message));
            if let Some(h) = e.hint {
                eprintln!("hint: {}", one_line(&h));
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use proptest::strategy::Strategy;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn messages_stay_on_one_short_line() {
        assert_eq!(one_line("a\nb\tc\u{1b}[31m"), "a\\nb\\tc\\u{1b}[31m");
        let long = format!("'{}' for --sizes", "9".repeat(10_000));
        let shown = one_line(&long);
        assert!(shown.len() < 300 && shown.ends_with("for --sizes") && shown.contains('…'), "{shown}");
        assert_eq!(one_line("error: plain words stay"), "error: plain words stay");
        assert!(one_line(&"ab ".repeat(10_000)).chars().count() <= MAX_LINE);
    }

    fn bench_args(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        let cli = Cli::try_parse_from(["anyccl", "bench"].iter().chain(args))?;
        match cli.command {
            Command::Bench(a) => Ok(a),
            other => panic!("{other:?}"),
        }
    }

    /// nccl-tests' `-b 8 -e 128M -f 2` parses to the sweep it means there; the long names are aliases; the
    /// flags need each other and exclude --sizes.
    #[test]
    fn nccl_tests_short_flags() {
        let a = bench_args(&["-b", "8", "-e", "128M", "-f", "2"]).expect("parses");
        assert_eq!((a.minbytes, a.maxbytes, a.stepfactor), (Some(8), Some(128 << 20), Some(2)));
        let (sizes, flag) = sizes_of(&a).ok().flatten().expect("a sweep");
        assert_eq!((sizes.len(), sizes[0], sizes[24], flag), (25, 8, 128 << 20, "-b/-e/-f"));
        let a = bench_args(&["--minbytes", "1KiB", "--maxbytes", "4KiB"]).expect("parses");
        assert_eq!(sizes_of(&a).ok().flatten().map(|s| s.0), Some(vec![1024, 2048, 4096]), "factor 2 by default");
        assert!(sizes_of(&bench_args(&[]).expect("parses")).ok().flatten().is_none(), "the backend's default");
        for bad in [
            &["-b", "8"][..],
            &["-e", "8"],
            &["-f", "2"],
            &["-b", "8", "-e", "16", "--sizes", "8"],
            &["-b", "8", "-e", "8", "-f", "1"],
        ] {
            assert!(bench_args(bad).is_err(), "{bad:?}");
        }
    }

    /// A wrong result (here one element of rank 0's out-of-place ring output, changed after the call) fails the
    /// command with the count and the cell named; an untouched run passes.
    #[cfg(feature = "host")]
    #[test]
    fn wrong_results_fail_the_command() {
        use crate::bench::{run_host_with, smoke_config, CellId};
        let mut cfg = smoke_config(Arc::new(Selector::defaults()));
        cfg.algorithms = Some(vec![Algorithm::Ring]);
        cfg.sizes = vec![4096];
        let target = CellId { rank: 0, bytes: 4096, algorithm: Some(Algorithm::Ring), in_place: false };
        let tamper = |id: CellId, out: &mut [u8]| {
            if id == target {
                out[8] ^= 1;
            }
        };
        let r = run_host_with(&cfg, &|_, _| {}, Some(&tamper)).expect("runs");
        let e = verdict(&r).expect_err("a wrong result fails the command");
        assert!(
            e.message.contains("1 elements of the results were wrong, in 1 cells (4 KiB out of place, ring: 1)"),
            "{}",
            e.message
        );
        assert!(verdict(&run_host_with(&cfg, &|_, _| {}, None).expect("runs")).is_ok());
    }

    proptest::proptest! {
        /// -b and -e take exactly what --sizes takes (the same parser), whatever the text.
        #[test]
        fn short_flags_parse_sizes_like_sizes(n in 0u64..(1 << 34), unit in "(|B|K|KiB|M|MiB|G|GiB|KB|MB|GB|x)") {
            let text = format!("{n}{unit}");
            let parsed = bench_args(&["-b", &text, "-e", &text]);
            match parse_bytes(&text) {
                Ok(v) => {
                    let a = parsed.expect("parses");
                    proptest::prop_assert_eq!((a.minbytes, a.maxbytes), (Some(v), Some(v)));
                    let sweep = sizes_of(&a).ok().flatten().map(|s| s.0);
                    proptest::prop_assert_eq!(sweep, (v > 0).then(|| vec![v]));
                }
                Err(_) => proptest::prop_assert!(parsed.is_err()),
            }
        }

        /// The whole command line parser: arbitrary arguments never panic it (clap reports, never aborts).
        #[test]
        fn argument_parser_never_panics(args in proptest::collection::vec(proptest::prop_oneof![
            proptest::strategy::Just("bench".to_owned()),
            proptest::strategy::Just("tune".to_owned()),
            proptest::strategy::Just("probe".to_owned()),
            "--(sizes|world|iters|warmup|dtype|op|algos|table|plot|out|backend|json|csv|graph|eager|per-rank|minbytes|maxbytes|stepfactor)".prop_map(String::from),
            "-[bef]".prop_map(String::from),
            "\\PC{0,12}",
            "-?[0-9]{1,25}(KiB|GiB|B)?",
        ], 0..8)) {
            let _ = Cli::try_parse_from(std::iter::once("anyccl".to_owned()).chain(args));
        }
    }
}
