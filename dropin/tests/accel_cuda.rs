//! The drop-in's CUDA side of `ncclAllReduce` (NCCL underneath, so `pending::<anyccl_cuda::Cuda>`) with no GPU:
//! the drop-in library cargo built for this run over the computing fake NCCL 2.28 and the fake CUDA driver
//! (`libcuda.so.1`: testkit/c/fake_cuda.c over the fake HIP runtime, which emulates anyccl's kernels from the
//! sm_90 cubin and records every launch, allocation count, IPC mapping and capture violation). Ranks are threads
//! calling the drop-in's C ABI; the application's side is the CUDA driver API (each rank's primary context made
//! current, `cuMemAlloc`, a non-blocking `cuStreamCreate` stream, global-mode captures, `cuGraphLaunch`).
//!
//! cudarc (inside the drop-in) finds `libcuda.so` through the dynamic loader, which reads `LD_LIBRARY_PATH` when the
//! process starts: each case runs this binary's ignored `child` test in a child process with `LD_LIBRARY_PATH` at
//! the fake driver's folder and `ANYCCL_NCCL_PATH` at the fake NCCL. The child checks every result against the host
//! reference and prints what the fake recorded; the parent asserts on that and on the drop-in's debug log.
//!
//! The custom CUDA kernels must be compiled in (`ANYCCL_CUDA_TOOLKIT=$(ci/install-cuda.sh)`, as CI does): without
//! them the drop-in turns the kernels off and the cases fail, saying so.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_cuda;
use anyccl_testkit::fake_hip;

mod support;
use support::accel_common;

use std::collections::BTreeSet;
use std::ffi::c_int;

use accel_common::*;
use fake_hip::{FakeHip, Launch};

// ---------------------------------------------------------------------------------------------------------------
// The parent half.

fn checked(case: &str, extra: &[(&str, &str)]) -> Child {
    let cuda = fake_cuda::build_cuda();
    let nccl = fake_cuda::build_nccl(&fake_ccl::NCCL_2_28);
    let dir = cuda.parent().expect("the fake driver's folder").to_owned();
    let base = [
        ("LD_LIBRARY_PATH", dir.into_os_string()),
        ("ANYCCL_NCCL_PATH", nccl.into_os_string()),
        ("FAKECUDA_LIB", cuda.into_os_string()),
        ("FAKECUDA_DEVICES", "4".into()),
    ];
    let c = run_child("accel-cuda", case, &base, extra);
    if c.stderr.contains("not compiled in") {
        panic!(
            "case {case}: the custom CUDA kernels are not compiled into this build; build with \
             ANYCCL_CUDA_TOOLKIT=$(ci/install-cuda.sh) as CI does\nstderr:\n{}",
            c.stderr
        );
    }
    assert!(c.ok, "case {case} failed\nstdout:\n{}\nstderr:\n{}", c.stdout, c.stderr);
    c
}

/// The `launch=` lines the child printed (one per kernel launch the fake recorded).
fn launches(c: &Child) -> Vec<&str> {
    c.stdout.lines().filter_map(|l| l.strip_prefix("launch=")).collect()
}

/// The launch line the child prints for a custom kernel of `world` ranks over `bytes` bytes, run once eagerly on
/// `rank` with the communicator's grid for that size (one block per 32 KiB, 4 to 64) and 512 threads.
fn eager_launch(name: &str, rank: usize, world: usize, bytes: usize) -> String {
    let blocks = (bytes / (32 << 10)).clamp(4, 64);
    format!(
        "{name} grid={blocks},1,1 block=512,1,1 status=0 rank={rank} world={world} n_vec={} capturing=false runs=1 \
         completed=1",
        bytes / 16
    )
}

/// The cases that check the one-shot's machinery at sizes NVIDIA's default table gives to the push one-shot run
/// with the push one-shot off, as before it existed ([`world_two_runs_the_push_one_shot_through_the_drop_in`]
/// runs it).
const PUSH_OFF: (&str, &str) = ("ANYCCL_PUSH_MAX_BYTES", "0");

#[test]
fn world_two_runs_the_cuda_one_shot_and_the_rest_forwards() {
    let c = checked("world2", &[PUSH_OFF]);
    // Per rank: bf16 4 KiB out of place and f32 4 KiB in place on the one-shot, int32 forwarded to NCCL. Every
    // result was checked against the host reference in the child.
    let mut want = Vec::new();
    for name in ["anyccl_one_shot_bf16", "anyccl_one_shot_f32"] {
        for rank in 0..2 {
            want.push(eager_launch(name, rank, 2, 4096));
        }
    }
    let mut got: Vec<String> = launches(&c).into_iter().map(str::to_owned).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "{}", c.stdout);
    assert_eq!(field(&c, "custom_calls"), "4");
    assert_eq!(field(&c, "calls"), "6");
    assert_eq!(field(&c, "violations"), "0");
    // The setup over NCCL: each rank loaded the sm_90 module and mapped its peer's staging, scratch and flags.
    assert_eq!(field(&c, "setup"), "modules_loaded=2 ipc_opened=6");
    // ANYCCL_LOG=debug: the choice and the selector's rule that made it, per call.
    let bf16 = log_lines(
        &c,
        &["choice=\"one-shot\"", "count=2048", "dtype=bfloat16", "why=defaults #4: vendor nvidia world 2 bytes"],
    );
    assert_eq!(bf16.len(), 2, "{}", c.stderr);
    let f32 = log_lines(
        &c,
        &["choice=\"one-shot\"", "count=1024", "dtype=float32", "why=defaults #4: vendor nvidia world 2 bytes"],
    );
    assert_eq!(f32.len(), 2, "{}", c.stderr);
    let int = log_lines(&c, &["choice=\"ccl\"", "dtype=int32", "float32, float16 and bfloat16 only"]);
    assert_eq!(int.len(), 2, "{}", c.stderr);
    // The communicators' state was made on the CUDA backend after the agreement round.
    let pending: Vec<&str> =
        c.stderr.lines().filter(|l| l.contains("anyccl state: pending") && l.contains("backend=\"cuda\"")).collect();
    assert_eq!(pending.len(), 2, "{}", c.stderr);
}

/// The same calls with the push one-shot on (the default): the setup over NCCL also maps each peer's push receive
/// buffer (8 mappings, not 6), the 4 KiB bf16 and f32 sums run `anyccl_push_one_shot_*` once per rank with
/// programmatic dependent launch (the fake is sm_90), chosen by NVIDIA's first world-2 rule, and every result was
/// right (checked in the child); int32 still forwards to NCCL.
#[test]
fn world_two_runs_the_push_one_shot_through_the_drop_in() {
    let c = checked("world2", &[]);
    let mut want = Vec::new();
    for name in ["anyccl_push_one_shot_bf16", "anyccl_push_one_shot_f32"] {
        for rank in 0..2 {
            want.push(format!(
                "{name} grid=4,1,1 block=512,1,1 status=0 rank={rank} world=2 n_vec=256 capturing=false runs=1 \
                 completed=1 pdl=true"
            ));
        }
    }
    let mut got: Vec<String> = launches(&c).into_iter().map(str::to_owned).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "{}", c.stdout);
    assert_eq!(field(&c, "custom_calls"), "4");
    assert_eq!(field(&c, "violations"), "0");
    assert_eq!(field(&c, "setup"), "modules_loaded=2 ipc_opened=8");
    for (count, dtype) in [("count=2048", "dtype=bfloat16"), ("count=1024", "dtype=float32")] {
        let lines =
            log_lines(&c, &["choice=\"one-shot-push\"", count, dtype, "why=defaults #4: vendor nvidia world 2 bytes"]);
        assert_eq!(lines.len(), 2, "{}", c.stderr);
    }
    assert_eq!(log_lines(&c, &["choice=\"ccl\"", "dtype=int32"]).len(), 2, "{}", c.stderr);
}

#[test]
fn world_four_runs_the_cuda_two_shot_on_a_mebibyte() {
    let c = checked("world4", &[]);
    // f32 and bf16, 1 MiB each, at world 4: NVLS comes first in NVIDIA's sm_90 table there, but the fake (like a
    // machine without multicast) has none, so two-shot runs.
    let mut want = Vec::new();
    for name in ["anyccl_two_shot_f32", "anyccl_two_shot_bf16"] {
        for rank in 0..4 {
            want.push(eager_launch(name, rank, 4, 1 << 20));
        }
    }
    let mut got: Vec<String> = launches(&c).into_iter().map(str::to_owned).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "{}", c.stdout);
    assert_eq!(field(&c, "custom_calls"), "8");
    assert_eq!(field(&c, "violations"), "0");
    assert_eq!(log_lines(&c, &["choice=\"two-shot\"", "count=262144", "dtype=float32"]).len(), 4, "{}", c.stderr);
    assert_eq!(log_lines(&c, &["choice=\"two-shot\"", "count=524288", "dtype=bfloat16"]).len(), 4, "{}", c.stderr);
}

#[test]
fn captured_calls_forward_before_setup_and_replay_the_kernels_after_it() {
    let c = checked("capture", &[PUSH_OFF]);
    // Before setup: the captured call went to NCCL (no launch, nothing allocated, mapped or loaded during the
    // capture: zero violations) and its graph replayed right.
    assert_eq!(field(&c, "before_setup"), "launches=0 custom=0 violations=0");
    let before = log_lines(&c, &["choice=\"ccl\"", "nothing is set up during capture"]);
    assert_eq!(before.len(), 2, "{}", c.stderr);
    // After the eager setup call: the captured call is the one-shot's `_table` kernel (reading the input through
    // staging), recorded while capturing and run at each of the two replays, each result right.
    let captured: Vec<&str> = launches(&c).into_iter().filter(|l| l.contains("capturing=true")).collect();
    assert_eq!(captured.len(), 2, "{}", c.stdout);
    let ranks: BTreeSet<&str> =
        captured.iter().filter_map(|l| l.split_whitespace().find(|w| w.starts_with("rank="))).collect();
    assert_eq!(ranks, BTreeSet::from(["rank=0", "rank=1"]), "{}", c.stdout);
    for l in &captured {
        assert!(l.starts_with("anyccl_one_shot_table_f32 grid=4,1,1 block=512,1,1 status=0 "), "{l}");
        assert!(l.ends_with("capturing=true runs=2 completed=2"), "{l}");
    }
    assert_eq!(field(&c, "custom_calls"), "4");
    assert_eq!(field(&c, "violations"), "0");
}

#[test]
fn destroy_releases_anyccls_state_before_forwarding() {
    let c = checked("destroy", &[PUSH_OFF]);
    // Set up: each rank mapped its peer's three buffers and loaded the kernels' module, and holds buffers the setup
    // allocated through the driver (5 per rank today: staging, scratch, flags, the graph-input tables and the
    // communicator's own 4-byte scratch; at least the first three).
    let setup = field(&c, "after_setup");
    assert!(setup.starts_with("ipc_open=6 modules_loaded=2 modules_unloaded=0 allocated="), "{setup}");
    let live: i32 = setup.rsplit_once("live=").and_then(|(_, n)| n.parse().ok()).expect("a count");
    assert!(live >= 6, "{setup}");
    // ncclCommDestroy: every mapping closed, both modules unloaded, every allocation of the drop-in's freed (none
    // left in the fake driver's records) and the primary-context reference each slot held released.
    assert_eq!(field(&c, "after_destroy"), "ipc_open=0 modules_unloaded=2 live=0 contexts_released=2");
    // The release comes before the forwarded destroy, for each communicator (two of two ranks each; a later one may
    // reuse an address, so the last event of each address counts).
    let comm_of = |l: &str| l.split_whitespace().find(|w| w.starts_with("comm=")).map(str::to_owned);
    let mut last: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
    let mut destroys = 0;
    for l in c.stderr.lines() {
        let Some(comm) = comm_of(l) else { continue };
        if l.contains("anyccl state of the communicator released") {
            last.insert(comm, "released");
        } else if l.contains("function=\"ncclCommDestroy\"") {
            assert_eq!(last.get(&comm).copied(), Some("released"), "{comm} destroyed before its state was released");
            last.insert(comm, "destroyed");
            destroys += 1;
        }
    }
    assert_eq!(destroys, 4, "{}", c.stderr);
    assert_eq!(field(&c, "violations"), "0");
}

#[test]
fn anyccl_disable_forwards_everything_to_nccl() {
    let c = checked("disabled", &[("ANYCCL_DISABLE", "custom-kernels")]);
    assert!(launches(&c).is_empty(), "{}", c.stdout);
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "calls"), "4");
    // Nothing of the kernels' setup ran: no module, no IPC handle.
    assert_eq!(field(&c, "setup"), "modules_loaded=0 ipc_opened=0");
    assert_eq!(log_lines(&c, &["choice=\"ccl\"", "ANYCCL_DISABLE"]).len(), 4, "{}", c.stderr);
    assert_eq!(field(&c, "violations"), "0");
}

// ---------------------------------------------------------------------------------------------------------------
// The child half.

/// One line per launch the fake recorded.
fn print_launches(fake: &FakeHip) {
    for l in fake.launches() {
        println!("launch={}", describe(&l));
    }
}

fn describe(l: &Launch) -> String {
    let (rank, world, n_vec) = match (&l.params, &l.push) {
        (Some(p), _) => (p.rank, p.world, p.n_vec),
        (None, Some(p)) => (p.rank, p.world, p.n_vec),
        (None, None) => (-1, -1, 0),
    };
    // Push launches say whether they used programmatic dependent launch.
    let pdl = if l.push.is_some() { format!(" pdl={}", l.pdl) } else { String::new() };
    format!(
        "{} grid={},{},{} block={},{},{} status={} rank={rank} world={world} n_vec={n_vec} capturing={} runs={} \
         completed={}{pdl}",
        l.name,
        l.grid[0],
        l.grid[1],
        l.grid[2],
        l.block[0],
        l.block[1],
        l.block[2],
        l.status,
        l.capturing,
        l.runs,
        l.completed,
    )
}

#[test]
#[ignore = "the child half of the drop-in's CUDA acceleration tests, which run it with the fakes' environment"]
fn child() {
    let case = std::env::var("ACCEL_CASE").expect("run by the other tests of this file, which set ACCEL_CASE");
    let (api, fake) = load_api(Runtime::Cuda);
    fake.reset();
    let setup_line = |fake: &FakeHip| {
        println!(
            "setup=modules_loaded={} ipc_opened={}",
            fake.calls("cuModuleLoadData"),
            fake.calls("cuIpcOpenMemHandle_v2")
        )
    };
    match case.as_str() {
        "world2" | "disabled" => {
            ranks(&api, 2, |r| {
                r.checked_all_reduce(NCCL_BFLOAT16, 2048, 0, false);
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 1, true);
                if case == "world2" {
                    r.checked_all_reduce(NCCL_INT32, 1024, 2, false);
                }
            });
            setup_line(&fake);
        }
        "world4" => {
            ranks(&api, 4, |r| {
                r.checked_all_reduce(NCCL_FLOAT32, 262_144, 0, false);
                r.checked_all_reduce(NCCL_BFLOAT16, 524_288, 1, false);
            });
        }
        "capture" => {
            let before = std::sync::Mutex::new(String::new());
            // Global-mode captures: no rank allocates or copies while another captures (the fake would count that
            // as a violation of the test itself), so the phases are separated by barriers.
            let phase = std::sync::Barrier::new(2);
            ranks(&api, 2, |r| {
                let n = 1024;
                let bytes = n * 4;
                let (send, recv) = (r.alloc(bytes), r.alloc(bytes));
                let (send2, recv2) = (r.alloc(bytes), r.alloc(bytes));
                let input =
                    |round: usize| encode(NCCL_FLOAT32, &(0..n).map(|i| value(r.rank, round, i)).collect::<Vec<_>>());
                r.upload(send, &input(0));
                // Before setup: captured, forwarded to NCCL, replayed right.
                phase.wait();
                let exec = r.capture(|| r.all_reduce(send, recv, n, NCCL_FLOAT32));
                phase.wait();
                r.replay(exec);
                r.check(recv, NCCL_FLOAT32, n, 0);
                if phase.wait().is_leader() {
                    // SAFETY: a counter read.
                    let custom = unsafe { (api.custom_calls.expect("the drop-in counts custom calls"))() };
                    *before.lock().expect("lock") = format!(
                        "launches={} custom={custom} violations={}",
                        fake.launch_total(),
                        fake.violations().len()
                    );
                }
                // Eager: sets the kernels up.
                r.checked_all_reduce(NCCL_FLOAT32, n, 1, false);
                // Captured after setup, replayed twice with new inputs.
                phase.wait();
                let exec = r.capture(|| r.all_reduce(send2, recv2, n, NCCL_FLOAT32));
                phase.wait();
                for round in [2, 3] {
                    r.upload(send2, &input(round));
                    r.replay(exec);
                    r.check(recv2, NCCL_FLOAT32, n, round);
                }
            });
            println!("before_setup={}", before.into_inner().expect("lock"));
            print_launches(&fake);
        }
        "destroy" => destroy(&api, &fake),
        other => panic!("unknown case {other}"),
    }
    if case != "capture" {
        print_launches(&fake);
    }
    // SAFETY: counter reads.
    unsafe {
        println!("custom_calls={}", (api.custom_calls.expect("the drop-in counts custom calls"))());
        println!("calls={}", (api.calls)());
    }
    println!("violations={}", fake.violations().len());
    for v in fake.violations() {
        println!("violation: {v}");
    }
}

/// The child half of [`destroy_releases_anyccls_state_before_forwarding`].
fn destroy(api: &Api, fake: &FakeHip) {
    let driver = open_leaked(&std::env::var_os("FAKECUDA_LIB").expect("set by the parent"));
    let retained: unsafe extern "C" fn() -> c_int = sym(driver, "fakecuda_contexts_retained");
    // SAFETY: a counter read of the fake driver.
    let contexts = || unsafe { retained() };
    let barrier = std::sync::Barrier::new(2);
    let seen = std::sync::Mutex::new(String::new());
    let snapshot = std::sync::Mutex::new((0, 0, 0));
    let counts = || (fake.calls("cuMemAlloc_v2"), fake.calls("cuMemFree_v2"));
    ranks(api, 2, |r| {
        // The application's buffers first (never freed), then the snapshot: what is allocated after it is the
        // drop-in's setup.
        let n = 1024;
        let (send, recv) = (r.alloc(n * 4), r.alloc(n * 4));
        r.upload(send, &encode(NCCL_FLOAT32, &(0..n).map(|i| value(r.rank, 0, i)).collect::<Vec<_>>()));
        if barrier.wait().is_leader() {
            let (a, f) = counts();
            *snapshot.lock().expect("lock") = (a, f, contexts());
        }
        barrier.wait();
        r.all_reduce(send, recv, n, NCCL_FLOAT32);
        r.sync();
        r.check(recv, NCCL_FLOAT32, n, 0);
        if barrier.wait().is_leader() {
            let (allocs, frees) = counts();
            let (allocs0, frees0, _) = *snapshot.lock().expect("lock");
            *seen.lock().expect("lock") = format!(
                "ipc_open={} modules_loaded={} modules_unloaded={} allocated={} live={}",
                fake.ipc_open_count(),
                fake.calls("cuModuleLoadData"),
                fake.calls("cuModuleUnload"),
                allocs - allocs0,
                (allocs - allocs0) - (frees - frees0)
            );
        }
        barrier.wait();
        r.destroy();
    });
    println!("after_setup={}", seen.into_inner().expect("lock"));
    let (allocs0, frees0, contexts0) = *snapshot.lock().expect("lock");
    let (allocs, frees) = counts();
    println!(
        "after_destroy=ipc_open={} modules_unloaded={} live={} contexts_released={}",
        fake.ipc_open_count(),
        fake.calls("cuModuleUnload"),
        (allocs - allocs0) - (frees - frees0),
        contexts0 - contexts()
    );
    // The library's own destroy ran too (after the release): a new communicator works.
    ranks(api, 2, |r| {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        assert_eq!(unsafe { (api.count)(r.comm, &mut n) }, 0);
        assert_eq!(n, 2);
        r.destroy();
    });
}
