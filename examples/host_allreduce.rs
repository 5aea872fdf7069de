//! All-reduce on the host backend, ranks as threads of one process: `cargo run --example host_allreduce`.

use anyccl::host::{communicators, HostBuffer, HostOptions, HostStream};
use anyccl::{DataType, InOut, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world = 4;
    let comms = communicators(world, HostOptions::default())?;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || -> anyccl::Result<Vec<f32>> {
                    let me = comm.rank() as f32;
                    let mut buf = HostBuffer::from_elems(&[me, 1.0, 2.0]);
                    comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 3, DataType::F32, ReduceOp::Sum, &HostStream)?;
                    Ok(buf.to_vec::<f32>())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "a rank panicked")?.map_err(Into::into))
            .collect::<Result<Vec<_>, Box<dyn std::error::Error + Send + Sync>>>()
    });
    for (rank, r) in results.map_err(|e| e.to_string())?.iter().enumerate() {
        println!("rank {rank}: {r:?}");
        assert_eq!(r, &[6.0, 4.0, 8.0]);
    }
    Ok(())
}
