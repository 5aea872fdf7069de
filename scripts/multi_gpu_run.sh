#!/usr/bin/env bash
# The multi-GPU run on a lent machine, in two device calls of at most 10 minutes each.
#
# Build here first (no Rust toolchain on the GPU machines), then carry `.devbin`:
#   cargo build --release --features cuda && cargo build --release -p anyccl-lab
#   cargo test --release -p anyccl-cuda -p anyccl-lab --all-features --no-run
#   mkdir -p .devbin && cp target/release/{anyccl,anyccl-cuda-emulated-bench,anyccl-cuda-ipc-check} .devbin/
#   cp target/release/deps/gpu-<hash> .devbin/gpu && cp target/release/deps/kernels_gpu-<hash> .devbin/kernels_gpu
#   cp scripts/torch_tp_bench.py scripts/multi_gpu_run.sh .devbin/ && strip .devbin/{anyccl*,gpu,kernels_gpu}
# Then on the device (`run` with carry [".devbin"]):
#   bash .devbin/multi_gpu_run.sh tests     # topology, probe, correctness (every GPU test, kill-a-rank)
#   bash .devbin/multi_gpu_run.sh bench     # TP N table with PyTorch's paths, tune, tuned table, host time
# Every command has its own time limit, so a hang costs that limit, not the whole call. Multicast stays off.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")"
phase=${1:-tests}
gpus=$(nvidia-smi -L | wc -l)
out=${OUT:-.}
echo "== $(date -u +%FT%TZ) phase $phase on $gpus GPU(s)"

case "$phase" in
tests)
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
    nvidia-smi topo -m
    python3 - <<'EOF'
import torch
n = torch.cuda.device_count()
bad = [(a, b) for a in range(n) for b in range(n) if a != b and not torch.cuda.can_device_access_peer(a, b)]
print(f"P2P between all {n * (n - 1)} ordered pairs:", "yes" if not bad else f"NO for {bad}")
EOF
    for g in $(seq 0 $((gpus - 1))); do
        echo "-- anyccl probe, GPU $g"
        CUDA_VISIBLE_DEVICES=$g timeout 60 ./anyccl probe 2>&1 | head -60
    done
    echo "-- gpu tests (conformance at every local world, capture, IPC, one process per GPU, graph buffers, kill a rank)"
    skip=()
    if [ "$gpus" -lt 2 ]; then
        # These two need two GPUs and fail with that message on one; say so instead of running them.
        skip=(--skip graph_buffers_single_process --skip a_rank_that_dies)
        echo "one GPU: not running graph_buffers_single_process* and a_rank_that_dies* (they need two GPUs)"
    fi
    ANYCCL_IPC_CHECK=$PWD/anyccl-cuda-ipc-check ANYCCL_TEST_COMM_ITERS=20 timeout 300 ./gpu --ignored --test-threads=1 "${skip[@]}" 2>&1 |
        grep -E "^test |result|panicked|dead peer|graph buffers|conformance over|symmetric windows|wait returned after" | tee "$out/gpu-tests.txt"
    echo "-- custom kernels, emulated ranks on GPU 0"
    timeout 200 ./kernels_gpu --ignored --test-threads=1 2>&1 | grep -E "^test |result|panicked"
    ;;
bench)
    echo "-- anyccl bench --graph --world $gpus (defaults)"
    timeout 120 ./anyccl bench --graph --world "$gpus" --plot "$out/tp$gpus.svg" 2>&1 | tee "$out/tp$gpus-defaults.txt"
    echo "-- PyTorch at TP $gpus (NCCL, symm_mem one-shot / two-shot), same call"
    timeout 150 python3 -m torch.distributed.run --nproc-per-node "$gpus" torch_tp_bench.py 2>&1 |
        grep -v -i "warn\|\*\*\*\|capture_end" | tee "$out/tp$gpus-torch.txt"
    echo "-- anyccl tune --world $gpus"
    timeout 150 ./anyccl tune --world "$gpus" --out "$out/h200x$gpus-tune.toml" 2>&1 | tee "$out/tp$gpus-tune.txt"
    echo "-- the table with the tuned selector"
    ANYCCL_TUNE_FILE="$out/h200x$gpus-tune.toml" timeout 120 ./anyccl bench --graph --world "$gpus" 2>&1 |
        tee "$out/tp$gpus-tuned.txt"
    echo "-- host time per eager call (anyccl vs raw NCCL; torch.distributed is in the PyTorch run above)"
    timeout 50 ./anyccl bench --backend cuda --eager --world "$gpus" --iters 500 --sizes 512KiB,16MiB 2>&1 | tee "$out/tp$gpus-eager.txt"
    ;;
*)
    echo "usage: multi_gpu_run.sh tests|bench" >&2
    exit 2
    ;;
esac
