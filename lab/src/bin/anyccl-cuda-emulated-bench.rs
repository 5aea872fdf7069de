//! Benchmark of the custom all-reduce kernels with N ranks emulated on one GPU (default 8, bf16, 1 MiB to
//! 64 MiB): one-shot, two-shot, and the three NVLS variants over the unicast emulation of the switch channel.
//!
//! Method: per size and kernel, each rank's stream holds a CUDA graph of 10 back-to-back calls; all ranks' graphs
//! start together after an event on a timing stream, which then waits for every rank; 3 warm-up rounds, 20 timed
//! rounds, median; time per all-reduce = round / 10. Each cell is `time  %copy/%unique`: the bytes the kernel moves
//! over a device-to-device copy measured in the same run (read + write counted), counted two ways:
//! - "copy": every rank's own reads and writes, summed over ranks (one-shot (N + 1) × size per rank, two-shot
//!   (3 + 1/N) × size, zero-copy 2 × size, the pipelines 6 × size);
//! - "unique": a byte several ranks read counts once (one-shot 2N × size in all, two-shot (2N + 2) × size; the
//!   others as above). On one GPU the emulated ranks share one L2, so repeated reads are often L2 hits and only
//!   the unique figure is comparable with the copy bandwidth.
//!
//! Usage: anyccl-cuda-emulated-bench [--world N] [--device D] [--kinds one-shot,two-shot,...]
//!        [--two-shot-rounds 0,2MiB,...]   (each round size is its own two-shot column; 0 = one round)

use std::process::ExitCode;

use anyccl_core::units::{format_bytes, parse_bytes};
use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_cuda::custom::Kind;
use anyccl_cuda::graph::Event;
use anyccl_lab::emulated::EmulatedRanks;
use cudarc::driver::result;

const CALLS: usize = 10;
const ROUNDS: usize = 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes moved per all-reduce of `bytes`, as multiples of `bytes`: (every rank's own, unique); `None` for a kernel
/// this bench has no traffic model for (`Kind` is `#[non_exhaustive]`), whose cells then show the time only.
fn traffic(kind: Kind, world: usize) -> Option<(f64, f64)> {
    let w = world as f64;
    match kind {
        Kind::OneShot => Some((w * (w + 1.0), 2.0 * w)),
        Kind::TwoShot => Some((3.0 * w + 1.0, 2.0 * w + 2.0)),
        Kind::NvlsZeroCopyEmulated => Some((2.0 * w, 2.0 * w)),
        Kind::NvlsWarpPipelineEmulated | Kind::NvlsBlockPipelineEmulated => Some((6.0 * w, 6.0 * w)),
        _ => None,
    }
}

fn copy_bandwidth(g: &EmulatedRanks) -> Result<f64> {
    let n = 1usize << 30;
    let a = g.runtime.alloc(n)?;
    let b = g.runtime.alloc(n)?;
    let s = &g.streams[0];
    let ctx = g.runtime.context();
    let (e0, e1) = (Event::new(ctx)?, Event::new(ctx)?);
    let mut times = Vec::new();
    for i in 0..6 {
        e0.record(s)?;
        // SAFETY: two live 1 GiB allocations of this device.
        unsafe { result::memcpy_dtod_async(b.device_ptr(), a.device_ptr(), n, s.raw()) }
            .map_err(|e| anyccl_cuda::driver::cu_err("cuMemcpyDtoDAsync", e))?;
        e1.record(s)?;
        s.synchronize()?;
        if i > 0 {
            times.push(f64::from(e0.elapsed_ms(&e1)?) * 1e-3);
        }
    }
    Ok(2.0 * n as f64 / median(times) / 1e9)
}

/// Median time of one all-reduce of `kind` over the group, seconds.
fn time_kind(g: &EmulatedRanks, kind: Kind, device: i32) -> Result<f64> {
    let timer = g.runtime.stream()?;
    let data = vec![0x3fu8; g.bytes];
    for b in &g.inputs {
        // SAFETY: a view of the group's own input buffer, used only here.
        let mut v = unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), g.bytes, device.unsigned_abs()) };
        g.runtime.upload(&mut v, &data, &timer)?;
    }
    g.launch(kind, DataType::Bf16)?;
    g.synchronize()?;
    let graphs = g.capture(kind, DataType::Bf16, CALLS)?;
    let per_call = anyccl_lab::emulated::time_graphs(&g.runtime, &g.streams, &graphs, CALLS, 3, ROUNDS)?;
    Ok(per_call)
}

fn kind_of(name: &str) -> Option<Kind> {
    Kind::ALL.into_iter().find(|k| k.name().split(' ').next() == Some(name))
}

fn run(world: usize, device: i32, kinds: &[Kind], rounds: &[usize]) -> Result<()> {
    let sizes: Vec<usize> = (0..7).map(|i| (1usize << 20) << i).collect();
    println!("anyccl custom kernels, {world} ranks emulated on one GPU, bf16 sum; time per all-reduce (all ranks)");
    let probe = EmulatedRanks::new(device, world, 1 << 20, 8)?;
    let copy = copy_bandwidth(&probe)?;
    drop(probe);
    println!("device-to-device copy: {copy:.0} GB/s (read + write); cells: time  %copy/%unique\n");
    // Columns: every kind, two-shot once per round size.
    let mut columns: Vec<(Kind, Option<usize>, String)> = Vec::new();
    for &k in kinds {
        if k == Kind::TwoShot && !rounds.is_empty() {
            for &r in rounds {
                let label =
                    if r == 0 { "two-shot".to_string() } else { format!("two-shot r={}", format_bytes(r as u64)) };
                columns.push((k, Some(r), label));
            }
        } else {
            columns.push((k, None, k.name().to_string()));
        }
    }
    print!("{:>8}", "size");
    for (_, _, label) in &columns {
        print!(" {label:>26}");
    }
    println!();
    for &bytes in &sizes {
        // One block per 64 KiB per rank, at most 24: 8 ranks × 24 blocks of 512 threads at ≤ 64 registers stay
        // co-resident on 132 SMs (2 blocks per SM), which the cross-rank barriers need.
        let blocks = (bytes / (64 << 10)).clamp(4, 24) as u32;
        let mut g = EmulatedRanks::new(device, world, bytes, blocks)?;
        print!("{:>4} MiB", bytes >> 20);
        for (kind, round, _) in &columns {
            g.two_shot_round = round.unwrap_or(anyccl_cuda::custom::TWO_SHOT_ROUND_BYTES);
            let t = time_kind(&g, *kind, device)?;
            let pct = |f: f64| 100.0 * f * bytes as f64 / t / 1e9 / copy;
            let cell = match traffic(*kind, world) {
                Some((own, unique)) => format!("{:.1} us {:.0}%/{:.0}%", t * 1e6, pct(own), pct(unique)),
                None => format!("{:.1} us ?/?", t * 1e6),
            };
            print!(" {cell:>26}");
        }
        println!();
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let world = value("--world").and_then(|v| v.parse().ok()).unwrap_or(8);
    let device = value("--device").and_then(|v| v.parse().ok()).unwrap_or(0);
    let kinds: Option<Vec<Kind>> = match value("--kinds") {
        None => Some(Kind::ALL.to_vec()),
        Some(list) => list.split(',').map(kind_of).collect(),
    };
    let rounds: std::result::Result<Vec<usize>, _> = match value("--two-shot-rounds") {
        None => Ok(Vec::new()),
        Some(list) => list.split(',').map(|r| parse_bytes(r).map(|b| b as usize)).collect(),
    };
    let (Some(kinds), Ok(rounds)) = (kinds, rounds) else {
        eprintln!(
            "usage: anyccl-cuda-emulated-bench [--world N] [--device D] [--kinds one-shot,two-shot,nvls-zero-copy,\
             nvls-warp-pipeline,nvls-block-pipeline] [--two-shot-rounds 0,2MiB,...]"
        );
        return ExitCode::FAILURE;
    };
    match run(world, device, &kinds, &rounds) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
