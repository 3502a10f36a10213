"""The runnable examples: ``train_digits.py --quick`` trains every configuration and learns well above chance."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CHANCE = 0.1  # digits has 10 balanced classes


def test_train_digits_quick(tmp_path: Path) -> None:
    out = tmp_path / "digits.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_digits.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"train_digits.py --quick failed:\n{proc.stdout}\n{proc.stderr}"
    rows = json.loads(out.read_text())["rows"]
    configs = [(r["method"], r["K"], r["policy"]) for r in rows]
    assert configs == [("e2e", 1, None), ("ppll", 2, "dgl"), ("ppll", 2, "infopro"), ("ppll", 4, "dgl"),
                       ("ppll", 4, "infopro")]
    for r in rows:  # every configuration is printed in the table with its accuracy
        line = f"{r['method']:<6} {r['K']:>2} {r['policy'] or '-':<8} {r['accuracy']:>8.3f}"
        assert line in proc.stdout, f"no table row {line!r} in:\n{proc.stdout}"
        assert len(r["stage_accuracy"]) == r["K"] - 1
    # every configuration learns: the weakest (K=4 infopro) reaches 0.74 with the example's seed
    low = {config: r["accuracy"] for config, r in zip(configs, rows) if not r["accuracy"] > 5 * CHANCE}
    assert not low, f"configurations at or below {5 * CHANCE:.2f} test accuracy: {low}\n{proc.stdout}"


def test_pipebd_mobilenet_quick() -> None:
    pytest.importorskip("torchvision")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "pipebd_mobilenet.py"), "--quick"], cwd=EXAMPLES.parent,
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"pipebd_mobilenet.py --quick failed:\n{proc.stdout}\n{proc.stderr}"
    assert "teacher ends at" in proc.stdout, f"no block table in:\n{proc.stdout}"
    loss = {when: float(m.group(1)) for when in ("before", "after")
            if (m := re.search(rf"^block loss {when}: ([0-9.]+)", proc.stdout, re.M))}
    assert set(loss) == {"before", "after"}, f"no block losses before and after training in:\n{proc.stdout}"
    assert loss["after"] < loss["before"], f"the block losses did not go down: {loss}\n{proc.stdout}"
