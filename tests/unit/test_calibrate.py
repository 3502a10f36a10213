"""Calibration as a step of its own: ``ppll_compile.calibrate`` and ``ppll-plan --calibrate`` / ``--recalibrate``."""

from __future__ import annotations

import json
import os
import warnings

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


def test_calibrate_writes_a_file_that_pins_the_figures(empty_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: calibrate_load(0.25))
    pin = tmp_path / "figures.json"
    assert main(["--calibrate", "--gpus", "2", "--figures", str(pin)]) == 0
    out, err = capsys.readouterr()
    threads = roofline.stage_threads(CALIBRATE_CPU, 2)
    assert out.startswith(f"ppll-plan: measured the figures of {roofline.device_name(CALIBRATE_CPU, threads)}: ")
    assert f"load 0.25 per core over {os.cpu_count()} cores while measuring\nppll-plan: cached in {empty_cache}\n" in out
    assert err == f"ppll-plan: wrote {pin} (pin it with {roofline.FIGURES_ENV}={pin})\n"  # not busy: no warning
    cached = json.loads(empty_cache.read_text())[calibrate_key(threads)]
    written = json.loads(pin.read_text())
    assert written == {k: v for k, v in cached.items() if k != "source"}
    assert written["load"] == {"before": 0.25 * (os.cpu_count() or 1), "after": 0.25 * (os.cpu_count() or 1),
                               "cores": os.cpu_count()}
    monkeypatch.setenv(roofline.FIGURES_ENV, str(pin))
    pinned = roofline.device_figures(CALIBRATE_CPU, 1)
    assert (pinned.source, pinned.rates, pinned.load) == (str(pin), written["rates"], written["load"])


def test_implicit_calibration_says_it_measured_now_and_how_to_redo_it(empty_cache, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: calibrate_load(0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback
        plan = ppll_compile.plan(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)),
                                 example_inputs=(torch.randn(2, 4),), split_points=["1"], devices=["cpu", "cpu"])
    note = next(n for n in plan.notes if n.startswith("costs are"))
    assert note.endswith("; measured now at load 0.00 per core and cached: `ppll-plan --recalibrate` or "
                         "`ppll_compile.calibrate(refresh=True)` measures them again")
    assert plan.calibration["load"] == {"before": 0.0, "after": 0.0, "cores": os.cpu_count()}


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--figures", "f.json"], None, "--figures writes the measured device figures; add --calibrate (or "
                                    "--recalibrate)"),
    (["--calibrate", "--recalibrate"], None, "--calibrate measures the figures unless cached, --recalibrate "
                                             "measures them again; give one of them"),
    (["--calibrate", "--figures", "no/such/dir/f.json"], None, "--figures: cannot write 'no/such/dir/f.json': "
                                                               "directory 'no/such/dir' does not exist; create it "
                                                               "or pass another path"),
    (["--recalibrate"], "busy", "PPLL_BUSY_LOAD='busy' is not a load per core; expected a number >= 0 (default "
                                "0.5; 0 warns on every calibration, inf on none), or unset PPLL_BUSY_LOAD"),
])
def test_bad_calibration_flags_exit_2_with_one_message(empty_cache, monkeypatch, capsys, argv, env, message):
    if env is not None:
        monkeypatch.setenv(roofline.BUSY_ENV, env)
    monkeypatch.setattr(roofline, "measure_device", lambda *a: pytest.fail("measured"))
    assert main(argv) == 2
    assert capsys.readouterr().err == f"ppll-plan: error: {message}\n"
    assert not empty_cache.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_this_machine_lacks_is_refused():
    with pytest.raises(ppll_compile.PlanError, match=r"^cannot calibrate cuda:0: this machine has no CUDA device; "
                                                     r"calibrate device='cpu', or run on the machine that will "
                                                     r"train$"):
        ppll_compile.calibrate("cuda:0")
    with pytest.raises(ValueError, match=r"^calibrate needs threads to be a positive integer, got 0$"):
        ppll_compile.calibrate(threads=0)
