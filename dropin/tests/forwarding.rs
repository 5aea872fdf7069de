//! The drop-in library (`libanyccl_nccl.so`, as cargo built it for this run) under a C program, with fake NCCL and
//! RCCL libraries underneath that record every call with its arguments (tests/c/fake_recording.c): every function
//! forwarded with its arguments and its result unchanged, a library without window symbols answered with an error
//! code and a text, no library at all answered cleanly, `ANYCCL_LOG=debug` logging each collective, and the drop-in
//! never loading itself when it is installed as `libnccl.so.2`, communicator handles the drop-in did not create
//! refused, `ncclGetLastError`'s text readable for good, and `nccl.h` 2.32 functions forwarded. Each case runs the program in its own process (the
//! drop-in loads its library once per process) with an empty environment but the variables it sets.

use anyccl_testkit::fake_ccl;
mod support;
use support::{header, programs};

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyccl_ccl::find::Place;
use programs::{case_dir, cc, dropin_so, link_to, run, Output};

/// A recording fake built from tests/c/fake_recording.c at `rel` (under the fake-library folder) with `defines`.
fn fake(rel: &str, defines: &[&str]) -> PathBuf {
    let source = std::fs::read_to_string(programs::c_dir().join("fake_recording.c")).expect("fake source");
    let extra: Vec<String> = defines.iter().map(|d| format!("-D{d}")).collect();
    fake_ccl::compile_once(rel, &source, &extra)
}

/// The forwarding program (tests/c/forward.c) linked to the drop-in where cargo built it.
fn forward_program() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = case_dir("forward-program");
        let out = dir.join("forward");
        let mut args = programs::link_to_dropin();
        args.push(OsString::from("-I"));
        args.push(programs::c_dir().into_os_string());
        cc(&out, &[programs::c_dir().join("forward.c")], &args);
        out
    })
}

fn os(s: impl AsRef<std::ffi::OsStr>) -> OsString {
    s.as_ref().to_owned()
}

/// The calls the full run of forward.c makes, as the fake records them (after the drop-in's own `ncclGetVersion`
/// at load), in order; `windows`: whether the library underneath has the window functions.
fn expected_records(windows: bool) -> Vec<&'static str> {
    let mut v = vec![
        "ncclGetVersion",
        "ncclGetVersion",
        "ncclGetUniqueId",
        "ncclMemAlloc size=4096",
        "ncclMemFree ptr=2001",
        "ncclCommInitRankConfig nranks=4 id0=90 rank=1 config=cf6",
        "ncclCommInitRank nranks=4 id0=90 id127=9 rank=2",
        "ncclCommInitAll ndev=2 devlist=0,1",
        "ncclCommFinalize comm=c10",
        "ncclCommDestroy comm=c11",
        // The fake's destroy asks its own ncclCommGetAsyncError, as NCCL does: the library's call stays inside it.
        "ncclCommGetAsyncError comm=c11",
        "ncclCommAbort comm=c12",
        "ncclCommRevoke comm=c13 flags=0",
        "ncclCommSplit comm=c14 color=3 key=7 config=cf7",
        "ncclCommShrink comm=c15 exclude=6,7 count=2 config=cf8 flags=1",
        "ncclCommInitRankScalable nranks=8 rank=3 nId=1 id0=90 config=cf9",
        "ncclResetDebugInit",
        "ncclCommGetAsyncError comm=c16",
        "ncclCommCount comm=c17",
        "ncclCommCuDevice comm=c18",
        "ncclCommUserRank comm=c19",
        "ncclCommRegister comm=c1a buff=b0f size=65536",
        "ncclCommDeregister comm=c1b handle=4a",
        "ncclRedOpCreatePreMulSum scalar=5ca dtype=9 residence=1 comm=c1c",
        "ncclRedOpDestroy op=5 comm=c1d",
        "ncclGroupStart",
        "ncclReduce send=101 recv=102 count=103 dtype=2 op=2 root=1 comm=c1e stream=5e1",
        "ncclBcast buff=111 count=113 dtype=3 root=2 comm=c1f stream=5e2",
        "ncclBroadcast send=121 recv=122 count=123 dtype=4 root=3 comm=c20 stream=5e3",
        "ncclAllReduce send=131 recv=132 count=133 dtype=9 op=0 comm=c21 stream=5e4",
        "ncclAllReduce send=135 recv=136 count=137 dtype=7 op=4 comm=c21 stream=5e4",
        "ncclReduceScatter send=141 recv=142 count=143 dtype=6 op=3 comm=c22 stream=5e5",
        "ncclAllGather send=151 recv=152 count=153 dtype=8 comm=c23 stream=5e6",
        "ncclAlltoAll send=161 recv=162 count=163 dtype=10 comm=c24 stream=5e7",
        "ncclGather send=171 recv=172 count=173 dtype=11 root=1 comm=c25 stream=5e8",
        "ncclScatter send=181 recv=182 count=183 dtype=0 root=2 comm=c26 stream=5e9",
        "ncclSend send=191 count=193 dtype=1 peer=3 comm=c27 stream=5ea",
        "ncclSend send=195 count=197 dtype=1 peer=2 comm=c27 stream=5ea",
        "ncclRecv recv=1a2 count=419 dtype=5 peer=3 comm=c28 stream=5eb",
        "ncclGroupEnd",
        "ncclGroupStart",
        "ncclGroupSimulateEnd info=51",
        "ncclAllGather send=1b1 recv=1b2 count=13 dtype=7 comm=c29 stream=5ec",
    ];
    if windows {
        v.push("ncclCommWindowRegister comm=c2a buff=1000 size=8192 flags=1");
        v.push("ncclCommWindowDeregister comm=c2b win=3b");
    }
    v.push("ncclCommCount comm=c2c");
    v
}

/// What forward.c prints for every call both kinds of fake answer the same way.
const COMMON_STDOUT: &[&str] = &[
    "ncclGetUniqueId rc=0 id0=90",
    "ncclMemAlloc rc=0 ptr=0xa110c",
    "ncclMemFree rc=0",
    "ncclCommInitRankConfig rc=0 comm=0xc0",
    "ncclCommInitRank rc=0 comm=0xc1",
    "ncclCommInitAll rc=0 comms=0xd0,0xd1",
    "ncclCommSplit rc=0 new=0xe0",
    "ncclCommShrink rc=0 new=0xe1",
    "ncclCommInitRankScalable rc=0 comm=0xc2",
    "ncclCommGetAsyncError rc=0 err=6",
    "ncclCommCount rc=0 count=8",
    "ncclCommCuDevice rc=0 device=3",
    "ncclCommUserRank rc=0 rank=5",
    "ncclCommRegister rc=0 handle=0x4a",
    "ncclRedOpCreatePreMulSum rc=0 op=5",
    "ncclRedOpDestroy rc=0",
    "ncclGroupStart rc=0",
    "ncclReduce rc=0",
    "ncclBcast rc=0",
    "ncclBroadcast rc=0",
    "ncclAllReduce rc=0",
    "pncclAllReduce rc=0",
    "ncclReduceScatter rc=0",
    "ncclAlltoAll rc=0",
    "ncclGather rc=0",
    "ncclScatter rc=0",
    "ncclSend rc=0",
    "pncclSend rc=0",
    "ncclRecv rc=0",
    // The fake's ncclInProgress, unchanged.
    "ncclGroupEnd rc=7",
    "pncclGroupStart rc=0",
    "ncclGroupSimulateEnd rc=0",
    // The fake's ncclInvalidArgument and its own last-error text, unchanged.
    "ncclAllGather rc=4",
    "last after ncclAllGather: fake: ncclAllGather refuses count 13",
    "ncclGetErrorString(4): fake error string 4",
    // anyccl_nccl_dropin_calls: none before the first call; then the 14 collective and point-to-point calls
    // (ncclReduce, ncclBcast, ncclBroadcast, ncclAllReduce, pncclAllReduce, ncclReduceScatter, ncclAllGather,
    // ncclAlltoAll, ncclGather, ncclScatter, ncclSend, pncclSend, ncclRecv, ncclAllGather again, refused by the
    // fake but forwarded); the group, communicator and window calls are not counted.
    "calls at start: 0",
    "calls at end: 14",
];

fn assert_lines(out: &Output, want: &[&str]) {
    let lines: Vec<&str> = out.stdout.lines().collect();
    for w in want {
        assert!(
            lines.contains(w),
            "missing line {w:?} in the program's output:\n{}\nstderr:\n{}",
            out.stdout,
            out.stderr
        );
    }
}

fn records(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_owned).collect()
}

fn line_starting<'a>(out: &'a Output, prefix: &str) -> &'a str {
    out.stdout.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix:?} in:\n{}", out.stdout))
}

#[test]
fn the_exports_are_exactly_nccl_h_2_32_3_and_the_device_host_functions_with_their_aliases() {
    use object::{Object, ObjectSymbol};
    let device = header::device_snapshot();
    assert_eq!(
        anyccl_nccl::api::DEVICE_HOST_FUNCTIONS,
        device.as_slice(),
        "the drop-in's table and the device API's host functions differ"
    );
    let mut snapshot = header::snapshot();
    assert_eq!(anyccl_nccl::api::NCCL_H_FUNCTIONS, snapshot.as_slice(), "the drop-in's table and the header differ");
    snapshot.extend(device);
    let bytes = std::fs::read(dropin_so()).expect("read the drop-in");
    let file = object::File::parse(&*bytes).expect("the drop-in is an object file");
    let mut exported: Vec<String> = file
        .dynamic_symbols()
        .filter(|s| s.is_definition() && s.is_global() && s.kind() == object::SymbolKind::Text)
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect();
    exported.sort();
    let mut want: Vec<String> = snapshot.iter().flat_map(|n| [n.to_string(), format!("p{n}")]).collect();
    want.push("anyccl_nccl_dropin_marker".into());
    want.push("anyccl_nccl_dropin_underlying".into());
    want.push("anyccl_nccl_dropin_calls".into());
    want.push("anyccl_nccl_dropin_custom_calls".into());
    want.push("anyccl_nccl_dropin_no_log_subscriber".into());
    want.sort();
    assert_eq!(exported, want);
}

#[test]
fn the_header_parser_finds_declarations_and_nothing_else() {
    let h = "#define NCCL_VERSION(X,Y,Z) ((X) * 1000)\n/* ncclNotThis(int) */\ntypedef enum { ncclSum = 0, \
             ncclMaxRedOp = 0x7f>>(32-8*sizeof(int)) } ncclRedOp_t;\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n\
             ncclResult_t  ncclA(int *v);\nncclResult_t pncclA(int *v);\n__attribute__ ((deprecated(\"x (y)\")))\n\
             void  ncclB();\nconst char* ncclC(ncclResult_t r); // ncclD(int)\ntypedef ncclResult_t (*ncclE)(int);\n";
    assert_eq!(header::functions(h), ["ncclA", "pncclA", "ncclB", "ncclC"]);
}

#[test]
fn every_call_is_forwarded_with_its_arguments_and_its_result() {
    let lib = fake("dropin-full/libnccl.so.2", &["FAKE_VERSION=22809"]);
    let dir = case_dir("full");
    let record = dir.join("calls.txt");
    let out = run(forward_program(), &dir, &[], &[("ANYCCL_NCCL_PATH", os(&lib)), ("FAKE_RECORD", os(&record))]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(records(&record), expected_records(true));
    assert_lines(&out, COMMON_STDOUT);
    assert_lines(
        &out,
        &[
            "ncclGetVersion rc=0 version=22809",
            "ncclCommWindowRegister rc=0 win=0x3b",
            "ncclCommWindowDeregister rc=0",
            // Every later call was forwarded: the library's own text.
            "last after ncclCommWindowRegister: fake: ncclAllGather refuses count 13",
            "last after ncclCommCount: fake: ncclAllGather refuses count 13",
        ],
    );
    assert_eq!(line_starting(&out, "underlying: "), format!("underlying: NCCL 2.28.9 {}", lib.display()));
    // Nothing on stderr without ANYCCL_LOG.
    assert_eq!(out.stderr, "");
}

/// The checks program (tests/c/checks.c) linked to the drop-in where cargo built it.
fn checks_program() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = case_dir("checks-program");
        let out = dir.join("checks");
        let mut args = programs::link_to_dropin();
        args.push(OsString::from("-I"));
        args.push(programs::c_dir().into_os_string());
        args.push(OsString::from("-pthread"));
        cc(&out, &[programs::c_dir().join("checks.c")], &args);
        out
    })
}

/// What the drop-in says of a handle it does not hold, passed to `function`.
fn refusal(function: &str, handle: &str) -> String {
    format!(
        "{function}: comm {handle} is not a communicator of this process: the anyccl drop-in NCCL did not create it, \
         or it was already destroyed (ncclCommDestroy or ncclCommAbort); nothing was called"
    )
}

#[test]
fn handles_the_drop_in_did_not_create_are_refused_and_its_texts_stay_readable() {
    let lib = fake("dropin-2.32/libnccl.so.2", &["FAKE_VERSION=23203", "NCCL_2_32"]);
    let dir = case_dir("checks");
    let record = dir.join("calls.txt");
    let env = [("ANYCCL_NCCL_PATH", os(&lib)), ("FAKE_RECORD", os(&record)), ("ANYCCL_LOG", os("debug"))];
    let out = run(checks_program(), &dir, &[], &env);
    assert_eq!(out.code, Some(0), "{out:?}");
    let ok = "rc=0 last=fake: no error yet";
    let refused = |what: &str, function: &str, handle: &str| format!("{what} rc=4 last={}", refusal(function, handle));
    let missing = format!(
        "ncclCommGetUniqueId rc=5 last=ncclCommGetUniqueId is not available: the library under the anyccl drop-in \
         NCCL, {} (NCCL 2.32.3), does not export it (the drop-in implements nccl.h 2.32.3); nothing was called",
        lib.display()
    );
    let lacks = |function: &str| {
        format!(
            "{function} is not available: the library under the anyccl drop-in NCCL, {} (NCCL 2.32.3), does not \
             export it (the drop-in implements nccl.h 2.32.3); nothing was called",
            lib.display()
        )
    };
    let want: Vec<String> = vec![
        refused("garbage ncclCommCount", "ncclCommCount", "0xdead0"),
        refused("garbage ncclAllReduce", "ncclAllReduce", "0xdead1"),
        refused("garbage ncclSend", "ncclSend", "0xdead2"),
        refused("garbage ncclCommDestroy", "ncclCommDestroy", "0xdead3"),
        refused("garbage ncclAllReduceConfig", "ncclAllReduceConfig", "0xdead4"),
        "freed ncclCommUserRank rc=4 names_it=1".into(),
        "garbage ncclGetLastError: text".into(),
        format!("live ncclCommCount {ok}"),
        format!("live ncclCommDestroy {ok}"),
        refused("destroyed ncclCommCount", "ncclCommCount", "0xd00"),
        refused("destroyed ncclCommDestroy", "ncclCommDestroy", "0xd00"),
        format!("live ncclCommAbort {ok}"),
        refused("aborted ncclAllReduce", "ncclAllReduce", "0xa00"),
        format!("live ncclCommFinalize {ok}"),
        format!("finalized ncclCommCount {ok}"),
        format!("null ncclCommDestroy {ok}"),
        // One buffer per thread, overwritten in place: the first pointer shows the newest text, never freed memory.
        format!("first pointer again: same=1 text={}", refusal("ncclCommCuDevice", "0xbad11")),
        format!("first text was: {}", refusal("ncclCommCount", "0xbad0")),
        format!(
            "after a forwarded call: fake: no error yet; first pointer: {}",
            refusal("ncclCommCuDevice", "0xbad11")
        ),
        format!("ended thread's pointer: {}", refusal("ncclCommCount", "0xbad2")),
        format!("ncclCommSuspend {ok}"),
        format!("ncclCommResume {ok}"),
        format!("ncclAllReduceConfig initializer {ok}"),
        format!("ncclAllReduceConfig null {ok}"),
        format!("ncclAllReduceConfig named {ok}"),
        format!("ncclAllReduceConfig tagged {ok}"),
        format!("ncclAllReduceConfig bad magic {ok}"),
        format!("ncclAllReduceConfig too small {ok}"),
        format!("ncclBroadcastConfig {ok}"),
        format!("pncclBroadcastConfig {ok}"),
        "ncclParamGetI32 rc=0 value=32".into(),
        missing,
        format!("ncclReduceConfig {ok}"),
        format!("ncclAllGatherConfig {ok}"),
        format!("ncclReduceScatterConfig {ok}"),
        format!("ncclAlltoAllConfig {ok}"),
        format!("ncclGatherConfig {ok}"),
        format!("ncclScatterConfig {ok}"),
        // The grown communicator is the drop-in's: a call on it is forwarded, not refused.
        "ncclCommGrow rc=0 new=e2 last=fake: no error yet".into(),
        format!("grown ncclCommCount {ok}"),
        format!("ncclSetEncryption {ok}"),
        "ncclWinGetUserPtr rc=0 user=5e4".into(),
        format!("ncclPutSignal {ok}"),
        format!("ncclSignal {ok}"),
        format!("ncclWaitSignal {ok}"),
        "ncclCommMemStats rc=0 value=1002".into(),
        "ncclParamBind rc=0 handle=9b".into(),
        // Each width and signedness written through untouched (the fake's extremes).
        "ncclParamGet ints rc=0,0,0,0,0,0,0 values=-8,-16,-1099511627776,200,60000,4000000000,9223372036854775808"
            .into(),
        "ncclParamGetStr rc=0 value=fake-str".into(),
        "ncclParamGet rc=0 value=raw len=3".into(),
        "ncclParamGetParameter rc=0 value=fake-value len=10".into(),
        "ncclParamGetAllParameterKeys rc=0 len=2 keys=NCCL_FAKE_A,NCCL_FAKE_B".into(),
        "ncclParamDumpAll last=fake: no error yet".into(),
        // The device API's host side: a team by value both ways, a handle refused with an empty team, a function
        // the fake lacks answered with -1 or ncclInvalidUsage and a text (the caller's pointer untouched).
        "ncclTeamWorld team=8,3,1 last=fake: no error yet".into(),
        "ncclTeamRankToWorld rank=105 last=fake: no error yet".into(),
        format!("garbage pncclTeamWorld team=0,0,0 last={}", refusal("pncclTeamWorld", "0xdead6")),
        format!("ncclLLA2ACalcSlots slots=-1 last={}", lacks("ncclLLA2ACalcSlots")),
        format!("ncclGetPeerDevicePointer rc=5 out=77 last={}", lacks("ncclGetPeerDevicePointer")),
        refused("destroyed ncclCommSuspend", "ncclCommSuspend", "0xc32"),
        // Counted as collectives: the six ncclAllReduceConfig, the two broadcast and six other *Config calls,
        // ncclPutSignal, ncclSignal and ncclWaitSignal (the refused calls above reached nothing and are not).
        "calls=17".into(),
    ];
    let got: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(got, want, "stderr:\n{}", out.stderr);
    // Nothing refused reached the library; the minting calls record nothing.
    assert_eq!(
        records(&record),
        [
            "ncclGetVersion",
            "ncclCommCount comm=d00",
            "ncclCommDestroy comm=d00",
            "ncclCommGetAsyncError comm=d00",
            "ncclCommAbort comm=a00",
            "ncclCommFinalize comm=f00",
            "ncclCommCount comm=f00",
            "ncclCommDestroy comm=0",
            "ncclCommCount comm=c00",
            "ncclCommSuspend comm=c32 flags=1",
            "ncclCommResume comm=c32",
            // Whichever way the drop-in decided each ncclAllReduceConfig (the log, below), what the library got is
            // the caller's call with the caller's config, untouched (a null one stays null).
            "ncclAllReduceConfig send=301 recv=302 count=303 dtype=7 op=0 comm=c32 stream=5f1 \
             config=size:72,magic:cafebeef,version:23203,alg:(null),force:1,tag:0",
            "ncclAllReduceConfig send=311 recv=312 count=313 dtype=7 op=0 comm=c32 stream=5f2 config=null",
            "ncclAllReduceConfig send=341 recv=342 count=343 dtype=7 op=0 comm=c32 stream=5f5 \
             config=size:72,magic:cafebeef,version:23203,alg:RING_SIMPLE,force:1,tag:0",
            "ncclAllReduceConfig send=351 recv=352 count=353 dtype=7 op=0 comm=c32 stream=5f6 \
             config=size:72,magic:cafebeef,version:23203,alg:(null),force:1,tag:42",
            "ncclAllReduceConfig send=361 recv=362 count=363 dtype=7 op=0 comm=c32 stream=5f7 \
             config=size:72,magic:0,version:23203,alg:(null),force:1,tag:0",
            "ncclAllReduceConfig send=371 recv=372 count=373 dtype=7 op=0 comm=c32 stream=5f8 \
             config=size:16,magic:cafebeef,version:23203,alg:(null),force:1,tag:0",
            "ncclBroadcastConfig send=321 recv=322 count=323 dtype=7 root=1 comm=c32 stream=5f3 config=cc2",
            "ncclBroadcastConfig send=331 recv=332 count=333 dtype=7 root=2 comm=c32 stream=5f4 config=cc3",
            "ncclParamGetI32 h=9a",
            "ncclReduceConfig send=401 recv=402 count=403 dtype=2 op=2 root=1 comm=c32 stream=5a1 config=cc4",
            "ncclAllGatherConfig send=411 recv=412 count=413 dtype=8 comm=c32 stream=5a2 config=cc5",
            "ncclReduceScatterConfig send=421 recv=422 count=423 dtype=6 op=3 comm=c32 stream=5a3 config=cc6",
            "ncclAlltoAllConfig send=431 recv=432 count=433 dtype=10 comm=c32 stream=5a4 config=cc7",
            "ncclGatherConfig send=441 recv=442 count=443 dtype=11 root=1 comm=c32 stream=5a5 config=cc8",
            "ncclScatterConfig send=451 recv=452 count=453 dtype=0 root=2 comm=c32 stream=5a6 config=cc9",
            "ncclCommGrow comm=c32 nranks=12 id0=33 rank=9 config=cfa",
            "ncclCommCount comm=e2",
            "ncclSetEncryption config=e4c",
            "ncclWinGetUserPtr comm=c32 win=3d",
            "ncclPutSignal send=501 count=503 dtype=9 peer=4 win=3e offset=4096 sig=2 ctx=1 flags=5 comm=c32 stream=5b1",
            "ncclSignal peer=5 sig=3 ctx=2 flags=6 comm=c32 stream=5b2",
            "ncclWaitSignal n=2 desc1=6,7,8,9 comm=c32 stream=5b3",
            "ncclCommMemStats comm=c32 stat=2",
            "ncclParamBind key=NCCL_FAKE_KEY",
            "ncclParamGetI8 h=9b",
            "ncclParamGetI16 h=9c",
            "ncclParamGetI64 h=9d",
            "ncclParamGetU8 h=9e",
            "ncclParamGetU16 h=9f",
            "ncclParamGetU32 h=a0",
            "ncclParamGetU64 h=a1",
            "ncclParamGetStr h=a2",
            "ncclParamGet h=a3 max=7",
            "ncclParamGetParameter key=NCCL_FAKE_PARAM",
            "ncclParamGetAllParameterKeys",
            "ncclParamDumpAll",
            "ncclTeamWorld comm=c32",
            "ncclTeamRankToWorld comm=c32 team=8,3,2 rank=5",
            "ncclCommDestroy comm=c32",
            "ncclCommGetAsyncError comm=c32",
        ]
    );
    // How each ncclAllReduceConfig was decided (ANYCCL_LOG=debug): a null config and one at the initializer's values
    // went the way of ncclAllReduce (anyccl's selector, which forwards here: the fake has no device runtime), the
    // others were forwarded for what they ask, each with its reason.
    let decided = |count: &str| -> String {
        let lines: Vec<&str> = out
            .stderr
            .lines()
            .filter(|l| l.contains("function=\"ncclAllReduceConfig\"") && l.split(' ').any(|w| w == count))
            .collect();
        assert_eq!(lines.len(), 1, "{count}: {lines:?}\n{}", out.stderr);
        lines[0].to_owned()
    };
    for count in ["count=303", "count=313"] {
        let line = decided(count);
        assert!(line.contains("choice=\"ccl\"") && !line.contains("per-call config"), "{line}");
    }
    for (count, why) in [
        ("count=343", "the per-call config asks for an algorithm selection (algSelection), which only the library"),
        ("count=353", "the per-call config asks for a profiler tag (userProfilerTag 0x2a)"),
        ("count=363", "the per-call config is not one the library accepts (magic 0x0 is not NCCL_API_MAGIC"),
        ("count=373", "the per-call config is not one the library accepts (size 16 is smaller than"),
    ] {
        let line = decided(count);
        assert!(line.contains(why) && line.contains("choice=\"ccl\""), "{why:?} not in {line}");
    }
}

#[test]
fn a_library_without_window_functions_is_answered_with_a_code_and_a_text() {
    // RCCL 7.0: no ncclCommWindowRegister. Named through ANYCCL_RCCL_PATH alone, so RCCL is searched first.
    let lib = fake("dropin-rocm-7.0/librccl.so.1", &["FAKE_VERSION=22606", "NO_WINDOWS", "RCCL"]);
    let dir = case_dir("no-windows");
    let record = dir.join("calls.txt");
    let out = run(forward_program(), &dir, &[], &[("ANYCCL_RCCL_PATH", os(&lib)), ("FAKE_RECORD", os(&record))]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(records(&record), expected_records(false), "nothing may reach the library for the missing functions");
    assert_lines(&out, COMMON_STDOUT);
    // ncclInvalidUsage (5), nothing written to the caller's window handle.
    assert_lines(&out, &["ncclCommWindowRegister rc=5 win=(nil)", "ncclCommWindowDeregister rc=5"]);
    let text = format!(
        "ncclCommWindowRegister is not available: the library under the anyccl drop-in NCCL, {} (RCCL 2.26.6), does \
         not export it (the drop-in implements nccl.h 2.32.3); nothing was called",
        lib.display()
    );
    assert_eq!(
        line_starting(&out, "last after ncclCommWindowRegister: "),
        format!("last after ncclCommWindowRegister: {text}")
    );
    // ncclGetErrorString leaves the drop-in's text in place; the next forwarded call gives the library's back.
    assert_eq!(
        line_starting(&out, "last after ncclGetErrorString: "),
        format!("last after ncclGetErrorString: {text}")
    );
    assert_lines(&out, &["last after ncclCommCount: fake: ncclAllGather refuses count 13"]);
    assert_eq!(line_starting(&out, "underlying: "), format!("underlying: RCCL 2.26.6 {}", lib.display()));
}

#[test]
fn anyccl_log_debug_logs_each_collective_and_a_bad_value_only_warns() {
    let lib = fake("dropin-full/libnccl.so.2", &["FAKE_VERSION=22809"]);
    let dir = case_dir("log");
    let record = dir.join("calls.txt");
    let env = |log: &str| vec![("ANYCCL_NCCL_PATH", os(&lib)), ("FAKE_RECORD", os(&record)), ("ANYCCL_LOG", os(log))];
    let out = run(forward_program(), &dir, &[], &env("debug"));
    assert_eq!(out.code, Some(0), "{out:?}");
    let line = |function: &str, fields: &[&str]| {
        let found = out.stderr.lines().any(|l| {
            l.contains(&format!("function=\"{function}\"")) && fields.iter().all(|f| l.split(' ').any(|w| w == *f))
        });
        assert!(found, "no log line for {function} with {fields:?} in:\n{}", out.stderr);
    };
    line("ncclAllReduce", &["count=133", "dtype=bfloat16", "op=sum", "comm=0xc21", "stream=0x5e4", "choice=\"ccl\""]);
    line("pncclAllReduce", &["count=137", "dtype=float32", "op=avg", "comm=0xc21", "stream=0x5e4"]);
    line("ncclReduce", &["count=103", "dtype=int32", "op=max", "root=1", "comm=0xc1e", "stream=0x5e1"]);
    line("ncclReduceScatter", &["count=143", "dtype=float16", "op=min", "comm=0xc22"]);
    line("ncclAllGather", &["count=153", "dtype=float64", "comm=0xc23", "stream=0x5e6"]);
    line("ncclAlltoAll", &["count=163", "dtype=float8e4m3"]);
    line("ncclBroadcast", &["count=123", "dtype=int64", "root=3"]);
    line("ncclBcast", &["count=113", "dtype=uint32", "root=2"]);
    line("ncclGather", &["count=173", "dtype=float8e5m2", "root=1"]);
    line("ncclScatter", &["count=183", "dtype=int8", "root=2"]);
    line("ncclSend", &["count=193", "dtype=uint8", "peer=3", "comm=0xc27", "stream=0x5ea"]);
    line("ncclRecv", &["count=419", "dtype=uint64", "peer=3", "comm=0xc28", "stream=0x5eb"]);
    line("ncclGroupStart", &[]);
    line("ncclGroupEnd", &[]);
    // The same calls reached the library.
    assert_eq!(records(&record), expected_records(true));

    let _ = std::fs::remove_file(&record);
    let out = run(forward_program(), &dir, &[], &env("[not a filter"));
    assert_eq!(out.code, Some(0), "{out:?}");
    let warnings: Vec<&str> = out.stderr.lines().filter(|l| l.contains("ANYCCL_LOG")).collect();
    assert_eq!(warnings.len(), 1, "{}", out.stderr);
    assert!(
        warnings[0].starts_with("warning: anyccl drop-in NCCL: ANYCCL_LOG=\"[not a filter\" is not a valid log filter")
    );
    assert_eq!(records(&record), expected_records(true));
}

/// A library anyccl's search could find on this machine outside the test's folders (a file at a default place, or
/// a soname in the dynamic loader's cache): then a "nothing found" case may legitimately forward to it.
fn machine_has_a_library(env: &[(&str, OsString)], test_dir: &Path) -> Option<String> {
    let lookup = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| PathBuf::from(v));
    let file = anyccl_nccl::load::plan(&lookup).into_iter().find_map(|p| match p {
        Place::Path(p) if !p.starts_with(test_dir) && p.is_file() => Some(p.display().to_string()),
        _ => None,
    });
    file.or_else(|| {
        let cache = ["/sbin/ldconfig", "/usr/sbin/ldconfig"]
            .iter()
            .find_map(|l| std::process::Command::new(l).arg("-p").output().ok())?;
        let text = String::from_utf8_lossy(&cache.stdout).into_owned();
        text.lines()
            .find(|l| {
                ["libnccl.so.2 ", "libnccl.so ", "librccl.so.1 ", "librccl.so "]
                    .iter()
                    .any(|n| l.trim_start().starts_with(n))
            })
            .map(|l| l.trim().to_owned())
    })
}

/// In the "nothing found" cases on a machine that has a library: the drop-in forwarded to something, not itself.
fn assert_forwarded_elsewhere(out: &Output, found: &str) {
    let u = line_starting(out, "underlying: ");
    assert!(
        u.len() > "underlying: ".len() && !u.contains("libanyccl_nccl") && !u.contains("/tmp/dropin-"),
        "{u} (this machine has {found})"
    );
}

#[test]
fn with_no_library_every_call_fails_cleanly_and_says_why() {
    let dir = case_dir("none");
    let missing = dir.join("missing").join("libnccl.so.2");
    let env = vec![("ANYCCL_NCCL_PATH", os(&missing))];
    let out = run(forward_program(), &dir, &[], &env);
    assert_eq!(out.code, Some(0), "{out:?}");
    if let Some(found) = machine_has_a_library(&env, &dir) {
        // This machine has a library at a default place: the drop-in forwards to it, never to itself.
        assert_forwarded_elsewhere(&out, &found);
        return;
    }
    assert_lines(
        &out,
        &[
            "underlying: ",
            // ncclSystemError; the caller's int untouched.
            "ncclGetVersion rc=2 version=-1",
            "ncclGetErrorString(2): system error (the anyccl drop-in found no NCCL or RCCL to forward to; see \
             ncclGetLastError)",
            "ncclAllReduce rc=2",
            // Answered by the drop-in itself: not counted as forwarded.
            "calls at end: 0",
        ],
    );
    let last = line_starting(&out, "last after ncclGetVersion: ");
    assert!(
        last.starts_with(&format!(
            "last after ncclGetVersion: ncclGetVersion: the anyccl drop-in NCCL ({}) found no NCCL or RCCL library \
             to forward to; set ANYCCL_NCCL_PATH (or ANYCCL_RCCL_PATH) to the real library's absolute path. Tried: \
             {} (not found); ",
            programs::dropin_as_linked().display(),
            missing.display()
        )),
        "{last}"
    );
    assert!(last.contains("librccl.so.1 (not found)"), "{last}");
    let last = line_starting(&out, "last after ncclResetDebugInit: ");
    assert!(last.starts_with("last after ncclResetDebugInit: ncclResetDebugInit: the anyccl drop-in NCCL"), "{last}");
}

/// The drop-in installed as `libnccl.so.2` (in D, and another copy in F), the program linked to it by that name,
/// and `LD_LIBRARY_PATH` D:F[:E] with the real (fake) library in E.
struct Installed {
    dir: PathBuf,
    d: PathBuf,
    f: PathBuf,
    e: PathBuf,
    program: PathBuf,
}

fn installed(name: &str) -> Installed {
    let dir = case_dir(name);
    let (d, f, e) = (dir.join("d"), dir.join("f"), dir.join("e"));
    for x in [&d, &f, &e] {
        std::fs::create_dir_all(x).expect("folder");
    }
    std::fs::copy(dropin_so(), d.join("libnccl.so.2")).expect("install the drop-in in D");
    std::fs::copy(dropin_so(), f.join("libnccl.so.2")).expect("install a second copy in F");
    std::fs::copy(fake("dropin-full/libnccl.so.2", &["FAKE_VERSION=22809"]), e.join("libnccl.so.2"))
        .expect("install the fake in E");
    let program = dir.join("forward");
    let mut args = link_to(&d, "libnccl.so.2");
    args.push(OsString::from("-I"));
    args.push(programs::c_dir().into_os_string());
    cc(&program, &[programs::c_dir().join("forward.c")], &args);
    Installed { dir, d, f, e, program }
}

fn path_list(dirs: &[&Path]) -> OsString {
    std::env::join_paths(dirs).expect("path list")
}

#[test]
fn installed_as_libnccl_so_2_it_never_loads_itself_and_finds_the_real_one() {
    let i = installed("recursion");
    let record = i.dir.join("calls.txt");
    // Even ANYCCL_NCCL_PATH naming the drop-in itself is skipped.
    let env = vec![
        ("LD_LIBRARY_PATH", path_list(&[&i.d, &i.f, &i.e])),
        ("ANYCCL_NCCL_PATH", os(i.d.join("libnccl.so.2"))),
        ("FAKE_RECORD", os(&record)),
    ];
    let out = run(&i.program, &i.dir, &[], &env);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        line_starting(&out, "underlying: "),
        format!("underlying: NCCL 2.28.9 {}", i.e.join("libnccl.so.2").display())
    );
    assert_lines(&out, &["ncclGetVersion rc=0 version=22809", "ncclAllReduce rc=0"]);
    assert_eq!(records(&record), expected_records(true));
    // Two copies of the drop-in: not left behind after a pass.
    let _ = std::fs::remove_dir_all(&i.dir);
}

#[test]
fn installed_as_libnccl_so_2_with_nothing_else_it_fails_cleanly() {
    let i = installed("recursion-alone");
    let env = vec![("LD_LIBRARY_PATH", path_list(&[&i.d, &i.f]))];
    let out = run(&i.program, &i.dir, &[], &env);
    assert_eq!(out.code, Some(0), "{out:?}");
    if let Some(found) = machine_has_a_library(&env, &i.dir) {
        assert_forwarded_elsewhere(&out, &found);
        let _ = std::fs::remove_dir_all(&i.dir);
        return;
    }
    assert_lines(&out, &["underlying: ", "ncclGetVersion rc=2 version=-1", "ncclAllReduce rc=2"]);
    let last = line_starting(&out, "last after ncclGetVersion: ");
    for refusal in [
        "libnccl.so.2 (the dynamic loader gave back this anyccl drop-in library itself)".to_owned(),
        format!("{} (it is this anyccl drop-in library itself (the same file))", i.d.join("libnccl.so.2").display()),
        format!(
            "{} (it is an anyccl drop-in library (it exports anyccl_nccl_dropin_marker))",
            i.f.join("libnccl.so.2").display()
        ),
    ] {
        assert!(last.contains(&refusal), "{refusal:?} not in {last}");
    }
    let _ = std::fs::remove_dir_all(&i.dir);
}

#[test]
fn preloaded_over_a_program_linked_to_the_real_library_it_forwards_to_that_library() {
    // As PyTorch runs under LD_PRELOAD: the program needs libnccl.so.2 (the fake, in E); the drop-in is preloaded,
    // so the program's calls reach it first, and it finds the library the program loaded by its soname.
    let dir = case_dir("preload");
    let e = dir.join("e");
    std::fs::create_dir_all(&e).expect("folder");
    std::fs::copy(fake("dropin-full/libnccl.so.2", &["FAKE_VERSION=22809"]), e.join("libnccl.so.2"))
        .expect("install the fake in E");
    let program = dir.join("forward");
    let mut args = link_to(&e, "libnccl.so.2");
    args.push(OsString::from("-I"));
    args.push(programs::c_dir().into_os_string());
    cc(&program, &[programs::c_dir().join("forward.c")], &args);
    let record = dir.join("calls.txt");
    let env = vec![("LD_PRELOAD", os(dropin_so())), ("FAKE_RECORD", os(&record))];
    let out = run(&program, &dir, &[], &env);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        line_starting(&out, "underlying: "),
        format!("underlying: NCCL 2.28.9 {}", e.join("libnccl.so.2").display())
    );
    assert_lines(&out, COMMON_STDOUT);
    assert_eq!(records(&record), expected_records(true));
    // Without the drop-in the same program calls the library directly: no load-time ncclGetVersion, and no
    // anyccl_nccl_dropin_underlying (the program says so and stops).
    let _ = std::fs::remove_file(&record);
    let out = run(&program, &dir, &[], &[("FAKE_RECORD", os(&record))]);
    assert_eq!((out.code, out.stdout.as_str()), (Some(1), "underlying: (no drop-in loaded)\n"));
    assert!(records(&record).is_empty());
}
