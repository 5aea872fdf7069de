//! How the ranks of a job reach each other outside the collective library: a small [`Bootstrap`] trait (all-gather
//! of bytes, broadcast, barrier), which is all that the GPU backends' setup needs beyond the library's own id:
//! custom-kernel IPC handles, graph-buffer registration, window handles.
//!
//! anyccl ships two implementations: the authenticated TCP rendezvous (`anyccl_rendezvous::Rendezvous`, one
//! process per rank) and [`LocalGroup`] (ranks as threads of one process). An engine that already has a way to
//! talk to its peers (an MPI communicator, a gloo group, its own store) implements [`Bootstrap::all_gather`] over
//! it and passes it where anyccl asks for `&mut dyn Bootstrap`; the other methods have defaults built on it.
//!
//! ```
//! use std::time::Duration;
//! use anyccl_core::bootstrap::{Bootstrap, LocalGroup};
//!
//! let group = LocalGroup::new(3, Duration::from_secs(10));
//! let gathered: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
//!     let hs: Vec<_> = (0..3)
//!         .map(|r| {
//!             let mut me = group.member(r);
//!             s.spawn(move || {
//!                 let b: &mut dyn Bootstrap = &mut me;
//!                 let from_root = b.broadcast(1, (b.rank() == 1).then_some(&b"hello"[..])).unwrap();
//!                 assert_eq!(from_root, b"hello");
//!                 b.barrier().unwrap();
//!                 b.all_gather(&[r as u8]).unwrap()
//!             })
//!         })
//!         .collect();
//!     hs.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert!(gathered.iter().all(|g| g == &[vec![0], vec![1], vec![2]]));
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, InvalidArgument, Result};

/// Byte exchange among the ranks of a job, used to set up what needs every rank's handles. Every method is
/// collective: every rank calls it, in the same order.
///
/// What a bootstrap returns comes from peers: callers check its shape (one entry per rank, sizes they expect)
/// before use. [`checked_all_gather`] does the first check.
pub trait Bootstrap {
    /// This rank, below [`Bootstrap::world`].
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world(&self) -> usize;

    /// Every rank's `mine`, indexed by rank.
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// `root`'s `data` on every rank (`data` is read on the root only; other ranks pass `None`). The default is
    /// an all-gather in which only the root contributes.
    fn broadcast(&mut self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        let world = self.world();
        if root >= world {
            return Err(InvalidArgument::RankOutOfRange { what: "broadcast root", rank: root, world }.into());
        }
        let mine = if self.rank() == root { data.unwrap_or_default() } else { &[] };
        let mut all = checked_all_gather(self, mine)?;
        Ok(std::mem::take(&mut all[root]))
    }

    /// Returns once every rank has called it. The default is an empty all-gather.
    fn barrier(&mut self) -> Result<()> {
        checked_all_gather(self, &[]).map(|_| ())
    }
}

/// [`Bootstrap::all_gather`], refusing an answer that does not hold exactly one entry per rank.
pub fn checked_all_gather<B: Bootstrap + ?Sized>(b: &mut B, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let world = b.world();
    let all = b.all_gather(mine)?;
    if all.len() != world {
        return Err(Error::PeerFailure(format!(
            "a bootstrap all-gather of {world} ranks returned {} entries",
            all.len()
        )));
    }
    Ok(all)
}

/// The most bytes one rank may contribute to [`all_gather_padded`] by default (1 MiB): setup payloads (IPC
/// handles, addresses, tokens) are far smaller, and every rank allocates `world ×` the largest contribution.
pub const MAX_PADDED_PAYLOAD: usize = 1 << 20;

/// An all-gather of byte strings of any length (up to `limit` each) over a fixed-size all-gather, such as a
/// communicator's own collective: `gather(input, output)` must all-gather `input.len()` bytes per rank into
/// `output` (`world × input.len()` bytes, rank `q`'s part at `q × input.len()`), collectively with the same sizes on
/// every rank. `rank` and `world` are the caller's place in that collective.
///
/// Two rounds: the lengths (8 bytes per rank), then every payload padded to the longest. A contribution longer
/// than `limit` (this rank's or a peer's) is refused on every rank after the first round, before anything is
/// allocated from it: this rank's with [`InvalidArgument::SizeTooLarge`], a peer's with [`Error::PeerFailure`]
/// naming it. Every rank takes part in both rounds or in neither, so a refusal never leaves a peer waiting.
pub fn all_gather_padded(
    rank: usize,
    world: usize,
    mine: &[u8],
    limit: usize,
    mut gather: impl FnMut(&[u8], &mut [u8]) -> Result<()>,
) -> Result<Vec<Vec<u8>>> {
    let oom = |what: &str, bytes: usize| Error::OutOfMemory { what: what.to_owned(), bytes: bytes as u64 };
    let len_bytes = world.checked_mul(8).ok_or_else(|| oom("the lengths of a bootstrap all-gather", usize::MAX))?;
    let mut lens = Vec::new();
    lens.try_reserve_exact(len_bytes).map_err(|_| oom("the lengths of a bootstrap all-gather", len_bytes))?;
    lens.resize(len_bytes, 0u8);
    gather(&(mine.len() as u64).to_le_bytes(), &mut lens)?;
    let lengths: Vec<u64> =
        lens.chunks_exact(8).map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect();
    let too_long: Vec<usize> = (0..world).filter(|q| lengths[*q] > limit as u64).collect();
    if too_long.contains(&rank) {
        return Err(InvalidArgument::SizeTooLarge {
            what: "a bootstrap all-gather payload",
            requested: mine.len() as u64,
            limit: limit as u64,
        }
        .into());
    }
    if let Some(q) = too_long.first() {
        return Err(Error::PeerFailure(format!(
            "rank {q} contributed {} bytes to a bootstrap all-gather over the communicator; at most {limit} are \
             accepted",
            lengths[*q]
        )));
    }
    // Every length is at most `limit` (a usize) from here on.
    let part = lengths.iter().copied().max().unwrap_or(0) as usize;
    let mut out = Vec::new();
    if part > 0 {
        let total = part.checked_mul(world).ok_or_else(|| oom("a bootstrap all-gather", usize::MAX))?;
        let mut padded = Vec::new();
        padded.try_reserve_exact(part).map_err(|_| oom("a bootstrap all-gather payload", part))?;
        padded.extend_from_slice(mine);
        padded.resize(part, 0);
        let mut all = Vec::new();
        all.try_reserve_exact(total).map_err(|_| oom("a bootstrap all-gather", total))?;
        all.resize(total, 0);
        gather(&padded, &mut all)?;
        out.try_reserve_exact(world).map_err(|_| oom("a bootstrap all-gather", world))?;
        for (q, len) in lengths.iter().enumerate() {
            out.push(all[q * part..q * part + *len as usize].to_vec());
        }
    } else {
        out.resize(world, Vec::new());
    }
    Ok(out)
}

/// A [`Bootstrap`] among the ranks of one process, each driven by its own thread ([`LocalGroup::member`]).
pub struct LocalGroup {
    world: usize,
    timeout: Duration,
    state: Mutex<LocalState>,
    changed: Condvar,
}

/// A finished round's contributions and how many ranks have yet to read them.
type Finished = (Vec<Vec<u8>>, usize);

#[derive(Default)]
struct LocalState {
    /// The round being filled and its contributions.
    round: u64,
    contributions: Vec<Option<Vec<u8>>>,
    /// Finished rounds not yet read by every rank: round → (result, readers left).
    done: HashMap<u64, Finished>,
}

impl LocalGroup {
    /// A group of `world` ranks; a rank waits at most `timeout` for the others in each exchange.
    pub fn new(world: usize, timeout: Duration) -> Arc<Self> {
        let state = LocalState { contributions: vec![None; world], ..LocalState::default() };
        Arc::new(LocalGroup { world, timeout, state: Mutex::new(state), changed: Condvar::new() })
    }

    fn all_gather_as(&self, rank: usize, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let poisoned = || Error::PeerFailure("a rank panicked during an in-process exchange".into());
        let mut st = self.state.lock().map_err(|_| poisoned())?;
        if rank >= self.world || st.contributions[rank].is_some() {
            return Err(Error::PeerFailure(format!("rank {rank} joined an in-process exchange twice")));
        }
        let round = st.round;
        st.contributions[rank] = Some(mine.to_vec());
        if st.contributions.iter().all(Option::is_some) {
            let all: Vec<Vec<u8>> = st.contributions.iter_mut().map(|c| c.take().unwrap_or_default()).collect();
            st.done.insert(round, (all, self.world));
            st.round += 1;
            self.changed.notify_all();
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some((all, left)) = st.done.get_mut(&round) {
                *left -= 1;
                if *left > 0 {
                    return Ok(all.clone());
                }
                return Ok(st.done.remove(&round).map(|(all, _)| all).unwrap_or_default());
            }
            let now = Instant::now();
            if now >= deadline {
                // Withdraw, so a late peer does not complete a round this rank has given up on.
                st.contributions[rank] = None;
                let missing: Vec<String> = (0..self.world)
                    .filter(|q| *q != rank && st.contributions[*q].is_none())
                    .map(|q| q.to_string())
                    .collect();
                return Err(Error::Timeout {
                    what: format!("in-process exchange of rank {rank}: ranks [{}] did not arrive", missing.join(", ")),
                    after: self.timeout,
                });
            }
            st = self.changed.wait_timeout(st, deadline - now).map_err(|_| poisoned())?.0;
        }
    }

    /// The group as seen by `rank`.
    pub fn member(self: &Arc<Self>, rank: usize) -> LocalRank {
        LocalRank { group: self.clone(), rank }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }
}

/// One rank's handle on a [`LocalGroup`]. A clone is the same rank (joining one round twice is refused).
#[derive(Clone)]
pub struct LocalRank {
    group: Arc<LocalGroup>,
    rank: usize,
}

impl Bootstrap for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.group.all_gather_as(self.rank, mine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_group_gathers_every_rank_round_after_round() {
        let world = 4;
        let group = LocalGroup::new(world, Duration::from_secs(30));
        let results: Vec<Vec<Vec<Vec<u8>>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let mut me = group.member(r);
                    sc.spawn(move || {
                        (0..50u8).map(|round| me.all_gather(&[r as u8, round]).expect("all-gather")).collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        for per_rank in &results {
            for (round, all) in per_rank.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..world).map(|q| vec![q as u8, round as u8]).collect();
                assert_eq!(all, &want, "round {round}");
            }
        }
        assert!(group.state.lock().expect("lock").done.is_empty(), "every finished round was read and dropped");
    }

    #[test]
    fn a_missing_rank_is_a_timeout_naming_it() {
        let group = LocalGroup::new(3, Duration::from_millis(200));
        let err = std::thread::scope(|sc| {
            let mut r1 = group.member(1);
            let h = sc.spawn(move || r1.all_gather(b"x"));
            let mut r0 = group.member(0);
            let e0 = r0.all_gather(b"y").expect_err("rank 2 never comes");
            let e1 = h.join().expect("rank thread").expect_err("rank 2 never comes");
            (e0, e1)
        });
        for e in [err.0, err.1] {
            assert!(matches!(e, Error::Timeout { .. }), "{e}");
            assert!(e.to_string().contains("2] did not arrive"), "{e}");
        }
    }

    #[test]
    fn the_same_rank_joining_a_round_twice_is_refused() {
        // 3 s: the first call's round must still be open when the second call arrives, even on a loaded machine
        let group = LocalGroup::new(2, Duration::from_secs(3));
        std::thread::scope(|sc| {
            let mut first = group.member(0);
            let h = sc.spawn(move || first.all_gather(b"1"));
            // Wait until the first call has deposited its contribution.
            while group.state.lock().expect("lock").contributions[0].is_none() {
                std::thread::yield_now();
            }
            let twice = group.member(0).all_gather(b"2").expect_err("rank 0 is already in this round");
            assert!(twice.to_string().contains("twice"), "{twice}");
            let first = h.join().expect("thread").expect_err("rank 1 never comes");
            assert!(matches!(first, Error::Timeout { .. }), "{first}");
        });
    }

    /// Payloads of different lengths (empty ones too) come back intact over a fixed-size all-gather; one over the
    /// limit is refused on every rank after the lengths round, with the payload round never run.
    #[test]
    fn padded_all_gather_keeps_lengths_and_refuses_an_oversized_payload_everywhere() {
        let run = |payloads: Vec<Vec<u8>>, limit: usize| -> Vec<(Result<Vec<Vec<u8>>>, usize)> {
            let world = payloads.len();
            let group = LocalGroup::new(world, Duration::from_secs(30));
            std::thread::scope(|sc| {
                let hs: Vec<_> = payloads
                    .iter()
                    .enumerate()
                    .map(|(r, mine)| {
                        let mut me = group.member(r);
                        sc.spawn(move || {
                            let mut rounds = 0;
                            let mut gather = |input: &[u8], out: &mut [u8]| {
                                rounds += 1;
                                let all = checked_all_gather(&mut me, input)?;
                                assert!(all.iter().all(|a| a.len() == input.len()), "fixed size on every rank");
                                out.copy_from_slice(&all.concat());
                                Ok(())
                            };
                            let got = all_gather_padded(r, world, mine, limit, &mut gather);
                            (got, rounds)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("rank")).collect()
            })
        };
        let payloads = vec![b"a".to_vec(), Vec::new(), vec![7u8; 300]];
        for (got, rounds) in run(payloads.clone(), 1024) {
            assert_eq!(got.expect("gathered"), payloads);
            assert_eq!(rounds, 2);
        }
        for (got, rounds) in run(vec![Vec::new(), Vec::new()], 1024) {
            assert_eq!(got.expect("gathered"), vec![Vec::<u8>::new(); 2]);
            assert_eq!(rounds, 1, "nothing to pad: one round");
        }
        let results = run(vec![b"ok".to_vec(), vec![1u8; 65], b"fine".to_vec()], 64);
        for (r, (got, rounds)) in results.into_iter().enumerate() {
            assert_eq!(rounds, 1, "rank {r}: refused after the lengths round");
            let e = got.expect_err("over the limit");
            if r == 1 {
                let want =
                    InvalidArgument::SizeTooLarge { what: "a bootstrap all-gather payload", requested: 65, limit: 64 };
                assert_eq!(e, Error::InvalidArgument(want));
            } else {
                assert!(matches!(&e, Error::PeerFailure(m) if m.contains("rank 1 contributed 65 bytes")), "{e}");
            }
        }
    }

    /// The default broadcast and barrier, built on all-gather: the root's bytes reach every rank, a bad root is
    /// an `InvalidArgument` naming it, and a bootstrap that returns the wrong number of entries is refused.
    #[test]
    fn default_broadcast_and_barrier_work_over_all_gather_and_check_the_answer() {
        let group = LocalGroup::new(3, Duration::from_secs(30));
        let got: Vec<Vec<u8>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let mut me = group.member(r);
                    sc.spawn(move || {
                        me.barrier().expect("barrier");
                        let data = if r == 2 { Some(&b"from two"[..]) } else { Some(&b"ignored"[..]) };
                        me.broadcast(2, data).expect("broadcast")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(got.iter().all(|g| g == b"from two"), "{got:?}");

        let e = group.member(0).broadcast(3, None).expect_err("root 3 of 3");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::RankOutOfRange { rank: 3, .. })), "{e}");

        /// Answers with one entry too few.
        struct Short;
        impl Bootstrap for Short {
            fn rank(&self) -> usize {
                0
            }
            fn world(&self) -> usize {
                2
            }
            fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
                Ok(vec![mine.to_vec()])
            }
        }
        let e = Short.broadcast(1, None).expect_err("one entry for two ranks");
        assert!(e.to_string().contains("returned 1 entries"), "{e}");
        assert!(Short.barrier().is_err());
    }
}
