//! Symmetric memory: `ncclMemAlloc` memory registered as a symmetric window on a [`crate::CclComm`]
//! ([`crate::CclComm::symmetric_memory`]), and the bookkeeping the communicator shares with it (its windows, and
//! whether it still lives).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyccl_core::{Result, Teardown};

use crate::{result, sys, CclLibrary};

/// The symmetric windows registered on one communicator, and a generation that changes with them.
#[derive(Default)]
pub(crate) struct Windows {
    /// (start, len) of each window.
    list: Mutex<Vec<(usize, usize)>>,
    /// Bumped on every registration and release, so a cached eligibility answer can tell it is stale.
    generation: AtomicU64,
}

impl Windows {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<(usize, usize)>> {
        // A panic while holding the lock left a plain Vec behind: still consistent.
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn add(&self, start: usize, len: usize) {
        self.list().push((start, len));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn remove(&self, start: usize) {
        self.list().retain(|(s, _)| *s != start);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether `[addr, +bytes)` lies inside one window.
    pub(crate) fn contains(&self, addr: usize, bytes: usize) -> bool {
        self.list().iter().any(|(s, l)| addr >= *s && addr.saturating_add(bytes) <= s + l)
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

/// Whether a communicator still lives, for the symmetric memory that may outlive it.
#[derive(Default)]
pub(crate) struct Life {
    /// Set when the communicator is dropped, destroyed, aborted or closed: its windows are gone with it.
    pub(crate) gone: AtomicBool,
    /// The communicator's background destroy, when it was closed that way
    /// ([`crate::CclComm::close_in_background_with`]). Set under this lock together with `gone`.
    closing: Mutex<Option<Teardown>>,
}

impl Life {
    pub(crate) fn closing(&self) -> std::sync::MutexGuard<'_, Option<Teardown>> {
        // Only ever holds an `Option`: consistent after a panic too.
        self.closing.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Memory from `ncclMemAlloc`, registered as a symmetric window on its communicator. Deregistered (while the
/// communicator lives) and freed on drop, with its device made current first.
pub struct SymmetricMemory {
    ptr: *mut c_void,
    size: usize,
    window: Option<sys::ncclWindow_t>,
    lib: Arc<CclLibrary>,
    comm: sys::ncclComm_t,
    life: Arc<Life>,
    windows: Arc<Windows>,
    bind: Box<dyn Fn() -> Result<()> + Send>,
}

// SAFETY: device memory plus opaque library handles, usable from any thread; the communicator handle is only
// used to deregister, after checking it is alive.
unsafe impl Send for SymmetricMemory {}

impl SymmetricMemory {
    /// The memory at `ptr` (`size` bytes from `ncclMemAlloc` of `lib`), registered as `window` on `comm`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ptr: *mut c_void,
        size: usize,
        window: sys::ncclWindow_t,
        lib: Arc<CclLibrary>,
        comm: sys::ncclComm_t,
        life: Arc<Life>,
        windows: Arc<Windows>,
        bind: Box<dyn Fn() -> Result<()> + Send>,
    ) -> Self {
        SymmetricMemory { ptr, size, window: Some(window), lib, comm, life, windows, bind }
    }

    /// The device address.
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// The allocated size (the requested size rounded up to 4 KiB).
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for SymmetricMemory {
    fn drop(&mut self) {
        // Deregistration and ncclMemFree act on the current device.
        if let Err(e) = (self.bind)() {
            tracing::warn!(error = %e, "binding the device to free a symmetric buffer failed");
        }
        self.windows.remove(self.ptr as usize);
        let comm_alive = !self.life.gone.load(Ordering::SeqCst);
        if !comm_alive {
            // Closed in the background: the library may still be destroying the communicator, and with it this
            // window. Free the memory only after that.
            let closing = self.life.closing().clone();
            if let Some(Err(e)) = closing.map(|t| t.wait()) {
                tracing::warn!(error = %e, "the communicator of a symmetric buffer failed to close");
            }
        }
        let window = self.window.take().filter(|_| comm_alive);
        if let Some(w) = window.filter(|_| self.lib.table().optional.comm_window_deregister.is_some()) {
            // SAFETY: the window was registered on this communicator, which is still alive (checked above; a
            // communicator is used from one thread at a time), and is deregistered once.
            if let Err(e) = unsafe { result::comm_window_deregister(&self.lib, self.comm, w) } {
                tracing::warn!(error = %e, "ncclCommWindowDeregister failed");
            }
        }
        // SAFETY: allocated by ncclMemAlloc in `symmetric_memory`, freed once.
        if let Err(e) = unsafe { result::mem_free(&self.lib, self.ptr) } {
            tracing::warn!(error = %e, size = self.size, "ncclMemFree failed");
        }
    }
}

/// A symmetric buffer as a backend's collectives take it: a view of type `B` (the backend's device buffer) over
/// [`SymmetricMemory`]. All-reduce on it can run the library's symmetric kernels, zero-copy. Deregistered and freed
/// on drop (never during capture: it is created outside one).
pub struct SymmetricBuffer<B> {
    // Declared first, so it drops first: a view that owns nothing, of the memory below.
    view: B,
    _mem: SymmetricMemory,
}

impl<B> SymmetricBuffer<B> {
    /// Pairs `mem` with `view`, which must be a non-owning view of exactly that memory.
    pub fn new(view: B, mem: SymmetricMemory) -> Self {
        SymmetricBuffer { view, _mem: mem }
    }

    /// The buffer as the collectives take it.
    pub fn buffer(&self) -> &B {
        &self.view
    }

    /// The buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut B {
        &mut self.view
    }
}
