"""The trained model back from a trainer: the whole model's parameters and buffers, gathered from every stage's
process (:meth:`ModelState.model_state_dict`), and written once as a plain state dict (:meth:`ModelState.save_model`).

Which process holds what: the stages train the model's own parameter objects, so under ``sequential``, ``threads`` and
the DNA baselines the model itself is trained in place. Under ``distributed`` every process trains only its own
stage: its model is up to date for that stage's parameters and buffers, the others' are as built (or still on the meta
device, for a model built there). :meth:`ModelState.model_state_dict` puts the whole model together on rank 0.

A parameter that stages train their own copies of (``tied='untie'``, :attr:`~ppll_compile.plan.Plan.untied`) is
folded back as the plan's notes say: the model's entry, under every name it has, is the first stage's copy.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import PPLLError
from ..lowered import Lowered
from ..plan import Plan
from .base import Runtime
from .checkpoint_files import replace_with
from .checkpointer import Checkpointer

Part = dict[str, tuple[int, Tensor]]
"""What one process contributes: per ``state_dict`` key it trains, (its stage, a CPU copy of the tensor)."""


class ModelState:
    """What a trainer gives back of the model it trains: :meth:`model_state_dict` and :meth:`save_model`.

    Both are collectives under ``distributed``: every process calls them, in the same order as the trainer's other
    calls. Only rank 0 (the process that writes checkpoint manifests) receives the whole state.
    """

    model: nn.Module | None = None
    """The model compiled, whose parameter objects the stages train (set by ``compiled.trainer(...)``). Under
    ``distributed`` it is up to date only for the stages of this process (:attr:`stages`)."""
    plan: Plan
    lowered: Lowered
    closed: bool
    _runtime: Runtime

    def model_state_dict(self) -> OrderedDict[str, Any] | None:
        """The whole model's trained parameters and buffers, keyed exactly as ``model.state_dict()`` (same keys, same
        order), as CPU copies: what ``model.load_state_dict(...)`` of the model as built accepts.

        Pending batches are finished first. Under ``sequential`` and ``threads`` it is the model's own state. Under
        ``distributed`` every process must call it: each sends the tensors of its stage (a replicated stage's first
        replica), and rank 0 returns them put together, equal to what a ``sequential`` run's ``model.state_dict()``
        holds after the same batches; the other ranks return ``None``. A tensor no stage trains (an unused parameter)
        is rank 0's own. Untied copies (``tied='untie'``) fold back: every name of a tied parameter gets the first
        stage's copy, as in the model.
        """
        parts = self._gather_parts()
        return None if parts is None else merge(self._whole_model(), parts)

    def save_model(self, path: str | os.PathLike) -> Path:
        """Write :meth:`model_state_dict` once (by rank 0 under ``distributed``) as a plain state dict that
        ``model.load_state_dict`` accepts; the path written, returned on every process once the file is complete.

        The format follows the name: ``.safetensors`` is safetensors (the ``safetensors`` package must be
        installed); a name without a suffix gets ``.safetensors`` when that package is installed, else ``.pt``; any
        other suffix (``.pt``, ``.pth``, ``.bin``, ...) is ``torch.save``. Tied parameters are written under each of
        their names. The file appears whole or not at all (written beside it, then renamed), so a process killed
        mid-write leaves any previous file in place. Read it back with
        ``model.load_state_dict(safetensors.torch.load_file(path))`` or
        ``model.load_state_dict(torch.load(path, weights_only=True))``.
        """
        target = model_format(Path(path))[0]
        self._whole_model()
        parts = self._gather_parts()
        Checkpointer(self._runtime).agree(
            "write the model", lambda: write_state(merge(self._whole_model(), parts or []), target),
            here=parts is not None)
        return target

    def _whole_model(self) -> nn.Module:
        if self.model is None:
            raise PPLLError("this trainer does not know the model it trains (it was built as Trainer(plan, lowered)); "
                            "build it with compiled.trainer(...) to get the trained model back")
        return self.model

    def _gather_parts(self) -> list[Part] | None:
        """Every process's :data:`Part`, on rank 0 (``None`` elsewhere); pending batches finished first."""
        model, rt = self._whole_model(), self._runtime
        if self.closed:
            if rt.one_process_per_stage:
                raise PPLLError("the trainer is closed, and under runtime='distributed' the model is put together "
                                "from every process: call model_state_dict() or save_model() before closing it "
                                "(inside its with block)")
        else:
            rt.finish()
        owner = stage_owners(self.plan, self.lowered, [r.index for r in rt.runners])
        return rt.gather_to_writer(local_part(model, owner) if rt.replica == 0 else {})


def stage_owners(plan: Plan, lowered: Lowered, stages: list[int]) -> dict[int, int]:
    """The stage that trains each tensor of ``stages``' modules (parameters and buffers, heads left out), by the
    tensor's id; a tensor two stages hold goes to the first."""
    owner: dict[int, int] = {}
    for i in sorted(stages):
        for k in plan.stages[i].blocks or (i,):
            module = lowered.modules[k]
            for t in (*module.parameters(), *module.buffers()):
                owner.setdefault(id(t), i)
    return owner


def local_part(model: nn.Module, owner: dict[int, int]) -> Part:
    """This process's :data:`Part`: the ``state_dict`` entries of ``model`` whose tensor a stage here trains."""
    copies: dict[int, Tensor] = {}
    part: Part = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor) and id(value) in owner:
            if id(value) not in copies:  # tied names share one copy, as they share one tensor
                copies[id(value)] = value.detach().to("cpu", copy=True)
            part[key] = (owner[id(value)], copies[id(value)])
    return part


def merge(model: nn.Module, parts: list[Part]) -> OrderedDict[str, Any]:
    """``model.state_dict()``'s keys in order, each with the value of the first stage that trains it among ``parts``,
    else ``model``'s own (a CPU copy; non-tensor entries as they are)."""
    found: dict[str, tuple[int, Tensor]] = {}
    for part in parts:
        for key, (stage, t) in part.items():
            if key not in found or stage < found[key][0]:
                found[key] = (stage, t)
    state = model.state_dict(keep_vars=True)
    out: OrderedDict[str, Any] = OrderedDict()
    copies: dict[int, Tensor] = {}
    on_meta = []
    for key, value in state.items():
        if key in found:
            out[key] = found[key][1]
        elif isinstance(value, Tensor):
            if value.is_meta:
                on_meta.append(key)
            elif id(value) not in copies:
                copies[id(value)] = value.detach().to("cpu", copy=True)
            out[key] = copies.get(id(value))
        else:
            out[key] = value
    if on_meta:
        shown = ", ".join(on_meta[:3]) + (f" and {len(on_meta) - 3} more" if len(on_meta) > 3 else "")
        raise PPLLError(f"the model's state holds {len(on_meta)} tensor(s) that no stage trains and that are still "
                        f"on the meta device ({shown}); give them values in the model before compiling it, or "
                        f"leave them out of the model")
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]  # module versions, as load_state_dict reads them
    return out


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


def write_state(state: OrderedDict[str, Any], path: Path) -> Path:
    """Write ``state`` to ``path`` in the format its name says (see :func:`model_format`), atomically: into a
    temporary file beside it under a random name, created exclusively (a link planted there is never followed),
    flushed to disk, then renamed over ``path`` (see :func:`.checkpoint_files.replace_with`)."""
    target, fmt = model_format(path)
    if fmt == "safetensors":
        odd = [k for k, v in state.items() if not isinstance(v, Tensor)]
        if odd:
            raise PPLLError(f"the model's state holds {len(odd)} entries that are not tensors ({', '.join(odd[:3])}), "
                            f"which safetensors cannot store; save to a .pt path to write them with torch.save")
        data = _safetensors().save(_unshared(state), metadata={"format": "pt"})
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_with(target, data)
    return target


def _unshared(state: OrderedDict[str, Any]) -> dict[str, Tensor]:
    """``state`` with no two entries sharing memory (safetensors stores each name's own bytes): a tied parameter's
    second name gets a copy; every tensor contiguous."""
    seen: set[tuple[int, torch.device]] = set()
    out = {}
    for key, t in state.items():
        t = t.contiguous()
        where = (t.untyped_storage().data_ptr(), t.device)
        if t.numel() and where in seen:
            t = t.clone()
        seen.add(where)
        out[key] = t
    return out
