"""anyccl against the installed vLLM (``-m vllm``; needs vLLM and torch, CPU only): vLLM's plugin loader finds
anyccl's entry point, loading it puts ``AnycclCustomAllreduce`` in vLLM's custom all-reduce slot, and the classes
match vLLM's ``CustomAllreduce`` and ``PyNcclCommunicator`` method for method (``inspect.signature`` side by side:
names, kinds, defaults)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, List

import pytest

pytestmark = pytest.mark.vllm

TARGET = "vllm.distributed.device_communicators.custom_all_reduce"
PYNCCL = "vllm.distributed.device_communicators.pynccl"
# vLLM's class's own helpers for its IPC buffers, which anyccl does not have (it shares memory through its
# bootstrap): static methods vLLM calls only from inside CustomAllreduce.
NOT_MATCHED = {"create_shared_buffer", "free_shared_buffer", "_complete_init"}


def vllm_class() -> Any:
    from anyccl.vllm import AnycclCustomAllreduce

    module = importlib.import_module(TARGET)
    return AnycclCustomAllreduce.replaced or module.CustomAllreduce


def methods(cls: Any, skip: Any = NOT_MATCHED) -> Dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, predicate=lambda m: inspect.isfunction(m) or inspect.ismethod(m))
        if (not name.startswith("_") or name == "__init__") and name not in skip
    }


def side_by_side(theirs_all: Dict[str, Any], mine_cls: Any) -> List[str]:
    """Every method of theirs that anyccl's class lacks or has with another signature (names, kinds, defaults)."""
    wrong = []
    for name, member in sorted(theirs_all.items()):
        mine_member = getattr(mine_cls, name, None)
        if mine_member is None:
            wrong.append(f"{name}: missing")
            continue
        theirs, mine = inspect.signature(member), inspect.signature(mine_member)
        side = [(p.name, p.kind, p.default) for p in theirs.parameters.values()]
        ours = [(p.name, p.kind, p.default) for p in mine.parameters.values()]
        if ours != side:
            wrong.append(f"{name}: vLLM {theirs} / anyccl {mine}")
    return wrong


def test_vllms_plugin_loader_finds_anyccl_and_the_slot_resolves_to_anyccl() -> None:
    from vllm.plugins import load_general_plugins, load_plugins_by_group

    from anyccl.vllm import AnycclCustomAllreduce

    found = load_plugins_by_group("vllm.general_plugins")
    assert "anyccl" in found, found
    load_general_plugins()
    module = importlib.import_module(TARGET)
    assert module.CustomAllreduce is AnycclCustomAllreduce
    assert AnycclCustomAllreduce.replaced is not None and AnycclCustomAllreduce.replaced.__name__ == "CustomAllreduce"
    # What vLLM's CudaCommunicator does when it makes a tensor-parallel group's communicator.
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    assert CustomAllreduce is AnycclCustomAllreduce


def test_every_method_of_vllms_custom_allreduce_is_here_with_the_same_signature() -> None:
    from anyccl.vllm import AnycclCustomAllreduce

    theirs_all = methods(vllm_class())
    assert {"__init__", "should_custom_ar", "custom_all_reduce", "capture", "close"} <= set(theirs_all)
    wrong = side_by_side(theirs_all, AnycclCustomAllreduce)
    assert not wrong, "\n".join(wrong)


def test_every_method_of_vllms_pynccl_communicator_is_here_with_the_same_signature() -> None:
    from anyccl.vllm import AnycclPyNcclCommunicator

    module = importlib.import_module(PYNCCL)
    theirs_all = methods(module.PyNcclCommunicator, skip=())
    # The calls the issue names, whatever else this vLLM has grown.
    assert {"__init__", "all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast"} <= set(theirs_all)
    wrong = side_by_side(theirs_all, AnycclPyNcclCommunicator)
    assert not wrong, "\n".join(wrong)
    # Return conventions: all_reduce returns its output; the output-first collectives return nothing.
    assert "return out_tensor" in inspect.getsource(module.PyNcclCommunicator.all_reduce)
    for name in ("all_gather", "reduce_scatter"):
        params = list(inspect.signature(getattr(module.PyNcclCommunicator, name)).parameters)
        assert params[1:3] == ["output_tensor", "input_tensor"], (name, params)


def test_capture_is_a_context_manager_on_both_and_disabled_is_an_attribute() -> None:
    from anyccl.vllm import AnycclCustomAllreduce

    for cls in (vllm_class(), AnycclCustomAllreduce):
        assert hasattr(cls.capture, "__wrapped__"), cls  # contextlib.contextmanager
        assert "self.disabled = True" in inspect.getsource(cls.__init__), cls  # off until it is set up
