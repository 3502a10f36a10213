"""The golden schedule grids (``tests/golden/schedule/``) and the reduced form that grids and traced or simulated
timelines are compared in: one :class:`Case` per golden file, the MLP and batches the runtimes train on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppll_compile.plans.schedule import Grid, Op, grid
from ppll_compile.plans.timeline import Timeline
from tests.helpers import seeded_batches

GOLDEN = Path(__file__).resolve().parent / "golden" / "schedule"
"""Where the golden grids are, one ``<case name>.txt`` per :class:`Case`."""

REGENERATE = os.environ.get("PPLL_REGENERATE_GOLDEN") == "1"
"""Whether the tests rewrite the golden files instead of comparing with them."""

BATCHES = 4
"""Batches of every case."""

Reduced = tuple[tuple[str, ...], ...]
"""Per stage, its actions in order: ``("R0", "F0", "E0", "B0", "O0", "R1", ...)``."""


@dataclass(frozen=True)
class Case:
    """One schedule: ``grid(stages, BATCHES, queue=, depth=, decoupled=, slots=)``."""

    stages: int
    queue: str
    depth: int
    slots: tuple[int, ...]
    decoupled: bool = True

    @property
    def name(self) -> str:
        """The golden file's name without ``.txt``, e.g. ``fifo-coupled-2stages-depth1-slots1-1``."""
        rule = self.queue + ("" if self.decoupled else "-coupled")
        return f"{rule}-{self.stages}stages-depth{self.depth}-slots{'-'.join(map(str, self.slots))}"

    def call(self) -> str:
        return (f"grid({self.stages}, {BATCHES}, queue={self.queue!r}, depth={self.depth}, "
                f"decoupled={self.decoupled}, slots={list(self.slots)})")

    def grid(self) -> Grid:
        return grid(self.stages, BATCHES, queue=self.queue, depth=self.depth, decoupled=self.decoupled,
                    slots=self.slots)

    def text(self) -> str:
        """The golden file's text: the call as a comment, then the grid it prints."""
        return f"# {self.call()}\n{self.grid()}\n"


def _cases() -> list[Case]:
    """Every queue rule at depths 1 and 2 on 2 and 3 stages, each with unit slots and with the one slow stage that
    makes its rule show: ``fifo`` and ``latest`` a slow stage 1 (the queue in front of it fills: sends wait for the
    step, or older inputs are dropped), ``reuse`` a slow stage 0 (the stages after it find no input and reuse).
    ``fifo`` also with a queue as deep as the batches (room for every send), and with the barrier
    (``decoupled=False``) at unit slots."""
    out = []
    for n in (2, 3):
        even = (1,) * n
        slow_after, slow_first, slower_after = (1, 3) + (1,) * (n - 2), (2,) + (1,) * (n - 1), (1, 5) + (1,) * (n - 2)
        for depth in (1, 2):
            out += [Case(n, "fifo", depth, even), Case(n, "fifo", depth, slow_after),
                    Case(n, "fifo", depth, even, decoupled=False),
                    Case(n, "latest", depth, even), Case(n, "latest", depth, slower_after),
                    Case(n, "reuse", depth, even), Case(n, "reuse", depth, slow_first)]
        out.append(Case(n, "fifo", BATCHES, even))
    return out


CASES = {c.name: c for c in _cases()}


def golden(case: Case) -> str:
    """The golden file's text of ``case`` (rewritten first under ``PPLL_REGENERATE_GOLDEN=1``)."""
    path = GOLDEN / f"{case.name}.txt"
    if REGENERATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(case.text())
    assert path.is_file(), f"{path} is missing; write it with PPLL_REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_schedule_golden.py"
    return path.read_text()


def golden_grid(case: Case) -> Grid:
    """The grid of ``case``'s golden file (its lines after the comment)."""
    text = golden(case)
    return Grid.from_str("\n".join(line for line in text.splitlines() if not line.startswith("#")))


def reduce_grid(g: Grid) -> Reduced:
    """Each stage's actions in order, each once (a forward over three slots is one ``F``), without ``L`` and ``W``."""
    out = []
    for j in range(len(g.rows)):
        acts = [str(a) for a in g.actions(j) if a.op not in (Op.LOSS, Op.BARRIER)]
        out.append(tuple(a for k, a in enumerate(acts) if k == 0 or acts[k - 1] != a))
    return tuple(out)


def reduce_timeline(timeline: Timeline, stages: int) -> Reduced:
    """Each stage's spans (its first replica's) in the form of :func:`reduce_grid`.

    A turn opens at a forward on another batch than the turn before (a second forward span of the same batch before
    its backward is the rest of the forward, after an early send): ``U`` if the stage trained on that batch
    before, else ``R`` after a ``D`` for every batch the stage before sent on that this stage has not taken and
    that is older. ``receive`` spans are not read (the simulator traces one only when the stage waited).
    """
    out: list[tuple[str, ...]] = []
    for j in range(stages):
        sent = [int(a[1:]) for a in out[j - 1] if a[0] in "ES"] if j > 0 else []
        events = sorted((e for e in timeline.events if e.stage == j and e.replica == 0), key=lambda e: e.start)
        acts: list[str] = []
        seen: set[int] = set()  # batches trained on or dropped
        batch, phase = None, None
        for e in events:
            b = e.batch
            if e.kind == "forward":
                if b == batch and phase == "forward":
                    continue
                if b in seen:
                    acts.append(f"U{b}")
                else:
                    dropped = [d for d in sent if d < b and d not in seen]
                    acts += [f"D{d}" for d in dropped] + [f"R{b}"]
                    seen.update(dropped + [b])
                acts.append(f"F{b}")
                batch, phase = b, "forward"
            elif e.kind == "send":
                acts.append(f"{'E' if phase == 'forward' and b == batch else 'S'}{b}")
            elif e.kind == "backward":
                acts.append(f"B{b}")
                phase = "backward"
            elif e.kind == "step":
                acts.append(f"O{b}")
                phase = "step"
        out.append(tuple(acts))
    return tuple(out)


def project(reduced: Reduced, level: str) -> Any:
    """What of ``reduced`` is compared at ``level``: ``exact`` all of it; ``first`` stage 0's actions; ``order`` per
    stage, the actions of its turns on new inputs (drops included) without the sends, and the batches it sent on,
    in order (where a send falls, inside the forward or after the step, and which inputs are reused, are left
    out)."""
    if level == "exact":
        return reduced
    if level == "first":
        return reduced[:1]
    assert level == "order", level
    out = []
    for acts in reduced:
        kept, again = [], False
        for a in acts:
            again = a[0] == "U" or (again and a[0] not in "RD")
            if not again and a[0] not in "ES":
                kept.append(a)
        out.append((tuple(kept), tuple(int(a[1:]) for a in acts if a[0] in "ES")))
    return tuple(out)


def show(reduced: Any) -> str:
    """``reduced`` one stage a line, for a failure's message."""
    return "\n" + "\n".join(" ".join(map(str, row)) for row in reduced)


class MLP(nn.Sequential):
    """Four linear layers with ReLUs between, 8 features in, 4 classes out."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The :data:`BATCHES` batches of 4 examples every runtime trains :class:`MLP` on."""
    return seeded_batches(0, [4] * BATCHES, (8,), 4)
