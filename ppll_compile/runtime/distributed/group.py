"""The process group of the ``distributed`` runtime: set-up, abort and release, each rank's place, the stage groups,
and the checks that every rank runs the same plan and the same model."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from ...errors import PPLLError
from ...lower.stages import Lowered
from ...plans.plan import Plan

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RESTART = "TORCHELASTIC_RESTART_COUNT"
"""The variable in which torchrun tells a process which incarnation of its job it belongs to (0, 1, ...)."""
_ABORT_TAG = 0x7A11  # a tag no message is ever sent with
_RELEASE = 10.0  # seconds release() waits for the process group's teardown


def init_group(stages: int, timeout: float) -> bool:
    """Initialise the default process group from torchrun's environment; whether this call did it.

    Under ``torchrun`` the group meets through :func:`restart_store`: processes that ``--max-restarts`` starts
    again form a working group (with a plain ``init_process_group`` they may not: see docs/recovery.md).
    """
    if not dist.is_available():
        raise PPLLError('runtime="distributed" needs torch.distributed, which this PyTorch build lacks; use '
                        'runtime="threads"')
    if dist.is_initialized():
        return False
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise PPLLError(f'runtime="distributed" runs one process per stage, but {", ".join(missing)} '
                        f'{"is" if len(missing) == 1 else "are"} not set: launch the script with '
                        f'torchrun --nproc-per-node={stages} your_script.py (or call '
                        f'torch.distributed.init_process_group yourself before building the trainer)')
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if _MET:  # compile() met the other processes through this store: the group forms on it
        store, rank, world = _MET.pop()
        store.set_timeout(timedelta(seconds=timeout))
    elif RESTART not in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        return True
    else:
        store, rank, world = meeting_store(timeout, keep=False)
    # each group this process forms publishes its addresses under keys of its own: a trainer built after another
    # one's group was released must not read the addresses of that group (torchrun's store outlives it)
    store = dist.PrefixStore(f"group_{next(_GROUPS)}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    return True


_GROUPS = itertools.count()
"""Process groups formed so far by this process on torchrun's store: every rank builds its trainers in the same
order, so the n-th group of every rank meets under the prefix ``group_<n>/``."""


_MET: list[tuple[Any, int, int]] = []
"""The store this process met the others through before any process group was formed (``compile()`` sharing rank
0's plan), with its rank and world size; :func:`init_group` forms the default group on it."""


def meeting_store(timeout: float, keep: bool = True) -> tuple[Any, int, int]:
    """(store, rank, world size) of torchrun's environment (``env://``: torchrun's store, or one rank 0 hosts), seen
    through :func:`restart_store`'s prefix; with ``keep`` made once and kept until :func:`init_group` forms the
    default process group on it (rank 0 may be hosting it, so it is not made twice)."""
    if keep and _MET:
        return _MET[0]
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    met = (restart_store(store), rank, world)
    if keep:
        _MET.append(met)
    return met


def restart_store(store: Any) -> Any:
    """``store`` seen through a prefix of its own for this incarnation of a ``torchrun`` job (its
    ``TORCHELASTIC_RESTART_COUNT``), so that processes restarted by ``torchrun --max-restarts`` form a new group.

    torchrun keeps one store (at ``MASTER_ADDR:MASTER_PORT``) for all incarnations of a job, and a process group
    publishes each rank's address there under keys that do not change from one incarnation to the next
    (``default_pg/0//cpu//0/<rank>`` for gloo). A restarted rank can then read the address a killed process had
    published and fail to connect to it (``Gloo connectFullMesh failed ... Connection refused``); behind the prefix
    every incarnation reads only addresses published by its own processes. Every process of one incarnation has
    the same restart count as long as one agent restarts them all (a single-node job: ``--standalone`` or one
    ``--nnodes``); it is 0 outside ``torchrun``'s restarts.
    """
    return dist.PrefixStore(f"ppll/restart_{int(os.environ.get(RESTART, '0'))}/", store)


def release() -> None:
    """Destroy the default process group (and every other), waiting at most 10 s for its teardown."""
    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - reported below
            warnings.warn(f"destroying the process group raised {type(e).__name__}: {e}", stacklevel=1)

    thread = threading.Thread(target=destroy, name="ppll-release", daemon=True)
    thread.start()
    thread.join(_RELEASE)
    if thread.is_alive():
        warnings.warn(f"the process group was not released within {_RELEASE:g} s (a peer still holds an operation "
                      f"open?); it is left to the end of the process", stacklevel=2)


def abort(groups: list[Any]) -> None:
    """Make every pending and later send, receive and collective of this rank in ``groups`` fail at once.

    ``None`` stands for the default group. Gloo has no abort of its own, but a receive that times out closes
    every connection of its group on this rank (the peers find them closed): a receive on a tag that nothing is
    ever sent with, waited for a millisecond, does that. It is tried with every peer, since one whose
    connection is closed already refuses the receive at once, without a time-out. Other backends get
    ``ProcessGroup.abort()``.
    """
    if not dist.is_initialized():
        return
    me = dist.get_rank()
    for group in groups:
        group = dist.group.WORLD if group is None else group
        try:
            if dist.get_backend(group) != "gloo":
                group.abort()
                continue
            peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        except Exception:  # noqa: BLE001 - a group that is gone already
            continue
        for peer in peers:
            try:
                dist.irecv(torch.empty(1), src=peer, group=group, tag=_ABORT_TAG).wait(timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the time-out itself, or a connection that is closed already
                pass


def rank_device(rank: int) -> torch.device:
    """The device of ``rank``: ``cuda:LOCAL_RANK`` (made current) when CUDA is there, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", rank % count))
    if local >= count:
        raise PPLLError(f"LOCAL_RANK is {local} but this machine has {count} CUDA device(s); start at most "
                        f"{count} processes per node (torchrun --nproc-per-node={count})")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def check_world(plan: Plan, world: int, queue: str) -> None:
    """The plan needs ``plan.world_size`` processes, and a ``queue`` other than FIFO one process per stage."""
    k = plan.num_stages
    if world != plan.world_size:
        replicas = f" ({' + '.join(str(s.replicas) for s in plan.stages)} replicas)" \
            if plan.world_size != k else ""
        raise PPLLError(f"the plan has {k} stages{replicas}, so it needs {plan.world_size} processes; got "
                        f"world size {world} (launch with torchrun --nproc-per-node={plan.world_size}, or "
                        f"compile with gpus={world})")
    if queue != "fifo" and plan.world_size != k:
        raise PPLLError(f'queue="{queue}" needs one process per stage: the replicas of a stage must train '
                        f'on the same batches; compile with replicas=False or use queue="fifo"')


def plan_identity(plan: Plan) -> dict[str, Any]:
    """What every rank's plan must share: cuts, heads, replicas and blocks."""
    return {"cuts": list(plan.cuts), "heads": [s.head.config for s in plan.stages],
            "replicas": [s.replicas for s in plan.stages], "blocks": [list(s.blocks) for s in plan.stages]}


def plan_mismatch(plans: list[dict[str, Any]]) -> str | None:
    """What to tell the user when the :func:`plan_identity` of every rank (in rank order) are not all the same;
    ``None`` when they are."""
    differ = [r for r, p in enumerate(plans) if p != plans[0]]
    if not differ:
        return None
    other = " (and other heads or replicas)" if plans[0]["cuts"] == plans[differ[0]]["cuts"] else ""
    return (f"the processes compiled different plans: rank 0 cuts after {plans[0]['cuts']}, rank "
            f"{differ[0]} after {plans[differ[0]]['cuts']}{other}. Plan once (e.g. "
            "plan.save('plan.json') on one process) and compile with plan='plan.json' on every rank")


def check_same_plan(plan: Plan, world: int) -> None:
    """Every rank must run the same cuts and heads: a plan measured by time may differ from process to process."""
    plans: list[Any] = [None] * world
    dist.all_gather_object(plans, plan_identity(plan))
    mismatch = plan_mismatch(plans)
    if mismatch is not None:
        raise PPLLError(mismatch)


SAME_MODEL = ("start every rank with the same model file and options (torchrun runs one script on every rank: build "
              "the model the same way on each, with no layer, width or dtype that depends on the rank)")
"""The way out when the ranks' models differ."""
_SHOWN = 160
"""Characters of a node or tensor shown in the error that names the first difference."""


def _plain(value: Any) -> str:
    """An argument of a graph node as text that is the same in every process: a node by its name, numbers and
    strings by their repr, containers item by item, a device by its type, any other object by its type's name (never
    an address)."""
    if isinstance(value, fx.Node):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        inner = ", ".join(map(_plain, value)) + ("," if isinstance(value, tuple) and len(value) == 1 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_plain(k)}: {_plain(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_plain(value.start)}, {_plain(value.stop)}, {_plain(value.step)})"
    if isinstance(value, torch.device):
        return f"device({value.type!r})"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    return type(value).__qualname__


def _call(module: nn.Module, node: fx.Node) -> str:
    """What ``node`` computes, as text: a submodule by its path and class (a ``torch.nn`` one with its settings, e.g.
    ``2: Linear(in_features=8, out_features=16, bias=True)``), a function by its qualified name, a method by its name,
    each with its arguments; a tensor attribute with its dtype and shape."""
    target = node.target
    args = ", ".join([*map(_plain, node.args), *(f"{k}={_plain(v)}" for k, v in node.kwargs.items())])
    if node.op == "placeholder":
        return "input"
    if node.op == "call_module":
        sub = module.get_submodule(str(target))
        kind = type(sub)
        settings = f"({sub.extra_repr()})" if kind.__module__.startswith("torch.nn") else ""
        return f"{target}: {kind.__qualname__}{settings}({args})"
    if node.op == "get_attr":
        value = getattr(module, str(target), None) if "." not in str(target) else None
        if isinstance(value, torch.Tensor):
            return f"{target}: {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
        return str(target)
    if node.op == "call_method":
        return f".{target}({args})"
    if callable(target):
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__qualname__
        return f"{getattr(target, '__module__', None) or ''}.{name}".lstrip(".") + f"({args})"
    return f"{target}({args})"


def module_lines(module: nn.Module) -> list[str]:
    """One module's fingerprint: for a graph (a traced model, or a stage holding one) every node of it (what it calls,
    on which values), for a head the classes of its submodules; then its parameters and buffers (name, dtype,
    shape)."""
    graph = module if isinstance(module, fx.GraphModule) else getattr(module, "module", None)
    if isinstance(graph, fx.GraphModule):
        lines = [f"node {node.name} = {_call(graph, node)}" for node in graph.graph.nodes]
    else:
        lines = [f"module {name or '(root)'}: {type(m).__qualname__}" for name, m in module.named_modules()]
    return lines + [f"{kind} {name}: {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
                    for name, t in items]


def model_fingerprint(lowered: Lowered) -> list[tuple[str, list[str]]]:
    """What every rank's model must share, part by part (each stage module, its head, Pipe-BD's teacher blocks):
    the lines of :func:`module_lines`, from the modules every rank holds (its own materialised, the others' on the
    meta device), so they are the same on every rank started with the same model and options."""
    block = "block" if lowered.teacher else "stage"
    parts = [(f"{block} {i}", m) for i, m in enumerate(lowered.modules)]
    parts += [(f"the head of {block} {i}", h) for i, h in enumerate(lowered.heads) if h is not None]
    parts += [(f"teacher block {i}", t) for i, t in enumerate(lowered.teacher)]
    return [(label, module_lines(m)) for label, m in parts]


def fingerprint_digest(fingerprint: list[tuple[str, list[str]]]) -> str:
    """A short digest of a :func:`model_fingerprint`, exchanged before the whole of it."""
    return hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest()


def model_mismatch(prints: list[list[tuple[str, list[str]]]]) -> str | None:
    """What to tell the user when the :func:`model_fingerprint` of every rank (in rank order) are not all the same:
    the ranks that differ from rank 0 and the first difference (the part, the parameter or node); ``None`` when they
    are the same."""
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if not differ:
        return None
    mine, other, r = prints[0], prints[differ[0]], differ[0]
    labels = [label for label, _ in mine]
    if labels != [label for label, _ in other]:
        where = (f"rank 0's model lowers to {', '.join(labels)}; rank {r}'s to "
                 f"{', '.join(label for label, _ in other)}")
    else:
        i = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
        (label, a), (_, b) = mine[i], other[i]
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

        def show(lines: list[str]) -> str:
            return f"{lines[j][:_SHOWN]!r}" if j < len(lines) else "nothing more"

        where = f"first in {label}: rank 0 has {show(a)} where rank {r} has {show(b)}"
    ranks = f"rank {r} differs" if len(differ) == 1 else f"ranks {', '.join(map(str, differ))} differ"
    return f"the ranks were started with different models ({ranks} from rank 0), {where}; {SAME_MODEL}"


def check_same_model(lowered: Lowered, world: int) -> None:
    """Every rank must have lowered the same model: their :func:`model_fingerprint` digests are gathered, and when
    they differ the whole fingerprints, so that every rank raises the same :class:`PPLLError` naming the ranks and
    the first difference (before any of them trains, or fails on a shape another rank sent)."""
    fingerprint = model_fingerprint(lowered)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, fingerprint_digest(fingerprint))
    if len(set(digests)) == 1:
        return
    prints: list[Any] = [None] * world
    dist.all_gather_object(prints, fingerprint)
    mismatch = model_mismatch(prints)
    if mismatch is not None:
        raise PPLLError(mismatch)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one rank sits in the pipeline: ranks go to the stages in order, ``plan.stages[j].replicas`` each."""

    rank: int
    """This process's rank."""
    ranks: tuple[tuple[int, ...], ...]
    """The ranks of every stage's replicas."""
    stage: int
    """The stage this rank runs."""
    replica: int
    """Which replica of its stage this rank is (0 for the first)."""

    @property
    def fed(self) -> bool:
        """Whether this rank gets its slice of the data from rank 0 (a further replica of stage 0)."""
        return self.stage == 0 and self.replica > 0

    @property
    def upstream(self) -> list[int]:
        """The ranks this rank receives each batch from (a part from each), in order."""
        if self.fed:
            return [0]
        return list(self.ranks[self.stage - 1]) if self.stage > 0 else []

    @property
    def feeds(self) -> list[int]:
        """Rank 0: the other replicas of stage 0, which it sends their slices of every batch."""
        return list(self.ranks[0][1:]) if self.rank == 0 else []

    @property
    def downstream(self) -> list[int]:
        """The replicas of the next stage, which this rank sends a slice of each batch."""
        return list(self.ranks[self.stage + 1]) if self.stage < len(self.ranks) - 1 else []

    def stage_of(self, rank: int) -> int:
        """The stage that ``rank`` runs."""
        return next(j for j, ranks in enumerate(self.ranks) if rank in ranks)


def place(plan: Plan, rank: int) -> Placement:
    """The placement of ``rank`` for ``plan``."""
    k = plan.num_stages
    first = [sum(s.replicas for s in plan.stages[:j]) for j in range(k + 1)]
    stage = max(j for j in range(k) if first[j] <= rank)
    return Placement(rank=rank, ranks=tuple(tuple(range(first[j], first[j + 1])) for j in range(k)), stage=stage,
                     replica=rank - first[stage])


def stage_group(placement: Placement) -> Any:
    """The process group of this rank's stage replicas (``None`` when unreplicated).

    Every rank creates every stage's group, in the same order, as ``new_group`` requires.
    """
    group = None
    for j, ranks in enumerate(placement.ranks):
        g = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        group = g if j == placement.stage else group
    return group
