//! Device memory as the GPU backends hand it out, written once: a buffer that owns its allocation (shared with
//! the views made of it) or views memory owned elsewhere, and the borrow-checked views of a byte range of it. A
//! backend supplies only the allocation ([`GpuAllocation`]): how memory is allocated, and freed when the last
//! buffer or view holding it drops.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, RangeBounds};
use std::sync::Arc;

use anyccl_ccl::{CclComm, CclStream, DeviceAddress, SymmetricBuffer};
use anyccl_core::runtime::{view_range, BufferLike};
use anyccl_core::{BufferDesc, CapabilityReport, Location, MemoryRuntime, Result};

/// What the capture rules ([`anyccl_core::capture`]) ask of one vendor's runtime: the streams it knows, a capture
/// query that is legal during capture, and its thread capture-mode exchange. The rules built on them
/// ([`Self::capture_blocks_this_thread`], [`Self::refuse_unsafe_call`], [`Self::relaxed`]) are written once here.
pub trait CaptureQueries {
    /// The runtime's capture interaction mode (`CUstreamCaptureMode`, `hipStreamCaptureMode`).
    type Mode: Copy;
    /// Its relaxed mode.
    const RELAXED: Self::Mode;

    /// The streams anyccl made or wraps on this runtime.
    fn known_streams(&self) -> &anyccl_core::capture::KnownStreams;
    /// Whether the raw stream `handle` is being captured (`cuStreamIsCapturing`, `hipStreamGetCaptureInfo`).
    fn stream_is_capturing(&self, handle: usize) -> Result<bool>;
    /// Whether a capture that no known stream shows would still break a potentially unsafe call from this
    /// thread (CUDA: one on a blocking stream of the device, which the legacy stream reveals). None by default.
    fn implicit_capture(&self) -> Result<bool> {
        Ok(false)
    }
    /// Swaps this thread's capture interaction mode with `mode`; `false` where the runtime cannot (nothing was
    /// swapped).
    fn exchange_capture_mode(&self, mode: &mut Self::Mode) -> bool;

    /// Whether a capture that a potentially unsafe call (allocation, free, synchronous copy) made on this thread
    /// would break is running: on a known stream ([`anyccl_core::capture::KnownStreams`]), or one
    /// [`Self::implicit_capture`] sees.
    fn capture_blocks_this_thread(&self) -> Result<bool> {
        if self.known_streams().capture_blocks_this_thread(&mut |h| self.stream_is_capturing(h))? {
            return Ok(true);
        }
        self.implicit_capture()
    }

    /// Refuses `what` ([`anyccl_core::capture::refuse`]) while [`Self::capture_blocks_this_thread`].
    fn refuse_unsafe_call(&self, what: &'static str) -> Result<()> {
        anyccl_core::capture::refuse_if(what, self.capture_blocks_this_thread()?)
    }

    /// Runs `f` with this thread's capture interaction mode relaxed, then restores the previous mode: a
    /// potentially unsafe call made by `f` neither fails nor invalidates a capture that anyccl could not see (as
    /// PyTorch's caching allocator allocates during capture). Where the runtime cannot exchange the mode, `f` just
    /// runs.
    fn relaxed<T>(&self, f: impl FnOnce() -> T) -> T
    where
        Self: Sized,
    {
        let mut mode = Self::RELAXED;
        let swapped = self.exchange_capture_mode(&mut mode);
        let out = f();
        if swapped {
            self.exchange_capture_mode(&mut mode);
        }
        out
    }
}

/// One allocation of a GPU backend (`cuMemAlloc`, `hipMalloc`), freed when the last [`GpuBuffer`] or view holding
/// it drops (its own `Drop`).
pub trait GpuAllocation: Sized + Send + Sync {
    /// What memory is allocated on (a CUDA context, a HIP device).
    type Device;

    /// Allocates `len` bytes on `device` ([`GpuBuffer::alloc`]), with the backend's rules (refused during a
    /// capture it would break, among others).
    fn alloc(device: &Arc<Self::Device>, len: usize) -> Result<GpuBuffer<Self>>;
}

/// A GPU backend's memory runtime of one device, as the shared layers use it: its buffers are [`GpuBuffer`]s.
/// Cloning it is cheap (it holds the device by reference count).
pub trait GpuRuntime:
    MemoryRuntime<Buffer = GpuBuffer<Self::Allocation>, OwnedBuffer = GpuBuffer<Self::Allocation>, Stream: CclStream>
    + Clone
    + Send
    + 'static
{
    /// The backend's allocation.
    type Allocation: GpuAllocation;

    /// Makes this runtime's device current on the calling thread.
    fn bind(&self) -> Result<()>;

    /// The allocation that contains device address `ptr`: its base and size, as the runtime knows it.
    fn address_range(&self, ptr: u64) -> Result<(u64, usize)>;

    /// The device's ordinal.
    fn ordinal(&self) -> u32;
}

/// Device memory: allocated by a backend (freed when it and every view of it have dropped), a view of memory owned
/// elsewhere ([`GpuBuffer::from_raw`]: an engine's tensor or pool), or a range of another buffer
/// ([`GpuBuffer::view`], [`GpuBuffer::view_mut`]). `A` is the backend's allocation.
#[derive(Debug)]
pub struct GpuBuffer<A> {
    ptr: u64,
    len: usize,
    ordinal: u32,
    /// The allocation when the backend made it; views share it, so the memory stays allocated while any of them
    /// exists, even one moved out of its [`GpuViewMut`] with `std::mem::swap`.
    owner: Option<Arc<A>>,
}

impl<A: GpuAllocation> GpuBuffer<A> {
    /// Allocates `len` bytes on `device` (at least one byte, so every buffer has a distinct address), by the
    /// backend's rules ([`GpuAllocation::alloc`]).
    pub fn alloc(device: &Arc<A::Device>, len: usize) -> Result<Self> {
        A::alloc(device, len)
    }
}

impl<A> GpuBuffer<A> {
    /// A buffer of the first `len` bytes at `ptr` of device `ordinal`, owning `owner` (the allocation they lie in).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is device memory of device `ordinal` inside `owner`'s allocation.
    pub unsafe fn owning(ptr: u64, len: usize, ordinal: u32, owner: Arc<A>) -> Self {
        GpuBuffer { ptr, len, ordinal, owner: Some(owner) }
    }

    /// A view of `len` bytes at device address `ptr` on device `ordinal`, owned by someone else (a PyTorch
    /// tensor, an engine's pool). Nothing is freed on drop.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is device memory of device `ordinal` that stays allocated while the view (and every
    /// view made of it) is used.
    pub unsafe fn from_raw(ptr: u64, len: usize, ordinal: u32) -> Self {
        GpuBuffer { ptr, len, ordinal, owner: None }
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// A non-owning buffer of `range` (in bytes) of this one, sharing its allocation.
    fn sub(&self, range: impl RangeBounds<usize>) -> Result<Self> {
        let (offset, len) = view_range(self.len, range)?;
        // `offset <= self.len` and `[self.ptr, +self.len)` is device memory (allocated by the backend, or promised
        // by `from_raw`'s contract), so the sum does not wrap.
        let ptr = self.ptr.wrapping_add(offset as u64);
        Ok(GpuBuffer { ptr, len, ordinal: self.ordinal, owner: self.owner.clone() })
    }

    /// A read-only view of the bytes `range` of this buffer (for example `1024..2048`), to pass as the input of a
    /// collective without `unsafe`. A range past the end (or ending before it starts) is
    /// [`anyccl_core::InvalidArgument::RangeOutOfBounds`]. The view borrows the buffer, so it cannot outlive it.
    pub fn view(&self, range: impl RangeBounds<usize>) -> Result<GpuView<'_, A>> {
        Ok(GpuView { buf: self.sub(range)?, _parent: PhantomData })
    }

    /// A writable view of the bytes `range` of this buffer, to all-reduce (or receive into) part of it without
    /// `unsafe`; the bytes outside the range are not touched. A range past the end is
    /// [`anyccl_core::InvalidArgument::RangeOutOfBounds`]. The view borrows the buffer exclusively, so it cannot outlive
    /// it and nothing else uses the buffer meanwhile. A view of a buffer made by [`GpuBuffer::from_raw`] is bound
    /// by that call's contract.
    pub fn view_mut(&mut self, range: impl RangeBounds<usize>) -> Result<GpuViewMut<'_, A>> {
        Ok(GpuViewMut { buf: self.sub(range)?, _parent: PhantomData })
    }
}

impl<A> BufferLike for GpuBuffer<A> {
    fn desc(&self) -> BufferDesc {
        BufferDesc { addr: self.ptr as usize, len: self.len, location: Location::Device { ordinal: self.ordinal } }
    }
}

// SAFETY: `ptr` is the start of `len` bytes of device memory, allocated by the backend or promised by `from_raw`'s
// contract, for as long as the value lives.
unsafe impl<A> DeviceAddress for GpuBuffer<A> {
    fn device_addr(&self) -> u64 {
        self.ptr
    }
}

/// A read-only view of a byte range of a [`GpuBuffer`] ([`GpuBuffer::view`]); it dereferences to a [`GpuBuffer`],
/// so every collective takes it as an input, and it cannot outlive the buffer it borrows.
#[derive(Debug)]
pub struct GpuView<'a, A> {
    buf: GpuBuffer<A>,
    _parent: PhantomData<&'a GpuBuffer<A>>,
}

impl<A> Deref for GpuView<'_, A> {
    type Target = GpuBuffer<A>;
    fn deref(&self) -> &GpuBuffer<A> {
        &self.buf
    }
}

/// A writable view of a byte range of a [`GpuBuffer`] ([`GpuBuffer::view_mut`]); it dereferences mutably to a
/// [`GpuBuffer`], so every collective takes it as an output or in place, and it borrows its buffer exclusively for
/// its lifetime.
#[derive(Debug)]
pub struct GpuViewMut<'a, A> {
    buf: GpuBuffer<A>,
    _parent: PhantomData<&'a mut GpuBuffer<A>>,
}

impl<A> Deref for GpuViewMut<'_, A> {
    type Target = GpuBuffer<A>;
    fn deref(&self) -> &GpuBuffer<A> {
        &self.buf
    }
}

impl<A> DerefMut for GpuViewMut<'_, A> {
    fn deref_mut(&mut self) -> &mut GpuBuffer<A> {
        &mut self.buf
    }
}

/// A symmetric buffer of `bytes` on `runtime`'s device, as the backend's buffer ([`CclComm::symmetric_memory`],
/// the device bound through the runtime). Collective: every rank calls it with the same size. Refused while a
/// capture that allocation would break runs ([`MemoryRuntime::refuse_during_capture`]) or `stream` captures,
/// and where `caps` has the windows off (the error carries the reason). `backend` names it in errors.
pub fn symmetric_buffer<R>(
    comm: &CclComm,
    backend: &str,
    caps: &CapabilityReport,
    runtime: &R,
    bytes: usize,
    stream: &R::Stream,
) -> Result<SymmetricBuffer<R::Buffer>>
where
    R: GpuRuntime,
    R::Stream: CclStream,
{
    runtime.refuse_during_capture("symmetric_buffer (ncclMemAlloc)")?;
    let bind = {
        let runtime = runtime.clone();
        Box::new(move || runtime.bind())
    };
    let range = |ptr| runtime.address_range(ptr);
    let mem = comm.symmetric_memory(backend, caps, bytes, stream.is_capturing()?, bind, &range)?;
    // SAFETY: `mem` holds `bytes` (rounded up) of this device's memory; the view owns nothing and drops first.
    let view = unsafe { GpuBuffer::from_raw(mem.ptr() as u64, bytes, runtime.ordinal()) };
    Ok(SymmetricBuffer::new(view, mem))
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyccl_core::{Error, InvalidArgument};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its frees, so the tests see when the memory would be released.
    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl GpuAllocation for Counted {
        type Device = Arc<AtomicUsize>;
        fn alloc(device: &Arc<Arc<AtomicUsize>>, len: usize) -> Result<GpuBuffer<Self>> {
            // SAFETY: never dereferenced: only addresses and lengths are computed.
            Ok(unsafe { GpuBuffer::owning(0x20_0000, len, 1, Arc::new(Counted((**device).clone()))) })
        }
    }

    #[test]
    fn views_keep_the_allocation_until_the_last_of_them_drops() {
        let freed = Arc::new(Arc::new(AtomicUsize::new(0)));
        let mut buf = GpuBuffer::<Counted>::alloc(&freed, 4096).expect("alloc");
        let mut m = buf.view_mut(1024..).expect("view");
        // SAFETY: never dereferenced.
        let mut moved = unsafe { GpuBuffer::<Counted>::from_raw(0, 0, 0) };
        std::mem::swap(&mut *m, &mut moved);
        drop(m);
        drop(buf);
        assert_eq!(freed.load(Ordering::SeqCst), 0, "the swapped-out view still holds the allocation");
        assert_eq!((moved.device_ptr(), moved.len(), moved.ordinal()), (0x20_0400, 3072, 1));
        drop(moved);
        assert_eq!(freed.load(Ordering::SeqCst), 1, "freed once, with the last holder");
    }

    #[test]
    fn views_cover_exactly_their_range_and_refuse_the_rest() {
        // SAFETY: never dereferenced.
        let buf = unsafe { GpuBuffer::<Counted>::from_raw(0x10_0000, 4096, 3) };
        let v = buf.view(1024..2048).expect("inside");
        assert_eq!(v.desc(), BufferDesc { addr: 0x10_0400, len: 1024, location: Location::Device { ordinal: 3 } });
        assert!(matches!(
            v.view(..1025).err(),
            Some(Error::InvalidArgument(InvalidArgument::RangeOutOfBounds { start: 0, end: 1025, len: 1024 }))
        ));
    }
}
