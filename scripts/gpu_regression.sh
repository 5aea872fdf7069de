#!/bin/bash
# The single-GPU regression run after a change to the CUDA communicator: the GPU tests (2-GPU ones skipped), the
# cudarc tests, the eager host-time check against raw NCCL, the bench, --per-rank and the IPC check under the real
# torchrun, and the kernel tests. Binaries are built elsewhere (the GPU machine has no Rust) and passed in BINDIR.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BIN="${1:-.devbin}"; cd "$BIN" || { echo "usage: $0 BINDIR (gpu, cudarc_gpu, kernels_gpu, anyccl, anyccl-cuda-ipc-check built here and copied there)"; exit 2; }
T0=$(date +%s)
echo "== gpu"; ANYCCL_IPC_CHECK=$PWD/anyccl-cuda-ipc-check ANYCCL_TEST_COMM_ITERS=20 ./gpu --ignored --test-threads=1 --skip graph_buffers_single_process --skip a_rank_that_dies --skip a_refused_wait_during_capture_leaves 2>&1 | grep -E "^test |test result|panicked|assert" | tail -30
echo "== cudarc_gpu"; ./cudarc_gpu --ignored --test-threads=1 --skip a_cudarc_slice_or_stream_of_another_device 2>&1 | grep -E "^test |test result|panicked" | tail -8
echo "== eager"; ./anyccl bench --backend cuda --eager --world 1 --iters 1000 --sizes 512KiB,16MiB 2>&1 | tail -12
echo "== bench"; ./anyccl bench --backend cuda --world 1 --sizes 4KiB,1MiB,64MiB --iters 20 2>&1 | tail -14; echo "rc=$?"
echo "== torchrun per-rank"; PATH=/opt/torch/.venv/bin:$PATH; torchrun --nproc-per-node 1 --master-port 29571 --no-python ./anyccl bench --backend cuda --per-rank --sizes 1MiB --iters 10 2>&1 | tail -6; echo "rc=$?"
torchrun --nproc-per-node 1 --master-port 29572 --no-python ./anyccl-cuda-ipc-check --kind nccl 2>&1 | tail -3
echo "== kernels_gpu"; ./kernels_gpu --ignored --test-threads=1 2>&1 | grep -E "^test |test result|panicked" | tail -10
echo "total $(( $(date +%s) - T0 )) s"
