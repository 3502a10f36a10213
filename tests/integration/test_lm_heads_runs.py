"""Tests of per-token heads through the model's own final norm and output projection (type ``lm_output``): options,
the frozen and shared copies, their costs against a fresh ``lm`` head, the pipelined equality, and a model without
a projection."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import ppll_compile
from ppll_compile.heads.build import head_spec
from ppll_compile.heads.output import ProjectionHead
from ppll_compile.heads.policy import validate_policy
from ppll_compile.plans.plan import TensorSpec
from tests.helpers import (
    LM_DIM,
    LM_LAYERS,
    LM_LEN,
    LM_N,
    LM_VOCAB,
    assert_same_parameters,
    lm_output_policy,
    quiet,
    token_batches,
)

CUTS = ["model.layers.1", "model.layers.2"]  # three stages, two heads


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=LM_VOCAB, hidden_size=LM_DIM, num_hidden_layers=LM_LAYERS, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def compiled(**options) -> object:
    with quiet():
        return ppll_compile.compile(llama(), example_kwargs=token_batches(1)[0][0], split_points=CUTS,
                                    policy=lm_output_policy(**options))


def train(c, runtime: str, data) -> None:
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime=runtime) as trainer:
        for x, y in data:
            trainer.step(x, y)
        trainer.finish()


# ---- the frozen and the shared copy ---------------------------------------------------------------------------

def frozen_state(head: ProjectionHead) -> list[torch.Tensor]:
    return [t.detach().clone() for t in head.frozen_tensors()]


def test_a_frozen_head_is_the_models_norm_and_projection_unchanged_by_training_while_its_adapter_trains():
    c = compiled(projection="frozen", adapter="linear")
    model, heads = c.model, c.heads[:-1]
    assert [type(h).__name__ for h in c.heads] == ["ProjectionHead", "ProjectionHead", "NoneType"]
    for head in heads:
        adapter, (norm, proj) = head.net
        assert torch.equal(proj.weight, model.lm_head.weight) and proj.weight is not model.lm_head.weight
        assert torch.equal(norm.weight, model.model.norm.weight) and norm.weight is not model.model.norm.weight
        assert [n for n, _ in head.named_parameters()] == ["net.0.weight", "net.0.bias"]  # the adapter only
        assert torch.equal(adapter.weight, torch.eye(LM_DIM)) and torch.equal(adapter.bias, torch.zeros(LM_DIM))
        h = torch.randn(LM_N, LM_LEN, LM_DIM)
        with torch.no_grad():
            assert torch.equal(head(h), model.lm_head(model.model.norm(adapter(h))))
    assert heads[0].frozen_tensors()[1] is not heads[1].frozen_tensors()[1]  # a copy per stage
    before = [frozen_state(h) for h in heads]
    projection = model.lm_head.weight.detach().clone()
    train(c, "sequential", token_batches(3))
    for head, kept in zip(heads, before):
        assert all(torch.equal(a, b) for a, b in zip(head.frozen_tensors(), kept, strict=True))
        assert not torch.equal(head.net[0].weight, torch.eye(LM_DIM))  # the adapter trained
    assert not torch.equal(model.lm_head.weight, projection)  # the last stage trains the model's own


def test_shared_heads_on_one_device_hold_one_copy_of_the_compiled_weights():
    c = compiled(projection="shared", adapter="none")
    first, second = c.heads[:-1]
    assert list(first.parameters()) == [] and first.frozen_names == ["net.0.0.weight", "net.0.1.weight"]
    assert all(a is b for a, b in zip(first.frozen_tensors(), second.frozen_tensors(), strict=True))
    assert first.frozen_tensors()[1] is not c.model.lm_head.weight
    kept = frozen_state(first)
    train(c, "sequential", token_batches(2))
    assert all(torch.equal(a, b) for a, b in zip(first.frozen_tensors(), kept, strict=True))
    assert not torch.equal(c.model.lm_head.weight, kept[1])


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"projection": "frozen", "adapter": "linear"},
                                     {"projection": "shared", "adapter": "norm"}])
def test_threads_train_the_same_parameters_as_sequential(options, one_thread_quietly):
    data = token_batches(4)
    a, b = compiled(**options), compiled(**options)
    train(a, "sequential", data)
    train(b, "threads", data)
    assert_same_parameters(a, b)
    for x, y in zip(a.heads[:-1], b.heads[:-1]):
        assert all(torch.equal(s, t) for s, t in zip(x.frozen_tensors(), y.frozen_tensors(), strict=True))
        assert all(torch.equal(p, q) for p, q in zip(x.parameters(), y.parameters(), strict=True))


# ---- costs ----------------------------------------------------------------------------------------------------

def _plan(policy_, optimizer: str):
    with quiet():
        return ppll_compile.plan(llama(), example_kwargs=token_batches(1)[0][0], split_points=CUTS, policy=policy_,
                                 optimizer=optimizer)


@pytest.mark.slow
def test_the_plan_keeps_no_gradient_or_optimizer_state_of_the_projection():
    fresh = 2 * LM_DIM + LM_DIM * 64 + 64 * LM_VOCAB + LM_VOCAB  # the lm policy's head: LayerNorm(D), Linear(D, 64, no bias), Linear(64, V)
    adapter = LM_DIM * LM_DIM + LM_DIM                  # the frozen head trains its Linear(D, D) adapter only
    frozen = {o: _plan(lm_output_policy(projection="frozen", adapter="linear"), o) for o in ("sgd", "adam")}
    lm = {o: _plan("lm", o) for o in ("sgd", "adam")}
    for s_lm, s_frozen in zip(lm["adam"].stages[:-1], frozen["adam"].stages[:-1], strict=True):
        assert (s_lm.head.param_count, s_frozen.head.param_count) == (fresh, adapter)
        assert s_lm.param_count == s_frozen.param_count  # the same backbone
    # Adam keeps two states per trained float32 parameter that SGD does not: 8 bytes each, none for the projection
    for i in range(2):
        grown = {k: p["adam"].stages[i].memory_bytes - p["sgd"].stages[i].memory_bytes
                 for k, p in (("lm", lm), ("frozen", frozen))}
        assert grown["lm"] - grown["frozen"] == 8 * (fresh - adapter)
        assert frozen["adam"].stages[i].head.memory_bytes - frozen["sgd"].stages[i].head.memory_bytes == 8 * adapter


def spec(n: int) -> TensorSpec:
    return TensorSpec(name="h", shape=(n, LM_LEN, LM_DIM), dtype="float32", bytes=4 * n * LM_LEN * LM_DIM)


def test_the_projection_is_measured_like_a_fresh_one_without_its_weight_gradient():
    model = llama()
    frozen, twice = (head_spec(lm_output_policy(adapter="none"), None, spec(n), LM_VOCAB, None, "sgd", per_token=True,
                               blocks=[model.model.norm, model.lm_head]) for n in (LM_N, 2 * LM_N))
    # what a head saves for backward grows with the batch but for the 4-byte total weight of the loss; its weights
    # do not: the frozen copy of the norm and the projection, once; a fresh head's weights and their gradients
    assert 2 * frozen.memory_bytes - twice.memory_bytes == 4 * (LM_DIM + LM_DIM * LM_VOCAB) + 4
    lm = validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm", "rank": 0}}, "inline")
    full, full_twice = (head_spec(lm, None, spec(n), LM_VOCAB, None, "sgd", per_token=True) for n in (LM_N, 2 * LM_N))
    assert 2 * full.memory_bytes - full_twice.memory_bytes == 8 * (2 * LM_DIM + LM_DIM * LM_VOCAB + LM_VOCAB) + 4
    matmul = 2 * LM_N * LM_LEN * LM_DIM * LM_VOCAB
    assert (frozen.flops_fwd, frozen.flops_bwd) == (matmul, matmul)  # the input's gradient only
    assert (full.flops_fwd, full.flops_bwd) == (matmul, 2 * matmul)  # and the weight's
