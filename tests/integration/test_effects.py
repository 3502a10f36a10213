"""Planning has no global effects: a fresh process plans and compiles alike whether the calibration cache is empty or full."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A user's first run: no pinned figures, an empty cache. The script plans (cache PLAN_DIR), then compiles from
# seed 0 (cache COMPILE_DIR), and reports what each left behind.
_SCRIPT = r"""
import json, os, sys, warnings
import torch
from torch import nn
import ppll_compile
from ppll_compile import allocator

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 5)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))).mean((2, 3)))

def state():
    return {"rng": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "threads": (torch.get_num_threads(), torch.get_num_interop_threads()), "filters": list(warnings.filters)}

def same(a, b):
    return {"rng": torch.equal(a["rng"], b["rng"]), "cuda": all(map(torch.equal, a["cuda"], b["cuda"])),
            "threads": a["threads"] == b["threads"], "filters": a["filters"] == b["filters"],
            "allocator": allocator.applied_setting() is None}

x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
os.environ["PPLL_CACHE_DIR"] = sys.argv[1]
torch.manual_seed(0)
model = Net()
before = state()
plan = ppll_compile.plan(model, gpus=2, example_inputs=(x,))
out = {"plan": same(before, state()), "plan_notes": [n for n in plan.notes if n.startswith("costs are")]}
os.environ["PPLL_CACHE_DIR"] = sys.argv[2]
torch.manual_seed(0)
model = Net()
before = state()
pipe = ppll_compile.compile(model, gpus=2, example_inputs=(x,))
after = same(before, state())
out["compile"] = {k: after[k] for k in ("threads", "filters", "allocator")}
out["compile_notes"] = [n for n in pipe.plan.notes if n.startswith("costs are")]
out["heads"] = [[p.tolist() for p in h.parameters()] for h in pipe.lowered.heads if h is not None]
out["next"] = torch.rand(4).tolist()
print(json.dumps(out))
"""


def _run(plan_cache: Path, compile_cache: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PPLL_DEVICE_FIGURES"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(plan_cache), str(compile_cache)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The script in a fresh process with both caches empty, then in another with both full."""
    base = tmp_path_factory.mktemp("caches")
    cold = _run(base / "plan", base / "compile")
    assert (base / "plan" / "devices.json").exists() and (base / "compile" / "devices.json").exists()
    return cold, _run(base / "plan", base / "compile")


def test_the_caches_were_cold_then_warm(cold_and_warm):
    cold, warm = cold_and_warm
    for key in ("plan_notes", "compile_notes"):
        assert "measured now" in cold[key][0] and "(roofline, measured figures" in cold[key][0]
        assert "(roofline, cache figures" in warm[key][0]


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_plan_leaves_generators_threads_filters_and_allocator_as_it_found_them(cold_and_warm, cache):
    run = cold_and_warm[cache == "warm"]
    assert run["plan"] == {"rng": True, "cuda": True, "threads": True, "filters": True, "allocator": True}
    assert run["compile"] == {"threads": True, "filters": True, "allocator": True}


def test_one_seed_compiles_the_same_pipeline_with_a_cold_or_a_warm_cache(cold_and_warm):
    cold, warm = cold_and_warm
    assert cold["heads"] and cold["heads"] == warm["heads"]
    assert cold["next"] == warm["next"]
