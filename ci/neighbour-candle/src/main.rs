//! An engine's all-reduce as a cudarc user writes it: cudarc's context, stream and `CudaSlice<bf16>`, anyccl's
//! communicator from the torchrun environment, one typed call. CI only compiles it.

use std::sync::Arc;

use anyccl::cuda::bootstrap::communicator_from_env;
use anyccl::cuda::CudarcAllReduce;
use anyccl::{ReduceOp, Selector};
use cudarc::driver::CudaContext;
use half::bf16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut comm, _rendezvous) = communicator_from_env(Arc::new(Selector::default()))?;
    let ctx = CudaContext::new(comm.runtime().context().ordinal().try_into()?)?;
    let stream = ctx.default_stream();
    let mut grads = stream.clone_htod(&vec![bf16::from_f32(1.0); 1 << 20])?;
    let chosen = comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &stream)?;
    let host = stream.clone_dtoh(&grads)?;
    println!("rank {}: {} ({}), first element {}", comm.rank(), chosen.algorithm, chosen.why, host[0]);
    Ok(())
}
