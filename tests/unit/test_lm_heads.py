"""Tests of per-token heads through the model's own final norm and output projection (type ``lm_output``): options,
the frozen and shared copies, their costs against a fresh ``lm`` head, the pipelined equality, and a model without
a projection."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ppll_compile
from ppll_compile.errors import PolicyError
from ppll_compile.heads.output import NoOutputProjection
from ppll_compile.heads.policy import validate_policy
from ppll_compile.heads.types import head_type
from tests.helpers import LM_DIM, LM_VOCAB, lm_output_policy, quiet, token_batches


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(PolicyError) as e:
        fn(*args, **kwargs)
    return str(e.value)


# ---- options --------------------------------------------------------------------------------------------------

def test_the_options_validate_and_bad_values_are_named():
    assert lm_output_policy().per_token == {"type": "lm_output", "projection": "frozen", "adapter": "linear"}
    assert lm_output_policy(projection="shared", adapter="linear").per_token == {
        "type": "lm_output", "projection": "shared", "adapter": "linear"}
    assert error(lm_output_policy, projection="fresh") == (
        "inline: per_token.projection must be one of frozen, shared, got 'fresh'")
    assert error(lm_output_policy, adapter="mlp") == (
        "inline: per_token.adapter must be one of none, linear, norm, got 'mlp'")
    assert error(lm_output_policy, rank=64) == (
        "inline: unknown key 'rank' at per_token (allowed: adapter, projection, type)")
    assert error(validate_policy, {"heads": {"sequence": {"type": "lm_output"}}}, "p.yaml") == (
        "p.yaml: heads.sequence.type 'lm_output' gives per-token scores (N x L x C), but heads.sequence serves labels "
        "of one class per example (N); use type mlp or momentum or token or transformer (a per-token head goes under "
        "per_token:)")


# ---- a model without an output projection ----------------------------------------------------------------------

class TiedOutput(nn.Module):
    """A language model whose scores are the hidden states times the embedding matrix: no output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, LM_DIM)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(LM_DIM, LM_DIM), nn.GELU()) for _ in range(3)])
        self.norm = nn.LayerNorm(LM_DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.layers(self.embed(ids))), self.embed.weight)


def test_a_model_without_an_output_projection_is_named_with_what_was_looked_for():
    ids = token_batches(1)[0][0]["input_ids"]
    with pytest.raises(NoOutputProjection) as e, quiet():
        ppll_compile.plan(TiedOutput(), 2, example_inputs=(ids,), policy=lm_output_policy(), tied="untie")
    assert str(e.value) == (
        "head type 'lm_output' reads the model's own output projection, but TiedOutput has none: looked for an "
        "nn.Linear as the last module its graph calls before the output (as Llama's or GPT-2's lm_head), found "
        "'norm' (LayerNorm); use type lm, a fresh projection")
    assert isinstance(e.value, PolicyError) and head_type("lm_output").per_token
