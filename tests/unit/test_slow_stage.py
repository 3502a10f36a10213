"""Planning warns when the slowest stage is predicted to take minutes per training step on its device, naming the
stage, its time, the device and the ways out; a plan of seconds says nothing of it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import ppll_compile
from ppll_compile.cli.command import main
from ppll_compile.place.partition import SLOW_STAGE_SECONDS
from tests.models import Residual

X = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
BIG = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
"""Inputs of 64x64 pixels: minutes a step on the slow device."""
FAMILIES = ("matmul", "attention", "conv", "conv_bwd", "norm", "math", "pool", "memory", "step")


def slow_device(tmp_path: Path) -> str:
    """A figures file of a device doing 1 MFLOP/s and 1 MB/s (the slowest figures a file may give): the small
    Residual takes minutes a step on it at 64x64 pixels."""
    path = tmp_path / "slow.json"
    path.write_text(json.dumps({"device": "a slow device", "torch": "any",
                                "rates": {f"{f}:float32": 1e6 for f in FAMILIES}, "overhead": 1e-6}))
    return str(path)


def planned(x: torch.Tensor = X, **options) -> tuple[ppll_compile.Plan, list[str]]:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = ppll_compile.plan(Residual(), 2, example_inputs=(x,), devices=["cpu", "cpu"], **options)
    return p, [str(w.message) for w in caught]


def expected(p: ppll_compile.Plan, device: str) -> str:
    s = p.stages[p.bottleneck_stage]
    return (f"stage {s.index} is predicted to take {s.cost:.0f} s ({s.cost / 60:.1f} min) per training step on "
            f"{device}: training will take minutes per batch; ways out: a smaller batch or input (batch_size=...), "
            f"more devices (gpus=3 or more; replicas=True lets stages share a batch), or a faster device "
            f"(devices=[...], or hardware=NAME to plan for the machine that will train)")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_a_stage_of_minutes_on_a_slow_device_is_warned_of(tmp_path):
    p, caught = planned(BIG, hardware=slow_device(tmp_path))
    assert p.bottleneck_cost > 5 * SLOW_STAGE_SECONDS  # minutes: the device is slow, the model small
    note = expected(p, "cpu (a slow device)")
    assert note.startswith(f"stage {p.bottleneck_stage} is predicted to take ")
    assert caught == [note]
    assert p.notes[-1] == note


def test_a_plan_of_seconds_says_nothing_of_it():
    p, caught = planned()  # the pinned figures of one CPU core
    assert p.bottleneck_cost < 1
    assert caught == [] and not any("per training step on" in n for n in p.notes)


def test_the_threshold_is_the_slowest_stages_predicted_seconds():
    first, _ = planned(profile="flops", flops_per_second=1.0)  # seconds = FLOPs (its boundary's send is ~0)
    cut = {"split_points": list(first.cuts)}  # the same stages at every speed
    flops = first.bottleneck_cost
    under, quiet = planned(profile="flops", flops_per_second=flops / (0.9 * SLOW_STAGE_SECONDS), **cut)
    assert under.bottleneck_cost == pytest.approx(0.9 * SLOW_STAGE_SECONDS) and quiet == []
    over, caught = planned(profile="flops", flops_per_second=flops / (1.1 * SLOW_STAGE_SECONDS), **cut)
    assert over.bottleneck_cost == pytest.approx(1.1 * SLOW_STAGE_SECONDS)
    assert caught == [expected(over, f"cpu at {over.flops_per_second:.3g} FLOP/s (profile='flops')")]


def test_ppll_plan_show_prints_it_with_flags(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text("import torch\nfrom tests.models import Residual\n\ndef build_model():\n    torch.manual_seed(0)\n"
                     "    return Residual()\n\ndef example_inputs():\n    return torch.randn(8, 3, 64, 64)\n")
    assert main([str(model), "--gpus", "2", "--devices", "cpu,cpu", "--hardware", slow_device(tmp_path),
                 "--show"]) == 0
    out, err = capsys.readouterr()
    line = next(line for line in out.splitlines() if "per training step on" in line)
    assert line.startswith("note: stage ")
    assert line.endswith("ways out: a smaller batch or input (--batch-size B), more devices (--gpus 3 or more; "
                         "--replicas auto lets stages share a batch), or a faster device (--devices DEV,..., or "
                         "--hardware NAME to plan for the machine that will train)")
    assert "per training step on" not in err  # printed once, as a note
