"""Figures files pinned by ``PPLL_DEVICE_FIGURES`` and the calibration cache: read and checked as ``hardware=FILE``
files are (special and oversized files refused unread, every field checked), a bad pinned file refused with an error
that names it, a damaged cache measured again with a warning instead of hanging or crashing a plan."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import PlanError
from ppll_compile.cost import figures, hardware, roofline
from ppll_compile.cost.oplog import COMPUTE, FAMILIES

CPU = torch.device("cpu")
RATES = {f"{family}:float32": 1e11 for family in FAMILIES}
WAY = ("give a JSON object with the fields device, torch, rates (by 'family:float32' for every family of "
       "matmul, attention, conv, conv_bwd, norm, math, pool, memory, step) and overhead (s) (`ppll-plan --calibrate "
       "--figures {path}` writes one), or unset PPLL_DEVICE_FIGURES to calibrate")
FAR = " (at most PLAUSIBLE = 1000 times the largest preset's figure: no device comes near it)"
MEASURED = figures.DeviceFigures(device="measured here", torch=torch.__version__, rates=RATES, overhead=1e-6,
                                 load={"before": 0.0, "after": 0.0, "cores": 1})


@pytest.fixture
def pinned(tmp_path, monkeypatch):
    """Pin the figures file ``tmp_path / 'figures.json'`` holding the given text (or fields over valid figures)."""
    path = tmp_path / "figures.json"
    monkeypatch.setenv(roofline.FIGURES_ENV, str(path))

    def pin(text: str | None = None, **fields: Any) -> Path:
        path.write_text(text if text is not None else
                        json.dumps({"device": "d", "torch": "any", "rates": RATES, "overhead": 1e-6, **fields}))
        return path
    return pin


def _message(path: Path, problem: str, way: str | None = None) -> str:
    """The exact error of a pinned file ``path`` refused for ``problem``, with the way out ``way`` (default ``WAY``)."""
    return f"PPLL_DEVICE_FIGURES={path}: {problem}; {WAY.format(path=path) if way is None else way}"


def _refused(path: Path, problem: str, way: str | None = None) -> None:
    with pytest.raises(PlanError, match=f"^{re.escape(_message(path, problem, way))}$"):
        roofline.device_figures(CPU)


@pytest.mark.parametrize("rates", [[1, 2], None, "fast"])
def test_pinned_rates_that_are_not_an_object_are_named_with_their_value(pinned, rates):
    path = pinned(rates=rates)  # a list gave AttributeError: 'list' object has no attribute 'get'
    _refused(path, f"rates is {rates!r}, expected an object of rates by 'family:dtype'")


def test_a_plan_with_pinned_rates_as_a_list_names_the_file_not_an_attribute(pinned):
    """Before, the plan failed inside the cost model with AttributeError: 'list' object has no attribute 'get'."""
    path = pinned(rates=[1, 2])
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(PlanError, match=f"^{re.escape(f'PPLL_DEVICE_FIGURES={path}: rates is [1, 2]')}"), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this machine has")  # the CPU fallback
        ppll_compile.plan(model, example_inputs=(torch.randn(2, 4),), split_points=["1"], devices=["cpu", "cpu"])


@pytest.mark.parametrize("fields,problem,unit", [
    ({"rates": {**RATES, "matmul:float32": 1e40}}, "rates['matmul:float32'] is 1e+40, expected a number of FLOP/s "
                                                   "from 1e+06 to 9.15e+17" + FAR, "FLOP/s"),
    ({"memory_bytes": 1e30}, "memory_bytes is 1e+30, expected a number of bytes from 1 to 1.92e+14" + FAR, "bytes"),
    ({"overhead": -1}, "overhead is -1, expected a number of seconds per operator from 0 to 1", "seconds per operator"),
])
def test_pinned_absurd_figures_are_refused_with_the_bound(pinned, fields, problem, unit):
    _refused(pinned(**fields), problem, f"give the device's own figure in {unit} (ppll_compile.calibrate(out=...) "
                                        f"measures them), or remove the field")


@pytest.mark.parametrize("text,problem", [
    ("[" * 100_000 + "]" * 100_000, "nested too deep to be a figures file (its values are numbers, strings and "
                                    "objects of numbers)"),
    ('{"n": ' + "9" * 10_000 + "}", "holds an integer of more than 4300 digits, which no figure has"),
    ('{"device": "d", "torch": "t", "speed": 1}', "unknown field(s) 'speed'; the fields are device, torch, rates, "
                                                  "calls, overhead, source, load, memory_bytes, intra_node_bandwidth, "
                                                  "inter_node_bandwidth, gpus_per_node, sources"),
    ("[1]", "a JSON list where an object was expected"),
], ids=["deep", "10000-digits", "unknown-key", "list"])
def test_a_pinned_file_that_is_not_figures_is_refused_by_what_it_is(pinned, text, problem):
    _refused(pinned(text), problem)


def test_a_pinned_fifo_or_device_is_refused_without_being_opened(tmp_path, monkeypatch):
    fifo, zero = tmp_path / "figures.fifo", tmp_path / "zero.json"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    monkeypatch.setattr(os, "open", lambda *a, **k: pytest.fail(f"opened {a[0]}"))
    for path in (fifo, zero):
        monkeypatch.setenv(roofline.FIGURES_ENV, str(path))
        with pytest.raises(PlanError) as e:
            roofline.device_figures(CPU)
        assert str(e.value) == _message(path, "not a regular file (a FIFO, device or directory)",
                                        "give the path of a JSON file")


def test_a_pinned_file_larger_than_a_figures_file_is_not_read_past_the_limit(pinned, monkeypatch):
    monkeypatch.setattr(figures, "MAX_FIGURES_BYTES", 1000)
    path = pinned("")
    with path.open("wb") as f:
        f.truncate(256 * 2 ** 20)  # sparse: no disk used
    with pytest.raises(PlanError) as e:
        roofline.device_figures(CPU)
    assert str(e.value) == _message(path, "larger than 1,000 bytes (MAX_FIGURES_BYTES), which no figures file is",
                                    "give the path of a figures file (ppll_compile.calibrate(out=...) writes one)")


@pytest.mark.parametrize("fields", [{"rates": [1]}, {"rates": {**RATES, "conv:float32": 1e40}}, {"overhead": 7.0},
                                    {"load": {"x": 1}}, {"calls": "x"}, {"gpus_per_node": 0.5}, {"x": 1}])
def test_a_pinned_file_and_a_hardware_file_are_refused_for_the_same_problem(pinned, fields):
    """One reader: the problem a hardware=FILE error names is the one the pinned file's error names."""
    path = pinned(**fields)
    with pytest.raises(PlanError) as as_hardware:
        hardware.load_hardware(path)
    with pytest.raises(PlanError) as as_pinned:
        roofline.device_figures(CPU)
    problem = str(as_hardware.value).removeprefix(f"hardware={path}: ")
    assert str(as_pinned.value).startswith(f"PPLL_DEVICE_FIGURES={path}: {problem.split('; give')[0]}; give")


def test_the_bounds_are_the_plausible_factor_times_the_largest_preset():
    """figures.FASTEST holds the presets' largest figures exactly (the MI300X's bfloat16 matmul, memory bandwidth and
    memory, NVLink 4), and each upper bound is PLAUSIBLE times one of them."""
    rates = [(k.split(":")[0], v) for h in hardware.PRESETS.values() for k, v in h.figures.rates.items()]
    assert figures.FASTEST == {"compute": max(v for f, v in rates if f in COMPUTE),
                               "memory-bound": max(v for f, v in rates if f not in COMPUTE),
                               "memory_bytes": hardware.LARGEST_DEVICE_BYTES,
                               "link": max(h.intra_node_bandwidth for h in hardware.PRESETS.values())}
    top = {k: high for k, (_, high, _) in figures.LIMITS.items()}
    assert figures.PLAUSIBLE == 1000 and {k: top[k] / 1000 for k in ("compute", "memory-bound", "memory_bytes")} == \
        {k: figures.FASTEST[k] for k in ("compute", "memory-bound", "memory_bytes")}
    assert top["intra_node_bandwidth"] == top["inter_node_bandwidth"] == 1000 * figures.FASTEST["link"]


@pytest.mark.parametrize("factor", [1.0, 1.001])
def test_a_pinned_file_and_a_hardware_file_share_their_bounds(pinned, factor):
    """At the bound both readers take a file; just past it both refuse it."""
    path = pinned(rates={**RATES, "matmul:float32": figures.LIMITS["compute"][1] * factor})
    outcomes = []
    for read in (hardware.load_hardware, lambda _: roofline.device_figures(CPU)):
        try:
            read(path)
            outcomes.append("taken")
        except PlanError as e:
            outcomes.append(str(e).split(": ", 1)[1].split(";")[0])
    said = f"rates['matmul:float32'] is {factor * figures.LIMITS['compute'][1]!r}, expected a number of FLOP/s from " \
           f"1e+06 to 9.15e+17{FAR}"
    assert outcomes == (["taken"] * 2 if factor == 1.0 else [said] * 2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An unpinned plan's cache file in ``tmp_path``, and a measurement that records that it ran."""
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(roofline.BUSY_ENV, "inf")
    monkeypatch.setattr(roofline, "measure_device", lambda device, threads: RUNS.append(threads) or MEASURED)
    RUNS.clear()
    return tmp_path / "devices.json"


RUNS: list[int] = []
"""The thread counts of the measurements the ``cache`` fixture's stand-in ran."""


KEY = f"{roofline.device_name(CPU, 1)} | torch {torch.__version__}"


def _measured_again(cache: Path, warning: str) -> None:
    with pytest.warns(UserWarning, match=warning):
        figs = roofline.device_figures(CPU, 1)
    assert (figs.rates, figs.source, RUNS) == (RATES, "measured", [1])
    assert json.loads(cache.read_text())[KEY]["rates"] == RATES  # written anew
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert roofline.device_figures(CPU, 1).source == "cache"


@pytest.mark.parametrize("entry,problem", [
    ({"rates": [1, 2]}, "rates is [1, 2], expected an object of rates by 'family:dtype'"),
    ({"load": {"x": 1}}, "load is {'x': 1}, expected {} or an object of the 1-minute load average"),
    ({"rates": {**RATES, "matmul:float32": 1e40}}, "rates['matmul:float32'] is 1e+40, expected a number of FLOP/s"),
    ({"calls": None}, "calls is None, expected an object of numbers by name"),
])
def test_a_damaged_cache_entry_is_measured_again_with_a_warning(cache, entry, problem):
    """Before, ``rates`` as a list crashed a plan with AttributeError, ``load`` without 'before' with KeyError, and
    1e40 FLOP/s made every stage free."""
    cache.write_text(json.dumps({KEY: {**MEASURED.to_dict(), **entry}, "other device": {"kept": 1}}))
    said = f"the calibration cache {cache} holds figures of {KEY!r} that cannot be used ({problem}"
    _measured_again(cache, f"^{re.escape(said)}")
    assert json.loads(cache.read_text())["other device"] == {"kept": 1}  # other devices' entries are kept


@pytest.mark.parametrize("text,problem", [
    ("{", "not JSON (Expecting property name"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep to be a figures file"),
    ("[]", "a JSON list where an object was expected"),
], ids=["truncated", "deep", "list"])
def test_an_unreadable_cache_is_measured_again_with_a_warning(cache, text, problem):
    """Before, a deep cache crashed every plan with RecursionError, and a truncated one was replaced silently."""
    cache.write_text(text)
    _measured_again(cache, f"^{re.escape(f'cannot use the calibration cache {cache}: {problem}')}")


def test_a_fifo_planted_as_the_cache_is_not_opened_and_is_replaced(cache, monkeypatch):
    """Before, a plan blocked for ever reading a FIFO with no writer."""
    os.mkfifo(cache)
    said = f"cannot use the calibration cache {cache}: not a regular file (a FIFO, device or directory); the " \
           f"figures are measured again"
    with pytest.warns(UserWarning, match=f"^{re.escape(said)}"):
        figs = roofline.device_figures(CPU, 1)
    assert figs.source == "measured" and cache.is_file()


def test_a_file_calibrate_writes_pins_as_it_is(cache, tmp_path, monkeypatch):
    """What ``calibrate(out=...)`` writes is a figures file the pinned reader takes, figure for figure."""
    out = tmp_path / "pinned.json"
    measured = ppll_compile.calibrate(threads=1, out=out)
    monkeypatch.setenv(roofline.FIGURES_ENV, str(out))
    figs = roofline.device_figures(CPU, 1)
    assert (figs.rates, figs.overhead, figs.load, figs.source) == (measured.rates, measured.overhead, measured.load,
                                                                   str(out))


@pytest.mark.timeout(20)
def test_calibrate_refuses_to_write_into_a_fifo_before_measuring(cache, tmp_path):
    """Before, writing the figures to a FIFO with no reader blocked for ever (after measuring them)."""
    fifo = tmp_path / "figures.fifo"
    os.mkfifo(fifo)
    said = f"cannot write the device figures to {str(fifo)!r}: not a regular file (a FIFO or device); pass out= " \
           f"(--figures) the path of a JSON file to write"
    with pytest.raises(PlanError, match=f"^{re.escape(said)}$"):
        ppll_compile.calibrate(threads=1, out=fifo)
    assert RUNS == []  # nothing measured
