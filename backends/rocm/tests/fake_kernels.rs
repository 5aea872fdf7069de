//! The fake HIP runtime's emulation of the custom all-reduce kernels (tests/support/fake_hip.c), driven through
//! its C ABI with no communicator: ranks are threads of this process that each launch their rank's kernel, as the
//! ROCm communicator will. The emulated kernels must give the exact sums the kernels give (f32 accumulation in
//! rank order), in every input mode (staged, input table before and after registration, direct), eager and
//! replayed from a graph; refuse malformed launches with a recorded violation; stop on the abort word; and record
//! every launch with its grid and decoded parameters. "Device" memory is host memory, so the tests fill and read
//! buffers directly.
//!
//! The fake keeps one process-wide record, so the tests take a lock and run one at a time.

#[path = "../../../tests/support/fake_ccl.rs"]
mod fake_ccl;
#[path = "../../../tests/support/fake_hip.rs"]
mod fake_hip;

use std::ffi::{c_void, CString};
use std::ptr::null_mut;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyccl_core::dtype::Value;
use anyccl_core::DataType;
use anyccl_kernels_hip::{ABORT_WORD_OFFSET, FLAG_BYTES, KERNELS, MAX_RANKS};
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
}

impl Param {
    fn ptr(&mut self) -> *mut c_void {
        match self {
            Param::Ptrs(p) => (p as *mut [u64; 8]).cast(),
            Param::U64(v) => (v as *mut u64).cast(),
            Param::I32(v) => (v as *mut i32).cast(),
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

fn kernel_name(shot: Shot, mode: Mode, dtype: DataType) -> String {
    let table = matches!(mode, Mode::TableStaged | Mode::TableRegistered);
    let shot = if shot == Shot::One { "one_shot" } else { "two_shot" };
    let dt = if dtype == DataType::F32 { "f32" } else { "bf16" };
    format!("anyccl_{shot}_{}{dt}", if table { "table_" } else { "" })
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

/// Every rank launches its kernel on its own thread and stream; the launches' statuses by rank.
fn run_ranks(hip: &Hip, w: &World, f: Dev, grid: u32, shot: Shot, mode: Mode, round_vecs: u64) -> Vec<i32> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..w.world)
            .map(|rank| {
                let mut params = w.params(shot, mode, rank, round_vecs);
                let stream = w.streams[rank];
                sc.spawn(move || hip.launch(f, [grid, 1, 1], [256, 1, 1], stream, &mut params))
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
            for dtype in [DataType::F32, DataType::Bf16] {
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
                        let dt = if dtype == DataType::F32 { "f32" } else { "bf16" };
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
    assert_eq!(hip.fake.calls("hipModuleLaunchKernel"), 2 * 2 * 4 * (2 + 4));
    assert_eq!(hip.fake.launch_total(), 2 * 2 * 4 * (2 + 4));
}
