#!/usr/bin/env bash
# The README's test command. Installs what the tests need, then checks formatting, lints, the test suite, and
# the two README commands (probe and a short bench) in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain"
command -v cargo >/dev/null || { echo "error: cargo not found; install a Rust toolchain (rustup)"; exit 1; }
for comp in rustfmt clippy; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
        rustup component add "$comp"
    fi
done
cargo --version
rustc --version

step "format"
cargo fmt --all -- --check

step "lint (all targets, all features)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "build without the host backend"
cargo clippy --locked --no-default-features -- -D warnings

step "tests (all features)"
cargo test --workspace --all-features --locked

step "README commands: probe and bench (release)"
cargo run --release --locked -- probe
cargo run --release --locked -- probe --json >/dev/null
cargo run --release --locked -- bench --world 2 --sizes 4KiB,1MiB --iters 5 --warmup 1
