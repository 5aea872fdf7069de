//! The NVLS multicast object manager, written over a driver seam ([`MulticastDriver`]).
//!
//! One [`MulticastGroup`] is one CUDA multicast object. The rank that owns it creates it
//! ([`MulticastGroup::create`]), every other rank imports the shareable handle the owner sends
//! ([`MulticastGroup::import`]); every rank then adds its device, binds its buffers at increasing offsets of the one
//! object ([`MulticastGroup::bind`]) and maps them ([`MulticastGroup::map`]).
//!
//! The sequence follows the CUDA rules in `shared/reference/vendor-facts.md` and avoids the two bugs of the seed
//! document:
//!
//! - the local allocation handle returned by `cuMulticastCreate` is released (`cuMemRelease`) right after it has
//!   been exported as a file descriptor (with a fabric handle, which is plain bytes and holds no reference, right
//!   after the owner has imported its own export); from then on the exported descriptor and the imported handles
//!   keep the object alive, so releasing every imported handle and closing every descriptor frees it;
//! - `cuMemMap` of a multicast handle must use offset 0: a buffer bound at offset `off` is mapped over
//!   `[0, off + size)` and the pointer returned is `base + off` (costs virtual address space only).
//!
//! The object's size comes from the buffers bound to it (each rounded up to the multicast granularity) or from an
//! explicit configured size, never from a fixed constant.
//!
//! Before anything is created or imported, [`multicast_eligibility`] checks the device attribute, the driver version
//! and `NCCL_NVLS_ENABLE`; when it says no, no multicast call is made at all. Every acquired resource is recorded on
//! a stack and released in reverse order, on [`MulticastGroup::close`], on drop, and when a step fails half way.
//!
//! This module holds no unsafe code and no CUDA bindings: the CUDA driver implementation of [`MulticastDriver`]
//! lives elsewhere; the tests here run against a fake driver that records every call.
#![forbid(unsafe_code)]

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyccl_core::{Error, Reason, Result};

/// The oldest CUDA driver that supports multicast objects (12.1, as `cuDriverGetVersion` reports it).
pub const MIN_DRIVER_VERSION: i32 = 12010;

/// The environment variable that turns NVLS multicast off when set to `0` (as it does for NCCL).
pub const NVLS_ENABLE_VAR: &str = anyccl_core::caps::NVLS_ENABLE_VAR;

/// A `CUmemGenericAllocationHandle` that refers to a multicast object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct McHandle(pub u64);

/// A `CUmemGenericAllocationHandle` of a physical allocation (`cuMemCreate`) to bind to a multicast object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemHandle(pub u64);

/// Which kind of shareable handle a multicast object is created for and exported as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ShareableKind {
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a file descriptor, passed to peers on the same node.
    #[default]
    PosixFd,
    /// `CU_MEM_HANDLE_TYPE_FABRIC`: a 64-byte blob, valid across nodes of one NVLink domain (IMEX).
    Fabric,
}

/// An exported multicast object (`cuMemExportToShareableHandle`), as sent to peers.
///
/// A [`Shareable::PosixFd`] owns its file descriptor: whoever holds it must close it
/// ([`MulticastDriver::close_shareable`]); the open descriptor holds a reference to the multicast object.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shareable {
    /// A POSIX file descriptor.
    PosixFd(i32),
    /// A fabric handle.
    Fabric([u8; 64]),
}

impl Shareable {
    /// The kind of this handle.
    pub fn kind(&self) -> ShareableKind {
        match self {
            Shareable::PosixFd(_) => ShareableKind::PosixFd,
            Shareable::Fabric(_) => ShareableKind::Fabric,
        }
    }
}

/// A failed driver call: the call's name, the driver's status code and its error string.
///
/// Not `#[non_exhaustive]`: every [`MulticastDriver`] implementation, fakes included, builds one with a literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverError {
    /// The driver entry point (`"cuMulticastCreate"`).
    pub call: &'static str,
    /// The `CUresult` value.
    pub code: i32,
    /// The driver's error string (`cuGetErrorString`) or other detail.
    pub message: String,
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed with code {}: {}", self.call, self.code, self.message)
    }
}

impl std::error::Error for DriverError {}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        Error::backend("cuda", e.call, Some(i64::from(e.code)), e.message)
    }
}

/// The CUDA driver calls the multicast manager makes, one method per call, so that the manager can be tested
/// against a fake. Handles are opaque; devices are CUDA device ordinals; sizes and offsets are bytes.
pub trait MulticastDriver {
    /// `cuDriverGetVersion`: the driver's CUDA version (`12080` for 12.8).
    fn driver_version(&self) -> Result<i32, DriverError>;

    /// `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)`: whether `device` supports multicast objects.
    fn multicast_supported(&self, device: i32) -> Result<bool, DriverError>;

    /// `cuMulticastGetGranularity` for an object of `size` bytes over `num_devices` devices:
    /// `CU_MULTICAST_GRANULARITY_RECOMMENDED` when `recommended`, else `CU_MULTICAST_GRANULARITY_MINIMUM`.
    fn multicast_granularity(&self, num_devices: usize, size: usize, recommended: bool) -> Result<usize, DriverError>;

    /// `cuMulticastCreate`: a multicast object of `size` bytes (a multiple of the granularity) for `num_devices`
    /// devices, exportable as `kind`. Returns the local allocation handle.
    fn multicast_create(&self, num_devices: usize, size: usize, kind: ShareableKind) -> Result<McHandle, DriverError>;

    /// `cuMemExportToShareableHandle`: exports `handle` as `kind`.
    fn export_shareable(&self, handle: McHandle, kind: ShareableKind) -> Result<Shareable, DriverError>;

    /// `cuMemImportFromShareableHandle`: a new handle to the object `shareable` refers to. The shareable handle
    /// stays open (see [`MulticastDriver::close_shareable`]).
    fn import_shareable(&self, shareable: &Shareable) -> Result<McHandle, DriverError>;

    /// Closes a shareable handle: `close(2)` for a file descriptor; nothing for a fabric handle.
    fn close_shareable(&self, shareable: &Shareable) -> Result<(), DriverError>;

    /// `cuMemRelease`: drops this reference to the object.
    fn release(&self, handle: McHandle) -> Result<(), DriverError>;

    /// `cuMulticastAddDevice`: adds `device` to the object.
    fn multicast_add_device(&self, mc: McHandle, device: i32) -> Result<(), DriverError>;

    /// `cuMulticastBindMem`: binds `size` bytes of the allocation `mem` from `mem_offset` at `mc_offset` of the object.
    fn multicast_bind_mem(
        &self,
        mc: McHandle,
        mc_offset: usize,
        mem: MemHandle,
        mem_offset: usize,
        size: usize,
    ) -> Result<(), DriverError>;

    /// `cuMulticastUnbind`: unbinds `device`'s memory from `[mc_offset, mc_offset + size)` of the object.
    fn multicast_unbind(&self, mc: McHandle, device: i32, mc_offset: usize, size: usize) -> Result<(), DriverError>;

    /// `cuMemAddressReserve`: reserves `size` bytes of virtual address space aligned to `alignment`.
    fn address_reserve(&self, size: usize, alignment: usize) -> Result<u64, DriverError>;

    /// `cuMemMap`: maps `size` bytes of `handle` from `offset` at `va`. For a multicast handle `offset` must be 0.
    fn map(&self, va: u64, size: usize, offset: usize, handle: McHandle) -> Result<(), DriverError>;

    /// `cuMemSetAccess`: read-write access to `[va, va + size)` for `device`.
    fn set_access(&self, va: u64, size: usize, device: i32) -> Result<(), DriverError>;

    /// `cuMemUnmap`.
    fn unmap(&self, va: u64, size: usize) -> Result<(), DriverError>;

    /// `cuMemAddressFree`.
    fn address_free(&self, va: u64, size: usize) -> Result<(), DriverError>;
}

/// A device name as [`Reason`]s spell it.
fn device_name(device: i32) -> String {
    format!("device {device}")
}

/// `12080` → `"12.8"`.
fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Whether multicast may be used on `device`: `Ok`, or the concrete reason it may not.
///
/// Checked in this order, each before any multicast object is created or imported: `NCCL_NVLS_ENABLE=0` in `env`
/// (read first, so that turning multicast off makes no driver call at all), the driver version (CUDA 12.1 or
/// newer), and `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` of `device`. A failed query disables multicast too.
pub fn multicast_eligibility<D: MulticastDriver + ?Sized>(
    driver: &D,
    device: i32,
    env: &dyn Fn(&str) -> Option<String>,
) -> std::result::Result<(), Reason> {
    if let Some(reason) = anyccl_core::caps::nvls_off_by_env(env) {
        return Err(reason);
    }
    let unavailable =
        |e: DriverError| Reason::Unavailable { component: "CUDA driver".to_owned(), detail: e.to_string() };
    let version = driver.driver_version().map_err(unavailable)?;
    if version < MIN_DRIVER_VERSION {
        return Err(Reason::VersionTooOld {
            component: "CUDA driver".to_owned(),
            found: version_string(version),
            required: version_string(MIN_DRIVER_VERSION),
        });
    }
    if !driver.multicast_supported(device).map_err(unavailable)? {
        return Err(Reason::DeviceAttribute {
            device: device_name(device),
            attribute: "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0".to_owned(),
        });
    }
    Ok(())
}

/// How large the multicast object is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum McSize {
    /// Large enough for these buffers bound one after another, each rounded up to the granularity.
    Buffers(Vec<usize>),
    /// This many bytes, rounded up to the granularity.
    Explicit(usize),
}

impl McSize {
    /// The bytes asked for before rounding (what the granularity query is given).
    fn requested(&self) -> Result<usize> {
        match self {
            McSize::Buffers(sizes) => sizes
                .iter()
                .try_fold(0usize, |acc, &s| acc.checked_add(s))
                .ok_or_else(|| size_error(format!("the buffer sizes {sizes:?} overflow"))),
            McSize::Explicit(size) => Ok(*size),
        }
    }
}

/// The multicast object's shape; every rank of the group passes the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MulticastConfig {
    /// How many devices (ranks) join the object.
    pub num_devices: usize,
    /// The object's size.
    pub size: McSize,
    /// The shareable handle kind the owner exports.
    pub kind: ShareableKind,
    /// Round to the recommended granularity (`true`) or to the minimum one (`false`, the default).
    pub recommended_granularity: bool,
}

impl MulticastConfig {
    /// An object sized for `buffer_sizes` across `num_devices` devices, exported as a file descriptor.
    pub fn for_buffers(num_devices: usize, buffer_sizes: &[usize]) -> Self {
        MulticastConfig {
            num_devices,
            size: McSize::Buffers(buffer_sizes.to_vec()),
            kind: ShareableKind::default(),
            recommended_granularity: false,
        }
    }

    /// An object of an explicit `size` across `num_devices` devices, exported as a file descriptor.
    pub fn explicit(num_devices: usize, size: usize) -> Self {
        MulticastConfig {
            num_devices,
            size: McSize::Explicit(size),
            kind: ShareableKind::default(),
            recommended_granularity: false,
        }
    }
}

fn size_error(message: String) -> Error {
    Error::Config { source_name: "multicast object size".to_owned(), line: None, message }
}

fn usage_error(call: &str, message: String) -> Error {
    Error::backend("cuda", call, None, message)
}

fn round_up(x: usize, granularity: usize) -> Option<usize> {
    x.div_ceil(granularity).checked_mul(granularity)
}

/// The size of the multicast object for `size` at `granularity`: the sum of the buffer sizes each rounded up to
/// the granularity, or the explicit size rounded up. Zero sizes and overflow are errors.
pub fn multicast_size(size: &McSize, granularity: usize) -> Result<usize> {
    if granularity == 0 {
        return Err(size_error("the driver reported a multicast granularity of 0".to_owned()));
    }
    let total = match size {
        McSize::Buffers(sizes) => {
            if sizes.is_empty() || sizes.contains(&0) {
                return Err(size_error(format!("buffer sizes {sizes:?}: need at least one, none of size 0")));
            }
            sizes.iter().try_fold(0usize, |acc, &s| round_up(s, granularity).and_then(|r| acc.checked_add(r)))
        }
        McSize::Explicit(0) => return Err(size_error("an explicit size of 0 bytes".to_owned())),
        McSize::Explicit(s) => round_up(*s, granularity),
    };
    total.ok_or_else(|| size_error(format!("{size:?} rounded to {granularity} bytes overflows")))
}

/// One resource held by a group, in the order acquired.
#[derive(Debug)]
enum Resource {
    /// A shareable handle this rank must close (the owner's export, or a peer's received one until imported).
    Shareable(Shareable),
    /// A handle to release (the creator's local handle until exported, then the imported one).
    Handle(McHandle),
    /// A binding of this rank's memory.
    Binding { mc: McHandle, offset: usize, size: usize },
    /// A virtual address reservation.
    Reservation { va: u64, size: usize },
    /// A mapping of the multicast handle.
    Mapping { va: u64, size: usize },
}

/// The stack of acquired resources; dropping it releases them in reverse order.
struct Resources<D: MulticastDriver + ?Sized> {
    driver: Arc<D>,
    device: i32,
    stack: Vec<Resource>,
}

impl<D: MulticastDriver + ?Sized> Resources<D> {
    fn release_one(&self, r: &Resource) -> Result<(), DriverError> {
        let d = &self.driver;
        match *r {
            Resource::Shareable(ref s) => d.close_shareable(s),
            Resource::Handle(h) => d.release(h),
            Resource::Binding { mc, offset, size } => d.multicast_unbind(mc, self.device, offset, size),
            Resource::Reservation { va, size } => d.address_free(va, size),
            Resource::Mapping { va, size } => d.unmap(va, size),
        }
    }

    /// Releases the resource at `index` now, out of stack order; on failure it stays on the stack.
    fn release_at(&mut self, index: usize) -> Result<(), DriverError> {
        let Some(r) = self.stack.get(index) else { return Ok(()) };
        self.release_one(r)?;
        self.stack.remove(index);
        Ok(())
    }

    /// Releases everything above `mark`, newest first, trying every one; returns the first error.
    fn unwind_to(&mut self, mark: usize) -> Result<(), DriverError> {
        let mut first = Ok(());
        while self.stack.len() > mark {
            let Some(r) = self.stack.pop() else { break };
            if let Err(e) = self.release_one(&r) {
                tracing::warn!(device = self.device, "multicast cleanup: {e}");
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

impl<D: MulticastDriver + ?Sized> Drop for Resources<D> {
    fn drop(&mut self) {
        // Errors are logged by `unwind_to`; a drop never fails or panics.
        let _ = self.unwind_to(0);
    }
}

/// A buffer bound to a [`MulticastGroup`]: where it sits in the multicast object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    group: u64,
    index: usize,
    offset: usize,
    size: usize,
    bound: usize,
}

impl Binding {
    /// The byte offset in the multicast object (a multiple of the granularity).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The buffer size asked for.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The bytes bound: [`Binding::size`] rounded up to the granularity.
    pub fn bound_size(&self) -> usize {
        self.bound
    }
}

/// Bookkeeping for one binding of a group.
#[derive(Debug)]
struct BindingState {
    offset: usize,
    mapped: Option<u64>,
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// One multicast object, as seen by one rank: its imported handle, this rank's device added to it, the buffers
/// bound to it and their mappings. Dropping it (or [`MulticastGroup::close`]) releases everything in reverse
/// order of acquisition.
pub struct MulticastGroup<D: MulticastDriver + ?Sized> {
    id: u64,
    res: Resources<D>,
    handle: McHandle,
    size: usize,
    granularity: usize,
    next_offset: usize,
    bindings: Vec<BindingState>,
}

impl<D: MulticastDriver + ?Sized> fmt::Debug for MulticastGroup<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MulticastGroup")
            .field("device", &self.res.device)
            .field("handle", &self.handle)
            .field("size", &self.size)
            .field("granularity", &self.granularity)
            .field("bindings", &self.bindings)
            .finish_non_exhaustive()
    }
}

impl<D: MulticastDriver + ?Sized> MulticastGroup<D> {
    /// The gate, then the granularity and the size; no resource acquired yet.
    fn prepare(
        driver: &D,
        device: i32,
        config: &MulticastConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(usize, usize)> {
        multicast_eligibility(driver, device, env)
            .map_err(|reason| Error::Unsupported { capability: "multicast".to_owned(), reason })?;
        if config.num_devices == 0 {
            return Err(size_error("a multicast object needs at least one device".to_owned()));
        }
        let requested = config.size.requested()?;
        let granularity =
            driver.multicast_granularity(config.num_devices, requested, config.recommended_granularity)?;
        let size = multicast_size(&config.size, granularity)?;
        Ok((granularity, size))
    }

    /// The owning rank: checks [`multicast_eligibility`] (and creates nothing when it fails), creates the object,
    /// exports it as `config.kind`, releases the local allocation handle right after the export (for a fabric handle,
    /// which holds no reference to the object, right after importing its own export instead), imports its own
    /// export and adds `device`. Send [`MulticastGroup::shareable`] to the peers. On failure everything acquired is
    /// released.
    pub fn create(
        driver: Arc<D>,
        device: i32,
        config: &MulticastConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let (granularity, size) = Self::prepare(&driver, device, config, env)?;
        let mut res = Resources { driver: Arc::clone(&driver), device, stack: Vec::new() };
        let local = driver.multicast_create(config.num_devices, size, config.kind)?;
        res.stack.push(Resource::Handle(local));
        let shareable = driver.export_shareable(local, config.kind)?;
        let kind = shareable.kind();
        res.stack.push(Resource::Shareable(shareable));
        // An exported file descriptor holds a reference to the object, so the local handle is released right away
        // (keeping it would leak the object). A fabric handle is plain bytes and holds none: the owner's own import
        // must take over the reference before the local handle goes.
        if kind == ShareableKind::PosixFd {
            res.release_at(0)?;
        }
        let handle = match res.stack.last() {
            Some(Resource::Shareable(s)) => driver.import_shareable(s)?,
            _ => return Err(usage_error("MulticastGroup::create", "the exported handle went missing".to_owned())),
        };
        res.stack.push(Resource::Handle(handle));
        if kind == ShareableKind::Fabric {
            res.release_at(0)?;
        }
        driver.multicast_add_device(handle, device)?;
        tracing::debug!(device, size, granularity, devices = config.num_devices, "created multicast object");
        Ok(MulticastGroup {
            id: NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed),
            res,
            handle,
            size,
            granularity,
            next_offset: 0,
            bindings: Vec::new(),
        })
    }

    /// A peer rank: checks [`multicast_eligibility`] (and imports nothing when it fails), imports the owner's
    /// `shareable` (this call owns it and closes it once imported, or on failure), and adds `device`. `config` must
    /// be the owner's. On failure everything acquired is released.
    pub fn import(
        driver: Arc<D>,
        device: i32,
        config: &MulticastConfig,
        shareable: Shareable,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let mut res = Resources { driver: Arc::clone(&driver), device, stack: vec![Resource::Shareable(shareable)] };
        let (granularity, size) = Self::prepare(&driver, device, config, env)?;
        let handle = match res.stack.last() {
            Some(Resource::Shareable(s)) => driver.import_shareable(s)?,
            _ => return Err(usage_error("MulticastGroup::import", "the received handle went missing".to_owned())),
        };
        res.stack.push(Resource::Handle(handle));
        res.release_at(0)?;
        driver.multicast_add_device(handle, device)?;
        tracing::debug!(device, size, granularity, "imported multicast object");
        Ok(MulticastGroup {
            id: NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed),
            res,
            handle,
            size,
            granularity,
            next_offset: 0,
            bindings: Vec::new(),
        })
    }

    /// The owner's exported handle, to send to the peers (`None` on a peer, or once closed).
    pub fn shareable(&self) -> Option<&Shareable> {
        self.res.stack.iter().find_map(|r| match r {
            Resource::Shareable(s) => Some(s),
            _ => None,
        })
    }

    /// Closes the owner's exported handle once every peer has imported it (otherwise it is closed last, at
    /// [`MulticastGroup::close`] or drop). Does nothing when there is none.
    pub fn close_shareable(&mut self) -> Result<()> {
        match self.res.stack.iter().position(|r| matches!(r, Resource::Shareable(_))) {
            Some(i) => Ok(self.res.release_at(i)?),
            None => Ok(()),
        }
    }

    /// This rank's handle to the multicast object.
    pub fn handle(&self) -> McHandle {
        self.handle
    }

    /// This rank's device.
    pub fn device(&self) -> i32 {
        self.res.device
    }

    /// The object's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The granularity sizes and offsets are rounded to.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Binds `size` bytes of the allocation `mem` (from its start) at the next free offset of the object, aligned to
    /// the granularity; the bound size is `size` rounded up to the granularity, so the allocation must be at least
    /// that large (allocations from `cuMemCreate` are rounded likewise). Every rank binds its own buffers in the same
    /// order, so the offsets agree.
    pub fn bind(&mut self, mem: MemHandle, size: usize) -> Result<Binding> {
        const CALL: &str = "MulticastGroup::bind";
        if size == 0 {
            return Err(usage_error(CALL, "cannot bind a buffer of 0 bytes".to_owned()));
        }
        let offset = self.next_offset;
        let bound = round_up(size, self.granularity)
            .filter(|b| offset.checked_add(*b).is_some_and(|end| end <= self.size))
            .ok_or_else(|| {
                usage_error(
                    CALL,
                    format!(
                        "a buffer of {size} bytes at offset {offset} does not fit the multicast object of {} bytes \
                         (granularity {})",
                        self.size, self.granularity
                    ),
                )
            })?;
        self.res.driver.multicast_bind_mem(self.handle, offset, mem, 0, bound)?;
        self.res.stack.push(Resource::Binding { mc: self.handle, offset, size: bound });
        self.next_offset = offset + bound;
        self.bindings.push(BindingState { offset, mapped: None });
        Ok(Binding { group: self.id, index: self.bindings.len() - 1, offset, size, bound })
    }

    /// Maps `binding` and returns its device pointer. A multicast handle can only be mapped from offset 0, so this
    /// reserves `offset + bound_size` bytes of address space, maps `[0, offset + bound_size)` of the object there,
    /// gives this device access, and returns `base + offset`. Mapping the same binding again returns the same
    /// pointer. On failure what this call acquired is released.
    pub fn map(&mut self, binding: &Binding) -> Result<u64> {
        const CALL: &str = "MulticastGroup::map";
        let state = self
            .bindings
            .get(binding.index)
            .filter(|s| binding.group == self.id && s.offset == binding.offset)
            .ok_or_else(|| usage_error(CALL, "the binding belongs to another multicast group".to_owned()))?;
        if let Some(ptr) = state.mapped {
            return Ok(ptr);
        }
        let len = binding.offset + binding.bound;
        let offset = u64::try_from(binding.offset)
            .map_err(|_| usage_error(CALL, format!("offset {} does not fit a device pointer", binding.offset)))?;
        let mark = self.res.stack.len();
        let ptr = self.map_range(len).map_err(Error::from).and_then(|base| {
            base.checked_add(offset)
                .ok_or_else(|| usage_error(CALL, format!("{base:#x} + {offset:#x} overflows a device pointer")))
        });
        let ptr = match ptr {
            Ok(ptr) => ptr,
            Err(e) => {
                // Errors while undoing are logged; the caller sees the one that made the map fail.
                let _ = self.res.unwind_to(mark);
                return Err(e);
            }
        };
        if let Some(s) = self.bindings.get_mut(binding.index) {
            s.mapped = Some(ptr);
        }
        Ok(ptr)
    }

    /// Reserve, map at offset 0, set access; each acquisition is pushed as it succeeds.
    fn map_range(&mut self, len: usize) -> Result<u64, DriverError> {
        let d = Arc::clone(&self.res.driver);
        let va = d.address_reserve(len, self.granularity)?;
        self.res.stack.push(Resource::Reservation { va, size: len });
        d.map(va, len, 0, self.handle)?;
        self.res.stack.push(Resource::Mapping { va, size: len });
        d.set_access(va, len, self.res.device)?;
        Ok(va)
    }

    /// Releases everything in reverse order of acquisition (unmap, free the address range, unbind, release the
    /// imported handle, close the exported one); every step is tried, and the first failure is returned.
    pub fn close(mut self) -> Result<()> {
        Ok(self.res.unwind_to(0)?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap, HashSet};
    use std::sync::Mutex;

    use super::*;

    const G: usize = 2 << 20;
    const REC_G: usize = 8 * G;
    const FAKE_BASE_VA: u64 = 0x7f00_0000_0000;

    /// What a shareable handle was, for the call log.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Sh {
        Fd(i32),
        Fabric(u64),
    }

    fn sh(s: &Shareable) -> Sh {
        match s {
            Shareable::PosixFd(fd) => Sh::Fd(*fd),
            Shareable::Fabric(b) => {
                let mut id = [0u8; 8];
                id.copy_from_slice(&b[..8]);
                Sh::Fabric(u64::from_le_bytes(id))
            }
        }
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Version,
        Supported(i32),
        Granularity { n: usize, size: usize, recommended: bool },
        Create { n: usize, size: usize },
        Export(McHandle),
        Import(Sh),
        Close(Sh),
        Release(McHandle),
        AddDevice(McHandle, i32),
        Bind { mc: McHandle, offset: usize, mem: MemHandle, size: usize },
        Unbind { mc: McHandle, device: i32, offset: usize, size: usize },
        Reserve { size: usize, align: usize },
        Map { va: u64, size: usize, offset: usize, mc: McHandle },
        SetAccess { va: u64, size: usize, device: i32 },
        Unmap { va: u64, size: usize },
        Free { va: u64, size: usize },
    }

    impl Call {
        fn is_create(&self) -> bool {
            matches!(self, Call::Create { .. })
        }
    }

    struct Obj {
        size: usize,
        num_devices: usize,
        devices: HashSet<i32>,
    }

    #[derive(Debug, Default, PartialEq, Eq)]
    struct Live {
        objects: usize,
        handles: usize,
        fds: usize,
        bindings: usize,
        reservations: usize,
        mappings: usize,
    }

    #[derive(Default)]
    struct State {
        version: i32,
        unsupported: HashSet<i32>,
        calls: Vec<Call>,
        fail_at: Option<usize>,
        next_id: u64,
        next_va: u64,
        objects: HashMap<u64, Obj>,
        handles: HashMap<McHandle, u64>,
        fds: HashMap<i32, u64>,
        mems: HashMap<MemHandle, (i32, usize)>,
        bindings: HashMap<(u64, i32, usize), usize>,
        reservations: BTreeMap<u64, usize>,
        mappings: BTreeMap<u64, (usize, u64)>,
    }

    fn err(call: &'static str, code: i32, message: &str) -> DriverError {
        DriverError { call, code, message: message.to_owned() }
    }

    const INVALID: i32 = 1;

    impl State {
        /// Records the call; fails it when it is the injected one.
        fn record(&mut self, name: &'static str, call: Call) -> Result<(), DriverError> {
            let index = self.calls.len();
            self.calls.push(call);
            if self.fail_at == Some(index) {
                return Err(err(name, 999, "injected failure"));
            }
            Ok(())
        }

        fn id(&mut self) -> u64 {
            self.next_id += 1;
            self.next_id
        }

        fn obj_of(&self, call: &'static str, h: McHandle) -> Result<u64, DriverError> {
            self.handles.get(&h).copied().ok_or_else(|| err(call, INVALID, "invalid handle"))
        }

        /// Destroys objects nothing refers to any more.
        fn collect(&mut self) {
            let referenced: HashSet<u64> = self
                .handles
                .values()
                .chain(self.fds.values())
                .chain(self.mappings.values().map(|(_, o)| o))
                .copied()
                .collect();
            self.objects.retain(|id, _| referenced.contains(id));
        }
    }

    /// A fake CUDA driver: records every call in order, checks arguments the way the driver does, tracks live
    /// resources, and fails the call at the index set with `fail_at`.
    struct Fake(Mutex<State>);

    impl Fake {
        fn new() -> Arc<Self> {
            Arc::new(Fake(Mutex::new(State { version: 12080, next_va: FAKE_BASE_VA, ..State::default() })))
        }

        fn st(&self) -> std::sync::MutexGuard<'_, State> {
            self.0.lock().expect("fake driver lock")
        }

        fn calls(&self) -> Vec<Call> {
            self.st().calls.clone()
        }

        fn fail_at(&self, index: usize) {
            self.st().fail_at = Some(index);
        }

        /// A physical allocation of `size` bytes on `device` (what `cuMemCreate` gives the user).
        fn alloc(&self, device: i32, size: usize) -> MemHandle {
            let mut st = self.st();
            let m = MemHandle(1_000_000 + st.id());
            st.mems.insert(m, (device, size));
            m
        }

        /// What a peer process receives when `s` is sent over a socket: a new descriptor for the same object.
        fn dup(&self, s: &Shareable) -> Shareable {
            let mut st = self.st();
            match s {
                Shareable::PosixFd(fd) => {
                    let obj = *st.fds.get(fd).expect("open fd");
                    let new = 100 + i32::try_from(st.id()).expect("small id");
                    st.fds.insert(new, obj);
                    Shareable::PosixFd(new)
                }
                Shareable::Fabric(b) => Shareable::Fabric(*b),
            }
        }

        fn live(&self) -> Live {
            let st = self.st();
            Live {
                objects: st.objects.len(),
                handles: st.handles.len(),
                fds: st.fds.len(),
                bindings: st.bindings.len(),
                reservations: st.reservations.len(),
                mappings: st.mappings.len(),
            }
        }
    }

    impl MulticastDriver for Fake {
        fn driver_version(&self) -> Result<i32, DriverError> {
            let mut st = self.st();
            st.record("cuDriverGetVersion", Call::Version)?;
            Ok(st.version)
        }

        fn multicast_supported(&self, device: i32) -> Result<bool, DriverError> {
            let mut st = self.st();
            st.record("cuDeviceGetAttribute", Call::Supported(device))?;
            Ok(!st.unsupported.contains(&device))
        }

        fn multicast_granularity(&self, n: usize, size: usize, recommended: bool) -> Result<usize, DriverError> {
            let mut st = self.st();
            st.record("cuMulticastGetGranularity", Call::Granularity { n, size, recommended })?;
            Ok(if recommended { REC_G } else { G })
        }

        fn multicast_create(&self, n: usize, size: usize, _kind: ShareableKind) -> Result<McHandle, DriverError> {
            const C: &str = "cuMulticastCreate";
            let mut st = self.st();
            st.record(C, Call::Create { n, size })?;
            if n == 0 || size == 0 || !size.is_multiple_of(G) {
                return Err(err(C, INVALID, "size not a multiple of the granularity"));
            }
            let obj = st.id();
            st.objects.insert(obj, Obj { size, num_devices: n, devices: HashSet::new() });
            let h = McHandle(st.id());
            st.handles.insert(h, obj);
            Ok(h)
        }

        fn export_shareable(&self, handle: McHandle, kind: ShareableKind) -> Result<Shareable, DriverError> {
            const C: &str = "cuMemExportToShareableHandle";
            let mut st = self.st();
            st.record(C, Call::Export(handle))?;
            let obj = st.obj_of(C, handle)?;
            Ok(match kind {
                ShareableKind::PosixFd => {
                    let fd = 100 + i32::try_from(st.id()).map_err(|_| err(C, INVALID, "too many fds"))?;
                    st.fds.insert(fd, obj);
                    Shareable::PosixFd(fd)
                }
                ShareableKind::Fabric => {
                    let mut b = [0u8; 64];
                    b[..8].copy_from_slice(&obj.to_le_bytes());
                    Shareable::Fabric(b)
                }
            })
        }

        fn import_shareable(&self, s: &Shareable) -> Result<McHandle, DriverError> {
            const C: &str = "cuMemImportFromShareableHandle";
            let mut st = self.st();
            st.record(C, Call::Import(sh(s)))?;
            let obj = match sh(s) {
                Sh::Fd(fd) => st.fds.get(&fd).copied().ok_or_else(|| err(C, INVALID, "bad fd"))?,
                Sh::Fabric(obj) => obj,
            };
            if !st.objects.contains_key(&obj) {
                return Err(err(C, INVALID, "the object no longer exists"));
            }
            let h = McHandle(st.id());
            st.handles.insert(h, obj);
            Ok(h)
        }

        fn close_shareable(&self, s: &Shareable) -> Result<(), DriverError> {
            let mut st = self.st();
            st.record("close", Call::Close(sh(s)))?;
            if let Shareable::PosixFd(fd) = s {
                st.fds.remove(fd).ok_or_else(|| err("close", 9, "EBADF"))?;
                st.collect();
            }
            Ok(())
        }

        fn release(&self, handle: McHandle) -> Result<(), DriverError> {
            const C: &str = "cuMemRelease";
            let mut st = self.st();
            st.record(C, Call::Release(handle))?;
            st.handles.remove(&handle).ok_or_else(|| err(C, INVALID, "invalid handle"))?;
            st.collect();
            Ok(())
        }

        fn multicast_add_device(&self, mc: McHandle, device: i32) -> Result<(), DriverError> {
            const C: &str = "cuMulticastAddDevice";
            let mut st = self.st();
            st.record(C, Call::AddDevice(mc, device))?;
            let obj = st.obj_of(C, mc)?;
            let o = st.objects.get_mut(&obj).ok_or_else(|| err(C, INVALID, "no object"))?;
            if o.devices.len() >= o.num_devices || !o.devices.insert(device) {
                return Err(err(C, INVALID, "device already added or too many devices"));
            }
            Ok(())
        }

        fn multicast_bind_mem(
            &self,
            mc: McHandle,
            offset: usize,
            mem: MemHandle,
            mem_offset: usize,
            size: usize,
        ) -> Result<(), DriverError> {
            const C: &str = "cuMulticastBindMem";
            let mut st = self.st();
            st.record(C, Call::Bind { mc, offset, mem, size })?;
            let obj = st.obj_of(C, mc)?;
            let (device, mem_size) = *st.mems.get(&mem).ok_or_else(|| err(C, INVALID, "bad memory handle"))?;
            let o = st.objects.get(&obj).ok_or_else(|| err(C, INVALID, "no object"))?;
            let aligned = offset.is_multiple_of(G) && size.is_multiple_of(G) && mem_offset.is_multiple_of(G);
            if !o.devices.contains(&device) || !aligned || offset + size > o.size || mem_offset + size > mem_size {
                return Err(err(C, INVALID, "bad binding"));
            }
            let overlaps = st
                .bindings
                .iter()
                .any(|(&(b, d, off), &sz)| b == obj && d == device && off < offset + size && offset < off + sz);
            if overlaps {
                return Err(err(C, INVALID, "range already bound"));
            }
            st.bindings.insert((obj, device, offset), size);
            Ok(())
        }

        fn multicast_unbind(&self, mc: McHandle, device: i32, offset: usize, size: usize) -> Result<(), DriverError> {
            const C: &str = "cuMulticastUnbind";
            let mut st = self.st();
            st.record(C, Call::Unbind { mc, device, offset, size })?;
            let obj = st.obj_of(C, mc)?;
            match st.bindings.remove(&(obj, device, offset)) {
                Some(s) if s == size => Ok(()),
                _ => Err(err(C, INVALID, "not bound")),
            }
        }

        fn address_reserve(&self, size: usize, align: usize) -> Result<u64, DriverError> {
            const C: &str = "cuMemAddressReserve";
            let mut st = self.st();
            st.record(C, Call::Reserve { size, align })?;
            if size == 0 || !align.is_power_of_two() {
                return Err(err(C, INVALID, "bad size or alignment"));
            }
            let va = st.next_va;
            st.next_va += 1 << 40;
            st.reservations.insert(va, size);
            Ok(va)
        }

        fn map(&self, va: u64, size: usize, offset: usize, handle: McHandle) -> Result<(), DriverError> {
            const C: &str = "cuMemMap";
            let mut st = self.st();
            st.record(C, Call::Map { va, size, offset, mc: handle })?;
            if offset != 0 {
                return Err(err(C, INVALID, "offset must be 0 for a multicast handle"));
            }
            let obj = st.obj_of(C, handle)?;
            let obj_size = st.objects.get(&obj).map_or(0, |o| o.size);
            let reserved =
                st.reservations.range(..=va).next_back().is_some_and(|(&b, &s)| va + size as u64 <= b + s as u64);
            if size == 0 || !size.is_multiple_of(G) || size > obj_size || !reserved || st.mappings.contains_key(&va) {
                return Err(err(C, INVALID, "bad mapping"));
            }
            st.mappings.insert(va, (size, obj));
            Ok(())
        }

        fn set_access(&self, va: u64, size: usize, device: i32) -> Result<(), DriverError> {
            const C: &str = "cuMemSetAccess";
            let mut st = self.st();
            st.record(C, Call::SetAccess { va, size, device })?;
            match st.mappings.get(&va) {
                Some(&(s, _)) if s == size => Ok(()),
                _ => Err(err(C, INVALID, "range not mapped")),
            }
        }

        fn unmap(&self, va: u64, size: usize) -> Result<(), DriverError> {
            const C: &str = "cuMemUnmap";
            let mut st = self.st();
            st.record(C, Call::Unmap { va, size })?;
            match st.mappings.remove(&va) {
                Some((s, _)) if s == size => {
                    st.collect();
                    Ok(())
                }
                _ => Err(err(C, INVALID, "not mapped")),
            }
        }

        fn address_free(&self, va: u64, size: usize) -> Result<(), DriverError> {
            const C: &str = "cuMemAddressFree";
            let mut st = self.st();
            st.record(C, Call::Free { va, size })?;
            let end = va + size as u64;
            if st.mappings.range(va..end).next().is_some() {
                return Err(err(C, INVALID, "range still mapped"));
            }
            match st.reservations.remove(&va) {
                Some(s) if s == size => Ok(()),
                _ => Err(err(C, INVALID, "not reserved")),
            }
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn owner(fake: &Arc<Fake>, config: &MulticastConfig) -> MulticastGroup<Fake> {
        MulticastGroup::create(Arc::clone(fake), 0, config, &no_env).expect("create")
    }

    #[test]
    fn local_handle_is_released_right_after_export() {
        let fake = Fake::new();
        let group = owner(&fake, &MulticastConfig::for_buffers(2, &[G]));
        let calls = fake.calls();
        let Call::Export(local) = calls[4] else { panic!("export expected, got {calls:?}") };
        let fd = sh(group.shareable().expect("owner keeps the export"));
        assert_eq!(
            calls,
            vec![
                Call::Version,
                Call::Supported(0),
                Call::Granularity { n: 2, size: G, recommended: false },
                Call::Create { n: 2, size: G },
                Call::Export(local),
                Call::Release(local),
                Call::Import(fd),
                Call::AddDevice(group.handle(), 0),
            ]
        );
        assert_ne!(group.handle(), local);
        // The object lives on through the export and the imported handle only.
        assert_eq!(fake.live(), Live { objects: 1, handles: 1, fds: 1, ..Live::default() });
    }

    #[test]
    fn second_buffer_maps_from_offset_zero() {
        let fake = Fake::new();
        let mut group = owner(&fake, &MulticastConfig::for_buffers(2, &[2 * G, 3 * G]));
        let (m1, m2) = (fake.alloc(0, 2 * G), fake.alloc(0, 3 * G));
        let b1 = group.bind(m1, 2 * G).expect("bind 1");
        let b2 = group.bind(m2, 3 * G).expect("bind 2");
        assert_eq!((b1.offset(), b2.offset()), (0, 2 * G));
        let before = fake.calls().len();
        let p2 = group.map(&b2).expect("map 2");
        let calls = fake.calls()[before..].to_vec();
        assert_eq!(calls[0], Call::Reserve { size: 5 * G, align: G });
        let Call::Map { va, .. } = calls[1] else { panic!("map expected, got {calls:?}") };
        // [0, off2 + size2) of the object, mapped from offset 0; the pointer is base + off2.
        assert_eq!(
            calls[1..],
            [
                Call::Map { va, size: 2 * G + 3 * G, offset: 0, mc: group.handle() },
                Call::SetAccess { va, size: 5 * G, device: 0 }
            ]
        );
        assert_eq!(p2, va + (2 * G) as u64);
        // Mapping it again reuses the mapping; the first buffer gets its own, over [0, 2G).
        assert_eq!(group.map(&b2).expect("map 2 again"), p2);
        let n = fake.calls().len();
        let p1 = group.map(&b1).expect("map 1");
        let calls = fake.calls()[n..].to_vec();
        let Call::Map { va: va1, .. } = calls[1] else { panic!("map expected, got {calls:?}") };
        assert_eq!(calls[1], Call::Map { va: va1, size: 2 * G, offset: 0, mc: group.handle() });
        assert_eq!(p1, va1);
    }

    #[test]
    fn fake_rejects_a_nonzero_map_offset() {
        let fake = Fake::new();
        let group = owner(&fake, &MulticastConfig::explicit(1, 2 * G));
        let va = fake.address_reserve(2 * G, G).expect("reserve");
        let e = fake.map(va, G, G, group.handle()).expect_err("offset must be 0");
        assert_eq!((e.call, e.code), ("cuMemMap", INVALID));
        fake.address_free(va, 2 * G).expect("free");
    }

    #[test]
    fn two_buffers_share_one_multicast_object() {
        let fake = Fake::new();
        let mut group = owner(&fake, &MulticastConfig::for_buffers(2, &[G, G]));
        let b1 = group.bind(fake.alloc(0, G), G).expect("bind 1");
        let b2 = group.bind(fake.alloc(0, G), G).expect("bind 2");
        group.map(&b1).expect("map 1");
        group.map(&b2).expect("map 2");
        let calls = fake.calls();
        assert_eq!(calls.iter().filter(|c| c.is_create()).count(), 1);
        let binds: Vec<_> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Bind { mc, offset, .. } => Some((*mc, *offset)),
                _ => None,
            })
            .collect();
        assert_eq!(binds, vec![(group.handle(), 0), (group.handle(), G)]);
        assert_eq!(fake.live(), Live { objects: 1, handles: 1, fds: 1, bindings: 2, reservations: 2, mappings: 2 });
        // A third buffer does not fit: refused before any driver call.
        let n = fake.calls().len();
        let e = group.bind(fake.alloc(0, G), G).expect_err("full");
        assert!(matches!(e, Error::Backend { code: None, .. }), "{e:?}");
        assert_eq!(fake.calls().len(), n);
    }

    /// Owner: create, bind two buffers, map both; returns the group, the bindings and the pointers.
    fn full_sequence(fake: &Arc<Fake>) -> Result<(MulticastGroup<Fake>, [u64; 2])> {
        full_sequence_as(fake, ShareableKind::PosixFd)
    }

    fn full_sequence_as(fake: &Arc<Fake>, kind: ShareableKind) -> Result<(MulticastGroup<Fake>, [u64; 2])> {
        let config = MulticastConfig { kind, ..MulticastConfig::for_buffers(2, &[G, 2 * G]) };
        let mut group = MulticastGroup::create(Arc::clone(fake), 0, &config, &no_env)?;
        let b1 = group.bind(fake.alloc(0, G), G)?;
        let b2 = group.bind(fake.alloc(0, 2 * G), 2 * G)?;
        let p1 = group.map(&b1)?;
        let p2 = group.map(&b2)?;
        Ok((group, [p1, p2]))
    }

    #[test]
    fn drop_releases_everything_in_reverse_order() {
        let fake = Fake::new();
        let (group, [p1, p2]) = full_sequence(&fake).expect("sequence");
        let handle = group.handle();
        let fd = sh(group.shareable().expect("export"));
        let (va1, va2) = (p1, p2 - G as u64);
        let n = fake.calls().len();
        drop(group);
        assert_eq!(
            fake.calls()[n..].to_vec(),
            vec![
                Call::Unmap { va: va2, size: 3 * G },
                Call::Free { va: va2, size: 3 * G },
                Call::Unmap { va: va1, size: G },
                Call::Free { va: va1, size: G },
                Call::Unbind { mc: handle, device: 0, offset: G, size: 2 * G },
                Call::Unbind { mc: handle, device: 0, offset: 0, size: G },
                Call::Release(handle),
                Call::Close(fd),
            ]
        );
        assert_eq!(fake.live(), Live::default());
    }

    #[test]
    fn close_releases_everything_and_reports_success() {
        let fake = Fake::new();
        let (group, _) = full_sequence(&fake).expect("sequence");
        group.close().expect("close");
        assert_eq!(fake.live(), Live::default());
        let n = fake.calls().len();
        assert!(matches!(fake.calls()[n - 1], Call::Close(_)));
    }

    #[test]
    fn failure_at_every_step_leaks_nothing() {
        let steps = {
            let fake = Fake::new();
            let (group, _) = full_sequence(&fake).expect("sequence");
            let n = fake.calls().len();
            drop(group);
            n
        };
        assert_eq!(steps, 3 + 5 + 2 + 2 * 3, "version, attribute, granularity, create..add, 2 binds, 2 maps");
        for kind in [ShareableKind::PosixFd, ShareableKind::Fabric] {
            for k in 0..steps {
                let fake = Fake::new();
                fake.fail_at(k);
                let e = full_sequence_as(&fake, kind).map(|_| ()).expect_err("the injected failure surfaces");
                assert!(matches!(e, Error::Backend { .. } | Error::Unsupported { .. }), "{kind:?} step {k}: {e:?}");
                assert_eq!(fake.live(), Live::default(), "{kind:?} step {k} leaked: {:?}", fake.calls());
            }
        }
    }

    #[test]
    fn failed_map_undoes_only_its_own_steps() {
        for step in 0..3 {
            let fake = Fake::new();
            let mut group = owner(&fake, &MulticastConfig::for_buffers(1, &[G]));
            let b = group.bind(fake.alloc(0, G), G).expect("bind");
            let before = fake.live();
            fake.fail_at(fake.calls().len() + step);
            group.map(&b).expect_err("injected");
            assert_eq!(fake.live(), before, "step {step}");
            // The group still works: the retry maps.
            group.map(&b).expect("retry");
            drop(group);
            assert_eq!(fake.live(), Live::default());
        }
    }

    #[test]
    fn peer_imports_closes_the_received_handle_and_leaks_nothing_on_failure() {
        let config = MulticastConfig::for_buffers(2, &[G]);
        // A clean run first, to count the peer's calls.
        let fake = Fake::new();
        let own = owner(&fake, &config);
        let received = fake.dup(own.shareable().expect("export"));
        let r = sh(&received);
        let n = fake.calls().len();
        let mut peer = MulticastGroup::import(Arc::clone(&fake), 1, &config, received, &no_env).expect("import");
        assert!(peer.shareable().is_none());
        let peer_calls = fake.calls()[n..].to_vec();
        assert_eq!(peer_calls[3..], [Call::Import(r), Call::Close(r), Call::AddDevice(peer.handle(), 1)]);
        let b = peer.bind(fake.alloc(1, G), G).expect("bind");
        peer.map(&b).expect("map");
        let peer_steps = fake.calls().len() - n;
        drop(peer);
        drop(own);
        assert_eq!(fake.live(), Live::default());

        for k in 0..peer_steps {
            let fake = Fake::new();
            let own = owner(&fake, &config);
            let received = fake.dup(own.shareable().expect("export"));
            let base = fake.live();
            fake.fail_at(fake.calls().len() + k);
            let run = || -> Result<MulticastGroup<Fake>> {
                let mut peer = MulticastGroup::import(Arc::clone(&fake), 1, &config, received, &no_env)?;
                let b = peer.bind(fake.alloc(1, G), G)?;
                peer.map(&b)?;
                Ok(peer)
            };
            run().expect_err("injected");
            // Only the owner's resources remain; the received descriptor is closed.
            assert_eq!(fake.live(), Live { fds: base.fds - 1, ..base }, "step {k}");
            drop(own);
            assert_eq!(fake.live(), Live::default(), "step {k}");
        }
    }

    #[test]
    fn owner_may_close_its_export_once_peers_imported() {
        let fake = Fake::new();
        let config = MulticastConfig::for_buffers(2, &[G]);
        let mut own = owner(&fake, &config);
        let received = fake.dup(own.shareable().expect("export"));
        let peer = MulticastGroup::import(Arc::clone(&fake), 1, &config, received, &no_env).expect("import");
        own.close_shareable().expect("close export");
        assert!(own.shareable().is_none());
        assert_eq!(fake.live(), Live { objects: 1, handles: 2, ..Live::default() });
        drop(own);
        assert_eq!(fake.live().objects, 1, "the peer's handle keeps the object");
        drop(peer);
        assert_eq!(fake.live(), Live::default());
    }

    #[test]
    fn fabric_handles_work_the_same_way() {
        let fake = Fake::new();
        let config = MulticastConfig { kind: ShareableKind::Fabric, ..MulticastConfig::for_buffers(2, &[G]) };
        let own = owner(&fake, &config);
        let Some(Shareable::Fabric(blob)) = own.shareable() else { panic!("fabric export expected") };
        // A fabric blob holds no reference: the owner imports before it releases the local handle.
        let calls = fake.calls();
        let Call::Export(local) = calls[4] else { panic!("export expected, got {calls:?}") };
        assert_eq!(
            calls[5..],
            [
                Call::Import(sh(own.shareable().expect("export"))),
                Call::Release(local),
                Call::AddDevice(own.handle(), 0)
            ]
        );
        let peer =
            MulticastGroup::import(Arc::clone(&fake), 1, &config, Shareable::Fabric(*blob), &no_env).expect("import");
        drop(own);
        drop(peer);
        assert_eq!(fake.live(), Live::default());
    }

    #[test]
    fn size_comes_from_the_buffers_rounded_to_granularity() {
        assert_eq!(multicast_size(&McSize::Buffers(vec![1, G, G + 1]), G).expect("size"), 4 * G);
        assert_eq!(multicast_size(&McSize::Buffers(vec![3 * G]), G).expect("size"), 3 * G);
        assert!(multicast_size(&McSize::Buffers(vec![]), G).is_err());
        assert!(multicast_size(&McSize::Buffers(vec![G, 0]), G).is_err());
        assert!(multicast_size(&McSize::Buffers(vec![usize::MAX]), G).is_err());
        assert!(multicast_size(&McSize::Buffers(vec![G]), 0).is_err());

        let fake = Fake::new();
        let mut group = owner(&fake, &MulticastConfig::for_buffers(2, &[1, G, G + 1]));
        assert_eq!(group.size(), 4 * G);
        assert!(fake.calls().contains(&Call::Granularity { n: 2, size: 2 * G + 2, recommended: false }));
        assert!(fake.calls().contains(&Call::Create { n: 2, size: 4 * G }));
        // Unaligned buffers are bound rounded up, at aligned offsets, and fill the object exactly.
        let offsets: Vec<_> = [1, G, G + 1]
            .iter()
            .map(|&s| group.bind(fake.alloc(0, round_up(s, G).expect("small")), s).expect("bind"))
            .map(|b| (b.offset(), b.size(), b.bound_size()))
            .collect();
        assert_eq!(offsets, vec![(0, 1, G), (G, G, G), (2 * G, G + 1, 2 * G)]);
    }

    #[test]
    fn explicit_size_is_used_rounded_up() {
        assert_eq!(multicast_size(&McSize::Explicit(3 * G + 5), G).expect("size"), 4 * G);
        assert!(multicast_size(&McSize::Explicit(0), G).is_err());
        let fake = Fake::new();
        let group = owner(&fake, &MulticastConfig::explicit(4, 3 * G + 5));
        assert_eq!(group.size(), 4 * G);
        assert!(fake.calls().contains(&Call::Create { n: 4, size: 4 * G }));

        let fake = Fake::new();
        let config = MulticastConfig { recommended_granularity: true, ..MulticastConfig::explicit(4, 3 * G) };
        let group = owner(&fake, &config);
        assert_eq!((group.size(), group.granularity()), (REC_G, REC_G));

        // A bad size is refused before anything is created.
        let fake = Fake::new();
        let e = MulticastGroup::create(Arc::clone(&fake), 0, &MulticastConfig::explicit(2, 0), &no_env)
            .expect_err("zero size");
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        assert!(!fake.calls().iter().any(Call::is_create));
    }

    fn assert_gate(fake: &Arc<Fake>, device: i32, env: &dyn Fn(&str) -> Option<String>, want: Reason) {
        assert_eq!(multicast_eligibility(&**fake, device, env), Err(want.clone()));
        let e = MulticastGroup::create(Arc::clone(fake), device, &MulticastConfig::for_buffers(2, &[G]), env)
            .expect_err("gated");
        assert_eq!(e, Error::Unsupported { capability: "multicast".to_owned(), reason: want.clone() });
        let e = MulticastGroup::import(
            Arc::clone(fake),
            device,
            &MulticastConfig::for_buffers(2, &[G]),
            Shareable::Fabric([0; 64]),
            env,
        )
        .expect_err("gated");
        assert_eq!(e, Error::Unsupported { capability: "multicast".to_owned(), reason: want });
        let calls = fake.calls();
        assert!(
            calls.iter().all(|c| matches!(c, Call::Version | Call::Supported(_) | Call::Close(_))),
            "only queries before the gate says no: {calls:?}"
        );
        assert!(!calls.iter().any(Call::is_create));
    }

    #[test]
    fn gate_attribute_zero() {
        let fake = Fake::new();
        fake.st().unsupported.insert(1);
        let want = Reason::DeviceAttribute {
            device: "device 1".to_owned(),
            attribute: "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0".to_owned(),
        };
        assert_gate(&fake, 1, &no_env, want);
        assert_eq!(multicast_eligibility(&*fake, 0, &no_env), Ok(()));
    }

    #[test]
    fn gate_driver_older_than_12_1() {
        let fake = Fake::new();
        fake.st().version = 12000;
        let want = Reason::VersionTooOld {
            component: "CUDA driver".to_owned(),
            found: "12.0".to_owned(),
            required: "12.1".to_owned(),
        };
        assert_gate(&fake, 0, &no_env, want);
        fake.st().version = 12010;
        assert_eq!(multicast_eligibility(&*fake, 0, &no_env), Ok(()));
    }

    #[test]
    fn gate_nccl_nvls_enable_0() {
        let fake = Fake::new();
        let env = |name: &str| (name == "NCCL_NVLS_ENABLE").then(|| "0".to_owned());
        let want = Reason::EnvVar { var: "NCCL_NVLS_ENABLE".to_owned(), value: "0".to_owned() };
        assert_gate(&fake, 0, &env, want);
        // Turned off by the environment, the driver is not even asked (the dropped received handle is closed).
        assert!(fake.calls().iter().all(|c| matches!(c, Call::Close(_))), "{:?}", fake.calls());
        let on = |name: &str| (name == "NCCL_NVLS_ENABLE").then(|| "1".to_owned());
        assert_eq!(multicast_eligibility(&*fake, 0, &on), Ok(()));
    }

    #[test]
    fn gate_query_failure_disables_with_a_reason() {
        let fake = Fake::new();
        fake.fail_at(0);
        let r = multicast_eligibility(&*fake, 0, &no_env).expect_err("query failed");
        assert!(matches!(r, Reason::Unavailable { .. }), "{r:?}");
    }

    #[test]
    fn drop_logs_teardown_errors_and_releases_the_rest() {
        let fake = Fake::new();
        let (group, _) = full_sequence(&fake).expect("sequence");
        let n = fake.calls().len();
        fake.fail_at(n); // the first unmap
        let e = group.close().expect_err("unmap failed");
        assert!(matches!(&e, Error::Backend { call, .. } if call == "cuMemUnmap"), "{e:?}");
        let tail = fake.calls()[n..].to_vec();
        assert_eq!(tail.len(), 8, "every step was still tried: {tail:?}");
        assert!(matches!(tail[7], Call::Close(_)));
        // Only the mapping that failed to unmap (and its address range, still mapped) remain.
        assert_eq!(fake.live(), Live { objects: 1, reservations: 1, mappings: 1, ..Live::default() });

        let fake = Fake::new();
        let (group, _) = full_sequence(&fake).expect("sequence");
        fake.fail_at(fake.calls().len() + 4); // an unbind, in Drop: logged, no panic
        drop(group);
        assert_eq!(fake.live(), Live { bindings: 1, ..Live::default() });
    }

    #[test]
    fn a_binding_of_another_group_is_refused() {
        let fake = Fake::new();
        let mut a = owner(&fake, &MulticastConfig::for_buffers(1, &[G]));
        let other = Fake::new();
        let mut b = owner(&other, &MulticastConfig::for_buffers(1, &[G]));
        let bb = b.bind(other.alloc(0, G), G).expect("bind");
        let n = fake.calls().len();
        assert!(a.map(&bb).is_err());
        assert_eq!(fake.calls().len(), n);
        assert!(a.bind(fake.alloc(0, G), 0).is_err());
    }

    #[test]
    fn driver_errors_convert_to_backend_errors() {
        let e: Error =
            DriverError { call: "cuMulticastCreate", code: 801, message: "operation not supported".into() }.into();
        assert_eq!(
            e,
            Error::Backend {
                backend: "cuda".into(),
                call: "cuMulticastCreate".into(),
                code: Some(801),
                message: "operation not supported".into()
            }
        );
    }
}
