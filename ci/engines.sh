#!/usr/bin/env bash
# The signature tests against the installed engines (python/tests, pytest -m "vllm or sglang or torch"): vLLM's and
# SGLang's plugin loaders find anyccl, their all-reduce slots resolve to anyccl's classes, the classes have the
# engines' signatures, and the vLLM-shaped classes run on 2 CPU processes over gloo. CPU only; no GPU needed.
#
# The environment: torch 2.15.0 from PyPI (the CUDA build with its nvidia-* wheels; it imports and runs on CPU;
# PyTorch's CPU-only index is not used), vLLM 0.33.0 and SGLang 0.5.23 without their declared dependencies (which
# would pull torch 2.14 and about 4.9 GB of wheels more), and the pure-Python packages their distributed and plugin
# modules import. Every package is pinned below and installed with --no-deps, so the environment is exactly this list.
# vLLM and SGLang declare torch 2.14.0 / 2.14.1; the modules under test import and run against 2.15.0.
# 3.4 GB of wheels, 6.6 GB unpacked, about 2 min 15 s to download and install on the development VM; cached per pin set in
# ${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}/engines-venv-<hash of the pins and the Python version> (one kept).
#
#   ci/engines.sh --prepare DIR     # make (or reuse from the cache) the environment; DIR becomes a link to it
#   ci/engines.sh DIR WHEEL         # install the anyccl wheel into it (--no-deps --force-reinstall), run the tests
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
# Removed on exit (globals: the EXIT trap runs after the functions have returned).
tmp=""
work=""
trap 'rm -rf ${tmp:+"$tmp"} ${work:+"$work"}' EXIT
trap 'exit 1' INT TERM

# The tests that must run (4 vllm, 3 sglang, 2 torch); fewer, or any skipped, fails.
EXPECTED_TESTS=9

# Found by trial: torch, numpy and pytest (as ci/python.sh pins them), the engines, then what importing
# vllm.distributed.device_communicators.{pynccl,custom_all_reduce}, vllm.plugins,
# sglang.srt.distributed.device_communicators.custom_all_reduce and sglang.srt.plugins asks for, and `pip freeze`.
PINS='
torch==2.15.0
vllm==0.33.0
sglang==0.5.23
numpy==2.2.6
pytest==8.3.5
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-types==0.8.0
anyio==4.16.0
asttokens==3.0.2
attrs==26.1.0
blake3==1.0.11
cachetools==8.0.2
certifi==2026.10.19.post1
charset-normalizer==3.5.3
cloudpickle==3.1.3
cuda-bindings==13.5.0
cuda-pathfinder==1.9.1
cuda-toolkit==13.2.2
executing==2.3.0
filelock==4.3.2
frozenlist==1.8.0
fsspec==2026.9.0
idna==3.20
iniconfig==2.3.1
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
Jinja2==3.1.6
MarkupSafe==3.0.4
matplotlib-inline==0.2.2
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
nvidia-cublas==13.4.1.3
nvidia-cuda-cccl==13.3.5.0.6
nvidia-cuda-cupti==13.2.86
nvidia-cuda-nvrtc==13.2.86
nvidia-cuda-runtime==13.2.86
nvidia-cudnn-cu13==9.26.0.51
nvidia-cufft==12.2.0.57
nvidia-cufile==1.17.1.22
nvidia-cusolver==12.2.0.11
nvidia-cusparse==12.7.10.12
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.30.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.7.2
nvidia-nvtx==13.2.86
orjson==3.13.0
packaging==26.4
parso==0.8.7
pexpect==4.9.0
pillow==13.0.0
pluggy==1.7.0
prompt_toolkit==3.0.53
propcache==0.5.4
psutil==7.2.2
ptyprocess==0.7.0
pure_eval==0.2.4
py-cpuinfo==9.0.0
pybase64==1.5.1
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
PyYAML==6.0.4
pyzmq==27.3.0
regex==2026.12.2
requests==2.34.2
stack-data==0.6.3
starlette==1.10.0
sympy==1.14.0
tqdm==4.70.1
traitlets==5.16.1
triton==3.9.0
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
wcwidth==0.9.4
yarl==1.25.1
'
# The modules the tests import from the engines: imported once after the install, so a missing dependency fails
# the preparation with its name rather than a test.
PROBE='
import importlib
for m in ("vllm.distributed.device_communicators.pynccl", "vllm.distributed.device_communicators.custom_all_reduce",
          "vllm.plugins", "sglang.srt.distributed.device_communicators.custom_all_reduce", "sglang.srt.plugins"):
    importlib.import_module(m)
'

prepare() { # dir
    local link="$1" cache key venv
    cache="${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}"
    mkdir -p "$cache"
    cache="$(cd "$cache" && pwd)"
    key="$( (python3 --version; printf '%s' "$PINS") | sha256sum | cut -c1-16)"
    venv="$cache/engines-venv-$key"
    if [ -f "$venv/.anyccl-complete" ]; then
        echo "engines: reusing $venv" >&2
    else
        # Built under a temporary name and renamed when complete (everything here runs it as `python -m`, which
        # works from the new path): an interrupted install leaves nothing that looks finished.
        tmp="$venv.tmp.$$"
        rm -rf "$tmp"
        python3 -m venv "$tmp"
        "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps \
            -r <(printf '%s\n' "$PINS" | sed '/^$/d')
        (cd "$tmp" && "$tmp/bin/python" -W ignore -c "$PROBE") 2>/dev/null \
            || { (cd "$tmp" && "$tmp/bin/python" -c "$PROBE") >&2; echo "engines: an engine module does not import" >&2; exit 1; }
        touch "$tmp/.anyccl-complete"
        rm -rf "$venv"
        mv "$tmp" "$venv"
        tmp=""
        echo "engines: made $venv ($(du -sh "$venv" | cut -f1))" >&2
    fi
    # One environment kept: those of other pin sets go.
    for old in "$cache"/engines-venv-*; do
        case "$old" in
        "$venv") ;;
        # Another run's unfinished install stays while that run lives.
        *.tmp.*) kill -0 "${old##*.tmp.}" 2>/dev/null || rm -rf "$old" ;;
        *) rm -rf "$old" ;;
        esac
    done
    if [ -L "$link" ]; then
        rm "$link"
    elif [ -e "$link" ]; then
        echo "engines: $link exists and is not a link" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$link")"
    ln -s "$venv" "$link"
}

run_tests() { # dir wheel
    local venv wheel
    venv="$(cd "$1" && pwd -P)"
    wheel="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
    [ -f "$venv/.anyccl-complete" ] || { echo "engines: $1 was not made by ci/engines.sh --prepare" >&2; exit 1; }
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --force-reinstall "$wheel"
    work="$(mktemp -d)"
    # From python/ so pytest reads python/pyproject.toml (the markers); `anyccl` is the installed wheel.
    (cd "$root/python" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs -m "vllm or sglang or torch" \
        --junitxml="$work/junit.xml" tests)
    "$venv/bin/python" - "$work/junit.xml" "$EXPECTED_TESTS" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
failed = int(suite.get("failures")) + int(suite.get("errors"))
expected = int(sys.argv[2])
print(f"engines: {tests} tests, {skipped} skipped, {failed} failed (expected {expected}, none skipped)")
if tests < expected or skipped or failed:
    sys.exit(1)
PY
}

case "${1:-}" in
--prepare)
    [ -n "${2:-}" ] || { echo "usage: ci/engines.sh --prepare DIR" >&2; exit 2; }
    prepare "$2"
    ;;
"" | -*)
    echo "usage: ci/engines.sh --prepare DIR | ci/engines.sh DIR WHEEL" >&2
    exit 2
    ;;
*)
    [ -n "${2:-}" ] || { echo "usage: ci/engines.sh DIR WHEEL" >&2; exit 2; }
    run_tests "$1" "$2"
    ;;
esac
