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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model_state_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile.errors import PPLLError  # noqa: E402
from ppll_compile.runtime import Trainer  # noqa: E402
from tests.helpers import compiled_residual, free_port, image_batches, run_torchrun, sgd  # noqa: E402
from tests.models import Residual, conv_student, conv_teacher  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _assert_equal_states(ours: dict, ref: dict) -> None:
    """Same keys in the same order, every tensor bit-identical and on the CPU."""
    assert list(ours) == list(ref)
    for key, value in ref.items():
        assert ours[key].device.type == "cpu", key
        torch.testing.assert_close(ours[key], value.detach().cpu(), rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def _train(compiled, runtime: str, batches: list):
    trainer = compiled.trainer(optimizer=sgd, runtime=runtime)
    for x, y in batches:
        trainer.step(x, y)
    return trainer


# ---- one process: the model's own state ----------------------------------------------------------------------

@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_the_state_is_the_models_own_copied_to_the_cpu(runtime):
    compiled = compiled_residual()
    before = {k: v.clone() for k, v in compiled.model.state_dict().items()}
    with _train(compiled, runtime, image_batches(3)) as trainer:
        state = trainer.model_state_dict()
        _assert_equal_states(state, compiled.model.state_dict())
        assert any(not torch.equal(state[k], before[k]) for k in before)  # trained, pending batches finished
        # a copy: training on does not change it
        kept = {k: v.clone() for k, v in state.items()}
        trainer.step(*image_batches(1, seed=5)[0])
        trainer.finish()
        _assert_equal_states(state, kept)
    _assert_equal_states(trainer.model_state_dict(), compiled.model.state_dict())  # after close too


def test_untied_copies_fold_back_to_the_first_stage_and_load_into_a_fresh_model():
    compiled = w.tied_pipeline()
    assert compiled.plan.untied == ("emb.weight = out.weight",)
    with _train(compiled, "sequential", w.PIPELINES["tied"][1]()) as trainer:
        state = trainer.model_state_dict()
    model = compiled.model
    _assert_equal_states(state, model.state_dict())
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
    _assert_equal_states(state, compiled.model.state_dict())
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
    with _train(compiled, "sequential", data) as trainer:
        state = trainer.model_state_dict()
    _assert_equal_states(state, compiled.model.state_dict())
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # stage 0's copy under both names
    fresh = gpt2()
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        ours, theirs = fresh.eval()(ids[0]).logits, compiled.model.eval()(ids[0]).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert not torch.equal(ours, gpt2().eval()(ids[0]).logits)  # trained


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
    with _train(compiled, "sequential", image_batches(2)) as trainer:
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
    _assert_equal_states(loaded, ref)
    fresh = Residual()
    fresh.load_state_dict(loaded, strict=True)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left


def test_without_safetensors_a_name_without_suffix_is_written_by_torch_save(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    compiled = compiled_residual()
    path, ref = _saved(compiled, tmp_path, "model")
    assert path == tmp_path / "model.pt"
    _assert_equal_states(torch.load(path, weights_only=True), ref)
    with compiled.trainer(optimizer=sgd) as trainer:
        with pytest.raises(PPLLError, match=r"cannot write '.*model.safetensors': the safetensors package is not "
                                            r"installed \(pip install safetensors\), or save to a .pt path"):
            trainer.save_model(tmp_path / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_tied_names_are_each_written_to_safetensors(tmp_path):
    compiled = w.tied_pipeline()
    with _train(compiled, "sequential", w.PIPELINES["tied"][1]()) as trainer:
        path = trainer.save_model(tmp_path / "tied")
    fresh = w.TiedNet()
    fresh.load_state_dict(safetensors_torch.load_file(str(path)), strict=True)
    _assert_equal_states(fresh.state_dict(), compiled.model.state_dict())


def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    compiled = compiled_residual()
    with _train(compiled, "sequential", image_batches(2)) as trainer:
        path = trainer.save_model(tmp_path / "model.pt")
        first = torch.load(path, weights_only=True)
        trainer.step(*image_batches(1, seed=5)[0])

        def broken(obj, f, *args, **kwargs):
            f.write(b"half a file")
            raise OSError("disk full")

        monkeypatch.setattr(torch, "save", broken)
        with pytest.raises(OSError, match="disk full"):
            trainer.save_model(path)
    _assert_equal_states(torch.load(path, weights_only=True), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


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
        _assert_equal_states(torch.load(tmp_path / f"{name}-state-0.pt", weights_only=True), ref)
        _assert_equal_states(torch.load(tmp_path / f"{name}.pt", weights_only=True), ref)
        loaded = safetensors_torch.load_file(str(tmp_path / f"{name}.safetensors"))
        _assert_equal_states({k: loaded[k] for k in ref}, ref)
        model = fresh[name]()
        model.load_state_dict(loaded, strict=True)
        _assert_equal_states(model.state_dict(), ref)
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
        _assert_equal_states({k: sharded[k] for k in ref}, ref)
        assert sorted(sharded) == sorted(ref)
        # rank 0's gather held one stage's part at most (the largest), never the whole state
        sizes = [p["bytes"] for p in parts]
        stats = ranks[0][name]["stats"]
        assert stats == [{"parts": processes, "total": sum(sizes), "peak": max(sizes)}] * len(stats)
        assert max(sizes) < sum(sizes)
        assert all(r[name]["stats"] == [None] * len(stats) and r[name]["parts"] == [] for r in ranks[1:])
    assert not list(tmp_path.glob("**/.*tmp*"))
