"""The trained model's state, stage by stage: every stage's tensors reach the process that writes (rank 0 under
``distributed``) one stage at a time, received straight into the tensors handed on, so that process never holds
more of the gather than one stage at once (:func:`gather_stages`).

Who sends what: every process lists what it trains (per tensor: its ``state_dict`` names, its stage, shape and
dtype) and every process sees every list (one small all-gather), so all agree, without a further exchange, on which
process sends each tensor: the first stage that trains it (a replicated stage's first replica). Then, stage after
stage, that process sends its tensors to rank 0, point to point, each as its bytes; rank 0 hands the stage's part to
the consumer (:class:`Sink`) before it receives the next stage's. A tensor no stage trains (an unused parameter)
is the writer's own, handed on with stage 0's part.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...errors import PPLLError
from ...lower.stages import Lowered
from ...plans.plan import Plan
from ..base import Runtime


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One entry of the model's state as the gather announces it before any tensor travels."""

    key: str
    """Its name in ``model.state_dict()``."""
    shape: tuple[int, ...]
    """Its shape."""
    dtype: torch.dtype
    """Its dtype."""

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class GatherStats:
    """What one gather of the model's state moved and held, counted by the gather on the process that wrote."""

    parts: int
    """Parts handed on, one per stage."""
    total_bytes: int
    """Bytes of every tensor handed on (a tensor under several names counted once)."""
    peak_bytes: int
    """The most bytes of tensors the gather held at once before handing them on: one stage's part, never more."""


class Sink(Protocol):
    """Where the gathered parts go, on the process that writes: what every part will hold, then each part in order."""

    def begin(self, layout: list[list[TensorInfo]], others: OrderedDict[str, Any]) -> None:
        """Before any part: every part's tensors (stage order; stage 0's holds the tensors no stage trains too)
        and the state's entries that are not tensors."""

    def take(self, stage: int, part: OrderedDict[str, Tensor]) -> None:
        """One stage's part: its entries keyed as ``model.state_dict()``, in that order, as CPU tensors (names of
        one tensor share it)."""


_Offer = tuple[tuple[str, ...], int, tuple[int, ...], str]
"""What one process offers of one tensor: (its names in the state dict, its stage, shape, dtype name)."""


def stage_owners(plan: Plan, lowered: Lowered, stages: list[int]) -> dict[int, int]:
    """The stage that trains each tensor of ``stages``' modules (parameters and buffers, heads left out), by the
    tensor's id; a tensor two stages hold goes to the first."""
    owner: dict[int, int] = {}
    for i in sorted(stages):
        for k in plan.stages[i].blocks or (i,):
            module = lowered.modules[k]
            for t in (*module.parameters(), *module.buffers()):
                owner.setdefault(id(t), i)
    return owner


def _offers(model: nn.Module, owner: dict[int, int]) -> tuple[list[_Offer], list[Tensor]]:
    """What this process trains of ``model``'s state (one offer per tensor, every name of it), and those tensors."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor) and id(value) in owner:
            names.setdefault(id(value), []).append(key)
            tensors[id(value)] = value
    offers = [(tuple(keys), owner[i], tuple(tensors[i].shape), str(tensors[i].dtype).removeprefix("torch."))
              for i, keys in names.items()]
    return offers, [tensors[i] for i in names]


def _meta_keys(model: nn.Module) -> list[str]:
    """Names of ``model``'s state whose tensor is on the meta device (not built in this process)."""
    return [k for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, Tensor) and v.is_meta]


def _on_meta_error(on_meta: list[str]) -> PPLLError:
    shown = ", ".join(on_meta[:3]) + (f" and {len(on_meta) - 3} more" if len(on_meta) > 3 else "")
    return PPLLError(f"the model's state holds {len(on_meta)} tensor(s) that no stage trains and that are still on "
                     f"the meta device ({shown}); give them values in the model before compiling it, or leave them "
                     f"out of the model")


def _leftovers(model: nn.Module, taken: set[str]) -> OrderedDict[str, Any]:
    """The writer's own entries of the state that no stage trains: CPU copies (names of one tensor share one) and
    the entries that are not tensors, as they are."""
    out: OrderedDict[str, Any] = OrderedDict()
    copies: dict[int, Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in taken:
            continue
        if isinstance(value, Tensor):
            if id(value) not in copies:
                copies[id(value)] = value.detach().to("cpu", copy=True)
            value = copies[id(value)]
        out[key] = value
    return out


def _choose(offers: list[list[_Offer]]) -> dict[str, tuple[int, int, int]]:
    """Per name: (stage, rank, index of the offer) it is taken from: the first stage that trains it."""
    best: dict[str, tuple[int, int, int]] = {}
    for rank, mine in enumerate(offers):
        for j, (keys, stage, _, _) in enumerate(mine):
            for key in keys:
                if key not in best or (stage, rank) < best[key][:2]:
                    best[key] = (stage, rank, j)
    return best


def _as_bytes(t: Tensor) -> Tensor:
    """``t``'s data as a flat uint8 tensor sharing its memory (every dtype travels as bytes)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


@dataclass(frozen=True, kw_only=True)
class _Route:
    """Which process sends which tensors of each stage, as every process computes it from the shared offers."""

    offers: list[list[_Offer]]
    """Every process's offers, in rank order."""
    by_stage: dict[int, list[tuple[int, int, list[str]]]]
    """Per stage: (rank, index of its offer, the names taken from it), in rank and offer order."""
    taken: frozenset[str]
    """Every name some stage trains."""

    @classmethod
    def of(cls, offers: list[list[_Offer]]) -> _Route:
        best = _choose(offers)
        by_stage: dict[int, list[tuple[int, int, list[str]]]] = {}
        for rank, offered in enumerate(offers):
            for j, (keys, stage, _, _) in enumerate(offered):
                taken = [k for k in keys if best[k][1:] == (rank, j)]
                if taken:
                    by_stage.setdefault(stage, []).append((rank, j, taken))
        return cls(offers=offers, by_stage=by_stage, taken=frozenset(best))

    def info(self, rank: int, j: int, key: str) -> TensorInfo:
        _, _, shape, dtype = self.offers[rank][j]
        return TensorInfo(key=key, shape=shape, dtype=getattr(torch, dtype))

    def layout(self, stages: int, leftovers: OrderedDict[str, Any], order: dict[str, int]) -> list[list[TensorInfo]]:
        """Every part's tensors, keyed in ``order``; stage 0's with the ``leftovers`` that are tensors."""
        out = []
        for s in range(stages):
            infos = [self.info(r, j, k) for r, j, keys in self.by_stage.get(s, []) for k in keys]
            if s == 0:
                infos += [TensorInfo(key=k, shape=tuple(v.shape), dtype=v.dtype) for k, v in leftovers.items()
                          if isinstance(v, Tensor)]
            out.append(sorted(infos, key=lambda i: order[i.key]))
        return out


def gather_stages(rt: Runtime, model: nn.Module, plan: Plan, lowered: Lowered, sink: Sink | None
                  ) -> GatherStats | None:
    """Hand the whole model's state to ``sink`` on the process that writes, stage by stage (see the module's
    docstring); its :class:`GatherStats` there, ``None`` on the other processes (whose ``sink`` is not used). A
    collective under ``distributed``: every process calls it."""
    many, writer = rt.one_process_per_stage, rt.is_main_writer
    if not many and not writer:
        return None
    here = [r.index for r in rt.runners] if many else list(range(plan.num_stages))
    offers, tensors = _offers(model, stage_owners(plan, lowered, here)) if rt.replica == 0 else ([], [])
    mine = (offers, _meta_keys(model) if writer else [])
    shared = rt.gather(mine) if many else [mine]
    route = _Route.of([o for o, _ in shared])
    on_meta = [k for _, keys in shared for k in keys if k not in route.taken]
    if on_meta:  # every process knows it from the offers: all raise, none waits
        raise _on_meta_error(on_meta)
    leftovers, order = OrderedDict(), {}
    if writer:
        leftovers = _leftovers(model, set(route.taken))
        order = {key: n for n, key in enumerate(model.state_dict(keep_vars=True))}
        if sink is not None:
            sink.begin(route.layout(plan.num_stages, leftovers, order),
                       OrderedDict((k, v) for k, v in leftovers.items() if not isinstance(v, Tensor)))
    comm = _comm_device(rt) if many else torch.device("cpu")
    me = getattr(rt, "rank", 0)
    total = peak = 0
    for s in range(plan.num_stages):
        if not writer:
            for rank, j, _ in route.by_stage.get(s, []):
                if rank == me:
                    _send(rt, tensors[j], comm)
            continue
        part = _take_part(rt, route, s, tensors, comm)
        if s == 0:
            part.update((k, v) for k, v in leftovers.items() if isinstance(v, Tensor))
        held = sum(t.numel() * t.element_size() for t in {id(t): t for t in part.values()}.values())
        peak, total = max(peak, held), total + held
        ordered = OrderedDict(sorted(part.items(), key=lambda kv: order[kv[0]]))
        del part
        if sink is not None:
            sink.take(s, ordered)
        del ordered
    return GatherStats(parts=plan.num_stages, total_bytes=total, peak_bytes=peak) if writer else None


def _take_part(rt: Runtime, route: _Route, stage: int, tensors: list[Tensor], comm: torch.device
               ) -> dict[str, Tensor]:
    """On the writer: the tensors of ``stage`` by name, received from their process or copied from its own."""
    me = getattr(rt, "rank", 0)
    part: dict[str, Tensor] = {}
    for rank, j, keys in route.by_stage.get(stage, []):
        t = tensors[j].detach().to("cpu", copy=True) if rank == me else \
            _receive(rt, rank, route.info(rank, j, keys[0]), comm)
        part.update((k, t) for k in keys)
    return part


def _send(rt: Runtime, tensor: Tensor, comm: torch.device) -> None:
    """One tensor to rank 0, as its bytes, from ``comm``."""
    data = _as_bytes(tensor.detach().to(comm).contiguous())
    if data.numel():
        rt.collective(lambda: dist.send(data, dst=0))


def _receive(rt: Runtime, src: int, info: TensorInfo, comm: torch.device) -> Tensor:
    """The tensor ``info`` from rank ``src``, as a CPU tensor (received on ``comm``, the device the backend sends
    from)."""
    out = torch.empty(info.shape, dtype=info.dtype)
    buf = out if comm.type == "cpu" else torch.empty(info.shape, dtype=info.dtype, device=comm)
    data = _as_bytes(buf)
    if data.numel():
        rt.collective(lambda: dist.recv(data, src=src))
    if buf is not out:
        out.copy_(buf)
    return out


def _comm_device(rt: Runtime) -> torch.device:
    """The device tensors travel from under ``distributed``: the rank's GPU under NCCL, else the CPU."""
    device = getattr(rt, "device", torch.device("cpu"))
    backend = str(dist.get_backend())
    return device if device.type == "cuda" and "nccl" in backend else torch.device("cpu")
