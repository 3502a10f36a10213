"""One plan for every rank: under ``torchrun``, ``compile()`` plans on rank 0 and the other ranks receive its plan.

Planning measures this machine (calibrated device figures, cached under ``PPLL_CACHE_DIR``; ``profile="time"``
timings), so processes that plan on their own may choose different cuts. When ``compile()`` runs under ``torchrun``
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, or a default process group formed) for as many
devices as there are processes, rank 0 plans (or re-applies the plan it was given) and broadcasts the plan, in the
plan file format, with the seed every rank initialises the heads from; each other rank traces the model and lowers
rank 0's plan. A call for another number of devices makes no distributed assumption: every process plans on its own.
A rank whose options differ from rank 0's (another ``split_points``, policy, ...) plans on its own, with a warning
naming the options, and a distributed trainer then refuses ranks whose plans differ. If rank 0 cannot plan, every
other rank raises a :class:`~ppll_compile.PPLLError` with rank 0's error; a rank lost meanwhile is named too. Once
each rank has traced its model for rank 0's plan, :func:`confirm_model` compares the traced models of every rank:
when one differs from rank 0's (or cannot take rank 0's cuts), every rank raises the same error naming the ranks and
the first difference.

How the ranks meet: through a default process group formed before ``compile()`` (by the user), used and left as it
is; else through torchrun's store (``env://``, under the prefix of this incarnation of the job,
:func:`~ppll_compile.runtime.distributed.group.meeting_store`), where rank 0 writes its plan and the others wait for it. No
process group is formed: the trainer forms it later on the same store, with its own ``timeout=`` (gloo keeps the
timeout a group was formed with).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ...errors import PPLLError
from ...options import PlanOptions, SavedPlan
from ...plans.plan import Plan
from .group import SAME_MODEL, meeting_store, model_mismatch, module_lines, rank_device

PLAN_TIMEOUT = 1800.0
"""Seconds the ranks wait for rank 0's plan."""
READ_TIMEOUT = 120.0
"""Seconds rank 0 waits for the other ranks to read its error before it raises it (rank 0 may host the store, which
ends with its process)."""

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_EXCHANGES = itertools.count()
"""Plans exchanged so far by this process: every rank compiles in the same order, so the n-th is under key
``plan/n`` of the store (where rank 0 writes its plan, or its error)."""


def shared_ranks(opts: PlanOptions, saved: SavedPlan | None) -> tuple[int, int] | None:
    """(rank, world size) when this ``compile()`` shares rank 0's plan: under torchrun (or a formed default group),
    more than one process, and the call asks for as many devices as there are processes; else ``None``."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif all(k in os.environ for k in _TORCHRUN) and dist.is_available():
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError:
            return None
    else:
        return None
    if world < 2 or requested_world(opts, saved) != world:
        return None
    return rank, world


def requested_world(opts: PlanOptions, saved: SavedPlan | None) -> int | None:
    """The processes the plan a call asks for will need (every stage's replicas), as far as the call says before
    planning: the replicas given per stage, the cuts given (a saved plan's, ``split_points``) + 1, else ``gpus`` (or
    ``len(devices)``), which the partitioner fills when it chooses the replicas."""
    if isinstance(opts.replicas, tuple):
        return sum(opts.replicas)
    if saved is not None:
        return len(saved.cuts) + 1
    if opts.split_points is not None:
        return len(set(opts.split_points)) + 1
    return opts.gpus or (len(opts.devices) if opts.devices else None)


def request_of(opts: PlanOptions, saved: SavedPlan | None) -> dict[str, str]:
    """What a rank asked for, comparable across processes: every option (a callable or class by its qualified name)
    and the saved plan's cuts, heads and inputs."""
    def plain(v: Any) -> str:
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(map(plain, v)) + ")"
        if isinstance(v, (str, int, float, bool, type(None))):
            return repr(v)
        if callable(v):
            return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__qualname__)}"
        return type(v).__qualname__

    out = {f.name: plain(getattr(opts, f.name)) for f in dataclasses.fields(opts)}
    if saved is not None:
        out["plan"] = repr((saved.cuts, saved.heads, [t.to_dict() for t in saved.inputs]))
    return out


def send_plan(request: dict[str, str], plan: Plan) -> int:
    """Rank 0: broadcast ``plan`` (in the plan file format) and the seed every rank initialises the heads from (this
    process's ``torch.initial_seed()``), which it returns."""
    seed = torch.initial_seed()
    _broadcast({"request": request, "plan": plan.to_json(), "seed": seed})
    return seed


def send_failure(request: dict[str, str], error: BaseException, world: int) -> None:
    """Rank 0: tell the other ``world - 1`` ranks why it could not plan (each then raises it as a
    :class:`PPLLError`), and wait up to :data:`READ_TIMEOUT` seconds until they have read it."""
    _broadcast({"request": request, "error": f"{type(error).__name__}: {error}"}, readers=world - 1)


def receive_plan(rank: int, request: dict[str, str]) -> tuple[Plan | None, int]:
    """Another rank: rank 0's plan and head seed. ``None`` for the plan (and this process's own seed) when this rank
    asked for another plan than rank 0 (a warning names what differs): it then plans on its own."""
    got = _broadcast(None)
    if "error" in got:
        raise PPLLError(f"rank 0 could not plan, and under torchrun every rank compiles rank 0's plan: {got['error']}")
    differ = sorted(k for k in set(request) | set(got["request"]) if request.get(k) != got["request"].get(k))
    if differ:
        warnings.warn(f"rank {rank} asked for another plan than rank 0 ({', '.join(differ)} differ), so it plans on "
                      f"its own, and a trainer refuses ranks whose plans differ; give every rank the same options to "
                      f"share rank 0's plan", UserWarning, stacklevel=4)  # at the caller of compile()
        return None, torch.initial_seed()
    return Plan.from_json(got["plan"]), int(got["seed"])


def shared_note(world: int) -> str:
    """The plan's note on a plan made by rank 0 and shared with every rank."""
    return f"planned on rank 0 and shared with all {world} ranks (torchrun): every rank lowers this plan"


def meet(rank: int) -> None:
    """Get ready to exchange rank 0's plan: this rank's CUDA device made current where there is one (NCCL's objects
    travel through it), and torchrun's store reached when no process group is formed."""
    rank_device(rank)
    if not dist.is_initialized():
        meeting_store(PLAN_TIMEOUT)


def confirm_model(rank: int, world: int, graph: fx.GraphModule | None, error: BaseException | None = None) -> None:
    """Every rank, once rank 0 has sent its plan (rank 0) or this rank has traced its own model for it (the others):
    the traced model (``graph``; ``None`` on a rank that plans on its own, which is not compared) or the error that
    rank 0's plan met on this rank's model, exchanged between all ``world`` ranks. When a rank's model differs from
    rank 0's, or took an error, every rank raises the same :class:`PPLLError` naming the ranks and the first
    difference, before any of them forms a trainer's process group."""
    report: dict[str, Any] = {"error": f"{type(error).__name__}: {error}"} if error is not None else \
        {"lines": module_lines(graph)} if graph is not None else {}
    reports = _gather(rank, world, report)
    failed = [(r, got["error"]) for r, got in enumerate(reports) if "error" in got]
    if failed:
        r, text = failed[0]
        others = f" (and rank(s) {', '.join(str(q) for q, _ in failed[1:])})" if len(failed) > 1 else ""
        raise PPLLError(f"rank {r}{others} could not lower rank 0's plan on its own model, so the ranks were started "
                        f"with different models: {text}; {SAME_MODEL}")
    mine = reports[0]["lines"]
    mismatch = model_mismatch([[("the traced model", got.get("lines", mine))] for got in reports])
    if mismatch is not None:
        raise PPLLError(mismatch)


def _gather(rank: int, world: int, report: dict[str, Any]) -> list[dict[str, Any]]:
    """``report`` of every rank (a JSON object), on every rank: through the default process group if one is formed,
    else through torchrun's store, where rank 0 waits until every other rank has read them all (it may host it)."""
    try:
        if dist.is_initialized():
            out: list[Any] = [None] * world
            dist.all_gather_object(out, report)
            return out
        store, key = meeting_store(PLAN_TIMEOUT)[0], f"plan/{next(_EXCHANGES)}"
        store.set(f"{key}/rank-{rank}", json.dumps(report))
        reports = [json.loads(store.get(f"{key}/rank-{r}")) for r in range(world)]
        store.add(f"{key}/read", 1)
        deadline = time.monotonic() + READ_TIMEOUT
        while rank == 0 and store.add(f"{key}/read", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        return reports
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PPLLError(f"lost a rank while the ranks compared their models: see the output of the rank that ended "
                        f"({first})") from None


def _broadcast(obj: Any, readers: int = 0) -> Any:
    """Rank 0's ``obj`` (a JSON value) on every rank, through the default process group if one is formed, else
    through torchrun's store; a lost rank (or the wait's timeout) is a :class:`PPLLError`. Through the store, every
    other rank counts itself under ``<key>/read`` once it has read the value, and rank 0 waits until ``readers``
    have (a rank that may end next must not take the store it hosts down before they read)."""
    try:
        if dist.is_initialized():
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        store, key = meeting_store(PLAN_TIMEOUT)[0], f"plan/{next(_EXCHANGES)}"
        if obj is None:
            got = json.loads(store.get(key))
            store.add(f"{key}/read", 1)
            return got
        store.set(key, json.dumps(obj))
        deadline = time.monotonic() + READ_TIMEOUT
        while store.add(f"{key}/read", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.05)
        return obj
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        what = "rank 0 sent its plan: see the output of the rank that ended" if obj is not None else \
            "this rank waited for rank 0's plan: see rank 0's own output for its error"
        raise PPLLError(f"lost a rank while {what} ({first})") from None
