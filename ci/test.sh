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
ci_summary() {
    local rc=$?
    step_end
    cpu_used
    printf '\n== time per step (wall, CPU = user + sys of the step\x27s processes)\n%s' "$ci_table"
    printf '%6d s %8s s  total (exit %d)\n' "$((SECONDS - ci_t0))" "$ci_cpu" "$rc"
    rm -f "$ci_times"
}
trap ci_summary EXIT

step "toolchain"
command -v cargo >/dev/null || { echo "error: cargo not found; install a Rust toolchain (rustup)"; exit 1; }
for comp in rustfmt clippy; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
        rustup component add "$comp"
    fi
done
cargo --version
rustc --version

step "CUDA compiler for the kernels (PyPI nvcc, cached)"
ANYCCL_CUDA_TOOLKIT="$(ci/install-cuda.sh)"
export ANYCCL_CUDA_TOOLKIT
step "HIP compiler and runtime for the HIP kernels (Debian's hipcc)"
ci/install-hip.sh

# The kernel crates' tests fail rather than skip when the kernels, cuobjdump or llvm-objdump are missing.
export ANYCCL_REQUIRE_KERNELS=1

step "format"
cargo fmt --all -- --check

step "lint (all targets, all features)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "every crate with its default features, in the workspace (as users and crates.io build them)"
cargo check --workspace --locked

step "the declared MSRV (workspace rust-version, 1.88): every crate and target with all features"
msrv="$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
[ -n "$msrv" ] || { echo "error: no rust-version in Cargo.toml"; exit 1; }
rustup toolchain install "$msrv" --profile minimal >/dev/null
CARGO_TARGET_DIR=target/msrv cargo "+$msrv" check --workspace --all-targets --all-features --locked

step "beside candle: a crate choosing cudarc's linking and version as candle does checks with anyccl's cuda + cudarc"
# ci/neighbour-candle depends on cudarc 0.19 with candle's features (dynamic-linking, cuda-version-from-build-system,
# nccl, driver) and on anyccl (cuda, cudarc): cudarc's build script panicked when anyccl chose dynamic-loading too.
# Its lock is the workspace's (every version as tested above; cargo only adds the neighbour's own entry, and a
# committed copy would go stale with each dependency change here). cudarc 0.19.10 knows CUDA up to 13.4 and
# panics on the CI nvcc (13.5), so CUDARC_CUDA_VERSION (which its build script reads before asking nvcc) stands in
# for the version the build system would report. No kernels: only cudarc's features are under test.
cp Cargo.lock ci/neighbour-candle/Cargo.lock
env -u ANYCCL_CUDA_TOOLKIT CUDARC_CUDA_VERSION=13000 cargo check --manifest-path ci/neighbour-candle/Cargo.toml

step "build without the host backend (the library and the command)"
cargo clippy --locked --no-default-features -p anyccl -p anyccl-cli -- -D warnings

step "the anyccl library has no command-line dependencies (they live in the anyccl-cli crate)"
cli_deps="$(cargo tree --locked -p anyccl --all-features -e normal --prefix none |
    awk '$1 ~ /^(clap|plotters|indicatif|tracing-subscriber)$/ {print $1}' | sort -u)"
[ -z "$cli_deps" ] || { echo "error: the anyccl library depends on: $(echo $cli_deps)"; exit 1; }

step "tests (all features)"
cargo test --workspace --all-features --locked

step "examples/torchrun.rs at world 2 under a torchrun stand-in (holds MASTER_PORT; the host backend across processes)"
cargo build --locked -p anyccl --example torchrun
# Each rank contributes rank + 1: the sum at world 2 is 3.
python3 ci/torchrun_stand_in.py 2 "RESULT rank {rank} of {world}: 3" "${CARGO_TARGET_DIR:-target}/debug/examples/torchrun"

step "real NCCL from the PyPI wheels (cached in \${ANYCCL_CACHE_DIR:-\$HOME/.cache/anyccl})"
command -v nm >/dev/null || { echo "error: nm (binutils) is needed by the real-NCCL test"; exit 1; }
ANYCCL_TEST_REAL_NCCL="$(ci/install-nccl.sh)"
export ANYCCL_TEST_REAL_NCCL
cargo test --locked -p anyccl-ccl --test real_nccl -- --ignored

step "the drop-in libnccl compiled against the real nccl.h 2.28.9, over the real NCCL 2.28.9, 2.26.5 and 2.32.3"
ANYCCL_TEST_NCCL_SDK="$(dropin/ci/install-nccl-sdk.sh)"
export ANYCCL_TEST_NCCL_SDK
cargo test --locked -p anyccl-nccl --test real_nccl -- --ignored
NCCL_LIB="${ANYCCL_TEST_REAL_NCCL##*=}"
ANYCCL_NCCL_PATH="$NCCL_LIB" cargo run --release --locked -- probe

step "real HIP runtime from Debian's libamdhip64-5 (loads with no AMD GPU and says why it is off)"
HIP_LIB="$(ldconfig -p | awk '/libamdhip64\.so\.5 /{print $NF; exit}')"
[ -n "$HIP_LIB" ] || { echo "error: libamdhip64.so.5 not found (ci/install-hip.sh installs it)"; exit 1; }
ANYCCL_TEST_REAL_HIP="$HIP_LIB" cargo test --locked -p anyccl-rocm --test fake -- --ignored
cargo run --release --locked --features rocm -- probe

step "the Python package: wheel, fresh venv, pytest, type stubs (ci/python.sh)"
ci/python.sh

step "README commands: probe and bench (release)"
cargo run --release --locked -- probe
cargo run --release --locked -- probe --json >/dev/null
cargo run --release --locked -- bench --world 2 --sizes 4KiB,1MiB --iters 5 --warmup 1
