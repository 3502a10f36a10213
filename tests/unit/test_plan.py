"""The Plan: totals, serialisation, validation, hand edits, and the planner's choices end to end."""

import dataclasses
import pickle
import re
import time

import pytest
import torch
import yaml
from models import DictOut, Masked, Residual

import ppll_compile
from ppll_compile import CutError, PartitionError, Plan, PlanError
from tests.helpers import PLAN_X, plan_residual


pytestmark = pytest.mark.usefixtures("quietly")  # no CPU-fallback warnings of compile


def test_totals_follow_from_stage_costs():
    p = plan_residual(profile="flops")
    costs = [s.cost for s in p.stages]
    assert p.bottleneck_cost == max(costs)
    assert p.ideal_cost == pytest.approx(sum(costs) / 3)
    assert p.imbalance == pytest.approx(max(costs) / (sum(costs) / 3))
    assert p.predicted_speedup == pytest.approx(p.sequential_cost / max(costs))
    for s in p.stages:
        assert s.cost == pytest.approx(s.compute_cost + s.comm_cost)
        expect_comm = sum(t.bytes for t in s.boundary) / p.link_bandwidth
        assert s.comm_cost == pytest.approx(expect_comm)
        expect_compute = (s.flops_fwd + s.flops_bwd + s.aux_flops) / p.flops_per_second
        assert s.compute_cost == pytest.approx(expect_compute)
    assert p.stages[-1].head.kind == "model" and p.stages[-1].aux_flops == 0
    assert [s.last_node for s in p.stages[:-1]] == list(p.cuts)


def test_memory_model_counts_optimizer_state():
    sgd, adam = plan_residual(optimizer="sgd"), plan_residual(optimizer="adam", split_points=list(plan_residual().cuts))
    for s, a in zip(sgd.stages, adam.stages):
        assert s.optim_bytes == 0 and a.optim_bytes == 2 * a.grad_bytes
        assert s.grad_bytes == s.param_bytes == 4 * s.param_count
        # the head's input is the stage's output, which the stage's last ReLU saves too: counted once
        twice = s.head.input_saved_bytes if s.last_node.startswith("relu") else 0
        assert s.memory_bytes == s.param_bytes + s.grad_bytes + s.activation_bytes + s.head.memory_bytes - twice


def test_json_and_yaml_round_trip(tmp_path):
    p = plan_residual(model=Masked(), gpus=3, example_inputs=(torch.randn(2, 5, 8), torch.ones(2, 5)))
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_yaml(p.to_yaml()) == p
    assert Plan.load(p.save(tmp_path / "p.json")) == p
    assert Plan.load(p.save(tmp_path / "p.yaml")) == p


def test_a_plan_cannot_be_changed_in_place_and_hashes_by_value():
    p = plan_residual()
    config = p.stages[0].head.config
    for change in (lambda: config.__setitem__("width", 1), lambda: config["loss"].__setitem__("classification", "x"),
                   lambda: setattr(p.stages[0], "cost", 0.0), lambda: config.pop("type")):
        with pytest.raises((TypeError, AttributeError, dataclasses.FrozenInstanceError)):
            change()
    assert p.stages[0].head.config["width"] == config["width"] and "type" in config
    copy = Plan.from_json(p.to_json())
    assert hash(copy) == hash(p) and copy == p
    assert len({p, copy, plan_residual(gpus=2)}) == 2
    assert pickle.loads(pickle.dumps(p)) == p
    edited = p.to_dict()
    edited["stages"][0]["head"]["config"]["width"] = 1  # to_dict gives plain data to edit and save
    assert Plan.from_dict(edited).stages[0].head.config["width"] == 1 and p.stages[0].head.config["width"] != 1


def test_planning_reports_the_seconds_of_each_phase():
    from ppll_compile.phases import PHASES, record_phases

    start = time.perf_counter()
    with record_phases() as outer:
        with record_phases() as inner:
            plan_residual(partitioner="exact")
    total = time.perf_counter() - start
    assert set(inner) == set(PHASES) and inner == outer
    assert all(inner[name] > 0 for name in PHASES), inner
    assert sum(inner.values()) <= total
    with record_phases() as later:
        pass
    assert later == dict.fromkeys(PHASES, 0.0)


def test_multi_tensor_boundaries_are_reported_and_run():
    model = Masked()
    x, mask = torch.randn(2, 5, 8), (torch.rand(2, 5) > 0.3).float()
    c = ppll_compile.compile(model, 3, example_inputs=(x, mask), split_points=["embed", "blocks.1"])
    assert c.plan.stages[0].boundary[0].name == "embed" and len(c.plan.stages[0].boundary) == 2
    assert "embed" in c.plan.multi_tensor_cuts
    assert any("sends 2 values" in n for n in c.plan.notes)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(c(x, mask), model(x, mask))


def test_validate_names_the_problem():
    p = plan_residual()
    bad = dataclasses.replace(p, stages=(p.stages[1], p.stages[0], p.stages[2]))
    with pytest.raises(PlanError, match=re.escape("stage 0 has index 1; stages must be numbered 0..2")):
        bad.validate()
    d = p.to_dict()
    d["version"] = 99
    with pytest.raises(PlanError, match="plan version 99 is not supported"):
        Plan.from_dict(d)
    d = p.to_dict()
    d["stagez"] = d.pop("stages")
    with pytest.raises(PlanError, match=re.escape("unknown plan field(s) ['stagez']")):
        Plan.from_dict(d)
    tight = dataclasses.replace(p, memory_limit=1)
    with pytest.raises(PlanError, match=re.escape("stage(s) [0, 1, 2] exceed the memory limit of 1 B")):
        tight.validate()


def test_too_many_stages():
    with pytest.raises(CutError, match=re.escape(
            "plan at most 6 stages (gpus=6 or fewer): the model has 5 legal cut point(s); got gpus=8")):
        plan_residual(gpus=8)


class _Chain(torch.nn.Module):
    """Equal Linear layers back to back: a legal cut after every layer, and every boundary the same tensor shape."""

    def __init__(self, depth: int = 8, width: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x):
        return self.layers(x)


def test_device_speeds_move_the_cut_to_the_fast_device():
    n, d, depth = 16, 64, 8
    even = plan_residual(_Chain(depth, d), gpus=2, example_inputs=(torch.randn(n, d),), profile="flops")
    skewed = plan_residual(_Chain(depth, d), gpus=2, example_inputs=(torch.randn(n, d),), device_speeds=[1.0, 0.25],
                   profile="flops")
    layer = 2 * n * d * d  # a layer's forward FLOPs, and those of each of its gradients
    head = even.stages[0].aux_flops  # every cut has the same boundary, so the same head
    send = n * d * 4 / even.link_bandwidth

    def stage_costs(k: int, speeds: tuple[float, float]) -> tuple[float, float]:
        """Stage costs with layers [0, k) on the first device: neither the model's input nor the second stage's
        (detached) needs a gradient."""
        first = (layer * (3 * k - 1) + head) / even.flops_per_second / speeds[0] + send
        return first, layer * (3 * (depth - k) - 1) / even.flops_per_second / speeds[1]

    def best(speeds: tuple[float, float]) -> int:
        ranked = sorted(range(1, depth), key=lambda k: max(stage_costs(k, speeds)))
        assert max(stage_costs(ranked[0], speeds)) < max(stage_costs(ranked[1], speeds))  # a unique optimum
        return ranked[0]

    assert (best((1.0, 1.0)), best((1.0, 0.25))) == (1, 4)
    assert even.cuts == ("layers_0",) and skewed.cuts == ("layers_3",)
    assert [s.cost for s in skewed.stages] == pytest.approx(stage_costs(4, (1.0, 0.25)), rel=1e-12)
    assert [s.cost for s in even.stages] == pytest.approx(stage_costs(1, (1.0, 1.0)), rel=1e-12)
    s = skewed.stages[1]
    assert s.compute_cost == pytest.approx((s.flops_fwd + s.flops_bwd) / skewed.flops_per_second / 0.25)


def test_hand_edited_plan_moves_a_cut_and_changes_device_and_head(tmp_path):
    model = Residual()
    p = plan_residual(model)
    d = yaml.safe_load(p.to_yaml())
    legal = list(p.legal_cuts)
    new_cut = next(c for c in legal if c not in p.cuts and legal.index(c) < legal.index(p.cuts[1]))
    d["stages"][0]["last_node"] = new_cut
    d["stages"][1]["head"]["config"]["type"] = "mlp"
    d["stages"][1]["head"]["config"]["hidden"] = 7
    d["stages"][1]["head"]["config"].pop("width", None)
    d["stages"][1]["head"]["config"].pop("depth", None)
    d["stages"][1]["head"]["config"].pop("pool", None)
    d["stages"][1]["head"]["config"].pop("max_width", None)
    d["stages"][2]["device"] = "cpu"
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(d))
    c = ppll_compile.compile(model, plan=path)
    assert c.plan.cuts == (new_cut, p.cuts[1]) and c.plan.partitioner == "manual"
    assert c.plan.stages[1].head.config["type"] == "mlp"
    hidden = next(m for m in c.heads[1].modules() if isinstance(m, torch.nn.Linear))
    assert hidden.out_features == 7
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(c(PLAN_X), model(PLAN_X))

    d["stages"][0]["last_node"] = "a1"  # inside the first residual block
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(CutError, match=re.escape(f"{path}: cannot cut after 'a1'") + ".*" +
                       re.escape("nearest legal cuts: 'relu' or 'add'")):
        ppll_compile.compile(model, plan=path)


def test_split_points_by_module_or_node_name():
    p = plan_residual(gpus=None, split_points=["stem"])
    assert p.cuts == ("stem",) and p.num_stages == 2
    fine = plan_residual(gpus=None, split_points=["relu", "add"])  # node names: the full trace is kept
    assert fine.cuts == ("relu", "add") and fine.legal_cuts == plan_residual().legal_cuts
    with pytest.raises(CutError, match=re.escape("'a9' is neither a node nor a module of the traced model")):
        plan_residual(gpus=None, split_points=["a9"])


def test_unknown_partitioner_lists_known_ones():
    with pytest.raises(PartitionError, match=re.escape(
            "unknown partitioner 'fast'; known partitioners: exact, greedy, params, uniform")):
        plan_residual(partitioner="fast")


def test_input_and_classes_that_cannot_be_inferred():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return x * 2
    with pytest.raises(ValueError, match=re.escape("cannot infer an input shape for Odd; pass example_inputs")):
        ppll_compile.plan(Odd(), gpus=2)
    with pytest.raises(ValueError, match=re.escape("cannot infer the number of classes: DictOut returns a "
                                                   "structured output, not N x classes (or N x tokens x classes) "
                                                   "scores; pass num_classes")):
        ppll_compile.plan(DictOut(), gpus=2, example_inputs=(torch.randn(2, 4),))


def test_batch_size_scales_costs():
    small, big = plan_residual(batch_size=4), plan_residual(batch_size=8,
                                                            split_points=list(plan_residual(batch_size=4).cuts))
    assert big.batch_size == 8 and big.inputs[0].shape[0] == 8
    for s, b in zip(small.stages, big.stages):
        assert b.flops_fwd == 2 * s.flops_fwd
        assert b.param_bytes == s.param_bytes


def test_cpu_fallback_is_noted_once():
    if torch.cuda.device_count() >= 3:
        pytest.skip("this machine has enough GPUs")
    with pytest.warns(UserWarning, match="all 3 stages run on the CPU") as record:
        p = ppll_compile.plan(Residual(), 3, example_inputs=(PLAN_X,))
    assert len([w for w in record if "CPU" in str(w.message)]) == 1
    assert p.devices == ("cpu",) * 3 and len([n for n in p.notes if "run on the CPU" in n]) == 1


def test_time_profile_measures_and_restores():
    model = Residual().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = plan_residual(model, profile="time", devices=["cpu"] * 3)
    assert not any(m.training for m in model.modules())
    assert p.profile == "time" and all(s.compute_cost > 0 for s in p.stages)
    assert any("as whole training steps of" in n for n in p.notes)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(q.grad is None for q in model.parameters())


def test_compiled_pipeline_heads_and_shared_parameters():
    model = Residual()
    c = ppll_compile.compile(model, 3, example_inputs=(PLAN_X,), policy="dgl")
    assert c.heads[-1] is None and all(h is not None for h in c.heads[:-1])
    own = {id(q) for q in model.parameters()}
    for i, stage in enumerate(c.stages):
        assert {id(q) for q in stage.parameters()} <= own
        h = c.heads[i]
        if h is not None:
            assert not ({id(q) for q in h.parameters()} & own)
            spec = c.plan.stages[i].boundary[0]
            assert h(torch.randn(spec.shape)).shape == (spec.shape[0], c.plan.num_classes)
            assert sum(q.numel() for q in h.parameters()) == c.plan.stages[i].head.param_count


def test_reapplied_plan_keeps_its_settings(tmp_path):
    model = Residual()
    p = plan_residual(model, optimizer="adam", memory_limit=10**9, batch_size=8, policy="mlp")
    again = ppll_compile.plan(model, plan=p.save(tmp_path / "p.yaml"))
    assert (again.optimizer, again.memory_limit, again.batch_size, again.policy) == ("adam", 10**9, 8, "mlp")
    assert again.cuts == p.cuts
    assert [s.cost for s in again.stages] == pytest.approx([s.cost for s in p.stages])
    assert ppll_compile.plan(model, plan=p, optimizer="sgd").optimizer == "sgd"  # the call overrides


def test_dict_output_and_fixed_keyword_through_the_pipeline():
    model = DictOut().eval()
    x = torch.randn(3, 4)
    c = ppll_compile.compile(model, 3, example_inputs=(x,), num_classes=2)
    with torch.no_grad():
        got, expected = c(x), model(x)
    assert set(got) == {"logits", "features"}
    for k in expected:
        torch.testing.assert_close(got[k], expected[k])
    with pytest.raises(TypeError, match=re.escape("DictOut was compiled with scale=None, a constant of the captured "
                                                  "graph, and is called with scale=2.0; compile again with "
                                                  "scale=2.0 in example_kwargs")):
        c(x, scale=2.0)
    torch.testing.assert_close(c(x, scale=None)["logits"], expected["logits"])  # the captured value is fine
