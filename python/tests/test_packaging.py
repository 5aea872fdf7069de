"""What the installed package says about itself: its metadata (readme, licence, extras), the vLLM plugin's entry
point and what the plugin does without vLLM, what the build holds (``anyccl.capabilities()``), and the source tree
not shadowing the installed package when the tests or Python are started in python/."""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import anyccl
from anyccl import vllm_plugin

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def test_the_metadata_has_the_readme_the_licence_and_the_extras() -> None:
    meta = md.metadata("anyccl")
    assert meta["License-Expression"] == "Apache-2.0 OR MIT"
    assert meta["Description-Content-Type"].startswith("text/markdown")
    body = meta.get_payload() or ""  # type: ignore[attr-defined]
    assert body.startswith("# anyccl for Python"), body[:80]
    assert {"numpy", "torch", "vllm"} <= set(meta.get_all("Provides-Extra") or [])
    requires = md.requires("anyccl") or []
    assert any(r.replace(" ", "").startswith("vllm;extra==") for r in requires), requires
    assert any(r.replace(" ", "").startswith("torch;extra==") for r in requires), requires
    assert not [r for r in requires if "extra ==" not in r], requires  # no required dependency
    licences = sorted((f for f in md.files("anyccl") or [] if "licenses/" in str(f)), key=str)
    assert [f.name for f in licences] == ["LICENSE-APACHE", "LICENSE-MIT"], licences
    assert "Apache License" in Path(str(licences[0].locate())).read_text(encoding="utf-8")
    assert "Permission is hereby granted, free of charge" in Path(str(licences[1].locate())).read_text(encoding="utf-8")


def test_the_vllm_plugin_entry_point_is_installed() -> None:
    eps = md.entry_points(group="vllm.general_plugins")
    mine = [ep for ep in eps if ep.name == "anyccl"]
    assert len(mine) == 1, list(eps)
    assert mine[0].value == "anyccl.vllm_plugin:register"
    assert mine[0].load() is vllm_plugin.register


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed: see test_vllm_signatures"
)
def test_the_plugin_without_vllm_does_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="anyccl.vllm_plugin"):
        said = vllm_plugin.register()
    assert said is not None and said.startswith("skipped: vLLM is not importable"), said
    assert "vllm" not in sys.modules
    assert any("skipped: vLLM is not importable" in r.getMessage() for r in caplog.records)


def test_the_plugin_turned_off_does_nothing_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for off in ("0", "off", "False"):
        monkeypatch.setenv("ANYCCL_VLLM_PLUGIN", off)
        said = vllm_plugin.register()
        assert said is not None and said.startswith("off: ANYCCL_VLLM_PLUGIN="), said
    assert "vllm" not in sys.modules


def test_the_sglang_plugin_entry_point_is_installed() -> None:
    from anyccl import sglang_plugin

    eps = md.entry_points(group="sglang.srt.plugins")
    mine = [ep for ep in eps if ep.name == "anyccl"]
    assert len(mine) == 1, list(eps)
    assert mine[0].value == "anyccl.sglang_plugin:register"
    assert mine[0].load() is sglang_plugin.register
    assert any(r.replace(" ", "").startswith("sglang;extra==") for r in md.requires("anyccl") or [])


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("sglang") is not None, reason="SGLang is installed: see test_sglang_signatures"
)
def test_the_sglang_plugin_without_sglang_does_nothing_and_says_so() -> None:
    from anyccl import sglang_plugin

    said = sglang_plugin.register()
    assert said is not None and said.startswith("skipped: SGLang is not importable"), said
    assert "sglang" not in sys.modules


def test_the_sglang_plugin_turned_off_does_nothing_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from anyccl import sglang_plugin

    monkeypatch.setenv("ANYCCL_SGLANG_PLUGIN", "0")
    said = sglang_plugin.register()
    assert said is not None and said.startswith("off: ANYCCL_SGLANG_PLUGIN=0"), said
    assert "sglang" not in sys.modules


def test_capabilities_says_whether_the_gpu_kernels_are_built_in() -> None:
    caps = anyccl.capabilities()
    assert caps["version"] == anyccl.__version__
    assert caps["cuda_backend"] is anyccl.CUDA_COMPILED_IN
    assert caps["cuda_kernels"] is (anyccl.CUDA_KERNELS_NOT_BUILT is None)
    assert caps["backends"] == anyccl.backends()
    if caps["cuda_kernels"]:
        assert caps["cuda_kernels_missing"] is None and caps["nvcc"], caps
    else:
        # The build's own words: nvcc was not found when the wheel was built (or CUDA is not compiled in).
        assert caps["cuda_kernels_missing"] and caps["nvcc"] is None, caps
        assert "nvcc" in caps["cuda_kernels_missing"] or not caps["cuda_backend"], caps


def test_python_m_pytest_started_in_python_dir_tests_the_installed_package() -> None:
    """`cd python && python -m pytest` puts python/ (the source, no compiled extension) first on sys.path."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_packaging.py", "-k", "capabilities"],
        cwd=PACKAGE_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout, out.stdout


def test_importing_the_source_tree_says_to_install_the_package() -> None:
    if any((PACKAGE_ROOT / "anyccl").glob("_anyccl*.so")):
        pytest.fail("python/anyccl holds a built extension (maturin develop?): this test needs the source tree bare")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", "import anyccl"], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode != 0
    assert "uncompiled source tree" in out.stderr and "pip install ./python" in out.stderr, out.stderr
    assert "circular import" not in out.stderr, out.stderr
