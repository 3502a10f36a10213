"""One plan for every rank: under torchrun rank 0 plans and the other ranks lower its plan; heads come from the seed."""

from __future__ import annotations

import sys
from pathlib import Path
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import one_plan_worker as w  # noqa: E402

import ppll_compile  # noqa: E402


def test_without_torchrun_or_for_another_world_size_nothing_is_shared(monkeypatch, one_thread_quietly):
    """Under torchrun's variables, a compile for another number of devices than processes (or share_plan=False)
    plans on its own and forms no process group."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: forming a group would fail
    torch.manual_seed(0)
    compiled = ppll_compile.compile(w.Mixed(), gpus=3, example_inputs=(w.X,), policy="dgl")
    assert compiled.plan.num_stages == 3 and not dist.is_initialized()
    torch.manual_seed(0)
    compiled = ppll_compile.compile(w.Mixed(), gpus=2, example_inputs=(w.X,), policy="dgl", share_plan=False)
    assert compiled.plan.num_stages == 2 and not dist.is_initialized()
    assert all("shared" not in note for note in compiled.plan.notes)
