#!/usr/bin/env bash
# Installs a CUDA compiler from PyPI (nvcc, its headers, NVVM, cuobjdump and nvdisasm, pinned) into a cache that
# survives between CI runs on the same machine, and prints the toolkit directory (for ANYCCL_CUDA_TOOLKIT). The
# kernels are compiled to machine code (cubins) for sm_80/sm_90/sm_100; no GPU or driver is needed to build.
set -euo pipefail
cache="${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}"
version=13.5.37
dest="$cache/cuda-$version"
if [ ! -x "$dest/nvidia/cu13/bin/nvcc" ] || [ ! -x "$dest/nvidia/cu13/bin/nvdisasm" ]; then
    echo "installing nvcc $version from PyPI into $dest" >&2
    rm -rf "$dest.part"
    python3 -m pip install -q --no-deps --only-binary=:all: --target "$dest.part" \
        "nvidia-cuda-nvcc==$version" "nvidia-cuda-cccl==13.3.5.0.6" "nvidia-nvvm==$version" \
        "nvidia-cuda-runtime==$version" "nvidia-cuda-crt==$version" "nvidia-cuda-cuobjdump==$version" \
        "nvidia-cuda-nvdisasm==$version" >&2
    rm -rf "$dest"
    mv "$dest.part" "$dest"
fi
"$dest/nvidia/cu13/bin/nvcc" --version >&2
echo "$dest/nvidia/cu13"
