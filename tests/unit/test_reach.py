"""No parameter left behind: a trainable parameter that no loss of its stage reaches (its value crosses the cut beside
the tensor the head reads) is found on the captured graph; the partitioner avoids such cuts while enough others
remain, cuts given by hand (or no alternative) are refused naming the stage, the parameters and the ways out, and
``frozen=`` accepts them, listed in the plan's notes."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import PlanError
from ppll_compile.analysis.reach import Reach, frozen_hint, listed
from ppll_compile.cost.nodes import measure_graph
from ppll_compile.options import PlanOptions
from ppll_compile.runtime.distributed.plan_share import request_of


class TwoBranch(nn.Module):
    """``side`` is computed before the cuts after ``stem``, ``a`` and ``relu_1`` and read only after them: a stage
    ending there sends it on detached, and its head reads the other branch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.side, self.a = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.b, self.c, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.side(x)
        h = torch.relu(self.stem(x))
        h = torch.relu(self.a(h))
        h = torch.relu(self.b(h) + s)
        h = torch.relu(self.c(h) * s)
        return self.out(h)


class InPlace(TwoBranch):
    """``extra``'s output is added in place into the side branch's value, which the later layers read: it crosses the
    cuts after ``stem``, ``a`` and ``relu_1`` with it (the graph's ``add_`` node itself has no users)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.side(x)
        s.add_(self.extra(x))
        h = torch.relu(self.stem(x))
        h = torch.relu(self.a(h))
        h = torch.relu(self.b(h) + s)
        h = torch.relu(self.c(h) * s)
        return self.out(h)


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([0, 1, 2, 1])
STRANDED = "side.weight, side.bias"


def _plan(model: nn.Module | None = None, **options) -> ppll_compile.Plan:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this machine has")  # the CPU fallback
        return ppll_compile.plan(model or TwoBranch(), example_inputs=(X,), **options)


def _reach(model: nn.Module, ends: list[str]) -> Reach:
    gm = torch.fx.symbolic_trace(model)
    measure_graph(gm, (X,))
    return Reach.of(gm, list(gm.graph.nodes), ends)


def test_the_branch_is_stranded_by_the_cuts_it_crosses_and_by_no_other():
    reach = _reach(TwoBranch(), ["stem", "relu_1", "mul"])
    assert reach.stranding("stem") == ["side.weight", "side.bias"]
    assert reach.stranding("relu_1") == ["side.weight", "side.bias"]
    assert reach.stranding("mul") == []
    [stage] = reach.stages(["relu_1"])
    assert (stage.stage, stage.end, stage.names) == (0, "relu_1", ("side.weight", "side.bias"))
    assert reach.stages(["mul"]) == [] and reach.stages([]) == []


def test_an_in_place_update_of_a_value_read_later_flows_where_that_value_does():
    reach = _reach(InPlace(), ["relu_1", "mul"])
    assert reach.stranding("relu_1") == ["side.weight", "side.bias", "extra.weight", "extra.bias"]
    assert reach.stranding("mul") == []


def test_what_the_analysis_finds_untrained_is_exactly_what_a_training_step_leaves_unchanged():
    torch.manual_seed(0)
    model = TwoBranch()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(model, example_inputs=(X,), split_points=["relu_1"], frozen=["side"])
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="sequential") as trainer:
        trainer.step(X, Y)
    unchanged = [k for k, p in model.named_parameters() if torch.equal(p, before[k])]
    assert unchanged == ["side.weight", "side.bias"]


def test_the_partitioner_leaves_out_the_cuts_that_strand_a_parameter_with_a_note():
    plan = _plan(gpus=2)
    assert plan.legal_cuts == ("side", "mul", "relu_3") and plan.cuts[0] in plan.legal_cuts
    note = next(n for n in plan.notes if "would never train" in n)
    assert note.startswith("5 of 8 legal cuts dropped: the stage before them would not train every parameter it "
                           "holds (parameter(s) side.weight, side.bias would never train: their values cross the cut "
                           "beside the tensor its head reads; frozen=[...] accepts that)")


def test_a_stranding_cut_given_by_hand_is_refused_naming_the_stage_parameters_and_ways_out():
    with pytest.raises(PlanError) as e:
        _plan(split_points=["relu_1"])
    assert str(e.value) == (
        "stage 0 of TwoBranch would never train 2 parameter tensor(s): side.weight, side.bias; its loss reads only "
        "'relu_1', the tensor at its cut (what its head reads), and their values cross the cut detached in 'side', "
        "so no loss reaches them (end-to-end training would train them); ways out: cut after 'side' instead of "
        "'relu_1' (the stage before it trains every parameter it holds), or accept them untrained with "
        "frozen=['side']")


def test_frozen_accepts_them_and_the_plan_lists_them():
    plan = _plan(split_points=["relu_1"], frozen=["side"])
    assert plan.cuts == ("relu_1",)
    assert ("stage 0: 2 parameter tensor(s) never trained, accepted by frozen=: side.weight, side.bias (no loss of "
            "the stage reaches them; they keep their values)") in plan.notes
    assert _plan(split_points=["relu_1"], frozen=["side.weight", "side.bias"]).cuts == ("relu_1",)
    with pytest.raises(PlanError, match=r"would never train 1 parameter tensor\(s\): side\.bias;"):
        _plan(split_points=["relu_1"], frozen=["side.weight"])


def test_frozen_names_a_parameter_or_module_of_the_model():
    with pytest.raises(ValueError) as e:
        _plan(gpus=2, frozen=["sid"])
    assert str(e.value) == ("frozen=['sid']: 'sid' names neither a parameter of TwoBranch nor a module holding one "
                            "(did you mean 'side'?); give names as model.named_parameters() or model.named_modules() "
                            "spell them")
    with pytest.raises(ValueError, match=re.escape("frozen must list parameter or module names (strings), got [3]")):
        _plan(gpus=2, frozen=[3])
    with pytest.raises(TypeError, match=re.escape("frozen must be a list with one entry per item, got 'side'")):
        _plan(gpus=2, frozen="side")


def test_frozen_that_accepts_nothing_in_the_plan_is_warned_and_noted():
    with pytest.warns(UserWarning, match=re.escape("frozen=['a'] accepts no parameter of this plan")) as w:
        plan = _plan(gpus=2, frozen=["a"])
    assert any(n.startswith("frozen=['a'] accepts no parameter of this plan") for n in plan.notes)
    assert w[0].filename == __file__  # at the user's call


def test_a_parameter_that_does_not_require_gradients_is_never_reported():
    model = TwoBranch()
    model.side.requires_grad_(False)
    plan = _plan(model, split_points=["relu_1"])
    assert plan.cuts == ("relu_1",) and not any("never train" in n for n in plan.notes)


def test_too_few_cuts_left_is_refused_with_the_stages_that_fit():
    with pytest.raises(PlanError) as e:
        _plan(gpus=5)
    assert str(e.value) == (
        "cannot cut TwoBranch into 5 stages so that every stage's loss reaches the parameters it holds: 5 of its 8 "
        "usable cuts would leave some untrained (the cut after 'stem': side.weight, side.bias, whose values cross it "
        "beside the tensor the head reads), leaving 3; plan at most 4 stages (gpus=4 or fewer), or accept them "
        "untrained with frozen=['side'] (they keep their values; end-to-end training would train them)")
    assert _plan(gpus=5, frozen=["side"]).num_stages == 5


def test_a_model_on_the_meta_device_is_checked_the_same():
    with torch.device("meta"):
        model = TwoBranch()
    assert _plan(model, gpus=2).legal_cuts == ("side", "mul", "relu_3")
    with pytest.raises(PlanError, match=re.escape(f"never train 2 parameter tensor(s): {STRANDED};")):
        _plan(model, split_points=["relu_1"])


def test_a_saved_plan_is_checked_again_when_re_applied(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(_plan(split_points=["relu_1"], frozen=["side"]).to_json())
    assert _plan(plan=path, frozen=["side"]).cuts == ("relu_1",)
    again = _plan(plan=path)  # the plan carries what frozen= accepted
    assert (again.cuts, again.frozen) == (("relu_1",), ("side",))
    assert "frozen" not in _plan(gpus=2).to_dict()  # a plan that accepts nothing writes the file it wrote before
    with pytest.raises(PlanError, match=re.escape(f"{path}: stage 0 of TwoBranch would never train")):
        _plan(plan=path, frozen=[])


def test_ranks_compare_frozen_when_they_share_a_plan():
    assert request_of(PlanOptions(frozen=("side",)), None) != request_of(PlanOptions(), None)
    assert request_of(PlanOptions(frozen=("side",)), None)["frozen"] == "('side')"


def test_messages_list_a_few_names_and_count_the_rest():
    names = [f"blocks.{i}.w" for i in range(7)]
    assert listed(names) == "blocks.0.w, blocks.1.w, blocks.2.w, blocks.3.w and 3 more"
    assert frozen_hint(["side.weight", "side.bias"]) == "frozen=['side']"
    assert frozen_hint(["a.weight", "b.weight"]) == "frozen=['a.weight', 'b.weight']"


def test_a_student_block_whose_loss_reaches_not_every_parameter_is_refused_in_blockwise_distillation():
    # block 0's loss compares the student's tensor at the block's end with the teacher's; the next student block
    # reads the teacher's values, so the student's branch that crosses the block's end never learns
    def distil(**options) -> ppll_compile.Plan:
        return _plan(TwoBranch(), teacher=TwoBranch(), gpus=2, blocks=[("a", "a")], **options)

    with pytest.raises(PlanError) as e:
        distil()
    assert str(e.value) == (
        "student block 0 of TwoBranch would never learn 2 parameter tensor(s): side.weight, side.bias; its "
        "distillation loss compares only 'a', the tensor at the block's end, with the teacher's, and their values "
        "leave the block beside it (the next block reads the teacher's values instead), so no loss reaches them; "
        "ways out: align the blocks elsewhere (blocks=[(teacher_module, student_module), ...]), or accept them "
        "untrained with frozen=['side']")
    plan = distil(frozen=["side"])
    assert [b.student_nodes[-1] for b in plan.blocks] == ["a", "out"]
    assert ("student block 0: 2 parameter tensor(s) never trained, accepted by frozen=: side.weight, side.bias (no "
            "loss of the student block reaches them; they keep their values)") in plan.notes
