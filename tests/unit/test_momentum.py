"""Momentum (MAN) heads at run time: the next stage publishes copies of the weights the head follows, the head pulls."""

import pytest
import torch

from tests.helpers import image_batches, momentum_pipeline, recording_sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

BATCHES = 6


def _trained(momentum: float, every: int, runtime: str):
    """Train :func:`momentum_pipeline` on BATCHES batches; stage 0's trunk before and after, and every copy stage 1
    published."""
    compiled = momentum_pipeline(momentum, every)
    head = compiled.lowered.heads[0]
    initial = [t.clone() for t in head.ema_tensors()]
    snapshots: list = []
    with compiled.trainer(optimizer=recording_sgd(compiled, snapshots), runtime=runtime) as trainer:
        for x, y in image_batches(BATCHES):
            trainer.step(x, y)
        trainer.finish()
    return initial, head.ema_tensors(), snapshots


def test_sequential_pulls_the_copy_published_after_every_nth_step():
    """m = 0.5, every 2: stage 1 publishes after its steps 2, 4, 6 (batches 1, 3, 5); stage 0 pulls before batches 2
    and 4, so its trunk is 0.5 (0.5 w0 + 0.5 s1) + 0.5 s3 with s_b stage 1's weights after batch b."""
    initial, final, snapshots = _trained(0.5, 2, "sequential")
    expected = initial
    for b in (1, 3):
        expected = [0.5 * e + 0.5 * s for e, s in zip(expected, snapshots[b])]
    assert len(snapshots) == BATCHES
    for got, want in zip(final, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_threads_pull_a_whole_published_copy_never_a_half_stepped_one():
    """m = 0: the trunk is the last copy pulled. Stage 0 starts batch 4 only after stage 1 took batch 1 (queues of
    2), so it has pulled at least once; what it holds is exactly one copy stage 1 published after a step."""
    initial, final, snapshots = _trained(0.0, 1, "threads")
    assert not all(torch.equal(a, b) for a, b in zip(final, initial))
    assert any(all(torch.equal(a, b) for a, b in zip(final, snap)) for snap in snapshots)
