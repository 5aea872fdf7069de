#!/bin/bash
# The single-GPU regression run after a change to the CUDA communicator: the GPU tests (2-GPU ones skipped), the
# cudarc tests, the eager host-time check against raw NCCL, the bench, --per-rank and the IPC check under the real
# torchrun, and the kernel tests. Binaries are built elsewhere (the GPU machine has no Rust) and passed in BINDIR:
# gpu, cudarc_gpu (anyccl-cuda test binaries), kernels_gpu (an anyccl-lab test binary), anyccl,
# anyccl-cuda-ipc-check (anyccl-lab). When BINDIR also holds them, the kernel tests (fused_gpu, push_gpu,
# quant_gpu of anyccl-lab: release builds, since their host checks at 64 MiB are slow in debug) and benches
# (anyccl-cuda-{fused,push,quant}-bench) run too. Prints each step's
# summary; exits 1 if any step failed. Multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BIN="${1:-.devbin}"
cd "$BIN" || { echo "usage: $0 BINDIR"; exit 2; }
T0=$(date +%s)
failed=()
step() { # NAME FILTER COMMAND...
    local name="$1" filter="$2"; shift 2
    echo "== $name"
    "$@" > "/tmp/gpu_regression_$name.log" 2>&1
    local rc=$?
    grep -E "$filter" "/tmp/gpu_regression_$name.log" | tail -30
    [ $rc -eq 0 ] || { echo "FAILED: $name (exit $rc; log /tmp/gpu_regression_$name.log)"; failed+=("$name"); }
}
TESTS="^test |test result|panicked|assert"
step gpu "$TESTS" env ANYCCL_IPC_CHECK="$PWD/anyccl-cuda-ipc-check" ANYCCL_TEST_COMM_ITERS=20 ./gpu --ignored \
    --test-threads=1 --skip graph_buffers_single_process --skip a_rank_that_dies \
    --skip a_refused_wait_during_capture_leaves --skip on_a_communicator_of_two_gpus
step cudarc_gpu "$TESTS" ./cudarc_gpu --ignored --test-threads=1 --skip a_cudarc_slice_or_stream_of_another_device
step eager "." ./anyccl bench --backend cuda --eager --world 1 --iters 1000 --sizes 512KiB,16MiB
step bench "." ./anyccl bench --backend cuda --world 1 --sizes 4KiB,1MiB,64MiB --iters 20
command -v torchrun >/dev/null || PATH=/opt/torch/.venv/bin:$PATH
step per_rank "." torchrun --nproc-per-node 1 --master-port 29571 --no-python ./anyccl bench --backend cuda \
    --per-rank --sizes 1MiB --iters 10
step ipc_check "." torchrun --nproc-per-node 1 --master-port 29572 --no-python ./anyccl-cuda-ipc-check --kind nccl
step kernels_gpu "$TESTS" ./kernels_gpu --ignored --test-threads=1
for t in fused_gpu push_gpu quant_gpu; do
    # The 2-GPU communicator test of the fused call needs two GPUs.
    [ -x "./$t" ] && step "$t" "$TESTS" ./"$t" --ignored --test-threads=1 --skip communicator_
done
for b in fused push quant; do
    [ -x "./anyccl-cuda-$b-bench" ] && step "${b}_bench" "." ./"anyccl-cuda-$b-bench"
done
echo "total $(( $(date +%s) - T0 )) s"
if [ ${#failed[@]} -gt 0 ]; then echo "RESULT: FAILED: ${failed[*]}"; exit 1; fi
echo "RESULT: all steps passed"
