//! Device memory shared between processes, for the custom kernels: legacy IPC handles for `cuMemAlloc` memory,
//! and cuMem (VMM) allocations exported as POSIX file descriptors, passed over a private Unix socket.
//!
//! Peers' buffers are opened once and closed on drop. Opening is not allowed during graph capture; callers open
//! before capture (the communicator checks).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use anyccl_core::{Error, Result};
use cudarc::driver::sys;

use crate::driver::{cu_err, device_location};
use crate::runtime::{DeviceBuffer, DeviceContext};

/// Bytes of a legacy IPC handle (`CUipcMemHandle`).
pub use anyccl_gpu::LEGACY_HANDLE_BYTES;

/// A legacy IPC handle of `cuMemAlloc` memory, as bytes for the rendezvous.
pub fn export_legacy(ctx: &Arc<DeviceContext>, buf: &DeviceBuffer) -> Result<[u8; LEGACY_HANDLE_BYTES]> {
    export_legacy_ptr(ctx, buf.device_ptr())
}

/// A legacy IPC handle of the `cuMemAlloc` allocation at `ptr` (its start, or an address inside it), as bytes.
pub fn export_legacy_ptr(ctx: &Arc<DeviceContext>, ptr: u64) -> Result<[u8; LEGACY_HANDLE_BYTES]> {
    ctx.bind()?;
    let mut h = sys::CUipcMemHandle { reserved: [0; LEGACY_HANDLE_BYTES] };
    // SAFETY: the driver checks that `ptr` is device memory of this context and fills the handle.
    unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }.result().map_err(|e| cu_err("cuIpcGetMemHandle", e))?;
    Ok(h.reserved.map(|c| c as u8))
}

/// A peer's legacy-IPC buffer mapped into this process; closed on drop.
pub struct LegacyMapping {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<DeviceContext>,
}

// SAFETY: a mapped device address may be used from any thread.
unsafe impl Send for LegacyMapping {}
// SAFETY: as above; nothing in it changes after `open`.
unsafe impl Sync for LegacyMapping {}

impl LegacyMapping {
    /// Opens a peer's handle (`cuIpcOpenMemHandle`) for `len` bytes.
    pub fn open(ctx: &Arc<DeviceContext>, handle: &[u8], len: usize) -> Result<Self> {
        let bytes: [u8; LEGACY_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            Error::backend(
                "cuda",
                "cuIpcOpenMemHandle",
                None,
                format!("an IPC handle has {LEGACY_HANDLE_BYTES} bytes, got {}", handle.len()),
            )
        })?;
        ctx.bind()?;
        let h = sys::CUipcMemHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the driver validates the handle and writes the mapped address.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        }
        .result()
        .map_err(|e| cu_err("cuIpcOpenMemHandle", e))?;
        // Owns the mapping from here: a failed check below closes it on drop. `len` comes from the peer, so the
        // view claims it only if the driver's mapping really spans it.
        let mapping = LegacyMapping { ptr, len, ctx: ctx.clone() };
        let range = ctx.address_range(ptr)?;
        anyccl_core::check_allocation("cuda", "cuIpcOpenMemHandle", ptr, len, range)?;
        Ok(mapping)
    }

    /// The mapped device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A view of the mapped memory.
    pub fn view(&self) -> DeviceBuffer {
        // SAFETY: mapped for `len` bytes until this value drops; the view is used while it lives.
        unsafe { DeviceBuffer::from_raw(self.ptr, self.len, self.ctx.ordinal().unsigned_abs()) }
    }
}

impl Drop for LegacyMapping {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: opened in `open`, closed once.
        if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result() {
            tracing::warn!(error = %cu_err("cuIpcCloseMemHandle", e), "closing a peer's IPC buffer failed");
        }
    }
}

fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is valid (null metadata, zero flags); the fields that matter are
    // set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location = device_location(ordinal);
    p
}

/// A cuMem (VMM) allocation mapped into this process: made here (exportable as a file descriptor) or imported
/// from a peer's descriptor. Unmapped and released on drop, in reverse order of acquisition.
pub struct VmmBuffer {
    ptr: sys::CUdeviceptr,
    size: usize,
    len: usize,
    handle: sys::CUmemGenericAllocationHandle,
    mapped: bool,
    ctx: Arc<DeviceContext>,
}

// SAFETY: device addresses and allocation handles may be used from any thread.
unsafe impl Send for VmmBuffer {}

impl VmmBuffer {
    /// The allocation granularity for `len` bytes on this device, rounded up.
    fn rounded(ctx: &Arc<DeviceContext>, len: usize) -> Result<usize> {
        let p = prop(ctx.ordinal());
        let mut g = 0usize;
        // SAFETY: valid property struct; writes one size.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(|e| cu_err("cuMemGetAllocationGranularity", e))?;
        anyccl_core::round_allocation("a VMM buffer", len, g)
    }

    /// Allocates `len` bytes (rounded up to the granularity) exportable as a POSIX file descriptor.
    pub fn alloc(ctx: &Arc<DeviceContext>, len: usize) -> Result<Self> {
        ctx.bind()?;
        let size = Self::rounded(ctx, len)?;
        let p = prop(ctx.ordinal());
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid property struct; writes one handle.
        unsafe { sys::cuMemCreate(&mut handle, size, &p, 0) }.result().map_err(|e| cu_err("cuMemCreate", e))?;
        Self::map(ctx, handle, size, len)
    }

    /// Imports a peer's allocation from its file descriptor (consumed) and maps it.
    pub fn import(ctx: &Arc<DeviceContext>, fd: OwnedFd, len: usize) -> Result<Self> {
        ctx.bind()?;
        let size = Self::rounded(ctx, len)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX descriptors the driver takes the fd value itself as the "pointer" argument; it reads
        // the descriptor and does not take ownership (we close ours when `fd` drops).
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(|e| cu_err("cuMemImportFromShareableHandle", e))?;
        drop(fd);
        Self::map(ctx, handle, size, len)
    }

    fn map(
        ctx: &Arc<DeviceContext>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        len: usize,
    ) -> Result<Self> {
        // Owns `handle` from here: a failure below unwinds through Drop.
        let mut b = VmmBuffer { ptr: 0, size, len, handle, mapped: false, ctx: ctx.clone() };
        // SAFETY: reserves `size` bytes of VA; writes the base.
        unsafe { sys::cuMemAddressReserve(&mut b.ptr, size, 0, 0, 0) }
            .result()
            .map_err(|e| cu_err("cuMemAddressReserve", e))?;
        // SAFETY: maps the whole allocation at offset 0 over the reserved range.
        unsafe { sys::cuMemMap(b.ptr, size, 0, handle, 0) }.result().map_err(|e| cu_err("cuMemMap", e))?;
        b.mapped = true;
        let access = sys::CUmemAccessDesc {
            location: device_location(ctx.ordinal()),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one access descriptor.
        unsafe { sys::cuMemSetAccess(b.ptr, size, &access, 1) }.result().map_err(|e| cu_err("cuMemSetAccess", e))?;
        Ok(b)
    }

    /// Exports the allocation as a POSIX file descriptor to send to a peer.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.ctx.bind()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: writes one int (the new descriptor), which we then own.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .map_err(|e| cu_err("cuMemExportToShareableHandle", e))?;
        if fd < 0 {
            return Err(cu_err(
                "cuMemExportToShareableHandle",
                cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
            ));
        }
        // SAFETY: the driver created this descriptor for us; nobody else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The allocation handle (`CUmemGenericAllocationHandle`), to bind to a multicast object.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// The mapped device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The bytes allocated and mapped (the requested length rounded up to the granularity).
    pub fn size(&self) -> usize {
        self.size
    }

    /// A view of the first `len` bytes.
    pub fn view(&self) -> DeviceBuffer {
        // SAFETY: mapped for `size >= len` bytes until this value drops.
        unsafe { DeviceBuffer::from_raw(self.ptr, self.len, self.ctx.ordinal().unsigned_abs()) }
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: each step undoes one made in `alloc`/`import`/`map`, in reverse order, once.
        unsafe {
            if self.mapped {
                if let Err(e) = sys::cuMemUnmap(self.ptr, self.size).result() {
                    tracing::warn!(error = %cu_err("cuMemUnmap", e), "unmapping a VMM buffer failed");
                }
            }
            if self.ptr != 0 {
                if let Err(e) = sys::cuMemAddressFree(self.ptr, self.size).result() {
                    tracing::warn!(error = %cu_err("cuMemAddressFree", e), "freeing VA failed");
                }
            }
            if let Err(e) = sys::cuMemRelease(self.handle).result() {
                tracing::warn!(error = %cu_err("cuMemRelease", e), "releasing a VMM allocation failed");
            }
        }
    }
}
