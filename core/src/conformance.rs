//! The conformance suite every backend runs (feature `conformance`).
//!
//! For each world size, the suite creates one communicator per rank, runs the ranks on threads, and for every
//! collective × dtype × valid op × element count × in-place/out-of-place (and, for all-reduce, every algorithm the
//! backend offers plus the selector's choice) it
//! - draws fresh random inputs per rank and call,
//! - poisons every output (all bytes `0xFF`: NaN for floats) and a guard region behind it,
//! - runs the call, and compares the result with an `f64` reference (exact `i128` arithmetic for integers) within
//!   the dtype's tolerance,
//! - checks that nothing past the output was written, that non-root outputs of `reduce` are untouched,
//! - and, after all ranks finish, that all-reduce results are bitwise identical on every rank.
//!
//! Invalid pairs (avg on integers) must fail with [`InvalidArgument::UnsupportedReduction`] on every rank.

use std::borrow::BorrowMut;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::algo::Algorithm;
use crate::comm::{AllReduceCall, CommBackend, Communicator, InOut, StreamOf};
use crate::dtype::{check_reduction, DataType, ReduceOp, Value as Val};
use crate::error::{Error, InvalidArgument, Result};
use crate::runtime::MemoryRuntime;

/// A backend under test: it makes communicators for a world size and a stream for each.
pub trait ConformanceTarget: Sync {
    /// The backend.
    type Backend: CommBackend + 'static;

    /// A name for messages.
    fn name(&self) -> String;

    /// One communicator per rank, index = rank.
    fn create(&self, world: usize) -> Result<Vec<Communicator<Self::Backend>>>;

    /// A stream for `comm`'s rank (called on that rank's thread).
    fn stream(&self, comm: &Communicator<Self::Backend>) -> Result<StreamOf<Self::Backend>>;
}

/// What to cover.
///
/// Not `#[non_exhaustive]`: suites build one with `Config { .., ..Config::default() }`.
#[derive(Debug, Clone)]
pub struct Config {
    /// World sizes.
    pub worlds: Vec<usize>,
    /// Element counts per rank (include ones that are not multiples of the world size).
    pub counts: Vec<usize>,
    /// Data types.
    pub dtypes: Vec<DataType>,
    /// Seed of the random inputs.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config { worlds: (1..=8).collect(), counts: vec![0, 1, 5, 1037], dtypes: DataType::ALL.to_vec(), seed: 0x5eed }
    }
}

/// What the suite ran and what failed.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Summary {
    /// Calls checked (per rank, summed).
    pub checks: usize,
    /// Calls that returned the expected typed error.
    pub expected_errors: usize,
    /// Every failure, with the case.
    pub failures: Vec<String>,
}

impl Summary {
    /// Panics with the failures (at most 40) if there are any, or if nothing was checked.
    pub fn assert_ok(&self) {
        assert!(self.checks > 0, "the conformance suite checked nothing");
        if !self.failures.is_empty() {
            let shown: Vec<_> = self.failures.iter().take(40).cloned().collect();
            panic!("{} conformance failures (first {}):\n{}", self.failures.len(), shown.len(), shown.join("\n"));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coll {
    AllReduce(Option<Algorithm>),
    AllGather,
    ReduceScatter,
    Broadcast(usize),
    Reduce(usize),
    SendRecv,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    id: u64,
    coll: Coll,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
}

fn cases(world: usize, algos: &[Algorithm], cfg: &Config) -> Vec<Case> {
    let mut out = Vec::new();
    let mut push = |coll, dtype, op, count, in_place| {
        out.push(Case { id: out.len() as u64, coll, dtype, op, count, in_place });
    };
    for &dtype in &cfg.dtypes {
        for &count in &cfg.counts {
            for in_place in [false, true] {
                for op in ReduceOp::ALL {
                    push(Coll::AllReduce(None), dtype, op, count, in_place);
                    if check_reduction(dtype, op).is_ok() {
                        // Each algorithm, also for pairs a backend refuses (the case then expects the error).
                        for &a in algos {
                            push(Coll::AllReduce(Some(a)), dtype, op, count, in_place);
                        }
                        push(Coll::ReduceScatter, dtype, op, count, in_place);
                        push(Coll::Reduce(count % world), dtype, op, count, in_place);
                    }
                }
                push(Coll::AllGather, dtype, ReduceOp::Sum, count, in_place);
                push(Coll::Broadcast(world - 1), dtype, ReduceOp::Sum, count, in_place);
                if world > 1 && !in_place {
                    push(Coll::SendRecv, dtype, ReduceOp::Sum, count, false);
                }
            }
        }
    }
    out
}

fn decode(dtype: DataType, bytes: &[u8]) -> Vec<Val> {
    bytes.chunks_exact(dtype.size_bytes()).map(|c| Val::decode(dtype, c)).collect()
}

fn encode(dtype: DataType, vals: &[Val]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size_bytes());
    for v in vals {
        v.encode(dtype, &mut out);
    }
    out
}

/// Random inputs of `n` elements for `rank`, already representable in `dtype`.
fn inputs(seed: u64, case: &Case, rank: usize, n: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed ^ (case.id << 8) ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let signed = matches!(case.dtype, DataType::I8 | DataType::I32 | DataType::I64);
    let vals: Vec<Val> = (0..n)
        .map(|_| match (case.dtype.is_float(), case.op, signed) {
            (true, ReduceOp::Prod, _) => Val::Float(rng.random_range(0.5..2.0)),
            (true, _, _) => Val::Float(rng.random_range(-1.0..1.0)),
            (false, ReduceOp::Prod, true) => Val::Int(rng.random_range(-3..=3)),
            (false, ReduceOp::Prod, false) => Val::Int(rng.random_range(0..=4)),
            (false, _, true) => Val::Int(rng.random_range(-50..=50)),
            (false, _, false) => Val::Int(rng.random_range(0..=100)),
        })
        .collect();
    encode(case.dtype, &vals)
}

/// Unit roundoff of the output type and of its accumulator, and the smallest subnormal of the output type.
fn tolerance_terms(dtype: DataType) -> (f64, f64, f64) {
    let p = |bits: i32| 2f64.powi(-bits);
    match dtype {
        DataType::F16 => (p(11), p(24), p(24)),
        DataType::Bf16 => (p(8), p(24), p(133)),
        DataType::F32 => (p(24), p(24), p(149)),
        DataType::F64 => (p(53), p(53), p(1074)),
        DataType::Fp8E4M3 => (p(4), p(24), p(9)),
        DataType::Fp8E5M2 => (p(3), p(24), p(16)),
        _ => (0.0, 0.0, 0.0),
    }
}

/// Expected reduction of `rows` (one row per rank) and per-element tolerances.
fn reference(dtype: DataType, op: ReduceOp, rows: &[Vec<Val>]) -> Vec<(Val, f64)> {
    let world = rows.len();
    let n = rows.first().map_or(0, Vec::len);
    let (u_out, u_acc, tiny) = tolerance_terms(dtype);
    (0..n)
        .map(|i| {
            let col = rows.iter().map(|r| r[i]);
            if dtype.is_float() {
                let xs: Vec<f64> = col.map(|v| if let Val::Float(f) = v { f } else { f64::NAN }).collect();
                let abs: f64 = xs.iter().map(|x| x.abs()).sum();
                let (r, err) = match op {
                    ReduceOp::Sum => {
                        let s: f64 = xs.iter().sum();
                        (s, world as f64 * u_acc * abs)
                    }
                    ReduceOp::Avg => {
                        let s: f64 = xs.iter().sum::<f64>() / world as f64;
                        (s, world as f64 * u_acc * abs / world as f64)
                    }
                    ReduceOp::Prod => {
                        let p: f64 = xs.iter().product();
                        (p, 2.0 * world as f64 * u_acc * p.abs())
                    }
                    ReduceOp::Min => (xs.iter().copied().fold(f64::INFINITY, f64::min), 0.0),
                    ReduceOp::Max => (xs.iter().copied().fold(f64::NEG_INFINITY, f64::max), 0.0),
                };
                (Val::Float(r), err + u_out * r.abs() + tiny)
            } else {
                let xs: Vec<i128> = col.map(|v| if let Val::Int(x) = v { x } else { 0 }).collect();
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => xs.iter().fold(0i128, |a, b| a.wrapping_add(*b)),
                    ReduceOp::Prod => xs.iter().fold(1i128, |a, b| a.wrapping_mul(*b)),
                    ReduceOp::Min => xs.iter().copied().min().unwrap_or(0),
                    ReduceOp::Max => xs.iter().copied().max().unwrap_or(0),
                };
                // Wrap to the type's width, exactly as the backend must.
                (decode(dtype, &encode(dtype, &[Val::Int(r)]))[0], 0.0)
            }
        })
        .collect()
}

fn compare(what: &str, dtype: DataType, got: &[u8], want: &[(Val, f64)]) -> Option<String> {
    let got = decode(dtype, got);
    for (i, (g, (w, tol))) in got.iter().zip(want).enumerate() {
        let ok = match (g, w) {
            (Val::Float(g), Val::Float(w)) => !g.is_nan() && (g - w).abs() <= *tol,
            (Val::Int(g), Val::Int(w)) => g == w,
            _ => false,
        };
        if !ok {
            return Some(format!("{what}: element {i} is {g:?}, expected {w:?} (tolerance {tol:e})"));
        }
    }
    None
}

const GUARD: usize = 64;
const POISON: u8 = 0xFF;

#[derive(Default)]
struct RankResult {
    checks: usize,
    expected_errors: usize,
    failures: Vec<String>,
    /// All-reduce output hashes, by case id.
    hashes: HashMap<u64, u64>,
}

/// Runs the suite on `target`.
pub fn run<T: ConformanceTarget>(target: &T, cfg: &Config) -> Summary {
    let mut summary = Summary::default();
    for &world in &cfg.worlds {
        let comms = match target.create(world) {
            Ok(c) => c,
            Err(e) => {
                summary.failures.push(format!("{}: world {world}: cannot create communicators: {e}", target.name()));
                continue;
            }
        };
        let results: Vec<RankResult> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || match target.stream(&c) {
                        Ok(stream) => run_rank(&mut c, &stream, world, cfg),
                        Err(e) => RankResult {
                            failures: vec![format!("rank {}: cannot create a stream: {e}", c.rank())],
                            ..RankResult::default()
                        },
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|_| RankResult {
                        failures: vec![format!("world {world} rank {rank}: thread panicked")],
                        ..RankResult::default()
                    })
                })
                .collect()
        });
        let hashes: Vec<Vec<(u64, u64)>> = results.iter().map(|r| sorted_hashes(&r.hashes)).collect();
        summary
            .failures
            .extend(compare_hashes(&hashes).into_iter().map(|f| format!("{}: world {world}: {f}", target.name())));
        for r in results {
            summary.checks += r.checks;
            summary.expected_errors += r.expected_errors;
            summary.failures.extend(r.failures.into_iter().map(|f| format!("{}: world {world}: {f}", target.name())));
        }
    }
    summary
}

/// What one rank found when it ran the suite by itself, in its own process ([`run_one_rank`]).
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct RankReport {
    /// Calls checked.
    pub checks: usize,
    /// Calls that returned the expected typed error.
    pub expected_errors: usize,
    /// Every failure, with the case.
    pub failures: Vec<String>,
    /// A hash of every all-reduce output, as `(case id, hash)` sorted by case id. Exchange them between the
    /// processes ([`encode_hashes`] / [`decode_hashes`]) and compare them with [`compare_hashes`]: all-reduce
    /// results must be bitwise identical on every rank.
    pub all_reduce_hashes: Vec<(u64, u64)>,
}

/// Runs the suite for one rank of a communicator whose other ranks live in other processes, each of which runs
/// this too with the same `cfg` (its `worlds` are ignored: the world is `comm`'s). Every process draws every
/// rank's inputs from the shared seed, so each checks its own outputs against the full reference. After the
/// first backend error the rank stops (its peers then fail or time out in their own calls).
pub fn run_one_rank<B: CommBackend>(comm: &mut Communicator<B>, stream: &StreamOf<B>, cfg: &Config) -> RankReport {
    let world = comm.world_size();
    let r = run_rank(comm, stream, world, cfg);
    RankReport {
        checks: r.checks,
        expected_errors: r.expected_errors,
        failures: r.failures,
        all_reduce_hashes: sorted_hashes(&r.hashes),
    }
}

fn sorted_hashes(h: &HashMap<u64, u64>) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = h.iter().map(|(k, v)| (*k, *v)).collect();
    v.sort_unstable();
    v
}

/// The bytes of a rank's all-reduce hashes (16 little-endian bytes per case), for an exchange between processes.
pub fn encode_hashes(hashes: &[(u64, u64)]) -> Vec<u8> {
    hashes.iter().flat_map(|(id, h)| id.to_le_bytes().into_iter().chain(h.to_le_bytes())).collect()
}

/// Reads [`encode_hashes`]' bytes back; a length that is not a multiple of 16 is an error.
pub fn decode_hashes(bytes: &[u8]) -> Result<Vec<(u64, u64)>> {
    if !bytes.len().is_multiple_of(16) {
        return Err(Error::PeerFailure(format!(
            "conformance hashes: {} bytes is not a whole number of 16-byte entries",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(16)
        .map(|c| {
            let mut id = [0u8; 8];
            let mut h = [0u8; 8];
            id.copy_from_slice(&c[..8]);
            h.copy_from_slice(&c[8..]);
            (u64::from_le_bytes(id), u64::from_le_bytes(h))
        })
        .collect())
}

/// Compares every rank's all-reduce hashes (index = rank, each sorted by case id) with rank 0's: one failure per
/// case whose result differs on some rank or that a rank lacks (or has in addition).
pub fn compare_hashes(ranks: &[Vec<(u64, u64)>]) -> Vec<String> {
    let mut failures = Vec::new();
    let Some(first) = ranks.first() else { return failures };
    let base: HashMap<u64, u64> = first.iter().copied().collect();
    for (rank, r) in ranks.iter().enumerate().skip(1) {
        let mine: HashMap<u64, u64> = r.iter().copied().collect();
        for (id, h) in first {
            match mine.get(id) {
                Some(x) if x == h => {}
                Some(_) => failures
                    .push(format!("all-reduce case {id}: rank {rank}'s result is not bitwise identical to rank 0's")),
                None => failures.push(format!("all-reduce case {id}: rank {rank} has no result, rank 0 has one")),
            }
        }
        for id in mine.keys().filter(|id| !base.contains_key(id)) {
            failures.push(format!("all-reduce case {id}: rank {rank} has a result, rank 0 has none"));
        }
    }
    failures
}

fn run_rank<B: CommBackend>(
    comm: &mut Communicator<B>,
    stream: &StreamOf<B>,
    world: usize,
    cfg: &Config,
) -> RankResult {
    let rank = comm.rank();
    let mut res = RankResult::default();
    // Lossy (quantized) algorithms are not the exact sums checked here; their own tests hold them to their model
    // and error bound.
    let algos: Vec<Algorithm> =
        comm.backend().allreduce_algorithms().iter().copied().filter(|a| !a.is_lossy()).collect();
    for case in cases(world, &algos, cfg) {
        match run_case(comm, stream, &case, world, cfg.seed) {
            Ok(Outcome::Checked { failure, hash }) => {
                res.checks += 1;
                if let Some(f) = failure {
                    res.failures.push(format!("rank {rank}: {case:?}: {f}"));
                }
                if let Some(h) = hash {
                    res.hashes.insert(case.id, h);
                }
            }
            Ok(Outcome::ExpectedError) => res.expected_errors += 1,
            Ok(Outcome::Skipped) => {}
            Err(e) => {
                // A backend error leaves the other ranks waiting; stop this rank (the caller drops or aborts the
                // communicator, which tells the peers) rather than cascade.
                res.failures.push(format!("rank {rank}: {case:?}: {e}"));
                return res;
            }
        }
    }
    // Once the stream has drained, the non-blocking completion query must say so.
    res.checks += 1;
    match comm.runtime().synchronize(stream).and_then(|()| comm.query(stream)) {
        Ok(true) => {}
        Ok(false) => res.failures.push(format!("rank {rank}: query: a drained stream was reported busy")),
        Err(e) => res.failures.push(format!("rank {rank}: query on a drained stream: {e}")),
    }
    res
}

enum Outcome {
    Checked { failure: Option<String>, hash: Option<u64> },
    ExpectedError,
    Skipped,
}

fn alloc_poisoned<B: CommBackend>(
    comm: &Communicator<B>,
    bytes: usize,
    stream: &StreamOf<B>,
) -> Result<<B::Runtime as MemoryRuntime>::OwnedBuffer> {
    let rt = comm.runtime();
    let mut buf = rt.alloc(bytes + GUARD)?;
    rt.upload(buf.borrow_mut(), &vec![POISON; bytes + GUARD], stream)?;
    Ok(buf)
}

fn read<B: CommBackend>(
    comm: &Communicator<B>,
    buf: &<B::Runtime as MemoryRuntime>::OwnedBuffer,
    bytes: usize,
    stream: &StreamOf<B>,
) -> Result<Vec<u8>> {
    use std::borrow::Borrow;
    let mut out = vec![0u8; bytes + GUARD];
    comm.runtime().download(buf.borrow(), &mut out, stream)?;
    Ok(out)
}

fn guard_failure(what: &str, full: &[u8], bytes: usize) -> Option<String> {
    full[bytes..].iter().any(|b| *b != POISON).then(|| format!("{what}: bytes past the output were written"))
}

fn hash_of(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

fn run_case<B: CommBackend>(
    comm: &mut Communicator<B>,
    stream: &StreamOf<B>,
    case: &Case,
    world: usize,
    seed: u64,
) -> Result<Outcome> {
    let rank = comm.rank();
    let dtype = case.dtype;
    let esz = dtype.size_bytes();
    let n = case.count;
    let part = n * esz;
    let op = case.op;
    let rows = |len: usize| -> Vec<Vec<u8>> { (0..world).map(|r| inputs(seed, case, r, len)).collect() };

    // Pairs core refuses, and pairs this backend refuses (it says why through `check_reduction`).
    let expect_err = check_reduction(dtype, op).is_err() || comm.backend().check_reduction(dtype, op).is_err();
    match case.coll {
        Coll::AllReduce(algo) => {
            if let Some(a) = algo {
                let call = AllReduceCall {
                    count: n,
                    dtype,
                    op,
                    bytes: part,
                    in_place: case.in_place,
                    capturing: false,
                    bufs: None,
                };
                if comm.check_algorithm(a, &call).is_err() {
                    return Ok(Outcome::Skipped);
                }
            }
            let ins = rows(n);
            let mut out = alloc_poisoned(comm, part, stream)?;
            let r = if case.in_place {
                comm.runtime().upload(out.borrow_mut(), &ins[rank], stream)?;
                let bufs = InOut::InPlace(out.borrow_mut());
                match algo {
                    Some(a) => comm.all_reduce_with(a, bufs, n, dtype, op, stream),
                    None => comm.all_reduce(bufs, n, dtype, op, stream).map(|_| ()),
                }
            } else {
                let mut inp = comm.runtime().alloc(part)?;
                comm.runtime().upload(inp.borrow_mut(), &ins[rank], stream)?;
                let bufs = InOut::Separate { send: std::borrow::Borrow::borrow(&inp), recv: out.borrow_mut() };
                match algo {
                    Some(a) => comm.all_reduce_with(a, bufs, n, dtype, op, stream),
                    None => comm.all_reduce(bufs, n, dtype, op, stream).map(|_| ()),
                }
            };
            if expect_err {
                return expect_unsupported(r);
            }
            r?;
            let got = read(comm, &out, part, stream)?;
            let want = reference(dtype, op, &ins.iter().map(|b| decode(dtype, b)).collect::<Vec<_>>());
            let failure =
                compare("all-reduce", dtype, &got[..part], &want).or_else(|| guard_failure("all-reduce", &got, part));
            Ok(Outcome::Checked { failure, hash: Some(hash_of(&got[..part])) })
        }
        Coll::ReduceScatter => {
            let total = part * world;
            let ins = rows(n * world);
            let (r, out, at) = if case.in_place {
                let mut buf = alloc_poisoned(comm, total, stream)?;
                comm.runtime().upload(buf.borrow_mut(), &ins[rank], stream)?;
                (comm.reduce_scatter(InOut::InPlace(buf.borrow_mut()), n, dtype, op, stream), buf, rank * part)
            } else {
                let mut inp = comm.runtime().alloc(total)?;
                comm.runtime().upload(inp.borrow_mut(), &ins[rank], stream)?;
                let mut out = alloc_poisoned(comm, part, stream)?;
                let bufs = InOut::Separate { send: std::borrow::Borrow::borrow(&inp), recv: out.borrow_mut() };
                (comm.reduce_scatter(bufs, n, dtype, op, stream), out, 0)
            };
            if expect_err {
                return expect_unsupported(r);
            }
            r?;
            let len = if case.in_place { total } else { part };
            let got = read(comm, &out, len, stream)?;
            let mine: Vec<Vec<Val>> = ins.iter().map(|b| decode(dtype, &b[rank * part..(rank + 1) * part])).collect();
            let want = reference(dtype, op, &mine);
            let failure = compare("reduce-scatter", dtype, &got[at..at + part], &want)
                .or_else(|| guard_failure("reduce-scatter", &got, len));
            Ok(Outcome::Checked { failure, hash: None })
        }
        Coll::Reduce(root) => {
            let ins = rows(n);
            let mut out = alloc_poisoned(comm, part, stream)?;
            let r = if case.in_place {
                comm.runtime().upload(out.borrow_mut(), &ins[rank], stream)?;
                comm.reduce(InOut::InPlace(out.borrow_mut()), n, dtype, op, root, stream)
            } else {
                let mut inp = comm.runtime().alloc(part)?;
                comm.runtime().upload(inp.borrow_mut(), &ins[rank], stream)?;
                let bufs = InOut::Separate { send: std::borrow::Borrow::borrow(&inp), recv: out.borrow_mut() };
                comm.reduce(bufs, n, dtype, op, root, stream)
            };
            if expect_err {
                return expect_unsupported(r);
            }
            r?;
            let got = read(comm, &out, part, stream)?;
            let failure = if rank == root {
                let want = reference(dtype, op, &ins.iter().map(|b| decode(dtype, b)).collect::<Vec<_>>());
                compare("reduce (root)", dtype, &got[..part], &want)
            } else {
                let untouched: &[u8] = if case.in_place { &ins[rank] } else { &vec![POISON; part] };
                (got[..part] != *untouched).then(|| "reduce: a non-root output was modified".to_owned())
            };
            Ok(Outcome::Checked { failure: failure.or_else(|| guard_failure("reduce", &got, part)), hash: None })
        }
        Coll::AllGather => {
            let ins = rows(n);
            let total = part * world;
            let mut out = alloc_poisoned(comm, total, stream)?;
            if case.in_place {
                let mut staged = vec![POISON; total + GUARD];
                staged[rank * part..(rank + 1) * part].copy_from_slice(&ins[rank]);
                comm.runtime().upload(out.borrow_mut(), &staged, stream)?;
                comm.all_gather(InOut::InPlace(out.borrow_mut()), n, dtype, stream)?;
            } else {
                let mut inp = comm.runtime().alloc(part)?;
                comm.runtime().upload(inp.borrow_mut(), &ins[rank], stream)?;
                let bufs = InOut::Separate { send: std::borrow::Borrow::borrow(&inp), recv: out.borrow_mut() };
                comm.all_gather(bufs, n, dtype, stream)?;
            }
            let got = read(comm, &out, total, stream)?;
            let want: Vec<u8> = ins.concat();
            let failure = (got[..total] != want[..])
                .then(|| "all-gather: output differs from the concatenated inputs".to_owned())
                .or_else(|| guard_failure("all-gather", &got, total));
            Ok(Outcome::Checked { failure, hash: Some(hash_of(&got[..total])) })
        }
        Coll::Broadcast(root) => {
            let data = inputs(seed, case, root, n);
            let mut out = alloc_poisoned(comm, part, stream)?;
            if case.in_place {
                if rank == root {
                    comm.runtime().upload(out.borrow_mut(), &data, stream)?;
                }
                comm.broadcast(InOut::InPlace(out.borrow_mut()), n, dtype, root, stream)?;
            } else {
                let mut inp = alloc_poisoned(comm, part, stream)?;
                if rank == root {
                    comm.runtime().upload(inp.borrow_mut(), &data, stream)?;
                }
                let bufs = InOut::Separate { send: std::borrow::Borrow::borrow(&inp), recv: out.borrow_mut() };
                comm.broadcast(bufs, n, dtype, root, stream)?;
            }
            let got = read(comm, &out, part, stream)?;
            let failure = (got[..part] != data[..])
                .then(|| "broadcast: output differs from the root's input".to_owned())
                .or_else(|| guard_failure("broadcast", &got, part));
            Ok(Outcome::Checked { failure, hash: None })
        }
        Coll::SendRecv => {
            // A ring: even ranks send first, odd ranks receive first, so blocking backends cannot deadlock.
            let next = (rank + 1) % world;
            let prev = (rank + world - 1) % world;
            let mine = inputs(seed, case, rank, n);
            let mut inp = comm.runtime().alloc(part)?;
            comm.runtime().upload(inp.borrow_mut(), &mine, stream)?;
            let mut out = alloc_poisoned(comm, part, stream)?;
            if rank.is_multiple_of(2) {
                comm.send(std::borrow::Borrow::borrow(&inp), n, dtype, next, stream)?;
                comm.recv(out.borrow_mut(), n, dtype, prev, stream)?;
            } else {
                comm.recv(out.borrow_mut(), n, dtype, prev, stream)?;
                comm.send(std::borrow::Borrow::borrow(&inp), n, dtype, next, stream)?;
            }
            let got = read(comm, &out, part, stream)?;
            let want = inputs(seed, case, prev, n);
            let failure = (got[..part] != want[..])
                .then(|| format!("send/recv: data from rank {prev} differs"))
                .or_else(|| guard_failure("recv", &got, part));
            comm.barrier(stream)?;
            Ok(Outcome::Checked { failure, hash: None })
        }
    }
}

fn expect_unsupported(r: Result<()>) -> Result<Outcome> {
    match r {
        Err(Error::InvalidArgument(InvalidArgument::UnsupportedReduction { .. })) => Ok(Outcome::ExpectedError),
        Err(e) => Ok(Outcome::Checked { failure: Some(format!("expected UnsupportedReduction, got {e}")), hash: None }),
        Ok(()) => {
            Ok(Outcome::Checked { failure: Some("an invalid dtype/op pair was accepted".to_owned()), hash: None })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codecs_round_trip_representable_values() {
        for d in DataType::ALL {
            let case = Case { id: 3, coll: Coll::AllGather, dtype: d, op: ReduceOp::Sum, count: 64, in_place: false };
            let bytes = inputs(1, &case, 0, 64);
            assert_eq!(bytes.len(), 64 * d.size_bytes());
            assert_eq!(encode(d, &decode(d, &bytes)), bytes, "{d}");
        }
    }

    #[test]
    fn reference_wraps_integers_and_bounds_floats() {
        let rows = vec![vec![Val::Int(100)], vec![Val::Int(100)]];
        assert_eq!(reference(DataType::I8, ReduceOp::Sum, &rows)[0].0, Val::Int(-56));
        assert_eq!(reference(DataType::U8, ReduceOp::Prod, &rows)[0].0, Val::Int(16));
        let rows = vec![vec![Val::Float(0.5)], vec![Val::Float(0.25)]];
        let (v, tol) = reference(DataType::Bf16, ReduceOp::Avg, &rows)[0];
        assert_eq!(v, Val::Float(0.375));
        assert!(tol > 0.0 && tol < 0.01);
    }

    #[test]
    fn hashes_round_trip_and_differences_are_named() {
        let a = vec![(1, 10), (2, 20), (5, 50)];
        assert_eq!(decode_hashes(&encode_hashes(&a)).expect("decode"), a);
        assert!(decode_hashes(&[0u8; 17]).is_err());
        assert!(compare_hashes(&[a.clone(), a.clone(), a.clone()]).is_empty());
        let mut differs = a.clone();
        differs[1].1 = 21;
        let mut lacks = a.clone();
        lacks.remove(2);
        let mut extra = a.clone();
        extra.push((9, 90));
        let f = compare_hashes(&[a, differs, lacks, extra]);
        assert_eq!(f.len(), 3, "{f:?}");
        assert!(f[0].contains("case 2: rank 1's result is not bitwise identical"), "{f:?}");
        assert!(f[1].contains("case 5: rank 2 has no result"), "{f:?}");
        assert!(f[2].contains("case 9: rank 3 has a result, rank 0 has none"), "{f:?}");
    }

    #[test]
    fn compare_rejects_poison_and_wrong_values() {
        let want = vec![(Val::Float(1.0), 1e-3)];
        assert!(compare("x", DataType::F32, &[0xFF; 4], &want).is_some());
        assert!(compare("x", DataType::F32, &1.5f32.to_le_bytes(), &want).is_some());
        assert!(compare("x", DataType::F32, &1.0f32.to_le_bytes(), &want).is_none());
    }
}
