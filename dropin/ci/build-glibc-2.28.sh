#!/usr/bin/env bash
# Builds the drop-in libnccl linked against glibc 2.28 (the manylinux_2_28 floor; the real NCCL 2.32.3 needs
# glibc 2.27), with cargo-zigbuild and Zig's glibc 2.28 stubs from PyPI (the packages cargo-zigbuild and ziglang),
# and prints the path of the built library: the value for ANYCCL_TEST_DROPIN_GLIBC_2_28.
#
# Linked on the build machine's own glibc instead (plain `cargo build`), the library needs the newest versions of
# that glibc's symbols: on glibc 2.34 and later, dlopen/dlsym/dladdr/dlerror/dlclose and pthread_key_create/
# pthread_key_delete/pthread_setspecific moved into libc with GLIBC_2.34 versions, stat64/fstat64 got GLIBC_2.33
# ones, and Rust's std refers to gettid (GLIBC_2.30, weakly). Every one of them exists in glibc 2.28 under its
# older version, so linking against 2.28 is all it takes; Rust's std itself supports glibc 2.17 and later.
# Usage: dropin/ci/build-glibc-2.28.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# The tools live in their own virtual environment under the target dir (pinned; a system pip may refuse installs).
tools="${CARGO_TARGET_DIR:-$PWD/target}/ci-zigbuild-venv"
if [ ! -x "$tools/bin/cargo-zigbuild" ]; then
    echo "installing cargo-zigbuild and ziglang from PyPI into $tools" >&2
    python3 -m venv "$tools" >&2
    "$tools/bin/python" -m pip install -q "cargo-zigbuild==0.24.1" "ziglang==0.17.1" >&2
fi
export PATH="$tools/bin:$PATH"
target=x86_64-unknown-linux-gnu
case "$(uname -m)" in aarch64) target=aarch64-unknown-linux-gnu ;; esac
# Only the link is under test (which glibc symbol versions it needs), so nothing is optimised: the dependencies
# of the dev profile are otherwise built at opt-level 2, a second time for this target.
cargo zigbuild --locked -p anyccl-nccl --lib --target "$target.2.28" \
    --config 'profile.dev.opt-level=0' --config 'profile.dev.package."*".opt-level=0' >&2
echo "${CARGO_TARGET_DIR:-$PWD/target}/$target/debug/libanyccl_nccl.so"
