"""Models built on the meta device: planned without their weights, materialised per stage, refused while on meta."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import meta_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import assert_same_plan_but_meta_note, free_port, built_on_meta, quiet  # noqa: E402
from ppll_compile.capture.meta import PLANNED_ON_META  # noqa: E402
from tests.models import Residual  # noqa: E402

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _llama_config(**sizes: int) -> object:
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=128) | sizes
    return transformers.LlamaConfig(**shape)


def _llama(meta: bool, **sizes: int) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return transformers.LlamaForCausalLM(_llama_config(**sizes))


X = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_a_meta_llama_plans_as_the_llama_built_normally():
    with quiet():
        normal = ppll_compile.plan(_llama(False), gpus=2, example_kwargs={"input_ids": IDS})
        meta = ppll_compile.plan(_llama(True), gpus=2, example_kwargs={"input_ids": IDS})
    assert_same_plan_but_meta_note(normal, meta)
    assert meta.tracer == "export"


@pytest.mark.slow
def test_planning_a_meta_model_never_allocates_it(tmp_path):
    # 8 layers of hidden 2048 and a 32,000-token vocabulary: 2.1 GiB of float32 weights when built normally; planned
    # for a preset, so that nothing is timed here (timing an operator allocates its arguments, up to
    # roofline.TIMING_BUDGET). The peak is VmHWM, this process's own: ru_maxrss keeps the parent's peak across exec
    script = (
        "import torch, transformers, warnings, ppll_compile; warnings.simplefilter('ignore')\n"
        "c = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, "
        "num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)\n"
        "with torch.device('meta'): m = transformers.LlamaForCausalLM(c)\n"
        "size = sum(p.numel() * p.element_size() for p in m.parameters())\n"
        "p = ppll_compile.plan(m, gpus=4, example_kwargs={'input_ids': torch.zeros(2, 64, dtype=torch.long)}, "
        "hardware='h100')\n"
        "peak = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024\n"
        "print(size, peak, p.num_stages, all(t.is_meta for t in m.parameters()))\n")
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    size, peak, stages, meta = out.stdout.split()
    assert int(size) > 2 * 2**30
    assert int(peak) < 2**30, f"planning peaked at {int(peak) / 2**20:.0f} MiB"
    assert (stages, meta) == ("4", "True")


def test_a_hugging_face_model_materialises_from_a_state_dict_per_stage(one_thread_quietly):
    normal = _llama(False)
    weights = normal.state_dict()
    asked: dict[int, list[str]] = {}

    def load(index: int, names: list[str]) -> dict[str, torch.Tensor]:
        asked[index] = names
        return {k: weights[k] for k in names if k in weights}

    compiled = ppll_compile.compile(_llama(True), gpus=2, example_kwargs={"input_ids": IDS}, state_dict=load)
    assert sorted(n for names in asked.values() for n in names) == sorted([*weights, "model.rotary_emb.inv_freq"])
    assert all(n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.", "model.rotary_emb"))
               for n in asked[0])
    torch.testing.assert_close(compiled.eval()(input_ids=IDS).logits, normal.eval()(input_ids=IDS).logits,
                               rtol=0, atol=0)


def test_a_hugging_face_model_initialises_itself_by_default(one_thread_quietly):
    normal, model = _llama(False), _llama(True)
    compiled = ppll_compile.compile(model, gpus=2, example_kwargs={"input_ids": IDS})
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, normal.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert 0.015 < float(model.lm_head.weight.std()) < 0.025  # initializer_range 0.02
    assert compiled.eval()(input_ids=IDS).logits.isfinite().all()


def _tied_gpt2(meta: bool) -> nn.Module:
    """A 2-layer GPT-2, whose output projection is tied to its token embedding (untied at 2 stages)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=4, use_cache=False)
    with torch.device("meta") if meta else torch.device("cpu"):
        return transformers.GPT2LMHeadModel(config)


def _copies(compiled: ppll_compile.CompiledPipeline) -> list[torch.Tensor]:
    """Every stage's tensor under the tied name ``lm_head.weight`` (the model's, or a stage's own copy)."""
    return [dict(s.module.named_parameters())["lm_head.weight"] for s in compiled.stages]


def test_an_untied_copy_of_a_meta_model_starts_equal_to_the_models_tensor_in_every_process(one_thread_quietly):
    compiled = ppll_compile.compile(_tied_gpt2(True), gpus=2, example_kwargs={"input_ids": IDS})
    assert compiled.plan.untied == ("lm_head.weight = transformer.wte.weight",)
    first, copy = _copies(compiled)
    assert first is not copy and torch.equal(first, copy)
    assert 0.015 < float(copy.std()) < 0.025  # initializer_range 0.02, not the memory empty_like left
    alone = ppll_compile.compile(_tied_gpt2(True), gpus=2, example_kwargs={"input_ids": IDS}, local_stages=[1])
    assert _copies(alone)[0].is_meta and torch.equal(_copies(alone)[1], copy)  # as rank 1 of torchrun builds it


def test_an_untied_copy_of_a_meta_model_loads_from_the_state_dict_under_the_name_its_stage_reads(
        one_thread_quietly):
    weights = _tied_gpt2(False).state_dict()
    compiled = ppll_compile.compile(_tied_gpt2(True), gpus=2, example_kwargs={"input_ids": IDS},
                                    state_dict=weights)
    assert all(torch.equal(t, weights["lm_head.weight"]) for t in _copies(compiled))


# ---- distributed: each rank materialises its own stage only ----------------------------------------------------

@pytest.mark.slow
def test_each_rank_materialises_its_stage_only_and_trains_as_sequential(tmp_path, one_thread_quietly):
    timeout = 120
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(HERE / "meta_worker.py"), "2", str(free_port()), str(timeout - 15), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"codes"')]
    assert lines and json.loads(lines[-1])["codes"] == [0, 0], proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = w.train_program(w.residual_pipeline(meta=False), "sequential")
    full = {i: sorted(reference[i]) for i in reference}
    for rank in (0, 1):
        record = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        other = 1 - rank
        assert record["meta"][rank] == []
        assert sorted(record["meta"][other]) == full[other]
        assert record["notes"][-1] == (f"the model was built on the meta device: stage(s) {rank} (this rank's; the "
                                       f"others stay on meta) allocated on its own device and filled by the "
                                       f"materialize= hook fill")
        assert list(record["states"]) == [rank]
        for name, value in reference[rank].items():
            torch.testing.assert_close(record["states"][rank][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("meta_inputs", [False, True])
def test_a_meta_model_plans_as_the_model_built_normally(tracer, meta_inputs):
    with quiet():
        normal = ppll_compile.plan(Residual(), gpus=2, example_inputs=(X,), tracer=tracer)
        model = built_on_meta(Residual)
        meta = ppll_compile.plan(model, gpus=2, example_inputs=(X.to("meta") if meta_inputs else X,), tracer=tracer)
    assert_same_plan_but_meta_note(normal, meta)
    assert meta.tracer == tracer
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_hook_materialises_the_normally_built_model_and_it_trains_the_same(tracer, one_thread_quietly):
    normal = w.residual_pipeline(meta=False, tracer=tracer)
    meta = w.residual_pipeline(meta=True, tracer=tracer)
    torch.testing.assert_close(meta.eval()(X), normal.eval()(X), rtol=0, atol=0)
    assert meta.plan.notes[-2:] == (PLANNED_ON_META, "the model was built on the meta device: every stage allocated "
                                    "on its own device and filled by the materialize= hook fill")
    assert w.meta_tensors(meta) == {0: [], 1: []}
    reference = w.train_program(normal, "sequential")
    for runtime in ("sequential", "threads"):
        ours = w.train_program(w.residual_pipeline(meta=True, tracer=tracer), runtime)
        assert ours.keys() == reference.keys()
        for i in reference:
            assert ours[i].keys() == reference[i].keys()
            for name, value in reference[i].items():
                torch.testing.assert_close(ours[i][name], value, rtol=0, atol=0, msg=f"{runtime} {i} {name}")
