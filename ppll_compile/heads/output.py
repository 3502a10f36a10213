"""The ``lm_output`` head: per-token scores through the model's own final norm and output projection, kept frozen.

The head is ``[adapter] -> final norm -> output projection``, the last two copied from the model (Llama's
``model.norm`` and ``lm_head``, GPT-2's ``transformer.ln_f`` and ``lm_head``) with their weights as buffers: no
gradient, no optimizer state, and the stage's local loss still trains the stage through them. ``projection`` says
whose copy a head holds:

- ``frozen``: each head its own copy of the weights as the pipeline was compiled (their memory once per stage).
- ``shared``: the heads in one process that sit on one device hold one copy between them (the same tensors), the
  weights as the pipeline was compiled; under ``distributed`` each rank holds its own. The last stage trains the
  model's own norm and projection as always. The earlier heads read the compiled weights, never the last stage's
  live ones: a live read would depend on how far the last stage has got, which differs between the sequential,
  threads and distributed runtimes, so pipelined training would no longer be the sequential computation.

The two compute the same; ``shared`` only saves the copies of stages that share a device.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from ..capture.trace import module_path
from ..errors import PolicyError
from .modules import AuxHead, frozen_buffers

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
_NO_NORM = nn.Identity()
"""The norm of a model without a final norm before its projection (or of a cut after it); heads copy it."""


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, _NORMS) or type(m).__name__.endswith("Norm")


class NoOutputProjection(PolicyError):
    """The model has no output projection an ``lm_output`` head could read: no cut can serve one (planning says so
    instead of dropping every cut)."""


class ProjectionHead(AuxHead):
    """A per-token head through a frozen copy of the model's final norm and output projection (see the module's
    docstring); only its adapter, if any, is trained."""

    def __init__(self, adapter: nn.Module | None, norm: nn.Module, projection: nn.Module, loss: Mapping[str, Any], *,
                 shared: bool) -> None:
        frozen = nn.Sequential(norm, projection)
        names = frozen_buffers(frozen, prefix=f"net.{1 if adapter is not None else 0}.")
        super().__init__(nn.Sequential(*([adapter] if adapter is not None else []), frozen), loss)
        self.frozen_names = names
        """The frozen weights' buffer names (the norm's, then the projection's; a tied weight once)."""
        self.shared = shared
        """Whether heads on one device hold one copy of the frozen weights between them (``projection: shared``)."""

    def frozen_tensors(self) -> list[Tensor]:
        """The frozen norm and projection weights, in :attr:`frozen_names` order."""
        return [self.get_buffer(n) for n in self.frozen_names]

    def frozen_bytes(self) -> int:
        """Bytes of the frozen copy: what the head keeps besides its trained adapter."""
        return sum(t.numel() * t.element_size() for t in self.frozen_tensors())


def _identity_linear(width: int) -> nn.Linear:
    layer = nn.Linear(width, width)
    with torch.no_grad():
        if not layer.weight.is_meta:
            layer.weight.copy_(torch.eye(width))
            layer.bias.zero_()
    return layer


_ADAPTERS = {"none": lambda d: None, "linear": _identity_linear, "norm": nn.LayerNorm}
"""The adapters before the frozen layers: none, Linear(D, D) initialised to the identity, LayerNorm(D)."""


def projection_head(options: Mapping[str, Any], shape: Sequence[int], num_classes: int, loss: Mapping[str, Any],
                    layers: Sequence[nn.Module] | None) -> ProjectionHead:
    """The head over the model's ``layers`` (final norm, projection; deep-copied here), or over stand-ins of their
    shape where they are not at hand (LayerNorm(D), Linear(D, C, no bias))."""
    d = shape[-1]
    if layers is None:
        norm, proj = nn.LayerNorm(d), nn.Linear(d, num_classes, bias=False)
    else:
        norm, proj = copy.deepcopy(list(layers))  # one deepcopy: weights the two share stay shared
        if not isinstance(proj, nn.Linear) or proj.in_features != d or proj.out_features != num_classes:
            found = (f"Linear({proj.in_features}, {proj.out_features})" if isinstance(proj, nn.Linear)
                     else type(proj).__name__)
            raise PolicyError(f"head type 'lm_output' projects the boundary's D = {d} features to {num_classes} "
                              f"per-token scores with the model's output projection, but that is {found}; cut "
                              f"where the boundary has the projection's width, or use type lm (a fresh projection)")
    return ProjectionHead(_ADAPTERS[options["adapter"]](d), norm, proj, loss, shared=options["projection"] == "shared")


def _module_at(model: nn.Module, node: fx.Node) -> tuple[str, nn.Module | None]:
    path = module_path(node)
    if not path:
        return "", None
    try:
        return path, model.get_submodule(path)
    except AttributeError:
        return path, None


def _called_backwards(model: nn.Module, nodes: Sequence[fx.Node]) -> Iterator[tuple[int, str, nn.Module]]:
    """(index, module path, module) of the nodes that run inside a module of ``model``, last first."""
    for i in range(len(nodes) - 1, -1, -1):
        if nodes[i].op not in ("placeholder", "output"):
            path, m = _module_at(model, nodes[i])
            if m is not None:
                yield i, path, m


def output_layers(model: nn.Module, nodes: Sequence[fx.Node], cut: str) -> list[tuple[str, nn.Module]]:
    """The model's final norm and output projection, with their module paths, found in its captured ``nodes``: the
    projection is the module the graph calls last, an ``nn.Linear``; the norm is the module called just before it,
    where that is a norm (LayerNorm, RMSNorm, a ``...Norm`` class) after the cut ``cut``, else an identity (a
    model without a final norm, or a cut after it)."""
    called = _called_backwards(model, nodes)
    last = next(called, None)
    if last is None or not isinstance(last[2], nn.Linear):
        found = f"{last[1]!r} ({type(last[2]).__name__})" if last else "none (no module is called)"
        raise NoOutputProjection(f"head type 'lm_output' reads the model's own output projection, but "
                                 f"{type(model).__name__} has none: looked for an nn.Linear as the last module its "
                                 f"graph calls before the output (as Llama's or GPT-2's lm_head), found {found}; use "
                                 f"type lm, a fresh projection")
    first, proj_path, proj = last
    before = next(called, None)
    while before is not None and before[1] == proj_path:  # the projection's other nodes (a bias add, a reshape)
        first, before = before[0], next(called, None)
    at = [n.name for n in nodes].index(cut)
    if first <= at:
        raise PolicyError(f"head type 'lm_output' reads the model's output projection {proj_path!r}, but the cut "
                          f"{cut!r} comes after it; cut before the projection, or use type lm")
    if before is not None and before[0] > at and _is_norm(before[2]):
        return [(before[1], before[2]), (proj_path, proj)]
    return [("", _NO_NORM), (proj_path, proj)]


def share_frozen(heads: Sequence[nn.Module | None]) -> None:
    """Point the ``shared`` projection heads on one device at one copy of the frozen weights (the first's)."""
    first: dict[Any, ProjectionHead] = {}
    for head in heads:
        if not isinstance(head, ProjectionHead) or not head.shared:
            continue
        keep = first.setdefault(next(iter(head.frozen_tensors())).device, head)
        for name, t in zip(head.frozen_names, keep.frozen_tensors()):
            owner, _, leaf = name.rpartition(".")
            head.get_submodule(owner).register_buffer(leaf, t)
