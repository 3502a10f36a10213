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

CPU = torch.device("cpu")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A user's first run: nothing pinned, an empty cache, the default busy threshold."""
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.delenv(roofline.BUSY_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "devices.json"


def _load(per_core: float) -> tuple[float, float, float]:
    """A 1-minute load average of ``per_core`` on this machine's cores."""
    return per_core * (os.cpu_count() or 1), 0.0, 0.0


def _key(threads: int) -> str:
    return f"{roofline.device_name(CPU, threads)} | torch {torch.__version__}"


def test_calibrate_writes_a_file_that_pins_the_figures(empty_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: _load(0.25))
    pin = tmp_path / "figures.json"
    assert main(["--calibrate", "--gpus", "2", "--figures", str(pin)]) == 0
    out, err = capsys.readouterr()
    threads = roofline.stage_threads(CPU, 2)
    assert out.startswith(f"ppll-plan: measured the figures of {roofline.device_name(CPU, threads)}: ")
    assert f"load 0.25 per core over {os.cpu_count()} cores while measuring\nppll-plan: cached in {empty_cache}\n" in out
    assert err == f"ppll-plan: wrote {pin} (pin it with {roofline.FIGURES_ENV}={pin})\n"  # not busy: no warning
    cached = json.loads(empty_cache.read_text())[_key(threads)]
    written = json.loads(pin.read_text())
    assert written == {k: v for k, v in cached.items() if k != "source"}
    assert written["load"] == {"before": 0.25 * (os.cpu_count() or 1), "after": 0.25 * (os.cpu_count() or 1),
                               "cores": os.cpu_count()}
    monkeypatch.setenv(roofline.FIGURES_ENV, str(pin))
    pinned = roofline.device_figures(CPU, 1)
    assert (pinned.source, pinned.rates, pinned.load) == (str(pin), written["rates"], written["load"])


def test_calibrate_measures_once_and_recalibrate_again(empty_cache, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: _load(0.1))
    first = ppll_compile.calibrate(threads=1)
    monkeypatch.setattr(os, "getloadavg", lambda: _load(0.2))
    again = ppll_compile.calibrate(threads=1)
    assert (first.source, again.source, again.rates, again.load) == ("measured", "cache", first.rates, first.load)
    assert main(["--calibrate", "--gpus", str(os.cpu_count() or 1)]) == 0  # one thread per stage: cached already
    assert capsys.readouterr().out.startswith(f"ppll-plan: the figures of {first.device} are cached (measured "
                                              f"before; --recalibrate measures them again): ")
    # the figures of an operator shape are replaced too
    with roofline.OpLog() as log:
        torch.randn(8, 8) @ torch.randn(8, 8)
    roofline.device_figures(CPU, 1, calls=[op.call for op in log.ops if op.call])
    assert len(json.loads(empty_cache.read_text())[_key(1)]["calls"]) == 1
    assert main(["--recalibrate", "--gpus", str(os.cpu_count() or 1)]) == 0
    assert capsys.readouterr().out.startswith(f"ppll-plan: measured the figures of {first.device}: ")
    cached = json.loads(empty_cache.read_text())[_key(1)]
    assert (cached["load"]["before"], cached["calls"]) == (0.2 * (os.cpu_count() or 1), {})


def test_a_busy_machine_is_named_in_a_warning(empty_cache, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: _load(0.5))  # at the threshold
    with pytest.warns(UserWarning, match=r"^the machine was busy while the figures of .* were measured \(load "
                                         r"average 0\.50 per core over \d+ cores, at or above 0\.5; PPLL_BUSY_LOAD "
                                         r"sets the threshold\): they may be slow, and they are cached; when it is "
                                         r"quieter, `ppll-plan --recalibrate` or "
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


def test_implicit_calibration_says_it_measured_now_and_how_to_redo_it(empty_cache, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: _load(0.0))
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
