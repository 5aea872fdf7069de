//! The HIP platform of the generic GPU communicator ([`anyccl_gpu::GpuPlatform`]): the HIP code objects of
//! `anyccl-kernels-hip` loaded with `hipModuleLoadData` and launched with `hipModuleLaunchKernel`, HIP legacy IPC
//! handles, peer access, the abort word's stream-ordered write, all through the loaded [`HipLibrary`] table and
//! under the HIP capture rules (module load, IPC and peer access are refused while a capture they would break
//! runs, before HIP sees them); RCCL as the collective library.

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use anyccl_ccl::{CclLibrary, CclVendor};
use anyccl_core::{Algorithm, CapabilityReport, Error, MemoryRuntime, Reason, Result, Vendor};
use anyccl_gpu::GpuRuntime;
use anyccl_gpu::{GpuPlatform, LEGACY_HANDLE_BYTES};

use crate::loader::{HipLibrary, HipLoadError};
use crate::runtime::{check, HipDevice, HipRuntime, HipStream};
use crate::sys;

/// The all-reduce algorithms of the ROCm backend: RCCL's own, the custom one-shot / two-shot kernels, and the
/// quantized two-shots (lossy: they run only where named, see [`Algorithm::is_lossy`]).
pub const ALGORITHMS: [Algorithm; 6] = [
    Algorithm::Ccl,
    Algorithm::CclSymmetric,
    Algorithm::OneShot,
    Algorithm::TwoShot,
    Algorithm::TwoShotFp8,
    Algorithm::TwoShotInt8,
];

/// The HIP platform (a marker type: [`crate::RocmComm`] is `GpuComm<Hip>`).
#[derive(Debug, Clone, Copy)]
pub struct Hip;

/// A loaded HIP module (`hipModuleLoadData`), unloaded on drop.
pub struct HipModule {
    raw: sys::hipModule_t,
    dev: Arc<HipDevice>,
}

// SAFETY: a module and its functions may be used from any thread of the process.
unsafe impl Send for HipModule {}
// SAFETY: as above; HIP serialises what it must.
unsafe impl Sync for HipModule {}

impl Drop for HipModule {
    fn drop(&mut self) {
        let lib = self.dev.library();
        if let Err(e) = self.dev.bind() {
            tracing::warn!(error = %e, "binding the device to unload the kernels failed");
        }
        // SAFETY: loaded in `load_module`, unloaded once.
        if let Err(e) = check(lib, "hipModuleUnload", unsafe { (lib.table().module_unload)(self.raw) }) {
            tracing::warn!(error = %e, "unloading the kernels failed");
        }
    }
}

/// A kernel of a [`HipModule`] (`hipFunction_t`).
#[derive(Debug, Clone, Copy)]
pub struct HipFunction(sys::hipFunction_t);

// SAFETY: a function handle may be launched from any thread while its module is loaded.
unsafe impl Send for HipFunction {}
// SAFETY: as above.
unsafe impl Sync for HipFunction {}

/// A peer's buffer opened from its HIP IPC handle (`hipIpcOpenMemHandle`), closed on drop.
pub struct HipIpcMapping {
    ptr: u64,
    dev: Arc<HipDevice>,
}

// SAFETY: a mapped device address may be used from any thread.
unsafe impl Send for HipIpcMapping {}
// SAFETY: as above; nothing in it changes after it is opened.
unsafe impl Sync for HipIpcMapping {}

impl Drop for HipIpcMapping {
    fn drop(&mut self) {
        let lib = self.dev.library();
        if let Err(e) = self.dev.bind() {
            tracing::warn!(error = %e, "binding the device to close a peer's IPC buffer failed");
        }
        // SAFETY: opened by `ipc_open`, closed once.
        let st = unsafe { (lib.table().ipc_close_mem_handle)(self.ptr as *mut c_void) };
        if let Err(e) = check(lib, "hipIpcCloseMemHandle", st) {
            tracing::warn!(error = %e, "closing a peer's IPC buffer failed");
        }
    }
}

/// The words the abort word's fallback write copies from (`hipMemcpyAsync` reads its source when the copy runs,
/// so the source lives for the whole process).
static WORDS: [u32; 2] = [0, 1];

/// The process's HIP runtime, loaded once from the standard places (what a job of one process per GPU uses).
pub fn hip_library() -> &'static std::result::Result<Arc<HipLibrary>, HipLoadError> {
    static HIP: OnceLock<std::result::Result<Arc<HipLibrary>, HipLoadError>> = OnceLock::new();
    HIP.get_or_init(|| HipLibrary::load().map(Arc::new))
}

/// [`hip_library`], or why it did not load as [`Error::Unsupported`].
fn process_hip() -> Result<&'static Arc<HipLibrary>> {
    hip_library().as_ref().map_err(|e| Error::Unsupported {
        capability: "hip-runtime".into(),
        reason: Reason::Unavailable { component: "HIP runtime".into(), detail: e.to_string() },
    })
}

/// Loads RCCL with the library search every constructor uses; `Error::Unsupported` says why when it cannot.
pub fn load_rccl() -> Result<Arc<CclLibrary>> {
    anyccl_gpu::load_ccl::<Hip>()
}

impl GpuPlatform for Hip {
    type Runtime = HipRuntime;
    type DeviceSpec = Arc<HipDevice>;
    type Module = HipModule;
    type Function = HipFunction;
    type Mapping = HipIpcMapping;

    const NAME: &'static str = "rocm";
    const COMM_NAME: &'static str = "RocmComm";
    const LABEL: &'static str = "ROCm";
    const VENDOR: Vendor = Vendor::Amd;
    const ALGORITHMS: &'static [Algorithm] = &ALGORITHMS;
    const NVLS_EMULATION: bool = false;
    const CCL_BINDS_DEVICE: bool = false;
    const CCL: CclVendor = CclVendor::Rccl;

    fn runtime(device: &Arc<HipDevice>) -> Result<HipRuntime> {
        Ok(HipRuntime::new(device.clone()))
    }

    fn ordinal(device: &Arc<HipDevice>) -> i32 {
        device.ordinal()
    }

    fn arch(rt: &HipRuntime) -> Result<String> {
        crate::runtime::arch_of(rt.device().library(), rt.device().ordinal())
    }

    fn stream(rt: &HipRuntime) -> Result<HipStream> {
        rt.stream()
    }

    fn kernels_not_built() -> Option<String> {
        anyccl_kernels_hip::NOT_BUILT.map(|why| format!("HIP kernels not compiled in: {why}"))
    }

    fn kernel_image(rt: &HipRuntime) -> Result<&'static [u8]> {
        let arch = Self::arch(rt)?;
        anyccl_kernels_hip::code_object_for("allreduce", &arch).ok_or_else(|| Error::Unsupported {
            capability: "custom-kernels".into(),
            reason: Reason::Unavailable {
                component: format!("HIP custom kernels on device {} ({arch})", rt.device().ordinal()),
                detail: anyccl_kernels_hip::why_not(&arch).unwrap_or_else(|| format!("no code object for {arch}")),
            },
        })
    }

    fn load_module(rt: &HipRuntime, image: &'static [u8]) -> Result<HipModule> {
        rt.refuse_during_capture("hipModuleLoadData")?;
        let dev = rt.device();
        dev.bind()?;
        let lib = dev.library();
        let mut raw: sys::hipModule_t = std::ptr::null_mut();
        // SAFETY: `image` is a complete AMDGPU code object that lives for the process; writes one handle.
        check(lib, "hipModuleLoadData", unsafe { (lib.table().module_load_data)(&mut raw, image.as_ptr().cast()) })?;
        Ok(HipModule { raw, dev: dev.clone() })
    }

    fn function(rt: &HipRuntime, module: &HipModule, name: &CStr) -> Result<HipFunction> {
        let lib = rt.device().library();
        let mut f: sys::hipFunction_t = std::ptr::null_mut();
        // SAFETY: a live module and a NUL-terminated name; writes one handle.
        check(lib, "hipModuleGetFunction", unsafe {
            (lib.table().module_get_function)(&mut f, module.raw, name.as_ptr())
        })?;
        Ok(HipFunction(f))
    }

    fn sm_count(rt: &HipRuntime) -> Result<usize> {
        let lib = rt.device().library();
        let Some(get) = lib.table().device_get_attribute else {
            // Only the occupancy of emulated ranks needs it; unknown then.
            return Ok(0);
        };
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let st = unsafe { get(&mut n, sys::HIP_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, rt.device().ordinal()) };
        check(lib, "hipDeviceGetAttribute", st)?;
        Ok(n.max(0) as usize)
    }

    unsafe fn launch(
        rt: &HipRuntime,
        f: HipFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        stream: &HipStream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let dev = rt.device();
        dev.bind()?;
        let lib = dev.library();
        // SAFETY: the caller guarantees that `params` matches the kernel's signature and its memory accesses; no
        // `extra` block is passed.
        let st = unsafe {
            (lib.table().module_launch_kernel)(
                f.0,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(lib, "hipModuleLaunchKernel", st)
    }

    fn ipc_export(rt: &HipRuntime, base: u64) -> Result<[u8; LEGACY_HANDLE_BYTES]> {
        rt.refuse_during_capture("hipIpcGetMemHandle")?;
        let dev = rt.device();
        dev.bind()?;
        let lib = dev.library();
        let mut h = sys::hipIpcMemHandle_t { reserved: [0; sys::HIP_IPC_HANDLE_BYTES] };
        // SAFETY: HIP checks that `base` is device memory it allocated and fills the handle.
        check(lib, "hipIpcGetMemHandle", unsafe { (lib.table().ipc_get_mem_handle)(&mut h, base as *mut c_void) })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    fn ipc_open(rt: &HipRuntime, handle: &[u8; LEGACY_HANDLE_BYTES], len: usize) -> Result<HipIpcMapping> {
        rt.refuse_during_capture("hipIpcOpenMemHandle")?;
        let dev = rt.device();
        dev.bind()?;
        let lib = dev.library();
        let h = sys::hipIpcMemHandle_t { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: HIP validates the handle and writes the mapped address.
        let st = unsafe { (lib.table().ipc_open_mem_handle)(&mut p, h, sys::HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) };
        check(lib, "hipIpcOpenMemHandle", st)?;
        // Owns the mapping from here: a failed check below closes it on drop. `len` comes from the peer, so the
        // mapping is used only if HIP's allocation really spans it.
        let mapping = HipIpcMapping { ptr: p as u64, dev: dev.clone() };
        let range = rt.address_range(p as u64)?;
        anyccl_core::check_allocation("rocm", "hipIpcOpenMemHandle", p as u64, len, range)?;
        Ok(mapping)
    }

    fn mapping_ptr(m: &HipIpcMapping) -> u64 {
        m.ptr
    }

    fn can_access_peer(a: &HipRuntime, b: &HipRuntime) -> Result<bool> {
        a.device().can_access_peer(b.device())
    }

    fn enable_peer_access(a: &HipRuntime, b: &HipRuntime) -> Result<()> {
        a.refuse_during_capture("hipDeviceEnablePeerAccess")?;
        a.device().bind()?;
        let lib = a.device().library();
        // SAFETY: a device ordinal HIP checks; flags must be 0.
        match unsafe { (lib.table().device_enable_peer_access)(b.device().ordinal(), 0) } {
            sys::HIP_SUCCESS | sys::HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            st => check(lib, "hipDeviceEnablePeerAccess", st),
        }
    }

    /// HIP's table here has no buffer-id attribute, so the id is the allocation itself: its base and size
    /// (`hipMemGetAddressRange`). An input freed and allocated again at the same address with the same size counts
    /// as the same input, whose table then still holds the peers' earlier mappings: like every collective's
    /// buffers, graph inputs must stay allocated while their graphs may be replayed.
    fn buffer_id(rt: &HipRuntime, ptr: u64) -> Result<u64> {
        let (base, size) = rt.address_range(ptr)?;
        Ok(base ^ (size as u64).rotate_left(32))
    }

    /// Memory `hipMemGetAddressRange` knows (a `hipMalloc` allocation) is offered for a legacy handle;
    /// `hipIpcGetMemHandle` refuses anything else, and that input stays on staging.
    fn legacy_ipc_capable(rt: &HipRuntime, ptr: u64) -> Result<()> {
        rt.address_range(ptr).map(|_| ())
    }

    unsafe fn write_word(rt: &HipRuntime, stream: &HipStream, word: u64, value: u32) -> Result<()> {
        anyccl_core::capture::refuse_if("the abort word's write", stream.is_capturing()?)?;
        let dev = rt.device();
        dev.bind()?;
        let lib = dev.library();
        if let Some(write) = lib.table().stream_write_value32 {
            // SAFETY: a live stream; the caller guarantees `word` is a 4-byte-aligned word of live device memory.
            return check(lib, "hipStreamWriteValue32", unsafe { write(stream.raw(), word as *mut c_void, value, 0) });
        }
        let Some(src) = WORDS.iter().find(|w| **w == value) else {
            return Err(Error::backend(
                "rocm",
                "the abort word's write",
                None,
                format!("{} has no hipStreamWriteValue32 and the fallback writes 0 or 1, not {value}", lib.describe()),
            ));
        };
        // SAFETY: a 4-byte copy from a static word to a 4-byte word of live device memory (the caller's
        // guarantee), in stream order on a live stream.
        let st = unsafe {
            (lib.table().memcpy_async)(
                word as *mut c_void,
                (src as *const u32).cast(),
                4,
                sys::HIP_MEMCPY_HOST_TO_DEVICE,
                stream.raw(),
            )
        };
        check(lib, "hipMemcpyAsync (the abort word)", st)
    }

    fn capabilities(
        device: &Arc<HipDevice>,
        lib: &CclLibrary,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<CapabilityReport> {
        Ok(crate::capabilities(Ok(device.library()), Some(lib), env))
    }

    fn device_count() -> Result<usize> {
        crate::runtime::device_count(process_hip()?)
    }

    fn device(ordinal: i32) -> Result<Arc<HipDevice>> {
        HipDevice::new(process_hip()?.clone(), ordinal)
    }
}
