#!/usr/bin/env bash
# Host time per call of the drop-in over the real NCCL, without a GPU (dropin/bench/host_time_cpu.c says what is
# timed and how). Builds the drop-in (release profile unless PROFILE=dev) and the timing program, then runs it.
#
# Usage: dropin/bench/host_time_cpu.sh [REAL_LIBNCCL] [ROUNDS] [BATCH]
#   REAL_LIBNCCL defaults to the NCCL 2.32.3 that ci/install-nccl.sh caches
#   (${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}/nccl/2.32.3/libnccl.so.2).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
real="${1:-${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}/nccl/2.32.3/libnccl.so.2}"
rounds="${2:-301}"
batch="${3:-2000}"
profile="${PROFILE:-release}"
[ -f "$real" ] || { echo "error: no real NCCL at $real (run ci/install-nccl.sh, or pass its path)" >&2; exit 1; }
cd "$root"
if [ "$profile" = release ]; then
    cargo build --release -p anyccl-nccl
    dir=release
else
    cargo build -p anyccl-nccl
    dir=debug
fi
target="${CARGO_TARGET_DIR:-$root/target}"
out="$target/$dir/host_time_cpu"
cc -O2 -std=gnu11 -o "$out" dropin/bench/host_time_cpu.c -ldl
"$out" "$real" "$target/$dir/libanyccl_nccl.so" "$rounds" "$batch"
