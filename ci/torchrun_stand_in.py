#!/usr/bin/env python3
"""A stand-in for torchrun in CI: holds MASTER_PORT (as torchrun's agent store does), starts WORLD copies of PROGRAM
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and checks that every rank exits 0 within the
deadline and prints the expected line.

    ci/torchrun_stand_in.py WORLD EXPECTED_FORMAT PROGRAM [ARGS...]

EXPECTED_FORMAT is a Python format string with {rank} and {world}, e.g. "RESULT rank {rank} of {world}: 3".
"""
import os
import socket
import subprocess
import sys

DEADLINE_S = 60


def main() -> int:
    world, expected, program = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen(16)
    port = held.getsockname()[1]
    ranks = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen(program, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failed = False
    for rank, p in enumerate(ranks):
        try:
            out, _ = p.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            print(f"rank {rank} still ran after {DEADLINE_S} s", file=sys.stderr)
            return 1
        want = expected.format(rank=rank, world=world)
        print(f"--- rank {rank} (exit {p.returncode})\n{out}", end="")
        if p.returncode != 0 or want not in out.splitlines():
            print(f"rank {rank}: expected exit 0 and the line {want!r}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
