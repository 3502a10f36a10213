"""Gradient reachability on the captured graph: which trainable parameters a stage's own loss reaches.

A stage's loss reads one value: the main tensor at its cut (what its auxiliary head reads; Pipe-BD's block loss reads
it too), or the model's output for the last stage. Every other value crossing a cut travels detached, so a parameter
whose every use in a stage feeds only such side values (a branch computed before the cut and read only after it, as
in a two-stream model) gets no gradient there, although end-to-end training would train it. Parameters with
``requires_grad=False`` are not trainable and never reported; nor is one that no output of the model reaches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from ..cost.nodes import META_KEY

SHOWN = 4
"""How many parameter names a message lists before ``and N more``."""
_INPUTS = ("placeholder", "get_attr", "output")


@dataclass(frozen=True)
class Stranded:
    """The trainable parameters of one stage (or Pipe-BD block) that no loss of it reaches."""

    stage: int
    """The stage's (or block's) index."""
    end: str
    """The node whose value its loss reads, ``""`` for the model's output."""
    names: tuple[str, ...]
    """One name per parameter tensor, in graph order of first use."""


class Reach:
    """Where every value of a measured graph flows with a gradient: to which of ``ends`` (node names whose value a
    loss reads) and to the model's output, in one backward sweep (a value shares what its in-place updates and
    views reach).

    ``trainable``: names of the parameters that require gradients (aliases of one tensor by ``aliases``: name ->
    tensor key; a tensor is reported by the name its first use gives it)."""

    def __init__(self, nodes: Sequence[fx.Node], trainable: Iterable[str], ends: Sequence[str],
                 aliases: dict[str, Any] | None = None) -> None:
        self.nodes = list(nodes)
        self.order = {n.name: i for i, n in enumerate(self.nodes)}
        self.bit = {name: 1 << (i + 1) for i, name in enumerate(dict.fromkeys(ends))}
        aliases = aliases or {}
        trained = set(trainable)
        self.uses: dict[str, dict[Any, str]] = {}  # node -> tensor key -> the name it uses the tensor by
        for n in self.nodes:
            if n.op in _INPUTS:
                continue
            used = {}
            for m in (n, *(a for a in n.all_input_nodes if a.op == "get_attr")):
                cost = _cost(m)
                for p in cost.params if cost is not None else ():
                    if p in trained:
                        used.setdefault(aliases.get(p, p), p)
            if used:
                self.uses[n.name] = used
        self.mask = self._sweep()

    @classmethod
    def of(cls, gm: fx.GraphModule, nodes: Sequence[fx.Node], ends: Sequence[str]) -> Reach:
        """The reach of ``gm``'s graph (``nodes`` in order) towards ``ends``, its trainable parameters read off it."""
        named = list(gm.named_parameters(remove_duplicate=False))
        return cls(nodes, [k for k, p in named if p.requires_grad], ends, {k: id(p) for k, p in named})

    def _sweep(self) -> dict[str, int]:
        """Per node, a bit set of the ends its value reaches with a gradient (bit 0: the model's output)."""
        mask: dict[str, int] = {}
        by_storage: dict[Any, int] = {}
        for n in reversed(self.nodes):
            if n.op == "output":
                for u in n.all_input_nodes:
                    mask[u.name] = mask.get(u.name, 0) | 1
                continue
            m = mask.get(n.name, 0) | self.bit.get(n.name, 0)
            key = _storage(n)
            if key is not None:
                m |= by_storage.get(key, 0)  # an in-place update or a view of a value read later
            mask[n.name] = m
            cost = _cost(n)
            if n.op in _INPUTS or cost is None or not cost.grad:
                continue
            for u in n.all_input_nodes:
                mask[u.name] = mask.get(u.name, 0) | m
                ukey = _storage(u)
                if ukey is not None:
                    by_storage[ukey] = by_storage.get(ukey, 0) | m
        return mask

    def _reaches(self, node: str, root: str) -> bool:
        """Whether the parameters ``node`` uses get a gradient from a loss on ``root`` (``""``: the output)."""
        cost = _cost(self.nodes[self.order[node]])
        return cost is not None and cost.grad and bool(self.mask.get(node, 0) & (self.bit[root] if root else 1))

    def stranded(self, lo: int, hi: int, root: str) -> list[str]:
        """The parameters used by the nodes at positions ``lo..hi`` (a stage) that a use there gives a gradient
        end-to-end but none gives one from a loss on ``root``: one name per tensor, in graph order."""
        names: dict[Any, str] = {}
        reached: set[Any] = set()
        for n in self.nodes[lo:hi + 1]:
            used = self.uses.get(n.name)
            if not used:
                continue
            if self._reaches(n.name, root):
                reached.update(used)
            elif self._reaches(n.name, ""):
                for key, name in used.items():
                    names.setdefault(key, name)
        return [name for key, name in names.items() if key not in reached]

    def stages(self, ends: Sequence[str]) -> list[Stranded]:
        """Per stage of the cuts after ``ends`` (in graph order), what no loss of it reaches; stages that train every
        parameter they use are left out."""
        out = []
        lo = 0
        for i, end in enumerate((*ends, "")):
            hi = self.order[end] if end else len(self.nodes) - 1
            names = self.stranded(lo, hi, end)
            if names:
                out.append(Stranded(stage=i, end=end, names=tuple(names)))
            lo = hi + 1
        return out

    def stranding(self, end: str) -> list[str]:
        """What a cut after ``end`` strands whatever stage it closes: the parameters with a use before it that gives
        them a gradient end-to-end but not from a loss on ``end`` (their value crosses the cut beside it)."""
        hi = self.order[end]
        names: dict[Any, str] = {}
        for n in self.nodes[:hi + 1]:
            used = self.uses.get(n.name)
            if used and not self._reaches(n.name, end) and self._reaches(n.name, ""):
                for key, name in used.items():
                    names.setdefault(key, name)
        return list(names.values())


def _cost(n: fx.Node) -> Any:
    return n.meta.get(META_KEY)


def _storage(n: fx.Node) -> Any:
    """The storage a node's single tensor output lives in (``None`` for anything else)."""
    cost = _cost(n)
    key = getattr(cost, "storage", None)
    return key if isinstance(key, str) else None


def accepted(name: str, frozen: Sequence[str]) -> bool:
    """Whether ``frozen`` names parameter ``name``: itself, or a module it lives under."""
    return any(name == f or name.startswith(f + ".") for f in frozen)


def unaccepted(names: Iterable[str], frozen: Sequence[str]) -> list[str]:
    """``names`` that ``frozen`` does not name."""
    return [n for n in names if not accepted(n, frozen)]


def unknown_frozen(frozen: Sequence[str], model: nn.Module) -> list[str]:
    """The entries of ``frozen`` that name neither a parameter of ``model`` nor a module holding one."""
    params = [k for k, _ in model.named_parameters(remove_duplicate=False)]
    return [f for f in frozen if not any(accepted(k, [f]) for k in params)]


def listed(names: Sequence[str], shown: int = SHOWN) -> str:
    """``a, b, c`` or ``a, b, c, d and 27 more``."""
    head = ", ".join(names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"


def frozen_hint(names: Sequence[str]) -> str:
    """A ``frozen=[...]`` value that accepts ``names``: their common modules where that is shorter."""
    modules = list(dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else n for n in names))
    chosen = modules if len(modules) < len(names) else list(names)
    return "frozen=[" + ", ".join(repr(c) for c in chosen[:SHOWN]) + (", ...]" if len(chosen) > SHOWN else "]")
