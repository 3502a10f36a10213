"""Figures that stay true: figures measured on a busy machine are measured again by the first plan or calibration
that finds it quiet, and every plan made with busy figures says so in its notes and a warning at the user's line.
The load is faked through ``os.getloadavg`` (the one reading, :func:`ppll_compile.cost.figures.load_average`), and
the measurement by a stand-in that records the load it ran at, from an empty cache directory."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.cost import figures as device
from ppll_compile.cost import roofline

PINNED = json.loads((Path(__file__).resolve().parents[1] / "device_figures.json").read_text())
CORES = os.cpu_count() or 1
CPU = torch.device("cpu")
AGAIN = ("the first plan or calibration at a load below the busy threshold measures them again by itself, or "
         "`ppll-plan --recalibrate` or `ppll_compile.calibrate(refresh=True)` measures them again")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An empty cache, nothing pinned, the default threshold; ``machine(load)`` sets the load per core (``None``:
    a system without a load average); ``machine.measured`` lists the load of every measurement."""
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.delenv(roofline.BUSY_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "cache"))
    measured: list[float | None] = []

    def set_load(per_core: float | None) -> None:
        def read() -> tuple[float, float, float]:
            if per_core is None:
                raise OSError("no load average")
            return per_core * CORES, 0.0, 0.0
        monkeypatch.setattr(os, "getloadavg", read)

    def measure(dev: torch.device, threads: int = 1, **_: object) -> device.DeviceFigures:
        before = device.load_average()
        measured.append(device.load_per_core())
        load = {"before": before, "after": before, "cores": CORES} if before is not None else {}
        return device.DeviceFigures(device=roofline.device_name(dev, threads), torch=torch.__version__,
                                    rates=PINNED["rates"], overhead=1e-6, load=load)

    monkeypatch.setattr(roofline, "measure_device", measure)
    monkeypatch.setattr(roofline, "measure_calls", lambda calls, *a: {repr(c): 1e-6 for c in calls})
    set_load.measured = measured  # type: ignore[attr-defined]
    set_load.cache = tmp_path / "cache" / "devices.json"  # type: ignore[attr-defined]
    return set_load


def _plan() -> ppll_compile.Plan:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this machine has")  # the CPU fallback
        return ppll_compile.plan(model, example_inputs=(torch.randn(2, 4),), split_points=["1"],
                                 devices=["cpu", "cpu"])


def _costs_note(plan: ppll_compile.Plan) -> str:
    return next(n for n in plan.notes if n.startswith("costs are"))


def _calibrate_busy(machine) -> None:
    machine(0.75)
    with pytest.warns(UserWarning, match=r"^the machine was busy while the figures of .* were measured \(load "
                                         r"average 0\.75 per core"):
        ppll_compile.calibrate(stages=2)


def test_busy_figures_are_measured_again_by_the_first_plan_on_a_quiet_machine(machine):
    _calibrate_busy(machine)
    stale = json.loads(machine.cache.read_text())
    (key,) = stale
    stale[key]["calls"] = {"stale": 1.0}  # a per-shape time measured while busy goes with the figures
    machine.cache.write_text(json.dumps(stale))
    machine(0.1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*busy")  # quiet now: no warning about busy figures
        plan = _plan()
    assert machine.measured == [0.75, 0.1]
    assert _costs_note(plan).endswith("; measured now at load 0.10 per core and cached: `ppll-plan --recalibrate` or "
                                      "`ppll_compile.calibrate(refresh=True)` measures them again")
    cached = json.loads(machine.cache.read_text())[key]
    assert cached["load"]["before"] == pytest.approx(0.1 * CORES) and "stale" not in cached["calls"]
    machine(0.9)
    _plan()  # quiet figures are kept, however busy the machine is later
    assert machine.measured == [0.75, 0.1]


@pytest.mark.parametrize(("now", "said"), [(0.6, " (load 0.60 per core now)"), (None, "")])
def test_busy_figures_while_still_busy_are_used_and_every_plan_says_so(machine, now, said):
    _calibrate_busy(machine)
    machine(now)
    for _ in range(2):  # every plan, not the first only
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = _plan()
        busy = [w for w in caught if "were measured while the machine was busy" in str(w.message)]
        assert [str(w.message) for w in busy] == [
            f"the cached figures of {roofline.device_name(CPU, roofline.stage_threads(CPU, 2))} were measured while "
            f"the machine was busy (load 0.75 per core, at or above 0.5; PPLL_BUSY_LOAD sets the threshold) and it is "
            f"still busy{said}: they are used, and they may be slow; {AGAIN}"]
        assert busy[0].filename == os.path.abspath(__file__)  # the user's line: _plan's call of plan()
        called = Path(__file__).read_text().splitlines()[busy[0].lineno - 1]
        assert called.strip().startswith("return ppll_compile.plan(")
        assert _costs_note(plan).endswith("; measured at load 0.75 per core (busy: they may be slow) and the machine "
                                          f"is still busy: {AGAIN}")
        assert plan.calibration["load"]["before"] == pytest.approx(0.75 * CORES)
    assert machine.measured == [0.75]


def test_a_pinned_file_of_busy_figures_says_so_in_every_plan(machine, tmp_path, monkeypatch):
    pin = tmp_path / "busy.json"
    pin.write_text(json.dumps({**PINNED, "load": {"before": 0.8 * CORES, "after": 0.8 * CORES, "cores": CORES}}))
    monkeypatch.setenv(roofline.FIGURES_ENV, str(pin))
    machine(0.0)
    note = _costs_note(_plan())
    assert note.endswith("; measured at load 0.80 per core (busy: they may be slow): pin figures measured on a quiet "
                         "machine (`ppll-plan --recalibrate --figures FILE` writes them)")
    assert machine.measured == []  # a pinned file is never measured again
    quiet = dataclasses.replace(device.DeviceFigures(**PINNED), source=str(pin), load={"before": 0, "after": 0,
                                                                                       "cores": CORES})
    assert quiet.describe().endswith("GB/s memory)")
