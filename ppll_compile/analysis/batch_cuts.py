"""Cuts that keep the batch first: a stage's head reads its boundary tensor's first dimension as the batch, so a cut
whose tensor folds the batch into another dimension (``(batch x patches, ...)`` inside a TNT block) is dropped.

The planned batch's shapes come from the measured graph; the graph then runs once more on fake tensors (shapes only,
no real compute) at another batch size, and a cut is kept when its main tensor's first dimension equals the batch
size in both runs. Side values that do not follow the batch (masks, rotary tables) travel unchanged and are not
checked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..capture.fake_state import on_device
from ..capture.meta import faked, input_device
from ..capture.trace import in_mode, quiet
from ..cost.nodes import META_KEY
from ..errors import PlanError
from ..options import PlanOptions
from ..plans.plan import TensorSpec
from .cuts import Cut

FOLDED = "their tensor does not carry the batch as its first dimension, which a head reads as the batch"
"""What the note on dropped cuts says of them."""


def _batch(inputs: Sequence[Any]) -> int | None:
    first = next((x for x in inputs if isinstance(x, Tensor) and x.dim() > 0), None)
    return None if first is None else first.shape[0]


def _at(x: Any, batch: int, other: int) -> Any:
    """``x`` with ``other`` rows where it has ``batch`` rows (rows repeated); other values unchanged."""
    if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != batch:
        return x
    return x[torch.arange(other) % batch]


class _Shapes(fx.Interpreter):
    """Runs a graph, keeping the shape of every named node's tensor output."""

    def __init__(self, gm: fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names = names
        self.shapes: dict[str, tuple[int, ...]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, Tensor):
            self.shapes[n.name] = tuple(out.shape)
        return out


def shapes_at_batch(gm: fx.GraphModule, inputs: Sequence[Any], batch: int, other: int,
                    names: set[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of the nodes ``names`` when ``gm`` runs on fake tensors (eval mode, no gradients) with every input
    that has ``batch`` rows given ``other`` rows instead; the model's own tensors are not touched."""
    device = input_device(inputs)
    disabled = logging.root.manager.disable  # torch logs a failing fake kernel's traceback; the caller says it
    logging.disable(max(disabled, logging.ERROR))
    try:
        with faked(gm, device) as (mode, _), in_mode(gm, False), torch.no_grad(), quiet():
            fakes = [on_device(mode.from_tensor(_at(x, batch, other)), device) if isinstance(x, Tensor) else x
                     for x in inputs]
            with mode:
                runner = _Shapes(gm, names)
                runner.run(*fakes)
    finally:
        logging.disable(disabled)
    return runner.shapes


def _why_not(gm: fx.GraphModule, inputs: Sequence[Any], batch: int, other: int) -> str:
    """Why the run at batch size ``other`` failed: that size, or fake tensors at all (the graph reads tensor values,
    or an operation has no fake implementation)."""
    try:
        shapes_at_batch(gm, inputs, batch, batch, set())
    except Exception:  # noqa: BLE001 - the planned batch fails too
        return "does not run on fake tensors"
    return f"does not run at batch size {other}"


def _stages_asked(opts: PlanOptions | None) -> int | None:
    """The stage count the options fix without split points, or ``None``."""
    if opts is None or opts.split_points is not None or opts.replicas_chosen or isinstance(opts.replicas, tuple):
        return None
    return opts.gpus


def batch_folded(gm: fx.GraphModule, cuts: Sequence[Cut], real_inputs: Sequence[Any], *, model: str,
                 opts: PlanOptions | None = None) -> tuple[list[Cut], dict[str, str], tuple[str, ...]]:
    """``cuts`` without those whose main boundary tensor does not carry the batch as its first dimension; why each
    dropped one was dropped (by node name); and the notes: how many were dropped, or that the graph does not run at
    a second batch size (only the planned batch is then checked). ``gm`` must have been measured
    (:func:`~ppll_compile.cost.nodes.measure_graph`).

    With ``opts`` asking for a number of stages (``gpus=`` without ``split_points``) that the cuts left cannot make
    while the cuts before could, a :class:`PlanError` names ``model``, the reason and the ways out.
    """
    batch = _batch(real_inputs)
    if batch is None or not cuts:
        return list(cuts), {}, ()
    other = batch + 1
    notes: list[str] = []
    try:
        later: dict[str, tuple[int, ...]] | None = shapes_at_batch(gm, real_inputs, batch, other,
                                                                   {c.node for c in cuts})
    except Exception as e:  # noqa: BLE001 - a graph that takes one batch size: only the planned batch is checked
        later, first = None, (str(e).splitlines() or [""])[0]
        notes.append(f"the cuts were checked for keeping the batch first at the planned batch size only: the graph "
                     f"{_why_not(gm, real_inputs, batch, other)} ({type(e).__name__}: {first})")
    nodes = {n.name: n for n in gm.graph.nodes}
    kept, dropped, seen = [], {}, {}
    for c in cuts:
        spec = nodes[c.node].meta[META_KEY].value
        shape = tuple(spec.shape) if isinstance(spec, TensorSpec) else ()
        again = later.get(c.node) if later is not None else None
        if not shape or (shape[0] == batch and (again is None or (again and again[0] == other))):
            kept.append(c)
            continue
        seen[c.node] = f"{shape} at batch {batch}" + (f", {again} at batch {other}" if again is not None else "")
        dropped[c.node] = f"its tensor's first dimension is not the batch ({seen[c.node]})"
    if dropped:
        whys = list(dict.fromkeys(seen.values()))
        notes.append(f"{len(dropped)} of {len(cuts)} legal cuts dropped: {FOLDED} ("
                     + "; ".join(whys[:3]) + (" ..." if len(whys) > 3 else "") + ")")
        _refuse_too_few(model, cuts, kept, seen, _stages_asked(opts))
    return kept, dropped, tuple(notes)


def _refuse_too_few(model: str, cuts: Sequence[Cut], kept: Sequence[Cut], seen: dict[str, str],
                    stages: int | None) -> None:
    if stages is None or stages - 1 <= len(kept) or stages - 1 > len(cuts):
        return
    node, shapes = next(iter(seen.items()))
    k = len(kept)
    ways = f"gpus={k + 1} or fewer" if k else "gpus=1 (one stage)"
    raise PlanError(f"{model} cannot be split into {stages} stages: {len(seen)} of its {len(cuts)} legal cuts "
                    f"fold the batch into another dimension (the tensor after {node!r} is {shapes}), and a stage's "
                    f"head would read that dimension as the batch; {k} cut(s) keep the batch first. Ways out: {ways}, "
                    f"or split_points=[...module names...] naming modules whose output keeps the batch first (the "
                    f"modules not holding them then stay opaque)")
