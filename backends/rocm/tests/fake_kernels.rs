//! The fake HIP runtime's runs of the custom all-reduce kernels (testkit/c/fake_hip.c, which runs their source compiled
//! for the host), driven through its C ABI with no communicator: ranks are threads of this process that each launch
//! their rank's kernel, as the ROCm communicator will. The kernels must give the exact sums of the test's own reference
//! (f32 accumulation in rank order), in every input mode (staged, input table before and after registration, direct),
//! eager and replayed from a graph; refuse malformed launches with a recorded violation; stop on the abort word; and
//! record every launch with its grid and decoded parameters. "Device" memory is host memory, so the tests fill and read
//! buffers directly.
//!
//! The fake keeps one process-wide record, so the tests take a lock and run one at a time.

use anyccl_testkit::fake_hip;
use anyccl_testkit::gpu_suite;

use std::ffi::{c_void, CString};
use std::ptr::null_mut;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyccl_core::dtype::Value;
use anyccl_core::DataType;
use anyccl_kernels_hip::{ABORT_WORD_OFFSET, FLAG_BYTES, KERNELS};
use fake_hip::{FakeHip, Launch, Shot};

static SERIAL: Mutex<()> = Mutex::new(());

type Ptr = *mut c_void;

/// `hipIpcMemHandle_t`, passed by value as HIP declares it.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle([u8; 64]);

type LaunchFn =
    unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, *mut *mut c_void, *mut *mut c_void) -> i32;

/// The fake runtime's HIP entry points the tests call, and its test interface.
struct Hip {
    fake: FakeHip,
    lib: libloading::Library,
}

/// A device pointer shared between the rank threads (the fake's memory is host memory, alive until freed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dev(u64);
// SAFETY: an address in the fake's process-wide memory; the tests synchronise their accesses by joining threads.
unsafe impl Send for Dev {}

impl Hip {
    fn open() -> (Self, MutexGuard<'static, ()>) {
        let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let path = fake_hip::build_hip();
        let fake = FakeHip::open(&path);
        fake.reset();
        fake.set_kernel_timeout_ms(-1);
        // SAFETY: the fake runtime built above; its initialisers do nothing.
        let lib = unsafe { libloading::Library::new(&path) }.expect("open the fake HIP runtime");
        (Hip { fake, lib }, guard)
    }

    fn sym<T: Copy>(&self, name: &str) -> T {
        let n = format!("{name}\0");
        // SAFETY: every caller names a HIP function with the signature `T` (as fake_hip.c defines it).
        unsafe { *self.lib.get::<T>(n.as_bytes()).expect("fake HIP symbol") }
    }

    /// `bytes` of fake device memory, filled with `fill`.
    fn malloc(&self, bytes: usize, fill: u8) -> Dev {
        let f: unsafe extern "C" fn(*mut Ptr, usize) -> i32 = self.sym("hipMalloc");
        let mut p = null_mut();
        // SAFETY: hipMalloc writes one pointer; the fake's memory is host memory of at least `bytes`.
        unsafe {
            assert_eq!(f(&mut p, bytes), 0, "hipMalloc");
            std::ptr::write_bytes(p.cast::<u8>(), fill, bytes);
        }
        Dev(p as u64)
    }

    fn free(&self, p: Dev) -> i32 {
        let f: unsafe extern "C" fn(Ptr) -> i32 = self.sym("hipFree");
        // SAFETY: a pointer of the fake (or not: the fake checks).
        unsafe { f(p.0 as Ptr) }
    }

    fn stream(&self) -> Dev {
        let f: unsafe extern "C" fn(*mut Ptr, u32) -> i32 = self.sym("hipStreamCreateWithFlags");
        let mut s = null_mut();
        // SAFETY: writes one handle.
        assert_eq!(unsafe { f(&mut s, 1) }, 0);
        Dev(s as u64)
    }

    fn begin_capture(&self, s: Dev, mode: i32) -> i32 {
        let f: unsafe extern "C" fn(Ptr, i32) -> i32 = self.sym("hipStreamBeginCapture");
        // SAFETY: a live stream.
        unsafe { f(s.0 as Ptr, mode) }
    }

    /// Ends the capture on `s` and instantiates its graph; the graph exec, or HIP's status.
    fn end_capture(&self, s: Dev) -> Result<Dev, i32> {
        let end: unsafe extern "C" fn(Ptr, *mut Ptr) -> i32 = self.sym("hipStreamEndCapture");
        let inst: unsafe extern "C" fn(*mut Ptr, Ptr, Ptr, *mut i8, usize) -> i32 = self.sym("hipGraphInstantiate");
        let destroy: unsafe extern "C" fn(Ptr) -> i32 = self.sym("hipGraphDestroy");
        let (mut g, mut exec) = (null_mut(), null_mut());
        // SAFETY: a capturing stream; each call writes one handle.
        unsafe {
            let rc = end(s.0 as Ptr, &mut g);
            if rc != 0 {
                return Err(rc);
            }
            assert_eq!(inst(&mut exec, g, null_mut(), null_mut(), 0), 0);
            assert_eq!(destroy(g), 0);
        }
        Ok(Dev(exec as u64))
    }

    fn graph_launch(&self, exec: Dev, s: Dev) -> i32 {
        let f: unsafe extern "C" fn(Ptr, Ptr) -> i32 = self.sym("hipGraphLaunch");
        // SAFETY: a live graph exec and stream.
        unsafe { f(exec.0 as Ptr, s.0 as Ptr) }
    }

    fn module(&self, image: &[u8]) -> Result<Dev, i32> {
        let f: unsafe extern "C" fn(*mut Ptr, *const c_void) -> i32 = self.sym("hipModuleLoadData");
        let mut m = null_mut();
        // SAFETY: `image` is a whole ELF image (the fake reads it within the extent its headers give).
        let rc = unsafe { f(&mut m, image.as_ptr().cast()) };
        if rc == 0 {
            Ok(Dev(m as u64))
        } else {
            Err(rc)
        }
    }

    fn function(&self, m: Dev, name: &str) -> Result<Dev, i32> {
        let f: unsafe extern "C" fn(*mut Ptr, Ptr, *const i8) -> i32 = self.sym("hipModuleGetFunction");
        let c = CString::new(name).expect("name");
        let mut p = null_mut();
        // SAFETY: a loaded module and a NUL-terminated name, which the fake copies.
        let rc = unsafe { f(&mut p, m.0 as Ptr, c.as_ptr().cast()) };
        if rc == 0 {
            Ok(Dev(p as u64))
        } else {
            Err(rc)
        }
    }

    /// `hipModuleLaunchKernel` with kernelParams pointing at `params`' values (one per parameter, in order).
    fn launch(&self, f: Dev, grid: [u32; 3], block: [u32; 3], s: Dev, params: &mut [Param]) -> i32 {
        let launch: LaunchFn = self.sym("hipModuleLaunchKernel");
        let mut ptrs: Vec<*mut c_void> = params.iter_mut().map(Param::ptr).collect();
        // SAFETY: every parameter pointer points at a live value of the kernel's parameter's size; the fake
        // checks the buffers those values name before it touches them.
        unsafe {
            launch(
                f.0 as Ptr,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                0,
                s.0 as Ptr,
                ptrs.as_mut_ptr(),
                null_mut(),
            )
        }
    }

    /// `hipModuleLaunchKernel` with its parameters in an `extra` parameter buffer.
    fn launch_extra(&self, f: Dev, grid: [u32; 3], s: Dev, buffer: &mut [u8]) -> i32 {
        let launch: LaunchFn = self.sym("hipModuleLaunchKernel");
        let mut size = buffer.len();
        let mut extra: [*mut c_void; 5] =
            [1 as Ptr, buffer.as_mut_ptr().cast(), 2 as Ptr, (&mut size as *mut usize).cast(), 3 as Ptr];
        // SAFETY: HIP_LAUNCH_PARAM_BUFFER_POINTER, the buffer, HIP_LAUNCH_PARAM_BUFFER_SIZE, its size, the end.
        unsafe {
            launch(f.0 as Ptr, grid[0], grid[1], grid[2], 64, 1, 1, 0, s.0 as Ptr, null_mut(), extra.as_mut_ptr())
        }
    }

    fn synchronize(&self, s: Dev) -> i32 {
        let f: unsafe extern "C" fn(Ptr) -> i32 = self.sym("hipStreamSynchronize");
        // SAFETY: a live stream.
        unsafe { f(s.0 as Ptr) }
    }

    fn query(&self, s: Dev) -> i32 {
        let f: unsafe extern "C" fn(Ptr) -> i32 = self.sym("hipStreamQuery");
        // SAFETY: a live stream.
        unsafe { f(s.0 as Ptr) }
    }

    fn write_value32(&self, s: Dev, p: Dev, v: u32) -> i32 {
        let f: unsafe extern "C" fn(Ptr, Ptr, u32, u32) -> i32 = self.sym("hipStreamWriteValue32");
        // SAFETY: a 4-byte aligned word of fake device memory.
        unsafe { f(s.0 as Ptr, p.0 as Ptr, v, 0) }
    }
}

/// One kernel parameter's value.
enum Param {
    Ptrs([u64; 8]),
    U64(u64),
    I32(i32),
    /// The fused kernels' `NormArgs` (48 bytes).
    Norm([u64; 6]),
}

impl Param {
    fn ptr(&mut self) -> *mut c_void {
        match self {
            Param::Ptrs(p) => (p as *mut [u64; 8]).cast(),
            Param::U64(v) => (v as *mut u64).cast(),
            Param::I32(v) => (v as *mut i32).cast(),
            Param::Norm(v) => (v as *mut [u64; 6]).cast(),
        }
    }
}

/// Where the kernel reads the ranks' inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// `in` = every rank's staging; this rank's input copied in first.
    Staged,
    /// A `_table` kernel whose table holds the staging pointers, `registered` 0.
    TableStaged,
    /// A `_table` kernel whose table holds the inputs themselves, `registered` 1.
    TableRegistered,
    /// `in` = the inputs, no `self_src`.
    Direct,
}

/// A world's buffers, each rank's at its index.
struct World {
    world: usize,
    n_vec: usize,
    inputs: Vec<Dev>,
    staging: Vec<Dev>,
    scratch: Vec<Dev>,
    outs: Vec<Dev>,
    flags: Vec<Dev>,
    tables: Vec<Dev>,
    streams: Vec<Dev>,
}

fn ptrs8(v: &[Dev]) -> [u64; 8] {
    let mut p = [0u64; 8];
    for (d, s) in p.iter_mut().zip(v) {
        *d = s.0;
    }
    p
}

impl World {
    fn new(hip: &Hip, world: usize, n_vec: usize) -> Self {
        let bytes = n_vec * 16;
        let each = |fill: u8| (0..world).map(|_| hip.malloc(bytes, fill)).collect::<Vec<_>>();
        World {
            world,
            n_vec,
            inputs: each(0),
            staging: each(0xee),
            scratch: each(0xee),
            outs: each(0xee),
            // Flags are zeroed once before first use, as the communicator does.
            flags: (0..world).map(|_| hip.malloc(FLAG_BYTES, 0)).collect(),
            tables: (0..world).map(|_| hip.malloc(72, 0)).collect(),
            streams: (0..world).map(|_| hip.stream()).collect(),
        }
    }

    /// Fills every rank's input with a pattern of `dtype` values that depends on `seed`, rank and index.
    fn fill_inputs(&self, dtype: DataType, seed: u32) {
        for (r, p) in self.inputs.iter().enumerate() {
            let bytes = self.element_bytes(dtype);
            let mut v = Vec::new();
            for i in 0..self.n_vec * 16 / bytes {
                let x = ((i as u32 * 37 + r as u32 * 101 + seed * 13) % 997) as f64 / 7.0 - 60.0;
                Value::Float(x).encode(dtype, &mut v);
            }
            // SAFETY: the input holds n_vec * 16 bytes of host memory.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p.0 as *mut u8, v.len()) };
        }
    }

    fn element_bytes(&self, dtype: DataType) -> usize {
        if dtype == DataType::F32 {
            4
        } else {
            2
        }
    }

    fn read(&self, p: Dev) -> Vec<u8> {
        // SAFETY: n_vec * 16 bytes of host memory.
        unsafe { std::slice::from_raw_parts(p.0 as *const u8, self.n_vec * 16).to_vec() }
    }

    /// The kernel's sum: each element's inputs accumulated in f32 in rank order, rounded to `dtype`.
    fn expected(&self, dtype: DataType) -> Vec<u8> {
        let eb = self.element_bytes(dtype);
        let inputs: Vec<Vec<u8>> = self.inputs.iter().map(|p| self.read(*p)).collect();
        let mut out = Vec::new();
        for i in 0..self.n_vec * 16 / eb {
            let mut acc = 0f32;
            for (r, input) in inputs.iter().enumerate() {
                let Value::Float(x) = Value::decode(dtype, &input[i * eb..(i + 1) * eb]) else { panic!("float") };
                acc = if r == 0 { x as f32 } else { acc + x as f32 };
            }
            Value::Float(f64::from(acc)).encode(dtype, &mut out);
        }
        out
    }

    /// Writes every rank's input table for `mode`.
    fn write_tables(&self, mode: Mode) {
        let (ptrs, registered) = match mode {
            Mode::TableRegistered => (ptrs8(&self.inputs), 1u64),
            _ => (ptrs8(&self.staging), 0u64),
        };
        for t in &self.tables {
            // SAFETY: a 72-byte table of host memory.
            unsafe {
                std::ptr::copy_nonoverlapping(ptrs.as_ptr(), t.0 as *mut u64, 8);
                *(t.0 as *mut u64).add(8) = registered;
            }
        }
    }

    /// Rank `rank`'s kernel parameters, in the kernel's order.
    fn params(&self, shot: Shot, mode: Mode, rank: usize, round_vecs: u64) -> Vec<Param> {
        let head = match mode {
            Mode::Staged => Param::Ptrs(ptrs8(&self.staging)),
            Mode::Direct => Param::Ptrs(ptrs8(&self.inputs)),
            Mode::TableStaged | Mode::TableRegistered => Param::U64(self.tables[rank].0),
        };
        let own = if mode == Mode::Direct { 0 } else { self.inputs[rank].0 };
        let mut p = vec![head, Param::U64(own)];
        if shot == Shot::Two {
            p.push(Param::Ptrs(ptrs8(&self.scratch)));
        }
        p.push(Param::U64(self.outs[rank].0));
        if shot == Shot::Two {
            p.push(Param::U64(round_vecs));
        }
        p.extend([
            Param::Ptrs(ptrs8(&self.flags)),
            Param::I32(rank as i32),
            Param::I32(self.world as i32),
            Param::U64(self.n_vec as u64),
        ]);
        p
    }
}

/// The catalogue's name of the `shot` kernel that `mode` launches for `dtype`.
fn kernel_name(shot: Shot, mode: Mode, dtype: DataType) -> String {
    gpu_suite::kernel(shot, matches!(mode, Mode::TableStaged | Mode::TableRegistered), dtype)
}

/// A minimal 64-bit AMDGPU ELF whose symbol table defines a FUNC symbol for each name (the fake reads nothing
/// else), so the tests do not depend on hipcc having built the real code object.
fn tiny_code_object(names: &[&str]) -> Vec<u8> {
    let mut strtab = vec![0u8];
    let mut symtab = vec![0u8; 24];
    for n in names {
        symtab.extend_from_slice(&(strtab.len() as u32).to_le_bytes());
        symtab.extend_from_slice(&[0x12, 0]); // STB_GLOBAL, STT_FUNC; default visibility
        symtab.extend_from_slice(&[0u8; 18]); // st_shndx, st_value, st_size
        strtab.extend_from_slice(n.as_bytes());
        strtab.push(0);
    }
    let sym_off = 64usize;
    let str_off = sym_off + symtab.len();
    let sh_off = (str_off + strtab.len()).next_multiple_of(8);
    let mut elf = vec![0u8; sh_off];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2; // 64-bit
    elf[5] = 1; // little endian
    elf[6] = 1;
    elf[16] = 3; // ET_DYN
    elf[18] = 224; // EM_AMDGPU
    elf[20] = 1;
    elf[0x28..0x30].copy_from_slice(&(sh_off as u64).to_le_bytes());
    elf[0x34] = 64; // e_ehsize
    elf[0x3a] = 64; // e_shentsize
    elf[0x3c] = 3; // e_shnum
    elf[sym_off..str_off].copy_from_slice(&symtab);
    elf[str_off..str_off + strtab.len()].copy_from_slice(&strtab);
    let section = |kind: u32, off: usize, size: usize, link: u32, entsize: u64| {
        let mut s = vec![0u8; 64];
        s[4..8].copy_from_slice(&kind.to_le_bytes());
        s[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
        s[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
        s[0x28..0x2c].copy_from_slice(&link.to_le_bytes());
        s[0x38..0x40].copy_from_slice(&entsize.to_le_bytes());
        s
    };
    elf.extend(vec![0u8; 64]);
    elf.extend(section(2, sym_off, symtab.len(), 2, 24)); // .symtab, strings in section 2
    elf.extend(section(3, str_off, strtab.len(), 0, 0)); // .strtab
    elf
}

/// The fake's module with the twelve all-reduce kernels and `extra` names.
fn module(hip: &Hip, extra: &[&str]) -> Dev {
    let mut names: Vec<&str> = KERNELS.to_vec();
    names.extend_from_slice(extra);
    hip.module(&tiny_code_object(&names)).expect("module loads")
}

/// Every rank launches its kernel on its own thread and stream and waits for it; the launches' statuses by rank.
fn run_ranks(hip: &Hip, w: &World, f: Dev, grid: u32, shot: Shot, mode: Mode, round_vecs: u64) -> Vec<i32> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..w.world)
            .map(|rank| {
                let mut params = w.params(shot, mode, rank, round_vecs);
                let stream = w.streams[rank];
                sc.spawn(move || {
                    let rc = hip.launch(f, [grid, 1, 1], [256, 1, 1], stream, &mut params);
                    assert_eq!(hip.synchronize(stream), 0);
                    rc
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn last_launches(hip: &Hip, n: usize) -> Vec<Launch> {
    let all = hip.fake.launches();
    all[all.len() - n..].to_vec()
}

#[test]
fn one_and_two_shot_give_the_kernels_sums_in_every_input_mode() {
    let (hip, _g) = Hip::open();
    let m = module(&hip, &[]);
    // 40 vectors: two-shot rounds of 7 vectors leave a short last round and chunks that do not divide evenly.
    for world in [2usize, 4] {
        let w = World::new(&hip, world, 40);
        let mut seed = 0;
        for shot in [Shot::One, Shot::Two] {
            for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
                for mode in [Mode::Staged, Mode::TableStaged, Mode::TableRegistered, Mode::Direct] {
                    seed += 1;
                    let name = kernel_name(shot, mode, dtype);
                    let f = hip.function(m, &name).expect("function");
                    w.fill_inputs(dtype, seed);
                    w.write_tables(mode);
                    for o in &w.outs {
                        // SAFETY: n_vec * 16 bytes of host memory.
                        unsafe { std::ptr::write_bytes(o.0 as *mut u8, 0xee, w.n_vec * 16) };
                    }
                    let round = if shot == Shot::Two && seed % 2 == 0 { 7 } else { 0 };
                    let grid = 1 + (seed % 3);
                    let rc = run_ranks(&hip, &w, f, grid, shot, mode, round);
                    let what = format!("{name} world {world} {mode:?}");
                    assert_eq!(rc, vec![0; world], "{what}");
                    let want = w.expected(dtype);
                    for (r, o) in w.outs.iter().enumerate() {
                        assert!(w.read(*o) == want, "{what}: rank {r}'s output is not the kernel's sum");
                    }
                    if matches!(mode, Mode::Staged | Mode::TableStaged) {
                        for (r, s) in w.staging.iter().enumerate() {
                            assert!(w.read(*s) == w.read(w.inputs[r]), "{what}: rank {r}'s staging holds its input");
                        }
                    }
                    assert_eq!(hip.fake.violations(), Vec::<String>::new(), "{what}");
                    for (r, l) in last_launches(&hip, world).iter().enumerate() {
                        // The rank threads record in any order.
                        let p = l.params.as_ref().expect("decoded parameters");
                        assert_eq!(l.name, name);
                        assert_eq!((l.grid, l.block, l.status, l.capturing), ([grid, 1, 1], [256, 1, 1], 0, false));
                        assert_eq!((l.runs, l.completed, l.aborted, l.timed_out, l.failed), (1, 1, 0, 0, 0), "{what}");
                        let rank = p.rank as usize;
                        assert!(rank < world, "{what}: launch {r} has rank {rank}");
                        assert_eq!(l.stream, w.streams[rank].0 as usize);
                        let dt = name.rsplit('_').next().unwrap_or_default();
                        assert_eq!((p.shot, p.world, p.n_vec, p.dtype), (shot, world as i32, 40, dt));
                        assert_eq!(p.flags, ptrs8(&w.flags));
                        assert_eq!(p.out, w.outs[rank].0);
                        assert_eq!(p.self_src, if mode == Mode::Direct { 0 } else { w.inputs[rank].0 });
                        assert_eq!(p.round_vecs, round);
                        assert_eq!(p.scratch, if shot == Shot::Two { ptrs8(&w.scratch) } else { [0; 8] });
                        match mode {
                            Mode::Staged => assert_eq!((p.inputs, p.table), (ptrs8(&w.staging), 0)),
                            Mode::Direct => assert_eq!((p.inputs, p.table), (ptrs8(&w.inputs), 0)),
                            _ => {
                                assert_eq!((p.inputs, p.table, p.table_kernel), ([0; 8], w.tables[rank].0, true));
                                assert_eq!(p.last_registered, Some(mode == Mode::TableRegistered));
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(hip.fake.calls("hipModuleLaunchKernel"), 2 * 3 * 4 * (2 + 4));
    assert_eq!(hip.fake.launch_total(), 2 * 3 * 4 * (2 + 4));
}

#[test]
fn a_captured_launch_recomputes_at_every_replay_with_the_inputs_of_the_moment() {
    let (hip, _g) = Hip::open();
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 24);
    let dtype = DataType::F32;
    let name = kernel_name(Shot::Two, Mode::TableStaged, dtype);
    let f = hip.function(m, &name).expect("function");
    w.write_tables(Mode::TableStaged);
    // Each rank captures its launch in global mode (as an engine captures its step), then the graphs replay
    // three times with new inputs; the table is rewritten to the registered inputs before the last two.
    let execs: Vec<Dev> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (hip, w) = (&hip, &w);
                sc.spawn(move || {
                    let s = w.streams[rank];
                    assert_eq!(hip.begin_capture(s, 0), 0);
                    let mut params = w.params(Shot::Two, Mode::TableStaged, rank, 5);
                    assert_eq!(hip.launch(f, [2, 1, 1], [128, 1, 1], s, &mut params), 0);
                    hip.end_capture(s).expect("capture ends valid")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    for l in hip.fake.launches() {
        assert!(l.capturing, "{l:?}");
        assert_eq!((l.status, l.runs), (0, 0), "a captured launch runs only when replayed");
    }
    for replay in 0..3u32 {
        w.fill_inputs(dtype, 100 + replay);
        if replay == 1 {
            w.write_tables(Mode::TableRegistered);
        }
        std::thread::scope(|sc| {
            for (&exec, &s) in execs.iter().zip(&w.streams) {
                let hip = &hip;
                sc.spawn(move || assert_eq!((hip.graph_launch(exec, s), hip.synchronize(s)), (0, 0)));
            }
        });
        let want = w.expected(dtype);
        for (r, o) in w.outs.iter().enumerate() {
            assert!(w.read(*o) == want, "replay {replay}: rank {r}'s output is not the sum of this replay's inputs");
        }
    }
    assert_eq!(hip.fake.violations(), Vec::<String>::new());
    let launches = hip.fake.launches();
    assert_eq!(launches.len(), 2, "replays add no launch records");
    for l in &launches {
        assert_eq!((l.runs, l.completed, l.aborted, l.timed_out), (3, 3, 0, 0), "{l:?}");
        assert_eq!(l.params.as_ref().and_then(|p| p.last_registered), Some(true));
    }
}

#[test]
fn malformed_launches_are_refused_with_a_violation_that_names_the_fault() {
    let (hip, _g) = Hip::open();
    // A launch the fake wrongly accepted would wait for its peer: fail in 2 s, not 20.
    hip.fake.set_kernel_timeout_ms(2000);
    let m = module(&hip, &["anyccl_mystery_f32"]);
    let w = World::new(&hip, 2, 8);
    let one = hip.function(m, "anyccl_one_shot_f32").expect("function");
    let s = w.streams[0];
    let launch = |f: Dev, grid: u32, edit: &dyn Fn(&mut Vec<Param>)| {
        let mut p = w.params(Shot::One, Mode::Staged, 0, 0);
        edit(&mut p);
        hip.launch(f, [grid, 1, 1], [256, 1, 1], s, &mut p)
    };
    type Edit<'a> = Box<dyn Fn(&mut Vec<Param>) + 'a>;
    let cases: Vec<(&str, i32, Edit<'_>, u32)> = vec![
        ("world 9 (2..=8)", 1, Box::new(|p| p[5] = Param::I32(9)), 1),
        ("world 1 (2..=8)", 1, Box::new(|p| p[5] = Param::I32(1)), 1),
        ("rank 2 of world 2", 1, Box::new(|p| p[4] = Param::I32(2)), 1),
        ("n_vec 0", 1, Box::new(|p| p[6] = Param::U64(0)), 1),
        ("no live hipMalloc allocation holds 144 bytes", 1, Box::new(|p| p[6] = Param::U64(9)), 1),
        ("out", 1, Box::new(|p| p[2] = Param::U64(w.outs[0].0 + 4)), 1),
        ("in[1] is null", 1, Box::new(|p| p[0] = Param::Ptrs([w.staging[0].0, 0, 0, 0, 0, 0, 0, 0])), 1),
        ("flags[1]", 1, Box::new(|p| p[3] = Param::Ptrs(ptrs8(&[w.flags[0], w.outs[1]]))), 1),
        ("grid 129x1x1", 1, Box::new(|_| {}), 129),
    ];
    for (want, code, edit, grid) in &cases {
        hip.fake.reset();
        assert_eq!(launch(one, *grid, edit.as_ref()), *code, "{want}");
        let v = hip.fake.violations();
        assert!(v.len() == 1 && v[0].contains(want), "{want}: {v:?}");
        let l = &hip.fake.launches()[0];
        assert_eq!((l.status, l.runs), (*code, 0), "{want}");
    }
    // A misaligned pointer is named with its address.
    hip.fake.reset();
    assert_eq!(launch(one, 1, &|p| p[1] = Param::U64(w.inputs[0].0 + 8)), 1);
    assert!(hip.fake.violations()[0].contains("self_src") && hip.fake.violations()[0].contains("16-byte aligned"));
    // A function the module has but the fake cannot run, and one the module lacks.
    hip.fake.reset();
    let mystery = hip.function(m, "anyccl_mystery_f32").expect("the module defines it");
    assert_eq!(launch(mystery, 1, &|_| {}), 98);
    let v = hip.fake.violations();
    assert!(v.len() == 1 && v[0].starts_with("anyccl_mystery_f32: not an all-reduce kernel"), "{v:?}");
    assert_eq!(hip.fake.launches()[0].name, "anyccl_mystery_f32");
    assert_eq!(hip.function(m, "anyccl_one_shot_f64").err(), Some(500));
    // A module that is not an AMDGPU ELF.
    let mut x86 = tiny_code_object(&["anyccl_one_shot_f32"]);
    x86[18] = 62;
    assert_eq!(hip.module(&x86).err(), Some(200));
}

/// `NormArgs` of fused.h: residual, weight, out, eps 1e-6, scale 1, bf16 output, `hidden_vec`, `tokens`.
fn norm_args(residual: Dev, weight: Dev, out: Dev, hidden_vec: u32, tokens: u64) -> Param {
    let floats = u64::from(1e-6f32.to_bits()) | (u64::from(1.0f32.to_bits()) << 32);
    Param::Norm([residual.0, weight.0, out.0, floats, u64::from(hidden_vec) << 32, tokens])
}

/// The fused, RMSNorm and quantized kernels are checked before they run, as the all-reduce kernels are, and a bad
/// launch is refused (1) with a violation naming the fault: a block other than 512 threads for the fused kernels
/// (their sum of squares is that of 512 threads), a row of 0 or more than 2048 vectors, a buffer too short for the
/// rows (`out`, 256 bytes for 2 rows of 8 vectors), a misaligned weight, world 9 and a grid of 129 blocks for the
/// fused one-shot, a staging buffer shorter than the quantized message's 4 blocks (144 bytes) and a block that
/// splits a quantization group. A good RMSNorm launch runs, with a grid beyond the 128 blocks of the flag arrays
/// (it has none), and writes its output.
#[test]
fn malformed_fused_and_quantized_launches_are_refused_with_the_fault_named() {
    let (hip, _g) = Hip::open();
    let names = ["anyccl_rmsnorm_bf16", "anyccl_fused_one_shot_bf16", "anyccl_quant_two_shot_int8_bf16"];
    let m = module(&hip, &names);
    // 8 vectors (128 bytes, one row of hidden 64) per buffer.
    let w = World::new(&hip, 2, 8);
    let [norm, fused, quant] = names.map(|n| hip.function(m, n).expect("function"));
    let s = w.streams[0];
    let rms = |edit: &dyn Fn(&mut Vec<Param>)| {
        let mut p = vec![Param::U64(w.inputs[0].0), norm_args(w.inputs[1], w.scratch[0], w.outs[0], 8, 1)];
        edit(&mut p);
        p
    };
    let one = |edit: &dyn Fn(&mut Vec<Param>)| {
        let mut p = vec![
            Param::Ptrs(ptrs8(&w.staging)),
            Param::U64(w.inputs[0].0),
            norm_args(w.inputs[1], w.scratch[0], w.outs[0], 8, 1),
            Param::Ptrs(ptrs8(&w.flags)),
            Param::I32(0),
            Param::I32(2),
        ];
        edit(&mut p);
        p
    };
    let q = |edit: &dyn Fn(&mut Vec<Param>)| {
        let mut p = vec![
            Param::U64(w.inputs[0].0),
            Param::Ptrs(ptrs8(&w.staging)),
            Param::Ptrs(ptrs8(&w.scratch)),
            Param::U64(w.outs[0].0),
            Param::Ptrs(ptrs8(&w.flags)),
            Param::I32(0),
            Param::I32(2),
            Param::U64(8),
        ];
        edit(&mut p);
        p
    };
    type Case<'a> = (&'a str, Dev, u32, u32, Vec<Param>);
    let cases: Vec<Case<'_>> = vec![
        ("block of 256 threads (the fused kernels need exactly 512)", norm, 1, 256, rms(&|_| {})),
        ("hidden_vec 0", norm, 1, 512, rms(&|p| p[1] = norm_args(w.inputs[1], w.scratch[0], w.outs[0], 0, 1))),
        ("hidden_vec 2049", norm, 1, 512, rms(&|p| p[1] = norm_args(w.inputs[1], w.scratch[0], w.outs[0], 2049, 1))),
        ("out", norm, 1, 512, rms(&|p| p[1] = norm_args(w.inputs[1], w.scratch[0], w.outs[0], 8, 2))),
        ("weight", norm, 1, 512, rms(&|p| p[1] = norm_args(w.inputs[1], Dev(w.scratch[0].0 + 8), w.outs[0], 8, 1))),
        ("world 9 (2..=8)", fused, 1, 512, one(&|p| p[5] = Param::I32(9))),
        ("grid 129x1x1", fused, 129, 512, one(&|_| {})),
        ("stage[0]", quant, 1, 512, q(&|p| p[7] = Param::U64(16))),
        ("not whole groups of a quantization block", quant, 1, 510, q(&|_| {})),
    ];
    for (want, f, grid, block, mut p) in cases {
        hip.fake.reset();
        assert_eq!(hip.launch(f, [grid, 1, 1], [block, 1, 1], s, &mut p), 1, "{want}");
        let v = hip.fake.violations();
        assert!(v.len() == 1 && v[0].contains(want), "{want}: {v:?}");
        let l = &hip.fake.launches()[0];
        assert_eq!((l.status, l.runs), (1, 0), "{want}");
    }
    // The good RMSNorm launch: 200 blocks, runs once, writes its row.
    hip.fake.reset();
    let before = w.read(w.outs[0]);
    assert_eq!(hip.launch(norm, [200, 1, 1], [512, 1, 1], s, &mut rms(&|_| {})), 0);
    assert_eq!(hip.synchronize(s), 0);
    assert_eq!(hip.fake.violations(), Vec::<String>::new());
    let l = &hip.fake.launches()[0];
    assert_eq!((l.status, l.runs, l.completed), (0, 1, 1));
    assert_ne!(w.read(w.outs[0]), before, "the RMSNorm wrote nothing");
}

/// Rank `rank`'s abort word.
fn abort_word(w: &World, rank: usize) -> Dev {
    Dev(w.flags[rank].0 + ABORT_WORD_OFFSET as u64)
}

#[test]
fn an_aborted_rank_ends_without_its_peers() {
    let (hip, _g) = Hip::open();
    hip.fake.set_kernel_timeout_ms(5000);
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    w.fill_inputs(DataType::F32, 1);
    let side = hip.stream();
    let launch = |rank: usize| {
        let mut p = w.params(Shot::One, Mode::Staged, rank, 0);
        hip.launch(f, [1, 1, 1], [256, 1, 1], w.streams[rank], &mut p)
    };
    // The abort word set before the launch (from another stream, as the communicator sets it): rank 0's kernel
    // ends at once, alone (running to its end on what the peer's memory holds, as on a GPU: its output is garbage).
    assert_eq!(hip.write_value32(side, abort_word(&w, 0), 1), 0);
    let started = Instant::now();
    assert_eq!(launch(0), 0);
    assert_eq!(hip.synchronize(w.streams[0]), 0);
    assert!(started.elapsed() < Duration::from_secs(2), "the aborted kernel waited for its peer");
    let l = &hip.fake.launches()[0];
    assert_eq!((l.runs, l.completed, l.aborted, l.timed_out), (1, 0, 1, 0), "{l:?}");
    assert_eq!(hip.fake.violations(), Vec::<String>::new());
    // Its barrier stores reached rank 1 as on a GPU: rank 1's launch of the same step completes without waiting.
    assert_eq!((launch(1), hip.synchronize(w.streams[1])), (0, 0));
    let l = &hip.fake.launches()[1];
    assert_eq!((l.completed, l.timed_out), (1, 0), "{l:?}");

    // The abort word set while the kernel waits for a peer that never launches: the launch returned at once (the
    // kernel runs on, as on a GPU), the stream is busy until the abort word ends the wait.
    assert_eq!(hip.write_value32(side, abort_word(&w, 0), 0), 0);
    assert_eq!(launch(0), 0);
    let deadline = Instant::now() + Duration::from_secs(4);
    while hip.fake.kernels_waiting() == 0 {
        assert!(Instant::now() < deadline, "rank 0's kernel never waited at its barrier");
        std::thread::yield_now();
    }
    assert_eq!(hip.query(w.streams[0]), 600, "hipErrorNotReady while the kernel waits");
    assert_eq!(hip.write_value32(side, abort_word(&w, 0), 1), 0);
    assert_eq!(hip.synchronize(w.streams[0]), 0);
    assert_eq!(hip.query(w.streams[0]), 0);
    let l = &hip.fake.launches()[2];
    assert_eq!((l.runs, l.completed, l.aborted, l.timed_out), (1, 0, 1, 0), "{l:?}");
    assert_eq!(hip.fake.violations(), Vec::<String>::new());
    assert_eq!(hip.fake.calls("hipStreamWriteValue32"), 3);
}

#[test]
fn a_kernel_whose_peer_never_comes_times_out_with_a_violation() {
    let (hip, _g) = Hip::open();
    hip.fake.set_kernel_timeout_ms(100);
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    let f = hip.function(m, "anyccl_two_shot_bf16").expect("function");
    let mut p = w.params(Shot::Two, Mode::Direct, 0, 0);
    let started = Instant::now();
    assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], w.streams[0], &mut p), 0);
    assert_eq!(hip.synchronize(w.streams[0]), 0);
    assert!(started.elapsed() < Duration::from_secs(3));
    let v = hip.fake.violations();
    assert!(v.len() == 1 && v[0].contains("rank 0 of 2: timed out"), "{v:?}");
    let l = &hip.fake.launches()[0];
    assert_eq!((l.completed, l.aborted, l.timed_out), (0, 0, 1), "{l:?}");
    hip.fake.set_kernel_timeout_ms(-1);
}

#[test]
fn ranks_launching_different_grids_wait_as_on_a_gpu() {
    // Each block has its own barrier slots: a peer that launches fewer blocks leaves the extra blocks waiting.
    let (hip, _g) = Hip::open();
    hip.fake.set_kernel_timeout_ms(100);
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    let rc: Vec<i32> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (hip, w) = (&hip, &w);
                sc.spawn(move || {
                    let mut p = w.params(Shot::One, Mode::Direct, rank, 0);
                    let rc = hip.launch(f, [1 + rank as u32, 1, 1], [256, 1, 1], w.streams[rank], &mut p);
                    assert_eq!(hip.synchronize(w.streams[rank]), 0);
                    rc
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert_eq!(rc, vec![0, 0]);
    // Rank 1's second block never meets a peer; rank 0 then waits for rank 1's last barrier, which comes only
    // when rank 1 gives up (whether that beats rank 0's own deadline is a matter of timing).
    let launches = hip.fake.launches();
    let rank1 = launches.iter().find(|l| l.params.as_ref().is_some_and(|p| p.rank == 1)).expect("rank 1's launch");
    assert_eq!((rank1.timed_out, rank1.completed), (1, 0), "{rank1:?}");
    assert!(hip.fake.violations().iter().any(|v| v.contains("rank 1 of 2: timed out")));
    hip.fake.set_kernel_timeout_ms(-1);
}

#[test]
fn races_and_freed_buffers_are_violations() {
    let (hip, _g) = Hip::open();
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    // One-shot in place over a directly read input: the peer may still read it while this rank writes.
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    let rc: Vec<i32> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (hip, w) = (&hip, &w);
                sc.spawn(move || {
                    let mut p = w.params(Shot::One, Mode::Direct, rank, 0);
                    p[2] = Param::U64(w.inputs[rank].0);
                    let rc = hip.launch(f, [1, 1, 1], [256, 1, 1], w.streams[rank], &mut p);
                    assert_eq!(hip.synchronize(w.streams[rank]), 0);
                    rc
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert_eq!(rc, vec![0, 0]);
    let v = hip.fake.violations();
    assert!(v.iter().any(|v| v.contains("one-shot writes out over in[")), "{v:?}");

    // A buffer freed between capture and replay: the replay's kernel refuses to run.
    hip.fake.reset();
    hip.fake.set_kernel_timeout_ms(100);
    let table = hip.function(m, "anyccl_one_shot_table_f32").expect("function");
    w.write_tables(Mode::TableStaged);
    let s = w.streams[0];
    assert_eq!(hip.begin_capture(s, 2), 0);
    let mut p = w.params(Shot::One, Mode::TableStaged, 0, 0);
    assert_eq!(hip.launch(table, [1, 1, 1], [256, 1, 1], s, &mut p), 0);
    let exec = hip.end_capture(s).expect("graph");
    assert_eq!(hip.free(w.tables[0]), 0);
    assert_eq!((hip.graph_launch(exec, s), hip.synchronize(s)), (0, 0));
    let v = hip.fake.violations();
    assert!(v.len() == 1 && v[0].contains("the input table") && v[0].contains("freed"), "{v:?}");
    assert_eq!(hip.fake.launches()[0].failed, 1);
    // Freeing it again is refused too.
    assert_eq!(hip.free(w.tables[0]), 1);
    hip.fake.set_kernel_timeout_ms(-1);
}

#[test]
fn launches_follow_the_capture_rules() {
    let (hip, _g) = Hip::open();
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    let s = w.streams[0];
    assert_eq!(hip.begin_capture(s, 0), 0);
    // A launch on the capturing stream is captured (runs 0); hipStreamWriteValue32 too (the word stays 0).
    let mut p = w.params(Shot::One, Mode::Staged, 0, 0);
    assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], s, &mut p), 0);
    assert_eq!(hip.write_value32(s, abort_word(&w, 0), 7), 0);
    // SAFETY: the abort word is a live u32 of host memory.
    assert_eq!(unsafe { *(abort_word(&w, 0).0 as *const u32) }, 0, "a captured write ran during capture");
    // A launch on the null stream while a global capture runs is refused and invalidates the capture.
    assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], Dev(0), &mut p), 900);
    assert_eq!(hip.end_capture(s).err(), Some(901));
    let launches = hip.fake.launches();
    assert_eq!((launches[0].capturing, launches[0].status, launches[0].runs), (true, 0, 0));
    assert_eq!((launches[1].capturing, launches[1].status), (false, 900));
    let v = hip.fake.violations();
    assert!(v.len() == 1 && v[0].contains("the legacy stream cannot be used during capture"), "{v:?}");
    // Loading a module during capture is refused as HIP refuses it.
    hip.fake.reset();
    assert_eq!(hip.begin_capture(s, 0), 0);
    assert_eq!(hip.module(&tiny_code_object(&["x"])).err(), Some(900));
    assert_eq!(hip.end_capture(s).err(), Some(901));
}

#[test]
fn a_parameter_buffer_in_extra_is_decoded_at_the_kernels_offsets() {
    let (hip, _g) = Hip::open();
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 16);
    w.fill_inputs(DataType::F32, 3);
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    // anyccl_kernels_common::allreduce_params("anyccl_one_shot_f32"): in 0, self_src 64, out 72, flags 80,
    // rank 144, world 148, n_vec 152; 160 bytes.
    let rc: Vec<i32> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (hip, w) = (&hip, &w);
                sc.spawn(move || {
                    let mut b = vec![0u8; 160];
                    for (i, p) in ptrs8(&w.staging).iter().enumerate() {
                        b[i * 8..i * 8 + 8].copy_from_slice(&p.to_le_bytes());
                    }
                    b[64..72].copy_from_slice(&w.inputs[rank].0.to_le_bytes());
                    b[72..80].copy_from_slice(&w.outs[rank].0.to_le_bytes());
                    for (i, p) in ptrs8(&w.flags).iter().enumerate() {
                        b[80 + i * 8..88 + i * 8].copy_from_slice(&p.to_le_bytes());
                    }
                    b[144..148].copy_from_slice(&(rank as i32).to_le_bytes());
                    b[148..152].copy_from_slice(&2i32.to_le_bytes());
                    b[152..160].copy_from_slice(&16u64.to_le_bytes());
                    let rc = hip.launch_extra(f, [2, 1, 1], w.streams[rank], &mut b);
                    assert_eq!(hip.synchronize(w.streams[rank]), 0);
                    rc
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert_eq!(rc, vec![0, 0]);
    let want = w.expected(DataType::F32);
    assert!(w.outs.iter().all(|o| w.read(*o) == want));
    assert_eq!(hip.fake.violations(), Vec::<String>::new());
    // A buffer of the wrong size is refused.
    let mut short = vec![0u8; 152];
    assert_eq!(hip.launch_extra(f, [1, 1, 1], w.streams[0], &mut short), 1);
    assert!(hip.fake.violations()[0].contains("ends before parameter 6"), "{:?}", hip.fake.violations());
}

#[test]
fn ipc_handles_name_live_allocations() {
    let (hip, _g) = Hip::open();
    let get: unsafe extern "C" fn(*mut IpcHandle, Ptr) -> i32 = hip.sym("hipIpcGetMemHandle");
    let open: unsafe extern "C" fn(*mut Ptr, IpcHandle, u32) -> i32 = hip.sym("hipIpcOpenMemHandle");
    let close: unsafe extern "C" fn(Ptr) -> i32 = hip.sym("hipIpcCloseMemHandle");
    let a = hip.malloc(4096, 0);
    let mut h = IpcHandle([0; 64]);
    let mut mapped = null_mut();
    // SAFETY: the fake's IPC calls with a live allocation, a handle it made, and the pointer it returned.
    unsafe {
        // A handle of an interior pointer names the allocation: opening maps it from its base.
        assert_eq!(get(&mut h, (a.0 + 256) as Ptr), 0);
        assert_eq!(open(&mut mapped, h, 1), 0);
        assert_eq!(mapped as u64, a.0);
        assert_eq!(hip.fake.ipc_open_count(), 1);
        assert_eq!(close(mapped), 0);
        assert_eq!(hip.fake.ipc_open_count(), 0);
        assert_eq!(close(mapped), 1, "closing twice");
        // Freed memory: its handle no longer opens, even when a new allocation takes the address.
        assert_eq!(hip.free(a), 0);
        let b = hip.malloc(4096, 0);
        assert_eq!(open(&mut mapped, h, 1), 400);
        assert_eq!(get(&mut h, null_mut()), 1);
        let _ = hip.free(b);
    }
    assert_eq!(hip.fake.calls("hipIpcGetMemHandle"), 2);
    assert_eq!(hip.fake.calls("hipIpcOpenMemHandle"), 2);
    assert_eq!(hip.fake.calls("hipIpcCloseMemHandle"), 2);
    let v = hip.fake.violations();
    assert!(v.len() == 2 && v[0].contains("not returned by hipIpcOpenMemHandle"), "{v:?}");
}

#[test]
fn the_real_code_object_defines_every_kernel_the_fake_runs() {
    // hipcc's code object (when this build has one) loads and yields every kernel the fake runs by name: the
    // all-reduce, push, fused, fused push and quantized kernels.
    let (hip, _g) = Hip::open();
    match anyccl_kernels_hip::code_object_for("allreduce", "gfx90a") {
        Some(image) => {
            let m = hip.module(image).expect("hipcc's code object loads");
            let all = KERNELS.iter().chain(&anyccl_kernels_hip::PUSH_KERNELS).chain(&anyccl_kernels_hip::FUSED_KERNELS);
            for k in all.chain(&anyccl_kernels_hip::FUSED_PUSH_KERNELS).chain(&anyccl_kernels_hip::QUANT_KERNELS) {
                assert!(hip.function(m, k).is_ok(), "{k}");
            }
            assert_eq!(hip.function(m, "anyccl_one_shot_f32.kd").err(), Some(500), "a descriptor is no function");
        }
        None => {
            let why = anyccl_kernels_hip::why_not("gfx90a").unwrap_or_default();
            assert!(std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_none(), "kernels required but not built: {why}");
            assert!(why.contains("HIP kernels"), "{why}");
        }
    }
}

#[test]
fn the_compute_unit_count_is_an_attribute_and_others_are_refused() {
    let (hip, _g) = Hip::open();
    let get: unsafe extern "C" fn(*mut i32, i32, i32) -> i32 = hip.sym("hipDeviceGetAttribute");
    let mut n = 0;
    // SAFETY: writes one int.
    unsafe {
        assert_eq!(get(&mut n, 63, 0), 0);
        assert_eq!(n, 104, "hipDeviceAttributeMultiprocessorCount of the fake MI210");
        assert_eq!(get(&mut n, 1, 0), 1, "an attribute the fake does not know");
        assert_eq!(get(&mut n, 63, 99), 101, "a device that does not exist");
    }
}

#[test]
fn a_free_waits_for_the_kernels_of_its_own_device_only() {
    let (hip, _g) = Hip::open();
    let set_device: unsafe extern "C" fn(i32) -> i32 = hip.sym("hipSetDevice");
    // SAFETY: sets the calling thread's device (a thread-local of the fake).
    let on_device = |d: i32| assert_eq!(unsafe { set_device(d) }, 0);
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    let wait_for_a_waiting_kernel = || {
        let deadline = Instant::now() + Duration::from_secs(4);
        while hip.fake.kernels_waiting() == 0 {
            assert!(Instant::now() < deadline, "no kernel waits at its barrier");
            std::thread::yield_now();
        }
    };
    // Rank 0 (device 0) waits in its kernel for rank 1 (device 1), whose thread frees memory before it launches:
    // the free waits for device 1 only, so rank 1 gets to its launch and both complete.
    hip.fake.set_kernel_timeout_ms(5000);
    std::thread::scope(|sc| {
        let (hip, w) = (&hip, &w);
        let rank0 = sc.spawn(move || {
            on_device(0);
            let s = hip.stream();
            let mut p = w.params(Shot::One, Mode::Direct, 0, 0);
            assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], s, &mut p), 0);
            assert_eq!(hip.synchronize(s), 0);
        });
        wait_for_a_waiting_kernel();
        sc.spawn(move || {
            on_device(1);
            let s = hip.stream();
            let started = Instant::now();
            assert_eq!(hip.free(hip.malloc(64, 0)), 0);
            assert!(started.elapsed() < Duration::from_secs(2), "a free on device 1 waited for device 0's kernel");
            let mut p = w.params(Shot::One, Mode::Direct, 1, 0);
            assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], s, &mut p), 0);
            assert_eq!(hip.synchronize(s), 0);
        });
        rank0.join().expect("rank 0");
    });
    let l = hip.fake.launches();
    assert!(l.iter().all(|l| l.completed == 1), "{l:?}");
    // A free on device 0 while rank 0's kernel waits for a peer that never comes returns only once the kernel
    // ended (here by timing out), as HIP's free waits for the device.
    hip.fake.set_kernel_timeout_ms(300);
    on_device(0);
    let s = hip.stream();
    let mut p = w.params(Shot::One, Mode::Direct, 0, 0);
    assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], s, &mut p), 0);
    wait_for_a_waiting_kernel();
    assert_eq!(hip.free(hip.malloc(64, 0)), 0);
    let last = hip.fake.launches().pop().expect("the launch");
    assert_eq!((last.timed_out, last.completed), (1, 0), "the free returned before the kernel ended: {last:?}");
    hip.fake.set_kernel_timeout_ms(-1);
}

#[test]
fn the_launch_record_keeps_the_last_4096_and_counts_all() {
    let (hip, _g) = Hip::open();
    let m = module(&hip, &[]);
    let w = World::new(&hip, 2, 8);
    let f = hip.function(m, "anyccl_one_shot_f32").expect("function");
    // Refused launches (world 9) are recorded too, and cost nothing to make.
    for _ in 0..4100 {
        let mut p = w.params(Shot::One, Mode::Direct, 0, 0);
        p[5] = Param::I32(9);
        assert_eq!(hip.launch(f, [1, 1, 1], [256, 1, 1], w.streams[0], &mut p), 1);
    }
    let held = hip.fake.launches();
    assert_eq!((held.len(), hip.fake.launch_total()), (4096, 4100));
    assert_eq!((held[0].seq, held[4095].seq), (5, 4100), "oldest first, the first four dropped");
    hip.fake.reset();
    assert_eq!((hip.fake.launches().len(), hip.fake.launch_total()), (0, 0));
}
