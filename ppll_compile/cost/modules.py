"""Measure a whole module (an auxiliary head) on meta tensors: its FLOPs, operators and bytes saved for backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..capture.fake_state import storage_id
from .flops import flop_counter
from .oplog import Op, OpLog


@dataclass(frozen=True, kw_only=True)
class ModuleCost:
    """Measured cost of a whole module (an auxiliary head) at one input shape."""

    flops_fwd: int
    """Forward FLOPs."""
    flops_bwd: int
    """Backward FLOPs."""
    param_count: int
    """Number of parameters."""
    activation_bytes: int
    """Bytes saved for backward."""
    input_saved_bytes: int = 0
    """Of those, the bytes of the input itself (saved by the module's first layers): a stage that saves its output
    already holds them."""
    ops: tuple[Op, ...] = ()
    """Every operator of the forward and backward, with its FLOPs and bytes (for the roofline)."""


def measure_module(module: nn.Module, run: Callable[[], Any], inputs: Sequence[Tensor] = ()) -> ModuleCost:
    """Forward and backward FLOPs, operators and saved bytes of ``run()``, a forward pass (or loss) of ``module`` on
    ``inputs`` (those of them that require grad get their gradient computed, as a stage's output does).

    Build the module under ``torch.device("meta")`` and feed it meta tensors to measure without allocating.
    """
    params = list(module.parameters())
    param_storages = {storage_id(p) for p in params}
    buffer_storages = {storage_id(b) for b in module.buffers()}
    input_storages = {storage_id(t) for t in inputs}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = storage_id(t)
        if s not in param_storages and s not in buffer_storages:
            saved[s] = max(saved.get(s, 0), t.untyped_storage().nbytes())
        return t

    with flop_counter() as fwd, OpLog() as log, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    grads = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    bwd = 0
    if grads:
        ones = [torch.ones_like(g) for g in grads]
        with flop_counter() as bwd_counter, log:
            torch.autograd.backward(grads, ones)
        bwd = bwd_counter.get_total_flops()
    return ModuleCost(flops_fwd=fwd.get_total_flops(), flops_bwd=bwd,
                      param_count=sum(p.numel() for p in params), activation_bytes=sum(saved.values()),
                      input_saved_bytes=sum(b for s, b in saved.items() if s in input_storages), ops=tuple(log.ops))
