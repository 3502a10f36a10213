"""The trained model's files: a safetensors file streamed stage by stage (the package's own bytes), a sharded save
(one file per stage and the index ``from_pretrained`` reads), the stages handed on one by one, and bad targets."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from ppll_compile.errors import PPLLError
from ppll_compile.runtime.checkpoint.gather import TensorInfo
from ppll_compile.runtime.checkpoint.model_files import SafetensorsFile
from tests.helpers import assert_equal_states_unordered, compiled_residual, image_batches, sgd
from tests.models import Residual

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

INDEX = "model.safetensors.index.json"


def _trained(compiled, runtime: str = "sequential", batches: int = 2):
    trainer = compiled.trainer(optimizer=sgd, runtime=runtime)
    for x, y in image_batches(batches):
        trainer.step(x, y)
    return trainer


def _sharded(folder: Path) -> tuple[dict, dict]:
    index = json.loads((folder / INDEX).read_text())
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded.update(safetensors_torch.load_file(str(folder / file)))
    return loaded, index


def test_a_streamed_safetensors_file_has_the_packages_own_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g),
             "n.count": torch.tensor(3), "m.mask": torch.rand(3, generator=g) > 0.5,
             "h.half": torch.randn(2, 2, generator=g).to(torch.bfloat16), "z.empty": torch.empty(0, 3)}
    file = SafetensorsFile(tmp_path / "m.safetensors",
                           [TensorInfo(key=k, shape=tuple(v.shape), dtype=v.dtype) for k, v in state.items()],
                           {"format": "pt"})
    for key in reversed(list(state)):  # any order of arrival: every tensor goes to its own place
        file.write(key, state[key])
    file.file.commit()
    assert (tmp_path / "m.safetensors").read_bytes() == safetensors_torch.save(state, metadata={"format": "pt"})
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_a_sharded_save_has_one_file_per_stage_and_an_index(tmp_path, runtime):
    compiled = compiled_residual()
    with _trained(compiled, runtime) as trainer:
        folder = trainer.save_model(tmp_path / "out", sharded=True)
        assert trainer.gather_stats.parts == 2
    ref = compiled.model.state_dict()
    assert folder == tmp_path / "out"
    loaded, index = _sharded(folder)
    assert_equal_states_unordered(loaded, ref)
    assert sorted(p.name for p in folder.iterdir()) == sorted([INDEX, "model-00001-of-00002.safetensors",
                                                               "model-00002-of-00002.safetensors"])
    stage0 = {k for k, _ in compiled.stages[0].module.named_parameters()}
    assert {k for k, f in index["weight_map"].items() if f.startswith("model-00001")} >= stage0
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    fresh = Residual()
    fresh.load_state_dict(loaded, strict=True)


def test_the_stages_are_handed_on_one_by_one(tmp_path):
    compiled = compiled_residual()
    parts: list[tuple[int, OrderedDict]] = []
    with _trained(compiled) as trainer:
        stats = trainer.stream_model_state(lambda stage, part: parts.append((stage, part)))
        whole = trainer.model_state_dict()
    ref = compiled.model.state_dict()
    assert [s for s, _ in parts] == [0, 1]
    order = list(ref)
    for _, part in parts:  # each part in the model's order, disjoint, together the whole state
        assert list(part) == sorted(part, key=order.index)
    assert_equal_states_unordered({k: v for _, p in parts for k, v in p.items()}, ref)
    sizes = [sum(t.numel() * t.element_size() for t in p.values()) for _, p in parts]
    assert (stats.parts, stats.total_bytes, stats.peak_bytes) == (2, sum(sizes), max(sizes))
    assert trainer.gather_stats == stats
    assert_equal_states_unordered(whole, ref)


def test_a_failing_take_raises_after_every_stage_was_received():
    compiled = compiled_residual()
    seen = []

    def take(stage, part):
        seen.append(stage)
        raise ValueError("no room")

    with _trained(compiled) as trainer:
        with pytest.raises(ValueError, match="no room"):
            trainer.stream_model_state(take)
        assert trainer.gather_stats.parts == 2  # the gather went on to the end
    assert seen == [0]


@pytest.mark.parametrize("name,what", [("out.safetensors", "a file name"), ("out.pt", "a file name"),
                                       ("file", "an existing file")])
def test_sharded_needs_a_directory(tmp_path, name, what):
    (tmp_path / "file").write_text("x")
    target = tmp_path / name
    with _trained(compiled_residual()) as trainer:
        with pytest.raises(PPLLError) as info:
            trainer.save_model(target, sharded=True)
    assert str(info.value) == (
        f"save_model({str(target)!r}, sharded=True) writes a directory (one safetensors file per stage and {INDEX}), "
        f"but {str(target)!r} is {what}; pass a directory path, or sharded=False to write one file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_sharded_refuses_a_directory_holding_a_single_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"old")
    with _trained(compiled_residual()) as trainer:
        with pytest.raises(PPLLError) as info:
            trainer.save_model(tmp_path, sharded=True)
    assert str(info.value) == (
        f"{str(tmp_path)!r} already holds model.safetensors, which from_pretrained reads instead of a sharded save's "
        f"{INDEX}; remove it, or save the shards into another directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_sharded_save_replaces_the_previous_one_and_keeps_other_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"stale")
    (tmp_path / INDEX).write_text("{}")
    compiled = compiled_residual()
    with _trained(compiled) as trainer:
        trainer.save_model(tmp_path, sharded=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", INDEX,
                                                                 "model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"])
    assert (tmp_path / "config.json").read_text() == "{}"
    assert_equal_states_unordered(_sharded(tmp_path)[0], compiled.model.state_dict())


def test_a_sharded_save_that_fails_midway_leaves_the_previous_save(tmp_path, monkeypatch):
    compiled = compiled_residual()
    with _trained(compiled) as trainer:
        trainer.save_model(tmp_path, sharded=True)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        trainer.step(*image_batches(1, seed=5)[0])

        def broken(self, key, tensor):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(SafetensorsFile, "write", broken)
        with pytest.raises(OSError, match="No space left on device"):
            trainer.save_model(tmp_path, sharded=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_tensor_no_stage_trains_still_on_meta_is_refused_by_name(tmp_path):
    compiled = compiled_residual()
    compiled.model.register_buffer("lost", torch.empty(3, device="meta"))  # no stage trains it
    with _trained(compiled) as trainer:
        for call in (trainer.model_state_dict, lambda: trainer.save_model(tmp_path / "out", sharded=True)):
            with pytest.raises(PPLLError) as info:
                call()
            assert str(info.value) == (
                "the model's state holds 1 tensor(s) that no stage trains and that are still on the meta device "
                "(lost); give them values in the model before compiling it, or leave them out of the model")
    assert list(tmp_path.iterdir()) == []
