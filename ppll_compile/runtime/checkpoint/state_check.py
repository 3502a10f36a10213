"""What keeps a stage's saved state from loading into the stage: counts below zero (:func:`negative_counter`), and
every tensor's name, shape and dtype, the optimizers' parameter groups, the schedulers and counters
(:func:`check_state`). Values are described by their type and shape, never quoted."""

from __future__ import annotations

from typing import Any

from torch import Tensor

_COUNTERS = ("steps", "reused", "dropped", "updates")
_SCHEDULER_COUNTERS = ("last_epoch", "_step_count", "num_bad_epochs", "cooldown_counter")


def _below_zero(value: Any) -> bool:
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


def negative_counter(state: Any) -> str | None:
    """The first count in a stage's saved ``state`` that is below 0, as ``'steps' is -3`` (the stage's counters,
    its schedulers' epoch and step counts, its optimizers' per-parameter ``step``); ``None`` when none is."""
    if not isinstance(state, dict):
        return None
    found = [(f"{key!r}", state.get(key)) for key in _COUNTERS]
    for j, sched in enumerate(state.get("schedulers") or ()):
        if isinstance(sched, dict):
            found += [(f"scheduler {j}'s {key!r}", sched.get(key)) for key in _SCHEDULER_COUNTERS]
    for j, opt in enumerate(state.get("optimizers") or ()):
        per = opt.get("state") if isinstance(opt, dict) else None
        for pid, values in (per.items() if isinstance(per, dict) else ()):
            if isinstance(values, dict):
                found.append((f"optimizer {j}'s 'step' of parameter {pid!r}", values.get("step")))
    for where, value in found:
        if _below_zero(value):
            return f"{where} is {value.item() if isinstance(value, Tensor) else value!r}"
    return None


def _describe(t: Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _tensors(saved: Any, ours: Any, where: str, out: list[str]) -> None:
    """Append to ``out`` how the tensors of ``saved`` differ from ``ours`` (names, shapes, dtypes)."""
    if isinstance(ours, dict):
        if not isinstance(saved, dict):
            out.append(f"{where} is {type(saved).__name__} in the checkpoint, a mapping here")
            return
        missing, extra = [k for k in ours if k not in saved], [k for k in saved if k not in ours]
        if missing:
            out.append(f"{where} lacks {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''} "
                       f"in the checkpoint")
        if extra:
            out.append(f"{where} has {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''} in the "
                       f"checkpoint, which this stage does not")
        for k in ours:
            if k in saved:
                _tensors(saved[k], ours[k], f"{where}[{k!r}]", out)
    elif isinstance(ours, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(ours):
            count = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            out.append(f"{where} has {count} entries in the checkpoint and {len(ours)} here")
            return
        for j, (s, o) in enumerate(zip(saved, ours)):
            _tensors(s, o, f"{where}[{j}]", out)
    elif isinstance(ours, Tensor):
        if not isinstance(saved, Tensor):
            out.append(f"{where} is {type(saved).__name__} in the checkpoint, a tensor here")
        elif saved.shape != ours.shape or saved.dtype != ours.dtype:
            out.append(f"{where} is {_describe(saved)} in the checkpoint and {_describe(ours)} here")
    elif ours is None and saved is not None:
        out.append(f"{where} is saved in the checkpoint, and this stage has none")


def _optimizer(saved: Any, ours: dict[str, Any], where: str, out: list[str]) -> None:
    """Append to ``out`` how a saved optimizer state cannot be loaded into one with state ``ours``."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        out.append(f"{where} is not an optimizer state (no 'state' and 'param_groups')")
        return
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    mine = [len(g["params"]) for g in ours["param_groups"]]
    if sizes != mine:
        out.append(f"{where} has parameter groups of sizes {sizes} in the checkpoint and {mine} here")
        return
    for pid, state in ours["state"].items():  # this optimizer has stepped: its state tensors must match
        if pid in saved["state"]:
            _tensors(saved["state"][pid], state, f"{where} state of parameter {pid}", out)


def check_state(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What keeps the saved state of a stage from loading into the stage whose state is ``ours`` (both as
    :meth:`Runner.state_dict` gives them): every tensor's name, shape and dtype, the optimizers' parameter
    groups, the schedulers and counters. Empty when it loads."""
    out: list[str] = []
    stage = ours["stage"]
    counters = _COUNTERS
    modules = [k for k in ours if k not in ("stage", "optimizers", "schedulers", "scaler", *counters)]
    for key in modules:
        if key not in saved:
            out.append(f"stage {stage}: the checkpoint has no {key!r} state")
        else:
            _tensors(saved[key], ours[key], f"stage {stage} {key}", out)
    opts = saved.get("optimizers")
    if not isinstance(opts, list) or len(opts) != len(ours["optimizers"]):
        out.append(f"stage {stage}: the checkpoint has {len(opts) if isinstance(opts, list) else 'no'} optimizer "
                   f"states and this stage {len(ours['optimizers'])}")
    else:
        for j, (s, o) in enumerate(zip(opts, ours["optimizers"])):
            _optimizer(s, o, f"stage {stage} optimizer {j}", out)
    scheds = saved.get("schedulers")
    if not isinstance(scheds, list) or len(scheds) != len(ours["schedulers"]):
        have = "a learning-rate scheduler" if ours["schedulers"] else "no scheduler"
        had = "scheduler states" if scheds else "no scheduler state"
        out.append(f"stage {stage}: the checkpoint has {had} and this trainer has {have}; build the trainer with "
                   f"the scheduler= it was trained with")
    for key in counters:
        if key in ("dropped", "updates") and key not in saved:  # written before the counter existed
            continue
        if not isinstance(saved.get(key), int):
            out.append(f"stage {stage}: the checkpoint's {key!r} counter is a {type(saved.get(key)).__name__}, not an "
                       f"integer")
    scaler = saved.get("scaler")  # absent before float16 scalers were saved (or without one): a fresh scale
    if scaler is not None and not (isinstance(scaler, dict) and isinstance(scaler.get("scale"), float)):
        out.append(f"stage {stage}: the checkpoint's gradient scaler state is a {type(scaler).__name__} without a "
                   f"float 'scale', not a GradScaler's")
    return out
