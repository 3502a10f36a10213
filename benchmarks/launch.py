"""Run a benchmark function on several spawned CPU ranks under gloo, with a deadline, and collect what they report."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppll_compile.allocator import keep_freed_memory

__all__ = ["EXAMPLES", "load_example", "one_thread", "spawn", "timed_steps"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """The module ``examples/<name>.py`` (``build_model``, ``example_inputs``)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def timed_steps(trainer: Any, data: list, warmup: int) -> float:
    """Samples per second of ``trainer`` over the ``(x, y)`` batches of ``data`` after ``warmup`` of them, the
    pipeline drained at both ends; the trainer is closed afterwards."""
    with trainer:
        for x, y in data[:warmup]:
            trainer.step(x, y)
        trainer.finish()
        start = time.perf_counter()
        for x, y in data[warmup:]:
            trainer.step(x, y)
        trainer.finish()
        return sum(len(y) for _, y in data[warmup:]) / (time.perf_counter() - start)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread (as every stage and rank of the benchmarks does), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., dict | None], args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # as every runtime does: the baselines run under the same allocator setting
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        out = fn(rank, world, *args)
        if out:
            queue.put(out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., dict | None], world: int, args: tuple, *, timeout: float) -> dict:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks (one thread each); the union of their returned dicts.

    ``fn`` must be importable (a module-level function). If a rank fails or the ranks outlive ``timeout``
    seconds, every rank is killed and a RuntimeError names the exit codes.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world, port, fn, args, queue), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: ranks exited with {codes}")
    out: dict = {}
    while not queue.empty():
        out.update(queue.get())
    return out
