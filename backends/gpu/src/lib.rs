//! anyccl-gpu: the GPU engine of anyccl, one communicator for both vendors, written once over a per-vendor platform
//! ([`GpuPlatform`]): the NCCL/RCCL rank, the custom one-shot / two-shot kernels (load, parameter packing, launch),
//! their peer buffers over peer access (one process) or legacy IPC handles (one process per GPU), graph-buffer
//! registration, the abort word and wait, and the bootstrap of a one-process-per-GPU job. A vendor supplies only
//! what differs: its runtime and streams, module load and raw launch, IPC handles, peer access, pointer attributes,
//! the stream-ordered write of the abort word, and its names. The `nccl.h` library itself is reached through
//! [`anyccl_ccl`].
//!
//! - [`device`]: device buffers and their views, written once for both GPU backends ([`GpuBuffer`] over a
//!   backend's [`GpuAllocation`]), and the runtime the engine needs of a backend ([`GpuRuntime`]);
//! - [`ccl_bootstrap`]: a [`anyccl_core::Bootstrap`] over a rank's own communicator ([`CclBootstrap`]), so that
//!   sub-communicators (and anything else that needs every rank's bytes) set up with no port of their own;
//! - [`kernels`]: the kernels of a device ([`CustomKernels`]), what each launch takes ([`Inputs`], [`Kind`]) and
//!   the parameter packing (the kernels' parameters are the same on every vendor,
//!   [`anyccl_kernels_common::allreduce_params`]);
//! - [`fused`]: the fused all-reduce + residual add + RMSNorm kernels ([`fused::FusedKernels`]), their choice and
//!   their host reference;
//! - [`graph_inputs`]: inputs of captured all-reduces and their registration ([`GraphInputs`]);
//! - [`push`]: the push one-shot ([`Algorithm::OneShotPush`]): its receive buffers' setting and its launch, with
//!   programmatic dependent launch where the platform has it ([`GpuPlatform::launch_dependent`]);
//! - [`quant`]: the quantized two-shot kernels (fp8 e4m3 / int8 exchanged data) of the same module;
//! - [`nvls`]: the NVLS multicast all-reduce plans over a multicast object the platform sets up
//!   ([`GpuPlatform::nvls_setup`]; by default a platform has none);
//! - [`comm`]: the communicator ([`GpuComm`]);
//! - [`multi_process`]: one process per GPU (unique id through a [`anyccl_core::Bootstrap`], the TCP rendezvous).

pub mod ccl_bootstrap;
pub mod comm;
pub mod device;
pub mod fused;
pub mod graph_inputs;
pub mod kernels;
mod launch_args;
pub mod multi_process;
pub mod nvls;
pub mod push;
pub mod quant;

use std::ffi::{c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_core::{Algorithm, CapabilityReport, Error, MemoryRuntime, Result, Vendor};

pub use ccl_bootstrap::CclBootstrap;
pub use comm::GpuComm;
pub use device::{CaptureQueries, GpuAllocation, GpuBuffer, GpuRuntime, GpuView, GpuViewMut};
pub use graph_inputs::GraphInputs;
pub use kernels::{CustomKernels, Inputs, Kind};

use anyccl_ccl::{CclLibrary, CclStream, CclVendor};

/// Bytes of a legacy IPC handle (`CUipcMemHandle`, `hipIpcMemHandle_t`: 64 on both vendors).
pub const LEGACY_HANDLE_BYTES: usize = 64;

/// A stream of platform `P`'s runtime.
pub type StreamOf<P> = <<P as GpuPlatform>::Runtime as MemoryRuntime>::Stream;
/// A device buffer of platform `P`.
pub type BufferOf<P> = GpuBuffer<<<P as GpuPlatform>::Runtime as GpuRuntime>::Allocation>;

/// What the generic communicator needs of one GPU vendor (CUDA through cudarc, HIP through anyccl's own table):
/// the runtime of a device, the kernels' module and raw launch, legacy IPC, peer access, pointer attributes, the
/// abort word's write, and the names it reports. Every call that is not capture-safe (module load, IPC, peer
/// access) refuses while a capture it would break runs, through the runtime's capture rules.
pub trait GpuPlatform: Sized + Send + Sync + 'static {
    /// The memory runtime of one device; its streams are the communicator's.
    type Runtime: GpuRuntime;
    /// What names a device to the constructors (CUDA: the ordinal; HIP: a device of a loaded runtime).
    type DeviceSpec: Clone + Send + Sync;
    /// A loaded module; unloaded when dropped.
    type Module: Send + Sync;
    /// A kernel of a loaded module (a plain handle, valid while its module lives).
    type Function: Copy + Send + Sync;
    /// A peer's buffer opened from its legacy IPC handle; closed when dropped.
    type Mapping: Send + Sync;

    /// The backend's name (`"cuda"`, `"rocm"`), as [`anyccl_core::CommBackend::name`] reports it and errors name it.
    const NAME: &'static str;
    /// The communicator's type name in hints (`"CudaComm"`).
    const COMM_NAME: &'static str;
    /// The backend's name in messages (`"CUDA"`, `"ROCm"`).
    const LABEL: &'static str;
    /// The vendor.
    const VENDOR: Vendor;
    /// Every all-reduce algorithm this backend lists (the library's, the custom kernels', and any the platform adds
    /// through [`Self::other_algorithm`]).
    const ALGORITHMS: &'static [Algorithm];
    /// Whether the module holds the NVLS emulations ([`Kind::is_nvls`]); their functions are looked up only then.
    const NVLS_EMULATION: bool;
    /// Whether the collective library makes the communicator's device current itself before a collective (NCCL
    /// does); if not, the communicator binds the device first.
    const CCL_BINDS_DEVICE: bool;

    /// The runtime of `device`.
    fn runtime(device: &Self::DeviceSpec) -> Result<Self::Runtime>;
    /// The ordinal `ncclCommInitAll` takes for `device`.
    fn ordinal(device: &Self::DeviceSpec) -> i32;
    /// The device's architecture (`"sm_90"`, `"gfx942"`).
    fn arch(runtime: &Self::Runtime) -> Result<String>;
    /// A new stream of the runtime's device.
    fn stream(runtime: &Self::Runtime) -> Result<StreamOf<Self>>;

    /// Why the custom kernels are not in this build at all (no nvcc/hipcc at build time), as a sentence.
    fn kernels_not_built() -> Option<String>;
    /// The kernels' image for the runtime's device (cubin, code object), or why there is none.
    fn kernel_image(runtime: &Self::Runtime) -> Result<&'static [u8]>;
    /// Loads `image` as a module on the runtime's device. Refused during capture.
    fn load_module(runtime: &Self::Runtime, image: &'static [u8]) -> Result<Self::Module>;
    /// The kernel `name` of `module`.
    fn function(runtime: &Self::Runtime, module: &Self::Module, name: &CStr) -> Result<Self::Function>;
    /// The device's multiprocessor (compute unit) count.
    fn sm_count(runtime: &Self::Runtime) -> Result<usize>;
    /// How many blocks of `threads` threads of `f` fit on one multiprocessor at once.
    fn max_active_blocks_per_sm(runtime: &Self::Runtime, f: Self::Function, threads: u32) -> Result<usize> {
        let _ = (runtime, f, threads);
        Err(Error::backend(Self::NAME, "occupancy", None, "the occupancy query is not available on this backend"))
    }
    /// Launches `f` on `stream` with `grid` × `block` threads and the kernel parameters `params` (one pointer per
    /// parameter, `cuLaunchKernel`/`hipModuleLaunchKernel`'s `kernelParams`).
    ///
    /// # Safety
    /// `params` matches `f`'s signature and points to live values; the kernel's memory accesses are valid.
    unsafe fn launch(
        runtime: &Self::Runtime,
        f: Self::Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        stream: &StreamOf<Self>,
        params: &mut [*mut c_void],
    ) -> Result<()>;

    /// Why launches on the runtime's device cannot use programmatic dependent launch
    /// ([`Self::launch_dependent`]), or `None` when they can. Default: the platform has none.
    fn dependent_launch_unavailable(runtime: &Self::Runtime) -> Option<String> {
        let _ = runtime;
        Some(format!("{} has no programmatic dependent launch", Self::LABEL))
    }
    /// [`Self::launch`] with programmatic dependent launch: the kernel may start while the stream's previous
    /// kernel still finishes, and waits for it where it says so (CUDA sm_90+: the programmatic-stream-serialization
    /// attribute through `cuLaunchKernelEx`). Only called when [`Self::dependent_launch_unavailable`] is `None`;
    /// the default is the plain launch.
    ///
    /// # Safety
    /// As for [`Self::launch`].
    unsafe fn launch_dependent(
        runtime: &Self::Runtime,
        f: Self::Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        stream: &StreamOf<Self>,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract is the plain launch's.
        unsafe { Self::launch(runtime, f, grid, block, stream, params) }
    }

    /// The legacy IPC handle of the allocation starting at `base` (memory of `cuMemAlloc`/`hipMalloc`). Refused
    /// during capture.
    fn ipc_export(runtime: &Self::Runtime, base: u64) -> Result<[u8; LEGACY_HANDLE_BYTES]>;
    /// Opens a peer's handle for `len` bytes; the mapping is checked to span `len` bytes. Refused during capture.
    fn ipc_open(runtime: &Self::Runtime, handle: &[u8; LEGACY_HANDLE_BYTES], len: usize) -> Result<Self::Mapping>;
    /// The device address of a mapping.
    fn mapping_ptr(mapping: &Self::Mapping) -> u64;
    /// Whether the device of `a` can access the memory of `b`'s.
    fn can_access_peer(a: &Self::Runtime, b: &Self::Runtime) -> Result<bool>;
    /// Lets the device of `a` access `b`'s memory; already enabled is fine.
    fn enable_peer_access(a: &Self::Runtime, b: &Self::Runtime) -> Result<()>;
    /// An identity of the allocation `ptr` lies in, which changes when the memory is freed and allocated again
    /// (graph inputs are known by pointer and this id); an error for memory the runtime does not know.
    fn buffer_id(runtime: &Self::Runtime, ptr: u64) -> Result<u64>;
    /// Whether `ptr` lies in memory a legacy IPC handle can share (else why not).
    fn legacy_ipc_capable(runtime: &Self::Runtime, ptr: u64) -> Result<()>;
    /// Writes the 32-bit `value` at device address `word` in stream order on `stream` (the abort word).
    ///
    /// # Safety
    /// `word` is a 4-byte aligned word of live device memory of the runtime's device.
    unsafe fn write_word(runtime: &Self::Runtime, stream: &StreamOf<Self>, word: u64, value: u32) -> Result<()>;

    /// Why `algorithm` (listed in [`Self::ALGORITHMS`], neither the library's nor the custom kernels') cannot run on
    /// a communicator with capabilities `caps`.
    fn other_algorithm(caps: &CapabilityReport, algorithm: Algorithm) -> String {
        let _ = caps;
        format!("{algorithm} is not implemented by the {} backend yet", Self::LABEL)
    }

    /// Sets an NVLS multicast object up for the ranks of one process (`runtimes[rank]`): every rank's staging-in,
    /// staging-out and flag buffers of `capacity`, `capacity` and [`anyccl_kernels_common::FLAG_BYTES`] bytes bound
    /// to it and mapped, one [`nvls::NvlsMemory`] per rank, or why not as a sentence. Called only where the
    /// capability report has multicast on; the platform checks its own gate again before any multicast call.
    /// Default: the platform has no multicast (nothing is called).
    fn nvls_setup(
        runtimes: &[&Self::Runtime],
        capacity: usize,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> std::result::Result<Vec<nvls::NvlsMemory>, String> {
        let _ = (runtimes, capacity, env);
        Err(format!("the {} backend has no multicast", Self::LABEL))
    }

    /// Sets this rank's part of an NVLS multicast object up for a communicator of one process per GPU: the same as
    /// [`Self::nvls_setup`] for one rank (its staging-in, staging-out and flag buffers bound to one object shared
    /// by every rank of `bootstrap`, which is this communicator's group), the object's handle moving between the
    /// processes through `bootstrap` and whatever channel the platform uses. Collective: every rank calls it, and
    /// every rank reaches every exchange even after a local failure, so that all ranks return `Ok` or all return
    /// `Err` (the first failing rank's reason, as a sentence). Called only where every rank's capability report has
    /// multicast on. Default: the platform has no multicast (nothing is called, on every rank alike).
    fn nvls_setup_rank(
        runtime: &Self::Runtime,
        bootstrap: &mut dyn anyccl_core::Bootstrap,
        capacity: usize,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> std::result::Result<nvls::NvlsMemory, String> {
        let _ = (runtime, bootstrap, capacity, env);
        Err(format!("the {} backend has no multicast", Self::LABEL))
    }

    /// The collective library of this vendor (NCCL, RCCL).
    const CCL: CclVendor;
    /// The capability report of a communicator on `device` over `lib` (`env` reads the environment).
    fn capabilities(
        device: &Self::DeviceSpec,
        lib: &CclLibrary,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<CapabilityReport>;
    /// The number of devices of this process's runtime (for a rank of a job that did not name its device).
    fn device_count() -> Result<usize>;
    /// Device `ordinal` of this process's runtime.
    fn device(ordinal: i32) -> Result<Self::DeviceSpec>;
}

/// Loads the collective library of platform `P` ([`GpuPlatform::CCL`]) with the standard search;
/// [`Error::Unsupported`] says why when it cannot.
pub fn load_ccl<P: GpuPlatform>() -> Result<Arc<CclLibrary>> {
    anyccl_ccl::load(P::CCL).map_err(|e| Error::Unsupported {
        capability: "ccl".into(),
        reason: anyccl_core::Reason::Unavailable { component: P::CCL.to_string(), detail: e.to_string() },
    })
}

/// The device of a rank of a one-process-per-GPU job: `device` when given, else the local rank (or the rank)
/// modulo the number of devices.
pub fn device_for_rank<P: GpuPlatform>(
    device: Option<i32>,
    local_rank: Option<usize>,
    rank: usize,
) -> Result<P::DeviceSpec> {
    let ordinal = match device {
        Some(d) => d,
        None => {
            let count = P::device_count()?.max(1);
            let slot = local_rank.unwrap_or(rank) % count;
            // `slot < count`, which came from an i32 device count.
            i32::try_from(slot).map_err(|_| Error::backend(P::NAME, "device", None, format!("device {slot}")))?
        }
    };
    P::device(ordinal)
}

/// Polls `stream` until its work is done, for at most `limit`: `Ok(false)` when it was still busy then. Refused
/// while the stream is being captured (the query would break the capture).
pub fn done_within<S: CclStream + ?Sized>(stream: &S, limit: Duration) -> Result<bool> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(20);
    while !stream.query()? {
        if start.elapsed() >= limit {
            return Ok(false);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
    Ok(true)
}

/// Tells every custom kernel of the rank whose flag array is `flags` to stop waiting for its peers: sets the abort
/// word ([`anyccl_kernels_common::ABORT_WORD_OFFSET`]) in stream order on `stream` (CUDA: `cuStreamWriteValue32`),
/// which must not be the stream the kernels are stuck on, and waits for that write (at most `limit`). Kernels
/// launched after it stop at their first barrier that waits long, so the rank's custom kernels are finished with
/// for good: use it once a wait has given up on a peer. Not during capture.
pub fn stop_waiting<P: GpuPlatform>(
    runtime: &P::Runtime,
    flags: &BufferOf<P>,
    stream: &StreamOf<P>,
    limit: Duration,
) -> Result<()> {
    if flags.len() < anyccl_kernels_common::FLAG_BYTES {
        return Err(Error::backend(
            P::NAME,
            "stop the custom kernels",
            None,
            format!("a flag array holds {} bytes, this one {}", anyccl_kernels_common::FLAG_BYTES, flags.len()),
        ));
    }
    anyccl_core::capture::refuse_if("the abort word's write", stream.is_capturing()?)?;
    let word = flags.device_ptr() + anyccl_kernels_common::ABORT_WORD_OFFSET as u64;
    // SAFETY: `word` is a 4-byte-aligned word inside the live flag array (length checked above).
    unsafe { P::write_word(runtime, stream, word, 1) }?;
    if !done_within(stream, limit)? {
        return Err(Error::Timeout { what: "the abort word's write".into(), after: limit });
    }
    Ok(())
}
