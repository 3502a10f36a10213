"""The roofline cost model: operator records, device figures and their cache, and the accounting it feeds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ppll_compile.cost import roofline
from ppll_compile.cost.oplog import Op, OpLog
from ppll_compile.cost.roofline import DeviceFigures, seconds, step_ops
from ppll_compile.draw.costs import cost_bars
from ppll_compile.errors import PlanError
from tests.helpers import plan_quietly

B = 5


def _figures(**rates: float) -> DeviceFigures:
    base = {f"{f}:float32": 1e9 for f in roofline.FAMILIES}
    return DeviceFigures(device="d", torch="t", rates={**base, **{f"{k}:float32": v for k, v in rates.items()}},
                         overhead=1e-6)


def test_oplog_records_every_kernel_with_its_flops_and_bytes() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    with OpLog() as log, FlopCounterMode(display=False) as flops:
        y = (x @ w).relu()
        y.t().t().view(-1)  # views: no kernel
    mm, relu = log.ops
    assert (mm.kind, mm.flops, mm.bytes) == ("matmul", flops.get_total_flops(), 4 * (4 * 8 + 8 * 3 + 4 * 3))
    assert mm.call[0] == "aten.mm.default"
    assert (relu.kind, relu.flops, relu.bytes, relu.call) == ("memory", 0, 4 * (12 + 12), ())


def test_operator_families() -> None:
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with OpLog() as log:
        y = nn.functional.batch_norm(nn.functional.conv2d(x, torch.randn(4, 3, 3, 3)), None, None, training=True)
        nn.functional.max_pool2d(nn.functional.gelu(y), 2).sum().backward()
    kinds = [op.kind for op in log.ops]
    for family in ("conv", "norm", "math", "pool", "conv_bwd"):
        assert family in kinds


def test_seconds_is_the_roofline_of_every_operator() -> None:
    fig = _figures(matmul=2e9, memory=4e9, norm=1e9)
    ops = [Op("matmul", "float32", 6_000, 4_000), Op("matmul", "float32", 2_000, 40_000),
           Op("norm", "float32", 0, 3_000)]
    # max(6000 / 2e9, 4000 / 4e9) + 1e-6, max(2000 / 2e9, 40000 / 4e9) + 1e-6, 3000 / 1e9 + 1e-6
    assert seconds(ops, fig) == pytest.approx(3e-6 + 1e-6 + 10e-6 + 1e-6 + 3e-6 + 1e-6)
    timed = Op("conv", "float32", 10**9, 1, call=("aten.convolution.default", (), ()))
    assert seconds([timed], fig) == pytest.approx(1.0 + 1e-6)
    measured = DeviceFigures(device="d", torch="t", rates=fig.rates, overhead=1e-6, calls={repr(timed.call): 0.25})
    assert seconds([timed], measured) == 0.25  # the time measured at its shape replaces the roofline


def test_step_ops_stream_parameters_gradients_and_state() -> None:
    assert [op.bytes for op in step_ops([100, 8], "sgd")] == [300, 24]
    assert [op.bytes for op in step_ops([100], "momentum")] == [500]
    assert [op.bytes for op in step_ops([100], "adam")] == [700]
    assert {op.kind for op in step_ops([1], "adam")} == {"step"}


def test_figures_are_measured_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path))
    made = []

    def measure_device(device, threads):
        made.append((device, threads))
        return _figures()
    monkeypatch.setattr(roofline, "measure_device", measure_device)
    first = roofline.device_figures(torch.device("cpu"), 1)
    again = roofline.device_figures(torch.device("cpu"), 1)
    roofline.device_figures(torch.device("cpu"), 2)
    assert made == [(torch.device("cpu"), 1), (torch.device("cpu"), 2)]
    assert (first.source, again.source, again.rates) == ("measured", "cache", first.rates)
    cache = json.loads((tmp_path / "devices.json").read_text())
    assert sorted(cache) == sorted(f"{roofline.device_name(torch.device('cpu'), t)} | torch {torch.__version__}"
                                   for t in (1, 2))
    roofline.device_figures(torch.device("cpu"), 1, refresh=True)
    assert len(made) == 3


def test_operator_shapes_are_timed_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(roofline, "measure_device", lambda device, threads: _figures())
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with OpLog() as log:
        a @ b
    bogus = ("aten.no_such_operator.default", (), ())
    fig = roofline.device_figures(torch.device("cpu"), calls=[log.ops[0].call, bogus])
    assert list(fig.calls) == [repr(log.ops[0].call)]  # the bogus call keeps its roofline estimate
    assert 0 < fig.calls[repr(log.ops[0].call)] < 0.1
    timed = []
    monkeypatch.setattr(roofline, "measure_calls", lambda calls, *a: timed.append(list(calls)) or {})
    assert roofline.device_figures(torch.device("cpu"), calls=[log.ops[0].call]).calls == fig.calls
    assert timed == []  # cached


def test_pinned_figures(tmp_path, monkeypatch) -> None:
    path = tmp_path / "figures.json"
    rates = {f"{f}:float32": 1e9 for f in roofline.FAMILIES}
    path.write_text(json.dumps({"device": "pinned", "torch": "x", "rates": rates}))
    monkeypatch.setenv(roofline.FIGURES_ENV, str(path))
    fig = roofline.device_figures(torch.device("cpu"))
    assert (fig.device, fig.source, fig.rates) == ("pinned", str(path), rates)
    path.write_text("{")
    with pytest.raises(PlanError, match=rf"^{roofline.FIGURES_ENV}={path}: not JSON \(Expecting property name"):
        roofline.device_figures(torch.device("cpu"))


def test_old_cached_figures_still_load(tmp_path, monkeypatch) -> None:
    # figures cached before the load was recorded: read as they are, not measured again
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path))
    old = {k: v for k, v in _figures().to_dict().items() if k != "load"}
    key = f"{roofline.device_name(torch.device('cpu'), 1)} | torch {torch.__version__}"
    (tmp_path / "devices.json").write_text(json.dumps({key: old}))
    monkeypatch.setattr(roofline, "measure_device", lambda *a: pytest.fail("measured again"))
    fig = roofline.device_figures(torch.device("cpu"), 1)
    assert (fig.source, fig.rates, fig.load, fig.load_per_core(), fig.busy()) == ("cache", old["rates"], {}, None,
                                                                                   False)
    assert "load" not in fig.record() and fig.describe().endswith("GB/s memory)")


def test_the_notes_of_figures_measured_now_say_how_to_measure_again() -> None:
    fig = dataclasses.replace(_figures(), source="measured", load={"before": 0.5, "after": 0.7, "cores": 4})
    assert fig.load_per_core() == 0.7 / 4 and not fig.busy()
    assert fig.describe() == ("costs are seconds on d (roofline, measured figures: 1 GFLOP/s matmul, 1 GB/s memory); "
                              "measured now at load 0.17 per core and cached: `ppll-plan --recalibrate` or "
                              "`ppll_compile.calibrate(refresh=True)` measures them again")
    busy = dataclasses.replace(fig, source="cache", load={"before": 3.0, "after": 1.0, "cores": 4})
    assert busy.busy() and busy.describe().endswith("memory); measured at load 0.75 per core (busy: they may be "
                                                    "slow) and the machine is still busy: the first plan or "
                                                    "calibration at a load below the busy threshold measures them "
                                                    "again by itself, or `ppll-plan --recalibrate` or "
                                                    "`ppll_compile.calibrate(refresh=True)` measures them again")
    assert busy.record()["load"] == {"before": 3.0, "after": 1.0, "cores": 4}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _linear_head(spec, num_classes):
    return nn.Linear(spec.shape[-1], num_classes)


def test_a_stage_computes_no_gradient_for_its_detached_input() -> None:
    plan = plan_quietly(_mlp(), torch.randn(B, 8), split_points=["1"], policy=_linear_head, profile="flops")
    first, second = plan.stages
    assert first.flops_bwd == 2 * B * 8 * 16  # the weight gradient (the model's input needs none)
    assert second.flops_bwd == 2 * B * 16 * 4  # the weight gradient only: its input arrives detached


def test_the_head_is_charged_its_input_gradient() -> None:
    plan = plan_quietly(_mlp(), torch.randn(B, 8), split_points=["1"], policy=_linear_head, profile="flops")
    head = plan.stages[0].head
    assert head.flops_fwd == 2 * B * 16 * 4
    assert head.flops_bwd == 2 * (2 * B * 16 * 4)  # the weight gradient and the gradient into the stage's output


def test_a_boundary_saved_by_the_stage_and_its_head_counts_once() -> None:
    plan = plan_quietly(_mlp(), torch.randn(B, 8), split_points=["1"], policy=_linear_head, profile="flops")
    first = plan.stages[0]
    boundary = B * 16 * 4  # the ReLU saves its output, and the head's Linear saves the same tensor
    assert first.head.input_saved_bytes == boundary
    assert first.memory_bytes == (first.param_bytes + first.grad_bytes + first.optim_bytes + first.activation_bytes
                                  + first.head.memory_bytes - boundary)


def test_roofline_stage_costs_include_the_optimizer_step() -> None:
    fig = DeviceFigures(**json.loads((Path(__file__).parents[1] / "device_figures.json").read_text()))
    plan = plan_quietly(_mlp(), torch.randn(B, 8), split_points=["1"], policy=_linear_head, optimizer="momentum")
    assert plan.profile == "roofline" and plan.calibration["device"] == fig.device
    first, second = plan.stages
    rate, overhead = fig.rates["step:float32"], fig.overhead  # 40 GB/s, 1 us per tensor

    def momentum_step(*tensor_bytes: int) -> float:  # reads parameter, gradient, buffer; writes buffer, parameter
        return sum(5 * b / rate + overhead for b in tensor_bytes)
    # stage 0 steps Linear(8, 16) (weight and bias) and its head (counted as one tensor of 16 * 4 + 4 floats)
    assert first.step_cost == pytest.approx(momentum_step(8 * 16 * 4, 16 * 4) + momentum_step((16 * 4 + 4) * 4))
    assert second.step_cost == pytest.approx(momentum_step(16 * 4 * 4, 4 * 4))
    assert all(s.step_cost < s.compute_cost for s in plan.stages)
    assert cost_bars(plan).segments["optimizer step"] == pytest.approx((first.step_cost * 1e3, second.step_cost * 1e3))
    sgd = plan_quietly(_mlp(), torch.randn(B, 8), split_points=["1"], policy=_linear_head, optimizer="sgd")
    assert sgd.stages[1].compute_cost - sgd.stages[1].step_cost == pytest.approx(
        second.compute_cost - second.step_cost)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.fc(y.mean(1))


def test_views_of_one_storage_are_saved_once() -> None:
    torch.manual_seed(0)
    model, x = _Attention(), torch.randn(3, 5, 16)
    plan = plan_quietly(model, x, gpus=1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)  # the packed q, k, v projection is saved as three views of one storage
    assert plan.stages[0].activation_bytes == sum(saved.values())
