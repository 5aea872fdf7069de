"""anyccl's vLLM general plugin: puts anyccl in vLLM's custom all-reduce slot, with no change to vLLM's source.

Installing anyccl registers the entry point ``anyccl = "anyccl.vllm_plugin:register"`` in the group
``vllm.general_plugins``, which vLLM loads in every process it starts (``vllm.plugins.load_general_plugins``; vLLM's
``VLLM_PLUGINS`` selects plugins by name). ``register()`` then replaces the name ``CustomAllreduce`` in
``vllm.distributed.device_communicators.custom_all_reduce`` by ``anyccl.vllm.AnycclCustomAllreduce``: vLLM's
``CudaCommunicator`` imports that name when it makes a tensor-parallel group's communicator, so the group's
``ca_comm`` is anyccl's, and vLLM's own checks (``should_custom_ar``) and fallback to pynccl stay as they are.

``ANYCCL_VLLM_PLUGIN=0`` turns the plugin off. Without vLLM (or torch) importable it does nothing and says why.
Calling it again does nothing more: vLLM may load plugins several times in one process.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Optional

__all__ = ["register", "ENV_SWITCH", "TARGET_MODULE"]

#: The environment variable that turns the plugin off ("0", "false", "off", "no").
ENV_SWITCH = "ANYCCL_VLLM_PLUGIN"
#: The vLLM module whose ``CustomAllreduce`` the plugin replaces.
TARGET_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"

logger = logging.getLogger("anyccl.vllm_plugin")


def register() -> Optional[str]:
    """vLLM's plugin hook. Returns what it did, as one line (also logged): "registered: ...", or why it did
    nothing ("off: ...", "skipped: ...")."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return _say(f"off: {ENV_SWITCH}={os.environ[ENV_SWITCH]}; vLLM keeps its own custom all-reduce")
    if importlib.util.find_spec("vllm") is None:
        return _say("skipped: vLLM is not importable in this Python (pip install 'anyccl[vllm]')")
    if importlib.util.find_spec("torch") is None:
        return _say("skipped: torch is not importable; anyccl's vLLM classes need it")
    try:
        target = importlib.import_module(TARGET_MODULE)
    except Exception as e:  # vLLM's own import failed, or the module moved: leave vLLM as it is
        return _say(f"skipped: cannot import {TARGET_MODULE} ({type(e).__name__}: {e}); vLLM keeps its own")
    from .vllm import AnycclCustomAllreduce

    current = getattr(target, "CustomAllreduce", None)
    if current is AnycclCustomAllreduce:
        return "registered: already"
    if current is None:
        return _say(f"skipped: {TARGET_MODULE} has no CustomAllreduce; this vLLM is not one anyccl knows")
    AnycclCustomAllreduce.replaced = current
    target.CustomAllreduce = AnycclCustomAllreduce  # type: ignore[attr-defined]
    return _say(f"registered: {TARGET_MODULE}.CustomAllreduce is anyccl.vllm.AnycclCustomAllreduce")


def _say(line: str) -> str:
    logger.info("anyccl vLLM plugin %s", line)
    return line
