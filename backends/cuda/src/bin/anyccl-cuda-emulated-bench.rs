//! Benchmark of the custom one-shot and two-shot kernels with N ranks emulated on one GPU (default 8, bf16,
//! 1 MiB to 64 MiB). Method: per size and kernel, each rank's stream holds a CUDA graph of 10 back-to-back calls;
//! all ranks' graphs start together after an event on a timing stream, which then waits for every rank; 3 warm-up
//! rounds, 20 timed rounds, median; time per all-reduce = round / 10. Bytes counted: one-shot moves (N reads + 1
//! write) × size per rank; two-shot (1 + 1/N + 1 + 1) × size per rank; their sum over ranks, over the time, is the
//! achieved bandwidth, compared with a device-to-device copy measured in the same run (read + write counted).
//! Usage: anyccl-cuda-emulated-bench [--world N] [--device D]

use std::process::ExitCode;

use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_cuda::custom::Kind;
use anyccl_cuda::emulated::EmulatedRanks;
use anyccl_cuda::graph::Event;
use cudarc::driver::result;

const CALLS: usize = 10;
const ROUNDS: usize = 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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

fn run(world: usize, device: i32) -> Result<()> {
    let sizes: Vec<usize> = (0..7).map(|i| (1usize << 20) << i).collect();
    println!("anyccl custom kernels, {world} ranks emulated on one GPU, bf16 sum; time per all-reduce (all ranks)");
    let probe = EmulatedRanks::new(device, world, 1 << 20, 8)?;
    let copy = copy_bandwidth(&probe)?;
    drop(probe);
    println!("device-to-device copy: {copy:.0} GB/s (read + write)\n");
    println!(
        "{:>8} {:>10} {:>10} {:>12} {:>10} {:>10} {:>12}",
        "size", "one-shot", "GB/s", "% copy bound", "two-shot", "GB/s", "% copy bound"
    );
    for &bytes in &sizes {
        // One block per 64 KiB per rank, at most 24: 8 ranks × 24 blocks of 512 threads at ≤ 64 registers stay
        // co-resident on 132 SMs (2 blocks per SM), which the cross-rank barriers need.
        let blocks = (bytes / (64 << 10)).clamp(4, 24) as u32;
        let g = EmulatedRanks::new(device, world, bytes, blocks)?;
        let timer = g.runtime.stream()?;
        let ctx = g.runtime.context();
        let mut row = Vec::new();
        for kind in [Kind::OneShot, Kind::TwoShot] {
            let data = vec![0x3fu8; bytes];
            for b in &g.inputs {
                // SAFETY: a view of the group's own input buffer, used only here.
                let mut v =
                    unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), bytes, device.unsigned_abs()) };
                g.runtime.upload(&mut v, &data, &timer)?;
            }
            g.launch(kind, DataType::Bf16)?;
            g.synchronize()?;
            let graphs = g.capture(kind, DataType::Bf16, CALLS)?;
            let (start, end) = (Event::new(ctx)?, Event::new(ctx)?);
            let done: Vec<Event> = g.streams.iter().map(|_| Event::new(ctx)).collect::<Result<_>>()?;
            let mut times = Vec::new();
            for round in 0..3 + ROUNDS {
                start.record(&timer)?;
                for ((gr, s), d) in graphs.iter().zip(&g.streams).zip(&done) {
                    start.wait_on(s)?;
                    gr.launch(s)?;
                    d.record(s)?;
                }
                for d in &done {
                    d.wait_on(&timer)?;
                }
                end.record(&timer)?;
                timer.synchronize()?;
                if round >= 3 {
                    times.push(f64::from(start.elapsed_ms(&end)?) * 1e-3 / CALLS as f64);
                }
            }
            let t = median(times);
            let per_rank = match kind {
                Kind::OneShot => (world + 1) as f64,
                Kind::TwoShot => 3.0 + 1.0 / world as f64,
                // Reads and writes 1/N of the message from and to every rank.
                Kind::NvlsZeroCopyEmulated => 2.0,
                // Copy in, reduce-load, broadcast-store, copy out.
                Kind::NvlsBlockPipelineEmulated => 6.0,
            };
            let moved = per_rank * world as f64 * bytes as f64;
            let bw = moved / t / 1e9;
            row.push((t * 1e6, bw, 100.0 * bw / copy));
        }
        println!(
            "{:>5} MiB {:>7.1} us {:>10.0} {:>11.0}% {:>7.1} us {:>10.0} {:>11.0}%",
            bytes >> 20,
            row[0].0,
            row[0].1,
            row[0].2,
            row[1].0,
            row[1].1,
            row[1].2
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok());
    match run(arg("--world").unwrap_or(8), arg("--device").unwrap_or(0) as i32) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
