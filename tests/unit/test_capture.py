"""Capture end to end: forward arguments with defaults, train/eval merging, wrapped and shared modules, the
torch.export front end, channels-last boundaries and token-level models, each checked against the model itself."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import ppll_compile
from ppll_compile import CutError, PPLLError, TraceError

CUDA = "0 CUDA device(s)"


pytestmark = pytest.mark.usefixtures("quietly")  # no CPU-fallback warnings of compile


# ---- toy models -------------------------------------------------------------------------------------------

class Defaults(nn.Module):
    """A forward with arguments of every default kind: a bool, a float, a tensor that may be None."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x, flag: bool = False, temperature=1.0, mask=None):
        h = torch.relu(self.a(x))
        if flag:
            h = h * 3
        if mask is not None:
            h = h * mask
        h = torch.relu(self.b(h))
        return self.c(h) / temperature


class RootDropout(nn.Module):
    """Functional dropout in the model's own forward, following ``self.training``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = F.dropout(h, 0.5, training=self.training)
        h = torch.relu(self.b(h))
        return self.c(h)


class RootBranch(RootDropout):
    """The model's own forward computes differently in train mode: a structural branch on ``self.training``."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.training:
            h = h * 2
        h = torch.relu(self.b(h))
        return self.c(h)


class Noise(nn.Module):
    """A submodule whose train branch adds an operation (structural)."""

    def forward(self, x):
        if self.training:
            x = x + torch.randn_like(x)
        return x


class Drop(nn.Module):
    """A submodule that only calls functional dropout (a constant argument the mode changes)."""

    def forward(self, x):
        return F.dropout(x, 0.25, training=self.training)


class NoiseAndDrop(nn.Module):
    """``a``, then the two mode-dependent submodules in the given order, then ``c``."""

    def __init__(self, order: tuple[str, str] = ("drop", "noise")):
        super().__init__()
        self.order = order
        self.a = nn.Linear(8, 16)
        self.noise = Noise()
        self.drop = Drop()
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        for name in self.order:
            h = getattr(self, name)(h)
        return self.c(h)


class NoiseThenRootOp(nn.Module):
    """A structural submodule whose output the model's own forward reads (the root does not branch)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.noise = Noise()
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.noise(self.a(x))))


class SharedTwice(nn.Module):
    """One module called at two depths: a, shared, b, shared again, head. ``d=256`` makes the balanced two-stage
    cut fall between the two calls of ``shared`` when tied parameters are not taken into account."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.a = nn.Linear(8, d)
        self.shared = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        x = torch.relu(self.shared(x))
        x = torch.relu(self.b(x))
        x = torch.relu(self.shared(x))
        return self.head(x)


class SharedAroundBlock(nn.Module):
    """Like :class:`SharedTwice`, with ``b`` a Sequential: the cut after ``b.1`` lies between the two calls."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a = nn.Linear(8, d)
        self.shared = nn.Linear(d, d)
        self.b = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        x = torch.relu(self.shared(x))
        x = self.b(x)
        x = torch.relu(self.shared(x))
        return self.head(x)


class ConvBNDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.drop(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


# ---- 1. forward arguments with any default -----------------------------------------------------------------

def test_forward_with_defaults_of_every_kind_compiles_and_equals_the_model():
    torch.manual_seed(0)
    model, x = Defaults().eval(), torch.randn(4, 8)
    c = ppll_compile.compile(model, 2, example_inputs=(x,))
    assert [n.target for n in c.graph_module.graph.nodes if n.op == "placeholder"] == ["x"]
    c.eval()
    with torch.no_grad():
        assert torch.equal(c(x), model(x))
        assert torch.equal(c(x, False, 1.0, None), model(x))  # the captured values, passed explicitly
    with pytest.raises(TypeError, match=re.escape("Defaults was compiled with flag=False, a constant of the captured "
                                                  "graph, and is called with flag=True")):
        c(x, flag=True)


def test_a_python_value_given_at_compile_time_is_a_constant_of_the_graph():
    torch.manual_seed(0)
    model, x = Defaults().eval(), torch.randn(4, 8)
    c = ppll_compile.compile(model, 2, example_inputs=(x,), example_kwargs={"temperature": 0.5, "flag": True}).eval()
    with torch.no_grad():
        expected = model(x, flag=True, temperature=0.5)
        assert not torch.equal(expected, model(x))
        assert torch.equal(c(x), expected)  # left out: the compiled value
        assert torch.equal(c(x, temperature=0.5), expected)  # the same value: fine
        assert torch.equal(c(x, True, 0.5), expected)
    with pytest.raises(TypeError, match=re.escape(
            "Defaults was compiled with temperature=0.5, a constant of the captured graph, and is called with "
            "temperature=2.0; compile again with temperature=2.0 in example_kwargs")):
        c(x, temperature=2.0)


def test_a_traced_tensor_input_left_out_of_the_call_is_named():
    torch.manual_seed(0)
    model, x, mask = Defaults().eval(), torch.randn(4, 8), (torch.rand(4, 16) > 0.5).float()
    c = ppll_compile.compile(model, 2, example_inputs=(x,), example_kwargs={"mask": mask}).eval()
    assert [n.target for n in c.graph_module.graph.nodes if n.op == "placeholder"] == ["x", "mask"]
    with torch.no_grad():
        assert torch.equal(c(x, mask=mask), model(x, mask=mask))
        assert not torch.equal(c(x, mask=mask), model(x))
    with pytest.raises(TypeError, match=re.escape("Defaults was compiled with mask as input(s) of the graph, but "
                                                  "the call does not pass it")):
        c(x)


# ---- 2. train and eval ---------------------------------------------------------------------------------

def test_functional_dropout_at_the_root_follows_the_mode_without_warnings():
    torch.manual_seed(0)
    model, x = RootDropout(), torch.randn(6, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = ppll_compile.compile(model, 2, example_inputs=(x,), policy="dgl")
    others = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and CUDA not in str(w.message)]
    assert others == []
    c.eval()
    with torch.no_grad():
        off = c(x)
        assert torch.equal(off, model.eval()(x))
        c.train()
        torch.manual_seed(1)
        a = c(x)
        torch.manual_seed(2)
        b = c(x)
        torch.manual_seed(1)
        again = c(x)
    assert not torch.equal(a, b) and not torch.equal(a, off)  # dropout on in train mode
    assert torch.equal(a, again)


def test_a_root_branch_on_training_is_refused_unless_baked():
    x = torch.randn(6, 8)
    with pytest.raises(TraceError) as info:
        ppll_compile.compile(RootBranch(), 2, example_inputs=(x,), policy="dgl", tracer="fx")
    msg = str(info.value)
    assert "RootBranch.forward computes differently in train and in eval mode (it branches on self.training" in msg
    assert "bake_train_mode=True" in msg
    with pytest.raises(TraceError, match=re.escape("branches on self.training")):
        ppll_compile.compile(RootBranch(), 2, example_inputs=(x,), policy="dgl")  # auto: neither front end takes it
    torch.manual_seed(0)
    model = RootBranch()
    c = ppll_compile.compile(model, 2, example_inputs=(x,), policy="dgl", bake_train_mode=True)
    with torch.no_grad():
        c.train()
        assert torch.equal(c(x), model.train()(x))
        c.eval()
        assert torch.equal(c(x), model.train()(x))  # the train branch is baked in
        assert not torch.equal(c(x), model.eval()(x))


def test_baking_the_root_branch_keeps_the_rest_following_the_mode():
    class BranchThenDropout(RootDropout):
        def forward(self, x):
            h = torch.relu(self.a(x))
            if self.training:
                h = h * 2
            h = F.dropout(h, 0.5, training=self.training)
            return self.c(torch.relu(self.b(h)))

    torch.manual_seed(0)
    model, x = BranchThenDropout(), torch.randn(6, 8)
    for tracer in ("fx", "export"):
        c = ppll_compile.compile(model, 2, example_inputs=(x,), policy="dgl", bake_train_mode=True, tracer=tracer)
        c.eval()
        with torch.no_grad():  # the branch stays (x 2), the dropout is off
            expected = model.c(torch.relu(model.b(torch.relu(model.a(x)) * 2)))
            assert torch.equal(c(x), expected), tracer


def _check_noise_opaque_and_drop_switched(order: tuple[str, str]) -> None:
    from ppll_compile.capture.modes import TrainEval
    from ppll_compile.capture.trace import trace

    torch.manual_seed(0)
    model, x = NoiseAndDrop(order), torch.randn(5, 8)
    gm = trace(model, example_inputs=(x,))
    calls = {n.name: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert calls["noise"] is model.noise  # opaque: the model's own module, which follows its own mode
    assert "drop" not in {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}  # traced into
    switched = [m for m in calls.values() if isinstance(m, TrainEval)]
    assert len(switched) == 1 and switched[0].target is F.dropout
    assert all(m.training for m in model.modules())  # trace leaves the modes as they were
    gm.eval()
    model.eval()
    assert torch.equal(gm(x), model(x))
    gm.train()
    model.train()
    torch.manual_seed(3)
    a = gm(x)
    torch.manual_seed(3)
    assert torch.equal(a, model(x))  # the same draws in the same order
    torch.manual_seed(4)
    assert not torch.equal(a, gm(x))


def test_a_structural_submodule_stays_opaque_and_a_dropout_submodule_is_traced_into():
    _check_noise_opaque_and_drop_switched(("drop", "noise"))


def test_a_dropout_submodule_after_a_structural_one_is_still_traced_into():
    _check_noise_opaque_and_drop_switched(("noise", "drop"))


def test_a_root_op_reading_a_structural_submodule_does_not_blame_the_root():
    from ppll_compile.capture.trace import trace

    torch.manual_seed(0)
    model, x = NoiseThenRootOp(), torch.randn(5, 8)
    gm = trace(model, example_inputs=(x,))
    assert gm.get_submodule("noise") is model.noise
    gm.eval()
    model.eval()
    assert torch.equal(gm(x), model(x))


class _Modal(nn.Module):
    def forward(self, x):
        y = F.dropout(x, 0.5, training=self.training)
        if self.training:
            y = y.contiguous()
        return y + 1


class _Structural(nn.Module):
    def forward(self, x):
        if self.training:
            x = x * 2
        return x + 1


def _both(module: nn.Module) -> tuple[fx.GraphModule, fx.GraphModule]:
    return fx.symbolic_trace(module.train()), fx.symbolic_trace(module.eval())


def test_merge_modes_switches_constants_and_copies_and_reports_branches():
    from ppll_compile.capture.modes import TrainEval, merge_modes

    train, eval_ = _both(_Modal())
    merge = merge_modes(train, eval_)
    assert merge.structural == [] and merge.switched == ["dropout", "contiguous"]
    kinds = {n.name: (n.op, type(train.get_submodule(n.target)) if n.op == "call_module" else None)
             for n in train.graph.nodes}
    assert kinds["dropout"] == kinds["contiguous"] == ("call_module", TrainEval)
    x = torch.randn(4, 6)
    train.eval()
    assert torch.equal(train(x), x + 1)
    train.train()
    torch.manual_seed(0)
    y = train(x)
    assert ((y == 1) | torch.isclose(y, 2 * x + 1)).all() and (y == 1).any()

    train, eval_ = _both(_Structural())
    merge = merge_modes(train, eval_)
    assert merge.switched == [] and merge.structural[0].name == "mul"  # the train-only op first
    assert all(n.op != "call_module" for n in train.graph.nodes)  # left unchanged


# ---- 4. a module used at two depths -----------------------------------------------------------------------

def _param_ids(stages) -> list[int]:
    return [id(p) for s in stages for p in s.parameters()]


def test_tied_error_never_puts_a_shared_module_into_two_stages():
    torch.manual_seed(0)
    model, x = SharedTwice(), torch.randn(6, 8)
    c = ppll_compile.compile(model, 2, example_inputs=(x,), policy="dgl")
    ids = _param_ids(c.stages)
    assert len(ids) == len(set(ids))  # no parameter in two stages
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # every model parameter exactly once
    held = [{id(p) for p in s.parameters()} for s in c.stages]
    assert sum(id(model.shared.weight) in h for h in held) == 1
    assert any("legal cuts dropped: parameters used on both sides" in n for n in c.plan.notes)


def test_a_cut_between_two_uses_is_refused_naming_the_parameter_and_the_way_out():
    torch.manual_seed(0)
    with pytest.raises(CutError) as info:
        ppll_compile.plan(SharedTwice(), example_inputs=(torch.randn(6, 8),), policy="dgl", split_points=["b"],
                          tied="error")
    msg = str(info.value)
    assert msg.startswith("cannot cut after 'b': parameter shared.weight is used on both sides of it; pass "
                          "tied='untie' to give each later stage its own copy; nearest usable cuts: ")


def test_a_module_name_resolving_to_a_dropped_cut_gives_the_reason():
    torch.manual_seed(0)
    with pytest.raises(CutError) as info:
        ppll_compile.plan(SharedAroundBlock(), example_inputs=(torch.randn(6, 8),), policy="dgl",
                          split_points=["b.1"], tied="error")
    assert "parameter shared.weight is used on both sides" in str(info.value)


def test_too_few_cuts_because_of_tied_parameters_says_why():
    torch.manual_seed(0)
    with pytest.raises(CutError) as info:
        ppll_compile.plan(SharedTwice(), 6, example_inputs=(torch.randn(6, 8),), policy="dgl", tied="error")
    assert str(info.value) == (
        "cannot cut SharedTwice into 6 stages with tied='error': parameters shared.weight, shared.bias are used on "
        "both sides of 4 of its 8 legal cut points, leaving 4; pass tied='untie' (each later stage trains its own "
        "copy; the model keeps the first stage's), or plan at most 5 stages (gpus=5 or fewer)")


def _train_untied(model: nn.Module, x: torch.Tensor, runtime: str) -> tuple[nn.Module, list[torch.Tensor]]:
    model = copy.deepcopy(model)
    torch.manual_seed(1)  # the heads are initialised from the global generator
    c = ppll_compile.compile(model, example_inputs=(x,), policy="dgl", split_points=["b"], tied="untie")
    g = torch.Generator().manual_seed(2)
    options = {"threads_per_stage": 1} if runtime == "threads" else {}
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime=runtime, **options) as trainer:
        for _ in range(2):
            trainer.step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
        trainer.finish()
    return model, [p.detach().clone() for i in range(c.plan.num_stages) for p in c.stage_parameters(i)]


def test_tied_untie_gives_the_later_stage_its_own_copy(one_thread_quietly):
    torch.manual_seed(0)
    model, x = SharedTwice(), torch.randn(6, 8)
    c = ppll_compile.compile(model, example_inputs=(x,), policy="dgl", split_points=["b"], tied="untie")
    assert ("tied parameter(s) shared.weight, shared.bias used by stages 0 to 1: untied, each stage trains its own "
            "copy; the model keeps stage 0's") in c.plan.notes
    assert c.plan.untied == ("shared.weight", "shared.bias")
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as trainer:  # a re-split would copy them afresh
        with pytest.raises(PPLLError, match=re.escape("stages train their own copies of a tied parameter")):
            trainer.move_cut(0, "b")
    ids = _param_ids(c.stages)
    assert len(ids) == len(set(ids))
    first, second = ({id(p) for p in s.parameters()} for s in c.stages)
    assert {id(model.shared.weight), id(model.shared.bias)} <= first
    assert not {id(p) for p in model.shared.parameters()} & second
    assert {id(p) for p in model.parameters()} == first | ({id(model.head.weight), id(model.head.bias)})
    c.eval()
    with torch.no_grad():
        assert torch.equal(c(x), model.eval()(x))

    seq_model, seq = _train_untied(model, x, "sequential")
    thr_model, thr = _train_untied(model, x, "threads")
    assert len(seq) == len(thr) > 0
    assert all(torch.equal(p, q) for p, q in zip(seq, thr))
    for (name, p), q in zip(seq_model.named_parameters(), thr_model.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(seq_model.shared.weight, model.shared.weight)  # the model trained in place


# ---- 5. front ends -------------------------------------------------------------------------------------

def test_export_front_end_shares_the_models_parameters_and_buffers():
    torch.manual_seed(0)
    model, x = ConvBNDrop(), torch.randn(4, 3, 8, 8)
    c = ppll_compile.compile(model, 2, example_inputs=(x,), tracer="export", policy="dgl")
    assert c.plan.notes[0] == "captured with torch.export"
    ids = _param_ids(c.stages)
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    assert {id(b) for s in c.stages for b in s.buffers()} == {id(b) for b in model.buffers()}
    c.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(c(x), model(x))
        y = torch.randn(7, 3, 8, 8)  # batch size is free
        assert torch.equal(c(y), model(y))
    mean, count = model.bn1.running_mean.clone(), int(model.bn1.num_batches_tracked)
    c.train()
    with torch.no_grad():
        c(x)
    assert not torch.equal(model.bn1.running_mean, mean)
    assert int(model.bn1.num_batches_tracked) == count + 1 == int(model.bn2.num_batches_tracked)


def test_a_moved_stage_keeps_the_model_pointing_at_the_buffers_it_updates():
    # moving a stage (to a GPU, or to another dtype) replaces its buffer tensors; the model must follow
    torch.manual_seed(0)
    model, x = ConvBNDrop(), torch.randn(4, 3, 8, 8)
    c = ppll_compile.compile(model, 2, example_inputs=(x,), tracer="export", policy="dgl")
    stage = next(s for s in c.stages if "bn1.running_mean" in dict(s.module.named_buffers()))
    stage.double()
    assert model.bn1.running_mean.dtype == torch.float64
    assert model.bn1.running_mean is stage.module.get_buffer("bn1.running_mean")


def test_export_refuses_leaf_modules_and_an_unknown_tracer_is_named():
    model, x = ConvBNDrop(), torch.randn(4, 3, 8, 8)
    with pytest.raises(TraceError, match=re.escape("leaf_modules keeps modules opaque")):
        ppll_compile.compile(model, 2, example_inputs=(x,), tracer="export", leaf_modules=["conv1"])
    with pytest.raises(ValueError, match=re.escape("tracer must be one of auto, fx, export, got 'bogus'")):
        ppll_compile.compile(model, 2, example_inputs=(x,), tracer="bogus")


class _PermuteNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1))


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3)

    def forward(self, x):
        return torch.relu(self.conv(x))


class _ReadsChannelsLast(nn.Module):
    def forward(self, x):
        return x.permute(0, 3, 1, 2) + 1


def test_layout_of_reads_the_graph():
    from ppll_compile.analysis.layout import CHANNELS_LAST, layout_of

    gm = fx.symbolic_trace(_PermuteNorm())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert CHANNELS_LAST == "channels_last"
    assert layout_of(nodes["permute"], gm) == "channels_last"
    assert layout_of(nodes["norm"], gm) == "channels_last"
    assert layout_of(nodes["x"], gm) == ""  # read by a permute to channels-last: it was N x C x H x W

    gm = fx.symbolic_trace(_Conv())
    assert [layout_of(n, gm) for n in gm.graph.nodes if n.op != "output"] == ["", "", ""]

    gm = fx.symbolic_trace(_ReadsChannelsLast())
    assert layout_of(next(iter(gm.graph.nodes)), gm) == "channels_last"  # read by a permute back to N x C x H x W


def test_the_ways_out_the_capture_errors_name_lead_to_working_plans():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from models import DataDependent

    x = torch.randn(4, 4)
    with pytest.raises(TraceError) as info:  # neither front end takes value-dependent Python
        ppll_compile.compile(DataDependent(), 2, example_inputs=(x,))
    assert "leaf_modules=['gate']" in str(info.value) and "torch.export, cannot capture it either" in str(info.value)
    c = ppll_compile.compile(DataDependent(), 2, example_inputs=(x,), leaf_modules=["gate"])  # the advice, followed
    assert c.plan.num_stages == 2 and c.plan.stages[0].flops_fwd > 0  # the opaque module is measured too
    c = ppll_compile.compile(DataDependent(), example_inputs=(x,), split_points=["pre", "gate"])  # the other advice
    assert c.plan.num_stages == 3

    model, y = NoiseThenRootOp(), torch.randn(4, 8)
    # a module with a train-only branch is kept whole under torch.export, as leaf_modules keeps it under fx
    exported = ppll_compile.compile(model, 2, example_inputs=(y,), tracer="export")
    assert any("kept whole" in n and "'noise'" in n for n in exported.plan.notes), exported.plan.notes
    c = ppll_compile.compile(model, 2, example_inputs=(y,), tracer="fx", leaf_modules=["noise"])
    c.eval(), model.eval(), exported.eval()
    with torch.no_grad():
        assert torch.equal(c(y), model(y)) and torch.equal(exported(y), model(y))
    baked = ppll_compile.compile(model, 2, example_inputs=(y,), tracer="export", bake_train_mode=True)  # the other way out
    assert baked.plan.num_stages == 2


def test_a_model_of_scalars_only_is_told_why_it_cannot_be_split():
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, t: float = 1.0):
            return self.w * t

    with pytest.raises(ValueError, match=re.escape("a model whose inputs are all Python scalars (or 0-D tensors) "
                                                   "cannot be split")):
        ppll_compile.compile(Scalar(), 2, example_inputs=(2.0,))


def test_example_inputs_the_model_cannot_take_are_named_with_the_failing_layer():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ppll_compile.PlanError, match=re.escape(
            "the model does not run on the example inputs (input (4, 5)): node '_0' (module '0') fails with "
            "RuntimeError: ")) as info:
        ppll_compile.compile(model, 2, example_inputs=(torch.randn(4, 5),))
    assert "model(*example_inputs) must run" in str(info.value)
