//! The fused all-reduce + residual add + RMSNorm through the front door (`Communicator::all_reduce_rmsnorm`) on
//! the host backend, ranks as threads (`HostComm`) and as `ProcessComm`s over an in-process bootstrap: every form,
//! f16 and bf16, fp8 output, bit for bit against a reference computed here (rank-order f32 sum rounded once, then
//! core's row arithmetic, which anyccl-gpu's tests tie to the GPU kernels' reference); the residual updated in
//! place; bad calls refused with typed errors that change nothing; the form chosen by the call, the selector's
//! forced form and a table rule.

use std::sync::Arc;
use std::time::Duration;

use anyccl_core::bootstrap::LocalGroup;
use anyccl_core::fused::{norm_row, RmsNormSpec};
use anyccl_core::{
    CommBackend, Communicator, DataType, Error, InvalidArgument, RmsNormForm, RmsNormSelection, Selector,
};
use anyccl_host::{communicator_over, communicators, HostBuffer, HostOptions, HostRuntime};

fn options(selector: Selector) -> HostOptions {
    HostOptions { timeout: Duration::from_secs(20), selector: Arc::new(selector), ..HostOptions::default() }
}

/// One call's data: every rank's input, the residual (the same on every rank) and the weight, as element bits.
struct Data {
    inputs: Vec<Vec<u16>>,
    residual: Vec<u16>,
    weight: Vec<u16>,
}

fn bits(dtype: DataType, v: f32) -> u16 {
    anyccl_core::fused::from_f32(dtype, v)
}

impl Data {
    fn new(dtype: DataType, world: usize, tokens: usize, hidden: usize, seed: u64) -> Self {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = |scale: f64| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            bits(dtype, (u * scale) as f32)
        };
        let n = tokens * hidden;
        Data {
            inputs: (0..world).map(|r| (0..n).map(|i| next([1e-2, 1.0, 30.0][(i + r) % 3])).collect()).collect(),
            residual: (0..n).map(|_| next(2.0)).collect(),
            weight: (0..hidden).map(|_| next(1.5)).collect(),
        }
    }

    /// The expected output bytes and new residual.
    fn expected(&self, spec: &RmsNormSpec) -> (Vec<u8>, Vec<u16>) {
        let call = spec.call().expect("valid spec");
        let (dtype, hidden) = (spec.dtype, spec.hidden);
        let mut residual = self.residual.clone();
        let mut out = vec![0u8; call.out_bytes];
        let mut scratch = vec![0f32; hidden];
        let row_out = hidden * spec.output.element_bytes(dtype);
        for t in 0..spec.tokens {
            let row = t * hidden..(t + 1) * hidden;
            let reduced: Vec<u16> = row
                .clone()
                .map(|i| {
                    let mut acc = anyccl_core::fused::to_f32(dtype, self.inputs[0][i]);
                    for x in &self.inputs[1..] {
                        acc += anyccl_core::fused::to_f32(dtype, x[i]);
                    }
                    bits(dtype, acc)
                })
                .collect();
            let o = &mut out[t * row_out..(t + 1) * row_out];
            norm_row(&call, &reduced, &mut residual[row], &self.weight, o, &mut scratch);
        }
        (out, residual)
    }
}

/// A host buffer holding element bits.
fn buf(bits: &[u16]) -> HostBuffer {
    let mut b = HostBuffer::zeroed(bits.len() * 2);
    for (o, v) in b.as_bytes_mut().chunks_exact_mut(2).zip(bits) {
        o.copy_from_slice(&v.to_ne_bytes());
    }
    b
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_ne_bytes([c[0], c[1]])).collect()
}

/// One rank's result: the selection, the output bytes and the new residual.
type Got = (RmsNormSelection, Vec<u8>, Vec<u16>);

/// Runs `spec` on every rank (a thread each) and returns each rank's result.
fn run<B: CommBackend<Runtime = HostRuntime>>(comms: &mut [Communicator<B>], spec: &RmsNormSpec, d: &Data) -> Vec<Got> {
    let out_bytes = spec.call().expect("valid").out_bytes;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter_mut()
            .map(|c| {
                s.spawn(move || {
                    let input = buf(&d.inputs[c.rank()]);
                    let weight = buf(&d.weight);
                    let mut residual = buf(&d.residual);
                    let mut out = HostBuffer::zeroed(out_bytes);
                    out.as_bytes_mut().fill(0xA5);
                    let sel = c
                        .all_reduce_rmsnorm(
                            input.as_bytes(),
                            residual.as_bytes_mut(),
                            weight.as_bytes(),
                            out.as_bytes_mut(),
                            spec,
                            &(),
                        )
                        .expect("all_reduce_rmsnorm");
                    (sel, out.as_bytes().to_vec(), u16s(residual.as_bytes()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn assert_exact(what: &str, got: &[Got], want: &(Vec<u8>, Vec<u16>)) {
    for (rank, (sel, out, residual)) in got.iter().enumerate() {
        assert!(residual == &want.1, "{what}: rank {rank}'s new residual differs from the reference");
        if let Some(i) = out.iter().zip(&want.0).position(|(a, b)| a != b) {
            panic!("{what}: rank {rank} output byte {i} is {:#x}, want {:#x} ({sel:?})", out[i], want.0[i]);
        }
        assert_eq!(out.len(), want.0.len(), "{what}");
        assert_eq!(sel, &got[0].0, "{what}: ranks chose differently");
    }
}

/// The forms the host offers (the fused push one-shot is a GPU kernel's exchange; refused here, tested below).
const HOST_FORMS: [RmsNormForm; 3] = [RmsNormForm::FusedOneShot, RmsNormForm::FusedTwoShot, RmsNormForm::Unfused];

#[test]
fn every_form_on_threads_is_bit_exact_against_the_reference() {
    for world in [2usize, 3] {
        let mut comms = communicators(world, options(Selector::defaults())).expect("group");
        // Shapes: one row; rows of several vectors per thread (4104 > 512 × 8); above 8 KiB (two-shot schedule).
        for (dtype, tokens, hidden) in [(DataType::Bf16, 1, 8), (DataType::F16, 5, 4104), (DataType::Bf16, 9, 1024)] {
            let d = Data::new(dtype, world, tokens, hidden, (world * 131 + tokens) as u64);
            let base = RmsNormSpec::new(dtype, tokens, hidden, 1e-6);
            let want = d.expected(&base);
            // The residual really changed, and the output is not trivially the input.
            assert_ne!(want.1, d.residual);
            let auto = run(&mut comms, &base, &d);
            assert_exact(&format!("world {world} {dtype} {tokens}x{hidden} auto"), &auto, &want);
            assert!(auto[0].0.why.contains("default rule"), "{:?}", auto[0].0);
            for form in HOST_FORMS {
                let got = run(&mut comms, &base.with_form(form), &d);
                assert_eq!(got[0].0.form, form, "the forced form runs");
                assert!(got[0].0.why.contains("RmsNormSpec::form"), "{:?}", got[0].0);
                assert_exact(&format!("world {world} {dtype} {tokens}x{hidden} {form}"), &got, &want);
            }
            let fp8 = base.fp8_output(0.05);
            let want8 = d.expected(&fp8);
            assert_eq!(want8.0.len(), tokens * hidden);
            assert_eq!(want8.1, want.1, "fp8 output leaves the residual as it is");
            for form in HOST_FORMS {
                let got = run(&mut comms, &fp8.with_form(form), &d);
                assert_exact(&format!("world {world} {dtype} {tokens}x{hidden} {form} fp8"), &got, &want8);
            }
        }
    }
}

#[test]
fn process_communicators_are_bit_exact_too() {
    let world = 3;
    let group = LocalGroup::new(world, Duration::from_secs(20));
    let mut comms: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let me = Box::new(group.member(r));
                s.spawn(move || communicator_over(me, options(Selector::defaults())).expect("communicator"))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("setup")).collect()
    });
    let (dtype, tokens, hidden) = (DataType::F16, 7, 2048);
    let d = Data::new(dtype, world, tokens, hidden, 5);
    let spec = RmsNormSpec::new(dtype, tokens, hidden, 1e-5);
    let want = d.expected(&spec);
    for form in HOST_FORMS {
        assert_exact(&format!("processes {form}"), &run(&mut comms, &spec.with_form(form), &d), &want);
    }
    let fp8 = spec.fp8_output(0.02);
    assert_exact("processes fp8", &run(&mut comms, &fp8, &d), &d.expected(&fp8));
}

/// Deterministic mode changes nothing: every form already sums in rank order, and the bits are the same.
#[test]
fn deterministic_mode_keeps_the_forms_and_the_bits() {
    let world = 2;
    let mut comms = communicators(world, options(Selector::defaults())).expect("group");
    let d = Data::new(DataType::Bf16, world, 40, 8192, 9);
    let spec = RmsNormSpec::new(DataType::Bf16, 40, 8192, 1e-6);
    let plain = run(&mut comms, &spec, &d);
    comms.iter_mut().for_each(|c| c.set_deterministic(true));
    let det = run(&mut comms, &spec, &d);
    // 40 rows of 8192 bf16 (640 KiB): the default rule's two-shot, in both modes.
    assert_eq!(det[0].0.form, RmsNormForm::FusedTwoShot);
    assert_eq!(plain[0].0, det[0].0);
    assert_exact("deterministic", &det, &d.expected(&spec));
}

/// The form from the selector's forced form (what `ANYCCL_FUSED_RMSNORM` sets) and from a table rule.
#[test]
fn the_selector_forces_and_table_rules_choose_the_form() {
    let world = 2;
    let d = Data::new(DataType::F16, world, 2, 64, 3);
    let spec = RmsNormSpec::new(DataType::F16, 2, 64, 1e-6);
    let want = d.expected(&spec);
    let forced = Selector::defaults().with_fused_forced(Some(RmsNormForm::Unfused));
    let got = run(&mut communicators(world, options(forced)).expect("group"), &spec, &d);
    assert_eq!((got[0].0.form, &*got[0].0.why), (RmsNormForm::Unfused, "forced by ANYCCL_FUSED_RMSNORM"));
    assert_exact("forced by the selector", &got, &want);

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tune.toml");
    std::fs::write(&path, "[[rule]]\nvendor = \"host\"\nbytes = \"0-1KiB\"\nfused_rmsnorm = [\"fused-two-shot\"]\n")
        .expect("write");
    let table = Selector::defaults().with_table_file(&path, "test").expect("table");
    let mut comms = communicators(world, options(table)).expect("group");
    let got = run(&mut comms, &spec, &d);
    assert_eq!(got[0].0.form, RmsNormForm::FusedTwoShot);
    assert!(got[0].0.why.contains("tune.toml:4"), "{}", got[0].0.why);
    assert_exact("table rule", &got, &want);
    // Above the rule's bytes: the default rule.
    let big = RmsNormSpec::new(DataType::F16, 16, 64, 1e-6);
    let got = run(&mut comms, &big, &Data::new(DataType::F16, world, 16, 64, 4));
    assert!(got[0].0.why.contains("default rule"), "{}", got[0].0.why);
}

/// Bad calls on one rank alone (refused before any exchange, so no peer is needed): a typed error naming the
/// culprit, and the residual and output untouched.
#[test]
fn bad_calls_are_refused_with_typed_errors_and_change_nothing() {
    let mut comms = communicators(2, options(Selector::defaults())).expect("group");
    let c = &mut comms[0];
    let (tokens, hidden) = (4, 64);
    let n = tokens * hidden * 2;
    let input = HostBuffer::zeroed(n + 16);
    let weight = HostBuffer::zeroed(hidden * 2);
    let mut residual = buf(&vec![0x3c00u16; tokens * hidden]);
    let mut out = HostBuffer::zeroed(n + 16);
    out.as_bytes_mut().fill(0x77);
    let ok = RmsNormSpec::new(DataType::F16, tokens, hidden, 1e-6);
    let with = |f: &dyn Fn(&mut RmsNormSpec)| {
        let mut s = ok;
        f(&mut s);
        s
    };
    let (res0, out0) = (residual.clone(), out.clone());
    let mut check = |spec: RmsNormSpec, input: &[u8], weight: &[u8], out_off: usize, out_len: usize| {
        let o = &mut out.as_bytes_mut()[out_off..out_off + out_len];
        let e = c.all_reduce_rmsnorm(input, residual.as_bytes_mut(), weight, o, &spec, &()).expect_err("refused");
        assert_eq!(residual, res0, "the residual changed on a refused call");
        match e {
            Error::InvalidArgument(i) => i,
            other => panic!("not an invalid argument: {other}"),
        }
    };
    let i = check(with(&|s| s.dtype = DataType::F32), input.as_bytes(), weight.as_bytes(), 0, n);
    assert!(matches!(i, InvalidArgument::UnsupportedDataType { dtype: DataType::F32, .. }), "{i}");
    let i = check(with(&|s| s.hidden = 60), input.as_bytes(), weight.as_bytes(), 0, n);
    assert!(matches!(i, InvalidArgument::InvalidValue { what: "RmsNormSpec::hidden", .. }), "{i}");
    let i = check(with(&|s| s.eps = f32::NAN), input.as_bytes(), weight.as_bytes(), 0, n);
    assert!(matches!(i, InvalidArgument::InvalidValue { what: "RmsNormSpec::eps", .. }), "{i}");
    let i = check(ok, &input.as_bytes()[8..], weight.as_bytes(), 0, n);
    assert!(matches!(i, InvalidArgument::Misaligned { which: "input", align: 16, .. }), "{i}");
    let i = check(ok, input.as_bytes(), &weight.as_bytes()[..hidden], 0, n);
    assert!(matches!(i, InvalidArgument::BufferTooSmall { which: "weight", .. }), "{i}");
    let i = check(ok, input.as_bytes(), weight.as_bytes(), 0, n - 2);
    assert!(matches!(i, InvalidArgument::BufferTooSmall { which: "out", .. }), "{i}");
    let i = check(ok.fp8_output(0.0), input.as_bytes(), weight.as_bytes(), 0, n);
    assert!(matches!(i, InvalidArgument::InvalidValue { .. }) && i.to_string().contains("scale"), "{i}");
    assert_eq!(out, out0, "the output changed on a refused call");
    // The fused push one-shot is not a host form: forced, it is refused before anything moves, naming it.
    let push = ok.with_form(RmsNormForm::FusedPush);
    let e = c
        .all_reduce_rmsnorm(
            input.as_bytes(),
            residual.as_bytes_mut(),
            weight.as_bytes(),
            &mut out.as_bytes_mut()[..n],
            &push,
            &(),
        )
        .expect_err("fused-push on the host");
    assert!(e.to_string().contains("fused-push"), "{e}");
    assert_eq!((&residual, &out), (&res0, &out0), "a refused fused-push call changed a buffer");
    // Other forced forms are checked like the rest; every host form is eligible, so a valid call on one rank
    // alone would wait for its peer: not run here.
}
