#!/usr/bin/env bash
# The Python package (python/, issue 19): builds the abi3 wheel with maturin from PyPI, installs it into a fresh
# virtual environment with NumPy, pytest and mypy (not torch: too big for CI), then runs
#   - `import anyccl` (without NumPy or torch imported),
#   - pytest python/tests: the host backend across 2 and 3 processes (NumPy; a unique id, the torchrun environment
#     under ci/torchrun_stand_in.py, a Python bootstrap object) and as threads of one process (the GIL released),
#     the error paths, the all-reduce options (named algorithms, deterministic mode) and DLPack input (arrays
#     reachable through __dlpack__ only, hand-made malformed capsules), the fused all-reduce + RMSNorm against NumPy;
#     the GPU tests (-m gpu) stay deselected here,
#   - the type stubs: mypy.stubtest on the extension module, mypy --strict on the package and two examples.
# Needs python3 with venv (or virtualenv) and pip, a Rust toolchain, and PyPI. About 2-4 minutes on 2 cores.
#
#   ci/python.sh                   # from the repository root (ci/test.sh calls it)
#   ANYCCL_PY_WHEEL_DIR=dir ci/python.sh   # where the wheel goes (default target/wheels-python)
#   ci/python.sh --prepare dir     # only make the virtual environment with the pinned tools, in dir
#   ANYCCL_PY_VENV=dir ci/python.sh        # use that environment (ci/test.sh prepares it while it compiles)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

MATURIN=1.9.6
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
    "$venv/bin/python" -m pip install --quiet "maturin==$MATURIN" "numpy==$NUMPY" "pytest==$PYTEST" "mypy==$MYPY"
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
    "$venv/bin/maturin" --version | grep -qx "maturin $MATURIN" || { echo "error: $venv has no maturin $MATURIN"; exit 1; }
else
    venv="$work/venv"
    make_venv "$venv"
fi
py="$venv/bin/python"

echo "== the wheel (maturin $MATURIN, release, --locked)"
wheels="${ANYCCL_PY_WHEEL_DIR:-${CARGO_TARGET_DIR:-target}/wheels-python}"
rm -rf "$wheels"
"$venv/bin/maturin" build --release --locked -m python/Cargo.toml -o "$wheels"
ls -l "$wheels"
"$py" -m pip install --quiet --no-index --find-links "$wheels" anyccl

echo "== import without NumPy or torch"
(cd "$work" && "$py" -c 'import sys, anyccl; assert "numpy" not in sys.modules and "torch" not in sys.modules; print("anyccl", anyccl.__version__, "backends:", anyccl.backends())')

echo "== pytest (host backend; -m gpu deselected)"
# Run from python/ so pytest reads python/pyproject.toml (markers, the gpu deselection); `anyccl` is the
# installed wheel: the pytest script (unlike `python -m pytest`) does not put the working directory, with the
# uncompiled python/anyccl, on sys.path.
(cd python && "$venv/bin/pytest" -q -p no:cacheprovider tests)

echo "== type stubs"
(cd "$work" && "$py" -m mypy.stubtest anyccl._anyccl)
(cd "$work" && "$py" -m mypy --strict --no-incremental -m anyccl)
(cd "$work" && "$py" -m mypy --strict --no-incremental "$root/examples/python/host_numpy.py" \
    "$root/examples/python/torchrun_allreduce.py")
echo "python: ok"
