"""One plan for every rank: under torchrun rank 0 plans and the other ranks lower its plan; heads come from the seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import one_plan_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile.plans.plan import Plan  # noqa: E402
from tests.helpers import run_gloo_workers  # noqa: E402

SHARED = "planned on rank 0 and shared with all 3 ranks (torchrun): every rank lowers this plan"


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{what}: {name}")


def _skewed(source: Path, target: Path) -> None:
    """Copy the calibration cache ``source`` to ``target`` with matrix products 10^4 times slower."""
    cache = json.loads((source / "devices.json").read_text())
    for figures in cache.values():
        figures["rates"]["matmul:float32"] /= 1e4
        figures["calls"] = {call: seconds * 1e4 for call, seconds in figures["calls"].items()}
    target.mkdir()
    (target / "devices.json").write_text(json.dumps(cache))


@pytest.mark.slow
def test_ranks_with_different_caches_train_rank_0s_plan_and_heads(tmp_path, monkeypatch, one_thread_quietly):
    """3 gloo ranks: rank 0's cache is empty (it calibrates), rank 1's holds figures whose matrix products are 10^4
    times slower, rank 2's this machine's figures; none is pinned. Each rank alone would cut elsewhere; every rank
    ends with rank 0's plan, the same heads, and trains what one process trains sequentially on that plan."""
    monkeypatch.delenv("PPLL_DEVICE_FIGURES")  # these plans read the caches (the workers unset it themselves)
    calibrated, slow = tmp_path / "cache-2", tmp_path / "cache-1"
    monkeypatch.setenv("PPLL_CACHE_DIR", str(calibrated))
    alone = {2: ppll_compile.plan(w.Mixed(), gpus=3, example_inputs=(w.X,), policy="dgl")}
    _skewed(calibrated, slow)
    monkeypatch.setenv("PPLL_CACHE_DIR", str(slow))
    alone[1] = ppll_compile.plan(w.Mixed(), gpus=3, example_inputs=(w.X,), policy="dgl")
    assert alone[1].cuts != alone[2].cuts, "on their own, ranks 1 and 2 would choose the same cuts"
    slow_figures = (slow / "devices.json").read_bytes()
    monkeypatch.delenv("PPLL_CACHE_DIR")

    run_gloo_workers(HERE / "one_plan_worker.py", 3, tmp_path, timeout=300)
    records = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(3)]

    assert [r["plan"] for r in records] == [records[0]["plan"]] * 3  # the same plan file text on every rank
    plan = Plan.from_json(records[0]["plan"])
    assert plan.notes[-1] == SHARED
    assert (tmp_path / "cache-0" / "devices.json").exists(), "rank 0 planned with its own (calibrated) figures"
    assert (slow / "devices.json").read_bytes() == slow_figures, "rank 1 planned with its own figures"
    for r in (1, 2):
        for i in range(3):
            _equal(records[r]["initial"][i], records[0]["initial"][i], f"rank {r}, stage {i} before training")
    assert all(r["released"] for r in records), "the trainer left its process group formed"

    # one process, rank 0's plan re-applied: the same initial stages and heads, the same training
    (tmp_path / "plan.json").write_text(records[0]["plan"])
    reference = w.mixed_pipeline(plan=str(tmp_path / "plan.json"))
    assert reference.plan.cuts == plan.cuts
    initial = w.tensors(reference, range(3))
    trained = w.train(reference, "sequential")
    for r in range(3):
        _equal(records[0]["initial"][r], initial[r], f"stage {r} before training, against one process")
        _equal(records[r]["trained"][r], trained[r], f"stage {r} trained on rank {r}, against sequential")

    # the meta-built model: every rank lowered rank 0's cuts; rank r's stage and head equal one process's
    meta_plans = [Plan.from_json(r["meta_plan"]) for r in records]
    assert [p.cuts for p in meta_plans] == [meta_plans[0].cuts] * 3
    assert meta_plans[0].notes[-2] == SHARED
    (tmp_path / "meta.json").write_text(records[0]["meta_plan"])
    whole = w.tensors(w.meta_pipeline(plan=str(tmp_path / "meta.json")), range(3))
    for r in range(3):
        _equal(records[r]["meta"][r], whole[r], f"meta-built stage {r} and its head on rank {r}")


@pytest.mark.slow
def test_a_stage_and_its_head_get_the_same_values_whichever_other_stages_are_built(one_thread_quietly):
    """A meta-built model's stage (its own initialisation) and its head are drawn from (seed, stage): built alone
    (as rank r builds it under torchrun) they equal the same stage built with every other."""
    whole = w.tensors(w.meta_pipeline(), range(3))
    for r in range(3):
        alone = w.meta_pipeline(local_stages=[r])
        _equal(w.tensors(alone, [r])[r], whole[r], f"stage {r} built alone")
    torch.manual_seed(1)
    reseeded = ppll_compile.compile(w.Mixed(), gpus=3, example_inputs=(w.X,), policy="dgl")
    torch.manual_seed(1)
    again = ppll_compile.compile(w.Mixed(), gpus=3, example_inputs=(w.X,), policy="dgl")
    for i in range(2):
        _equal(w.tensors(reseeded, [i])[i], w.tensors(again, [i])[i], f"stage {i} compiled twice from seed 1")
    torch.manual_seed(2)  # another seed draws other values: the equalities above are not met by any two builds
    other = ppll_compile.compile(w.Mixed(), gpus=3, example_inputs=(w.X,), policy="dgl")
    first, drawn = w.tensors(again, [0])[0], w.tensors(other, [0])[0]
    assert any(not torch.equal(first[name], value) for name, value in drawn.items())


@pytest.mark.slow
def test_when_rank_0_cannot_plan_every_rank_raises_its_error(tmp_path, one_thread_quietly):
    """Only rank 0 plans: its error (no stage fits the memory limit) reaches the other ranks, which raise it."""
    (tmp_path / "failing").touch()
    run_gloo_workers(HERE / "one_plan_worker.py", 3, tmp_path, timeout=200)
    texts = [(tmp_path / f"failed-{r}.txt").read_text() for r in range(3)]
    assert texts[0].startswith("InfeasibleMemoryError: "), texts[0]
    for r in (1, 2):
        assert texts[r] == f"PPLLError: rank 0 could not plan, and under torchrun every rank compiles rank 0's plan: " \
                           f"{texts[0]}", texts[r]
