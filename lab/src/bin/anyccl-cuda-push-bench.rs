//! Benchmark of the push-mode one-shot against today's one-shot, N ranks emulated on one GPU (default: world 2,
//! then world 8; bf16 sum; 4, 16, 64 and 256 KiB).
//!
//! Method (that of anyccl-cuda-emulated-bench): per size and kernel, each rank's stream holds a CUDA graph of 10
//! back-to-back calls; all ranks' graphs start together after an event on a timing stream, which then waits for
//! every rank; 3 warm-up rounds, 20 timed rounds, median; time per all-reduce = round / 10. Columns: today's
//! one-shot (the communicator's grid, `custom_blocks`), the push one-shot without programmatic dependent launch, and
//! with it (sm_90+; "-" elsewhere), each push column with its ratio to the one-shot (target ≤ 0.75×), then the push
//! two-shot (`push2`: scatter, reduce, gather over the same receive buffers; with programmatic dependent launch where
//! the device has it; grid `push_two_shot_blocks`) and its ratio.
//!
//! Correctness, per cell: the inputs are small integers, whose sums every element type holds exactly, so every
//! rank's output must equal the exact sum bit for bit, after the timed graphs and again after one eager call on
//! fresh inputs (which catches data left over from an earlier call). Any wrong cell makes the exit status non-zero.
//!
//! Usage: anyccl-cuda-push-bench [--world N] [--device D] [--dtype bf16|f16|f32] [--sizes 4KiB,16KiB,...]
//!        [--push-blocks B]   (every push column's grid; default `push_blocks` / `push_two_shot_blocks`)

use std::process::ExitCode;

use anyccl_core::units::{format_bytes, parse_bytes};
use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_cuda::custom::Kind;
use anyccl_cuda::graph::Graph;
use anyccl_lab::emulated::EmulatedRanks;
use anyccl_lab::push::{EmulatedPush, PushShape, PUSH_MAX_BYTES};

const CALLS: usize = 10;
const ROUNDS: usize = 20;

/// Which kernel a column runs.
#[derive(Clone, Copy, PartialEq)]
enum Col {
    OneShot,
    Push { pdl: bool, shape: PushShape },
}

/// Element `i` of rank `r`'s input for pattern `k`: an integer in -8..=8.
fn value(k: usize, r: usize, i: usize) -> f64 {
    ((i * 7 + r * 3 + k * 5) % 17) as f64 - 8.0
}

/// The bytes of integer `v` (|v| < 2048, so every element type holds it exactly) in `dtype`.
fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    let f = v as f32;
    match dtype {
        DataType::F32 => f.to_le_bytes().to_vec(),
        // bf16 is the top half of the f32 (exact: a small integer has at most 8 significant bits here).
        DataType::Bf16 => ((f.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        _ => {
            // f16 by hand (no conversion crate in this binary): sign, exponent, the 10 mantissa bits.
            let (sign, m) = (u16::from(v < 0.0) << 15, v.abs() as u32);
            let bits = if m == 0 {
                sign
            } else {
                let e = 31 - m.leading_zeros();
                sign | ((e + 15) << 10) as u16 | (((m << (10 - e)) & 0x3FF) as u16)
            };
            bits.to_le_bytes().to_vec()
        }
    }
}

/// Uploads pattern `k` to every rank's input; returns the exact sum's bytes (the same on every rank).
fn set_inputs(g: &EmulatedRanks, dtype: DataType, k: usize, device: i32) -> Result<Vec<u8>> {
    let world = g.streams.len();
    let n = g.bytes / dtype.size_bytes();
    let s = &g.streams[0];
    g.synchronize()?;
    for (r, b) in g.inputs.iter().enumerate() {
        let data: Vec<u8> = (0..n).flat_map(|i| encode(dtype, value(k, r, i))).collect();
        // SAFETY: a view of the group's own input buffer, used only here.
        let mut v = unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), g.bytes, device.unsigned_abs()) };
        g.runtime.upload(&mut v, &data, s)?;
    }
    s.synchronize()?;
    Ok((0..n).flat_map(|i| encode(dtype, (0..world).map(|r| value(k, r, i)).sum())).collect())
}

/// Whether every rank's output equals `want`; poisons them afterwards.
fn outputs_equal(g: &EmulatedRanks, want: &[u8], device: i32) -> Result<bool> {
    g.synchronize()?;
    let s = &g.streams[0];
    let mut ok = true;
    for o in &g.outputs {
        let mut v = vec![0u8; g.bytes];
        g.runtime.download(o, &mut v, s)?;
        ok &= v == want;
        // SAFETY: a view of the group's own output buffer, used only here.
        let mut view = unsafe { anyccl_cuda::DeviceBuffer::from_raw(o.device_ptr(), o.len(), device.unsigned_abs()) };
        g.runtime.upload(&mut view, &vec![0xA5u8; g.bytes], s)?;
    }
    s.synchronize()?;
    Ok(ok)
}

fn launch(g: &EmulatedRanks, p: &mut EmulatedPush, col: Col, dtype: DataType) -> Result<()> {
    match col {
        Col::OneShot => g.launch(Kind::OneShot, dtype),
        Col::Push { pdl, shape } => {
            (p.pdl, p.shape) = (pdl, shape);
            p.launch(g, dtype)
        }
    }
}

fn capture(g: &EmulatedRanks, p: &mut EmulatedPush, col: Col, dtype: DataType) -> Result<Vec<Graph>> {
    match col {
        Col::OneShot => g.capture(Kind::OneShot, dtype, CALLS),
        Col::Push { pdl, shape } => {
            (p.pdl, p.shape) = (pdl, shape);
            p.capture(g, dtype, CALLS)
        }
    }
}

/// Median time of one all-reduce of `col`, seconds, and whether every result was right.
fn time_col(g: &mut EmulatedRanks, p: &mut EmulatedPush, col: Col, opts: &Opts) -> Result<(f64, bool)> {
    let (dtype, device) = (opts.dtype, opts.device);
    g.blocks = match col {
        Col::OneShot => anyccl_gpu::comm::custom_blocks(g.bytes, anyccl_gpu::comm::DEFAULT_CUSTOM_MAX_BLOCKS),
        Col::Push { shape, .. } => opts.push_blocks.unwrap_or_else(|| shape.blocks(g.bytes, g.streams.len())),
    };
    let want = set_inputs(g, dtype, 0, device)?;
    launch(g, p, col, dtype)?;
    let mut ok = outputs_equal(g, &want, device)?;
    let graphs = capture(g, p, col, dtype)?;
    let per_call = anyccl_lab::emulated::time_graphs(&g.runtime, &g.streams, &graphs, CALLS, 3, ROUNDS)?;
    ok &= outputs_equal(g, &want, device)?;
    // One eager call on other inputs: a result left over from an earlier call would show here.
    let want = set_inputs(g, dtype, 1, device)?;
    launch(g, p, col, dtype)?;
    ok &= outputs_equal(g, &want, device)?;
    Ok((per_call, ok))
}

/// The command line's choices.
struct Opts {
    device: i32,
    dtype: DataType,
    sizes: Vec<usize>,
    /// The push columns' grid instead of `push_blocks` (1..=128).
    push_blocks: Option<u32>,
}

fn run(world: usize, opts: &Opts) -> Result<bool> {
    let (device, dtype) = (opts.device, opts.dtype);
    println!(
        "push one-shot and two-shot vs one-shot, {world} ranks emulated on one GPU, {dtype} sum; time per \
         all-reduce (graphs of {CALLS} calls, median of {ROUNDS}); ratio = push / one-shot (target <= 0.75x); push2: \
         the push two-shot (with programmatic dependent launch where the device has it)"
    );
    let mut all_ok = true;
    let mut header = false;
    for &bytes in &opts.sizes {
        let mut g = EmulatedRanks::new(device, world, bytes, 4)?;
        let mut p = EmulatedPush::new(&g)?;
        let pdl = p.pdl_supported();
        if !header {
            println!(
                "{:>9} {:>7} {:>12} {:>7} {:>12} {:>8} {:>12} {:>8} {:>7} {:>12} {:>8}  check",
                "size",
                "blocks",
                "one-shot",
                "blocks",
                "push",
                "ratio",
                "push+pdl",
                "ratio",
                "blocks",
                "push2",
                "ratio"
            );
            header = true;
        }
        let (one, ok1) = time_col(&mut g, &mut p, Col::OneShot, opts)?;
        let one_blocks = g.blocks;
        let one_shot = PushShape::OneShot;
        let (push, ok2) = time_col(&mut g, &mut p, Col::Push { pdl: false, shape: one_shot }, opts)?;
        let push_blocks = g.blocks;
        let (pdl_cell, pdl_ratio, ok3) = if pdl {
            let (t, ok) = time_col(&mut g, &mut p, Col::Push { pdl: true, shape: one_shot }, opts)?;
            (format!("{:.2} us", t * 1e6), format!("{:.2}x", t / one), ok)
        } else {
            ("-".to_string(), "-".to_string(), true)
        };
        // The push two-shot, with programmatic dependent launch where the device has it.
        let (two, ok4) = time_col(&mut g, &mut p, Col::Push { pdl, shape: PushShape::TwoShot }, opts)?;
        let ok = ok1 && ok2 && ok3 && ok4;
        all_ok &= ok;
        println!(
            "{:>9} {:>7} {:>12} {:>7} {:>12} {:>8} {:>12} {:>8} {:>7} {:>12} {:>8}  {}",
            format_bytes(bytes as u64),
            one_blocks,
            format!("{:.2} us", one * 1e6),
            push_blocks,
            format!("{:.2} us", push * 1e6),
            format!("{:.2}x", push / one),
            pdl_cell,
            pdl_ratio,
            g.blocks,
            format!("{:.2} us", two * 1e6),
            format!("{:.2}x", two / one),
            if ok {
                "ok".to_string()
            } else {
                format!("WRONG (one-shot {ok1}, push {ok2}, push+pdl {ok3}, push two-shot {ok4})")
            }
        );
    }
    println!();
    Ok(all_ok)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let usage = || {
        eprintln!(
            "usage: anyccl-cuda-push-bench [--world N (2..=8; default: 2, then 8)] [--device D] \
             [--dtype bf16|f16|f32] [--sizes 4KiB,16KiB,64KiB,256KiB (multiples of 16, at most 256 KiB)] \
             [--push-blocks B (1..=128; default: push_blocks(size, world))]"
        );
        ExitCode::FAILURE
    };
    let worlds: Vec<usize> = match value("--world").map(|v| v.parse::<usize>()) {
        None => vec![2, 8],
        Some(Ok(w)) if (2..=8).contains(&w) => vec![w],
        Some(_) => return usage(),
    };
    let Ok(device) = value("--device").map_or(Ok(0), |v| v.parse::<i32>()) else { return usage() };
    let dtype = match value("--dtype").as_deref() {
        None | Some("bf16") => DataType::Bf16,
        Some("f16") => DataType::F16,
        Some("f32") => DataType::F32,
        Some(_) => return usage(),
    };
    let sizes: std::result::Result<Vec<usize>, _> = match value("--sizes") {
        None => Ok(vec![4 << 10, 16 << 10, 64 << 10, 256 << 10]),
        Some(list) => list.split(',').map(|r| parse_bytes(r).map(|b| b as usize)).collect(),
    };
    let Ok(sizes) = sizes else { return usage() };
    if sizes.iter().any(|&b| b == 0 || b % 16 != 0 || b > PUSH_MAX_BYTES) {
        return usage();
    }
    let push_blocks = match value("--push-blocks").map(|v| v.parse::<u32>()) {
        None => None,
        Some(Ok(b)) if (1..=128).contains(&b) => Some(b),
        Some(_) => return usage(),
    };
    let opts = Opts { device, dtype, sizes, push_blocks };
    let mut ok = true;
    for world in worlds {
        match run(world, &opts) {
            Ok(good) => ok &= good,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("error: a result was wrong (see the check column)");
        ExitCode::FAILURE
    }
}
