"""What travels between stages: the per-batch ``Message``, its kinds, and the evaluation tallies stages return."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import PPLLError
from ..plans.plan import TensorSpec

TRAIN, EVAL = "train", "eval"


@dataclass(kw_only=True)
class Message:
    """What travels between stages for one batch: the boundary values, the labels and (for InfoPro heads) the input."""

    index: int
    """Sequence number of the batch, from 0."""
    values: tuple[Any, ...]
    """The receiving stage's inputs: the model inputs for stage 0, else the previous boundary (detached)."""
    target: Any
    """Labels (or whatever the last stage's loss takes)."""
    raw: Tensor | None = None
    """The model's first input, for heads that reconstruct it (InfoPro); ``None`` when no later head needs it."""
    kind: str = TRAIN
    """``train`` or ``eval``."""
    events: list[Any] = field(default_factory=list)
    """CUDA events the receiver waits on before reading the tensors (threads runtime on GPUs)."""
    whole: int | None = None
    """Rows of the whole batch when this message is one replica's slice of it (distributed runtime)."""
    reused: bool = False
    """Whether the receiving stage trained on this input before (``queue="latest"``): another random stream."""

    @property
    def size(self) -> int:
        """Batch size: the first dimension of the target."""
        return int(self.target.shape[0]) if isinstance(self.target, Tensor) and self.target.dim() else 1


def dtype_of(spec: TensorSpec) -> torch.dtype | None:
    """The torch dtype of a tensor ``spec``, or ``None`` for a Python scalar (``spec.scalar``)."""
    if spec.scalar:  # its dtype names a Python type: getattr(torch, "bool") would be torch.bool
        return None
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise PPLLError(f"boundary value {spec.name!r} has dtype {spec.dtype!r}, which names no torch dtype; a plan "
                        f"file must spell tensor dtypes as torch does (e.g. float32, bool, int64)")
    return dtype


def add_counts(total: Any, more: Any) -> Any:
    """Sum of two evaluation tallies (tuples of numbers, elementwise); ``None`` when either is ``None``."""
    if total is None or more is None:
        return None
    return more if total == () else tuple(a + b for a, b in zip(total, more))


def shape_text(shape: Iterable[Any]) -> str:
    """A shape as error messages write it, e.g. ``(N, 3, 32, 32)``."""
    return "(" + ", ".join(str(s) for s in shape) + ")"
