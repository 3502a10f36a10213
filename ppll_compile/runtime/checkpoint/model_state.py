"""The trained model back from a trainer: the whole model's parameters and buffers, gathered from every stage's
process (:meth:`ModelState.model_state_dict`), written as one file or one file per stage
(:meth:`ModelState.save_model`), or handed on stage by stage (:meth:`ModelState.stream_model_state`).

Which process holds what: the stages train the model's own parameter objects, so under ``sequential``, ``threads`` and
the DNA baselines the model itself is trained in place. Under ``distributed`` every process trains only its own
stage: its model is up to date for that stage's parameters and buffers, the others' are as built (or still on the meta
device, for a model built there). The gather (:mod:`.gather`) brings the stages to rank 0 one at a time, so rank 0
holds at most one stage of the gather besides what the caller keeps: the whole state for :meth:`model_state_dict`,
nothing but one stage for a safetensors :meth:`save_model` (streamed into its file).

A parameter that stages train their own copies of (``tied='untie'``, :attr:`~ppll_compile.plans.plan.Plan.untied`) is
folded back as the plan's notes say: the model's entry, under every name it has, is the first stage's copy.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ...errors import PPLLError
from ...lower.stages import Lowered
from ...plans.plan import Plan
from ..base import Runtime
from .checkpointer import Checkpointer
from .gather import GatherStats, TensorInfo, gather_stages
from .model_files import ShardedSafetensors, StreamedSafetensors, TorchFile, check_shard_dir


class ModelState:
    """What a trainer gives back of the model it trains: :meth:`model_state_dict`, :meth:`save_model` and
    :meth:`stream_model_state`.

    All are collectives under ``distributed``: every process calls them, in the same order as the trainer's other
    calls. Only rank 0 (the process that writes checkpoint manifests) receives the model.
    """

    model: nn.Module | None = None
    """The model compiled, whose parameter objects the stages train (set by ``compiled.trainer(...)``). Under
    ``distributed`` it is up to date only for the stages of this process (:attr:`stages`)."""
    gather_stats: GatherStats | None = None
    """What the last gather of the model (:meth:`model_state_dict`, :meth:`save_model`, :meth:`stream_model_state`)
    moved and held at most at once, on the process that received it; ``None`` elsewhere and before one."""
    plan: Plan
    lowered: Lowered
    closed: bool
    _runtime: Runtime

    def model_state_dict(self) -> OrderedDict[str, Any] | None:
        """The whole model's trained parameters and buffers, keyed exactly as ``model.state_dict()`` (same keys, same
        order), as CPU copies: what ``model.load_state_dict(...)`` of the model as built accepts.

        Pending batches are finished first. Under ``sequential`` and ``threads`` it is the model's own state. Under
        ``distributed`` every process must call it: each sends the tensors of its stage (a replicated stage's first
        replica) to rank 0, one stage after the other, and rank 0 returns them put together, equal to what a
        ``sequential`` run's ``model.state_dict()`` holds after the same batches; the other ranks return ``None``.
        Rank 0 holds the result and at most one stage on its way besides. A tensor no stage trains (an unused
        parameter) is rank 0's own. Untied copies (``tied='untie'``) fold back: every name of a tied parameter gets the
        first stage's copy, as in the model.
        """
        collector = StateCollector(self._whole_model())
        self._stream(collector, "put the model together")
        return collector.state() if self.gather_stats is not None else None

    def stream_model_state(self, take: Callable[[int, OrderedDict[str, Tensor]], None]) -> GatherStats | None:
        """Call ``take(stage, part)`` on rank 0 for every stage in order, ``part`` being the CPU copies of the
        entries of ``model.state_dict()`` that stage trains (in that order; stage 0's with the entries no stage
        trains): the model's state one stage at a time, never whole, for writing it to any format. What it moved and
        held (:attr:`gather_stats`) on rank 0, ``None`` on the other processes, which only send (their ``take`` is not
        called). A part is not kept once ``take`` returns, unless ``take`` keeps it. When ``take`` raises, the
        remaining stages are still received (and not handed on), then every process raises. Pending batches are
        finished first; every process calls it under ``distributed``.
        """
        sink = _Callback(take)
        self._stream(sink, "take the model's state")
        return self.gather_stats

    def save_model(self, path: str | os.PathLike, sharded: bool = False) -> Path:
        """Write the whole trained model (:meth:`model_state_dict`'s tensors), once (by rank 0 under ``distributed``),
        as a plain state dict that ``model.load_state_dict`` accepts; the path written, returned on every process once
        the file is complete.

        The format follows the name: ``.safetensors`` is safetensors (the ``safetensors`` package must be installed);
        a name without a suffix gets ``.safetensors`` when that package is installed, else ``.pt``; any other suffix
        (``.pt``, ``.pth``, ``.bin``, ...) is ``torch.save``. A safetensors file is written as the stages arrive, so
        rank 0 never holds the whole model for it; ``torch.save`` takes one dict, so a ``.pt`` file holds it once.
        Tied parameters are written under each of their names. The file appears whole or not at all (written beside
        it, then renamed), so a process killed mid-write leaves any previous file in place. Read it back with
        ``model.load_state_dict(safetensors.torch.load_file(path))`` or
        ``model.load_state_dict(torch.load(path, weights_only=True))``.

        ``sharded=True``: ``path`` is a directory (made when missing) that gets one safetensors file per stage that
        holds tensors (``model-00001-of-00004.safetensors``, ...) and ``model.safetensors.index.json`` naming every
        tensor's file: the layout Hugging Face ``transformers``' ``from_pretrained(path)`` reads (write the model's
        ``config.json`` there too: ``model.config.save_pretrained(path)``). Other files in the directory stay; a
        previous sharded save there is replaced (see :class:`.model_files.ShardedSafetensors`); a directory holding a
        ``model.safetensors`` is refused (``from_pretrained`` would read that file instead).
        """
        model = self._whole_model()
        path = Path(path)
        rt = self._runtime
        sink: Any
        if sharded:
            target = path
            Checkpointer(rt).agree("write the model", lambda: check_shard_dir(path), here=rt.is_main_writer)
            sink = ShardedSafetensors(path)
        else:
            target, fmt = model_format(path)
            sink = StreamedSafetensors(target) if fmt == "safetensors" else TorchFile(target, StateCollector(model))
        self._stream(sink, "write the model")
        return target

    def _whole_model(self) -> nn.Module:
        if self.model is None:
            raise PPLLError("this trainer does not know the model it trains (it was built as Trainer(plan, lowered)); "
                            "build it with compiled.trainer(...) to get the trained model back")
        return self.model

    def _stream(self, sink: Any, doing: str) -> None:
        """Gather the model into ``sink`` on rank 0 (pending batches finished first); every process then learns
        whether ``sink`` failed there, and ``sink`` is committed (a file renamed into place) or discarded."""
        model, rt = self._whole_model(), self._runtime
        if self.closed:
            if rt.one_process_per_stage:
                raise PPLLError("the trainer is closed, and under runtime='distributed' the model is put together "
                                "from every process: call model_state_dict() or save_model() before closing it "
                                "(inside its with block)")
        else:
            rt.finish()
        guard = _Guarded(sink) if rt.is_main_writer else None
        self.gather_stats = None
        try:
            self.gather_stats = gather_stages(rt, model, self.plan, self.lowered, guard)
        except BaseException:  # another process failed midway (or the gather refused the state): nothing is written
            if guard is not None:
                guard.sink.discard()
            raise
        Checkpointer(rt).agree(doing, guard.finish if guard is not None else lambda: None, here=guard is not None)


class StateCollector:
    """A sink of the gather keeping every part: the whole state, keyed and ordered as ``model.state_dict()``."""

    def __init__(self, model: nn.Module) -> None:
        state = model.state_dict(keep_vars=True)
        self.order = list(state)
        self.metadata = getattr(state, "_metadata", None)
        self.parts: dict[str, Any] = {}

    def begin(self, layout: list[list[TensorInfo]], others: OrderedDict[str, Any]) -> None:
        self.parts.update(others)

    def take(self, stage: int, part: OrderedDict[str, Tensor]) -> None:
        self.parts.update(part)

    def commit(self) -> None:
        """Nothing to write."""

    def discard(self) -> None:
        self.parts.clear()

    def state(self) -> OrderedDict[str, Any]:
        """The state put together, with the model's ``_metadata`` (module versions, as ``load_state_dict`` reads)."""
        out: OrderedDict[str, Any] = OrderedDict((k, self.parts[k]) for k in self.order)
        if self.metadata is not None:
            out._metadata = self.metadata  # type: ignore[attr-defined]
        return out


class _Callback(StateCollector):
    """A sink handing each part to a function of the user's."""

    def __init__(self, take: Callable[[int, OrderedDict[str, Tensor]], None]) -> None:
        self.parts = {}
        self.take = take  # type: ignore[method-assign]


class _Guarded:
    """A sink whose first error stops the writing but not the gather (the other processes still send their stages);
    :meth:`finish` raises it, else commits."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.error: BaseException | None = None

    def begin(self, layout: list[list[TensorInfo]], others: OrderedDict[str, Any]) -> None:
        self._run(lambda: self.sink.begin(layout, others))

    def take(self, stage: int, part: OrderedDict[str, Tensor]) -> None:
        self._run(lambda: self.sink.take(stage, part))

    def _run(self, fn: Callable[[], None]) -> None:
        if self.error is None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - raised by finish(), once every stage has been received
                self.error = e

    def finish(self) -> None:
        if self.error is not None:
            self.sink.discard()
            raise self.error
        try:
            self.sink.commit()
        except BaseException:
            self.sink.discard()
            raise


def _safetensors() -> Any:
    """``safetensors.torch``, or ``None`` when the package is not installed."""
    try:
        import safetensors.torch
    except ImportError:
        return None
    return safetensors.torch


def model_format(path: Path) -> tuple[Path, str]:
    """The file :meth:`ModelState.save_model` writes for ``path`` and its format (``safetensors`` or ``torch``)."""
    st = _safetensors()
    if path.suffix == ".safetensors":
        if st is None:
            raise PPLLError(f"cannot write {str(path)!r}: the safetensors package is not installed (pip install "
                            f"safetensors), or save to a .pt path to write it with torch.save")
        return path, "safetensors"
    if path.suffix == "":
        return (path.with_name(path.name + ".safetensors"), "safetensors") if st is not None else \
            (path.with_name(path.name + ".pt"), "torch")
    return path, "torch"
