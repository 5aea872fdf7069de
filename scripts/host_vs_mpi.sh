#!/usr/bin/env bash
# Open MPI's MPI_Allreduce and anyccl's host backend (threads, and one process per rank) side by side, measured the
# same way in one run: sum; each timed call between two barriers (barrier, all-reduce, barrier); the median of the
# timed calls after untimed warm-up ones; processes report the average of the ranks' medians, threads rank 0's;
# anyccl's cells are the selector's choice ("auto"), out of place. Placement as mpirun's default: mpirun binds each
# rank to a core of its own when the ranks fit on the cores, and anyccl's ranks get the same (`bench --bind`); with
# more ranks than cores neither is bound. anyccl runs f32 and bf16; Open MPI has no bf16,
# so its f32 time is the reference for both (the ratio columns divide by it). `#wrong` adds up the elements that
# differ from the exact result in every cell of the row (Open MPI's own check included): it must stay 0.
#
# Usage: scripts/host_vs_mpi.sh [WORLDS] [SIZES] [ITERS]
#   WORLDS  space-separated world sizes           (default "2 4 8"; above the core count the ranks oversubscribe)
#   SIZES   comma-separated sizes, KiB/MiB suffix (default 4KiB,64KiB,1MiB,16MiB,64MiB)
#   ITERS   timed calls per cell up to 64 KiB     (default 200); larger sizes get ITERS * 64 KiB / size, at least 5
# Environment: ANYCCL_BIN (an anyccl binary to use instead of building one), WARMUP (default 20; larger sizes get a
#   fifth of their timed calls, at least 1), PORT (the first rendezvous port for the per-rank runs, default 29600),
#   DTYPES (anyccl's element types, default "f32 bf16").
#
# Installs Debian's Open MPI (openmpi-bin, libopenmpi-dev) with apt-get when mpicc is missing. Running as root needs
# --allow-run-as-root; worlds larger than the core count need --oversubscribe (both are passed).
set -euo pipefail

WORLDS=${1:-"2 4 8"}
SIZES=${2:-4KiB,64KiB,1MiB,16MiB,64MiB}
ITERS=${3:-200}
WARMUP=${WARMUP:-20}
PORT=${PORT:-29600}
DTYPES=${DTYPES:-"f32 bf16"}
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
    a = r["auto"]  # out of place (the in-place cells are under r["in_place"])
    print(r["bytes"], "%.2f" % a["median_us"], a.get("wrong") or 0)
'
}

# Timed calls and warm-up calls for a size.
iters_for() { local b=$1 n; n=$((ITERS * 65536 / b)); ((n > ITERS)) && n=$ITERS; ((n < 5)) && n=5; echo "$n"; }
warmup_for() { local n=$1 w; w=$((n / 5)); ((w > WARMUP)) && w=$WARMUP; ((w < 1)) && w=1; echo "$w"; }

MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
declare -A CELL WRONG
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
port=$PORT
for w in $WORLDS; do
    for b in $BYTES; do
        n=$(iters_for "$b")
        wu=$(warmup_for "$n")
        echo "world $w, $b bytes: $n calls" >&2
        read -r _ us wrong < <("${MPIRUN[@]}" -np "$w" "$WORK/allreduce" "$n" "$wu" "$b")
        CELL[$w,$b,mpi]=$us
        WRONG[$w,$b]=$wrong
        for dt in $DTYPES; do
            read -r _ us wrong < <("$ANYCCL" bench --backend host --bind --world "$w" --dtype "$dt" --sizes "$b" \
                --algos two-shot --iters "$n" --warmup "$wu" --json | cells)
            CELL[$w,$b,threads,$dt]=$us
            WRONG[$w,$b]=$((WRONG[$w,$b] + wrong))
            port=$((port + 1))
            pids=()
            for ((r = 0; r < w; r++)); do
                RANK=$r LOCAL_RANK=$r WORLD_SIZE=$w LOCAL_WORLD_SIZE=$w MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                    "$ANYCCL" bench --backend host --bind --per-rank --dtype "$dt" --sizes "$b" --algos two-shot \
                    --iters "$n" --warmup "$wu" --json > "$WORK/rank$r.json" &
                pids+=($!)
            done
            for p in "${pids[@]}"; do wait "$p"; done
            read -r _ us wrong < <(cells < "$WORK/rank0.json")
            CELL[$w,$b,procs,$dt]=$us
            WRONG[$w,$b]=$((WRONG[$w,$b] + wrong))
        done
    done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# "µs (ratio×)" against Open MPI's f32 median.
cell() {
    python3 -c 'import sys; v, m = float(sys.argv[1]), float(sys.argv[2]); print("%s (%.2fx)" % (sys.argv[1], v / m))' "$1" "$2"
}

echo "sum; median of the timed calls (ITERS=$ITERS up to 64 KiB, fewer above), each between two barriers; µs, and in"
echo "brackets the ratio to Open MPI's f32 median (below 1: anyccl faster); anyccl: the selector's choice, out of place;"
echo "ranks bound to cores of their own where they fit (mpirun's default; anyccl bench --bind), unbound when oversubscribed"
echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')), $(uname -m), $(mpirun --version 2>/dev/null | head -1)"
echo "load average (1, 5, 15 min): $LOAD_START at the start, $LOAD_END at the end"
echo
hdr="| world | size | Open MPI f32"
sep="| ---: | ---: | ---:"
for dt in $DTYPES; do
    hdr+=" | processes $dt | threads $dt"
    sep+=" | ---: | ---:"
done
echo "$hdr | #wrong |"
echo "$sep | ---: |"
for w in $WORLDS; do
    for b in $BYTES; do
        m=${CELL[$w,$b,mpi]}
        row="| $w | $(numfmt --to=iec-i --suffix=B "$b") | $m"
        for dt in $DTYPES; do
            row+=" | $(cell "${CELL[$w,$b,procs,$dt]}" "$m") | $(cell "${CELL[$w,$b,threads,$dt]}" "$m")"
        done
        echo "$row | ${WRONG[$w,$b]} |"
    done
done
