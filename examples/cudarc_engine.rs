//! An engine that holds cudarc's context, stream and slices: a typed all-reduce of a `CudaSlice<f32>` on its
//! `CudaStream`, count and element type from the slice. One process per GPU. CI only compiles it
//! (`--features cudarc`).

use std::sync::Arc;

use anyccl::cuda::cudarc::driver::CudaContext;
use anyccl::cuda::CudarcAllReduce;
use anyccl::ReduceOp;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The ranks find each other from torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    // `MASTER_PORT`): `torchrun --nproc-per-node 2 target/debug/examples/cudarc_engine`.
    let (mut comm, _rendezvous) =
        anyccl::cuda::multi_process::communicator_from_env(Arc::new(anyccl::Selector::default()))?;
    let stream = CudaContext::new(comm.runtime().context().ordinal().try_into()?)?.default_stream();
    let mut grads = stream.clone_htod(&vec![1.0f32; 1 << 20])?;
    comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &stream)?;
    println!("sum = {}", stream.clone_dtoh(&grads)?[0]);
    Ok(())
}
