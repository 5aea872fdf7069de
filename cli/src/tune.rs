//! `anyccl tune`: measure every eligible all-reduce algorithm over a size sweep on this machine, write a selector
//! table (TOML) that picks the fastest per size range, and check that `auto` with it is within 5% of the best.

use std::path::Path;

use serde::Serialize;

use crate::bench::BenchReport;
use anyccl::core::{Algorithm, Error, Result, SelectorTable};

/// How far `auto` may be from the best measured algorithm, at any size of the sweep.
pub const TOLERANCE: f64 = 0.05;

/// A selector table file as `anyccl tune` writes it (version 1), for the plain and the fused (`--fused rmsnorm`)
/// tables alike.
#[derive(Serialize)]
struct TableOut<'a> {
    version: i64,
    rule: &'a [RuleOut],
}

/// One rule of a written table: the fields in the order the files have always had them; a rule names
/// `algorithms` (all-reduce), `fused_rmsnorm` (the fused forms), and the empty one is left out.
#[derive(Serialize)]
pub(crate) struct RuleOut {
    pub(crate) vendor: String,
    pub(crate) arch: String,
    pub(crate) world: String,
    pub(crate) dtype: Vec<String>,
    pub(crate) bytes: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) algorithms: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) fused_rmsnorm: Vec<String>,
}

/// The TOML of a table of `rules` (version 1).
pub(crate) fn rules_toml(rules: &[RuleOut]) -> Result<String> {
    toml::to_string(&TableOut { version: 1, rule: rules }).map_err(|e| Error::Config {
        source_name: "tuned table".into(),
        line: None,
        message: e.to_string(),
    })
}

/// A rule's `bytes` range from `start` to `end` (`None`: open).
pub(crate) fn bytes_range(start: u64, end: Option<u64>) -> String {
    match end {
        Some(e) => format!("{start}-{e}"),
        None => format!("{start}-"),
    }
}

/// The boundary between the measured sizes `below` and `above`: their geometric mean, rounded down to a multiple of
/// 16 bytes (at least 16).
pub(crate) fn boundary(below: u64, above: u64) -> u64 {
    let b = ((below as f64) * (above as f64)).sqrt() as u64;
    (b / 16).max(1) * 16
}

/// The fastest measured algorithm per size of `report` (sizes ascending).
pub fn winners(report: &BenchReport) -> Vec<(u64, Algorithm)> {
    let mut v: Vec<(u64, Algorithm)> = report
        .rows
        .iter()
        .filter_map(|r| {
            r.out_of_place
                .cells
                .iter()
                .filter(|c| c.median_us.is_finite())
                .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
                .map(|c| (r.bytes, c.algorithm))
        })
        .collect();
    v.sort_by_key(|(b, _)| *b);
    v
}

/// The table text for `report`: one rule per run of sizes with the same winner; boundaries at the geometric mean
/// of neighbouring sizes (16-byte multiples); the first range starts at 0 and the last is open. `fallback` follows
/// the winner in each rule, for calls the winner cannot run.
pub fn table_text(report: &BenchReport, vendor: &str, arch: &str, fallback: Algorithm) -> Result<String> {
    let w = winners(report);
    if w.is_empty() {
        return Err(nothing_measured(report));
    }
    let mut rules = Vec::new();
    let mut start = 0u64;
    let mut i = 0;
    while i < w.len() {
        let algo = w[i].1;
        let mut j = i;
        while j + 1 < w.len() && w[j + 1].1 == algo {
            j += 1;
        }
        let end = w.get(j + 1).map(|(next, _)| boundary(w[j].0, *next));
        let mut algorithms = vec![algo.name().to_owned()];
        if fallback != algo {
            algorithms.push(fallback.name().to_owned());
        }
        rules.push(RuleOut {
            vendor: vendor.to_owned(),
            arch: arch.to_owned(),
            world: report.world.to_string(),
            dtype: vec![report.dtype.name().to_owned()],
            bytes: bytes_range(start, end),
            algorithms,
            fused_rmsnorm: Vec::new(),
        });
        start = end.unwrap_or(start);
        i = j + 1;
    }
    let body = rules_toml(&rules)?;
    Ok(format!(
        "# Written by `anyccl tune`: backend {}, world {}, {} {}; {}\n# Rules are tried before the built-in defaults (ANYCCL_TUNE_FILE or --table).\n\n{body}",
        report.backend, report.world, report.dtype, report.op, report.method
    ))
}

/// Why a sweep measured no algorithm: each one asked for and why it could not run.
fn nothing_measured(report: &BenchReport) -> Error {
    let why = if report.ineligible.is_empty() {
        "the sweep measured no algorithm at any size".to_owned()
    } else {
        report.ineligible.iter().map(|i| format!("{}: {}", i.algorithm, i.reason)).collect::<Vec<_>>().join("; ")
    };
    Error::NoEligibleAlgorithm { why: format!("tune has nothing to compare on the {} backend ({why})", report.backend) }
}

/// Refuses, before any sweep, an `--algos` list of which `backend` implements none (`implemented`): tune would
/// have nothing to compare. `None` (every algorithm) is fine. Only the host backend implements a subset.
#[cfg(feature = "host")]
pub fn check_measurable(requested: Option<&[Algorithm]>, implemented: &[Algorithm], backend: &str) -> Result<()> {
    let Some(requested) = requested else { return Ok(()) };
    if requested.iter().any(|a| implemented.contains(a)) {
        return Ok(());
    }
    let names = |v: &[Algorithm]| v.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ");
    Err(Error::Config {
        source_name: "--algos".into(),
        line: None,
        message: format!(
            "tune has nothing to measure: {} {} not implemented by the {backend} backend (it implements {})",
            names(requested),
            if requested.len() == 1 { "is" } else { "are" },
            names(implemented)
        ),
    })
}

/// Writes `text` to `path` (whole or not at all) after checking it parses back.
pub fn write_table(path: &Path, text: &str) -> Result<SelectorTable> {
    let parsed = SelectorTable::parse(text, &path.display().to_string())?;
    crate::output::write_atomically(path, text.as_bytes(), "--out", "the tuned table")?;
    Ok(parsed)
}

/// One size of the check: `auto` against the best of the same run.
#[derive(Debug, Clone, Serialize)]
pub struct CheckRow {
    /// Message size.
    pub bytes: u64,
    /// The algorithm `auto` chose.
    pub auto: Algorithm,
    /// Its median, µs.
    pub auto_us: f64,
    /// Its fastest call, µs.
    pub auto_min_us: f64,
    /// The fastest algorithm of the run.
    pub best: Algorithm,
    /// Its median, µs.
    pub best_us: f64,
    /// Its fastest call, µs.
    pub best_min_us: f64,
    /// Whether a rule of the tuned table chose `auto`'s algorithm (not `ANYCCL_ALLREDUCE_ALGO`, not a rule of
    /// another table or of the defaults).
    pub followed_table: bool,
    /// Whether `auto` is fast enough: it chose the fastest algorithm, or its median or its fastest call is within
    /// [`TOLERANCE`] of the best's (timing noise on a busy machine moves one of the two, rarely both).
    pub fast: bool,
    /// Both.
    pub ok: bool,
}

/// Compares `auto` with the best measured algorithm at every size of `report` (a run with the tuned table, whose
/// rules name it as `table`), out of place.
pub fn check(report: &BenchReport, table: &str) -> Vec<CheckRow> {
    let origin = format!("{table}:");
    report
        .rows
        .iter()
        .filter_map(|r| {
            let p = &r.out_of_place;
            let best = p
                .cells
                .iter()
                .filter(|c| c.median_us.is_finite())
                .min_by(|a, b| a.median_us.total_cmp(&b.median_us))?;
            let within = |a: f64, b: f64| a <= b * (1.0 + TOLERANCE);
            let fast = p.auto.algorithm == best.algorithm
                || within(p.auto.median_us, best.median_us)
                || within(p.auto.min_us, best.min_us);
            let followed_table = p.auto_rule.starts_with(&origin);
            Some(CheckRow {
                bytes: r.bytes,
                auto: p.auto.algorithm,
                auto_us: p.auto.median_us,
                auto_min_us: p.auto.min_us,
                best: best.algorithm,
                best_us: best.median_us,
                best_min_us: best.min_us,
                followed_table,
                fast,
                ok: followed_table && fast,
            })
        })
        .collect()
}

/// Why the check failed, or `None` when every size passed.
pub fn failure(rows: &[CheckRow]) -> Option<String> {
    let bad: Vec<&CheckRow> = rows.iter().filter(|r| !r.ok).collect();
    if bad.is_empty() && !rows.is_empty() {
        return None;
    }
    if rows.is_empty() {
        return Some("tune's check measured no size".into());
    }
    let what: Vec<String> = bad
        .iter()
        .map(|r| {
            let size = anyccl::core::units::format_bytes(r.bytes);
            if r.followed_table {
                format!("{size}: auto ({}) is slower than {} by more than {:.0}%", r.auto, r.best, TOLERANCE * 100.0)
            } else {
                format!("{size}: auto chose {} by a rule that is not the tuned table's", r.auto)
            }
        })
        .collect();
    Some(format!("tune's check failed at {} of {} sizes ({})", bad.len(), rows.len(), what.join("; ")))
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;
    use crate::bench::{cell, Placement, Row};
    use anyccl::core::{DataType, ReduceOp};

    /// (bytes, measured cells, auto cell) per row.
    type Rows<'a> = &'a [(u64, &'a [(Algorithm, f64)], (Algorithm, f64))];

    fn report(rows: Rows<'_>) -> BenchReport {
        BenchReport {
            schema: crate::bench::SCHEMA,
            backend: "host".into(),
            launch: crate::bench::Launch::Threads,
            library: None,
            ranks: Vec::new(),
            world: 4,
            dtype: DataType::Bf16,
            op: ReduceOp::Sum,
            iters: 1,
            warmup: 0,
            baseline: Algorithm::Ring,
            algorithms: vec![Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Ring],
            ineligible: Vec::new(),
            rows: rows
                .iter()
                .map(|(bytes, cells, auto)| Row {
                    bytes: *bytes,
                    count: (*bytes / 2) as usize,
                    out_of_place: Placement {
                        cells: cells.iter().map(|(a, us)| cell(*a, *us, *us, *bytes, 4)).collect(),
                        auto: cell(auto.0, auto.1, auto.1, *bytes, 4),
                        auto_rule: "tuned.toml:3: world 4".into(),
                        best: Algorithm::Ring,
                        best_speedup_vs_baseline: None,
                    },
                    in_place: None,
                    wrong: 0,
                    host_us_per_call: None,
                    raw_ccl_host_us_per_call: None,
                })
                .collect(),
            wrong: 0,
            check: "test".into(),
            method: "test".into(),
        }
    }

    #[test]
    fn rules_follow_the_winners_and_parse_back() {
        use Algorithm::*;
        let r = report(&[
            (4096, &[(OneShot, 10.0), (TwoShot, 12.0), (Ring, 20.0)], (OneShot, 10.0)),
            (16384, &[(OneShot, 15.0), (TwoShot, 14.0), (Ring, 20.0)], (OneShot, 15.0)),
            (65536, &[(OneShot, 40.0), (TwoShot, 30.0), (Ring, 35.0)], (TwoShot, 30.0)),
        ]);
        let text = table_text(&r, "host", "host", Ring).expect("table");
        let t = SelectorTable::parse(&text, "tuned.toml").expect("parses back");
        assert_eq!(t.rules.len(), 2);
        assert_eq!(t.rules[0].algorithms, vec![OneShot, Ring]);
        assert_eq!((t.rules[0].bytes_min, t.rules[0].bytes_max), (0, Some(8192)));
        assert_eq!(t.rules[1].algorithms, vec![TwoShot, Ring]);
        assert_eq!((t.rules[1].bytes_min, t.rules[1].bytes_max), (8192, None));
        assert_eq!((t.rules[1].world_min, t.rules[1].world_max), (4, 4));
        let rows = check(&r, "tuned.toml");
        assert!(!rows[1].ok && rows[1].followed_table, "auto 15 vs best 14 is beyond 5%");
        assert!(rows[0].ok && rows[2].ok);
        let why = failure(&rows).expect("fails");
        assert!(
            why.contains("1 of 3 sizes") && why.contains("16 KiB: auto (one-shot) is slower than two-shot"),
            "{why}"
        );
        // Another table's rule (or ANYCCL_ALLREDUCE_ALGO) chose: the check fails even where auto was fastest.
        let rows = check(&r, "other.toml");
        assert!(rows.iter().all(|r| !r.followed_table && !r.ok));
        assert!(failure(&rows).expect("fails").contains("not the tuned table's"));
    }

    /// The written text, byte for byte (the format `anyccl tune` has always written; bench_fused's
    /// `table_text` shares the serialisation).
    #[test]
    fn the_table_text_is_unchanged_byte_for_byte() {
        use Algorithm::*;
        let r = report(&[
            (4096, &[(OneShot, 10.0), (Ring, 20.0)], (OneShot, 10.0)),
            (65536, &[(OneShot, 40.0), (Ring, 35.0)], (Ring, 35.0)),
        ]);
        let text = table_text(&r, "host", "host", Ring).expect("table");
        assert_eq!(text, GOLDEN_TUNE, "{text}");
    }

    const GOLDEN_TUNE: &str = r#"# Written by `anyccl tune`: backend host, world 4, bf16 sum; test
# Rules are tried before the built-in defaults (ANYCCL_TUNE_FILE or --table).

version = 1

[[rule]]
vendor = "host"
arch = "host"
world = "4"
dtype = ["bf16"]
bytes = "0-16384"
algorithms = ["one-shot", "ring"]

[[rule]]
vendor = "host"
arch = "host"
world = "4"
dtype = ["bf16"]
bytes = "16384-"
algorithms = ["ring"]
"#;

    /// Timing noise: auto on the best algorithm passes whatever the numbers; a different algorithm passes when its
    /// median or its fastest call is within the tolerance, and fails only when both are beyond it.
    #[test]
    fn the_check_tolerates_noise_in_one_of_median_and_fastest_call() {
        use Algorithm::*;
        let mut r = report(&[(4096, &[(OneShot, 10.0), (Ring, 20.0)], (OneShot, 13.0))]);
        assert!(check(&r, "tuned.toml")[0].ok, "same algorithm as the best");
        r.rows[0].out_of_place.auto.algorithm = Ring;
        assert!(!check(&r, "tuned.toml")[0].ok, "13 vs 10 in median and fastest call");
        r.rows[0].out_of_place.auto.min_us = 10.4;
        assert!(check(&r, "tuned.toml")[0].ok, "the fastest call is within 5%");
        assert_eq!(failure(&check(&r, "tuned.toml")), None);
        assert!(failure(&[]).is_some(), "an empty check is a failure");
    }

    #[test]
    fn nothing_to_measure_says_which_and_why() {
        use Algorithm::*;
        let e = check_measurable(Some(&[NvlsZeroCopy]), &[OneShot, TwoShot, Ring], "host").expect_err("none");
        let Error::Config { source_name, message, .. } = &e else { panic!("{e:?}") };
        assert_eq!(source_name, "--algos");
        assert!(message.contains("nvls-zero-copy is not implemented by the host backend"), "{message}");
        assert!(message.contains("one-shot, two-shot, ring"), "{message}");
        assert!(check_measurable(Some(&[NvlsZeroCopy, Ring]), &[Ring], "host").is_ok());
        assert!(check_measurable(None, &[Ring], "host").is_ok());
        // A report with nothing measured: the error names the algorithm and the reason, not "cannot parse".
        let mut r = report(&[]);
        r.ineligible = vec![crate::bench::Ineligible { algorithm: NvlsZeroCopy, reason: "no multicast".into() }];
        let e = table_text(&r, "host", "host", Ring).expect_err("empty").to_string();
        assert!(e.contains("nvls-zero-copy: no multicast") && !e.contains("cannot parse"), "{e}");
    }
}
