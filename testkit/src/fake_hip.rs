//! The fake HIP runtime (`fake_hip.c`) and fake RCCL libraries whose collectives compute on its host-backed
//! "device" memory (`fake_rccl.c`), compiled at test time with the system `cc`. Each RCCL profile of
//! `fake_ccl.rs` gives the exported symbol set; the fake RCCL links the fake HIP runtime by soname, as the real
//! one links libamdhip64.

use std::path::{Path, PathBuf};

use crate::fake_ccl::{self, Profile};

const HIP_C: &str = include_str!("../c/fake_hip.c");
/// The fake HIP runtime's soname.
pub const HIP_SONAME: &str = "libamdhip64.so.6";

/// The fake HIP runtime, built once per test process.
pub fn build_hip() -> PathBuf {
    // The host kernels first: the libraries after them resolve their references.
    let mut args = fake_ccl::host_kernel_args();
    args.extend([
        format!("-Wl,-soname,{HIP_SONAME}"),
        // nodelete: the streams' worker threads run code of the library, so a dlclose by the last handle of a
        // test must not unmap it (another test would load a fresh copy under the old threads).
        "-Wl,-z,nodelete".into(),
        "-lpthread".into(),
        // The host kernels' f32 arithmetic (fmaf, sqrtf, rintf), one rounding per operation, as on a GPU.
        "-lm".into(),
        "-ffp-contract=off".into(),
    ]);
    fake_ccl::compile_once(&format!("hip/{HIP_SONAME}"), HIP_C, &args)
}

/// A computing fake RCCL with the symbol set of `p`, linked against the fake HIP runtime.
pub fn build_rccl(p: &Profile) -> PathBuf {
    fake_ccl::build_computing(p, "compute", &build_hip())
}

/// The fake HIP runtime's test interface, reached through the same loaded copy the backend uses.
pub struct FakeHip {
    lib: libloading::Library,
}

impl FakeHip {
    /// Opens the fake runtime (already loaded by the backend or the fake RCCL: the same instance).
    pub fn open(path: &Path) -> Self {
        // SAFETY: the fake runtime built above; its initialisers do nothing.
        FakeHip { lib: unsafe { libloading::Library::new(path) }.expect("open the fake HIP runtime") }
    }

    /// Capture violations recorded so far.
    pub fn violations(&self) -> Vec<String> {
        // SAFETY: the fake exports these with these C signatures.
        unsafe {
            let count = self.lib.get::<unsafe extern "C" fn() -> i32>(b"fakehip_violation_count\0").expect("sym");
            let get = self
                .lib
                .get::<unsafe extern "C" fn(i32) -> *const std::ffi::c_char>(b"fakehip_violation\0")
                .expect("sym");
            (0..count()).map(|i| std::ffi::CStr::from_ptr(get(i)).to_string_lossy().into_owned()).collect()
        }
    }

    /// How often `name` was called.
    pub fn calls(&self, name: &str) -> i32 {
        let c = std::ffi::CString::new(name).expect("name");
        // SAFETY: as above.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*const std::ffi::c_char) -> i32>(b"fakehip_call_count\0");
            f.expect("sym")(c.as_ptr())
        }
    }

    /// Clears the records.
    pub fn reset(&self) {
        // SAFETY: as above.
        unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fakehip_reset\0").expect("sym")() }
    }

    /// Marks `stream` busy (its work never finishes, as with a peer that died) or idle again.
    pub fn set_busy(&self, stream: *mut std::ffi::c_void, busy: bool) {
        // SAFETY: as above.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*mut std::ffi::c_void, i32)>(b"fakehip_set_busy\0");
            f.expect("sym")(stream, i32::from(busy))
        }
    }

    /// Makes the next `hipMalloc` return success with a null pointer, as a broken runtime might.
    pub fn next_malloc_null(&self) {
        // SAFETY: as above.
        unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fakehip_next_malloc_null\0").expect("sym")() }
    }

    /// Makes `hipMemGetAddressRange` report every allocation `bytes` shorter than it is (0: the truth).
    pub fn set_range_shrink(&self, bytes: usize) {
        // SAFETY: as above.
        unsafe { self.lib.get::<unsafe extern "C" fn(usize)>(b"fakehip_set_range_shrink\0").expect("sym")(bytes) }
    }

    /// Makes the next `count` `hipMemcpyAsync` calls of exactly `bytes` bytes on a stream of device `device` fail
    /// (hipErrorInvalidValue); `count` 0 turns it off.
    pub fn fail_copies(&self, device: i32, bytes: usize, count: i32) {
        // SAFETY: as above.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(i32, usize, i32)>(b"fakehip_fail_copies\0");
            f.expect("sym")(device, bytes, count)
        }
    }

    /// Makes the next `count` launches of a kernel whose name starts with `prefix` fail with
    /// hipErrorLaunchFailure (719, CUDA's CUDA_ERROR_LAUNCH_FAILED too) before anything runs; `count` 0 turns it
    /// off.
    pub fn fail_launches(&self, prefix: &str, count: i32) {
        let prefix = std::ffi::CString::new(prefix).expect("a kernel name prefix without NUL");
        // SAFETY: as above; the fake copies the prefix.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*const std::ffi::c_char, i32)>(b"fakehip_fail_launches\0");
            f.expect("sym")(prefix.as_ptr(), count)
        }
    }

    /// Bytes of every live allocation of the fake's "device" memory (all devices), from `hipMemGetInfo`.
    pub fn used_bytes(&self) -> usize {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: hipMemGetInfo writes two sizes.
        let rc = unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*mut usize, *mut usize) -> i32>(b"hipMemGetInfo\0");
            f.expect("sym")(&mut free, &mut total)
        };
        assert_eq!(rc, 0, "hipMemGetInfo");
        total - free
    }

    /// Calls `hipMalloc` directly (to prove the fake enforces the rules); returns HIP's status.
    pub fn raw_malloc(&self, bytes: usize) -> i32 {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: hipMalloc writes one pointer.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*mut *mut std::ffi::c_void, usize) -> i32>(b"hipMalloc\0");
            f.expect("sym")(&mut p, bytes)
        }
    }
}

/// `struct fakehip_launch` of fake_hip.c, field for field (the C side refuses a copy of another size).
#[repr(C)]
#[derive(Clone, Copy)]
struct RawLaunch {
    seq: u64,
    name: [std::ffi::c_char; 64],
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    capturing: i32,
    stream: u64,
    status: i32,
    kernel: i32,
    table_kernel: i32,
    dtype: i32,
    rank: i32,
    world: i32,
    table: u64,
    self_src: u64,
    out: u64,
    round_vecs: u64,
    n_vec: u64,
    inputs: [u64; 8],
    scratch: [u64; 8],
    flags: [u64; 8],
    runs: u32,
    completed: u32,
    aborted: u32,
    timed_out: u32,
    failed: u32,
    last_registered: i32,
    recv: [u64; 8],
    my_flags: u64,
    pdl: i32,
    out_fp8: i32,
    hidden_vec: u32,
    eps: f32,
    scale: f32,
    residual: u64,
    weight: u64,
    tokens: u64,
    quant: i32,
    reserved: i32,
}

/// Which all-reduce kernel a launch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shot {
    /// `anyccl_one_shot[_table]_*`.
    One,
    /// `anyccl_two_shot[_table]_*`.
    Two,
}

/// The decoded parameters of an all-reduce kernel launch (`anyccl_kernels_common::allreduce_params`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllReduceParams {
    /// One-shot or two-shot.
    pub shot: Shot,
    /// A `_table` kernel: the inputs' pointers are read from `table` when the work runs.
    pub table_kernel: bool,
    /// Element type: "f32", "f16" or "bf16".
    pub dtype: &'static str,
    /// `in`: every rank's input or staging buffer (zero for `_table` kernels).
    pub inputs: [u64; 8],
    /// `table`: the device input table (zero unless `table_kernel`).
    pub table: u64,
    /// `self_src`: this rank's input to copy into its staging first (0: none).
    pub self_src: u64,
    /// `scratch`: every rank's two-shot scratch (zero for one-shot).
    pub scratch: [u64; 8],
    /// `out`.
    pub out: u64,
    /// `round_vecs` (two-shot; 0 for one-shot).
    pub round_vecs: u64,
    /// `flags`: every rank's flag array.
    pub flags: [u64; 8],
    /// `rank`.
    pub rank: i32,
    /// `world`.
    pub world: i32,
    /// `n_vec`: 16-byte vectors.
    pub n_vec: u64,
    /// The input table's `registered` word at the last run (`None`: no table read yet, or not a table kernel).
    pub last_registered: Option<bool>,
}

/// The decoded parameters of a push one-shot launch (`anyccl_kernels_common::push::PUSH_PARAMS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushParams {
    /// Element type: "f32", "f16" or "bf16".
    pub dtype: &'static str,
    /// `in`: this rank's input.
    pub input: u64,
    /// `out`.
    pub out: u64,
    /// `recv`: every rank's receive buffer.
    pub recv: [u64; 8],
    /// `my_flags`: this rank's flag array.
    pub my_flags: u64,
    /// `rank`.
    pub rank: i32,
    /// `world`.
    pub world: i32,
    /// `n_vec`: 16-byte vectors.
    pub n_vec: u64,
}

/// Which fused kernel a launch ran (`anyccl_kernels_common::fused_params`, `FUSED_PUSH_PARAMS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    /// `anyccl_fused_one_shot[_table]_*`.
    OneShot,
    /// `anyccl_fused_two_shot[_table]_*`.
    TwoShot,
    /// `anyccl_rmsnorm_*`: the unfused form's second kernel.
    RmsNorm,
    /// `anyccl_fused_push_one_shot_*`.
    Push,
}

/// The decoded parameters of a fused (or separate RMSNorm) kernel launch: its `NormArgs` and the rest.
#[derive(Clone, Debug, PartialEq)]
pub struct NormParams {
    /// Which kernel.
    pub form: Fused,
    /// A `_table` kernel.
    pub table_kernel: bool,
    /// Element type: "f16" or "bf16".
    pub dtype: &'static str,
    /// `NormArgs::residual`, `weight`, `out`.
    pub residual: u64,
    /// `NormArgs::weight`.
    pub weight: u64,
    /// `NormArgs::out`.
    pub out: u64,
    /// `NormArgs::tokens`.
    pub tokens: u64,
    /// `NormArgs::hidden_vec`.
    pub hidden_vec: u32,
    /// `NormArgs::eps`.
    pub eps: f32,
    /// `NormArgs::scale`.
    pub scale: f32,
    /// `NormArgs::out_fp8 != 0`.
    pub out_fp8: bool,
    /// `self_src` (fused one-/two-shot), or the kernel's own input `in` (RMSNorm, fused push).
    pub own_input: u64,
    /// `rank`, `world` (0 for the RMSNorm kernel, which has neither).
    pub rank: i32,
    /// As above.
    pub world: i32,
}

/// The decoded parameters of a quantized two-shot launch (`anyccl_kernels_common::QUANT_PARAMS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantParams {
    /// "fp8" or "int8".
    pub format: &'static str,
    /// Element type: "f32", "f16" or "bf16".
    pub dtype: &'static str,
    /// `in`: this rank's input.
    pub input: u64,
    /// `stage`: every rank's staging.
    pub stage: [u64; 8],
    /// `scratch`: every rank's scratch.
    pub scratch: [u64; 8],
    /// `out`.
    pub out: u64,
    /// `rank`, `world`, `n_vec`.
    pub rank: i32,
    /// As above.
    pub world: i32,
    /// As above.
    pub n_vec: u64,
}

/// One `hipModuleLaunchKernel` as the fake recorded it.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// 1, 2, … since the last reset.
    pub seq: u64,
    /// The function's name.
    pub name: String,
    /// Grid x, y, z.
    pub grid: [u32; 3],
    /// Block x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_bytes: u32,
    /// The stream (its handle's address; 0: the null stream).
    pub stream: usize,
    /// The stream was capturing: the work runs at each replay of the graph instead of now.
    pub capturing: bool,
    /// What `hipModuleLaunchKernel` returned (0, or 98/1/400/900 for a refused launch).
    pub status: i32,
    /// The decoded parameters of an all-reduce kernel (also for launches refused after decoding).
    pub params: Option<AllReduceParams>,
    /// The decoded parameters of a push one-shot kernel.
    pub push: Option<PushParams>,
    /// The decoded parameters of a fused kernel or the separate RMSNorm kernel.
    pub norm: Option<NormParams>,
    /// The decoded parameters of a quantized two-shot kernel.
    pub quant: Option<QuantParams>,
    /// Launched with programmatic dependent launch (`cuLaunchKernelEx` with the programmatic-stream-serialization
    /// attribute, fake CUDA driver only).
    pub pdl: bool,
    /// Times the work started (eager: 1; captured: one per replay).
    pub runs: u32,
    /// Runs that met every barrier and wrote `out`.
    pub completed: u32,
    /// Runs that stopped on this rank's abort word.
    pub aborted: u32,
    /// Runs that gave up waiting for a peer (a violation says so too).
    pub timed_out: u32,
    /// Runs refused when they started (a buffer freed since the launch, a bad input table).
    pub failed: u32,
}

impl FakeHip {
    fn sym<T: Copy>(&self, name: &[u8]) -> T {
        // SAFETY: every caller names a function fake_hip.c exports with the signature `T`.
        unsafe { *self.lib.get::<T>(name).expect("fake HIP symbol") }
    }

    /// The kernel launches held (the last 4096 since the reset, oldest first).
    pub fn launches(&self) -> Vec<Launch> {
        let count: unsafe extern "C" fn() -> i32 = self.sym(b"fakehip_launch_count\0");
        let get: unsafe extern "C" fn(i32, *mut RawLaunch, usize) -> i32 = self.sym(b"fakehip_launch\0");
        // SAFETY: plain reads of the fake's record into a struct of the C layout (whose size the C side checks).
        let n = unsafe { count() };
        (0..n)
            .filter_map(|i| {
                let mut raw = std::mem::MaybeUninit::<RawLaunch>::zeroed();
                // SAFETY: as above; `raw` is a whole RawLaunch the C side fills on success.
                let rc = unsafe { get(i, raw.as_mut_ptr(), std::mem::size_of::<RawLaunch>()) };
                assert_ne!(rc, 2, "fake_hip.rs RawLaunch differs from fake_hip.c's struct fakehip_launch");
                // SAFETY: zero-initialised, then filled: every bit pattern is a valid RawLaunch.
                (rc == 0).then(|| Launch::from(unsafe { raw.assume_init() }))
            })
            .collect()
    }

    /// Kernel launches since the reset, including those no longer held.
    pub fn launch_total(&self) -> u64 {
        let f: unsafe extern "C" fn() -> u64 = self.sym(b"fakehip_launch_total\0");
        // SAFETY: reads a counter.
        unsafe { f() }
    }

    /// Emulated kernel runs waiting at a barrier for their peers now.
    pub fn kernels_waiting(&self) -> i32 {
        let f: unsafe extern "C" fn() -> i32 = self.sym(b"fakehip_kernels_waiting\0");
        // SAFETY: reads a counter.
        unsafe { f() }
    }

    /// How long a kernel's block waits for its peers without progress before the run records "timed out" (negative: the
    /// default, `FAKEHIP_KERNEL_TIMEOUT_MS` or 20 s).
    pub fn set_kernel_timeout_ms(&self, ms: i32) {
        let f: unsafe extern "C" fn(i32) = self.sym(b"fakehip_set_kernel_timeout_ms\0");
        // SAFETY: sets a number.
        unsafe { f(ms) }
    }

    /// IPC mappings opened and not closed yet.
    pub fn ipc_open_count(&self) -> i32 {
        let f: unsafe extern "C" fn() -> i32 = self.sym(b"fakehip_ipc_open_count\0");
        // SAFETY: reads a counter.
        unsafe { f() }
    }
}

impl From<RawLaunch> for Launch {
    fn from(r: RawLaunch) -> Self {
        let name_bytes: Vec<u8> = r.name.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
        let params = (r.kernel == 1 || r.kernel == 2).then(|| AllReduceParams {
            shot: if r.kernel == 1 { Shot::One } else { Shot::Two },
            table_kernel: r.table_kernel != 0,
            dtype: match r.dtype {
                0 => "f32",
                1 => "f16",
                _ => "bf16",
            },
            inputs: r.inputs,
            table: r.table,
            self_src: r.self_src,
            scratch: r.scratch,
            out: r.out,
            round_vecs: r.round_vecs,
            flags: r.flags,
            rank: r.rank,
            world: r.world,
            n_vec: r.n_vec,
            last_registered: (r.last_registered >= 0).then_some(r.last_registered == 1),
        });
        let dtype = match r.dtype {
            0 => "f32",
            1 => "f16",
            _ => "bf16",
        };
        // The push one-shot (3) and two-shot (9) take the same parameters.
        let push = (r.kernel == 3 || r.kernel == 9).then_some(PushParams {
            dtype,
            input: r.self_src,
            out: r.out,
            recv: r.recv,
            my_flags: r.my_flags,
            rank: r.rank,
            world: r.world,
            n_vec: r.n_vec,
        });
        let form = match r.kernel {
            4 => Some(Fused::OneShot),
            5 => Some(Fused::TwoShot),
            6 => Some(Fused::RmsNorm),
            7 => Some(Fused::Push),
            _ => None,
        };
        let norm = form.map(|form| NormParams {
            form,
            table_kernel: r.table_kernel != 0,
            dtype,
            residual: r.residual,
            weight: r.weight,
            out: r.out,
            tokens: r.tokens,
            hidden_vec: r.hidden_vec,
            eps: r.eps,
            scale: r.scale,
            out_fp8: r.out_fp8 != 0,
            own_input: r.self_src,
            rank: r.rank,
            world: r.world,
        });
        let quant = (r.kernel == 8).then_some(QuantParams {
            format: if r.quant == 1 { "fp8" } else { "int8" },
            dtype,
            input: r.self_src,
            stage: r.inputs,
            scratch: r.scratch,
            out: r.out,
            rank: r.rank,
            world: r.world,
            n_vec: r.n_vec,
        });
        Launch {
            norm,
            quant,
            push,
            pdl: r.pdl != 0,
            seq: r.seq,
            name: String::from_utf8_lossy(&name_bytes).into_owned(),
            grid: r.grid,
            block: r.block,
            shared_bytes: r.shared_bytes,
            stream: r.stream as usize,
            capturing: r.capturing != 0,
            status: r.status,
            params,
            runs: r.runs,
            completed: r.completed,
            aborted: r.aborted,
            timed_out: r.timed_out,
            failed: r.failed,
        }
    }
}
