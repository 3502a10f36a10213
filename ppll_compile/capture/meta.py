"""Models built on the meta device: finding their meta tensors, their graphs' device constants, the runtime's error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import PPLLError, TraceError
from .fake_state import on_device

META = torch.device("meta")

MATERIALIZE_HELP = ("compile(model, ..., materialize=fn) with fn(stage_module, stage_index, device) filling the "
                    "stage's tensors, or compile(model, ..., state_dict=load) with load(stage_index, names) -> "
                    "{name: tensor} (or a whole state dict), or build the model off the meta device")
"""The ways to give a meta-built model's stages their values, as errors name them."""

PLANNED_ON_META = ("the model was planned on the meta device (no weights allocated); compile() materialises each "
                   "stage on its own device only: the model's own initialisation by default, materialize=fn(stage, "
                   "index, device) to fill a stage, or state_dict=load(index, names) to load pretrained weights "
                   "per stage")
"""The plan's note on a model planned on the meta device."""


def meta_names(module: nn.Module) -> list[str]:
    """The qualified names of ``module``'s parameters and buffers that are on the meta device."""
    return [k for k, t in (*module.named_parameters(remove_duplicate=False),
                           *module.named_buffers(remove_duplicate=False)) if t.is_meta]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built under ``torch.device("meta")``)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def input_device(values: Iterable[Any]) -> torch.device:
    """The device a meta model is planned for: the first example input's that is not meta, else the CPU."""
    for v in pytree.tree_leaves(list(values)):
        if isinstance(v, Tensor) and not v.is_meta:
            return v.device
    return torch.device("cpu")


@contextlib.contextmanager
def faked(model: nn.Module, device: torch.device) -> Iterator[tuple[FakeTensorMode, dict[int, Tensor]]]:
    """Within: ``model``'s parameters and buffers swapped for fake tensors standing on ``device`` (those on the meta
    device, and the others), so that ``torch.export`` captures a meta-built model as it captures the model built
    on ``device`` (a kernel's meta implementation may lay its output out unlike the device's). Yields the fake mode
    (for the inputs) and, by id of each fake, the model's own tensor, which :func:`unfake` puts back in a graph."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, Tensor] = {}
    own: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    try:
        # each module once, however many names it has (a module shared by several parents is put back once, with
        # its own tensors: swapping name by name would put a shared module's fakes back as its originals)
        for m in model.modules():
            for table in (m._parameters, m._buffers):
                for k, t in table.items():
                    if t is None:
                        continue
                    f = fakes.get(id(t))
                    if f is None:
                        f = fakes[id(t)] = on_device(mode.from_tensor(t), device)
                        own[id(f)] = t
                    swapped.append((table, k, t))
                    table[k] = f
        yield mode, own
    finally:
        for table, k, t in reversed(swapped):
            table[k] = t


def unfake(gm: fx.GraphModule, own: dict[int, Tensor]) -> None:
    """Point ``gm``'s attributes that are fakes made by :func:`faked` back at the model's own tensors; a fake tensor
    left over (a constant the forward computed) is an error, as no value stands behind it."""
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        path, _, name = str(n.target).rpartition(".")
        holder = gm.get_submodule(path)
        value = getattr(holder, name)
        if id(value) in own:
            target = own[id(value)]
            if isinstance(target, nn.Parameter):
                holder.register_parameter(name, target) if name in holder._parameters else setattr(holder, name, target)
            elif name in holder._buffers:
                holder._buffers[name] = target
            else:
                setattr(holder, name, target)
        elif isinstance(value, FakeTensor):
            raise TraceError(f"capturing the meta-built model left {n.target!r}, a tensor its forward computes, "
                             f"without a value; build the model off the meta device, or with tracer='fx'")


def check_materialized(stage: int, module: nn.Module | None, head: nn.Module | None) -> None:
    """Refuse to run stage ``stage`` while its own parameters and buffers, or its head's, are on the meta device:
    the error says what to materialise and how."""
    for what, m in ((f"stage {stage}", module), (f"stage {stage}'s head", head)):
        names = meta_names(m) if m is not None else []
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise PPLLError(f"{what} holds {len(names)} tensor(s) on the meta device ({shown}), "
                            f"which have no values to run on; materialise stage {stage} on this process: "
                            f"{MATERIALIZE_HELP}")


def check_real_batch(values: Any) -> None:
    """Refuse a batch (inputs or labels) on the meta device: it has no values to train or evaluate on."""
    meta = [tuple(v.shape) for v in pytree.tree_leaves(values) if isinstance(v, Tensor) and v.is_meta]
    if meta:
        raise PPLLError(f"the batch holds a tensor on the meta device (shape {meta[0]}), which has no values to "
                        f"train or evaluate on; feed real tensors (meta example inputs serve planning only)")
