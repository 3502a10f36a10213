"""Encoder-decoder models (Hugging Face T5 and BART, small random-weight configs, labels given as a model input):
cuts inside the encoder and inside the decoder, the encoder's output travelling beside the decoder's hidden state,
eval equal to the model, threads training as sequential, and the local losses falling."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ppll_compile

transformers = pytest.importorskip("transformers")

SOURCE, TARGET, BATCH, VOCAB = 8, 6, 4, 32


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> torch.nn.Module:
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.1, pad_token_id=1,
                                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(config)


MODELS = {"t5": _t5, "bart": _bart}


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (BATCH, SOURCE), generator=g),
            "labels": torch.randint(3, VOCAB, (BATCH, TARGET), generator=g)}


def _compile(model: torch.nn.Module, stages: int) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(1)  # the heads' weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA device; the tied embedding untied
        return ppll_compile.compile(model, gpus=stages, example_kwargs=_batch(0), tied="untie")


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


@pytest.mark.slow  # captures with torch.export (several seconds a model)
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_equals_the_model_with_cuts_inside_the_encoder_and_the_decoder(name, one_thread_quietly):
    model = _build(name)
    compiled = _compile(model, 4)
    ends = [s.last_module or s.last_node for s in compiled.plan.stages[:-1]]
    inside = [e.split(".layers.")[0].split(".block.")[0].split(".")[-1] for e in ends
              if ".layers." in e or ".block." in e]
    assert "encoder" in inside and "decoder" in inside, ends
    # a decoder stage sends the encoder's output beside its own hidden state (and the target tokens)
    decoder_stage = next(i for i, e in enumerate(ends) if "decoder" in e)
    assert len(compiled.plan.stages[decoder_stage].boundary) >= 3, compiled.plan.stages[decoder_stage].boundary
    compiled.eval()
    x = _batch(5)
    with torch.no_grad():
        expected, got = model(**x), compiled(**x)
    assert type(got) is type(expected)
    assert float((got.logits - expected.logits).abs().max()) <= 1e-6
    assert float((got.loss - expected.loss).abs()) <= 1e-6


def _train(name: str, runtime: str, steps: int = 3) -> tuple[list[torch.Tensor], list[list[float]]]:
    compiled = _compile(copy.deepcopy(_build(name)), 4)
    options = {"threads_per_stage": 1} if runtime == "threads" else {}
    losses: list[list[float]] = [[] for _ in range(4)]
    with compiled.trainer(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), runtime=runtime, seed=0,
                          **options) as trainer:
        for step in range(steps):
            x = _batch(step % 2)  # two batches in turn: random targets are learnt by heart
            for stage, done in enumerate(trainer.step(x, x["labels"])):
                losses[stage] += done
        for stage, done in enumerate(trainer.finish()):
            losses[stage] += done
    params = [p.detach().clone() for i in range(4) for p in compiled.stage_parameters(i)]
    params += [p.detach().clone() for h in compiled.heads if h is not None for p in h.parameters()]
    return params, losses


@pytest.mark.slow  # trains two pipelines
@pytest.mark.parametrize("name", list(MODELS))
def test_threads_train_as_sequential_and_every_stage_loss_falls(name, one_thread_quietly):
    ref, ref_losses = _train(name, "sequential", steps=6)
    ours, our_losses = _train(name, "threads", steps=6)
    assert len(ours) == len(ref) and all(torch.equal(p, q) for p, q in zip(ours, ref))
    assert our_losses == ref_losses
    for stage, ls in enumerate(ref_losses):
        assert len(ls) == 6 and ls[4] + ls[5] < ls[0] + ls[1], (stage, ls)


# ---- sequence classification: pooling at the last end-of-sequence token -------------------------------------------

def _classifier(name: str) -> tuple[torch.nn.Module, int]:
    """A 3-class classifier and its end-of-sequence token id."""
    torch.manual_seed(0)
    config = (_t5 if name == "t5" else _bart)().config
    config.num_labels = 3
    cls = transformers.T5ForSequenceClassification if name == "t5" else transformers.BartForSequenceClassification
    return cls(config), config.eos_token_id


def _sentences(seed: int, eos: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SOURCE), generator=torch.Generator().manual_seed(seed))
    ids[:, -1] = eos  # one end-of-sequence token a row, last
    return {"input_ids": ids}


@pytest.mark.slow  # captures with torch.export and trains two pipelines
@pytest.mark.parametrize("name", list(MODELS))
def test_a_sequence_classifier_equals_the_model_and_trains_the_same_under_threads(name, one_thread_quietly):
    model, eos = _classifier(name)
    results = []
    for runtime in ("sequential", "threads"):
        copied = copy.deepcopy(model)
        torch.manual_seed(1)
        compiled = ppll_compile.compile(copied, gpus=2, example_kwargs=_sentences(0, eos), tied="untie")
        compiled.eval()
        model.eval()
        with torch.no_grad():
            x = _sentences(7, eos)
            assert float((compiled(**x).logits - model(**x).logits).abs().max()) <= 1e-6
        options = {"threads_per_stage": 1} if runtime == "threads" else {}
        with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), runtime=runtime, seed=0,
                              **options) as trainer:
            for step in range(3):
                trainer.step(_sentences(step, eos), torch.tensor([0, 1, 2, 1]))
        results.append([p.detach().clone() for i in range(2) for p in compiled.stage_parameters(i)])
    assert len(results[0]) == len(results[1]) and all(torch.equal(p, q) for p, q in zip(*results))
    assert any(not torch.equal(p, q) for p, q in zip(results[0], model.parameters()))
    # the model's check that every example holds as many end-of-sequence tokens stays
    uneven = _sentences(3, eos)
    uneven["input_ids"][0, 2] = eos
    with pytest.raises((RuntimeError, ValueError), match="same number of <eos> tokens"):
        with torch.no_grad():
            compiled(**uneven)


@pytest.mark.slow  # captures with torch.export
def test_bart_given_decoder_input_ids_is_cut_after_every_encoder_layer(one_thread_quietly):
    # the decoder's input is then a graph input that crosses every encoder cut beside the encoder's mask; the
    # decoder's cuts, found with the encoder's output as a side value, are what shows the encoder is a stream
    torch.manual_seed(0)
    config = _bart().config
    config.encoder_layers = config.decoder_layers = 3
    model = transformers.BartForConditionalGeneration(config)
    x = _batch(0)
    ids = {"input_ids": x["input_ids"], "decoder_input_ids": x["labels"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(model, gpus=3, example_kwargs=ids, tied="untie",
                                        split_points=["model.encoder.layers.0", "model.decoder.layers.0"])
    from ppll_compile.analysis.cuts import legal_cuts
    from ppll_compile.capture.frontends import capture
    from ppll_compile.capture.trace import module_path
    from ppll_compile.cost.nodes import measure_graph
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, (), ids)
    measure_graph(captured.gm, captured.inputs)
    ends = {}  # the last node of each encoder layer
    for n in captured.gm.graph.nodes:
        if module_path(n).startswith("model.encoder.layers."):
            ends[".".join(module_path(n).split(".")[:4])] = n.name
    assert len(ends) == 3 and set(ends.values()) <= {c.node for c in legal_cuts(captured.gm)}, ends
    modules = [s.last_module for s in compiled.plan.stages[:-1]]
    assert modules[0].startswith("model.encoder.layers.0") and modules[1].startswith("model.decoder.layers.0"), modules
    compiled.eval()
    y = {"input_ids": _batch(5)["input_ids"], "decoder_input_ids": _batch(5)["labels"]}
    with torch.no_grad():
        expected, got = model(**y), compiled(**y)
    assert float((got.logits - expected.logits).abs().max()) <= 1e-6
