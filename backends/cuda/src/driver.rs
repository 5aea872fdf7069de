//! The CUDA driver, probed before use: cudarc panics when `libcuda.so.1` is absent, so anyccl checks first and
//! reports "CUDA backend unavailable: libcuda.so.1 not found" instead.

use std::sync::OnceLock;

use anyccl_core::{Error, Reason};
use cudarc::driver::{result, sys, DriverError};

/// Converts a driver error into anyccl's error, keeping the driver's own name and text.
pub fn cu_err(call: &str, e: DriverError) -> Error {
    let name = e.error_name().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    let text = e.error_string().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    Error::backend("cuda", call, Some(e.0 as i64), format!("{name}: {text}"))
}

/// The location "device `ordinal`" for the cuMem calls, whichever CUDA version cudarc was built for: up to CUDA
/// 13.1 cudarc's `CUmemLocation` is `{ type_, id }`, from 13.2 on `{ type_, union { id, .. } }`. In C both are
/// `{ CUmemLocationType type; int id; }` in memory, so one value serves both (the library builds against the
/// version the final binary chooses, or cudarc's newest without nvcc).
pub(crate) fn device_location(ordinal: i32) -> sys::CUmemLocation {
    #[repr(C)]
    struct Plain {
        type_: sys::CUmemLocationType,
        id: std::ffi::c_int,
    }
    const _: () = assert!(std::mem::align_of::<Plain>() == std::mem::align_of::<sys::CUmemLocation>());
    let plain = Plain { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    // SAFETY: both are `repr(C)` with the same size (transmute checks it at compile time) and alignment (asserted
    // above): the location type first, then the C `int` device id, alone or as the first member of a union of
    // 4-byte members, so every bit pattern of `Plain` is a valid `CUmemLocation` meaning the same device.
    unsafe { std::mem::transmute::<Plain, sys::CUmemLocation>(plain) }
}

/// One device as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: i32,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`.
    pub multicast_supported: bool,
    /// Total memory in bytes.
    pub total_memory: usize,
}

impl DeviceInfo {
    /// `sm_90` style architecture name.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// What the driver offers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverInfo {
    /// `cuDriverGetVersion` (e.g. 13000).
    pub version: i32,
    /// Every device.
    pub devices: Vec<DeviceInfo>,
}

impl DriverInfo {
    /// `13.0`.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

/// Loads and initialises the driver once per process. `Err` carries the reason the backend is unavailable.
pub fn probe() -> Result<&'static DriverInfo, Reason> {
    static PROBE: OnceLock<Result<DriverInfo, Reason>> = OnceLock::new();
    PROBE.get_or_init(probe_uncached).as_ref().map_err(Clone::clone)
}

/// The driver library's names: the soname first, then the development link (what cudarc also tries).
const LIBCUDA_NAMES: &[&str] = if cfg!(windows) { &["nvcuda.dll"] } else { &["libcuda.so.1", "libcuda.so"] };

/// Whether the dynamic loader finds the driver library. Asked here rather than through cudarc's
/// `is_culib_present`, which exists only when the binary chose cudarc's `dynamic-loading`: with
/// `dynamic-linking` (candle's choice) the library is already loaded and the answer is yes.
fn libcuda_loadable() -> bool {
    LIBCUDA_NAMES.iter().any(|name| {
        // SAFETY: loads the NVIDIA driver library by its system name, as cudarc itself does before its first call;
        // its initialisers are the driver's own. No symbol is called here, and the handle is closed on drop (the
        // library stays loaded while cudarc holds it).
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// Whether the driver library exports `symbol` (asked of the dynamic loader, once per symbol name; cudarc would
/// panic on calling a symbol the driver lacks).
pub fn has_symbol(symbol: &str) -> bool {
    static FOUND: std::sync::Mutex<Vec<(String, bool)>> = std::sync::Mutex::new(Vec::new());
    let mut found = FOUND.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, yes)) = found.iter().find(|(s, _)| s == symbol) {
        return *yes;
    }
    let mut name = symbol.as_bytes().to_vec();
    name.push(0);
    let yes = LIBCUDA_NAMES.iter().any(|lib| {
        // SAFETY: as in `libcuda_loadable`: the driver library by its system name; no symbol is called, only
        // looked up, and the handle is closed on drop (the library stays loaded while cudarc holds it).
        match unsafe { libloading::Library::new(*lib) } {
            // SAFETY: a lookup only; the pointer is not used.
            Ok(l) => unsafe { l.get::<*const std::ffi::c_void>(name.as_slice()) }.is_ok(),
            Err(_) => false,
        }
    });
    found.push((symbol.to_owned(), yes));
    yes
}

fn probe_uncached() -> Result<DriverInfo, Reason> {
    let unavailable = |detail: String| Reason::Unavailable { component: "libcuda.so.1".into(), detail };
    if !libcuda_loadable() {
        return Err(unavailable("not found by the dynamic loader (no NVIDIA driver installed)".into()));
    }
    result::init().map_err(|e| unavailable(format!("cuInit failed: {}", cu_err("cuInit", e))))?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| unavailable(format!("cuDriverGetVersion failed: {}", cu_err("cuDriverGetVersion", e))))?;
    let count = result::device::get_count().map_err(|e| unavailable(cu_err("cuDeviceGetCount", e).to_string()))?;
    if count == 0 {
        return Err(Reason::Unavailable {
            component: "NVIDIA GPU".into(),
            detail: "the driver reports no device".into(),
        });
    }
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(|e| unavailable(cu_err("cuDeviceGet", e).to_string()))?;
        let attr = |a: sys::CUdevice_attribute| -> i32 {
            // SAFETY: `dev` is a valid device handle; reading an attribute has no side effects.
            unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
        };
        let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
        devices.push(DeviceInfo {
            ordinal,
            name,
            compute_capability: (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            multicast_supported: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) != 0,
            // SAFETY: valid device handle.
            total_memory: unsafe { result::device::total_mem(dev) }.unwrap_or(0),
        });
    }
    Ok(DriverInfo { version, devices })
}
