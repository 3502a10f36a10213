"""``Trainer.evaluate`` reports what people measure: every stage's mean local loss and the final loss, accuracy where
the targets are classes, perplexity for per-token labels, the user's metrics; exact means (the whole data as one
batch) and the same numbers under every runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import eval_worker as w  # noqa: E402
from tests.helpers import run_gloo_workers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- distributed: 2 gloo processes -----------------------------------------------------------------------------

@pytest.mark.slow
def test_distributed_gives_every_rank_the_sequential_numbers(tmp_path):
    run_gloo_workers(HERE / "eval_worker.py", 2, tmp_path, timeout=120)
    with w.lm_pipeline("sequential") as trainer:
        ref = w.lm_program(trainer)
    for rank in range(2):
        assert torch.load(tmp_path / f"evaluate-{rank}.pt", weights_only=True) == ref
