"""A user's batch as the message stage 0 receives: the inputs bound and checked against the plan, and the labels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..capture.meta import check_real_batch
from ..lower.stages import Lowered
from ..plans.plan import Plan, TensorSpec
from .messages import Message, dtype_of, shape_text


def _expected(spec: TensorSpec) -> str:
    return shape_text(("N", *spec.shape[1:]))


def check_inputs(specs: Sequence[TensorSpec], values: Sequence[Any]) -> int:
    """The batch size of ``values``, after checking each tensor against its spec (any dimension 0); 1 if none."""
    batch = None
    for spec, v in zip(specs, values):
        dtype = dtype_of(spec)
        if dtype is None:
            continue
        if not isinstance(v, Tensor):
            raise TypeError(f"input {spec.name!r} must be a tensor of shape {_expected(spec)} and "
                            f"dtype {spec.dtype}; got {type(v).__name__}")
        if v.dtype != dtype or v.dim() != len(spec.shape) or tuple(v.shape[1:]) != spec.shape[1:]:
            raise ValueError(f"input {spec.name!r} has shape {shape_text(v.shape)} and dtype "
                             f"{str(v.dtype).removeprefix('torch.')}; the plan expects "
                             f"{_expected(spec)} {spec.dtype} (N = any batch size). Compile with "
                             f"example inputs of the shape you train on")
        batch = batch if batch is not None else int(v.shape[0])
    return batch if batch is not None else 1


def batch_message(plan: Plan, lowered: Lowered, inputs: Any, target: Any, *, index: int, kind: str,
                  carry_raw: bool) -> Message:
    """The message of batch ``index`` for stage 0: ``inputs`` bound to the model's signature and checked.

    ``inputs`` is a tensor, a tuple of positional inputs or a dict of keyword inputs. A ``pipebd`` plan
    needs no labels (``target=None`` becomes one zero per row); ``carry_raw`` keeps the first input tensor
    for the heads that reconstruct it.
    """
    if isinstance(inputs, dict):
        values = lowered.inputs.bind(**inputs)
    elif isinstance(inputs, (tuple, list)):
        values = lowered.inputs.bind(*inputs)
    else:
        values = lowered.inputs.bind(inputs)
    check_real_batch((values, target))
    batch = check_inputs(plan.inputs, values)
    if batch == 0:
        raise ValueError(f"batch {index} is empty (0 examples): nothing to train on, and a mean loss over no "
                         f"examples is NaN; skip empty batches (e.g. DataLoader(drop_last=True) when a sampler can "
                         f"leave one empty)")
    if target is None and plan.mode == "pipebd":  # distillation needs no labels; rows travel with the batch
        target = torch.zeros(batch, dtype=torch.int64)
    if isinstance(target, Tensor) and target.dim() and target.shape[0] != batch:
        raise ValueError(f"target has {target.shape[0]} rows but the inputs have batch size {batch}; "
                         f"pass one label per example")
    raw = next((v for v in values if isinstance(v, Tensor)), None) if carry_raw else None
    return Message(index=index, values=values, target=target, raw=raw, kind=kind)


def loader_pair(item: Any) -> tuple[Any, Any]:
    """An item of a loader as ``(inputs, target)``; a loader must yield such pairs."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    raise ValueError(f"a loader must yield (inputs, target) pairs; got {type(item).__name__}"
                     + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
