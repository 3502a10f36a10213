"""Plans in the precision users train in (``precision=``): costs at the hardware's low-precision rates, fused
element-wise chains, memory by the documented rule, the plan field, and the trainer's autocast following it."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import PPLLError
from ppll_compile.analysis.analyse import analyse
from ppll_compile.cli.command import main
from ppll_compile.cost.hardware import PRESETS
from ppll_compile.cost.nodes import META_KEY, measure_graph
from ppll_compile.cost.roofline import seconds
from ppll_compile.options import PlanOptions
from ppll_compile.plans.plan import Plan
from tests.helpers import BATCH, assert_same_parameters, compiled_residual_at, image_batches, sgd
from tests.models import Residual

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

B, D_IN, D = 16, 64, 128
H100 = PRESETS["h100"].figures


class Chained(nn.Module):
    """A linear layer whose output feeds a chain of 3 element-wise operators (mul, add, sigmoid) and, past it, a
    second branch: the chain's nodes are no legal cut (they do not dominate the output), so it fuses whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D_IN, D)
        self.left = nn.Linear(D, 10)
        self.right = nn.Linear(D, 10)

    def forward(self, x):
        h = self.lin(x)
        z = torch.sigmoid(h * 2 + 1)
        return self.left(z) + self.right(h)


def _analysis(precision: str, fusion: str | None = None):
    torch.manual_seed(0)
    return analyse(Chained(), (torch.randn(B, D_IN),), None, PlanOptions(precision=precision, fusion=fusion))


def _matmul(a, name: str):
    (op,) = [op for op in a.by_name[name].meta[META_KEY].ops_fwd if op.kind == "matmul"]
    return op


@pytest.mark.parametrize("precision, dtype, size", [("fp32", "float32", 4), ("bf16", "bfloat16", 2),
                                                    ("fp16", "float16", 2), ("bf16-pure", "bfloat16", 2)])
def test_a_linear_layer_costs_its_matmul_at_the_precision_rate(precision, dtype, size):
    op = _matmul(_analysis(precision), "lin")
    assert op.dtype == dtype and op.flops == 2 * B * D_IN * D
    assert op.bytes == size * (D + B * D_IN + D_IN * D + B * D)  # bias, input, weight, output
    rate = {"float32": 67e12, "bfloat16": 989.5e12, "float16": 989.5e12}[dtype] * 0.7  # datasheet x fraction
    expected = max(op.flops / rate, op.bytes / (3.35e12 * 0.8)) + 5e-6
    assert seconds([op], H100) == pytest.approx(expected, rel=1e-12)


def test_a_fused_chain_of_three_element_wise_operators_reads_once_and_writes_once():
    eager, fused = _analysis("bf16", "eager"), _analysis("bf16", "fused")
    chain = ["mul", "add", "sigmoid"]
    assert [eager.by_name[n].meta[META_KEY].ops_fwd != () for n in chain] == [True] * 3
    assert [fused.by_name[n].meta[META_KEY].ops_fwd for n in chain[:2]] == [(), ()]
    cost = fused.by_name["sigmoid"].meta[META_KEY]
    one = B * D * 2  # one bfloat16 activation of the chain
    (fwd,), (bwd,) = cost.ops_fwd, cost.ops_bwd
    assert (fwd.kind, fwd.dtype, fwd.bytes) == ("math", "bfloat16", one + one)  # read h, write the sigmoid
    assert bwd.bytes == 3 * one  # read h and the output's gradient, write h's gradient
    eager_bytes = sum(op.bytes for n in chain for op in eager.by_name[n].meta[META_KEY].ops_fwd)
    assert eager_bytes >= 5 * one  # each operator reads and writes (the chain saves the rest)
    assert seconds([fwd], H100) == pytest.approx(2 * one / (3.35e12 * 0.7) + 5e-6, rel=1e-12)


def test_fp32_is_priced_as_measured():
    a = _analysis("fp32")
    priced = {n.name: n.meta[META_KEY] for n in a.nodes if META_KEY in n.meta}
    measure_graph(a.gm, a.real_inputs)  # the fake-tensor measurement alone, nothing re-priced
    assert {n.name: n.meta[META_KEY] for n in a.nodes if META_KEY in n.meta} == priced
    torch.manual_seed(0)
    x = torch.randn(BATCH, 3, 8, 8)
    default = ppll_compile.plan(Residual(), 2, example_inputs=(x,), hardware="h100")
    assert default.precision == "fp32" and default.fusion == "eager"
    assert ppll_compile.plan(Residual(), 2, example_inputs=(x,), hardware="h100", precision="fp32") == default


def _plans(**options):
    x = torch.randn(BATCH, 3, 8, 8)
    return {p: ppll_compile.plan(Residual(), 2, example_inputs=(x,), hardware="h100", split_points=["add"],
                                 optimizer="adam", precision=p, **options) for p in ("fp32", "bf16", "bf16-pure")}


def test_boundaries_travel_in_the_low_precision_and_memory_follows_the_rule():
    plans = _plans(fusion="eager")
    f32, mixed, pure = (plans[p].stages[0] for p in ("fp32", "bf16", "bf16-pure"))
    (b32,), (b16,) = f32.boundary, mixed.boundary
    assert (b32.dtype, b16.dtype, pure.boundary[0].dtype) == ("float32", "bfloat16", "bfloat16")
    assert b16.bytes * 2 == b32.bytes == BATCH * 8 * 8 * 8 * 4
    assert mixed.comm_cost == pytest.approx(f32.comm_cost / 2, rel=1e-12)
    # mixed: float32 weights, gradients and Adam's two moments; saved activations halved, plus autocast's copy of
    # every weight (2 bytes an element)
    assert (mixed.param_bytes, mixed.grad_bytes, mixed.optim_bytes) == (f32.param_bytes, f32.grad_bytes,
                                                                         f32.optim_bytes)
    assert mixed.activation_bytes == f32.activation_bytes // 2 + 2 * f32.param_count
    # pure: everything bfloat16
    assert (pure.param_bytes, pure.grad_bytes, pure.optim_bytes, pure.activation_bytes) == (
        f32.param_bytes // 2, f32.grad_bytes // 2, f32.optim_bytes // 2, f32.activation_bytes // 2)


def test_the_plan_records_and_prints_its_precision_and_old_files_load_as_fp32(tmp_path):
    plan = _plans()["bf16"]
    assert (plan.precision, plan.fusion) == ("bf16", "fused")
    assert "optimizer adam, precision bf16, element-wise chains fused" in plan.table()
    for path in (tmp_path / "p.json", tmp_path / "p.yaml"):
        assert Plan.load(plan.save(path)) == plan
    old = plan.to_dict()
    del old["precision"], old["fusion"]
    loaded = Plan.from_dict(old)
    assert (loaded.precision, loaded.fusion) == ("fp32", "eager")
    bad = {**plan.to_dict(), "precision": "fp8"}
    with pytest.raises(ppll_compile.PlanError, match=re.escape(
            "plan precision 'fp8' is not known; precisions: fp32, bf16, fp16, bf16-pure")):
        Plan.from_dict(bad)


def test_an_unknown_precision_lists_the_known_ones():
    with pytest.raises(ValueError, match=re.escape(
            "unknown precision 'bfloat16'; known precisions: fp32 (float32 throughout (the default)), bf16 (mixed "
            "precision: bfloat16 compute and activations under torch.autocast, float32 weights, gradients and "
            "optimizer state), fp16 (mixed precision: float16 compute and activations under torch.autocast with a "
            "gradient scaler, float32 weights, gradients and optimizer state), bf16-pure (pure bfloat16: weights, "
            "gradients, optimizer state, compute and activations all bfloat16)")):
        ppll_compile.plan(Residual(), 2, example_inputs=(torch.randn(BATCH, 3, 8, 8),), precision="bfloat16")
    with pytest.raises(ValueError, match=re.escape("fusion must be one of eager, fused or None")):
        PlanOptions(fusion="inductor")
    with pytest.raises(ValueError, match=re.escape("profile='time' times the stages on this machine in float32, "
                                                   "but precision='bf16' plans for another precision")):
        PlanOptions(precision="bf16", profile="time")


def test_ppll_plan_takes_precision(capsys):
    code = main(["examples/resnet32.py", "--gpus", "2", "--hardware", "h100", "--precision", "bf16"])
    assert code == 0
    assert "precision bf16, element-wise chains fused" in capsys.readouterr().out


def test_the_trainer_autocasts_as_the_plan_says_and_refuses_another_dtype():
    compiled = compiled_residual_at("bf16")
    seen: list[torch.dtype] = []
    for stage in compiled.stages:
        for m in stage.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with compiled.trainer(optimizer=sgd) as trainer:
        x, y = image_batches(1)[0]
        trainer.step(x, y)
        assert [r.scaler for r in trainer.runners] == [None, None]
    assert seen and set(seen) == {torch.bfloat16}
    compiled.trainer(optimizer=sgd, autocast=torch.bfloat16).close()  # the plan's own dtype may be repeated
    for given, text in ((torch.float16, "torch.float16"), ([torch.bfloat16, None], "[torch.bfloat16, None]")):
        with pytest.raises(PPLLError, match=re.escape(
                f"autocast={text} conflicts with the plan's precision 'bf16', whose costs, memory and boundaries "
                f"are priced in bfloat16 and whose stages train under torch.autocast(torch.bfloat16); drop "
                f"autocast= (it follows the plan), or re-plan with the precision you mean (precision='fp32', "
                f"'bf16' or 'fp16')")):
            compiled.trainer(optimizer=sgd, autocast=given)


def test_autocast_on_an_fp32_plan_warns_that_its_costs_are_float32():
    compiled = compiled_residual_at("fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.trainer(optimizer=sgd, autocast=torch.bfloat16).close()
    assert any("autocast=torch.bfloat16 trains a plan priced in float32 (precision 'fp32'): its costs, memory and "
               "boundaries are float32's; plan with precision='bf16' and drop autocast=" in str(w.message)
               for w in caught)


def test_a_pure_plan_refuses_float32_parameters():
    compiled = compiled_residual_at("bf16-pure")
    with pytest.raises(PPLLError, match=re.escape(
            "the plan's precision 'bf16-pure' trains bfloat16 parameters, but stage 0 holds float32 ones "
            "('stem.weight'); cast the model with model.to(torch.bfloat16) and feed bfloat16 inputs, or re-plan "
            "with precision='bf16' (mixed precision: float32 weights)")):
        compiled.trainer(optimizer=sgd)
    compiled.model.to(torch.bfloat16)
    with compiled.trainer(optimizer=sgd) as trainer:
        x, y = image_batches(1)[0]
        losses = trainer.step(x.to(torch.bfloat16), y)
    assert all(torch.isfinite(torch.tensor(ls)).all() for ls in losses)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_low_precision_plan_trains_under_threads_as_sequential(precision):
    data = image_batches(4)
    runs = {}
    for runtime in ("sequential", "threads"):
        compiled = compiled_residual_at(precision)
        losses: list[list[float]] = [[], []]
        with compiled.trainer(optimizer=sgd, runtime=runtime) as trainer:
            for out in [trainer.step(x, y) for x, y in data] + [trainer.finish()]:
                for i, ls in enumerate(out):
                    losses[i] += ls
        runs[runtime] = (compiled, losses)
    assert_same_parameters(runs["sequential"][0], runs["threads"][0])
    assert runs["sequential"][1] == runs["threads"][1] and len(runs["threads"][1][1]) == 4


def test_the_simulator_sends_a_low_precision_boundary_in_half_the_time():
    plans = _plans(fusion="eager")
    slow = 1e3  # bytes per second: the sends dominate every step
    sims = {p: ppll_compile.simulate(plans[p], steps=16, link_bandwidth=slow) for p in ("fp32", "bf16")}
    send = {p: plans[p].stages[0].boundary[0].bytes / slow for p in ("fp32", "bf16")}
    assert send["bf16"] * 2 == send["fp32"]
    for p in ("fp32", "bf16"):
        assert sims[p].step_time == pytest.approx(send[p], rel=1e-3)


# ---- losses and heads as autocast runs them -----------------------------------------------------------------------

N_SCORES = 4 * 16 * 1000


def _loss(dtype: str):
    from ppll_compile.heads.build import counted_loss
    from ppll_compile.plans.specs import TensorSpec
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return counted_loss(TensorSpec(name="logits", shape=(4, 16, 1000), dtype=dtype, bytes=N_SCORES * size), 1000,
                        per_token=True)


def test_meta_autocast_runs_layers_low_and_losses_in_float32_as_cuda_autocast():
    from ppll_compile.cost.autocast import MetaAutocast
    with torch.device("meta"):
        layer, x, y = nn.Linear(8, 5), torch.empty(3, 8), torch.zeros(3, dtype=torch.long)
        with MetaAutocast(torch.bfloat16):
            scores = layer(x)
            loss = nn.functional.cross_entropy(scores, y)
    assert (layer.weight.dtype, scores.dtype, loss.dtype) == (torch.float32, torch.bfloat16, torch.float32)


def test_a_low_precision_loss_holds_its_output_low_and_saves_and_differentiates_in_float32():
    (full, full_cost), (low, low_cost) = _loss("float32"), _loss("bfloat16")
    assert (full.scores_bytes, low.scores_bytes) == (4 * N_SCORES, 2 * N_SCORES)
    # the same float32 log-probabilities saved, the same float32 gradient; only the held output is half
    assert low_cost.activation_bytes == full_cost.activation_bytes
    assert full.memory_bytes - low.memory_bytes == 2 * N_SCORES
    # its time: the float32 loss, plus autocast's cast of the scores to float32 and of their gradient back (6 bytes
    # an element each way)
    casts = [op for op in low_cost.ops if op not in full_cost.ops]
    assert [(op.kind, op.flops, op.bytes) for op in casts] == [("memory", 0, 6 * N_SCORES)] * 2
    assert {op.dtype for op in low_cost.ops if op.kind == "math"} == {"float32"}


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_a_low_precision_head_runs_its_layers_low_and_its_loss_in_float32(precision):
    from ppll_compile.heads.build import counted_head
    from ppll_compile.heads.policy import load_policy
    from ppll_compile.plans.specs import TensorSpec
    spec = {p: TensorSpec(name="h", shape=(4, 16, 32), dtype=d, bytes=4 * 16 * 32 * s)
            for p, d, s in (("fp32", "float32", 4), (precision, "bfloat16", 2))}
    (full, full_cost), (low, low_cost) = (
        counted_head(load_policy("lm"), None, spec[p], 1000, None, "sgd", per_token=True, precision=p)
        for p in ("fp32", precision))
    assert {op.dtype for op in full_cost.ops} == {"float32"}
    assert {op.dtype for op in low_cost.ops if op.kind == "matmul"} == {"bfloat16"}
    assert {op.dtype for op in low_cost.ops if op.kind in ("math", "norm")} == {"float32"}  # softmax, LayerNorm
    assert (full.scores_bytes, low.scores_bytes) == (4 * N_SCORES, 2 * N_SCORES)
    weights = full.param_count * (4 if precision == "bf16" else 2)  # float32 master weights, or bfloat16 ones
    # parameters and their gradients (SGD keeps no state), what it saves, and the scores' float32 gradient
    assert low.memory_bytes == 2 * weights + low_cost.activation_bytes + 4 * N_SCORES
