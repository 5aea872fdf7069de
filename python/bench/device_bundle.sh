#!/usr/bin/env bash
# Everything the GPU machine (torch preinstalled, no Rust, no internet) needs in one folder, python/dist:
# the anyccl wheel (abi3, CPython >= 3.9, manylinux; CUDA and NCCL loaded at run time) and pure-Python wheels of
# pytest and its dependencies (for Pythons without them). Needs maturin (pip install maturin==1.9.6) and PyPI.
#
#   python/bench/device_bundle.sh            # then carry python/dist to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/../.."
out=python/dist
rm -rf "$out"
maturin="${MATURIN:-maturin}"
"$maturin" build --release --locked -m python/Cargo.toml -o "$out"
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$out" \
    pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2 exceptiongroup==1.2.2 tomli==2.0.1
ls -l "$out"
du -sh "$out"
