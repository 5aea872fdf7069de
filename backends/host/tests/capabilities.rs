//! The host backend's capability report says what its collectives accept: every flag it reports on works through
//! an all-reduce, and bf16, fp8 and `avg`, which its own kernels implement, are reported on.

use std::time::Duration;

use anyccl_core::{Capabilities, DataType, Error, InOut, InvalidArgument, ReduceOp};
use anyccl_host::{communicators, host_capabilities, HostBuffer, HostOptions, HostStream};
use float8::{F8E4M3, F8E5M2};
use half::bf16;

/// One all-reduce of two elements per case, on two ranks; rank r contributes r + 1, so the sum is 3 and the mean
/// 1.5 (both exact in bf16 and the fp8 types).
const CASES: [(Capabilities, DataType, ReduceOp, f32); 5] = [
    (Capabilities::BF16, DataType::Bf16, ReduceOp::Sum, 3.0),
    (Capabilities::AVG, DataType::F32, ReduceOp::Avg, 1.5),
    (Capabilities::AVG, DataType::Bf16, ReduceOp::Avg, 1.5),
    (Capabilities::FP8, DataType::Fp8E4M3, ReduceOp::Sum, 3.0),
    (Capabilities::FP8, DataType::Fp8E5M2, ReduceOp::Avg, 1.5),
];

fn buffer(dtype: DataType, v: f32) -> HostBuffer {
    match dtype {
        DataType::Bf16 => HostBuffer::from_elems(&[bf16::from_f32(v); 2]),
        DataType::F32 => HostBuffer::from_elems(&[v; 2]),
        DataType::Fp8E4M3 => HostBuffer::from_elems(&[F8E4M3::from_f32(v); 2]),
        DataType::Fp8E5M2 => HostBuffer::from_elems(&[F8E5M2::from_f32(v); 2]),
        other => panic!("no case uses {other}"),
    }
}

fn values(dtype: DataType, buf: &HostBuffer) -> Vec<f32> {
    match dtype {
        DataType::Bf16 => buf.to_vec::<bf16>().into_iter().map(bf16::to_f32).collect(),
        DataType::F32 => buf.to_vec::<f32>(),
        DataType::Fp8E4M3 => buf.to_vec::<F8E4M3>().into_iter().map(|x| x.to_f32()).collect(),
        DataType::Fp8E5M2 => buf.to_vec::<F8E5M2>().into_iter().map(|x| x.to_f32()).collect(),
        other => panic!("no case uses {other}"),
    }
}

#[test]
fn the_report_says_on_for_what_an_all_reduce_accepts() {
    let opts = HostOptions { timeout: Duration::from_secs(60), ..HostOptions::default() };
    let comms = communicators(2, opts).expect("host group");
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let report = comm.capabilities().clone();
                    assert_eq!(report, host_capabilities());
                    for (cap, dtype, op, want) in CASES {
                        let name = cap.name().expect("a single flag");
                        assert!(report.has(cap), "{name} reported off: {report}");
                        let mut buf = buffer(dtype, comm.rank() as f32 + 1.0);
                        let chosen = comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 2, dtype, op, &HostStream);
                        assert!(chosen.is_ok(), "{name}: {dtype} {op} refused: {chosen:?}");
                        assert_eq!(values(dtype, &buf), [want; 2], "{name}: {dtype} {op}");
                    }
                    // What the report keeps off is refused: `avg` needs a floating-point type on every backend.
                    let mut ints = HostBuffer::from_elems(&[1i32; 2]);
                    let refused = comm.all_reduce(
                        InOut::InPlace(ints.as_bytes_mut()),
                        2,
                        DataType::I32,
                        ReduceOp::Avg,
                        &HostStream,
                    );
                    assert!(
                        matches!(refused, Err(Error::InvalidArgument(InvalidArgument::UnsupportedReduction { .. }))),
                        "{refused:?}"
                    );
                })
            })
            .collect();
        for r in ranks {
            r.join().expect("rank thread");
        }
    });
}

#[test]
fn the_report_keeps_vendor_capabilities_off_with_a_reason() {
    let report = host_capabilities();
    let on = Capabilities::HOST_BACKEND
        | Capabilities::COMM_SPLIT
        | Capabilities::BF16
        | Capabilities::AVG
        | Capabilities::FP8;
    assert_eq!(report.enabled(), on, "{report}");
    let text = report.to_string();
    assert!(text.contains("[on ] bf16\n[on ] avg\n[on ] fp8\n"), "{text}");
    assert!(
        text.contains(
            "[off] ccl                  not applicable: the host backend uses no vendor library or accelerator\n"
        ),
        "{text}"
    );
}
