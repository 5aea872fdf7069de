//! cudarc's currency (feature `cudarc`): all-reduce cudarc's device memory on cudarc's stream.
//!
//! An engine that holds `CudaSlice<T>`, `CudaView<T>` or `CudaViewMut<T>` and an `Arc<CudaStream>` (candle,
//! mistral.rs, a hand-written cudarc program) passes them as they are: the element count and type come from the
//! slice, the device from the slice's cudarc context, and cudarc's stream/event tracking is honoured (the stream
//! waits for the slice's pending writes, and reads too when it is written, and the call is recorded on the
//! slice's events afterwards, through cudarc's own [`DevicePtr`] / [`DevicePtrMut`]). Every call goes through
//! [`Communicator::all_reduce`], the validating front door: a slice on another device, a receive slice shorter
//! than the send slice, overlapping slices and reductions the type does not support are errors, never a
//! vendor call.
//!
//! ```no_run
//! # fn demo(
//! #     comm: &mut anyccl_core::Communicator<anyccl_cuda::CudaComm>,
//! #     stream: &std::sync::Arc<cudarc::driver::CudaStream>,
//! #     grads: &mut cudarc::driver::CudaSlice<half::bf16>,
//! # ) -> anyccl_core::Result<()> {
//! use anyccl_core::ReduceOp;
//! use anyccl_cuda::CudarcAllReduce;
//!
//! let chosen = comm.all_reduce_in_place(grads, ReduceOp::Sum, stream)?;
//! println!("{} because {}", chosen.algorithm, chosen.why);
//! # Ok(())
//! # }
//! ```
//!
//! This module chooses nothing about cudarc's linking or CUDA version: the binary does (see the crate's
//! `cudarc-dynamic-loading` feature).

use anyccl_core::{
    Communicator, DataType, Element, Error, InOut, InvalidArgument, Location, Reason, ReduceOp, Result, Selection,
};
use cudarc::driver::{CudaStream as CudarcStream, DevicePtr, DevicePtrMut};

use crate::comm::CudaComm;
use crate::driver::cu_err;
use crate::runtime::{CudaStream, DeviceBuffer};

/// Typed all-reduce of cudarc's device memory; implemented for [`Communicator<CudaComm>`].
///
/// `S`, `Src` and `Dst` are `CudaSlice<T>`, `CudaView<'_, T>` or `CudaViewMut<'_, T>` (anything cudarc hands
/// out as [`DevicePtr`] / [`DevicePtrMut`]); `T` is any [`Element`] (`half::bf16`, `half::f16`, `f32`, the fp8
/// types, the integers). The stream is cudarc's (`&Arc<CudaStream>` coerces).
pub trait CudarcAllReduce {
    /// All-reduces every element of `buf` in place on `stream`, with the algorithm the selector picks.
    fn all_reduce_in_place<T: Element, S: DevicePtrMut<T>>(
        &mut self,
        buf: &mut S,
        op: ReduceOp,
        stream: &CudarcStream,
    ) -> Result<Selection>;

    /// All-reduces every element of `send` into the first `send.len()` elements of `recv` on `stream`. (Named
    /// apart from [`Communicator::all_reduce`], the untyped front door, which an inherent method would shadow.)
    fn all_reduce_into<T: Element, Src: DevicePtr<T>, Dst: DevicePtrMut<T>>(
        &mut self,
        send: &Src,
        recv: &mut Dst,
        op: ReduceOp,
        stream: &CudarcStream,
    ) -> Result<Selection>;
}

/// What the typed API derives from a slice of `len` elements of `T`: (count, byte length, data type).
///
/// The byte length is checked: a length whose bytes overflow is [`InvalidArgument::CountOverflow`].
pub fn typed_call<T: Element>(len: usize) -> Result<(usize, usize, DataType)> {
    let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or(InvalidArgument::CountOverflow {
        count: len,
        dtype: T::DTYPE,
        world: 1,
    })?;
    Ok((len, bytes, T::DTYPE))
}

/// The device of a cudarc slice or stream: the ordinal of its cudarc context.
fn ordinal_of(stream: &CudarcStream) -> Result<u32> {
    let ordinal = stream.context().ordinal();
    u32::try_from(ordinal).map_err(|_| {
        Error::backend(
            "cuda",
            "cudarc CudaContext::ordinal",
            None,
            format!("device ordinal {ordinal} does not fit a CUDA device ordinal"),
        )
    })
}

/// anyccl's view of cudarc's `stream`, borrowed for one call: it must be a stream of the communicator's device, in
/// that device's primary context (where the communicator and its kernels live).
fn borrow_stream(comm: &Communicator<CudaComm>, stream: &CudarcStream) -> Result<CudaStream> {
    let ctx = comm.runtime().context();
    let ordinal = ordinal_of(stream)?;
    let expected = ctx.ordinal().unsigned_abs();
    if ordinal != expected {
        return Err(InvalidArgument::WrongDevice {
            which: "stream",
            found: Location::Device { ordinal },
            expected: Location::Device { ordinal: expected },
        }
        .into());
    }
    if !stream.context().is_primary() {
        return Err(Error::Unsupported {
            capability: "cudarc stream".into(),
            reason: Reason::NotApplicable {
                detail: format!(
                    "the stream belongs to a non-primary CUDA context of device {ordinal}; the communicator lives in \
                     the device's primary context (cudarc's CudaContext::new)"
                ),
            },
        });
    }
    // SAFETY: `stream` is a live cudarc stream of `ctx`'s device (checked above: same ordinal, primary context, which
    // is the context `ctx` retains). The returned view does not own it (nothing is destroyed on drop) and is
    // dropped by the caller before the borrow of `stream` ends.
    Ok(unsafe { CudaStream::from_raw(stream.cu_stream().cast(), ctx) })
}

/// cudarc's errors recorded while it set up the event waits (it records them in the context instead of
/// returning them); checked before the collective is enqueued, so a call whose ordering failed is not run.
fn check_tracking(stream: &CudarcStream) -> Result<()> {
    stream.context().check_err().map_err(|e| cu_err("cudarc stream/event tracking (CudaStream::wait)", e))
}

impl CudarcAllReduce for Communicator<CudaComm> {
    fn all_reduce_in_place<T: Element, S: DevicePtrMut<T>>(
        &mut self,
        buf: &mut S,
        op: ReduceOp,
        stream: &CudarcStream,
    ) -> Result<Selection> {
        let (count, bytes, dtype) = typed_call::<T>(buf.len())?;
        let ordinal = ordinal_of(buf.stream())?;
        let on = borrow_stream(self, stream)?;
        // cudarc's tracking: `stream` waits for the slice's pending reads and writes; dropping `_written` after
        // the all-reduce is enqueued records it as the slice's latest write.
        let (ptr, _written) = buf.device_ptr_mut(stream);
        check_tracking(stream)?;
        // SAFETY: `[ptr, ptr + bytes)` is the memory of the cudarc slice `buf` (its pointer for `stream` and its
        // length in bytes), on the device of its own context (`ordinal`). `buf` is mutably borrowed for this whole
        // function, so the memory stays allocated and no other Rust reference reaches it while `view` exists;
        // `view` is dropped before returning and frees nothing.
        let mut view = unsafe { DeviceBuffer::from_raw(ptr, bytes, ordinal) };
        self.all_reduce(InOut::InPlace(&mut view), count, dtype, op, &on)
    }

    fn all_reduce_into<T: Element, Src: DevicePtr<T>, Dst: DevicePtrMut<T>>(
        &mut self,
        send: &Src,
        recv: &mut Dst,
        op: ReduceOp,
        stream: &CudarcStream,
    ) -> Result<Selection> {
        let (count, send_bytes, dtype) = typed_call::<T>(send.len())?;
        let (_, recv_bytes, _) = typed_call::<T>(recv.len())?;
        let (send_ordinal, recv_ordinal) = (ordinal_of(send.stream())?, ordinal_of(recv.stream())?);
        let on = borrow_stream(self, stream)?;
        // cudarc's tracking: `stream` waits for `send`'s pending writes and `recv`'s pending reads and writes; the
        // guards record the all-reduce as `send`'s latest read and `recv`'s latest write when dropped after it.
        let (send_ptr, _read) = send.device_ptr(stream);
        let (recv_ptr, _written) = recv.device_ptr_mut(stream);
        check_tracking(stream)?;
        // SAFETY: each view covers exactly its cudarc slice's memory (pointer and length in bytes) on the device of
        // the slice's context. `send` is borrowed and `recv` mutably borrowed for this whole function, so both stay
        // allocated and `recv` is reached by no other Rust reference; the views are dropped before returning and
        // free nothing. Whether the two overlap is checked by the front door.
        let send_view = unsafe { DeviceBuffer::from_raw(send_ptr, send_bytes, send_ordinal) };
        // SAFETY: as above, for `recv`.
        let mut recv_view = unsafe { DeviceBuffer::from_raw(recv_ptr, recv_bytes, recv_ordinal) };
        Communicator::all_reduce(
            self,
            InOut::Separate { send: &send_view, recv: &mut recv_view },
            count,
            dtype,
            op,
            &on,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count, byte length and data type come from the element type: each Rust type maps to its own anyccl type
    /// and size, and a length whose bytes overflow is refused.
    #[test]
    fn typed_call_maps_each_element_type() -> Result<()> {
        fn check<T: Element>(dtype: DataType, size: usize) -> Result<()> {
            assert_eq!(typed_call::<T>(3)?, (3, 3 * size, dtype), "{dtype}");
            assert_eq!(typed_call::<T>(0)?, (0, 0, dtype), "{dtype}");
            Ok(())
        }
        check::<half::bf16>(DataType::Bf16, 2)?;
        check::<half::f16>(DataType::F16, 2)?;
        check::<f32>(DataType::F32, 4)?;
        check::<f64>(DataType::F64, 8)?;
        check::<i8>(DataType::I8, 1)?;
        check::<u8>(DataType::U8, 1)?;
        check::<i32>(DataType::I32, 4)?;
        check::<u32>(DataType::U32, 4)?;
        check::<i64>(DataType::I64, 8)?;
        check::<u64>(DataType::U64, 8)?;
        check::<float8::F8E4M3>(DataType::Fp8E4M3, 1)?;
        check::<float8::F8E5M2>(DataType::Fp8E5M2, 1)?;
        let overflow = typed_call::<half::bf16>(usize::MAX / 2 + 1);
        assert!(
            matches!(
                overflow,
                Err(Error::InvalidArgument(InvalidArgument::CountOverflow { dtype: DataType::Bf16, .. }))
            ),
            "{overflow:?}"
        );
        assert_eq!(typed_call::<u8>(usize::MAX)?.1, usize::MAX);
        Ok(())
    }
}
