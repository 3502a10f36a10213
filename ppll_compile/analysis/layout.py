"""Read a 4-D tensor's layout off the graph: ``N x C x H x W`` or channels-last ``N x H x W x C``.

The rank alone cannot tell them apart, and a head that convolves over the wrong axis trains on nonsense.
The graph can: channels-last maps are made or read by a ``permute`` to ``(0, 2, 3, 1)``, a LayerNorm over
the last dimension or a Linear layer; channels-first maps by convolutions, BatchNorm and pooling. The
nearest such operation before the tensor (else after it) decides.
"""

from __future__ import annotations

from collections import deque

import torch.fx as fx
from torch import nn

CHANNELS_LAST = "channels_last"
_LAST = (nn.LayerNorm, nn.Linear)
_FIRST = (nn.Conv2d, nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d, nn.MaxPool2d, nn.AvgPool2d,
          nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.ConvTranspose2d)
_LAST_OPS = ("layer_norm", "linear")
_FIRST_OPS = ("conv2d", "batch_norm", "group_norm", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d")
_STEPS = 12


def _name(target: object) -> str:
    return str(getattr(target, "__name__", target)).split(".")[-1]


def _dims(node: fx.Node) -> tuple[int, ...] | None:
    """The permutation of a ``permute`` node, when it is given as constants."""
    if _name(node.target) != "permute":
        return None
    dims = node.args[1:] if len(node.args) > 2 else node.args[1] if len(node.args) > 1 else node.kwargs.get("dims")
    return tuple(dims) if isinstance(dims, (tuple, list)) and all(isinstance(d, int) for d in dims) else None


def _evidence(node: fx.Node, gm: fx.GraphModule, producer: bool) -> str | None:
    """What ``node`` says about the layout of the 4-D value it makes (``producer``) or reads."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, _LAST):
            return CHANNELS_LAST
        if isinstance(module, _FIRST):
            return ""
        return None
    if node.op not in ("call_function", "call_method"):
        return None
    dims = _dims(node)
    if dims is not None and len(dims) == 4:
        made_last = dims == (0, 2, 3, 1)
        if producer:
            return CHANNELS_LAST if made_last else "" if dims == (0, 3, 1, 2) else None
        return CHANNELS_LAST if dims == (0, 3, 1, 2) else "" if made_last else None
    name = _name(node.target)
    if any(name.startswith(op) for op in _LAST_OPS):
        return CHANNELS_LAST
    if any(name.startswith(op) for op in _FIRST_OPS):
        return ""
    return None


def layout_of(node: fx.Node, gm: fx.GraphModule) -> str:
    """``"channels_last"`` when the 4-D value of ``node`` is an ``N x H x W x C`` map, else ``""``.

    Searches breadth-first, first backwards through the nodes that made the value, then forwards through
    those that read it, up to a few steps each way; the nearest layout-revealing operation decides.
    """
    for producer in (True, False):
        queue, seen = deque([(node, 0)]), {node}
        while queue:
            n, depth = queue.popleft()
            found = _evidence(n, gm, producer)
            if found is not None:
                return found
            if depth == _STEPS:
                continue
            for m in (n.all_input_nodes if producer else n.users):
                if m not in seen and m.op != "get_attr":
                    seen.add(m)
                    queue.append((m, depth + 1))
    return ""
