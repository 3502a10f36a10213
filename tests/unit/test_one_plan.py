"""One plan for every rank: under torchrun rank 0 plans and the other ranks lower its plan; heads come from the seed."""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import one_plan_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile.runtime.distributed import plan_share  # noqa: E402
from ppll_compile.runtime.distributed.group import SAME_MODEL, model_fingerprint, model_mismatch  # noqa: E402


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


# ---- one model for every rank: the fingerprint a distributed trainer compares --------------------------------------


def _mlp(width: int = 16, extra: bool = False) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), *([nn.ReLU()] if extra else []),
                         nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


_FINGERPRINTS: dict[tuple, list] = {}
"""Fingerprints by (width, extra ReLU, built on meta): each model compiled once for both tests."""


def _fingerprint(width: int = 16, extra: bool = False, meta: bool = False) -> list:
    key = (width, extra, meta)
    if key not in _FINGERPRINTS:
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = _mlp(width, extra)
        compiled = ppll_compile.compile(model, gpus=2, example_inputs=(torch.randn(4, 8),), split_points=["_2"],
                                        share_plan=False, **({"local_stages": [1]} if meta else {}))
        _FINGERPRINTS[key] = model_fingerprint(compiled.lowered)
    return _FINGERPRINTS[key]


def test_the_same_model_has_one_fingerprint_whatever_its_weights_or_the_stages_materialised(one_thread_quietly):
    """What every rank holds of the same model: a meta-built one, filled by its own initialisation (other weights)
    on the stage it trains and every other stage left on the meta device (as a rank of a meta-built model holds it),
    has the fingerprint of the model built with its weights."""
    first = _fingerprint()
    assert _fingerprint(meta=True) == first
    assert [label for label, _ in first] == ["stage 0", "stage 1", "the head of stage 0"]
    assert first[0][1][:2] == ["node input_1 = input",
                               "node _0 = 0: Linear(in_features=8, out_features=16, bias=True)(input_1)"]
    assert "parameter module.0.weight: float32 (16, 8)" in first[0][1]


def test_ranks_whose_models_differ_are_named_with_the_first_difference(one_thread_quietly):
    """One more ReLU (which trains without any error) or another width: the ranks that differ from rank 0, the stage,
    and the node of each that differs first."""
    same, relu, wide = _fingerprint(), _fingerprint(extra=True), _fingerprint(width=32)
    assert model_mismatch([same, same, same]) is None
    assert model_mismatch([same, relu]) == (
        "the ranks were started with different models (rank 1 differs from rank 0), first in stage 1: rank 0 has "
        "'node _4 = 4: Linear(in_features=16, out_features=16, bias=True)(_3)' where rank 1 has "
        f"'node _4 = 4: ReLU()(_3)'; {SAME_MODEL}")
    assert model_mismatch([same, wide, relu]) == (
        "the ranks were started with different models (ranks 1, 2 differ from rank 0), first in stage 0: rank 0 has "
        "'node _0 = 0: Linear(in_features=8, out_features=16, bias=True)(input_1)' where rank 1 has "
        f"'node _0 = 0: Linear(in_features=8, out_features=32, bias=True)(input_1)'; {SAME_MODEL}")
    assert SAME_MODEL.startswith("start every rank with the same model file and options")


def _confirm_on_threads(monkeypatch, reports: list[tuple]) -> list[str | None]:
    """:func:`confirm_model` on one thread per rank (``reports``: each rank's graph and error), meeting through one
    in-memory store as torchrun's ranks meet through its store; each rank's error text, ``None`` where none."""
    store = dist.HashStore()
    monkeypatch.setattr(plan_share, "meeting_store", lambda timeout: (store, None, None))
    monkeypatch.setattr(plan_share, "_EXCHANGES", itertools.repeat(0))  # one exchange: the same key on every thread
    monkeypatch.setattr(plan_share, "READ_TIMEOUT", 5.0)
    errors: list[str | None] = [None] * len(reports)

    def rank(r: int) -> None:
        try:
            plan_share.confirm_model(r, len(reports), *reports[r])
        except ppll_compile.PPLLError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(reports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a rank still waits for the others"
    return errors


def test_sharing_the_plan_compares_the_traced_models_and_every_rank_raises(monkeypatch):
    """Under torchrun each rank traces its own model for rank 0's plan: the same model passes; one more ReLU on rank 1
    is named on both ranks with the first node that differs; a rank whose model cannot take rank 0's cuts makes every
    rank raise its error as a difference of the models; a rank that plans on its own (``None``) is not compared."""
    gm = [torch.fx.symbolic_trace(_mlp(extra=extra)) for extra in (False, True)]
    assert _confirm_on_threads(monkeypatch, [(gm[0], None), (gm[0], None), (None, None)]) == [None] * 3
    differ = _confirm_on_threads(monkeypatch, [(gm[0], None), (gm[1], None)])
    assert differ == [("the ranks were started with different models (rank 1 differs from rank 0), first in the "
                       "traced model: rank 0 has 'node _4 = 4: Linear(in_features=16, out_features=16, bias=True)(_3)' "
                       f"where rank 1 has 'node _4 = 4: ReLU()(_3)'; {SAME_MODEL}")] * 2
    cut = ppll_compile.CutError("rank 0's plan: '_9' is neither a node nor a module of the traced model")
    failed = _confirm_on_threads(monkeypatch, [(gm[0], None), (None, cut)])
    assert failed == [("rank 1 could not lower rank 0's plan on its own model, so the ranks were started with "
                       "different models: CutError: rank 0's plan: '_9' is neither a node nor a module of the traced "
                       f"model; {SAME_MODEL}")] * 2
