//! Choosing the all-reduce algorithm: (vendor, arch, world, bytes, dtype, capturing) → algorithm.
//!
//! A [`SelectorTable`] is an ordered list of [`Rule`]s. The first rule that matches the call names the algorithms
//! to try in order; the first one the backend finds eligible runs. Rules from a table file (`ANYCCL_TUNE_FILE`, or
//! the table `anyccl tune` writes) come before the defaults, so they override them. `ANYCCL_ALLREDUCE_ALGO` forces
//! one algorithm: if it cannot run a call, that call fails with a clear error rather than silently falling back.
//!
//! Lossy algorithms (the quantized two-shots, [`Algorithm::is_lossy`]) run only where they are named: forced, in a
//! table rule, or passed to `Communicator::all_reduce_with`; the defaults never name them and the fallback skips
//! them.
//!
//! Deterministic mode (`ANYCCL_DETERMINISTIC=1`, [`Selector::with_deterministic`], or per communicator
//! `Communicator::set_deterministic`): only algorithms that sum in rank order ([`Algorithm::nondeterministic`] is
//! `None`: one-shot, two-shot) run. A rule's other algorithms are skipped, and the selection's `why` names them; when
//! a rule yields none, two-shot then one-shot are tried; when neither can run the call (custom kernels off, the
//! message above their staging size), the call fails with [`Error::NoEligibleAlgorithm`] listing every reason,
//! rather than running something whose result could differ. A forced algorithm that is not deterministic is an
//! error in deterministic mode.
//!
//! # Table file format (TOML)
//!
//! ```toml
//! version = 1                      # optional; 1 is the only version
//!
//! [[rule]]
//! vendor = ["nvidia"]              # optional: host, nvidia, amd (a string or a list)
//! arch = "sm_90"                   # optional: the backend's architecture name
//! world = "2-8"                    # optional: 4, "2-8" or "4-" (inclusive)
//! bytes = "0-512KiB"               # optional: "[min]-[max]", min inclusive, max exclusive
//! dtype = ["bf16", "f16"]          # optional
//! capturing = true                 # optional: only inside (true) or outside (false) graph capture
//! algorithms = ["one-shot", "two-shot"]   # tried in order (all-reduce)
//! fused_rmsnorm = ["fused-two-shot", "fused-one-shot"]  # tried in order (fused all-reduce + RMSNorm)
//! ```
//!
//! A rule names `algorithms`, `fused_rmsnorm`, or both (at least one). `algorithms` apply to all-reduce calls;
//! `fused_rmsnorm` (added after version 1 shipped; files without it parse as before) applies to
//! [`crate::Communicator::all_reduce_rmsnorm`], whose `bytes` is the input's size (`tokens × hidden` elements),
//! and lists forms by the names of [`RmsNormForm`]: `fused-one-shot`, `fused-two-shot`, `unfused`. The overlap
//! check applies among the all-reduce rules and among the fused rules separately.
//!
//! # The fused all-reduce + RMSNorm
//!
//! Its form is chosen by, in order: the call's own ([`crate::fused::RmsNormSpec::form`]);
//! `ANYCCL_FUSED_RMSNORM` ([`Selector::with_fused_forced`]); the first matching table rule with `fused_rmsnorm`
//! whose form the backend finds eligible; the default rule ([`default_rmsnorm_forms`]). A forced form the backend
//! cannot run is an error, never a silent change. Every form sums in rank order (see [`crate::fused`]), so
//! deterministic mode skips none; the backend still sees the mode ([`crate::fused::RmsNormCall::deterministic`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::algo::{Algorithm, Vendor};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::fused::{RmsNormCall, RmsNormForm, RmsNormSelection, ENV_FUSED_RMSNORM};
use crate::units::{format_bytes, parse_bytes};

/// The environment variable that forces one all-reduce algorithm.
pub const ENV_FORCE_ALGO: &str = "ANYCCL_ALLREDUCE_ALGO";
/// The environment variable naming a selector table file.
pub const ENV_TABLE_FILE: &str = "ANYCCL_TUNE_FILE";
/// The environment variable that turns deterministic mode on (`1`, `true`, `on`, `yes`) or off (`0`, `false`,
/// `off`, `no`, empty); see the module documentation.
pub const ENV_DETERMINISTIC: &str = "ANYCCL_DETERMINISTIC";

/// What the selector knows about one all-reduce call.
///
/// Not `#[non_exhaustive]`: callers of [`Selector::select`] build one with a literal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SelectionQuery<'a> {
    /// The backend's vendor.
    pub vendor: Vendor,
    /// The backend's architecture name (`"sm_90"`, `"gfx942"`, `"host"`).
    pub arch: &'a str,
    /// Number of ranks.
    pub world: usize,
    /// Message size in bytes (count × element size).
    pub bytes: u64,
    /// Element type.
    pub dtype: DataType,
    /// Whether the stream is being captured into a graph.
    pub capturing: bool,
}

/// The outcome of a selection: which algorithm, and the rule (or override) that chose it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Selection {
    /// The algorithm that runs.
    pub algorithm: Algorithm,
    /// Why: the rule and its origin, or the override (shared, so selecting allocates nothing).
    pub why: Arc<str>,
}

/// One row of a selector table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    /// Vendors the rule applies to (empty: any).
    pub vendors: Vec<Vendor>,
    /// Architecture the rule applies to (`None`: any).
    pub arch: Option<String>,
    /// Smallest world size (inclusive).
    pub world_min: usize,
    /// Largest world size (inclusive).
    pub world_max: usize,
    /// Smallest message in bytes (inclusive).
    pub bytes_min: u64,
    /// Message bound in bytes (exclusive; `None`: unbounded).
    pub bytes_max: Option<u64>,
    /// Element types (empty: any).
    pub dtypes: Vec<DataType>,
    /// Capture state (`None`: either).
    pub capturing: Option<bool>,
    /// Algorithms to try, in order (empty: the rule is for the fused call only).
    pub algorithms: Vec<Algorithm>,
    /// Forms of the fused all-reduce + RMSNorm to try, in order (empty: the rule is for all-reduce only).
    pub fused: Vec<RmsNormForm>,
    /// Where the rule came from (`"defaults #3"`, `"tune.toml:12"`).
    pub origin: String,
    /// The rule as text, made once (what [`Selection::why`] shares).
    #[serde(skip)]
    label: Arc<str>,
}

impl Rule {
    /// Fills the shared label from the rule's fields (after construction or change).
    fn labelled(mut self) -> Self {
        self.label = Arc::from(self.to_string());
        self
    }

    /// Whether some call could match both `self` and `other`.
    pub fn overlaps(&self, other: &Rule) -> bool {
        let vendors = self.vendors.is_empty()
            || other.vendors.is_empty()
            || self.vendors.iter().any(|v| other.vendors.contains(v));
        let arch = match (&self.arch, &other.arch) {
            (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
            _ => true,
        };
        let world = self.world_min <= other.world_max && other.world_min <= self.world_max;
        let dtypes =
            self.dtypes.is_empty() || other.dtypes.is_empty() || self.dtypes.iter().any(|d| other.dtypes.contains(d));
        let capturing = match (self.capturing, other.capturing) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        let below = |max: Option<u64>, min: u64| max.is_some_and(|m| m <= min);
        let bytes = !below(self.bytes_max, other.bytes_min) && !below(other.bytes_max, self.bytes_min);
        vendors && arch && world && dtypes && capturing && bytes
    }

    /// Whether the rule applies to `q`.
    pub fn matches(&self, q: &SelectionQuery<'_>) -> bool {
        (self.vendors.is_empty() || self.vendors.contains(&q.vendor))
            && self.arch.as_deref().is_none_or(|a| a.eq_ignore_ascii_case(q.arch))
            && (self.world_min..=self.world_max).contains(&q.world)
            && q.bytes >= self.bytes_min
            && self.bytes_max.is_none_or(|m| q.bytes < m)
            && (self.dtypes.is_empty() || self.dtypes.contains(&q.dtype))
            && self.capturing.is_none_or(|c| c == q.capturing)
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.origin)?;
        if !self.vendors.is_empty() {
            let v: Vec<_> = self.vendors.iter().map(|v| v.name()).collect();
            write!(f, "vendor {} ", v.join("|"))?;
        }
        if let Some(a) = &self.arch {
            write!(f, "arch {a} ")?;
        }
        if self.world_min == self.world_max {
            write!(f, "world {} ", self.world_min)?;
        } else if self.world_max == usize::MAX {
            write!(f, "world >= {} ", self.world_min)?;
        } else {
            write!(f, "world {}-{} ", self.world_min, self.world_max)?;
        }
        match self.bytes_max {
            // An exclusive bound one past a round size reads better as an inclusive one.
            Some(m) if m > 0 && !format_bytes(m - 1).contains('.') && format_bytes(m).contains('.') => {
                write!(f, "bytes [{}, {}] ", format_bytes(self.bytes_min), format_bytes(m - 1))?
            }
            Some(m) => write!(f, "bytes [{}, {}) ", format_bytes(self.bytes_min), format_bytes(m))?,
            None if self.bytes_min > 0 => write!(f, "bytes >= {} ", format_bytes(self.bytes_min))?,
            None => {}
        }
        if !self.dtypes.is_empty() {
            let d: Vec<_> = self.dtypes.iter().map(|d| d.name()).collect();
            write!(f, "dtype {} ", d.join("|"))?;
        }
        if let Some(c) = self.capturing {
            write!(f, "{}", if c { "capturing " } else { "eager " })?;
        }
        let a: Vec<_> = self.algorithms.iter().map(|a| a.name()).collect();
        if !a.is_empty() {
            write!(f, "-> {}", a.join(", "))?;
        }
        if !self.fused.is_empty() {
            let sep = if a.is_empty() { "" } else { "; " };
            let forms: Vec<_> = self.fused.iter().map(|a| a.name()).collect();
            write!(f, "{sep}fused_rmsnorm -> {}", forms.join(", "))?;
        }
        Ok(())
    }
}

/// Where a selector's table came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
#[non_exhaustive]
pub enum TableSource {
    /// Built-in defaults only.
    Defaults,
    /// A table file, then the defaults.
    File {
        /// The file.
        path: PathBuf,
        /// How it was named (`ANYCCL_TUNE_FILE` or a flag).
        via: String,
    },
}

impl fmt::Display for TableSource {
    /// `built-in defaults`, or `<path> (via <how>), then the built-in defaults` (as `anyccl probe` prints it).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TableSource::Defaults => f.write_str("built-in defaults"),
            TableSource::File { path, via } => {
                write!(f, "{} (via {via}), then the built-in defaults", path.display())
            }
        }
    }
}

/// An ordered list of rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SelectorTable {
    /// The rules, first match wins.
    pub rules: Vec<Rule>,
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

impl SelectorTable {
    /// The built-in defaults.
    ///
    /// GPU rows follow the thresholds public engines use on H100-class nodes (see `vendor-facts.md`): on NVIDIA the
    /// push one-shot first up to 256 KiB at world ≤ 4 and up to 64 KiB at world 5–8 (where it measured faster than
    /// the one-shot), falling back to the rows below where it cannot run; custom one-shot always at world 2 (up to 64 MiB, where its staging buffers allow), below 512 KiB at world ≤ 4 and below 256 KiB at world ≤ 8;
    /// two-shot above that up to 8 MiB; NVLS multicast at world 4–8 on sm_90 between those; symmetric windows at
    /// world ≥ 4 for large messages; the vendor library otherwise. Host rows come from `anyccl bench` on the
    /// 2-core build machine (docs/benchmarks.md).
    pub fn defaults() -> Self {
        use Algorithm::*;
        let gpu = vec![Vendor::Nvidia, Vendor::Amd];
        let mut rules = Vec::new();
        let mut add = |vendors: Vec<Vendor>,
                       arch: Option<&str>,
                       world: (usize, usize),
                       bytes: (u64, Option<u64>),
                       algorithms: Vec<Algorithm>| {
            let n = rules.len() + 1;
            rules.push(
                Rule {
                    vendors,
                    arch: arch.map(str::to_owned),
                    world_min: world.0,
                    world_max: world.1,
                    bytes_min: bytes.0,
                    bytes_max: bytes.1,
                    dtypes: Vec::new(),
                    capturing: None,
                    algorithms,
                    fused: Vec::new(),
                    origin: format!("defaults #{n}"),
                    label: Arc::from(""),
                }
                .labelled(),
            );
        };
        // Host: one rank needs no exchange; small messages are bound by synchronisation (one-shot has the
        // fewest barriers); from 8 KiB on, memory traffic dominates and two-shot (each rank reduces 1/N) won
        // nearly every size at world 2 and 4 in `anyccl bench` on the 2-core build machine (docs/benchmarks.md).
        add(vec![Vendor::Host], None, (1, 1), (0, None), vec![OneShot, TwoShot, Ring]);
        add(vec![Vendor::Host], None, (2, usize::MAX), (0, Some(8 * KIB)), vec![OneShot, TwoShot, Ring]);
        add(vec![Vendor::Host], None, (2, usize::MAX), (8 * KIB, None), vec![TwoShot, Ring, OneShot]);
        // GPUs.
        // NVIDIA, small messages: the push one-shot first (one write across the links, no barrier round), then the
        // rows below. On one H200 with emulated ranks, push + programmatic dependent launch took 0.39-0.46x the
        // one-shot's time at 2 ranks from 4 to 256 KiB, 0.48-0.61x at 4 ranks from 4 to 256 KiB, and 0.59-0.76x at
        // 8 ranks up to 128 KiB, but 1.04-1.08x at 256 KiB with 8 ranks (docs/benchmarks.md); 3 ranks follow 4,
        // 5-7 follow 8. Where the push one-shot is not set up (ANYCCL_PUSH_MAX_BYTES, its receive buffers) or the
        // message exceeds its limit, one-shot runs.
        add(vec![Vendor::Nvidia], None, (2, 2), (0, Some(256 * KIB + 1)), vec![OneShotPush, OneShot, Ccl]);
        add(vec![Vendor::Nvidia], None, (3, 4), (0, Some(256 * KIB + 1)), vec![OneShotPush, OneShot, TwoShot, Ccl]);
        add(vec![Vendor::Nvidia], None, (5, 8), (0, Some(128 * KIB + 1)), vec![OneShotPush, OneShot, TwoShot, Ccl]);
        // World 2: one-shot whenever the custom kernels can take the message (their staging size,
        // ANYCCL_CUSTOM_MAX_BYTES, default 8 MiB), up to 64 MiB. On two H200s the custom one-shot beat NCCL by
        // 1.28-1.96x from 1 to 8 MiB and, with 64 MiB staging, by 1.15-1.27x from 16 to 64 MiB (docs/benchmarks.md).
        // Above 8 MiB this is measured on NVIDIA only.
        add(gpu.clone(), None, (2, 2), (0, Some(8 * MIB + 1)), vec![OneShot, Ccl]);
        add(vec![Vendor::Nvidia], None, (2, 2), (8 * MIB + 1, Some(64 * MIB + 1)), vec![OneShot, Ccl]);
        add(gpu.clone(), None, (3, 4), (0, Some(512 * KIB)), vec![OneShot, TwoShot, Ccl]);
        add(gpu.clone(), None, (5, 8), (0, Some(256 * KIB)), vec![OneShot, TwoShot, Ccl]);
        add(vec![Vendor::Nvidia], Some("sm_90"), (4, 8), (256 * KIB, Some(4 * MIB)), vec![NvlsBlockPipeline, TwoShot]);
        add(gpu.clone(), None, (3, 8), (0, Some(8 * MIB)), vec![TwoShot, CclSymmetric, Ccl]);
        add(vec![Vendor::Nvidia], None, (4, usize::MAX), (8 * MIB, None), vec![CclSymmetric, Ccl]);
        add(gpu, None, (1, usize::MAX), (0, None), vec![Ccl]);
        SelectorTable { rules }
    }

    /// Parses a table file's text. `source_name` (the path) is used in error messages, which name the line.
    pub fn parse(text: &str, source_name: &str) -> Result<Self> {
        // Byte offsets of the line ends, once, so a span's line is a binary search (counting newlines before each
        // span made a table of n rules cost O(n²)).
        let newlines: Vec<usize> = text.bytes().enumerate().filter(|(_, b)| *b == b'\n').map(|(i, _)| i).collect();
        let line_of = |offset: usize| newlines.partition_point(|&nl| nl < offset) + 1;
        let err =
            |line: Option<usize>, message: String| Error::Config { source_name: source_name.to_owned(), line, message };
        let file: RawFile = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(s.start));
            err(line, e.message().trim().to_owned())
        })?;
        if let Some(v) = &file.version {
            if *v.get_ref() != 1 {
                return Err(err(
                    Some(line_of(v.span().start)),
                    format!("unsupported version {} (expected 1)", v.get_ref()),
                ));
            }
        }
        let mut rules: Vec<Rule> = Vec::with_capacity(file.rule.len());
        let mut lines: Vec<usize> = Vec::with_capacity(file.rule.len());
        for raw in file.rule {
            let rule_span = raw.span();
            let raw = raw.into_inner();
            let Some(first) =
                raw.algorithms.as_ref().map(|a| a.span()).or(raw.fused_rmsnorm.as_ref().map(|a| a.span()))
            else {
                let line = Some(line_of(rule_span.start));
                return Err(err(line, "a rule needs `algorithms`, `fused_rmsnorm` or both".to_owned()));
            };
            let rule_line = line_of(first.start);
            let at = |span: std::ops::Range<usize>| Some(line_of(span.start));

            let vendors = match raw.vendor {
                None => Vec::new(),
                Some(v) => {
                    let line = at(v.span());
                    v.into_inner()
                        .into_vec()
                        .iter()
                        .map(|s| s.parse::<Vendor>().map_err(|e| err(line, e.to_string())))
                        .collect::<Result<_>>()?
                }
            };
            let (world_min, world_max) = match raw.world {
                None => (1, usize::MAX),
                Some(w) => {
                    let line = at(w.span());
                    parse_world(w.get_ref()).map_err(|m| err(line, m))?
                }
            };
            let (bytes_min, bytes_max) = match raw.bytes {
                None => (0, None),
                Some(b) => {
                    let line = at(b.span());
                    parse_byte_range(b.get_ref()).map_err(|m| err(line, m))?
                }
            };
            let dtypes = match raw.dtype {
                None => Vec::new(),
                Some(d) => {
                    let line = at(d.span());
                    d.into_inner()
                        .into_vec()
                        .iter()
                        .map(|s| s.parse::<DataType>().map_err(|e| err(line, e.to_string())))
                        .collect::<Result<_>>()?
                }
            };
            let mut algorithms: Vec<Algorithm> = Vec::new();
            if let Some(raw_algorithms) = raw.algorithms {
                let algo_line = at(raw_algorithms.span());
                algorithms = raw_algorithms
                    .into_inner()
                    .iter()
                    .map(|s| s.parse::<Algorithm>().map_err(|e| err(algo_line, e.to_string())))
                    .collect::<Result<_>>()?;
                if algorithms.is_empty() {
                    return Err(err(algo_line, "`algorithms` must name at least one algorithm".to_owned()));
                }
            }
            let mut fused: Vec<RmsNormForm> = Vec::new();
            if let Some(raw_fused) = raw.fused_rmsnorm {
                let line = at(raw_fused.span());
                fused = raw_fused
                    .into_inner()
                    .iter()
                    .map(|s| s.parse::<RmsNormForm>().map_err(|e| err(line, e.to_string())))
                    .collect::<Result<_>>()?;
                if fused.is_empty() {
                    return Err(err(line, "`fused_rmsnorm` must name at least one form".to_owned()));
                }
            }
            rules.push(
                Rule {
                    vendors,
                    arch: raw.arch,
                    world_min,
                    world_max,
                    bytes_min,
                    bytes_max,
                    dtypes,
                    capturing: raw.capturing,
                    algorithms,
                    fused,
                    origin: format!("{source_name}:{rule_line}"),
                    label: Arc::from(""),
                }
                .labelled(),
            );
            lines.push(rule_line);
        }
        // A table file is a partition: two rules that could both match one call are a mistake (the second would
        // never apply where they overlap).
        // Separately among the all-reduce rules and among the fused rules (a rule with both lists is in both).
        let subset = |keep: fn(&Rule) -> bool| -> (Vec<Rule>, Vec<usize>) {
            let idx: Vec<usize> = (0..rules.len()).filter(|&i| keep(&rules[i])).collect();
            (idx.iter().map(|&i| rules[i].clone()).collect(), idx)
        };
        let found = [subset(|r| !r.algorithms.is_empty()), subset(|r| !r.fused.is_empty())]
            .into_iter()
            .find_map(|(sub, idx)| overlap::find(&sub).map(|(i, j)| (idx[i], idx[j])));
        if let Some((i, j)) = found {
            return Err(err(
                Some(lines[j]),
                format!(
                    "this rule overlaps the rule at line {} (their vendors, arch, world, dtype, capture and byte \
                     ranges intersect)",
                    lines[i]
                ),
            ));
        }
        Ok(SelectorTable { rules })
    }

    /// Reads and parses a table file: a regular file of at most [`MAX_TABLE_FILE_BYTES`], UTF-8. A FIFO, device,
    /// directory or socket is refused without reading from it (and opening never blocks), so a path like
    /// `/dev/urandom` or a named pipe gives an error naming it instead of filling memory or hanging.
    pub fn load(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let text = read_table_file(path).map_err(|message| Error::Config {
            source_name: name.clone(),
            line: None,
            message,
        })?;
        Self::parse(&text, &name)
    }
}

/// The largest table file [`SelectorTable::load`] reads: 4 MiB (`anyccl tune` writes a few KiB; 4 MiB holds
/// some 70 000 rules).
pub const MAX_TABLE_FILE_BYTES: u64 = 4 << 20;

/// Why `meta` is not a regular file, or `Ok`.
fn regular_file(meta: &std::fs::Metadata) -> std::result::Result<(), String> {
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(());
    }
    let kind = if ft.is_dir() {
        "a directory"
    } else {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            if ft.is_fifo() {
                "a FIFO (named pipe)"
            } else if ft.is_char_device() {
                "a character device"
            } else if ft.is_block_device() {
                "a block device"
            } else if ft.is_socket() {
                "a socket"
            } else {
                "not a regular file"
            }
        }
        #[cfg(not(unix))]
        {
            "not a regular file"
        }
    };
    Err(format!("cannot read the table file: it is {kind}; a table file must be a regular file"))
}

/// The text of the table file at `path`, or why not (the caller adds the path).
fn read_table_file(path: &Path) -> std::result::Result<String, String> {
    use std::io::Read;
    let cannot = |e: std::io::Error| format!("cannot read the table file: {e}");
    // Refuse what is not a regular file before opening it (opening some devices has effects of its own) ...
    regular_file(&std::fs::metadata(path).map_err(cannot)?)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // ... and open without blocking, then check again on the open file, in case the path changed in between.
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    }
    let file = options.open(path).map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    regular_file(&meta)?;
    let too_big = |len: u64| {
        format!(
            "the table file holds {} or more; table files are limited to {} (anyccl tune writes a few KiB)",
            format_bytes(len),
            format_bytes(MAX_TABLE_FILE_BYTES)
        )
    };
    if meta.len() > MAX_TABLE_FILE_BYTES {
        return Err(too_big(meta.len()));
    }
    // At most the cap and one byte more, whatever the size said (files in /proc say 0; a file may grow).
    let mut bytes = Vec::new();
    let want = usize::try_from(meta.len().min(MAX_TABLE_FILE_BYTES) + 1).unwrap_or(usize::MAX);
    bytes.try_reserve(want).map_err(|e| format!("cannot read the table file: {e}"))?;
    file.take(MAX_TABLE_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(cannot)?;
    if bytes.len() as u64 > MAX_TABLE_FILE_BYTES {
        return Err(too_big(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!("the table file is not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to())
    })
}

fn parse_world(w: &WorldSpec) -> std::result::Result<(usize, usize), String> {
    let bad = |s: &str| format!("bad world '{s}' (expected a number, \"MIN-MAX\" or \"MIN-\")");
    let (lo, hi) = match w {
        WorldSpec::One(n) => {
            let n = usize::try_from(*n).map_err(|_| bad(&n.to_string()))?;
            (n, n)
        }
        WorldSpec::Range(s) => {
            let t = s.trim();
            if let Some((a, b)) = t.split_once('-') {
                let lo = a.trim().parse::<usize>().map_err(|_| bad(s))?;
                let hi =
                    if b.trim().is_empty() { usize::MAX } else { b.trim().parse::<usize>().map_err(|_| bad(s))? };
                (lo, hi)
            } else {
                let n = t.parse::<usize>().map_err(|_| bad(s))?;
                (n, n)
            }
        }
    };
    if lo == 0 || lo > hi {
        return Err(format!("bad world range {lo}-{hi} (world sizes start at 1 and MIN <= MAX)"));
    }
    Ok((lo, hi))
}

fn parse_byte_range(s: &str) -> std::result::Result<(u64, Option<u64>), String> {
    let Some((a, b)) = s.split_once('-') else {
        return Err(format!("bad bytes '{s}' (expected \"[MIN]-[MAX]\", e.g. \"0-512KiB\" or \"8MiB-\")"));
    };
    let lo = if a.trim().is_empty() { 0 } else { parse_bytes(a).map_err(|e| e.to_string())? };
    let hi = if b.trim().is_empty() { None } else { Some(parse_bytes(b).map_err(|e| e.to_string())?) };
    if let Some(h) = hi {
        if h <= lo {
            return Err(format!("bad bytes range '{s}': the upper bound must exceed the lower"));
        }
    }
    Ok((lo, hi))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    version: Option<toml::Spanned<i64>>,
    #[serde(default)]
    rule: Vec<toml::Spanned<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    vendor: Option<toml::Spanned<OneOrMany>>,
    arch: Option<String>,
    world: Option<toml::Spanned<WorldSpec>>,
    bytes: Option<toml::Spanned<String>>,
    dtype: Option<toml::Spanned<OneOrMany>>,
    capturing: Option<bool>,
    algorithms: Option<toml::Spanned<Vec<String>>>,
    fused_rmsnorm: Option<toml::Spanned<Vec<String>>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WorldSpec {
    One(i64),
    Range(String),
}

/// Picks the all-reduce algorithm for each call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    table: SelectorTable,
    source: TableSource,
    forced: Option<Algorithm>,
    forced_why: Arc<str>,
    fallback_why: Arc<str>,
    deterministic: bool,
    deterministic_fallback_why: Arc<str>,
    /// `ANYCCL_FUSED_RMSNORM`'s form.
    fused_forced: Option<RmsNormForm>,
}

impl Default for Selector {
    fn default() -> Self {
        Selector {
            table: SelectorTable::defaults(),
            source: TableSource::Defaults,
            forced: None,
            forced_why: Arc::from(format!("forced by {ENV_FORCE_ALGO}")),
            fallback_why: Arc::from("no rule matched; first eligible algorithm"),
            deterministic: false,
            deterministic_fallback_why: Arc::from(
                "deterministic mode: no rule yielded a deterministic algorithm; first eligible of two-shot, one-shot",
            ),
            fused_forced: None,
        }
    }
}

impl Selector {
    /// The defaults, no file, no override.
    pub fn defaults() -> Self {
        Self::default()
    }

    /// Reads `ANYCCL_ALLREDUCE_ALGO` and `ANYCCL_TUNE_FILE`. A bad value of either is an error naming it, and so is
    /// any `ANYCCL_*` variable that is set but not UTF-8 ([`crate::env::check_process_env`]).
    pub fn from_env() -> Result<Self> {
        let mut s = Self::default();
        if let Some(path) = std::env::var_os(ENV_TABLE_FILE).filter(|p| !p.is_empty()) {
            s = s.with_table_file(Path::new(&path), ENV_TABLE_FILE)?;
        }
        let forced = crate::env::var(ENV_FORCE_ALGO)?;
        s.deterministic = match crate::env::var(ENV_DETERMINISTIC)? {
            Some(v) => parse_switch(&v).map_err(|message| Error::Config {
                source_name: ENV_DETERMINISTIC.to_owned(),
                line: None,
                message,
            })?,
            None => false,
        };
        // every other variable read below through a plain closure: set but not UTF-8 is an error naming it
        crate::env::check_process_env()?;
        s.fused_forced = crate::fused::form_from_env(&|k| std::env::var(k).ok())?;
        if let Some(v) = forced {
            if !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("auto") {
                let a = v.parse::<Algorithm>().map_err(|e| Error::Config {
                    source_name: ENV_FORCE_ALGO.to_owned(),
                    line: None,
                    message: e.to_string(),
                })?;
                s.forced = Some(a);
            }
        }
        Ok(s)
    }

    /// Puts the rules of the table file at `path` before the defaults. `via` says how it was named.
    pub fn with_table_file(mut self, path: &Path, via: &str) -> Result<Self> {
        let file = SelectorTable::load(path)?;
        let mut rules = file.rules;
        rules.extend(SelectorTable::defaults().rules);
        self.table = SelectorTable { rules };
        self.source = TableSource::File { path: path.to_owned(), via: via.to_owned() };
        Ok(self)
    }

    /// Forces (or with `None`, stops forcing) one algorithm.
    pub fn with_forced(mut self, algorithm: Option<Algorithm>) -> Self {
        self.forced = algorithm;
        self
    }

    /// The forced algorithm, if any.
    pub fn forced(&self) -> Option<Algorithm> {
        self.forced
    }

    /// Turns deterministic mode on or off (see the module documentation). Every rank of a communicator must use
    /// the same setting, or their selections differ and the call hangs.
    pub fn with_deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }

    /// Whether deterministic mode is on (the default of the communicators using this selector).
    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    /// Forces (or with `None`, stops forcing) one form of the fused all-reduce + RMSNorm for calls that do not
    /// force their own (what `ANYCCL_FUSED_RMSNORM` sets in [`Selector::from_env`]).
    pub fn with_fused_forced(mut self, form: Option<RmsNormForm>) -> Self {
        self.fused_forced = form;
        self
    }

    /// The form `ANYCCL_FUSED_RMSNORM` (or [`Selector::with_fused_forced`]) forces, if any.
    pub fn fused_forced(&self) -> Option<RmsNormForm> {
        self.fused_forced
    }

    /// Chooses the form of a fused all-reduce + RMSNorm (see the module documentation): `forced` (the call's own),
    /// else this selector's forced form, else the first eligible form of the first matching table rule with
    /// `fused_rmsnorm`, else the first eligible form of the default rule ([`default_rmsnorm_forms`]). `q.bytes` is
    /// the input's size. `eligible` is the backend's verdict on one form (`Err` carries why not).
    pub fn select_rmsnorm(
        &self,
        q: &SelectionQuery<'_>,
        call: &RmsNormCall,
        forced: Option<RmsNormForm>,
        eligible: impl FnMut(RmsNormForm) -> std::result::Result<(), String>,
    ) -> Result<RmsNormSelection> {
        self.select_rmsnorm_from(self.table.rules.iter(), q, call, forced, eligible)
    }

    /// [`Selector::select_rmsnorm`] over the rules at `candidates` ([`Selector::candidates`]).
    pub(crate) fn select_rmsnorm_among(
        &self,
        candidates: &[usize],
        q: &SelectionQuery<'_>,
        call: &RmsNormCall,
        forced: Option<RmsNormForm>,
        eligible: impl FnMut(RmsNormForm) -> std::result::Result<(), String>,
    ) -> Result<RmsNormSelection> {
        let rules = candidates.iter().filter_map(|&i| self.table.rules.get(i));
        self.select_rmsnorm_from(rules, q, call, forced, eligible)
    }

    fn select_rmsnorm_from<'r>(
        &'r self,
        rules: impl Iterator<Item = &'r Rule>,
        q: &SelectionQuery<'_>,
        call: &RmsNormCall,
        forced: Option<RmsNormForm>,
        mut eligible: impl FnMut(RmsNormForm) -> std::result::Result<(), String>,
    ) -> Result<RmsNormSelection> {
        let overrides = [(forced, "forced by the call (RmsNormSpec::form)"), (self.fused_forced, ENV_FUSED_RMSNORM)];
        if let Some((form, by)) = overrides.iter().find_map(|(f, by)| f.map(|f| (f, *by))) {
            let by = if by == ENV_FUSED_RMSNORM { format!("forced by {ENV_FUSED_RMSNORM}") } else { by.to_owned() };
            return match eligible(form) {
                Ok(()) => Ok(RmsNormSelection::new(form, by)),
                Err(why) => Err(Error::NoEligibleAlgorithm {
                    why: format!("all_reduce_rmsnorm form {form} ({by}) cannot run this call: {why}"),
                }),
            };
        }
        let mut refused: Vec<(RmsNormForm, String)> = Vec::new();
        let mut try_forms = |forms: &[RmsNormForm], refused: &mut Vec<(RmsNormForm, String)>| {
            for &f in forms {
                if refused.iter().any(|(r, _)| *r == f) {
                    continue;
                }
                match eligible(f) {
                    Ok(()) => return Some(f),
                    Err(why) => refused.push((f, why)),
                }
            }
            None
        };
        for rule in rules.filter(|r| !r.fused.is_empty() && r.matches(q)) {
            if let Some(f) = try_forms(&rule.fused, &mut refused) {
                return Ok(RmsNormSelection::new(f, rule.label.clone()));
            }
        }
        let (forms, why) = default_rmsnorm_forms(call, q.world);
        if let Some(f) = try_forms(&forms, &mut refused) {
            return Ok(RmsNormSelection::new(f, why));
        }
        let why = refused.iter().map(|(f, w)| format!("{f}: {w}")).collect::<Vec<_>>().join("; ");
        Err(Error::NoEligibleAlgorithm { why: format!("no form of all_reduce_rmsnorm can run this call: {why}") })
    }

    /// The active table.
    pub fn table(&self) -> &SelectorTable {
        &self.table
    }

    /// Where the active table came from.
    pub fn source(&self) -> &TableSource {
        &self.source
    }

    /// Chooses the algorithm for `q`. `eligible` is the backend's verdict on one algorithm for this call (`Err`
    /// carries why not). A forced algorithm that is not eligible is an error; otherwise the first eligible
    /// algorithm of the first matching rule wins, and if no rule yields one, the first eligible algorithm at all.
    pub fn select(
        &self,
        q: &SelectionQuery<'_>,
        eligible: impl FnMut(Algorithm) -> std::result::Result<(), String>,
    ) -> Result<Selection> {
        self.select_from(self.table.rules.iter(), q, self.deterministic, eligible)
    }

    /// The indices of the rules that can match some call of a communicator of `vendor`, `arch` and `world`
    /// (which never change for one communicator), in table order. [`Selector::select_among`] then looks at
    /// those alone: the per-call scan stays a few rules long however long the table is.
    pub(crate) fn candidates(&self, vendor: Vendor, arch: &str, world: usize) -> Vec<usize> {
        let fixed = |r: &Rule| {
            (r.vendors.is_empty() || r.vendors.contains(&vendor))
                && r.arch.as_deref().is_none_or(|a| a.eq_ignore_ascii_case(arch))
                && (r.world_min..=r.world_max).contains(&world)
        };
        self.table.rules.iter().enumerate().filter(|(_, r)| fixed(r)).map(|(i, _)| i).collect()
    }

    /// Whether one of the rules at `candidates` looks at the capture state (a forced algorithm looks at none).
    pub(crate) fn reads_capture(&self, candidates: &[usize]) -> bool {
        self.forced.is_none()
            && candidates
                .iter()
                .filter_map(|&i| self.table.rules.get(i))
                .any(|r| r.capturing.is_some() && !r.algorithms.is_empty())
    }

    /// [`Selector::select`] over the rules at `candidates` (from [`Selector::candidates`] with `q`'s vendor,
    /// arch and world): the same choice, without scanning the rules that cannot match.
    /// `deterministic` overrides the selector's own setting (a communicator's [`Selector::with_deterministic`]).
    pub(crate) fn select_among(
        &self,
        candidates: &[usize],
        q: &SelectionQuery<'_>,
        deterministic: bool,
        eligible: impl FnMut(Algorithm) -> std::result::Result<(), String>,
    ) -> Result<Selection> {
        self.select_from(candidates.iter().filter_map(|&i| self.table.rules.get(i)), q, deterministic, eligible)
    }

    fn select_from<'r>(
        &'r self,
        rules: impl Iterator<Item = &'r Rule>,
        q: &SelectionQuery<'_>,
        deterministic: bool,
        mut eligible: impl FnMut(Algorithm) -> std::result::Result<(), String>,
    ) -> Result<Selection> {
        if let Some(a) = self.forced {
            if let Some(why) = a.nondeterministic().filter(|_| deterministic) {
                return Err(Error::AlgorithmNotEligible { algorithm: a, why: deterministic_refusal(why) });
            }
            return match eligible(a) {
                Ok(()) => Ok(Selection { algorithm: a, why: self.forced_why.clone() }),
                Err(why) => Err(Error::AlgorithmNotEligible { algorithm: a, why }),
            };
        }
        let mut refused: Vec<(Algorithm, String)> = Vec::new();
        // Deterministic mode: the algorithms skipped for their reduction order, named in the selection's `why`.
        let mut skipped: Vec<Algorithm> = Vec::new();
        for rule in rules.filter(|r| r.matches(q)) {
            for &a in &rule.algorithms {
                if refused.iter().any(|(r, _)| *r == a) {
                    continue;
                }
                if let Some(why) = a.nondeterministic().filter(|_| deterministic) {
                    refused.push((a, deterministic_refusal(why)));
                    skipped.push(a);
                    continue;
                }
                match eligible(a) {
                    Ok(()) => {
                        let why = if skipped.is_empty() {
                            rule.label.clone()
                        } else {
                            Arc::from(format!("{}; deterministic mode skipped {}", rule.label, names(&skipped)))
                        };
                        return Ok(Selection { algorithm: a, why });
                    }
                    Err(why) => refused.push((a, why)),
                }
            }
        }
        let (order, fallback_why): (&[Algorithm], _) = if deterministic {
            (&[Algorithm::TwoShot, Algorithm::OneShot], &self.deterministic_fallback_why)
        } else {
            (&Algorithm::ALL, &self.fallback_why)
        };
        for &a in order {
            if refused.iter().any(|(r, _)| *r == a) {
                continue;
            }
            if a.is_lossy() {
                refused.push((a, "lossy (quantized): runs only where named, never as a fallback".to_owned()));
                continue;
            }
            match eligible(a) {
                Ok(()) => {
                    let why = if skipped.is_empty() {
                        fallback_why.clone()
                    } else {
                        Arc::from(format!("{fallback_why}; deterministic mode skipped {}", names(&skipped)))
                    };
                    return Ok(Selection { algorithm: a, why });
                }
                Err(why) => refused.push((a, why)),
            }
        }
        let mut why = refused.iter().map(|(a, w)| format!("{a}: {w}")).collect::<Vec<_>>().join("; ");
        if deterministic {
            why = format!(
                "deterministic mode ({ENV_DETERMINISTIC}) found no algorithm that sums in rank order for this call \
                 (one-shot and two-shot need the custom kernels and a message within their staging size): {why}"
            );
        }
        Err(Error::NoEligibleAlgorithm { why })
    }
}

/// Input size (bytes of one rank's `tokens × hidden` elements) up to which the default rule prefers fused
/// one-shot: one-shot reads every peer's whole input, which stops paying off once the message is large (the plain
/// all-reduce's crossover on an H200 is of the same order). Above it fused two-shot, when every rank owns at
/// least one row.
pub const FUSED_ONE_SHOT_MAX_BYTES: usize = 512 << 10;

/// Input size up to which the default rule tries the fused push one-shot first (where the backend offers it: GPU
/// communicators with the push one-shot set up). Measured on one H200 with emulated ranks
/// (`anyccl-cuda-fused-bench`, bf16, hidden 8192): at 1 and 8 tokens (16 and 128 KiB) it took 0.58–0.60× the
/// fused one-shot's time at 2 ranks and 0.80–0.89× at 8; larger messages were not measured.
pub const FUSED_PUSH_MAX_BYTES: usize = 128 << 10;

/// The default rule of the fused all-reduce + RMSNorm: the fused push one-shot up to [`FUSED_PUSH_MAX_BYTES`],
/// then fused one-shot up to [`FUSED_ONE_SHOT_MAX_BYTES`] (or when there are fewer rows than ranks, where two-shot
/// would leave ranks idle), else fused two-shot; each followed by the other fused forms, then unfused, so a
/// backend's refusal (no push buffers, two-shot scratch too small, fused kernels off) falls back in that order.
/// Returns the forms in order and the rule's text.
pub fn default_rmsnorm_forms(call: &RmsNormCall, world: usize) -> ([RmsNormForm; 4], &'static str) {
    use RmsNormForm::*;
    if call.bytes <= FUSED_PUSH_MAX_BYTES {
        (
            [FusedPush, FusedOneShot, FusedTwoShot, Unfused],
            "default rule: fused push up to 128 KiB where offered, else fused one-shot",
        )
    } else if call.bytes <= FUSED_ONE_SHOT_MAX_BYTES || call.tokens < world {
        (
            [FusedOneShot, FusedTwoShot, Unfused, FusedPush],
            "default rule: fused one-shot up to 512 KiB or below one row per rank",
        )
    } else {
        (
            [FusedTwoShot, FusedOneShot, Unfused, FusedPush],
            "default rule: fused two-shot above 512 KiB with a row per rank",
        )
    }
}

/// The reason deterministic mode gives for refusing an algorithm.
fn deterministic_refusal(why: &str) -> String {
    format!("not deterministic ({ENV_DETERMINISTIC}): {why}")
}

/// `a, b, c`.
fn names(algorithms: &[Algorithm]) -> String {
    algorithms.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
}

/// An on/off setting's value: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no`, empty (any case, spaces
/// around ignored).
pub fn parse_switch(v: &str) -> std::result::Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" | "" => Ok(false),
        _ => Err(format!("{v:?} is not an on/off value (1, true, on, yes / 0, false, off, no)")),
    }
}

/// Finding two rules of a table that could both match one call, in near-linear time.
///
/// Rules are boxes: categorical sets (vendor, capture state, dtype, arch) times an inclusive world range times a
/// half-open byte range. Comparing every pair cost O(n²) (16 000 rules took 19 s). Here:
/// - each categorical dimension's values are split into the classes the table tells apart (values every rule
///   treats alike share one class), so the common table needs one class per rule and the worst needs 72;
/// - a sweep over the byte axis keeps the rules whose byte range holds the sweep point ("active");
/// - for each (class, arch) the active rules' world ranges are counted in a Fenwick tree over the world values
///   that occur, so "does an active compatible rule share a world size with this one" is a range sum.
///
/// That is O(C·n log n) for n rules each in at most C classes. Once a rule is found to overlap, its partner (the
/// first rule that overlaps it) is found by one linear scan with [`Rule::overlaps`], which stays the definition.
mod overlap {
    use std::collections::HashMap;

    use super::Rule;
    use crate::algo::Vendor;
    use crate::dtype::DataType;

    /// Range add, range sum over `n` points (two Fenwick trees).
    struct Fenwick {
        b1: Vec<i64>,
        b2: Vec<i64>,
    }

    impl Fenwick {
        fn new(n: usize) -> Self {
            Fenwick { b1: vec![0; n + 1], b2: vec![0; n + 1] }
        }

        fn update(tree: &mut [i64], mut i: usize, v: i64) {
            while i < tree.len() {
                tree[i] += v;
                i += i & i.wrapping_neg();
            }
        }

        fn sum(tree: &[i64], mut i: usize) -> i64 {
            let mut s = 0;
            while i > 0 {
                s += tree[i];
                i -= i & i.wrapping_neg();
            }
            s
        }

        /// Adds `v` to points `l..=r` (0-based).
        fn add(&mut self, l: usize, r: usize, v: i64) {
            let (l, r) = (l + 1, r + 1);
            Self::update(&mut self.b1, l, v);
            Self::update(&mut self.b1, r + 1, -v);
            Self::update(&mut self.b2, l, v * (l as i64 - 1));
            Self::update(&mut self.b2, r + 1, -v * r as i64);
        }

        fn prefix(&self, i: usize) -> i64 {
            Self::sum(&self.b1, i) * i as i64 - Self::sum(&self.b2, i)
        }

        /// The sum over points `l..=r` (0-based).
        fn range(&self, l: usize, r: usize) -> i64 {
            self.prefix(r + 1) - self.prefix(l)
        }
    }

    /// Active world ranges of one (class, arch slot), over the world values of every rule that uses it.
    struct Slot {
        coords: Vec<usize>,
        tree: Fenwick,
    }

    impl Slot {
        /// The compressed range of `lo..=hi`; both are in `coords` by construction.
        fn span(&self, lo: usize, hi: usize) -> (usize, usize) {
            (self.coords.partition_point(|&c| c < lo), self.coords.partition_point(|&c| c <= hi).saturating_sub(1))
        }
    }

    /// Splits the values `0..domain` into the classes the masks tell apart; returns each mask's classes.
    fn classes(masks: &[u32], domain: usize) -> (usize, Vec<Vec<u32>>) {
        let mut distinct: Vec<u32> = masks.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        // A value's signature: which distinct masks hold it. Equal signatures, one class.
        let mut class_of = vec![0u32; domain];
        let mut signatures: Vec<Vec<bool>> = Vec::new();
        for (v, class) in class_of.iter_mut().enumerate() {
            let sig: Vec<bool> = distinct.iter().map(|m| m & (1 << v) != 0).collect();
            let k = match signatures.iter().position(|s| *s == sig) {
                Some(k) => k,
                None => {
                    signatures.push(sig);
                    signatures.len() - 1
                }
            };
            *class = k as u32;
        }
        let of_mask = |m: u32| -> Vec<u32> {
            let mut c: Vec<u32> = (0..domain).filter(|v| m & (1 << v) != 0).map(|v| class_of[v]).collect();
            c.sort_unstable();
            c.dedup();
            c
        };
        let per_distinct: Vec<Vec<u32>> = distinct.iter().map(|&m| of_mask(m)).collect();
        let out = masks
            .iter()
            .map(|m| distinct.binary_search(m).map(|i| per_distinct[i].clone()).unwrap_or_default())
            .collect();
        (signatures.len(), out)
    }

    fn vendor_bit(v: Vendor) -> u32 {
        match v {
            Vendor::Host => 1,
            Vendor::Nvidia => 2,
            Vendor::Amd => 4,
        }
    }

    fn dtype_bit(d: DataType) -> u32 {
        DataType::ALL.iter().position(|x| *x == d).map_or(0, |i| 1 << i)
    }

    /// Slot 0 holds rules of any arch (`arch` unset), slot 1 every rule, slot 2 + k the rules of named arch k.
    const ANY_ARCH: u32 = 0;
    const ALL: u32 = 1;

    /// A pair `(i, j)`, `i < j`, of rules that overlap, if there is one.
    pub(super) fn find(rules: &[Rule]) -> Option<(usize, usize)> {
        if rules.len() < 2 {
            return None;
        }
        let full = |mask: u32, all: u32| if mask == 0 { all } else { mask };
        let vmasks: Vec<u32> =
            rules.iter().map(|r| full(r.vendors.iter().map(|v| vendor_bit(*v)).fold(0, |a, b| a | b), 7)).collect();
        let cmasks: Vec<u32> = rules.iter().map(|r| r.capturing.map_or(3, |c| 1 << u32::from(c))).collect();
        let dall = (1u32 << DataType::ALL.len()) - 1;
        let dmasks: Vec<u32> =
            rules.iter().map(|r| full(r.dtypes.iter().map(|d| dtype_bit(*d)).fold(0, |a, b| a | b), dall)).collect();
        let (_, vcls) = classes(&vmasks, 3);
        let (nc, ccls) = classes(&cmasks, 2);
        let (nd, dcls) = classes(&dmasks, DataType::ALL.len());
        let mut arch_ids: HashMap<String, u32> = HashMap::new();
        let arch_slot: Vec<u32> = rules
            .iter()
            .map(|r| match &r.arch {
                None => ANY_ARCH,
                Some(a) => {
                    let next = arch_ids.len() as u32 + 2;
                    *arch_ids.entry(a.to_ascii_lowercase()).or_insert(next)
                }
            })
            .collect();
        // Each rule's classes, flattened to one id per (vendor, capture, dtype) class triple.
        let (nc, nd) = (nc as u64, nd as u64);
        let class_ids = |i: usize| -> Vec<u64> {
            let mut out = Vec::new();
            for &v in &vcls[i] {
                for &c in &ccls[i] {
                    for &d in &dcls[i] {
                        out.push((u64::from(v) * nc + u64::from(c)) * nd + u64::from(d));
                    }
                }
            }
            out
        };
        let ids: Vec<Vec<u64>> = (0..rules.len()).map(class_ids).collect();

        // The slots each rule is counted in, and the slots it queries; each slot's world values.
        let mut slot_index: HashMap<(u64, u32), usize> = HashMap::new();
        let mut coords: Vec<Vec<usize>> = Vec::new();
        let mut slot = |key: (u64, u32), coords: &mut Vec<Vec<usize>>| -> usize {
            *slot_index.entry(key).or_insert_with(|| {
                coords.push(Vec::new());
                coords.len() - 1
            })
        };
        // (member slots, query slots) per rule.
        let mut member: Vec<Vec<usize>> = Vec::with_capacity(rules.len());
        let mut query: Vec<Vec<usize>> = Vec::with_capacity(rules.len());
        for (i, r) in rules.iter().enumerate() {
            let (mut m, mut q) = (Vec::new(), Vec::new());
            for &class in &ids[i] {
                let all = slot((class, ALL), &mut coords);
                let own = slot((class, arch_slot[i]), &mut coords);
                let any = slot((class, ANY_ARCH), &mut coords);
                m.extend([all, own]);
                if arch_slot[i] == ANY_ARCH {
                    q.push(all);
                } else {
                    q.extend([own, any]);
                }
                // Every rule that counts in or queries a slot puts its world bounds there, so that two ranges
                // that share a world size share one of these values.
                for s in [all, own, any] {
                    coords[s].extend([r.world_min, r.world_max]);
                }
            }
            m.dedup();
            member.push(m);
            query.push(q);
        }
        let mut slots: Vec<Slot> = coords
            .into_iter()
            .map(|mut c| {
                c.sort_unstable();
                c.dedup();
                let tree = Fenwick::new(c.len());
                Slot { coords: c, tree }
            })
            .collect();

        // The sweep over bytes: a range [min, max) ends before another starts at its max.
        let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * rules.len());
        for (i, r) in rules.iter().enumerate() {
            events.push((r.bytes_min, true, i));
            if let Some(max) = r.bytes_max {
                events.push((max, false, i));
            }
        }
        events.sort_unstable();
        for (_, start, i) in events {
            let r = &rules[i];
            if start {
                let hit = query[i].iter().any(|&s| {
                    let (l, h) = slots[s].span(r.world_min, r.world_max);
                    l <= h && slots[s].tree.range(l, h) > 0
                });
                if hit {
                    if let Some(k) = (0..rules.len()).find(|&k| k != i && rules[k].overlaps(r)) {
                        return Some((k.min(i), k.max(i)));
                    }
                }
            }
            let v = if start { 1 } else { -1 };
            for &s in &member[i] {
                let (l, h) = slots[s].span(r.world_min, r.world_max);
                if l <= h {
                    slots[s].tree.add(l, h, v);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(vendor: Vendor, world: usize, bytes: u64) -> SelectionQuery<'static> {
        SelectionQuery { vendor, arch: "sm_90", world, bytes, dtype: DataType::Bf16, capturing: false }
    }

    fn all_ok(_: Algorithm) -> std::result::Result<(), String> {
        Ok(())
    }

    #[test]
    fn defaults_follow_published_thresholds() {
        let s = Selector::defaults();
        let pick = |v, w, b| s.select(&q(v, w, b), all_ok).expect("selects").algorithm;
        assert_eq!(pick(Vendor::Nvidia, 2, 4 * MIB), Algorithm::OneShot);
        assert_eq!(pick(Vendor::Nvidia, 2, 8 * MIB), Algorithm::OneShot);
        assert_eq!(pick(Vendor::Nvidia, 2, 16 * MIB), Algorithm::OneShot);
        assert_eq!(pick(Vendor::Nvidia, 2, 128 * MIB), Algorithm::Ccl);
        assert_eq!(pick(Vendor::Nvidia, 4, 256 * KIB), Algorithm::OneShotPush);
        assert_eq!(pick(Vendor::Nvidia, 4, 256 * KIB + 16), Algorithm::OneShot);
        assert_eq!(pick(Vendor::Nvidia, 8, 256 * KIB), Algorithm::NvlsBlockPipeline);
        assert_eq!(pick(Vendor::Amd, 8, 256 * KIB), Algorithm::TwoShot);
        assert_eq!(pick(Vendor::Nvidia, 8, 64 * MIB), Algorithm::CclSymmetric);
        assert_eq!(pick(Vendor::Amd, 2, 64 * MIB), Algorithm::Ccl);
    }

    #[test]
    fn nvidia_prefers_the_push_one_shot_where_it_measured_faster_and_falls_back_to_one_shot() {
        let s = Selector::defaults();
        let pick = |v, w, b| s.select(&q(v, w, b), all_ok).expect("selects").algorithm;
        for (world, limit) in [(2, 256 * KIB), (3, 256 * KIB), (4, 256 * KIB), (5, 128 * KIB), (8, 128 * KIB)] {
            for bytes in [16, 4 * KIB, limit] {
                assert_eq!(pick(Vendor::Nvidia, world, bytes), Algorithm::OneShotPush, "world {world} {bytes}");
            }
            assert_ne!(pick(Vendor::Nvidia, world, limit + 16), Algorithm::OneShotPush, "world {world}");
            // Never on AMD (not offered there), nor at world 1 or above 8.
            assert_ne!(pick(Vendor::Amd, world, 4 * KIB), Algorithm::OneShotPush, "world {world}");
        }
        assert_eq!(pick(Vendor::Nvidia, 8, 256 * KIB), Algorithm::NvlsBlockPipeline);
        for world in [1, 9] {
            assert_ne!(pick(Vendor::Nvidia, world, 4 * KIB), Algorithm::OneShotPush, "world {world}");
        }
        // Push not set up (or the message above its limit): one-shot, and the selection says why push was skipped.
        let sel = s
            .select(&q(Vendor::Nvidia, 8, 4 * KIB), |a| match a {
                Algorithm::OneShotPush => Err("no receive buffers".into()),
                _ => Ok(()),
            })
            .expect("selects");
        assert_eq!(sel.algorithm, Algorithm::OneShot);
        // Deterministic mode keeps it: it sums in rank order like the one-shot.
        let det = Selector::defaults().with_deterministic(true);
        assert_eq!(det.select(&q(Vendor::Nvidia, 2, 4 * KIB), all_ok).expect("det").algorithm, Algorithm::OneShotPush);
    }

    #[test]
    fn falls_through_ineligible_algorithms() {
        let s = Selector::defaults();
        let sel = s
            .select(&q(Vendor::Nvidia, 8, 64 * MIB), |a| match a {
                Algorithm::CclSymmetric => Err("no windows".into()),
                _ => Ok(()),
            })
            .expect("selects");
        assert_eq!(sel.algorithm, Algorithm::Ccl);
        assert!(sel.why.starts_with("defaults #"), "{}", sel.why);
    }

    #[test]
    fn forced_ineligible_is_an_error() {
        let s = Selector::defaults().with_forced(Some(Algorithm::NvlsZeroCopy));
        let err = s
            .select(&q(Vendor::Nvidia, 8, MIB), |a| {
                if a == Algorithm::NvlsZeroCopy {
                    Err("multicast is off".into())
                } else {
                    Ok(())
                }
            })
            .expect_err("not eligible");
        assert_eq!(
            err,
            Error::AlgorithmNotEligible { algorithm: Algorithm::NvlsZeroCopy, why: "multicast is off".into() }
        );
        let ok = s.select(&q(Vendor::Nvidia, 8, MIB), all_ok).expect("eligible");
        assert_eq!(ok.algorithm, Algorithm::NvlsZeroCopy);
    }

    #[test]
    fn nothing_eligible_lists_every_reason() {
        let err = Selector::defaults()
            .select(&q(Vendor::Host, 2, 10), |a| Err(format!("no {a}")))
            .expect_err("none eligible");
        let Error::NoEligibleAlgorithm { why } = err else { panic!("wrong error {err:?}") };
        for a in Algorithm::ALL {
            if a.is_lossy() {
                // Never asked: a lossy algorithm is no fallback, and the reason says so.
                assert!(!why.contains(&format!("no {a}")) && why.contains(&format!("{a}: lossy")), "{why}");
            } else {
                assert!(why.contains(&format!("no {a}")), "{why}");
            }
        }
    }

    #[test]
    fn lossy_algorithms_run_only_where_named() {
        // No default rule names them, the fallback never picks them even when everything else is refused...
        for r in &SelectorTable::defaults().rules {
            assert!(r.algorithms.iter().all(|a| !a.is_lossy()), "{r}");
        }
        let only_lossy = |a: Algorithm| if a.is_lossy() { Ok(()) } else { Err(format!("no {a}")) };
        for world in [2, 8] {
            for bytes in [1024, 64 * MIB] {
                let err = Selector::defaults().select(&q(Vendor::Nvidia, world, bytes), only_lossy);
                assert!(matches!(err, Err(Error::NoEligibleAlgorithm { .. })), "{err:?}");
            }
        }
        // ...but a table rule or the override that names one runs it, and the selection says so.
        let t = SelectorTable::parse(
            "[[rule]]\nvendor = \"nvidia\"\nbytes = \"32MiB-\"\nalgorithms = [\"two-shot-fp8\", \"ccl\"]\n",
            "q.toml",
        )
        .expect("valid");
        let mut sel = Selector::defaults();
        sel.table.rules.splice(0..0, t.rules);
        let s = sel.select(&q(Vendor::Nvidia, 8, 64 * MIB), all_ok).expect("eligible");
        assert_eq!(s.algorithm, Algorithm::TwoShotFp8);
        assert!(s.why.contains("two-shot-fp8"), "{}", s.why);
        let below = sel.select(&q(Vendor::Nvidia, 8, MIB), all_ok).expect("eligible").algorithm;
        assert_eq!(below, Selector::defaults().select(&q(Vendor::Nvidia, 8, MIB), all_ok).expect("eligible").algorithm);
        let forced = Selector::defaults().with_forced(Some(Algorithm::TwoShotInt8));
        assert_eq!(
            forced.select(&q(Vendor::Nvidia, 8, MIB), all_ok).expect("forced").algorithm,
            Algorithm::TwoShotInt8
        );
    }

    #[test]
    fn deterministic_mode_runs_only_rank_order_algorithms_and_says_what_it_skipped() {
        let det = Selector::defaults().with_deterministic(true);
        assert!(det.deterministic() && !Selector::defaults().deterministic());
        // Everything eligible: every size and world gets one-shot or two-shot, never the library, NVLS, ring or a
        // quantized algorithm; where the rule named others first, the selection says it skipped them.
        for vendor in [Vendor::Nvidia, Vendor::Amd, Vendor::Host] {
            for world in 1..=9 {
                for bytes in [0, 16, 300 * KIB, 3 * MIB, 9 * MIB, 64 * MIB, 1 << 40] {
                    let mut query = q(vendor, world, bytes);
                    query.arch = "sm_90";
                    let s = det.select(&query, all_ok).expect("eligible");
                    assert!(s.algorithm.nondeterministic().is_none(), "{vendor} {world} {bytes}: {s:?}");
                    let plain = Selector::defaults().select(&query, all_ok).expect("eligible");
                    if plain.algorithm.nondeterministic().is_some() {
                        assert!(s.why.contains("deterministic mode skipped"), "{}", s.why);
                        assert!(s.why.contains(plain.algorithm.name()), "{} should name {}", s.why, plain.algorithm);
                    } else {
                        assert_eq!(s.algorithm, plain.algorithm);
                    }
                }
            }
        }
        // Large messages at world 8 (rule: ccl-symmetric, ccl) fall back to two-shot first, then one-shot.
        let large = q(Vendor::Nvidia, 8, 64 * MIB);
        assert_eq!(det.select(&large, all_ok).expect("two-shot").algorithm, Algorithm::TwoShot);
        let no_two = |a: Algorithm| if a == Algorithm::TwoShot { Err("too big".to_owned()) } else { Ok(()) };
        assert_eq!(det.select(&large, no_two).expect("one-shot").algorithm, Algorithm::OneShot);
        // Nothing deterministic eligible: a typed error naming the mode and every reason; the library is not used.
        let only_ccl = |a: Algorithm| if a == Algorithm::Ccl { Ok(()) } else { Err(format!("no {a}")) };
        let err = det.select(&large, only_ccl).expect_err("nothing deterministic");
        let Error::NoEligibleAlgorithm { why } = &err else { panic!("wrong error {err:?}") };
        assert!(why.contains(ENV_DETERMINISTIC) && why.contains("no two-shot") && why.contains("no one-shot"), "{why}");
        assert!(why.contains("ccl: not deterministic"), "{why}");
        // A forced algorithm that is not deterministic is an error; a deterministic one runs.
        for a in Algorithm::ALL {
            let r = det.clone().with_forced(Some(a)).select(&large, all_ok);
            match a.nondeterministic() {
                Some(_) => {
                    let Err(Error::AlgorithmNotEligible { algorithm, why }) = r else { panic!("{a}: {r:?}") };
                    assert_eq!(algorithm, a);
                    assert!(why.contains(ENV_DETERMINISTIC), "{why}");
                }
                None => assert_eq!(r.expect("deterministic").algorithm, a),
            }
        }
    }

    #[test]
    fn on_off_values_parse_and_bad_ones_are_refused() {
        for v in ["1", "true", " ON ", "yes"] {
            assert_eq!(parse_switch(v), Ok(true), "{v}");
        }
        for v in ["0", "false", "Off", "no", ""] {
            assert_eq!(parse_switch(v), Ok(false), "{v}");
        }
        for v in ["2", "maybe", "enabled"] {
            assert!(parse_switch(v).expect_err(v).contains(v), "{v}");
        }
    }

    #[test]
    fn file_rules_override_defaults() {
        let t = SelectorTable::parse(
            "version = 1\n[[rule]]\nvendor = \"nvidia\"\nworld = \"2-8\"\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n",
            "t.toml",
        )
        .expect("valid");
        assert_eq!(t.rules.len(), 1);
        let r = &t.rules[0];
        assert_eq!((r.world_min, r.world_max, r.bytes_min, r.bytes_max), (2, 8, 0, Some(MIB)));
        assert_eq!(r.origin, "t.toml:6");
        assert!(r.matches(&q(Vendor::Nvidia, 4, 1000)));
        assert!(!r.matches(&q(Vendor::Nvidia, 4, MIB)));
        assert!(!r.matches(&q(Vendor::Amd, 4, 1000)));
    }

    #[test]
    fn disjoint_rules_are_accepted() {
        let t = SelectorTable::parse(
            "[[rule]]\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n[[rule]]\nbytes = \"1MiB-\"\nalgorithms = [\"ring\"]\n[[rule]]\nvendor = \"amd\"\nworld = 3\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n",
            "ok.toml",
        );
        // The third rule overlaps the first (any vendor there includes amd, world 3, same bytes).
        assert!(t.is_err());
        let t = SelectorTable::parse(
            "[[rule]]\nvendor = \"nvidia\"\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n[[rule]]\nvendor = \"amd\"\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n[[rule]]\nvendor = \"nvidia\"\nbytes = \"1MiB-\"\nalgorithms = [\"ring\"]\n",
            "ok.toml",
        )
        .expect("disjoint by vendor and bytes");
        assert_eq!(t.rules.len(), 3);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]
        /// Fuzzing the table parser: arbitrary TOML-ish text never panics, and every error names this file and a
        /// line inside it (or none).
        #[test]
        fn parser_never_panics_and_names_a_real_line(
            parts in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just("[[rule]]\n".to_owned()),
                proptest::strategy::Just("version = 1\n".to_owned()),
                "(vendor|arch|world|bytes|dtype|capturing|algorithms|speed) = \"[-a-z0-9_ ]{0,12}\"\n",
                "(world|version) = -?[0-9]{1,20}\n",
                "algorithms = \\[(\"(ccl|one-shot|ring|two-shot|x)\", ?){0,3}\\]\n",
                "bytes = \"[0-9]{0,6}(KiB|MiB|k|B|parsec)?-[0-9]{0,6}(KiB|MiB)?\"\n",
                "[\\[\\]{}=\"#a-z0-9\\n -]{0,20}",
            ], 0..12)
        ) {
            let text: String = parts.concat();
            let lines = text.lines().count() + 1;
            match SelectorTable::parse(&text, "fuzz.toml") {
                Ok(t) => proptest::prop_assert!(t.rules.iter().all(|r| !r.algorithms.is_empty())),
                Err(Error::Config { source_name, line, message }) => {
                    proptest::prop_assert_eq!(source_name, "fuzz.toml");
                    proptest::prop_assert!(line.is_none_or(|l| l >= 1 && l <= lines), "line {:?} of {}: {}", line, lines, message);
                    proptest::prop_assert!(!message.is_empty());
                }
                Err(other) => proptest::prop_assert!(false, "unexpected error kind {:?}", other),
            }
        }
    }

    #[test]
    fn malformed_files_name_the_line() {
        let cases: &[(&str, usize, &str)] = &[
            ("[[rule]]\nalgorithms = [\"warp-drive\"]\n", 2, "warp-drive"),
            ("[[rule]]\nbytes = \"0-12 parsecs\"\nalgorithms = [\"ccl\"]\n", 2, "parsecs"),
            ("[[rule]]\nworld = \"8-2\"\nalgorithms = [\"ccl\"]\n", 2, "world"),
            ("[[rule]]\n\nspeed = 3\nalgorithms = [\"ccl\"]\n", 3, "speed"),
            ("[[rule]]\nalgorithms = [\"ccl\"\n", 2, ""),
            ("[[rule]]\nvendor = \"intel\"\nalgorithms = [\"ccl\"]\n", 2, "intel"),
            ("[[rule]]\ndtype = [\"f128\"]\nalgorithms = [\"ccl\"]\n", 2, "f128"),
            ("version = 7\n", 1, "version"),
            ("[[rule]]\nalgorithms = []\n", 2, "at least one"),
            ("[[rule]]\nworld = 2\n", 1, "algorithms"),
            (
                "[[rule]]\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n\n[[rule]]\nbytes = \"512KiB-\"\nalgorithms = [\"ring\"]\n",
                7,
                "overlaps the rule at line 3",
            ),
        ];
        for (text, line, needle) in cases {
            let err = SelectorTable::parse(text, "bad.toml").expect_err(text);
            let Error::Config { source_name, line: got, message } = &err else { panic!("{err:?}") };
            assert_eq!(source_name, "bad.toml");
            assert_eq!(*got, Some(*line), "{text:?}: {message}");
            assert!(message.contains(needle), "{text:?}: {message}");
            assert!(!err.to_string().contains('\n'), "one line: {err}");
        }
    }

    /// A generated table of `n` disjoint rules in the shape `anyccl tune` writes (vendor, arch, world, dtype,
    /// bytes), spread over several worlds, dtypes and archs, with some rules of any arch and any dtype.
    fn big_table(n: usize) -> String {
        use std::fmt::Write;
        let mut t = String::from("version = 1\n");
        for i in 0..n {
            let (world, arch, dtype) =
                (2 + i % 7, ["sm_90", "sm_80", "gfx942"][i % 3], ["bf16", "f16", "f32"][i % 5 % 3]);
            // Rule i of its (world, arch, dtype) group covers [16k, 16(k+1)); rules of any arch / any dtype get a
            // world of their own (9+), so the table stays a partition.
            let k = i / 105;
            let _ = match i % 105 {
                0 => writeln!(
                    t,
                    "[[rule]]\nworld = {}\nbytes = \"{}-{}\"\nalgorithms = [\"ring\"]",
                    9 + i % 3,
                    16 * k,
                    16 * (k + 1)
                ),
                _ => writeln!(
                    t,
                    "[[rule]]\nvendor = \"nvidia\"\narch = \"{arch}\"\nworld = {world}\ndtype = [\"{dtype}\"]\n\
                     bytes = \"{}-{}\"\nalgorithms = [\"one-shot\", \"ccl\"]",
                    16 * i,
                    16 * (i + 1)
                ),
            };
        }
        t
    }

    /// 100 000 rules parse (the overlap check was O(n²) and so was finding each rule's line: 16 000 rules took
    /// 19 s). This runs in well under a second at opt-level 1; the timing itself is measured by the
    /// `selector_parse` example, not asserted here.
    #[test]
    fn a_hundred_thousand_rules_parse() {
        let text = big_table(100_000);
        let t = SelectorTable::parse(&text, "big.toml").expect("a partition");
        assert_eq!(t.rules.len(), 100_000);
        // The last rule's origin names its real line (the `algorithms` line, the last of the file).
        assert_eq!(t.rules[99_999].origin, format!("big.toml:{}", text.lines().count()));
        // One overlapping rule after 30 000 good ones is found, and named with a rule it overlaps.
        let cut = text.match_indices("[[rule]]").nth(30_000).map_or(text.len(), |(i, _)| i);
        let head = &text[..cut];
        let bad = format!(
            "{head}[[rule]]\nvendor = \"nvidia\"\narch = \"SM_90\"\nbytes = \"16-48\"\nalgorithms = [\"ccl\"]\n"
        );
        let Err(Error::Config { line, message, .. }) = SelectorTable::parse(&bad, "big.toml") else {
            panic!("the overlap was not found")
        };
        assert_eq!(line, Some(bad.lines().count()), "{message}");
        assert!(message.contains("overlaps the rule at line"), "{message}");
    }

    fn rule(
        vendors: Vec<Vendor>,
        arch: Option<&str>,
        world: (usize, usize),
        bytes: (u64, Option<u64>),
        dtypes: Vec<DataType>,
        capturing: Option<bool>,
    ) -> Rule {
        Rule {
            vendors,
            arch: arch.map(str::to_owned),
            world_min: world.0,
            world_max: world.1,
            bytes_min: bytes.0,
            bytes_max: bytes.1,
            dtypes,
            capturing,
            algorithms: vec![Algorithm::Ccl],
            fused: Vec::new(),
            origin: String::new(),
            label: Arc::from(""),
        }
    }

    fn arb_rule() -> impl proptest::strategy::Strategy<Value = Rule> {
        use proptest::prelude::*;
        let vendors = proptest::sample::subsequence(vec![Vendor::Host, Vendor::Nvidia, Vendor::Amd], 0..=3);
        let dtypes = proptest::sample::subsequence(DataType::ALL.to_vec(), 0..=3);
        let arch = proptest::option::of(proptest::sample::select(vec!["sm_90", "SM_90", "sm_80", "gfx942"]));
        let world = (1usize..6, 0usize..4, any::<bool>())
            .prop_map(|(lo, w, open)| (lo, if open { usize::MAX } else { lo + w }));
        let bytes = (0u64..8, 1u64..6, any::<bool>())
            .prop_map(|(lo, w, open)| (lo * 64, if open { None } else { Some((lo + w) * 64) }));
        let capturing = proptest::option::of(any::<bool>());
        (vendors, arch, world, bytes, dtypes, capturing).prop_map(|(v, a, w, b, d, c)| rule(v, a, w, b, d, c))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]
        /// The per-communicator shortcut (the rules that can match its vendor, arch and world, found once) chooses
        /// exactly what scanning the whole table does, with the same reason, or fails the same way.
        #[test]
        fn selecting_among_a_communicators_candidates_equals_scanning_the_table(
            rules in proptest::collection::vec((arb_rule(), proptest::sample::subsequence(Algorithm::ALL.to_vec(), 1..=3)), 0..10),
            vendor in proptest::sample::select(vec![Vendor::Host, Vendor::Nvidia, Vendor::Amd]),
            arch in proptest::sample::select(vec!["sm_90", "sm_80", "gfx942", "host"]),
            world in 1usize..8,
            bytes in 0u64..600,
            dtype in proptest::sample::select(DataType::ALL.to_vec()),
            capturing in proptest::prelude::any::<bool>(),
            refused in proptest::sample::subsequence(Algorithm::ALL.to_vec(), 0..=Algorithm::ALL.len()),
        ) {
            let rules = rules
                .into_iter()
                .enumerate()
                .map(|(n, (mut r, algorithms))| {
                    r.algorithms = algorithms;
                    r.origin = format!("rule {n}");
                    r.labelled()
                })
                .collect();
            let sel = Selector { table: SelectorTable { rules }, ..Selector::default() };
            let q = SelectionQuery { vendor, arch, world, bytes, dtype, capturing };
            let eligible = |a: Algorithm| if refused.contains(&a) { Err(format!("{a} refused")) } else { Ok(()) };
            let whole = sel.select(&q, eligible);
            let among = sel.select_among(&sel.candidates(vendor, arch, world), &q, false, eligible);
            proptest::prop_assert_eq!(format!("{whole:?}"), format!("{among:?}"));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]
        /// The sweep finds an overlap exactly when comparing every pair does, and the pair it names overlaps.
        #[test]
        fn overlap_sweep_agrees_with_every_pair(rules in proptest::collection::vec(arb_rule(), 0..12)) {
            let naive = (0..rules.len()).any(|j| (0..j).any(|i| rules[i].overlaps(&rules[j])));
            let found = overlap::find(&rules);
            proptest::prop_assert_eq!(found.is_some(), naive, "{:#?}", rules);
            if let Some((i, j)) = found {
                proptest::prop_assert!(i < j && rules[i].overlaps(&rules[j]));
            }
        }

        /// Arbitrary text (any Unicode) never panics the table parser.
        #[test]
        fn parser_never_panics_on_any_text(text in "\\PC{0,200}") {
            let _ = SelectorTable::parse(&text, "any.toml");
        }
    }

    #[cfg(unix)]
    #[test]
    fn table_sources_read_as_probe_prints_them() {
        assert_eq!(TableSource::Defaults.to_string(), "built-in defaults");
        let file = TableSource::File { path: PathBuf::from("/etc/anyccl/tune.toml"), via: ENV_TABLE_FILE.to_owned() };
        assert_eq!(file.to_string(), "/etc/anyccl/tune.toml (via ANYCCL_TUNE_FILE), then the built-in defaults");
    }

    mod files {
        use super::super::*;

        fn dir(name: &str) -> PathBuf {
            let d = std::env::temp_dir().join(format!("anyccl-selector-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).expect("temp dir");
            d
        }

        /// Through the `mkfifo` tool: this crate has no unsafe code, not even in tests.
        fn mkfifo(p: &Path) {
            let st = std::process::Command::new("mkfifo").arg(p).status().expect("mkfifo runs");
            assert!(st.success(), "mkfifo {}", p.display());
        }

        fn load_err(p: &Path) -> String {
            match SelectorTable::load(p) {
                Err(Error::Config { source_name, line: None, message }) => {
                    assert_eq!(source_name, p.display().to_string());
                    message
                }
                other => panic!("{}: {other:?}", p.display()),
            }
        }

        /// Devices, FIFOs (directly or through a symlink) and directories are refused without reading, so none
        /// can hang the caller or fill its memory; each error names the file and what it is.
        #[test]
        fn only_regular_files_are_read() {
            let d = dir("kinds");
            let fifo = d.join("fifo");
            mkfifo(&fifo);
            let link = d.join("link");
            std::os::unix::fs::symlink(&fifo, &link).expect("symlink");
            assert!(load_err(&fifo).contains("a FIFO"));
            assert!(load_err(&link).contains("a FIFO"));
            assert!(load_err(&d).contains("a directory"));
            assert!(load_err(Path::new("/dev/zero")).contains("a character device"));
            assert!(load_err(Path::new("/dev/urandom")).contains("a character device"));
            assert!(load_err(&d.join("missing")).contains("No such file"));
            std::fs::remove_dir_all(&d).ok();
        }

        #[test]
        fn size_cap_and_encoding() {
            let d = dir("size");
            let big = d.join("big.toml");
            let f = std::fs::File::create(&big).expect("create");
            // Sparse: 100 MB on paper, nothing on disk; refused from its size alone.
            f.set_len(100_000_000).expect("set_len");
            assert!(load_err(&big).contains("limited to 4 MiB"), "{}", load_err(&big));
            f.set_len(MAX_TABLE_FILE_BYTES + 1).expect("set_len");
            assert!(load_err(&big).contains("limited to 4 MiB"));
            let latin1 = d.join("latin1.toml");
            std::fs::write(&latin1, b"# caf\xe9\n").expect("write");
            assert!(load_err(&latin1).contains("not UTF-8"));
            let ok = d.join("ok.toml");
            std::fs::write(&ok, "[[rule]]\nalgorithms = [\"ring\"]\n").expect("write");
            assert_eq!(SelectorTable::load(&ok).expect("loads").rules.len(), 1);
            std::fs::remove_dir_all(&d).ok();
        }

        /// A "regular" file whose read fails (reading offset 0 of /proc/self/mem is an I/O error even for root)
        /// is an error naming the file, not a panic.
        #[test]
        fn read_errors_name_the_file() {
            let p = Path::new("/proc/self/mem");
            if p.exists() {
                assert!(load_err(p).contains("cannot read the table file"));
            }
        }
    }
}

/// The fused all-reduce + RMSNorm's rules and selection.
#[cfg(test)]
mod fused_tests {
    use super::*;
    use crate::fused::{RmsNormForm::*, RmsNormSpec};

    fn q(world: usize, bytes: u64) -> SelectionQuery<'static> {
        SelectionQuery { vendor: Vendor::Nvidia, arch: "sm_90", world, bytes, dtype: DataType::Bf16, capturing: false }
    }

    fn call(tokens: usize) -> RmsNormCall {
        RmsNormSpec::new(DataType::Bf16, tokens, 8192, 1e-6).call().expect("valid")
    }

    const TABLE: &str = r#"
[[rule]]
world = "2-8"
bytes = "0-64KiB"
algorithms = ["one-shot"]

[[rule]]
world = "2-8"
bytes = "0-64KiB"
fused_rmsnorm = ["unfused", "fused-one-shot"]

[[rule]]
world = "2-8"
bytes = "64KiB-"
algorithms = ["two-shot"]
fused_rmsnorm = ["fused-two-shot"]
"#;

    #[test]
    fn tables_with_and_without_fused_rules_parse() {
        // A version-1 file of all-reduce rules only parses as before: no fused forms.
        let old = SelectorTable::parse("[[rule]]\nalgorithms = [\"ring\"]\n", "old.toml").expect("old file");
        assert!(old.rules[0].fused.is_empty());
        assert_eq!(old.rules[0].algorithms, vec![Algorithm::Ring]);
        let t = SelectorTable::parse(TABLE, "t.toml").expect("parses");
        assert_eq!(t.rules[1].algorithms, vec![]);
        assert_eq!(t.rules[1].fused, vec![Unfused, FusedOneShot]);
        assert_eq!(t.rules[2].fused, vec![FusedTwoShot]);
        assert!(t.rules[1].to_string().ends_with("fused_rmsnorm -> unfused, fused-one-shot"), "{}", t.rules[1]);
        assert!(t.rules[2].to_string().ends_with("-> two-shot; fused_rmsnorm -> fused-two-shot"), "{}", t.rules[2]);
        // Neither list, an empty list, an unknown form: errors naming the line.
        let e = SelectorTable::parse("version = 1\n\n[[rule]]\nworld = 2\n", "t.toml").expect_err("no lists");
        assert!(matches!(&e, Error::Config { line: Some(3), .. }) && e.to_string().contains("fused_rmsnorm"), "{e}");
        let e = SelectorTable::parse("[[rule]]\nfused_rmsnorm = []\n", "t.toml").expect_err("empty");
        assert!(matches!(&e, Error::Config { line: Some(2), .. }), "{e}");
        let e = SelectorTable::parse("[[rule]]\nfused_rmsnorm = [\"fast\"]\n", "t.toml").expect_err("unknown");
        assert!(e.to_string().contains("fast") && e.to_string().contains("fused-two-shot"), "{e}");
        // Two fused rules that overlap are refused; a fused rule over an all-reduce rule is not an overlap.
        let both = "[[rule]]\nbytes = \"0-1MiB\"\nfused_rmsnorm = [\"unfused\"]\n\n[[rule]]\nbytes = \"512KiB-\"\n\
                    fused_rmsnorm = [\"fused-one-shot\"]\n";
        let e = SelectorTable::parse(both, "t.toml").expect_err("overlap");
        assert!(matches!(&e, Error::Config { line: Some(7), .. }) && e.to_string().contains("overlaps"), "{e}");
    }

    #[test]
    fn forced_env_table_and_default_in_that_order() {
        let ok = |_: RmsNormForm| Ok(());
        let s = Selector::defaults();
        // Default rule: one-shot up to 512 KiB (32 rows of 8192 bf16), two-shot above, one-shot below a row a rank.
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(32), None, ok).expect("ok").form, FusedOneShot);
        let big = s.select_rmsnorm(&q(8, 0), &call(33), None, ok).expect("ok");
        assert_eq!(big.form, FusedTwoShot);
        assert!(big.why.contains("default rule"), "{}", big.why);
        assert_eq!(s.select_rmsnorm(&q(64, 0), &call(33), None, ok).expect("ok").form, FusedOneShot);
        // The backend's refusal of two-shot (scratch too small) falls back to one-shot, then unfused.
        let no2 = |f: RmsNormForm| if f == FusedTwoShot { Err("scratch".to_owned()) } else { Ok(()) };
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(512), None, no2).expect("ok").form, FusedOneShot);
        let only_unfused = |f: RmsNormForm| if f == Unfused { Ok(()) } else { Err("kernels off".to_owned()) };
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(512), None, only_unfused).expect("ok").form, Unfused);
        let none = |_: RmsNormForm| Err("no".to_owned());
        let e = s.select_rmsnorm(&q(8, 0), &call(1), None, none).expect_err("none");
        assert!(matches!(&e, Error::NoEligibleAlgorithm { why } if why.contains("fused-two-shot: no")), "{e}");

        // Table rules (bytes of the input): 16 KiB → the fused-only rule, whose first eligible form wins.
        let table = SelectorTable::parse(TABLE, "t.toml").expect("parses");
        let mut rules = table.rules;
        rules.extend(SelectorTable::defaults().rules);
        let t = Selector { table: SelectorTable { rules }, ..Selector::defaults() };
        let small = t.select_rmsnorm(&q(4, 16 << 10), &call(1), None, ok).expect("ok");
        assert_eq!(small.form, Unfused);
        assert!(small.why.starts_with("t.toml:"), "{}", small.why);
        let no_unfused = |f: RmsNormForm| if f == Unfused { Err("x".to_owned()) } else { Ok(()) };
        assert_eq!(t.select_rmsnorm(&q(4, 16 << 10), &call(1), None, no_unfused).expect("ok").form, FusedOneShot);
        assert_eq!(t.select_rmsnorm(&q(4, 1 << 20), &call(64), None, ok).expect("ok").form, FusedTwoShot);
        // A world the table does not cover: the default rule.
        let d = t.select_rmsnorm(&q(16, 16 << 10), &call(1), None, ok).expect("ok");
        assert!(d.why.contains("default rule"), "{}", d.why);
        // The fused-only rule leaves all-reduce alone: 16 KiB at world 4 is the first rule's one-shot.
        let ar = t.select(&q(4, 16 << 10), |_| Ok(())).expect("ok");
        assert_eq!(ar.algorithm, Algorithm::OneShot);

        // The environment's form beats the table; the call's beats the environment's.
        let env = t.clone().with_fused_forced(Some(FusedTwoShot));
        assert_eq!(env.fused_forced(), Some(FusedTwoShot));
        let e = env.select_rmsnorm(&q(4, 16 << 10), &call(1), None, ok).expect("ok");
        assert_eq!((e.form, &*e.why), (FusedTwoShot, "forced by ANYCCL_FUSED_RMSNORM"));
        let c = env.select_rmsnorm(&q(4, 16 << 10), &call(1), Some(Unfused), ok).expect("ok");
        assert_eq!(c.form, Unfused);
        assert!(c.why.contains("RmsNormSpec::form"), "{}", c.why);
        // A forced form the backend refuses is an error naming it, never a silent change.
        let e = env.select_rmsnorm(&q(4, 16 << 10), &call(1), None, no2).expect_err("refused");
        assert!(e.to_string().contains("fused-two-shot") && e.to_string().contains("scratch"), "{e}");
    }

    /// The default rule: fused push first up to 128 KiB (8 rows of 8192 bf16), fused one-shot from there; a
    /// backend without the push form falls back to fused one-shot with the rule's text.
    #[test]
    fn the_default_rule_tries_fused_push_up_to_128_kib() {
        let s = Selector::defaults();
        let ok = |_: RmsNormForm| Ok(());
        let got = s.select_rmsnorm(&q(8, 0), &call(8), None, ok).expect("ok");
        assert_eq!(got.form, FusedPush);
        assert!(got.why.contains("fused push up to 128 KiB"), "{}", got.why);
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(9), None, ok).expect("ok").form, FusedOneShot);
        let host = |f: RmsNormForm| if f == FusedPush { Err("not offered".to_owned()) } else { Ok(()) };
        assert_eq!(s.select_rmsnorm(&q(2, 0), &call(8), None, host).expect("ok").form, FusedOneShot);
        assert_eq!("push".parse::<RmsNormForm>().expect("alias"), FusedPush);
        assert_eq!(FusedPush.name(), "fused-push");
    }

    /// Deterministic mode skips no form (each sums in rank order): the same choices with it on.
    #[test]
    fn deterministic_mode_keeps_every_form() {
        let s = Selector::defaults().with_deterministic(true);
        let ok = |_: RmsNormForm| Ok(());
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(1), None, ok).expect("ok").form, FusedPush);
        let no_push = |f: RmsNormForm| if f == FusedPush { Err("no push buffers".to_owned()) } else { Ok(()) };
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(1), None, no_push).expect("ok").form, FusedOneShot);
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(512), None, ok).expect("ok").form, FusedTwoShot);
        assert_eq!(s.select_rmsnorm(&q(8, 0), &call(512), Some(Unfused), ok).expect("ok").form, Unfused);
    }
}
