#!/bin/bash
# The CLI findings of docs/security.md, one run each under ulimit -v. usage: cli_findings.sh BIN ; prints one line per case: name | rc | secs | first stderr line
BIN=$1
D=/tmp/cli-repro/work; rm -rf $D; mkdir -p $D
mkfifo $D/fifo; ln -s $D/fifo $D/fifolink; mkdir $D/dir
printf '[[rule]]\nalgorithms=["ring"]\n' > $D/noread.toml; chmod 000 $D/noread.toml
truncate -s 100M $D/big.toml
python3 - <<'PY'
n=16000
with open('/tmp/cli-repro/work/rules16k.toml','w') as f:
    for i in range(n):
        f.write('[[rule]]\nvendor="host"\nbytes="%d-%d"\nalgorithms=["ring"]\n'%(i*16,(i+1)*16))
PY
run() { # name, env..., -- args
  local name=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local t0=$(date +%s.%N)
  env -u ANYCCL_TUNE_FILE -u ANYCCL_ALLREDUCE_ALGO -u ANYCCL_DISABLE -u ANYCCL_LOG "${envs[@]}" \
    timeout -s KILL 60 sh -c 'ulimit -v 4000000; exec "$@"' sh $BIN "$@" >$D/out 2>$D/err
  local rc=$?; local t1=$(date +%s.%N)
  local first=$(head -c 300 $D/err | head -1); local pan=$(grep -c panicked $D/err)
  printf '%-28s rc=%-4s %6.1fs panic=%s | %s\n' "$name" "$rc" "$(echo "$t1-$t0"|bc)" "$pan" "$first"
}
run sizes-2^63 -- bench --sizes 9223372036854775808 --iters 1
run sizes-2^64 -- bench --sizes 18446744073709551616 --iters 1
run sizes-100GiB -- bench --sizes 100GiB --iters 1
run world8-1GiB -- bench --world 8 --sizes 1GiB --iters 1
run iters-u32max -- bench --sizes 4KiB --iters 4294967295
run warmup-huge -- bench --sizes 4KiB --iters 1 --warmup 4294967295
run tune-2^62 -- tune --sizes 4611686018427387904 --out $D/t.toml
run sizes-zero -- bench --sizes 0
run sizes-neg -- bench --sizes -4
run sizes-empty -- bench --sizes ''
run sizes-unicode -- bench --sizes '４KiB'
run world-huge -- bench --world 100000
run algos-unknown -- bench --algos warp
run tunefile-urandom ANYCCL_TUNE_FILE=/dev/urandom -- probe
run tunefile-zero ANYCCL_TUNE_FILE=/dev/zero -- probe
run tunefile-fifo ANYCCL_TUNE_FILE=$D/fifo -- probe
run table-fifo -- probe --table $D/fifo
run tunefile-fifolink ANYCCL_TUNE_FILE=$D/fifolink -- probe
run tunefile-dir ANYCCL_TUNE_FILE=$D/dir -- probe
run tunefile-noread ANYCCL_TUNE_FILE=$D/noread.toml -- probe
run tunefile-100MB ANYCCL_TUNE_FILE=$D/big.toml -- probe
run tunefile-16k-rules ANYCCL_TUNE_FILE=$D/rules16k.toml -- probe --json
run algo-env-bad ANYCCL_ALLREDUCE_ALGO=fastest -- bench --sizes 4KiB --iters 1
run tune-nvls -- tune --algos nvls-zero-copy --sizes 4KiB --iters 1 --out $D/t2.toml
run plot-badpath -- bench --sizes 4KiB --iters 1 --plot /nonexistent/dir/x.svg
run tune-out-badpath -- tune --sizes 4KiB --iters 1 --out /nonexistent/dir/x.toml
run disable-host ANYCCL_DISABLE=host-backend -- bench --sizes 4KiB --iters 1
run disable-bogus ANYCCL_DISABLE=bogus -- bench --sizes 4KiB --iters 1
run log-bad ANYCCL_LOG='debug=[' -- probe
