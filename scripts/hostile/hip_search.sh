#!/usr/bin/env bash
# Reproduction tally for the HIP runtime search (docs/security.md).
# Usage: hip_search.sh ROCM_HOSTILE_TEST_BINARY FAKE_DIR [ATTEMPTS]
set -u
bin=$(realpath "$1"); fake=$(realpath "$2"); n=${3:-3}
work=$(mktemp -d /tmp/anyccl-repro-hip.XXXXXX)
planted=$fake/planted-hip/libamdhip64.so; data=$fake/data-object-hip/libamdhip64.so.7; good=$fake/hip/libamdhip64.so.6
mk() { d=$work/$1; mkdir -p "$d"; echo "$d"; }
run() { # name cwd case env...
    local name=$1 cwd=$2 case=$3; shift 3
    local cnt_clean=0 cnt_planted=0 cnt_hang=0 cnt_crash=0 cnt_other=0 last=""
    for _ in $(seq "$n"); do
        pre=(); case " $* " in *" CAPSH=1 "*) pre=(capsh --drop=cap_dac_override,cap_dac_read_search -- -c 'exec "$@"' capsh-child);; esac
        out=$(cd "$cwd" && timeout -s KILL 10 "${pre[@]}" env -i ANYCCL_HOSTILE_CASE="$case" "$@" "$bin" child --exact --ignored --nocapture --test-threads=1 -q 2>/dev/null); rc=$?
        res=$(printf '%s\n' "$out" | sed -n 's/^RESULT //p')
        if [ $rc -eq 137 ]; then cnt_hang=$((cnt_hang+1)); last="hang (killed after 10 s)"
        elif [ $rc -gt 128 ]; then cnt_crash=$((cnt_crash+1)); last="crash: signal $((rc-128))"
        elif printf '%s' "$out" | grep -q PLANTED-CONSTRUCTOR-RAN; then cnt_planted=$((cnt_planted+1)); last="planted code ran: $res"
        elif [ $rc -eq 0 ]; then cnt_clean=$((cnt_clean+1)); last="$res"
        else cnt_other=$((cnt_other+1)); last="exit $rc: $res"; fi
    done
    printf '%-38s attempts=%d clean=%d planted-code-ran=%d hang=%d crash=%d other=%d\n    last: %.400s\n' \
        "$name" "$n" $cnt_clean $cnt_planted $cnt_hang $cnt_crash $cnt_other "$last"
}
d=$(mk fifo); mkfifo $d/libamdhip64.so; mkdir -p $d/r/lib; mkfifo $d/r/lib/libamdhip64.so
run "ANYCCL_HIP_PATH=FIFO" $d load ANYCCL_HIP_PATH=$d/libamdhip64.so
d=$(mk rel); mkdir -p $d/rocm/lib; cp $planted $d/rocm/lib/; for s in 7 6 5; do cp $planted $d/libamdhip64.so.$s; done; cp $planted $d/libamdhip64.so
run "ROCM_PATH=rocm (relative)" $d load ROCM_PATH=rocm
run "ANYCCL_HIP_PATH=rocm/lib/... (relative)" $d load ANYCCL_HIP_PATH=rocm/lib/libamdhip64.so
run "LD_LIBRARY_PATH='/x:' + cwd libs" $d load LD_LIBRARY_PATH=/nonexistent:
run "LD_LIBRARY_PATH='.' + cwd libs" $d load LD_LIBRARY_PATH=.
d=$(mk soname-fifo); for s in .7 .6 .5 ""; do mkfifo $d/libamdhip64.so$s; done
run "FIFOs named like the sonames in cwd" $d load
d=$(mk data)
run "hipRuntimeGetVersion is data (explicit)" $d load ANYCCL_HIP_PATH=$data
run "hipRuntimeGetVersion is data (soname)" $d load LD_LIBRARY_PATH=$(dirname $data)
long=$d/$(printf 'x%.0s' $(seq 300))/libamdhip64.so
run "ENAMETOOLONG explicit path" $d open ANYCCL_HOSTILE_PATH=$long
cp $good $d/denied.so; chmod 000 $d/denied.so
run "EACCES explicit path (caps dropped)" $d open ANYCCL_HOSTILE_PATH=$d/denied.so CAPSH=1
rm -rf "$work"
