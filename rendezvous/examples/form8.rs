//! How long a group of 8 ranks (threads on 127.0.0.1) takes to form and do one all-gather of 128 bytes per rank.
//!
//! `cargo run --release -p anyccl-rendezvous --example form8 [runs]` prints the median, the fastest and the 90th
//! percentile of `runs` (default 50) formations, each from rank 0's `listen` until every rank has its result.
//! The code uses only API that protocol versions 1 and 2 share, so the same file measures both.

use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

const WORLD: usize = 8;

fn form_once() -> Result<Duration, anyccl_core::Error> {
    let start = Instant::now();
    let addr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 0));
    let listener = Rendezvous::listen(RendezvousConfig::new(0, WORLD, addr).with_timeout(Duration::from_secs(30)))?;
    let ranks: Vec<_> = (1..WORLD)
        .map(|rank| {
            let cfg = listener.client_config(rank);
            thread::spawn(move || Rendezvous::connect(cfg).and_then(|mut g| g.all_gather(&[rank as u8; 128])))
        })
        .collect();
    let mut g0 = listener.accept_all()?;
    let all = g0.all_gather(&[0u8; 128])?;
    for r in ranks {
        let theirs = r.join().map_err(|_| anyccl_core::Error::PeerFailure("a rank thread panicked".into()))??;
        if theirs != all {
            return Err(anyccl_core::Error::PeerFailure("the ranks disagree".into()));
        }
    }
    Ok(start.elapsed())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let runs: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 50,
    };
    // one warm-up run (thread stacks, first connections)
    form_once()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        times.push(form_once()?);
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p90 = times[(times.len() * 9 / 10).min(times.len() - 1)];
    println!(
        "form8: {} runs, a group of {WORLD} formed and all-gathered 128 B in median {:.3} ms (min {:.3} ms, p90 {:.3} ms)",
        times.len(),
        ms(times[times.len() / 2]),
        ms(times[0]),
        ms(p90)
    );
    Ok(())
}
