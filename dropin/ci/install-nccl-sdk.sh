#!/usr/bin/env bash
# Installs the NCCL "SDK" the drop-in's real-NCCL test compiles and runs against: nccl.h (and the rest of the
# include folder) and libnccl.so.2 of the PyPI wheel nvidia-nccl-cu12 (default 2.32.3, the nccl.h the drop-in
# implements), into a cache that survives between CI runs on the same machine (as ci/install-nccl.sh does), and
# prints the folder, which holds include/nccl.h and lib/libnccl.so.2: the value for ANYCCL_TEST_NCCL_SDK.
# Usage: dropin/ci/install-nccl-sdk.sh [VERSION]
set -euo pipefail
v="${1:-2.32.3}"
cache="${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}"
sdk="$cache/nccl-sdk/$v"
if [ ! -s "$sdk/include/nccl.h" ] || [ ! -s "$sdk/lib/libnccl.so.2" ]; then
    echo "installing the NCCL $v headers and library from the nvidia-nccl-cu12 wheel" >&2
    mkdir -p "$cache/wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: "nvidia-nccl-cu12==$v" -d "$cache/wheels" >&2
    whl=$(set -- "$cache"/wheels/nvidia_nccl_cu12-"$v"-*.whl; echo "$1")
    rm -rf "$sdk.part"
    mkdir -p "$sdk.part"
    python3 - "$whl" "$sdk.part" <<'PY'
import os, shutil, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
prefix = "nvidia/nccl/"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if not name.startswith(prefix) or name.endswith("/"):
            continue
        rel = name[len(prefix):]
        if not (rel.startswith("include/") or rel == "lib/libnccl.so.2"):
            continue
        dest = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(name) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
    rm -f "$whl"
    rm -rf "$sdk"
    mv "$sdk.part" "$sdk"
fi
echo "$sdk"
