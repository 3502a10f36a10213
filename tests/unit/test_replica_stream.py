"""Replicas of one stage draw their own random numbers: a stage's training forward on a batch runs under the seed of
(seed, stage, batch, replica), so two replicas training slices of one batch draw different dropout masks, each the
mask that seed gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.runtime.rng import stream_seed
from tests.helpers import quiet, sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

SEED = 11
X = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(1))


def _compiled() -> ppll_compile.CompiledPipeline:
    """Two stages; stage 0 ends with a dropout of probability 0.5 (its output shows the mask)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with quiet():
        return ppll_compile.compile(model, example_inputs=(X,), policy="dgl", split_points=["2"])


def _first_stage_output(replica: int) -> torch.Tensor:
    """What stage 0, as replica ``replica``, sends on for the first batch."""
    with _compiled().trainer(optimizer=sgd, runtime="sequential", seed=SEED) as trainer:
        runner = trainer.runners[0]
        runner.replica = replica  # as the distributed runtime sets it on each replica's process
        before = torch.get_rng_state()
        out, _ = runner.train_step(trainer.message(X, Y))
        assert torch.equal(torch.get_rng_state(), before)  # drawn from the stage's stream, not the caller's
        return out.values[0]


def _by_hand(replica: int) -> torch.Tensor:
    """Stage 0's forward in train mode with torch's generator seeded from (seed, stage 0, batch 0, replica)."""
    stage = _compiled().stages[0].train()
    state = torch.get_rng_state()
    torch.manual_seed(stream_seed(SEED, 0, 0, replica=replica))
    with torch.no_grad():
        (out,) = stage(X)  # a stage returns its boundary values
    torch.set_rng_state(state)
    return out


def test_two_replicas_of_a_stage_draw_different_masks_each_from_its_own_seed():
    outputs = [_first_stage_output(r) for r in (0, 1)]
    masks = [o != 0 for o in outputs]
    assert not torch.equal(masks[0], masks[1])
    for replica, out in enumerate(outputs):
        torch.testing.assert_close(out, _by_hand(replica), rtol=0, atol=0)
    torch.testing.assert_close(_first_stage_output(1), outputs[1], rtol=0, atol=0)  # the same replica: the same
