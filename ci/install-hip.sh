#!/usr/bin/env bash
# Installs Debian's HIP compiler and runtime (hipcc, libamdhip64-dev, rocm-device-libs: HIP 5.2 with clang 15)
# when hipcc is missing, so the HIP kernels are built and checked. Needs root or passwordless sudo and Debian's
# package sources. Prints nothing on stdout; progress goes to stderr.
set -euo pipefail
if command -v hipcc >/dev/null 2>&1; then
    echo "hipcc present: $(command -v hipcc)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "error: hipcc is missing and installing it needs root (apt-get)" >&2; exit 1; }
    SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >&2
$SUDO apt-get install -y -qq --no-install-recommends hipcc libamdhip64-dev rocm-device-libs >&2
command -v hipcc >/dev/null || { echo "error: apt-get finished but hipcc is not on PATH" >&2; exit 1; }
echo "installed hipcc: $(command -v hipcc)" >&2
