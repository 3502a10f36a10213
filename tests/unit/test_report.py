"""What a plan says a cluster will see: the last stage's loss and the heads' scores in its costs, each stage's memory
by part, the heads' share of the step, and the model FLOPs utilisation, in plan(), simulate() and ppll-plan --show."""

import dataclasses
import json
import textwrap

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import Plan
from ppll_compile.cli.command import main
from ppll_compile.cost.hardware import PRESETS
from ppll_compile.heads.build import counted_head
from ppll_compile.heads.policy import validate_policy
from ppll_compile.plans.plan import TensorSpec
from ppll_compile.plans.report import LARGE_HEAD, memory_split, mfu, model_flops, peak_flops
from tests.helpers import quiet

N, L, D, V = 4, 8, 16, 96  # batch, tokens, width, vocabulary of the tiny causal LM

TINY_LM = f"""
import torch
from torch import nn

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding({V}, {D})
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear({D}, {D}), nn.ReLU()) for _ in range(4)])
        self.out = nn.Linear({D}, {V}, bias=False)

    def forward(self, ids):
        return self.out(self.blocks(self.embed(ids)))

def build_model():
    return TinyLM()

def example_inputs():
    return torch.zeros({N}, {L}, dtype=torch.long)
"""


def tiny_lm() -> nn.Module:
    scope: dict = {}
    exec(TINY_LM, scope)
    torch.manual_seed(0)
    return scope["build_model"]()


def ids() -> torch.Tensor:
    return torch.zeros(N, L, dtype=torch.long)


def lm_plan(**options) -> Plan:
    with quiet():
        return ppll_compile.plan(tiny_lm(), options.pop("gpus", 3), example_inputs=(ids(),), **options)


def test_the_last_stage_costs_its_logits_as_computed_by_hand():
    plan = lm_plan(hardware="h100")
    last = plan.stages[-1]
    scores = N * L * V * 4  # float32 logits, one copy
    # the output held until the step ends, the log-probabilities the loss saves, their gradient; and the loss also
    # saves its int64 labels and its float32 total weight
    assert last.head.scores_bytes == scores
    assert last.head.memory_bytes == 3 * scores + N * L * 8 + 4
    assert memory_split(last).logits == last.head.memory_bytes
    assert last.memory_bytes == (last.param_bytes + last.grad_bytes + last.optim_bytes + last.activation_bytes
                                 + last.head.memory_bytes)
    assert last.head_cost > 0 and last.head_cost < last.compute_cost  # the loss's operators, priced


def test_a_per_token_head_counts_its_scores_gradient():
    spec = TensorSpec(name="h", shape=(N, L, D), dtype="float32", bytes=4 * N * L * D)
    policy = validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm", "rank": 0}},
                             "inline")
    head, cost = counted_head(policy, None, spec, V, None, "sgd", per_token=True)
    params = 4 * (2 * D + D * V + V)  # LayerNorm(D), Linear(D, V)
    assert head.scores_bytes == N * L * V * 4
    assert head.memory_bytes == 2 * params + cost.activation_bytes + head.scores_bytes


def test_the_memory_split_sums_to_each_stage_memory():
    plan = lm_plan(hardware="h100", optimizer="adam")
    for s in plan.stages:
        split = memory_split(s)
        assert split.total == s.memory_bytes
        assert (split.weights, split.gradients, split.optimizer, split.activations) == (
            s.param_bytes, s.grad_bytes, s.optim_bytes, s.activation_bytes)
        if not s.is_last:  # the head, less its input where the backbone saves it already
            assert split.logits == 0 and s.head.memory_bytes - s.head.input_saved_bytes <= split.head \
                <= s.head.memory_bytes
    sim = ppll_compile.simulate(plan, steps=8)
    assert [s.split for s in sim.stages] == [memory_split(s) for s in plan.stages]
    assert [s.head_share for s in sim.stages] == [s.head_cost / s.cost for s in plan.stages]


def test_mfu_is_the_hand_formula():
    plan = lm_plan(profile="flops", flops_per_second=1e12, gpus=2)
    flops = sum(s.flops_fwd + s.flops_bwd for s in plan.stages)
    assert model_flops(plan) == flops > 0
    assert mfu(plan, 0.5) == pytest.approx(flops / (0.5 * 2 * 1e12), rel=1e-12)
    sim = ppll_compile.simulate(plan, steps=8)
    assert sim.mfu == pytest.approx(flops / (sim.step_time * plan.world_size * 1e12), rel=1e-12)
    h100 = lm_plan(hardware="h100", gpus=2)
    assert peak_flops(h100) == (pytest.approx(67e12), "h100 float32 dense peak")  # the datasheet's FP32 peak
    assert ppll_compile.simulate(h100, steps=8).peak_flops == pytest.approx(67e12)
    assert PRESETS["h100"].figures.rate("matmul", "float32") < 67e12  # the costs assume a fraction of it


def test_show_prints_the_memory_split_and_mfu(tmp_path, capsys):
    path = tmp_path / "tiny_lm.py"
    path.write_text(textwrap.dedent(TINY_LM))
    assert main([str(path), "--gpus", "3", "--hardware", "h100", "--show"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("stage") and "weights" in line)
    assert header.split() == ["stage", "weights", "grads", "optimizer", "activations", "head", "logits", "memory",
                              "head", "%", "of", "step"]
    assert "model FLOPs" in out and "MFU" in out and "h100 float32 dense peak" in out


def test_a_large_head_is_noted_with_a_cheaper_one():
    policy = validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm", "rank": 0}},
                             "inline")
    free = lm_plan(policy=policy, profile="flops", gpus=2)
    head = free.stages[0].head.memory_bytes
    capped = lm_plan(policy=policy, profile="flops", gpus=2, memory_limit=int(head / (2 * LARGE_HEAD)),
                     split_points=list(free.cuts))
    notes = [n for n in capped.notes if n.startswith("stage 0: its head takes")]
    assert len(notes) == 1 and "a cheaper head: per_token: {type: lm, rank: 64}" in notes[0]
    assert not [n for n in free.notes if "its head takes" in n]  # no device memory known: nothing to compare with


def test_old_plan_files_load_with_the_new_figures_zero(tmp_path):
    plan = lm_plan(hardware="h100")
    d = json.loads(plan.to_json())
    for s in d["stages"]:
        del s["head_cost"], s["head"]["scores_bytes"]
    old = Plan.from_dict(d)
    assert [s.head_cost for s in old.stages] == [0.0] * plan.num_stages
    assert [memory_split(s) for s in old.stages] == [memory_split(s) for s in plan.stages]
    sim = ppll_compile.simulate(old, steps=4)
    assert [s.head_share for s in sim.stages] == [0.0] * plan.num_stages and sim.mfu is not None
    assert dataclasses.replace(old, stages=plan.stages) == plan


def test_without_a_preset_the_peak_is_the_fastest_measured_compute_rate():
    plan = lm_plan(gpus=2)
    assert plan.hardware is None and plan.profile == "roofline"
    rates = plan.calibration["rates"]
    fastest = max(rates[f"{family}:float32"] for family in ("matmul", "attention", "conv", "conv_bwd"))
    assert peak_flops(plan)[0] == fastest
    assert mfu(plan, plan.bottleneck_cost) == pytest.approx(
        model_flops(plan) / (plan.bottleneck_cost * plan.world_size * fastest), rel=1e-12)
