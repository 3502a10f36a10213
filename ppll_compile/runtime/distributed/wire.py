"""The ``distributed`` runtime's wire format: a batch as an int64 header and its tensors, cut by rows for replicas.

Every batch travels as a fixed-length int64 header followed by its tensors::

    header   kind, batch index, batch size, target dtype code, target ndim, raw present, extra bytes,
             whole batch size (0 unless the part is a replica's slice), target shape (padded to 8 dims)
    tensors  the boundary values (in the plan's order), the target, the raw input if a later head needs it

Receive buffers are sized from the plan: a dimension 0 equal to the planned batch size is the batch and
takes the header's batch size. Python scalars travel as one-element tensors (int64 for ``int`` and
``bool``, float64 for ``float``) and arrive as the same Python type. An END header closes an epoch; a STOP
header is followed by a uint8 tensor holding a failing stage's report (JSON, its length in "extra bytes").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...errors import PPLLError
from ...partitioners.batch import split_refusal
from ...plans.plan import Plan, TensorSpec
from ..messages import EVAL, TRAIN, Message, dtype_of, shape_text

_TRAIN, _EVAL, _END, _STOP = 1, 2, 3, 4
_KIND_CODES = {TRAIN: _TRAIN, EVAL: _EVAL}
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64)
"""Target dtypes the header can name (by position)."""
_SCALARS = {"int": torch.int64, "float": torch.float64, "bool": torch.int64}
_PY_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "float": float, "bool": bool}

END = object()
"""What :meth:`Wire.receive` returns for an END header: the sender's epoch is over."""


class Stop:
    """A STOP header arrived from upstream, with the failing stage's report."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report


def _expected(spec: TensorSpec, planned: int, batch: int) -> tuple[int, ...]:
    """The shape of a value of ``spec`` at ``batch``: dimension 0 scales when it is the planned batch size."""
    if spec.shape and spec.shape[0] == planned:
        return (batch, *spec.shape[1:])
    return tuple(spec.shape)


def _rows(v: Any, spec: TensorSpec | None, planned: int) -> bool:
    """Whether ``v`` is split by rows between replicas: a tensor whose dimension 0 is the batch."""
    return isinstance(v, Tensor) and spec is not None and bool(spec.shape) and spec.shape[0] == planned


def split(msg: Message, specs: tuple[TensorSpec, ...], planned: int, parts: int) -> list[Message]:
    """``msg`` cut by rows into ``parts`` near-equal slices, one per replica (other values go to each whole)."""
    if parts == 1:
        return [msg]
    if (why := split_refusal(msg.size, parts)) is not None:
        raise PPLLError(f"{why}; feed batches of at least {parts} examples")

    def cut(v: Any, rows: bool) -> Any:
        return v.tensor_split(parts) if rows else [v] * parts

    columns = [cut(v, _rows(v, s, planned)) for v, s in zip(msg.values, specs)]
    targets, raws = cut(msg.target, True), cut(msg.raw, msg.raw is not None)
    return [Message(index=msg.index, values=tuple(c[i] for c in columns), target=targets[i], raw=raws[i],
                    kind=msg.kind, whole=msg.whole or msg.size) for i in range(parts)]


def join(values: list[Any], spec: TensorSpec | None, planned: int) -> Any:
    """The parts of one value received from several replicas, joined by rows (or the first, if not split)."""
    return torch.cat(values) if _rows(values[0], spec, planned) and len(values) > 1 else values[0]


def check_splittable(plan: Plan) -> None:
    """A replicated stage's input (and what follows one) must be tensors: a Python scalar has no rows to split."""
    k = plan.num_stages
    for j, specs in ((j, plan.stages[j - 1].boundary if j else plan.inputs) for j in range(k)):
        cut = plan.stages[j].replicas > 1 or (j > 0 and plan.stages[j - 1].replicas > 1)
        if cut and any(dtype_of(t) is None for t in specs):
            raise PPLLError(f"stage {j} is replicated (or follows a replicated stage), but its input carries a "
                            f"Python scalar, which cannot be split by rows; compile with replicas=False or "
                            f"cut elsewhere")


class Wire:
    """One rank's encoder and decoder: packs the batches it sends, receives (and joins) the batches it gets.

    ``stage`` names this rank's stage in errors; ``in_specs`` are what it receives (the previous stage's
    boundary, or the model inputs for a further replica of stage 0); ``raw_spec`` is the raw input's spec;
    buffers live on ``comm`` (the GPU under NCCL, else the CPU).
    """

    def __init__(self, *, stage: int, planned: int, in_specs: tuple[TensorSpec, ...], raw_spec: TensorSpec | None,
                 comm: torch.device) -> None:
        self.stage = stage
        self.planned = planned
        self.in_specs = in_specs
        self.raw_spec = raw_spec
        self.comm = comm
        self.receiving_from = 0
        """The rank :meth:`receive` is (or was last) receiving from: the peer to name when it fails."""

    def end(self) -> list[Tensor]:
        """The END header, which closes an epoch."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _END
        return [header.to(self.comm)]

    def stop(self, report: dict[str, Any]) -> list[Tensor]:
        """The STOP header and the JSON of ``report``, which stop the receiver."""
        blob = torch.tensor(list(json.dumps(report).encode()), dtype=torch.uint8)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[6] = _STOP, blob.numel()
        return [header.to(self.comm), blob.to(self.comm)]

    def pack(self, msg: Message, kind: str, specs: tuple[TensorSpec, ...]) -> list[Tensor]:
        """The header and tensors of ``msg`` (a ``kind`` batch), checked against the plan's ``specs`` of its values."""
        if len(msg.values) != len(specs):
            raise PPLLError(f"stage {self.stage} produced {len(msg.values)} boundary value(s); the plan has "
                            f"{len(specs)}")
        batch = next((int(v.shape[0]) for v, s in zip(msg.values, specs)
                      if isinstance(v, Tensor) and v.dim() and s.shape and s.shape[0] == self.planned), None)
        if batch is None:
            batch = int(msg.raw.shape[0]) if isinstance(msg.raw, Tensor) and msg.raw.dim() else msg.size
        payload = [self._value(v, s, batch) for v, s in zip(msg.values, specs)]
        target = self._target(msg.target)
        payload.append(target)
        if msg.raw is not None:
            assert self.raw_spec is not None
            payload.append(self._checked(msg.raw, self.raw_spec, batch, "the raw input"))
        shape = list(target.shape) + [0] * (_MAX_DIMS - target.dim())
        header = torch.tensor([_KIND_CODES[kind], msg.index, batch, _DTYPES.index(target.dtype), target.dim(),
                               int(msg.raw is not None), 0, msg.whole or 0, *shape], dtype=torch.int64)
        return [t.detach().to(self.comm).contiguous() for t in (header, *payload)]

    def _value(self, v: Any, spec: TensorSpec, batch: int) -> Tensor:
        if dtype_of(spec) is not None:
            return self._checked(v, spec, batch, f"boundary value {spec.name!r}")
        if isinstance(v, Tensor) or not isinstance(v, (int, float, bool)):
            raise PPLLError(f"stage {self.stage} sends {spec.name!r} as {type(v).__name__}; the plan recorded a "
                            f"Python {spec.dtype} there when the model was captured, so the model computes "
                            f"another kind of value now than it did when it was compiled: compile again with "
                            f"example inputs like the batches you train on, or cut elsewhere (split_points=...)")
        return torch.tensor([v], dtype=_SCALARS[spec.dtype])

    @staticmethod
    def _target(target: Any) -> Tensor:
        if not isinstance(target, Tensor):
            raise PPLLError(f"the distributed runtime sends the labels between processes as one tensor; got "
                            f"{type(target).__name__}. Pass the target as a tensor (or use runtime=\"threads\")")
        if target.dim() > _MAX_DIMS or target.dtype not in _DTYPES:
            raise PPLLError(f"the target has shape {shape_text(target.shape)} and dtype {target.dtype}; the "
                            f"distributed runtime sends targets of at most {_MAX_DIMS} dimensions and dtypes "
                            f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}; convert it first")
        return target

    def _checked(self, v: Any, spec: TensorSpec, batch: int, what: str) -> Tensor:
        want = _expected(spec, self.planned, batch)
        dtype = dtype_of(spec)
        if not isinstance(v, Tensor) or tuple(v.shape) != want or v.dtype != dtype:
            found = f"shape {shape_text(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, Tensor) \
                else type(v).__name__
            raise PPLLError(f"stage {self.stage} sends {what} with {found}; the plan fixes {shape_text(want)} "
                            f"{spec.dtype} for a batch of {batch}. The distributed runtime sizes its receive "
                            f"buffers from the plan, where only a dimension 0 equal to the planned batch size "
                            f"({self.planned}) may vary: compile with example inputs shaped like your batches")
        return v

    def receive(self, upstream: list[int]) -> Message | Stop | object:
        """One batch from the ``upstream`` ranks (a part from each, joined by rows), :data:`END` or a :class:`Stop`."""
        parts = []
        for src in upstream:
            self.receiving_from = src
            part = self._receive_part(src)
            if isinstance(part, Stop):
                return part
            parts.append(part)
        if all(p is END for p in parts):
            return END
        if any(p is END for p in parts):
            raise PPLLError(f"stage {self.stage} received END from some replicas of stage {self.stage - 1} and "
                            f"a batch from others")
        first = parts[0]
        values = tuple(join([p.values[i] for p in parts], spec, self.planned)
                       for i, spec in enumerate(self.in_specs))
        raw = join([p.raw for p in parts], self.raw_spec, self.planned) if first.raw is not None else None
        return Message(index=first.index, values=values, target=torch.cat([p.target for p in parts]), raw=raw,
                       kind=first.kind, whole=first.whole)

    def _receive_part(self, src: int) -> Any:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.comm)
        dist.recv(header, src)
        h = header.tolist()
        kind = h[0]
        if kind == _END:
            return END
        if kind == _STOP:
            blob = torch.empty(h[6], dtype=torch.uint8, device=self.comm)
            dist.recv(blob, src)
            return Stop(json.loads(bytes(blob.tolist()).decode()))
        if kind not in (_TRAIN, _EVAL):
            raise PPLLError(f"stage {self.stage} received a header of unknown kind {kind} from rank {src}")
        batch = h[2]
        values = [self._receive_value(s, batch, src) for s in self.in_specs]
        target = torch.empty(h[8:8 + h[4]], dtype=_DTYPES[h[3]], device=self.comm)
        dist.recv(target, src)
        raw = None
        if h[5]:
            assert self.raw_spec is not None
            raw = torch.empty(_expected(self.raw_spec, self.planned, batch),
                              dtype=dtype_of(self.raw_spec), device=self.comm)
            dist.recv(raw, src)
        if self.comm.type == "cuda":
            torch.cuda.current_stream(self.comm).synchronize()  # the trainer reads them on its own thread
        return Message(index=h[1], values=tuple(values), target=target, raw=raw,
                       kind=TRAIN if kind == _TRAIN else EVAL, whole=h[7] or None)

    def _receive_value(self, spec: TensorSpec, batch: int, src: int) -> Any:
        dtype = dtype_of(spec)
        if dtype is None:
            buf = torch.empty(1, dtype=_SCALARS[spec.dtype], device=self.comm)
            dist.recv(buf, src)
            return _PY_TYPES[spec.dtype](buf.item())
        buf = torch.empty(_expected(spec, self.planned, batch), dtype=dtype, device=self.comm)
        dist.recv(buf, src)
        return buf
