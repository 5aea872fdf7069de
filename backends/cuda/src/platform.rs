//! The CUDA platform of the generic GPU communicator ([`anyccl_gpu::GpuPlatform`]): the CUDA driver through
//! cudarc for module load and launch, legacy IPC handles, peer access, pointer attributes and the abort word's
//! `cuStreamWriteValue32`; NCCL as the collective library; the NVLS multicast object (feature `multicast`).

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use anyccl_ccl::{CclLibrary, CclVendor};
use anyccl_core::{Algorithm, Capabilities, CapabilityReport, Error, MemoryRuntime, Reason, Result, Vendor};
use anyccl_gpu::{GpuPlatform, LEGACY_HANDLE_BYTES};
use cudarc::driver::{result, sys};

use crate::driver::cu_err;
use crate::ipc::LegacyMapping;
use crate::runtime::{CudaRuntime, CudaStream};

/// The all-reduce algorithms of the CUDA backend. The NVLS ones run where multicast is on and set up (the
/// `multicast` feature, devices that report it, `NCCL_NVLS_ENABLE` not 0, `ANYCCL_DISABLE` allowing it, ranks of
/// one process); elsewhere selection says why not. The push one-shot runs where
/// the custom kernels' setup allocated and exchanged its receive buffers (`ANYCCL_PUSH_MAX_BYTES`). The
/// quantized two-shots are lossy: they run only where named (see [`Algorithm::is_lossy`]).
pub const ALGORITHMS: [Algorithm; 11] = [
    Algorithm::Ccl,
    Algorithm::CclSymmetric,
    Algorithm::OneShot,
    Algorithm::TwoShot,
    Algorithm::NvlsZeroCopy,
    Algorithm::NvlsWarpPipeline,
    Algorithm::NvlsBlockPipeline,
    Algorithm::OneShotPush,
    Algorithm::TwoShotPush,
    Algorithm::TwoShotFp8,
    Algorithm::TwoShotInt8,
];

/// The CUDA platform (a marker type: [`crate::CudaComm`] is `GpuComm<Cuda>`).
#[derive(Debug, Clone, Copy)]
pub struct Cuda;

/// A loaded CUDA module (`cuModuleLoadData`), unloaded on drop.
pub struct CudaModule {
    module: sys::CUmodule,
    runtime: CudaRuntime,
}

// SAFETY: a module and its functions may be used from any thread of the process.
unsafe impl Send for CudaModule {}
// SAFETY: as above; launching is thread-safe in the driver.
unsafe impl Sync for CudaModule {}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let _ = self.runtime.context().bind();
        // SAFETY: loaded in `load_module`, unloaded once.
        if let Err(e) = unsafe { result::module::unload(self.module) } {
            tracing::warn!(error = %cu_err("cuModuleUnload", e), "unloading the kernels failed");
        }
    }
}

/// A kernel of a [`CudaModule`] (`CUfunction`).
#[derive(Debug, Clone, Copy)]
pub struct CudaFunction(sys::CUfunction);

// SAFETY: a function handle may be launched from any thread while its module is loaded.
unsafe impl Send for CudaFunction {}
// SAFETY: as above.
unsafe impl Sync for CudaFunction {}

fn pointer_attribute(rt: &CudaRuntime, attr: sys::CUpointer_attribute, ptr: u64) -> Result<u64> {
    rt.context().bind()?;
    let mut v = 0u64;
    // SAFETY: both attributes asked for here write at most 8 bytes (a u64 buffer id, an int flag).
    unsafe { sys::cuPointerGetAttribute((&mut v as *mut u64).cast(), attr, ptr) }
        .result()
        .map_err(|e| cu_err("cuPointerGetAttribute", e))?;
    Ok(v)
}

/// Why the NVLS algorithms cannot run on a communicator with capabilities `caps` (the engine answers for them
/// itself; this is only asked of an algorithm it does not know).
fn nvls_unavailable(caps: &CapabilityReport) -> String {
    match caps.require(Capabilities::MULTICAST) {
        Err(e) => e.to_string(),
        Ok(()) => "the NVLS plans are set up by CudaComm::init_all or CudaComm::enable_nvls only".into(),
    }
}

/// Oldest driver with `cuLaunchKernelEx` and its launch attributes (CUDA 11.8).
const LAUNCH_EX_DRIVER: i32 = 11080;

/// Why launches on device `ordinal` cannot use programmatic dependent launch, or `None` when they can: the device
/// must be compute capability 9.0 or newer, and the driver must have `cuLaunchKernelEx` (CUDA 11.8; looked up in
/// the loaded driver library, since cudarc panics on a missing symbol).
pub fn dependent_launch_unavailable(ordinal: i32) -> Option<String> {
    let info = match crate::driver::probe() {
        Ok(info) => info,
        Err(reason) => return Some(reason.to_string()),
    };
    let Some(dev) = info.devices.iter().find(|d| d.ordinal == ordinal) else {
        return Some(format!("device {ordinal} is not among the driver's devices"));
    };
    let (major, minor) = dev.compute_capability;
    if major < 9 {
        return Some(format!(
            "device {ordinal} is compute capability {major}.{minor}: programmatic dependent launch needs sm_90 or newer"
        ));
    }
    if info.version < LAUNCH_EX_DRIVER {
        return Some(format!("driver {} lacks cuLaunchKernelEx (CUDA 11.8 or newer)", info.version_string()));
    }
    // Asked once (this runs before every push launch too).
    static LAUNCH_EX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*LAUNCH_EX.get_or_init(|| crate::driver::has_symbol("cuLaunchKernelEx")) {
        return Some("the CUDA driver library does not export cuLaunchKernelEx".into());
    }
    None
}

/// Loads NCCL with the library search every constructor uses; `Error::Unsupported` says why when it cannot.
pub fn load_nccl() -> Result<Arc<CclLibrary>> {
    anyccl_gpu::load_ccl::<Cuda>()
}

impl GpuPlatform for Cuda {
    type Runtime = CudaRuntime;
    type DeviceSpec = i32;
    type Module = CudaModule;
    type Function = CudaFunction;
    type Mapping = LegacyMapping;

    const NAME: &'static str = "cuda";
    const COMM_NAME: &'static str = "CudaComm";
    const LABEL: &'static str = "CUDA";
    const VENDOR: Vendor = Vendor::Nvidia;
    const ALGORITHMS: &'static [Algorithm] = &ALGORITHMS;
    const NVLS_EMULATION: bool = true;
    const CCL_BINDS_DEVICE: bool = true;
    const CCL: CclVendor = CclVendor::Nccl;

    fn runtime(device: &i32) -> Result<CudaRuntime> {
        CudaRuntime::new(*device)
    }

    fn ordinal(device: &i32) -> i32 {
        *device
    }

    fn arch(rt: &CudaRuntime) -> Result<String> {
        let info = crate::driver::probe()
            .map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        let ordinal = rt.context().ordinal();
        Ok(info.devices.iter().find(|d| d.ordinal == ordinal).map(|d| d.arch()).unwrap_or_else(|| "unknown".into()))
    }

    fn stream(rt: &CudaRuntime) -> Result<CudaStream> {
        rt.stream()
    }

    fn kernels_not_built() -> Option<String> {
        anyccl_kernels_cuda::NOT_BUILT.map(|why| format!("custom kernels not compiled in: {why}"))
    }

    fn kernel_image(rt: &CudaRuntime) -> Result<&'static [u8]> {
        let ctx = rt.context();
        let info = crate::driver::probe()
            .map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        let dev = info.devices.iter().find(|d| d.ordinal == ctx.ordinal());
        let (major, minor) = dev.map_or((0, 0), |d| d.compute_capability);
        anyccl_kernels_cuda::cubin_for("allreduce", major, minor).ok_or_else(|| Error::Unsupported {
            capability: "custom-kernels".into(),
            reason: Reason::DeviceAttribute {
                device: format!("device {}", ctx.ordinal()),
                attribute: format!("compute capability {major}.{minor} (kernels are built for sm_80, sm_90, sm_100)"),
            },
        })
    }

    fn load_module(rt: &CudaRuntime, image: &'static [u8]) -> Result<CudaModule> {
        rt.refuse_during_capture("cuModuleLoadData")?;
        rt.context().bind()?;
        // The driver wants the image at a stable address for the call; copy it into an owned buffer.
        let owned = image.to_vec();
        // SAFETY: `owned` holds a complete cubin; the driver copies what it needs before returning.
        let module =
            unsafe { result::module::load_data(owned.as_ptr().cast()) }.map_err(|e| cu_err("cuModuleLoadData", e))?;
        Ok(CudaModule { module, runtime: rt.clone() })
    }

    fn function(_rt: &CudaRuntime, module: &CudaModule, name: &CStr) -> Result<CudaFunction> {
        // SAFETY: live module; looking a function up by name only reads the module.
        unsafe { result::module::get_function(module.module, name.to_owned()) }
            .map(CudaFunction)
            .map_err(|e| cu_err("cuModuleGetFunction", e))
    }

    fn sm_count(rt: &CudaRuntime) -> Result<usize> {
        let sms = result::device::get(rt.context().ordinal())
            .and_then(|d| {
                // SAFETY: a valid device handle; reading an attribute has no side effects.
                unsafe {
                    result::device::get_attribute(d, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                }
            })
            .map_err(|e| cu_err("cuDeviceGetAttribute", e))?;
        Ok(sms.max(0) as usize)
    }

    fn max_active_blocks_per_sm(rt: &CudaRuntime, f: CudaFunction, threads: u32) -> Result<usize> {
        rt.context().bind()?;
        let threads = i32::try_from(threads).unwrap_or(i32::MAX);
        // SAFETY: a function of a loaded module; the query has no side effects.
        let per_sm = unsafe { result::occupancy::max_active_block_per_multiprocessor(f.0, threads, 0) }
            .map_err(|e| cu_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok(per_sm.max(0) as usize)
    }

    unsafe fn launch(
        rt: &CudaRuntime,
        f: CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        stream: &CudaStream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        rt.context().bind()?;
        // SAFETY: the caller guarantees that `params` matches the kernel's signature and its memory accesses.
        unsafe { result::launch_kernel(f.0, grid, block, 0, stream.raw(), params) }
            .map_err(|e| cu_err("cuLaunchKernel", e))
    }

    fn dependent_launch_unavailable(rt: &CudaRuntime) -> Option<String> {
        dependent_launch_unavailable(rt.context().ordinal())
    }

    unsafe fn launch_dependent(
        rt: &CudaRuntime,
        f: CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        stream: &CudaStream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // Checked again here: cudarc panics on a symbol the driver lacks.
        if let Some(why) = dependent_launch_unavailable(rt.context().ordinal()) {
            return Err(Error::backend("cuda", "cuLaunchKernelEx", None, why));
        }
        // SAFETY: an all-zero launch attribute is valid plain data (id 0 is CU_LAUNCH_ATTRIBUTE_IGNORE).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: 0,
            hStream: stream.raw(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        rt.context().bind()?;
        // SAFETY: the caller guarantees that `params` matches the kernel's signature and its memory accesses;
        // `config` and `attr` outlive the call; the driver has the symbol (checked above).
        unsafe { sys::cuLaunchKernelEx(&config, f.0, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| cu_err("cuLaunchKernelEx", e))
    }

    fn ipc_export(rt: &CudaRuntime, base: u64) -> Result<[u8; LEGACY_HANDLE_BYTES]> {
        rt.refuse_during_capture("cuIpcGetMemHandle")?;
        crate::ipc::export_legacy_ptr(rt.context(), base)
    }

    fn ipc_open(rt: &CudaRuntime, handle: &[u8; LEGACY_HANDLE_BYTES], len: usize) -> Result<LegacyMapping> {
        rt.refuse_during_capture("cuIpcOpenMemHandle")?;
        LegacyMapping::open(rt.context(), handle, len)
    }

    fn mapping_ptr(m: &LegacyMapping) -> u64 {
        m.device_ptr()
    }

    fn can_access_peer(a: &CudaRuntime, b: &CudaRuntime) -> Result<bool> {
        a.context().can_access_peer(b.context())
    }

    fn enable_peer_access(a: &CudaRuntime, b: &CudaRuntime) -> Result<()> {
        a.context().enable_peer_access(b.context())
    }

    fn buffer_id(rt: &CudaRuntime, ptr: u64) -> Result<u64> {
        pointer_attribute(rt, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)
    }

    fn legacy_ipc_capable(rt: &CudaRuntime, ptr: u64) -> Result<()> {
        let capable =
            pointer_attribute(rt, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)?;
        if capable & 0xffff_ffff == 0 {
            return Err(Error::backend(
                "cuda",
                "graph buffers",
                None,
                format!("{ptr:#x} is not cuMemAlloc memory (a cuMem/VMM, managed or host allocation)"),
            ));
        }
        Ok(())
    }

    unsafe fn write_word(rt: &CudaRuntime, stream: &CudaStream, word: u64, value: u32) -> Result<()> {
        stream.refuse_if_capturing("cuStreamWriteValue32")?;
        rt.context().bind()?;
        // SAFETY: a live stream; the caller guarantees `word` is a 4-byte-aligned word of live device memory.
        let st = unsafe {
            sys::cuStreamWriteValue32_v2(
                stream.raw(),
                word,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        };
        if st != sys::CUresult::CUDA_SUCCESS {
            return Err(cu_err("cuStreamWriteValue32", cudarc::driver::DriverError(st)));
        }
        Ok(())
    }

    fn other_algorithm(caps: &CapabilityReport, algorithm: Algorithm) -> String {
        match algorithm {
            Algorithm::NvlsZeroCopy | Algorithm::NvlsWarpPipeline | Algorithm::NvlsBlockPipeline => {
                nvls_unavailable(caps)
            }
            other => format!("{other} is not implemented by the CUDA backend yet"),
        }
    }

    #[cfg(feature = "multicast")]
    fn nvls_setup(
        runtimes: &[&CudaRuntime],
        capacity: usize,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> std::result::Result<Vec<anyccl_gpu::nvls::NvlsMemory>, String> {
        crate::nvls::setup(runtimes, capacity, env)
    }

    #[cfg(feature = "multicast")]
    fn nvls_setup_rank(
        runtime: &CudaRuntime,
        bootstrap: &mut dyn anyccl_core::Bootstrap,
        capacity: usize,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> std::result::Result<anyccl_gpu::nvls::NvlsMemory, String> {
        crate::nvls::setup_rank(runtime, bootstrap, capacity, env)
    }

    fn capabilities(_device: &i32, lib: &CclLibrary, env: &dyn Fn(&str) -> Option<String>) -> Result<CapabilityReport> {
        Ok(crate::capabilities(Some(lib), env))
    }

    fn device_count() -> Result<usize> {
        let info = crate::driver::probe()
            .map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        Ok(info.devices.len())
    }

    fn device(ordinal: i32) -> Result<i32> {
        Ok(ordinal)
    }
}
