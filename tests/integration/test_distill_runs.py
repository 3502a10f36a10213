"""Pipe-BD: block alignment, distillation losses, placement with replicas, and the one-process runtimes."""

import pytest
import torch

from tests.helpers import distill_batches, distill_compiled, distill_reference, sgd


pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- training -----------------------------------------------------------------------------------------


def _train(runtime: str, batches, policy: str = "mse", replicas=None, **options) -> list[torch.Tensor]:
    c = distill_compiled(policy=policy, replicas=replicas)
    with c.trainer(optimizer=sgd, runtime=runtime, **options) as trainer:
        for x in batches:
            trainer.step(x)
    return [p.detach().clone() for p in c.model.parameters()]


@pytest.mark.parametrize("runtime,options", [("sequential", {}), ("threads", {}), ("threads", {"decoupled": False}),
                                             ("dna", {}), ("threads", {"replicas": (2, 1)})])
def test_every_runtime_equals_blockwise_distillation_by_hand(runtime, options):
    # one process runs a replicated stage once, on the whole batch: the same computation
    batches = distill_batches(5, last=5)
    for ours, ref in zip(_train(runtime, batches, "kl", **options), distill_reference(batches, "kl")):
        torch.testing.assert_close(ours, ref)
