"""anyccl's SGLang general plugin: puts anyccl in SGLang's custom all-reduce slot, with no change to SGLang's source.

Installing anyccl registers the entry point ``anyccl = "anyccl.sglang_plugin:register"`` in the group
``sglang.srt.plugins``, which SGLang loads in its processes (``sglang.srt.plugins.load_plugins``; SGLang's
``SGLANG_PLUGINS`` selects plugins by name). ``register()`` then registers, through SGLang's own hook registry
(``HookRegistry.register(..., HookType.REPLACE)``, applied by ``load_plugins``), a replacement of
``sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce`` that returns
``anyccl.sglang.AnycclSglangCustomAllreduce``: SGLang's ``GroupCoordinator`` calls it when it makes a tensor-parallel
group's custom all-reduce, so the group's ``ca_comm`` is anyccl's, and SGLang's checks (``should_custom_ar``) and
fallback to NCCL stay as they are. SGLang's ``PyNcclCommunicator`` slot is left alone (SGLang makes it directly, with
no hook, and drives it through ``change_state``).

``ANYCCL_SGLANG_PLUGIN=0`` turns the plugin off. Without SGLang (or torch) importable it does nothing and says why.
Calling it again does nothing more.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Any, Optional

__all__ = ["register", "ENV_SWITCH", "TARGET"]

#: The environment variable that turns the plugin off ("0", "false", "off", "no").
ENV_SWITCH = "ANYCCL_SGLANG_PLUGIN"
#: The SGLang function the plugin replaces.
TARGET = "sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce"

logger = logging.getLogger("anyccl.sglang_plugin")
_registered = False


def dispatch_custom_allreduce(*args: Any, **kwargs: Any) -> Any:
    """SGLang's ``dispatch_custom_allreduce(group=, device=)``, answering anyccl's class whatever the platform."""
    from .sglang import AnycclSglangCustomAllreduce

    return AnycclSglangCustomAllreduce


def register() -> Optional[str]:
    """SGLang's plugin hook. Returns what it did, as one line (also logged): "registered: ...", or why it did
    nothing ("off: ...", "skipped: ...")."""
    global _registered
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return _say(f"off: {ENV_SWITCH}={os.environ[ENV_SWITCH]}; SGLang keeps its own custom all-reduce")
    if importlib.util.find_spec("sglang") is None:
        return _say("skipped: SGLang is not importable in this Python (pip install 'anyccl[sglang]')")
    if importlib.util.find_spec("torch") is None:
        return _say("skipped: torch is not importable; anyccl's SGLang class needs it")
    if _registered:
        return "registered: already"
    try:
        hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
        module = importlib.import_module(TARGET.rsplit(".", 1)[0])
    except Exception as e:  # SGLang's own import failed, or the modules moved: leave SGLang as it is
        return _say(f"skipped: cannot import SGLang's hook registry or {TARGET} ({type(e).__name__}: {e})")
    if not hasattr(module, "dispatch_custom_allreduce") or not hasattr(hooks, "HookRegistry"):
        return _say(f"skipped: {TARGET} or SGLang's HookRegistry is missing; this SGLang is not one anyccl knows")
    from .sglang import AnycclSglangCustomAllreduce

    AnycclSglangCustomAllreduce.replaced = getattr(module, "CustomAllreduce", None)
    hooks.HookRegistry.register(TARGET, dispatch_custom_allreduce, hooks.HookType.REPLACE)
    _registered = True
    return _say(f"registered: {TARGET} answers anyccl.sglang.AnycclSglangCustomAllreduce (applied by load_plugins)")


def _say(line: str) -> str:
    logger.info("anyccl SGLang plugin %s", line)
    return line
