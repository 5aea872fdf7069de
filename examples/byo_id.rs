//! Bring your own NCCL id: an engine that moves the id itself (here through files in a shared directory, as candle
//! does) and gives anyccl a [`Bootstrap`] of its own for the rest of the setup (custom-kernel IPC handles). The full
//! communicator, custom kernels included, comes from `communicator_with_id`.
//!
//! ```text
//! # in two shells, one GPU each:
//! BYO_DIR=/tmp/job1 BYO_RANK=0 BYO_WORLD=2 cargo run --example byo_id --features cuda
//! BYO_DIR=/tmp/job1 BYO_RANK=1 BYO_WORLD=2 cargo run --example byo_id --features cuda
//! ```
//!
//! CI only compiles it. The file exchange trusts whoever can write the directory: give it mode 0700.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl::core::bootstrap::Bootstrap;
use anyccl::cuda::multi_process::{communicator_with_id, new_unique_id};
use anyccl::{Error, Selector};

/// The largest file a peer may leave for one exchange.
const MAX_ENTRY: u64 = 1 << 20;

/// A [`Bootstrap`] over a shared directory: in round `n`, rank `r` writes `n.r` (atomically, by rename) and reads
/// every rank's file of that round.
struct FileBootstrap {
    dir: PathBuf,
    rank: usize,
    world: usize,
    round: u64,
    timeout: Duration,
}

impl Bootstrap for FileBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, mine: &[u8]) -> anyccl::Result<Vec<Vec<u8>>> {
        let io = |what: String, e: std::io::Error| Error::PeerFailure(format!("{what}: {e}"));
        let round = self.round;
        self.round += 1;
        let tmp = self.dir.join(format!("{round}.{}.tmp", self.rank));
        std::fs::write(&tmp, mine).map_err(|e| io(format!("writing {}", tmp.display()), e))?;
        let done = self.dir.join(format!("{round}.{}", self.rank));
        std::fs::rename(&tmp, &done).map_err(|e| io(format!("renaming to {}", done.display()), e))?;
        let deadline = Instant::now() + self.timeout;
        (0..self.world)
            .map(|q| {
                let path = self.dir.join(format!("{round}.{q}"));
                loop {
                    match std::fs::metadata(&path) {
                        Ok(m) if m.len() > MAX_ENTRY => {
                            return Err(Error::PeerFailure(format!("{} is over {MAX_ENTRY} bytes", path.display())))
                        }
                        Ok(_) => return std::fs::read(&path).map_err(|e| io(format!("reading {}", path.display()), e)),
                        Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                        Err(e) => return Err(io(format!("rank {q} never wrote {}", path.display()), e)),
                    }
                }
            })
            .collect()
    }
}

fn var(name: &str) -> Result<String, Box<dyn std::error::Error>> {
    std::env::var(name).map_err(|_| format!("set {name}").into())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(var("BYO_DIR")?);
    let rank: usize = var("BYO_RANK")?.parse()?;
    let world: usize = var("BYO_WORLD")?.parse()?;
    let mut boot = FileBootstrap { dir, rank, world, round: 0, timeout: Duration::from_secs(60) };
    // The engine moves the id itself: rank 0 makes it, the others read it.
    let mine = if rank == 0 { new_unique_id()?.as_bytes().to_vec() } else { Vec::new() };
    let id_bytes = boot.broadcast(0, Some(&mine))?;
    let id = anyccl::ccl::UniqueId::from_bytes(&id_bytes)?;
    let comm = communicator_with_id(&id, rank, world, rank as i32, &mut boot, Arc::new(Selector::default()))?;
    println!("rank {} of {} joined with its own id", comm.rank(), comm.world_size());
    Ok(())
}
