//! A [`Bootstrap`] over a rank's own NCCL/RCCL communicator: what a sub-communicator (or the drop-in library)
//! needs to exchange setup bytes among its ranks (custom-kernel IPC handles, graph-buffer tables) with no port and
//! no rendezvous of its own.
//!
//! An all-gather of byte strings runs as two `ncclAllGather`s on device buffers: the lengths (8 bytes per rank),
//! then every payload padded to the longest ([`anyccl_core::bootstrap::all_gather_padded`]); the result is
//! downloaded to the host. A payload longer than the limit ([`MAX_PADDED_PAYLOAD`], 1 MiB, unless
//! [`CclBootstrap::with_limit`] says otherwise) is refused on every rank after the lengths round, before anything
//! is allocated from a peer's length, so no rank is left waiting.

use anyccl_core::bootstrap::{all_gather_padded, Bootstrap, MAX_PADDED_PAYLOAD};
use anyccl_core::{DataType, Error, Result};
use std::borrow::{Borrow, BorrowMut};

use crate::device::GpuRuntime;
use anyccl_ccl::{CclComm, CclStream, DeviceAddress};

/// A [`Bootstrap`] whose exchanges are collectives of the communicator `comm`, on `stream` of `runtime`'s
/// device. Every method is collective over that communicator, and blocks until the exchange has finished.
///
/// Allocates device memory for each exchange, so it is refused while `stream` (or a capture `runtime` knows of)
/// is being captured ([`anyccl_core::InvalidArgument::DuringCapture`]), before anything is exchanged: call it
/// before or after a capture, on every rank.
pub struct CclBootstrap<'a, R: GpuRuntime> {
    comm: &'a CclComm,
    runtime: &'a R,
    stream: &'a R::Stream,
    limit: usize,
}

impl<'a, R> CclBootstrap<'a, R>
where
    R: GpuRuntime,
    R::Stream: CclStream,
{
    /// A bootstrap over `comm`, moving its bytes through `runtime`'s device on `stream`.
    pub fn new(comm: &'a CclComm, runtime: &'a R, stream: &'a R::Stream) -> Self {
        CclBootstrap { comm, runtime, stream, limit: MAX_PADDED_PAYLOAD }
    }

    /// The same with another limit on the bytes one rank may contribute (every rank must use the same one).
    pub fn with_limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    /// The limit on one rank's contribution.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// All-gathers `input.len()` bytes per rank into `out` with `ncclAllGather` through device buffers.
    fn gather(&self, input: &[u8], out: &mut [u8]) -> Result<()> {
        let world = self.comm.world();
        if input.len().checked_mul(world) != Some(out.len()) {
            return Err(Error::backend(
                "ccl",
                "CclBootstrap::all_gather",
                None,
                format!("{} output bytes for {} bytes from each of {world} ranks", out.len(), input.len()),
            ));
        }
        let mut send = self.runtime.alloc(input.len())?;
        let mut recv = self.runtime.alloc(out.len())?;
        self.runtime.upload(send.borrow_mut(), input, self.stream)?;
        self.runtime.bind()?;
        let (s, r) = (send.borrow().device_addr(), recv.borrow_mut().device_addr());
        let lib = self.comm.library();
        let u8_code = anyccl_ccl::nccl_dtype(lib, DataType::U8)?;
        // SAFETY: a live communicator of `lib` (borrowed for the call); `send` holds `input.len()` bytes and `recv`
        // `world × input.len()` bytes of this rank's device, both alive until the download below has waited for
        // the stream; the stream is borrowed, so live.
        unsafe {
            anyccl_ccl::result::all_gather(
                lib,
                s as *const _,
                r as *mut _,
                input.len(),
                u8_code,
                self.comm.handle()?,
                self.stream.ccl_handle(),
            )
        }?;
        self.runtime.download(recv.borrow(), out, self.stream)
    }
}

impl<R> Bootstrap for CclBootstrap<'_, R>
where
    R: GpuRuntime,
    R::Stream: CclStream,
{
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        const WHAT: &str = "CclBootstrap::all_gather (device allocation)";
        anyccl_core::capture::refuse_if(WHAT, self.stream.is_capturing()?)?;
        self.runtime.refuse_during_capture(WHAT)?;
        let (rank, world) = (self.comm.rank(), self.comm.world());
        let this = &*self;
        all_gather_padded(rank, world, mine, this.limit, |input, out| this.gather(input, out))
    }
}
