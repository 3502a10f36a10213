"""Plans in the precision users train in (``precision=``): costs at the hardware's low-precision rates, fused
element-wise chains, memory by the documented rule, the plan field, and the trainer's autocast following it."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import compiled_residual_at, free_port, image_batches, run_torchrun, sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _trained_state(runtime: str) -> dict | None:
    """A bf16 plan of Residual trained on 3 batches under ``runtime``; the whole model's state (``None`` on ranks
    other than 0)."""
    compiled = compiled_residual_at("bf16", devices=["cpu", "cpu"])
    with compiled.trainer(optimizer=sgd, runtime=runtime) as trainer:
        for x, y in image_batches(3):
            trainer.step(x, y)
        trainer.finish()
        return trainer.model_state_dict()


@pytest.mark.slow
def test_a_bf16_plan_trains_under_torchrun_as_sequential(tmp_path):
    out = tmp_path / "state.pt"
    run_torchrun(["--nproc-per-node=2", f"--master-port={free_port()}"], Path(__file__), [str(out)], timeout=240)
    ref = _trained_state("sequential")
    got = torch.load(out, weights_only=True)
    assert list(got) == list(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


if __name__ == "__main__":  # a torchrun worker of the test above
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    state = _trained_state("distributed")
    if state is not None:
        torch.save(state, sys.argv[1])
