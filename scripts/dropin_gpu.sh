#!/usr/bin/env bash
# The GPU proofs of the drop-in libnccl, in one run on a CUDA machine with NCCL installed:
#   1. nccl-tests (public source, .devbin/nccl-tests) built with this machine's nvcc against the drop-in (NCCL_HOME
#      is a folder whose lib/ holds the drop-in as libnccl.so and libnccl.so.2 and whose include/ holds the system's
#      nccl*.h); `ldd` must show libnccl resolving to the drop-in.
#   2. all_reduce_perf all_gather_perf reduce_scatter_perf broadcast_perf reduce_perf alltoall_perf sendrecv_perf with
#      -g $NGPUS -b 8 -e 128M -f 4 -c 1 -w 5 -n 20 (data check on) through the drop-in, and all_reduce_perf on the
#      system libnccl (the same binary, libnccl.so pointing at the real library) side by side: every #wrong 0,
#      "Out of bounds values : 0 OK", exit status 0.
#   3. ANYCCL_LOG=debug (with ANYCCL_NCCL_PATH unset: the drop-in's own search): the drop-in's log lines appear, it
#      forwards to the system NCCL (the version the real library reports), and logs each ncclAllReduce.
#   4. dropin/bench/host_time.c built with gcc -lcudart: host time per ncclAllReduce, real vs drop-in (a benchmark:
#      reported, not a pass/fail unless HOST_TIME_STRICT=1).
#   5. scripts/dropin_torch.py, if python3 can import torch: torch.distributed (nccl) without the drop-in (baseline)
#      and under LD_PRELOAD of it (world $NGPUS).
#
# Usage: scripts/dropin_gpu.sh [DROPIN_SO]
#   DROPIN_SO (or env ANYCCL_DROPIN_SO): the drop-in library; default target/release/libanyccl_nccl.so.
# Environment (all optional): NGPUS (default 1), CUDA_HOME, REAL_NCCL (the system libnccl.so.2), NCCL_INCLUDE (the
#   folder of nccl.h), NCCL_TESTS_SRC (default .devbin/nccl-tests), DROPIN_WORK (build folder; default a new temporary
#   folder), NVCC_GENCODE (default: this GPU's architecture), MAKE_JOBS (default 16), RUN_TORCH (auto|0|1),
#   HOST_TIME_ITERS (default 1000), HOST_TIME_STRICT (0|1), PYTHON (the python with torch; default python3), OUT (logs are copied to $OUT/dropin_gpu when set).
# Exit status: 0 when every check passed, 1 otherwise (the summary at the end says which failed), 2 on bad setup.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DROPIN_ARG="${1:-${ANYCCL_DROPIN_SO:-$ROOT/target/release/libanyccl_nccl.so}}"
NGPUS="${NGPUS:-1}"
SRC="${NCCL_TESTS_SRC:-$ROOT/.devbin/nccl-tests}"
WORK="${DROPIN_WORK:-$(mktemp -d /tmp/dropin-gpu.XXXXXX)}"
LOGS="$WORK/logs"
MAKE_JOBS="${MAKE_JOBS:-16}"
RUN_TORCH="${RUN_TORCH:-auto}"
HOST_TIME_ITERS="${HOST_TIME_ITERS:-1000}"
HOST_TIME_STRICT="${HOST_TIME_STRICT:-0}"
mkdir -p "$LOGS"

START=$(date +%s)
SUMMARY=()
FAILED=0
say() { printf '[dropin_gpu %4ss] %s\n' "$(($(date +%s) - START))" "$*"; }
pass() { SUMMARY+=("PASS  $*"); say "PASS: $*"; }
fail() { SUMMARY+=("FAIL  $*"); FAILED=1; say "FAIL: $*"; }
info() { SUMMARY+=("INFO  $*"); say "$*"; }
setup_error() { echo "dropin_gpu.sh: setup error: $*" >&2; exit 2; }

finish() {
    local copied=""
    if [ -n "${OUT:-}" ] && mkdir -p "$OUT/dropin_gpu" 2>/dev/null && cp -r "$LOGS/." "$OUT/dropin_gpu/" 2>/dev/null; then
        copied=" (copied to $OUT/dropin_gpu)"
    fi
    echo
    echo "================ drop-in GPU proofs: summary ================"
    printf '%s\n' "${SUMMARY[@]}"
    echo "logs: $LOGS$copied"
    if [ "$FAILED" = 0 ]; then echo "RESULT: all checks passed"; else echo "RESULT: FAILED"; fi
}

# ---------------------------------------------------------------- setup: the drop-in, CUDA, the real NCCL, nccl.h
[ -f "$DROPIN_ARG" ] || setup_error "the drop-in $DROPIN_ARG does not exist (cargo build --release -p anyccl-nccl)"
DROPIN="$(readlink -f "$DROPIN_ARG")"
[[ "$NGPUS" =~ ^[1-9][0-9]?$ ]] || setup_error "NGPUS must be a number from 1 to 99, not '$NGPUS'"
[ -d "$SRC/src" ] || setup_error "no nccl-tests source at $SRC (set NCCL_TESTS_SRC)"

if [ -z "${CUDA_HOME:-}" ]; then
    if command -v nvcc >/dev/null; then
        CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    else
        for d in /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12*; do
            if [ -x "$d/bin/nvcc" ]; then CUDA_HOME="$d"; break; fi
        done
    fi
fi
[ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] || setup_error "no nvcc found (set CUDA_HOME)"
CUDA_LIB="$CUDA_HOME/lib64"
[ -d "$CUDA_LIB" ] || CUDA_LIB="$CUDA_HOME/lib"

if [ -z "${REAL_NCCL:-}" ]; then
    for f in /lib/x86_64-linux-gnu/libnccl.so.2 /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/lib64/libnccl.so.2 \
        /usr/local/lib/libnccl.so.2 "$CUDA_LIB/libnccl.so.2"; do
        if [ -f "$f" ]; then REAL_NCCL="$f"; break; fi
    done
fi
[ -n "${REAL_NCCL:-}" ] && [ -f "$REAL_NCCL" ] || setup_error "no system libnccl.so.2 found (set REAL_NCCL)"
REAL_NCCL="$(readlink -f "$REAL_NCCL")"

if [ -z "${NCCL_INCLUDE:-}" ]; then
    for d in /usr/include /usr/local/include "$CUDA_HOME/include" "$(dirname "$(dirname "$REAL_NCCL")")/include"; do
        if [ -f "$d/nccl.h" ]; then NCCL_INCLUDE="$d"; break; fi
    done
fi
if [ -z "${NCCL_INCLUDE:-}" ]; then
    # Last: the header of the NCCL wheel (nvidia-nccl-cu12/cu13, torch's), when python has one.
    wheel="$("${PYTHON:-python3}" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)"
    if [ -n "$wheel" ] && [ -f "$wheel/include/nccl.h" ]; then NCCL_INCLUDE="$wheel/include"; fi
fi
[ -n "${NCCL_INCLUDE:-}" ] && [ -f "$NCCL_INCLUDE/nccl.h" ] ||
    setup_error "no nccl.h found in /usr/include, /usr/local/include, \$CUDA_HOME/include or python's nvidia.nccl wheel (install libnccl-dev or set NCCL_INCLUDE)"

# The real library's version (ncclGetVersion), e.g. 22803 -> 2.28.3.
REAL_CODE="$(python3 -c 'import ctypes,sys
l=ctypes.CDLL(sys.argv[1]); v=ctypes.c_int(0)
sys.exit("ncclGetVersion failed") if l.ncclGetVersion(ctypes.byref(v)) else print(v.value)' "$REAL_NCCL")"
REAL_VERSION="$((REAL_CODE / 10000)).$((REAL_CODE / 100 % 100)).$((REAL_CODE % 100))"
HEADER_VERSION="$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{v[$2]=$3} END{print v["NCCL_MAJOR"]"."v["NCCL_MINOR"]"."v["NCCL_PATCH"]}' \
    "$NCCL_INCLUDE/nccl.h")"
if [ -z "${NVCC_GENCODE:-}" ]; then
    CC_CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')" || true
    [[ "${CC_CAP:-}" =~ ^[0-9]+$ ]] || CC_CAP=90
    NVCC_GENCODE="-gencode=arch=compute_${CC_CAP},code=sm_${CC_CAP}"
fi
trap finish EXIT
info "drop-in: $DROPIN"
info "real NCCL: $REAL_NCCL (ncclGetVersion: $REAL_VERSION); nccl.h: $NCCL_INCLUDE/nccl.h ($HEADER_VERSION)"
info "CUDA: $CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')); $NVCC_GENCODE; GPUs used: $NGPUS"
info "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo unknown)"

# NCCL_HOME for the drop-in: include/ = the system's nccl*.h (nccl.h, nccl_device.h and its folder, ...); lib/ = the
# drop-in under both of NCCL's names (its SONAME is libnccl.so.2, so a program linked against it records that name).
DHOME="$WORK/nccl_home_dropin"
RHOME="$WORK/nccl_home_real"
mkdir -p "$DHOME/include" "$DHOME/lib" "$RHOME/lib"
for h in "$NCCL_INCLUDE"/nccl*; do ln -sfn "$h" "$DHOME/include/$(basename "$h")"; done
ln -sf "$DROPIN" "$DHOME/lib/libnccl.so"
ln -sf "$DROPIN" "$DHOME/lib/libnccl.so.2"
# The same binaries on the real library: libnccl.so (their DT_NEEDED) and libnccl.so.2 name the system file.
ln -sf "$REAL_NCCL" "$RHOME/lib/libnccl.so"
ln -sf "$REAL_NCCL" "$RHOME/lib/libnccl.so.2"

# ---------------------------------------------------------------- 1. build nccl-tests against the drop-in
TESTS=(all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv)
BUILD="$WORK/build"
targets=()
for t in "${TESTS[@]}"; do targets+=("$BUILD/${t}_perf"); done
say "building nccl-tests ($(sed -n 's/#define NCCL_TESTS_VERSION "\(.*\)"/\1/p' "$SRC/src/common.h")) in $BUILD"
if make -C "$SRC/src" -j"$MAKE_JOBS" MPI=0 CUDA_HOME="$CUDA_HOME" NCCL_HOME="$DHOME" BUILDDIR="$BUILD" \
    NVCC_GENCODE="$NVCC_GENCODE" "${targets[@]}" >"$LOGS/build.log" 2>&1; then
    pass "nccl-tests built against the drop-in ($(du -sh "$BUILD" | cut -f1), log build.log)"
else
    missing="$(grep -o "undefined reference to \`[A-Za-z0-9_]*'" "$LOGS/build.log" | sort -u | tr '\n' ' ' || true)"
    tail -40 "$LOGS/build.log"
    if [ -n "$missing" ]; then
        fail "nccl-tests did not link against the drop-in: it needs symbols the drop-in does not export: $missing"
    else
        fail "nccl-tests did not build (see the log above / build.log; not a missing drop-in symbol)"
    fi
    exit 1
fi

# The binaries must resolve libnccl to the drop-in (with its folder in LD_LIBRARY_PATH) and to the real library
# with the other folder.
resolves() { # binary libdir -> the file libnccl resolves to
    LD_LIBRARY_PATH="$2${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$1" | awk '/libnccl\.so/ {print $3; exit}' || true
}
ldd_ok=1
for t in "${TESTS[@]}"; do
    r="$(resolves "$BUILD/${t}_perf" "$DHOME/lib")"
    if [ -z "$r" ] || [ "$(readlink -f "$r")" != "$DROPIN" ]; then
        ldd_ok=0
        fail "ldd: ${t}_perf resolves libnccl to '${r:-nothing}', not the drop-in"
    fi
done
needed="$(LD_LIBRARY_PATH="$DHOME/lib" ldd "$BUILD/all_reduce_perf" | grep libnccl | sed 's/ *(0x[0-9a-f]*)//' | xargs || true)"
[ "$ldd_ok" = 1 ] && pass "ldd: all 7 binaries resolve libnccl to the drop-in ($needed)"
r="$(resolves "$BUILD/all_reduce_perf" "$RHOME/lib")"
if [ "$(readlink -f "${r:-/nonexistent}")" = "$REAL_NCCL" ]; then
    pass "ldd: with the real folder all_reduce_perf resolves libnccl to $REAL_NCCL"
else
    fail "ldd: with the real folder all_reduce_perf resolves libnccl to '${r:-nothing}', not $REAL_NCCL"
fi

# The binaries have no run path: when the loader cannot find libcudart by itself (the toolkit's folder is not in
# ld.so.conf), its folder goes to the end of LD_LIBRARY_PATH (after the drop-in's or the real library's folder).
EXTRA_LIBS=""
if LD_LIBRARY_PATH="$DHOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$BUILD/all_reduce_perf" | grep -q 'libcudart.*not found'; then
    EXTRA_LIBS=":$CUDA_LIB"
    info "libcudart is not on the loader's path: $CUDA_LIB is appended to LD_LIBRARY_PATH for the runs"
fi

# ---------------------------------------------------------------- 2. run them, data check on
# check_output LOG NAME: every #wrong 0, "Out of bounds values : 0 OK", the largest size reached.
check_output() {
    python3 - "$1" "$2" <<'EOF'
import re, sys
path, name = sys.argv[1], sys.argv[2]
lines = open(path, errors="replace").read().splitlines()
header = None
for l in lines:
    if l.startswith("#") and "#wrong" in l and "size" in l:
        header = l.lstrip("#").split()
if header is None:
    sys.exit(f"{name}: no result table header (with #wrong) in the output")
wrong_cols = [i for i, t in enumerate(header) if t == "#wrong"]
rows = [l.split() for l in lines if l.strip() and not l.startswith("#")]
rows = [r for r in rows if len(r) == len(header) and r[0].isdigit()]
if not rows:
    sys.exit(f"{name}: no result rows")
bad = []
checked = 0
not_run = 0
for r in rows:
    numeric = 0
    for i in wrong_cols:
        # nccl-tests prints N/A in the in-place column of collectives it runs out of place only (alltoall,
        # sendrecv); every row must still have at least one checked column.
        if r[i] == "N/A":
            not_run += 1
            continue
        try:
            if float(r[i]) != 0:
                bad.append(f"size {r[0]}: #wrong {r[i]}")
            numeric += 1
        except ValueError:
            bad.append(f"size {r[0]}: #wrong is {r[i]!r}")
    if numeric == 0:
        bad.append(f"size {r[0]}: no #wrong column was checked")
    checked += numeric
oob = [l for l in lines if re.match(r"#\s*Out of bounds values\s*:", l)]
oob_ok = len(oob) == 1 and re.match(r"#\s*Out of bounds values\s*:\s*0\s+OK\s*$", oob[0])
largest = max(int(r[0]) for r in rows)
bw = [l for l in lines if "Avg bus bandwidth" in l]
problems = bad[:]
if not oob_ok:
    problems.append(f"out-of-bounds line: {oob!r}")
if largest < 0.9 * 128 * 2**20:
    problems.append(f"largest size reached {largest} B, not 128 MiB")
bw_text = bw[0].split(":")[1].strip() if bw else "?"
if problems:
    print(f"{name}: {len(rows)} sizes; " + "; ".join(problems[:8]))
    sys.exit(1)
na = f", {not_run} in-place columns N/A (not run by nccl-tests)" if not_run else ""
print(f"{name}: {len(rows)} sizes (8 B to {largest} B), #wrong all 0 ({checked} values{na}), "
      f"out of bounds 0 OK, avg bus bandwidth {bw_text} GB/s")
EOF
}

NT_ARGS=(-g "$NGPUS" -b 8 -e 128M -f 4 -c 1 -w 5 -n 20)
run_test() { # NAME LIBDIR LOGNAME [env...]
    local name="$1" libdir="$2" log="$3"
    shift 3
    local rc=0
    env "$@" NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}$EXTRA_LIBS" \
        timeout 300 "$BUILD/${name}_perf" "${NT_ARGS[@]}" >"$LOGS/$log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        tail -20 "$LOGS/$log"
        fail "$log: ${name}_perf exited with status $rc"
        return 0
    fi
    local verdict
    if verdict="$(check_output "$LOGS/$log" "${name}_perf")"; then
        pass "$log: $verdict"
        RAN_OK+=("$log")
    else
        fail "$log: $verdict"
    fi
}
RAN_OK=()
say "running nccl-tests through the drop-in: ${NT_ARGS[*]} (NCCL_NVLS_ENABLE=0)"
for t in "${TESTS[@]}"; do
    run_test "$t" "$DHOME/lib" "dropin_${t}.log" ANYCCL_NCCL_PATH="$REAL_NCCL"
done
say "running all_reduce_perf on the real library directly"
run_test all_reduce "$RHOME/lib" "real_all_reduce.log" -u ANYCCL_NCCL_PATH
if [[ " ${RAN_OK[*]} " == *" dropin_all_reduce.log "* && " ${RAN_OK[*]} " == *" real_all_reduce.log "* ]]; then
    python3 - "$LOGS/real_all_reduce.log" "$LOGS/dropin_all_reduce.log" >"$LOGS/all_reduce_side_by_side.txt" <<'EOF' || true
import sys
def table(p):
    lines = open(p, errors="replace").read().splitlines()
    head = [l.lstrip("#").split() for l in lines if l.startswith("#") and "#wrong" in l and "size" in l][-1]
    t = head.index("time")
    return {r[0]: r for r in (l.split() for l in lines if l.strip() and not l.startswith("#"))
            if len(r) == len(head) and r[0].isdigit()}, t
(real, t), (drop, _) = table(sys.argv[1]), table(sys.argv[2])
print(f"{'bytes':>10} {'real us':>9} {'drop-in us':>10} {'real busbw':>10} {'drop-in busbw':>13}  (out-of-place)")
for size in sorted(real, key=int):
    if size in drop:
        print(f"{size:>10} {real[size][t]:>9} {drop[size][t]:>10} {real[size][t+2]:>10} {drop[size][t+2]:>13}")
EOF
    cat "$LOGS/all_reduce_side_by_side.txt"
    info "all_reduce_perf side by side (out-of-place time and busbw): all_reduce_side_by_side.txt"
fi

# ---------------------------------------------------------------- 3. the drop-in is in the path (ANYCCL_LOG=debug)
say "ANYCCL_LOG=debug all_reduce_perf through the drop-in, ANYCCL_NCCL_PATH unset (the drop-in's own search)"
rc=0
env -u ANYCCL_NCCL_PATH ANYCCL_LOG=debug NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$DHOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}$EXTRA_LIBS" \
    timeout 120 "$BUILD/all_reduce_perf" -g "$NGPUS" -b 8 -e 1M -f 4 -c 1 -w 1 -n 2 >"$LOGS/debug_all_reduce.log" 2>&1 || rc=$?
chosen="$(grep -m1 'anyccl drop-in NCCL forwards to this library' "$LOGS/debug_all_reduce.log" || true)"
n_ar="$(grep -c 'function="ncclAllReduce"' "$LOGS/debug_all_reduce.log" || true)"
if [ "$rc" != 0 ]; then
    tail -20 "$LOGS/debug_all_reduce.log"
    fail "ANYCCL_LOG=debug run exited with status $rc"
elif [ -z "$chosen" ]; then
    fail "ANYCCL_LOG=debug: no 'anyccl drop-in NCCL forwards to this library' line: the drop-in was not in the path"
elif ! grep -q "library=NCCL $REAL_VERSION" <<<"$chosen"; then
    fail "ANYCCL_LOG=debug: the drop-in forwards to something else than NCCL $REAL_VERSION: $chosen"
elif [ "${n_ar:-0}" -lt 10 ]; then
    fail "ANYCCL_LOG=debug: only ${n_ar:-0} ncclAllReduce log lines"
else
    where="${chosen##*library=}"
    pass "ANYCCL_LOG=debug: the drop-in forwarded to ${where%% refused=*} and logged $n_ar ncclAllReduce calls, e.g.: $(grep -m1 'function="ncclAllReduce"' "$LOGS/debug_all_reduce.log" | cut -c1-220)"
fi

# ---------------------------------------------------------------- 4. host time per ncclAllReduce
say "building and running dropin/bench/host_time.c"
HT="$WORK/host_time"
if gcc -O2 -std=gnu11 -Wall -o "$HT" "$ROOT/dropin/bench/host_time.c" -I"$CUDA_HOME/include" -I"$NCCL_INCLUDE" \
    -L"$CUDA_LIB" -lcudart -ldl -Wl,-rpath,"$CUDA_LIB" >"$LOGS/host_time_build.log" 2>&1; then
    rc=0
    env -u ANYCCL_LOG NCCL_NVLS_ENABLE=0 timeout 180 "$HT" "$REAL_NCCL" "$DROPIN" "$HOST_TIME_ITERS" \
        >"$LOGS/host_time.log" 2>&1 || rc=$?
    cat "$LOGS/host_time.log"
    if [ "$rc" != 0 ]; then
        fail "host_time exited with status $rc"
    else
        while read -r line; do
            info "host time: ${line#RESULT }"
            if [ "$HOST_TIME_STRICT" = 1 ] && grep -q ABOVE <<<"$line"; then fail "host time above the 0.3 us bar"; fi
        done < <(grep '^RESULT ' "$LOGS/host_time.log")
    fi
else
    cat "$LOGS/host_time_build.log"
    fail "host_time.c did not build"
fi

# ---------------------------------------------------------------- 5. torch.distributed under LD_PRELOAD
PYTHON="${PYTHON:-python3}"
if [ "$RUN_TORCH" = auto ]; then
    if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        RUN_TORCH=1
    else
        RUN_TORCH=0
        info "torch: $PYTHON cannot import torch with CUDA here; dropin_torch.py not run (RUN_TORCH=1 forces it)"
    fi
fi
if [ "$RUN_TORCH" = 1 ]; then
    for mode in baseline dropin; do
        say "scripts/dropin_torch.py --world $NGPUS ($mode)"
        rc=0
        args=(--world "$NGPUS")
        if [ "$mode" = dropin ]; then args+=(--dropin "$DROPIN"); else args+=(--baseline); fi
        env -u ANYCCL_NCCL_PATH NCCL_NVLS_ENABLE=0 timeout 300 "$PYTHON" "$ROOT/scripts/dropin_torch.py" "${args[@]}" \
            >"$LOGS/torch_$mode.log" 2>&1 || rc=$?
        tail -25 "$LOGS/torch_$mode.log"
        last="$(grep '^SUMMARY' "$LOGS/torch_$mode.log" | tail -1 || true)"
        if [ "$rc" = 0 ]; then pass "torch ($mode): ${last#SUMMARY }"; else fail "torch ($mode): status $rc ${last#SUMMARY }"; fi
    done
fi
[ "$FAILED" = 0 ]
