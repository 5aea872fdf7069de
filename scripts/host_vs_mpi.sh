#!/usr/bin/env bash
# Open MPI's MPI_Allreduce and anyccl's host backend (threads, and one process per rank) side by side, measured the
# same way in one run: f32 sum; each timed call between two barriers (barrier, all-reduce, barrier); the median of
# ITERS timed calls after WARMUP untimed ones; processes report the average of the ranks' medians, threads rank 0's.
#
# Usage: scripts/host_vs_mpi.sh [WORLDS] [SIZES] [ITERS]
#   WORLDS  space-separated world sizes           (default "2 4 8")
#   SIZES   comma-separated sizes, KiB/MiB suffix (default 4KiB,64KiB,1MiB,16MiB,64MiB)
#   ITERS   timed calls per cell                  (default 200)
# Environment: ANYCCL_BIN (an anyccl binary to use instead of building one), WARMUP (default 20),
#   PORT (the first rendezvous port for the per-rank runs, default 29600).
#
# Installs Debian's Open MPI (openmpi-bin, libopenmpi-dev) with apt-get when mpicc is missing. Running as root needs
# --allow-run-as-root; worlds larger than the core count need --oversubscribe (both are passed).
set -euo pipefail

WORLDS=${1:-"2 4 8"}
SIZES=${2:-4KiB,64KiB,1MiB,16MiB,64MiB}
ITERS=${3:-200}
WARMUP=${WARMUP:-20}
PORT=${PORT:-29600}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "installing Open MPI (openmpi-bin, libopenmpi-dev)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y openmpi-bin libopenmpi-dev >&2 || { apt-get update >&2 && apt-get install -y openmpi-bin libopenmpi-dev >&2; }
fi

# Sizes in bytes.
BYTES=$(python3 - "$SIZES" <<'PY'
import sys
units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
out = []
for s in sys.argv[1].split(","):
    s = s.strip().lower()
    for u, m in units.items():
        if s.endswith(u):
            out.append(str(int(float(s[: -len(u)]) * m)))
            break
    else:
        out.append(str(int(s)))
print(" ".join(out))
PY
)

cat > "$WORK/allreduce.c" <<'C'
/* MPI_Allreduce latency: f32 sum; barrier, all-reduce, barrier; median of ITERS; each size checked. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    int iters = atoi(argv[1]), warmup = atoi(argv[2]);
    for (int a = 3; a < argc; a++) {
        size_t bytes = strtoull(argv[a], NULL, 10), n = bytes / sizeof(float);
        float *send = malloc(bytes), *recv = malloc(bytes);
        double *t = malloc(sizeof(double) * iters);
        if (!send || !recv || !t) MPI_Abort(MPI_COMM_WORLD, 1);
        for (size_t i = 0; i < n; i++) send[i] = (float)(rank + 1 + (int)(i % 7));
        for (int i = 0; i < warmup; i++) MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (int i = 0; i < iters; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            MPI_Barrier(MPI_COMM_WORLD);
            t[i] = MPI_Wtime() - t0;
        }
        long wrong = 0;
        for (size_t i = 0; i < n; i++) {
            float want = (float)(world * (world + 1) / 2 + world * (int)(i % 7));
            wrong += recv[i] != want;
        }
        qsort(t, iters, sizeof(double), cmp);
        double med = (iters % 2 ? t[iters / 2] : (t[iters / 2 - 1] + t[iters / 2]) / 2) * 1e6, sum = 0;
        long wrong_all = 0;
        MPI_Reduce(&med, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) printf("%zu %.2f %ld\n", bytes, sum / world, wrong_all);
        free(send);
        free(recv);
        free(t);
    }
    MPI_Finalize();
    return 0;
}
C
mpicc -O2 -o "$WORK/allreduce" "$WORK/allreduce.c"

if [[ -n "${ANYCCL_BIN:-}" ]]; then
    ANYCCL=$ANYCCL_BIN
else
    (cd "$ROOT" && cargo build --release -q -p anyccl-cli >&2)
    ANYCCL="$ROOT/target/release/anyccl"
fi

# The out-of-place median of the algorithm the selector picks, per size: "bytes median_us wrong" lines.
cells() {
    python3 -c '
import json, sys
d = json.load(sys.stdin)
for r in d["rows"]:
    a = r["auto"]
    print(r["bytes"], "%.2f" % a["median_us"], a.get("wrong") or 0)
'
}

MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
declare -A MPI THREADS PROCS
for w in $WORLDS; do
    while read -r b us wrong; do MPI[$w,$b]="$us ($wrong wrong)"; done < <("${MPIRUN[@]}" -np "$w" "$WORK/allreduce" "$ITERS" "$WARMUP" $BYTES)
    while read -r b us wrong; do THREADS[$w,$b]="$us ($wrong wrong)"; done < <("$ANYCCL" bench --backend host --world "$w" --dtype f32 --sizes "$SIZES" --iters "$ITERS" --warmup "$WARMUP" --json | cells)
    port=$((PORT + 2 * w))
    pids=()
    for ((r = 0; r < w; r++)); do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=$w LOCAL_WORLD_SIZE=$w MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            "$ANYCCL" bench --backend host --per-rank --dtype f32 --sizes "$SIZES" --iters "$ITERS" --warmup "$WARMUP" \
            --json > "$WORK/rank$r.json" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    while read -r b us wrong; do PROCS[$w,$b]="$us ($wrong wrong)"; done < <(cells < "$WORK/rank0.json")
done

echo "f32 sum, median of $ITERS calls after $WARMUP warm-up, each between two barriers; µs (#wrong)"
echo "machine: $(nproc) cores, $(uname -m), $(mpirun --version 2>/dev/null | head -1)"
echo
echo "| world | size | Open MPI | anyccl processes (--per-rank) | anyccl threads |"
echo "| ---: | ---: | ---: | ---: | ---: |"
for w in $WORLDS; do
    for b in $BYTES; do
        echo "| $w | $(numfmt --to=iec-i --suffix=B "$b") | ${MPI[$w,$b]:--} | ${PROCS[$w,$b]:--} | ${THREADS[$w,$b]:--} |"
    done
done
