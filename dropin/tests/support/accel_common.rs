//! The halves shared by the drop-in's acceleration tests (accel.rs over the fake RCCL and HIP runtime, accel_cuda.rs
//! over the fake NCCL and CUDA driver): the parent starts this test binary's ignored `child` test with the fakes'
//! environment and reads what it printed; the child drives ranks as threads through the drop-in's C ABI and the
//! application's device calls on the fake runtime.

use std::ffi::{c_int, c_void, OsString};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt;

use super::programs;
use anyccl_testkit::fake_hip::{FakeHip, Launch, Shot};

/// A child that has not ended by then has hung.
pub const CHILD_DEADLINE: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------------------------
// The parent half.

/// What a child printed, and whether it passed.
pub struct Child {
    /// It exited with success.
    pub ok: bool,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error (the drop-in's log).
    pub stderr: String,
}

/// Runs this test binary's ignored `child` test for `case` (a file's cases are told apart by `name`) in an empty
/// environment but `base` and `extra`, with `ACCEL_CASE` set, within [`CHILD_DEADLINE`].
pub fn run_child(name: &str, case: &str, base: &[(&str, OsString)], extra: &[(&str, &str)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .env_clear()
        .env("ACCEL_CASE", case)
        .env("ACCEL_DROPIN", programs::dropin_so())
        .env("ANYCCL_LOG", "anyccl_nccl=debug")
        .env("FAKEHIP_KERNEL_TIMEOUT_MS", "10000");
    for (k, v) in base {
        cmd.env(k, v);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let dir = programs::case_dir(&format!("{name}-{case}"));
    let (out_path, err_path) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    cmd.stdin(Stdio::null());
    cmd.stdout(std::fs::File::create(&out_path).expect("stdout file"));
    cmd.stderr(std::fs::File::create(&err_path).expect("stderr file"));
    let mut child = cmd.spawn().expect("spawn the child");
    let status = match child.wait_timeout(CHILD_DEADLINE).expect("wait") {
        Some(s) => s,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the child of case {case} hung; stderr:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    Child { ok: status.success(), stdout, stderr }
}

/// [`run_child`], which must succeed.
pub fn checked_child(name: &str, case: &str, base: &[(&str, OsString)], extra: &[(&str, &str)]) -> Child {
    let c = run_child(name, case, base, extra);
    assert!(c.ok, "case {case} failed\nstdout:\n{}\nstderr:\n{}", c.stdout, c.stderr);
    c
}

/// The value of `KEY=value` lines the child printed.
pub fn field(c: &Child, key: &str) -> String {
    let prefix = format!("{key}=");
    c.stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key} in the child's output:\n{}", c.stdout))
        .to_owned()
}

/// Log lines of the drop-in's `ncclAllReduce` decisions with all of `words`.
pub fn log_lines<'a>(c: &'a Child, words: &[&str]) -> Vec<&'a str> {
    log_lines_of(c, "ncclAllReduce", words)
}

/// The drop-in's log lines for `function` with all of `words`.
pub fn log_lines_of<'a>(c: &'a Child, function: &str, words: &[&str]) -> Vec<&'a str> {
    let f = format!("function=\"{function}\"");
    c.stderr.lines().filter(|l| l.contains(&f) && words.iter().all(|w| l.contains(w))).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// The child half.

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Id(pub [u8; 128]);

pub type Comm = *mut c_void;

/// The C entry points the child calls: the drop-in's, and the application's device calls on the fake runtime
/// (the fake HIP runtime's own, or the fake CUDA driver's through [`cuda`]'s adapters of the same C signatures).
pub struct Api {
    pub get_unique_id: unsafe extern "C" fn(*mut Id) -> c_int,
    pub init_rank: unsafe extern "C" fn(*mut Comm, c_int, Id, c_int) -> c_int,
    pub all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int,
    /// `ncclAllReduceConfig` (`None` in a drop-in built before nccl.h 2.31).
    pub all_reduce_config: Option<AllReduceConfig>,
    pub destroy: unsafe extern "C" fn(Comm) -> c_int,
    pub split: unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> c_int,
    pub group_start: unsafe extern "C" fn() -> c_int,
    pub last_error: unsafe extern "C" fn(Comm) -> *const std::ffi::c_char,
    pub group_end: unsafe extern "C" fn() -> c_int,
    pub count: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub calls: unsafe extern "C" fn() -> u64,
    /// `None` in a drop-in built before the acceleration (the benchmark's comparison).
    pub custom_calls: Option<unsafe extern "C" fn() -> u64>,
    pub set_device: unsafe extern "C" fn(c_int) -> c_int,
    pub malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    pub memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int,
    pub stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int,
    pub synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub begin_capture: unsafe extern "C" fn(*mut c_void, c_int) -> c_int,
    pub end_capture: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int,
    pub instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *mut c_void, *mut c_void, usize) -> c_int,
    pub graph_launch: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
}

/// `ncclAllReduceConfig`'s C signature (the config as an untyped pointer).
pub type AllReduceConfig =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void, *const c_void) -> c_int;

pub fn sym<T: Copy>(lib: &'static libloading::Library, name: &str) -> T {
    // SAFETY: every caller names a C function of the drop-in or the fake runtime with the signature `T`.
    unsafe { *lib.get::<T>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
}

/// The application's device runtime in the child.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Runtime {
    /// The fake HIP runtime at `ANYCCL_HIP_PATH` (under the fake RCCL).
    Hip,
    /// The fake CUDA driver at `FAKECUDA_LIB` (under the fake NCCL; the drop-in's cudarc loads it through
    /// `LD_LIBRARY_PATH`: the same file, so the same loaded copy).
    Cuda,
}

/// Opens a library for the rest of the process (leaked: its code stays mapped).
pub fn open_leaked(path: &std::ffi::OsStr) -> &'static libloading::Library {
    // SAFETY: the drop-in and the fakes built for this test; their initialisers do nothing.
    Box::leak(Box::new(unsafe { libloading::Library::new(path) }.unwrap_or_else(|e| panic!("open {path:?}: {e}"))))
}

/// The drop-in (`ACCEL_DROPIN`) and the application's runtime `rt`, and the fake runtime's records.
pub fn load_api(rt: Runtime) -> (Api, FakeHip) {
    let var = |v: &str| std::env::var_os(v).unwrap_or_else(|| panic!("{v} is set by the parent"));
    let d = open_leaked(&var("ACCEL_DROPIN"));
    let runtime_path = var(if rt == Runtime::Hip { "ANYCCL_HIP_PATH" } else { "FAKECUDA_LIB" });
    let h = open_leaked(&runtime_path);
    let dev = match rt {
        Runtime::Hip => Device {
            set_device: sym(h, "hipSetDevice"),
            malloc: sym(h, "hipMalloc"),
            memcpy: sym(h, "hipMemcpy"),
            stream_create: sym(h, "hipStreamCreateWithFlags"),
            synchronize: sym(h, "hipStreamSynchronize"),
            begin_capture: sym(h, "hipStreamBeginCapture"),
            end_capture: sym(h, "hipStreamEndCapture"),
            instantiate: sym(h, "hipGraphInstantiate"),
            graph_launch: sym(h, "hipGraphLaunch"),
        },
        Runtime::Cuda => cuda::device(h),
    };
    let api = Api {
        get_unique_id: sym(d, "ncclGetUniqueId"),
        init_rank: sym(d, "ncclCommInitRank"),
        all_reduce: sym(d, "ncclAllReduce"),
        // SAFETY: the drop-in's ncclAllReduceConfig, with nccl.h's signature.
        all_reduce_config: unsafe { d.get::<AllReduceConfig>(b"ncclAllReduceConfig") }.ok().map(|f| *f),
        destroy: sym(d, "ncclCommDestroy"),
        split: sym(d, "ncclCommSplit"),
        group_start: sym(d, "ncclGroupStart"),
        last_error: sym(d, "ncclGetLastError"),
        group_end: sym(d, "ncclGroupEnd"),
        count: sym(d, "ncclCommCount"),
        calls: sym(d, "anyccl_nccl_dropin_calls"),
        // SAFETY: the drop-in's counter, a C function without arguments.
        custom_calls: unsafe { d.get::<unsafe extern "C" fn() -> u64>(b"anyccl_nccl_dropin_custom_calls") }
            .ok()
            .map(|f| *f),
        set_device: dev.set_device,
        malloc: dev.malloc,
        memcpy: dev.memcpy,
        stream_create: dev.stream_create,
        synchronize: dev.synchronize,
        begin_capture: dev.begin_capture,
        end_capture: dev.end_capture,
        instantiate: dev.instantiate,
        graph_launch: dev.graph_launch,
    };
    let fake = FakeHip::open(Path::new(&runtime_path));
    (api, fake)
}

/// The application's device calls, with the fake HIP runtime's C signatures.
pub struct Device {
    set_device: unsafe extern "C" fn(c_int) -> c_int,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int,
    synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    begin_capture: unsafe extern "C" fn(*mut c_void, c_int) -> c_int,
    end_capture: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int,
    instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *mut c_void, *mut c_void, usize) -> c_int,
    graph_launch: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
}

/// The application's side on the fake CUDA driver, as a CUDA runtime program sees it: the device's primary context
/// made current on the calling thread (`cudaSetDevice`), `cuMemAlloc_v2`, `cuMemcpyHtoD_v2` / `cuMemcpyDtoH_v2`,
/// `cuStreamCreate`, global-mode captures, `cuGraphInstantiate_v2`, `cuGraphLaunch`. Where the driver's signature
/// differs from HIP's, a small adapter with HIP's signature calls it.
pub mod cuda {
    use std::ffi::{c_int, c_uint, c_void};
    use std::sync::OnceLock;

    use super::{sym, Device};

    struct Driver {
        init: unsafe extern "C" fn(c_uint) -> c_int,
        retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int,
        set_current: unsafe extern "C" fn(*mut c_void) -> c_int,
        htod: unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
        dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
    }

    static DRIVER: OnceLock<Driver> = OnceLock::new();

    fn driver() -> &'static Driver {
        DRIVER.get().expect("cuda::device ran first")
    }

    /// `cudaSetDevice`: the device's primary context, retained (once per call: the process keeps it) and current.
    unsafe extern "C" fn set_device(d: c_int) -> c_int {
        let drv = driver();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: driver calls with valid out-pointers; the context is the driver's own.
        unsafe {
            let st = (drv.init)(0);
            if st != 0 {
                return st;
            }
            let st = (drv.retain)(&mut ctx, d);
            if st != 0 {
                return st;
            }
            (drv.set_current)(ctx)
        }
    }

    /// `cudaMemcpy` for the two directions the tests use: 1 host to device, 2 device to host.
    unsafe extern "C" fn memcpy(dst: *mut c_void, src: *const c_void, n: usize, kind: c_int) -> c_int {
        let drv = driver();
        // SAFETY: the caller's contract (hipMemcpy's): `dst` and `src` hold `n` bytes.
        unsafe {
            match kind {
                1 => (drv.htod)(dst as u64, src, n),
                2 => (drv.dtoh)(dst, src as u64, n),
                _ => 1,
            }
        }
    }

    /// The device calls of the fake CUDA driver `h`.
    pub fn device(h: &'static libloading::Library) -> Device {
        let _ = DRIVER.set(Driver {
            init: sym(h, "cuInit"),
            retain: sym(h, "cuDevicePrimaryCtxRetain"),
            set_current: sym(h, "cuCtxSetCurrent"),
            htod: sym(h, "cuMemcpyHtoD_v2"),
            dtoh: sym(h, "cuMemcpyDtoH_v2"),
        });
        Device {
            set_device,
            // cuMemAlloc_v2 writes a CUdeviceptr (a u64: a pointer here), cuStreamCreate takes HIP's flags (1:
            // non-blocking), and cuGraphInstantiate_v2 HIP's arguments.
            malloc: sym(h, "cuMemAlloc_v2"),
            memcpy,
            stream_create: sym(h, "cuStreamCreate"),
            synchronize: sym(h, "cuStreamSynchronize"),
            begin_capture: sym(h, "cuStreamBeginCapture_v2"),
            end_capture: sym(h, "cuStreamEndCapture"),
            instantiate: sym(h, "cuGraphInstantiate_v2"),
            graph_launch: sym(h, "cuGraphLaunch"),
        }
    }
}

/// `ncclDataType_t` values used here.
pub const NCCL_INT32: c_int = 2;
pub const NCCL_FLOAT32: c_int = 7;
pub const NCCL_BFLOAT16: c_int = 9;

pub fn value(rank: usize, round: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13 + round * 5) % 17) as f32 - 8.0
}

pub fn encode(dtype: c_int, v: &[f32]) -> Vec<u8> {
    match dtype {
        NCCL_FLOAT32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        NCCL_BFLOAT16 => v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        NCCL_INT32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
        other => panic!("no encoding for {other}"),
    }
}

pub fn decode(dtype: c_int, b: &[u8]) -> Vec<f32> {
    match dtype {
        NCCL_FLOAT32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        NCCL_BFLOAT16 => {
            b.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
        }
        NCCL_INT32 => b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect(),
        other => panic!("no decoding for {other}"),
    }
}

pub fn elem(dtype: c_int) -> usize {
    if dtype == NCCL_BFLOAT16 {
        2
    } else {
        4
    }
}

/// One rank's communicator, stream and device memory, driven through the C ABI.
pub struct Rank<'a> {
    pub api: &'a Api,
    pub rank: usize,
    pub world: usize,
    pub comm: Comm,
    pub stream: *mut c_void,
}

impl Rank<'_> {
    pub fn new(api: &Api, rank: usize, world: usize, id: Id) -> Rank<'_> {
        // SAFETY: C calls of the fake runtime and the drop-in with valid out-pointers.
        unsafe {
            assert_eq!((api.set_device)(rank as c_int), 0);
            let mut comm: Comm = std::ptr::null_mut();
            assert_eq!((api.init_rank)(&mut comm, world as c_int, id, rank as c_int), 0, "ncclCommInitRank");
            let mut stream = std::ptr::null_mut();
            assert_eq!((api.stream_create)(&mut stream, 1), 0);
            Rank { api, rank, world, comm, stream }
        }
    }

    pub fn alloc(&self, bytes: usize) -> *mut c_void {
        let mut p = std::ptr::null_mut();
        // SAFETY: hipMalloc writes one pointer.
        assert_eq!(unsafe { (self.api.malloc)(&mut p, bytes) }, 0);
        p
    }

    pub fn upload(&self, dst: *mut c_void, bytes: &[u8]) {
        // SAFETY: `dst` holds at least `bytes.len()` bytes of fake device memory.
        assert_eq!(unsafe { (self.api.memcpy)(dst, bytes.as_ptr().cast(), bytes.len(), 1) }, 0);
    }

    pub fn download(&self, src: *const c_void, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: `src` holds at least `len` bytes of fake device memory.
        assert_eq!(unsafe { (self.api.memcpy)(out.as_mut_ptr().cast(), src, len, 2) }, 0);
        out
    }

    pub fn sync(&self) {
        // SAFETY: the rank's live stream.
        assert_eq!(unsafe { (self.api.synchronize)(self.stream) }, 0);
    }

    pub fn all_reduce(&self, send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int) {
        // SAFETY: buffers of `count` elements of this device; the rank's communicator and stream.
        let rc = unsafe { (self.api.all_reduce)(send, recv, count, dtype, 0, self.comm, self.stream) };
        assert_eq!(rc, 0, "ncclAllReduce rank {}", self.rank);
    }

    /// An all-reduce of `count` elements of round `round`'s inputs, checked against the host reference.
    pub fn checked_all_reduce(&self, dtype: c_int, count: usize, round: usize, in_place: bool) {
        let bytes = count * elem(dtype);
        let send = self.alloc(bytes);
        let recv = if in_place { send } else { self.alloc(bytes) };
        let mine: Vec<f32> = (0..count).map(|i| value(self.rank, round, i)).collect();
        self.upload(send, &encode(dtype, &mine));
        self.all_reduce(send, recv, count, dtype);
        self.sync();
        self.check(recv, dtype, count, round);
    }

    /// As [`Rank::checked_all_reduce`] out of place, through `ncclAllReduceConfig` with `config` (null, or an
    /// `ncclCollConfig_t` that lives through the call).
    pub fn checked_all_reduce_config(&self, dtype: c_int, count: usize, round: usize, config: *const c_void) {
        let f = self.api.all_reduce_config.expect("the drop-in exports ncclAllReduceConfig");
        let bytes = count * elem(dtype);
        let (send, recv) = (self.alloc(bytes), self.alloc(bytes));
        let mine: Vec<f32> = (0..count).map(|i| value(self.rank, round, i)).collect();
        self.upload(send, &encode(dtype, &mine));
        // SAFETY: buffers of `count` elements of this device; the rank's communicator and stream; the caller's
        // config.
        let rc = unsafe { f(send, recv, count, dtype, 0, self.comm, self.stream, config) };
        assert_eq!(rc, 0, "ncclAllReduceConfig rank {}", self.rank);
        self.sync();
        self.check(recv, dtype, count, round);
    }

    /// As [`Rank::checked_all_reduce`] out of place, with `end` run after the call (a group's end).
    pub fn checked_all_reduce_in(&self, dtype: c_int, count: usize, round: usize, end: impl FnOnce()) {
        let bytes = count * elem(dtype);
        let (send, recv) = (self.alloc(bytes), self.alloc(bytes));
        let mine: Vec<f32> = (0..count).map(|i| value(self.rank, round, i)).collect();
        self.upload(send, &encode(dtype, &mine));
        self.all_reduce(send, recv, count, dtype);
        end();
        self.sync();
        self.check(recv, dtype, count, round);
    }

    pub fn check(&self, recv: *const c_void, dtype: c_int, count: usize, round: usize) {
        let got = decode(dtype, &self.download(recv, count * elem(dtype)));
        let want: Vec<f32> = (0..count).map(|i| (0..self.world).map(|r| value(r, round, i)).sum()).collect();
        assert!(got == want, "rank {} round {round} dtype {dtype}: wrong sum", self.rank);
    }

    pub fn capture(&self, f: impl FnOnce()) -> *mut c_void {
        // SAFETY: capture calls of the fake runtime on the rank's live stream (global mode: anything unsafe on any
        // thread during the capture is a recorded violation).
        unsafe {
            assert_eq!((self.api.begin_capture)(self.stream, 0), 0);
            f();
            let mut graph = std::ptr::null_mut();
            assert_eq!((self.api.end_capture)(self.stream, &mut graph), 0);
            let mut exec = std::ptr::null_mut();
            let null = std::ptr::null_mut();
            assert_eq!((self.api.instantiate)(&mut exec, graph, null, null, 0), 0);
            exec
        }
    }

    pub fn replay(&self, exec: *mut c_void) {
        // SAFETY: an instantiated graph of the fake runtime and the rank's stream.
        assert_eq!(unsafe { (self.api.graph_launch)(exec, self.stream) }, 0);
        self.sync();
    }

    pub fn destroy(&self) {
        // SAFETY: the rank's communicator, destroyed once.
        assert_eq!(unsafe { (self.api.destroy)(self.comm) }, 0);
    }
}

pub fn unique_id(api: &Api) -> Id {
    let mut id = Id([0; 128]);
    // SAFETY: writes one id.
    assert_eq!(unsafe { (api.get_unique_id)(&mut id) }, 0);
    id
}

/// Runs `f` on one thread per rank of a new communicator of `world`.
pub fn ranks(api: &Api, world: usize, f: impl Fn(&Rank<'_>) + Sync) {
    ranks_with(api, world, |_| {}, f)
}

/// As [`ranks`], with `before(rank)` run on each rank's thread before its communicator is created.
pub fn ranks_with(api: &Api, world: usize, before: impl Fn(usize) + Sync, f: impl Fn(&Rank<'_>) + Sync) {
    let id = unique_id(api);
    let (f, before) = (&f, &before);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                s.spawn(move || {
                    before(r);
                    f(&Rank::new(api, r, world, id))
                })
            })
            .collect();
        for h in hs {
            h.join().expect("rank thread");
        }
    });
}

pub fn launches_summary(launches: &[Launch]) -> String {
    let n = |f: &dyn Fn(&Launch) -> bool| launches.iter().filter(|l| f(l)).count();
    let shot = |l: &Launch, s: Shot, d: &str| l.params.as_ref().is_some_and(|p| p.shot == s && p.dtype == d);
    format!(
        "one_shot_f32={} one_shot_bf16={} two_shot={} other={}",
        n(&|l| shot(l, Shot::One, "f32")),
        n(&|l| shot(l, Shot::One, "bf16")),
        n(&|l| l.params.as_ref().is_some_and(|p| p.shot == Shot::Two)),
        n(&|l| l.params.is_none()),
    )
}
