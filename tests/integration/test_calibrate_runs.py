"""Calibration as a step of its own: ``ppll_compile.calibrate`` and ``ppll-plan --calibrate`` / ``--recalibrate``."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ppll_compile
from ppll_compile.cli.command import main
from ppll_compile.cost import roofline
from tests.helpers import CALIBRATE_CPU, calibrate_key, calibrate_load


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A user's first run: nothing pinned, an empty cache, the default busy threshold."""
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.delenv(roofline.BUSY_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "devices.json"


def test_calibrate_measures_once_and_recalibrate_again(empty_cache, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: calibrate_load(0.1))
    first = ppll_compile.calibrate(threads=1)
    monkeypatch.setattr(os, "getloadavg", lambda: calibrate_load(0.2))
    again = ppll_compile.calibrate(threads=1)
    assert (first.source, again.source, again.rates, again.load) == ("measured", "cache", first.rates, first.load)
    assert main(["--calibrate", "--gpus", str(os.cpu_count() or 1)]) == 0  # one thread per stage: cached already
    assert capsys.readouterr().out.startswith(f"ppll-plan: the figures of {first.device} are cached (measured "
                                              f"before; --recalibrate measures them again): ")
    # the figures of an operator shape are replaced too
    with roofline.OpLog() as log:
        torch.randn(8, 8) @ torch.randn(8, 8)
    roofline.device_figures(CALIBRATE_CPU, 1, calls=[op.call for op in log.ops if op.call])
    assert len(json.loads(empty_cache.read_text())[calibrate_key(1)]["calls"]) == 1
    assert main(["--recalibrate", "--gpus", str(os.cpu_count() or 1)]) == 0
    assert capsys.readouterr().out.startswith(f"ppll-plan: measured the figures of {first.device}: ")
    cached = json.loads(empty_cache.read_text())[calibrate_key(1)]
    assert (cached["load"]["before"], cached["calls"]) == (0.2 * (os.cpu_count() or 1), {})


def test_a_busy_machine_is_named_in_a_warning(empty_cache, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: calibrate_load(0.5))  # at the threshold
    with pytest.warns(UserWarning, match=r"^the machine was busy while the figures of .* were measured \(load "
                                         r"average 0\.50 per core over \d+ cores, at or above 0\.5; PPLL_BUSY_LOAD "
                                         r"sets the threshold\): they may be slow, and they are cached; the first "
                                         r"plan or calibration at a load below the busy threshold measures them "
                                         r"again by itself, or `ppll-plan --recalibrate` or "
                                         r"`ppll_compile.calibrate\(refresh=True\)` measures them again$"):
        figures = ppll_compile.calibrate(threads=1)
    assert figures.busy() and "measured now at load 0.50 per core (busy: they may be slow)" in figures.describe()
    monkeypatch.setenv(roofline.BUSY_ENV, "0.75")
    assert main(["--recalibrate", "--gpus", str(os.cpu_count() or 1)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "load 0.50 per core" in out and "(busy)" not in out
    monkeypatch.setenv(roofline.BUSY_ENV, "0")
    assert main(["--recalibrate", "--gpus", str(os.cpu_count() or 1)]) == 0
    out, err = capsys.readouterr()
    assert "(busy)" in out and err.startswith("ppll-plan: warning: the machine was busy while the figures of ")
