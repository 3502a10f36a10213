"""``compile_stages``: every stage's forward under torch.compile trains what eager trains (dropout included), and a
stage that torch.compile cannot serve is refused by name, with the reason and the way out."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

if __name__ == "__main__":  # the distributed test runs this file as its worker
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ppll_compile
from ppll_compile.errors import PPLLError, StageError
from ppll_compile.runtime.compiled import compile_options
from tests.helpers import run_gloo_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_quietly")]


class DropPath(nn.Module):
    """Stochastic depth as timm writes it: a mask drawn with ``bernoulli_`` from the default generator."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * x.new_empty(x.shape[0], 1).bernoulli_(1 - self.p) / (1 - self.p)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = DropPath(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.lin(x)))


def chain(blocks: int = 1) -> nn.Module:
    """Linear, ReLU, dropout | ``blocks`` residual blocks with drop-path | linear, ReLU, dropout, linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.3), *(Residual() for _ in range(blocks)),
                         nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def pipeline(model: nn.Module, splits: tuple[str, ...] | list[str]) -> Any:
    torch.manual_seed(1)  # the heads' initial weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(model, example_inputs=(torch.randn(8, 16),), policy="dgl", split_points=list(splits))


def batches(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 8, the last of 5 (a second shape: the compiled stages take both)."""
    g = torch.Generator().manual_seed(2)
    sizes = [8] * (n - 1) + [5]
    return [(torch.randn(s, 16, generator=g), torch.randint(0, 4, (s,), generator=g)) for s in sizes]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(runtime: str, compile_stages: Any, data: list, *, model: nn.Module | None = None, splits: tuple[str, ...] = ("3",),
          load: Path | None = None, save: Path | None = None, **options: Any) -> dict[str, Any]:
    """Train a fresh :func:`chain` (or ``model``) on ``data``; its parameters, evaluation and stage state keys."""
    model = model or chain()
    pipe = pipeline(model, splits)
    with pipe.trainer(optimizer=sgd, runtime=runtime, compile_stages=compile_stages, **options) as trainer:
        if load is not None:
            trainer.load(load)
        for x, y in data:
            trainer.step(x, y)
        trainer.finish()
        if save is not None:
            trainer.save(save)
        evaluation = trainer.evaluate(data[-2:])
        keys = [sorted(r.state_dict()["backbone"]) + sorted(r.state_dict()["head"] or {}) for r in trainer.runners]
        draws = [r.draws_random for r in trainer.runners]
    return {"params": [p.detach().clone() for p in model.parameters()], "evaluation": evaluation, "keys": keys,
            "draws": draws, "pipe": pipe}


def assert_close(ours: dict[str, Any], ref: dict[str, Any], atol: float = 1e-5) -> None:
    for a, b in zip(ours["params"], ref["params"], strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)
    for k in ("loss", "accuracy", "stage_loss"):
        torch.testing.assert_close(torch.tensor(ours["evaluation"][k]), torch.tensor(ref["evaluation"][k]),
                                   atol=atol, rtol=1e-5)


def test_inductor_trains_what_eager_trains_with_dropout_in_sequential_threads_and_after_a_load(tmp_path):
    data = batches()
    eager = train("sequential", False, data, save=tmp_path / "eager")
    before = counters["stats"]["unique_graphs"]
    ours = train("sequential", True, data)
    assert counters["stats"]["unique_graphs"] - before >= 4  # the two blocks and the head, in training and in eval
    assert ours["draws"] == [True, True]  # dropout drew from the stages' seeded generators under compile too
    assert_close(ours, eager)
    assert ours["keys"] == eager["keys"] and not any("_orig_mod" in k for ks in ours["keys"] for k in ks)
    assert_close(train("threads", True, data), eager)
    # an eager checkpoint loads into a compiled trainer, which goes on as eager does
    more = batches(3)
    assert_close(train("threads", True, more, load=tmp_path / "eager"),
                 train("sequential", False, more, load=tmp_path / "eager"))


def recording(graphs: list[torch.fx.GraphModule], calls: list[int] | None = None) -> Any:
    """A backend that records every graph it is given and runs it as it is (compiles nothing: fast); ``calls`` gets
    one entry per run of a compiled graph."""
    def backend(gm: torch.fx.GraphModule, inputs: list) -> Any:
        graphs.append(gm)

        def run(*args: Any) -> Any:
            if calls is not None:
                calls.append(len(graphs))
            return gm.forward(*args)
        return run
    return backend


def test_every_stage_of_a_deep_pipeline_runs_compiled_in_training_and_eval():
    # four stages: four blocks of one class and three heads of one class, each compiled for a full batch, a ragged
    # last one and eval mode: more graphs than torch.compile keeps for one function (its recompile_limit, 8)
    data = batches()
    graphs: list[torch.fx.GraphModule] = []
    calls: list[int] = []
    splits = ["2", "3", "4"]
    ours = train("sequential", {"backend": recording(graphs, calls)}, data, model=chain(blocks=2), splits=splits)
    assert_close(ours, train("sequential", False, data, model=chain(blocks=2), splits=splits), atol=1e-6)
    assert len(calls) == 7 * (len(data) + 2)  # every block and head, on every batch trained and the 2 evaluated
    # the modules are not left compiled: the pipeline's own call (and a later eager trainer) runs eagerly
    assert all("forward" not in vars(m) for m in (*ours["pipe"].lowered.modules, *ours["pipe"].lowered.heads) if m)
    ours["pipe"](torch.randn(3, 16))
    assert len(calls) == 7 * (len(data) + 2)


def test_stages_compiled_under_autocast_train_what_eager_autocast_trains():
    data = batches(3)
    graphs: list[torch.fx.GraphModule] = []
    ours = train("threads", {"backend": recording(graphs)}, data, autocast=torch.bfloat16)
    assert graphs
    assert_close(ours, train("threads", False, data, autocast=torch.bfloat16), atol=1e-6)
    full = train("threads", False, data)  # bfloat16 made a difference, which the compiled stages kept
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ours["params"], full["params"]))


def test_a_mode_is_the_inductor_options_it_stands_for_with_eager_random_numbers():
    mode = compile_options({"mode": "max-autotune-no-cudagraphs"})
    assert mode == {"options": {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"),
                                "fallback_random": True}}
    with pytest.raises(PPLLError, match=r"compile_stages\['mode'\] must be one of 'default', .*'max-autotune'.* "
                                        r"\(a torch.compile mode\), got 'fast'"):
        compile_options({"mode": "fast"})


def test_checkpointed_blocks_are_said_to_train_eagerly_and_train_what_eager_trains():
    def run(compile_stages: Any) -> list[torch.Tensor]:
        model = chain()
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = ppll_compile.compile(model, example_inputs=(torch.randn(8, 16),), policy="dgl", split_points=["3"],
                                        checkpoint_activations=True)
        with pipe.trainer(optimizer=sgd, runtime="threads", compile_stages=compile_stages) as trainer:
            for x, y in batches(3):
                trainer.step(x, y)
        return [p.detach().clone() for p in model.parameters()]

    with pytest.warns(UserWarning, match=r"compile_stages: stage 0's block recomputes its forward in backward "
                                         r"\(checkpoint_activations=True\), and torch.compile runs those training "
                                         r"forwards eagerly .*pass compile_stages=False"):
        ours = run({"backend": recording([])})
    for a, b in zip(ours, run(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def broken(gm: torch.fx.GraphModule, inputs: list) -> Any:
    raise RuntimeError("no kernels for this graph")


def no_backward(gm: torch.fx.GraphModule, inputs: list) -> Any:
    raise RuntimeError("no backward kernels")


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_a_stage_torch_compile_fails_on_is_refused_by_name_with_the_way_out(runtime):
    model = chain()
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StageError, match=r"stage 0 failed at batch 0: PPLLError: stage 0's block runs eagerly but not "
                                         r"under torch.compile \(compile_stages is on, backend 'broken'\): "
                                         r"BackendCompilerFailed: backend='broken' raised: RuntimeError: no kernels "
                                         r"for this graph; pass compile_stages=False to train it eagerly"):
        train(runtime, {"backend": broken}, batches(2), model=model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start))  # the refused stage trained nothing


def test_a_backward_torch_compile_fails_on_is_refused_by_name():
    backend = aot_autograd(fw_compiler=lambda gm, inputs: gm.forward, bw_compiler=no_backward)
    with pytest.raises(StageError, match=r"stage 0 failed at batch 0: PPLLError: stage 0's backward failed inside "
                                         r"torch.compile \(compile_stages is on, backend '.*'\): RuntimeError: no "
                                         r"backward kernels; pass compile_stages=False to train it eagerly"):
        train("sequential", {"backend": backend}, batches(2))


def distillation() -> Any:
    """A Pipe-BD pair of two stages: each student block learns its teacher block's output."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(),
                            nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(student, teacher=teacher, example_inputs=(torch.randn(8, 16),),
                                    split_points=["_4"], replicas=(1, 1))


def distilled(compile_stages: Any) -> list[torch.Tensor]:
    pipe = distillation()
    with pipe.trainer(optimizer=sgd, runtime="threads", compile_stages=compile_stages) as trainer:
        for x, _ in batches(3):
            trainer.step(x)
    return [p.detach().clone() for p in pipe.model.parameters()]


def test_pipebd_student_blocks_compile_and_a_failing_one_is_named():
    graphs: list[torch.fx.GraphModule] = []
    for a, b in zip(distilled({"backend": recording(graphs)}), distilled(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert graphs
    with pytest.raises(StageError, match=r"PPLLError: stage 0's student block 0 runs eagerly but not under "
                                         r"torch.compile \(compile_stages is on, backend 'broken'\)"):
        distilled({"backend": broken})


def test_the_models_own_error_is_raised_as_eager_raises_it():
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def run(compile_stages: Any) -> str:
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = ppll_compile.compile(model(), example_inputs=(torch.randint(0, 10, (8,)),), policy="dgl",
                                        split_points=["2"])
        with pipe.trainer(optimizer=sgd, compile_stages=compile_stages) as trainer, \
                pytest.raises(StageError) as error:
            trainer.step(torch.tensor([1, 2, 12]), torch.tensor([0, 1, 2]))  # token 12 of a 10-token vocabulary
        return str(error.value).split("\n")[0]

    ours = run({"backend": recording([])})
    assert ours == run(False) and ours.startswith("stage 0 failed at batch 0: IndexError: index out of range")


def test_distributed_compiled_stages_train_what_sequential_eager_trains(tmp_path):
    run_gloo_workers(Path(__file__).resolve(), 2, tmp_path, timeout=150)
    eager = train("sequential", False, batches(3)[:2])
    pipe = eager["pipe"]
    for rank in range(2):
        record = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        for a, b in zip(record["params"], pipe.stage_parameters(rank), strict=True):
            torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
        assert record["compiled"] and record["draws"]


def _rank_main(out: Path) -> None:
    """One rank of the distributed test: train its stage compiled, save its parameters."""
    torch.set_num_threads(1)
    model = chain()
    pipe = pipeline(model, ["3"])
    with pipe.trainer(optimizer=sgd, runtime="distributed", compile_stages=True, timeout=100) as trainer:
        for x, y in batches(3)[:2]:  # rank 0 feeds the batches; the other receives one per step
            trainer.step(x, y)
        trainer.finish()
    (stage,) = trainer.stages
    torch.save({"params": [p.detach().clone() for p in pipe.stage_parameters(stage)],
                "compiled": trainer.runners[0].compiler is not None, "draws": trainer.runners[0].draws_random},
               out / f"rank-{os.environ['RANK']}.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch._inductor.compile_fx  # loaded once here instead of in every worker
    from dist_worker import launch
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]),
           body=lambda argv: _rank_main(Path(argv[0])))
