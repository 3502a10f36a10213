"""Every wall-clock measurement of a plan: whole candidate stages and their optimizer step, segments and heads
(``profile="time"``), Pipe-BD blocks at replica shares."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..analysis.analyse import Analysis
from ..capture.frontends import BUFFER_OWNERS
from ..cost.optimizers import OPTIMIZERS
from ..heads.build import head_for
from ..heads.losses import logits_of, model_loss
from ..heads.modules import head_loss
from ..heads.policy import Policy
from ..plans.specs import HeadSpec, StageTime
from .split import split_stages
from .stages import Stage, move

OptimizerKind = str | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""``sgd``, ``momentum`` or ``adam``, or a factory ``fn(params) -> Optimizer``."""

_TIMING_LR = 1e-4
"""Learning rate of the optimizers a timing builds: small, so that the copies' weights stay well scaled."""


def first_device(requested: Sequence[str] | None) -> torch.device:
    """The device a time profile runs on: the first requested one, else the first GPU, else the CPU."""
    if requested:
        return torch.device(requested[0])
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def time_callable(fn: Callable[[], Any], *, device: torch.device, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rows(values: tuple[Any, ...]) -> int:
    return next(v.shape[0] for v in values if isinstance(v, Tensor) and v.dim())


def _head_rows(values: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
    """The first ``rows`` rows of every batch-major tensor (one replica's share)."""
    n = _rows(values)
    return tuple(v[:rows] if isinstance(v, Tensor) and v.dim() and v.shape[0] == n else v for v in values)


def time_blocks(tb: Sequence[Stage], sb: Sequence[Stage], losses: Sequence[Callable], inputs: tuple[Any, ...],
                device: torch.device, replicas: int) -> list[list[float]]:
    """Median seconds of each Pipe-BD block on ``device`` (teacher forward plus student forward and backward), at
    the whole batch and at each share of it that ``2 .. replicas`` replicas would train on: ``times[r - 1][k]``.

    Uses copies, so the models' parameters, buffers and gradients are untouched, and torch's random number
    generators are restored afterwards (a student's dropout draws from them).
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _time_blocks(tb, sb, losses, inputs, device, replicas)


def _time_blocks(tb: Sequence[Stage], sb: Sequence[Stage], losses: Sequence[Callable], inputs: tuple[Any, ...],
                 device: torch.device, replicas: int) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in range(replicas)]
    values: Any = move(inputs, device)
    for t, s, loss in zip(tb, sb, losses):
        t, s = copy.deepcopy(t).to(device).eval(), copy.deepcopy(s).to(device).train()
        with torch.no_grad():
            out = t(*values)
        for r in range(1, replicas + 1):
            rows = -(-_rows(values) // r)
            x, y = _head_rows(values, rows), _head_rows((out,) if not isinstance(out, tuple) else out, rows)

            def student_step(x: Any = x, target: Tensor = y[0], s: nn.Module = s, loss: Callable = loss) -> None:
                o = s(*x)
                loss(o[0] if isinstance(o, tuple) else o, target).backward()

            def teacher_step(x: Any = x, t: nn.Module = t) -> None:
                with torch.no_grad():
                    t(*x)
            times[r - 1].append(time_callable(teacher_step, device=device) + time_callable(student_step, device=device))
        values = out
    return times


def round_statistics(rounds: Sequence[Sequence[float]]) -> tuple[float, float]:
    """The least of the per-round medians of timing samples (``rounds[r]``: round ``r``'s runs), and their spread
    ``max / min - 1`` (0 when the least median is 0)."""
    if not rounds or not all(rounds):
        raise ValueError(f"round_statistics needs at least one round of at least one sample, got {rounds!r}")
    medians = [statistics.median(r) for r in rounds]
    lo = min(medians)
    return lo, (max(medians) / lo - 1.0 if lo > 0 else 0.0)


def make_optimizer(kind: OptimizerKind, params: list[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    """The torch optimizer a plan's ``optimizer`` names, over ``params``, with the multi-tensor (``foreach``)
    implementation on CUDA; a callable ``kind`` is called with ``params``."""
    if callable(kind):
        return kind(params)
    foreach = True if device.type == "cuda" else None  # None: torch's own choice elsewhere
    _check_optimizer(kind)
    return OPTIMIZERS[kind].make(params, _TIMING_LR, foreach)


def _check_optimizer(kind: OptimizerKind) -> None:
    if not callable(kind) and kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or a factory fn(params) -> Optimizer, "
                         f"got {kind!r}")


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def _labels(a: Analysis, scores: Tensor, device: torch.device, classes: int) -> Tensor:
    """Random class labels for ``scores`` (N x ... per example, N x L x ... per token)."""
    shape = scores.shape[:2] if a.per_token else scores.shape[:1]
    return torch.randint(0, max(classes, 1), shape, device=device)


def _sum_loss(out: Any) -> Tensor:
    """A loss whose backward is that of a sum of every grad-requiring tensor of ``out``."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("the last stage's output has no tensor that requires grad: nothing to train")
    return sum(t.sum() for t in leaves)  # type: ignore[return-value]


def _last_loss(a: Analysis, out: Any, device: torch.device) -> Callable[[Any], Tensor]:
    """The last stage's loss: the default (cross-entropy) on class scores, else the backward of a sum."""
    scores = logits_of(out)
    if isinstance(scores, Tensor) and scores.is_floating_point() and a.num_classes > 0 \
            and scores.dim() == (3 if a.per_token else 2):
        y = _labels(a, scores, device, scores.shape[-1])
        return lambda o: model_loss(o, y)
    return _sum_loss


@dataclass
class _Candidate:
    """One candidate stage, ready to train: its module, loss, optimizer and the input it receives."""

    stage: Stage
    loss: Callable[[Any], Tensor]
    optimizer: torch.optim.Optimizer | None
    inputs: tuple[Any, ...]

    def run(self, sync: Callable[[], None]) -> tuple[float, float]:
        """One training step: (seconds of the whole step, seconds of its optimizer step and zero_grad)."""
        xs = tuple(v.clone() if isinstance(v, Tensor) else v for v in self.inputs)  # a fresh received copy
        sync()
        t0 = time.perf_counter()
        self.loss(self.stage(*xs)).backward()
        sync()
        t1 = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


def _check_intervals(intervals: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out = []
    for iv in intervals:
        i, j = iv
        if not (0 <= i <= j < n):
            raise ValueError(f"candidate stage {tuple(iv)} is not an interval of the {n} atomic segments: give "
                             f"(first, last) with 0 <= first <= last <= {n - 1}")
        out.append((int(i), int(j)))
    return list(dict.fromkeys(out))


def _received(gm: torch.fx.GraphModule, a: Analysis, device: torch.device, firsts: set[int], lasts: set[int]
              ) -> tuple[dict[int, tuple[Any, ...]], dict[int, Any]]:
    """One training-mode forward of ``gm`` without autograd: the values segment ``i`` receives (for ``i`` in
    ``firsts``, detached, as the runtime gives them) and the main value after segment ``j`` (for ``j`` in ``lasts``;
    the model's output after the last)."""
    values: tuple[Any, ...] = tuple(move(x, device) for x in a.real_inputs)
    inputs: dict[int, tuple[Any, ...]] = {}
    after: dict[int, Any] = {}
    with torch.no_grad():
        for i, seg in enumerate(split_stages(gm, a.cuts, untie=True)):
            if i in firsts:
                inputs[i] = tuple(v.detach() if isinstance(v, Tensor) else v for v in values)
            values = seg(*values)
            if seg.is_last:
                values = (values,)
            if i in lasts:
                after[i] = values[0]
    return inputs, after


def _candidates(a: Analysis, heads: Mapping[int, HeadSpec], policy: Policy, device: torch.device,
                optimizer: OptimizerKind, intervals: list[tuple[int, int]]) -> dict[tuple[int, int], _Candidate]:
    """Every interval as a stage module of a private copy of the model on ``device``, with its head and optimizer."""
    owners = a.gm.meta.get(BUFFER_OWNERS)  # the model's modules behind buffers read by attribute: not copied along
    gm = copy.deepcopy(a.gm, {id(owners): {}} if owners is not None else None).to(device).train()
    for p in gm.parameters():
        p.grad = None
    n = len(a.cuts) + 1
    inputs, after = _received(gm, a, device, {i for i, _ in intervals} | {0}, {j for _, j in intervals})
    raw = inputs[0][0] if inputs[0] and isinstance(inputs[0][0], Tensor) else None  # what an InfoPro head rebuilds
    input_shape = a.inputs[0].shape if a.inputs else None
    made: dict[int, nn.Module] = {}
    cands: dict[tuple[int, int], _Candidate] = {}
    for i, j in intervals:
        cuts = ([a.cuts[i - 1]] if i > 0 else []) + ([a.cuts[j]] if j < n - 1 else [])
        stage = split_stages(gm, cuts, untie=True)[1 if i > 0 else 0].train()
        params = list(stage.parameters())
        if j < n - 1:
            if j not in made:
                config = heads[j].config if j in heads else None
                made[j] = head_for(policy, config, a.boundary(a.cuts[j])[0], a.num_classes, input_shape,
                                   per_token=a.per_token)[0].to(device).train()
            head, y = made[j], _labels(a, after[j], device, a.num_classes)
            loss = (lambda o, head=head, y=y: head_loss(head, o[0], y, raw))
            params += list(head.parameters())
        else:
            loss = _last_loss(a, after[j], device)
        params = [p for p in params if p.requires_grad]
        opt = make_optimizer(optimizer, params, device) if params else None
        cands[(i, j)] = _Candidate(stage=stage, loss=loss, optimizer=opt, inputs=inputs[i])
    return cands


def time_stages(a: Analysis, heads: Mapping[int, HeadSpec], policy: Policy, device: torch.device,
                optimizer: OptimizerKind, intervals: Sequence[tuple[int, int]], *, rounds: int = 3, runs: int = 3,
                warmup: int = 1) -> dict[tuple[int, int], StageTime]:
    """Robust wall time on ``device`` of a whole training step of every candidate stage in ``intervals``.

    A candidate ``(first, last)`` runs atomic segments ``first..last`` (inclusive; segment ``i`` ends at cut ``i``)
    as one stage module, on its input detached as the runtime gives it, then the auxiliary head at cut ``last``
    (``heads[last]``'s config, else the policy's) or, for the stage that ends the model, the default loss on the
    model's class scores (the backward of a sum if its output is not class scores), backward, and an
    ``optimizer`` step over the stage's and its head's parameters with ``zero_grad(set_to_none=True)``.

    After ``warmup`` steps of every candidate, ``rounds`` rounds each run every candidate in turn, ``runs`` steps
    each (interleaved, so that a slow spell of a shared machine hits all candidates alike); a candidate's time is
    the least of its rounds' medians (:func:`round_statistics`). Works on a copy of the model: its parameters,
    gradients, buffers and modes, and torch's random number generators, are as they were.
    """
    if rounds < 1 or runs < 1 or warmup < 0:
        raise ValueError(f"time_stages needs rounds >= 1, runs >= 1 and warmup >= 0; got rounds={rounds}, "
                         f"runs={runs}, warmup={warmup}")
    wanted = _check_intervals(intervals, len(a.cuts) + 1)
    _check_optimizer(optimizer)
    if not wanted:
        return {}
    sync = _sync(device)
    gpus = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        cands = _candidates(a, heads, policy, device, optimizer, wanted)
        for c in cands.values():
            for _ in range(warmup):
                c.run(sync)
        total: dict[tuple[int, int], list[list[float]]] = {k: [] for k in cands}
        step: dict[tuple[int, int], list[list[float]]] = {k: [] for k in cands}
        for _ in range(rounds):
            for k, c in cands.items():
                samples = [c.run(sync) for _ in range(runs)]
                total[k].append([s[0] for s in samples])
                step[k].append([s[1] for s in samples])
    result = {}
    for k in cands:
        seconds, spread = round_statistics(total[k])
        result[k] = StageTime(seconds=seconds, step_seconds=round_statistics(step[k])[0], spread=spread)
    return result
