"""Helpers the test modules and worker scripts share: an optimizer, data, small pipelines, synthetic plans, a port."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.heads.policy import validate_policy
from ppll_compile.plans.plan import Plan
from tests.models import CNN, Residual

if TYPE_CHECKING:
    from ppll_compile.simulation.simulate import Simulation

__all__ = ["BATCH", "CONV_X", "IMG", "sgd", "free_port", "quiet", "image_batches", "compiled_residual",
           "seeded_batches", "stage_state", "train_residual", "on_first_stage", "assert_same_parameters", "heads_policy",
           "compile_quietly", "momentum_pipeline", "recording_sgd", "synthetic_plan", "lane", "run_gloo_workers",
           "run_torchrun", "example_module"]

BATCH = 8
"""Batch size of :func:`image_batches` and of the example input of :func:`compiled_residual`."""

CONV_X = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
"""An example input of :func:`~tests.models.conv_student` and :func:`~tests.models.conv_teacher`."""

IMG = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
"""An example input of :class:`~tests.models.CNN`."""


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with learning rate 0.05 and momentum 0.9: the optimizer factory most tests train with."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warnings (the CPU fallback of a machine without GPUs) while planning or compiling."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def seeded_batches(seed: int, sizes: list[int], shape: tuple[int, ...],
                   classes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of ``sizes`` examples: inputs of ``shape`` and labels in [0, ``classes``), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)) for n in sizes]


# ---- the Residual pipeline of the one-process runtime tests ---------------------------------------------------

def image_batches(n: int, last: int = BATCH, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 3x8x8 images and labels in [0, 5); the last batch has ``last`` examples."""
    g = torch.Generator().manual_seed(seed)
    sizes = [BATCH] * (n - 1) + [last]
    return [(torch.randn(b, 3, 8, 8, generator=g), torch.randint(0, 5, (b,), generator=g)) for b in sizes]


def compiled_residual(gpus: int = 2, policy: str = "dgl", seed: int = 0, **options: Any) -> Any:
    """:class:`~tests.models.Residual` compiled into ``gpus`` stages, its weights drawn after ``manual_seed(seed)``."""
    torch.manual_seed(seed)
    model = Residual()
    return ppll_compile.compile(model, gpus, example_inputs=(torch.randn(BATCH, 3, 8, 8),), policy=policy,
                                **options)


def stage_state(compiled: Any) -> list[torch.Tensor]:
    """Copies of every stage's parameters, stage by stage."""
    return [p.detach().clone() for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]


def train_residual(runtime: str, data: list, gpus: int = 2, policy: str = "dgl",
                   **options: Any) -> tuple[Any, list[list[float]]]:
    """A fresh :func:`compiled_residual` trained on ``data`` under ``runtime``; it and each stage's losses."""
    compiled = compiled_residual(gpus, policy)
    losses: list[list[float]] = [[] for _ in range(gpus)]
    with compiled.trainer(optimizer=sgd, runtime=runtime, **options) as trainer:
        for x, y in data:
            for i, ls in enumerate(trainer.step(x, y)):
                losses[i] += ls
        for i, ls in enumerate(trainer.finish()):
            losses[i] += ls
    return compiled, losses


def on_first_stage(compiled: Any, action: Callable[[], None], lr: float) -> Callable[[list], torch.optim.Optimizer]:
    """An SGD factory whose optimizer of stage 0 calls ``action()`` before every step."""
    first = {id(p) for p in compiled.stage_parameters(0)}

    class Hooked(torch.optim.SGD):
        def step(self, closure=None):
            if any(id(p) in first for g in self.param_groups for p in g["params"]):
                action()
            return super().step(closure)

    return lambda params: Hooked(params, lr=lr)


def assert_same_parameters(a: Any, b: Any) -> None:
    """Every stage parameter of compiled pipeline ``a`` equals ``b``'s bit for bit."""
    for p, q in zip(stage_state(a), stage_state(b), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ---- heads: an inline policy, and the momentum (MAN) pipeline -------------------------------------------------

def heads_policy(sequence: dict | None = None, feature_map: dict | None = None) -> Any:
    """An inline policy with the given head configs (MLP heads for the other kinds)."""
    heads = {"vector": {"type": "mlp"}, "sequence": sequence or {"type": "mlp"},
             "feature_map": feature_map or {"type": "mlp"}}
    return validate_policy({"heads": heads}, "inline")


def compile_quietly(model: nn.Module, x: torch.Tensor, **options: Any) -> Any:
    """``ppll_compile.compile(model, example_inputs=(x,), **options)`` without the CPU-fallback warnings."""
    with quiet():
        return ppll_compile.compile(model, example_inputs=(x,), **options)


def momentum_pipeline(momentum: float, every: int) -> Any:
    """The 4-block CNN in 2 stages (cut after its second block); stage 0's head follows block 2 (stage 1's first)."""
    torch.manual_seed(0)
    head = {"type": "momentum", "depth": 1, "momentum": momentum, "every": every}
    return compile_quietly(CNN(), IMG, gpus=2, split_points=["relu_3"], policy=heads_policy(feature_map=head))


def recording_sgd(compiled: Any, snapshots: list) -> Callable[[list], torch.optim.Optimizer]:
    """SGD whose optimizer of stage 1 records a copy of the weights stage 0's head follows after every step."""
    mirrored = compiled.lowered.mirrors(0)
    ids = {id(p) for p in mirrored}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            out = super().step(closure)
            if any(id(p) in ids for g in self.param_groups for p in g["params"]):
                snapshots.append([p.detach().clone() for p in mirrored])
            return out

    return lambda params: Recording(params, lr=0.05, momentum=0.9)


# ---- the simulator: plans with exactly the given work, and one stage's events ---------------------------------

def synthetic_plan(base: Plan, specs: list[dict], bandwidth: float = 1.0) -> Plan:
    """A validated plan of ``len(specs)`` stages with exactly the given work (bandwidth 1: bytes are seconds).

    Each spec: ``compute`` (forward + backward seconds), FLOPs that split it (``fwd``/``bwd`` of the block,
    ``head_fwd``/``head_bwd`` of a PPLL head, ``aux`` of Pipe-BD's teacher blocks), ``grad`` bytes (all-reduced
    over ``replicas``), ``out`` boundary bytes (every stage but the last).
    """
    d = base.to_dict()
    middle, last = d["stages"][0], d["stages"][-1]
    n = len(specs)
    stages = []
    for i, spec in enumerate(specs):
        s = copy.deepcopy(last if i == n - 1 else middle)
        r = spec.get("replicas", 1)
        sync = 2 * (r - 1) / r * spec.get("grad", 0) / bandwidth
        send = 0.0 if i == n - 1 else spec.get("out", 0) / bandwidth / r
        s.update(index=i, nodes=[f"n{i}"], first_node=f"n{i}", last_node=f"n{i}", replicas=r,
                 aux_flops=spec.get("aux", 0), flops_fwd=spec.get("fwd", 0), flops_bwd=spec.get("bwd", 0),
                 grad_bytes=spec.get("grad", 0), compute_cost=spec["compute"] + sync, comm_cost=send,
                 cost=spec["compute"] + sync + send, step_cost=spec.get("step", 0.0))
        s["head"].update(param_count=0, flops_fwd=spec.get("head_fwd", 0), flops_bwd=spec.get("head_bwd", 0))
        if i < n - 1:
            s["boundary"] = [{"name": f"n{i}", "shape": [1], "dtype": "float32", "bytes": spec.get("out", 0)}]
        if d["blocks"]:
            s["blocks"] = [i]  # Pipe-BD: one distillation block per stage
        stages.append(s)
    if d["blocks"]:
        d["blocks"] = [dict(copy.deepcopy(d["blocks"][0]), index=i) for i in range(n)]
    d.update(stages=stages, legal_cuts=[f"n{i}" for i in range(n - 1)], multi_tensor_cuts=[],
             device_speeds=[1.0] * n, memory_limit=None, link_bandwidth=bandwidth)
    return Plan.from_dict(d)


def lane(sim: Simulation, stage: int, replica: int = 0) -> list[tuple]:
    """``(batch, kind, start, end)`` of every event of one stage replica in ``sim``, by batch and time."""
    return sorted(((e.batch, e.kind, e.start, e.end) for e in sim.timeline.events
                   if e.stage == stage and e.replica == replica), key=lambda t: (t[0], t[2], t[3]))


def no_workers_left() -> bool:
    """Whether every ``threads`` runtime's stage worker has ended."""
    return not [t for t in threading.enumerate() if t.name.startswith("ppll-stage-")]


def run_gloo_workers(script: Path, processes: int, tmp_path: Path, timeout: float) -> str:
    """Run ``script processes PORT SECONDS tmp_path`` (a test module or worker script that starts ``processes`` gloo
    workers itself, each left ``timeout - 15`` seconds) from the repository root; its output, once every worker
    reported exit code 0. A run still going after ``timeout`` seconds is killed, with its process group, and fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, str(script), str(processes), str(free_port()), str(timeout - 15),
                             str(tmp_path)], cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the {processes}-process run was still going after {timeout} s (killed):\n"
                    f"{proc.communicate()[0][-3000:]}")
    codes = [json.loads(line)["codes"] for line in text.splitlines() if line.startswith('{"codes"')]
    assert codes == [[0] * processes], text[-3000:]
    return text


def run_dist_scenario(scenario: str, processes: int, out: Path, limit: float, *args: str
                      ) -> tuple[list[int | None], str]:
    """Fork ``processes`` ranks of ``scenario`` of tests/dist_worker.py (writing into ``out``); their exit codes
    (``None``: still running after ``limit`` seconds, killed) and the output. A launcher still going ``limit + 30``
    seconds later is killed with its process group and fails the test."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    worker = Path(__file__).resolve().parent / "dist_worker.py"
    cmd = [sys.executable, str(worker), str(processes), str(free_port()), str(limit), scenario, str(out), *args]
    proc = subprocess.Popen(cmd, cwd=worker.parents[1], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        text = proc.communicate(timeout=limit + 30)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the {processes}-process run of {scenario!r} was still going after {limit + 30} s (killed):\n"
                    f"{proc.communicate()[0][-3000:]}")
    lines = [line for line in text.splitlines() if line.startswith('{"codes"')]
    assert lines, f"the launcher printed no exit codes:\n{text[-3000:]}"
    return json.loads(lines[-1])["codes"], text


# ---- resumable fit: a shuffling DataLoader that can fail at a given batch -------------------------------------

RESUME_EPOCH = 6
"""Batches per epoch of :func:`resume_loader` (44 examples in batches of 8, the last of 4)."""


def resume_loader(trap: int | None = None, action: Callable[[], None] | None = None) -> Any:
    """A ``DataLoader(shuffle=True)`` over 44 seeded 3x8x8 images with labels in [0, 5), in :data:`RESUME_EPOCH`
    batches of 8 (the last of 4); with ``trap``, ``action()`` runs when batch ``trap`` is drawn (counted from 0
    over every epoch of this loader) instead of giving it. ``loader.collate_fn.drawn``: ``[batches collated]``."""
    from torch.utils.data import DataLoader, TensorDataset, default_collate
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(44, 3, 8, 8, generator=g), torch.randint(0, 5, (44,), generator=g))
    drawn = [0]

    def collate(items: list) -> Any:
        if drawn[0] == trap and action is not None:
            action()
        drawn[0] += 1
        return default_collate(items)

    collate.drawn = drawn  # type: ignore[attr-defined]
    return DataLoader(data, batch_size=BATCH, shuffle=True, collate_fn=collate)


# ---- torchrun jobs ------------------------------------------------------------------------------------------------

def run_torchrun(flags: list[str], script: Path, args: list[str], timeout: float) -> str:
    """``python -m torch.distributed.run FLAGS SCRIPT ARGS`` from the repository root, in a session of its own (one
    torch thread a process, the repository importable, no launcher variables inherited); its output, once it exited
    with status 0. A job still going after ``timeout`` seconds is killed with its process group and fails the test."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, str(script), *args], cwd=root,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the torchrun job was still going after {timeout} s (killed):\n{proc.communicate()[0][-4000:]}")
    assert proc.returncode == 0, text[-4000:]
    return text


def example_module(name: str) -> Any:
    """``examples/<name>.py`` loaded as a module (the examples folder is no package the tests import from)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
