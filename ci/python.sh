#!/usr/bin/env bash
# The Python package (python/): builds the sdist (python/tools/sdist.py) and from it the abi3 manylinux_2_28 wheel with
# maturin and zig from PyPI, checks the tag with auditwheel, installs the wheel into a fresh virtual environment with
# NumPy, pytest and mypy (not torch, vLLM or SGLang: ci/engines.sh tests the wheel against those), then runs
#   - `import anyccl` (without NumPy or torch imported),
#   - pytest python/tests: the host backend across 2 and 3 processes (NumPy; a unique id, the torchrun environment
#     under ci/torchrun_stand_in.py, a Python bootstrap object) and as threads of one process (the GIL released),
#     the error paths, the all-reduce options (named algorithms, deterministic mode) and DLPack input (arrays
#     reachable through __dlpack__ only, hand-made malformed capsules), the fused all-reduce + RMSNorm against NumPy,
#     the READMEs' Python snippets (2 processes), the metadata, the vLLM and SGLang plugins' entry points and their
#     no-engine paths, grouped host send/receive and plain buffer-protocol objects read and written in place;
#     the GPU, vLLM, SGLang and torch tests (-m gpu, -m vllm, -m sglang, -m torch) stay deselected here (ci/test.sh
#     runs the last three through ci/engines.sh),
#   - the type stubs: mypy.stubtest on the extension module, mypy --strict on every module of the package (the
#     vLLM, SGLang and torch modules too: torch is not installed here, so its names are Any; with torch installed,
#     `mypy --strict --python-executable <its python> -p anyccl` checks them against torch's own types, in about 50 s
#     of CPU) and two examples.
# Needs python3 with venv (or virtualenv) and pip, a Rust toolchain, and PyPI. About 9 minutes on 2 loaded cores (6 min 20 s
# of it the release build; the sdist adds about 15 s, as the wheel is built from it rather than from the tree).
#
#   ci/python.sh                   # from the repository root (ci/test.sh calls it)
#   ANYCCL_PY_WHEEL_DIR=dir ci/python.sh   # where the wheel goes (default target/wheels-python)
#   ci/python.sh --prepare dir     # only make the virtual environment with the pinned tools, in dir
#   ANYCCL_PY_VENV=dir ci/python.sh        # use that environment (ci/test.sh prepares it while it compiles)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

# 1.16.0: 1.9.6 cannot write this workspace's sdist (the root's README.md and python/README.md collide).
MATURIN=1.16.0
# The wheel links against glibc 2.28 through zig (the host's glibc would tag it with its own, e.g. 2_34).
ZIGLANG=0.13.0.post1
AUDITWHEEL=6.8.2
NUMPY=2.2.6
PYTEST=8.3.5
MYPY=1.15.0

# A fresh virtual environment with the pinned tools, in $1.
make_venv() {
    local venv="$1"
    rm -rf "$venv"
    if ! python3 -m venv "$venv" 2>/dev/null; then
        # Debian/Ubuntu without python3-venv: virtualenv from PyPI instead.
        python3 -m pip install --quiet --user "virtualenv==20.29.3"
        python3 -m virtualenv --quiet "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "maturin==$MATURIN" "numpy==$NUMPY" "pytest==$PYTEST" "mypy==$MYPY" \
        "ziglang==$ZIGLANG" "auditwheel==$AUDITWHEEL"
}
if [ "${1:-}" = --prepare ]; then
    [ -n "${2:-}" ] || { echo "usage: ci/python.sh --prepare DIR" >&2; exit 2; }
    make_venv "$2"
    exit 0
fi

python3 --version
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ -n "${ANYCCL_PY_VENV:-}" ]; then
    # Prepared by `ci/python.sh --prepare` with the same pins; the wheel is installed into it below.
    venv="$(cd "$ANYCCL_PY_VENV" && pwd)"
    [ "$("$venv/bin/maturin" --version)" = "maturin $MATURIN" ] || { echo "error: $venv has no maturin $MATURIN"; exit 1; }
else
    venv="$work/venv"
    make_venv "$venv"
fi
py="$venv/bin/python"

echo "== the sdist (python/tools/sdist.py: maturin sdist + the root crate's sources), the wheel built from it"
# One compilation, as before: the wheel is built from the unpacked sdist (so a broken sdist fails here), for
# manylinux_2_28 through zig. Not --locked: cargo prunes the lock file's entries of the crates the sdist leaves out
# (the versions of the others stay as locked).
wheels="${ANYCCL_PY_WHEEL_DIR:-${CARGO_TARGET_DIR:-target}/wheels-python}"
case "$wheels" in /*) ;; *) wheels="$root/$wheels" ;; esac
rm -rf "$wheels"
sdist="$("$py" python/tools/sdist.py "$work/sdist" "$venv/bin/maturin")"
ls -l "$sdist"
tar -xzf "$sdist" -C "$work/sdist"
target="${CARGO_TARGET_DIR:-target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac
CARGO_TARGET_DIR="$target" PATH="$venv/bin:$PATH" "$venv/bin/maturin" build --release --zig \
    --compatibility manylinux_2_28 -m "$work/sdist/$(basename "$sdist" .tar.gz)/python/Cargo.toml" -o "$wheels"
cp "$sdist" "$wheels/"
ls -l "$wheels"

echo "== the wheel's platform tag (auditwheel $AUDITWHEEL): manylinux_2_28"
"$venv/bin/auditwheel" show "$wheels"/*.whl | tee "$work/auditwheel.txt"
tr -s ' \n' ' ' < "$work/auditwheel.txt" | grep "platform tag: \"manylinux_2_28_$(uname -m)\"" >/dev/null \
    || { echo "python: the wheel is not manylinux_2_28" >&2; exit 1; }
"$py" -m pip install --quiet --no-index "$wheels"/anyccl-*.whl

echo "== import without NumPy or torch"
(cd "$work" && "$py" -c 'import sys, anyccl; assert "numpy" not in sys.modules and "torch" not in sys.modules; print("anyccl", anyccl.__version__, "backends:", anyccl.backends())')

echo "== pytest (host backend; -m gpu, vllm, sglang and torch deselected)"
# Run from python/ so pytest reads python/pyproject.toml (markers, the gpu and vllm deselection); `anyccl` is the
# installed wheel (python/tests/conftest.py keeps the uncompiled python/anyccl off sys.path, for `python -m pytest`).
(cd python && "$venv/bin/pytest" -q -p no:cacheprovider tests)

echo "== type stubs"
(cd "$work" && "$py" -m mypy.stubtest anyccl._anyccl)
(cd "$work" && "$py" -m mypy --strict --no-incremental -p anyccl)
(cd "$work" && "$py" -m mypy --strict --no-incremental "$root/examples/python/host_numpy.py" \
    "$root/examples/python/torchrun_allreduce.py")
echo "python: ok"
