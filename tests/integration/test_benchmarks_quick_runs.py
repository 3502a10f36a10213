"""``python -m benchmarks --quick`` (docs/measured.md) runs: every section's quick form, each in a process of its own,
writes its results, its report and its plots into the results folder."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import SECTIONS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

TIMEOUT = 300
"""Seconds a section's quick form may take here before the test fails (each takes well under a minute quietly)."""


@pytest.mark.parametrize("section", list(SECTIONS))
def test_quick_section_runs(section, tmp_path):
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the tests' pinned device figures too: nothing calibrates
    command = [sys.executable, "-m", "benchmarks", "--quick", "--only", section, "--out", str(out)]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout also stops its workers
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"python -m benchmarks --quick --only {section} took over {TIMEOUT} s; its output:\n"
                    f"{output[-4000:]}")
    assert proc.returncode == 0, output[-8000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results) == [section] and results[section]["quick"] is True
    report = results[section]["report"]
    heading, body = report.split("\n", 1)  # results.md says when and where between them
    assert heading.startswith("## ") and f"{heading}\n\n_Measured " in (out / "results.md").read_text()
    assert body in (out / "results.md").read_text()
    figures = [line.split("](", 1)[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]
    for figure in figures:
        assert (out / figure).read_bytes().startswith(b"\x89PNG"), figure
