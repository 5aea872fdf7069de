//! The TCP rendezvous through core's `Bootstrap` trait object: what the GPU backends' setup sees when an engine
//! passes it (`&mut dyn Bootstrap`).

use std::net::SocketAddr;
use std::thread;
use std::time::Duration;

use anyccl_core::bootstrap::{checked_all_gather, Bootstrap};
use anyccl_core::{Error, InvalidArgument};
use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

/// Three ranks over TCP, driven only through `&mut dyn Bootstrap`: rank and world are the group's, all-gather
/// returns every rank's bytes by rank, broadcast delivers the root's bytes, barrier returns, and a root outside
/// the world is an `InvalidArgument` (and leaves the group usable: a last all-gather still works).
#[test]
fn the_rendezvous_serves_every_bootstrap_call_through_the_trait_object() {
    let world = 3;
    let cfg = RendezvousConfig::new(0, world, any_port()).with_timeout(Duration::from_secs(20));
    let listener = Rendezvous::listen(cfg).expect("listen");
    let run = |mut g: Rendezvous| {
        let b: &mut dyn Bootstrap = &mut g;
        let rank = b.rank();
        assert_eq!(b.world(), 3);
        let all = checked_all_gather(b, format!("rank {rank}").as_bytes()).expect("all-gather");
        let from_root = b.broadcast(2, (rank == 2).then_some(&b"root two"[..])).expect("broadcast");
        b.barrier().expect("barrier");
        let bad = b.broadcast(3, None).expect_err("root 3 of 3");
        assert!(matches!(bad, Error::InvalidArgument(InvalidArgument::RankOutOfRange { rank: 3, .. })), "{bad}");
        let last = b.all_gather(&[rank as u8]).expect("the group still works");
        (rank, all, from_root, last)
    };
    let clients: Vec<_> = (1..world)
        .map(|rank| {
            let cfg = listener.client_config(rank);
            thread::spawn(move || run(Rendezvous::connect(cfg).expect("connect")))
        })
        .collect();
    let mut results = vec![run(listener.accept_all().expect("accept_all"))];
    results.extend(clients.into_iter().map(|h| h.join().expect("rank thread")));
    for (i, (rank, all, from_root, last)) in results.into_iter().enumerate() {
        let want: Vec<Vec<u8>> = (0..world).map(|q| format!("rank {q}").into_bytes()).collect();
        assert_eq!(rank, i);
        assert_eq!(all, want, "rank {rank}");
        assert_eq!(from_root, b"root two", "rank {rank}");
        assert_eq!(last, vec![vec![0], vec![1], vec![2]], "rank {rank}");
    }
}
