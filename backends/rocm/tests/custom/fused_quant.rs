//! The ROCm communicator's fused all-reduce + residual add + RMSNorm and quantized two-shot on the fake HIP runtime,
//! which runs the kernels themselves (their source compiled for the host, testkit/c/host_kernels.cpp): every form's
//! outputs and new residuals equal core's host reference bit for bit, the quantized two-shots equal the host model
//! of `anyccl-kernels-common` value for value, and the ROCm communicator names what it offers and why it refuses
//! the rest. A module of the `custom` test (`main.rs`: its setup, its lock).

use super::*;

use anyccl_core::fused::{from_f32, to_f32, RmsNormForm, RmsNormSpec};
use anyccl_gpu::quant::{self, Format};
use fake_hip::Fused;
use fused_case::{bytes_of, rng, u16s, Case};

use anyccl_testkit::fused_case;

const EPS: f32 = 1e-5;

/// Every rank's result of one fused call with `spec`: the selection, the output bytes and the new residual.
type FusedResult = Result<(anyccl_core::RmsNormSelection, Vec<u8>, Vec<u16>)>;

fn run_fused(cs: &mut [Communicator<RocmComm>], case: &Case, spec: &RmsNormSpec) -> Vec<FusedResult> {
    per_rank(cs, |c| -> FusedResult {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let call = &case.call;
        let mut input = rt.alloc(call.bytes)?;
        rt.upload(&mut input, &bytes_of(&case.inputs[c.rank()]), &st)?;
        let mut residual = rt.alloc(call.bytes)?;
        rt.upload(&mut residual, &bytes_of(&case.residual), &st)?;
        let mut weight = rt.alloc(call.hidden * 2)?;
        rt.upload(&mut weight, &bytes_of(&case.weight), &st)?;
        let mut out = rt.alloc(call.out_bytes)?;
        let sel = c.all_reduce_rmsnorm(&input, &mut residual, &weight, &mut out, spec, &st)?;
        st.synchronize()?;
        let (mut o, mut r) = (vec![0u8; call.out_bytes], vec![0u8; call.bytes]);
        rt.download(&out, &mut o, &st)?;
        rt.download(&residual, &mut r, &st)?;
        Ok((sel, o, u16s(&r)))
    })
}

/// The kernels a fused form launches on every rank, in order: (name, its kind in the fake's record).
fn kernels_of(form: RmsNormForm, dtype: DataType, bytes: usize) -> Vec<(String, Option<Fused>)> {
    let name = |family| catalogue_kernel(family, dtype);
    match form {
        RmsNormForm::FusedOneShot => vec![(name(Family::FusedOneShot { table: false }), Some(Fused::OneShot))],
        RmsNormForm::FusedTwoShot => vec![(name(Family::FusedTwoShot { table: false }), Some(Fused::TwoShot))],
        RmsNormForm::Unfused => {
            // The custom all-reduce: one-shot up to the fused one-shot's limit, two-shot above.
            let all_reduce = if bytes <= anyccl_core::selector::FUSED_ONE_SHOT_MAX_BYTES {
                Family::OneShot { table: false }
            } else {
                Family::TwoShot { table: false }
            };
            vec![(name(all_reduce), None), (name(Family::RmsNorm), Some(Fused::RmsNorm))]
        }
        other => panic!("{other} does not run on ROCm"),
    }
}

/// Every fused form the ROCm communicator offers (fused one-shot, fused two-shot, unfused: the custom all-reduce,
/// then `anyccl_rmsnorm_*`) at worlds 2 and 4, bf16 and f16, 1, 3, 5 and 64 tokens (3 and 5 divide by neither world:
/// two-shot's last chunk is short or empty), rows of fewer vectors than the kernels' 512 threads and of more
/// (4800 elements: 600 vectors, so some threads add two), and fp8 output once per world. The 64 rows of 4800 are
/// there to be sensitive: a sum of squares off by one f32 ulp (an unfused multiply-add, another order) moves some
/// of their 307200 rounded outputs, which few rows would not show. Every rank's output and
/// new residual equal core's host reference bit for bit, the form that ran is the one asked for, and each rank
/// launched exactly that form's kernels, decoded with the call's `NormArgs`, and they ran to completion. The
/// fused push form is refused on ROCm, with the reason, and fp8 output on the unfused path too.
#[test]
fn every_fused_form_equals_the_host_reference_bit_for_bit() {
    let _g = serial();
    let s = setup();
    let forms = [RmsNormForm::FusedOneShot, RmsNormForm::FusedTwoShot, RmsNormForm::Unfused];
    for world in [2usize, 4] {
        let mut cs = comms(&s, world);
        assert!(cs[0].backend().custom_kernels_off().is_none(), "{:?}", cs[0].backend().custom_kernels_off());
        let mut cases = Vec::new();
        for dtype in [DataType::Bf16, DataType::F16] {
            for (tokens, hidden) in [(1usize, 4800usize), (3, 64), (5, 1032), (64, 4800)] {
                cases.push((RmsNormSpec::new(dtype, tokens, hidden, EPS), &forms[..]));
            }
        }
        let fp8 = RmsNormSpec::new(DataType::Bf16, 3, 4800, EPS).fp8_output(0.03);
        cases.push((fp8, &forms[..2]));
        for (k, (spec, forms)) in cases.into_iter().enumerate() {
            let case = Case::new(spec, world, (world * 1000 + k * 10) as u64);
            let (want_out, want_res) = case.expected();
            for &form in forms {
                let what = format!(
                    "world {world} {} tokens {} hidden {} {:?} {form}",
                    spec.dtype, spec.tokens, spec.hidden, spec.output
                );
                let from = s.fake.launch_total();
                let got = run_fused(&mut cs, &case, &spec.with_form(form));
                for (rank, r) in got.into_iter().enumerate() {
                    let (sel, out, res) = r.unwrap_or_else(|e| panic!("{what} rank {rank}: {e}"));
                    assert_eq!(sel.form, form, "{what}");
                    assert!(res == want_res, "{what} rank {rank}: the new residual differs from the reference");
                    assert!(out == want_out, "{what} rank {rank}: the output differs from the reference");
                }
                let launches: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
                let want = kernels_of(form, spec.dtype, case.call.bytes);
                assert_eq!(launches.len(), want.len() * world, "{what}: {launches:?}");
                for (name, kind) in want {
                    let of: Vec<&Launch> = launches.iter().filter(|l| l.name == name).collect();
                    assert_eq!(of.len(), world, "{what}: {name} once per rank");
                    for l in of {
                        assert_eq!((l.status, l.runs, l.completed), (0, 1, 1), "{what}: {l:?}");
                        if let Some(kind) = kind {
                            let p = l.norm.as_ref().expect("decoded NormArgs");
                            assert_eq!(p.form, kind);
                            assert_eq!(l.block, [512, 1, 1], "{what}");
                            assert_eq!((p.tokens, p.hidden_vec as usize), (spec.tokens as u64, spec.hidden / 8));
                            assert_eq!(
                                (p.eps, p.out_fp8),
                                (EPS, spec.output != anyccl_core::fused::RmsNormOutput::Same)
                            );
                        }
                    }
                }
            }
            // Refused on ROCm, with the reason, and nothing launched.
            let from = s.fake.launch_total();
            for r in run_fused(&mut cs, &case, &spec.with_form(RmsNormForm::FusedPush)) {
                let e = r.expect_err("no fused push on ROCm").to_string();
                // Above the push slots' 256 KiB the size is named first.
                let why = if case.call.bytes <= 256 << 10 { "ROCm backend does not offer it" } else { "push" };
                assert!(e.contains(why), "{e}");
            }
            if spec.output != anyccl_core::fused::RmsNormOutput::Same {
                for r in run_fused(&mut cs, &case, &spec.with_form(RmsNormForm::Unfused)) {
                    assert!(r.expect_err("fp8 unfused").to_string().contains("fp8"));
                }
            }
            assert_eq!(s.fake.launch_total(), from, "a refused call launched something");
        }
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// A fused call whose kernel launch fails (the fake fails the next launches of that kernel, as a failing device
/// would) returns the launch's failure named by the form that ran (`{form} all-reduce + rmsnorm: …`), on every rank;
/// nothing was left half-run, so the same call then runs and equals the host reference. The unfused form's second
/// kernel (the RMSNorm, after its all-reduce ran on every rank) fails the same way.
#[test]
fn a_failed_fused_launch_names_its_form() {
    let _g = serial();
    let s = setup();
    let world = 2;
    let mut cs = comms(&s, world);
    let spec = RmsNormSpec::new(DataType::Bf16, 3, 1032, EPS);
    let case = Case::new(spec, world, 77);
    let (want_out, want_res) = case.expected();
    let cases = [
        (RmsNormForm::FusedOneShot, "anyccl_fused_one_shot_"),
        (RmsNormForm::FusedTwoShot, "anyccl_fused_two_shot_"),
        (RmsNormForm::Unfused, "anyccl_rmsnorm_"),
    ];
    for (form, prefix) in cases {
        s.fake.fail_launches(prefix, world as i32);
        let got = run_fused(&mut cs, &case, &spec.with_form(form));
        s.fake.fail_launches("", 0);
        for (rank, r) in got.into_iter().enumerate() {
            let e = r.expect_err("the launch failed");
            match &e {
                anyccl_core::Error::Backend { call, .. } => {
                    assert!(call.starts_with(&format!("{form} all-reduce + rmsnorm: ")), "rank {rank}: {e}");
                }
                other => panic!("rank {rank}: {form}: not the launch's failure: {other}"),
            }
        }
        for (rank, r) in run_fused(&mut cs, &case, &spec.with_form(form)).into_iter().enumerate() {
            let (sel, out, res) = r.unwrap_or_else(|e| panic!("{form} rank {rank} after the failure: {e}"));
            assert_eq!(sel.form, form);
            assert!(res == want_res && out == want_out, "{form} rank {rank}: differs from the reference");
        }
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// Captured fused calls on ROCm read their inputs through the `_table` kernels: a replay before
/// `register_graph_buffers` stages the input (`registered` 0), one after reads the registered inputs directly
/// (`registered` 1), and both replays' outputs and new residuals (residual and inputs uploaded anew before each)
/// equal the host reference bit for bit. Fused one-shot and fused two-shot at world 2, bf16, 3 tokens.
#[test]
fn captured_fused_calls_replay_bit_for_bit_through_the_table_kernels() {
    let _g = serial();
    let s = setup();
    let world = 2;
    let spec = RmsNormSpec::new(DataType::Bf16, 3, 1032, EPS);
    for (form, name) in [
        (RmsNormForm::FusedOneShot, "anyccl_fused_one_shot_table_bf16"),
        (RmsNormForm::FusedTwoShot, "anyccl_fused_two_shot_table_bf16"),
    ] {
        // A communicator per form: a registration outlives the buffers it names (they must stay allocated while
        // their graphs live), so a later capture must not meet the earlier one's addresses.
        let mut cs = comms(&s, world);
        let rounds: Vec<Case> = (0..2).map(|r| Case::new(spec, world, 7000 + 10 * r)).collect();
        let from = s.fake.launch_total();
        let got = per_rank(&mut cs, |c| -> Result<Vec<(Vec<u8>, Vec<u16>)>> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let call = &rounds[0].call;
            let mut input = rt.alloc(call.bytes)?;
            let mut residual = rt.alloc(call.bytes)?;
            let mut weight = rt.alloc(call.hidden * 2)?;
            let mut out = rt.alloc(call.out_bytes)?;
            let f = spec.with_form(form);
            let graph = HipGraph::capture(&st, |st| {
                c.all_reduce_rmsnorm(&input, &mut residual, &weight, &mut out, &f, st).map(|_| ())
            })?;
            let mut results = Vec::new();
            for (round, case) in rounds.iter().enumerate() {
                if round == 1 {
                    let reg = c.register_graph_buffers(None)?;
                    assert_eq!(reg.registered, 1, "{reg:?}");
                }
                rt.upload(&mut input, &bytes_of(&case.inputs[c.rank()]), &st)?;
                rt.upload(&mut residual, &bytes_of(&case.residual), &st)?;
                rt.upload(&mut weight, &bytes_of(&case.weight), &st)?;
                graph.launch(&st)?;
                st.synchronize()?;
                let (mut o, mut r) = (vec![0u8; call.out_bytes], vec![0u8; call.bytes]);
                rt.download(&out, &mut o, &st)?;
                rt.download(&residual, &mut r, &st)?;
                results.push((o, u16s(&r)));
            }
            Ok(results)
        });
        for (rank, r) in got.into_iter().enumerate() {
            let results = r.unwrap_or_else(|e| panic!("{form} rank {rank}: {e}"));
            for (round, (out, res)) in results.into_iter().enumerate() {
                let (want_out, want_res) = rounds[round].expected();
                assert!(res == want_res, "{form} rank {rank} replay {round}: the new residual differs");
                assert!(out == want_out, "{form} rank {rank} replay {round}: the output differs");
            }
        }
        let launches: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
        assert_eq!(launches.len(), world, "{launches:?}");
        for l in &launches {
            assert_eq!(l.name, name);
            assert!(l.capturing && l.norm.as_ref().is_some_and(|p| p.table_kernel), "{l:?}");
            assert_eq!((l.runs, l.completed, l.failed), (2, 2, 0), "{l:?}");
        }
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// The quantized two-shots (`two-shot-fp8`, `two-shot-int8`) on ROCm at worlds 2 and 4, bf16, f16 and f32, one
/// vector, sizes whose last 32-element block is partial, out of place and in place: every element of every rank's
/// output equals `anyccl_kernels_common::quant::model` (the host model the CUDA GPU test compares with) rounded to
/// the element type, bit for bit; each rank launched `anyccl_quant_two_shot_{format}_{type}` once, decoded with
/// the communicator's staging and scratch, and it ran to completion.
#[test]
fn quantized_two_shots_equal_the_host_model_value_for_value() {
    let _g = serial();
    let s = setup();
    for world in [2usize, 4] {
        let mut cs = comms(&s, world);
        for format in Format::ALL {
            let algorithm = if format == Format::Fp8E4m3 { Algorithm::TwoShotFp8 } else { Algorithm::TwoShotInt8 };
            let cases = [
                (DataType::Bf16, 16usize, false),
                (DataType::Bf16, 4096 + 48, true),
                (DataType::F16, 2064, false),
                (DataType::F32, 1040, false),
            ];
            for (k, (dtype, bytes, in_place)) in cases.into_iter().enumerate() {
                let what = format!("world {world} {format:?} {dtype} {bytes} bytes in place {in_place}");
                let n = bytes / dtype.size_bytes();
                // Each rank's input as f32 values exact in the element type.
                let ins: Vec<Vec<f32>> = (0..world)
                    .map(|r| {
                        let mut next = rng((world * 100 + k * 10 + r) as u64 + 1);
                        (0..n)
                            .map(|i| {
                                let v = next() * [1.0f32, 16.0, 0.0625][(i / 45) % 3];
                                if dtype == DataType::F32 {
                                    v
                                } else {
                                    to_f32(dtype, from_f32(dtype, v))
                                }
                            })
                            .collect()
                    })
                    .collect();
                let encode = |v: &[f32]| -> Vec<u8> {
                    match dtype {
                        DataType::F32 => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
                        _ => v.iter().flat_map(|x| from_f32(dtype, *x).to_ne_bytes()).collect(),
                    }
                };
                let from = s.fake.launch_total();
                let got = per_rank(&mut cs, |c| -> Result<Vec<u8>> {
                    let rt = c.runtime().clone();
                    let st = rt.stream()?;
                    let mut a = rt.alloc(bytes)?;
                    rt.upload(&mut a, &encode(&ins[c.rank()]), &st)?;
                    let mut b = rt.alloc(bytes)?;
                    let bufs =
                        if in_place { InOut::InPlace(&mut a) } else { InOut::Separate { send: &a, recv: &mut b } };
                    c.all_reduce_with(algorithm, bufs, n, dtype, ReduceOp::Sum, &st)?;
                    st.synchronize()?;
                    let mut host = vec![0u8; bytes];
                    rt.download(if in_place { &a } else { &b }, &mut host, &st)?;
                    Ok(host)
                });
                let refs: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
                let want = encode(&quant::model::model(format, &refs));
                for (rank, r) in got.into_iter().enumerate() {
                    let host = r.unwrap_or_else(|e| panic!("{what} rank {rank}: {e}"));
                    let esz = dtype.size_bytes();
                    let wrong = (0..n).filter(|i| host[i * esz..(i + 1) * esz] != want[i * esz..(i + 1) * esz]).count();
                    assert_eq!(wrong, 0, "{what} rank {rank}: elements that differ from the host model");
                }
                let launches: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
                let kernel = catalogue_kernel(Family::QuantTwoShot(format), dtype);
                assert_eq!(launches.len(), world, "{what}: {launches:?}");
                for l in &launches {
                    assert_eq!(l.name, kernel, "{what}");
                    assert_eq!((l.status, l.runs, l.completed), (0, 1, 1), "{what}: {l:?}");
                    let q = l.quant.as_ref().expect("decoded quantized parameters");
                    assert_eq!((q.format, q.world as usize, q.n_vec as usize), (format.name(), world, bytes / 16));
                    assert!(q.stage[..world].iter().chain(&q.scratch[..world]).all(|p| *p != 0), "{what}: {q:?}");
                }
            }
        }
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// What the ROCm communicator says it offers: the fused one-shot, fused two-shot and unfused forms are eligible
/// (each chosen when forced), the default choice is one of them, the fused push form is refused with the reason
/// (ROCm has no push one-shot), and the quantized two-shots are ROCm algorithms, eligible when named but never
/// chosen by the default selection (lossy).
#[test]
fn rocm_names_the_fused_and_quantized_forms_it_offers() {
    let _g = serial();
    let s = setup();
    let cs = comms(&s, 2);
    let c = &cs[0];
    let call = RmsNormSpec::new(DataType::Bf16, 3, 1024, EPS).call().expect("valid");
    for form in [RmsNormForm::FusedOneShot, RmsNormForm::FusedTwoShot, RmsNormForm::Unfused] {
        let sel = c.select_rmsnorm(&call, Some(form)).unwrap_or_else(|e| panic!("{form}: {e}"));
        assert_eq!(sel.form, form);
    }
    let default = c.select_rmsnorm(&call, None).expect("a default form").form;
    assert!(
        [RmsNormForm::FusedOneShot, RmsNormForm::FusedTwoShot, RmsNormForm::Unfused].contains(&default),
        "{default}"
    );
    let e = c.select_rmsnorm(&call, Some(RmsNormForm::FusedPush)).expect_err("no fused push").to_string();
    assert!(e.contains("ROCm backend does not offer it"), "{e}");
    for algorithm in [Algorithm::TwoShotFp8, Algorithm::TwoShotInt8] {
        assert!(anyccl_rocm::platform::ALGORITHMS.contains(&algorithm));
        let call = anyccl_core::comm::AllReduceCall {
            count: 2048,
            dtype: DataType::Bf16,
            op: ReduceOp::Sum,
            bytes: 4096,
            in_place: true,
            capturing: false,
            bufs: None,
        };
        c.check_algorithm(algorithm, &call).unwrap_or_else(|e| panic!("{algorithm}: {e}"));
        let chosen = c.select_all_reduce(&call).expect("selection").algorithm;
        assert!(!chosen.is_lossy(), "the default selection chose {chosen}");
    }
}
