//! A communicator closed in the background whose destroy is still running when the process exits: the exit waits
//! for it (the destroy finishes, nothing crashes), and the process still exits with its own status. Run in a child
//! process (this test binary again, its `#[ignore]`d test `exit_child`), because the point is the exit.

use anyccl_testkit::fake_ccl;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_ccl::{CclComm, CclLibrary, UniqueId};

/// How long the child's fake destroy sleeps: well past the moment it exits, well within the exit's wait.
const DESTROY_DELAY_MS: u64 = 400;

#[test]
#[ignore = "the child half of a_close_still_running_at_exit_finishes_before_the_process_ends, which runs it"]
fn exit_child() {
    let path = PathBuf::from(std::env::var_os("ANYCCL_TEST_SLOW_NCCL").expect("set by the parent test"));
    let lib = Arc::new(CclLibrary::open(&path).expect("the fake loads"));
    let id = UniqueId::new(&lib).expect("id");
    let comm = CclComm::init_rank(lib, 1, &id, 0).expect("communicator");
    let t = comm.close_in_background();
    println!("RESULT returned done={}", t.is_done());
    // Exits at once, while the destroy sleeps on its thread.
    std::process::exit(0);
}

fn run_child(path: &Path, marker: &Path) -> (std::process::ExitStatus, String, Duration) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["exit_child", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .env_clear()
        .env("ANYCCL_TEST_SLOW_NCCL", path)
        .env("FAKE_CCL_DESTROY_DELAY_MS", DESTROY_DELAY_MS.to_string())
        .env("FAKE_CCL_DESTROY_MARKER", marker)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the child");
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the child still ran after 60 s");
        }
        // Polling the child's exit: std has no wait with a deadline.
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = start.elapsed();
    let out = child.wait_with_output().expect("output");
    (status, String::from_utf8_lossy(&out.stdout).into_owned(), took)
}

#[test]
fn a_close_still_running_at_exit_finishes_before_the_process_ends() {
    let path = fake_ccl::build_slow_destroy(&fake_ccl::NCCL_2_28);
    let marker = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("destroy-marker-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let (status, stdout, took) = run_child(&path, &marker);
    assert!(status.success(), "the child crashed or failed at exit ({status}):\n{stdout}");
    assert!(stdout.contains("RESULT returned done=false"), "the close waited for the destroy:\n{stdout}");
    let written = std::fs::read_to_string(&marker).unwrap_or_default();
    let _ = std::fs::remove_file(&marker);
    assert_eq!(written, "destroyed\n", "the exit did not wait for the destroy to finish");
    assert!(took >= Duration::from_millis(DESTROY_DELAY_MS), "exited after {took:?}");
}
