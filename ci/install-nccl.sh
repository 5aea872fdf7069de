#!/usr/bin/env bash
# Installs real libnccl.so.2 files from the PyPI wheels nvidia-nccl-cu12 (one release before 2.27, which has no
# symmetric windows, and the newest) into a cache that survives between CI runs on the same machine, and prints
# the value for ANYCCL_TEST_REAL_NCCL: "VERSION=PATH:VERSION=PATH".
# Usage: ci/install-nccl.sh [VERSION ...]
set -euo pipefail
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.26.5 2.32.3)
cache="${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}"
mkdir -p "$cache/wheels"
pairs=()
for v in "${versions[@]}"; do
    lib="$cache/nccl/$v/libnccl.so.2"
    if [ ! -s "$lib" ]; then
        echo "installing NCCL $v from the nvidia-nccl-cu12 wheel" >&2
        python3 -m pip download -q --no-deps --only-binary=:all: "nvidia-nccl-cu12==$v" -d "$cache/wheels" >&2
        whl=$(set -- "$cache"/wheels/nvidia_nccl_cu12-"$v"-*.whl; echo "$1")
        mkdir -p "$cache/nccl/$v"
        python3 - "$whl" "$lib" <<'PY'
import shutil, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    with z.open("nvidia/nccl/lib/libnccl.so.2") as src, open(out + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(out + ".part", out)
PY
        rm -f "$whl"
    fi
    pairs+=("$v=$lib")
done
(IFS=:; echo "${pairs[*]}")
