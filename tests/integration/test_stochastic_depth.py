"""Modules that compute differently in train and eval mode under torch.export: a drop-path is kept whole, so such
models compile with the defaults, give their own eval output and train alike under threads; per-layer dropouts of one
shared tensor line up across the two modes."""

import pytest
import torch

from benchmarks.zoo import Entry, batches, build, call, changed, compile_entry, logits, train, train_sizes

transformers = pytest.importorskip("transformers")


def _swin(drop: bool) -> torch.nn.Module:
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 2],
                                     window_size=4, num_labels=3, drop_path_rate=0.5,
                                     hidden_dropout_prob=0.1 if drop else 0.0)
    return transformers.SwinForImageClassification(config)


def _pixels(n: int, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g)}, torch.randint(0, 3, (n,), generator=g)


SWIN = Entry(name="hf-swin-drop-path", library="transformers", make=_swin, batch=_pixels)


@pytest.mark.slow  # captures a real model with torch.export
def test_swin_with_drop_path_compiles_with_the_defaults_and_gives_its_eval_output():
    model = build(SWIN)
    x = batches(SWIN, [8])[0][0]
    compiled = compile_entry(SWIN, model, 2, x)
    notes = " ".join(compiled.plan.notes)
    assert "captured with torch.export" in notes and "kept whole" in notes and "drop_path" in notes, notes
    assert compiled.plan.num_stages == 2
    compiled.eval()
    with torch.no_grad():
        expected, got = call(model, x), call(compiled, x)
    torch.testing.assert_close(logits(got), logits(expected), rtol=1e-5, atol=1e-6)
    # in train mode the drop-path draws: two calls differ, as the model's own do
    compiled.train()
    with torch.no_grad():
        assert not torch.equal(logits(call(compiled, x)), logits(call(compiled, x)))


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread_quietly")  # one thread per stage in both runtimes: the same reduction order
def test_swin_with_drop_path_trains_under_threads_as_under_sequential():
    model = build(SWIN, drop=True)
    data = batches(SWIN, train_sizes())
    ref = train(SWIN, model, 2, "sequential", data)
    ours = train(SWIN, model, 2, "threads", data)
    assert len(ours.parameters) == len(ref.parameters)
    for i, (p, q) in enumerate(zip(ours.parameters, ref.parameters)):
        assert torch.equal(p, q), f"parameter {i} differs by {float((p - q).abs().max())}"
    assert any(ref.draws_random) and ours.draws_random == ref.draws_random
    assert changed(ref.model, model) > 0 and changed(ours.model, model) == changed(ref.model, model)


def _deberta(drop: bool) -> torch.nn.Module:
    config = transformers.DebertaV2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=100, relative_attention=True,
                                          position_buckets=16, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                                          position_biased_input=False, norm_rel_ebd="layer_norm", num_labels=3)
    return transformers.DebertaV2ForSequenceClassification(config)


def _tokens(n: int, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    return {"input_ids": torch.randint(0, 100, (n, 16), generator=g)}, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.slow  # captures a real model with torch.export
def test_deberta_whose_layers_each_drop_out_the_shared_relative_embeddings_compiles_and_gives_its_eval_output():
    # in eval mode torch.export records the layers' pos_dropout calls on the one relative-embedding tensor as a chain
    # (each hands back the tensor it was given); in train mode each reads the embeddings
    entry = Entry(name="hf-deberta-v2", library="transformers", make=_deberta, batch=_tokens)
    model = build(entry)
    x = batches(entry, [4])[0][0]
    compiled = compile_entry(entry, model, 2, x)
    assert compiled.plan.num_stages == 2
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(call(compiled, x)), logits(call(model, x)), rtol=1e-5, atol=1e-6)
