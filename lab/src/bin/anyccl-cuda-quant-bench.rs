//! Benchmark of the quantized two-shot all-reduce with N ranks emulated on one GPU (default 8, bf16, 8/32/64 MiB),
//! beside the full-precision two-shot, with a correctness check of every cell.
//!
//! Columns: bf16 two-shot reading the inputs through staging (the communicator's eager path: each rank's kernel
//! first copies its input into its staging), bf16 two-shot reading the inputs directly (registered buffers, graph
//! replays), fp8 (e4m3) two-shot, int8 two-shot; then fp8's and int8's speed-up over each bf16 column
//! (time bf16 / time quantized: > 1 is faster).
//!
//! Method (as anyccl-cuda-emulated-bench): per size and column each rank's stream holds a CUDA graph of 10
//! back-to-back calls; all ranks' graphs start together after an event on a timing stream, which then waits for
//! every rank; 3 warm-up rounds, 20 timed rounds, median; time per all-reduce = round / 10.
//!
//! Check: the inputs are random (magnitudes 1/16 to 16); after the timed replays every rank's output is
//! downloaded: bf16 two-shot must equal the host's rank-order sum bitwise; fp8/int8 must equal the host model of the
//! kernels (`anyccl_kernels_common::quant::model`) value for value and stay within the documented error bound
//! against the exact sum. The measured error (max |err| / max |exact| and sum |err| / sum |exact|) is printed per
//! format. Any wrong cell makes the exit status non-zero.
//!
//! On one GPU every rank's traffic goes through the same HBM, so the quantized form's saving on links (about 0.56 of
//! bf16's exchanged bytes) shows only in part: quantizing is one more pass over the input. See docs/kernels.md.
//!
//! Usage: anyccl-cuda-quant-bench [--world N] [--device D] [--sizes 8MiB,32MiB,64MiB]

use std::process::ExitCode;

use anyccl_core::units::{format_bytes, parse_bytes};
use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_cuda::custom::Kind;
use anyccl_cuda::graph::Graph;
use anyccl_gpu::quant::model as quant;
use anyccl_lab::emulated::{EmulatedRanks, InputMode};
use anyccl_lab::emulated_quant::{Format, QuantRanks};

const CALLS: usize = 10;
const ROUNDS: usize = 20;
const DTYPE: DataType = DataType::Bf16;

/// xorshift64*: reproducible inputs without a dependency; uniform in [-1, 1).
fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
    }
}

/// What a column runs.
#[derive(Clone, Copy)]
enum Column {
    TwoShot(InputMode),
    Quant(Format),
}

impl Column {
    fn label(self) -> &'static str {
        match self {
            Column::TwoShot(InputMode::Staged) => "bf16 two-shot (staged)",
            Column::TwoShot(_) => "bf16 two-shot (direct)",
            Column::Quant(Format::Fp8E4m3) => "fp8 two-shot",
            Column::Quant(_) => "int8 two-shot",
        }
    }
}

fn capture(q: &QuantRanks, c: Column) -> Result<Vec<Graph>> {
    match c {
        Column::TwoShot(_) => q.ranks.capture(Kind::TwoShot, DTYPE, CALLS),
        Column::Quant(f) => q.capture(f, DTYPE, CALLS),
    }
}

/// Median time of one all-reduce, seconds.
fn time(q: &QuantRanks, c: Column) -> Result<f64> {
    let g = &q.ranks;
    let graphs = capture(q, c)?;
    let per_call = anyccl_lab::emulated::time_graphs(&g.runtime, &g.streams, &graphs, CALLS, 3, ROUNDS)?;
    Ok(per_call)
}

/// Every rank's output, as f32 values (bf16 decoded).
fn outputs(g: &EmulatedRanks) -> Result<Vec<Vec<u8>>> {
    g.outputs
        .iter()
        .map(|o| {
            let mut v = vec![0u8; g.bytes];
            g.runtime.download(o, &mut v, &g.streams[0])?;
            Ok(v)
        })
        .collect()
}

fn bf16s(b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(2).map(|c| from_bf16(u16::from_le_bytes([c[0], c[1]])))
}

/// bf16 bits to f32 (exact). By hand: the bench's only use of bf16, without a dependency for it.
fn from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16 bits, round to nearest even (the kernels' conversion; NaN stays a quiet NaN).
fn to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// Checks the outputs of column `c` (after its timed replays); returns what is wrong, and for a quantized column
/// its measured error.
fn check(q: &QuantRanks, c: Column, ins: &[Vec<f32>]) -> Result<(Vec<String>, Option<quant::Measured>)> {
    let outs = outputs(&q.ranks)?;
    let mut wrong = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        if *o != outs[0] {
            wrong.push(format!("rank {r} differs from rank 0"));
        }
    }
    let got: Vec<f32> = bf16s(&outs[0]).collect();
    let n = got.len();
    let refs: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
    match c {
        Column::TwoShot(_) => {
            let mut bad = 0usize;
            for (i, g) in got.iter().enumerate() {
                let mut acc = ins[0][i];
                for x in &ins[1..] {
                    acc += x[i];
                }
                if to_bf16(acc) != to_bf16(*g) {
                    bad += 1;
                }
            }
            if bad > 0 {
                wrong.push(format!("{bad} of {n} elements differ from the rank-order sum"));
            }
            Ok((wrong, None))
        }
        Column::Quant(f) => {
            let model = quant::model(f, &refs);
            let s = quant::block_magnitudes(&refs);
            let (mut off_model, mut off_bound) = (0usize, 0usize);
            let mut exact = Vec::with_capacity(n);
            for i in 0..n {
                let x: f64 = ins.iter().map(|v| f64::from(v[i])).sum();
                if from_bf16(to_bf16(model[i])) != got[i] {
                    off_model += 1;
                }
                let bound = quant::bound_f32(f, s[i]) + 2f64.powi(-8) * f64::from(model[i].abs()) + 1e-30;
                if (f64::from(got[i]) - x).abs() > bound {
                    off_bound += 1;
                }
                exact.push(x);
            }
            if off_model > 0 {
                wrong.push(format!("{off_model} of {n} elements differ from the host model"));
            }
            if off_bound > 0 {
                wrong.push(format!("{off_bound} of {n} elements outside the error bound"));
            }
            let result: Vec<f64> = got.iter().map(|v| f64::from(*v)).collect();
            Ok((wrong, Some(quant::measure(&result, &exact))))
        }
    }
}

fn run(world: usize, device: i32, sizes: &[usize]) -> Result<bool> {
    let columns = [
        Column::TwoShot(InputMode::Staged),
        Column::TwoShot(InputMode::Direct),
        Column::Quant(Format::Fp8E4m3),
        Column::Quant(Format::Int8),
    ];
    println!("anyccl quantized two-shot, {world} ranks emulated on one GPU, bf16 in and out; time per all-reduce");
    print!("{:>8}", "size");
    for c in columns {
        print!(" {:>23}", c.label());
    }
    println!(" {:>18} {:>18}", "fp8 x (staged/dir)", "int8 x (staged/dir)");
    let mut ok = true;
    let mut errors: Vec<String> = Vec::new();
    for &bytes in sizes {
        // One block per 64 KiB per rank, at most 24: 8 ranks × 24 blocks of 512 threads at ≤ 64 registers stay
        // co-resident on 132 SMs (2 blocks per SM), which the cross-rank barriers need.
        let blocks = (bytes / (64 << 10)).clamp(4, 24) as u32;
        let mut q = QuantRanks::new(device, world, bytes, blocks)?;
        let n = bytes / DTYPE.size_bytes();
        let mut ins = Vec::new();
        for r in 0..world {
            let mut next = rng(0x5eed ^ ((r as u64 + 1) << 20) ^ bytes as u64);
            let scales = [0.0625f32, 1.0, 16.0, 0.25];
            let vals: Vec<f32> = (0..n).map(|i| from_bf16(to_bf16(next() * scales[(i / 97) % scales.len()]))).collect();
            let raw: Vec<u8> = vals.iter().flat_map(|v| to_bf16(*v).to_le_bytes()).collect();
            let b = &q.ranks.inputs[r];
            // SAFETY: a view of the group's own input buffer, used only here.
            let mut v = unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), bytes, device.unsigned_abs()) };
            q.ranks.runtime.upload(&mut v, &raw, &q.ranks.streams[0])?;
            ins.push(vals);
        }
        let mut times = Vec::new();
        let mut cells = Vec::new();
        for c in columns {
            if let Column::TwoShot(mode) = c {
                q.ranks.input_mode = mode;
            }
            let t = time(&q, c)?;
            let (wrong, measured) = check(&q, c, &ins)?;
            if let Some(m) = measured {
                errors.push(format!(
                    "{:>4} MiB {:>13}: max |err|/max |exact| {:.4}, sum |err|/sum |exact| {:.4}",
                    bytes >> 20,
                    c.label(),
                    m.max_rel,
                    m.mean_rel
                ));
            }
            let mark = if wrong.is_empty() { "ok" } else { "WRONG" };
            if !wrong.is_empty() {
                ok = false;
                eprintln!("{} at {}: {}", c.label(), format_bytes(bytes as u64), wrong.join("; "));
            }
            cells.push(format!("{:.1} us {mark}", t * 1e6));
            times.push(t);
        }
        print!("{:>4} MiB", bytes >> 20);
        for cell in &cells {
            print!(" {cell:>23}");
        }
        let ratio = |q: f64| format!("{:.2}/{:.2}", times[0] / q, times[1] / q);
        println!(" {:>18} {:>18}", ratio(times[2]), ratio(times[3]));
    }
    println!("\nmeasured error against the exact sum (random inputs, magnitudes 1/16 to 16):");
    for e in errors {
        println!("  {e}");
    }
    println!(
        "\ntarget: fp8 two-shot >= 1.5x faster than bf16 two-shot at 32-64 MiB, 8 ranks (ratios above: \
         over the staged / the direct bf16 two-shot)"
    );
    Ok(ok)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let world = value("--world").map(|v| v.parse::<usize>());
    let device = value("--device").map(|v| v.parse::<i32>());
    let sizes: std::result::Result<Vec<usize>, _> = match value("--sizes") {
        None => Ok(vec![8 << 20, 32 << 20, 64 << 20]),
        Some(list) => list.split(',').map(|r| parse_bytes(r).map(|b| b as usize)).collect(),
    };
    let (Ok(world), Ok(device), Ok(sizes)) = (world.unwrap_or(Ok(8)), device.unwrap_or(Ok(0)), sizes) else {
        eprintln!("usage: anyccl-cuda-quant-bench [--world N] [--device D] [--sizes 8MiB,32MiB,64MiB]");
        return ExitCode::FAILURE;
    };
    if !(2..=8).contains(&world) || sizes.iter().any(|s| *s == 0 || s % 16 != 0) {
        eprintln!("--world is 2 to 8, and every size a non-zero multiple of 16 bytes");
        return ExitCode::FAILURE;
    }
    match run(world, device, &sizes) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("error: some results were wrong (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
