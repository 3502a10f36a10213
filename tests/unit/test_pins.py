"""Exact properties of the newest planning, cost and runtime code, held in-process and fast: figures and bounds at
their boundaries, the measured per-replica cost with a head, the state-dict checks of a meta-built model, and the
parts of the distributed runtime (placement, plan sharing, the model's gather) that otherwise run only under
torchrun."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from ppll_compile.partitioners.objective import allreduce_seconds
from torch import nn

import ppll_compile
from ppll_compile.analysis.batch_cuts import _refuse_too_few
from ppll_compile.cost.autocast import MetaAutocast
from ppll_compile.cost.hardware import load_hardware
from ppll_compile.errors import PlanError, PPLLError
from ppll_compile.options import PlanOptions
from ppll_compile.place import partition
from ppll_compile.plans.precision import PRECISIONS
from ppll_compile.plans.report import peak_flops
from ppll_compile.plans.specs import StageTime
from ppll_compile.runtime.checkpoint import gather
from ppll_compile.runtime.checkpoint.model_state import StateCollector
from ppll_compile.runtime.distributed.group import place
from ppll_compile.runtime.distributed.plan_share import shared_ranks

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))


class _MLP(nn.Module):
    """Three linear layers: a ``ppll`` plan cuts it after ``a`` for two stages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


# ---- planning: measured costs, cut counts, figures files -----------------------------------------------------

def test_a_measured_replicated_stage_all_reduces_its_heads_gradients_too(monkeypatch):
    """profile="time" with replicas=(2, 1): stage 0's compute is its measured step over its 2 replicas plus the ring
    all-reduce of its backbone's and its auxiliary head's float32 gradients (stage_seconds by hand)."""
    def measured(a, heads, policy, device, optimizer, intervals):
        return {iv: StageTime(seconds=0.01 * (iv[1] - iv[0] + 1), step_seconds=0.001, spread=0.0) for iv in intervals}

    monkeypatch.setattr(partition, "time_stages", measured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ppll_compile.plan(_MLP(), example_inputs=(X,), profile="time", replicas=(2, 1), link_bandwidth=1e6)
    first, last = plan.stages
    assert (first.replicas, last.replicas) == (2, 1) and first.head.param_count > 0
    grads = first.grad_bytes + 4 * first.head.param_count
    assert first.compute_cost == pytest.approx(0.01 / 2 + allreduce_seconds(grads, 2, 1e6), rel=1e-12)


def test_the_stage_count_the_cuts_kept_can_make_is_allowed_and_one_more_is_refused():
    """_refuse_too_few at its boundaries: with 5 of 10 cuts kept, 6 stages (5 cuts) pass, 7 are refused naming
    gpus=6; 11 stages (all 10 legal cuts) are refused, 12 (more than the legal cuts allow) are left to others."""
    cuts, kept, seen = [f"c{i}" for i in range(10)], [f"c{i}" for i in range(5)], {"inner1": "(8, 4) at batch 2"}
    for stages in (None, 1, 6, 12):
        _refuse_too_few("Folding", cuts, kept, seen, stages)
    for stages in (7, 11):
        with pytest.raises(PlanError) as e:
            _refuse_too_few("Folding", cuts, kept, seen, stages)
        assert str(e.value) == (
            f"Folding cannot be split into {stages} stages: 1 of its 10 legal cuts fold the batch into another "
            f"dimension (the tensor after 'inner1' is (8, 4) at batch 2), and a stage's head would read that "
            f"dimension as the batch; 5 cut(s) keep the batch first. Ways out: gpus=6 or fewer, or "
            f"split_points=[...module names...] naming modules whose output keeps the batch first (the modules not "
            f"holding them then stay opaque)")


RATES = {"matmul:float32": 1.0e11, "attention:float32": 7.5e10, "conv:float32": 2.5e11, "conv_bwd:float32": 2.0e11,
         "norm:float32": 1.2e10, "math:float32": 2.0e10, "pool:float32": 3.0e9, "memory:float32": 1.5e11,
         "step:float32": 4.0e10}


def test_a_figures_file_with_zero_overhead_loads_as_zero_and_a_negative_one_is_refused(tmp_path):
    """load_hardware: ``overhead: 0`` is a valid figure (kept as 0.0); ``overhead: -1e-6`` is refused by name."""
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"device": "d", "torch": "any", "rates": RATES, "overhead": 0}))
    hw = load_hardware(zero)
    assert hw.figures is not None and hw.figures.overhead == 0 and hw.figures.rates == RATES
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps({"device": "d", "torch": "any", "rates": RATES, "overhead": -1e-6}))
    with pytest.raises(PlanError) as e:
        load_hardware(negative)
    assert str(e.value) == (f"hardware={negative}: overhead is -1e-06, expected a number of seconds per operator from 0 "
                            f"to 1; give the device's own figure in seconds per operator "
                            f"(ppll_compile.calibrate(out=...) measures them), or remove the field")


# ---- report, precision, autocast ------------------------------------------------------------------------------

def _calibrated(precision: str, rates: dict[str, float]) -> SimpleNamespace:
    return SimpleNamespace(precision=precision, hardware=None, profile="roofline", calibration={"rates": rates},
                           flops_per_second=0.0)


def test_the_peak_of_a_low_precision_plan_is_the_rate_measured_in_that_dtype():
    """peak_flops: a bf16 plan's peak is the fastest compute family's bfloat16 rate where the calibration measured
    one, its float32 rate where it did not; an fp32 plan reads the float32 rates only."""
    rates = {"matmul:float32": 1e11, "matmul:bfloat16": 4e11, "attention:float32": 2e11, "conv:float32": 3e11}
    assert peak_flops(_calibrated("bf16", rates)) == (4e11, "the fastest compute rate measured: matmul")
    assert peak_flops(_calibrated("fp32", rates)) == (3e11, "the fastest compute rate measured: conv")
    del rates["matmul:bfloat16"]
    assert peak_flops(_calibrated("bf16", rates)) == (3e11, "the fastest compute rate measured: conv")


def test_only_a_pure_precision_halves_float32_parameters_and_never_integer_ones():
    """Precision.param_bytes: bf16-pure halves 4-byte floating tensors only (int32 and float64 keep their bytes);
    fp32 and mixed bf16 keep every tensor's bytes."""
    pure, mixed, fp32 = PRECISIONS["bf16-pure"], PRECISIONS["bf16"], PRECISIONS["fp32"]
    assert pure.param_bytes(10, 4, True) == 20
    assert pure.param_bytes(10, 4, False) == 40
    assert pure.param_bytes(10, 8, True) == 80
    assert pure.param_bytes(10, 2, True) == 20
    assert mixed.param_bytes(10, 4, True) == fp32.param_bytes(10, 4, True) == 40


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_meta_autocast_runs_layers_low_and_losses_in_float32_for_both_low_dtypes(low):
    """MetaAutocast(low): F.linear on float32 operands gives ``low``; F.cross_entropy and F.log_softmax on ``low``
    scores give float32 (as CUDA autocast runs them), for float16 as for bfloat16."""
    meta = torch.device("meta")
    with MetaAutocast(low):
        scores = F.linear(torch.empty(4, 8, device=meta), torch.empty(10, 8, device=meta))
        loss = F.cross_entropy(scores, torch.zeros(4, dtype=torch.long, device=meta))
        logp = F.log_softmax(torch.empty(4, 10, device=meta, dtype=low), dim=-1)
    assert (scores.dtype, loss.dtype, logp.dtype) == (low, torch.float32, torch.float32)


# ---- a meta-built model's state dict ----------------------------------------------------------------------------

def test_a_state_dict_value_of_another_shape_is_refused_even_when_it_would_broadcast():
    """A meta-built model compiled with a state dict whose ``c.bias`` has shape (1,) for the (4,) tensor is refused
    with the exact message (copying would broadcast it silently)."""
    weights = _MLP().state_dict()
    weights["c.bias"] = torch.zeros(1)
    with torch.device("meta"):
        model = _MLP()
    with warnings.catch_warnings(), pytest.raises(PPLLError) as e:
        warnings.simplefilter("ignore")
        ppll_compile.compile(model, gpus=2, example_inputs=(X,), policy="dgl", split_points=["a"], state_dict=weights)
    assert str(e.value) == ("state_dict gives 'c.bias' of shape (1,) for stage 1, whose tensor has shape (4,); load "
                            "the checkpoint of this model's configuration")


# ---- the model's gather across processes --------------------------------------------------------------------------

def test_a_tensor_several_stages_offer_is_taken_from_the_first_stage():
    """_Route.of: a name offered by rank 0 (stage 0, with its tied alias) and by rank 1 (stage 1's untied copy) is
    taken from stage 0 under every name; rank 1 still sends the names only it offers."""
    offers = [[(("emb.weight", "out.weight"), 0, (4, 2), "float32")],
              [(("out.weight",), 1, (4, 2), "float32"), (("b.weight",), 1, (2, 2), "float32")]]
    route = gather._Route.of(offers)
    assert route.by_stage == {0: [(0, 0, ["emb.weight", "out.weight"])], 1: [(1, 1, ["b.weight"])]}
    assert route.taken == {"emb.weight", "out.weight", "b.weight"}


class _Rank:
    """A process of a two-stage ``distributed`` run as the gather sees it: its rank and stage, every process's
    offers as its all-gather would return them."""

    one_process_per_stage = True
    replica = 0

    def __init__(self, rank: int, shared: list) -> None:
        self.rank, self.is_main_writer, self.shared = rank, rank == 0, shared
        self.runners = [SimpleNamespace(index=rank)]

    def gather(self, mine: tuple) -> list:
        assert mine == self.shared[self.rank]
        return self.shared


def test_every_rank_sends_its_own_stage_and_rank_0_puts_the_model_together(monkeypatch):
    """gather_stages on two ranks in one process: rank 1 sends exactly its stage's tensors, in order; rank 0
    receives each as announced (source, shape, dtype) and its state equals ``model.state_dict()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    plan = SimpleNamespace(num_stages=2, stages=[SimpleNamespace(blocks=()), SimpleNamespace(blocks=())])
    lowered = SimpleNamespace(modules=[model[0], model[1]])
    shared = [(gather._offers(model, gather.stage_owners(plan, lowered, [r]))[0], []) for r in (0, 1)]
    sent: list[torch.Tensor] = []

    def receive(rt, src, info, comm):
        t = sent.pop(0)
        assert (src, info.shape, info.dtype) == (1, tuple(t.shape), t.dtype)
        return t

    monkeypatch.setattr(gather, "_comm_device", lambda rt: torch.device("cpu"))
    monkeypatch.setattr(gather, "_send", lambda rt, t, comm: sent.append(t.detach().clone()))
    monkeypatch.setattr(gather, "_receive", receive)
    assert gather.gather_stages(_Rank(1, shared), model, plan, lowered, None) is None
    assert [t.shape for t in sent] == [model[1].weight.shape] and torch.equal(sent[0], model[1].weight)
    collector = StateCollector(model)
    stats = gather.gather_stages(_Rank(0, shared), model, plan, lowered, collector)
    state = collector.state()
    assert not sent and stats is not None and stats.parts == 2
    assert list(state) == list(model.state_dict()) and all(torch.equal(state[k], v)
                                                           for k, v in model.state_dict().items())


# ---- placement and plan sharing under torchrun --------------------------------------------------------------------

def test_ranks_are_placed_on_the_stages_in_order_with_their_replicas():
    """place: replicas (2, 1, 2) put ranks 0-1, 2, 3-4 on stages 0, 1, 2; each rank's replica index, the ranks it
    receives from and sends to, and rank 0 feeding stage 0's second replica."""
    plan = SimpleNamespace(num_stages=3, stages=[SimpleNamespace(replicas=r) for r in (2, 1, 2)])
    got = [(p.stage, p.replica, p.upstream, p.downstream, p.feeds, p.fed) for p in (place(plan, r) for r in range(5))]
    assert got == [(0, 0, [], [2], [1], False), (0, 1, [0], [2], [], True), (1, 0, [0, 1], [3, 4], [], False),
                   (2, 0, [2], [], [], False), (2, 1, [2], [], [], False)]
    assert place(plan, 4).ranks == ((0, 1), (2,), (3, 4)) and place(plan, 3).stage_of(1) == 0


@pytest.mark.timeout(20, method="thread")
def test_under_torchruns_variables_only_a_call_for_as_many_devices_as_processes_shares_the_plan(monkeypatch):
    """shared_ranks under RANK=1 of WORLD_SIZE=2 (a store no one serves): (1, 2) for gpus=2 or one split point,
    ``None`` (plan alone, never meet at the store) for gpus=3, replicas=(1, 2) or a world of one."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert shared_ranks(PlanOptions(gpus=2), None) == (1, 2)
    assert shared_ranks(PlanOptions(split_points=("a",)), None) == (1, 2)
    assert shared_ranks(PlanOptions(gpus=3), None) is None
    assert shared_ranks(PlanOptions(replicas=(1, 2)), None) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert shared_ranks(PlanOptions(gpus=1), None) is None
