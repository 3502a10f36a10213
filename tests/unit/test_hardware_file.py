"""Hardware figures files (``hardware=FILE``): malformed, absurd, huge or special files get an error naming the file,
the key, the value and the way out, and are read no further than a figures file can be."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from ppll_compile import PlanError
from ppll_compile.cost import figures
from ppll_compile.cost.hardware import LARGEST_DEVICE_BYTES, PRESETS, load_hardware
from ppll_compile.cost.oplog import FAMILIES

RATES = {f"{family}:float32": 1e11 for family in FAMILIES}
FIELDS = "give a JSON object with the fields device, torch, rates (by 'family:float32' for every family of "
OWN = "give the device's own figure in {unit} (ppll_compile.calibrate(out=...) measures them), or remove the field"
FAR = " (at most PLAUSIBLE = 1000 times the largest preset's figure: no device comes near it)"


def _file(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"device": "d", "torch": "any", "rates": RATES, "overhead": 1e-6, **fields}))
    return path


def _refused(path: Path, problem: str, way: str = FIELDS) -> None:
    with pytest.raises(PlanError, match=f"^{re.escape(f'hardware={path}: {problem}; {way}')}"):
        load_hardware(path)


@pytest.mark.parametrize("rates", [[1, 2], None, "fast", 5])
def test_rates_that_are_not_an_object_are_named_with_their_value(tmp_path, rates):
    path = _file(tmp_path, rates=rates)
    _refused(path, f"rates is {rates!r}, expected an object of rates by 'family:dtype'")


@pytest.mark.parametrize("text,problem", [
    ("[" * 100_000 + "]" * 100_000, "nested too deep to be a figures file"),
    ('{"rates":' * 100_000 + "1" + "}" * 100_000, "nested too deep to be a figures file"),
    ("[1, 2]", "a JSON list where an object was expected"),
    ("{", "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ('{"n": ' + "9" * 10_000 + "}", "holds an integer of more than 4300 digits, which no figure has"),
], ids=["deep-list", "deep-object", "list", "truncated", "10000-digits"])
def test_a_file_that_is_not_a_figures_object_is_refused_by_what_it_is(tmp_path, text, problem):
    path = tmp_path / "figures.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=f"^{re.escape(f'hardware={path}: {problem}')}"):
        load_hardware(path)


@pytest.mark.parametrize("fields,problem", [
    ({"calls": [1]}, "calls is [1], expected an object of numbers by name"),
    ({"load": "x"}, "load is 'x', expected {} or an object of the 1-minute load average 'before' and 'after' "
                    "measuring and the machine's 'cores'"),
    ({"load": {"before": 1, "after": -1, "cores": 2}}, "load['after'] is -1, expected a number from 0 to 1e6"),
    ({"device": 5}, "device is 5, expected a string (at most 2000 characters)"),
    ({"sources": ["a"]}, "sources is ['a'], expected a string (at most 2000 characters)"),
    ({"rates": {**RATES, "warp:float32": 1e9}}, "rates has the key 'warp:float32', expected 'family:dtype' with a "
                                                "family of matmul, attention, conv, conv_bwd, norm, math, pool, "
                                                "memory, step"),
    ({"speed": 1}, "unknown field(s) 'speed'; the fields are device, torch, rates, calls, overhead, source, load, "
                   "memory_bytes, intra_node_bandwidth, inter_node_bandwidth, gpus_per_node, sources"),
])
def test_fields_of_the_wrong_kind_are_named_with_their_value(tmp_path, fields, problem):
    _refused(_file(tmp_path, **fields), problem)


@pytest.mark.parametrize("fields,problem,unit", [
    ({"rates": {**RATES, "matmul:float32": 1e40}}, "rates['matmul:float32'] is 1e+40, expected a number of FLOP/s "
                                                   "from 1e+06 to 9.15e+17" + FAR, "FLOP/s"),
    ({"rates": {**RATES, "memory:float32": 1e20}}, "rates['memory:float32'] is 1e+20, expected a number of bytes/s "
                                                   "from 1e+06 to 4.24e+15" + FAR, "bytes/s"),
    ({"memory_bytes": 1e30}, "memory_bytes is 1e+30, expected a number of bytes from 1 to 1.92e+14" + FAR, "bytes"),
    ({"memory_bytes": 10 ** 400}, f"memory_bytes is {repr(10 ** 400)[:57]}..., expected a number of bytes from 1 to "
                                  "1.92e+14" + FAR, "bytes"),
    ({"intra_node_bandwidth": 3e17}, "intra_node_bandwidth is 3e+17, expected a number of bytes/s from 1000 to "
                                     "3.6e+14" + FAR, "bytes/s"),
    ({"inter_node_bandwidth": 0}, "inter_node_bandwidth is 0, expected a number of bytes/s from 1000 to "
                                  "3.6e+14" + FAR, "bytes/s"),
    ({"overhead": 100.0}, "overhead is 100.0, expected a number of seconds per operator from 0 to 1",
     "seconds per operator"),
    ({"calls": {"mm": 1e9}}, "calls['mm'] is 1000000000.0, expected a number of seconds per operator call from 0 to "
                             "3600", "seconds per operator call"),
])
def test_absurd_figures_are_refused_with_the_bound_and_why(tmp_path, fields, problem, unit):
    _refused(_file(tmp_path, **fields), problem, OWN.format(unit=unit))


def test_too_many_devices_per_node_is_refused(tmp_path):
    _refused(_file(tmp_path, gpus_per_node=10 ** 9), "gpus_per_node is 1000000000, expected a whole number of "
                                                     "devices from 1 to 1024", "give the devices per node of the "
                                                                               "cluster, or remove the field")


def test_the_bounds_are_the_plausible_factor_times_the_largest_preset():
    """Each bound is PLAUSIBLE times the largest figure of the presets: the MI300X's memory and bfloat16 rate,
    its memory bandwidth at the achievable fraction, NVLink 4 at the link fraction."""
    limits, plausible = figures.LIMITS, figures.PLAUSIBLE
    assert plausible == 1000 and LARGEST_DEVICE_BYTES == 192 * 10 ** 9
    mi300x = PRESETS["mi300x"].figures.rates
    assert limits["memory_bytes"][1] == plausible * 192e9
    assert limits["compute"][1] == plausible * mi300x["matmul:bfloat16"] == pytest.approx(plausible * 0.7 * 1307.4e12)
    assert limits["memory-bound"][1] == plausible * mi300x["memory:float32"] == pytest.approx(plausible * 0.8 * 5.3e12)
    assert limits["intra_node_bandwidth"][1] == pytest.approx(plausible * 0.8 * 450e9)


def test_every_preset_and_a_calibrated_file_lie_within_the_bounds(tmp_path):
    """The bounds refuse nothing real: every preset's figures, written as a file, load as they are."""
    for name, preset in PRESETS.items():
        figures = preset.figures
        path = _file(tmp_path, device=figures.device, rates=figures.rates, overhead=figures.overhead,
                     memory_bytes=figures.memory_bytes, intra_node_bandwidth=preset.intra_node_bandwidth,
                     inter_node_bandwidth=preset.inter_node_bandwidth, gpus_per_node=preset.gpus_per_node,
                     calls={"('aten.mm.default', ...)": 2e-5}, load={"before": 0.5, "after": 0.7, "cores": 2})
        hw = load_hardware(path)
        assert (hw.figures.rates, hw.memory_bytes, hw.gpus_per_node) == (figures.rates, figures.memory_bytes, 8), name
    pinned = Path(__file__).parents[1] / "device_figures.json"
    assert load_hardware(pinned).figures.rates == json.loads(pinned.read_text())["rates"]


def test_a_file_larger_than_a_figures_file_is_not_read_past_the_limit(tmp_path, monkeypatch):
    """A sparse file of 256 MiB (no disk used) is refused after MAX_FIGURES_BYTES + 1 bytes, not read whole."""
    monkeypatch.setattr(figures, "MAX_FIGURES_BYTES", 1000)
    path = tmp_path / "figures.json"
    with path.open("wb") as f:
        f.truncate(256 * 2 ** 20)
    with pytest.raises(PlanError, match=f"^hardware={re.escape(str(path))}: larger than 1,000 bytes "
                                        r"\(MAX_FIGURES_BYTES\), which no figures file is; give the path of a "
                                        r"figures file \(ppll_compile.calibrate\(out=...\) writes one\)$"):
        load_hardware(path)


def test_a_fifo_a_device_or_a_folder_is_refused_without_being_opened(tmp_path, monkeypatch):
    """A FIFO with no writer would block a read for ever; /dev/zero would be read without end."""
    fifo = tmp_path / "figures.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    monkeypatch.setattr(os, "open", lambda *a, **k: pytest.fail(f"opened {a[0]}"))
    for path in (fifo, link, tmp_path):
        with pytest.raises(PlanError, match=f"^hardware={re.escape(str(path))}: not a regular file \\(a FIFO, "
                                            f"device or directory\\); give the path of a JSON file$"):
            load_hardware(path)
    with pytest.raises(PlanError, match=f"^unknown hardware {re.escape(repr(str(tmp_path / 'none.json')))}: not a "
                                        f"preset and no such file"):
        load_hardware(tmp_path / "none.json")
