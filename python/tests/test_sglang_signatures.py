"""anyccl against the installed SGLang (``-m sglang``; needs SGLang and torch, CPU only): SGLang's plugin loader finds
anyccl's entry point, loading it makes SGLang's ``dispatch_custom_allreduce`` answer anyccl's class, and that class
matches SGLang's ``CustomAllreduce`` method for method (``inspect.signature`` side by side: names, kinds, defaults)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, List

import pytest

pytestmark = pytest.mark.sglang

MODULE = "sglang.srt.distributed.device_communicators.custom_all_reduce"
# SGLang's class's own helpers for its IPC buffers, which anyccl does not have (it shares memory through its
# bootstrap): static methods SGLang calls only from inside CustomAllreduce.
NOT_MATCHED = {"create_shared_buffer", "free_shared_buffer"}


def methods(cls: Any) -> Dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, predicate=lambda m: inspect.isfunction(m) or inspect.ismethod(m))
        if (not name.startswith("_") or name == "__init__") and name not in NOT_MATCHED
    }


def test_sglangs_plugin_loader_finds_anyccl_and_the_slot_resolves_to_anyccl() -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group

    from anyccl.sglang import AnycclSglangCustomAllreduce

    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "anyccl" in found, found
    load_plugins()
    module = importlib.import_module(MODULE)
    # What SGLang's GroupCoordinator does when it makes a tensor-parallel group's custom all-reduce.
    assert module.dispatch_custom_allreduce(group=None, device="cpu") is AnycclSglangCustomAllreduce
    assert AnycclSglangCustomAllreduce.replaced is module.CustomAllreduce


def test_every_method_of_sglangs_custom_allreduce_is_here_with_the_same_signature() -> None:
    from anyccl.sglang import AnycclSglangCustomAllreduce

    theirs_all = methods(importlib.import_module(MODULE).CustomAllreduce)
    assert {"__init__", "should_custom_ar", "custom_all_reduce", "capture", "close"} <= set(theirs_all)
    wrong: List[str] = []
    for name, member in sorted(theirs_all.items()):
        mine_member = getattr(AnycclSglangCustomAllreduce, name, None)
        if mine_member is None:
            wrong.append(f"{name}: missing")
            continue
        theirs, mine = inspect.signature(member), inspect.signature(mine_member)
        side = [(p.name, p.kind, p.default) for p in theirs.parameters.values()]
        ours = [(p.name, p.kind, p.default) for p in mine.parameters.values()]
        if ours != side:
            wrong.append(f"{name}: SGLang {theirs} / anyccl {mine}")
    assert not wrong, "\n".join(wrong)


def test_capture_is_a_context_manager_on_both() -> None:
    from anyccl.sglang import AnycclSglangCustomAllreduce

    for cls in (importlib.import_module(MODULE).CustomAllreduce, AnycclSglangCustomAllreduce):
        assert hasattr(cls.capture, "__wrapped__"), cls  # contextlib.contextmanager
