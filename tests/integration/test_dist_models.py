"""Real models under torchrun: Llama, Mistral, Qwen2, GPT-2, BERT and T5 with their default attention (sdpa, boolean
and float masks, integer positions crossing the cuts), built on the meta device and built normally, trained by
``runtime="distributed"`` with 2 and 3 processes; the gathered model equals the ``sequential`` runtime's bit for bit.

One torchrun job per process count trains every model in turn (tests/hf_dist_worker.py), so it also holds that one
job can build one trainer after another. Each test compares one model with its sequential reference, trained here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the repository root: ``tests.…`` imports

pytest.importorskip("transformers")

from hf_dist_worker import BUILDS, MODELS, pipeline, train  # noqa: E402

from tests.helpers import free_port, run_torchrun  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """(process count, the folder where its torchrun job left every model it trained)."""
    out = tmp_path_factory.mktemp(f"dist-{request.param}")
    run_torchrun([f"--nproc-per-node={request.param}", f"--master-port={free_port()}"], HERE / "hf_dist_worker.py",
                 [str(out)], timeout=600)
    return request.param, out


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_the_model_trained_under_torchrun_equals_sequential(trained, name, build, one_thread):
    stages, out = trained
    compiled = pipeline(name, build, stages)
    assert compiled.plan.num_stages == stages
    before = [{k: v.clone() for k, v in stage.state_dict().items()} for stage in compiled.stages]
    reference = train(compiled, name, "sequential")
    got = torch.load(out / f"{name}-{build}.pt", weights_only=True)
    assert list(got) == list(reference)
    differ = [k for k in reference if not torch.equal(got[k], reference[k])]
    assert not differ, f"{len(differ)} of {len(reference)} tensors differ from sequential, e.g. {differ[:3]}"
    for i, stage in enumerate(compiled.stages):  # every stage trained: the equality holds of trained models
        trains = [k for k, v in stage.module.named_parameters() if v.requires_grad]  # a 1-node stage may hold none
        assert not trains or any(not torch.equal(v, before[i][k]) for k, v in stage.state_dict().items()), \
            f"stage {i}"
