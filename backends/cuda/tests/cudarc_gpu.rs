//! The typed all-reduce over cudarc's currency (feature `cudarc`). The tests marked `#[ignore = "needs an NVIDIA
//! GPU…"]` run on the GPU machine with `--ignored`; the compile check runs everywhere.
#![cfg(feature = "cudarc")]

use std::sync::Arc;

use anyccl_core::{Communicator, Error, InvalidArgument, Location, ReduceOp, Selector};
use anyccl_cuda::{CudaComm, CudarcAllReduce};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;

type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// What an engine writes: each of cudarc's slice types (owned slice, view, mutable view, sub-ranges) and its
/// `Arc<CudaStream>`, with no count, byte length, data type or `unsafe`.
fn takes_cudarc_currency(
    comm: &mut Communicator<CudaComm>,
    stream: &Arc<CudaStream>,
    a: &mut CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
) -> anyccl_core::Result<()> {
    comm.all_reduce_in_place(a, ReduceOp::Sum, stream)?;
    comm.all_reduce_in_place(&mut a.as_view_mut(), ReduceOp::Max, stream)?;
    comm.all_reduce_into(b, a, ReduceOp::Sum, stream)?;
    comm.all_reduce_into(&b.as_view(), &mut a.as_view_mut(), ReduceOp::Min, stream)?;
    comm.all_reduce_into(&b.slice(1..3), &mut a.slice_mut(2..4), ReduceOp::Sum, stream)?;
    Ok(())
}

#[test]
fn the_typed_api_takes_cudarc_slices_views_and_streams() -> anyccl_core::Result<()> {
    // That `takes_cudarc_currency` compiles is the check of the signatures (CI has no GPU to call it on).
    let _ = takes_cudarc_currency;
    // What it derives from a bf16 slice of 3 elements: count 3, 6 bytes, bf16.
    let derived = anyccl_cuda::cudarc_interop::typed_call::<bf16>(3)?;
    assert_eq!(derived, (3, 6, anyccl_core::DataType::Bf16));
    Ok(())
}

fn nccl() -> Arc<anyccl_ccl::CclLibrary> {
    anyccl_ccl::load(anyccl_ccl::CclVendor::Nccl).unwrap_or_else(|e| panic!("NCCL must be installed: {e}"))
}

fn world_one(ordinal: i32) -> anyccl_core::Result<Communicator<CudaComm>> {
    let mut comms = anyccl_cuda::communicators_single_process(nccl(), &[ordinal], Arc::new(Selector::defaults()))?;
    Ok(comms.remove(0))
}

fn ramp(n: usize) -> Vec<bf16> {
    (0..n).map(|i| bf16::from_f32((i % 97) as f32 - 48.0)).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn typed_all_reduce_of_cudarc_bf16_at_world_one() -> TestResult {
    let mut comm = world_one(0)?;
    let ctx = CudaContext::new(0)?;
    // The data is written on one stream and reduced on another: cudarc's event tracking orders them.
    let upload = ctx.new_stream()?;
    let work = ctx.new_stream()?;
    let host = ramp(4099);
    let send = upload.clone_htod(&host)?;
    let mut recv = upload.alloc_zeros::<bf16>(host.len())?;

    // Out of place at world 1: the result is the input, so every element moved (the output started at zero).
    let chosen = comm.all_reduce_into(&send, &mut recv, ReduceOp::Sum, &work)?;
    eprintln!("world 1 typed all-reduce: {} ({})", chosen.algorithm, chosen.why);
    assert_eq!(upload.clone_dtoh(&recv)?, host);

    // Sub-ranges: elements 100..600 of `send` into 200..700 of a zeroed `out`; nothing outside is touched.
    let mut out = upload.alloc_zeros::<bf16>(host.len())?;
    comm.all_reduce_into(&send.slice(100..600), &mut out.slice_mut(200..700), ReduceOp::Sum, &work)?;
    let got = upload.clone_dtoh(&out)?;
    assert_eq!(&got[200..700], &host[100..600]);
    assert!(got[..200].iter().chain(&got[700..]).all(|v| *v == bf16::ZERO), "written outside the view");

    // In place keeps the values at world 1 (and returns the selection).
    let mut x = upload.clone_htod(&host)?;
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &work)?;
    assert_eq!(upload.clone_dtoh(&x)?, host);
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_short_cudarc_receive_slice_is_an_invalid_argument_and_nothing_is_written() -> TestResult {
    let mut comm = world_one(0)?;
    let stream = CudaContext::new(0)?.default_stream();
    let send = stream.clone_htod(&ramp(1024))?;
    let mut recv = stream.alloc_zeros::<bf16>(1000)?;
    let e = comm.all_reduce_into(&send, &mut recv, ReduceOp::Sum, &stream).err();
    assert!(
        matches!(
            e,
            Some(Error::InvalidArgument(InvalidArgument::BufferTooSmall { which: "recv", have: 2000, need: 2048, .. }))
        ),
        "{e:?}"
    );
    assert!(stream.clone_dtoh(&recv)?.iter().all(|v| *v == bf16::ZERO), "a refused call wrote");
    Ok(())
}

#[test]
#[ignore = "needs two NVIDIA GPUs: run on a machine with two or more with --ignored"]
fn a_cudarc_slice_or_stream_of_another_device_is_wrong_device() -> TestResult {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).map_err(|r| r.to_string())?;
    assert!(gpus >= 2, "this test needs two GPUs; this machine has {gpus}");
    let mut comm = world_one(0)?;
    let here = CudaContext::new(0)?.default_stream();
    let there = CudaContext::new(1)?.default_stream();
    let mut other = there.clone_htod(&ramp(64))?;
    let mut mine = here.clone_htod(&ramp(64))?;
    // The slice's device comes from its cudarc context: device 1, not the communicator's 0.
    let e = comm.all_reduce_in_place(&mut other, ReduceOp::Sum, &here).err();
    assert!(
        matches!(
            e,
            Some(Error::InvalidArgument(InvalidArgument::WrongDevice {
                found: Location::Device { ordinal: 1 },
                expected: Location::Device { ordinal: 0 },
                ..
            }))
        ),
        "{e:?}"
    );
    // A stream of device 1 for a communicator of device 0.
    let e = comm.all_reduce_in_place(&mut mine, ReduceOp::Sum, &there).err();
    assert!(matches!(e, Some(Error::InvalidArgument(InvalidArgument::WrongDevice { which: "stream", .. }))), "{e:?}");
    Ok(())
}
