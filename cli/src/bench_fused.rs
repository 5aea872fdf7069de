//! `anyccl bench --fused rmsnorm`: the fused all-reduce + residual add + RMSNorm
//! ([`anyccl::Communicator::all_reduce_rmsnorm`]) for each token count, in each form (fused one-shot, fused
//! two-shot, and the baseline: the all-reduce followed by a separate RMSNorm, `unfused`), with the form `auto`
//! picks, the best fused form's time over the unfused one's, and a correctness check of every cell (`#wrong`:
//! output and new-residual elements that differ from the reference, bit for bit).
//!
//! Method: one thread per rank (the erased communicator, [`anyccl::dynamic`]); for each token count and form,
//! `warmup` untimed calls, then `iters` timed ones. Before each call the residual is reset (untimed, so it does not
//! grow from call to call); each timed call starts after a barrier and ends when this rank's stream has finished.
//! A cell reports rank 0's median. Then one more call per cell is checked on every rank against the reference: the
//! rank-order f32 sum rounded once, then core's row arithmetic (`anyccl::core::fused::norm_row`, which equals the
//! GPU kernels' reference bit for bit).

use std::time::Instant;

use serde::Serialize;

use anyccl::core::fused::{from_f32, norm_row, to_f32, RmsNormCall, RmsNormForm, RmsNormSpec};
use anyccl::core::units::format_bytes;
use anyccl::core::{DataType, Error, InvalidArgument, Result};
use anyccl::dynamic::{AnyBuffer, AnyStream, BackendKind, DynComm};
use anyccl::Selector;

use crate::tune::{boundary, bytes_range, rules_toml, RuleOut};

/// The most token counts one run takes (`--tokens`).
pub const MAX_TOKEN_COUNTS: usize = 64;
/// The largest input of one call (`--tokens` × `--hidden` elements): 1 GiB.
pub const MAX_CALL_BYTES: usize = 1 << 30;
/// `eps` of every call.
pub const EPS: f32 = 1e-6;

/// What to measure.
#[derive(Debug, Clone)]
pub struct FusedConfig {
    /// Number of ranks.
    pub world: usize,
    /// f16 or bf16.
    pub dtype: DataType,
    /// Elements per row.
    pub hidden: usize,
    /// Rows per call, one row of the report each.
    pub tokens: Vec<usize>,
    /// Timed calls per cell.
    pub iters: usize,
    /// Untimed calls before them.
    pub warmup: usize,
}

impl FusedConfig {
    /// Checks the sizes before anything is set up: each call's spec ([`RmsNormSpec::call`]: type, `hidden`,
    /// sizes), the number of token counts, and each call's bytes. Returns the calls.
    pub fn calls(&self) -> Result<Vec<RmsNormCall>> {
        if self.tokens.is_empty() || self.tokens.len() > MAX_TOKEN_COUNTS {
            return Err(InvalidArgument::OutOfRange {
                what: "--tokens (how many counts)",
                value: self.tokens.len() as u64,
                min: 1,
                max: MAX_TOKEN_COUNTS as u64,
            }
            .into());
        }
        self.tokens
            .iter()
            .map(|&t| {
                let call = RmsNormSpec::new(self.dtype, t, self.hidden, EPS).call()?;
                if call.bytes > MAX_CALL_BYTES {
                    return Err(InvalidArgument::SizeTooLarge {
                        what: "--tokens × --hidden",
                        requested: call.bytes as u64,
                        limit: MAX_CALL_BYTES as u64,
                    }
                    .into());
                }
                Ok(call)
            })
            .collect()
    }
}

/// One form at one token count.
#[derive(Debug, Clone, Serialize)]
pub struct FusedCell {
    /// The form's name.
    pub form: RmsNormForm,
    /// Rank 0's median time per call in microseconds (`None`: the form cannot run the call here).
    pub us: Option<f64>,
    /// Why the form cannot run the call, where it cannot.
    pub ineligible: Option<String>,
    /// Output and new-residual elements that differ from the reference, over every rank.
    pub wrong: usize,
}

/// One token count.
#[derive(Debug, Clone, Serialize)]
pub struct FusedRow {
    /// Rows of the call.
    pub tokens: usize,
    /// Bytes of one rank's input.
    pub bytes: usize,
    /// The form `auto` picks (the selector's table and default rule), and why.
    pub auto: RmsNormForm,
    /// The rule behind `auto`.
    pub why: String,
    /// Each form, in [`RmsNormForm::ALL`] order.
    pub cells: Vec<FusedCell>,
    /// The best fused form's time over the unfused form's (below 1: the fusion pays).
    pub fused_over_unfused: Option<f64>,
}

/// What `anyccl bench --fused rmsnorm` measured.
#[derive(Debug, Clone, Serialize)]
pub struct FusedReport {
    /// The call measured.
    pub op: &'static str,
    /// Backend.
    pub backend: &'static str,
    /// Rank 0's architecture (`sm_90`, `host`), what tuned rules name.
    pub arch: String,
    /// Ranks.
    pub world: usize,
    /// Element type.
    pub dtype: DataType,
    /// Elements per row.
    pub hidden: usize,
    /// Timed calls per cell.
    pub iters: usize,
    /// One row per token count.
    pub rows: Vec<FusedRow>,
    /// Wrong elements over every cell.
    pub wrong: usize,
    /// How it was measured and checked.
    pub method: &'static str,
}

/// Element `i` of rank `r`'s input (`r = world`: the residual, `r = world + 1`: the weight): reproducible values
/// in [-1, 1) of several magnitudes, so the order of the additions shows.
fn value(dtype: DataType, r: usize, i: usize) -> u16 {
    let mut s = (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    s ^= s >> 31;
    s = s.wrapping_mul(0x94d0_49bb_1331_11eb);
    s ^= s >> 29;
    let u = (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
    from_f32(dtype, (u * [1.0, 0.01, 8.0][i % 3]) as f32)
}

fn bytes_of(bits: &[u16]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_ne_bytes()).collect()
}

/// The expected output bytes and new residual of `call` on `world` ranks.
fn expected(call: &RmsNormCall, world: usize) -> (Vec<u8>, Vec<u16>) {
    let (dtype, hidden) = (call.dtype, call.hidden);
    let n = call.tokens * hidden;
    let weight: Vec<u16> = (0..hidden).map(|i| value(dtype, world + 1, i)).collect();
    let mut residual: Vec<u16> = (0..n).map(|i| value(dtype, world, i)).collect();
    let mut out = vec![0u8; call.out_bytes];
    let mut scratch = vec![0f32; hidden];
    let row_out = hidden * call.output.element_bytes(dtype);
    for t in 0..call.tokens {
        let reduced: Vec<u16> = (t * hidden..(t + 1) * hidden)
            .map(|i| {
                let mut acc = to_f32(dtype, value(dtype, 0, i));
                for r in 1..world {
                    acc += to_f32(dtype, value(dtype, r, i));
                }
                from_f32(dtype, acc)
            })
            .collect();
        let res = &mut residual[t * hidden..(t + 1) * hidden];
        norm_row(call, &reduced, res, &weight, &mut out[t * row_out..(t + 1) * row_out], &mut scratch);
    }
    (out, residual)
}

/// One rank's cell: its median time (`None`: ineligible, with the reason) and its wrong elements.
type RankCell = (Option<f64>, Option<String>, usize);

/// One rank's buffers for one call.
struct Bufs {
    input: AnyBuffer,
    residual: AnyBuffer,
    weight: AnyBuffer,
    out: AnyBuffer,
    residual0: Vec<u8>,
}

fn rank_bufs(c: &dyn DynComm, call: &RmsNormCall, st: &AnyStream) -> Result<Bufs> {
    let (dtype, world, rank) = (call.dtype, c.world_size(), c.rank());
    let n = call.tokens * call.hidden;
    let mut input = c.alloc(call.bytes)?;
    c.upload(&mut input, &bytes_of(&(0..n).map(|i| value(dtype, rank, i)).collect::<Vec<_>>()), st)?;
    let mut weight = c.alloc(call.weight_bytes())?;
    c.upload(&mut weight, &bytes_of(&(0..call.hidden).map(|i| value(dtype, world + 1, i)).collect::<Vec<_>>()), st)?;
    let residual0 = bytes_of(&(0..n).map(|i| value(dtype, world, i)).collect::<Vec<_>>());
    let residual = c.alloc(call.bytes)?;
    let out = c.alloc(call.out_bytes)?;
    Ok(Bufs { input, residual, weight, out, residual0 })
}

/// One call of `spec` with the residual reset first; the time from after the barrier to the stream's end.
fn timed_call(c: &mut dyn DynComm, b: &mut Bufs, spec: &RmsNormSpec, st: &AnyStream) -> Result<f64> {
    c.upload(&mut b.residual, &b.residual0, st)?;
    c.barrier(st)?;
    let t0 = Instant::now();
    c.all_reduce_rmsnorm(&b.input, &mut b.residual, &b.weight, &mut b.out, spec, st)?;
    c.synchronize(st)?;
    Ok(t0.elapsed().as_secs_f64() * 1e6)
}

/// Every cell of one rank: per call, per form.
fn rank_run(
    c: &mut dyn DynComm,
    cfg: &FusedConfig,
    calls: &[RmsNormCall],
    want: &[(Vec<u8>, Vec<u16>)],
) -> Result<Vec<Vec<RankCell>>> {
    let st = c.stream()?;
    let mut rows = Vec::with_capacity(calls.len());
    for (call, want) in calls.iter().zip(want) {
        let mut b = rank_bufs(c, call, &st)?;
        let mut cells = Vec::with_capacity(RmsNormForm::ALL.len());
        for form in RmsNormForm::ALL {
            // Eligibility is the same on every rank (a function of the call and the communicator's shape).
            if let Err(e) = c.select_rmsnorm(call, Some(form)) {
                cells.push((None, Some(e.to_string()), 0));
                continue;
            }
            let spec = RmsNormSpec::new(call.dtype, call.tokens, call.hidden, EPS).with_form(form);
            for _ in 0..cfg.warmup {
                timed_call(c, &mut b, &spec, &st)?;
            }
            let mut times = Vec::with_capacity(cfg.iters);
            for _ in 0..cfg.iters {
                times.push(timed_call(c, &mut b, &spec, &st)?);
            }
            times.sort_by(f64::total_cmp);
            let median = times.get(times.len() / 2).copied();
            timed_call(c, &mut b, &spec, &st)?;
            let mut out = vec![0u8; call.out_bytes];
            let mut res = vec![0u8; call.bytes];
            c.download(&b.out, &mut out, &st)?;
            c.download(&b.residual, &mut res, &st)?;
            let esz = call.output.element_bytes(call.dtype);
            let wrong_out = out.chunks(esz).zip(want.0.chunks(esz)).filter(|(a, b)| a != b).count();
            let want_res = bytes_of(&want.1);
            let wrong_res = res.chunks(2).zip(want_res.chunks(2)).filter(|(a, b)| a != b).count();
            cells.push((median, None, wrong_out + wrong_res));
        }
        rows.push(cells);
    }
    Ok(rows)
}

/// Runs the measurement on `kind` with `world` ranks of this process, one thread each.
pub fn run(kind: BackendKind, cfg: &FusedConfig, selector: std::sync::Arc<Selector>) -> Result<FusedReport> {
    let calls = cfg.calls()?;
    let want: Vec<(Vec<u8>, Vec<u16>)> = calls.iter().map(|c| expected(c, cfg.world)).collect();
    let chosen = anyccl::dynamic::communicators(kind.into(), cfg.world, selector)?;
    let first = chosen.comms.first().ok_or_else(|| Error::PeerFailure("no communicator was made".into()))?;
    let arch = first.arch().to_owned();
    let autos = calls.iter().map(|c| first.select_rmsnorm(c, None)).collect::<Result<Vec<_>>>()?;
    let results: Vec<Result<Vec<Vec<RankCell>>>> = std::thread::scope(|s| {
        let hs: Vec<_> = chosen
            .comms
            .into_iter()
            .map(|mut c| {
                let (calls, want) = (&calls, &want);
                s.spawn(move || rank_run(&mut *c, cfg, calls, want))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::PeerFailure("a rank's thread panicked".into()))))
            .collect()
    });
    let per_rank = results.into_iter().collect::<Result<Vec<_>>>()?;
    let mut rows = Vec::with_capacity(calls.len());
    let mut wrong = 0;
    for (i, (call, auto)) in calls.iter().zip(autos).enumerate() {
        let cells: Vec<FusedCell> = RmsNormForm::ALL
            .iter()
            .enumerate()
            .map(|(j, &form)| {
                let (us, ineligible, _) = per_rank[0][i][j].clone();
                let w: usize = per_rank.iter().map(|r| r[i][j].2).sum();
                FusedCell { form, us, ineligible, wrong: w }
            })
            .collect();
        wrong += cells.iter().map(|c| c.wrong).sum::<usize>();
        let unfused = cells.iter().find(|c| c.form == RmsNormForm::Unfused).and_then(|c| c.us);
        let best_fused = cells.iter().filter(|c| c.form.is_fused()).filter_map(|c| c.us).min_by(f64::total_cmp);
        let fused_over_unfused = best_fused.zip(unfused).filter(|(_, u)| *u > 0.0).map(|(f, u)| f / u);
        rows.push(FusedRow {
            tokens: call.tokens,
            bytes: call.bytes,
            auto: auto.form,
            why: auto.why.to_string(),
            cells,
            fused_over_unfused,
        });
    }
    Ok(FusedReport {
        op: "all-reduce + residual add + RMSNorm",
        backend: kind.name(),
        arch,
        world: cfg.world,
        dtype: cfg.dtype,
        hidden: cfg.hidden,
        iters: cfg.iters,
        rows,
        wrong,
        method: "one thread per rank; per cell `warmup` untimed then `iters` timed calls, each after a barrier \
                 until its stream finished, the residual reset before each (untimed); rank 0's median; then one \
                 call per cell checked on every rank, bit for bit, against the rank-order sum and core's RMSNorm",
    })
}

/// The selector table `anyccl tune --fused rmsnorm` writes from `r` (vendor `vendor`): one `fused_rmsnorm` rule per
/// token count, over the input sizes from halfway (geometrically) below it to halfway above it, naming the forms
/// that ran, fastest first. Errors when no form ran at any token count.
pub fn table_text(r: &FusedReport, vendor: &str) -> Result<String> {
    let mut rows: Vec<(usize, Vec<RmsNormForm>)> = r
        .rows
        .iter()
        .filter_map(|row| {
            let mut ran: Vec<(f64, RmsNormForm)> =
                row.cells.iter().filter_map(|c| c.us.map(|us| (us, c.form))).collect();
            ran.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!ran.is_empty()).then(|| (row.bytes, ran.into_iter().map(|(_, f)| f).collect()))
        })
        .collect();
    rows.sort_by_key(|(b, _)| *b);
    rows.dedup_by_key(|(b, _)| *b);
    if rows.is_empty() {
        return Err(Error::NoEligibleAlgorithm {
            why: "no form of the fused all-reduce + RMSNorm ran at any --tokens (see `anyccl bench --fused rmsnorm`)"
                .into(),
        });
    }
    let mut rules = Vec::with_capacity(rows.len());
    let mut start = 0u64;
    for (i, (bytes, forms)) in rows.iter().enumerate() {
        let end = rows.get(i + 1).map(|(next, _)| boundary(*bytes as u64, *next as u64));
        rules.push(RuleOut {
            vendor: vendor.to_owned(),
            arch: r.arch.clone(),
            world: r.world.to_string(),
            dtype: vec![r.dtype.name().to_owned()],
            bytes: bytes_range(start, end),
            algorithms: Vec::new(),
            fused_rmsnorm: forms.iter().map(|f| f.name().to_owned()).collect(),
        });
        start = end.unwrap_or(start);
    }
    let body = rules_toml(&rules)?;
    Ok(format!(
        "# Written by `anyccl tune --fused rmsnorm`: backend {}, world {}, {} hidden {}; fastest form first.\n\
         # Rules are tried before the built-in defaults (ANYCCL_TUNE_FILE or --table).\n\n{body}",
        r.backend, r.world, r.dtype, r.hidden
    ))
}

/// The report as a table: one row per token count, a column per form (µs), `auto`'s form, fused/unfused and
/// `#wrong`.
pub fn render_table(r: &FusedReport) -> String {
    let mut s = format!(
        "# anyccl bench --fused rmsnorm: {} on {}, {} ranks, {} hidden {}, {} timed calls per cell\n",
        r.op, r.backend, r.world, r.dtype, r.hidden, r.iters
    );
    s += &format!(
        "{:>8} {:>10} {:>16} {:>16} {:>16} {:>16} {:>16} {:>13} {:>7}\n",
        "tokens",
        "bytes",
        "fused-one-shot",
        "fused-two-shot",
        "fused-push",
        "unfused",
        "auto",
        "fused/unfused",
        "#wrong"
    );
    for row in &r.rows {
        let t = |f: RmsNormForm| {
            row.cells.iter().find(|c| c.form == f).map_or("-".to_owned(), |c| match c.us {
                Some(us) => format!("{us:.1} us"),
                None => "n/a".to_owned(),
            })
        };
        let ratio = row.fused_over_unfused.map_or("-".to_owned(), |x| format!("{x:.2}x"));
        let wrong: usize = row.cells.iter().map(|c| c.wrong).sum();
        s += &format!(
            "{:>8} {:>10} {:>16} {:>16} {:>16} {:>16} {:>16} {:>13} {:>7}\n",
            row.tokens,
            format_bytes(row.bytes as u64),
            t(RmsNormForm::FusedOneShot),
            t(RmsNormForm::FusedTwoShot),
            t(RmsNormForm::FusedPush),
            t(RmsNormForm::Unfused),
            row.auto.name(),
            ratio,
            wrong
        );
    }
    for row in &r.rows {
        for c in row.cells.iter().filter(|c| c.ineligible.is_some()) {
            s += &format!("# {} tokens, {}: n/a: {}\n", row.tokens, c.form, c.ineligible.as_deref().unwrap_or(""));
        }
    }
    s += &format!("# method: {}\n", r.method);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tokens: Vec<usize>, hidden: usize) -> FusedConfig {
        FusedConfig { world: 2, dtype: DataType::Bf16, hidden, tokens, iters: 2, warmup: 1 }
    }

    #[test]
    fn sizes_are_checked_before_anything_runs() {
        assert_eq!(cfg(vec![1, 8], 8192).calls().expect("valid").len(), 2);
        let e = cfg(vec![1], 8193).calls().expect_err("hidden");
        assert!(e.to_string().contains("hidden"), "{e}");
        let e = cfg(vec![], 8192).calls().expect_err("empty");
        assert!(e.to_string().contains("--tokens"), "{e}");
        let e = cfg(vec![1 << 20], 16384).calls().expect_err("too large");
        assert!(e.to_string().contains("--tokens × --hidden"), "{e}");
        let e = cfg(vec![usize::MAX], 16384).calls().expect_err("overflow");
        assert!(e.to_string().contains("overflows"), "{e}");
        let mut c = cfg(vec![1], 64);
        c.dtype = DataType::F32;
        assert!(c.calls().expect_err("f32").to_string().contains("f32"));
    }

    /// A quick run on host ranks: every form measured and right, `auto` named, the table printed.
    #[test]
    fn a_quick_host_run_measures_every_form_and_finds_nothing_wrong() {
        let r = run(BackendKind::Host, &cfg(vec![1, 3], 256), std::sync::Arc::new(Selector::defaults())).expect("ran");
        assert_eq!((r.rows.len(), r.wrong), (2, 0));
        for row in &r.rows {
            assert_eq!(row.cells.len(), 4);
            // The host runs every form but the fused push one-shot, which it refuses with the reason.
            for c in &row.cells {
                if c.form == RmsNormForm::FusedPush {
                    assert!(
                        c.us.is_none() && c.ineligible.as_deref().is_some_and(|w| w.contains("fused-push")),
                        "{c:?}"
                    );
                } else {
                    assert!(c.us.is_some_and(|us| us > 0.0) && c.wrong == 0, "{row:?}");
                }
            }
            assert_eq!(row.auto, RmsNormForm::FusedOneShot);
            assert!(row.fused_over_unfused.is_some());
        }
        let t = render_table(&r);
        assert!(t.contains("fused-one-shot") && t.contains("#wrong") && t.contains("unfused"), "{t}");
    }

    /// The tuned table names the fastest form first per token count, over ranges that partition the sizes, and
    /// parses back; the selector then picks those forms.
    #[test]
    fn tuned_rules_name_the_fastest_form_and_parse_back() {
        let mut r =
            run(BackendKind::Host, &cfg(vec![1, 4], 64), std::sync::Arc::new(Selector::defaults())).expect("ran");
        // Make the measurements decisive: two-shot fastest at 1 token, unfused at 4.
        let set = |row: &mut FusedRow, us: [f64; 3]| {
            for (c, t) in row.cells.iter_mut().zip(us) {
                c.us = Some(t);
            }
        };
        set(&mut r.rows[0], [2.0, 1.0, 3.0]);
        set(&mut r.rows[1], [2.0, 3.0, 1.0]);
        let text = table_text(&r, "host").expect("table");
        let t = anyccl::core::SelectorTable::parse(&text, "tuned.toml").expect("parses back");
        assert_eq!(t.rules.len(), 2);
        assert_eq!(t.rules[0].fused, [RmsNormForm::FusedTwoShot, RmsNormForm::FusedOneShot, RmsNormForm::Unfused]);
        assert_eq!(t.rules[1].fused[0], RmsNormForm::Unfused);
        assert!(t.rules.iter().all(|r| r.algorithms.is_empty()));
        assert_eq!((t.rules[0].bytes_min, t.rules[1].bytes_max), (0, None));
        let empty = FusedReport { rows: vec![], ..r };
        assert!(table_text(&empty, "host").is_err());
    }

    /// The written text, byte for byte (the format `anyccl tune --fused rmsnorm` has always written).
    #[test]
    fn the_table_text_is_unchanged_byte_for_byte() {
        let mut r =
            run(BackendKind::Host, &cfg(vec![1, 4], 64), std::sync::Arc::new(Selector::defaults())).expect("ran");
        r.arch = "host".into();
        for (row, us) in r.rows.iter_mut().zip([[2.0, 1.0, 3.0], [2.0, 3.0, 1.0]]) {
            for (c, t) in row.cells.iter_mut().zip(us) {
                c.us = Some(t);
            }
        }
        let text = table_text(&r, "host").expect("table");
        assert_eq!(text, GOLDEN_FUSED, "{text}");
    }

    const GOLDEN_FUSED: &str = r#"# Written by `anyccl tune --fused rmsnorm`: backend host, world 2, bf16 hidden 64; fastest form first.
# Rules are tried before the built-in defaults (ANYCCL_TUNE_FILE or --table).

version = 1

[[rule]]
vendor = "host"
arch = "host"
world = "2"
dtype = ["bf16"]
bytes = "0-256"
fused_rmsnorm = ["fused-two-shot", "fused-one-shot", "unfused"]

[[rule]]
vendor = "host"
arch = "host"
world = "2"
dtype = ["bf16"]
bytes = "256-"
fused_rmsnorm = ["unfused", "fused-one-shot", "fused-two-shot"]
"#;

    /// The check finds a wrong result: the reference of another world differs from this world's results.
    #[test]
    fn the_reference_depends_on_every_rank() {
        let call = RmsNormSpec::new(DataType::F16, 2, 64, EPS).call().expect("valid");
        assert_ne!(expected(&call, 2), expected(&call, 3));
    }
}
