#!/usr/bin/env bash
# The README's test command. Installs what the tests need, then checks formatting, lints, the test suite, and
# the two README commands (probe and a short bench) in release mode. `cargo run` at the root runs the `anyccl`
# command (the workspace's default member, cli/), so `--features rocm` there is the command's feature.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step prints its wall time and the CPU time (user + sys) of the processes it ran; the end (or a failure)
# prints the table of all steps. CPU time is the figure to compare between runs on a shared machine.
ci_times="$(mktemp)"
ci_t0=$SECONDS
ci_table=""
step_name=""
# Sets ci_cpu to the CPU seconds used so far by this script's finished child processes (`times`, second line).
# `times` runs in this shell (not in a command substitution, whose children it would not see).
cpu_used() {
    times >"$ci_times"
    ci_cpu="$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); n += a[1] * 60 + a[2] }; printf "%.1f", n }' "$ci_times")"
}
step_end() {
    [ -n "$step_name" ] || return 0
    cpu_used
    local wall=$((SECONDS - step_t0)) cpu
    cpu="$(awk -v a="$ci_cpu" -v b="$step_cpu0" 'BEGIN { printf "%.1f", a - b }')"
    printf '<== %s: %d s wall, %s s CPU\n' "$step_name" "$wall" "$cpu"
    ci_table+="$(printf '%6d s %8s s  %s' "$wall" "$cpu" "$step_name")"$'\n'
    step_name=""
}
step() {
    step_end
    step_name="$*"
    step_t0=$SECONDS
    cpu_used
    step_cpu0="$ci_cpu"
    printf '\n==> %s\n' "$*"
}
ci_summary() { # [exit status]
    local rc="${1:-$?}"
    step_end
    cpu_used
    printf '\n== time per step (wall, CPU = user + sys of the step\x27s processes)\n%s' "$ci_table"
    printf '%6d s %8s s  total (exit %d)\n' "$((SECONDS - ci_t0))" "$ci_cpu" "$rc"
    rm -f "$ci_times"
}
trap ci_summary EXIT

# CI-only build settings (the manifests' profiles stay as users get them): no incremental compilation (each crate
# is compiled once per run, so its bookkeeping is pure cost), and line tables instead of full debug information
# in the debug/test builds (backtraces keep file and line; about a third less to generate and link).
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only

# Downloads and installs that no early step needs run in the background while the first steps compile; each is
# waited for (and its log shown if it failed) where it is first needed.
mkdir -p target/ci-logs
bg_pids=()
background() { # name command...
    local name="$1"
    shift
    "$@" >"target/ci-logs/$name.out" 2>"target/ci-logs/$name.log" &
    eval "bg_$name=$!"
    bg_pids+=("$!")
}
wait_for() { # name
    local pid_var="bg_$1"
    if ! wait "${!pid_var}"; then
        echo "error: $1 failed:"
        cat "target/ci-logs/$1.log"
        exit 1
    fi
    cat "target/ci-logs/$1.log" >&2
}
trap 'ci_rc=$?; for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null || true; done; ci_summary "$ci_rc"' EXIT

step "toolchain"
command -v cargo >/dev/null || { echo "error: cargo not found; install a Rust toolchain (rustup)"; exit 1; }
for comp in rustfmt clippy; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
        rustup component add "$comp"
    fi
done
cargo --version
rustc --version
msrv="$(sed -n '/^rust-version = "\(.*\)"/{s//\1/p;q}' Cargo.toml)"
[ -n "$msrv" ] || { echo "error: no rust-version in Cargo.toml"; exit 1; }

step "downloads in the background: HIP compiler and runtime (Debian), NCCL wheels, nightly (docs.rs), Python tools, torch + vLLM + SGLang (cached)"
background hip ci/install-hip.sh
background nccl ci/install-nccl.sh
background nccl_sdk dropin/ci/install-nccl-sdk.sh
background nightly bash -c 'cargo +nightly --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal'
background python_venv ci/python.sh --prepare target/ci-python-venv
# torch 2.15.0, vLLM 0.33.0, SGLang 0.5.23 (about 6.5 GB, cached in ${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}).
background engines_venv ci/engines.sh --prepare target/ci-engines-venv
rustup toolchain install "$msrv" --profile minimal >/dev/null

step "CUDA compiler for the kernels (PyPI nvcc, cached)"
ANYCCL_CUDA_TOOLKIT="$(ci/install-cuda.sh)"
export ANYCCL_CUDA_TOOLKIT

# The kernel crates' tests fail rather than skip when the kernels, cuobjdump or llvm-objdump are missing.
export ANYCCL_REQUIRE_KERNELS=1

step "format"
cargo fmt --all -- --check

step "the declared MSRV (workspace rust-version): every crate and target with all features"
# Type-checks the Rust of every target on the oldest supported compiler. The kernel compilers are kept out
# (NVCC/HIPCC name nothing): the kernel crates then embed empty tables of the same types, and this step needs
# neither hipcc (still installing) nor the minutes of device code compilation that the debug build does anyway.
CARGO_TARGET_DIR=target/msrv NVCC=/nonexistent/nvcc HIPCC=/nonexistent/hipcc \
    cargo "+$msrv" check --workspace --all-targets --all-features --locked

step "HIP compiler and runtime for the HIP kernels (Debian's hipcc; installed in the background)"
wait_for hip
# The kernel build scripts run once per profile (debug, release, the wheel): the same sources, the same flags.
# ci/kernel-cache compiles each once (ci/kernel-cache/compile says how it keys: compiler version, flags, sources
# and headers), in the download cache, so a run whose kernels did not change compiles none (about 4 minutes of CPU
# on 2 cores when they did). Entries unused for two weeks are removed.
export ANYCCL_CI_NVCC="$ANYCCL_CUDA_TOOLKIT/bin/nvcc"
ANYCCL_CI_HIPCC="$(command -v hipcc)"
export ANYCCL_CI_HIPCC
export ANYCCL_CI_KERNEL_CACHE="${ANYCCL_CACHE_DIR:-$HOME/.cache/anyccl}/kernel-cache"
mkdir -p "$ANYCCL_CI_KERNEL_CACHE"
find "$ANYCCL_CI_KERNEL_CACHE" -type f -mtime +14 -delete
export NVCC="$PWD/ci/kernel-cache/nvcc" HIPCC="$PWD/ci/kernel-cache/hipcc"

step "lint (all targets, all features)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "every crate with its default features, in the workspace (as users and crates.io build them)"
cargo check --workspace --locked

step "the facade alone with cuda (cudarc's fallbacks; no final binary choosing its linking or CUDA version)"
cargo check --locked -p anyccl --features cuda

step "beside candle: a crate choosing cudarc's linking and version as candle does checks with anyccl's cuda + cudarc"
# ci/neighbour-candle depends on cudarc 0.19 with candle's features (dynamic-linking, cuda-version-from-build-system,
# nccl, driver) and on anyccl (cuda, cudarc): cudarc's build script panicked when anyccl chose dynamic-loading too.
# Its lock is the workspace's (every version as tested above; cargo only adds the neighbour's own entry, and a
# committed copy would go stale with each dependency change here). cudarc 0.19.10 knows CUDA up to 13.4 and
# panics on the CI nvcc (13.5), so CUDARC_CUDA_VERSION (which its build script reads before asking nvcc) stands in
# for the version the build system would report. No kernels: only cudarc's features are under test.
cp Cargo.lock ci/neighbour-candle/Cargo.lock
env -u ANYCCL_CUDA_TOOLKIT -u NVCC -u HIPCC CUDARC_CUDA_VERSION=13000 \
    cargo check --manifest-path ci/neighbour-candle/Cargo.toml

step "build without the host backend (the library and the command)"
cargo clippy --locked --no-default-features -p anyccl -p anyccl-cli -- -D warnings

step "the anyccl library has no command-line dependencies (they live in the anyccl-cli crate) and no duplicates"
cli_deps="$(cargo tree --locked -p anyccl --all-features -e normal --prefix none |
    awk '$1 ~ /^(clap|plotters|indicatif|tracing-subscriber)$/ {print $1}' | sort -u)"
[ -z "$cli_deps" ] || { echo "error: the anyccl library depends on: $(echo $cli_deps)"; exit 1; }
# One version of each crate (one syn among them) in the library's build, host-only and with every backend.
for features in host cuda,rocm; do
    dups="$(cargo tree --locked -p anyccl --no-default-features --features "$features" -e normal,build -d 2>/dev/null |
        awk '/^[a-z]/ {print $1, $2}' | sort -u)"
    [ -z "$dups" ] || { echo "error: the anyccl library ($features) builds two versions of:"; echo "$dups"; exit 1; }
done

step "what each published crate would ship (ci/check-packages.sh)"
ci/check-packages.sh

step "tests (all features)"
cargo test --workspace --all-features --locked

step "examples/torchrun.rs at world 2 under a torchrun stand-in (holds MASTER_PORT; the host backend across processes)"
# Built by the test step (cargo test builds the examples) with the same features: this finds it up to date.
cargo build --locked --workspace --all-features --example torchrun
# Each rank contributes rank + 1: the sum at world 2 is 3.
python3 ci/torchrun_stand_in.py 2 "RESULT rank {rank} of {world}: 3" "${CARGO_TARGET_DIR:-target}/debug/examples/torchrun"

step "real NCCL from the PyPI wheels (cached in \${ANYCCL_CACHE_DIR:-\$HOME/.cache/anyccl}); the drop-in libnccl compiled against the real nccl.h 2.32.3, over the real NCCL 2.26.5 and 2.32.3, linked like libnccl.so.2 and built for glibc 2.28"
command -v nm >/dev/null || { echo "error: nm (binutils) is needed by the real-NCCL test"; exit 1; }
wait_for nccl
wait_for nccl_sdk
ANYCCL_TEST_REAL_NCCL="$(cat target/ci-logs/nccl.out)"
ANYCCL_TEST_NCCL_SDK="$(cat target/ci-logs/nccl_sdk.out)"
# The drop-in linked against glibc 2.28 (zig's stubs), for the floor check of its real_nccl test.
ANYCCL_TEST_DROPIN_GLIBC_2_28="$(dropin/ci/build-glibc-2.28.sh)"
export ANYCCL_TEST_REAL_NCCL ANYCCL_TEST_NCCL_SDK ANYCCL_TEST_DROPIN_GLIBC_2_28
# Both real_nccl test targets (anyccl-ccl's loader, anyccl-nccl's drop-in), built with the test step's features,
# so nothing is compiled again.
cargo test --workspace --all-features --locked --test real_nccl -- --ignored
NCCL_LIB="${ANYCCL_TEST_REAL_NCCL##*=}"
ANYCCL_NCCL_PATH="$NCCL_LIB" cargo run --release --locked -- probe

step "real HIP runtime from Debian's libamdhip64-5 (loads with no AMD GPU and says why it is off)"
# awk reads all of ldconfig's output (no early `exit`): under pipefail, a reader that quits first kills the writer
# with SIGPIPE and fails the step (exit 141).
HIP_LIB="$(ldconfig -p | awk '/libamdhip64\.so\.5 / && !found { print $NF; found = 1 }')"
[ -n "$HIP_LIB" ] || { echo "error: libamdhip64.so.5 not found (ci/install-hip.sh installs it)"; exit 1; }
# anyccl-rocm's `fake` target as the test step built it (the filter leaves out the other crates' `fake` targets).
real_hip_test=the_real_hip_runtime_loads_and_says_why_there_is_no_device
ANYCCL_TEST_REAL_HIP="$HIP_LIB" cargo test --workspace --all-features --locked --test fake -- --ignored --exact \
    "$real_hip_test" | tee target/ci-logs/real_hip.txt
grep -q "^test $real_hip_test \.\.\. ok$" target/ci-logs/real_hip.txt || { echo "error: $real_hip_test did not run"; exit 1; }
# The command as the test step built it (every feature, rocm among them): probe needs no optimised build.
"${CARGO_TARGET_DIR:-target}/debug/anyccl" probe

step "the Python package: wheel, fresh venv, pytest, type stubs (ci/python.sh)"
wait_for python_venv
ANYCCL_PY_VENV=target/ci-python-venv ci/python.sh

step "the engines' plugin loaders and signatures: the wheel in torch 2.15.0 + vLLM 0.33.0 + SGLang 0.5.23, CPU (ci/engines.sh)"
# pytest -m "vllm or sglang or torch" against the installed engines; fails if fewer than all 9 run or any skips.
wait_for engines_venv
ci/engines.sh target/ci-engines-venv "${CARGO_TARGET_DIR:-target}"/wheels-python/anyccl-*.whl

step "README commands: probe and bench (release)"
cargo run --release --locked -- probe
cargo run --release --locked -- probe --json >/dev/null
cargo run --release --locked -- bench --world 2 --sizes 4KiB,1MiB --iters 5 --warmup 1

step "docs.rs: each published crate's documentation as docs.rs builds it, feature marks shown (ci/docs-rs.sh)"
wait_for nightly
ci/docs-rs.sh
