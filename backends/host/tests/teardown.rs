//! The host backend's background close: nothing slow to do, so the teardown has finished when the call returns.

use std::time::Duration;

use anyccl_core::{DataType, InOut, ReduceOp};
use anyccl_host::{communicators, HostBuffer, HostOptions};

#[test]
fn closing_host_ranks_in_the_background_has_finished_on_return() {
    let opts = HostOptions { timeout: Duration::from_secs(20), ..HostOptions::default() };
    let comms = communicators(2, opts).expect("host group");
    let teardowns: Vec<anyccl_core::Teardown> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let mut b = HostBuffer::from_elems(&[1.0f32, 2.0]);
                    comm.all_reduce(InOut::InPlace(b.as_bytes_mut()), 2, DataType::F32, ReduceOp::Sum, &())
                        .expect("all-reduce");
                    comm.close_in_background()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    for t in teardowns {
        assert!(t.is_done(), "the host backend tears down before returning");
        assert_eq!(t.wait_timeout(Duration::ZERO), Some(Ok(())));
    }
}
