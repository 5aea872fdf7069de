//! What engines with tensor × pipeline × data parallel layouts need, on the host backend with ranks as threads
//! and as processes: grouped sends and receives (a pipeline stage sends to the next stage and receives from the
//! previous one at once, in either order, without deadlock) and sub-communicators (`split(color, key)`), each with
//! its own ranks and all-reduce, independent of its siblings and of its parent.
//!
//! The processes run twice: as threads over core's `LocalGroup` (the same `ProcessComm` code, in one process), and
//! as real processes started the way `torchrun` starts them (`anyccl_testkit::launcher`).

use anyccl_testkit::launcher;

use std::time::{Duration, Instant};

use anyccl_core::bootstrap::LocalGroup;
use anyccl_core::{CommBackend, Communicator, DataType, Error, InOut, InvalidArgument, P2pOp, ReduceOp, Result};
use anyccl_host::{communicator_over, communicators, from_env, HostBuffer, HostOptions, HostRuntime};

/// Elements per message: 1 MiB of f32, far above a Unix socket's buffer, so that two ranks that each blocked in a
/// send before receiving would never finish.
const BIG: usize = 1 << 18;

/// Element `i` of the message rank `r` sends in round `k`.
fn value(r: usize, k: usize, i: usize) -> f32 {
    (r * 1_000_003 + k * 7919 + i % 65_521) as f32
}

fn message(r: usize, k: usize) -> HostBuffer {
    HostBuffer::from_elems(&(0..BIG).map(|i| value(r, k, i)).collect::<Vec<_>>())
}

fn check(got: &HostBuffer, r: usize, k: usize, me: usize) {
    let v = got.to_vec::<f32>();
    let bad = (0..BIG).find(|i| v[*i].to_bits() != value(r, k, *i).to_bits());
    assert_eq!(bad, None, "rank {me}: round {k}'s message from rank {r} is wrong at that element");
}

/// The ring steps every rank runs: a send to the next rank and a receive from the previous one, in a group
/// listed send-first, receive-first, and (mixed) receive-first on even ranks only; then two sends to the next
/// rank and two receives from the previous one (matched in order); then the `send_recv` shorthand backwards.
fn ring<B: CommBackend<Runtime = HostRuntime>>(comm: &mut Communicator<B>) -> Result<()> {
    let (me, world) = (comm.rank(), comm.world_size());
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let f32s = DataType::F32;
    for (k, recv_first) in [(0, false), (1, true), (2, me.is_multiple_of(2))] {
        let out = message(me, k);
        let mut got = HostBuffer::zeroed(out.len());
        let send = P2pOp::send(out.as_bytes(), BIG, f32s, next);
        let recv = P2pOp::recv(got.as_bytes_mut(), BIG, f32s, prev);
        let mut ops = if recv_first { [recv, send] } else { [send, recv] };
        comm.p2p(&mut ops, &())?;
        check(&got, prev, k, me);
    }
    let (a, b) = (message(me, 3), message(me, 4));
    let (mut ga, mut gb) = (HostBuffer::zeroed(a.len()), HostBuffer::zeroed(b.len()));
    comm.p2p(
        &mut [
            P2pOp::recv(ga.as_bytes_mut(), BIG, f32s, prev),
            P2pOp::send(a.as_bytes(), BIG, f32s, next),
            P2pOp::recv(gb.as_bytes_mut(), BIG, f32s, prev),
            P2pOp::send(b.as_bytes(), BIG, f32s, next),
        ],
        &(),
    )?;
    check(&ga, prev, 3, me);
    check(&gb, prev, 4, me);
    let out = message(me, 5);
    let mut got = HostBuffer::zeroed(out.len());
    comm.send_recv(out.as_bytes(), prev, got.as_bytes_mut(), next, BIG, f32s, &())?;
    check(&got, next, 5, me);
    Ok(())
}

/// Color of parent rank `r` of `world`: even and odd ranks, and the last rank of an odd world joins none.
fn color(r: usize, world: usize) -> Option<u32> {
    (world.is_multiple_of(2) || r + 1 < world).then_some((r % 2) as u32)
}

/// One rank's split, checked: the keys reverse the parent order inside each color, so new rank 0 is the color's
/// highest parent rank; an all-reduce of `parent rank + 1` in each sub-communicator gives its own members' sum,
/// and a ring in it works; the parent still all-reduces afterwards, with some sub-communicators already dropped
/// and others still alive. Returns `rank/world:sum` in the sub-communicator, or `none`.
fn split_and_reduce<B: CommBackend<Runtime = HostRuntime>>(comm: &mut Communicator<B>) -> Result<String> {
    let (me, world) = (comm.rank(), comm.world_size());
    // What the probe reports for the host backend: it splits (threads and processes alike).
    comm.capabilities().require(anyccl_core::Capabilities::COMM_SPLIT)?;
    let mine = color(me, world);
    let sub = comm.split(mine, (world - me) as u32)?;
    let mut keep = None;
    let line = match (mine, sub) {
        (None, None) => "none".to_owned(),
        (Some(c), Some(mut sub)) => {
            let members: Vec<usize> = (0..world).filter(|r| color(*r, world) == Some(c)).rev().collect();
            assert_eq!(sub.world_size(), members.len(), "rank {me}");
            assert_eq!(members[sub.rank()], me, "rank {me}: ranked by key, which reverses the parent order");
            let mut buf = HostBuffer::from_elems(&[(me + 1) as f32, 1.0]);
            sub.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 2, DataType::F32, ReduceOp::Sum, &())?;
            let sum = members.iter().map(|r| (r + 1) as f32).sum::<f32>();
            assert_eq!(buf.to_vec::<f32>(), vec![sum, members.len() as f32], "rank {me}: the sub-sum of color {c}");
            if sub.world_size() > 1 {
                ring(&mut sub)?;
            }
            let line = format!("{}/{}:{sum}", sub.rank(), sub.world_size());
            // Every member is done with it past this barrier: some drop it now, others after the parent's call.
            sub.barrier(&())?;
            if !me.is_multiple_of(3) {
                keep = Some(sub);
            }
            line
        }
        (c, s) => panic!("rank {me}: color {c:?} but sub-communicator {:?}", s.map(|s| s.rank())),
    };
    let mut buf = HostBuffer::from_elems(&[1.0f32]);
    comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 1, DataType::F32, ReduceOp::Sum, &())?;
    assert_eq!(buf.to_vec::<f32>(), vec![world as f32], "rank {me}: the parent after the split");
    drop(keep);
    Ok(line)
}

/// What every rank of `world` should report from [`split_and_reduce`].
fn expected_split(world: usize) -> Vec<String> {
    (0..world)
        .map(|me| match color(me, world) {
            None => "none".to_owned(),
            Some(c) => {
                let members: Vec<usize> = (0..world).filter(|r| color(*r, world) == Some(c)).rev().collect();
                let rank = members.iter().position(|r| *r == me).expect("member");
                let sum = members.iter().map(|r| (r + 1) as f32).sum::<f32>();
                format!("{rank}/{}:{sum}", members.len())
            }
        })
        .collect()
}

/// Runs `f` on one thread per rank. The communicators are dropped only after every thread has finished: a host
/// rank that leaves makes its peers' waits fail, as a rank that died would.
fn on_threads<B, T: Send>(mut comms: Vec<Communicator<B>>, f: impl Fn(&mut Communicator<B>) -> T + Sync) -> Vec<T>
where
    B: CommBackend + Send,
{
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms.iter_mut().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn options() -> HostOptions {
    HostOptions { timeout: Duration::from_secs(20), ..HostOptions::default() }
}

/// `ProcessComm`s over an in-process `LocalGroup` (each set up on its own thread).
fn process_comms(world: usize) -> Vec<Communicator<anyccl_host::ProcessComm>> {
    let group = LocalGroup::new(world, Duration::from_secs(20));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let me = Box::new(group.member(r));
                s.spawn(move || communicator_over(me, options()).expect("communicator"))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("setup thread")).collect()
    })
}

#[test]
fn grouped_ring_in_both_orders_on_threads_at_worlds_3_and_4() {
    for world in [3, 4] {
        let results = on_threads(communicators(world, options()).expect("group"), ring);
        assert!(results.iter().all(Result::is_ok), "world {world}: {results:?}");
    }
}

#[test]
fn split_into_two_colors_on_threads_at_worlds_4_and_5() {
    for world in [4, 5] {
        let got = on_threads(communicators(world, options()).expect("group"), |c| split_and_reduce(c).expect("split"));
        assert_eq!(got, expected_split(world), "world {world}");
    }
}

#[test]
fn grouped_ring_and_split_on_process_communicators_over_a_local_group() {
    for world in [3, 4] {
        let results = on_threads(process_comms(world), |c| -> Result<String> {
            ring(c)?;
            split_and_reduce(c)
        });
        let got: Vec<String> = results.into_iter().map(|r| r.expect("ring and split")).collect();
        assert_eq!(got, expected_split(world), "world {world}");
    }
}

/// Why groups exist: on process communicators, a ring of plain blocking sends of 1 MiB or more (each rank sends before it
/// receives) stalls, every rank blocked in its send with its peer blocked in its own, until the write timeout;
/// the same exchange as a group completes.
#[test]
fn plain_sends_in_a_ring_stall_where_a_group_completes() {
    let short = || HostOptions { timeout: Duration::from_secs(2), ..HostOptions::default() };
    let group = LocalGroup::new(3, Duration::from_secs(20));
    let comms: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let me = Box::new(group.member(r));
                s.spawn(move || communicator_over(me, short()).expect("communicator"))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("setup thread")).collect()
    });
    // The stall needs a message that a Unix socket's send buffer (net.core.wmem_default, 208 KiB on common hosts)
    // cannot take whole: 1 MiB, or 8 times that buffer on a host tuned higher.
    let wmem = std::fs::read_to_string("/proc/sys/net/core/wmem_default")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let stall = BIG.max(2 * wmem);
    let t0 = Instant::now();
    let plain = on_threads(comms, |c| {
        let (me, world) = (c.rank(), c.world_size());
        let out = HostBuffer::zeroed(stall * 4);
        let mut got = HostBuffer::zeroed(stall * 4);
        c.send(out.as_bytes(), stall, DataType::F32, (me + 1) % world, &())?;
        c.recv(got.as_bytes_mut(), stall, DataType::F32, (me + world - 1) % world, &())
    });
    eprintln!("plain blocking sends after {:?}: {plain:?}", t0.elapsed());
    assert!(
        plain.iter().all(|r| matches!(r, Err(Error::Timeout { .. }))),
        "plain blocking sends should stall: {plain:?}"
    );
    assert!(t0.elapsed() >= Duration::from_secs(2), "they failed only at the write timeout");
    let grouped = on_threads(process_comms(3), |c| {
        let (me, world) = (c.rank(), c.world_size());
        let out = message(me, 0);
        let mut got = HostBuffer::zeroed(out.len());
        c.send_recv(
            out.as_bytes(),
            (me + 1) % world,
            got.as_bytes_mut(),
            (me + world - 1) % world,
            BIG,
            DataType::F32,
            &(),
        )?;
        check(&got, (me + world - 1) % world, 0, me);
        Ok::<_, Error>(())
    });
    assert!(grouped.iter().all(Result::is_ok), "{grouped:?}");
}

/// A sub-communicator splits again (pairs out of the even ranks), and its own sub-communicator all-reduces.
#[test]
fn a_sub_communicator_splits_again() {
    let got = on_threads(communicators(6, options()).expect("group"), |c| -> Result<Option<f32>> {
        let me = c.rank();
        let Some(mut evens) = c.split(Some((me % 2) as u32), me as u32)? else { return Ok(None) };
        let r = evens.rank();
        let Some(mut low) = evens.split((r < 2).then_some(0), 0)? else { return Ok(None) };
        let mut buf = HostBuffer::from_elems(&[me as f32]);
        low.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 1, DataType::F32, ReduceOp::Sum, &())?;
        Ok(Some(buf.to_vec::<f32>()[0]))
    });
    let got: Vec<Option<f32>> = got.into_iter().map(|r| r.expect("nested split")).collect();
    // Evens 0, 2, 4 → 0 and 2 pair up; odds 1, 3, 5 → 1 and 3 pair up.
    assert_eq!(got, vec![Some(2.0), Some(4.0), Some(2.0), Some(4.0), None, None]);
}

/// A receive whose size does not match what the peer sent is refused and loses nothing: a receive of the right
/// size gets the message next. On threads and on process communicators.
#[test]
fn a_mismatched_receive_in_a_group_loses_nothing() {
    fn run<B: CommBackend<Runtime = HostRuntime>>(comms: Vec<Communicator<B>>) {
        let got = on_threads(comms, |c| -> Result<Vec<f32>> {
            if c.rank() == 0 {
                let out = HostBuffer::from_elems(&[1.0f32, 2.0, 3.0]);
                c.p2p(&mut [P2pOp::send(out.as_bytes(), 3, DataType::F32, 1)], &())?;
                return Ok(vec![]);
            }
            let mut short = HostBuffer::zeroed(8);
            let e = c.p2p(&mut [P2pOp::recv(short.as_bytes_mut(), 2, DataType::F32, 0)], &()).expect_err("2 ≠ 3");
            assert_eq!(e, Error::InvalidArgument(InvalidArgument::MessageMismatch { peer: 0, got: 12, expected: 8 }));
            let mut right = HostBuffer::zeroed(12);
            c.p2p(&mut [P2pOp::recv(right.as_bytes_mut(), 3, DataType::F32, 0)], &())?;
            Ok(right.to_vec::<f32>())
        });
        assert_eq!(got[1].as_ref().expect("rank 1"), &vec![1.0, 2.0, 3.0]);
    }
    run(communicators(2, options()).expect("threads"));
    run(process_comms(2));
}

fn start(world: usize, port: u16) -> Vec<std::process::Child> {
    launcher::start_ranks(world, port, &[("ANYCCL_HOST_CHILD", "groups".to_owned())])
}

fn across_processes(world: usize) {
    let held = launcher::hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let t0 = Instant::now();
    let kids = start(world, port);
    let lines: Vec<String> = kids
        .into_iter()
        .enumerate()
        .map(|(r, c)| launcher::result_line(r, &launcher::finish(r, c, t0, Duration::from_secs(60))))
        .collect();
    eprintln!("{world} processes: {:?}", t0.elapsed());
    assert_eq!(lines, expected_split(world));
}

#[test]
fn grouped_ring_and_split_across_3_processes() {
    across_processes(3);
}

#[test]
fn grouped_ring_and_split_across_4_processes() {
    across_processes(4);
}

/// The rank half, started by the tests above with torchrun's variables.
#[test]
#[ignore = "one rank of the launcher tests, which start it with torchrun's variables"]
fn rank() {
    assert_eq!(std::env::var("ANYCCL_HOST_CHILD").as_deref(), Ok("groups"), "run by the launcher tests");
    let mut comm = from_env(options()).expect("the host communicator forms");
    ring(&mut comm).expect("grouped ring");
    println!("RESULT {}", split_and_reduce(&mut comm).expect("split"));
}
