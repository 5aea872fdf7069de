"""Makes the tests import the installed anyccl, wherever pytest is started.

``python -m pytest`` puts the directory it is started in first on ``sys.path``; started in ``python/``, that is the
source tree, whose ``anyccl/`` has no compiled ``_anyccl`` extension, and it would shadow the installed package.
The source directory is taken off ``sys.path`` here unless it holds a built extension (``maturin develop`` puts one
there); when no installed anyccl is found either, the run stops with the command that installs it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # python/: holds anyccl/ (the source) and pyproject.toml


def _built_in_place() -> bool:
    return any((_PACKAGE_ROOT / "anyccl").glob("_anyccl*.so")) or any((_PACKAGE_ROOT / "anyccl").glob("_anyccl*.pyd"))


def _is_source_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == _PACKAGE_ROOT
    except OSError:
        return False


if not _built_in_place():
    sys.path[:] = [entry for entry in sys.path if not _is_source_root(entry)]
    if importlib.util.find_spec("anyccl") is None:
        raise pytest.UsageError(
            "anyccl is not installed in this Python; the tests run against the installed package. Install it "
            f"first: `pip install {_PACKAGE_ROOT}` (or `maturin develop -m {_PACKAGE_ROOT / 'Cargo.toml'}` in a "
            "virtual environment), then run pytest again."
        )
