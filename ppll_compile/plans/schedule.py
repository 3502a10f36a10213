"""The schedule of a local-learning stage as data: what it does next under a queue rule, printable as a grid.

A stage takes an input (``R``: receive a new one; ``U``: reuse a remembered one; ``D``: drop an older waiting
one), runs its block (``F``), sends its output on at once when the next queue has room (``E``: early
forwarding), takes its local loss (``L``: the auxiliary head, or the model's loss on the last stage), runs
backward (``B``), waits for every stage (``W``, only with ``decoupled=False``), steps its optimizer (``O``) and,
when the early send found no room, sends then (``S``). :class:`StageRule` says which of these a stage does,
:func:`next_input` which input it takes (the one rule the threads and distributed runtimes both follow),
:class:`Memory` which input ``queue="reuse"`` trains on again, and :func:`grid` plays them on a clock of
unit slots, printed one stage per line::

    >>> print(grid(2, 2, slots=[1, 1]))
    R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1 .  .
    .  .  .  R0 F0 L0 B0 O0 .  R1 F1 L1 B1 O1

The queue rules: ``fifo`` trains on every input in order (the stage before waits while the queue is full);
``latest`` takes the newest waiting input and drops the older ones (the stage before never waits: a full queue
drops its oldest input); ``reuse`` is FIFO, and a stage that finds no input waiting trains again on its newest,
else second-newest, input not yet reused (each at most once; the output of a reused input is not sent on).
The first stage always takes its inputs in order and never reuses.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Op", "Action", "StageRule", "Memory", "next_input", "rules", "Grid", "grid"]

QUEUES = ("fifo", "latest", "reuse")
"""The queue rules in front of a stage."""

T = TypeVar("T")


class Op(enum.Enum):
    """One thing a stage does, named by its letter in a grid."""

    RECEIVE = "R"
    REUSE = "U"
    DROP = "D"
    FORWARD = "F"
    SEND_EARLY = "E"
    LOSS = "L"
    BACKWARD = "B"
    BARRIER = "W"
    STEP = "O"
    SEND_LATE = "S"

    @property
    def span(self) -> str | None:
        """The kind of timeline span this is part of (a runtime traces the loss inside its ``forward`` span);
        ``None`` when it has none."""
        return _SPANS[self]


_SPANS: dict[Op, str | None] = {
    Op.RECEIVE: "receive", Op.REUSE: None, Op.DROP: None, Op.FORWARD: "forward", Op.SEND_EARLY: "send",
    Op.LOSS: "forward", Op.BACKWARD: "backward", Op.BARRIER: None, Op.STEP: "step", Op.SEND_LATE: "send"}


@dataclass(frozen=True, kw_only=True)
class Action:
    """One thing a stage does on one batch, written ``F3`` (its :class:`Op`'s letter, then the batch index)."""

    op: Op
    """What it does."""
    batch: int
    """The index of the batch it does it on."""

    def __str__(self) -> str:
        return f"{self.op.value}{self.batch}"

    @classmethod
    def from_str(cls, text: str) -> Action:
        """The action written ``text`` (e.g. ``"F3"``)."""
        letters = {op.value: op for op in Op}
        if text[:1] not in letters or not text[1:].isdigit():
            raise ValueError(f"{text!r} is not an action: expected one of the letters {''.join(letters)} and a "
                             f"batch index, e.g. 'F3'")
        return cls(op=letters[text[0]], batch=int(text[1:]))


@dataclass(frozen=True, kw_only=True)
class StageRule:
    """How one stage trains: its queue rule, the depth of the queues, the barrier and its place in the pipeline."""

    queue: str = "fifo"
    """The rule of the queue in front of every stage after the first: one of :data:`QUEUES`."""
    depth: int = 2
    """Inputs a queue between two stages holds."""
    decoupled: bool = True
    """``False``: a barrier of all the stages before every optimizer step (FIFO queues only)."""
    first: bool = True
    """Whether this is the first stage (it takes its inputs in order and never reuses)."""
    last: bool = True
    """Whether this is the last stage (it sends nothing on)."""

    def __post_init__(self) -> None:
        if self.queue not in QUEUES:
            raise ValueError(f"queue must be one of {', '.join(QUEUES)}, got {self.queue!r}")
        if not isinstance(self.depth, int) or isinstance(self.depth, bool) or self.depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {self.depth!r} (the inputs a queue holds, e.g. 2)")
        if not self.decoupled and self.queue != "fifo":
            raise ValueError(f"decoupled=False (a barrier before every optimizer step) needs queue='fifo', got "
                             f"queue={self.queue!r}; use decoupled=True with {self.queue!r}")

    @property
    def takes_newest(self) -> bool:
        """Whether the stage takes the newest waiting input and drops the older ones (``queue="latest"``)."""
        return self.queue == "latest" and not self.first

    @property
    def reuses(self) -> bool:
        """Whether the stage trains again on a remembered input when none is waiting (``queue="reuse"``)."""
        return self.queue == "reuse" and not self.first

    @property
    def barrier(self) -> bool:
        """Whether the stage waits for every stage between its backward and its optimizer step."""
        return not self.decoupled

    def sends(self, reused: bool = False) -> bool:
        """Whether the stage sends its output on (never from the last stage, never for a reused input)."""
        return not self.last and not reused

    def send_early(self, room: bool) -> bool:
        """Whether the output goes on right after the forward (else after the step), given whether the next queue
        has ``room``: a ``latest`` queue always takes it (it drops its oldest input instead)."""
        return room or self.queue == "latest"

    def turn(self, batch: int, *, reused: bool = False, early: bool = True, dropped: Sequence[int] = ()
             ) -> tuple[Action, ...]:
        """The actions of one training step on ``batch``: a ``reused`` input or a new one (``dropped``: the
        older inputs dropped to take it), its output sent ``early`` or after the step."""
        def act(op: Op, b: int = batch) -> Action:
            return Action(op=op, batch=b)

        sends = self.sends(reused)
        out = [act(Op.DROP, d) for d in dropped] + [act(Op.REUSE if reused else Op.RECEIVE), act(Op.FORWARD)]
        out += [act(Op.SEND_EARLY)] if sends and early else []
        out += [act(Op.LOSS), act(Op.BACKWARD)] + ([act(Op.BARRIER)] if self.barrier else []) + [act(Op.STEP)]
        return tuple(out + ([act(Op.SEND_LATE)] if sends and not early else []))


def rules(stages: int, *, queue: str = "fifo", depth: int = 2, decoupled: bool = True) -> tuple[StageRule, ...]:
    """The rule of every stage of a ``stages``-stage pipeline."""
    return tuple(StageRule(queue=queue, depth=depth, decoupled=decoupled, first=j == 0, last=j == stages - 1)
                 for j in range(stages))


class Memory(Generic[T]):
    """``queue="reuse"``: a stage's two newest inputs, each handed out again at most once, the newest first."""

    KEEP = 2
    """Inputs remembered."""

    def __init__(self) -> None:
        self._entries: list[list[Any]] = []  # [input, reused?], newest first

    def remember(self, item: T) -> None:
        """Remember a new input (the oldest remembered one is forgotten beyond :attr:`KEEP`)."""
        self._entries = [[item, False]] + self._entries[:self.KEEP - 1]

    def reuse(self) -> T | None:
        """The newest, else the second newest, input not yet reused (now marked reused); ``None`` if none."""
        for entry in self._entries:
            if not entry[1]:
                entry[1] = True
                return entry[0]
        return None

    def clear(self) -> None:
        """Forget every input (at the end of an epoch)."""
        self._entries = []


def next_input(rule: StageRule, *, poll: Callable[[], Any], wait: Callable[[], Any], memory: Memory[Any]
               ) -> tuple[Any, bool]:
    """The next item a stage takes and whether it is a reused input.

    ``poll()`` gives the next waiting item (by the queue's rule) or ``None`` without waiting; ``wait()`` waits
    for one. A stage that reuses polls, and when nothing waits trains again on ``memory``'s choice, or waits
    if it has none; a new item it takes is remembered. Any other stage waits for the next item.
    """
    if not rule.reuses:
        return wait(), False
    item = poll()
    if item is None:
        again = memory.reuse()
        if again is not None:
            return again, True
        item = wait()
    memory.remember(item)
    return item, False


@dataclass(frozen=True)
class Grid:
    """What every stage does in each slot of a clock: one row per stage, ``None`` where it waits."""

    rows: tuple[tuple[Action | None, ...], ...]

    def __str__(self) -> str:
        cells = [[str(a) if a is not None else "." for a in row] for row in self.rows]
        width = max((len(c) for row in cells for c in row), default=1)
        return "\n".join(" ".join(c.ljust(width) for c in row).rstrip() for row in cells)

    @classmethod
    def from_str(cls, text: str) -> Grid:
        """The grid printed as ``text`` (rows of actions or ``.``; indentation and blank lines are ignored)."""
        rows = [[None if c == "." else Action.from_str(c) for c in line.split()]
                for line in text.strip("\n").splitlines() if line.strip()]
        width = max((len(r) for r in rows), default=0)
        return cls(rows=tuple(tuple(r + [None] * (width - len(r))) for r in rows))

    def actions(self, stage: int) -> tuple[Action, ...]:
        """What ``stage`` does, in order, without the waits."""
        return tuple(a for a in self.rows[stage] if a is not None)


class _Idle(Exception):
    """Nothing waits for a stage in this slot, and its input is still to come."""


_END = object()


class _Clock:
    """Every stage's rule played slot by slot; what a stage does in a slot is seen by the others in the next."""

    def __init__(self, rules_: Sequence[StageRule], batches: int, slots: Sequence[int]) -> None:
        n = len(rules_)
        self.rules = rules_
        self.slots = slots
        self.inbox: list[list[int]] = [list(range(batches))] + [[] for _ in range(n - 1)]
        self.dropped: list[list[int]] = [[] for _ in range(n)]
        self.ended = [True] + [False] * (n - 1)  # whether the stage before has sent everything it will
        self.arrived = [0] * n  # backward passes done (the barrier counts them)
        self._later: list[Callable[[], None]] = []  # what this slot changes, seen from the next one

    def run(self, limit: int) -> Grid:
        n = len(self.rules)
        stages = [self._stage(j) for j in range(n)]
        rows: list[list[Action | None]] = [[] for _ in range(n)]
        live = set(range(n))
        for _ in range(limit):
            for j in range(n):
                cell: Any = next(stages[j], _END) if j in live else None
                if cell is _END:
                    live.discard(j)
                    cell = None
                rows[j].append(cell)
            for change in self._later:
                change()
            self._later = []
            if not live:
                width = max((k + 1 for r in rows for k, a in enumerate(r) if a is not None), default=0)
                return Grid(rows=tuple(tuple(r[:width]) for r in rows))
        raise ValueError(f"the stages still wait for each other after {limit} slots: {self.rules[0]!r}")

    def _take(self, j: int) -> Any:
        """The next waiting input of stage ``j`` by its rule (``_END`` once no more will come); ``None`` if none."""
        box = self.inbox[j]
        if not box:
            return _END if self.ended[j] else None
        if self.rules[j].takes_newest:
            self.dropped[j] += box[:-1]
            del box[:-1]
        return box.pop(0)

    def _wait(self, j: int) -> Any:
        item = self._take(j)
        if item is None:
            raise _Idle
        return item

    def _put(self, j: int, batch: int) -> None:
        """Stage ``j`` sends ``batch`` on (seen by the next stage from the next slot on)."""
        box, rule = self.inbox[j + 1], self.rules[j + 1]

        def arrive() -> None:
            if rule.queue == "latest" and len(box) >= rule.depth:
                self.dropped[j + 1].append(box.pop(0))  # a full latest queue drops its oldest input
            box.append(batch)

        self._later.append(arrive)

    def _room(self, j: int) -> bool:
        return len(self.inbox[j + 1]) < self.rules[j].depth

    def _stage(self, j: int) -> Iterator[Action | None]:
        rule, slots = self.rules[j], self.slots[j]
        memory: Memory[int] = Memory()
        steps = 0
        while True:
            try:
                item, reused = next_input(rule, poll=lambda: self._take(j), wait=lambda: self._wait(j),
                                          memory=memory)
            except _Idle:
                yield None
                continue
            if item is _END:
                if not rule.last:
                    self._later.append(lambda: self.ended.__setitem__(j + 1, True))
                return
            b: int = item
            sends, early = rule.sends(reused), True
            dropped, self.dropped[j] = self.dropped[j], []
            for action in rule.turn(b, reused=reused, early=True, dropped=dropped):
                op = action.op
                if op is Op.SEND_EARLY:
                    early = rule.send_early(self._room(j))
                    if not early:
                        continue
                    self._put(j, b)
                elif op is Op.BARRIER:
                    while min(self.arrived) < steps + 1:
                        yield None
                if op in (Op.FORWARD, Op.LOSS, Op.BACKWARD, Op.STEP):
                    for _ in range(slots - 1):
                        yield action
                if op is Op.BACKWARD:
                    self._later.append(lambda: self.arrived.__setitem__(j, self.arrived[j] + 1))
                yield action
            steps += 1
            if sends and not early:
                while not self._room(j):
                    yield None
                self._put(j, b)
                yield Action(op=Op.SEND_LATE, batch=b)


def grid(stages: int, batches: int, *, queue: str = "fifo", depth: int = 2, decoupled: bool = True,
         slots: Sequence[int] | None = None) -> Grid:
    """The schedule of ``batches`` batches through ``stages`` stages on a clock of unit slots.

    Every action takes one slot, except the forward, loss, backward and step of stage ``j``, which take
    ``slots[j]`` each (default 1): a slower stage makes the queue after it fill (FIFO sends wait for the step,
    ``latest`` drops) and the stage after it find no input (``reuse``). The first stage's inputs are all there
    from the start. What a stage sends arrives in the next slot, and the barrier of ``decoupled=False`` lets the
    stages step in the slot after the last one ended its backward.
    """
    slots = [1] * stages if slots is None else list(slots)
    if len(slots) != stages or any(not isinstance(s, int) or s < 1 for s in slots):
        raise ValueError(f"slots must give an int >= 1 for each of the {stages} stages, got {slots!r}")
    clock = _Clock(rules(stages, queue=queue, depth=depth, decoupled=decoupled), batches, slots)
    return clock.run(limit=16 * (stages + batches) * (max(slots) * 4 + 6))
