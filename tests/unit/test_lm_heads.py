"""Tests of per-token heads through the model's own final norm and output projection (type ``lm_output``): options,
the frozen and shared copies, their costs against a fresh ``lm`` head, the pipelined equality, and a model without
a projection."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import ppll_compile
from ppll_compile.errors import PolicyError
from ppll_compile.heads.build import head_spec
from ppll_compile.heads.output import NoOutputProjection, ProjectionHead
from ppll_compile.heads.policy import validate_policy
from ppll_compile.heads.types import head_type
from ppll_compile.plans.plan import TensorSpec
from tests.helpers import assert_same_parameters, quiet

V, D, LAYERS = 128, 32, 4      # the tiny Llama's vocabulary, hidden size and decoder layers
N, L = 2, 16                   # a batch of token ids
CUTS = ["model.layers.1", "model.layers.2"]  # three stages, two heads


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def batches(n: int) -> list[tuple[dict, torch.Tensor]]:
    """``n`` batches of token ids and their next-token labels (the last position ignored)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (N, L), generator=g)
        out.append(({"input_ids": ids}, torch.cat([ids[:, 1:], torch.full((N, 1), -100)], 1)))
    return out


def policy(**options) -> object:
    return validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm_output", **options}},
                           "inline")


def compiled(**options) -> object:
    with quiet():
        return ppll_compile.compile(llama(), example_kwargs=batches(1)[0][0], split_points=CUTS,
                                    policy=policy(**options))


def train(c, runtime: str, data) -> None:
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime=runtime) as trainer:
        for x, y in data:
            trainer.step(x, y)
        trainer.finish()


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(PolicyError) as e:
        fn(*args, **kwargs)
    return str(e.value)


# ---- options --------------------------------------------------------------------------------------------------

def test_the_options_validate_and_bad_values_are_named():
    assert policy().per_token == {"type": "lm_output", "projection": "frozen", "adapter": "linear"}
    assert policy(projection="shared", adapter="linear").per_token == {"type": "lm_output", "projection": "shared",
                                                                       "adapter": "linear"}
    assert error(policy, projection="fresh") == ("inline: per_token.projection must be one of frozen, shared, got "
                                                 "'fresh'")
    assert error(policy, adapter="mlp") == "inline: per_token.adapter must be one of none, linear, norm, got 'mlp'"
    assert error(policy, rank=64) == "inline: unknown key 'rank' at per_token (allowed: adapter, projection, type)"
    assert error(validate_policy, {"heads": {"sequence": {"type": "lm_output"}}}, "p.yaml") == (
        "p.yaml: heads.sequence.type 'lm_output' gives per-token scores (N x L x C), but heads.sequence serves labels "
        "of one class per example (N); use type mlp or momentum or token or transformer (a per-token head goes under "
        "per_token:)")


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
        assert torch.equal(adapter.weight, torch.eye(D)) and torch.equal(adapter.bias, torch.zeros(D))
        h = torch.randn(N, L, D)
        with torch.no_grad():
            assert torch.equal(head(h), model.lm_head(model.model.norm(adapter(h))))
    assert heads[0].frozen_tensors()[1] is not heads[1].frozen_tensors()[1]  # a copy per stage
    before = [frozen_state(h) for h in heads]
    projection = model.lm_head.weight.detach().clone()
    train(c, "sequential", batches(3))
    for head, kept in zip(heads, before):
        assert all(torch.equal(a, b) for a, b in zip(head.frozen_tensors(), kept, strict=True))
        assert not torch.equal(head.net[0].weight, torch.eye(D))  # the adapter trained
    assert not torch.equal(model.lm_head.weight, projection)  # the last stage trains the model's own


def test_shared_heads_on_one_device_hold_one_copy_of_the_compiled_weights():
    c = compiled(projection="shared", adapter="none")
    first, second = c.heads[:-1]
    assert list(first.parameters()) == [] and first.frozen_names == ["net.0.0.weight", "net.0.1.weight"]
    assert all(a is b for a, b in zip(first.frozen_tensors(), second.frozen_tensors(), strict=True))
    assert first.frozen_tensors()[1] is not c.model.lm_head.weight
    kept = frozen_state(first)
    train(c, "sequential", batches(2))
    assert all(torch.equal(a, b) for a, b in zip(first.frozen_tensors(), kept, strict=True))
    assert not torch.equal(c.model.lm_head.weight, kept[1])


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"projection": "frozen", "adapter": "linear"},
                                     {"projection": "shared", "adapter": "norm"}])
def test_threads_train_the_same_parameters_as_sequential(options, one_thread_quietly):
    data = batches(4)
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
        return ppll_compile.plan(llama(), example_kwargs=batches(1)[0][0], split_points=CUTS, policy=policy_,
                                 optimizer=optimizer)


@pytest.mark.slow
def test_the_plan_keeps_no_gradient_or_optimizer_state_of_the_projection():
    fresh = 2 * D + D * 64 + 64 * V + V  # the lm policy's head: LayerNorm(D), Linear(D, 64, no bias), Linear(64, V)
    adapter = D * D + D                  # the frozen head trains its Linear(D, D) adapter only
    frozen = {o: _plan(policy(projection="frozen", adapter="linear"), o) for o in ("sgd", "adam")}
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
    return TensorSpec(name="h", shape=(n, L, D), dtype="float32", bytes=4 * n * L * D)


def test_the_projection_is_measured_like_a_fresh_one_without_its_weight_gradient():
    model = llama()
    frozen, twice = (head_spec(policy(adapter="none"), None, spec(n), V, None, "sgd", per_token=True,
                               blocks=[model.model.norm, model.lm_head]) for n in (N, 2 * N))
    # what a head saves for backward grows with the batch but for the 4-byte total weight of the loss; its weights
    # do not: the frozen copy of the norm and the projection, once; a fresh head's weights and their gradients
    assert 2 * frozen.memory_bytes - twice.memory_bytes == 4 * (D + D * V) + 4
    lm = validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm", "rank": 0}}, "inline")
    full, full_twice = (head_spec(lm, None, spec(n), V, None, "sgd", per_token=True) for n in (N, 2 * N))
    assert 2 * full.memory_bytes - full_twice.memory_bytes == 8 * (2 * D + D * V + V) + 4
    matmul = 2 * N * L * D * V
    assert (frozen.flops_fwd, frozen.flops_bwd) == (matmul, matmul)  # the input's gradient only
    assert (full.flops_fwd, full.flops_bwd) == (matmul, 2 * matmul)  # and the weight's


# ---- a model without an output projection ----------------------------------------------------------------------

class TiedOutput(nn.Module):
    """A language model whose scores are the hidden states times the embedding matrix: no output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(3)])
        self.norm = nn.LayerNorm(D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.layers(self.embed(ids))), self.embed.weight)


def test_a_model_without_an_output_projection_is_named_with_what_was_looked_for():
    ids = batches(1)[0][0]["input_ids"]
    with pytest.raises(NoOutputProjection) as e, quiet():
        ppll_compile.plan(TiedOutput(), 2, example_inputs=(ids,), policy=policy(), tied="untie")
    assert str(e.value) == (
        "head type 'lm_output' reads the model's own output projection, but TiedOutput has none: looked for an "
        "nn.Linear as the last module its graph calls before the output (as Llama's or GPT-2's lm_head), found "
        "'norm' (LayerNorm); use type lm, a fresh projection")
    assert isinstance(e.value, PolicyError) and head_type("lm_output").per_token
