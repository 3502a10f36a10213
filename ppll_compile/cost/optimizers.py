"""The optimizer kinds a plan costs (``sgd``, ``momentum``, ``adam``): one table of what each keeps and streams."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["OptimizerSpec", "OPTIMIZERS", "optimizer_spec"]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One optimizer kind a plan can cost."""

    name: str
    """The plan's name for it (``optimizer=`` of :func:`ppll_compile.plan`)."""
    states: int
    """State tensors kept per parameter tensor, each of the parameter's size (SGD none, momentum its buffer, Adam its
    two moments): the plan counts ``states`` times the gradient bytes of optimizer memory."""
    make: Callable[[Sequence[nn.Parameter], float, bool | None], torch.optim.Optimizer]
    """``make(params, lr, foreach)``: a torch optimizer of this kind, as a timing builds it."""

    @property
    def step_reads(self) -> int:
        """Tensors the step reads per parameter tensor: the parameter, its gradient and every state tensor."""
        return 2 + self.states

    @property
    def step_writes(self) -> int:
        """Tensors the step writes per parameter tensor: the parameter and every state tensor."""
        return 1 + self.states


OPTIMIZERS: dict[str, OptimizerSpec] = {o.name: o for o in (
    OptimizerSpec(name="sgd", states=0, make=lambda p, lr, foreach: torch.optim.SGD(p, lr=lr, foreach=foreach)),
    OptimizerSpec(name="momentum", states=1,
                  make=lambda p, lr, foreach: torch.optim.SGD(p, lr=lr, momentum=0.9, foreach=foreach)),
    OptimizerSpec(name="adam", states=2, make=lambda p, lr, foreach: torch.optim.Adam(p, lr=lr, foreach=foreach)),
)}
"""The optimizer kinds, by name: the one table the cost model, the roofline, timing and the trainer's check read."""

OPTIMIZER_STATES = {name: o.states for name, o in OPTIMIZERS.items()}
"""Optimizer state tensors kept per parameter tensor, by kind (read from :data:`OPTIMIZERS`)."""


def optimizer_spec(name: str) -> OptimizerSpec:
    """The kind ``name``; a ValueError listing the known kinds for any other."""
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer kind {name!r}; known kinds: {', '.join(OPTIMIZERS)} (pass one of them "
                         f"as optimizer=)")
    return OPTIMIZERS[name]


_TWO_STATES = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam",
                                                       "Adadelta", "Rprop") if hasattr(torch.optim, n))
_ONE_STATE = tuple(getattr(torch.optim, n) for n in ("Adagrad", "ASGD") if hasattr(torch.optim, n))


def states_of(optimizer: torch.optim.Optimizer) -> int | None:
    """State tensors ``optimizer`` keeps per parameter tensor (SGD: 0, or 1 with momentum; Adam and its kin: 2, 3 with
    ``amsgrad``; RMSprop: 1 plus momentum plus ``centered``); ``None`` for an optimizer this does not know."""
    groups = optimizer.param_groups
    has = lambda key: any(g.get(key) for g in groups)  # noqa: E731
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if has("momentum") else 0
    if isinstance(optimizer, _TWO_STATES):
        return 3 if has("amsgrad") else 2
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + has("momentum") + has("centered")
    if isinstance(optimizer, _ONE_STATE):
        return 1
    return None


def kind_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The kind a plan should cost for ``optimizer``: the one keeping as many state tensors, or the most of them for
    an optimizer that keeps more (Adam with ``amsgrad``); ``None`` for an optimizer :func:`states_of` does not know."""
    n = states_of(optimizer)
    if n is None:
        return None
    return max((o for o in OPTIMIZERS.values() if o.states <= n), key=lambda o: o.states).name
