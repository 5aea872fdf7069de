//! The fused all-reduce + residual add + RMSNorm with N ranks emulated on one GPU, against the host reference
//! (`anyccl_gpu::fused::reference`, the kernels' math operation for operation): exact bits for the output and
//! the new residual on every rank, for fused one-shot, fused two-shot and the unfused baseline (all-reduce kernel,
//! then the separate RMSNorm kernel), eager and graph replay, direct / staged / table inputs, and fp8 e4m3 output
//! against the float8 crate's conversion.

use anyccl_core::{DataType, MemoryRuntime};
use anyccl_cuda::custom::Kind;
use anyccl_gpu::fused::reference;
use anyccl_gpu::fused::{FusedForm, FusedOutput};
use anyccl_lab::emulated::InputMode;
use anyccl_lab::emulated_fused::{EmulatedFused, FusedPath};

/// xorshift64*: reproducible inputs in [-1, 1) without a dependency.
fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
    }
}

fn bytes_of(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|e| e.to_le_bytes()).collect()
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

/// A second handle on a buffer of the group, for the upload/download API.
fn view(b: &anyccl_cuda::DeviceBuffer) -> anyccl_cuda::DeviceBuffer {
    // SAFETY: the group owns the allocation and outlives every use of the view in this test.
    unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), b.len(), 0) }
}

/// Host data of one case: every rank's input, the residual (the same on every rank) and the weight, as element bits.
struct Data {
    inputs: Vec<Vec<u16>>,
    residual: Vec<u16>,
    weight: Vec<u16>,
}

impl Data {
    fn new(dtype: DataType, world: usize, tokens: usize, hidden: usize, seed: u64) -> Self {
        let n = tokens * hidden;
        let inputs = (0..world)
            .map(|r| {
                let mut next = rng(seed ^ ((r as u64 + 1) * 0x1000_0001));
                (0..n).map(|_| reference::from_f32(dtype, next())).collect()
            })
            .collect();
        let mut next = rng(seed ^ 0xabcd);
        let residual = (0..n).map(|_| reference::from_f32(dtype, next())).collect();
        let weight = (0..hidden).map(|_| reference::from_f32(dtype, 1.0 + 0.5 * next())).collect();
        Data { inputs, residual, weight }
    }

    fn reference(&self, dtype: DataType, eps: f32) -> Vec<reference::Row> {
        let refs: Vec<&[u16]> = self.inputs.iter().map(Vec::as_slice).collect();
        reference::fused(dtype, &refs, &self.residual, &self.weight, eps)
    }
}

/// Uploads the inputs and weight once.
fn upload(g: &EmulatedFused, d: &Data) {
    let s = &g.streams[0];
    for (r, x) in d.inputs.iter().enumerate() {
        g.runtime.upload(&mut view(&g.inputs[r]), &bytes_of(x), s).expect("upload input");
    }
    g.runtime.upload(&mut view(&g.weight), &bytes_of(&d.weight), s).expect("upload weight");
}

/// Before every call: the residual back to the case's, the outputs poisoned.
fn reset(g: &EmulatedFused, d: &Data) {
    let s = &g.streams[0];
    let res = bytes_of(&d.residual);
    for r in 0..g.streams.len() {
        g.runtime.upload(&mut view(&g.residual[r]), &res, s).expect("reset residual");
        g.runtime.upload(&mut view(&g.out[r]), &vec![0xFFu8; g.bytes], s).expect("poison output");
    }
}

/// Every rank's (output bytes, new residual bits).
fn results(g: &EmulatedFused) -> Vec<(Vec<u8>, Vec<u16>)> {
    let s = &g.streams[0];
    let out_bytes = g.tokens * g.hidden * g.output.element_bytes(g.dtype);
    (0..g.streams.len())
        .map(|r| {
            let mut o = vec![0u8; out_bytes];
            g.runtime.download(&g.out[r], &mut o, s).expect("download output");
            let mut res = vec![0u8; g.bytes];
            g.runtime.download(&g.residual[r], &mut res, s).expect("download residual");
            (o, u16s(&res))
        })
        .collect()
}

/// What the reference says the output bytes are.
fn expected_out(rows: &[reference::Row], output: FusedOutput) -> Vec<u8> {
    match output {
        FusedOutput::Fp8E4M3 { scale } => {
            rows.iter().flat_map(|r| r.y.iter().map(move |y| float8::F8E4M3::from_f32(y / scale).to_bits())).collect()
        }
        _ => rows.iter().flat_map(|r| bytes_of(&r.out)).collect(),
    }
}

/// Asserts every rank's output and residual equal the reference exactly; on a mismatch says how many elements
/// differ and by how many units in the last place at most.
fn assert_exact(what: &str, got: &[(Vec<u8>, Vec<u16>)], rows: &[reference::Row], output: FusedOutput) {
    let want_out = expected_out(rows, output);
    let want_res: Vec<u16> = rows.iter().flat_map(|r| r.residual.iter().copied()).collect();
    for (rank, (o, res)) in got.iter().enumerate() {
        if o != &want_out {
            let (diffs, max_ulp) = match output {
                FusedOutput::Fp8E4M3 { .. } => {
                    let d: Vec<i32> = o.iter().zip(&want_out).map(|(a, b)| (*a as i32 - *b as i32).abs()).collect();
                    (d.iter().filter(|x| **x != 0).count(), d.iter().copied().max().unwrap_or(0))
                }
                _ => {
                    let (a, b) = (u16s(o), u16s(&want_out));
                    let d: Vec<i32> = a.iter().zip(&b).map(|(x, y)| (*x as i32 - *y as i32).abs()).collect();
                    (d.iter().filter(|x| **x != 0).count(), d.iter().copied().max().unwrap_or(0))
                }
            };
            let first = o.iter().zip(&want_out).position(|(a, b)| a != b);
            panic!("{what}: rank {rank}: output differs from the reference in {diffs} bytes/elements (max {max_ulp} ulp; first byte {first:?})");
        }
        if res != &want_res {
            let diffs = res.iter().zip(&want_res).filter(|(a, b)| a != b).count();
            panic!("{what}: rank {rank}: new residual differs from the reference in {diffs} elements");
        }
    }
}

/// One call of `path`, eager, from a fresh residual.
fn run(g: &EmulatedFused, d: &Data, path: FusedPath) -> Vec<(Vec<u8>, Vec<u16>)> {
    reset(g, d);
    g.launch(path).expect("launch");
    g.synchronize().expect("sync");
    results(g)
}

/// One replay of a captured call of `path`, from a fresh residual.
fn replay(g: &EmulatedFused, d: &Data, path: FusedPath) -> Vec<(Vec<u8>, Vec<u16>)> {
    let graphs = g.capture(path, 1).expect("capture");
    reset(g, d);
    for (gr, s) in graphs.iter().zip(&g.streams) {
        gr.launch(s).expect("replay");
    }
    g.synchronize().expect("sync");
    results(g)
}

/// Every path on one group: each equal to the reference (so fused bits == unfused bits), and the fused forms
/// compared with the unfused ones explicitly; `graph`: each replayed from a graph too.
fn check_paths(g: &EmulatedFused, d: &Data, rows: &[reference::Row], graph: bool, label: &str) {
    let mut by_path = Vec::new();
    for path in FusedPath::ALL {
        let what = format!("{label} {}", path.name());
        let eager = run(g, d, path);
        assert_exact(&format!("{what} eager"), &eager, rows, g.output);
        if graph {
            let replayed = replay(g, d, path);
            assert_eq!(replayed, eager, "{what}: graph replay differs from eager");
        }
        by_path.push((path, eager));
    }
    let unfused = &by_path[2].1;
    for (path, got) in &by_path[..2] {
        assert_eq!(got, unfused, "{label}: {} bits differ from all-reduce + separate RMSNorm", path.name());
    }
}

const SHAPES: [(usize, usize); 5] = [(1, 16384), (1, 8), (5, 8192), (37, 1032), (64, 4096)];

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn fused_forms_match_the_reference_and_the_unfused_bits_for_2_to_8_ranks() {
    let mut seed = 1;
    for world in 2..=8 {
        for dtype in [DataType::Bf16, DataType::F16] {
            for (i, (tokens, hidden)) in SHAPES.into_iter().enumerate() {
                seed += 1;
                let g = EmulatedFused::new(0, world, dtype, tokens, hidden, 8).expect("emulated ranks");
                let d = Data::new(dtype, world, tokens, hidden, seed);
                upload(&g, &d);
                let rows = d.reference(dtype, g.eps);
                // Graph replay on two shapes per world and type (one of them hidden 16384 with one token).
                let graph = i == 0 || i == 3;
                check_paths(&g, &d, &rows, graph, &format!("world {world} {dtype} {tokens}x{hidden}"));
            }
        }
        eprintln!("world {world}: fused one-/two-shot and unfused, bf16/f16, {SHAPES:?}: bit-exact");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn fused_forms_read_inputs_through_staging_and_tables() {
    let mut seed = 500;
    for world in [2, 3, 8] {
        for (tokens, hidden) in [(1, 16384), (19, 2048)] {
            let dtype = DataType::Bf16;
            seed += 1;
            let mut g = EmulatedFused::new(0, world, dtype, tokens, hidden, 8).expect("emulated ranks");
            let d = Data::new(dtype, world, tokens, hidden, seed);
            upload(&g, &d);
            let rows = d.reference(dtype, g.eps);
            for (mode, registered) in [(InputMode::Staged, false), (InputMode::Table, false), (InputMode::Table, true)]
            {
                g.input_mode = mode;
                g.set_tables(registered).expect("tables");
                let label = format!("world {world} {tokens}x{hidden} {mode:?} registered={registered}");
                check_paths(&g, &d, &rows, true, &label);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn fp8_output_is_the_e4m3_of_the_normalised_value_over_the_scale() {
    let mut seed = 900;
    for world in [2, 5, 8] {
        for dtype in [DataType::Bf16, DataType::F16] {
            // Scales that put the values in the middle of e4m3's range, near its top (saturating some) and at its
            // bottom (subnormals and zeros).
            for scale in [0.01f32, 0.004, 40.0] {
                let (tokens, hidden) = (9, 4096);
                seed += 1;
                let mut g = EmulatedFused::new(0, world, dtype, tokens, hidden, 8).expect("emulated ranks");
                g.output = FusedOutput::Fp8E4M3 { scale };
                let d = Data::new(dtype, world, tokens, hidden, seed);
                upload(&g, &d);
                let rows = d.reference(dtype, g.eps);
                let label = format!("fp8 scale {scale} world {world} {dtype}");
                check_paths(&g, &d, &rows, world == 8, &label);
                if scale == 0.004 {
                    let q = expected_out(&rows, g.output);
                    assert!(q.iter().any(|b| b & 0x7f == 0x7e), "{label}: the case was meant to saturate some values");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn repeated_calls_keep_the_barriers_in_step_and_update_the_residual_each_time() {
    // Three back-to-back calls in one graph per rank: the residual is updated three times in place, and the
    // epochs of every block stay in step across the kernels (fused and all-reduce kernels share the flag arrays).
    for path in FusedPath::ALL.into_iter().chain(FusedPath::PUSH) {
        let (world, dtype, tokens, hidden) = (4, DataType::Bf16, 13, 1024);
        let mut g = EmulatedFused::new(0, world, dtype, tokens, hidden, 8).expect("emulated ranks");
        g.enable_push().expect("push paths");
        let mut d = Data::new(dtype, world, tokens, hidden, 77);
        upload(&g, &d);
        let graphs = g.capture(path, 3).expect("capture");
        reset(&g, &d);
        for (gr, s) in graphs.iter().zip(&g.streams) {
            gr.launch(s).expect("replay");
        }
        g.synchronize().expect("sync");
        let got = results(&g);
        let mut rows = Vec::new();
        for _ in 0..3 {
            rows = d.reference(dtype, g.eps);
            d.residual = rows.iter().flat_map(|r| r.residual.iter().copied()).collect();
        }
        assert_exact(&format!("{} × 3 in one graph", path.name()), &got, &rows, g.output);
    }
}

/// The fused push one-shot and its baseline (push one-shot, then the separate RMSNorm): bit for bit the reference
/// for 2–8 ranks, f16/bf16, up to the receive slots' 256 KiB; two eager calls in a row (the second uses the other
/// buffer set), graph replay, fp8 output; and the two paths interleaved on the same receive buffers.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn fused_push_matches_the_reference_for_2_to_8_ranks_on_alternating_buffer_sets() {
    const PUSH_SHAPES: [(usize, usize); 4] = [(1, 8192), (1, 16384), (5, 1032), (16, 8192)];
    let mut seed = 500;
    for world in 2..=8 {
        for dtype in [DataType::Bf16, DataType::F16] {
            for (i, (tokens, hidden)) in PUSH_SHAPES.into_iter().enumerate() {
                seed += 1;
                let mut g = EmulatedFused::new(0, world, dtype, tokens, hidden, 8).expect("emulated ranks");
                g.enable_push().expect("push paths");
                if i == 2 {
                    g.output = FusedOutput::Fp8E4M3 { scale: 0.01 };
                }
                let d = Data::new(dtype, world, tokens, hidden, seed);
                upload(&g, &d);
                let rows = d.reference(dtype, g.eps);
                for path in FusedPath::PUSH.into_iter().chain(FusedPath::PUSH) {
                    let what = format!("world {world} {dtype} {tokens}x{hidden} {}", path.name());
                    for call in 0..2 {
                        assert_exact(&format!("{what} eager call {call}"), &run(&g, &d, path), &rows, g.output);
                    }
                    if i == 0 || i == 3 {
                        assert_exact(&format!("{what} replayed"), &replay(&g, &d, path), &rows, g.output);
                    }
                }
                // Every slot of both sets holds the sentinel again after the calls.
                let p = g.push.as_ref().expect("enabled");
                let mut recv = vec![0u8; anyccl_lab::push::PUSH_RECV_BYTES];
                for (r, b) in p.recv.iter().enumerate() {
                    g.runtime.download(b, &mut recv, &g.streams[0]).expect("download receive buffer");
                    let sets = anyccl_kernels_cuda::push::PUSH_CTRL_OFFSET;
                    assert!(recv[..sets].iter().all(|b| *b == 0xFF), "{world} {dtype} rank {r}: a slot kept data");
                }
            }
        }
        eprintln!("world {world}: fused push and push + rmsnorm, bf16/f16, {PUSH_SHAPES:?}: bit-exact");
    }
}

/// The fused push kernel stops through the abort word when its peer never pushes (with and without programmatic
/// dependent launch).
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_fused_push_kernel_whose_peer_never_writes_stops_when_its_abort_word_is_set() {
    for pdl in [false, true] {
        let mut g = EmulatedFused::new(0, 2, DataType::Bf16, 2, 4096, 8).expect("emulated ranks");
        g.enable_push().expect("push paths");
        let p = g.push.as_mut().expect("enabled");
        if pdl && !p.pdl {
            continue;
        }
        p.pdl = pdl;
        let d = Data::new(DataType::Bf16, 2, 2, 4096, 3);
        upload(&g, &d);
        reset(&g, &d);
        g.launch_rank(FusedPath::FusedPush, 0, &g.streams[0]).expect("launch rank 0");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!g.streams[0].query().expect("query"), "pdl {pdl}: rank 0 finished without its peer's rows");
        let t = std::time::Instant::now();
        anyccl_cuda::custom::stop_waiting(&g.flags[0], &g.streams[1], std::time::Duration::from_secs(1))
            .expect("set the abort word");
        while !g.streams[0].query().expect("query") {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                eprintln!("pdl {pdl}: the fused push kernel still waits 10 s after its abort word was set");
                std::process::exit(1);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        eprintln!("pdl {pdl}: stopped {:?} after its abort word was set", t.elapsed());
    }
}

#[test]
fn paths_cover_both_fused_forms_and_both_unfused_all_reduces() {
    assert_eq!(
        FusedPath::ALL,
        [
            FusedPath::Fused(FusedForm::OneShot),
            FusedPath::Fused(FusedForm::TwoShot),
            FusedPath::Unfused(Kind::OneShot),
            FusedPath::Unfused(Kind::TwoShot)
        ]
    );
}

/// The front door (`Communicator::all_reduce_rmsnorm`) on real GPUs (one rank per GPU, NCCL for the
/// communicator): every form against the reference, bit for bit on every rank, and a bad call refused with a
/// typed error.
#[test]
#[ignore = "needs 2 or more NVIDIA GPUs and NCCL: run on a multi-GPU machine with --ignored"]
fn communicator_all_reduce_rmsnorm_matches_the_reference_on_every_gpu() {
    use anyccl_core::{Communicator, RmsNormForm, RmsNormSpec, Selector};
    use anyccl_gpu::GpuPlatform;
    use std::sync::Arc;
    let gpus = anyccl_cuda::Cuda::device_count().expect("device count");
    assert!(gpus >= 2, "this test needs at least 2 GPUs, found {gpus}");
    let lib = anyccl_ccl::load(anyccl_ccl::CclVendor::Nccl).unwrap_or_else(|e| panic!("NCCL must be installed: {e}"));
    for world in [2, gpus.min(8)] {
        let caps = Arc::new(anyccl_cuda::capabilities(Some(&lib), &|k| std::env::var(k).ok()));
        let ordinals: Vec<i32> = (0..world as i32).collect();
        let backends = anyccl_cuda::CudaComm::init_all(lib.clone(), &ordinals, caps).expect("communicators");
        assert!(
            backends[0].custom_kernels_off().is_none(),
            "custom kernels off: {:?}",
            backends[0].custom_kernels_off()
        );
        let selector = Arc::new(Selector::defaults());
        let mut comms: Vec<_> = backends.into_iter().map(|b| Communicator::new(b, selector.clone())).collect();
        for (tokens, hidden) in [(1usize, 8192usize), (64, 4096), (300, 2048)] {
            let dtype = DataType::Bf16;
            let d = Data::new(dtype, world, tokens, hidden, 31 + tokens as u64);
            let rows = d.reference(dtype, 1e-6);
            let bytes = tokens * hidden * 2;
            let mut bufs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    let rt = c.runtime().clone();
                    let st = rt.stream().expect("stream");
                    let mut input = rt.alloc(bytes).expect("alloc");
                    rt.upload(&mut input, &bytes_of(&d.inputs[r]), &st).expect("upload");
                    let mut weight = rt.alloc(hidden * 2).expect("alloc");
                    rt.upload(&mut weight, &bytes_of(&d.weight), &st).expect("upload");
                    let (residual, out) = (rt.alloc(bytes).expect("alloc"), rt.alloc(bytes).expect("alloc"));
                    (rt, st, input, weight, residual, out)
                })
                .collect();
            // The fused push one-shot takes messages up to the push receive slots (256 KiB).
            let forms = RmsNormForm::ALL;
            let fits = |f: &RmsNormForm| *f != RmsNormForm::FusedPush || bytes <= 256 << 10;
            for (choice, fp8) in forms
                .iter()
                .filter(|f| fits(f))
                .map(|c| (*c, None))
                .chain([(forms[0], Some(0.01f32)), (forms[1], Some(0.01))])
            {
                let mut spec = RmsNormSpec::new(dtype, tokens, hidden, 1e-6).with_form(choice);
                if let Some(scale) = fp8 {
                    spec = spec.fp8_output(scale);
                }
                for (rt, st, _, _, residual, out) in &mut bufs {
                    rt.upload(residual, &bytes_of(&d.residual), st).expect("reset residual");
                    rt.upload(out, &vec![0xFFu8; bytes], st).expect("poison");
                }
                for (c, (_, st, input, weight, residual, out)) in comms.iter_mut().zip(&mut bufs) {
                    let how =
                        c.all_reduce_rmsnorm(input, residual, weight, out, &spec, st).expect("all_reduce_rmsnorm");
                    assert_eq!(how.form, choice, "{choice:?} carried out as asked");
                }
                let output = spec.output;
                let got: Vec<(Vec<u8>, Vec<u16>)> = bufs
                    .iter()
                    .map(|(rt, st, _, _, residual, out)| {
                        st.synchronize().expect("sync");
                        let mut o = vec![0u8; tokens * hidden * output.element_bytes(dtype)];
                        rt.download(out, &mut o, st).expect("download");
                        let mut res = vec![0u8; bytes];
                        rt.download(residual, &mut res, st).expect("download");
                        (o, u16s(&res))
                    })
                    .collect();
                assert_exact(
                    &format!("comm world {world} {tokens}x{hidden} {choice:?} fp8 {fp8:?}"),
                    &got,
                    &rows,
                    output,
                );
            }
            // A bad call: refused before anything is launched, with the culprit named.
            let (_, st, input, weight, residual, out) = &mut bufs[0];
            let bad = RmsNormSpec::new(dtype, tokens, hidden + 4, 1e-6);
            let e = comms[0].all_reduce_rmsnorm(input, residual, weight, out, &bad, st).expect_err("refused");
            assert!(e.to_string().contains("hidden"), "{e}");
        }
        eprintln!("communicator, world {world}: fused one-shot, two-shot, unfused, fp8: bit-exact");
    }
}
