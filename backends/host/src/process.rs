//! The host backend with one process per rank: [`communicator_over`] a [`Bootstrap`] (the TCP rendezvous, an
//! engine's own store, or [`anyccl_core::bootstrap::LocalGroup`] for ranks as threads), and [`from_env`] for ranks
//! started by `torchrun` (or any launcher that sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//!
//! **Transport.** The collectives move their data through the bootstrap's byte exchange: every rank all-gathers
//! its contribution and reduces locally, visiting the ranks in one fixed order per element, so every rank gets
//! bitwise identical results (the same reduction kernels as the threaded host backend). Point-to-point messages
//! go over a mesh of Unix-domain stream sockets set up through the bootstrap: each rank listens in a fresh private
//! directory (mode 0700), and a connecting peer proves itself with a random token exchanged over the bootstrap
//! before its messages are accepted. This is a correctness and CI path, not a fast one: no shared memory yet, and
//! a collective's per-rank bytes are bounded by the bootstrap's message limit (1 MiB by default for the TCP
//! rendezvous, `RendezvousConfig::max_message`).
//!
//! **Failure.** A rank that dies makes its peers fail with [`Error::PeerFailure`] or [`Error::Timeout`] within the
//! bootstrap's timeout (collectives) or [`HostOptions::timeout`] (receives), instead of hanging.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyccl_core::bootstrap::{checked_all_gather, Bootstrap};
use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, RecvArgs, ReduceArgs, ReduceScatterArgs, SendArgs,
};
use anyccl_core::{
    Algorithm, CapabilityReport, CommBackend, Communicator, DataType, Error, InvalidArgument, Result, Vendor,
};

use crate::reduce::{cast, cast_mut, internal, reduce_into, resolve, with_type};
use crate::{host_capabilities, split_io, try_copy, HostBuffer, HostOptions, HostRuntime};

/// The all-reduce algorithm of the process backend: one all-gather through the bootstrap, then a local reduction.
pub const PROCESS_ALGORITHMS: [Algorithm; 1] = [Algorithm::OneShot];

/// Length of the token a peer proves itself with on the point-to-point mesh.
const TOKEN_LEN: usize = 32;

/// One rank of a host communicator whose ranks are separate processes (or threads) joined by a [`Bootstrap`].
/// Make one with [`communicator_over`] or [`from_env`].
pub struct ProcessComm {
    rank: usize,
    world: usize,
    boot: Box<dyn Bootstrap + Send>,
    /// Stream to and from each peer (`None` at this rank's own index).
    peers: Vec<Option<UnixStream>>,
    /// A message header read from a peer whose length did not match the receive: the payload waits in the stream
    /// for the next receive, so a mismatched receive loses nothing.
    pending: Vec<Option<usize>>,
    runtime: HostRuntime,
    caps: CapabilityReport,
    timeout: Duration,
}

/// A host communicator over `bootstrap`: every rank calls this collectively. `options.timeout` bounds the
/// point-to-point setup and each receive; the collectives wait as long as the bootstrap does.
pub fn communicator_over(
    bootstrap: Box<dyn Bootstrap + Send>,
    options: HostOptions,
) -> Result<Communicator<ProcessComm>> {
    let comm = ProcessComm::new(bootstrap, options.timeout)?;
    Ok(Communicator::new(comm, options.selector))
}

/// A host communicator for a rank started by `torchrun` (or a launcher setting the same variables): joins the
/// authenticated TCP rendezvous configured by `anyccl_rendezvous::RendezvousConfig::from_env` (on `MASTER_PORT + 1`
/// or `ANYCCL_MASTER_PORT`, beside torchrun's agent), then [`communicator_over`] it.
pub fn from_env(options: HostOptions) -> Result<Communicator<ProcessComm>> {
    let cfg = anyccl_rendezvous::RendezvousConfig::from_env()?;
    let rdv = anyccl_rendezvous::Rendezvous::establish(cfg)?;
    communicator_over(Box::new(rdv), options)
}

fn peer_failure(what: String) -> Error {
    Error::PeerFailure(what)
}

fn io_error(what: &str, e: std::io::Error) -> Error {
    Error::PeerFailure(format!("{what}: {e}"))
}

/// A fresh private directory (mode 0700) under the temporary directory for this rank's listening socket.
fn private_dir(rank: usize) -> Result<PathBuf> {
    let mut name = [0u8; 8];
    getrandom::fill(&mut name).map_err(|e| internal(format!("no randomness for the host mesh directory: {e}")))?;
    let dir = std::env::temp_dir().join(format!("anyccl-host-{rank}-{:016x}", u64::from_le_bytes(name)));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| io_error(&format!("cannot create {}", dir.display()), e))?;
    Ok(dir)
}

/// Removes the listening directory when setup ends, whatever happened (connections outlive the path).
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl ProcessComm {
    fn new(mut boot: Box<dyn Bootstrap + Send>, timeout: Duration) -> Result<Self> {
        let (rank, world) = (boot.rank(), boot.world());
        if world == 0 || rank >= world {
            return Err(InvalidArgument::BadWorld(format!("bootstrap rank {rank} of world {world}")).into());
        }
        let peers = if world > 1 { mesh(boot.as_mut(), rank, world, timeout)? } else { vec![None] };
        tracing::debug!(rank, world, "host communicator over a bootstrap is up");
        let pending = vec![None; world];
        Ok(ProcessComm { rank, world, boot, peers, pending, runtime: HostRuntime, caps: host_capabilities(), timeout })
    }

    /// Every rank's `mine`, each checked to be exactly `len` bytes and copied into aligned memory.
    fn gather(&mut self, mine: &[u8], len: usize) -> Result<Vec<HostBuffer>> {
        let all = checked_all_gather(self.boot.as_mut(), mine)?;
        all.iter()
            .enumerate()
            .map(|(q, b)| {
                if b.len() != len {
                    return Err(peer_failure(format!(
                        "rank {q} contributed {} bytes to a host collective, expected {len}",
                        b.len()
                    )));
                }
                let mut h = HostBuffer::try_zeroed(len)?;
                h.as_bytes_mut().copy_from_slice(b);
                Ok(h)
            })
            .collect()
    }

    fn peer(&mut self, peer: usize) -> Result<&mut UnixStream> {
        self.peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| peer_failure(format!("rank {peer} has no point-to-point connection")))
    }
}

/// Sets up the point-to-point mesh: rank `j` connects to every rank `i < j` and proves itself with `i`'s token.
fn mesh(boot: &mut dyn Bootstrap, rank: usize, world: usize, timeout: Duration) -> Result<Vec<Option<UnixStream>>> {
    let dir = RemoveDir(private_dir(rank)?);
    let path = dir.0.join("p2p.sock");
    let listener =
        UnixListener::bind(&path).map_err(|e| io_error(&format!("cannot listen on {}", path.display()), e))?;
    let mut token = [0u8; TOKEN_LEN];
    getrandom::fill(&mut token).map_err(|e| internal(format!("no randomness for the host mesh token: {e}")))?;
    let path_bytes = path.as_os_str().as_encoded_bytes();
    let mut mine = Vec::new();
    mine.extend_from_slice(&token);
    mine.extend_from_slice(path_bytes);
    let all = checked_all_gather(boot, &mine)?;
    let mut peers: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
    for (i, entry) in all.iter().enumerate().take(rank) {
        if entry.len() <= TOKEN_LEN || entry.len() > TOKEN_LEN + 4096 {
            return Err(peer_failure(format!("rank {i} sent a malformed mesh address ({} bytes)", entry.len())));
        }
        let their_path = Path::new(
            std::str::from_utf8(&entry[TOKEN_LEN..])
                .map_err(|_| peer_failure(format!("rank {i} sent a mesh address that is not UTF-8")))?,
        );
        let mut s = UnixStream::connect(their_path)
            .map_err(|e| io_error(&format!("rank {rank} cannot reach rank {i} at {}", their_path.display()), e))?;
        s.set_write_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
        let mut hello = (rank as u64).to_le_bytes().to_vec();
        hello.extend_from_slice(&entry[..TOKEN_LEN]);
        s.write_all(&hello).map_err(|e| io_error(&format!("rank {rank} cannot greet rank {i}"), e))?;
        peers[i] = Some(s);
    }
    // Accept the ranks above this one; their connections are already queued once they passed the all-gather, so
    // the poll below only waits for a peer that died or stalls.
    listener.set_nonblocking(true).map_err(|e| io_error("socket mode", e))?;
    let deadline = Instant::now() + timeout;
    let mut left = world - 1 - rank;
    while left > 0 {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| io_error("socket mode", e))?;
                s.set_read_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
                s.set_write_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
                let mut hello = [0u8; 8 + TOKEN_LEN];
                if s.read_exact(&mut hello).is_err() || hello[8..] != token {
                    tracing::warn!(rank, "refused a mesh connection without this rank's token");
                    continue;
                }
                let mut who = [0u8; 8];
                who.copy_from_slice(&hello[..8]);
                let j = usize::try_from(u64::from_le_bytes(who)).unwrap_or(usize::MAX);
                if j <= rank || j >= world || peers[j].is_some() {
                    return Err(peer_failure(format!("a mesh peer with the right token claimed rank {j}")));
                }
                peers[j] = Some(s);
                left -= 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        what: format!("rank {rank}'s point-to-point connections from {left} higher ranks"),
                        after: timeout,
                    });
                }
                // std's listener has no accept with a deadline: poll it.
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io_error("accepting a mesh connection", e)),
        }
    }
    for s in peers.iter().flatten() {
        s.set_read_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
    }
    boot.barrier()?;
    Ok(peers)
}

impl CommBackend for ProcessComm {
    /// The operator in the host kernels' own set, resolved once per call by `check_reduction`.
    type Reduction = crate::reduce::Op;
    type Runtime = HostRuntime;

    fn runtime(&self) -> &HostRuntime {
        &self.runtime
    }

    fn name(&self) -> &'static str {
        "host"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn vendor(&self) -> Vendor {
        Vendor::Host
    }

    fn arch(&self) -> &str {
        "host-processes"
    }

    fn capabilities(&self) -> &CapabilityReport {
        &self.caps
    }

    fn allreduce_algorithms(&self) -> &[Algorithm] {
        &PROCESS_ALGORITHMS
    }

    fn check_reduction(&self, dtype: DataType, op: anyccl_core::ReduceOp) -> Result<crate::reduce::Op> {
        // The host kernels implement every pair core accepts that this build knows.
        resolve(dtype, op)
    }

    fn allreduce_eligible(&self, algorithm: Algorithm, _call: &AllReduceCall) -> std::result::Result<(), String> {
        if PROCESS_ALGORITHMS.contains(&algorithm) {
            Ok(())
        } else {
            Err("the host backend across processes runs one-shot only".to_owned())
        }
    }

    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        let (dtype, bytes) = (args.dtype(), args.bytes());
        let op = args.reduction();
        let (input, buf) = split_io(args.into_bufs());
        let src = try_copy(input.map_or(&buf[..bytes], |i| &i[..bytes]), "a host contribution")?;
        let all = self.gather(&src, bytes)?;
        with_type!(dtype, T => {
            let ins: Vec<&[T]> = all.iter().map(|h| cast::<T>(h.as_bytes())).collect::<Result<_>>()?;
            reduce_into(&ins, cast_mut::<T>(&mut buf[..bytes])?, op, self.world);
        });
        Ok(())
    }

    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        let part = args.count() * args.dtype().size_bytes();
        let (input, buf) = split_io(args.into_bufs());
        let own = self.rank * part..(self.rank + 1) * part;
        let src = try_copy(input.map_or(&buf[own], |i| &i[..part]), "a host contribution")?;
        let all = self.gather(&src, part)?;
        for (q, h) in all.iter().enumerate() {
            buf[q * part..(q + 1) * part].copy_from_slice(h.as_bytes());
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        let (dtype, total) = (args.dtype(), args.bytes());
        let op = args.reduction();
        let part = args.count() * dtype.size_bytes();
        let (input, buf) = split_io(args.into_bufs());
        let in_place = input.is_none();
        let src = match input {
            Some(i) => try_copy(&i[..total], "a host contribution")?,
            None => try_copy(&buf[..total], "a host contribution")?,
        };
        let all = self.gather(&src, total)?;
        let mine = self.rank * part..(self.rank + 1) * part;
        let out = if in_place { &mut buf[mine.clone()] } else { &mut buf[..part] };
        with_type!(dtype, T => {
            let ins: Vec<&[T]> = all.iter().map(|h| cast::<T>(&h.as_bytes()[mine.clone()])).collect::<Result<_>>()?;
            reduce_into(&ins, cast_mut::<T>(out)?, op, self.world);
        });
        Ok(())
    }

    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        let (bytes, root) = (args.bytes(), args.root());
        let (input, buf) = split_io(args.into_bufs());
        let data = (self.rank == root).then(|| input.map_or(&buf[..bytes], |i| &i[..bytes]));
        let data = data.map(|d| try_copy(d, "a broadcast payload")).transpose()?;
        let got = self.boot.broadcast(root, data.as_deref())?;
        if got.len() != bytes {
            return Err(peer_failure(format!("root {root} broadcast {} bytes, expected {bytes}", got.len())));
        }
        buf[..bytes].copy_from_slice(&got);
        Ok(())
    }

    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        let (bytes, dtype, root) = (args.bytes(), args.dtype(), args.root());
        // On every rank, the root's peers too, so an unknown type or operator fails everywhere before anything moves.
        let op = args.reduction();
        let (input, buf) = split_io(args.into_bufs());
        let src = try_copy(input.map_or(&buf[..bytes], |i| &i[..bytes]), "a host contribution")?;
        let all = self.gather(&src, bytes)?;
        if self.rank == root {
            with_type!(dtype, T => {
                let ins: Vec<&[T]> = all.iter().map(|h| cast::<T>(h.as_bytes())).collect::<Result<_>>()?;
                reduce_into(&ins, cast_mut::<T>(&mut buf[..bytes])?, op, self.world);
            });
        }
        Ok(())
    }

    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        let (peer, bytes) = (args.peer(), args.bytes());
        let rank = self.rank;
        let s = self.peer(peer)?;
        let len = (bytes as u64).to_le_bytes();
        s.write_all(&len)
            .and_then(|()| s.write_all(&args.buf()[..bytes]))
            .map_err(|e| io_error(&format!("rank {rank}'s message to rank {peer}"), e))
    }

    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        let (peer, bytes) = (args.peer(), args.bytes());
        let (rank, timeout) = (self.rank, self.timeout);
        let pending = self.pending.get_mut(peer).and_then(Option::take);
        let s = self.peer(peer)?;
        let failed = |e: std::io::Error| {
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                Error::Timeout { what: format!("rank {rank}'s message from rank {peer}"), after: timeout }
            } else {
                io_error(&format!("rank {rank}'s message from rank {peer}"), e)
            }
        };
        let got = match pending {
            Some(got) => got,
            None => {
                let mut len = [0u8; 8];
                s.read_exact(&mut len).map_err(failed)?;
                usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX)
            }
        };
        if got != bytes {
            self.pending[peer] = Some(got);
            return Err(InvalidArgument::MessageMismatch { peer, got, expected: bytes }.into());
        }
        s.read_exact(&mut args.into_buf()[..bytes]).map_err(failed)
    }

    fn barrier(&mut self, _stream: &()) -> Result<()> {
        self.boot.barrier()
    }
}
