"""Cuts that keep the batch first: a cut whose tensor folds the batch into another dimension (``(batch x patches,
...)`` inside a TNT block) is dropped at plan time with a note, and refused when no other cut is left."""

from __future__ import annotations


import pytest
import torch

import ppll_compile
from ppll_compile.analysis.batch_cuts import FOLDED


pytestmark = pytest.mark.usefixtures("quietly")  # no CPU-fallback warnings of compile


@pytest.mark.slow
def test_timm_tnt_drops_its_batch_folded_cuts_and_trains_at_two_stages():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model, x = timm.create_model("tnt_s_legacy_patch16_224", img_size=32, num_classes=10), torch.randn(2, 3, 32, 32)
    c = ppll_compile.compile(model, 2, example_inputs=(x,))
    note = next(n for n in c.plan.notes if FOLDED in n)
    assert note.startswith(f"10 of 19 legal cuts dropped: {FOLDED} (")  # batch x 4 patches: 8 rows at batch 2
    assert "(8, 16, 24) at batch 2, (12, 16, 24) at batch 3" in note
    assert c.plan.stages[0].boundary[0].shape[0] == 2
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="sequential") as trainer:
        losses = trainer.step(x, torch.tensor([1, 7]))
        trainer.finish()
    assert all(torch.isfinite(torch.tensor(ls)).all() for ls in losses)
