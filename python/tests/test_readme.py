"""The README's Python snippets, run as written: every ```python block of python/README.md and of the repository's
README.md. A snippet that makes its communicator with ``Communicator.from_env()`` runs as 2 processes under
ci/torchrun_stand_in.py (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set as torchrun sets them); a
snippet that needs torch and CUDA GPUs is marked ``gpu`` (run with ``-m gpu``: the blocks of python/README.md that
use torch run in order in one namespace, on 2 GPUs, after a prelude that makes ``comm``, ``x``, ``residual`` and
``weight``). Run without a launcher, the from_env snippet fails with the error that says how to launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "python" / "README.md", ROOT / "README.md"]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

# Appended to a from_env snippet that all-reduces `x` (each rank's rank + 1): the result every rank must hold.
HOST_CHECK = textwrap.dedent(
    """
    import os as _os
    _world = int(_os.environ["WORLD_SIZE"])
    assert (x == _world * (_world + 1) // 2).all(), x[:4]
    print(f"SNIPPET OK rank {_os.environ['RANK']} of {_world}")
    """
)

# Before the GPU blocks of python/README.md (they continue one another: `h` is made in the first and used in the
# next): what the README leaves to the reader.
GPU_PRELUDE = textwrap.dedent(
    """
    import os
    import torch
    import anyccl
    comm = anyccl.Communicator.from_env("cuda")
    torch.cuda.set_device(comm.device_index)
    x = torch.ones(8, 1024, dtype=torch.bfloat16, device="cuda")
    residual = torch.zeros_like(x)
    weight = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    """
)
GPU_CHECK = textwrap.dedent(
    """
    torch.cuda.synchronize()
    print(f"SNIPPET OK rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}")
    """
)


def snippets(path: Path) -> List[Tuple[str, str]]:
    """The ```python blocks of `path`, each with an id (file name and first line number)."""
    text = path.read_text(encoding="utf-8")
    return [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 2}", m.group(1)) for m in FENCE.finditer(text)]


ALL = [s for p in READMES for s in snippets(p)]
TORCH = re.compile(r"\btorch\b")  # torch itself (not "torchrun", not "torch_ops")
HOST = [(i, code) for i, code in ALL if not TORCH.search(code)]
GPU = [(i, code) for i, code in snippets(READMES[0]) if TORCH.search(code)]


def test_the_readmes_have_the_snippets_this_file_expects() -> None:
    """A snippet added, removed or rewritten to need torch shows here, so that each is run by one test below."""
    assert len(HOST) == 2, [i for i, _ in HOST]  # the from_env snippet, in both READMEs
    assert all("Communicator.from_env()" in code and "comm.all_reduce(x)" in code for _, code in HOST)
    assert len(GPU) == 2, [i for i, _ in GPU]  # torch ops + graphs, the fused call
    # A torch snippet in the repository's README would be run by none of the tests below.
    assert not [i for p in READMES[1:] for i, c in snippets(p) if TORCH.search(c)]


def run_under_launcher(tmp_path: Path, code: str, world: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "ci" / "torchrun_stand_in.py"),
            str(world),
            "SNIPPET OK rank {rank} of {world}",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("where,code", HOST, ids=[i for i, _ in HOST])
def test_host_snippet_with_two_processes(tmp_path: Path, where: str, code: str) -> None:
    out = run_under_launcher(tmp_path, code + HOST_CHECK)
    assert out.returncode == 0, f"{where}\n{out.stdout}{out.stderr}"
    assert out.stdout.count("SNIPPET OK rank") == 2, out.stdout
    assert "'algorithm'" in out.stdout, out.stdout  # the snippet's own print of last_selection


@pytest.mark.parametrize("where,code", HOST, ids=[i for i, _ in HOST])
def test_from_env_snippet_without_a_launcher_says_how_to_launch(tmp_path: Path, where: str, code: str) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode != 0
    assert "anyccl.InvalidArgumentError" in out.stderr or "InvalidArgumentError" in out.stderr, out.stderr
    assert "torchrun --nproc-per-node" in out.stderr and "WORLD_SIZE" in out.stderr, out.stderr
    assert "WORLD_SIZE: not set" not in out.stderr, out.stderr


@pytest.mark.gpu
def test_gpu_snippets_on_two_gpus(tmp_path: Path) -> None:
    """python/README.md's torch blocks in order, 2 ranks on 2 GPUs (fails, not skips, with fewer)."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    assert torch.cuda.device_count() >= 2, "the README's GPU snippets need 2 GPUs (the fused call refuses world 1)"
    code = GPU_PRELUDE + "".join(c for _, c in GPU) + GPU_CHECK
    out = run_under_launcher(tmp_path, code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SNIPPET OK rank") == 2, out.stdout
