"""The examples that need no torch, run as users run them: torchrun's environment (ci/torchrun_stand_in.py holds
MASTER_PORT as torchrun's agent does) and ranks as processes meeting through a unique id."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world", [2, 3])
def test_from_env_under_a_torchrun_stand_in(world: int) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ci" / "torchrun_stand_in.py"),
            str(world),
            "RESULT rank {rank} of {world}: " + f"{world * (world + 1) // 2}",
            sys.executable,
            str(ROOT / "examples" / "python" / "torchrun_allreduce.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("RESULT rank") == world


def test_the_numpy_example_with_three_processes() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python" / "host_numpy.py"), "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in range(3):
        want = f"RESULT rank {rank} of 3: sum 6, gathered [0, 1, 2], reduce_scatter [3.0, 3.0, 3.0, 3.0]"
        assert want in out.stdout, out.stdout
