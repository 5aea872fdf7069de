//! One process per rank, started by `torchrun` (or any launcher that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), on the best backend present:
//!
//! ```text
//! torchrun --nproc-per-node 2 target/debug/examples/torchrun
//! ```
//!
//! Built with the `cudarc` feature on a machine with a CUDA driver, it all-reduces a cudarc `CudaSlice<f32>` on the
//! GPU `LOCAL_RANK`; otherwise the host backend runs one process per rank (what CI runs). anyccl's rendezvous
//! listens on `MASTER_PORT + 1` (or `ANYCCL_MASTER_PORT`), beside torchrun's own store on `MASTER_PORT`.
//!
//! Every rank contributes `rank + 1` in each of 4 elements and prints `RESULT rank R of W: S` where `S` is
//! `W (W + 1) / 2`.

use anyccl::{DataType, InOut, ReduceOp};

fn host() -> Result<(usize, usize, f32), Box<dyn std::error::Error>> {
    let mut comm = anyccl::host::from_env(anyccl::host::HostOptions::default())?;
    let me = (comm.rank() + 1) as f32;
    let mut buf = anyccl::host::HostBuffer::from_elems(&[me; 4]);
    comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 4, DataType::F32, ReduceOp::Sum, &anyccl::host::HostStream)?;
    let out = buf.to_vec::<f32>();
    if out.iter().any(|v| *v != out[0]) {
        return Err(format!("elements differ: {out:?}").into());
    }
    Ok((comm.rank(), comm.world_size(), out[0]))
}

#[cfg(feature = "cudarc")]
fn cuda() -> Result<(usize, usize, f32), Box<dyn std::error::Error>> {
    use anyccl::cuda::cudarc::driver::CudaContext;
    use anyccl::cuda::CudarcAllReduce;

    let (mut comm, _rendezvous) =
        anyccl::cuda::multi_process::communicator_from_env(std::sync::Arc::new(anyccl::Selector::default()))?;
    let stream = CudaContext::new(comm.runtime().context().ordinal().try_into()?)?.default_stream();
    let me = (comm.rank() + 1) as f32;
    let mut buf = stream.clone_htod(&[me; 4])?;
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream)?;
    Ok((comm.rank(), comm.world_size(), stream.clone_dtoh(&buf)?[0]))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "cudarc")]
    let ((rank, world, sum), backend) =
        if anyccl::cuda::driver::probe().is_ok() { (cuda()?, "cuda") } else { (host()?, "host") };
    #[cfg(not(feature = "cudarc"))]
    let ((rank, world, sum), backend) = (host()?, "host");
    eprintln!("rank {rank}: all-reduced on the {backend} backend");
    println!("RESULT rank {rank} of {world}: {sum}");
    Ok(())
}
