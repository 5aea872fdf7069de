//! `ncclAllReduce` through the drop-in asks anyccl's selector: the drop-in library (as cargo built it for this run)
//! over the computing fake RCCL and the fake HIP runtime (which emulates anyccl's HIP custom kernels and records
//! every launch), with ranks as threads calling the C ABI of the drop-in (`ncclGetUniqueId`, `ncclCommInitRank`,
//! `ncclAllReduce`, `ncclCommDestroy`) through `libloading`. No GPU.
//!
//! Each case runs in a child process (this test binary's ignored `child` test) with an empty environment but the
//! variables it sets: the drop-in finds the fake RCCL through `ANYCCL_RCCL_PATH` and the fake HIP runtime through
//! `ANYCCL_HIP_PATH` once per process, and the fake runtime's records are per process. The child checks results
//! against the host reference and prints what it saw; the parent asserts on that and on the drop-in's log. The
//! ranks and both halves' machinery are shared with accel_cuda.rs (the CUDA side) in support/accel_common.rs.

mod support;
use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_hip;
use support::{accel_common, programs};

use std::ffi::{c_int, c_void};

use accel_common::*;
use fake_hip::Launch;

fn base_env() -> Vec<(&'static str, std::ffi::OsString)> {
    vec![
        ("ANYCCL_RCCL_PATH", fake_hip::build_rccl(&fake_ccl::RCCL_7_1).into()),
        ("ANYCCL_HIP_PATH", fake_hip::build_hip().into()),
    ]
}

fn checked(case: &str, extra: &[(&str, &str)]) -> Child {
    accel_common::checked_child("accel", case, &base_env(), extra)
}

#[test]
fn small_sums_run_the_custom_kernels_and_the_rest_forwards() {
    let c = checked("world2", &[("ANYCCL_CUSTOM_MAX_BYTES", "64KiB")]);
    // Per rank: f32 and bf16 one-shot out of place, f32 one-shot in place; i32, 28 bytes and 128 KiB (above the
    // 64 KiB staging) forwarded. Every result was checked against the host reference in the child.
    assert_eq!(field(&c, "launches"), "one_shot_f32=4 one_shot_bf16=2 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "6");
    assert_eq!(field(&c, "calls"), "14");
    assert_eq!(field(&c, "violations"), "0");
    // ANYCCL_LOG=debug: what ran each call and why.
    assert_eq!(log_lines(&c, &["choice=\"one-shot\"", "count=1024", "dtype=float32"]).len(), 4, "{}", c.stderr);
    assert_eq!(log_lines(&c, &["choice=\"one-shot\"", "dtype=bfloat16"]).len(), 2, "{}", c.stderr);
    let int = log_lines(&c, &["choice=\"ccl\"", "dtype=int32", "float32, float16 and bfloat16 only"]);
    assert_eq!(int.len(), 2, "{}", c.stderr);
    assert_eq!(log_lines(&c, &["choice=\"ccl\"", "count=7", "not a multiple of 16"]).len(), 2, "{}", c.stderr);
    assert_eq!(log_lines(&c, &["choice=\"ccl\"", "count=32768", "ANYCCL_CUSTOM_MAX_BYTES"]).len(), 2, "{}", c.stderr);
    assert_eq!(log_lines(&c, &["choice=\"ccl\"", "inside ncclGroupStart"]).len(), 2, "{}", c.stderr);
}

/// The fake RCCL 7.1 symbol set and `ncclAllReduceConfig` (a release with NCCL 2.31's per-call config).
const RCCL_CONFIG_EXTRA: &[&str] = &[
    "ncclCommSplit",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclGroupSimulateEnd",
    "ncclCommInitRankScalable",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
    "ncclCommShrink",
    "ncclAllToAllv",
    "mscclLoadAlgo",
    "ncclAllReduceWithBias",
    "ncclAllReduceConfig",
];
const RCCL_CONFIG: fake_ccl::Profile =
    fake_ccl::Profile { file: "rccl-config/librccl.so.1", version: 22707, extra: RCCL_CONFIG_EXTRA };

#[test]
fn all_reduce_config_asking_nothing_runs_the_custom_kernels_and_a_config_that_asks_forwards() {
    assert_eq!(&RCCL_CONFIG_EXTRA[..RCCL_CONFIG_EXTRA.len() - 1], fake_ccl::RCCL_7_1.extra);
    let base = vec![
        ("ANYCCL_RCCL_PATH", fake_hip::build_rccl(&RCCL_CONFIG).into()),
        ("ANYCCL_HIP_PATH", fake_hip::build_hip().into()),
    ];
    let c = accel_common::checked_child("accel", "config", &base, &[]);
    // Per rank: the initializer's config and a null one on the one-shot; a named algorithm, a profiler tag and a
    // bad magic forwarded to the library's ncclAllReduceConfig. Every result was checked in the child. Then a call
    // anyccl refuses, answered in ncclAllReduceConfig's name.
    assert_eq!(field(&c, "launches"), "one_shot_f32=4 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "4");
    // Six calls per rank, the refused one included (it reached anyccl's kernels' path).
    assert_eq!(field(&c, "calls"), "12");
    assert_eq!(field(&c, "violations"), "0");
    let bad: Vec<&str> = c.stdout.lines().filter_map(|l| l.strip_prefix("bad_config_call=")).collect();
    assert_eq!(bad.len(), 2, "{}", c.stdout);
    for b in bad {
        let want = "rc=4 text=ncclAllReduceConfig: the anyccl drop-in's custom all-reduce failed: ";
        assert!(b.starts_with(want) && b.contains("overlap"), "{b}");
    }
    let config = "ncclAllReduceConfig";
    assert_eq!(log_lines_of(&c, config, &["choice=\"one-shot\""]).len(), 4, "{}", c.stderr);
    for why in ["algorithm selection (algSelection)", "userProfilerTag 0x7", "magic 0x1234"] {
        assert_eq!(log_lines_of(&c, config, &["choice=\"ccl\"", why]).len(), 2, "{why}\n{}", c.stderr);
    }
}

#[test]
fn a_failed_setup_turns_the_kernels_off_on_every_rank_and_everything_forwards() {
    // Every rank's setup refuses the setting (3 blocks is below the minimum); the agreement rounds still run, so
    // nobody waits, and both ranks forward this call and every later one, with the reason.
    let c = checked("setup_off", &[("ANYCCL_CUSTOM_MAX_BLOCKS", "3")]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "calls"), "4");
    let off = log_lines(
        &c,
        &["choice=\"ccl\"", "the custom kernels are off for this communicator", "ANYCCL_CUSTOM_MAX_BLOCKS"],
    );
    assert_eq!(off.len(), 4, "{}", c.stderr);
}

#[test]
fn four_ranks_run_the_two_shot_kernel_on_a_mebibyte() {
    let c = checked("world4", &[]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=8 other=0");
    assert_eq!(field(&c, "custom_calls"), "8");
    assert_eq!(log_lines(&c, &["choice=\"two-shot\"", "count=262144"]).len(), 4, "{}", c.stderr);
}

#[test]
fn captured_calls_forward_before_setup_and_run_the_kernels_after_it() {
    let c = checked("capture", &[]);
    // Before setup: the captured call went to RCCL (no launch, nothing allocated or registered during capture)
    // and its graph replayed right; after the eager setup call, the captured call is a table kernel (through
    // staging) that ran at each of the two replays, each result right.
    assert_eq!(field(&c, "before_setup"), "launches=0 custom=0 violations=0");
    assert_eq!(field(&c, "captured"), "launches=2 capturing=2 table=2 runs=2,2 completed=2,2");
    assert_eq!(field(&c, "violations"), "0");
    let before = log_lines(&c, &["choice=\"ccl\"", "nothing is set up during capture"]);
    assert_eq!(before.len(), 2, "{}", c.stderr);
}

#[test]
fn destroy_releases_the_state_first_then_destroys() {
    let c = checked("destroy", &[]);
    // Set up: every rank mapped its peer's three buffers and loaded the kernels' module.
    assert_eq!(field(&c, "after_setup"), "ipc_open=6 modules_loaded=2 modules_unloaded=0");
    // ncclCommDestroy: mappings closed and modules unloaded (the drop-in's state first), and the library's destroy
    // ran after (the child's later ncclCommCount on a fresh communicator of the same id works, and the log shows
    // the release before the forwarded destroy).
    assert_eq!(field(&c, "after_destroy"), "ipc_open=0 modules_unloaded=2");
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
    // Two communicators of two ranks each.
    assert_eq!(destroys, 4, "{}", c.stderr);
}

#[test]
fn ranks_on_different_hosts_forward_with_the_reason() {
    // ANYCCL_HOST_ID differs per rank (a preloaded getenv answers it per thread): the setup's one-host check, run
    // over the communicator before any IPC handle is made, turns the kernels off on both ranks.
    let shim = thread_env_shim();
    let c = checked("host_id", &[("LD_PRELOAD", shim.as_str()), ("ACCEL_THREADENV", shim.as_str())]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "ipc_opened"), "0");
    let off = log_lines(&c, &["choice=\"ccl\"", "ranks span 2 hosts (rank 0 on node-a, rank 1 on node-b)"]);
    assert_eq!(off.len(), 4, "{}", c.stderr);
}

/// The preloaded getenv shim (tests/c/thread_env.c) that answers variables set per thread (per rank).
fn thread_env_shim() -> String {
    let shim = fake_ccl::compile_once(
        "dropin-thread-env-2/libthreadenv.so",
        &std::fs::read_to_string(programs::c_dir().join("thread_env.c")).expect("thread_env.c"),
        &["-ldl".into()],
    );
    shim.to_str().expect("a UTF-8 path").to_owned()
}

/// Runs `case` with the per-thread getenv shim preloaded (and `extra`).
fn checked_per_rank_env(case: &str, extra: &[(&str, &str)]) -> Child {
    let shim = thread_env_shim();
    let mut env = vec![("LD_PRELOAD", shim.as_str()), ("ACCEL_THREADENV", shim.as_str())];
    env.extend_from_slice(extra);
    checked(case, &env)
}

/// Log lines of the drop-in's agreement round at communicator creation with all of `words`.
fn agreement_lines<'a>(c: &'a Child, words: &[&str]) -> Vec<&'a str> {
    c.stderr.lines().filter(|l| l.contains("anyccl agreement") && words.iter().all(|w| l.contains(w))).collect()
}

#[test]
fn ranks_with_different_custom_max_bytes_agree_to_forward() {
    // Rank 1 stages 64 KiB, rank 0 the default 8 MiB. Without the agreement round at creation, a 128 KiB call (between
    // the two limits) sends rank 0 into the kernels' setup (an ncclAllGather) while rank 1 forwards an
    // ncclAllReduce: mismatched collectives. With it, both ranks see the difference when the communicator is created
    // and forward every call, with the setting named in the reason; every result is checked in the child.
    let c = checked_per_rank_env("max_bytes_differ", &[]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "violations"), "0");
    // Per rank: one all-gather of the agreement round (the fake RCCL's calls are not counted by the drop-in), then
    // the two all-reduces forwarded.
    assert_eq!(field(&c, "calls"), "4");
    let off = log_lines(&c, &["choice=\"ccl\"", "ANYCCL_CUSTOM_MAX_BYTES differs between ranks (rank 0 and rank 1)"]);
    assert_eq!(off.len(), 4, "{}", c.stderr);
    assert_eq!(agreement_lines(&c, &["verdict=\"off\"", "ANYCCL_CUSTOM_MAX_BYTES differs"]).len(), 2, "{}", c.stderr);
}

#[test]
fn equal_custom_max_bytes_spelled_differently_still_run_the_kernels() {
    // "64KiB" on rank 0 and "65536" on rank 1: the same staging size, so the ranks agree and the kernels run.
    let c = checked_per_rank_env("max_bytes_equal", &[]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=4 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "4");
    assert_eq!(field(&c, "violations"), "0");
    assert_eq!(agreement_lines(&c, &["verdict=\"on\""]).len(), 2, "{}", c.stderr);
}

#[test]
fn one_rank_with_anyccl_disable_turns_both_off() {
    // Rank 0 sets ANYCCL_DISABLE=custom-kernels, rank 1 does not: rank 0 still takes part in the round (with an "off"
    // fingerprint), and both forward.
    let c = checked_per_rank_env("disable_one", &[]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "violations"), "0");
    let off = log_lines(&c, &["choice=\"ccl\"", "ANYCCL_DISABLE differs between ranks (rank 0 and rank 1)"]);
    assert_eq!(off.len(), 4, "{}", c.stderr);
}

#[test]
fn a_table_file_on_one_rank_only_turns_both_off() {
    // Rank 1 reads a table file (ANYCCL_TUNE_FILE) that sends small world-2 sums to RCCL; rank 0 uses the defaults,
    // which put them on the kernels. Without the round rank 0 would set up while rank 1 forwards.
    let dir = programs::case_dir("accel-table-file");
    let table = dir.join("tune.toml");
    std::fs::write(&table, "version = 1\n[[rule]]\nworld = 2\nbytes = \"0-1MiB\"\nalgorithms = [\"ccl\"]\n")
        .expect("table file");
    let c = checked_per_rank_env("table_differ", &[("ACCEL_TABLE", table.to_str().expect("UTF-8 path"))]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "violations"), "0");
    let off = log_lines(&c, &["choice=\"ccl\"", "ANYCCL_TUNE_FILE differs between ranks (rank 0 and rank 1)"]);
    assert_eq!(off.len(), 4, "{}", c.stderr);
}

#[test]
fn a_communicator_created_inside_a_group_is_off_with_that_reason() {
    // ncclCommInitRank between ncclGroupStart and ncclGroupEnd: the round's all-gather would join the caller's
    // group, so none is issued and the communicator forwards.
    let c = checked("group_init", &[]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(field(&c, "calls"), "4");
    assert_eq!(field(&c, "violations"), "0");
    let off = log_lines(&c, &["choice=\"ccl\"", "created inside ncclGroupStart/ncclGroupEnd"]);
    assert_eq!(off.len(), 4, "{}", c.stderr);
}

#[test]
fn a_split_runs_its_own_round() {
    // Equal settings when the parent is created (its kernels run); then rank 1 sets ANYCCL_CUSTOM_MAX_BYTES=64KiB
    // and both ranks split the parent (one color): the split's own round finds the difference, so the split
    // forwards while the parent still runs the kernels.
    let c = checked_per_rank_env("split", &[]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=4 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "4");
    assert_eq!(field(&c, "violations"), "0");
    assert_eq!(agreement_lines(&c, &["verdict=\"on\""]).len(), 2, "{}", c.stderr);
    assert_eq!(agreement_lines(&c, &["verdict=\"off\"", "ANYCCL_CUSTOM_MAX_BYTES differs"]).len(), 2, "{}", c.stderr);
    let off = log_lines(&c, &["choice=\"ccl\"", "ANYCCL_CUSTOM_MAX_BYTES differs between ranks (rank 0 and rank 1)"]);
    assert_eq!(off.len(), 4, "{}", c.stderr);
}

#[test]
fn an_argument_anyccl_refuses_is_ncclinvalidargument_with_a_readable_last_error() {
    let c = checked("bad_args", &[]);
    let bad: Vec<&str> = c.stdout.lines().filter_map(|l| l.strip_prefix("bad_call=")).collect();
    assert_eq!(bad.len(), 2, "{}", c.stdout);
    for b in bad {
        assert!(b.starts_with("rc=4 text=ncclAllReduce: the anyccl drop-in's custom all-reduce failed: "), "{b}");
        assert!(b.contains("overlap"), "{b}");
    }
    // Two good calls per rank on the kernels, nothing launched for the refused one.
    assert_eq!(field(&c, "launches"), "one_shot_f32=4 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "4");
}

#[test]
fn anyccl_disable_turns_it_off_and_everything_forwards() {
    let c = checked("disabled", &[("ANYCCL_DISABLE", "custom-kernels")]);
    assert_eq!(field(&c, "launches"), "one_shot_f32=0 one_shot_bf16=0 two_shot=0 other=0");
    assert_eq!(field(&c, "custom_calls"), "0");
    assert_eq!(log_lines(&c, &["choice=\"ccl\"", "ANYCCL_DISABLE"]).len(), 2, "{}", c.stderr);
}

/// A benchmark, not a test of time: host nanoseconds per `ncclAllReduce` call (world 1, one f32, the fake RCCL's
/// call itself included) on a communicator created through the drop-in (world 1: anyccl off, "one rank"), straight
/// into the fake RCCL and through the drop-in. Run with `-- --ignored host_time --nocapture`; `ACCEL_BENCH_DROPIN=<path>` times
/// another build of the drop-in the same way.
#[test]
#[ignore = "a benchmark: prints host time per call; run by hand"]
fn host_time_on_the_fakes() {
    // ACCEL_BENCH_DROPIN: another build of the drop-in to time instead (an older one, for a before/after).
    let other = std::env::var("ACCEL_BENCH_DROPIN").unwrap_or_default();
    let mut env = vec![("ANYCCL_LOG", "")];
    if !other.is_empty() {
        env.push(("ACCEL_DROPIN", other.as_str()));
    }
    let c = checked("host_time", &env);
    for l in c.stdout.lines().filter(|l| l.starts_with("host_time ")) {
        println!("{l}");
    }
    assert!(c.stdout.contains("host_time registered"), "{}", c.stdout);
}

/// A benchmark, not a test of time: host microseconds per `ncclCommInitRank` of a world-2 communicator (ranks as
/// threads, each timing its own call; a barrier before each creation) straight into the fake RCCL, and through the
/// drop-in (its state made, and since the agreement round, the round's `ncclAllGather`). Run with
/// `-- --ignored init_time --nocapture`; `ACCEL_BENCH_DROPIN=<path>` times another build of the drop-in.
#[test]
#[ignore = "a benchmark: prints host time per communicator creation; run by hand"]
fn init_time_on_the_fakes() {
    let other = std::env::var("ACCEL_BENCH_DROPIN").unwrap_or_default();
    let mut env = vec![("ANYCCL_LOG", "")];
    if !other.is_empty() {
        env.push(("ACCEL_DROPIN", other.as_str()));
    }
    // The fake RCCL keeps at most 64 communicator ids per process: several children of 30 creations per variant.
    for _ in 0..5 {
        let c = checked("init_time", &env);
        for l in c.stdout.lines().filter(|l| l.starts_with("init_time ")) {
            println!("{l}");
        }
        assert!(c.stdout.contains("init_time dropin"), "{}", c.stdout);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The child half.

#[test]
#[ignore = "the child half of the drop-in acceleration tests, which run it with the fakes' environment"]
fn child() {
    let case = std::env::var("ACCEL_CASE").expect("run by the other tests of this file, which set ACCEL_CASE");
    let (api, fake) = load_api(Runtime::Hip);
    fake.reset();
    match case.as_str() {
        "world2" | "disabled" | "setup_off" => {
            ranks(&api, 2, |r| {
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 0, false);
                if case == "setup_off" {
                    r.checked_all_reduce(NCCL_FLOAT32, 1024, 1, false);
                }
                if case != "world2" {
                    return;
                }
                r.checked_all_reduce(NCCL_BFLOAT16, 2048, 1, false);
                r.checked_all_reduce(NCCL_INT32, 1024, 2, false);
                r.checked_all_reduce(NCCL_FLOAT32, 7, 3, false);
                r.checked_all_reduce(NCCL_FLOAT32, 32768, 4, false);
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 5, true);
                // Inside a group: the group runs it (forwarded), even though the kernels are set up.
                // SAFETY: group calls of the drop-in, balanced.
                unsafe {
                    assert_eq!((api.group_start)(), 0);
                    r.checked_all_reduce_in(NCCL_FLOAT32, 1024, 6, || assert_eq!((api.group_end)(), 0));
                }
            });
        }
        "world4" => {
            ranks(&api, 4, |r| {
                r.checked_all_reduce(NCCL_FLOAT32, 262_144, 0, false);
                r.checked_all_reduce(NCCL_BFLOAT16, 524_288, 1, false);
            });
        }
        "capture" => {
            let before = std::sync::Mutex::new(String::new());
            // Global-mode captures: no rank allocates or copies while another captures (the fake counts that as a
            // violation of the test itself), so the phases are separated by barriers.
            let phase = std::sync::Barrier::new(2);
            ranks(&api, 2, |r| {
                let n = 1024;
                let bytes = n * 4;
                let (send, recv) = (r.alloc(bytes), r.alloc(bytes));
                let (send2, recv2) = (r.alloc(bytes), r.alloc(bytes));
                let input =
                    |round: usize| encode(NCCL_FLOAT32, &(0..n).map(|i| value(r.rank, round, i)).collect::<Vec<_>>());
                r.upload(send, &input(0));
                // Before setup: captured, forwarded to RCCL, replayed right.
                phase.wait();
                let exec = r.capture(|| r.all_reduce(send, recv, n, NCCL_FLOAT32));
                phase.wait();
                r.replay(exec);
                r.check(recv, NCCL_FLOAT32, n, 0);
                if r.rank == 0 {
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
            let captured: Vec<Launch> = fake.launches().into_iter().filter(|l| l.capturing).collect();
            let tables = captured.iter().filter(|l| l.params.as_ref().is_some_and(|p| p.table_kernel)).count();
            let join =
                |f: &dyn Fn(&Launch) -> u32| captured.iter().map(|l| f(l).to_string()).collect::<Vec<_>>().join(",");
            println!(
                "captured=launches={} capturing={} table={tables} runs={} completed={}",
                captured.len(),
                captured.len(),
                join(&|l| l.runs),
                join(&|l| l.completed)
            );
        }
        "destroy" => {
            let barrier = std::sync::Barrier::new(2);
            let seen = std::sync::Mutex::new(String::new());
            ranks(&api, 2, |r| {
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 0, false);
                if barrier.wait().is_leader() {
                    *seen.lock().expect("lock") = format!(
                        "ipc_open={} modules_loaded={} modules_unloaded={}",
                        fake.ipc_open_count(),
                        fake.calls("hipModuleLoadData"),
                        fake.calls("hipModuleUnload")
                    );
                }
                barrier.wait();
                r.destroy();
            });
            println!("after_setup={}", seen.into_inner().expect("lock"));
            println!(
                "after_destroy=ipc_open={} modules_unloaded={}",
                fake.ipc_open_count(),
                fake.calls("hipModuleUnload")
            );
            // The library's own destroy ran too: a new communicator works.
            ranks(&api, 2, |r| {
                let mut n: c_int = 0;
                // SAFETY: writes one int.
                assert_eq!(unsafe { (api.count)(r.comm, &mut n) }, 0);
                assert_eq!(n, 2);
                r.destroy();
            });
        }
        "config" => {
            use anyccl_nccl::coll_config::CollConfigV23200 as Config;
            ranks(&api, 2, |r| {
                // Each rank's own configs, the same on every rank (as nccl.h requires).
                let plain = Config::INITIALIZER;
                let named = Config { algSelection: c"RING_LL".as_ptr(), ..Config::INITIALIZER };
                let tagged = Config { userProfilerTag: 7, ..Config::INITIALIZER };
                let bad = Config { magic: 0x1234, ..Config::INITIALIZER };
                let ptr = |c: &Config| std::ptr::from_ref(c).cast::<c_void>();
                r.checked_all_reduce_config(NCCL_FLOAT32, 1024, 0, ptr(&plain));
                r.checked_all_reduce_config(NCCL_FLOAT32, 1024, 1, std::ptr::null());
                r.checked_all_reduce_config(NCCL_FLOAT32, 1024, 2, ptr(&named));
                r.checked_all_reduce_config(NCCL_FLOAT32, 1024, 3, ptr(&tagged));
                r.checked_all_reduce_config(NCCL_FLOAT32, 1024, 4, ptr(&bad));
                // An output that overlaps its input: refused by anyccl (set up by now), in the config call's name.
                let f = api.all_reduce_config.expect("the drop-in exports ncclAllReduceConfig");
                let buf = r.alloc(8192);
                // SAFETY: both ranges lie in the 8 KiB buffer; the rank's communicator and stream; a live config.
                let rc = unsafe {
                    f(buf, buf.cast::<u8>().add(16).cast(), 1024, NCCL_FLOAT32, 0, r.comm, r.stream, ptr(&plain))
                };
                // SAFETY: the drop-in's text for this thread's last call.
                let text = unsafe { std::ffi::CStr::from_ptr((api.last_error)(r.comm)) }.to_string_lossy().into_owned();
                println!("bad_config_call=rc={rc} text={text}");
            });
        }
        "host_time" => host_time(&api),
        "init_time" => init_time(&api),
        "max_bytes_differ" | "max_bytes_equal" | "disable_one" | "table_differ" => {
            let table = std::env::var("ACCEL_TABLE").unwrap_or_default();
            let setting = |rank: usize| match (case.as_str(), rank) {
                ("max_bytes_differ", 1) => Some(("ANYCCL_CUSTOM_MAX_BYTES", "64KiB")),
                ("max_bytes_equal", 0) => Some(("ANYCCL_CUSTOM_MAX_BYTES", "64KiB")),
                ("max_bytes_equal", 1) => Some(("ANYCCL_CUSTOM_MAX_BYTES", "65536")),
                ("disable_one", 0) => Some(("ANYCCL_DISABLE", "custom-kernels")),
                ("table_differ", 1) => Some(("ANYCCL_TUNE_FILE", table.as_str())),
                _ => None,
            };
            ranks_with(
                &api,
                2,
                |rank| {
                    if let Some((k, v)) = setting(rank) {
                        set_thread_env(k, v);
                    }
                },
                |r| {
                    // 128 KiB: above rank 1's 64 KiB staging in max_bytes_differ, below rank 0's 8 MiB; then 4 KiB,
                    // below both (the kernels' size when the ranks agree).
                    if case != "max_bytes_equal" {
                        r.checked_all_reduce(NCCL_FLOAT32, 32768, 0, false);
                    }
                    r.checked_all_reduce(NCCL_FLOAT32, 1024, 1, false);
                    if case == "max_bytes_equal" {
                        r.checked_all_reduce(NCCL_FLOAT32, 1024, 2, true);
                    }
                },
            );
        }
        "split" => {
            ranks(&api, 2, |r| {
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 0, false);
                if r.rank == 1 {
                    set_thread_env("ANYCCL_CUSTOM_MAX_BYTES", "64KiB");
                }
                let mut child: Comm = std::ptr::null_mut();
                // SAFETY: a collective split of the rank's live communicator; writes one communicator.
                assert_eq!(unsafe { (api.split)(r.comm, 0, r.rank as c_int, &mut child, std::ptr::null_mut()) }, 0);
                assert!(!child.is_null());
                let s = Rank { api: r.api, rank: r.rank, world: 2, comm: child, stream: r.stream };
                s.checked_all_reduce(NCCL_FLOAT32, 1024, 1, false);
                s.checked_all_reduce(NCCL_FLOAT32, 1024, 2, true);
                // The parent keeps its agreed state.
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 3, false);
                s.destroy();
            });
        }
        "group_init" => {
            let id = unique_id(&api);
            let api = &api;
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..2)
                    .map(|rank| {
                        s.spawn(move || {
                            // SAFETY: group calls of the drop-in, balanced around the init.
                            let r = unsafe {
                                assert_eq!((api.group_start)(), 0);
                                let r = Rank::new(api, rank, 2, id);
                                assert_eq!((api.group_end)(), 0);
                                r
                            };
                            r.checked_all_reduce(NCCL_FLOAT32, 1024, 0, false);
                            r.checked_all_reduce(NCCL_FLOAT32, 1024, 1, true);
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().expect("rank thread");
                }
            });
        }
        "bad_args" => {
            let seen = std::sync::Mutex::new(Vec::new());
            ranks(&api, 2, |r| {
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 0, false);
                // Set up. Now an output that overlaps its input without being it: anyccl refuses it on every rank
                // before anything is launched, with NCCL's code for a bad argument and a readable text.
                let buf = r.alloc(8192);
                // SAFETY: both ranges lie in the 8 KiB buffer; the rank's communicator and stream.
                let rc = unsafe {
                    (api.all_reduce)(buf, buf.cast::<u8>().add(16).cast(), 1024, NCCL_FLOAT32, 0, r.comm, r.stream)
                };
                // SAFETY: the drop-in's text for this thread's last call.
                let text = unsafe { std::ffi::CStr::from_ptr((api.last_error)(r.comm)) }.to_string_lossy().into_owned();
                seen.lock().expect("lock").push(format!("rc={rc} text={text}"));
                // The communicator still works afterwards.
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 1, false);
            });
            for l in seen.into_inner().expect("lock") {
                println!("bad_call={l}");
            }
        }
        "host_id" => {
            let p = std::env::var_os("ACCEL_THREADENV").expect("set by the parent");
            // SAFETY: the preloaded shim (already loaded: the same copy); its initialisers do nothing.
            let shim: &'static libloading::Library =
                Box::leak(Box::new(unsafe { libloading::Library::new(&p) }.expect("open the shim")));
            let set: unsafe extern "C" fn(*const std::ffi::c_char) = sym(shim, "threadenv_set_host_id");
            ranks(&api, 2, |r| {
                let host: &'static std::ffi::CStr = if r.rank == 0 { c"node-a" } else { c"node-b" };
                // SAFETY: a static C string, for this thread.
                unsafe { set(host.as_ptr()) };
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 0, false);
                r.checked_all_reduce(NCCL_FLOAT32, 1024, 1, false);
            });
            println!("ipc_opened={}", fake.calls("hipIpcOpenMemHandle"));
        }
        other => panic!("unknown case {other}"),
    }
    println!("launches={}", launches_summary(&fake.launches()));
    // SAFETY: counter reads.
    unsafe {
        if let Some(f) = api.custom_calls {
            println!("custom_calls={}", f());
        }
        println!("calls={}", (api.calls)());
    }
    println!("violations={}", fake.violations().len());
    for v in fake.violations() {
        println!("violation: {v}");
    }
}

/// The preloaded getenv shim's setter for this thread: `set(name, value)` (both must live for the process).
fn thread_env_setter() -> unsafe extern "C" fn(*const std::ffi::c_char, *const std::ffi::c_char) -> c_int {
    let p = std::env::var_os("ACCEL_THREADENV").expect("set by the parent");
    // SAFETY: the preloaded shim (already loaded: the same copy); its initialisers do nothing.
    let shim: &'static libloading::Library =
        Box::leak(Box::new(unsafe { libloading::Library::new(&p) }.expect("open the shim")));
    sym(shim, "threadenv_set")
}

/// Sets `name=value` for this thread only (through the shim).
fn set_thread_env(name: &str, value: &str) {
    let set = thread_env_setter();
    let leak = |s: &str| Box::leak(std::ffi::CString::new(s).expect("no NUL").into_boxed_c_str()).as_ptr();
    // SAFETY: two C strings leaked for the process.
    assert_eq!(unsafe { set(leak(name), leak(value)) }, 0);
}

/// The child half of [`init_time_on_the_fakes`].
fn init_time(api: &Api) {
    let rccl: &'static libloading::Library = {
        let p = std::env::var_os("ANYCCL_RCCL_PATH").expect("set by the parent");
        // SAFETY: the fake RCCL built for this test (the same file the drop-in forwards to: one copy).
        Box::leak(Box::new(unsafe { libloading::Library::new(&p) }.expect("open")))
    };
    type Init = unsafe extern "C" fn(*mut Comm, c_int, Id, c_int) -> c_int;
    type Destroy = unsafe extern "C" fn(Comm) -> c_int;
    let direct: (Init, Destroy) = (sym(rccl, "ncclCommInitRank"), sym(rccl, "ncclCommDestroy"));
    let dropin: (Init, Destroy) = (api.init_rank, api.destroy);
    // 30 creations per variant: the fake RCCL keeps 64 communicator ids per process.
    const ROUNDS: usize = 30;
    for (name, (init, destroy)) in [("direct", direct), ("dropin", dropin)] {
        let ids: Vec<Id> = (0..ROUNDS).map(|_| unique_id(api)).collect();
        let barrier = std::sync::Barrier::new(2);
        let times = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for rank in 0..2 {
                let (ids, barrier, times) = (&ids, &barrier, &times);
                s.spawn(move || {
                    // SAFETY: C calls with valid out-pointers; each communicator destroyed once.
                    unsafe {
                        assert_eq!((api.set_device)(rank), 0);
                        for id in ids {
                            barrier.wait();
                            let mut comm: Comm = std::ptr::null_mut();
                            let t = std::time::Instant::now();
                            assert_eq!(init(&mut comm, 2, *id, rank), 0);
                            let us = t.elapsed().as_nanos() as f64 / 1000.0;
                            if rank == 0 {
                                times.lock().expect("lock").push(us);
                            }
                            barrier.wait();
                            assert_eq!(destroy(comm), 0);
                        }
                    }
                });
            }
        });
        let mut v = times.into_inner().expect("lock");
        v.sort_by(f64::total_cmp);
        let q = |x: f64| v[((v.len() - 1) as f64 * x) as usize];
        println!("init_time {name} median_us={:.1} p10_us={:.1} p90_us={:.1}", q(0.5), q(0.1), q(0.9));
    }
}

/// The child half of [`host_time_on_the_fakes`].
fn host_time(api: &Api) {
    let rccl: &'static libloading::Library = {
        let p = std::env::var_os("ANYCCL_RCCL_PATH").expect("set by the parent");
        // SAFETY: the fake RCCL built for this test (the same file the drop-in forwards to: one copy).
        Box::leak(Box::new(unsafe { libloading::Library::new(&p) }.expect("open")))
    };
    let direct_init: unsafe extern "C" fn(*mut Comm, c_int, Id, c_int) -> c_int = sym(rccl, "ncclCommInitRank");
    let direct_ar: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int =
        sym(rccl, "ncclAllReduce");
    // SAFETY: C calls with valid out-pointers; world 1.
    let (plain, stream) = unsafe {
        assert_eq!((api.set_device)(0), 0);
        let mut comm: Comm = std::ptr::null_mut();
        assert_eq!(direct_init(&mut comm, 1, unique_id(api), 0), 0);
        let mut stream = std::ptr::null_mut();
        assert_eq!((api.stream_create)(&mut stream, 1), 0);
        (comm, stream)
    };
    let r = Rank { api, rank: 0, world: 1, comm: plain, stream };
    let (send, recv) = (r.alloc(64), r.alloc(64));
    type Ar = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int;
    let time = |variants: &[(&str, Ar, Comm)]| {
        const CALLS: u32 = 1000;
        const BLOCKS: usize = 300;
        let mut per: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for b in 0..BLOCKS {
            for k in 0..variants.len() {
                let k = if b % 2 == 0 { k } else { variants.len() - 1 - k };
                let (_, f, comm) = variants[k];
                let t = std::time::Instant::now();
                for _ in 0..CALLS {
                    // SAFETY: 64-byte buffers of this device, one f32, a live communicator and stream.
                    let rc = unsafe { f(send, recv, 1, NCCL_FLOAT32, 0, comm, stream) };
                    debug_assert_eq!(rc, 0);
                }
                per[k].push(t.elapsed().as_nanos() as f64 / f64::from(CALLS));
            }
            r.sync();
        }
        for ((name, _, _), mut v) in variants.iter().zip(per) {
            v.sort_by(f64::total_cmp);
            let q = |x: f64| v[((v.len() - 1) as f64 * x) as usize];
            println!("host_time {name} median_ns={:.1} p10_ns={:.1} p90_ns={:.1}", q(0.5), q(0.1), q(0.9));
        }
    };
    // A communicator created through the drop-in (one it did not see created is refused by its handle check, so
    // only this path exists for a program): the same handle timed straight into the library and through the
    // drop-in. The first call through the drop-in warms it up.
    let registered = Rank::new(api, 0, 1, unique_id(api));
    registered.all_reduce(send, recv, 1, NCCL_FLOAT32);
    r.sync();
    time(&[("direct", direct_ar, registered.comm), ("registered", api.all_reduce, registered.comm)]);
}
