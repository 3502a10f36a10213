"""The trained model back: ``trainer.model_state_dict()`` and ``trainer.save_model(path)`` under every runtime, untied
copies folded back, and under torchrun the whole model put together from both processes, equal to sequential."""

# The torchrun test starts tests/model_state_worker.py under ``python -m torch.distributed.run`` in its own session,
# under a timeout; whatever is left when it expires is killed.

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import model_state_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import assert_equal_states, free_port, run_torchrun, sgd, train_steps  # noqa: E402
from tests.models import Residual, conv_student, conv_teacher  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.mark.slow
def test_a_distilled_student_comes_back_whole():
    torch.manual_seed(0)
    compiled = ppll_compile.compile(conv_student(), 2, teacher=conv_teacher(), profile="flops", devices=["cpu", "cpu"],
                                    example_inputs=(torch.randn(4, 3, 16, 16),))
    before = {k: v.clone() for k, v in compiled.model.state_dict().items()}
    with compiled.trainer(optimizer=sgd) as trainer:
        for _ in range(2):
            trainer.step(torch.randn(4, 3, 16, 16))
        state = trainer.model_state_dict()
    assert_equal_states(state, compiled.model.state_dict())
    assert any(not torch.equal(state[k], before[k]) for k in before)


@pytest.mark.slow
def test_a_gpt2_compiled_with_tied_untie_comes_back_whole():
    tf = pytest.importorskip("transformers")

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                                bos_token_id=0, eos_token_id=0))

    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)]
    data = [({"input_ids": x}, torch.cat([x[:, 1:], torch.full((2, 1), -100)], 1)) for x in ids]
    compiled = ppll_compile.compile(gpt2(), 2, example_kwargs=data[0][0], tied="untie")
    assert compiled.plan.untied == ("lm_head.weight = transformer.wte.weight",)
    with train_steps(compiled, "sequential", data) as trainer:
        state = trainer.model_state_dict()
    assert_equal_states(state, compiled.model.state_dict())
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # stage 0's copy under both names
    fresh = gpt2()
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        ours, theirs = fresh.eval()(ids[0]).logits, compiled.model.eval()(ids[0]).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert not torch.equal(ours, gpt2().eval()(ids[0]).logits)  # trained


# ---- torchrun: the whole model from every process, stage by stage, equal to sequential ---------------------------

def _torchrun(out: Path, processes: int, timeout: float) -> str:
    return run_torchrun([f"--nproc-per-node={processes}", f"--master-port={free_port()}"],
                        HERE / "model_state_worker.py", [str(out)], timeout)


def _load_sharded(folder: Path) -> tuple[dict, dict]:
    """The tensors of a sharded save (every shard the index names) and its index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        part = safetensors_torch.load_file(str(folder / file))
        assert all(index["weight_map"][k] == file for k in part)
        loaded.update(part)
    return loaded, index


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 3])
def test_under_torchrun_rank_0_gets_the_whole_model_equal_to_sequential(tmp_path, processes):
    _torchrun(tmp_path, processes, timeout=300)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(processes)]
    fresh = {"tied": w.TiedNet, "meta": Residual}
    for name, (build, batches) in w.pipelines(processes).items():
        reference = w.reference_pipeline(processes) if name == "meta" else build()
        w.train(reference, "sequential", batches(), tmp_path / "ref", name)
        ref = reference.model.state_dict()
        # each process trained its own stage; only rank 0 received the model, and every rank got the paths
        assert [r[name]["stages"] for r in ranks] == [[i] for i in range(processes)]
        assert [r[name]["received"] for r in ranks] == [True] + [False] * (processes - 1)
        paths = [str(tmp_path / f"{name}.safetensors"), str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}-sharded")]
        assert all(r[name]["paths"] == paths for r in ranks)
        assert_equal_states(torch.load(tmp_path / f"{name}-state-0.pt", weights_only=True), ref)
        assert_equal_states(torch.load(tmp_path / f"{name}.pt", weights_only=True), ref)
        loaded = safetensors_torch.load_file(str(tmp_path / f"{name}.safetensors"))
        assert_equal_states({k: loaded[k] for k in ref}, ref)
        model = fresh[name]()
        model.load_state_dict(loaded, strict=True)
        assert_equal_states(model.state_dict(), ref)
        # stage by stage: one part per stage, in order, each key in exactly one, the whole state together
        parts = ranks[0][name]["parts"]
        assert [p["stage"] for p in parts] == list(range(processes))
        assert sorted(k for p in parts for k in p["keys"]) == sorted(ref)
        # sharded: one file per stage that holds tensors (the 3-stage tied net's last stage holds only its own copy
        # of the tied weight, which folds back to stage 0's), the index naming each tensor's file
        sharded, index = _load_sharded(tmp_path / f"{name}-sharded")
        files = [p["keys"] for p in parts if p["keys"]]
        assert (name, processes, len(files)) != ("tied", 3, processes)
        assert index["weight_map"] == {k: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                       for i, keys in enumerate(files) for k in keys}
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
        assert_equal_states({k: sharded[k] for k in ref}, ref)
        assert sorted(sharded) == sorted(ref)
        # rank 0's gather held one stage's part at most (the largest), never the whole state
        sizes = [p["bytes"] for p in parts]
        stats = ranks[0][name]["stats"]
        assert stats == [{"parts": processes, "total": sum(sizes), "peak": max(sizes)}] * len(stats)
        assert max(sizes) < sum(sizes)
        assert all(r[name]["stats"] == [None] * len(stats) and r[name]["parts"] == [] for r in ranks[1:])
    assert not list(tmp_path.glob("**/.*tmp*"))
