"""Every wall-clock measurement of a plan: segments and heads (``profile="time"``), Pipe-BD blocks at replica shares."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .analysis import Analysis
from .heads import head_for, head_loss
from .lower import split_stages
from .lowered import Stage, move
from .plan import HeadSpec
from .policy import Policy
from .trace import train_mode

__all__ = ["first_device", "time_callable", "time_segments", "time_blocks"]


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


def _backward_sum(out: Any) -> None:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


def _time_segment(seg: Stage, xs: tuple[Any, ...], first: bool, device: torch.device) -> float:
    """Median forward+backward seconds of one segment on the values it receives."""
    if first:
        return time_callable(lambda: _backward_sum(seg(*xs)), device=device)
    # inside a stage a segment also computes its input's gradient (so a stage's first segment is charged one
    # input gradient too many); copies of grad-requiring leaves let in-place ops at its start run, and the
    # copying time is taken off again
    leaves = tuple(v.requires_grad_(v.is_floating_point()) if isinstance(v, Tensor) else v for v in xs)
    clones = lambda: tuple(v.clone() if isinstance(v, Tensor) else v for v in leaves)  # noqa: E731
    full = time_callable(lambda: _backward_sum(seg(*clones())), device=device)
    return max(0.0, full - time_callable(clones, device=device))


def time_segments(a: Analysis, heads: Mapping[int, HeadSpec], policy: Policy,
                  device: torch.device) -> tuple[list[float], dict[int, float]]:
    """Median forward+backward seconds of every atomic segment and of the head at every cut, on ``device``.

    The model's buffers, gradients and train/eval modes are restored afterwards.
    """
    gm = a.gm
    if any(p.device != device for p in gm.parameters()):
        gm = copy.deepcopy(gm).to(device)
    buffers = {k: b.clone() for k, b in gm.named_buffers()}
    grads = {p: p.grad for p in gm.parameters()}
    seg_times: list[float] = []
    head_times: dict[int, float] = {}
    values: Any = tuple(x.to(device) if isinstance(x, Tensor) else x for x in a.real_inputs)
    first_input = values[0]
    input_shape = a.inputs[0].shape if a.inputs else None
    try:
        with train_mode(gm):
            for i, seg in enumerate(split_stages(gm, a.cuts)):
                xs = tuple(v.detach() if isinstance(v, Tensor) else v for v in values)  # as a stage receives them
                seg_times.append(_time_segment(seg, xs, i == 0, device))
                with torch.no_grad():
                    values = seg(*xs)
                if i in heads:
                    head = head_for(policy, heads[i].config, a.boundary(a.cuts[i])[0], a.num_classes,
                                    input_shape, per_token=a.per_token)[0].to(device)
                    h = values[0].detach()
                    labels = h.shape[:2] if a.per_token else h.shape[:1]
                    y = torch.randint(0, a.num_classes, labels, device=device)
                    head_times[i] = time_callable(lambda: head_loss(head, h, y, first_input).backward(),
                                                  device=device)
    finally:
        with torch.no_grad():
            for k, b in gm.named_buffers():
                b.copy_(buffers[k])
        for p, g in grads.items():
            p.grad = g
    return seg_times, head_times


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

    Uses copies, so the models' parameters, buffers and gradients are untouched.
    """
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
