//! The CUDA backend's part of `anyccl bench` that must stay typed: in eager mode, the host time of one all-reduce
//! call through anyccl against a raw `ncclAllReduce` of the same library on the same buffers, both on the typed
//! `Communicator<CudaComm>` (reached from the erased communicator by downcasting), so the erased face's virtual
//! call does not enter anyccl's measured per-call overhead. Everything else runs in the driver of every backend
//! ([`crate::bench_any`]).

use std::time::Instant;

use anyccl::core::Communicator;
use anyccl::cuda::{CudaComm, CudaStream};
use anyccl::dynamic::{AnyBuffer, AnyStream, DynComm};
use anyccl::{InOut, Result};

use crate::bench::{median, BenchConfig};

/// Median host time (µs) per call through anyccl (`call(true, …)`) and raw (`call(false, …)`), over `iters` eager
/// calls of each, synchronising after each call. The two are interleaved (anyccl, raw, raw, anyccl, …: the first of
/// each pair alternates), so both see the same clock, cache and scheduling conditions; blocks of each timed one
/// after the other drifted by more than the difference being measured between runs on the H200 machine.
fn time_host_pair(
    stream: &CudaStream,
    iters: usize,
    call: &mut dyn FnMut(bool, &CudaStream) -> Result<()>,
) -> Result<(f64, f64)> {
    let (mut through, mut raw) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for i in 0..iters {
        let order = if i % 2 == 0 { [true, false] } else { [false, true] };
        for anyccl in order {
            let t = Instant::now();
            call(anyccl, stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if anyccl {
                through.push(us)
            } else {
                raw.push(us)
            }
            stream.synchronize()?;
        }
    }
    Ok((median(&mut through), median(&mut raw)))
}

/// The eager host times of one size (`n` bytes of `send` into `recv`) on a CUDA rank: `None` when `c` is not a
/// one-process CUDA communicator or the buffers are not its.
pub(crate) fn host_pair(
    c: &mut dyn DynComm,
    send: &AnyBuffer,
    recv: &mut AnyBuffer,
    stream: &AnyStream,
    n: usize,
    cfg: &BenchConfig,
) -> Result<Option<(f64, f64)>> {
    let Some(c) = c.as_any_mut().downcast_mut::<Communicator<CudaComm>>() else { return Ok(None) };
    let (Some(send), Some(recv), Some(stream)) = (send.as_cuda(), recv.as_cuda_mut(), stream.as_cuda()) else {
        return Ok(None);
    };
    let (dtype, op) = (cfg.dtype, cfg.op);
    let count = n / dtype.size_bytes();
    // The raw call's (type, operator) codes are mapped once, outside the loop: it is NCCL alone.
    let lib = c.backend().ccl().library().clone();
    let (d, o) = anyccl::ccl::CclReduction::new(&lib, dtype, op)?.codes(&lib)?;
    let sv = send.view(..n)?;
    let mut rv = recv.view_mut(..n)?;
    let pair = time_host_pair(stream, cfg.iters, &mut |anyccl, s| {
        if anyccl {
            return c.all_reduce(InOut::Separate { send: &*sv, recv: &mut *rv }, count, dtype, op, s).map(|_| ());
        }
        let comm = c.backend().ccl().handle()?;
        // SAFETY: a live communicator of `lib` (the communicator's own, borrowed for the call); views of this rank's
        // live buffers of this device, `n` bytes each (validated above by `view`); the stream is live.
        unsafe {
            anyccl::ccl::result::all_reduce(
                &lib,
                sv.device_ptr() as *const std::ffi::c_void,
                rv.device_ptr() as *mut std::ffi::c_void,
                count,
                d,
                o,
                comm,
                s.raw() as _,
            )
        }
    })?;
    Ok(Some(pair))
}
