"""A trainer's checkpoints across all its processes: every part of a save or a load is agreed on by every process
before the next, so a failure anywhere fails everywhere and leaves the previous checkpoint (see :mod:`.checkpoint`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, PPLLError, StageError
from ..lowered import Lowered
from ..plan import Plan
from . import checkpoint
from .base import Runtime


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
        temp = rt.gather(self.agree("start the save", lambda: checkpoint.begin(path), here=rt.is_main_writer))[0]
        work = Path(path) / temp
        mine = self.agree("write its stages", lambda: [checkpoint.save_stage(work, s) for s in rt.states()])
        files = [f for part in rt.gather(mine) for f in part]
        self.agree("finish the save",
                   lambda: checkpoint.commit(path, temp, self.identity(plan, lowered), files, trainer, keep),
                   here=rt.is_main_writer)
        return Path(path) / checkpoint.final_name(temp)

    def load(self, path: str | os.PathLike, *, plan: Plan, lowered: Lowered, seed: int | None) -> tuple[Path, int]:
        """Restore this process's stages from the newest complete checkpoint under ``path`` (or the checkpoint
        directory ``path``), every part checked first on every process, pending batches finished before; the directory
        read and the batch count it was saved at. A checkpoint saved with another ``seed`` than the trainer's warns."""
        self._runtime.finish()
        found, trainer, states = self.agree("read the checkpoint", lambda: self._read(path, plan, lowered))
        for r in self._runtime.runners:
            r.load_state_dict(states[r.index])
        if "seed" in trainer and trainer["seed"] != seed:
            warnings.warn(f"checkpoint {str(path)!r} was trained with seed={trainer['seed']!r}; this trainer has "
                          f"seed={seed!r}, so dropout and other training randomness continue on other "
                          f"streams than an uninterrupted run (build the trainer with seed={trainer['seed']!r} "
                          f"to continue it exactly)", stacklevel=3)  # the caller of trainer.load(...)
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
        """What a checkpoint of this pipeline must match (see :func:`.checkpoint.identity`)."""
        return checkpoint.identity(plan, [lowered.stage_parameters(s) for s in plan.stages],
                                   [o for r in self._runtime.runners for o in r.optimizers])

    def _read(self, path: str | os.PathLike, plan: Plan,
              lowered: Lowered) -> tuple[Path, dict[str, Any], dict[int, dict[str, Any]]]:
        """The checkpoint directory read, its trainer state and this process's stage states, every one checked
        against its stage."""
        runners = self._runtime.runners
        found, trainer, states = checkpoint.read(path, self.identity(plan, lowered), [r.index for r in runners])
        problems = [p for r in runners for p in checkpoint.check_state(states[r.index], r.state_dict())]
        if problems:
            raise CheckpointError(f"checkpoint {str(found)!r} does not fit this trainer: "
                                  + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
                                  + ". Load it into a trainer built as the one that saved it")
        return found, trainer, states
