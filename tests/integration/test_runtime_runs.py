"""The one-process runtimes: threads reproduce sequential local learning, faults stop the pipeline, checkpoints resume."""

import pytest
from tests.helpers import assert_same_parameters, image_batches, train_residual

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- the same computation ----------------------------------------------------------------------
@pytest.mark.parametrize("gpus,policy", [(2, "dgl"), (3, "dgl"), (2, "infopro")])
def test_threads_fifo_equals_sequential(gpus, policy):
    data = image_batches(6, last=5)
    seq, seq_losses = train_residual("sequential", data, gpus, policy)
    thr, thr_losses = train_residual("threads", data, gpus, policy, queue_depth=1 if gpus == 3 else 2)
    assert_same_parameters(seq, thr)
    assert thr_losses == seq_losses
    assert all(len(ls) == len(data) for ls in seq_losses)
