"""The input memory of ``queue="latest"``: a stage's two newest inputs, to train on again when none is waiting."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .messages import Message

__all__ = ["Recent"]


class Recent:
    """``queue="latest"``: a stage's two newest inputs, each trained on again at most once when none is waiting."""

    def __init__(self) -> None:
        self._entries: list[list[Any]] = []  # [pristine copy, reused?], newest first

    @staticmethod
    def _copy(m: Message, reused: bool = False) -> Message:
        # a stage may modify its input in place (a ReLU right after the cut): keep and hand out copies
        return Message(index=m.index, values=tuple(v.clone() if isinstance(v, Tensor) else v for v in m.values),
                       target=m.target, raw=m.raw, kind=m.kind, whole=m.whole, reused=reused)

    def remember(self, msg: Message) -> None:
        """Keep a copy of a new input (call it before the stage runs on ``msg``)."""
        self._entries = [[self._copy(msg), False]] + self._entries[:1]

    def reuse(self) -> Message | None:
        """A copy of the newest, else the second newest, input not yet reused (marked ``reused``); ``None`` if none."""
        for entry in self._entries:
            if not entry[1]:
                entry[1] = True
                return self._copy(entry[0], reused=True)
        return None

    def clear(self) -> None:
        """Forget every input (at the end of an epoch)."""
        self._entries = []
