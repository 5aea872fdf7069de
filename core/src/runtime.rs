//! The memory runtime a backend provides: where buffers live, how they are allocated and copied, and whether a
//! stream is being captured into a graph. CUDA and HIP implement it over their drivers; the host backend over host
//! memory.

use std::borrow::BorrowMut;
use std::fmt;

use serde::Serialize;

use crate::error::Result;

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
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

/// What the validation front-end needs to know of a buffer: where it starts, how long it is, where it lives.
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

    /// Allocates `bytes` bytes, aligned for every [`crate::DataType`]. Not allowed while a stream is capturing.
    fn alloc(&self, bytes: usize) -> Result<Self::OwnedBuffer>;

    /// Copies `src` into the start of `dst`, ordered on `stream`, and waits for it.
    fn upload(&self, dst: &mut Self::Buffer, src: &[u8], stream: &Self::Stream) -> Result<()>;

    /// Copies the start of `src` into `dst`, ordered on `stream`, and waits for it.
    fn download(&self, src: &Self::Buffer, dst: &mut [u8], stream: &Self::Stream) -> Result<()>;

    /// Blocks until all work on `stream` has finished.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;

    /// Whether `stream` is being captured into a graph right now (the path chosen depends on it).
    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool>;
}
