"""Timing whole candidate stages (`time_stages`): what a timed step holds, its statistics, the model left as it was."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppll_compile.lower.profile import round_statistics, time_blocks, time_stages
from ppll_compile.plans.specs import StageTime
from tests.helpers import profile_cnn, profile_setup

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    model = profile_cnn()
    return (model, *profile_setup(model, torch.randn(4, 3, 8, 8)))


def _recording(log: list[int], made: list[list[nn.Parameter]], sleep: float = 0.0):
    """An SGD factory whose ``k``-th optimizer (in the order they are made) logs ``k`` at every step."""

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        k = len(made)
        made.append(list(params))

        class Logged(torch.optim.SGD):
            def step(self, closure=None):
                log.append(k)
                if sleep:
                    time.sleep(sleep)
                return super().step(closure)

        return Logged(params, lr=1e-4)

    return factory


def test_round_statistics_is_the_least_median_and_the_spread_of_the_medians():
    assert round_statistics([[3.0, 1.0, 1.5], [5.0, 4.0, 9.0], [2.5, 9.0, 1.5]]) == (1.5, 5.0 / 1.5 - 1.0)
    assert round_statistics([[1.0, 3.0]]) == (2.0, 0.0)  # one round: no spread; an even count: the middle mean
    assert round_statistics([[0.0], [1.0]]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="at least one round"):
        round_statistics([[1.0], []])


def test_the_model_is_bit_identical_after_timing(cnn):
    model, a, heads, policy = cnn
    n = len(a.cuts) + 1
    params = list(model.parameters())
    for p in params[::2]:
        p.grad = torch.randn_like(p)  # a gradient the user holds must survive; the others stay None
    model[4].eval()  # a module the user put in eval mode stays so
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad for p in params]
    grad_values = [None if g is None else g.clone() for g in grads]
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    times = time_stages(a, heads, policy, CPU, "adam", [(0, 0), (0, n - 1), (1, n - 1), (n - 1, n - 1)],
                        rounds=2, runs=1)
    assert set(times) == {(0, 0), (0, n - 1), (1, n - 1), (n - 1, n - 1)}
    assert all(isinstance(t, StageTime) and t.seconds > 0 for t in times.values())
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(after[k], v), k  # parameters and BatchNorm statistics (num_batches_tracked too)
    for p, g, value in zip(params, grads, grad_values):
        assert p.grad is g
        assert value is None or torch.equal(p.grad, value)
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_timed_step_includes_the_optimizer_step(cnn):
    _, a, heads, policy = cnn
    n = len(a.cuts) + 1
    log: list[int] = []
    times = time_stages(a, heads, policy, CPU, _recording(log, [], sleep=0.02), [(0, 1), (2, n - 1)],
                        rounds=2, runs=2, warmup=0)
    for t in times.values():
        assert t.step_seconds >= 0.02  # the sleeping step is timed as the step...
        assert t.seconds >= t.step_seconds + 1e-6  # ...and within the whole step, with the forward and backward
    real = time_stages(a, heads, policy, CPU, "momentum", [(0, n - 1)], rounds=1, runs=2)[(0, n - 1)]
    assert 0 < real.step_seconds < real.seconds


def test_rounds_interleave_the_candidates_after_a_warm_up(cnn):
    _, a, heads, policy = cnn
    n = len(a.cuts) + 1
    log: list[int] = []
    intervals = [(0, 0), (1, n - 1), (0, n - 1)]
    time_stages(a, heads, policy, CPU, _recording(log, []), intervals, rounds=3, runs=2, warmup=2)
    warm = [k for k in range(3) for _ in range(2)]
    one_round = [k for k in range(3) for _ in range(2)]
    assert log == warm + one_round * 3


def test_the_optimizer_trains_the_stage_and_its_head(cnn):
    _, a, heads, policy = cnn
    n = len(a.cuts) + 1
    intervals = [(0, 0), (1, 2), (0, n - 1), (2, n - 1)]
    made: list[list[nn.Parameter]] = []
    time_stages(a, heads, policy, CPU, _recording([], made), intervals, rounds=1, runs=1, warmup=0)
    for (i, j), params in zip(intervals, made):
        expected = a.summary(a.segment_nodes(i, j), "sgd").param_count + (heads[j].param_count if j < n - 1 else 0)
        assert sum(p.numel() for p in params) == expected, (i, j)
        assert len({id(p) for p in params}) == len(params)


def test_an_output_that_is_not_class_scores_is_trained_by_the_backward_of_a_sum():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 4, 1))  # a dense map, not N x C scores
    a, heads, policy = profile_setup(model, torch.randn(2, 3, 8, 8), num_classes=5)
    n = len(a.cuts) + 1
    t = time_stages(a, heads, policy, CPU, "sgd", [(0, n - 1), (1, n - 1)], rounds=1, runs=1)
    assert all(v.seconds > 0 for v in t.values())


class _Seen(nn.Module):
    """Identity that records, when autograd records, whether its input requires grad (kept opaque when tracing);
    every copy records into the one class-wide list, as the timing trains a copy of the model."""

    requires_grad: ClassVar[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.requires_grad.append(x.requires_grad)
        return x


def test_a_stage_receives_its_input_detached_as_the_runtime_gives_it():
    torch.manual_seed(0)
    seen = _Seen()
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), seen, nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    a, heads, policy = profile_setup(model, torch.randn(2, 3, 8, 8), leaf_modules=(_Seen,))
    n = len(a.cuts) + 1
    at = next(k for k, node in enumerate(a.nodes) if node.op == "call_module" and node.target == "2")
    first = next(k for k, c in enumerate(a.cuts) if c.position == at - 1) + 1  # the segment that opens with it
    seen.requires_grad.clear()
    time_stages(a, heads, policy, CPU, "sgd", [(first, n - 1)], rounds=1, runs=2, warmup=0)
    assert seen.requires_grad == [False, False]  # a stage that opens with it: its input needs no gradient
    seen.requires_grad.clear()
    time_stages(a, heads, policy, CPU, "sgd", [(0, n - 1)], rounds=1, runs=1, warmup=0)
    assert seen.requires_grad == [True]  # inside a stage it does


@pytest.mark.parametrize("interval", [(2, 1), (-1, 0), (0, 99)])
def test_a_candidate_that_is_no_interval_of_the_segments_is_refused(cnn, interval):
    _, a, heads, policy = cnn
    with pytest.raises(ValueError, match=r"is not an interval of the \d+ atomic segments"):
        time_stages(a, heads, policy, CPU, "sgd", [interval])


def test_an_unknown_optimizer_is_refused(cnn):
    _, a, heads, policy = cnn
    with pytest.raises(ValueError, match="optimizer must be one of sgd, momentum, adam"):
        time_stages(a, heads, policy, CPU, "lamb", [(0, 0)])


def test_timing_distillation_blocks_leaves_the_generator_as_it_was():
    # a student with dropout draws random numbers in every timed step; the caller's stream goes on as before
    class Block(nn.Module):  # as a stage module: the values it sends on, as a tuple
        def __init__(self, dropout: float):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 6), nn.Dropout(dropout))

        def forward(self, x):
            return (self.body(x),)

    teacher, student = [Block(0.0), Block(0.0)], [Block(0.5), Block(0.5)]
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    times = time_blocks(teacher, student, [F.mse_loss, F.mse_loss], (torch.ones(4, 6),), torch.device("cpu"), 2)
    assert [len(t) for t in times] == [2, 2] and all(s > 0 for t in times for s in t)
    assert torch.equal(torch.rand(3), expected)
