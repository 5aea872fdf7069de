//! Benchmark of the fused all-reduce + residual add + RMSNorm with N ranks emulated on one GPU (default bf16,
//! hidden 8192, tokens 1, 8, 64, 512, at 2 and 8 ranks): fused one-shot, fused two-shot, and the unfused baseline,
//! anyccl's all-reduce (one-shot and two-shot) followed by the separate RMSNorm kernel, side by side, with the
//! ratio best fused / best unfused (the target: ≤ 0.8) and a correctness check per cell.
//!
//! Method (as anyccl-cuda-emulated-bench): per cell and path, each rank's stream holds a CUDA graph of 10
//! back-to-back calls; all ranks' graphs start together after an event on a timing stream, which then waits for
//! every rank; 3 warm-up rounds, 20 timed rounds, median; time per call = round / 10. Before timing, every path
//! runs once eagerly from a fresh residual and every rank's output and new residual are compared bit for bit with
//! the host reference (anyccl_gpu::fused::reference); any difference makes the exit status non-zero.
//!
//! The push paths (fused push one-shot; push one-shot then RMSNorm) run where the message fits the push receive
//! slots (256 KiB; `-` elsewhere), with programmatic dependent launch on sm_90+, on the push grids
//! (`anyccl_gpu::push::fused_push_blocks`, `anyccl_lab::push::push_blocks`). The ratio takes the best of
//! every fused path over the best of every unfused one.
//!
//! Blocks per rank: fused one-shot and the all-reduce kernels min(rows, cap); fused two-shot min(rows per rank,
//! cap); the separate RMSNorm kernel min(rows, cap); cap = the blocks the device holds at once / ranks (at most
//! 128), which keeps every rank's blocks co-resident (the cross-rank barriers need it).
//!
//! Usage: anyccl-cuda-fused-bench [--world 2,8] [--hidden 8192] [--tokens 1,8,64,512] [--dtype bf16|f16]
//!        [--device D]

use std::process::ExitCode;

use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_cuda::custom::Kind;
use anyccl_gpu::fused::{reference, FusedForm, FusedOutput};
use anyccl_lab::emulated_fused::{EmulatedFused, FusedPath};

const CALLS: usize = 10;
const ROUNDS: usize = 20;

fn view(b: &anyccl_cuda::DeviceBuffer, device: i32) -> anyccl_cuda::DeviceBuffer {
    // SAFETY: a second handle on a buffer the group owns, used only while the group lives.
    unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), b.len(), device.unsigned_abs()) }
}

fn bytes_of(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|e| e.to_le_bytes()).collect()
}

/// Reproducible values in [-1, 1).
fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
    }
}

/// Runs `path` once from a fresh residual and compares every rank's output and residual with the reference.
fn check(g: &EmulatedFused, device: i32, path: FusedPath, residual: &[u8], want: &(Vec<u8>, Vec<u8>)) -> Result<bool> {
    let s = &g.streams[0];
    for r in 0..g.streams.len() {
        g.runtime.upload(&mut view(&g.residual[r], device), residual, s)?;
        g.runtime.upload(&mut view(&g.out[r], device), &vec![0xFFu8; g.bytes], s)?;
    }
    g.launch(path)?;
    g.synchronize()?;
    let mut ok = true;
    for r in 0..g.streams.len() {
        let (mut o, mut res) = (vec![0u8; want.0.len()], vec![0u8; want.1.len()]);
        g.runtime.download(&g.out[r], &mut o, s)?;
        g.runtime.download(&g.residual[r], &mut res, s)?;
        ok &= o == want.0 && res == want.1;
    }
    Ok(ok)
}

/// Median time of one call of `path` over the group, seconds.
fn time_path(g: &EmulatedFused, path: FusedPath) -> Result<f64> {
    let graphs = g.capture(path, CALLS)?;
    let per_call = anyccl_lab::emulated::time_graphs(&g.runtime, &g.streams, &graphs, CALLS, 3, ROUNDS)?;
    Ok(per_call)
}

/// One row of the table; returns whether every check passed.
fn cell(device: i32, world: usize, dtype: DataType, hidden: usize, tokens: usize) -> Result<bool> {
    let mut g = EmulatedFused::new(device, world, dtype, tokens, hidden, 1)?;
    g.output = FusedOutput::Same;
    // Inputs, weight and residual; the reference once.
    let n = tokens * hidden;
    let inputs: Vec<Vec<u16>> = (0..world)
        .map(|r| {
            let mut next = rng(r as u64 * 7919 + tokens as u64);
            (0..n).map(|_| reference::from_f32(dtype, next())).collect()
        })
        .collect();
    let mut next = rng(12345);
    let residual: Vec<u16> = (0..n).map(|_| reference::from_f32(dtype, next())).collect();
    let weight: Vec<u16> = (0..hidden).map(|_| reference::from_f32(dtype, 1.0 + 0.5 * next())).collect();
    let s = &g.streams[0];
    for (r, x) in inputs.iter().enumerate() {
        g.runtime.upload(&mut view(&g.inputs[r], device), &bytes_of(x), s)?;
    }
    g.runtime.upload(&mut view(&g.weight, device), &bytes_of(&weight), s)?;
    let refs: Vec<&[u16]> = inputs.iter().map(Vec::as_slice).collect();
    let rows = reference::fused(dtype, &refs, &residual, &weight, g.eps);
    let want_out: Vec<u8> = rows.iter().flat_map(|r| bytes_of(&r.out)).collect();
    let want_res: Vec<u8> = rows.iter().flat_map(|r| bytes_of(&r.residual)).collect();
    let want = (want_out, want_res);
    let res_bytes = bytes_of(&residual);

    let fit =
        g.fused.resident_blocks(FusedForm::TwoShot, dtype)?.min(g.fused.resident_blocks(FusedForm::OneShot, dtype)?);
    let fit =
        fit.min(g.kernels.resident_blocks(Kind::OneShot, dtype)?).min(g.kernels.resident_blocks(Kind::TwoShot, dtype)?);
    let cap = (fit / world).clamp(1, 128);
    let per_rank_rows = tokens.div_ceil(world);
    // The push paths where the message fits the push receive slots (256 KiB).
    let push = g.enable_push().is_ok();
    let mut times = Vec::new();
    let mut all_ok = true;
    for path in FusedPath::ALL.into_iter().chain(FusedPath::PUSH) {
        if !push && FusedPath::PUSH.contains(&path) {
            times.push(None);
            continue;
        }
        let rows_here = match path {
            FusedPath::Fused(FusedForm::TwoShot) => per_rank_rows,
            FusedPath::Unfused(_) => (g.bytes / (8 << 10)).max(1),
            _ => tokens,
        };
        g.blocks = rows_here.clamp(1, cap) as u32;
        g.norm_blocks = tokens.clamp(1, cap) as u32;
        let ok = check(&g, device, path, &res_bytes, &want)?;
        all_ok &= ok;
        let t = time_path(&g, path)?;
        let blocks = match (&g.push, path) {
            (Some(p), FusedPath::FusedPush) => p.fused_blocks,
            (Some(p), FusedPath::UnfusedPush) => p.push_blocks,
            _ => g.blocks,
        };
        times.push(Some((t, ok, blocks)));
    }
    // Fused: fused one-shot, fused two-shot, fused push; unfused: one-shot, two-shot or push, then RMSNorm.
    let best = |idx: &[usize]| idx.iter().filter_map(|i| times[*i].map(|t| t.0)).fold(f64::INFINITY, f64::min);
    let best_fused = best(&[0, 1, 4]);
    let best_unfused = best(&[2, 3, 5]);
    print!("{world:>5} {tokens:>6}");
    for t in &times {
        let cell = match t {
            Some((t, ok, blocks)) => format!("{:.1} us ({blocks}b){}", t * 1e6, if *ok { "" } else { " WRONG" }),
            None => "-".to_string(),
        };
        print!(" {cell:>20}");
    }
    let ratio = best_fused / best_unfused;
    println!(
        " {:>8.2}x {:>7} {}",
        ratio,
        if ratio <= 0.8 { "<=0.8" } else { ">0.8" },
        if all_ok { "ok (bit-exact)" } else { "WRONG" }
    );
    Ok(all_ok)
}

fn list(v: Option<String>, default: &[usize]) -> Option<Vec<usize>> {
    match v {
        None => Some(default.to_vec()),
        Some(s) => s.split(',').map(|x| x.trim().parse().ok()).collect(),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let worlds = list(value("--world"), &[2, 8]);
    let tokens = list(value("--tokens"), &[1, 8, 64, 512]);
    let hidden = value("--hidden").map(|h| h.parse::<usize>().ok()).unwrap_or(Some(8192));
    let device = value("--device").and_then(|v| v.parse().ok()).unwrap_or(0);
    let dtype = match value("--dtype").as_deref() {
        None | Some("bf16") => Some(DataType::Bf16),
        Some("f16") => Some(DataType::F16),
        Some(_) => None,
    };
    let (Some(worlds), Some(tokens), Some(hidden), Some(dtype)) = (worlds, tokens, hidden, dtype) else {
        eprintln!(
            "usage: anyccl-cuda-fused-bench [--world 2,8] [--hidden 8192] [--tokens 1,8,64,512] [--dtype bf16|f16] \
             [--device D]"
        );
        return ExitCode::FAILURE;
    };
    println!(
        "anyccl fused all-reduce + residual add + RMSNorm, ranks emulated on one GPU, {dtype}, hidden {hidden}; time \
         per call (all ranks), (blocks per rank)"
    );
    print!("{:>5} {:>6}", "world", "tokens");
    for p in FusedPath::ALL.into_iter().chain(FusedPath::PUSH) {
        print!(" {:>20}", p.name());
    }
    println!(" {:>9} {:>7} check", "fused/unf", "target");
    let mut ok = true;
    for &world in &worlds {
        for &t in &tokens {
            match cell(device, world, dtype, hidden, t) {
                Ok(good) => ok &= good,
                Err(e) => {
                    eprintln!("error: world {world} tokens {t}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("some results differ from the host reference (WRONG above)");
        ExitCode::FAILURE
    }
}
