"""Helpers the test modules and worker scripts share: an optimizer, data, small pipelines, synthetic plans, a port."""

from __future__ import annotations

import _thread
import ast
import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import yaml
from ppll_compile.partitioners import InfeasibleMemoryError
from ppll_compile.partitioners.replicas import (
    Layout,
    ReplicaProblem,
    brute_force_replicated,
    layout_costs,
    solve_replicated,
)
from torch import nn

import ppll_compile
from ppll_compile import HeadSpec
from ppll_compile.analysis.analyse import Analysis, analyse
from ppll_compile.capture.meta import PLANNED_ON_META
from ppll_compile.capture.trace import trace
from ppll_compile.cli.command import main
from ppll_compile.cost import roofline
from ppll_compile.cost.nodes import META_KEY, measure_graph
from ppll_compile.heads.build import head_spec
from ppll_compile.heads.policy import Policy, load_policy, validate_policy
from ppll_compile.options import PlanOptions
from ppll_compile.pipebd.policy import distill_loss, load_distill_policy
from ppll_compile.plans.plan import Plan
from ppll_compile.plans.timeline import Event, Timeline
from tests.models import CNN, Residual, conv_student, conv_teacher

if TYPE_CHECKING:
    from ppll_compile.simulation.simulate import Simulation

__all__ = ["BATCH", "CONV_X", "IMG", "sgd", "free_port", "quiet", "image_batches", "compiled_residual",
           "seeded_batches", "stage_state", "train_residual", "on_first_stage", "assert_same_parameters",
           "heads_policy", "compile_quietly", "plan_quietly", "momentum_pipeline", "recording_sgd", "synthetic_plan",
           "lane", "run_gloo_workers", "run_torchrun", "example_module", "DROPOUT_CHAIN_X", "DROPOUT_CHAIN_SPLITS",
           "DropPath", "DropPathResidual", "dropout_chain", "compile_dropout_chain", "dropout_chain_sgd",
           "dropout_chain_data", "assert_tensors_equal", "Loader", "dna_by_hand", "compiled_conv_pair",
           "conv_pair_data", "sequential_slices", "state_copy", "bn_teacher", "assert_equal_states", "train_steps",
           "measured_costs", "SeqNet", "assert_same_plan_but_meta_note", "compiled_residual_at",
           "compile_on_cpu_with_warnings", "GATE_X", "GATE_Y", "Gate", "interrupted_inside_a_forward",
           "same_tensors", "params_and_grads", "TOKENS_N", "Tokens", "compiled_with_warnings", "plain_sgd", "tokens_x",
           "LM_VOCAB", "LM_DIM", "LM_LAYERS", "LM_N", "LM_LEN", "token_batches", "lm_output_policy", "RESUME_EVERY",
           "fit_with_checkpoints", "saved_at", "assert_equal_states_unordered", "cli_user_error", "Net", "cli_error",
           "policy_file", "CALIBRATE_CPU", "calibrate_key", "calibrate_load", "CLI_EXAMPLES", "CLI_RESNET32",
           "cli_apply", "cli_file", "DISTILL_STUDENT_ENDS", "DISTILL_TEACHER_ENDS", "DISTILL_X", "distill_batches",
           "distill_compiled", "distill_pair", "distill_reference", "distill_slices", "DNA_EPOCHS", "dna_assert_equal",
           "dna_fit", "DRAW_PNG", "draw_is_png", "draw_is_svg", "draw_quietly", "draw_timeline", "built_on_meta",
           "Block", "ShapeLoop", "PLAN_X", "plan_residual",
           "profile_cnn", "profile_setup", "REBALANCE_BATCH", "RebalanceBlock", "Chain", "REBALANCE_IN",
           "rebalance_compiled", "rebalance_data", "rebalance_sgd", "rebalance_step_lr", "REGISTRY_X",
           "registry_pipebd", "registry_ppll", "replicas_check_valid", "replicas_key", "replicas_on_nodes",
           "replicas_random_problem", "replicas_same_as_brute_force", "replicas_stage_memory", "SURFACE_ROOT",
           "surface_declared"]

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


def plan_quietly(model: nn.Module, x: torch.Tensor, **options: Any) -> Plan:
    """``ppll_compile.plan(model, example_inputs=(x,), **options)`` without the CPU-fallback warnings."""
    with quiet():
        return ppll_compile.plan(model, example_inputs=(x,), **options)


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


# ---- what a unit test file and its integration file (tests/integration/*_runs.py) share ----------------------

DROPOUT_CHAIN_X = torch.randn(8, 16)
"""An example input of :func:`dropout_chain`."""


DROPOUT_CHAIN_SPLITS = ["2", "3"]
"""The cuts of :func:`dropout_chain`: stage 0: linear, relu, dropout; stage 1: a residual block with drop-path;
stage 2: the rest."""


class DropPath(nn.Module):
    """Stochastic depth as timm writes it: a mask drawn with ``bernoulli_`` on a new tensor (no generator)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        return x * x.new_empty(x.shape[0], 1).bernoulli_(keep) / keep


class DropPathResidual(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.lin(x)))


def dropout_chain(p: tuple[float, float, float] = (0.3, 0.5, 0.3)) -> nn.Module:
    """Three stages, each with its own random op (dropout, drop-path, dropout) of probability ``p[i]``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(p[0]), DropPathResidual(p[1]),
                         nn.Linear(16, 16), nn.ReLU(), nn.Dropout(p[2]), nn.Linear(16, 4))


def compile_dropout_chain(model: nn.Module) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(1)  # the heads are initialised from the global generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(model, example_inputs=(DROPOUT_CHAIN_X,), policy="dgl",
                                    split_points=DROPOUT_CHAIN_SPLITS)


def dropout_chain_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def dropout_chain_data(n: int = 6, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8 if i < n - 1 else 5, 16, generator=g), torch.randint(0, 4, (8 if i < n - 1 else 5,),
                                                                              generator=g)) for i in range(n)]


def assert_tensors_equal(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p, q), f"parameter {i} differs by {float((p - q).abs().max())}"


class Loader:
    """(inputs, target) pairs, like a DataLoader of a fixed dataset; counts the passes over it."""

    def __init__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.items = items
        self.passes = 0

    def __iter__(self) -> Any:
        self.passes += 1
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def conv_pair_data(sizes: tuple[int, ...] = (8, 8, 5), seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 16, 16, generator=g), torch.zeros(n, dtype=torch.long)) for n in sizes]


def bn_teacher() -> nn.Sequential:
    """conv_teacher's shapes with BatchNorm (running statistics far from their defaults) and Dropout in its blocks:
    in train mode it would give other targets on every call. Its blocks end after layers 5, 10, 15 (inclusive)."""
    torch.manual_seed(0)
    teacher = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(), nn.Conv2d(8, 24, 1), nn.ReLU(), nn.Conv2d(24, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
        nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Dropout2d(0.5),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5),
        nn.Linear(32, 10))
    with torch.no_grad():
        for m in teacher.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return teacher


def compiled_conv_pair(teacher: nn.Module | None = None, student: nn.Module | None = None, split: str = "5") -> Any:
    """The pair compiled in 2 stages ending at student layer ``split`` (conv_teacher and conv_student by default)."""
    torch.manual_seed(0)
    teacher = conv_teacher() if teacher is None else teacher
    student = conv_student() if student is None else student
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(student, teacher=teacher, example_inputs=(CONV_X,), split_points=[split],
                                    replicas=(1, 1))


def sequential_slices(model: nn.Sequential, ends: list[str]) -> list[nn.Sequential]:
    cut = [int(e) + 1 for e in ends[:-1]]
    return [model[a:b] for a, b in zip([0, *cut], [*cut, len(model)])]


def dna_by_hand(compiled: Any, teacher: nn.Sequential, student: nn.Sequential, data: list, epochs: int) -> list:
    """DNA as published, written out: block after block, each over every epoch, the teacher in eval mode run from
    the input; the student's parameters after. ``student`` starts as the compiled one did."""
    plan = compiled.plan
    teacher.eval()
    t_blocks = sequential_slices(teacher, [b.teacher_module for b in plan.blocks])
    s_blocks = sequential_slices(student, [b.student_module for b in plan.blocks])
    rules = load_distill_policy(plan.policy)
    for k, block in enumerate(s_blocks):
        opt = sgd(list(block.parameters()))
        loss_fn = distill_loss(rules.last if k == len(s_blocks) - 1 else rules.loss)
        for _ in range(epochs):
            for x, _ in data:
                with torch.no_grad():
                    for tb in t_blocks[:k]:
                        x = tb(x)
                    y = t_blocks[k](x)
                loss = loss_fn(block(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return [p.detach().clone() for p in student.parameters()]


def state_copy(teacher: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in teacher.state_dict().items()}


def assert_equal_states(ours: dict, ref: dict) -> None:
    """Same keys in the same order, every tensor bit-identical and on the CPU."""
    assert list(ours) == list(ref)
    for key, value in ref.items():
        assert ours[key].device.type == "cpu", key
        torch.testing.assert_close(ours[key], value.detach().cpu(), rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def train_steps(compiled, runtime: str, batches: list):
    trainer = compiled.trainer(optimizer=sgd, runtime=runtime)
    for x, y in batches:
        trainer.step(x, y)
    return trainer


def measured_costs(model, *inputs, reuse=True):
    gm = trace(model, example_inputs=inputs)
    measure_graph(gm, inputs, reuse=reuse)
    return {n.name: n.meta[META_KEY] for n in gm.graph.nodes if n.op != "output"}, gm


class SeqNet(nn.Module):
    """Linear embedding, ``n`` pre-norm transformer blocks in a Sequential (MLP ``ratio`` x D), LayerNorm, the first
    token, linear."""

    def __init__(self, d: int = 32, n: int = 4, classes: int = 5, ratio: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(12, d)
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(d, 2, ratio * d, dropout=0.0, batch_first=True,
                                                                 norm_first=True) for _ in range(n)])
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, classes)

    def forward(self, x):
        return self.fc(self.norm(self.blocks(self.embed(x)))[:, 0])


def assert_same_plan_but_meta_note(normal: ppll_compile.Plan, meta: ppll_compile.Plan) -> None:
    assert dataclasses.replace(meta, notes=()) == dataclasses.replace(normal, notes=())
    assert meta.notes == (*normal.notes, PLANNED_ON_META)


def compiled_residual_at(precision: str, seed: int = 0, **options: Any) -> Any:
    """:func:`compiled_residual` in 2 stages cut at ``add``, at ``precision``."""
    return compiled_residual(seed=seed, split_points=["add"], precision=precision, **options)


def compile_on_cpu_with_warnings(model: nn.Module, gpus: int | None, **options):
    """``compile`` on CPU devices; the warnings it gives."""
    devices = ["cpu"] * gpus if gpus else ["cpu"] * (len(options.get("split_points", ())) + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = ppll_compile.compile(model, gpus, devices=devices, **options)
    return compiled, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


class Gate(nn.Module):
    """Identity whose forward, once armed, says it entered and waits until opened: a stage's own code that blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False  # compile() runs the module while planning
        self.entered = threading.Event()
        self.opened = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.entered.set()
            self.opened.wait(30)
        return x


GATE_X, GATE_Y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])


def params_and_grads(compiled) -> list[torch.Tensor | None]:
    """Every stage's parameters and gradients, copied."""
    params = [p for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]
    return [p.detach().clone() for p in params] + [None if p.grad is None else p.grad.clone() for p in params]


def same_tensors(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def interrupted_inside_a_forward(compiled, gate, root):
    """A threads trainer that saved a checkpoint under ``root``, then got Ctrl-C (KeyboardInterrupt in the caller)
    while stage 1 waits inside its own forward, and was closed; the worker thread still inside that forward."""
    before = set(threading.enumerate())
    trainer = compiled.trainer(optimizer=sgd, runtime="threads", queue_depth=1)
    trainer.step(GATE_X, GATE_Y)
    trainer.finish()
    trainer.save(root)
    gate.armed = True

    def ctrl_c() -> None:
        if gate.entered.wait(10):
            time.sleep(0.5)  # the caller is waiting in step() by then: every queue is full
            _thread.interrupt_main()

    threading.Thread(target=ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(50):
            trainer.step(GATE_X, GATE_Y)
    start = time.monotonic()
    trainer.close()
    assert time.monotonic() - start < 1.5
    stuck = [t for t in set(threading.enumerate()) - before if t.name == "ppll-stage-1" and t.is_alive()]
    assert len(stuck) == 1
    return stuck[0]


TOKENS_N = 4


class Tokens(nn.Module):
    """N x 8 x 6 in, N x 8 x ``out`` per-token values out; ``features``: says so as timm does (``num_classes`` 0)."""

    def __init__(self, out: int = 12, features: bool = False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, out)
        if features:
            self.num_classes = 0

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def plain_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)  # no state: the plans cost optimizer='sgd'


def compiled_with_warnings(model: nn.Module, x: torch.Tensor,
                           **options) -> tuple[ppll_compile.CompiledPipeline, list[str]]:
    """``model`` compiled into 2 stages on the CPU, and the warnings compiling it gave."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = ppll_compile.compile(model, 2, example_inputs=(x,), devices=["cpu", "cpu"], **options)
    return c, [str(w.message) for w in caught]


def tokens_x() -> torch.Tensor:
    return torch.randn(TOKENS_N, 8, 6, generator=torch.Generator().manual_seed(0))


LM_VOCAB, LM_DIM, LM_LAYERS = 128, 32, 4      # the tiny Llama's vocabulary, hidden size and decoder layers


LM_N, LM_LEN = 2, 16                   # a batch of token ids


def token_batches(n: int) -> list[tuple[dict, torch.Tensor]]:
    """``n`` batches of token ids and their next-token labels (the last position ignored)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, LM_VOCAB, (LM_N, LM_LEN), generator=g)
        out.append(({"input_ids": ids}, torch.cat([ids[:, 1:], torch.full((LM_N, 1), -100)], 1)))
    return out


def lm_output_policy(**options) -> object:
    return validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm_output", **options}},
                           "inline")


RESUME_EVERY = 2


def fit_with_checkpoints(runtime: str, root: Path, loader=None, **options):
    """A fresh pipeline trained by ``fit(loader, epochs=2, checkpoint=root, every=EVERY)`` (trainer ``options``);
    it and the history."""
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd, runtime=runtime, **options) as trainer:
        history = trainer.fit(loader if loader is not None else resume_loader(), epochs=2, checkpoint=root,
                              every=RESUME_EVERY, progress=False)
    return compiled, history


def saved_at(root: Path) -> int:
    """The batch count of the checkpoint ``root/latest`` names."""
    name = (root / "latest").read_text().strip()
    return json.loads((root / name / "manifest.json").read_text())["trainer"]["batches"]


def assert_equal_states_unordered(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        torch.testing.assert_close(ours[key], value.detach().cpu(), rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def cli_user_error(capsys, argv: list[str]) -> str:
    """The stderr of a ppll-plan run that must fail with a user error (exit 2, nothing on stdout)."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    return err


def policy_file(tmp_path, data, name="p.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.b(self.a(x)).mean((2, 3)))


def cli_error(argv, capsys, status=2):
    assert main([str(a) for a in argv]) == status
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and err.count("\n") == 1
    return err


CALIBRATE_CPU = torch.device("cpu")


def calibrate_load(per_core: float) -> tuple[float, float, float]:
    """A 1-minute load average of ``per_core`` on this machine's cores."""
    return per_core * (os.cpu_count() or 1), 0.0, 0.0


def calibrate_key(threads: int) -> str:
    return f"{roofline.device_name(CALIBRATE_CPU, threads)} | torch {torch.__version__}"


CLI_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


CLI_RESNET32 = str(CLI_EXAMPLES / "resnet32.py")


def cli_file(tmp_path: Path, text: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def cli_apply(capsys, path: Path) -> dict:
    assert main([CLI_RESNET32, "--plan", str(path), "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


DISTILL_X = torch.randn(8, 3, 16, 16)


DISTILL_TEACHER_ENDS = [4, 8, 12]  # conv_teacher's blocks end after these layers (exclusive), then the logits


DISTILL_STUDENT_ENDS = [2, 6, 8]


def distill_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return conv_teacher(), conv_student()


def distill_compiled(**options):
    teacher, student = distill_pair()
    options.setdefault("split_points", ["5"])
    return ppll_compile.compile(student, teacher=teacher, example_inputs=(DISTILL_X,), **options)


def distill_batches(n: int, seed: int = 1, last: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8 if i < n - 1 else last, 3, 16, 16, generator=g) for i in range(n)]


def distill_slices(model: nn.Sequential, ends: list[int]) -> list[nn.Sequential]:
    return [model[a:b] for a, b in zip([0, *ends], [*ends, len(model)])]


def distill_reference(batches: list[torch.Tensor], policy: str = "pipebd") -> list[torch.Tensor]:
    """Blockwise distillation written out by hand on the Sequential slices: the parameters after ``batches``."""
    teacher, student = distill_pair()
    t_blocks, s_blocks = distill_slices(teacher, DISTILL_TEACHER_ENDS), distill_slices(student, DISTILL_STUDENT_ENDS)
    optimizers = [sgd(list(b.parameters())) for b in s_blocks]
    rules = load_distill_policy(policy)
    for x in batches:
        with torch.no_grad():
            acts = [x]
            for b in t_blocks:
                acts.append(b(acts[-1]))
        for k, (b, opt) in enumerate(zip(s_blocks, optimizers)):
            loss = distill_loss(rules.last if k == 3 else rules.loss)(b(acts[k]), acts[k + 1])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [p.detach().clone() for p in student.parameters()]


DNA_EPOCHS = 2


def dna_fit(runtime: str, compiled: Any, loader: Any, epochs: int = DNA_EPOCHS) -> tuple[Any, list[dict[str, Any]]]:
    with compiled.trainer(optimizer=sgd, runtime=runtime) as trainer:
        history = trainer.fit(loader, epochs=epochs, progress=False)
    return trainer, history


def dna_assert_equal(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


DRAW_PNG = b"\x89PNG\r\n\x1a\n"


def draw_quietly(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return build()


def draw_is_png(path) -> bool:
    return path.read_bytes().startswith(DRAW_PNG)


def draw_is_svg(path) -> bool:
    return path.read_text().lstrip().startswith(("<?xml", "<svg"))


def draw_timeline(source="simulated"):
    """Three stages, the middle one on two replicas taking alternate batches; 1 ms per span."""
    events, kinds = [], ("receive", "forward", "backward", "allreduce", "step", "send")
    for stage, replicas in enumerate((1, 2, 1)):
        for replica in range(replicas):
            t = stage * 3.0 + replica
            for batch in range(replica, 4, replicas):
                for kind in kinds if replicas > 1 else [k for k in kinds if k != "allreduce"]:
                    events.append(Event(stage=stage, replica=replica, batch=batch, kind=kind, start=t / 1e3,
                                        end=(t + 1) / 1e3))
                    t += 1
    return Timeline.of(events, source=source, model="Residual")


def built_on_meta(build: type[nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


class Block(nn.Module):
    """A residual block: the legal cuts of :class:`ShapeLoop` lie between blocks."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


class ShapeLoop(nn.Module):
    """How many blocks run depends on the input's width: symbolic tracing cannot take it, ``torch.export`` can."""

    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.out = nn.Linear(d, 5)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks[: x.shape[1] // 4]:
            x = b(x)
        return self.out(x)


PLAN_X = torch.randn(4, 3, 16, 16)


def plan_residual(model=None, gpus=3, **kw):
    return ppll_compile.plan(model or Residual(), gpus, example_inputs=kw.pop("example_inputs", (PLAN_X,)), **kw)


def profile_cnn(width: int = 8, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes))


def profile_setup(model: nn.Module, x: torch.Tensor, **options) -> tuple[Analysis, dict[int, HeadSpec], Policy]:
    """The analysis, the policy's head at every cut, and the policy, as planning hands them to the profile."""
    a = analyse(model, (x,), None, PlanOptions(gpus=2, **options))
    a = a.drop_untrained_cuts()
    policy = load_policy("auto")
    shape = a.inputs[0].shape
    heads = {i: head_spec(policy, None, a.boundary(c)[0], a.num_classes, shape, "sgd") for i, c in enumerate(a.cuts)}
    return a, heads, policy


REBALANCE_BATCH = 16


REBALANCE_IN = 12


class RebalanceBlock(nn.Module):
    """A residual block with dropout: the legal cuts of :class:`Chain` lie between blocks."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(torch.relu(self.lin(x)))


class Chain(nn.Module):
    """input layer, ``depth`` residual blocks, classifier; legal cuts 'inp', 'relu', then 'add', 'add_1', ... after each
    block."""

    def __init__(self, d: int = 16, depth: int = 4, classes: int = 5, p: float = 0.2):
        super().__init__()
        self.inp = nn.Linear(REBALANCE_IN, d)
        self.blocks = nn.ModuleList(RebalanceBlock(d, p) for _ in range(depth))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def rebalance_compiled(gpus: int = 3, split_points=("add_1", "add_2"), seed: int = 0, model=None, **options):
    torch.manual_seed(seed)
    model = model or Chain()
    options = {"split_points": list(split_points)} | options if split_points is not None else options
    return ppll_compile.compile(model, gpus, example_inputs=(torch.randn(REBALANCE_BATCH, REBALANCE_IN),),
                                profile="flops", devices=["cpu"] * gpus, **options)


def rebalance_data(n: int, seed: int = 1, batch: int = REBALANCE_BATCH, width: int = REBALANCE_IN):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def rebalance_sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def rebalance_step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


REGISTRY_X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def registry_ppll(seed: int = 0) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(conv_student(), 2, example_inputs=(REGISTRY_X,), split_points=["5"])


def registry_pipebd() -> ppll_compile.CompiledPipeline:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(REGISTRY_X,),
                                    split_points=["5"], replicas=(1, 1))


def replicas_random_problem(seed: int) -> ReplicaProblem:
    """A small random problem with ties (zeros, small integers, halves) and optional heads, comm, grads and caps."""
    rng = random.Random(seed)
    n, devices = rng.randint(1, 7), rng.randint(1, 5)

    def column(choices: list[float], chance: float = 0.5) -> list[float] | None:
        return [rng.choice(choices) for _ in range(n)] if rng.random() < chance else None

    memory = column([0, 1, 2, 3], 0.6)
    problem = ReplicaProblem(
        compute=[rng.choice([0, 0.5, 1, 1, 2, 3, 4, 6, 1.25, 0.1]) for _ in range(n)],
        head=column([0, 0, 0.5, 1, 2]),
        comm=column([0, 0.25, 1, 0.3]),
        grad_bytes=column([0, 1, 2, 4, 8, 0.7], 0.6),
        head_grad_bytes=column([0, 1, 3]),
        allreduce_bandwidth=rng.choice([0.5, 1.0, 4.0, 16.0, 3.0]),
        memory=memory,
        head_memory=column([0, 1, 2]) if memory else None,
        memory_limit=rng.choice([None, 2, 3, 4, 6, 0]) if memory else None,
        devices=devices,
        max_replicas=rng.choice([None, None, 1, 2, 3]),
        stages=rng.choice([None, None, *range(1, min(n, devices) + 1)]),
    )
    if seed % 5 == 1:  # what a stage saves by starting at a segment (no input gradient): up to that segment's cost
        problem = dataclasses.replace(problem, start=[rng.choice([0, 0.5, 1]) * c for c in problem.compute])
    return problem


def replicas_stage_memory(problem: ReplicaProblem, layout: Layout) -> list[float]:
    """Bytes one replica of each stage needs, summed directly (the tests use integer bytes, so exactly)."""
    memory = problem.memory or [0] * len(problem.compute)
    head = problem.head_memory or [0] * len(problem.compute)
    return [sum(memory[a:b]) + head[b - 1] for a, b in zip((0, *layout.ends), layout.ends)]


def replicas_check_valid(problem: ReplicaProblem, layout: Layout) -> None:
    """Assert that ``layout`` obeys every constraint of ``problem`` and reports its costs exactly."""
    n, cap = len(problem.compute), min(problem.max_replicas or problem.devices, problem.devices,
                                       problem.batch or problem.devices)
    assert layout.ends[-1] == n and list(layout.ends) == sorted(set(layout.ends)) and layout.ends[0] >= 1
    assert len(layout.replicas) == len(layout.ends) and all(1 <= r <= cap for r in layout.replicas)
    assert layout.devices <= problem.devices
    assert problem.stages is None or len(layout.ends) == problem.stages
    if problem.memory_limit is not None:
        assert max(replicas_stage_memory(problem, layout)) <= problem.memory_limit
    assert list(layout.costs) == layout_costs(problem, layout.ends, layout.replicas)


def replicas_on_nodes(problem: ReplicaProblem, seed: int) -> ReplicaProblem:
    """``problem`` on nodes of 1, 2 or 3 devices whose link across (sends and all-reduces) is 4 to 40 times slower
    than the one inside."""
    rng = random.Random(2000 + seed)
    n = len(problem.compute)
    comm = problem.comm or [rng.choice([0, 0.25, 1, 0.3]) for _ in range(n)]
    slower = rng.choice([4.0, 40.0])
    return dataclasses.replace(problem, comm=comm, cross_comm=[c * slower + rng.choice([0, 0.5]) for c in comm],
                               gpus_per_node=rng.choice([1, 2, 3]),
                               inter_node_bandwidth=problem.allreduce_bandwidth / slower)


def replicas_same_as_brute_force(problem: ReplicaProblem, seed: int) -> tuple[Layout, Layout] | None:
    """The solver's layout and brute force's, equal in what they minimise and both valid; or ``None`` when both refuse
    alike, with the same message and a cap that then fits."""
    try:
        expected = brute_force_replicated(problem)
    except InfeasibleMemoryError as error:
        with pytest.raises(InfeasibleMemoryError) as caught:
            solve_replicated(problem)
        assert caught.value.min_limit == error.min_limit, f"seed {seed}"
        assert str(caught.value) == str(error), f"seed {seed}"
        solve_replicated(dataclasses.replace(problem, memory_limit=error.min_limit))  # the cap it names fits
        return None
    layout = solve_replicated(problem)
    assert replicas_key(problem, layout) == replicas_key(problem, expected), f"seed {seed}: {problem}"
    replicas_check_valid(problem, layout)
    replicas_check_valid(problem, expected)
    return layout, expected


def replicas_key(problem: ReplicaProblem, layout: Layout) -> tuple[bool, float, int, int]:
    """What the solvers minimise: a layout that is not a whole number of nodes, the bottleneck, devices, stages."""
    g = problem.gpus_per_node
    return bool(g) and layout.devices % g != 0, layout.bottleneck, layout.devices, len(layout.ends)


SURFACE_ROOT = Path(__file__).resolve().parents[1]


def surface_declared() -> dict[str, list[str]]:
    found = {}
    # each top-level folder and the name it installs as (pyproject.toml's package-dir)
    for folder, package in {"ppll_compile": "ppll_compile", "partitioners": "ppll_compile.partitioners",
                            "policies": "ppll_compile.policies"}.items():
        for path in sorted((SURFACE_ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                    parts = path.relative_to(SURFACE_ROOT / folder).with_suffix("").parts
                    name = ".".join((package, *parts)).removesuffix(".__init__")
                    found[name] = [ast.literal_eval(e) for e in node.value.elts]
    return found


CLI_PIPEBD_FILE = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

build_teacher = build_model

def example_inputs():
    return (torch.randn(2, 8),)
"""

CLI_MODEL_FILE = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def example_inputs():
    return (torch.randn(2, {width}),)
"""


def cli_bad_files(d: Path) -> dict[str, Path]:
    """In folder ``d``: a good model file, a good 3-stage plan, and generated bad files and plans, by name."""
    rng = random.Random(4)
    out = {"dir": d / "folder"}
    out["dir"].mkdir()
    for name, text in (("model.py", CLI_MODEL_FILE.format(width=8)), ("misfit.py", CLI_MODEL_FILE.format(width=5)),
                       ("pipebd.py", CLI_PIPEBD_FILE)):
        out[name] = d / name
        out[name].write_text(textwrap.dedent(text))
    for name in ("random.yaml", "random.json", "random.py"):
        out[name] = d / name
        out[name].write_bytes(bytes([0xff, 0xfe]) + rng.randbytes(300))  # never valid UTF-8
    out["latin1.yaml"] = d / "latin1.yaml"
    out["latin1.yaml"].write_bytes("name: café\nheads: {vector: {type: mlp}}\n".encode("latin-1"))
    out["plan.yaml"] = d / "plan.yaml"
    assert main([str(out["model.py"]), "--gpus", "3", "--devices", "cpu,cpu,cpu", "--split-points", "_0,_1",
                 "--yaml", str(out["plan.yaml"])]) == 0
    good = yaml.safe_load(out["plan.yaml"].read_text())
    assert [s["last_node"] for s in good["stages"][:-1]] == ["_0", "_1"]

    def edited(name: str, edit) -> None:
        saved = yaml.safe_load(out["plan.yaml"].read_text())
        edit(saved)
        out[name] = d / name
        out[name].write_text(yaml.safe_dump(saved))

    def reverse(p):
        p["stages"][0]["last_node"], p["stages"][1]["last_node"] = "_1", "_0"

    edited("reversed.yaml", reverse)
    edited("duplicated.yaml", lambda p: p["stages"].insert(1, dict(p["stages"][0])))
    edited("banana.yaml", lambda p: p["stages"][1].update(device="banana"))
    edited("tpu.yaml", lambda p: p["stages"][2].update(device="tpu:7"))
    edited("batch.yaml", lambda p: p.update(batch_size="many"))
    return out


PACKAGES = {"ppll_compile": "ppll_compile", "partitioners": "ppll_compile.partitioners",
            "policies": "ppll_compile.policies"}
"""Each top-level folder of the repository and the package it installs as (pyproject.toml's package-dir)."""


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name (a package by its ``__init__``), with its file."""
    root = Path(__file__).resolve().parents[1]
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            if folder == "ppll_compile" and path.relative_to(root / folder).parts[0] in PACKAGES:
                continue
            name = ".".join((package, *path.relative_to(root / folder).with_suffix("").parts))
            out[name.removesuffix(".__init__")] = path
    return out


GATED_MODEL_FILE = """
import torch
from torch import nn

class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)

def build_model():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Gate(), nn.ReLU(), nn.Linear(8, 4))

def example_inputs():
    return (torch.randn(2, 8),)
"""
"""A model file whose module '2' branches on its input's values: torch.fx cannot trace into it."""


def gated_model_file(folder: Path) -> str:
    """:data:`GATED_MODEL_FILE` written in ``folder``: its path."""
    path = folder / "gated.py"
    path.write_text(textwrap.dedent(GATED_MODEL_FILE).lstrip())
    return str(path)
