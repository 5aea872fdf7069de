//! An engine's all-reduce as a cudarc user writes it (docs/rust.md's torchrun example): cudarc's context, stream and
//! `CudaSlice<bf16>`, anyccl's communicator from the torchrun environment, one typed call. CI only compiles it.

use std::sync::Arc;

use anyccl::cuda::{multi_process::communicator_from_env, CudarcAllReduce};
use anyccl::{ReduceOp, Selector};
use cudarc::driver::CudaContext;
use half::bf16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut comm, _rendezvous) = communicator_from_env(Arc::new(Selector::default()))?; // RANK, WORLD_SIZE, ...
    let stream = CudaContext::new(comm.runtime().context().ordinal().try_into()?)?.default_stream();
    let mut grads = stream.clone_htod(&vec![bf16::ONE; 1 << 20])?;
    comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &stream)?; // count, dtype and device from the slice
    assert_eq!(stream.clone_dtoh(&grads)?[0].to_f32(), comm.world_size() as f32);
    Ok(())
}
