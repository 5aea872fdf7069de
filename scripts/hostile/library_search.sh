#!/usr/bin/env bash
# Reproduction tally for the library-search findings (docs/security.md); HOSTILE_TEST_BINARY is target/debug/deps/hostile-<hash> of anyccl-ccl, FAKE_DIR its target/tmp/fake-ccl.
# Usage: library_search.sh HOSTILE_TEST_BINARY FAKE_DIR [ATTEMPTS]
# Runs the hostile test binary's `child` (the real SearchPlan::from_env(..).load() / CclLibrary::open) in planted
# working directories, ATTEMPTS times per case, each with a 10 s deadline, and classifies every run.
set -u
bin=$(realpath "$1"); fake=$(realpath "$2"); n=${3:-3}
work=$(mktemp -d /tmp/anyccl-repro.XXXXXX)
planted=$fake/planted/libnccl.so.2; rplanted=$fake/planted/librccl.so.1
data=$fake/data-object/libnccl.so.2; good=$fake/nccl-2.28/libnccl.so.2
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
    printf '%-34s attempts=%d clean=%d planted-code-ran=%d hang=%d crash=%d other=%d\n    last: %.400s\n' \
        "$name" "$n" $cnt_clean $cnt_planted $cnt_hang $cnt_crash $cnt_other "$last"
}
d=$(mk py-empty); mkdir -p $d/nvidia/nccl/lib; cp $planted $d/nvidia/nccl/lib/
run "PYTHONPATH='/x:' (empty entry)" $d search-nccl PYTHONPATH=/nonexistent: HOME=$d/home
run "PYTHONPATH='.'" $d search-nccl PYTHONPATH=. HOME=$d/home
d=$(mk homes); mkdir -p $d/cuda/lib64 $d/rocm/lib; cp $planted $d/cuda/lib64/; cp $rplanted $d/rocm/lib/
run "CUDA_HOME=cuda (relative)" $d search-nccl CUDA_HOME=cuda
run "ROCM_PATH=rocm (relative, RCCL)" $d search-rccl ROCM_PATH=rocm
d=$(mk explicit-rel); mkdir -p $d/mine; cp $planted $d/mine/
run "ANYCCL_NCCL_PATH=mine/libnccl.so.2" $d search-nccl ANYCCL_NCCL_PATH=mine/libnccl.so.2
d=$(mk llp); cp $planted $d/
run "LD_LIBRARY_PATH='/x:' + cwd lib" $d search-nccl LD_LIBRARY_PATH=/nonexistent:
run "LD_LIBRARY_PATH='.' + cwd lib" $d search-nccl LD_LIBRARY_PATH=.
d=$(mk soname-fifo); mkfifo $d/libnccl.so.2 $d/libnccl.so
run "FIFO libnccl.so.2 in cwd" $d search-nccl
d=$(mk soname-junk); echo junk > $d/libnccl.so.2
run "junk libnccl.so.2 in cwd (real in LLP)" $d search-nccl LD_LIBRARY_PATH=$(dirname $good)
d=$(mk fifo); mkdir -p $d/cuda/lib64; mkfifo $d/explicit.so $d/cuda/lib64/libnccl.so.2 $d/librccl.so.1
run "ANYCCL_NCCL_PATH=FIFO" $d search-nccl ANYCCL_NCCL_PATH=$d/explicit.so
run "ANYCCL_RCCL_PATH=FIFO" $d search-rccl ANYCCL_RCCL_PATH=$d/librccl.so.1
run "CUDA_HOME/lib64/libnccl.so.2=FIFO" $d search-nccl CUDA_HOME=$d/cuda
d=$(mk data)
run "ncclGetVersion is data (explicit)" $d search-nccl ANYCCL_NCCL_PATH=$data
run "ncclGetVersion is data (by soname)" $d search-nccl LD_LIBRARY_PATH=$(dirname $data)
long=$d/$(printf 'x%.0s' $(seq 300))/libnccl.so.2
run "ENAMETOOLONG explicit path" $d open ANYCCL_HOSTILE_PATH=$long
cp $good $d/denied.so; chmod 000 $d/denied.so
# Root reads any file: drop the two capabilities that let it (capsh) so the open really fails with EACCES.
run "EACCES explicit path (caps dropped)" $d open ANYCCL_HOSTILE_PATH=$d/denied.so CAPSH=1
rm -rf "$work"
