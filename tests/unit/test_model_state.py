"""The trained model back: ``trainer.model_state_dict()`` and ``trainer.save_model(path)`` under every runtime, untied
copies folded back, and under torchrun the whole model put together from both processes, equal to sequential."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import model_state_worker as w  # noqa: E402
from ppll_compile.errors import PPLLError  # noqa: E402
from ppll_compile.runtime import Trainer  # noqa: E402
from tests.helpers import assert_equal_states, compiled_residual, image_batches, sgd, train_steps  # noqa: E402
from tests.models import Residual  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- one process: the model's own state ----------------------------------------------------------------------

@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_the_state_is_the_models_own_copied_to_the_cpu(runtime):
    compiled = compiled_residual()
    before = {k: v.clone() for k, v in compiled.model.state_dict().items()}
    with train_steps(compiled, runtime, image_batches(3)) as trainer:
        state = trainer.model_state_dict()
        assert_equal_states(state, compiled.model.state_dict())
        assert any(not torch.equal(state[k], before[k]) for k in before)  # trained, pending batches finished
        # a copy: training on does not change it
        kept = {k: v.clone() for k, v in state.items()}
        trainer.step(*image_batches(1, seed=5)[0])
        trainer.finish()
        assert_equal_states(state, kept)
    assert_equal_states(trainer.model_state_dict(), compiled.model.state_dict())  # after close too


def test_untied_copies_fold_back_to_the_first_stage_and_load_into_a_fresh_model():
    compiled = w.tied_pipeline()
    assert compiled.plan.untied == ("emb.weight = out.weight",)
    with train_steps(compiled, "sequential", w.PIPELINES["tied"][1]()) as trainer:
        state = trainer.model_state_dict()
    model = compiled.model
    assert_equal_states(state, model.state_dict())
    # every name of the tied parameter holds stage 0's copy, not the one stage 1 trained
    stage1_copy = dict(compiled.stages[1].module.named_parameters())["out.weight"]
    assert torch.equal(state["out.weight"], state["emb.weight"])
    assert torch.equal(state["emb.weight"], dict(compiled.stages[0].module.named_parameters())["emb.weight"])
    assert not torch.equal(state["out.weight"], stage1_copy)
    fresh = w.TiedNet()
    fresh.load_state_dict(state, strict=True)
    x = torch.randint(0, w.VOCAB, (6,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), model.eval()(x), rtol=0, atol=0)


def test_a_trainer_built_without_the_pipeline_says_how_to_get_the_model(tmp_path):
    compiled = compiled_residual()
    with Trainer(compiled.plan, compiled.lowered, optimizer=sgd) as trainer:
        for call in (trainer.model_state_dict, lambda: trainer.save_model(tmp_path / "m")):
            with pytest.raises(PPLLError, match=r"does not know the model it trains .*build it with "
                                                r"compiled.trainer\(...\) to get the trained model back"):
                call()
    assert list(tmp_path.iterdir()) == []


# ---- save_model: the format from the name, atomic ------------------------------------------------------------

def _saved(compiled, tmp_path: Path, name: str) -> tuple[Path, dict]:
    with train_steps(compiled, "sequential", image_batches(2)) as trainer:
        path = trainer.save_model(tmp_path / name)
    return path, compiled.model.state_dict()


@pytest.mark.parametrize("name,written", [("model", "model.safetensors"), ("model.safetensors", "model.safetensors"),
                                          ("sub/model.pt", "sub/model.pt"), ("model.bin", "model.bin")])
def test_save_model_writes_the_format_its_name_says(tmp_path, name, written):
    path, ref = _saved(compiled_residual(), tmp_path, name)
    assert path == tmp_path / written and path.is_file()
    if path.suffix == ".safetensors":
        loaded = safetensors_torch.load_file(str(path))
        assert list(loaded) == sorted(ref)  # a safetensors file lists its names sorted
        loaded = {k: loaded[k] for k in ref}
    else:
        loaded = torch.load(path, weights_only=True)
    assert_equal_states(loaded, ref)
    fresh = Residual()
    fresh.load_state_dict(loaded, strict=True)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left


def test_without_safetensors_a_name_without_suffix_is_written_by_torch_save(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    compiled = compiled_residual()
    path, ref = _saved(compiled, tmp_path, "model")
    assert path == tmp_path / "model.pt"
    assert_equal_states(torch.load(path, weights_only=True), ref)
    with compiled.trainer(optimizer=sgd) as trainer:
        with pytest.raises(PPLLError, match=r"cannot write '.*model.safetensors': the safetensors package is not "
                                            r"installed \(pip install safetensors\), or save to a .pt path"):
            trainer.save_model(tmp_path / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_tied_names_are_each_written_to_safetensors(tmp_path):
    compiled = w.tied_pipeline()
    with train_steps(compiled, "sequential", w.PIPELINES["tied"][1]()) as trainer:
        path = trainer.save_model(tmp_path / "tied")
    fresh = w.TiedNet()
    fresh.load_state_dict(safetensors_torch.load_file(str(path)), strict=True)
    assert_equal_states(fresh.state_dict(), compiled.model.state_dict())


def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    compiled = compiled_residual()
    with train_steps(compiled, "sequential", image_batches(2)) as trainer:
        path = trainer.save_model(tmp_path / "model.pt")
        first = torch.load(path, weights_only=True)
        trainer.step(*image_batches(1, seed=5)[0])

        def broken(obj, f, *args, **kwargs):
            f.write(b"half a file")
            raise OSError("disk full")

        monkeypatch.setattr(torch, "save", broken)
        with pytest.raises(OSError, match="disk full"):
            trainer.save_model(path)
    assert_equal_states(torch.load(path, weights_only=True), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
