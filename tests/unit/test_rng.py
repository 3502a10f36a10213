"""Training randomness per stage: every runtime trains the same computation with dropout on in every stage."""

# The distributed test runs this file as its worker: ``python tests/test_rng.py K PORT TIMEOUT OUT`` forks
# K ranks (torch imported once) that train the pipeline of :func:`_pipeline` and save their stage states.

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))

import ppll_compile  # noqa: E402
from ppll_compile.runtime.messages import Message  # noqa: E402
from ppll_compile.runtime.queues import Recent  # noqa: E402
from ppll_compile.runtime.rng import RNG_LOCK, stream_seed  # noqa: E402
from tests.helpers import run_gloo_workers  # noqa: E402

X = torch.randn(8, 16)
SPLITS = ["2", "3"]  # stage 0: linear, relu, dropout; stage 1: a residual block with drop-path; stage 2: the rest


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


class Residual(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.lin(x)))


def _model(p: tuple[float, float, float] = (0.3, 0.5, 0.3)) -> nn.Module:
    """Three stages, each with its own random op (dropout, drop-path, dropout) of probability ``p[i]``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(p[0]), Residual(p[1]),
                         nn.Linear(16, 16), nn.ReLU(), nn.Dropout(p[2]), nn.Linear(16, 4))


def _compile(model: nn.Module) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(1)  # the heads are initialised from the global generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(model, example_inputs=(X,), policy="dgl", split_points=SPLITS)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _data(n: int = 6, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8 if i < n - 1 else 5, 16, generator=g), torch.randint(0, 4, (8 if i < n - 1 else 5,),
                                                                              generator=g)) for i in range(n)]


def _params(compiled: ppll_compile.CompiledPipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]


def _train(model: nn.Module, runtime: str, data: list, **options) -> tuple[list[torch.Tensor], list]:
    """Train a copy of ``model`` on ``data``; its stage parameters and ``draws_random`` of every stage."""
    compiled = _compile(copy.deepcopy(model))
    if runtime == "threads":
        options.setdefault("threads_per_stage", 1)
    with compiled.trainer(optimizer=_sgd, runtime=runtime, **options) as trainer:
        for x, y in data:
            trainer.step(x, y)
    return _params(compiled), [r.draws_random for r in trainer.runners]


def _assert_equal(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p, q), f"parameter {i} differs by {float((p - q).abs().max())}"


pytestmark = pytest.mark.usefixtures("one_thread_quietly")  # the same reduction order in every runtime


# ---- the seed ----------------------------------------------------------------------------------------

def test_stream_seed_is_stable_and_every_argument_counts():
    base = stream_seed(0, 1, 2)
    assert base == stream_seed(0, 1, 2, reused=False, replica=0) == 0xD63DB11C9BD85A9B  # the same everywhere
    others = [stream_seed(1, 1, 2), stream_seed(0, 0, 2), stream_seed(0, 1, 3), stream_seed(0, 1, 2, reused=True),
              stream_seed(0, 1, 2, replica=1), stream_seed(0, 2, 1)]
    assert len({base, *others}) == 1 + len(others)
    assert all(0 <= s < 2 ** 64 for s in (base, *others)) and stream_seed(-1, 0, 0) < 2 ** 64


def test_a_reused_input_is_marked_and_gets_another_stream():
    recent = Recent()
    msg = Message(index=4, values=(torch.zeros(2),), target=torch.zeros(2))
    recent.remember(msg)
    again = recent.reuse()
    assert not msg.reused and again is not None and again.reused and again.index == 4


def test_seed_must_be_an_int_or_none():
    compiled = _compile(_model())
    for bad in ("0", 1.5, True):
        with pytest.raises(TypeError, match="seed must be an int"):
            compiled.trainer(optimizer=_sgd, seed=bad)
    assert compiled.trainer(optimizer=_sgd, seed=None).seed is None


# ---- the same computation ------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"queue_depth": 1}])
def test_threads_equal_sequential_with_dropout_in_every_stage(options):
    model, data = _model(), _data()
    ref, draws = _train(model, "sequential", data)
    ours, draws_threads = _train(model, "threads", data, **options)
    _assert_equal(ours, ref)
    assert draws == draws_threads == [True, True, True]


def test_training_does_not_depend_on_the_global_generator_and_the_seed_does():
    model, data = _model(), _data()
    runs = []
    for global_seed, seed in [(123, 0), (456, 0), (123, 7)]:
        compiled = _compile(copy.deepcopy(model))
        torch.manual_seed(global_seed)  # the caller's stream when training starts: it must not matter
        with compiled.trainer(optimizer=_sgd, seed=seed) as trainer:
            for x, y in data:
                trainer.step(x, y)
        runs.append(_params(compiled))
    _assert_equal(runs[1], runs[0])
    assert not all(torch.equal(p, q) for p, q in zip(runs[2], runs[0]))


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_training_leaves_the_callers_generator_untouched(runtime):
    compiled, data = _compile(_model()), _data()
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with compiled.trainer(optimizer=_sgd, runtime=runtime) as trainer:
        for x, y in data:
            trainer.step(x, y)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_stage_without_random_ops_is_never_locked():
    # with no random op anywhere, once every stage has trained a step no forward takes the lock: training and
    # evaluation go on while another thread holds it
    compiled, data = _compile(_model((0.0, 0.0, 0.0))), _data()
    trainer = compiled.trainer(optimizer=_sgd, runtime="threads")
    trainer.step(*data[0])
    trainer.finish()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with RNG_LOCK:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10)
    done = []
    worker = threading.Thread(target=lambda: done.append((
        [trainer.step(x, y) for x, y in data[1:]], trainer.finish(), trainer.evaluate(data[:2]))), daemon=True)
    worker.start()
    worker.join(15)
    finished_while_held = bool(done)
    release.set()
    holder.join(10)
    worker.join(15)
    trainer.close()
    assert finished_while_held, "training blocked on the RNG lock although no stage draws random numbers"
    assert [r.draws_random for r in trainer.runners] == [False, False, False]
    # dropout in stages 0 and 2 only: stage 1 is found to draw nothing on its first step
    _, draws = _train(_model((0.3, 0.0, 0.3)), "threads", _data())
    assert draws == [True, False, True]


def test_a_stage_measured_alone_draws_what_training_it_does():
    x, y = _data(1)[0]
    trainer = _compile(_model()).trainer(optimizer=_sgd)
    msg = trainer.message(x, y)
    first = trainer.runners[0]
    out, loss = first.forward_loss(msg)
    sent, trained = first.train_step(msg)
    assert float(trained) == float(loss.detach()) and torch.equal(sent.values[0], out[0].detach())


def test_resume_continues_the_same_stream(tmp_path):
    model, data = _model(), _data()
    straight, _ = _train(model, "threads", data)
    first = _compile(copy.deepcopy(model)).trainer(optimizer=_sgd, runtime="threads")
    for x, y in data[:3]:
        first.step(x, y)
    first.save(tmp_path / "ckpt")
    first.close()
    resumed_pipeline = _compile(copy.deepcopy(model))
    with resumed_pipeline.trainer(optimizer=_sgd, runtime="sequential") as resumed:
        resumed.load(tmp_path / "ckpt")
        for x, y in data[3:]:
            resumed.step(x, y)
    _assert_equal(_params(resumed_pipeline), straight)
    assert json.loads((tmp_path / "ckpt" / "ckpt-000000" / "manifest.json").read_text())["trainer"]["seed"] == 0
    with pytest.warns(UserWarning, match=r"was trained with seed=0; this trainer has seed=3"):
        _compile(copy.deepcopy(model)).trainer(optimizer=_sgd, seed=3).load(tmp_path / "ckpt")


# ---- Pipe-BD and the DNA baseline ---------------------------------------------------------------------

def _distill_params(runtime: str, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    from tests.models import conv_teacher
    torch.manual_seed(0)
    teacher = conv_teacher()
    student = nn.Sequential(  # conv_student with dropout in every block
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.3),
        nn.Conv2d(8, 12, 1), nn.ReLU(), nn.Dropout(0.3), nn.Conv2d(12, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Dropout2d(0.3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(32, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(student, teacher=teacher, example_inputs=(torch.randn(8, 3, 16, 16),),
                                        split_points=["7"])
    # stage 1 waits before its first block: under threads, stage 0 draws for the next batch first
    slow = compiled.student_blocks[compiled.plan.stages[1].blocks[0]]
    forward = slow.forward
    slow.forward = lambda *v: (time.sleep(0.02), forward(*v))[1]
    with compiled.trainer(optimizer=_sgd, runtime=runtime) as trainer:
        for x in batches:
            trainer.step(x)
    return [p.detach().clone() for p in student.parameters()], [r.draws_random for r in trainer.runners]


def test_pipebd_threads_and_dna_equal_sequential_with_dropout_in_every_block():
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 3, 16, 16, generator=g) for _ in range(4)]
    ref, draws = _distill_params("sequential", batches)
    for runtime in ("threads", "dna"):
        ours, _ = _distill_params(runtime, batches)
        _assert_equal(ours, ref)
    assert draws == [True, True]


# ---- distributed: one process per stage on gloo ---------------------------------------------------------

@pytest.mark.slow
def test_distributed_equals_sequential_with_dropout_in_every_stage(tmp_path):
    timeout = 90
    run_gloo_workers(Path(__file__).resolve(), 3, tmp_path, timeout=timeout)
    ref_compiled = _compile(_model())
    with ref_compiled.trainer(optimizer=_sgd, runtime="sequential") as trainer:
        for x, y in _data():
            trainer.step(x, y)
    for rank in range(3):
        record = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        _assert_equal(record["params"], [p.detach().clone() for p in ref_compiled.stage_parameters(rank)])
        assert record["draws_random"] is True


def _rank_main(out: Path) -> None:
    """One rank of the distributed test: train the pipeline on the test's batches, save its stage's parameters."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    compiled = _compile(_model())
    with compiled.trainer(optimizer=_sgd, runtime="distributed", timeout=60) as trainer:
        for x, y in _data():  # rank 0 feeds the batches; every other rank receives one per step
            trainer.step(x, y)
        trainer.finish()
    (stage,) = trainer.stages
    torch.save({"params": [p.detach().clone() for p in compiled.stage_parameters(stage)],
                "draws_random": trainer.runners[0].draws_random}, out / f"rank-{rank}.pt")


if __name__ == "__main__":
    from dist_worker import launch
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]),
           body=lambda argv: _rank_main(Path(argv[0])))
