//! The memory runtime a backend provides: where buffers live, how they are allocated and copied, and whether a
//! stream is being captured into a graph. CUDA and HIP implement it over their drivers; the host backend over host
//! memory.

use std::borrow::BorrowMut;
use std::fmt;
use std::ops::{Bound, RangeBounds};

use serde::Serialize;

use crate::error::{Error, InvalidArgument, Result};

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
#[non_exhaustive]
pub enum Location {
    /// Host (CPU) memory.
    Host,
    /// Memory of the accelerator with this ordinal.
    Device {
        /// Device ordinal as the vendor runtime numbers it.
        ordinal: u32,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host => f.write_str("the host"),
            Location::Device { ordinal } => write!(f, "device {ordinal}"),
        }
    }
}

/// How a stream capture treats calls from other threads that are unsafe during capture (the CUDA and HIP
/// `StreamCaptureMode`).
///
/// Not `#[non_exhaustive]`: the three modes are the vendors' complete set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CaptureMode {
    /// Any thread's unsafe call (a synchronous allocation, a stream synchronize) fails while the capture lasts.
    /// What engines that capture whole forward passes (PyTorch, vLLM) use.
    Global,
    /// Only the capturing thread's own unsafe calls fail; other threads (other ranks driving other GPUs) go on.
    #[default]
    ThreadLocal,
    /// No call is refused on behalf of the capture; the caller answers for what it does.
    Relaxed,
}

/// What the validation front-end needs to know of a buffer: where it starts, how long it is, where it lives.
///
/// Not `#[non_exhaustive]`: every [`BufferLike`] implementation, in backends and engines, builds one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferDesc {
    /// Start address (host or device virtual address).
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Where the memory lives.
    pub location: Location,
}

impl BufferDesc {
    /// Whether `[self.addr, +len)` and `[other.addr, +len)` share at least one byte.
    pub fn overlaps(&self, other: &BufferDesc) -> bool {
        if self.location != other.location || self.len == 0 || other.len == 0 {
            return false;
        }
        let a_end = self.addr.saturating_add(self.len);
        let b_end = other.addr.saturating_add(other.len);
        self.addr < b_end && other.addr < a_end
    }
}

/// A view of memory that a backend's collectives accept.
pub trait BufferLike {
    /// Address, length and location of the view.
    fn desc(&self) -> BufferDesc;
}

impl BufferLike for [u8] {
    fn desc(&self) -> BufferDesc {
        BufferDesc { addr: self.as_ptr() as usize, len: self.len(), location: Location::Host }
    }
}

/// Memory and stream services of one device (or of the host), shared by all algorithms of a backend.
///
/// Implemented over the CUDA driver, the HIP runtime and host memory. The conformance suite and the benchmark
/// use only this trait to move data in and out, so they run unchanged on every backend.
pub trait MemoryRuntime: Send + Sync {
    /// The borrowed buffer type the collectives take (`[u8]` on the host, a device slice on GPUs).
    type Buffer: ?Sized + BufferLike;
    /// An owned allocation that lends out a [`Self::Buffer`].
    type OwnedBuffer: BorrowMut<Self::Buffer> + Send;
    /// The stream collectives are ordered on (`()` on the host).
    type Stream: Send + Sync;

    /// Where this runtime's buffers live.
    fn location(&self) -> Location;

    /// Allocates `bytes` bytes, aligned for every [`crate::DataType`]. Not allowed while a stream is being captured
    /// into a graph: GPU runtimes refuse it with [`InvalidArgument::DuringCapture`] before the driver sees it, so the
    /// capture stays valid ([`MemoryRuntime::refuse_during_capture`], [`crate::capture`]).
    fn alloc(&self, bytes: usize) -> Result<Self::OwnedBuffer>;

    /// Copies `src` into the start of `dst`, ordered on `stream`, and waits for it.
    fn upload(&self, dst: &mut Self::Buffer, src: &[u8], stream: &Self::Stream) -> Result<()>;

    /// Copies the start of `src` into `dst`, ordered on `stream`, and waits for it.
    fn download(&self, src: &Self::Buffer, dst: &mut [u8], stream: &Self::Stream) -> Result<()>;

    /// Blocks until all work on `stream` has finished.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;

    /// Whether `stream` is being captured into a graph right now (the path chosen depends on it).
    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool>;

    /// Refuses `what`, a call that takes no stream but is not capture-safe (allocation, registration), with
    /// [`InvalidArgument::DuringCapture`] while a capture it would break runs on a stream this runtime knows
    /// ([`crate::capture::KnownStreams`]). The default, for runtimes without graphs (the host): never refused.
    fn refuse_during_capture(&self, what: &'static str) -> Result<()> {
        let _ = what;
        Ok(())
    }

    /// Whether all work queued on `stream` has finished, without blocking where the runtime can tell (`true`:
    /// done). Refused with [`InvalidArgument::DuringCapture`] while `stream` is being captured. The default synchronizes and answers `true`: right for a
    /// runtime whose work is done when the call that queued it returns (the host); GPU runtimes override it.
    fn query(&self, stream: &Self::Stream) -> Result<bool> {
        self.synchronize(stream).map(|()| true)
    }
}

/// The byte range `range` of a `len`-byte buffer as `(offset, length)`, for the views of device buffers. Refused
/// with [`InvalidArgument::RangeOutOfBounds`] when it ends past `len` or before it starts.
pub fn view_range(len: usize, range: impl RangeBounds<usize>) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(start), Some(end)) if start <= end && end <= len => Ok((start, end - start)),
        _ => Err(InvalidArgument::RangeOutOfBounds {
            start: start.unwrap_or(usize::MAX),
            end: end.unwrap_or(usize::MAX),
            len,
        }
        .into()),
    }
}

/// The largest single allocation anyccl asks of a vendor allocator: `isize::MAX` bytes, the most a slice can
/// describe. Larger requests are refused before any vendor call.
pub const MAX_ALLOCATION: usize = isize::MAX as usize;

/// `bytes` rounded up to a whole number of `granule`-byte units (at least one unit), refused with
/// [`InvalidArgument::SizeTooLarge`] when that exceeds [`MAX_ALLOCATION`] (instead of wrapping to a small size).
pub fn round_allocation(what: &'static str, bytes: usize, granule: usize) -> Result<usize> {
    let granule = granule.max(1);
    let too_large = || {
        Error::InvalidArgument(InvalidArgument::SizeTooLarge {
            what,
            requested: bytes as u64,
            limit: (MAX_ALLOCATION / granule * granule) as u64,
        })
    };
    let rounded = bytes.max(1).div_ceil(granule).checked_mul(granule).ok_or_else(too_large)?;
    if rounded > MAX_ALLOCATION {
        return Err(too_large());
    }
    Ok(rounded)
}

/// Refuses a null address that a vendor call returned with success for `len` bytes.
pub fn check_non_null(backend: &str, call: &str, ptr: u64, len: usize) -> Result<()> {
    if ptr == 0 {
        return Err(Error::backend(
            backend,
            call,
            None,
            format!("returned success but a null address for {len} bytes"),
        ));
    }
    Ok(())
}

/// Checks what a vendor allocator (or an IPC open) returned before a buffer claims it: the address is not null,
/// and `[ptr, ptr + len)` lies inside the allocation the runtime reports for `ptr` (`range`: its base and size, from
/// `cuMemGetAddressRange` / `hipMemGetAddressRange`). `call` names the vendor call that produced `ptr`.
pub fn check_allocation(backend: &str, call: &str, ptr: u64, len: usize, range: (u64, usize)) -> Result<()> {
    check_non_null(backend, call, ptr, len)?;
    let fail = |message: String| Error::backend(backend, call, None, message);
    let (base, size) = range;
    let end = ptr.checked_add(len as u64);
    let alloc_end = base.checked_add(size as u64);
    match (end, alloc_end) {
        (Some(end), Some(alloc_end)) if base <= ptr && end <= alloc_end => Ok(()),
        _ => Err(fail(format!(
            "returned {ptr:#x} for {len} bytes, but the runtime reports the allocation there as {size} bytes at \
             {base:#x}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_never_wraps() {
        assert_eq!(round_allocation("x", 0, 4096), Ok(4096));
        assert_eq!(round_allocation("x", 4097, 4096), Ok(8192));
        assert_eq!(round_allocation("x", 5, 0), Ok(5));
        for bytes in [usize::MAX, usize::MAX - 4095, MAX_ALLOCATION + 1, MAX_ALLOCATION - 1] {
            let err = round_allocation("symmetric buffer", bytes, 4096).expect_err("too large");
            assert!(
                matches!(err, Error::InvalidArgument(InvalidArgument::SizeTooLarge { requested, .. }) if requested == bytes as u64),
                "{err:?}"
            );
        }
    }

    #[test]
    fn view_ranges_stay_inside_the_buffer() {
        assert_eq!(view_range(100, ..), Ok((0, 100)));
        assert_eq!(view_range(100, 10..20), Ok((10, 10)));
        assert_eq!(view_range(100, 10..=19), Ok((10, 10)));
        assert_eq!(view_range(100, 90..), Ok((90, 10)));
        assert_eq!(view_range(100, ..100), Ok((0, 100)));
        assert_eq!(view_range(100, 100..100), Ok((100, 0)), "an empty view at the end");
        assert_eq!(view_range(0, ..), Ok((0, 0)));
        let refused = |len: usize, r: (Bound<usize>, Bound<usize>), start: usize, end: usize| {
            let err = view_range(len, r).expect_err("out of range");
            assert_eq!(err, Error::InvalidArgument(InvalidArgument::RangeOutOfBounds { start, end, len }), "{r:?}");
        };
        refused(100, (Bound::Included(0), Bound::Excluded(101)), 0, 101);
        refused(100, (Bound::Included(101), Bound::Unbounded), 101, 100);
        refused(100, (Bound::Included(20), Bound::Excluded(10)), 20, 10);
        refused(100, (Bound::Included(0), Bound::Included(usize::MAX)), 0, usize::MAX);
        refused(100, (Bound::Excluded(usize::MAX), Bound::Unbounded), usize::MAX, 100);
        let msg = view_range(16, 8..32).expect_err("past the end").to_string();
        assert!(msg.contains("8..32") && msg.contains("16-byte"), "{msg}");
    }

    #[test]
    fn allocations_must_exist_and_span_the_size() {
        assert!(check_allocation("cuda", "ncclMemAlloc", 0x1000, 4096, (0x1000, 4096)).is_ok());
        assert!(check_allocation("cuda", "ncclMemAlloc", 0x2000, 4096, (0x1000, 8192)).is_ok());
        let null = check_allocation("cuda", "ncclMemAlloc", 0, 4096, (0, 0)).expect_err("null");
        assert!(null.to_string().contains("null address"), "{null}");
        let short = check_allocation("cuda", "ncclMemAlloc", 0x1000, 8192, (0x1000, 4096)).expect_err("short");
        assert!(short.to_string().contains("4096 bytes at 0x1000"), "{short}");
        assert!(check_allocation("cuda", "x", 0x1000, 16, (0x2000, 4096)).is_err(), "below the base");
        assert!(check_allocation("cuda", "x", u64::MAX - 8, 16, (u64::MAX - 8, 4096)).is_err(), "wraps");
    }
}
