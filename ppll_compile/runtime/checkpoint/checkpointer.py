"""A trainer's checkpoints across all its processes: every part of a save or a load is agreed on by every process
before the next, so a failure anywhere fails everywhere and leaves the previous checkpoint (see :mod:`.checkpoint`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, PPLLError, StageError
from ...lower.stages import Lowered
from ...plans.plan import Plan
from ..base import Runtime
from ..runner import Runner
from . import files, state_check, store


class Checkpointer:
    """Saves and loads the stages of ``runtime`` (those of this process) with every other process of the pipeline.

    A save: the main writer starts it, every process writes its stages' files, the main writer commits the manifest
    and moves ``latest``. A load: every process reads and checks the checkpoint against its own stages before any
    state changes. After each part every process learns whether another one failed (:meth:`agree`).
    """

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def save(self, path: str | os.PathLike, keep: int, *, plan: Plan, lowered: Lowered,
             trainer: dict[str, Any], fed: int = 0) -> Path:
        """Write this process's stages as the newest checkpoint under ``path`` (the manifest records ``trainer``:
        the batch count and seed); the checkpoint's own directory. Pending batches are finished first. ``fed``:
        training batches fed since the data last ended; a save inside an accumulation group is refused."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (how many complete checkpoints stay), got {keep!r}")
        rt = self._runtime
        n = rt.runners[0].accumulate if rt.runners else 1
        fed, batches = max(rt.gather((fed, trainer["batches"]))) if n > 1 else (0, 0)  # rank 0's: it feeds the data
        if held := fed % n:
            raise PPLLError(f"save() would lose the gradients every stage holds for {held} batch(es) of an "
                            f"accumulation group (accumulate={n}; {batches} batches fed); save after a "
                            f"multiple of {n} batches, or call trainer.finish() first to step on the partial group")
        rt.finish()
        rank = getattr(rt, "rank", 0)
        held: list[files.RootLock] = []

        def start() -> str:
            held.append(store.lock(path))
            return store.begin(path)

        temp, done = None, False
        try:
            temp = rt.gather(self.agree("start the save", _saving(path, rank, start, paths=True),
                                        here=rt.is_main_writer))[0]
            work = Path(path) / temp
            mine = self.agree("write its stages",
                              _saving(path, rank, lambda: [store.save_stage(work, s) for s in rt.states()]))
            entries = [f for part in rt.gather(mine) for f in part]
            self.agree("finish the save", _saving(path, rank, lambda: store.commit(
                path, temp, self.identity(plan, lowered), entries, trainer, keep)), here=rt.is_main_writer)
            done = True
        finally:
            for lock in held:  # the main writer: what a failed save wrote goes, then the next save may start
                if not done and temp is not None:
                    files.remove_quietly(Path(path) / temp)
                lock.release()
        return Path(path) / store.final_name(temp)

    def load(self, path: str | os.PathLike, *, plan: Plan, lowered: Lowered, seed: int | None) -> tuple[Path, int]:
        """Restore this process's stages from the newest complete checkpoint under ``path`` (or the checkpoint
        directory ``path``), every part checked first on every process, pending batches finished before; the directory
        read and the batch count it was saved at. A checkpoint saved with another ``seed`` than the trainer's warns.

        Hyperparameters: the optimizers take the checkpoint's learning rate, momentum, weight decay and every other
        value of their parameter groups (what an exact resume needs, schedulers included), not those the optimizer
        factory gave. Where the two differ, one warning names each stage and value (``stage 0: lr 0.1 -> 0.05 (from
        the checkpoint)``); to train on with the factory's values, set them again after the load (``for g in
        opt.param_groups: g['lr'] = 0.1`` for every ``opt`` in ``trainer.runners[i].optimizers``). Under a
        scheduler, ``initial_lr`` is compared instead of the ``lr`` it drives. A normal resume warns nothing."""
        self._runtime.finish()
        found, trainer, states = self.agree("read the checkpoint", lambda: self._read(path, plan, lowered))
        changed = [c for r in self._runtime.runners for c in hyperparameter_changes(r, states[r.index])]
        for r in self._runtime.runners:
            r.load_state_dict(states[r.index])
        if "seed" in trainer and trainer["seed"] != seed:
            warnings.warn(f"checkpoint {str(path)!r} was trained with seed={trainer['seed']!r}; this trainer has "
                          f"seed={seed!r}, so dropout and other training randomness continue on other "
                          f"streams than an uninterrupted run (build the trainer with seed={trainer['seed']!r} "
                          f"to continue it exactly)", stacklevel=3)  # the caller of trainer.load(...)
        if changed:
            warnings.warn(f"checkpoint {str(found)!r} replaced optimizer hyperparameters the optimizer factory gave: "
                          + "; ".join(changed) + ". The checkpoint's values are kept (they resume the run exactly); "
                          "to train with the factory's, set them again after load, e.g. for g in "
                          "opt.param_groups: g['lr'] = ... for every opt in trainer.runners[i].optimizers",
                          stacklevel=3)
        self._runtime.barrier()
        return found, int(trainer["batches"])

    def agree(self, doing: str, fn: Callable[[], Any], *, here: bool = True) -> Any:
        """``fn()`` on this process (where ``here``; else ``None``). When it raised on any process, every process
        raises: this one its own error, the others a CheckpointError naming the process and the error."""
        value, error = None, None
        try:
            if here:
                value = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, once every process knows
            error = e
        try:
            texts = self._runtime.gather(None if error is None else f"{type(error).__name__}: {error}")
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - a process that died without a word (killed, out of memory)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"could not {doing}: another process of the pipeline is gone "
                                  f"({type(e).__name__}: {first}); the checkpoint that 'latest' names "
                                  f"is the newest one completed") from e
        if error is not None:
            raise error
        for rank, text in enumerate(texts):
            if text is not None:
                raise CheckpointError(f"the process of rank {rank} could not {doing}: {text}")
        return value

    def identity(self, plan: Plan, lowered: Lowered) -> dict[str, Any]:
        """What a checkpoint of this pipeline must match (see :func:`.store.identity`)."""
        return store.identity(plan, [lowered.stage_parameters(s) for s in plan.stages],
                                   [o for r in self._runtime.runners for o in r.optimizers])

    def _read(self, path: str | os.PathLike, plan: Plan,
              lowered: Lowered) -> tuple[Path, dict[str, Any], dict[int, dict[str, Any]]]:
        """The checkpoint directory read, its trainer state and this process's stage states, every one checked
        against its stage."""
        runners = self._runtime.runners
        found, trainer, states = store.read(path, self.identity(plan, lowered), [r.index for r in runners])
        problems = [p for r in runners for p in state_check.check_state(states[r.index], r.state_dict())]
        if problems:
            raise CheckpointError(f"checkpoint {str(found)!r} does not fit this trainer: "
                                  + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
                                  + ". Load it into a trainer built as the one that saved it")
        return found, trainer, states


def _saving(path: Any, rank: int, fn: Callable[[], Any], *, paths: bool = False) -> Callable[[], Any]:
    """``fn`` (a step of a save into ``path`` on ``rank``) whose operating-system errors (and, with ``paths``,
    odd paths) raise the CheckpointError of :func:`.checkpoint.save_failure`."""
    def run() -> Any:
        try:
            return fn()
        except CheckpointError:
            raise
        except OSError as e:
            raise store.save_failure(path, rank, e) from None
        except ValueError as e:
            if not paths:
                raise
            raise store.save_failure(path, rank, e) from None
    return run


def _shown(value: Any) -> str:
    return repr(value.tolist() if isinstance(value, torch.Tensor) else value)


def hyperparameter_changes(runner: Runner, state: dict[str, Any]) -> list[str]:
    """Each hyperparameter of ``runner``'s optimizers that loading ``state`` (its stage's checkpoint state) would
    change, as ``stage 0: lr 0.1 -> 0.05 (from the checkpoint)``. Under a scheduler (``initial_lr`` in both),
    ``initial_lr`` is compared and not the ``lr`` it drives."""
    out = []
    optimizers = runner.optimizers
    for j, (opt, saved) in enumerate(zip(optimizers, state["optimizers"])):
        groups = opt.param_groups
        for g, (ours, theirs) in enumerate(zip(groups, saved["param_groups"])):
            where = f"stage {runner.index}" + (f" optimizer {j}" if len(optimizers) > 1 else "") \
                + (f" group {g}" if len(groups) > 1 else "")
            scheduled = "initial_lr" in ours and "initial_lr" in theirs
            for key, value in ours.items():
                if key == "params" or (scheduled and key == "lr") or key not in theirs:
                    continue
                if _shown(value) != _shown(theirs[key]):
                    out.append(f"{where}: {key} {_shown(value)} -> {_shown(theirs[key])} (from the checkpoint)")
    return out
